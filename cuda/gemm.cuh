/*
 * gemm: the backend's bf16 products of few input rows through cuBLASLt,
 * with the algorithm chosen by timing.
 *
 * cublasGemmEx takes cuBLAS's heuristic first choice, which for the
 * products of a short query prefill or a decode step reads the weights
 * well below the memory's speed (run 20, 30 rows: a 4096 x 4096 product at
 * 1.4 TB/s, a 4096 x 14336 one at 2.7). Here each new problem (rows, n,
 * cols, pointer alignment) of at most CUDA_GEMM_TUNE_MAX_N columns has the
 * heuristic's candidates timed once, with the weights evicted from L2
 * before every timed run as in a forward, and keeps the fastest for the
 * life of the context. Timing waits for the stream, so it is not allowed
 * while a CUDA graph is being captured: the caller then falls back to its
 * own product.
 */
#ifndef IS_CUDA_GEMM_CUH
#define IS_CUDA_GEMM_CUH

#include "common.cuh"

extern "C" {
#include "backend_cuda.h" /* cuda_gemm_stats */
}

/* Input rows (GEMM columns) up to which products are timed and tuned. */
#define CUDA_GEMM_TUNE_MAX_N 64

typedef struct cuda_gemm cuda_gemm;

is_status cuda_gemm_create(cuda_gemm **out);
void cuda_gemm_free(cuda_gemm *g);

/* y[n][rows] (f32, column-major rows x n) = W[rows][cols] x[n][cols]^T, W and
 * x bf16, through the algorithm chosen for this problem. *ran is false, and
 * nothing is queued, when the problem is not tuned and may_tune is false,
 * or when cuBLASLt offers no algorithm for it: the caller runs its own
 * product then. ws: workspace of ws_bytes the algorithms may use. */
is_status cuda_gemm_bf16(cuda_gemm *g, cudaStream_t s, float *y, const __nv_bfloat16 *w,
                         const __nv_bfloat16 *x, int64_t rows, int32_t n, int64_t cols, void *ws,
                         size_t ws_bytes, bool may_tune, bool *ran);

void cuda_gemm_stats_get(const cuda_gemm *g, cuda_gemm_stats *out);

#endif

/*
 * wgmma_gemm: the backend's products of up to 32 GEMM columns that the
 * skinny kernel does not take (option wgmma, default on: products.cuh), e.g. a
 * 30-token query's on the 8B shape; bench_gemm_gpu -w measures it.
 *
 * Why: on the 8B shape a 30-token query's layer is ~170 us, of which the
 * four cuBLAS products are ~126 us back to back against 104 us of weight
 * reading; cuBLAS's kernels cannot start reading their weights before the
 * op before them ends (docs/notes/cuda-diary.md). This kernel, launched as
 * a programmatic dependent, can: weights do not depend on the kernel
 * before. Measured: as fast as cuBLAS inside with its
 * default block shapes, ~5 us a layer faster as dependents, a 30-token
 * query's TTFT 0.0-0.3 ms faster.
 *
 * y[n][rows] = x[n][cols] W^T, W bf16 [rows][cols], x bf16 [n][cols]
 * (n <= 32), y f32: the layout cuBLAS writes for the backend.
 *  - A block owns 64, 128 or 256 weight rows over a range of columns; one
 *    producer thread streams 64-column tiles of W and x into a ring of
 *    shared-memory stages with TMA (128-byte swizzle; x's rows past n come
 *    in as zeros), a warpgroup multiplies each stage with wgmma
 *    (m64n32k16, W and x both K-major, f32 accumulators in registers).
 *  - With PDL the producer issues the weights of the first stages before
 *    griddepcontrol.wait, x after it.
 *  - Column ranges (at most 8) are a thread-block cluster that sums its
 *    partial results through distributed shared memory in range order
 *    (deterministic), as cuda/skinny.cu does.
 */
#ifndef IS_CUDA_WGMMA_GEMM_CUH
#define IS_CUDA_WGMMA_GEMM_CUH

#include "common.cuh"

#define WGMMA_MAX_N 32

/* Whether this GPU runs the sm_90a library's kernels (a Hopper; asked once:
 * whether one of them loads). flash_wgmma.cu asks it too. */
bool cuda_sm90a_runs(void);

/* Whether the kernel takes this product on this device with its default
 * block shape: an sm_90a GPU, 1 <= n <= 32, cols a multiple of 64, rows a
 * multiple of 64 (128, 256) at most 64 (128, 256) an SM. W and x must be
 * 16-byte aligned. */
bool cuda_wgmma_supports(int32_t n, int64_t rows, int64_t cols);

/* Sets the kernels' shared-memory limits (once; call it outside any stream
 * capture: cuda_wgmma_gemm calls it too). */
is_status cuda_wgmma_prepare(void);

/* A block's shape: mb (64 mb weight rows a block: 1, 2 or 4), stages in its
 * shared-memory ring, splits (column ranges, 1..8, a cluster). Zeros take
 * the default choice. */
struct cuda_wgmma_cfg {
    int32_t mb, stages, splits;
};

/* How many blocks of this shape an SM holds (by shared memory: 1 or 2). */
int32_t cuda_wgmma_blocks_per_sm(int32_t mb, int32_t stages);

/* The (mb, stages) pairs compiled in, for sweeps: *count of them. */
const cuda_wgmma_cfg *cuda_wgmma_variants(int *count);

/* y[n][rows] = x W^T (see above). pdl: launched as a programmatic
 * dependent of the stream's previous kernel. trigger: lets the next kernel,
 * if a dependent, launch as soon as all this one's blocks run (so that a
 * product after it can stream its weights in early). cfg: NULL for the
 * default. */
is_status cuda_wgmma_gemm(cudaStream_t s, float *y, const __nv_bfloat16 *w, const __nv_bfloat16 *x,
                          int32_t n, int64_t rows, int64_t cols, bool pdl, bool trigger,
                          const cuda_wgmma_cfg *cfg);

/* The gate and up product and SwiGLU in one kernel: w stacks gate
 * [ffn][cols] over up [ffn][cols]; y[n][ffn] = silu(x gate^T) * (x up^T)
 * and obf its bf16 copy (cuda_f32_to_bf16's rounding; obf must not be x).
 * Each gate and up value is the same sum as cuda_wgmma_gemm's on the
 * stacked weights (the same column ranges), so the results are the bits of
 * that product followed by cuda_swiglu_stacked. A block takes 64 gate rows
 * and their 64 up rows (two boxes a stage). Takes: 1 <= n <= 32, ffn a
 * multiple of 64 with at most two blocks an SM, cols a multiple of 64. */
bool cuda_wgmma_swiglu_supports(int32_t n, int64_t ffn, int64_t cols);
is_status cuda_wgmma_swiglu(cudaStream_t s, float *y, __nv_bfloat16 *obf, const __nv_bfloat16 *w,
                            const __nv_bfloat16 *x, int32_t n, int64_t ffn, int64_t cols, bool pdl);

#endif

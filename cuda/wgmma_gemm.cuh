/*
 * wgmma_gemm: EXPERIMENTAL, not used by the backend; bench_gemm_gpu -w is
 * its only caller. Written (2026-12-03, seventh session) after the device
 * ran out; it has not run on a GPU: the next session's first call must
 * check it against cuBLAS (bench_gemm_gpu -w prints the relative
 * difference) before anything else.
 *
 * Why: on the 8B shape a 30-token query's layer is ~170 us, of which the
 * four cuBLAS products are ~126 us back to back against 104 us of weight
 * reading; the rest is the attention and four small kernels during which
 * the memory is idle, and cuBLAS's kernels cannot start reading their
 * weights before the op before them ends (cuda/NOTES.md runs 35-45). A
 * product kernel of our own, launched as a programmatic dependent, can:
 * weights do not depend on the kernel before.
 *
 * y[n][rows] = x[n][cols] W^T, W bf16 [rows][cols], x bf16 [n][cols]
 * (n <= 32), y f32: the layout cuBLAS writes for the backend.
 *  - A block owns 128 or 256 weight rows over a range of columns; one
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

/* Whether the kernel takes this product: 1 <= n <= 32, rows a multiple of
 * 128, cols a multiple of 64, W, x 16-byte aligned with cols * 2 bytes a
 * row a multiple of 16. */
bool cuda_wgmma_supports(int32_t n, int64_t rows, int64_t cols);

/* y[n][rows] = x W^T (see above). pdl: launched as a programmatic
 * dependent of the stream's previous kernel. */
is_status cuda_wgmma_gemm(cudaStream_t s, float *y, const __nv_bfloat16 *w,
                          const __nv_bfloat16 *x, int32_t n, int64_t rows, int64_t cols,
                          bool pdl);

#endif

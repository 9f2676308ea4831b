/*
 * skinny: matrix products with few input rows (decode steps, short query
 * prefills: n <= 64), where the product is bound by reading the weights
 * once: y[n][rows] = x[n][cols] W^T, W bf16 [rows][cols], x bf16, y f32
 * (the layout cuBLAS writes for the backend).
 *
 * The backend's products use it for decode steps only (at most 8 GEMM
 * columns, option skinny: products.cuh): inside the kernel it is 13-29%
 * slower than cuBLAS's nvjet kernels at 30 rows on the 8B layer's shapes,
 * and a layer's products in sequence run at 0.93-1.04x of cuBLAS's speed
 * (docs/notes/cuda-diary.md); bench_gemm_gpu measures it up to 64. This kernel:
 *  - streams W straight from memory into tensor-core fragments: a block of
 *    8 warps owns 128 weight rows (16 a warp) over one range of columns,
 *    each warp keeping 4 64-column steps of its rows in registers (16-byte
 *    loads that skip L1, 256-byte L2 prefetch); x comes into shared memory
 *    by chunks of 256 columns, read alike by the block's 8 warps;
 *  - cuts the columns into up to 8 ranges whose blocks form a thread-block
 *    cluster and add their partial sums through distributed shared memory,
 *    in range order (deterministic; no partials in global memory, no second
 *    launch); the cut is chosen so the grid is about one wave;
 *  - with programmatic dependent launch (PDL), issues its first weight
 *    loads before waiting for the kernel that writes x, so a product's ramp
 *    overlaps the end of the op before it.
 * The dot products are permutation-invariant in k, so each lane takes 8
 * contiguous columns and x's fragments follow the same permutation: no
 * shuffles, no ldmatrix, every load coalesced.
 */
#ifndef IS_CUDA_SKINNY_CUH
#define IS_CUDA_SKINNY_CUH

#include "common.cuh"

/* Largest n the kernel takes. */
#define SKINNY_MAX_N 64
/* Weight rows a block owns, and the most column ranges (cluster size). */
#define SKINNY_BLOCK_ROWS 128
#define SKINNY_MAX_SPLITS 8

/* How a product is cut: row blocks of 128 rows, column ranges of kc
 * columns (a multiple of 64), splits = ceil(cols / kc) ranges. */
typedef struct skinny_plan {
    int32_t row_blocks;
    int32_t splits;
    int32_t kc;
} skinny_plan;

/* Whether the kernel takes this product: 1 <= n <= 64 input rows, cols a
 * multiple of 64. */
bool cuda_skinny_supports(int32_t n, int64_t rows, int64_t cols);

/* The cut on the current device: the most ranges (<= 8, each of at least
 * 256 columns) that keep the grid within the clusters resident at once, one
 * range where the row blocks alone fill the GPU. splits > 0 forces the
 * number of ranges (tests, benchmarks). */
skinny_plan cuda_skinny_plan(int32_t n, int64_t rows, int64_t cols, int32_t splits);

/* Asks the device once how many blocks and clusters of the kernel fit (not
 * while a stream captures); the plan reads the answers. */
is_status cuda_skinny_prepare(void);

/* Whether every block (or cluster) of the plan is resident at once: the
 * kernel is built for one wave, and past it loses to cuBLAS (the 8B head,
 * 128256 rows at one row: 1002 blocks, 1-6% slower). */
bool cuda_skinny_one_wave(const skinny_plan *p, int32_t n);

/* y[n][rows] = x W^T. pdl: launched as a programmatic dependent of the
 * stream's previous kernel (its weights are read before that kernel ends;
 * x after). */
is_status cuda_skinny_gemm(cudaStream_t s, const skinny_plan *p, float *y, const __nv_bfloat16 *w,
                           const __nv_bfloat16 *x, int32_t n, int64_t rows, int64_t cols, bool pdl);

#endif

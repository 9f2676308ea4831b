/*
 * skinny: matrix products with few input rows (decode steps, short query
 * prefills: T <= 64), where the product is bound by reading the weights
 * once, y[T][rows] = x[T][cols] W^T with W bf16 [rows][cols].
 *
 * cuBLAS reaches about 70% of the copy bandwidth on these shapes (5.4 ms
 * against 3.8 ms of weight reading for a 30-token request on the 8B shape,
 * cuda/NOTES.md run 12). This kernel streams W straight into tensor-core
 * fragments: a warp owns 16 * MT rows of W and one range of cols, copies
 * its next 64-column steps into a shared ring with cp.async (3 or 7 in
 * flight) and reads x from shared memory, where its block (4 warps, 64 * MT
 * rows) placed the range once. The dot products are permutation-invariant
 * in k, so each lane takes 8 contiguous columns and the x fragments follow
 * the same permutation: no shuffles, no ldmatrix, every load coalesced.
 * Measured (runs 18-19): 7-14% faster than cuBLAS a layer at T = 1 in
 * isolation, 0.71x at T = 30, 0.91-1.02x in a live 8B decode step; so it is
 * opt-in (backend_cuda_set_skinny).
 *
 * The cols range of a block is cols / n_splits; with n_splits > 1 each
 * block writes its partial sums and a second kernel adds them in split
 * order, so results do not depend on scheduling.
 */
#ifndef IS_CUDA_SKINNY_CUH
#define IS_CUDA_SKINNY_CUH

#include "common.cuh"

/* Largest T the kernel takes (split inputs: half of it). */
#define SKINNY_MAX_T 64

/* How a product is cut: rows per warp (16 * mt), columns per block (kc,
 * a multiple of 64), and so the number of splits. */
typedef struct skinny_plan {
    int32_t mt;       /* 1 or 2 */
    int32_t kc;
    int32_t n_splits; /* ceil(cols / kc) */
    int32_t row_tiles;
} skinny_plan;

/* Whether the kernel takes this product: T rows of x (2T columns when
 * split), cols a multiple of 64. */
bool cuda_skinny_supports(int32_t T, int64_t rows, int64_t cols, bool split);

/* The cut for a GPU of n_sms multiprocessors: about one block on each
 * (enough copies in flight), with the fewest splits that gives (less
 * partial traffic). mt, kc > 0 force them (benchmarks). */
skinny_plan cuda_skinny_plan(int32_t T, int64_t rows, int64_t cols, bool split, int32_t n_sms,
                             int32_t mt, int32_t kc);

/* Floats of partial sums the plan needs. */
size_t cuda_skinny_partial_floats(const skinny_plan *p, int32_t T, int64_t rows);

/* Lets the kernels take more than 48 KiB of shared memory, on the current
 * device: once, before the first product (not while a stream captures). */
is_status cuda_skinny_prepare(void);

/* y[T][rows] = x W^T (+ bias[rows] if not NULL). x bf16 [T][cols], or with
 * split [hi: T][cols] then [lo: T][cols] (cuda_f32_to_bf16_split's layout),
 * whose two products are summed. */
is_status cuda_skinny_matmul(cudaStream_t s, const skinny_plan *p, float *y,
                             const __nv_bfloat16 *w, const __nv_bfloat16 *x, const float *bias,
                             int32_t T, int64_t rows, int64_t cols, bool split, float *partial);

#endif

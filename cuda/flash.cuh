/*
 * flash: FlashAttention-style paged attention over a bf16 KV cache, for
 * plain causal batches (no segment masks, no q_prefix: those take the exact
 * kernel of attention.cuh).
 *
 * A block owns a query tile: up to FLASH_BM rows, each a (token, query head)
 * pair of one KV head's group, FLASH_BM / group consecutive tokens of one
 * sequence; so the heads of a GQA group share every K/V tile they read.
 * It walks the sequence's keys in tiles of FLASH_BN through the block table
 * (cp.async 16-byte copies into shared memory, the next tile in flight while
 * one is used), computes S = Q K^T and O += P V on the tensor cores
 * (mma.sync m16n8k16, bf16 operands, f32 accumulation, all in registers)
 * with an online softmax in f32 between them. Q is rounded to bf16, P too before the
 * P V product (as FlashAttention does); softmax statistics stay f32.
 *
 * Few tiles (a short query over a long memory, decode steps) would leave
 * most multiprocessors idle, so the keys are then split over n_splits
 * blocks per tile (flash-decoding); each writes an unnormalised partial
 * result and a second kernel merges them.
 *
 * Two block shapes: FLASH_BM rows (4 warps, two K/V stages) for long runs
 * of tokens, as in a prefill; FLASH_BM_SHORT rows (8 warps, four stages)
 * when every run is short (a query after injected memory: 30 tokens x 4
 * heads in one block), so each K/V tile is read once for all the query's
 * rows and a block's few tiles are all in flight at once.
 * cuda_flash_plan_batch cuts the batch and chooses the shape and splits.
 */
#ifndef IS_CUDA_FLASH_CUH
#define IS_CUDA_FLASH_CUH

#include "common.cuh"

#define FLASH_BM 64        /* query rows per block for long runs: 4 warps x 16 */
#define FLASH_BM_SHORT 128 /* for short runs: 8 warps x 16 */
#define FLASH_BN 64        /* keys per tile */
#define FLASH_MAX_SPLITS 64

/* Whether the kernel takes this shape: head_dim 64 or 128, whole groups. */
bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads);

/* How a batch is cut for cuda_flash_attention. */
typedef struct cuda_flash_plan {
    int32_t n_tiles; /* query tiles */
    int32_t rows;    /* query rows a block: FLASH_BM or FLASH_BM_SHORT */
    int32_t splits;  /* blocks each tile's keys are split over, 1..FLASH_MAX_SPLITS */
} cuda_flash_plan;

/* Which plan cuda_flash_plan_batch makes; all but the first for A/B
 * measurements (bench_attn_gpu). */
typedef enum cuda_flash_choice {
    CUDA_FLASH_CHOICE_AUTO = 0, /* serving's: FLASH_BM_SHORT rows for short runs, splits
                                   by the cost model */
    CUDA_FLASH_CHOICE_ROWS64,   /* the cost model's splits, FLASH_BM rows always */
    CUDA_FLASH_CHOICE_LEGACY,   /* before device run 23: FLASH_BM rows, splits filling two
                                   blocks a multiprocessor (the last ones possibly empty) */
} cuda_flash_choice;

/* Cuts a batch (host arrays: seq_of_token[T], pos[T]) into query tiles,
 * written to tiles (host int32 [T][4], the layout cuda_flash_attention
 * reads), and chooses the block shape and the key splits for a GPU of n_sms
 * multiprocessors. Deterministic: the same batch gives the same plan. */
cuda_flash_plan cuda_flash_plan_batch(const int32_t *seq_of_token, const int32_t *pos, int32_t T,
                                      int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                      int32_t n_sms, cuda_flash_choice choice, int32_t *tiles);

/* Floats of the partial results for plan.splits > 1. */
static inline size_t cuda_flash_partial_floats(cuda_flash_plan plan, int32_t n_kv_heads,
                                               int32_t head_dim) {
    return (size_t)plan.n_tiles * n_kv_heads * plan.splits * plan.rows * (head_dim + 2);
}

/* out[T][n_heads*head_dim] for the tokens the tiles cover. tiles: device
 * int32 [plan.n_tiles][4] = {first batch token, tokens, sequence, position
 * of the first}, the tokens of a tile consecutive in the batch and in
 * position, at most plan.rows / group of them; block tables of sequence s
 * at flat + bt_off[s] (cuda_attn_meta's). partial:
 * cuda_flash_partial_floats of scratch when plan.splits > 1.
 * IS_ERR_UNSUPPORTED for a shape cuda_flash_supports refuses,
 * IS_ERR_INVALID_ARG for a plan it cannot run; nothing is launched then. */
is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *bt_off, const int32_t *tiles,
                               cuda_flash_plan plan, float *partial, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t block_size);

#endif

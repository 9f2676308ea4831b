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
 */
#ifndef IS_CUDA_FLASH_CUH
#define IS_CUDA_FLASH_CUH

#include "common.cuh"

#define FLASH_BM 64 /* query rows per block: 4 warps x 16 */
#define FLASH_BN 64 /* keys per tile */

/* Whether the kernel takes this shape: head_dim 64 or 128, whole groups. */
bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads);

/* Tokens in one query tile. */
static inline int32_t cuda_flash_tile_tokens(int32_t n_heads, int32_t n_kv_heads) {
    return FLASH_BM / (n_heads / n_kv_heads);
}

/* Floats of the partial results for n_splits > 1. */
static inline size_t cuda_flash_partial_floats(int32_t n_tiles, int32_t n_kv_heads,
                                               int32_t n_splits, int32_t head_dim) {
    return (size_t)n_tiles * n_kv_heads * n_splits * FLASH_BM * (head_dim + 2);
}

/* out[T][n_heads*head_dim] for the tokens the tiles cover. tiles: device
 * int32 [n_tiles][4] = {first batch token, tokens, sequence, position of the
 * first}, the tokens of a tile consecutive in the batch and in position;
 * block tables of sequence s at flat + bt_off[s] (cuda_attn_meta's). partial:
 * cuda_flash_partial_floats of scratch when n_splits > 1. */
is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *bt_off, const int32_t *tiles,
                               int32_t n_tiles, int32_t n_splits, float *partial, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t block_size);

#endif

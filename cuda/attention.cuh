/*
 * attention: paged attention over the KV cache, for prefill chunks and
 * decode steps alike, with the semantics of the CPU reference
 * (backend.h, attn_batch): causal over each sequence's slots, restricted by
 * segment ids where the sequence has them, and, for the segment-masked
 * reference, queries rotated to their encoding-time position (q_prefix)
 * when scoring segment-0 keys.
 *
 * This is the straightforward kernel: one block of four warps per
 * (token, head); each warp takes chunks of 32 keys (one key per lane for
 * the score, then the chunk's values with the head's dimensions spread over
 * the lanes) with an online softmax, and the four partial results are merged
 * at the end. Keys and values are read through the block table straight
 * from the cache. It is the exact path (f32 caches, segment masks, q_prefix);
 * plain causal batches over a bf16 cache take the tiled tensor-core kernel
 * of flash.cuh instead.
 */
#ifndef IS_CUDA_ATTENTION_CUH
#define IS_CUDA_ATTENTION_CUH

#include "common.cuh"

/* Where each query token attends, in device memory: the host attn_batch
 * packed into one int32 array by the backend. */
typedef struct cuda_attn_meta {
    const int32_t *pos;          /* [T] slot of each token in its sequence */
    const int32_t *seq_of_token; /* [T] sequence index */
    const int32_t *bt_off;       /* [S] offset of the sequence's block table in flat */
    const int32_t *seg_off;      /* [S] offset of its segment ids in flat, or -1 (none) */
    const int32_t *flat;         /* block tables and segment ids */
    /* [S][2] memory segments (attn_batch.mem_span), or NULL; a query after
     * its sequence's segment scores its keys as score * mem_mul + mem_add. */
    const int32_t *mem;
    float mem_mul, mem_add;
} cuda_attn_meta;

/* Largest head_dim the kernel takes. */
#define CUDA_ATTN_MAX_HEAD_DIM 256

/* out[T][n_heads*head_dim] = softmax(q K^T / sqrt(head_dim) + mask) V, in
 * f32 arithmetic. q, q_prefix (or NULL): [T][n_heads*head_dim]; caches as in
 * kv.cuh (bf16 or f32). IS_ERR_UNSUPPORTED when head_dim >
 * CUDA_ATTN_MAX_HEAD_DIM. */
is_status cuda_attention(cudaStream_t s, float *out, const float *q, const float *q_prefix,
                         const void *k_cache, const void *v_cache, cuda_attn_meta meta, int32_t T,
                         int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                         bool bf16);

#endif

/*
 * kv: writes a batch's keys and values into the paged KV cache
 * ([n_blocks][n_kv_heads][block_size][head_dim] per layer, f32 like the CPU
 * reference; a bf16 cache is a later step) at the slots the KV bookkeeping
 * handed out (slot = block * block_size + offset).
 */
#ifndef IS_CUDA_KV_CUH
#define IS_CUDA_KV_CUH

#include "common.cuh"

/* k, v: [T][n_kv_heads*head_dim]; slots: [T] device. */
is_status cuda_kv_store(cudaStream_t s, float *k_cache, float *v_cache, const float *k,
                        const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                        int32_t head_dim, int32_t block_size);

#endif

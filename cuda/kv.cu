/*
 * kv: scatter of K and V rows into the paged cache (see kv.cuh). One block
 * per (token, KV head); threads copy the head's elements.
 */
#include "kv.cuh"

static __global__ void kv_store_kernel(float *k_cache, float *v_cache, const float *k,
                                       const float *v, const int32_t *slots, int32_t n_kv_heads,
                                       int32_t head_dim, int32_t block_size) {
    int32_t t = blockIdx.x, h = blockIdx.y;
    int32_t slot = slots[t];
    int64_t block = slot / block_size, off = slot % block_size;
    int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim;
    int64_t src = ((int64_t)t * n_kv_heads + h) * head_dim;
    for (int32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}

is_status cuda_kv_store(cudaStream_t s, float *k_cache, float *v_cache, const float *k,
                        const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                        int32_t head_dim, int32_t block_size) {
    if (T <= 0 || n_kv_heads <= 0) return IS_OK;
    dim3 grid((unsigned)T, (unsigned)n_kv_heads);
    int threads = head_dim >= 128 ? 128 : (head_dim + 31) / 32 * 32;
    kv_store_kernel<<<grid, threads, 0, s>>>(k_cache, v_cache, k, v, slots, n_kv_heads, head_dim,
                                             block_size);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/*
 * kv: scatter of K and V rows into the paged cache, injection of facts from
 * the arena, and the arena's fill (see kv.cuh).
 */
#include "kv.cuh"

/* One block per (token, KV head); threads copy the head's elements. */
template <typename CT>
static __global__ void kv_store_kernel(CT *k_cache, CT *v_cache, const float *k, const float *v,
                                       const int32_t *slots, int32_t n_kv_heads, int32_t head_dim,
                                       int32_t block_size) {
    int32_t t = blockIdx.x, h = blockIdx.y;
    int32_t slot = slots[t];
    int64_t block = slot / block_size, off = slot % block_size;
    int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim;
    int64_t src = ((int64_t)t * n_kv_heads + h) * head_dim;
    for (int32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        kv_put(k_cache + dst + i, k[src + i]);
        kv_put(v_cache + dst + i, v[src + i]);
    }
}

is_status cuda_kv_store(cudaStream_t s, void *k_cache, void *v_cache, const float *k,
                        const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                        int32_t head_dim, int32_t block_size, bool bf16) {
    if (T <= 0 || n_kv_heads <= 0) return IS_OK;
    dim3 grid((unsigned)T, (unsigned)n_kv_heads);
    int threads = head_dim >= 128 ? 128 : (head_dim + 31) / 32 * 32;
    if (bf16)
        kv_store_kernel<<<grid, threads, 0, s>>>((__nv_bfloat16 *)k_cache, (__nv_bfloat16 *)v_cache,
                                                 k, v, slots, n_kv_heads, head_dim, block_size);
    else
        kv_store_kernel<<<grid, threads, 0, s>>>((float *)k_cache, (float *)v_cache, k, v, slots,
                                                 n_kv_heads, head_dim, block_size);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* Element d of head x rotated with its pair partner by the table row tab
 * ([half][cos, sin]; neg: a negative position, sin negated): the value
 * rope_kernel leaves there. Elements past the rotated ones pass through. */
template <typename T>
static __device__ __forceinline__ float rope_element(const T *x, int32_t d, int32_t half,
                                                     bool neox, const float *tab, bool neg) {
    if (d >= 2 * half) return kv_load(x + d);
    const int32_t pi = neox ? (d < half ? d : d - half) : d / 2;
    const int32_t i0 = neox ? pi : 2 * pi, i1 = neox ? pi + half : 2 * pi + 1;
    const float c = tab[2 * pi], sn = neg ? -tab[2 * pi + 1] : tab[2 * pi + 1];
    const float a = kv_load(x + i0), b = kv_load(x + i1);
    return d == i0 ? rope_first(a, b, c, sn) : rope_second(a, b, c, sn);
}

/* One block per token: the queries' pairs rotated in place (as
 * rope_kernel: thread per pair), then each key element rotated with its
 * pair partner (as inject_kernel) and stored with its value. */
template <typename CT>
static __global__ void rope_store_kernel(float *q, const float *k, const float *v, CT *k_cache,
                                         CT *v_cache, const int32_t *pos, const int32_t *slots,
                                         int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                         int32_t block_size, int32_t half, bool neox,
                                         const float *cs) {
    const int32_t t = blockIdx.x, p = pos[t];
    const float *tab = cs + (int64_t)(p < 0 ? -p : p) * half * 2;
    float *qt = q + (int64_t)t * n_heads * head_dim;
    for (int32_t k2 = threadIdx.x; k2 < n_heads * half; k2 += blockDim.x) {
        const int32_t i = k2 % half;
        float *x = qt + (int64_t)(k2 / half) * head_dim;
        const float c = tab[2 * i], sn = p < 0 ? -tab[2 * i + 1] : tab[2 * i + 1];
        const int32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        const float a = x[i0], b = x[i1];
        x[i0] = rope_first(a, b, c, sn);
        x[i1] = rope_second(a, b, c, sn);
    }
    const int32_t slot = slots[t];
    const int64_t block = slot / block_size, off = slot % block_size;
    const int32_t kv_dim = n_kv_heads * head_dim;
    const float *kt = k + (int64_t)t * kv_dim, *vt = v + (int64_t)t * kv_dim;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        const int32_t h = e / head_dim, d = e % head_dim;
        const int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim + d;
        kv_put(k_cache + dst, rope_element(kt + (int64_t)h * head_dim, d, half, neox, tab, p < 0));
        kv_put(v_cache + dst, vt[e]);
    }
}

is_status cuda_rope_store(cudaStream_t s, float *q, const float *k, const float *v, void *k_cache,
                          void *v_cache, const int32_t *pos, const int32_t *slots, int32_t T,
                          int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                          int32_t n_rot, bool neox, const float *cs, bool bf16) {
    if (T <= 0) return IS_OK;
    const int32_t half = n_rot / 2;
    if (bf16)
        rope_store_kernel<<<T, 256, 0, s>>>(q, k, v, (__nv_bfloat16 *)k_cache,
                                            (__nv_bfloat16 *)v_cache, pos, slots, n_heads,
                                            n_kv_heads, head_dim, block_size, half, neox, cs);
    else
        rope_store_kernel<<<T, 256, 0, s>>>(q, k, v, (float *)k_cache, (float *)v_cache, pos, slots,
                                            n_heads, n_kv_heads, head_dim, block_size, half, neox,
                                            cs);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* One block per (token, layer); thread e takes element e of the token's
 * kv_dim keys (rotated with its pair partner, as rope_kernel rotates: the
 * same table, the same expressions) and values. */
template <typename CT>
static __global__ void inject_kernel(void *const *caches, const __nv_bfloat16 *arena,
                                     const int32_t *pages, const int32_t *slots, int32_t pos0,
                                     int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                                     int32_t block_size, int32_t n_rot, bool neox,
                                     const float *cs) {
    const int32_t i = blockIdx.x, l = blockIdx.y;
    const int32_t kv_dim = n_kv_heads * head_dim, half = n_rot / 2, p = pos0 + i;
    const __nv_bfloat16 *kr = arena + (int64_t)pages[i] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim;
    const __nv_bfloat16 *vr = kr + (int64_t)n_layers * kv_dim;
    CT *kc = (CT *)caches[l], *vc = (CT *)caches[n_layers + l];
    const int32_t slot = slots[i];
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        const int32_t h = e / head_dim, d = e % head_dim;
        const int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim + d;
        kv_put(kc + dst, rope_element(kr + (int64_t)h * head_dim, d, half, neox,
                                      cs + (int64_t)p * half * 2, false));
        kv_put(vc + dst, __bfloat162float(vr[e]));
    }
}

/* The bf16 cache with every dimension rotated (the serving case): a thread
 * takes 8 elements of a head with 16-byte loads and stores (the old kernel
 * above moved 2 bytes a load and was ~3x off the copy bandwidth at k = 50),
 * or for the neox layout 8 elements and their 8 partners half a head away.
 * The rotation is rope_kernel's expression, as above. Threads run over
 * (layer, token, unit), so consecutive threads write consecutive bytes. */
static __device__ __forceinline__ void bf16x8_to_f32(const uint4 &u, float *f) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 v = __bfloat1622float2(h[j]);
        f[2 * j] = v.x;
        f[2 * j + 1] = v.y;
    }
}

static __device__ __forceinline__ uint4 f32_to_bf16x8(const float *f) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return u;
}

static __global__ void inject_bf16_kernel(void *const *caches, const __nv_bfloat16 *arena,
                                          const int32_t *pages, const int32_t *slots,
                                          int32_t pos0, int32_t n_tokens, int32_t n_layers,
                                          int32_t n_kv_heads, int32_t head_dim,
                                          int32_t block_size, bool neox, const float *cs) {
    const int32_t kv_dim = n_kv_heads * head_dim, half = head_dim / 2;
    const int32_t per_head = neox ? head_dim / 16 : head_dim / 8, units = n_kv_heads * per_head;
    const int64_t total = (int64_t)n_layers * n_tokens * units;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int32_t u = (int32_t)(idx % units);
        const int64_t r = idx / units;
        const int32_t i = (int32_t)(r % n_tokens), l = (int32_t)(r / n_tokens);
        const int32_t h = u / per_head, d = (u % per_head) * 8;
        const __nv_bfloat16 *kr =
            arena + (int64_t)pages[i] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim + h * head_dim;
        const __nv_bfloat16 *vr = kr + (int64_t)n_layers * kv_dim;
        __nv_bfloat16 *kc = (__nv_bfloat16 *)caches[l], *vc = (__nv_bfloat16 *)caches[n_layers + l];
        const int32_t slot = slots[i];
        const int64_t dst = (((int64_t)(slot / block_size) * n_kv_heads + h) * block_size +
                             slot % block_size) * head_dim;
        const float *ce = cs + (int64_t)(pos0 + i) * half * 2;
        float a[8], b[8], c[16];
        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(kr + d), a);
        if (!neox) {
            /* Pairs (d + 2j, d + 2j + 1), j < 4: table entries d / 2 + j. */
            *reinterpret_cast<float4 *>(c) = *reinterpret_cast<const float4 *>(ce + d);
            *reinterpret_cast<float4 *>(c + 4) = *reinterpret_cast<const float4 *>(ce + d + 4);
            float o[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float x0 = a[2 * j], x1 = a[2 * j + 1], co = c[2 * j], sn = c[2 * j + 1];
                o[2 * j] = rope_first(x0, x1, co, sn);
                o[2 * j + 1] = rope_second(x0, x1, co, sn);
            }
            *reinterpret_cast<uint4 *>(kc + dst + d) = f32_to_bf16x8(o);
            *reinterpret_cast<uint4 *>(vc + dst + d) = *reinterpret_cast<const uint4 *>(vr + d);
        } else {
            /* Pairs (d + j, d + j + half), j < 8: table entries d + j. */
            bf16x8_to_f32(*reinterpret_cast<const uint4 *>(kr + d + half), b);
#pragma unroll
            for (int j = 0; j < 4; j++)
                *reinterpret_cast<float4 *>(c + 4 * j) =
                    *reinterpret_cast<const float4 *>(ce + 2 * d + 4 * j);
            float o0[8], o1[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float co = c[2 * j], sn = c[2 * j + 1];
                o0[j] = rope_first(a[j], b[j], co, sn);
                o1[j] = rope_second(a[j], b[j], co, sn);
            }
            *reinterpret_cast<uint4 *>(kc + dst + d) = f32_to_bf16x8(o0);
            *reinterpret_cast<uint4 *>(kc + dst + d + half) = f32_to_bf16x8(o1);
            *reinterpret_cast<uint4 *>(vc + dst + d) = *reinterpret_cast<const uint4 *>(vr + d);
            *reinterpret_cast<uint4 *>(vc + dst + d + half) =
                *reinterpret_cast<const uint4 *>(vr + d + half);
        }
    }
}

is_status cuda_inject(cudaStream_t s, void *const *caches, const __nv_bfloat16 *arena,
                      const int32_t *pages, const int32_t *slots, int32_t n_tokens, int32_t pos0,
                      int32_t n_layers, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                      int32_t n_rot, bool neox, const float *cs, bool bf16) {
    if (n_tokens <= 0 || n_layers <= 0) return IS_OK;
    if (bf16 && n_rot == head_dim && head_dim % 16 == 0) {
        const int64_t units = (int64_t)n_layers * n_tokens * n_kv_heads * head_dim / (neox ? 16 : 8);
        inject_bf16_kernel<<<cuda_blocks_for(units, 256), 256, 0, s>>>(
            caches, arena, pages, slots, pos0, n_tokens, n_layers, n_kv_heads, head_dim,
            block_size, neox, cs);
        CUDA_CHECK_LAUNCH();
        return IS_OK;
    }
    dim3 grid((unsigned)n_tokens, (unsigned)n_layers);
    const int32_t kv_dim = n_kv_heads * head_dim;
    int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
    if (bf16)
        inject_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(caches, arena, pages, slots, pos0,
                                                              n_layers, n_kv_heads, head_dim,
                                                              block_size, n_rot, neox, cs);
    else
        inject_kernel<float><<<grid, threads, 0, s>>>(caches, arena, pages, slots, pos0, n_layers,
                                                      n_kv_heads, head_dim, block_size, n_rot,
                                                      neox, cs);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* One block per (token, layer). */
static __global__ void arena_fill_kernel(__nv_bfloat16 *arena, const int32_t *pages,
                                         const float *k, const float *v, int32_t n_tokens,
                                         int32_t n_layers, int32_t kv_dim) {
    const int32_t j = blockIdx.x, l = blockIdx.y;
    __nv_bfloat16 *kd = arena + (int64_t)pages[j] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim;
    __nv_bfloat16 *vd = kd + (int64_t)n_layers * kv_dim;
    const int64_t src = ((int64_t)l * n_tokens + j) * kv_dim;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        kd[e] = __float2bfloat16_rn(k[src + e]);
        vd[e] = __float2bfloat16_rn(v[src + e]);
    }
}

is_status cuda_arena_fill(cudaStream_t s, __nv_bfloat16 *arena, const int32_t *pages,
                          const float *k, const float *v, int32_t n_tokens, int32_t n_layers,
                          int32_t kv_dim) {
    if (n_tokens <= 0 || n_layers <= 0) return IS_OK;
    dim3 grid((unsigned)n_tokens, (unsigned)n_layers);
    int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
    arena_fill_kernel<<<grid, threads, 0, s>>>(arena, pages, k, v, n_tokens, n_layers, kv_dim);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

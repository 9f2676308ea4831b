/*
 * attention: paged attention, one block per (token, head) (see
 * attention.cuh for the plan and what is left).
 */
#include "attention.cuh"
#include "kv.cuh"

#include <math.h>

#define ATTN_WARPS 4

/* May a query of segment qs see a key of segment ks (causality apart)? */
static __device__ __forceinline__ bool seg_visible(int32_t qs, int32_t ks) {
    if (ks == 0) return true;
    if (ks > 0) return qs == 0 || qs == ks || qs == -ks;
    return qs == ks || qs == -ks;
}

/* Each lane keeps NI of the head's dimensions (lane + 32 i): head_dim <= 32 NI. */
template <int NI, typename CT>
static __global__ void __launch_bounds__(ATTN_WARPS * 32)
    attn_kernel(float *out, const float *q, const float *q_prefix, const CT *k_cache,
                const CT *v_cache, cuda_attn_meta meta, int32_t n_heads, int32_t n_kv_heads,
                int32_t head_dim, int32_t block_size, float scale, bool vec4) {
    __shared__ __align__(16) float sq[CUDA_ATTN_MAX_HEAD_DIM];  /* query */
    __shared__ __align__(16) float sqp[CUDA_ATTN_MAX_HEAD_DIM]; /* query for segment-0 keys */
    __shared__ float sacc[ATTN_WARPS][CUDA_ATTN_MAX_HEAD_DIM];
    __shared__ float sm[ATTN_WARPS], sl[ATTN_WARPS];

    const int32_t h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t kh = h / (n_heads / n_kv_heads);
    const int32_t qpos = meta.pos[t], s = meta.seq_of_token[t];
    const int32_t *bt = meta.flat + meta.bt_off[s];
    const int32_t *seg = meta.seg_off[s] >= 0 ? meta.flat + meta.seg_off[s] : nullptr;
    const int32_t qseg = seg ? seg[qpos] : 0;
    /* Memory keys [mb, me) for a query after them (empty otherwise). */
    int32_t mb = 0, me = 0;
    if (meta.mem && qpos >= meta.mem[2 * s + 1]) {
        mb = meta.mem[2 * s];
        me = meta.mem[2 * s + 1];
    }
    const int64_t qo = (int64_t)t * n_heads * head_dim + (int64_t)h * head_dim;
    const float *qp = q_prefix ? q_prefix + qo : q + qo;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        sq[i] = q[qo + i];
        sqp[i] = qp[i];
    }
    __syncthreads();

    float m = -INFINITY, l = 0.0f, acc[NI];
#pragma unroll
    for (int i = 0; i < NI; i++) acc[i] = 0.0f;
    const int32_t n_keys = qpos + 1;
    for (int32_t c0 = warp * 32; c0 < n_keys; c0 += ATTN_WARPS * 32) {
        /* Scores: lane j of the warp takes key c0 + j. */
        const int32_t j = c0 + lane;
        float sc = -INFINITY;
        if (j < n_keys) {
            const float *qs = sq;
            bool vis = true;
            if (seg) {
                int32_t ks = seg[j];
                vis = seg_visible(qseg, ks);
                if (ks == 0) qs = sqp;
            }
            if (vis) {
                const CT *kr =
                    k_cache + (((int64_t)bt[j / block_size] * n_kv_heads + kh) * block_size +
                               j % block_size) *
                                  head_dim;
                float d = 0.0f;
                if (vec4) { /* f32 caches only */
                    for (int32_t i = 0; i < head_dim; i += 4) {
                        float4 kv = *reinterpret_cast<const float4 *>((const float *)kr + i);
                        float4 qv = *reinterpret_cast<const float4 *>(qs + i);
                        d += qv.x * kv.x;
                        d += qv.y * kv.y;
                        d += qv.z * kv.z;
                        d += qv.w * kv.w;
                    }
                } else {
                    for (int32_t i = 0; i < head_dim; i++) d += qs[i] * kv_load(kr + i);
                }
                sc = d * scale;
                if (j >= mb && j < me) sc = sc * meta.mem_mul + meta.mem_add;
            }
        }
        /* Online softmax over the chunk (uniform across the warp). */
        const float cmax = warp_max(sc);
        if (cmax == -INFINITY) continue;
        const float mn = fmaxf(m, cmax);
        const float alpha = expf(m - mn); /* 0 while m is -inf */
        const float p = sc == -INFINITY ? 0.0f : expf(sc - mn);
        l = l * alpha + warp_sum(p);
#pragma unroll
        for (int i = 0; i < NI; i++) acc[i] *= alpha;
        const int32_t n_here = n_keys - c0 < 32 ? n_keys - c0 : 32;
        for (int32_t k = 0; k < n_here; k++) {
            const float pk = __shfl_sync(FULL_MASK, p, k);
            if (pk == 0.0f) continue;
            const int32_t jj = c0 + k;
            const CT *vr =
                v_cache +
                (((int64_t)bt[jj / block_size] * n_kv_heads + kh) * block_size + jj % block_size) *
                    head_dim;
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int32_t d = lane + 32 * i;
                if (d < head_dim) acc[i] += pk * kv_load(vr + d);
            }
        }
        m = mn;
    }

    /* Merge the warps' partial softmaxes. */
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < NI; i++) {
        const int32_t d = lane + 32 * i;
        if (d < head_dim) sacc[warp][d] = acc[i];
    }
    __syncthreads();
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, sm[w]);
    float wscale[ATTN_WARPS], sum = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++) {
        wscale[w] = sm[w] == -INFINITY ? 0.0f : expf(sm[w] - mx);
        sum += sl[w] * wscale[w];
    }
    /* The query always sees its own key, so sum > 0. */
    const float inv = 1.0f / sum;
    float *o = out + qo;
    for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) v += sacc[w][d] * wscale[w];
        o[d] = v * inv;
    }
}

template <typename CT>
static void attn_launch(cudaStream_t s, float *out, const float *q, const float *q_prefix,
                        const CT *k_cache, const CT *v_cache, cuda_attn_meta meta, int32_t T,
                        int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                        bool vec4) {
    const float scale = 1.0f / sqrtf((float)head_dim);
    dim3 grid((unsigned)n_heads, (unsigned)T);
    const int threads = ATTN_WARPS * 32;
    if (head_dim <= 64)
        attn_kernel<2, CT><<<grid, threads, 0, s>>>(out, q, q_prefix, k_cache, v_cache, meta,
                                                    n_heads, n_kv_heads, head_dim, block_size,
                                                    scale, vec4);
    else if (head_dim <= 128)
        attn_kernel<4, CT><<<grid, threads, 0, s>>>(out, q, q_prefix, k_cache, v_cache, meta,
                                                    n_heads, n_kv_heads, head_dim, block_size,
                                                    scale, vec4);
    else
        attn_kernel<8, CT><<<grid, threads, 0, s>>>(out, q, q_prefix, k_cache, v_cache, meta,
                                                    n_heads, n_kv_heads, head_dim, block_size,
                                                    scale, vec4);
}

is_status cuda_attention(cudaStream_t s, float *out, const float *q, const float *q_prefix,
                         const void *k_cache, const void *v_cache, cuda_attn_meta meta, int32_t T,
                         int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                         bool bf16) {
    if (T <= 0) return IS_OK;
    if (head_dim <= 0 || head_dim > CUDA_ATTN_MAX_HEAD_DIM)
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda attention: head_dim %d (at most %d)",
                            head_dim, CUDA_ATTN_MAX_HEAD_DIM);
    if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda attention: %d heads over %d KV heads",
                            n_heads, n_kv_heads);
    if (bf16) {
        attn_launch(s, out, q, q_prefix, (const __nv_bfloat16 *)k_cache,
                    (const __nv_bfloat16 *)v_cache, meta, T, n_heads, n_kv_heads, head_dim,
                    block_size, false);
    } else {
        const bool vec4 = head_dim % 4 == 0 && ((uintptr_t)k_cache & 15) == 0;
        attn_launch(s, out, q, q_prefix, (const float *)k_cache, (const float *)v_cache, meta, T,
                    n_heads, n_kv_heads, head_dim, block_size, vec4);
    }
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

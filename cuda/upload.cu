/*
 * upload: staged records into arena pages (see upload.cuh).
 *
 * One block per (token, layer): it moves that token's K row and V row of
 * the layer, 16 bytes a thread where the rows allow (every shape we serve:
 * kv_dim a multiple of 8), 2 bytes otherwise.
 */
#include "upload.cuh"

#include <cuda_fp16.h>

namespace {

__device__ __forceinline__ uint4 to_bf16x8(uint4 raw, bool f16) {
    if (!f16) return raw;
    const __half *h = reinterpret_cast<const __half *>(&raw);
    uint4 out;
    __nv_bfloat16 *b = reinterpret_cast<__nv_bfloat16 *>(&out);
#pragma unroll
    for (int e = 0; e < 8; e++) b[e] = __float2bfloat16_rn(__half2float(h[e]));
    return out;
}

__device__ __forceinline__ uint16_t to_bf16(uint16_t raw, bool f16) {
    if (!f16) return raw;
    const __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__ushort_as_half(raw)));
    return __bfloat16_as_ushort(b);
}

template <bool VEC>
__global__ void scatter_kernel(__nv_bfloat16 *arena, const uint16_t *staging,
                               const cuda_upload_token *toks, int32_t l0, int32_t n_layers,
                               int32_t kv_dim) {
    const cuda_upload_token t = toks[blockIdx.x];
    const int32_t l = l0 + (int32_t)blockIdx.y;
    const uint16_t *k = staging + t.k + ((int64_t)l * t.n_tokens + t.j) * kv_dim;
    const uint16_t *v = k + (int64_t)n_layers * t.n_tokens * kv_dim;
    uint16_t *kd = reinterpret_cast<uint16_t *>(arena) + (int64_t)t.page * 2 * n_layers * kv_dim +
                   (int64_t)l * kv_dim;
    uint16_t *vd = kd + (int64_t)n_layers * kv_dim;
    if (VEC) {
        const uint4 *ks = reinterpret_cast<const uint4 *>(k),
                    *vs = reinterpret_cast<const uint4 *>(v);
        uint4 *kw = reinterpret_cast<uint4 *>(kd), *vw = reinterpret_cast<uint4 *>(vd);
        for (int32_t e = threadIdx.x; e < kv_dim / 8; e += blockDim.x) {
            kw[e] = to_bf16x8(ks[e], t.f16);
            vw[e] = to_bf16x8(vs[e], t.f16);
        }
    } else {
        for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
            kd[e] = to_bf16(k[e], t.f16);
            vd[e] = to_bf16(v[e], t.f16);
        }
    }
}

} // namespace

is_status cuda_upload_scatter(cudaStream_t s, __nv_bfloat16 *arena, const uint16_t *staging,
                              const cuda_upload_token *toks, int32_t n, int32_t l0, int32_t l1,
                              int32_t n_layers, int32_t kv_dim) {
    if (n <= 0 || l1 <= l0) return IS_OK;
    if (l0 < 0 || l1 > n_layers || l1 - l0 > 65535 || kv_dim <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda upload: bad layers [%d, %d) of %d", (int)l0,
                            (int)l1, (int)n_layers);
    const dim3 grid((unsigned)n, (unsigned)(l1 - l0));
    if (kv_dim % 8 == 0) {
        const int32_t vec = kv_dim / 8;
        const int threads = vec >= 128 ? 128 : (vec + 31) / 32 * 32;
        scatter_kernel<true><<<grid, threads, 0, s>>>(arena, staging, toks, l0, n_layers, kv_dim);
    } else {
        const int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
        scatter_kernel<false><<<grid, threads, 0, s>>>(arena, staging, toks, l0, n_layers, kv_dim);
    }
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

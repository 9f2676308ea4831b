/*
 * upload: host records into arena pages (see upload.cuh).
 *
 * One block per (token, layer): it moves that token's K row and V row of
 * the layer, 16 bytes a thread where the rows allow (every shape we serve:
 * kv_dim a multiple of 8, rows 16-byte aligned), so each PCIe read is a
 * full, coalesced line of the row.
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

__global__ void upload_vec_kernel(__nv_bfloat16 *arena, cuda_upload_pages pages, const uint4 *k,
                                  const uint4 *v, bool f16, int32_t tok0, int32_t n_tokens,
                                  int32_t n_layers, int32_t kv_dim) {
    const int32_t j = blockIdx.x, l = blockIdx.y, vec = kv_dim / 8;
    const int64_t src = ((int64_t)l * n_tokens + tok0 + j) * vec;
    uint4 *kd = reinterpret_cast<uint4 *>(arena + (int64_t)pages.page[j] * 2 * n_layers * kv_dim +
                                          (int64_t)l * kv_dim);
    uint4 *vd = kd + (int64_t)n_layers * vec;
    for (int32_t e = threadIdx.x; e < vec; e += blockDim.x) {
        kd[e] = to_bf16x8(k[src + e], f16);
        vd[e] = to_bf16x8(v[src + e], f16);
    }
}

template <typename T> __device__ __forceinline__ __nv_bfloat16 to_bf16(T x);
template <> __device__ __forceinline__ __nv_bfloat16 to_bf16(__half x) {
    return __float2bfloat16_rn(__half2float(x));
}
template <> __device__ __forceinline__ __nv_bfloat16 to_bf16(__nv_bfloat16 x) { return x; }

template <typename T>
__global__ void upload_kernel(__nv_bfloat16 *arena, cuda_upload_pages pages, const T *k, const T *v,
                              int32_t tok0, int32_t n_tokens, int32_t n_layers, int32_t kv_dim) {
    const int32_t j = blockIdx.x, l = blockIdx.y;
    const int64_t src = ((int64_t)l * n_tokens + tok0 + j) * kv_dim;
    __nv_bfloat16 *kd =
        arena + (int64_t)pages.page[j] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim;
    __nv_bfloat16 *vd = kd + (int64_t)n_layers * kv_dim;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        kd[e] = to_bf16(k[src + e]);
        vd[e] = to_bf16(v[src + e]);
    }
}

} // namespace

is_status cuda_upload_record(cudaStream_t s, __nv_bfloat16 *arena, const cuda_upload_pages *pages,
                             const void *k, const void *v, int32_t dtype, int32_t tok0, int32_t n,
                             int32_t n_tokens, int32_t n_layers, int32_t kv_dim) {
    if (n <= 0 || n_layers <= 0) return IS_OK;
    if (n > CUDA_UPLOAD_MAX_TOKENS || tok0 < 0 || tok0 + n > n_tokens || n_layers > 65535 ||
        (dtype != 1 && dtype != 2))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda upload: bad record slice (dtype %d, %d+%d of %d)", (int)dtype,
                            (int)tok0, (int)n, (int)n_tokens);
    const dim3 grid((unsigned)n, (unsigned)n_layers);
    const bool f16 = dtype == 1;
    if (kv_dim % 8 == 0 && (uintptr_t)k % 16 == 0 && (uintptr_t)v % 16 == 0) {
        const int32_t vec = kv_dim / 8;
        const int threads = vec >= 128 ? 128 : (vec + 31) / 32 * 32;
        upload_vec_kernel<<<grid, threads, 0, s>>>(arena, *pages, (const uint4 *)k,
                                                   (const uint4 *)v, f16, tok0, n_tokens, n_layers,
                                                   kv_dim);
    } else {
        const int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
        if (f16)
            upload_kernel<__half><<<grid, threads, 0, s>>>(arena, *pages, (const __half *)k,
                                                           (const __half *)v, tok0, n_tokens,
                                                           n_layers, kv_dim);
        else
            upload_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(
                arena, *pages, (const __nv_bfloat16 *)k, (const __nv_bfloat16 *)v, tok0, n_tokens,
                n_layers, kv_dim);
    }
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/*
 * norm: RMSNorm, one block per row (see norm.cuh).
 */
#include "norm.cuh"

#define NORM_THREADS 256

/* With res (the fused residual add), x[i] += res[i] first, stored back;
 * the sum and the norm then read what the add wrote, as separate add and
 * rmsnorm launches would: the results are the same bits. */
static __global__ void rmsnorm_kernel(float *out, float *x, const float *res, const float *g,
                                      int32_t n, float eps, __nv_bfloat16 *obf, int64_t split_off) {
    __shared__ float partial[NORM_THREADS / 32];
    float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    if (res) {
        const float *rr = res + (int64_t)blockIdx.x * n;
        for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) xr[i] = xr[i] + rr[i];
    }
    float ss = 0.0f;
    for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) ss += xr[i] * xr[i];
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < NORM_THREADS / 32 ? partial[threadIdx.x] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (threadIdx.x == 0) partial[0] = ss;
    }
    __syncthreads();
    float scale = 1.0f / sqrtf(partial[0] / (float)n + eps);
    /* Every thread has read partial[0] before any writes out (out may alias x,
     * but each element is read and written by the same thread). */
    __nv_bfloat16 *ob = obf ? obf + (int64_t)blockIdx.x * n : NULL;
    for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) {
        const float y = xr[i] * scale * g[i];
        o[i] = y;
        if (ob) {
            const __nv_bfloat16 hi = __float2bfloat16_rn(y);
            ob[i] = hi;
            if (split_off) ob[split_off + i] = __float2bfloat16_rn(y - __bfloat162float(hi));
        }
    }
}

is_status cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *g, int32_t T,
                       int32_t n, float eps, __nv_bfloat16 *obf, bool split) {
    /* Without res the kernel only reads x. */
    return cuda_add_rmsnorm(s, out, (float *)x, NULL, g, T, n, eps, obf, split);
}

is_status cuda_add_rmsnorm(cudaStream_t s, float *out, float *x, const float *res, const float *g,
                           int32_t T, int32_t n, float eps, __nv_bfloat16 *obf, bool split) {
    if (T <= 0 || n <= 0) return IS_OK;
    rmsnorm_kernel<<<T, NORM_THREADS, 0, s>>>(out, x, res, g, n, eps, obf,
                                              obf && split ? (int64_t)T * n : 0);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

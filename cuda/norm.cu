/*
 * norm: RMSNorm, one block per row (see norm.cuh).
 */
#include "norm.cuh"

#define NORM_THREADS 256

/* The sum of every thread's ss over the block (NORM_THREADS), returned to
 * all threads: lanes, then warps through partial[]. */
static __device__ __forceinline__ float block_sum(float ss, float *partial) {
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < NORM_THREADS / 32 ? partial[threadIdx.x] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (threadIdx.x == 0) partial[0] = ss;
    }
    __syncthreads();
    return partial[0];
}

/* With res (the fused residual add), x[i] += res[i] first, stored back;
 * the sum and the norm then read what the add wrote, as separate add and
 * rmsnorm launches would: the results are the same bits. */
static __global__ void rmsnorm_kernel(float *out, float *x, const float *res, const float *g,
                                      int32_t n, float eps, __nv_bfloat16 *obf, int64_t split_off) {
    __shared__ float partial[NORM_THREADS / 32];
    pdl_wait(); /* launched as a dependent: nothing before this */
    float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    if (res) {
        const float *rr = res + (int64_t)blockIdx.x * n;
        for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) xr[i] = xr[i] + rr[i];
    }
    float ss = 0.0f;
    for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) ss += xr[i] * xr[i];
    ss = block_sum(ss, partial);
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    /* Every thread has its sum before any writes out (out may alias x, but
     * each element is read and written by the same thread). */
    __nv_bfloat16 *ob = obf ? obf + (int64_t)blockIdx.x * n : NULL;
    for (int32_t i = threadIdx.x; i < n; i += NORM_THREADS) {
        const float y = xr[i] * scale * g[i];
        o[i] = y;
        if (ob) bf16_copy_put(ob, split_off, i, y, split_off != 0);
    }
}

/* The same op with the row held in registers: one read of x (and res),
 * 16-byte accesses. For rows of n % 4 == 0 up to 4 * VPT * NORM_THREADS
 * floats, 16-byte aligned. The few rows of a query or decode step leave
 * most of the GPU idle, so what a row costs is its latency: one pass
 * instead of three. */
template <int VPT>
static __global__ void rmsnorm_vec_kernel(float *out, float *x, const float *res, const float *g,
                                          int32_t n, float eps, __nv_bfloat16 *obf,
                                          int64_t split_off) {
    __shared__ float partial[NORM_THREADS / 32];
    pdl_wait();
    const int32_t n4 = n >> 2;
    float4 *xr = (float4 *)(x + (int64_t)blockIdx.x * n);
    const float4 *rr = res ? (const float4 *)(res + (int64_t)blockIdx.x * n) : NULL;
    const float4 *g4 = (const float4 *)g;
    float4 v[VPT], gv[VPT];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        const int32_t i = threadIdx.x + j * NORM_THREADS;
        if (i < n4) {
            gv[j] = g4[i]; /* read with the row, not after the sum: one memory round trip */
            float4 a = xr[i];
            if (rr) {
                const float4 b = rr[i];
                a.x += b.x;
                a.y += b.y;
                a.z += b.z;
                a.w += b.w;
                xr[i] = a;
            }
            v[j] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    ss = block_sum(ss, partial);
    const float scale = 1.0f / sqrtf(ss / (float)n + eps);
    float4 *o = (float4 *)(out + (int64_t)blockIdx.x * n);
    __nv_bfloat16 *ob = obf ? obf + (int64_t)blockIdx.x * n : NULL;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
        const int32_t i = threadIdx.x + j * NORM_THREADS;
        if (i < n4) {
            const float4 gg = gv[j];
            const float4 y = make_float4(v[j].x * scale * gg.x, v[j].y * scale * gg.y,
                                         v[j].z * scale * gg.z, v[j].w * scale * gg.w);
            o[i] = y;
            if (ob) {
                const __nv_bfloat162 h0 = __floats2bfloat162_rn(y.x, y.y);
                const __nv_bfloat162 h1 = __floats2bfloat162_rn(y.z, y.w);
                ((__nv_bfloat162 *)ob)[2 * i] = h0;
                ((__nv_bfloat162 *)ob)[2 * i + 1] = h1;
                if (split_off) {
                    __nv_bfloat162 *ol = (__nv_bfloat162 *)(ob + split_off);
                    ol[2 * i] =
                        __floats2bfloat162_rn(y.x - __low2float(h0), y.y - __high2float(h0));
                    ol[2 * i + 1] =
                        __floats2bfloat162_rn(y.z - __low2float(h1), y.w - __high2float(h1));
                }
            }
        }
    }
}

is_status cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *g, int32_t T,
                       int32_t n, float eps, __nv_bfloat16 *obf, bool split, bool pdl) {
    /* Without res the kernel only reads x. */
    return cuda_add_rmsnorm(s, out, (float *)x, NULL, g, T, n, eps, obf, split, pdl);
}

is_status cuda_add_rmsnorm(cudaStream_t s, float *out, float *x, const float *res, const float *g,
                           int32_t T, int32_t n, float eps, __nv_bfloat16 *obf, bool split,
                           bool pdl) {
    if (T <= 0 || n <= 0) return IS_OK;
    const int64_t split_off = obf && split ? (int64_t)T * n : 0;
    const int32_t per = (n / 4 + NORM_THREADS - 1) / NORM_THREADS; /* float4s a thread */
    const bool vec = n % 4 == 0 && per <= 8 && cuda_aligned16(out) && cuda_aligned16(x) &&
                     (!res || cuda_aligned16(res)) && cuda_aligned16(g) &&
                     ((uintptr_t)obf & 7) == 0;
    void (*k)(float *, float *, const float *, const float *, int32_t, float, __nv_bfloat16 *,
              int64_t) = !vec       ? rmsnorm_kernel
                         : per <= 1 ? rmsnorm_vec_kernel<1>
                         : per <= 2 ? rmsnorm_vec_kernel<2>
                         : per <= 4 ? rmsnorm_vec_kernel<4>
                                    : rmsnorm_vec_kernel<8>;
    CUDA_CHECK(cuda_launch_dependent(k, dim3((unsigned)T), dim3(NORM_THREADS), 0, s, pdl, out, x,
                                     res, g, n, eps, obf, split_off));
    return IS_OK;
}

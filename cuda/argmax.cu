/*
 * argmax: see argmax.cuh. A block scans a row: each thread keeps the best
 * of its elements in ascending index order (a later equal value does not
 * replace it, a NaN compares false and is skipped), then the block keeps
 * the larger value, the lower index on a tie.
 */
#include "argmax.cuh"

#include <math.h>

#define ARGMAX_THREADS 1024

/* (v, i) better than (bv, bi): larger, or equal at a lower index. */
static __device__ __forceinline__ bool argmax_better(float v, int32_t i, float bv, int32_t bi) {
    return v > bv || (v == bv && i < bi);
}

/* The best (bv, bi) of the warp's lanes, in every lane. */
static __device__ __forceinline__ void warp_best(float &bv, int32_t &bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (argmax_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

template <bool VEC>
static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_kernel(int32_t *out, const float *x, int32_t n) {
    const float *row = x + (size_t)blockIdx.x * n;
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    int32_t tail = 0;
    if (VEC) {
        /* 16-byte loads (n % 4 == 0 and x aligned: the host checks). */
        const int32_t n4 = n / 4;
        for (int32_t j = threadIdx.x; j < n4; j += ARGMAX_THREADS) {
            const float4 q = reinterpret_cast<const float4 *>(row)[j];
            const float e[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (e[k] > bv) {
                    bv = e[k];
                    bi = 4 * j + k;
                }
        }
        tail = 4 * n4;
    }
    for (int32_t i = tail + (int32_t)threadIdx.x; i < n; i += ARGMAX_THREADS)
        if (row[i] > bv) {
            bv = row[i];
            bi = i;
        }
    /* The warp's best, then the block's. */
    warp_best(bv, bi);
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int32_t si[ARGMAX_THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane];
        bi = si[lane];
        warp_best(bv, bi);
        if (lane == 0) out[blockIdx.x] = bv == -INFINITY ? 0 : bi;
    }
}

is_status cuda_argmax_rows(cudaStream_t s, int32_t *out, const float *x, int32_t rows, int32_t n) {
    if (rows <= 0 || n <= 0) return IS_OK;
    static_assert(ARGMAX_THREADS / 32 == 32, "the block's second step is one warp");
    if (n % 4 == 0 && cuda_aligned16(x))
        argmax_kernel<true><<<(unsigned)rows, ARGMAX_THREADS, 0, s>>>(out, x, n);
    else argmax_kernel<false><<<(unsigned)rows, ARGMAX_THREADS, 0, s>>>(out, x, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

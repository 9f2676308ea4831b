/*
 * norm: RMSNorm over rows, out[t][i] = x[t][i] / rms(x[t]) * g[i], with the
 * CPU reference's formula (scale = 1 / sqrtf(mean(x^2) + eps)); only the
 * order of the f32 sum of squares differs (a tree here, a loop there).
 */
#ifndef IS_CUDA_NORM_CUH
#define IS_CUDA_NORM_CUH

#include "common.cuh"

/* out, x: [T][n] (may alias); g: [n] f32. */
is_status cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *g, int32_t T,
                       int32_t n, float eps);

#endif

/*
 * norm: RMSNorm over rows, out[t][i] = x[t][i] / rms(x[t]) * g[i], with the
 * CPU reference's formula (scale = 1 / sqrtf(mean(x^2) + eps)); only the
 * order of the f32 sum of squares differs (a tree here, a loop there).
 */
#ifndef IS_CUDA_NORM_CUH
#define IS_CUDA_NORM_CUH

#include "common.cuh"

/* out, x: [T][n] (may alias); g: [n] f32. With obf, the same rows also go
 * to obf in bf16 (the next matrix product's input, saving its conversion
 * pass): rounded to nearest even, or when split as hi = bf16(y) in
 * obf[0, T*n) and lo = bf16(y - hi) in obf[T*n, 2*T*n) (cuda_f32_to_bf16_split's
 * layout). pdl: launched as a programmatic dependent (common.cuh). */
is_status cuda_rmsnorm(cudaStream_t s, float *out, const float *x, const float *g, int32_t T,
                       int32_t n, float eps, __nv_bfloat16 *obf, bool split, bool pdl);

/* x += res, then cuda_rmsnorm(out, x): the residual add and the next norm in
 * one launch (64 launches fewer a forward of a 32-layer model). res and out
 * may alias (each element is read before any is written); x may not alias
 * either. res NULL: cuda_rmsnorm. */
is_status cuda_add_rmsnorm(cudaStream_t s, float *out, float *x, const float *res, const float *g,
                           int32_t T, int32_t n, float eps, __nv_bfloat16 *obf, bool split,
                           bool pdl);

#endif

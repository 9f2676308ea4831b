/*
 * rope: rotary position embedding in place, reading a cos/sin table that the
 * backend builds on the host exactly as the CPU reference does (f32 inverse
 * frequencies, the angle and its cos/sin in double, rounded to f32), so both
 * backends rotate by bit-identical factors; only the f32 multiply-adds of
 * the rotation itself may round differently (fused on the GPU).
 */
#ifndef IS_CUDA_ROPE_CUH
#define IS_CUDA_ROPE_CUH

#include "common.cuh"

/* Rotates x[T][n_heads][head_dim] in place. pos: [T] device, any sign
 * (negative p uses cos(-a) = cos a, sin(-a) = -sin a); cs: device table
 * [n_pos][n_rot/2][cos, sin] with n_pos > max |pos|. neox selects the
 * rotate-halves layout (x[i], x[i + n_rot/2]), else adjacent pairs. */
is_status cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                    int32_t head_dim, int32_t n_rot, bool neox, const float *cs);

#endif

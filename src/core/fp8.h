/*
 * fp8: the OCP fp8 e4m3 ("e4m3fn") element type of compressed fact KV, and
 * the per-row scales that go with it.
 *
 * e4m3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
 * infinities; S.1111.111 is NaN, so the largest finite value is 448
 * (S.1111.110). Subnormals are m * 2^-9 (exponent field 0). Each value has
 * at most 4 significant bits, so a relative error of at most 2^-4 after
 * rounding.
 *
 * Conversion from f32 is exactly specified, as CUDA's __nv_fp8_e4m3(float)
 * (cvt.rn.satfinite.e4m3x2.f32) does it: round to nearest, ties to even;
 * anything whose magnitude exceeds 448, infinities included, saturates to
 * +-448; NaN gives 0x7F; the sign of a zero result is kept.
 * tests/core/test_fp8.c checks it against a reference script's table and
 * tests/cuda/test_fp8_cuda.cu against the GPU, bit for bit.
 *
 * Scales: a row (one KV head of one token of one layer: head_dim values)
 * is stored as codes of x / s with s = 2^e, the smallest power of two (e >=
 * -126) with max|x| <= 464 s (464: the largest magnitude that still rounds
 * to 448, not past it). A power of two rather than max|x| / 448 because
 * then decoding (code value * s) is exact in f32, and encoding the decoded
 * row again gives the same codes and scale (its largest code is then at
 * least 240, so half the scale would overflow): a record in fp8 and a GPU
 * cache in fp8 hold the same bytes, whichever tier converted them. For a
 * floating-point element type the scale only sets the range, so a power of
 * two costs nothing but (at most) one binade at the bottom of the
 * subnormals.
 *
 * The scale rule is plain integer arithmetic on the f32 bits, in line here
 * so the CUDA kernels use the same expression (FP8_HD marks it for both).
 *
 * Threads: pure functions.
 */
#ifndef IS_KV_FP8_H
#define IS_KV_FP8_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define FP8_HD __host__ __device__
#else
#define FP8_HD
#endif

#define FP8_E4M3_MAX 448.0f
#define FP8_E4M3_NAN 0x7F /* the NaN the conversion gives */

/* f32 -> e4m3 code (rules above). */
uint8_t fp8_e4m3_from_f32(float x);

/* e4m3 code -> f32, exact; 0x7F and 0xFF give a quiet NaN (0x7FFFFFFF). */
float fp8_e4m3_to_f32(uint8_t code);

/* The row scale for a row whose largest magnitude is amax: 2^e, the
 * smallest power of two with e >= -126 and amax <= 464 * 2^e; 1 when amax
 * is 0, NaN or infinite (a row of zeros, or one that saturates anyway). */
static inline FP8_HD float fp8_scale_for_amax(float amax) {
    uint32_t u;
    memcpy(&u, &amax, 4);
    u &= 0x7FFFFFFFu;
    if (u == 0 || u >= 0x7F800000u) return 1.0f;
    const int32_t eb = (int32_t)(u >> 23); /* biased exponent, 0: subnormal */
    /* amax in [2^(eb-127), 2^(eb-126)); 464 * 2^(eb-135) = 1.8125 *
     * 2^(eb-127), enough unless amax's significand passes 1.8125. */
    int32_t e = eb - 135 + ((u & 0x7FFFFFu) > 0x680000u ? 1 : 0);
    if (eb == 0 || e < -126) e = -126;
    const uint32_t s = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &s, 4);
    return f;
}

/* The inverse of a scale from fp8_scale_for_amax: 2^-e, exact. */
static inline FP8_HD float fp8_scale_inverse(float scale) {
    uint32_t u;
    memcpy(&u, &scale, 4);
    const uint32_t inv = (uint32_t)(254 - (int32_t)(u >> 23)) << 23;
    float f;
    memcpy(&f, &inv, 4);
    return f;
}

/* Quantises n_rows rows of row_len f32 values (x [n_rows][row_len]) into
 * codes [n_rows][row_len] and scales [n_rows] (rules above). */
void fp8_quantize_rows(const float *x, size_t n_rows, size_t row_len, uint8_t *codes,
                       float *scales);

/* The inverse: out[r][i] = fp8_e4m3_to_f32(codes[r][i]) * scales[r]. */
void fp8_dequantize_rows(const uint8_t *codes, const float *scales, size_t n_rows, size_t row_len,
                         float *out);

#endif

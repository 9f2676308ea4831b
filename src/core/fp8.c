/*
 * fp8: e4m3 conversions and row quantisation (see fp8.h), in integer
 * arithmetic on the f32 bits so that the result does not depend on the
 * compiler's or the CPU's floating-point settings.
 */
#include "core/fp8.h"

#include <math.h>

uint8_t fp8_e4m3_from_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return FP8_E4M3_NAN;
    if (a >= 0x43E00000u) return sign | 0x7E; /* >= 448 (and infinities): saturate */
    const int32_t eb = (int32_t)(a >> 23);    /* f32 biased exponent */
    const uint32_t sig =
        (a & 0x7FFFFFu) | (eb ? 0x800000u : 0); /* value = sig * 2^(max(eb,1) - 150) */
    if (eb < 121) {
        /* Below e4m3's smallest normal (2^-6): the code is the value in
         * units of 2^-9, rounded to an integer (0..8; 8 is the smallest
         * normal, whose code is 8 too). */
        const int32_t shift = 141 - (eb ? eb : 1); /* value * 2^9 = sig * 2^-shift */
        if (shift >= 25) return sign;              /* below 2^-11: rounds to zero */
        uint32_t q = sig >> shift;
        const uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return sign | (uint8_t)q;
    }
    /* Normal: keep 3 of f32's 23 mantissa bits, round the other 20. */
    uint32_t q = a >> 20; /* exponent and top 3 mantissa bits */
    const uint32_t rem = a & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1))) q++; /* a carry bumps the exponent */
    /* Rebias the exponent: f32 127 -> e4m3 7, i.e. subtract 120 << 3. */
    q -= 120u << 3;
    if (q > 0x7E) q = 0x7E; /* rounded up past 448 */
    return sign | (uint8_t)q;
}

float fp8_e4m3_to_f32(uint8_t code) {
    const uint32_t e = (code >> 3) & 15u, m = code & 7u;
    uint32_t u;
    if (e == 15 && m == 7) {
        u = 0x7FFFFFFFu;
    } else {
        float v = e ? ldexpf((float)(8 + m), (int)e - 10) : ldexpf((float)m, -9);
        memcpy(&u, &v, 4);
        u |= (uint32_t)(code & 0x80u) << 24;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void fp8_quantize_rows(const float *x, size_t n_rows, size_t row_len, uint8_t *codes,
                       float *scales) {
    for (size_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * row_len;
        float amax = 0;
        for (size_t i = 0; i < row_len; i++) amax = fmaxf(amax, fabsf(xr[i]));
        const float s = fp8_scale_for_amax(amax), inv = fp8_scale_inverse(s);
        scales[r] = s;
        uint8_t *cr = codes + r * row_len;
        for (size_t i = 0; i < row_len; i++) cr[i] = fp8_e4m3_from_f32(xr[i] * inv);
    }
}

void fp8_dequantize_rows(const uint8_t *codes, const float *scales, size_t n_rows, size_t row_len,
                         float *out) {
    /* The 256 values once, so the loop is a lookup and a product. */
    float table[256];
    for (int c = 0; c < 256; c++) table[c] = fp8_e4m3_to_f32((uint8_t)c);
    for (size_t r = 0; r < n_rows; r++) {
        const float s = scales[r];
        const uint8_t *cr = codes + r * row_len;
        float *o = out + r * row_len;
        for (size_t i = 0; i < row_len; i++) o[i] = table[cr[i]] * s;
    }
}

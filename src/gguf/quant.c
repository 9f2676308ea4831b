/*
 * quant: dequantisation of GGUF element types to f32 (see quant.h).
 *
 * Each block kernel follows ggml's dequantize_row_* element order exactly.
 * Block layouts (little-endian, packed, no padding; f16 = IEEE half):
 *
 *   Q4_0 (32 values, 18 B)  f16 d | u8 qs[16]
 *        y[j] = ((qs[j] & 15) - 8) * d, y[j+16] = ((qs[j] >> 4) - 8) * d
 *   Q4_1 (32, 20 B)         f16 d | f16 m | u8 qs[16]
 *        y[j] = (qs[j] & 15) * d + m,   y[j+16] = (qs[j] >> 4) * d + m
 *   Q5_0 (32, 22 B)         f16 d | u32 qh | u8 qs[16]; bit j of qh is the
 *        fifth bit of value j: y = (q5 - 16) * d
 *   Q5_1 (32, 24 B)         f16 d | f16 m | u32 qh | u8 qs[16]: y = q5 * d + m
 *   Q8_0 (32, 34 B)         f16 d | i8 qs[32]: y = qs * d
 *   Q4_K (256, 144 B)       f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *        eight sub-blocks of 32 with 6-bit scale sc and min m (packed, see
 *        scale_min_k4); each 32 bytes of qs hold sub-block 2i in the low
 *        nibbles and 2i+1 in the high ones: y = d*sc * q - dmin*m
 *   Q5_K (256, 176 B)       f16 d | f16 dmin | u8 scales[12] | u8 qh[32] |
 *        u8 qs[128]; as Q4_K, plus bit s of qh[l] is the fifth bit of value
 *        l of sub-block s
 *   Q6_K (256, 210 B)       u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d;
 *        two halves of 128 values; in each, value l + 32k (l < 32, k < 4)
 *        takes a nibble of ql (k = 0,1 low nibbles of ql[l], ql[l+32];
 *        k = 2,3 high nibbles) and bits 2k..2k+1 of qh[l], minus 32, times
 *        d * scales[16-value group]
 */
#include "gguf/quant.h"

#include "core/status.h"
#include "gguf/tensor_type.h"

#include <string.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define QUANT_HAVE_F16C 1
#endif

#define QK   32  /* values per block of the legacy types */
#define QK_K 256 /* values per K-quant super-block */

/* ---- scalar conversions ------------------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float quant_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) /* inf, or NaN made quiet */
        return f32_from_bits(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0));
    if (exp != 0) /* normal: rebias 15 -> 127 */
        return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
    if (mant == 0) return f32_from_bits(sign);
    /* subnormal mant * 2^-24: shift the leading one up to the hidden bit */
    uint32_t e = 113;
    while (!(mant & 0x400u)) {
        mant <<= 1;
        e--;
    }
    return f32_from_bits(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

uint16_t quant_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    if (x >= 0x477ff000u) /* >= 65520 (halfway to 2^16) rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (x >= 0x38800000u) { /* normal half: round the 13 dropped bits */
        x += 0xfffu + ((x >> 13) & 1u);
        return (uint16_t)(sign | ((x - 0x38000000u) >> 13));
    }
    if (x <= 0x33000000u) /* <= 2^-25: ties to even give zero */
        return sign;
    /* subnormal half: value / 2^-24 = mant24 * 2^(exp - 126) */
    uint32_t exp = x >> 23;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp; /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++; /* may carry into 0x400 */
    return (uint16_t)(sign | q);
}

float quant_bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

uint16_t quant_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

void quant_f32_to_f16_row(const float *src, void *dst, size_t n) {
    uint8_t *d = dst;
    size_t i = 0;
#ifdef QUANT_HAVE_F16C
    /* VCVTPS2PH rounds to nearest even, overflows to inf, gives f32
     * subnormals (all below f16's range) signed zero and keeps a NaN's
     * top payload bits with the quiet bit set: the scalar rules above,
     * checked over every f32 bit pattern by test_quant. */
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(d + 2 * i), h);
    }
#endif
    for (; i < n; i++) {
        uint16_t h = quant_f32_to_f16(src[i]);
        memcpy(d + 2 * i, &h, 2);
    }
}

void quant_f32_to_bf16_row(const float *src, void *dst, size_t n) {
    uint8_t *d = dst;
    /* quant_f32_to_bf16 written without branches (a select for NaN) and
     * through a local block, so the compiler vectorises it. */
    for (size_t i = 0; i < n; i += 64) {
        size_t m = n - i < 64 ? n - i : 64;
        uint32_t x[64];
        uint16_t out[64];
        memcpy(x, src + i, m * sizeof(float));
        for (size_t j = 0; j < m; j++) {
            uint32_t r = (x[j] + 0x7fffu + ((x[j] >> 16) & 1u)) >> 16;
            uint32_t q = (x[j] >> 16) | 0x40u;
            out[j] = (uint16_t)((x[j] & 0x7fffffffu) > 0x7f800000u ? q : r);
        }
        memcpy(d + 2 * i, out, m * sizeof(uint16_t));
    }
}

/* ---- block kernels --------------------------------------------------------- */

static inline float load_f16(const uint8_t *p) {
    return quant_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

static void deq_f32(const uint8_t *src, float *restrict y, int64_t n) {
    memcpy(y, src, (size_t)n * sizeof(float));
}

static void deq_f16(const uint8_t *src, float *restrict y, int64_t n) {
    int64_t i = 0;
#ifdef QUANT_HAVE_F16C
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) y[i] = load_f16(src + 2 * i);
}

static void deq_bf16(const uint8_t *src, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, src + 2 * i, 2);
        y[i] = quant_bf16_to_f32(b);
    }
}

static void deq_q4_0(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((int32_t)(qs[j] & 0x0f) - 8) * d;
        y[j + QK / 2] = (float)((int32_t)(qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b), m = load_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)(qs[j] & 0x0f) * d + m;
        y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
    }
}

static void deq_q5_0(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        int32_t lo = (qs[j] & 0x0f) | (int32_t)(((qh >> j) & 1u) << 4);
        int32_t hi = (qs[j] >> 4) | (int32_t)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)(lo - 16) * d;
        y[j + QK / 2] = (float)(hi - 16) * d;
    }
}

static void deq_q5_1(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b), m = load_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        int32_t lo = (qs[j] & 0x0f) | (int32_t)(((qh >> j) & 1u) << 4);
        int32_t hi = (qs[j] >> 4) | (int32_t)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)lo * d + m;
        y[j + QK / 2] = (float)hi * d + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) y[j] = (float)qs[j] * d;
}

/* The 12 scale bytes of Q4_K/Q5_K hold eight 6-bit (scale, min) pairs:
 * sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scale) and 4..7 (min);
 * sub-blocks 4..7 in the nibbles of bytes 8..11 (scale low, min high) with
 * their top two bits in the spare top bits of bytes 0..3 (scale) and 4..7
 * (min). Same as ggml's get_scale_min_k4. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void deq_q4_k(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b), dmin = load_f16(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int p = 0; p < 4; p++) { /* pairs of sub-blocks sharing 32 bytes */
        uint8_t sc, m;
        scale_min_k4(2 * p, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * p + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        const uint8_t *q = qs + 32 * p;
        float *yp = y + 64 * p;
        for (int l = 0; l < 32; l++) {
            yp[l] = d1 * (float)(q[l] & 0x0f) - m1;
            yp[l + 32] = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static void deq_q5_k(const uint8_t *b, float *restrict y) {
    const float d = load_f16(b), dmin = load_f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int p = 0; p < 4; p++) {
        uint8_t sc, m;
        scale_min_k4(2 * p, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * p + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        const uint8_t *q = qs + 32 * p;
        const int s1 = 2 * p, s2 = 2 * p + 1; /* bit of qh for each half */
        float *yp = y + 64 * p;
        for (int l = 0; l < 32; l++) {
            int32_t lo = (q[l] & 0x0f) | (((qh[l] >> s1) & 1) << 4);
            int32_t hi = (q[l] >> 4) | (((qh[l] >> s2) & 1) << 4);
            yp[l] = d1 * (float)lo - m1;
            yp[l + 32] = d2 * (float)hi - m2;
        }
    }
}

static void deq_q6_k(const uint8_t *b, float *restrict y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = load_f16(b + 208);
    for (int h = 0; h < 2; h++) { /* halves of 128 values */
        float ds[8];              /* d * scale for the eight 16-value groups of this half */
        for (int g = 0; g < 8; g++) ds[g] = d * (float)sc[g];
        for (int l = 0; l < 32; l++) {
            const int g = l / 16;
            int32_t q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int32_t q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int32_t q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int32_t q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = ds[g] * (float)q1;
            y[l + 32] = ds[g + 2] * (float)q2;
            y[l + 64] = ds[g + 4] * (float)q3;
            y[l + 96] = ds[g + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* ---- rows ------------------------------------------------------------------- */

/* A row loop per type, so that the block kernel is inlined into it. */
typedef void (*row_fn)(const uint8_t *src, float *restrict y, int64_t n_blocks);

#define ROW_FN(name, kernel, bytes, elems)                                                         \
    static void name(const uint8_t *src, float *restrict y, int64_t nb) {                          \
        for (int64_t i = 0; i < nb; i++) kernel(src + i * (bytes), y + i * (elems));               \
    }
ROW_FN(row_q4_0, deq_q4_0, 18, QK)
ROW_FN(row_q4_1, deq_q4_1, 20, QK)
ROW_FN(row_q5_0, deq_q5_0, 22, QK)
ROW_FN(row_q5_1, deq_q5_1, 24, QK)
ROW_FN(row_q8_0, deq_q8_0, 34, QK)
ROW_FN(row_q4_k, deq_q4_k, 144, QK_K)
ROW_FN(row_q5_k, deq_q5_k, 176, QK_K)
ROW_FN(row_q6_k, deq_q6_k, 210, QK_K)
#undef ROW_FN

/* The quantised types we read, with the block size each kernel assumes. */
typedef struct row_kernel {
    uint32_t type;
    row_fn fn;
    uint32_t block_bytes;
} row_kernel;

static const row_kernel row_kernels[] = {
    {TENSOR_TYPE_Q4_0, row_q4_0, 18},  {TENSOR_TYPE_Q4_1, row_q4_1, 20},
    {TENSOR_TYPE_Q5_0, row_q5_0, 22},  {TENSOR_TYPE_Q5_1, row_q5_1, 24},
    {TENSOR_TYPE_Q8_0, row_q8_0, 34},  {TENSOR_TYPE_Q4_K, row_q4_k, 144},
    {TENSOR_TYPE_Q5_K, row_q5_k, 176}, {TENSOR_TYPE_Q6_K, row_q6_k, 210},
};

static const row_kernel *row_kernel_find(uint32_t type) {
    for (size_t i = 0; i < sizeof row_kernels / sizeof row_kernels[0]; i++)
        if (row_kernels[i].type == type) return &row_kernels[i];
    return NULL;
}

bool quant_can_dequantize(uint32_t type) {
    return type == TENSOR_TYPE_F32 || type == TENSOR_TYPE_F16 || type == TENSOR_TYPE_BF16 ||
           row_kernel_find(type) != NULL;
}

is_status quant_dequantize(uint32_t type, const void *src, float *dst, int64_t n) {
    const tensor_type_info *info = tensor_type_get(type);
    if (info == NULL || !quant_can_dequantize(type))
        return is_error_set(IS_ERR_UNSUPPORTED, "dequantize: tensor type %u (%s) is not supported",
                            type, info ? info->name : "unknown");
    if (n < 0 || n % info->block_elems != 0)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "dequantize: %lld values is not a whole number of %s blocks of %u",
                            (long long)n, info->name, info->block_elems);
    if (n == 0) return IS_OK;
    if (src == NULL || dst == NULL)
        return is_error_set(IS_ERR_INVALID_ARG, "dequantize: NULL buffer");

    const uint8_t *s = src;
    switch (type) {
    case TENSOR_TYPE_F32: deq_f32(s, dst, n); return IS_OK;
    case TENSOR_TYPE_F16: deq_f16(s, dst, n); return IS_OK;
    case TENSOR_TYPE_BF16: deq_bf16(s, dst, n); return IS_OK;
    default: break;
    }
    const row_kernel *k = row_kernel_find(type);
    IS_ASSERT(k != NULL && k->block_bytes == info->block_bytes); /* tables agree */
    k->fn(s, dst, n / info->block_elems);
    return IS_OK;
}

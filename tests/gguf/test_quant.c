/*
 * test_quant: dequantisation of every type we read, checked three ways:
 *   - f16/bf16 conversions against ldexp/nearbyint reference formulas
 *     (exhaustive over the 65536 narrow values, ties at every position);
 *   - hand-built blocks whose expected values are written out from the
 *     format description (packing done here, element by element);
 *   - golden files from tools/make_quant_golden.py (Python gguf reference),
 *     compared bit for bit.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/tensor_type.h"
#include "gguf/quant.h"

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Bitwise equality of two float arrays, reporting the first difference. */
static void assert_floats_bitwise(const float *got, const float *want, int64_t n,
                                  const char *what) {
    for (int64_t i = 0; i < n; i++) {
        if (bits_of(got[i]) != bits_of(want[i])) {
            print_error("%s: value %lld: got %.9g (0x%08x), want %.9g (0x%08x)\n", what,
                        (long long)i, got[i], bits_of(got[i]), want[i], bits_of(want[i]));
            fail();
        }
    }
}

static void put_f16(uint8_t *p, uint16_t h) {
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* ---- f16 / bf16 ------------------------------------------------------------ */

/* Value of a half by its definition; NaN for NaNs. */
static double ref_f16_value(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0) v = ldexp(m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* Value of a float rounded to `mant_bits` explicit mantissa bits, minimum
 * normal exponent `emin`, ties to even (the FPU's default rounding), as a
 * double; the caller checks overflow. */
static double ref_round(double a, int mant_bits, int emin) {
    if (a == 0) return a;
    int e;
    frexp(fabs(a), &e); /* |a| = f * 2^e, f in [0.5, 1): leading bit 2^(e-1) */
    int qe = (e - 1 < emin ? emin : e - 1) - mant_bits;
    return ldexp(nearbyint(ldexp(a, -qe)), qe);
}

static void test_f16_to_f32_exhaustive(void **state) {
    (void)state;
    static uint16_t all[65536];
    static float row[65536];
    for (uint32_t h = 0; h < 65536; h++) {
        all[h] = (uint16_t)h;
        float got = quant_f16_to_f32((uint16_t)h);
        double want = ref_f16_value((uint16_t)h);
        if (isnan(want)) {
            /* quiet NaN, same sign, payload shifted up 13 bits */
            uint32_t b = bits_of(got);
            assert_true(isnan(got));
            assert_int_equal(b >> 31, h >> 15);
            assert_int_equal(b & 0x1fff, 0);
            assert_int_equal((b >> 13) & 0x3ff, (h & 0x3ff) | 0x200);
        } else {
            assert_int_equal(bits_of(got), bits_of((float)want)); /* exact, -0 too */
        }
    }
    /* the row path (F16C when compiled in) agrees bit for bit, NaNs included */
    assert_int_equal(quant_dequantize(TENSOR_TYPE_F16, all, row, 65536), IS_OK);
    for (uint32_t h = 0; h < 65536; h++)
        assert_int_equal(bits_of(row[h]), bits_of(quant_f16_to_f32((uint16_t)h)));
    /* and on odd lengths and unaligned input (the scalar tail) */
    uint8_t *buf = malloc(2 * 37 + 1);
    float out[37];
    memcpy(buf + 1, all + 0x7bf0, 2 * 37);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_F16, buf + 1, out, 37), IS_OK);
    for (int i = 0; i < 37; i++)
        assert_int_equal(bits_of(out[i]), bits_of(quant_f16_to_f32((uint16_t)(0x7bf0 + i))));
    free(buf);
}

/* Checks quant_f32_to_f16(f) against the reference rounding. */
static void check_f32_to_f16(float f) {
    uint16_t h = quant_f32_to_f16(f);
    if (isnan(f)) {
        assert_int_equal(h & 0x7e00, 0x7e00); /* quiet NaN */
        assert_int_equal(h >> 15, bits_of(f) >> 31);
        return;
    }
    double want = ref_round(f, 10, -14);
    if (fabs(want) >= 65536.0) want = copysign(INFINITY, f); /* overflow */
    float got = quant_f16_to_f32(h);
    if (bits_of(got) != bits_of((float)want)) {
        print_error("f32_to_f16(%.9g = 0x%08x) = 0x%04x (%.9g), want %.9g\n", f, bits_of(f), h, got,
                    want);
        fail();
    }
}

static void test_f32_to_f16(void **state) {
    (void)state;
    /* every half round-trips */
    for (uint32_t h = 0; h < 65536; h++) {
        if (isnan(ref_f16_value((uint16_t)h))) continue;
        assert_int_equal(quant_f32_to_f16(quant_f16_to_f32((uint16_t)h)), h);
    }
    /* ties and near-ties between every pair of neighbouring halves, both signs */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        for (int s = 0; s < 2; s++) {
            uint16_t a = (uint16_t)(h | (s << 15));
            double lo = ref_f16_value(a);
            double hi =
                (h + 1 == 0x7c00) ? copysign(65536.0, lo) : ref_f16_value((uint16_t)(a + 1));
            float mid = (float)((lo + hi) / 2); /* exact: needs 12 bits */
            assert_true((double)mid == (lo + hi) / 2);
            check_f32_to_f16(mid);
            check_f32_to_f16(nextafterf(mid, INFINITY));
            check_f32_to_f16(nextafterf(mid, -INFINITY));
        }
    }
    /* every sign/exponent/top-mantissa pattern with assorted low bits */
    const uint32_t lows[] = {0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff};
    uint64_t rnd = 0x9e3779b97f4a7c15ull;
    for (uint32_t top = 0; top < (1u << 19); top++) {
        for (size_t k = 0; k < sizeof lows / sizeof lows[0]; k++)
            check_f32_to_f16(float_of((top << 13) | lows[k]));
        rnd = rnd * 6364136223846793005ull + 1442695040888963407ull;
        check_f32_to_f16(float_of((top << 13) | (uint32_t)(rnd >> 51)));
    }
    /* named cases */
    assert_int_equal(quant_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(quant_f32_to_f16(nextafterf(65520.0f, 0)), 0x7bff);
    assert_int_equal(quant_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(quant_f32_to_f16(-1e30f), 0xfc00);
    assert_int_equal(quant_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(quant_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(quant_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(quant_f32_to_f16(ldexpf(1, -25)), 0x0000); /* tie -> even 0 */
    assert_int_equal(quant_f32_to_f16(nextafterf(ldexpf(1, -25), 1)), 0x0001);
    assert_int_equal(quant_f32_to_f16(ldexpf(3, -25)), 0x0002);        /* 1.5 ulp -> 2 */
    assert_int_equal(quant_f32_to_f16(ldexpf(5, -25)), 0x0002);        /* 2.5 ulp -> 2 */
    assert_int_equal(quant_f32_to_f16(ldexpf(2047, -25)), 0x0400);     /* up to min normal */
    assert_int_equal(quant_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00); /* tie -> even */
    assert_int_equal(quant_f32_to_f16(1.0f + ldexpf(3, -11)), 0x3c02);
    assert_int_equal(quant_f32_to_f16(NAN) & 0x7e00, 0x7e00);
}

static double ref_bf16_value(uint16_t b) {
    int e = (b >> 7) & 0xff, m = b & 0x7f;
    double v;
    if (e == 0) v = ldexp(m, -133);
    else if (e == 255) v = m ? NAN : INFINITY;
    else v = ldexp(128 + m, e - 134);
    return (b & 0x8000) ? -v : v;
}

static void check_f32_to_bf16(float f) {
    uint16_t b = quant_f32_to_bf16(f);
    if (isnan(f)) {
        assert_int_equal(b, (bits_of(f) >> 16) | 0x40); /* quiet, payload kept */
        return;
    }
    double want = ref_round(f, 7, -126);
    if (fabs(want) > FLT_MAX) want = copysign(INFINITY, f);
    float got = quant_bf16_to_f32(b);
    if (bits_of(got) != bits_of((float)want)) {
        print_error("f32_to_bf16(%.9g = 0x%08x) = 0x%04x, want %.9g\n", f, bits_of(f), b, want);
        fail();
    }
}

/* The row conversions give exactly the scalar ones' bits for every f32
 * bit pattern, at every offset of the vector loop and its scalar tail
 * (blocks of 8189 values: not a multiple of any vector width) and with an
 * odd destination address. */
static void test_rows_exhaustive(void **state) {
    (void)state;
    enum { BLOCK = 8189 };
    static float src[BLOCK];
    static uint16_t want_h[BLOCK], want_b[BLOCK];
    static uint8_t got_h[2 * BLOCK + 1], got_b[2 * BLOCK + 1];
    uint64_t bad_h = 0, bad_b = 0;
    for (uint64_t x0 = 0; x0 <= UINT32_MAX; x0 += BLOCK) {
        size_t m = UINT32_MAX - x0 + 1 < BLOCK ? (size_t)(UINT32_MAX - x0 + 1) : BLOCK;
        for (size_t j = 0; j < m; j++) {
            uint32_t x = (uint32_t)(x0 + j);
            memcpy(&src[j], &x, 4);
            want_h[j] = quant_f32_to_f16(src[j]);
            want_b[j] = quant_f32_to_bf16(src[j]);
        }
        quant_f32_to_f16_row(src, got_h + 1, m);
        quant_f32_to_bf16_row(src, got_b + 1, m);
        bad_h += memcmp(want_h, got_h + 1, 2 * m) != 0;
        bad_b += memcmp(want_b, got_b + 1, 2 * m) != 0;
    }
    assert_int_equal(bad_h, 0);
    assert_int_equal(bad_b, 0);
    /* n = 0 writes nothing */
    got_h[1] = 0xab;
    quant_f32_to_f16_row(src, got_h + 1, 0);
    quant_f32_to_bf16_row(src, got_h + 1, 0);
    assert_int_equal(got_h[1], 0xab);
}

static void test_bf16(void **state) {
    (void)state;
    static uint16_t all[65536];
    static float row[65536];
    for (uint32_t b = 0; b < 65536; b++) {
        all[b] = (uint16_t)b;
        float got = quant_bf16_to_f32((uint16_t)b);
        double want = ref_bf16_value((uint16_t)b);
        if (isnan(want)) assert_int_equal(bits_of(got), b << 16);
        else assert_int_equal(bits_of(got), bits_of((float)want));
        if (!isnan(want)) assert_int_equal(quant_f32_to_bf16(got), b);
    }
    assert_int_equal(quant_dequantize(TENSOR_TYPE_BF16, all, row, 65536), IS_OK);
    for (uint32_t b = 0; b < 65536; b++) assert_int_equal(bits_of(row[b]), b << 16);

    const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
    uint64_t rnd = 12345;
    for (uint32_t top = 0; top < 65536; top++) {
        for (size_t k = 0; k < sizeof lows / sizeof lows[0]; k++)
            check_f32_to_bf16(float_of((top << 16) | lows[k]));
        rnd = rnd * 6364136223846793005ull + 1442695040888963407ull;
        check_f32_to_bf16(float_of((top << 16) | (uint32_t)(rnd >> 48)));
    }
    assert_int_equal(quant_f32_to_bf16(FLT_MAX), 0x7f80);              /* rounds up to inf */
    assert_int_equal(quant_f32_to_bf16(1.0f + ldexpf(1, -8)), 0x3f80); /* tie -> even */
    assert_int_equal(quant_f32_to_bf16(1.0f + ldexpf(3, -8)), 0x3f82);
    assert_int_equal(quant_f32_to_bf16(float_of(0x00008000)), 0x0000); /* subnormal tie */
    assert_int_equal(quant_f32_to_bf16(float_of(0x00018000)), 0x0002);
}

/* ---- hand-built blocks ------------------------------------------------------ */

/* Dequantises `nblk` blocks of `type` and compares with `want`. */
static void check_blocks(uint32_t type, const uint8_t *blocks, int nblk, const float *want,
                         const char *what) {
    const tensor_type_info *info = tensor_type_get(type);
    assert_non_null(info);
    int64_t n = (int64_t)nblk * info->block_elems;
    float *got = malloc((size_t)n * sizeof(float));
    assert_int_equal(quant_dequantize(type, blocks, got, n), IS_OK);
    assert_floats_bitwise(got, want, n, what);
    /* the same bytes at an odd address give the same values */
    size_t bytes = (size_t)nblk * info->block_bytes;
    uint8_t *odd = malloc(bytes + 3);
    memcpy(odd + 3, blocks, bytes);
    memset(got, 0, (size_t)n * sizeof(float));
    assert_int_equal(quant_dequantize(type, odd + 3, got, n), IS_OK);
    assert_floats_bitwise(got, want, n, what);
    free(odd);
    free(got);
}

static void test_q8_0(void **state) {
    (void)state;
    uint8_t b[2 * 34];
    float want[64];
    const uint16_t ds[2] = {0x3800 /* 0.5 */, 0xc100 /* -2.5 */};
    const double dv[2] = {0.5, -2.5};
    for (int k = 0; k < 2; k++) {
        put_f16(b + 34 * k, ds[k]);
        for (int i = 0; i < 32; i++) {
            int q = (k == 0) ? -128 + 8 * i + (i == 31 ? 7 : 0) : 127 - 8 * i; /* -128..127 */
            b[34 * k + 2 + i] = (uint8_t)(int8_t)q;
            want[32 * k + i] = (float)(q * dv[k]);
        }
    }
    assert_true(want[0] == -64.0f && want[31] == 63.5f && want[32] == -317.5f);
    check_blocks(TENSOR_TYPE_Q8_0, b, 2, want, "q8_0");
}

/* Legacy 4/5-bit types: value i of a block is nibble (i % 16) of byte
 * (i % 16), low nibble for i < 16, high for i >= 16; the fifth bit is bit i
 * of the 32-bit qh. */
static void pack_legacy(uint8_t *qs, uint8_t *qh, const int *q) {
    uint32_t h = 0;
    memset(qs, 0, 16);
    for (int i = 0; i < 32; i++) {
        qs[i % 16] |= (uint8_t)((q[i] & 15) << (i < 16 ? 0 : 4));
        h |= (uint32_t)((q[i] >> 4) & 1) << i;
    }
    if (qh)
        for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void test_q4_legacy(void **state) {
    (void)state;
    int q[32];
    for (int i = 0; i < 32; i++) q[i] = (i < 16) ? i : 31 - i; /* 0..15, then 15..0 */
    /* Q4_0, d = -0.25: y = (q - 8) * d */
    uint8_t b0[18];
    float w0[32];
    put_f16(b0, 0xb400);
    pack_legacy(b0 + 2, NULL, q);
    for (int i = 0; i < 32; i++) w0[i] = (float)((q[i] - 8) * -0.25);
    assert_true(w0[0] == 2.0f && w0[15] == -1.75f && w0[16] == -1.75f && w0[31] == 2.0f);
    check_blocks(TENSOR_TYPE_Q4_0, b0, 1, w0, "q4_0");
    /* Q4_1, d = 0.5, m = -3: y = q * d + m */
    uint8_t b1[20];
    float w1[32];
    put_f16(b1, 0x3800);
    put_f16(b1 + 2, 0xc200);
    pack_legacy(b1 + 4, NULL, q);
    for (int i = 0; i < 32; i++) w1[i] = (float)(q[i] * 0.5 - 3.0);
    assert_true(w1[0] == -3.0f && w1[15] == 4.5f);
    check_blocks(TENSOR_TYPE_Q4_1, b1, 1, w1, "q4_1");
}

static void test_q5_legacy(void **state) {
    (void)state;
    int q[32];
    for (int i = 0; i < 32; i++) q[i] = (i * 11 + 3) % 32; /* 3, 14, 25, 4, ... covers 0 and 31 */
    q[5] = 0;
    q[20] = 31;
    q[31] = 16;
    /* Q5_0, d = 0.75: y = (q - 16) * d */
    uint8_t b0[22];
    float w0[32];
    put_f16(b0, 0x3a00);
    pack_legacy(b0 + 6, b0 + 2, q);
    for (int i = 0; i < 32; i++) w0[i] = (float)((q[i] - 16) * 0.75);
    check_blocks(TENSOR_TYPE_Q5_0, b0, 1, w0, "q5_0");
    /* Q5_1, d = -0.125, m = 1.5: y = q * d + m */
    uint8_t b1[24];
    float w1[32];
    put_f16(b1, 0xb000);
    put_f16(b1 + 2, 0x3e00);
    pack_legacy(b1 + 8, b1 + 4, q);
    for (int i = 0; i < 32; i++) w1[i] = (float)(q[i] * -0.125 + 1.5);
    assert_true(w1[20] == -2.375f && w1[5] == 1.5f);
    check_blocks(TENSOR_TYPE_Q5_1, b1, 1, w1, "q5_1");
}

/* K-quant 6-bit scales/mins as ggml's quantize_row_q4_K packs them. */
static void pack_scales_k4(uint8_t *out, const int *sc, const int *mn) {
    memset(out, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            out[j] = (uint8_t)sc[j];
            out[j + 4] = (uint8_t)mn[j];
        } else {
            out[j + 4] = (uint8_t)((sc[j] & 0xf) | ((mn[j] & 0xf) << 4));
            out[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            out[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
}

/* Builds one Q4_K (five_bit = 0) or Q5_K block: value i of sub-block s (32
 * values each) sits in byte 32*(s/2) + i of qs, low nibble for even s; its
 * fifth bit is bit s of qh[i]. */
static void build_k(uint8_t *b, int five_bit, uint16_t d, uint16_t dmin, const int *sc,
                    const int *mn, const int *q /* [256] */) {
    put_f16(b, d);
    put_f16(b + 2, dmin);
    pack_scales_k4(b + 4, sc, mn);
    uint8_t *qh = b + 16, *qs = b + (five_bit ? 48 : 16);
    if (five_bit) memset(qh, 0, 32);
    memset(qs, 0, 128);
    for (int s = 0; s < 8; s++)
        for (int i = 0; i < 32; i++) {
            int v = q[32 * s + i];
            qs[32 * (s / 2) + i] |= (uint8_t)((v & 15) << (s % 2 ? 4 : 0));
            if (five_bit) qh[i] |= (uint8_t)(((v >> 4) & 1) << s);
        }
}

static void test_k_quants(void **state) {
    (void)state;
    /* scale indices 0..7 each get a different 6-bit value, extremes included,
     * so that a mix-up in the j >= 4 packing shows */
    const int sc[2][8] = {{0, 1, 31, 63, 7, 32, 62, 17}, {63, 48, 16, 5, 33, 1, 0, 60}};
    const int mn[2][8] = {{63, 0, 5, 33, 62, 1, 47, 16}, {2, 63, 40, 15, 0, 49, 31, 63}};
    const uint16_t d[2] = {0x3800 /* 0.5 */, 0xbc00 /* -1 */};
    const uint16_t dmin[2] = {0x3400 /* 0.25 */, 0xb800 /* -0.5 */};
    const double dv[2] = {0.5, -1.0}, dminv[2] = {0.25, -0.5};
    for (int five = 0; five < 2; five++) {
        uint32_t type = five ? TENSOR_TYPE_Q5_K : TENSOR_TYPE_Q4_K;
        int bytes = five ? 176 : 144, qmax = five ? 32 : 16;
        uint8_t *b = malloc(2 * (size_t)bytes);
        float want[512];
        for (int k = 0; k < 2; k++) {
            int q[256];
            for (int e = 0; e < 256; e++) q[e] = (e * 7 + 3 * (e / 32) + k) % qmax;
            q[0] = 0;
            q[255] = qmax - 1;
            q[32 * 4 + 1] = qmax - 1;
            build_k(b + k * bytes, five, d[k], dmin[k], sc[k], mn[k], q);
            for (int e = 0; e < 256; e++) {
                int s = e / 32;
                want[256 * k + e] = (float)(dv[k] * sc[k][s] * q[e] - dminv[k] * mn[k][s]);
            }
        }
        /* a few values worked out by hand */
        if (!five) {
            assert_true(want[0] == -15.75f);                    /* 0.5*0*0 - 0.25*63 */
            assert_true(want[255] == 0.5f * 17 * 15 - 4.0f);    /* sub-block 7 */
            assert_true(want[256 + 32 * 4 + 1] == -33.0f * 15); /* -1*33*15 + 0.5*0 */
        }
        check_blocks(type, b, 2, want, five ? "q5_k" : "q4_k");
        free(b);
    }
}

static void test_q6_k(void **state) {
    (void)state;
    uint8_t b[2 * 210];
    float want[512];
    memset(b, 0, sizeof b);
    const uint16_t d[2] = {0x3000 /* 0.125 */, 0xc000 /* -2 */};
    const double dv[2] = {0.125, -2.0};
    for (int k = 0; k < 2; k++) {
        uint8_t *ql = b + 210 * k, *qh = ql + 128;
        int8_t sc[16];
        for (int g = 0; g < 16; g++) sc[g] = (int8_t)(k == 0 ? -128 + 17 * g : 127 - 13 * g);
        sc[15] = (k == 0) ? 127 : -1;
        memcpy(ql + 192, sc, 16);
        put_f16(ql + 208, d[k]);
        for (int e = 0; e < 256; e++) {
            int q = ((e * 7 + 3 + k) % 64) - 32; /* -32..31 */
            if (e == 1) q = -32;
            if (e == 2) q = 31;
            /* element e: half e/128; within it r = 32*j + l; ql byte 64*half + l
             * (+32 for odd j), nibble low for j < 2; qh byte 32*half + l, bits 2j */
            int half = e / 128, r = e % 128, j = r / 32, l = r % 32;
            int u = q + 32;
            ql[64 * half + l + 32 * (j & 1)] |= (uint8_t)((u & 15) << (j < 2 ? 0 : 4));
            qh[32 * half + l] |= (uint8_t)((u >> 4) << (2 * j));
            want[256 * k + e] = (float)(dv[k] * sc[e / 16] * q);
        }
    }
    assert_true(want[1] == 0.125f * -128 * -32);
    assert_true(want[2] == 0.125f * -128 * 31);
    check_blocks(TENSOR_TYPE_Q6_K, b, 2, want, "q6_k");
}

static void test_plain_types(void **state) {
    (void)state;
    float src[8] = {1.5f, -0.0f, INFINITY, 1e-40f, -3.25f, 65504.0f, 0, 7}, dst[8];
    assert_int_equal(quant_dequantize(TENSOR_TYPE_F32, src, dst, 8), IS_OK);
    assert_memory_equal(src, dst, sizeof src);
}

/* ---- golden files from the Python gguf package --------------------------- */

static uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void check_golden(const char *name, uint32_t type) {
    char path[512];
    snprintf(path, sizeof path, "%s/quant_%s.bin", IS_GOLDEN_DIR, name);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        print_error("missing %s (run tools/make_quant_golden.py)\n", path);
        fail();
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc((size_t)size);
    assert_int_equal(fread(data, 1, (size_t)size, f), (size_t)size);
    fclose(f);

    assert_true(size >= 32);
    assert_memory_equal(data, "ISQG", 4);
    assert_int_equal(rd_u32(data + 4), 1);
    assert_int_equal(rd_u32(data + 8), type);
    uint32_t nblk = rd_u32(data + 12), elems = rd_u32(data + 16), bytes = rd_u32(data + 20);
    const tensor_type_info *info = tensor_type_get(type);
    assert_int_equal(elems, info->block_elems);
    assert_int_equal(bytes, info->block_bytes);
    int64_t n = (int64_t)nblk * elems;
    assert_int_equal(size, 32 + (long)nblk * bytes + n * 4);

    float *want = malloc((size_t)n * 4), *got = malloc((size_t)n * 4);
    const uint8_t *w = data + 32 + (size_t)nblk * bytes;
    for (int64_t i = 0; i < n; i++) want[i] = float_of(rd_u32(w + 4 * i));
    assert_int_equal(quant_dequantize(type, data + 32, got, n), IS_OK);
    assert_floats_bitwise(got, want, n, name);
    free(got);
    free(want);
    free(data);
}

static void test_golden(void **state) {
    (void)state;
    check_golden("f32", TENSOR_TYPE_F32);
    check_golden("f16", TENSOR_TYPE_F16);
    check_golden("bf16", TENSOR_TYPE_BF16);
    check_golden("q4_0", TENSOR_TYPE_Q4_0);
    check_golden("q4_1", TENSOR_TYPE_Q4_1);
    check_golden("q5_0", TENSOR_TYPE_Q5_0);
    check_golden("q5_1", TENSOR_TYPE_Q5_1);
    check_golden("q8_0", TENSOR_TYPE_Q8_0);
    check_golden("q4_k", TENSOR_TYPE_Q4_K);
    check_golden("q5_k", TENSOR_TYPE_Q5_K);
    check_golden("q6_k", TENSOR_TYPE_Q6_K);
}

/* ---- contract ------------------------------------------------------------- */

static void test_errors(void **state) {
    (void)state;
    uint8_t src[512] = {0};
    float dst[256];
    const uint32_t readable[] = {TENSOR_TYPE_F32,  TENSOR_TYPE_F16,  TENSOR_TYPE_BF16,
                                 TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q5_0,
                                 TENSOR_TYPE_Q5_1, TENSOR_TYPE_Q8_0, TENSOR_TYPE_Q4_K,
                                 TENSOR_TYPE_Q5_K, TENSOR_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof readable / sizeof readable[0]; i++)
        assert_true(quant_can_dequantize(readable[i]));
    const uint32_t unreadable[] = {TENSOR_TYPE_Q2_K,
                                   TENSOR_TYPE_Q3_K,
                                   TENSOR_TYPE_Q8_1,
                                   TENSOR_TYPE_Q8_K,
                                   TENSOR_TYPE_I8,
                                   TENSOR_TYPE_I32,
                                   TENSOR_TYPE_F64,
                                   4,
                                   5,
                                   39,
                                   40,
                                   1000,
                                   UINT32_MAX};
    for (size_t i = 0; i < sizeof unreadable / sizeof unreadable[0]; i++) {
        assert_false(quant_can_dequantize(unreadable[i]));
        dst[0] = 42.0f;
        assert_int_equal(quant_dequantize(unreadable[i], src, dst, 256), IS_ERR_UNSUPPORTED);
        assert_true(dst[0] == 42.0f);
        assert_true(strlen(is_error_last()) > 0);
    }
    dst[0] = 42.0f;
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q4_0, src, dst, 31), IS_ERR_INVALID_ARG);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q4_K, src, dst, 32), IS_ERR_INVALID_ARG);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q8_0, src, dst, -32), IS_ERR_INVALID_ARG);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_F32, src, dst, -1), IS_ERR_INVALID_ARG);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q8_0, NULL, dst, 32), IS_ERR_INVALID_ARG);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q8_0, src, NULL, 32), IS_ERR_INVALID_ARG);
    assert_true(dst[0] == 42.0f);
    assert_int_equal(quant_dequantize(TENSOR_TYPE_Q6_K, NULL, NULL, 0), IS_OK);
    assert_true(dst[0] == 42.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_to_f32_exhaustive),
        cmocka_unit_test(test_f32_to_f16),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_rows_exhaustive),
        cmocka_unit_test(test_q8_0),
        cmocka_unit_test(test_q4_legacy),
        cmocka_unit_test(test_q5_legacy),
        cmocka_unit_test(test_k_quants),
        cmocka_unit_test(test_q6_k),
        cmocka_unit_test(test_plain_types),
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* fp8 e4m3: the C conversions against the reference table of
 * tools/make_fp8_golden.py (every code decoded; every code, every midpoint
 * and their neighbours, saturation, NaN, infinities and a sweep of f32
 * encoded), the power-of-two row scales, and row quantisation: its error
 * bound and that quantising a dequantised row gives the same values. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "core/fp8.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void test_reference_table(void **state) {
    (void)state;
    FILE *fp = fopen(IS_GOLDEN_DIR "/fp8_e4m3.txt", "r");
    assert_non_null(fp);
    char line[128];
    int n_dec = 0, n_enc = 0, bad = 0;
    while (fgets(line, sizeof line, fp)) {
        unsigned a, b;
        if (line[0] == 'd' && sscanf(line + 1, "%x %x", &a, &b) == 2) {
            uint32_t got = bits_of(fp8_e4m3_to_f32((uint8_t)a));
            if (got != b && bad++ < 10) printf("decode %02x: got %08x, want %08x\n", a, got, b);
            n_dec++;
        } else if (line[0] == 'e' && sscanf(line + 1, "%x %x", &a, &b) == 2) {
            uint8_t got = fp8_e4m3_from_f32(float_of(a));
            if (got != b && bad++ < 10) printf("encode %08x: got %02x, want %02x\n", a, got, b);
            n_enc++;
        }
    }
    fclose(fp);
    printf("fp8 reference: %d codes decoded, %d f32 inputs encoded, %d differ\n", n_dec, n_enc,
           bad);
    assert_int_equal(n_dec, 256);
    assert_true(n_enc > 5000);
    assert_int_equal(bad, 0);
}

/* Edge cases spelled out, so a regression names itself. */
static void test_edges(void **state) {
    (void)state;
    assert_int_equal(fp8_e4m3_from_f32(448.0f), 0x7E);
    assert_int_equal(fp8_e4m3_from_f32(-448.0f), 0xFE);
    assert_int_equal(fp8_e4m3_from_f32(464.0f), 0x7E); /* past the top: saturates */
    assert_int_equal(fp8_e4m3_from_f32(INFINITY), 0x7E);
    assert_int_equal(fp8_e4m3_from_f32(-INFINITY), 0xFE);
    assert_int_equal(fp8_e4m3_from_f32(NAN), FP8_E4M3_NAN);
    assert_int_equal(fp8_e4m3_from_f32(-0.0f), 0x80);
    assert_int_equal(fp8_e4m3_from_f32(1.0f), 0x38);
    assert_int_equal(fp8_e4m3_from_f32(1.0625f), 0x38);  /* tie between 1 and 1.125: even */
    assert_int_equal(fp8_e4m3_from_f32(1.1875f), 0x3A);  /* tie between 1.125 and 1.25: even */
    assert_int_equal(fp8_e4m3_from_f32(0x1p-10f), 0x00); /* half the smallest subnormal: even (0) */
    assert_int_equal(fp8_e4m3_from_f32(0x1.8p-9f), 0x02); /* 1.5 units: even (2) */
    assert_int_equal(fp8_e4m3_from_f32(0x1.ep-7f),
                     0x08); /* 7.5 units rounds up to the smallest normal */
    assert_true(isnan(fp8_e4m3_to_f32(0x7F)) && isnan(fp8_e4m3_to_f32(0xFF)));
    assert_true(fp8_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(fp8_e4m3_to_f32(0x7E) == 448.0f);
}

static void test_scales(void **state) {
    (void)state;
    assert_true(fp8_scale_for_amax(0.0f) == 1.0f);
    assert_true(fp8_scale_for_amax(NAN) == 1.0f);
    assert_true(fp8_scale_for_amax(INFINITY) == 1.0f);
    assert_true(fp8_scale_for_amax(448.0f) == 1.0f);
    assert_true(fp8_scale_for_amax(464.0f) == 1.0f); /* still rounds to 448 */
    assert_true(fp8_scale_for_amax(464.00003f) == 2.0f);
    assert_true(fp8_scale_for_amax(232.0f) == 0.5f);
    assert_true(fp8_scale_for_amax(232.00002f) == 1.0f);
    assert_true(fp8_scale_for_amax(1e-45f) == 0x1p-126f); /* clamped to a normal power of two */
    assert_true(fp8_scale_for_amax(3e38f) == 0x1p119f);
    assert_true(fp8_scale_for_amax(FLT_MAX) == 0x1p120f);
    /* For a sweep of amax: a power of two, amax in (232 s, 464 s], its inverse exact. */
    for (uint32_t u = 0x00800000u; u < 0x7F800000u; u += 0x1357u * 61) {
        float amax = float_of(u), s = fp8_scale_for_amax(amax);
        assert_int_equal(bits_of(s) & 0x807FFFFFu, 0);
        if (s > 0x1p-126f) assert_true((double)amax > 232.0 * s);
        assert_true((double)amax <= 464.0 * s);
        assert_true(s * fp8_scale_inverse(s) == 1.0f);
    }
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float gauss(void) { /* about N(0, 1), from 4 uniforms */
    float sum = 0;
    for (int i = 0; i < 4; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        sum += (float)(rng >> 40) / (float)(1u << 24) - 0.5f;
    }
    return sum * 1.7320508f;
}

static void test_rows(void **state) {
    (void)state;
    enum { ROWS = 64, LEN = 64 };
    float *x = malloc(sizeof(float) * ROWS * LEN), *y = malloc(sizeof(float) * ROWS * LEN);
    float *z = malloc(sizeof(float) * ROWS * LEN);
    uint8_t *c = malloc(ROWS * LEN), *c2 = malloc(ROWS * LEN);
    float s[ROWS], s2[ROWS];
    assert_true(x && y && z && c && c2);
    for (int r = 0; r < ROWS; r++) {
        float mag = ldexpf(1.0f, r % 40 - 20); /* rows of very different size */
        for (int i = 0; i < LEN; i++) x[r * LEN + i] = r == 5 ? 0.0f : gauss() * mag;
    }
    fp8_quantize_rows(x, ROWS, LEN, c, s);
    fp8_dequantize_rows(c, s, ROWS, LEN, y);
    for (int r = 0; r < ROWS; r++) {
        float amax = 0;
        for (int i = 0; i < LEN; i++) amax = fmaxf(amax, fabsf(x[r * LEN + i]));
        for (int i = 0; i < LEN; i++) {
            double e = fabs((double)y[r * LEN + i] - x[r * LEN + i]);
            /* Half a unit of 3 mantissa bits, or half the smallest subnormal step. */
            double bound = fmax(fabs(x[r * LEN + i]) * 0x1p-4, s[r] * 0x1p-10);
            assert_true(e <= bound);
            /* Exactly code * scale. */
            assert_true(y[r * LEN + i] == fp8_e4m3_to_f32(c[r * LEN + i]) * s[r]);
        }
        if (r == 5) assert_true(s[r] == 1.0f);
    }
    /* Quantising the dequantised rows gives the same codes and scales:
     * every tier that converts again holds the record's bytes. */
    fp8_quantize_rows(y, ROWS, LEN, c2, s2);
    assert_memory_equal(c, c2, ROWS * LEN);
    assert_memory_equal(s, s2, sizeof s);
    fp8_dequantize_rows(c2, s2, ROWS, LEN, z);
    assert_memory_equal(y, z, sizeof(float) * ROWS * LEN);
    free(x);
    free(y);
    free(z);
    free(c);
    free(c2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_table),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_scales),
        cmocka_unit_test(test_rows),
    };
    return test_run_group(tests, NULL, NULL);
}

/*
 * test_cpu_qmatmul: the CPU backend's products on quantised weights.
 *
 * For every type cpu_qmatmul reads, random blocks (finite f16 scales, any
 * quant bits) are checked three ways:
 *   - expansion: with one-hot activation rows, y[t][r] = W[r][t] has a
 *     single non-zero term, so each expanded weight must equal the
 *     dequantised copy (gguf/quant.c) exactly;
 *   - products: y against a double-precision product of random x and the
 *     dequantised weights, max error <= 1e-5 of max |y|, for token counts
 *     that hit every tile size and row counts that do not divide evenly
 *     among threads;
 *   - the backend: cpu matmul on a weight made from a fake GGUF tensor, for
 *     T on both sides of the quantised/sgemm threshold, with a bias.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_qmatmul.h"
#include "gguf/tensor_type.h"
#include "gguf/quant.h"

/* ---- random blocks --------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd_u32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

/* Uniform in [lo, hi). */
static float rnd_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)(rnd_u32() & 0xffffff) / 16777216.0f;
}

static void put_f16(uint8_t *p, float f) {
    uint16_t h = quant_f32_to_f16(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* A scale of random magnitude in [2^-12, 2^-2), negative if `signed_`
 * and a coin says so. */
static float rnd_scale(int signed_) {
    float v = ldexpf(rnd_uniform(1.0f, 2.0f), -(int)(2 + rnd_u32() % 10));
    return signed_ && (rnd_u32() & 1) ? -v : v;
}

/* Fills one row of `cols` values of `type` with random bytes, then writes
 * finite f16 scales where the layout has them. */
static void fill_row(uint32_t type, uint8_t *row, int64_t cols) {
    const tensor_type_info *info = tensor_type_get(type);
    size_t bytes = tensor_type_row_bytes(type, cols);
    for (size_t i = 0; i < bytes; i++) row[i] = (uint8_t)rnd_u32();
    int64_t nb = cols / info->block_elems;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *p = row + (size_t)b * info->block_bytes;
        switch (type) {
        case TENSOR_TYPE_Q4_0:
        case TENSOR_TYPE_Q8_0: put_f16(p, rnd_scale(1)); break;
        case TENSOR_TYPE_Q4_1:
            put_f16(p, rnd_scale(0));
            put_f16(p + 2, -8.0f * rnd_scale(0));
            break;
        case TENSOR_TYPE_Q4_K:
            put_f16(p, rnd_scale(0) / 16.0f);
            put_f16(p + 2, rnd_scale(0) / 16.0f);
            break;
        case TENSOR_TYPE_Q6_K: put_f16(p + 208, rnd_scale(1) / 64.0f); break;
        case TENSOR_TYPE_F16: put_f16(p, rnd_uniform(-1.0f, 1.0f)); break;
        default: fail_msg("no generator for type %u", type);
        }
    }
}

typedef struct qweight {
    uint32_t type;
    int64_t rows, cols;
    uint8_t *raw; /* [rows] packed rows */
    float *deq;   /* [rows][cols] gguf/quant.c's dequantisation */
} qweight;

static qweight qweight_random(uint32_t type, int64_t rows, int64_t cols) {
    qweight w = {type, rows, cols, NULL, NULL};
    size_t rb = tensor_type_row_bytes(type, cols);
    assert_true(rb > 0);
    w.raw = malloc(rb * (size_t)rows);
    w.deq = malloc(sizeof(float) * (size_t)(rows * cols));
    assert_non_null(w.raw);
    assert_non_null(w.deq);
    for (int64_t r = 0; r < rows; r++) {
        fill_row(type, w.raw + rb * (size_t)r, cols);
        assert_int_equal(quant_dequantize(type, w.raw + rb * (size_t)r, w.deq + r * cols, cols),
                         IS_OK);
    }
    for (int64_t i = 0; i < rows * cols; i++) assert_true(isfinite(w.deq[i]));
    return w;
}

static void qweight_free(qweight *w) {
    free(w->raw);
    free(w->deq);
}

/* Double-precision y[T][rows] = x W^T; returns max |y|. */
static double reference(double *y, const float *x, const qweight *w, int32_t T) {
    double mx = 0.0;
    for (int32_t t = 0; t < T; t++)
        for (int64_t r = 0; r < w->rows; r++) {
            double s = 0.0;
            for (int64_t c = 0; c < w->cols; c++)
                s += (double)x[t * w->cols + c] * (double)w->deq[r * w->cols + c];
            y[t * w->rows + r] = s;
            if (fabs(s) > mx) mx = fabs(s);
        }
    return mx;
}

/* Max |got - want| over n values must be <= 1e-5 * scale. */
static void assert_close(const float *got, const double *want, int64_t n, double scale,
                         const char *what) {
    double worst = 0.0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= worst)) {
            worst = e;
            at = i;
        }
    }
    if (!(worst <= 1e-5 * scale)) {
        print_error("%s: value %lld: got %.9g, want %.9g (error %.3g, max |y| %.3g)\n", what,
                    (long long)at, got[at], want[at], worst, scale);
        fail();
    }
}

static const uint32_t k_types[] = {TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q8_0,
                                   TENSOR_TYPE_Q4_K, TENSOR_TYPE_Q6_K, TENSOR_TYPE_F16};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

static int64_t block_cols(uint32_t type) {
    return type == TENSOR_TYPE_Q4_K || type == TENSOR_TYPE_Q6_K ? 256 : 32;
}

/* ---- tests ----------------------------------------------------------------- */

static void test_supports(void **state) {
    for (size_t i = 0; i < N_TYPES; i++) {
        int64_t bc = block_cols(k_types[i]);
        assert_true(cpu_qmatmul_supports(k_types[i], bc));
        assert_true(cpu_qmatmul_supports(k_types[i], 3 * bc));
        assert_false(cpu_qmatmul_supports(k_types[i], bc + 16));
        assert_false(cpu_qmatmul_supports(k_types[i], 0));
    }
    assert_false(cpu_qmatmul_supports(TENSOR_TYPE_F32, 64));
    assert_false(cpu_qmatmul_supports(TENSOR_TYPE_Q5_K, 256));
    assert_false(cpu_qmatmul_supports(9999, 256));
}

/* One-hot rows of x pick single weights: y[t][r] == W[r][t] exactly, the
 * other terms being zeros. (Compared as values: a -0 weight comes out as
 * +0, since the accumulators start at +0.) */
static void test_expansion_is_exact(void **state) {
    for (size_t i = 0; i < N_TYPES; i++) {
        uint32_t type = k_types[i];
        int64_t rows = 13, cols = 2 * block_cols(type);
        qweight w = qweight_random(type, rows, cols);
        float *x = calloc((size_t)(cols * cols), sizeof(float));
        float *y = malloc(sizeof(float) * (size_t)(cols * rows));
        for (int64_t c = 0; c < cols; c++) x[c * cols + c] = 1.0f;
        /* In chunks of 11 tokens, so every weight goes through a tile of 5 or 6. */
        for (int64_t t0 = 0; t0 < cols; t0 += 11) {
            int32_t n = (int32_t)(cols - t0 < 11 ? cols - t0 : 11);
            assert_int_equal(cpu_qmatmul(y + t0 * rows, x + t0 * cols, w.raw, type, rows, cols, n),
                             IS_OK);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                if (y[c * rows + r] != w.deq[r * cols + c]) {
                    print_error("type %u: W[%lld][%lld]: kernel %.9g, dequantised %.9g\n", type,
                                (long long)r, (long long)c, y[c * rows + r], w.deq[r * cols + c]);
                    fail();
                }
        free(x);
        free(y);
        qweight_free(&w);
    }
}

static void test_products_match_reference(void **state) {
    static const int32_t Ts[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 23, 40};
    static const int64_t rows_list[] = {1, 37, 129};
    int saved = omp_get_max_threads();
    omp_set_num_threads(3); /* rows below split unevenly */
    for (size_t i = 0; i < N_TYPES; i++) {
        uint32_t type = k_types[i];
        for (size_t ri = 0; ri < sizeof rows_list / sizeof rows_list[0]; ri++) {
            int64_t rows = rows_list[ri];
            int64_t cols = block_cols(type) == 256 ? 768 : 608;
            qweight w = qweight_random(type, rows, cols);
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                int32_t T = Ts[ti];
                float *x = malloc(sizeof(float) * (size_t)(T * cols));
                float *y = malloc(sizeof(float) * (size_t)(T * rows));
                double *ref = malloc(sizeof(double) * (size_t)(T * rows));
                for (int64_t k = 0; k < T * cols; k++) x[k] = rnd_uniform(-2.0f, 2.0f);
                double mx = reference(ref, x, &w, T);
                assert_int_equal(cpu_qmatmul(y, x, w.raw, type, rows, cols, T), IS_OK);
                char what[96];
                snprintf(what, sizeof what, "type %u rows %lld T %d", type, (long long)rows, T);
                assert_close(y, ref, T * rows, mx, what);
                free(x);
                free(y);
                free(ref);
            }
            qweight_free(&w);
        }
    }
    omp_set_num_threads(saved);
}

/* Through the backend: both sides of the threshold, and a bias. */
static void test_backend_matmul(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(2, &be), IS_OK);
    static const uint32_t types[] = {TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q8_0, TENSOR_TYPE_Q4_0,
                                     TENSOR_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        uint32_t type = types[i];
        int64_t rows = 75, cols = block_cols(type) == 256 ? 512 : 320;
        qweight w = qweight_random(type, rows, cols);
        gguf_tensor t = {.name = "w",
                         .n_dims = 2,
                         .ne = {cols, rows, 1, 1},
                         .type = type,
                         .data = w.raw,
                         .nbytes = tensor_type_row_bytes(type, cols) * rows,
                         .n_elements = rows * cols};
        float bias_v[75];
        for (int64_t r = 0; r < rows; r++) bias_v[r] = rnd_uniform(-1.0f, 1.0f);
        gguf_tensor tb = {.name = "b",
                          .n_dims = 1,
                          .ne = {rows, 1, 1, 1},
                          .type = TENSOR_TYPE_F32,
                          .data = bias_v,
                          .nbytes = sizeof bias_v,
                          .n_elements = rows};
        backend_weight *bw, *bb;
        assert_int_equal(be->ops->weight_create(be, &t, &bw), IS_OK);
        assert_int_equal(be->ops->weight_create(be, &tb, &bb), IS_OK);
        for (int32_t T = 1; T <= 40; T += (T < 20 ? 1 : 7)) {
            float *x = malloc(sizeof(float) * (size_t)(T * cols));
            float *y = malloc(sizeof(float) * (size_t)(T * rows));
            double *ref = malloc(sizeof(double) * (size_t)(T * rows));
            for (int64_t k = 0; k < T * cols; k++) x[k] = rnd_uniform(-2.0f, 2.0f);
            reference(ref, x, &w, T);
            double mx = 0.0;
            for (int32_t tt = 0; tt < T; tt++)
                for (int64_t r = 0; r < rows; r++) {
                    ref[tt * rows + r] += bias_v[r];
                    if (fabs(ref[tt * rows + r]) > mx) mx = fabs(ref[tt * rows + r]);
                }
            be->ops->matmul(be, y, x, bw, bb, T);
            char what[96];
            snprintf(what, sizeof what, "backend type %u T %d", type, T);
            assert_close(y, ref, T * rows, mx, what);
            free(x);
            free(y);
            free(ref);
        }
        be->ops->weight_free(be, bw);
        be->ops->weight_free(be, bb);
        qweight_free(&w);
    }
    be->ops->free(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_supports),
        cmocka_unit_test(test_expansion_is_exact),
        cmocka_unit_test(test_products_match_reference),
        cmocka_unit_test(test_backend_matmul),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

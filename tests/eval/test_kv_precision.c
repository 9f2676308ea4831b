/*
 * test_kv_precision: the accuracy cost of narrow fact-KV records on the
 * default model (CPU backend, f32 compute), the same k = 20 LoCoMo facts
 * injected for each of 2 questions (eval/kv_precision.h; bench_kv_precision prints
 * the full table). Stated tolerances, on the logits that predict the gold
 * answer's first token, against f32 records:
 *
 *   f32    identical (the comparison is deterministic);
 *   bf16   the project's bf16 tolerance: relative L2 error <= 1e-2, same
 *          top-1; and here also KL <= 1e-4 nats, max |dlogit| <= 2e-3 of
 *          the logits' range;
 *   fp8    relative L2 error <= 2e-2, KL <= 5e-3 nats, max |dlogit| <=
 *          2e-2 of the range, same top-1; and its error above bf16's (so
 *          the records really are narrowed to fp8); its K and V at most
 *          0.55 of bf16's bytes (codes plus a scale per head).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "backend/backend.h"
#include "eval/kv_precision.h"
#include "model/model.h"
#include "test_util.h"

#define LOCOMO_26 IS_SOURCE_DIR "/../shared/data/locomo/26.json"

static void test_record_dtypes_against_f32(void **state) {
    (void)state;
    if (!test_file_exists(IS_DEFAULT_MODEL)) TEST_SKIP(TEST_NEEDS_MODEL);
    if (!test_file_exists(LOCOMO_26)) TEST_SKIP(TEST_NEEDS_LOCOMO);
    backend *be;
    model *m;
    engine *e;
    locomo_conv *conv;
    assert_int_equal(backend_cpu_create(0, &be), IS_OK);
    assert_int_equal(model_load(IS_DEFAULT_MODEL, be, &m), IS_OK);
    engine_params ep = engine_default_params();
    ep.max_seqs = KV_DTYPE_COUNT + 3;
    ep.n_ctx = 2048;
    assert_int_equal(engine_create(m, ep, &e), IS_OK);
    assert_int_equal(locomo_load(LOCOMO_26, &conv), IS_OK);
    char dir[] = "/tmp/test_kv_precision_XXXXXX";
    assert_non_null(mkdtemp(dir));
    /* Both questions on the same 20 facts: one encoding each, so the test
     * stays fast on two cores. */
    kv_precision_params p = {.k = 20, .n_questions = 2, .window = 0, .fact_stride = 0};
    kv_precision_row rows[KV_DTYPE_COUNT];
    is_status st = kv_precision_run(e, conv, &p, dir, rows);
    if (st != IS_OK) fprintf(stderr, "%s\n", is_error_last());
    assert_int_equal(st, IS_OK);
    for (int d = 0; d < KV_DTYPE_COUNT; d++) {
        const kv_precision_row *r = &rows[d];
        printf("  %-4s records: %zu bytes, max |dlogit| %.4f (%.2e of range), rel L2 %.2e, "
               "KL mean %.2e max %.2e, top-1 %d/%d, |dNLL| %.4f\n",
               kv_dtype_name(r->dtype), r->kv_bytes, r->max_abs_dlogit, r->max_rel_dlogit,
               r->max_rel_l2, r->mean_kl, r->max_kl, r->top1_agree, r->n, r->mean_abs_dnll);
        assert_int_equal(r->n, 2);
        assert_int_equal(r->top1_agree, r->n);
    }
    const kv_precision_row *f32 = &rows[KV_DTYPE_F32], *bf = &rows[KV_DTYPE_BF16],
                           *f8 = &rows[KV_DTYPE_FP8];
    assert_true(f32->max_abs_dlogit == 0 && f32->max_kl == 0);
    assert_true(bf->max_rel_l2 <= 1e-2 && bf->max_kl <= 1e-4 && bf->max_rel_dlogit <= 2e-3);
    assert_true(f8->max_rel_l2 <= 2e-2 && f8->max_kl <= 5e-3 && f8->max_rel_dlogit <= 2e-2);
    assert_true(f8->max_abs_dlogit > bf->max_abs_dlogit && f8->max_kl > bf->max_kl);
    assert_true(bf->max_abs_dlogit > 0);
    assert_true((double)f8->kv_bytes <= 0.55 * (double)bf->kv_bytes);
    assert_true(f8->kv_bytes > 0);
    assert_int_equal(test_remove_tree(dir), 0);
    locomo_free(conv);
    engine_free(e);
    model_free(m);
    be->ops->free(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_record_dtypes_against_f32),
    };
    return test_run_group(tests, NULL, NULL);
}

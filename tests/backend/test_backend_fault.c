/*
 * Backend failures on the CPU backend (backend.h, "Failures"): an injected
 * fault fails exactly the op it was aimed at, is latched (the ops after it
 * do nothing, status reports it with its message), fires once, and clears
 * with recover; a stuck fault keeps recover failing until it is disarmed.
 * The engine and the server build their failure paths on these rules
 * (tests/engine/test_engine_fault.c, tests/serve/test_serve_fault.c).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "backend/backend.h"
#include "core/status.h"

#define N 64

static void fill(float *x, float v) {
    for (int i = 0; i < N; i++) x[i] = v;
}

static void test_clean_backend_counts_ops(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(1, &be), IS_OK);
    float a[N], b[N];
    fill(a, 1.0f);
    fill(b, 2.0f);
    int64_t c0 = backend_op_count(be);
    be->ops->add(be, a, b, N);
    be->ops->copy(be, b, a, sizeof a);
    be->ops->sync(be);
    assert_int_equal(backend_op_count(be) - c0, 3);
    assert_true(a[0] == 3.0f && b[N - 1] == 3.0f);
    assert_int_equal(backend_status(be), IS_OK);
    assert_int_equal(backend_recover(be), IS_OK); /* a no-op when nothing failed */
    be->ops->free(be);
}

static void test_fault_fails_the_aimed_op_and_latches(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(1, &be), IS_OK);
    float a[N], b[N], c[N];
    fill(a, 1.0f);
    fill(b, 2.0f);
    fill(c, 0.0f);
    backend_fault_arm(be, 3, false);
    be->ops->add(be, a, b, N);         /* op 1: runs */
    be->ops->copy(be, c, a, sizeof a); /* op 2: runs */
    assert_true(a[0] == 3.0f && c[0] == 3.0f);
    assert_int_equal(backend_status(be), IS_OK);
    be->ops->add(be, a, b, N); /* op 3: the fault, nothing written */
    assert_true(a[0] == 3.0f);
    assert_int_equal(backend_status(be), IS_ERR_INTERNAL);
    assert_non_null(strstr(is_error_last(), "injected fault"));
    be->ops->copy(be, c, b, sizeof b); /* latched: skipped */
    be->ops->add(be, a, b, N);
    assert_true(a[0] == 3.0f && c[0] == 3.0f);
    assert_int_equal(backend_status(be), IS_ERR_INTERNAL); /* still, until recover */
    assert_int_equal(backend_recover(be), IS_OK);
    assert_int_equal(backend_status(be), IS_OK);
    /* The fault fired once: everything runs again. */
    for (int i = 0; i < 10; i++) be->ops->add(be, a, b, N);
    assert_true(a[N - 1] == 23.0f);
    assert_int_equal(backend_status(be), IS_OK);
    be->ops->free(be);
}

static void test_stuck_fault_blocks_recovery_until_disarmed(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(1, &be), IS_OK);
    float a[N], b[N];
    fill(a, 1.0f);
    fill(b, 1.0f);
    backend_fault_arm(be, 1, true);
    be->ops->sync(be); /* an op too: the fault lands on it */
    assert_int_equal(backend_status(be), IS_ERR_INTERNAL);
    for (int i = 0; i < 3; i++) assert_int_equal(backend_recover(be), IS_ERR_INTERNAL);
    be->ops->add(be, a, b, N);
    assert_true(a[0] == 1.0f);
    backend_fault_arm(be, 0, false);
    assert_int_equal(backend_recover(be), IS_OK);
    be->ops->add(be, a, b, N);
    assert_true(a[0] == 2.0f);
    assert_int_equal(backend_status(be), IS_OK);
    be->ops->free(be);
}

static void test_disarm_before_it_fires(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(1, &be), IS_OK);
    float a[N], b[N];
    fill(a, 0.0f);
    fill(b, 1.0f);
    backend_fault_arm(be, 2, true);
    backend_fault_arm(be, 0, false);
    for (int i = 0; i < 5; i++) be->ops->add(be, a, b, N);
    assert_true(a[0] == 5.0f);
    assert_int_equal(backend_status(be), IS_OK);
    be->ops->free(be);
}

/* The interface's options (backend_set_option): the CPU backend has none,
 * refuses each with IS_ERR_UNSUPPORTED and a message, and stays as it was;
 * it has no device memory of its own. */
static void test_cpu_has_no_options(void **state) {
    backend *be;
    assert_int_equal(backend_cpu_create(1, &be), IS_OK);
    assert_null(be->ops->kv_elem_size); /* f32, the interface's default */
    assert_int_equal(backend_set_option(be, BACKEND_OPT_KV_COMPACT, 1), IS_ERR_UNSUPPORTED);
    assert_non_null(strstr(is_error_last(), "cpu backend"));
    assert_int_equal(backend_set_option(be, BACKEND_OPT_FACT_CACHE_BYTES, 1 << 20),
                     IS_ERR_UNSUPPORTED);
    assert_null(be->ops->kv_elem_size); /* f32, the interface's default */
    assert_int_equal(backend_free_bytes(be), 0);
    assert_int_equal(backend_status(be), IS_OK);
    assert_int_equal(backend_set_option(NULL, BACKEND_OPT_KV_COMPACT, 1), IS_ERR_INVALID_ARG);
    /* Nor settings of its own: an empty list is nothing to apply, a list
     * with an item is refused by name, and the configuration reads "". */
    char desc[16] = "x";
    assert_int_equal(backend_configure(be, NULL, desc, sizeof desc), IS_OK);
    assert_string_equal(desc, "");
    assert_int_equal(backend_configure(be, " , ", NULL, 0), IS_OK);
    assert_int_equal(backend_configure(be, "pdl=off", desc, sizeof desc), IS_ERR_UNSUPPORTED);
    assert_non_null(strstr(is_error_last(), "cpu backend: no settings (got 'pdl=off')"));
    assert_non_null(strstr(backend_options_help("cpu"), "(none)"));
    assert_non_null(backend_options_help("cuda"));
    be->ops->free(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clean_backend_counts_ops),
        cmocka_unit_test(test_fault_fails_the_aimed_op_and_latches),
        cmocka_unit_test(test_stuck_fault_blocks_recovery_until_disarmed),
        cmocka_unit_test(test_disarm_before_it_fires),
        cmocka_unit_test(test_cpu_has_no_options),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * The CUDA backend's options (cuda/options.h): every key parsed onto its own
 * field, the list printed back and read again to the same options, the
 * environment variable read the same way, and every kind of bad item
 * refused by name with the options left as they were. Host code only: runs
 * without a GPU, CI included.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "options.h"

static bool same(const cuda_options *a, const cuda_options *b) {
    char x[512], y[512];
    cuda_options_format(a, x, sizeof x);
    cuda_options_format(b, y, sizeof y);
    return strcmp(x, y) == 0;
}

static void test_defaults_are_the_documented_ones(void **state) {
    (void)state;
    const cuda_options o = cuda_options_default();
    char buf[512];
    cuda_options_format(&o, buf, sizeof buf);
    /* The table of options.h and README's CUDA section. */
    assert_string_equal(buf, "precision=bf16x2,kv=f32,flash=on,clusters=on,wide=on,"
                             "flash_wgmma=on,skinny=on,skinny_splits=0,wgmma=on,stacked=on,"
                             "fused_convert=on,pdl=on");
}

static void test_each_key_sets_its_field(void **state) {
    (void)state;
    cuda_options o = cuda_options_default();
    assert_int_equal(cuda_options_parse(&o, "precision=bf16, kv=bf16 ,flash=off"), IS_OK);
    assert_int_equal(o.precision, CUDA_MATMUL_BF16);
    assert_int_equal(o.kv, CUDA_KV_BF16);
    assert_false(o.flash);
    assert_true(o.flash_clusters); /* untouched */
    assert_int_equal(cuda_options_parse(&o, "clusters=0,wide=off,flash_wgmma=off,skinny=off"),
                     IS_OK);
    assert_false(o.flash_clusters);
    assert_false(o.flash_wide);
    assert_false(o.flash_wgmma);
    assert_false(o.skinny);
    assert_int_equal(cuda_options_parse(&o, "skinny_splits=4,wgmma=off,stacked=off,"
                                            "fused_convert=off,pdl=off,"),
                     IS_OK);
    assert_int_equal(o.skinny_splits, 4);
    assert_false(o.wgmma);
    assert_false(o.stacked);
    assert_false(o.fused_convert);
    assert_false(o.pdl);
    assert_int_equal(cuda_options_parse(&o, "pdl=1,precision=bf16x2,kv=f32"), IS_OK);
    assert_true(o.pdl);
    assert_int_equal(o.precision, CUDA_MATMUL_BF16X2);
    assert_int_equal(o.kv, CUDA_KV_F32);
    /* Nothing to apply. */
    cuda_options before = o;
    assert_int_equal(cuda_options_parse(&o, NULL), IS_OK);
    assert_int_equal(cuda_options_parse(&o, ""), IS_OK);
    assert_int_equal(cuda_options_parse(&o, " , ,"), IS_OK);
    assert_true(same(&o, &before));
}

static void test_printed_list_reads_back(void **state) {
    (void)state;
    cuda_options o = cuda_options_default();
    assert_int_equal(cuda_options_parse(&o, "precision=bf16,kv=bf16,clusters=off,skinny_splits=8,"
                                            "pdl=off"),
                     IS_OK);
    char buf[512];
    int n = cuda_options_format(&o, buf, sizeof buf);
    assert_int_equal(n, (int)strlen(buf));
    cuda_options back = cuda_options_default();
    assert_int_equal(cuda_options_parse(&back, buf), IS_OK);
    assert_true(same(&o, &back));
    assert_int_equal(back.skinny_splits, 8);
    /* A short buffer gets a prefix and the length the whole list needs. */
    char small[8];
    assert_int_equal(cuda_options_format(&o, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
}

/* Refused, with the offending item named, and o as it was. */
static void refused(const char *spec, const char *needle) {
    cuda_options o = cuda_options_default();
    assert_int_equal(cuda_options_parse(&o, "kv=bf16"), IS_OK);
    const cuda_options before = o;
    if (cuda_options_parse(&o, spec) != IS_ERR_INVALID_ARG) fail_msg("'%s' was accepted", spec);
    if (!strstr(is_error_last(), needle))
        fail_msg("'%s': message '%s' does not name '%s'", spec, is_error_last(), needle);
    assert_true(same(&o, &before));
}

static void test_bad_items_are_refused_by_name(void **state) {
    (void)state;
    refused("graphs=on", "unknown key 'graphs'");
    refused("graphs=on", "keys: precision, kv,");
    refused("skinny=all", "'skinny' takes on or off, not 'all'");
    refused("precision=fp8", "'precision' takes bf16x2 | bf16, not 'fp8'");
    refused("kv=f16", "'kv' takes f32 | bf16");
    refused("skinny_splits=9", "'skinny_splits' takes an integer in 0..8, not '9'");
    refused("skinny_splits=2x", "not '2x'");
    refused("pdl", "'pdl' is not key=value");
    refused("pdl=", "'pdl' needs a value");
    refused("Pdl=on", "unknown key 'Pdl'");
    /* All or nothing: the good items before a bad one are not applied. */
    refused("precision=bf16,flash=off,wide=maybe", "'wide' takes on or off");
}

static void test_environment_variable(void **state) {
    (void)state;
    cuda_options o = cuda_options_default();
    const cuda_options def = o;
    unsetenv("IS_CUDA_OPTIONS");
    assert_int_equal(cuda_options_from_env(&o), IS_OK);
    assert_true(same(&o, &def));
    setenv("IS_CUDA_OPTIONS", "pdl=off,wgmma=off", 1);
    assert_int_equal(cuda_options_from_env(&o), IS_OK);
    assert_false(o.pdl);
    assert_false(o.wgmma);
    setenv("IS_CUDA_OPTIONS", "early=on", 1);
    assert_int_equal(cuda_options_from_env(&o), IS_ERR_INVALID_ARG);
    assert_non_null(strstr(is_error_last(), "IS_CUDA_OPTIONS"));
    assert_non_null(strstr(is_error_last(), "unknown key 'early'"));
    unsetenv("IS_CUDA_OPTIONS");
}

static void test_help_lists_every_key(void **state) {
    (void)state;
    const char *h = cuda_options_help();
    const char *keys[] = {"precision",     "kv",     "flash",         "clusters", "wide",
                          "flash_wgmma",   "skinny", "skinny_splits", "wgmma",    "stacked",
                          "fused_convert", "pdl",    "defaults:"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strstr(h, keys[i])) fail_msg("help lacks '%s'", keys[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_are_the_documented_ones),
        cmocka_unit_test(test_each_key_sets_its_field),
        cmocka_unit_test(test_printed_list_reads_back),
        cmocka_unit_test(test_bad_items_are_refused_by_name),
        cmocka_unit_test(test_environment_variable),
        cmocka_unit_test(test_help_lists_every_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

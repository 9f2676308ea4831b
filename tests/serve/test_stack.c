/*
 * test_stack: the set-up pieces the tools share (serve/stack.h): the
 * embedder by folder (optional default, "none", a missing folder), the
 * model's message naming the file, and stack_open_records, the answering
 * half over a record store of its own that `ask` and `eval` use.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* After the headers it needs. */
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "serve/stack.h"
#include "test_util.h"

static char g_dir[256];

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_stack_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

static void test_embedder_open(void **state) {
    embedder *e = (embedder *)1;
    char name[64];
    /* "none": no embedder, and the store names it so. */
    assert_int_equal(stack_embedder_open("none", false, 0, &e, name, sizeof name), IS_OK);
    assert_null(e);
    assert_string_equal(name, "none");
    /* A folder named but missing: an error saying how to get it. */
    char missing[320];
    snprintf(missing, sizeof missing, "%s/no-such-embedder", g_dir);
    assert_int_equal(stack_embedder_open(missing, true, 0, &e, name, sizeof name),
                     IS_ERR_NOT_FOUND);
    assert_null(e);
    assert_non_null(strstr(is_error_last(), "no-such-embedder"));
    assert_non_null(strstr(is_error_last(), "'none'"));
    /* The default, from a folder where it is not (the test runs in the
     * build tree): optional gives BM25 only, required an error. */
    struct stat sb;
    if (stat(STACK_DEFAULT_EMBEDDER, &sb) == 0) return; /* run from the source tree */
    assert_int_equal(stack_embedder_open(NULL, true, 0, &e, name, sizeof name), IS_OK);
    assert_null(e);
    assert_string_equal(name, "none");
    assert_int_equal(stack_embedder_open(NULL, false, 0, &e, name, sizeof name), IS_ERR_NOT_FOUND);
}

static void test_open_records(void **state) {
    char rec[400], bad[400];
    snprintf(rec, sizeof rec, "%s/a/b/kv", g_dir);
    snprintf(bad, sizeof bad, "%s/missing.gguf", g_dir);
    stack_records_params p = {
        .model_path = bad, .records_dir = rec, .cache_bytes = 1 << 20, .dtype = KV_DTYPE_F32};
    stack *s = (stack *)1;
    assert_int_not_equal(stack_open_records(&p, &s), IS_OK);
    assert_ptr_equal(s, (stack *)1); /* unchanged on failure */
    assert_non_null(strstr(is_error_last(), "cannot load model"));
    assert_non_null(strstr(is_error_last(), "missing.gguf"));
    p.records_dir = NULL;
    assert_int_equal(stack_open_records(&p, &s), IS_ERR_INVALID_ARG);

    struct stat sb;
    if (stat(IS_DEFAULT_MODEL, &sb) != 0) TEST_SKIP(TEST_NEEDS_MODEL);
    p.model_path = IS_DEFAULT_MODEL;
    p.records_dir = rec;
    p.n_threads = 1;
    p.n_ctx_max = 512;
    assert_int_equal(stack_open_records(&p, &s), IS_OK);
    assert_null(s->mem);
    assert_null(s->emb);
    assert_non_null(s->rs);
    assert_non_null(s->ask);
    assert_ptr_equal(ask_ctx_store(s->ask), s->rs);
    assert_int_equal(stat(rec, &sb), 0); /* made with its parents */
    assert_true(S_ISDIR(sb.st_mode));
    /* A fact encoded through it lands in that store. */
    ask_fact f = {"f1", "Alice plays the cello.", NULL, 0};
    bool did = false;
    assert_int_equal(ask_encode_fact(s->ask, &f, 0, &did), IS_OK);
    assert_true(did);
    assert_true(record_store_contains(s->rs, "f1"));
    stack_close(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_embedder_open, setup, teardown),
        cmocka_unit_test_setup_teardown(test_open_records, setup, teardown),
    };
    return test_run_group(tests, NULL, NULL);
}

/*
 * The public API (include/inferscale.h, and nothing else: this file also
 * proves the header compiles as plain C): loading errors, tokenisation,
 * sessions with prefix reuse, stop strings, finish reasons.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "inferscale.h"

static is_model *g_model;

static int setup(void **state) {
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    is_model_params p = is_model_default_params();
    return is_model_load(IS_DEFAULT_MODEL, p, &g_model) == IS_OK ? 0 : -1;
}

static int teardown(void **state) {
    is_model_free(g_model);
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

typedef struct text {
    char s[8192];
    size_t n;
    int calls;
    int stop_after; /* return false after this many calls (0 = never) */
} text;

static bool collect(const char *t, size_t l, void *ud) {
    text *x = ud;
    if (x->n + l < sizeof x->s) {
        memcpy(x->s + x->n, t, l);
        x->n += l;
        x->s[x->n] = 0;
    }
    x->calls++;
    return !(x->stop_after && x->calls >= x->stop_after);
}

static void test_load_errors(void **state) {
    is_model *m = NULL;
    is_model_params p = is_model_default_params();
    assert_int_equal(is_model_load("/nonexistent/model.gguf", p, &m), IS_ERR_IO);
    assert_null(m);
    assert_non_null(strstr(is_error_last(), "/nonexistent/model.gguf"));
    p.backend = "tpu";
    assert_int_equal(is_model_load(IS_DEFAULT_MODEL, p, &m), IS_ERR_UNSUPPORTED);
    assert_null(m);
    assert_string_equal(is_status_to_string(IS_ERR_FORMAT), "malformed file or data");
}

static is_gen_params greedy(int32_t n) {
    is_gen_params g = is_gen_default_params();
    g.temperature = 0;
    g.max_tokens = n;
    return g;
}

static void tokenize(const char *s, bool special, int32_t **t, size_t *n) {
    assert_int_equal(is_tokenize(g_model, s, strlen(s), false, special, t, n), IS_OK);
}

static void test_generate_reuse_and_stop(void **state) {
    SKIP_WITHOUT_MODEL();
    is_session *s;
    assert_int_equal(is_session_create(g_model, is_session_default_params(), &s), IS_OK);
    is_chat_message msgs[] = {{"user", "List three colors, one per line."}};
    char *prompt;
    assert_int_equal(is_chat_render(g_model, msgs, 1, true, &prompt), IS_OK);
    int32_t *toks;
    size_t n;
    tokenize(prompt, true, &toks, &n);
    text a = {0};
    is_gen_stats st;
    assert_int_equal(is_session_generate(s, toks, n, greedy(32), collect, &a, &st), IS_OK);
    assert_true(st.n_generated > 0);
    assert_int_equal(st.n_prompt, (int32_t)n);
    assert_int_equal(st.n_prompt_reused, 0);
    printf("  greedy: \"%s\"\n", a.s);

    /* The same prompt again reuses all but its last token, and greedy
     * decoding gives the same text. */
    text b = {0};
    assert_int_equal(is_session_generate(s, toks, n, greedy(32), collect, &b, &st), IS_OK);
    assert_int_equal(st.n_prompt_reused, (int32_t)n - 1);
    assert_string_equal(a.s, b.s);

    /* A stop string taken from inside the greedy text ends generation
     * before it, and never reaches the callback. */
    assert_true(a.n > 8);
    char stop[8];
    memcpy(stop, a.s + a.n / 2, 3);
    stop[3] = 0;
    const char *stops[] = {stop};
    is_gen_params g = greedy(32);
    g.stop = stops;
    g.n_stop = 1;
    text c = {0};
    assert_int_equal(is_session_generate(s, toks, n, g, collect, &c, &st), IS_OK);
    assert_int_equal(st.finish, IS_FINISH_STOP);
    assert_null(strstr(c.s, stop));
    const char *first = strstr(a.s, stop);
    assert_int_equal(c.n, (size_t)(first - a.s));
    assert_memory_equal(c.s, a.s, c.n);

    /* The callback can abort. */
    text d = {.stop_after = 2};
    assert_int_equal(is_session_generate(s, toks, n, greedy(32), collect, &d, &st), IS_OK);
    assert_int_equal(st.finish, IS_FINISH_ABORT);
    assert_int_equal(d.calls, 2);

    /* Length limit. */
    text e = {0};
    assert_int_equal(is_session_generate(s, toks, n, greedy(3), collect, &e, &st), IS_OK);
    assert_true(st.n_generated <= 3);
    free(toks);
    free(prompt);
    is_session_free(s);
}

static void test_prompt_past_context_is_refused(void **state) {
    SKIP_WITHOUT_MODEL();
    is_session *s;
    is_session_params sp = is_session_default_params();
    sp.n_ctx = 64;
    assert_int_equal(is_session_create(g_model, sp, &s), IS_OK);
    int32_t toks[100];
    for (int i = 0; i < 100; i++) toks[i] = 1000 + i;
    text t = {0};
    is_gen_stats st;
    assert_int_equal(is_session_generate(s, toks, 100, greedy(4), collect, &t, &st),
                     IS_ERR_CONTEXT_FULL);
    assert_int_equal(t.n, 0);
    toks[3] = -5;
    assert_int_equal(is_session_generate(s, toks, 10, greedy(4), collect, &t, &st),
                     IS_ERR_INVALID_ARG);
    /* Generation that reaches the end of the context stops cleanly. */
    assert_int_equal(is_session_generate(s, toks + 4, 60, greedy(100), collect, &t, &st), IS_OK);
    assert_true(st.n_generated <= 5);
    is_session_free(s);
}

static void test_tokenize_round_trip(void **state) {
    SKIP_WITHOUT_MODEL();
    const char *s = "Hello, world! 1234 ünïcödé 你好 🙂";
    int32_t *t;
    size_t n;
    tokenize(s, false, &t, &n);
    char out[256];
    size_t o = 0;
    for (size_t i = 0; i < n; i++) o += is_token_to_piece(g_model, t[i], out + o, sizeof out - o);
    out[o] = 0;
    assert_string_equal(out, s);
    free(t);
    /* Control tokens are recognised only when asked. */
    tokenize("<|im_end|>", true, &t, &n);
    assert_int_equal(n, 1);
    assert_true(is_token_is_eog(g_model, t[0]));
    free(t);
    tokenize("<|im_end|>", false, &t, &n);
    assert_true(n > 1);
    free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_generate_reuse_and_stop),
        cmocka_unit_test(test_prompt_past_context_is_refused),
        cmocka_unit_test(test_tokenize_round_trip),
    };
    return test_run_group(tests, setup, teardown);
}

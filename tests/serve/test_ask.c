/*
 * The ask path end to end on the default model: kv and prompt modes agree
 * where they must (one fact, w = 0: identical greedy answers), records are
 * encoded once, and bad records (another model's, corrupted, truncated)
 * make the request fail cleanly without touching the rest of the store.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv/record_store.h"
#include "serve/ask.h"
#include "test_sched.h"
#include "test_util.h"

static test_ask_stack g_st; /* backend, model, engine, record store, ask context */
static char g_dir[] = "/tmp/test_ask_XXXXXX";
#define MAX_TOKENS 24 /* of each answer */

static int setup(void **state) { return test_ask_stack_open(&g_st, 2048, g_dir); }

static int teardown(void **state) { return test_ask_stack_close(&g_st, g_dir); }

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_st.model) TEST_SKIP(TEST_NEEDS_MODEL);                                              \
    } while (0)

static void test_single_fact_kv_equals_prompt(void **state) {
    SKIP_WITHOUT_MODEL();
    ask_fact f = {"melanie-clarinet", "Melanie plays the clarinet and started as a child.", NULL,
                  0};
    bool did;
    assert_int_equal(ask_encode_fact(g_st.ask, &f, 0, &did), IS_OK);
    assert_true(did);
    assert_int_equal(ask_encode_fact(g_st.ask, &f, 0, &did), IS_OK);
    assert_false(did); /* already stored for this model, text and window */
    const char *ids[] = {f.id}, *texts[] = {f.text};
    test_text a = {0}, b = {0};
    ask_timing ta, tb;
    ask_request r = test_ask_greedy(ASK_MODE_KV, "What instrument does Melanie play?", ids, texts,
                                    1, MAX_TOKENS);
    assert_int_equal(ask_run(g_st.ask, &r, test_text_collect, &a, &ta), IS_OK);
    r.mode = ASK_MODE_PROMPT;
    assert_int_equal(ask_run(g_st.ask, &r, test_text_collect, &b, &tb), IS_OK);
    printf("  kv: \"%s\"\n  prompt: \"%s\"\n", a.s, b.s);
    assert_true(a.n > 0);
    assert_string_equal(a.s, b.s);
    assert_int_equal(ta.n_memory_tokens, tb.n_memory_tokens);
    /* kv prefills only the suffix; prompt prefills the memory too. */
    assert_int_equal(tb.n_prefilled - ta.n_prefilled, tb.n_memory_tokens);
}

/* Every bad record fails the request with a clear status; the good record
 * next to it still serves, and the bad file is left as it was. */
static void test_bad_records_fail_cleanly(void **state) {
    SKIP_WITHOUT_MODEL();
    ask_fact good = {"good", "Caroline moved from Sweden four years ago.", NULL, 0};
    ask_fact other = {"other-model", "Caroline has a guinea pig named Oscar.", NULL, 0};
    ask_fact corrupt = {"corrupt", "Melanie is learning to bake sourdough bread.", NULL, 0};
    ask_fact trunc = {"truncated", "Caroline attended a pride parade in June.", NULL, 0};
    bool did;
    assert_int_equal(ask_encode_fact(g_st.ask, &good, 0, &did), IS_OK);
    assert_int_equal(ask_encode_fact(g_st.ask, &corrupt, 0, &did), IS_OK);
    assert_int_equal(ask_encode_fact(g_st.ask, &trunc, 0, &did), IS_OK);

    /* A record made by another model: same shapes, another fingerprint. */
    const fact_kv *kv;
    assert_int_equal(record_store_get(g_st.store, "good", NULL, &kv), IS_OK);
    fact_kv_meta meta = kv->meta;
    memcpy(meta.model_fingerprint, "0123456789abcdef", 17);
    assert_int_equal(record_store_put(g_st.store, other.id, &meta, kv->tokens, kv->k, kv->v),
                     IS_OK);
    record_store_release(g_st.store, kv);

    /* Damage two files behind the store's back; close and reopen so no
     * cached copy hides them. */
    ask_ctx_free(g_st.ask);
    g_st.ask = NULL;
    record_store_close(g_st.store);
    g_st.store = NULL;
    char path[512];
    size_t n;
    snprintf(path, sizeof path, "%s/corrupt.fkv", g_dir);
    unsigned char *buf = test_read_file(path, &n);
    assert_non_null(buf);
    buf[n / 2] ^= 0x40;
    assert_true(test_write_file(path, buf, n));
    free(buf);
    snprintf(path, sizeof path, "%s/truncated.fkv", g_dir);
    buf = test_read_file(path, &n);
    assert_non_null(buf);
    assert_true(test_write_file(path, buf, n / 3));
    free(buf);
    assert_int_equal(record_store_open(g_dir, 64 << 20, &g_st.store), IS_OK);
    assert_int_equal(ask_ctx_create(g_st.engine, g_st.store, KV_DTYPE_F32, &g_st.ask), IS_OK);

    struct {
        const char *id;
        is_status want;
    } cases[] = {
        {"other-model", IS_ERR_MISMATCH},
        {"corrupt", IS_ERR_FORMAT},
        {"truncated", IS_ERR_FORMAT},
        {"missing", IS_ERR_NOT_FOUND},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *ids[] = {"good", cases[i].id}, *texts[] = {good.text, "x"};
        test_text out = {0};
        ask_request r = test_ask_greedy(ASK_MODE_KV, "Where did Caroline move from?", ids, texts, 2,
                                        MAX_TOKENS);
        is_status st = ask_run(g_st.ask, &r, test_text_collect, &out, NULL);
        printf("  %-12s -> %s: %s\n", cases[i].id, is_status_to_string(st), is_error_last());
        assert_int_equal(st, cases[i].want);
        assert_int_equal(out.n, 0); /* nothing generated */
    }
    /* The engine's sequences were all given back. */
    assert_true(kv_cache_check(engine_kv(g_st.engine)));
    /* The good record still serves; the corrupt and truncated files were
     * moved to corrupt/ (the store then reads as without them), the other
     * model's record, not damaged, is where it was. */
    const char *ids[] = {"good"}, *texts[] = {good.text};
    test_text out = {0};
    ask_request r =
        test_ask_greedy(ASK_MODE_KV, "Where did Caroline move from?", ids, texts, 1, MAX_TOKENS);
    assert_int_equal(ask_run(g_st.ask, &r, test_text_collect, &out, NULL), IS_OK);
    assert_true(out.n > 0);
    const char *moved[] = {"corrupt", "truncated"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s.fkv", g_dir, moved[i]);
        assert_int_not_equal(access(path, F_OK), 0);
        snprintf(path, sizeof path, "%s/" RECORD_STORE_CORRUPT_DIR "/%s.fkv", g_dir, moved[i]);
        assert_int_equal(access(path, F_OK), 0);
    }
    snprintf(path, sizeof path, "%s/other-model.fkv", g_dir);
    assert_int_equal(access(path, F_OK), 0);
    /* Re-encoding replaces a bad record. */
    assert_int_equal(ask_encode_fact(g_st.ask, &corrupt, 0, &did), IS_OK);
    assert_true(did);
    const char *ids2[] = {"corrupt"}, *texts2[] = {corrupt.text};
    r = test_ask_greedy(ASK_MODE_KV, "What is Melanie learning?", ids2, texts2, 1, MAX_TOKENS);
    assert_int_equal(ask_run(g_st.ask, &r, NULL, NULL, NULL), IS_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_fact_kv_equals_prompt),
        cmocka_unit_test(test_bad_records_fail_cleanly),
    };
    return test_run_group(tests, setup, teardown);
}

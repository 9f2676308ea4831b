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

#include "serve/ask.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static engine *g_engine;
static record_store *g_store;
static ask_ctx *g_ask;
static char g_dir[] = "/tmp/test_ask_XXXXXX";

typedef struct text_buf {
    char s[4096];
    size_t n;
} text_buf;

static bool collect(const char *t, size_t l, void *ud) {
    text_buf *b = ud;
    if (b->n + l < sizeof b->s) {
        memcpy(b->s + b->n, t, l);
        b->n += l;
        b->s[b->n] = 0;
    }
    return true;
}

static int setup(void **state) {
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    if (!mkdtemp(g_dir)) return -1;
    engine_params ep = engine_default_params();
    ep.max_seqs = 3;
    ep.n_ctx = 2048;
    if (backend_cpu_create(0, &g_be) != IS_OK ||
        model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK ||
        engine_create(g_model, ep, &g_engine) != IS_OK ||
        record_store_open(g_dir, 64 << 20, &g_store) != IS_OK ||
        ask_ctx_create(g_engine, g_store, KV_DTYPE_F32, &g_ask) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    ask_ctx_free(g_ask);
    if (g_store) record_store_close(g_store);
    engine_free(g_engine);
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    if (g_model) {
        if (test_remove_tree(g_dir) != 0) return -1;
    }
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

static ask_request greedy(ask_mode mode, const char *q, const char *const *ids,
                          const char *const *texts, int n) {
    ask_request r = {.mode = mode,
                     .query = q,
                     .fact_ids = ids,
                     .fact_texts = texts,
                     .n_facts = n,
                     .max_tokens = 24,
                     .temperature = 0,
                     .top_k = 0,
                     .top_p = 1.0f};
    return r;
}

static void test_single_fact_kv_equals_prompt(void **state) {
    SKIP_WITHOUT_MODEL();
    ask_fact f = {"melanie-clarinet", "Melanie plays the clarinet and started as a child.", NULL,
                  0};
    bool did;
    assert_int_equal(ask_encode_fact(g_ask, &f, 0, &did), IS_OK);
    assert_true(did);
    assert_int_equal(ask_encode_fact(g_ask, &f, 0, &did), IS_OK);
    assert_false(did); /* already stored for this model, text and window */
    const char *ids[] = {f.id}, *texts[] = {f.text};
    text_buf a = {0}, b = {0};
    ask_timing ta, tb;
    ask_request r = greedy(ASK_MODE_KV, "What instrument does Melanie play?", ids, texts, 1);
    assert_int_equal(ask_run(g_ask, &r, collect, &a, &ta), IS_OK);
    r.mode = ASK_MODE_PROMPT;
    assert_int_equal(ask_run(g_ask, &r, collect, &b, &tb), IS_OK);
    printf("  kv: \"%s\"\n  prompt: \"%s\"\n", a.s, b.s);
    assert_true(a.n > 0);
    assert_string_equal(a.s, b.s);
    assert_int_equal(ta.n_memory_tokens, tb.n_memory_tokens);
    /* kv prefills only the suffix; prompt prefills the memory too. */
    assert_int_equal(tb.n_prefilled - ta.n_prefilled, tb.n_memory_tokens);
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void *read_whole(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *b = malloc(*n);
    assert_int_equal(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
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
    assert_int_equal(ask_encode_fact(g_ask, &good, 0, &did), IS_OK);
    assert_int_equal(ask_encode_fact(g_ask, &corrupt, 0, &did), IS_OK);
    assert_int_equal(ask_encode_fact(g_ask, &trunc, 0, &did), IS_OK);

    /* A record made by another model: same shapes, another fingerprint. */
    const fact_kv *kv;
    assert_int_equal(record_store_get(g_store, "good", NULL, &kv), IS_OK);
    fact_kv_meta meta = kv->meta;
    memcpy(meta.model_fingerprint, "0123456789abcdef", 17);
    assert_int_equal(record_store_put(g_store, other.id, &meta, kv->tokens, kv->k, kv->v), IS_OK);
    record_store_release(g_store, kv);

    /* Damage two files behind the store's back; close and reopen so no
     * cached copy hides them. */
    ask_ctx_free(g_ask);
    g_ask = NULL;
    record_store_close(g_store);
    g_store = NULL;
    char path[512];
    size_t n;
    snprintf(path, sizeof path, "%s/corrupt.fkv", g_dir);
    unsigned char *buf = read_whole(path, &n);
    buf[n / 2] ^= 0x40;
    write_file(path, buf, n);
    free(buf);
    snprintf(path, sizeof path, "%s/truncated.fkv", g_dir);
    buf = read_whole(path, &n);
    write_file(path, buf, n / 3);
    free(buf);
    assert_int_equal(record_store_open(g_dir, 64 << 20, &g_store), IS_OK);
    assert_int_equal(ask_ctx_create(g_engine, g_store, KV_DTYPE_F32, &g_ask), IS_OK);

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
        text_buf out = {0};
        ask_request r = greedy(ASK_MODE_KV, "Where did Caroline move from?", ids, texts, 2);
        is_status st = ask_run(g_ask, &r, collect, &out, NULL);
        printf("  %-12s -> %s: %s\n", cases[i].id, is_status_to_string(st), is_error_last());
        assert_int_equal(st, cases[i].want);
        assert_int_equal(out.n, 0); /* nothing generated */
    }
    /* The engine's sequences were all given back. */
    assert_true(kv_cache_check(engine_kv(g_engine)));
    /* The good record still serves, and the bad files are still there. */
    const char *ids[] = {"good"}, *texts[] = {good.text};
    text_buf out = {0};
    ask_request r = greedy(ASK_MODE_KV, "Where did Caroline move from?", ids, texts, 1);
    assert_int_equal(ask_run(g_ask, &r, collect, &out, NULL), IS_OK);
    assert_true(out.n > 0);
    snprintf(path, sizeof path, "%s/corrupt.fkv", g_dir);
    assert_int_equal(access(path, F_OK), 0);
    /* Re-encoding replaces a bad record. */
    assert_int_equal(ask_encode_fact(g_ask, &corrupt, 0, &did), IS_OK);
    assert_true(did);
    const char *ids2[] = {"corrupt"}, *texts2[] = {corrupt.text};
    r = greedy(ASK_MODE_KV, "What is Melanie learning?", ids2, texts2, 1);
    assert_int_equal(ask_run(g_ask, &r, NULL, NULL, NULL), IS_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_fact_kv_equals_prompt),
        cmocka_unit_test(test_bad_records_fail_cleanly),
    };
    return test_run_group(tests, setup, teardown);
}

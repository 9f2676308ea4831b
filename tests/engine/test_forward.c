/*
 * Forward pass against the reference (transformers on the same GGUF, f32),
 * whose outputs tools/make_golden_logits.py wrote to tests/golden/logits/:
 * last-position logits within 1e-3 of the logit range with the same argmax,
 * every position of the short prompt, and 32 greedy tokens. Then the paged
 * cache: one prefill, many chunks, and interleaving with other sequences all
 * give the same logits.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/engine.h"
#include "test_util.h"
#include "engine/sampler.h"

#define GOLDEN IS_GOLDEN_DIR "/logits"

typedef struct golden_prompt {
    char name[32];
    int32_t *tokens;
    int32_t n_tokens;
    float *last; /* [n_vocab] */
    float *all;  /* [n_tokens][n_vocab] or NULL */
    int32_t greedy[32];
} golden_prompt;

static backend *g_be;
static model *g_model;
static golden_prompt g_prompts[8];
static int g_n_prompts;

static float *read_f32(const char *name, size_t expect) {
    char path[512];
    snprintf(path, sizeof path, GOLDEN "/%s", name);
    size_t n;
    float *d = test_read_file(path, &n);
    if (!d || n != expect * sizeof(float)) {
        fprintf(stderr, "golden file %s: expected %zu floats\n", path, expect);
        abort();
    }
    return d;
}

static int setup(void **state) {
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0; /* tests skip */
    assert_int_equal(backend_cpu_create(0, &g_be), IS_OK);
    if (model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK) {
        fprintf(stderr, "model_load: %s\n", is_error_last());
        return -1;
    }
    size_t n;
    char *json = test_read_file(GOLDEN "/manifest.json", &n);
    if (!json) return -1;
    cJSON *root = cJSON_Parse(json);
    free(json);
    const cJSON *ps = cJSON_GetObjectItem(root, "prompts");
    int32_t V = g_model->cfg.n_vocab;
    const cJSON *p;
    cJSON_ArrayForEach(p, ps) {
        golden_prompt *g = &g_prompts[g_n_prompts++];
        snprintf(g->name, sizeof g->name, "%s", cJSON_GetObjectItem(p, "name")->valuestring);
        const cJSON *toks = cJSON_GetObjectItem(p, "tokens");
        g->n_tokens = cJSON_GetArraySize(toks);
        g->tokens = malloc((size_t)g->n_tokens * sizeof(int32_t));
        for (int32_t i = 0; i < g->n_tokens; i++)
            g->tokens[i] = cJSON_GetArrayItem(toks, i)->valueint;
        g->last = read_f32(cJSON_GetObjectItem(p, "last_logits")->valuestring, (size_t)V);
        const cJSON *all = cJSON_GetObjectItem(p, "all_logits");
        if (cJSON_IsString(all)) g->all = read_f32(all->valuestring, (size_t)V * g->n_tokens);
        const cJSON *gr = cJSON_GetObjectItem(p, "greedy");
        assert_int_equal(cJSON_GetArraySize(gr), 32);
        for (int i = 0; i < 32; i++) g->greedy[i] = cJSON_GetArrayItem(gr, i)->valueint;
    }
    cJSON_Delete(root);
    return 0;
}

static int teardown(void **state) {
    for (int i = 0; i < g_n_prompts; i++) {
        free(g_prompts[i].tokens);
        free(g_prompts[i].last);
        free(g_prompts[i].all);
    }
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* max |a - ref| / (max(ref) - min(ref)) */
static engine *make_engine(int32_t max_seqs, int32_t max_batch) {
    engine_params ep = engine_default_params();
    ep.n_ctx = 4096;
    ep.max_seqs = max_seqs;
    ep.max_batch = max_batch;
    engine *e = NULL;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    return e;
}

/* Feeds tokens to `seq` in one call; logits of the last token. */
static void feed(engine *e, int32_t seq, const int32_t *toks, int32_t n, float *logits) {
    int32_t *s = malloc((size_t)n * sizeof *s);
    for (int32_t i = 0; i < n; i++) s[i] = seq;
    engine_batch b = {.n_tokens = n, .tokens = toks, .seq = s};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    free(s);
}

static void test_last_logits_match_reference(void **state) {
    SKIP_WITHOUT_MODEL();
    int32_t V = g_model->cfg.n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    engine *e = make_engine(1, 512);
    for (int i = 0; i < g_n_prompts; i++) {
        golden_prompt *g = &g_prompts[i];
        int32_t seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        feed(e, seq, g->tokens, g->n_tokens, logits);
        double err = test_rel_range_err(logits, g->last, V);
        printf("  %-8s %5d tokens: max |diff| / range = %.2e, argmax %d (ref %d)\n", g->name,
               g->n_tokens, err, argmax(logits, V), argmax(g->last, V));
        assert_true(err <= 1e-3);
        assert_int_equal(argmax(logits, V), argmax(g->last, V));
        engine_seq_close(e, seq);
    }
    engine_free(e);
    free(logits);
}

static void test_all_positions_match_reference(void **state) {
    SKIP_WITHOUT_MODEL();
    int32_t V = g_model->cfg.n_vocab;
    for (int i = 0; i < g_n_prompts; i++) {
        golden_prompt *g = &g_prompts[i];
        if (!g->all) continue;
        float *logits = malloc((size_t)V * g->n_tokens * sizeof(float));
        bool *want = malloc((size_t)g->n_tokens);
        int32_t *s = calloc((size_t)g->n_tokens, sizeof *s);
        for (int32_t t = 0; t < g->n_tokens; t++) want[t] = true;
        engine *e = make_engine(2, 512);
        int32_t seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        engine_batch b = {
            .n_tokens = g->n_tokens, .tokens = g->tokens, .seq = s, .want_logits = want};
        assert_int_equal(engine_decode(e, &b, logits), IS_OK);
        for (int32_t t = 0; t < g->n_tokens; t++) {
            double err = test_rel_range_err(logits + (size_t)t * V, g->all + (size_t)t * V, V);
            assert_true(err <= 1e-3);
            assert_int_equal(argmax(logits + (size_t)t * V, V), argmax(g->all + (size_t)t * V, V));
        }
        /* The greedy form of the same batch: every row's choice, the
         * reference's argmax. */
        int32_t *tok = malloc((size_t)g->n_tokens * sizeof *tok);
        int32_t seq2;
        assert_int_equal(engine_seq_open(e, &seq2), IS_OK);
        for (int32_t t = 0; t < g->n_tokens; t++) s[t] = seq2;
        assert_int_equal(engine_decode_greedy(e, &b, tok), IS_OK);
        for (int32_t t = 0; t < g->n_tokens; t++)
            assert_int_equal(tok[t], argmax(g->all + (size_t)t * V, V));
        free(tok);
        engine_free(e);
        free(logits);
        free(want);
        free(s);
    }
}

static void test_greedy_continuation_matches_reference(void **state) {
    SKIP_WITHOUT_MODEL();
    int32_t V = g_model->cfg.n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    engine *e = make_engine(1, 512);
    for (int i = 0; i < g_n_prompts; i++) {
        golden_prompt *g = &g_prompts[i];
        int32_t seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        feed(e, seq, g->tokens, g->n_tokens, logits);
        for (int k = 0; k < 32; k++) {
            int32_t tok = sampler_argmax(logits, V);
            if (tok != g->greedy[k])
                fail_msg("%s: greedy token %d is %d, reference %d", g->name, k, tok, g->greedy[k]);
            feed(e, seq, &tok, 1, logits);
        }
        engine_seq_close(e, seq);
        /* The same continuation chosen by engine_decode_greedy: with the
         * backend's argmax op (no logits leave the backend), then with a
         * backend that has none (the engine's row-by-row download). */
        const backend_ops *ops = g_be->ops;
        backend_ops without = *ops;
        without.argmax = NULL;
        for (int pass = 0; pass < 2; pass++) {
            g_be->ops = pass ? &without : ops;
            assert_int_equal(engine_seq_open(e, &seq), IS_OK);
            int32_t *s = malloc((size_t)g->n_tokens * sizeof *s);
            for (int32_t t = 0; t < g->n_tokens; t++) s[t] = seq;
            engine_batch b = {.n_tokens = g->n_tokens, .tokens = g->tokens, .seq = s};
            int32_t tok;
            assert_int_equal(engine_decode_greedy(e, &b, &tok), IS_OK);
            for (int k = 0; k < 32; k++) {
                if (tok != g->greedy[k])
                    fail_msg("%s: engine_decode_greedy's token %d is %d (%s), reference %d",
                             g->name, k, tok, pass ? "no argmax op" : "argmax op", g->greedy[k]);
                engine_batch one = {.n_tokens = 1, .tokens = &tok, .seq = &seq};
                int32_t next;
                assert_int_equal(engine_decode_greedy(e, &one, &next), IS_OK);
                tok = next;
            }
            free(s);
            engine_seq_close(e, seq);
        }
        g_be->ops = ops;
    }
    engine_free(e);
    free(logits);
}

/* One prefill vs chunks of uneven sizes vs interleaved with two other
 * sequences in the same batches: same logits (up to float reassociation). */
static void test_paged_cache_chunking_and_interleaving(void **state) {
    SKIP_WITHOUT_MODEL();
    int32_t V = g_model->cfg.n_vocab;
    const golden_prompt *g = NULL;
    for (int i = 0; i < g_n_prompts; i++)
        if (strcmp(g_prompts[i].name, "medium") == 0) g = &g_prompts[i];
    assert_non_null(g);
    int32_t n = g->n_tokens;
    float *one = malloc((size_t)V * sizeof(float));
    float *chunked = malloc((size_t)V * sizeof(float));
    float *mixed = malloc((size_t)V * 3 * sizeof(float));

    engine *e = make_engine(4, 512);
    int32_t s0;
    assert_int_equal(engine_seq_open(e, &s0), IS_OK);
    feed(e, s0, g->tokens, n, one);
    engine_seq_close(e, s0);

    /* Chunks of 1, 7, 33, 100, ... tokens. Small max_batch also splits calls. */
    engine *e2 = make_engine(4, 64);
    int32_t s1;
    assert_int_equal(engine_seq_open(e2, &s1), IS_OK);
    int32_t sizes[] = {1, 7, 33, 100, 3};
    for (int32_t done = 0, k = 0; done < n; k++) {
        int32_t c = sizes[k % 5];
        if (c > n - done) c = n - done;
        feed(e2, s1, g->tokens + done, c, chunked);
        done += c;
    }
    double err = test_rel_range_err(chunked, one, V);
    printf("  chunked vs one prefill: %.2e\n", err);
    assert_true(err <= 1e-4);
    assert_int_equal(argmax(chunked, V), argmax(one, V));

    /* Interleaved: three sequences (the prompt, its reverse, a shifted copy)
     * fed round-robin in batches of mixed tokens, occupying blocks in
     * alternation so each sequence's block table is scattered. */
    engine *e3 = make_engine(4, 512);
    int32_t a, b, c;
    assert_int_equal(engine_seq_open(e3, &b), IS_OK);
    assert_int_equal(engine_seq_open(e3, &a), IS_OK);
    assert_int_equal(engine_seq_open(e3, &c), IS_OK);
    int32_t *rev = malloc((size_t)n * sizeof *rev);
    for (int32_t i = 0; i < n; i++) rev[i] = g->tokens[n - 1 - i];
    int32_t step = 21;
    for (int32_t done = 0; done < n; done += step) {
        int32_t cnt = n - done < step ? n - done : step;
        int32_t toks[3 * 21], seqs[3 * 21];
        bool want[3 * 21] = {0};
        int32_t m = 0;
        for (int32_t i = 0; i < cnt; i++) {
            toks[m] = rev[done + i];
            seqs[m++] = b;
        }
        for (int32_t i = 0; i < cnt; i++) {
            toks[m] = g->tokens[done + i];
            seqs[m++] = a;
        }
        for (int32_t i = 0; i < cnt; i++) {
            toks[m] = g->tokens[(done + i + 5) % n];
            seqs[m++] = c;
        }
        bool last = done + cnt >= n;
        want[2 * cnt - 1] = last;
        engine_batch bt = {.n_tokens = m, .tokens = toks, .seq = seqs, .want_logits = want};
        assert_int_equal(engine_decode(e3, &bt, mixed), IS_OK);
    }
    err = test_rel_range_err(mixed, one, V);
    printf("  interleaved vs one prefill: %.2e\n", err);
    assert_true(err <= 1e-4);
    assert_int_equal(argmax(mixed, V), argmax(one, V));
    assert_true(kv_cache_check(engine_kv(e3)));

    free(rev);
    engine_free(e);
    engine_free(e2);
    engine_free(e3);
    free(one);
    free(chunked);
    free(mixed);
}

static void test_context_overflow_is_refused(void **state) {
    SKIP_WITHOUT_MODEL();
    engine_params ep = engine_default_params();
    ep.n_ctx = 32;
    ep.max_seqs = 1;
    engine *e = NULL;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    int32_t toks[40], s[40];
    for (int i = 0; i < 40; i++) {
        toks[i] = 100 + i;
        s[i] = seq;
    }
    float *logits = malloc((size_t)g_model->cfg.n_vocab * sizeof(float));
    engine_batch b = {.n_tokens = 20, .tokens = toks, .seq = s};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    b.n_tokens = 13; /* 33 > 32 */
    assert_int_equal(engine_decode(e, &b, logits), IS_ERR_CONTEXT_FULL);
    assert_int_equal(kv_seq_length(engine_kv(e), seq), 20);
    toks[0] = 1 << 30; /* bad token id */
    b.n_tokens = 1;
    assert_int_equal(engine_decode(e, &b, logits), IS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_length(engine_kv(e), seq), 20);
    free(logits);
    engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_last_logits_match_reference),
        cmocka_unit_test(test_all_positions_match_reference),
        cmocka_unit_test(test_greedy_continuation_matches_reference),
        cmocka_unit_test(test_paged_cache_chunking_and_interleaving),
        cmocka_unit_test(test_context_overflow_is_refused),
    };
    return test_run_group(tests, setup, teardown);
}

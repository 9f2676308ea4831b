/*
 * test_model: the engine tests' fixture on the default model (test_model.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_model.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const test_locomo_facts[TEST_N_LOCOMO_FACTS] = {
    "Caroline went to an LGBTQ support group on 7 May 2023.",
    "Melanie painted a sunrise over a lake last year.",
    "Caroline is planning to adopt children as a single parent.",
    "Melanie's kids love going camping in the mountains.",
    "Caroline moved from Sweden four years ago.",
    "Melanie ran a charity race for mental health on Saturday.",
    "Caroline is researching adoption agencies.",
    "Melanie has been married for five years.",
    "Caroline gave a talk at a school about her transition.",
    "Melanie plays the clarinet and started as a child.",
    "Caroline's grandmother gave her a necklace from Sweden.",
    "Melanie went to a pottery class with her kids in July.",
    "Caroline wants to become a counselor for trans youth.",
    "Melanie read 'Charlotte's Web' to her children.",
    "Caroline attended a pride parade in June.",
    "Melanie's family took a road trip to the Grand Canyon.",
    "Caroline has a guinea pig named Oscar.",
    "Melanie bought new running shoes last week.",
    "Caroline's friends threw her a birthday party.",
    "Melanie is learning to bake sourdough bread.",
    "Caroline volunteers at a youth center on weekends.",
    "Melanie's son broke his arm playing soccer.",
};

const char *const test_locomo_dated_facts[TEST_N_LOCOMO_DATED_FACTS] = {
    "[7 May 2023] Caroline went to an LGBTQ support group.",
    "[8 May 2023] Melanie painted a sunrise over a lake last year.",
    "[25 May 2023] Caroline moved from Sweden four years ago.",
    "[9 June 2023] Melanie ran a charity race for mental health.",
};

/* The default model (and the prompt, mp not NULL) on be; *m NULL without it. */
static int load(backend *be, model **m, memory_prompt **mp) {
    *m = NULL;
    if (mp) *mp = NULL;
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    if (model_load(IS_DEFAULT_MODEL, be, m) != IS_OK ||
        (mp && memory_prompt_create(*m, NULL, mp) != IS_OK)) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

int test_model_open(const char *backend_name, backend **be, model **m, memory_prompt **mp) {
    if (backend_create(backend_name, 0, be) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return load(*be, m, mp);
}

int test_model_close(backend *be, model *m, memory_prompt *mp) {
    memory_prompt_free(mp);
    model_free(m);
    if (be) be->ops->free(be);
    return 0;
}

int test_model_open_scratch(backend *be, model **m, char *dir) {
    if (load(be, m, NULL) != 0) return -1;
    if (*m && !mkdtemp(dir)) {
        fprintf(stderr, "setup: cannot make %s\n", dir);
        return -1;
    }
    return 0;
}

int test_model_close_scratch(backend *be, model *m, const char *dir) {
    bool made = m;
    test_model_close(be, m, NULL);
    return made && test_remove_tree(dir) != 0 ? -1 : 0;
}

engine_params test_engine_params(int32_t n_ctx, int32_t max_seqs, int32_t max_batch) {
    engine_params ep = engine_default_params();
    ep.n_ctx = n_ctx;
    ep.max_seqs = max_seqs;
    if (max_batch > 0) ep.max_batch = max_batch;
    return ep;
}

engine *test_engine_create(model *m, engine_params ep) {
    engine *e = NULL;
    if (engine_create(m, ep, &e) != IS_OK) fail_msg("engine_create: %s", is_error_last());
    return e;
}

/* One sequence id per token: engine_batch.seq for a batch of one sequence. */
static int32_t *seq_ids(int32_t seq, int32_t n) {
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    assert_non_null(ids);
    for (int32_t i = 0; i < n; i++) ids[i] = seq;
    return ids;
}

void test_decode_seq(engine *e, int32_t seq, const int32_t *toks, int32_t n, float *logits) {
    int32_t *ids = seq_ids(seq, n);
    engine_batch b = {.n_tokens = n, .tokens = toks, .seq = ids};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    free(ids);
}

void test_prefill(engine *e, const int32_t *toks, int32_t n, engine_kv_capture *cap,
                  float *logits) {
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    int32_t *ids = seq_ids(seq, n);
    engine_batch b = {.n_tokens = n, .tokens = toks, .seq = ids, .capture = cap};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    free(ids);
    engine_seq_close(e, seq);
}

void test_fact_encode(engine *e, const memory_prompt *mp, const char *text, test_fact *f) {
    const model_config *c = &engine_model(e)->cfg;
    memset(f, 0, sizeof *f);
    assert_int_equal(memory_prompt_fact(mp, text, &f->toks, &f->n), IS_OK);
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    int32_t *toks = malloc((size_t)(np + f->n) * sizeof *toks);
    size_t sz = (size_t)c->n_layers * f->n * c->n_kv_heads * c->head_dim;
    f->k = malloc(sz * sizeof(float));
    f->v = malloc(sz * sizeof(float));
    float *logits = malloc((size_t)c->n_vocab * sizeof(float));
    assert_true(toks && f->k && f->v && logits);
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    memcpy(toks + np, f->toks, (size_t)f->n * sizeof *toks);
    engine_kv_capture cap = {.first = np, .n = f->n, .k = f->k, .v = f->v};
    test_prefill(e, toks, np + f->n, &cap, logits);
    free(logits);
    free(toks);
}

void test_facts_free(test_fact *f, int n) {
    for (int i = 0; i < n; i++) {
        free(f[i].toks);
        free(f[i].k);
        free(f[i].v);
    }
}

void test_facts_to_engine(const test_fact *f, int n, engine_fact *out) {
    for (int i = 0; i < n; i++) out[i] = (engine_fact){f[i].n, f[i].toks, f[i].k, f[i].v};
}

int32_t test_prefix_open(engine *e, const memory_prompt *mp, float *logits) {
    int32_t np, ps;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    assert_int_equal(engine_seq_open(e, &ps), IS_OK);
    test_decode_seq(e, ps, pre, np, logits);
    return ps;
}

void test_prefix_logits(engine *e, const memory_prompt *mp, int32_t ps, float *logits) {
    int32_t np, seq;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, ps, np - 1), IS_OK);
    test_decode_seq(e, seq, pre + np - 1, 1, logits);
    engine_seq_close(e, seq);
}

int32_t test_prompt_tokens(const memory_prompt *mp, const test_fact *f, int n, const int32_t *suf,
                           int32_t ns, int32_t *toks, int32_t cap) {
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    int32_t total = np + ns;
    for (int i = 0; i < n; i++) total += f[i].n;
    assert_true(total <= cap);
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    int32_t at = np;
    for (int i = 0; i < n; i++) {
        memcpy(toks + at, f[i].toks, (size_t)f[i].n * sizeof *toks);
        at += f[i].n;
    }
    memcpy(toks + at, suf, (size_t)ns * sizeof *toks);
    return total;
}

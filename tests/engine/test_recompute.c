/*
 * Static recomputation of injected memory tokens (engine_recompute), on the
 * CPU in f32, against references that do not use it:
 *  - every token of every fact recomputed (m past the longest fact): the
 *    query's logits equal a plain prefill of prefix, facts and query (prompt
 *    mode), since each recomputed token then sees exactly what it sees
 *    there;
 *  - none recomputed: injection as it was (the same logits as without the
 *    call);
 *  - the first m = 3 tokens: logits between the two (neither equals), and
 *    the serving prefix, shared by reference with the sequence, unchanged
 *    (a fresh fork of it gives the logits it gave before);
 *  - bad positions (outside the memory, not increasing) are refused before
 *    anything runs;
 *  - fused (engine_batch.rewrite: the recomputed tokens and the query in one
 *    forward): the same logits as engine_recompute followed by the query's
 *    prefill (1e-5 of the range), every token recomputed equals prompt
 *    mode; a rewrite after an appended token of its sequence is refused
 *    with the sequence unchanged.
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

#include "engine/engine.h"
#include "serve/memory_prompt.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;

static const char *FACTS[] = {
    "[7 May 2023] Caroline went to an LGBTQ support group.",
    "[8 May 2023] Melanie painted a sunrise over a lake last year.",
    "[25 May 2023] Caroline moved from Sweden four years ago.",
};
#define N_FACTS 3

typedef struct fact {
    int32_t *toks, n;
    float *k, *v;
} fact;

static int32_t kv_dim(void) { return g_model->cfg.n_kv_heads * g_model->cfg.head_dim; }

static engine *make_engine(void) {
    engine_params ep = engine_default_params();
    ep.n_ctx = 1024;
    ep.max_seqs = 4;
    ep.max_batch = 256;
    engine *e = NULL;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    return e;
}

/* Keys and values of a fact encoded right after the serving prefix. */
static void encode(engine *e, const char *text, fact *f) {
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_fact(g_mp, text, &f->toks, &f->n), IS_OK);
    size_t sz = (size_t)g_model->cfg.n_layers * f->n * kv_dim();
    f->k = malloc(sz * sizeof(float));
    f->v = malloc(sz * sizeof(float));
    int32_t toks[512], seqs[512], seq;
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    memcpy(toks + np, f->toks, (size_t)f->n * sizeof *toks);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int i = 0; i < np + f->n; i++) seqs[i] = seq;
    engine_kv_capture cap = {.first = np, .n = f->n, .k = f->k, .v = f->v};
    float *logits = malloc((size_t)g_model->cfg.n_vocab * sizeof(float));
    engine_batch b = {.n_tokens = np + f->n, .tokens = toks, .seq = seqs, .capture = &cap};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    engine_seq_close(e, seq);
    free(logits);
}

/* The query's last logits after the facts injected into a fork of the
 * cached prefix (prefix_seq), with their first m tokens recomputed (m < 0:
 * no call), by engine_recompute before the query's prefill or (fused) in
 * the query's forward. */
static void kv_logits_x(engine *e, int32_t prefix_seq, const fact *f, int m, bool fused,
                        const int32_t *suf, int32_t ns, float *out) {
    int32_t np, seq, seqs[512];
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, prefix_seq, np), IS_OK);
    engine_fact ef[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) ef[i] = (engine_fact){f[i].n, f[i].toks, f[i].k, f[i].v};
    assert_int_equal(engine_inject(e, seq, ef, N_FACTS), IS_OK);
    if (m >= 0) {
        int32_t pos[512], toks[512], n = 0, off = np;
        for (int i = 0; i < N_FACTS; i++) {
            for (int j = 0; j < f[i].n && j < m; j++) {
                pos[n] = off + j;
                toks[n++] = f[i].toks[j];
            }
            off += f[i].n;
        }
        if (fused) {
            int32_t rw[512], len = kv_seq_length(engine_kv(e), seq);
            assert_true(n + ns <= 512);
            for (int i = 0; i < 512; i++) seqs[i] = seq;
            for (int i = 0; i < n + ns; i++) rw[i] = i < n ? pos[i] : -1;
            memcpy(toks + n, suf, (size_t)ns * sizeof *toks);
            engine_batch b = {.n_tokens = n + ns, .tokens = toks, .seq = seqs, .rewrite = rw};
            assert_int_equal(engine_decode(e, &b, out), IS_OK);
            assert_int_equal(kv_seq_length(engine_kv(e), seq), len + ns);
            engine_seq_close(e, seq);
            return;
        }
        assert_int_equal(engine_recompute(e, seq, pos, toks, n), IS_OK);
    }
    for (int i = 0; i < 512; i++) seqs[i] = seq;
    engine_batch b = {.n_tokens = ns, .tokens = suf, .seq = seqs};
    assert_int_equal(engine_decode(e, &b, out), IS_OK);
    engine_seq_close(e, seq);
}

static void kv_logits(engine *e, int32_t prefix_seq, const fact *f, int m, const int32_t *suf,
                      int32_t ns, float *out) {
    kv_logits_x(e, prefix_seq, f, m, false, suf, ns, out);
}

static void test_recompute(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    const int32_t V = g_model->cfg.n_vocab;
    engine *e = make_engine();
    fact f[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) encode(e, FACTS[i], &f[i]);
    int32_t np, ns, *suf;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);

    /* The cached prefix, and what a fork of it gives before anything else. */
    int32_t ps, seqs[512];
    assert_int_equal(engine_seq_open(e, &ps), IS_OK);
    for (int i = 0; i < 512; i++) seqs[i] = ps;
    float *pre_before = malloc((size_t)V * sizeof(float)),
          *pre_after = malloc((size_t)V * sizeof(float));
    engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = seqs};
    assert_int_equal(engine_decode(e, &bp, pre_before), IS_OK);

    /* Prompt mode: everything prefilled in place. */
    float *prompt = malloc((size_t)V * sizeof(float)), *kv = malloc((size_t)V * sizeof(float));
    float *none = malloc((size_t)V * sizeof(float)), *all = malloc((size_t)V * sizeof(float));
    float *some = malloc((size_t)V * sizeof(float));
    int32_t toks[512], n = 0, s2, sq2[512];
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    n = np;
    for (int i = 0; i < N_FACTS; i++) {
        memcpy(toks + n, f[i].toks, (size_t)f[i].n * sizeof *toks);
        n += f[i].n;
    }
    memcpy(toks + n, suf, (size_t)ns * sizeof *toks);
    n += ns;
    assert_true(n < 512);
    assert_int_equal(engine_seq_open(e, &s2), IS_OK);
    for (int i = 0; i < 512; i++) sq2[i] = s2;
    engine_batch bw = {.n_tokens = n, .tokens = toks, .seq = sq2};
    assert_int_equal(engine_decode(e, &bw, prompt), IS_OK);
    engine_seq_close(e, s2);

    kv_logits(e, ps, f, -1, suf, ns, kv);
    kv_logits(e, ps, f, 0, suf, ns, none);
    kv_logits(e, ps, f, 1000, suf, ns, all);
    kv_logits(e, ps, f, 3, suf, ns, some);
    double e_none = test_rel_range_err(none, kv, V), e_all = test_rel_range_err(all, prompt, V);
    double kv_vs_prompt = test_rel_range_err(kv, prompt, V);
    double some_kv = test_rel_range_err(some, kv, V),
           some_prompt = test_rel_range_err(some, prompt, V);
    printf("  none recomputed vs kv %.2e; all recomputed vs prompt %.2e (kv vs prompt %.2e)\n",
           e_none, e_all, kv_vs_prompt);
    printf("  first 3 recomputed: vs kv %.2e, vs prompt %.2e\n", some_kv, some_prompt);
    assert_true(e_none == 0.0);
    assert_true(e_all <= 1e-4);
    assert_true(kv_vs_prompt > 1e-2); /* else the comparison above proves nothing */
    assert_true(some_kv > 1e-3 && some_prompt > 1e-3);

    /* Fused into the query's forward: the same as recomputing first. */
    float *fused = malloc((size_t)V * sizeof(float));
    kv_logits_x(e, ps, f, 3, true, suf, ns, fused);
    double e_fused = test_rel_range_err(fused, some, V);
    kv_logits_x(e, ps, f, 1000, true, suf, ns, fused);
    double e_fused_all = test_rel_range_err(fused, prompt, V);
    printf("  fused, first 3: vs recompute then query %.2e; fused, all: vs prompt %.2e\n", e_fused,
           e_fused_all);
    assert_true(e_fused <= 1e-5);
    assert_true(e_fused_all <= 1e-4);
    free(fused);

    /* The shared prefix blocks were never written. */
    int32_t s3, sq3[512];
    assert_int_equal(engine_seq_open(e, &s3), IS_OK);
    assert_int_equal(engine_seq_fork(e, s3, ps, np - 1), IS_OK);
    for (int i = 0; i < 512; i++) sq3[i] = s3;
    engine_batch bl = {.n_tokens = 1, .tokens = pre + np - 1, .seq = sq3};
    assert_int_equal(engine_decode(e, &bl, pre_after), IS_OK);
    assert_true(test_rel_range_err(pre_after, pre_before, V) <= 1e-5);
    engine_seq_close(e, s3);

    /* Bad positions: refused, nothing run. */
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, ps, np), IS_OK);
    engine_fact ef = {f[0].n, f[0].toks, f[0].k, f[0].v};
    assert_int_equal(engine_inject(e, seq, &ef, 1), IS_OK);
    int32_t p_out[1] = {np - 1}, p_dec[2] = {np + 1, np}, t2[2] = {f[0].toks[0], f[0].toks[1]};
    assert_int_equal(engine_recompute(e, seq, p_out, t2, 1), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_recompute(e, seq, p_dec, t2, 2), IS_ERR_INVALID_ARG);
    int32_t p_end[1] = {np + f[0].n};
    assert_int_equal(engine_recompute(e, seq, p_end, t2, 1), IS_ERR_INVALID_ARG);
    /* Fused: a rewrite after an appended token of its sequence, or outside
     * the memory, is refused and nothing is appended. */
    int32_t len0 = kv_seq_length(engine_kv(e), seq), sq[2] = {seq, seq};
    int32_t rw_late[2] = {-1, np}, rw_out[2] = {np - 1, -1};
    engine_batch late = {.n_tokens = 2, .tokens = t2, .seq = sq, .rewrite = rw_late};
    engine_batch outside = {.n_tokens = 2, .tokens = t2, .seq = sq, .rewrite = rw_out};
    float *junk = malloc((size_t)V * sizeof(float));
    assert_int_equal(engine_decode(e, &late, junk), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_decode(e, &outside, junk), IS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_length(engine_kv(e), seq), len0);
    free(junk);
    engine_seq_close(e, seq);

    engine_seq_close(e, ps);
    for (int i = 0; i < N_FACTS; i++) {
        free(f[i].toks);
        free(f[i].k);
        free(f[i].v);
    }
    free(suf);
    free(pre_before);
    free(pre_after);
    free(prompt);
    free(kv);
    free(none);
    free(all);
    free(some);
    engine_free(e);
}

static int setup(void **state) {
    (void)state;
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    if (backend_cpu_create(0, &g_be) != IS_OK) return -1;
    if (model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK) return -1;
    if (memory_prompt_create(g_model, NULL, &g_mp) != IS_OK) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    memory_prompt_free(g_mp);
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_recompute)};
    return test_run_group(tests, setup, teardown);
}

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

#include "engine/engine.h"
#include "serve/memory_prompt.h"
#include "test_model.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;

#define N_FACTS 3 /* the first of test_locomo_dated_facts */

static engine *make_engine(void) {
    return test_engine_create(g_model, test_engine_params(1024, 4, 256));
}

/* The query's last logits after the facts injected into a fork of the
 * cached prefix (prefix_seq), with their first m tokens recomputed (m < 0:
 * no call), by engine_recompute before the query's prefill or (fused) in
 * the query's forward. */
static void kv_logits_x(engine *e, int32_t prefix_seq, const test_fact *f, int m, bool fused,
                        const int32_t *suf, int32_t ns, float *out) {
    int32_t np, seq, seqs[512];
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, prefix_seq, np), IS_OK);
    engine_fact ef[N_FACTS];
    test_facts_to_engine(f, N_FACTS, ef);
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

static void kv_logits(engine *e, int32_t prefix_seq, const test_fact *f, int m, const int32_t *suf,
                      int32_t ns, float *out) {
    kv_logits_x(e, prefix_seq, f, m, false, suf, ns, out);
}

static void test_recompute(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    const int32_t V = g_model->cfg.n_vocab;
    engine *e = make_engine();
    test_fact f[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) test_fact_encode(e, g_mp, test_locomo_dated_facts[i], &f[i]);
    int32_t np, ns, *suf;
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);

    /* The cached prefix, and what a fork of it gives before anything else. */
    float *pre_before = malloc((size_t)V * sizeof(float)),
          *pre_after = malloc((size_t)V * sizeof(float));
    int32_t ps = test_prefix_open(e, g_mp, pre_before);

    /* Prompt mode: everything prefilled in place. */
    float *prompt = malloc((size_t)V * sizeof(float)), *kv = malloc((size_t)V * sizeof(float));
    float *none = malloc((size_t)V * sizeof(float)), *all = malloc((size_t)V * sizeof(float));
    float *some = malloc((size_t)V * sizeof(float));
    int32_t toks[512];
    int32_t n = test_prompt_tokens(g_mp, f, N_FACTS, suf, ns, toks, 512);
    test_prefill(e, toks, n, NULL, prompt);

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
    test_prefix_logits(e, g_mp, ps, pre_after);
    assert_true(test_rel_range_err(pre_after, pre_before, V) <= 1e-5);

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
    test_facts_free(f, N_FACTS);
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

static int setup(void **state) { return test_model_open("cpu", &g_be, &g_model, &g_mp); }

static int teardown(void **state) { return test_model_close(g_be, g_model, g_mp); }

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_recompute)};
    return test_run_group(tests, setup, teardown);
}

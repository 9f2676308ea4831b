/*
 * CacheBlend selective recomputation (engine_recompute_blend) against
 * references that do not use it, on the default model:
 *  - ratio 1: every memory token recomputed through the layers past the
 *    first: the query's logits equal engine_recompute of every memory token
 *    (which equals prompt mode, test_recompute) up to the first layer's
 *    rounding;
 *  - ratio 0: nothing written: the logits of injection, bit for bit;
 *  - the deviations and the selection against a plain reference: the
 *    second layer's keys and values of every memory token captured from a
 *    prefill of prefix and facts in place (prompt mode: the first layer
 *    then reads what the blend's first layer reads), compared with the
 *    stored ones, sorted; the selection must be its top share (up to
 *    deviations that tie within rounding);
 *  - an intermediate ratio moves the logits from kv toward prompt without
 *    writing the shared serving prefix; bad arguments are refused;
 *  - fused into the query's forward (engine_batch.blend): the logits of the
 *    blend followed by the query, the same selection;
 *  - a backend failure at the first, a middle or the last op of a fused
 *    blend reaches the caller, the query is not appended, and after
 *    engine_recover a new sequence gives the clean logits.
 * BLEND_CUDA builds the twin on the CUDA backend (test_blend_cuda, label
 * gpu; exits 77 without a device), f32 cache, with the GPU's tolerances.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "engine/recompute.h"
#include "serve/memory_prompt.h"
#include "test_model.h"
#include "test_util.h"
#ifdef BLEND_CUDA
#include "backend_cuda.h"
#define BLEND_BACKEND "cuda"
#else
#define BLEND_BACKEND "cpu"
#endif

/* CPU f32: the same sums up to their order. The GPU's products take other
 * kernels (bf16 inputs) for batches of other sizes: test_cuda_model's bar. */
#ifdef BLEND_CUDA
#define LOGIT_TOL 1e-2
#define DEV_TOL   5e-2
#else
#define LOGIT_TOL 1e-5
#define DEV_TOL   1e-3
#endif

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;

#define N_FACTS 4 /* of test_locomo_dated_facts */

static int32_t kv_dim(void) { return g_model->cfg.n_kv_heads * g_model->cfg.head_dim; }

static engine *make_engine(void) {
    /* A batch smaller than the memory: both passes run in chunks. */
    return test_engine_create(g_model, test_engine_params(1024, 4, 48));
}

/* The query's last logits after the facts injected into a fork of the
 * cached prefix, then: how < 0 nothing, 0 engine_recompute of every memory
 * token, 1 the blend at `ratio` (selected, deviation out, or NULL), 2 the
 * same fused into the query's forward. */
static void kv_logits(engine *e, int32_t ps, const test_fact *f, int how, float ratio,
                      const int32_t *suf, int32_t ns, float *out, bool *selected,
                      float *deviation) {
    int32_t np, seq, seqs[512];
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, ps, np), IS_OK);
    engine_fact ef[N_FACTS];
    int32_t total = 0;
    test_facts_to_engine(f, N_FACTS, ef);
    for (int i = 0; i < N_FACTS; i++) total += f[i].n;
    assert_int_equal(engine_inject(e, seq, ef, N_FACTS), IS_OK);
    if (how == 0) {
        int32_t pos[512], toks[512];
        assert_int_equal(recompute_first_list(ef, N_FACTS, 1 << 20, np, pos, toks), total);
        assert_int_equal(engine_recompute(e, seq, pos, toks, total), IS_OK);
    } else if (how == 1) {
        assert_int_equal(engine_recompute_blend(e, seq, ef, N_FACTS, ratio, selected, deviation),
                         IS_OK);
    }
    for (int i = 0; i < 512; i++) seqs[i] = seq;
    engine_blend bl = {ef, N_FACTS, ratio, selected, deviation};
    int32_t len = kv_seq_length(engine_kv(e), seq);
    engine_batch b = {.n_tokens = ns, .tokens = suf, .seq = seqs, .blend = how == 2 ? &bl : NULL};
    assert_int_equal(engine_decode(e, &b, out), IS_OK);
    assert_int_equal(kv_seq_length(engine_kv(e), seq), len + ns);
    engine_seq_close(e, seq);
}

typedef struct ranked {
    double d;
    int i;
} ranked;

static int cmp_desc(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    if (a->d != b->d) return a->d > b->d ? -1 : 1;
    return a->i - b->i;
}

static void test_blend(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
#ifdef BLEND_CUDA
    if (backend_cuda_configure(g_be, "kv=f32") != IS_OK)
        fail_msg("cuda options: %s", is_error_last());
#endif
    const int32_t V = g_model->cfg.n_vocab, L = g_model->cfg.n_layers, D = kv_dim();
    engine *e = make_engine();
    test_fact f[N_FACTS];
    int32_t total = 0;
    for (int i = 0; i < N_FACTS; i++) {
        test_fact_encode(e, g_mp, test_locomo_dated_facts[i], &f[i]);
        total += f[i].n;
    }
    int32_t np, ns, *suf;
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);

    /* The cached prefix, and its logits before anything else. */
    float *pre_before = malloc((size_t)V * sizeof(float)),
          *pre_after = malloc((size_t)V * sizeof(float));
    int32_t ps = test_prefix_open(e, g_mp, pre_before);

    /* Prompt mode, in place, capturing the memory tokens' K and V. */
    int32_t toks[1024];
    int32_t n = test_prompt_tokens(g_mp, f, N_FACTS, suf, ns, toks, 1024);
    float *pk = malloc((size_t)L * total * D * sizeof(float)),
          *pv = malloc((size_t)L * total * D * sizeof(float));
    float *prompt = malloc((size_t)V * sizeof(float)), *kv = malloc((size_t)V * sizeof(float));
    float *full = malloc((size_t)V * sizeof(float)), *got = malloc((size_t)V * sizeof(float));
    engine_kv_capture cap = {.first = np, .n = total, .k = pk, .v = pv};
    test_prefill(e, toks, n, &cap, prompt);

    kv_logits(e, ps, f, -1, 0, suf, ns, kv, NULL, NULL);
    kv_logits(e, ps, f, 0, 0, suf, ns, full, NULL, NULL);
    double kv_prompt = test_rel_range_err(kv, prompt, V);
    assert_true(kv_prompt > 1e-2); /* else nothing below can tell the cases apart */

    bool *sel = malloc((size_t)total * sizeof *sel);
    float *dev = malloc((size_t)total * sizeof *dev);
    kv_logits(e, ps, f, 1, 1.0f, suf, ns, got, sel, dev);
    double e_one = test_rel_range_err(got, full, V);
    for (int i = 0; i < total; i++) assert_true(sel[i]);
    kv_logits(e, ps, f, 1, 0.0f, suf, ns, got, sel, dev);
    double e_zero = test_rel_range_err(got, kv, V);
    for (int i = 0; i < total; i++) assert_false(sel[i]);
    printf("  %d memory tokens; ratio 1 vs every token recomputed %.2e; ratio 0 vs kv %.2e "
           "(kv vs prompt %.2e)\n",
           total, e_one, e_zero, kv_prompt);
    assert_true(e_one <= LOGIT_TOL);
#ifdef BLEND_CUDA
    assert_true(e_zero <= 1e-6);
#else
    assert_true(e_zero == 0.0); /* the selection pass writes nothing */
#endif

    /* The reference deviations: prompt mode's second-layer K and V (the
     * first layer's are the token's alone, so the blend's first layer reads
     * the same) against the stored ones. */
    ranked *ref = malloc((size_t)total * sizeof *ref);
    double worst = 0, dmax = 0;
    for (int i = 0, at = 0; i < N_FACTS; i++)
        for (int j = 0; j < f[i].n; j++, at++) {
            const float *ks = f[i].k + ((size_t)f[i].n + j) * D,
                        *vs = f[i].v + ((size_t)f[i].n + j) * D;
            const float *kp = pk + ((size_t)total + at) * D, *vp = pv + ((size_t)total + at) * D;
            double d = 0;
            for (int x = 0; x < D; x++)
                d += (double)(kp[x] - ks[x]) * (kp[x] - ks[x]) +
                     (double)(vp[x] - vs[x]) * (vp[x] - vs[x]);
            ref[at] = (ranked){d, at};
            if (d > dmax) dmax = d;
        }
    for (int i = 0; i < total; i++) {
        double err = fabs(dev[i] - ref[i].d);
        if (err > worst) worst = err;
    }
    printf("  deviations vs reference: max abs error %.2e of a largest deviation %.2e\n", worst,
           dmax);
    assert_true(dmax > 0);
    assert_true(worst <= DEV_TOL * dmax);
    qsort(ref, (size_t)total, sizeof *ref, cmp_desc);
    const float ratios[] = {0.05f, 0.15f, 0.3f, 0.5f};
    for (size_t r = 0; r < sizeof ratios / sizeof ratios[0]; r++) {
        kv_logits(e, ps, f, 1, ratios[r], suf, ns, got, sel, dev);
        int want = recompute_blend_count(ratios[r], total), have = 0, differ = 0;
        bool *in_ref = calloc((size_t)total, sizeof *in_ref);
        for (int i = 0; i < want; i++) in_ref[ref[i].i] = true;
        const double edge = ref[want - 1].d; /* the smallest deviation chosen */
        for (int i = 0; i < total; i++) {
            have += sel[i];
            if (sel[i] != in_ref[i]) {
                differ++;
                /* Only a near tie at the edge may go either way. */
                double d = 0;
                for (int j = 0; j < total; j++)
                    if (ref[j].i == i) d = ref[j].d;
                assert_true(fabs(d - edge) <= DEV_TOL * dmax);
            }
        }
        double vs_kv = test_rel_range_err(got, kv, V),
               vs_prompt = test_rel_range_err(got, prompt, V);
        printf(
            "  ratio %.2f: %d of %d tokens (%d at a tie differ from the reference); logits vs kv "
            "%.2e, vs prompt %.2e\n",
            (double)ratios[r], have, total, differ, vs_kv, vs_prompt);
        printf("    chosen (fact:offset):");
        for (int i = 0, at = 0; i < N_FACTS; i++)
            for (int j = 0; j < f[i].n; j++, at++)
                if (sel[at]) printf(" %d:%d", i, j);
        printf("\n");
        assert_int_equal(have, want);
        assert_true(vs_kv > LOGIT_TOL);
        free(in_ref);
    }

    /* Fused into the query's forward: the same logits and choice. */
    bool *sel2 = malloc((size_t)total * sizeof *sel2);
    float *fused = malloc((size_t)V * sizeof(float));
    const float fr[] = {0.15f, 1.0f};
    for (int r = 0; r < 2; r++) {
        kv_logits(e, ps, f, 1, fr[r], suf, ns, got, sel, dev);
        kv_logits(e, ps, f, 2, fr[r], suf, ns, fused, sel2, NULL);
        double err = test_rel_range_err(fused, got, V);
        printf("  fused, ratio %.2f: vs blend then query %.2e\n", (double)fr[r], err);
        assert_true(err <= LOGIT_TOL);
        for (int i = 0; i < total; i++) assert_int_equal(sel[i], sel2[i]);
    }
    /* A blend batch of several sequences is refused, nothing appended. */
    int32_t sq, sb[2], tb[2] = {suf[0], suf[1]};
    assert_int_equal(engine_seq_open(e, &sq), IS_OK);
    sb[0] = ps;
    sb[1] = sq;
    engine_fact ef0 = {f[0].n, f[0].toks, f[0].k, f[0].v};
    engine_blend bad = {&ef0, 1, 0.5f, NULL, NULL};
    engine_batch two = {.n_tokens = 2, .tokens = tb, .seq = sb, .blend = &bad};
    assert_int_equal(engine_decode(e, &two, fused), IS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_length(engine_kv(e), ps), np);
    engine_seq_close(e, sq);
    free(sel2);
    free(fused);

    /* The shared prefix was never written. */
    test_prefix_logits(e, g_mp, ps, pre_after);
    assert_true(test_rel_range_err(pre_after, pre_before, V) <= LOGIT_TOL);

    /* Bad arguments: refused before anything runs. */
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    assert_int_equal(engine_seq_fork(e, seq, ps, np), IS_OK);
    engine_fact ef[2] = {{f[0].n, f[0].toks, f[0].k, f[0].v}, {f[1].n, f[1].toks, f[1].k, f[1].v}};
    assert_int_equal(engine_inject(e, seq, ef, 1), IS_OK);
    assert_int_equal(engine_recompute_blend(e, seq, ef, 1, 1.5f, NULL, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_recompute_blend(e, seq, ef, 1, NAN, NULL, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_recompute_blend(e, seq, ef, 2, 0.5f, NULL, NULL), IS_ERR_INVALID_ARG);
    engine_fact novals = {f[0].n, f[0].toks, NULL, NULL};
    assert_int_equal(engine_recompute_blend(e, seq, &novals, 1, 0.5f, NULL, NULL),
                     IS_ERR_INVALID_ARG);
    engine_seq_close(e, seq);

    engine_seq_close(e, ps);
    test_facts_free(f, N_FACTS);
    free(suf);
    free(pre_before);
    free(pre_after);
    free(pk);
    free(pv);
    free(prompt);
    free(kv);
    free(full);
    free(got);
    free(sel);
    free(dev);
    free(ref);
    engine_free(e);
}

static void test_blend_fault(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    const int32_t V = g_model->cfg.n_vocab;
    engine *e = make_engine();
    test_fact f[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) test_fact_encode(e, g_mp, test_locomo_dated_facts[i], &f[i]);
    int32_t np, ns, *suf;
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);
    float *clean = malloc((size_t)V * sizeof(float)), *got = malloc((size_t)V * sizeof(float));
    float *junk = malloc((size_t)V * sizeof(float));
    int32_t ps = test_prefix_open(e, g_mp, junk);
    engine_fact ef[N_FACTS];
    test_facts_to_engine(f, N_FACTS, ef);
    engine_blend bl = {ef, N_FACTS, 0.3f, NULL, NULL};
    /* The clean run, counting the fused decode's ops. */
    int64_t n_ops = 0;
    for (int pass = 0; pass < 5; pass++) {
        int32_t seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        assert_int_equal(engine_seq_fork(e, seq, ps, np), IS_OK);
        assert_int_equal(engine_inject(e, seq, ef, N_FACTS), IS_OK);
        int32_t len = kv_seq_length(engine_kv(e), seq), sq[64];
        for (int i = 0; i < ns; i++) sq[i] = seq;
        engine_batch b = {.n_tokens = ns, .tokens = suf, .seq = sq, .blend = &bl};
        int64_t at = pass == 0 ? 0 : pass == 1 ? 1 : pass == 2 ? n_ops / 2 : pass == 3 ? n_ops : 0;
        int64_t before = backend_op_count(g_be);
        if (pass >= 1 && pass <= 3) backend_fault_arm(g_be, at, false);
        is_status st = engine_decode(e, &b, pass == 0 || pass == 4 ? clean : junk);
        if (pass == 0) {
            assert_int_equal(st, IS_OK);
            n_ops = backend_op_count(g_be) - before;
            assert_true(n_ops > 3);
        } else if (pass <= 3) {
            printf("  fault at op %lld of %lld: %s\n", (long long)at, (long long)n_ops,
                   is_status_to_string(st));
            assert_int_not_equal(st, IS_OK);
            assert_int_not_equal(engine_status(e), IS_OK);
            assert_int_equal(kv_seq_length(engine_kv(e), seq), len);
            assert_int_equal(engine_recover(e), IS_OK);
        } else {
            assert_int_equal(st, IS_OK);
        }
        engine_seq_close(e, seq);
        if (pass == 0) memcpy(got, clean, (size_t)V * sizeof(float));
    }
    /* After three recoveries the clean run's logits again (pass 4 wrote clean). */
    assert_true(test_rel_range_err(clean, got, V) == 0.0);
    engine_seq_close(e, ps);
    test_facts_free(f, N_FACTS);
    free(suf);
    free(clean);
    free(got);
    free(junk);
    engine_free(e);
}

/* The selection's arithmetic alone: counts, order, ties, NaN. */
static void test_select(void **state) {
    (void)state;
    assert_int_equal(recompute_blend_count(0.0f, 10), 0);
    assert_int_equal(recompute_blend_count(0.3f, 10), 3);
    assert_int_equal(recompute_blend_count(0.05f, 10), 1);
    assert_int_equal(recompute_blend_count(1.0f, 7), 7);
    const float dev[6] = {1.0f, 5.0f, 2.0f, 5.0f, NAN, 0.5f};
    bool sel[6];
    assert_int_equal(recompute_select_top(dev, 6, 0.5f, sel), IS_OK);
    const bool want[6] = {false, true, false, true, true, false};
    for (int i = 0; i < 6; i++) assert_int_equal(sel[i], want[i]);
    assert_int_equal(recompute_select_top(dev, 6, 0.34f, sel), IS_OK); /* ceil(2.04) = 3 */
    int n = 0;
    for (int i = 0; i < 6; i++) n += sel[i];
    assert_int_equal(n, 3);
    assert_int_equal(recompute_select_top(dev, 6, 0.3f, sel), IS_OK); /* 2: NaN, then index 1 */
    assert_true(sel[4] && sel[1] && !sel[3]);
}

static int setup(void **state) { return test_model_open(BLEND_BACKEND, &g_be, &g_model, &g_mp); }

static int teardown(void **state) { return test_model_close(g_be, g_model, g_mp); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_select),
        cmocka_unit_test(test_blend),
        cmocka_unit_test(test_blend_fault),
    };
#ifdef BLEND_CUDA
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU tests are skipped\n");
        return 77;
    }
#endif
    return test_run_group(tests, setup, teardown);
}

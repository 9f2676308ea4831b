/*
 * Memory as attention, proven exact on the CPU in f32:
 *  - position invariance: a fact's pre-RoPE keys and values do not depend on
 *    the offset at which it (with its context) was encoded;
 *  - exactness: encode facts, inject them (chunked RoPE + scatter through the
 *    block table), prefill the suffix: the logits at every suffix position
 *    equal those of a single segment-masked reference prefill of the same
 *    tokens, and greedy continuations agree for 32 tokens;
 *  - one fact with w = 0 equals a plain prefill of the whole prompt.
 *
 * The reference is one forward pass over
 *   [prefix][ctx_1 fact_1][ctx_2 fact_2]...[suffix]
 * in which fact i (segment i) and its context (segment -i) see the prefix and
 * themselves only, the suffix sees the prefix and the facts but no context,
 * facts sit at their serving positions, each context right before its fact,
 * and fact i's queries score prefix keys at the distance they had when the
 * fact was encoded right after the prefix (prefix_shift). That last point is
 * what "fact i sees the serving prefix" means once facts are moved: a fact
 * encoded after the prefix and served k tokens later was computed with the
 * prefix k tokens closer than a plain masked prefill would place it.
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
#include <sys/stat.h>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "gguf/quant.h"
#include "kv/kv_cache.h"
#include "serve/memory_prompt.h"
#include "test_model.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;

static const char *TURNS[] = {
    "Caroline: Hey Mel! Good to see you! How have you been?",
    "Melanie: Hey Caroline! I'm swamped with the kids and work. What's up with you?",
    "Caroline: I went to an LGBTQ support group yesterday and it was so powerful.",
    "Melanie: Wow, that's cool, Caroline! What happened that was so awesome?",
    "Caroline: The transgender stories were so inspiring! I was so happy and thankful.",
};

typedef struct encoded {
    int32_t *ctx; /* context tokens */
    int32_t n_ctx;
    int32_t *toks; /* fact tokens */
    int32_t n;
    float *k, *v; /* [n_layers][n][kv_dim] pre-RoPE */
} encoded;

static int setup(void **state) { return test_model_open("cpu", &g_be, &g_model, &g_mp); }

static int teardown(void **state) { return test_model_close(g_be, g_model, g_mp); }

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

static engine *make_engine(int32_t n_ctx) {
    return test_engine_create(g_model, test_engine_params(n_ctx, 4, 256));
}

static int32_t kv_dim(void) { return g_model->cfg.n_kv_heads * g_model->cfg.head_dim; }

/* Encodes a fact after the serving prefix and `w` context turns, with every
 * RoPE position moved by `offset`. */
static void encode(engine *e, const char *text, int w, int32_t offset, encoded *out) {
    memset(out, 0, sizeof *out);
    assert_int_equal(memory_prompt_fact(g_mp, text, &out->toks, &out->n), IS_OK);
    assert_int_equal(memory_prompt_context(g_mp, TURNS, w, &out->ctx, &out->n_ctx), IS_OK);
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    int32_t total = np + out->n_ctx + out->n;
    int32_t *toks = malloc((size_t)total * sizeof *toks);
    int32_t *seqs = calloc((size_t)total, sizeof *seqs);
    int32_t *pos = malloc((size_t)total * sizeof *pos);
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    if (out->n_ctx) memcpy(toks + np, out->ctx, (size_t)out->n_ctx * sizeof *toks);
    memcpy(toks + np + out->n_ctx, out->toks, (size_t)out->n * sizeof *toks);
    for (int32_t i = 0; i < total; i++) pos[i] = i + offset;
    size_t sz = (size_t)g_model->cfg.n_layers * out->n * kv_dim();
    out->k = malloc(sz * sizeof(float));
    out->v = malloc(sz * sizeof(float));
    engine_kv_capture cap = {.first = np + out->n_ctx, .n = out->n, .k = out->k, .v = out->v};
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int32_t i = 0; i < total; i++) seqs[i] = seq;
    float *logits = malloc((size_t)g_model->cfg.n_vocab * sizeof(float));
    engine_batch b = {.n_tokens = total, .tokens = toks, .seq = seqs, .pos = pos, .capture = &cap};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    engine_seq_close(e, seq);
    free(logits);
    free(toks);
    free(seqs);
    free(pos);
}

static void encoded_free(encoded *x) {
    free(x->ctx);
    free(x->toks);
    free(x->k);
    free(x->v);
}

/* One forward over [prefix][fact], the fact's rows captured in `dtype`
 * into k, v; returns the engine's status (the sequence is closed). */
static is_status capture_as(engine *e, const int32_t *fact, int32_t n, int32_t dtype, int32_t first,
                            void *k, void *v, int32_t *len_after) {
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    int32_t total = np + n, seq;
    int32_t *toks = malloc((size_t)total * sizeof *toks);
    int32_t *seqs = malloc((size_t)total * sizeof *seqs);
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    memcpy(toks + np, fact, (size_t)n * sizeof *toks);
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int32_t i = 0; i < total; i++) seqs[i] = seq;
    engine_kv_capture cap = {
        .first = first < 0 ? np : first, .n = n, .dtype = dtype, .k = k, .v = v};
    engine_batch b = {.n_tokens = total, .tokens = toks, .seq = seqs, .capture = &cap};
    int32_t next;
    is_status st = engine_decode_greedy(e, &b, &next);
    *len_after = kv_seq_length(engine_kv(e), seq);
    engine_seq_close(e, seq);
    free(toks);
    free(seqs);
    return st;
}

/* Rows captured in f16 or bf16 are the f32 capture narrowed by the
 * record conversions, bit for bit (the backend narrows them where they are
 * computed); a capture the engine cannot make is refused before the
 * sequence grows. */
static void test_capture_dtype(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(4096);
    int32_t *fact, n, len;
    assert_int_equal(memory_prompt_fact(g_mp, test_locomo_facts[1], &fact, &n), IS_OK);
    size_t cnt = (size_t)g_model->cfg.n_layers * n * kv_dim();
    float *k32 = malloc(cnt * sizeof(float)), *v32 = malloc(cnt * sizeof(float));
    uint16_t *k16 = malloc(cnt * 2), *v16 = malloc(cnt * 2), *want = malloc(cnt * 2);
    assert_int_equal(capture_as(e, fact, n, 0, -1, k32, v32, &len), IS_OK);
    for (int32_t dtype = 1; dtype <= 2; dtype++) {
        assert_int_equal(capture_as(e, fact, n, dtype, -1, k16, v16, &len), IS_OK);
        for (int side = 0; side < 2; side++) {
            const float *src = side ? v32 : k32;
            if (dtype == 1) quant_f32_to_f16_row(src, want, cnt);
            else quant_f32_to_bf16_row(src, want, cnt);
            assert_memory_equal(side ? v16 : k16, want, cnt * 2);
        }
    }
    int32_t np;
    memory_prompt_prefix(g_mp, &np);
    assert_int_equal(capture_as(e, fact, n, 3, -1, k16, v16, &len), IS_ERR_INVALID_ARG);
    assert_int_equal(len, 0);
    assert_int_equal(capture_as(e, fact, n, 2, np + 1, k16, v16, &len), IS_ERR_INVALID_ARG);
    assert_int_equal(len, 0);
    free(fact);
    free(k32);
    free(v32);
    free(k16);
    free(v16);
    free(want);
    engine_free(e);
}

static void test_position_invariance(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(4096);
    for (int w = 0; w <= 3; w += 3) {
        encoded a, b;
        encode(e, test_locomo_facts[2], w, 0, &a);
        encode(e, test_locomo_facts[2], w, 3000, &b);
        assert_int_equal(a.n, b.n);
        size_t sz = (size_t)g_model->cfg.n_layers * a.n * kv_dim();
        double kmax = 0, vmax = 0, kerr = 0, verr = 0;
        for (size_t i = 0; i < sz; i++) {
            kmax = fmax(kmax, fabs(a.k[i]));
            vmax = fmax(vmax, fabs(a.v[i]));
            kerr = fmax(kerr, fabs(a.k[i] - b.k[i]));
            verr = fmax(verr, fabs(a.v[i] - b.v[i]));
        }
        printf("  w=%d: keys max |diff| / max |k| = %.2e, values %.2e\n", w, kerr / kmax,
               verr / vmax);
        assert_true(kerr / kmax <= 1e-5);
        assert_true(verr / vmax <= 1e-5);
        encoded_free(&a);
        encoded_free(&b);
    }
    engine_free(e);
}

/* Compares injection with the segment-masked reference for one fact set. */
static void check_fact_set(engine *e, const int *idx, int n_facts, int w, const char *query) {
    int32_t V = g_model->cfg.n_vocab;
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    encoded *enc = calloc((size_t)n_facts, sizeof *enc);
    engine_fact *facts = calloc((size_t)n_facts, sizeof *facts);
    for (int i = 0; i < n_facts; i++) {
        /* Each fact gets its own context: the turns before it, rotated. */
        encode(e, test_locomo_facts[idx[i]], w, 0, &enc[i]);
        facts[i] = (engine_fact){enc[i].n, enc[i].toks, enc[i].k, enc[i].v};
    }
    int32_t *suf, ns;
    assert_int_equal(memory_prompt_suffix(g_mp, query, &suf, &ns), IS_OK);
    float *inj = malloc((size_t)ns * V * sizeof(float));
    float *ref = malloc((size_t)ns * V * sizeof(float));
    bool *want = malloc((size_t)ns);
    for (int32_t i = 0; i < ns; i++) want[i] = true;

    /* Injection: prefix, facts, suffix. */
    int32_t si;
    assert_int_equal(engine_seq_open(e, &si), IS_OK);
    int32_t *sq = malloc(4096 * sizeof *sq);
    for (int i = 0; i < 4096; i++) sq[i] = si;
    engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = sq};
    assert_int_equal(engine_decode(e, &bp, inj), IS_OK);
    assert_int_equal(engine_inject(e, si, facts, n_facts), IS_OK);
    engine_batch bs = {.n_tokens = ns, .tokens = suf, .seq = sq, .want_logits = want};
    assert_int_equal(engine_decode(e, &bs, inj), IS_OK);

    /* Reference: one segment-masked prefill. */
    int32_t mem = 0, extra = 0;
    for (int i = 0; i < n_facts; i++) {
        mem += enc[i].n;
        extra += enc[i].n_ctx;
    }
    int32_t total = np + mem + extra + ns;
    int32_t *toks = malloc((size_t)total * sizeof *toks),
            *seg = malloc((size_t)total * sizeof *seg);
    int32_t *pos = malloc((size_t)total * sizeof *pos),
            *shift = malloc((size_t)total * sizeof *shift);
    bool *rwant = calloc((size_t)total, 1);
    int32_t t = 0, s_i = np;
    for (int32_t i = 0; i < np; i++, t++) {
        toks[t] = pre[i];
        seg[t] = 0;
        pos[t] = i;
        shift[t] = 0;
    }
    for (int i = 0; i < n_facts; i++) {
        int32_t delta = s_i - enc[i].n_ctx - np;
        for (int32_t j = 0; j < enc[i].n_ctx; j++, t++) {
            toks[t] = enc[i].ctx[j];
            seg[t] = -(i + 1);
            pos[t] = s_i - enc[i].n_ctx + j;
            shift[t] = delta;
        }
        for (int32_t j = 0; j < enc[i].n; j++, t++) {
            toks[t] = enc[i].toks[j];
            seg[t] = i + 1;
            pos[t] = s_i + j;
            shift[t] = delta;
        }
        s_i += enc[i].n;
    }
    for (int32_t j = 0; j < ns; j++, t++) {
        toks[t] = suf[j];
        seg[t] = 0;
        pos[t] = s_i + j;
        shift[t] = 0;
        rwant[t] = true;
    }
    int32_t sr;
    assert_int_equal(engine_seq_open(e, &sr), IS_OK);
    int32_t *sqr = malloc((size_t)total * sizeof *sqr);
    for (int32_t i = 0; i < total; i++) sqr[i] = sr;
    engine_batch br = {.n_tokens = total,
                       .tokens = toks,
                       .seq = sqr,
                       .want_logits = rwant,
                       .segment = seg,
                       .pos = pos,
                       .prefix_shift = shift};
    assert_int_equal(engine_decode(e, &br, ref), IS_OK);

    double worst = 0;
    for (int32_t j = 0; j < ns; j++) {
        double err = test_rel_range_err(inj + (size_t)j * V, ref + (size_t)j * V, V);
        if (err > worst) worst = err;
        assert_int_equal(sampler_argmax(inj + (size_t)j * V, V),
                         sampler_argmax(ref + (size_t)j * V, V));
    }
    printf("  %2d facts, w=%d: %d memory tokens, %d query tokens, max |diff| / range = %.2e\n",
           n_facts, w, mem, ns, worst);
    assert_true(worst <= 1e-4);

    /* Greedy continuation, 32 tokens, in both. */
    int32_t next_pos = s_i + ns;
    int32_t ti = sampler_argmax(inj + (size_t)(ns - 1) * V, V);
    int32_t tr = sampler_argmax(ref + (size_t)(ns - 1) * V, V);
    for (int k = 0; k < 32; k++) {
        assert_int_equal(ti, tr);
        engine_batch gi = {.n_tokens = 1, .tokens = &ti, .seq = &si};
        assert_int_equal(engine_decode(e, &gi, inj), IS_OK);
        int32_t zero = 0;
        engine_batch gr = {
            .n_tokens = 1, .tokens = &tr, .seq = &sr, .segment = &zero, .pos = &next_pos};
        assert_int_equal(engine_decode(e, &gr, ref), IS_OK);
        next_pos++;
        ti = sampler_argmax(inj, V);
        tr = sampler_argmax(ref, V);
    }
    engine_seq_close(e, si);
    engine_seq_close(e, sr);
    for (int i = 0; i < n_facts; i++) encoded_free(&enc[i]);
    free(enc);
    free(facts);
    free(suf);
    free(inj);
    free(ref);
    free(want);
    free(sq);
    free(toks);
    free(seg);
    free(pos);
    free(shift);
    free(rwant);
    free(sqr);
}

static void test_injection_equals_segment_masked_reference(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(4096);
    uint64_t rng = 12345;
    int sizes[] = {1, 2, 5, 20};
    const char *queries[] = {"When did Caroline go to the support group?",
                             "What instrument does Melanie play?"};
    for (int w = 0; w <= 3; w += 3) {
        for (int si = 0; si < 4; si++) {
            int idx[32];
            for (int i = 0; i < sizes[si]; i++) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                idx[i] = (int)(rng % TEST_N_LOCOMO_FACTS);
            }
            check_fact_set(e, idx, sizes[si], w, queries[si % 2]);
        }
    }
    engine_free(e);
}

/* One fact, w = 0: injection equals a plain (unmasked) prefill of the whole
 * prompt, since the fact then sits exactly where it was encoded. */
static void test_single_fact_equals_plain_prefill(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(4096);
    int32_t V = g_model->cfg.n_vocab;
    encoded f;
    encode(e, test_locomo_facts[4], 0, 0, &f);
    int32_t np, ns, *suf;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    int32_t s1, s2;
    assert_int_equal(engine_seq_open(e, &s1), IS_OK);
    int32_t sq1[512], sq2[512];
    for (int i = 0; i < 512; i++) sq1[i] = s1;
    engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = sq1};
    assert_int_equal(engine_decode(e, &bp, a), IS_OK);
    engine_fact fact = {f.n, f.toks, f.k, f.v};
    assert_int_equal(engine_inject(e, s1, &fact, 1), IS_OK);
    engine_batch bs = {.n_tokens = ns, .tokens = suf, .seq = sq1};
    assert_int_equal(engine_decode(e, &bs, a), IS_OK);

    int32_t total = np + f.n + ns, toks[512];
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    memcpy(toks + np, f.toks, (size_t)f.n * sizeof *toks);
    memcpy(toks + np + f.n, suf, (size_t)ns * sizeof *toks);
    assert_int_equal(engine_seq_open(e, &s2), IS_OK);
    for (int i = 0; i < 512; i++) sq2[i] = s2;
    engine_batch bw = {.n_tokens = total, .tokens = toks, .seq = sq2};
    assert_int_equal(engine_decode(e, &bw, b), IS_OK);
    double err = test_rel_range_err(a, b, V);
    printf("  single fact vs plain prefill: %.2e\n", err);
    assert_true(err <= 1e-4);
    assert_int_equal(sampler_argmax(a, V), sampler_argmax(b, V));
    encoded_free(&f);
    free(suf);
    free(a);
    free(b);
    engine_free(e);
}

/* Injection into a forked prefix: the prefix's full blocks are shared, not
 * copied, and the result equals injecting after a private prefill. */
static void test_fork_shares_prefix_blocks(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(4096);
    int32_t V = g_model->cfg.n_vocab;
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    int32_t sp, s1, s2, sq[512];
    assert_int_equal(engine_seq_open(e, &sp), IS_OK);
    for (int i = 0; i < 512; i++) sq[i] = sp;
    engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = sq};
    assert_int_equal(engine_decode(e, &bp, a), IS_OK);
    int32_t free_before = kv_cache_free_blocks(engine_kv(e));
    assert_int_equal(engine_seq_open(e, &s1), IS_OK);
    assert_int_equal(engine_seq_fork(e, s1, sp, np), IS_OK);
    int32_t bs = engine_default_params().block_size;
    assert_int_equal(free_before - kv_cache_free_blocks(engine_kv(e)), np % bs ? 1 : 0);
    encoded f;
    encode(e, test_locomo_facts[7], 0, 0, &f);
    engine_fact fact = {f.n, f.toks, f.k, f.v};
    int32_t *suf, ns;
    assert_int_equal(memory_prompt_suffix(g_mp, "How long has Melanie been married?", &suf, &ns),
                     IS_OK);
    assert_int_equal(engine_inject(e, s1, &fact, 1), IS_OK);
    for (int i = 0; i < 512; i++) sq[i] = s1;
    engine_batch b1 = {.n_tokens = ns, .tokens = suf, .seq = sq};
    assert_int_equal(engine_decode(e, &b1, a), IS_OK);
    assert_int_equal(engine_seq_open(e, &s2), IS_OK);
    for (int i = 0; i < 512; i++) sq[i] = s2;
    engine_batch b2 = {.n_tokens = np, .tokens = pre, .seq = sq};
    assert_int_equal(engine_decode(e, &b2, b), IS_OK);
    assert_int_equal(engine_inject(e, s2, &fact, 1), IS_OK);
    engine_batch b3 = {.n_tokens = ns, .tokens = suf, .seq = sq};
    assert_int_equal(engine_decode(e, &b3, b), IS_OK);
    for (int32_t i = 0; i < V; i++) assert_true(a[i] == b[i]);
    assert_true(kv_cache_check(engine_kv(e)));
    encoded_free(&f);
    free(suf);
    free(a);
    free(b);
    engine_free(e);
}

/* Values may be left out only for a fact the backend holds; the CPU holds
 * none, so such an injection is refused and the sequence left as it was. */
static void test_values_required_unless_resident(void **state) {
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(1024);
    int32_t seq, toks[3] = {1, 2, 3};
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    const uint64_t id = 0x1234;
    assert_false(engine_fact_resident(e, id, 3));
    assert_false(engine_fact_resident(e, 0, 3));
    engine_fact f = {3, toks, NULL, NULL};
    assert_int_equal(engine_inject_ids(e, seq, &f, &id, 1), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_inject(e, seq, &f, 1), IS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_length(engine_kv(e), seq), 0);
    engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values_required_unless_resident),
        cmocka_unit_test(test_position_invariance),
        cmocka_unit_test(test_capture_dtype),
        cmocka_unit_test(test_single_fact_equals_plain_prefill),
        cmocka_unit_test(test_fork_shares_prefix_blocks),
        cmocka_unit_test(test_injection_equals_segment_masked_reference),
    };
    return test_run_group(tests, setup, teardown);
}

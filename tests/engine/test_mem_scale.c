/*
 * Memory scaling (APE-style attention temperature and mass over the
 * injected memory segment), against references that do not share its code:
 *  - the attention op, against a plain dense reference written here (double
 *    sums, every key scored one by one): queries after a sequence's memory
 *    score its keys as score / T + ln(S), other queries and other keys as
 *    plain attention; prefill- and decode-sized runs, several sequences
 *    (one without memory), queries inside the memory segment, segment masks,
 *    grouped-query heads;
 *  - the engine: one fact (w = 0) injected after the serving prefix, the
 *    query prefilled with T and S set, equals a plain prefill of the same
 *    tokens with that fact's slots marked as memory (engine_seq_set_memory):
 *    injection records its segment, forks keep it, and the scaling changes
 *    the logits (so the comparison can fail);
 *  - T = S = 1 is plain attention bit for bit (the default stays exact).
 *
 * Built twice: on the CPU backend in f32 (test_mem_scale), and with
 * MEM_SCALE_CUDA on the CUDA backend (test_mem_scale_cuda, label gpu; exits
 * 77 without a device), where the op runs on the exact kernel (f32 cache,
 * tolerance 1e-5 of the output's range) and on the tiled bf16 kernel (bf16
 * K, V, Q and P: 1e-2, the tiled kernel's tolerance in test_cuda_ops).
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
#include "engine/sampler.h"
#include "gguf/quant.h"
#include "serve/memory_prompt.h"
#include "test_model.h"
#include "test_util.h"
#ifdef MEM_SCALE_CUDA
#include "backend_cuda.h"
#define MEM_SCALE_BACKEND "cuda"

/* Applies a configuration list (cuda/options.h) to the test's backend. */
static void cuda_opt(backend *be, const char *spec) {
    if (backend_cuda_configure(be, spec) != IS_OK)
        fail_msg("cuda options '%s': %s", spec, is_error_last());
}
#else
#define MEM_SCALE_BACKEND "cpu"
#endif

/* Injected against prefilled logits: f32 on the CPU gives the same sums up
 * to their order; the GPU's products take different kernels (and bf16
 * inputs) for a 60-token prefill and for a 10-token query, so its bar is
 * test_cuda_model's for the default precision. */
#ifdef MEM_SCALE_CUDA
#define ENGINE_TOL 1e-2
#else
#define ENGINE_TOL 1e-4
#endif

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;
static uint64_t g_rng = 7;

static float frand(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static float bf16_round(float x) { return quant_bf16_to_f32(quant_f32_to_bf16(x)); }

/* ---- the dense reference -------------------------------------------------- */

static bool ref_visible(int32_t qp, int32_t kp, const int32_t *seg) {
    if (kp > qp) return false;
    if (!seg) return true;
    int32_t qs = seg[qp], ks = seg[kp];
    if (ks == 0) return true;
    if (ks > 0) return qs == 0 || qs == ks || qs == -ks;
    return qs == ks || qs == -ks;
}

/* out[T][H*hd] from host f32 caches laid out as backend.h says. */
static void ref_attention(float *out, const float *q, const float *kc, const float *vc,
                          const attn_batch *b, int32_t H, int32_t KH, int32_t hd, int32_t bs) {
    double *w = malloc(4096 * sizeof *w);
    for (int32_t t = 0; t < b->n_tokens; t++) {
        const int32_t s = b->seq_of_token[t], qp = b->pos[t];
        const int32_t *seg = b->seq_segments ? b->seq_segments[s] : NULL;
        int32_t mb = 0, me = 0;
        if (b->mem_span && qp >= b->mem_span[2 * s + 1]) {
            mb = b->mem_span[2 * s];
            me = b->mem_span[2 * s + 1];
        }
        for (int32_t h = 0; h < H; h++) {
            const int32_t kh = h / (H / KH);
            const float *qv = q + ((size_t)t * H + h) * hd;
            double mx = -INFINITY;
            for (int32_t j = 0; j <= qp; j++) {
                w[j] = -INFINITY;
                if (!ref_visible(qp, j, seg)) continue;
                const float *k =
                    kc + (((size_t)b->block_tables[s][j / bs] * KH + kh) * bs + j % bs) * hd;
                double d = 0;
                for (int32_t i = 0; i < hd; i++) d += (double)qv[i] * k[i];
                d /= sqrt((double)hd);
                if (j >= mb && j < me) d = d / b->mem_temp + log((double)b->mem_mass);
                w[j] = d;
                if (d > mx) mx = d;
            }
            double sum = 0;
            for (int32_t j = 0; j <= qp; j++) {
                w[j] = w[j] == -INFINITY ? 0.0 : exp(w[j] - mx);
                sum += w[j];
            }
            float *o = out + ((size_t)t * H + h) * hd;
            for (int32_t i = 0; i < hd; i++) {
                double acc = 0;
                for (int32_t j = 0; j <= qp; j++) {
                    if (w[j] == 0.0) continue;
                    const float *v =
                        vc + (((size_t)b->block_tables[s][j / bs] * KH + kh) * bs + j % bs) * hd;
                    acc += w[j] * v[i];
                }
                o[i] = (float)(acc / sum);
            }
        }
    }
    free(w);
}

/* ---- the op against it ----------------------------------------------------------- */

/* One scenario: up to 3 sequences, each with its length, memory span and
 * query positions [q_from, q_from + q_n). */
typedef struct mem_case {
    const char *name;
    int32_t n_seqs;
    int32_t len[3], mem[3][2], q_from[3], q_n[3];
    bool segments; /* sequence 0 gets segment ids (prefix 0, facts 1.., query 0) */
} mem_case;

static const mem_case CASES[] = {
    /* a short query after the memory: the decode-sized path on the CPU */
    {"decode-sized", 1, {150, 0, 0}, {{20, 120}, {0, 0}, {0, 0}}, {144, 0, 0}, {6, 0, 0}, false},
    /* a prefill-sized run that starts inside the memory: its first rows
     * are not scaled, the rest are */
    {"prefill across the memory's end",
     1,
     {200, 0, 0},
     {{33, 170}, {0, 0}, {0, 0}},
     {150, 0, 0},
     {50, 0, 0},
     false},
    /* three sequences: memory, none, memory at the start */
    {"three sequences",
     3,
     {180, 90, 130},
     {{17, 150}, {0, 0}, {0, 100}},
     {160, 70, 110},
     {20, 20, 20},
     false},
    /* with segment masks (the reference layout's) */
    {"segments", 1, {160, 0, 0}, {{16, 140}, {0, 0}, {0, 0}}, {140, 0, 0}, {20, 0, 0}, true},
};

/* mode 0: f32 cache; mode 1 (CUDA only): bf16 cache, the tiled kernel. */
static double run_case(const mem_case *mc, float temp, float mass, int mode, float *max_shift) {
    const int32_t H = 4, KH = 2, hd = 64, bs = 16, S = mc->n_seqs;
    int32_t n_blocks = 0;
    for (int32_t s = 0; s < S; s++) n_blocks += (mc->len[s] + bs - 1) / bs;
    int32_t *perm = malloc((size_t)n_blocks * sizeof *perm);
    for (int32_t i = 0; i < n_blocks; i++) perm[i] = n_blocks - 1 - i; /* reversed: not identity */
    const int32_t *tables[3];
    int32_t span[6], *segs[3] = {NULL, NULL, NULL};
    for (int32_t s = 0, at = 0; s < S; s++) {
        tables[s] = perm + at;
        at += (mc->len[s] + bs - 1) / bs;
        span[2 * s] = mc->mem[s][0];
        span[2 * s + 1] = mc->mem[s][1];
    }
    if (mc->segments) {
        segs[0] = calloc((size_t)mc->len[0], sizeof(int32_t));
        for (int32_t p = mc->mem[0][0], f = 1; p < mc->mem[0][1]; p++) {
            if ((p - mc->mem[0][0]) % 31 == 30) f++; /* facts of 31 tokens */
            segs[0][p] = f;
        }
    }
    int32_t T = 0;
    for (int32_t s = 0; s < S; s++) T += mc->q_n[s];
    int32_t *pos = malloc((size_t)T * sizeof *pos), *sot = malloc((size_t)T * sizeof *sot);
    for (int32_t s = 0, t = 0; s < S; s++)
        for (int32_t i = 0; i < mc->q_n[s]; i++, t++) {
            pos[t] = mc->q_from[s] + i;
            sot[t] = s;
        }
    const size_t cache_n = (size_t)n_blocks * KH * bs * hd, q_n = (size_t)T * H * hd;
    float *kh = malloc(cache_n * sizeof *kh), *vh = malloc(cache_n * sizeof *vh);
    float *qh = malloc(q_n * sizeof *qh);
    /* Scores of a few units, so that a temperature moves the weights. */
    for (size_t i = 0; i < cache_n; i++) {
        kh[i] = 2.0f * frand();
        vh[i] = frand();
    }
    for (size_t i = 0; i < q_n; i++) qh[i] = 2.0f * frand();
    if (mode == 1)
        for (size_t i = 0; i < cache_n; i++) {
            kh[i] = bf16_round(kh[i]);
            vh[i] = bf16_round(vh[i]);
        }
    attn_batch b = {.n_tokens = T,
                    .pos = pos,
                    .seq_of_token = sot,
                    .n_seqs = S,
                    .block_tables = tables,
                    .seq_len = mc->len,
                    .seq_segments = mc->segments ? (const int32_t *const *)segs : NULL,
                    .mem_span = span,
                    .mem_temp = temp,
                    .mem_mass = mass};
    float *want = malloc(q_n * sizeof *want), *plain = malloc(q_n * sizeof *plain);
    float *got = malloc(q_n * sizeof *got);
    ref_attention(want, qh, kh, vh, &b, H, KH, hd, bs);
    attn_batch b1 = b;
    b1.mem_span = NULL;
    ref_attention(plain, qh, kh, vh, &b1, H, KH, hd, bs);
    /* How far the scaling moves the output, on the comparison's scale. */
    *max_shift = (float)test_rel_range_err(plain, want, (int32_t)q_n);

    backend *be = g_be;
    const backend_ops *op = be->ops;
    void *k = NULL, *v = NULL;
    float *q = NULL, *o = NULL;
    if (mode == 1) {
        uint16_t *k16 = malloc(cache_n * 2), *v16 = malloc(cache_n * 2);
        for (size_t i = 0; i < cache_n; i++) {
            k16[i] = quant_f32_to_bf16(kh[i]);
            v16[i] = quant_f32_to_bf16(vh[i]);
        }
        assert_int_equal(op->alloc(be, cache_n * 2, &k), IS_OK);
        assert_int_equal(op->alloc(be, cache_n * 2, &v), IS_OK);
        op->upload(be, k, k16, cache_n * 2);
        op->upload(be, v, v16, cache_n * 2);
        free(k16);
        free(v16);
    } else {
        assert_int_equal(op->alloc(be, cache_n * sizeof(float), &k), IS_OK);
        assert_int_equal(op->alloc(be, cache_n * sizeof(float), &v), IS_OK);
        op->upload(be, k, kh, cache_n * sizeof(float));
        op->upload(be, v, vh, cache_n * sizeof(float));
    }
    assert_int_equal(op->alloc(be, q_n * sizeof(float), (void **)&q), IS_OK);
    assert_int_equal(op->alloc(be, q_n * sizeof(float), (void **)&o), IS_OK);
    op->upload(be, q, qh, q_n * sizeof(float));
    op->attention(be, o, q, k, v, &b, H, KH, hd, bs);
    op->download(be, got, o, q_n * sizeof(float));
    op->sync(be);
    assert_int_equal(backend_status(be), IS_OK);
    double err = test_rel_range_err(got, want, (int32_t)q_n);
    op->release(be, k);
    op->release(be, v);
    op->release(be, q);
    op->release(be, o);
    free(want);
    free(plain);
    free(got);
    free(kh);
    free(vh);
    free(qh);
    free(pos);
    free(sot);
    free(perm);
    free(segs[0]);
    return err;
}

static void check_cases(int mode, double tol) {
    const float params[][2] = {{0.7f, 1.0f}, {1.0f, 3.0f}, {0.8f, 0.5f}, {1.3f, 2.0f}};
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++)
        for (size_t p = 0; p < sizeof params / sizeof params[0]; p++) {
            const mem_case *mc = &CASES[c];
            /* The tiled kernel takes no segment masks (the exact one runs). */
            float shift;
            double err = run_case(mc, params[p][0], params[p][1], mode, &shift);
            printf("  %-32s T=%.1f S=%.1f%s: err %.2e (the scaling moves it by %.2e)\n", mc->name,
                   params[p][0], params[p][1], mode ? " [bf16]" : "", err, shift);
            assert_true(err <= tol);
            /* Else a backend that ignored the scaling would pass. */
            assert_true(shift > 1e-2 && shift > 5 * err);
        }
}

static void test_op_against_dense_reference(void **state) {
    (void)state;
#ifdef MEM_SCALE_CUDA
    cuda_opt(g_be, "kv=f32");
#endif
    check_cases(0, 1e-5);
}

#ifdef MEM_SCALE_CUDA
static void test_op_tiled_bf16(void **state) {
    (void)state;
    cuda_opt(g_be, "kv=bf16");
    cuda_opt(g_be, "flash=on");
    check_cases(1, 1e-2);
    cuda_opt(g_be, "flash=off"); /* the exact kernel on the same bf16 cache */
    check_cases(1, 1e-5);
    cuda_opt(g_be, "flash=on");
    cuda_opt(g_be, "kv=f32");
}
#endif

/* T = S = 1 through the mapped path is plain attention (the engine then
 * names no span at all, so the default takes the unmapped paths). */
static void test_unit_scaling_is_plain(void **state) {
    (void)state;
#ifdef MEM_SCALE_CUDA
    cuda_opt(g_be, "kv=f32");
#endif
    float shift;
    assert_true(run_case(&CASES[1], 1.0f, 1.0f, 0, &shift) <= 1e-5);
    assert_true(shift == 0.0f);
}

/* ---- the engine ------------------------------------------------------------- */

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

static engine *make_engine(float temp, float mass) {
    engine_params ep = test_engine_params(2048, 4, 256);
    ep.mem_temp = temp;
    ep.mem_mass = mass;
    return test_engine_create(g_model, ep);
}

/* Logits of the query's last token: injected (0) or prefilled in place
 * with the fact's slots marked as memory (1). */
static void query_logits(engine *e, int how, const int32_t *pre, int32_t np, const int32_t *ft,
                         int32_t nf, const float *k, const float *v, const int32_t *suf, int32_t ns,
                         float *out) {
    int32_t seq, seqs[512], toks[512];
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int i = 0; i < 512; i++) seqs[i] = seq;
    if (how == 0) {
        engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = seqs};
        assert_int_equal(engine_decode(e, &bp, out), IS_OK);
        /* A fork keeps the memory segment: inject into a first sequence,
         * fork it whole, and query the fork. */
        engine_fact fact = {nf, ft, k, v};
        assert_int_equal(engine_inject(e, seq, &fact, 1), IS_OK);
        int32_t mb, me;
        engine_seq_memory(e, seq, &mb, &me);
        assert_int_equal(mb, np);
        assert_int_equal(me, np + nf);
        int32_t fork;
        assert_int_equal(engine_seq_open(e, &fork), IS_OK);
        assert_int_equal(engine_seq_fork(e, fork, seq, np + nf), IS_OK);
        engine_seq_memory(e, fork, &mb, &me);
        assert_int_equal(mb, np);
        assert_int_equal(me, np + nf);
        engine_seq_close(e, seq);
        seq = fork;
        for (int i = 0; i < 512; i++) seqs[i] = seq;
        engine_batch bs = {.n_tokens = ns, .tokens = suf, .seq = seqs};
        assert_int_equal(engine_decode(e, &bs, out), IS_OK);
    } else {
        memcpy(toks, pre, (size_t)np * sizeof *toks);
        memcpy(toks + np, ft, (size_t)nf * sizeof *toks);
        memcpy(toks + np + nf, suf, (size_t)ns * sizeof *toks);
        assert_int_equal(engine_seq_set_memory(e, seq, np, np + nf), IS_OK);
        engine_batch bw = {.n_tokens = np + nf + ns, .tokens = toks, .seq = seqs};
        assert_int_equal(engine_decode(e, &bw, out), IS_OK);
    }
    engine_seq_close(e, seq);
}

static void test_engine_injected_equals_prefill(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
#ifdef MEM_SCALE_CUDA
    cuda_opt(g_be, "kv=f32");
#endif
    const int32_t V = g_model->cfg.n_vocab;
    int32_t np, ns, *suf;
    const int32_t *pre = memory_prompt_prefix(g_mp, &np);
    assert_int_equal(memory_prompt_suffix(g_mp, "Where did Caroline move from?", &suf, &ns), IS_OK);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    float *plain = malloc((size_t)V * sizeof(float));
    engine *e0 = make_engine(1.0f, 1.0f);
    test_fact fact;
    test_fact_encode(e0, g_mp, "Caroline moved from Sweden four years ago.", &fact);
    const int32_t *ft = fact.toks, nf = fact.n;
    const float *k = fact.k, *v = fact.v;
    assert_true(np + nf + ns < 512);
    query_logits(e0, 0, pre, np, ft, nf, k, v, suf, ns, plain);
    engine_free(e0);

    const float params[][2] = {{0.6f, 1.0f}, {1.0f, 4.0f}, {0.8f, 2.0f}};
    for (size_t p = 0; p < sizeof params / sizeof params[0]; p++) {
        engine *e = make_engine(params[p][0], params[p][1]);
        query_logits(e, 0, pre, np, ft, nf, k, v, suf, ns, a);
        query_logits(e, 1, pre, np, ft, nf, k, v, suf, ns, b);
        double err = test_rel_range_err(a, b, V), moved = test_rel_range_err(a, plain, V);
        printf("  T=%.1f S=%.1f: injected vs prefill %.2e; vs unscaled %.2e\n", params[p][0],
               params[p][1], err, moved);
        assert_true(err <= ENGINE_TOL);
        assert_true(moved > 3 * ENGINE_TOL);
        engine_free(e);
    }
    /* Set on a running engine, the scaling applies from the next forward;
     * bad values leave it unchanged. */
    engine *e = make_engine(1.0f, 1.0f);
    assert_int_equal(engine_set_memory_scale(e, 0.0f, 1.0f), IS_ERR_INVALID_ARG);
    assert_int_equal(engine_set_memory_scale(e, 1.0f, INFINITY), IS_ERR_INVALID_ARG);
    query_logits(e, 0, pre, np, ft, nf, k, v, suf, ns, a);
    assert_true(test_rel_range_err(a, plain, V) <= 1e-5);
    assert_int_equal(engine_set_memory_scale(e, params[2][0], params[2][1]), IS_OK);
    query_logits(e, 0, pre, np, ft, nf, k, v, suf, ns, a);
    query_logits(e, 1, pre, np, ft, nf, k, v, suf, ns, b);
    assert_true(test_rel_range_err(a, b, V) <= ENGINE_TOL);
    assert_true(test_rel_range_err(a, plain, V) > 3 * ENGINE_TOL);
    engine_free(e);
    /* Bad settings are refused with an error, never used. */
    engine_params ep = engine_default_params();
    engine *bad = NULL;
    ep.mem_temp = 0.0f;
    assert_int_equal(engine_create(g_model, ep, &bad), IS_ERR_INVALID_ARG);
    ep.mem_temp = 1.0f;
    ep.mem_mass = -1.0f;
    assert_int_equal(engine_create(g_model, ep, &bad), IS_ERR_INVALID_ARG);
    ep.mem_mass = NAN;
    assert_int_equal(engine_create(g_model, ep, &bad), IS_ERR_INVALID_ARG);
    assert_null(bad);
    test_facts_free(&fact, 1);
    free(a);
    free(b);
    free(plain);
    free(suf);
}

/* ---- setup ---------------------------------------------------------------- */

static int setup(void **state) {
    return test_model_open(MEM_SCALE_BACKEND, &g_be, &g_model, &g_mp);
}

static int teardown(void **state) { return test_model_close(g_be, g_model, g_mp); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_op_against_dense_reference),
        cmocka_unit_test(test_unit_scaling_is_plain),
#ifdef MEM_SCALE_CUDA
        cmocka_unit_test(test_op_tiled_bf16),
#endif
        cmocka_unit_test(test_engine_injected_equals_prefill),
    };
#ifdef MEM_SCALE_CUDA
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU tests are skipped\n");
        return 77;
    }
#endif
    return test_run_group(tests, setup, teardown);
}

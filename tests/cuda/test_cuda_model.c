/*
 * The whole forward pass on the CUDA backend against the CPU reference, at
 * the project's bf16 tolerance: relative L2 error of the logits (over all
 * compared positions) <= 1e-2, and the same argmax on >= 99% of positions,
 * in the default matmul precision (CUDA_MATMUL_BF16X2) and KV cache (f32);
 * the faster CUDA_MATMUL_BF16 is held to 1.5e-2 on the default model; the
 * bf16 KV cache (tiled attention) and the legacy backend to 1e-2.
 *
 *  - default model (SmolLM2-135M, Q4_1): a 256-token prefill with logits at
 *    every position, then 64 decode steps through the paged KV cache, each
 *    feeding the next token of the same text (320 positions);
 *  - tiny random-weight models (the .gguf files of tests/golden/tiny, where present:
 *    qwen2 with biases and NeoX RoPE, llama-3.1 frequency factors,
 *    head_dim != dim / n_heads): 200-token prefill + 40 decode steps of
 *    random tokens (same argmax on 95% only: see ARGMAX_MIN_RANDOM);
 *  - memory injection on the GPU: facts encoded (pre-RoPE KV captured),
 *    injected and the query prefilled on the CUDA backend, against the
 *    segment-masked reference prefill on the CUDA backend and on the CPU;
 *  - greedy choices on the GPU (engine_decode_greedy, the argmax op): each
 *    stream compared above runs again, and every position's choice is
 *    vmath_argmax of its GPU logits.
 *
 * Each part skips cleanly without a usable GPU or without its model file.
 * Batches ask for logits at every position or at the first only: the
 * engine gathers other selections with a host memcpy on backend memory,
 * which device memory does not allow (see the report of this test's commit).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "core/vmath.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "serve/memory_prompt.h"
#include "test_util.h"

#define REL_TOL      1e-2   /* the bf16 bar, for the default precision */
#define REL_TOL_BF16 1.5e-2 /* CUDA_MATMUL_BF16 (see test_default_model) */
#define ARGMAX_MIN   0.99
/* Random-weight models (vocabulary 320) have near-ties: top-2 margins down
 * to 1e-4 of the logits. A simulation of this rounding on them
 * (cuda/predict_precision.py) kept the argmax at 98.3% to 100% of positions, so they
 * are held to 95%; the 99% bar applies to the real model. */
#define ARGMAX_MIN_RANDOM 0.95

/* Applies a configuration list (cuda/options.h) to a CUDA backend. */
static void cuda_opts(backend *be, const char *spec) {
    if (backend_cuda_configure(be, spec) != IS_OK)
        fail_msg("cuda options '%s': %s", spec, is_error_last());
}

/* Every option back to its default (the kv option included: f32). */
static void cuda_opts_reset(backend *be) {
    const cuda_options def = cuda_options_default();
    char spec[512];
    cuda_options_format(&def, spec, sizeof spec);
    cuda_opts(be, spec);
}

static backend *g_cpu, *g_gpu;
static model *g_mc, *g_mg; /* the default model on each backend */

static const char *TEXT =
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could "
    "see the fishing boats returning to the harbour, their lamps swaying on the dark water. His "
    "daughter, who was learning to read, liked to count the boats aloud and write the number in a "
    "small blue notebook. On stormy nights the keeper stayed awake until dawn, polishing the great "
    "lens and listening to the wind hammer the windows. In spring the town held a festival for the "
    "sailors, with music, bread and smoked fish, and the keeper's daughter read a poem she had "
    "written about the light that never sleeps.";

static void gpu_ok(void) {
    is_status st = backend_cuda_check(g_gpu);
    if (st != IS_OK) fprintf(stderr, "cuda: %s\n", is_error_last());
    assert_int_equal(st, IS_OK);
}

static int setup(void **state) {
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: every test skips\n");
        return 0;
    }
    if (backend_cpu_create(0, &g_cpu) != IS_OK) return -1;
    if (backend_cuda_create(0, &g_gpu) != IS_OK) {
        fprintf(stderr, "backend_cuda_create: %s\n", is_error_last());
        return -1;
    }
    if (!test_file_exists(IS_DEFAULT_MODEL)) {
        printf("%s is absent: the default-model tests skip\n", IS_DEFAULT_MODEL);
        return 0;
    }
    if (model_load(IS_DEFAULT_MODEL, g_cpu, &g_mc) != IS_OK ||
        model_load(IS_DEFAULT_MODEL, g_gpu, &g_mg) != IS_OK) {
        fprintf(stderr, "model_load: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    model_free(g_mc);
    model_free(g_mg);
    if (g_gpu) g_gpu->ops->free(g_gpu);
    if (g_cpu) g_cpu->ops->free(g_cpu);
    return 0;
}

static engine *make_engine(model *m, int32_t n_ctx) {
    engine_params ep = engine_default_params();
    ep.n_ctx = n_ctx;
    ep.max_seqs = 4;
    engine *e = NULL;
    is_status st = engine_create(m, ep, &e);
    if (st != IS_OK) fprintf(stderr, "engine_create: %s\n", is_error_last());
    assert_int_equal(st, IS_OK);
    return e;
}

typedef struct agreement {
    double rel;   /* |gpu - cpu| / |cpu| over all positions */
    double worst; /* the largest per-position relative error */
    double same;  /* fraction of positions with the same argmax */
} agreement;

static agreement compare_logits(const float *gpu, const float *cpu, int32_t n_pos, int32_t V) {
    agreement a = {0, 0, 0};
    double num = 0, den = 0;
    int32_t same = 0;
    for (int32_t p = 0; p < n_pos; p++) {
        const float *g = gpu + (size_t)p * V, *c = cpu + (size_t)p * V;
        double pn = 0, pd = 0;
        for (int32_t i = 0; i < V; i++) {
            double d = isfinite(g[i]) ? (double)g[i] - c[i] : INFINITY;
            pn += d * d;
            pd += (double)c[i] * c[i];
        }
        num += pn;
        den += pd;
        double r = sqrt(pn / pd);
        if (!(r <= a.worst)) a.worst = r;
        if (sampler_argmax(g, V) == sampler_argmax(c, V)) same++;
    }
    a.rel = sqrt(num / den);
    a.same = (double)same / n_pos;
    return a;
}

static void expect_agreement(const char *what, agreement a, int32_t n_pos, double tol,
                             double argmax_min) {
    printf("  %-44s %4d positions: rel err %.3e (worst position %.3e), same argmax %.2f%%\n", what,
           n_pos, a.rel, a.worst, 100.0 * a.same);
    if (!(a.rel <= tol)) fail_msg("%s: relative error %.3e > %.1e", what, a.rel, tol);
    if (!(a.same >= argmax_min))
        fail_msg("%s: same argmax on %.2f%% < %.0f%%", what, 100.0 * a.same, 100.0 * argmax_min);
}

/* Logits of tokens[0..n_prefill) from one prefill, then of each further
 * token from a decode step: out[n_prefill + n_decode][V]. */
/* The prefill in chunks of at most `chunk` tokens (0: one), then the
 * decode steps; logits of every position into out. */
static void run_stream_chunked(model *m, const int32_t *tokens, int32_t n_prefill, int32_t n_decode,
                               float *out, int32_t chunk, int32_t *greedy) {
    const int32_t V = m->cfg.n_vocab;
    engine *e = make_engine(m, 1024);
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    int32_t *seqs = malloc((size_t)n_prefill * sizeof *seqs);
    bool *want = malloc((size_t)n_prefill);
    for (int32_t i = 0; i < n_prefill; i++) {
        seqs[i] = seq;
        want[i] = true;
    }
    if (chunk <= 0) chunk = n_prefill;
    for (int32_t t = 0; t < n_prefill; t += chunk) {
        const int32_t n = n_prefill - t < chunk ? n_prefill - t : chunk;
        engine_batch b = {.n_tokens = n, .tokens = tokens + t, .seq = seqs, .want_logits = want};
        assert_int_equal(greedy ? engine_decode_greedy(e, &b, greedy + t)
                                : engine_decode(e, &b, out + (size_t)t * V),
                         IS_OK);
    }
    for (int32_t i = 0; i < n_decode; i++) {
        engine_batch d = {.n_tokens = 1, .tokens = tokens + n_prefill + i, .seq = &seq};
        assert_int_equal(greedy ? engine_decode_greedy(e, &d, greedy + n_prefill + i)
                                : engine_decode(e, &d, out + (size_t)(n_prefill + i) * V),
                         IS_OK);
    }
    free(seqs);
    free(want);
    engine_free(e);
}

static void run_stream(model *m, const int32_t *tokens, int32_t n_prefill, int32_t n_decode,
                       float *out) {
    run_stream_chunked(m, tokens, n_prefill, n_decode, out, 0, NULL);
}

/* The GPU's logits against the CPU's, the GPU's prefill in chunks of at
 * most `chunk` tokens (0: one), the CPU's in one. */
static void compare_stream_chunked(const char *what, model *mc, model *mg, const int32_t *tokens,
                                   int32_t n_prefill, int32_t n_decode, int32_t chunk, double tol,
                                   double argmax_min) {
    const int32_t V = mc->cfg.n_vocab, n = n_prefill + n_decode;
    float *lc = malloc((size_t)n * V * sizeof(float)), *lg = malloc((size_t)n * V * sizeof(float));
    assert_non_null(lc);
    assert_non_null(lg);
    for (size_t i = 0; i < (size_t)n * V; i++) lg[i] = NAN;
    run_stream(mc, tokens, n_prefill, n_decode, lc);
    run_stream_chunked(mg, tokens, n_prefill, n_decode, lg, chunk, NULL);
    gpu_ok();
    expect_agreement(what, compare_logits(lg, lc, n, V), n, tol, argmax_min);
    /* The same stream again with engine_decode_greedy: the GPU's argmax op
     * chooses, at every position, vmath_argmax of the logits above. */
    int32_t *greedy = malloc((size_t)n * sizeof *greedy);
    assert_non_null(greedy);
    run_stream_chunked(mg, tokens, n_prefill, n_decode, NULL, chunk, greedy);
    gpu_ok();
    for (int32_t p = 0; p < n; p++)
        if (greedy[p] != vmath_argmax(lg + (size_t)p * V, V))
            fail_msg("%s: greedy choice at %d is %d, the logits' argmax %d", what, p, greedy[p],
                     vmath_argmax(lg + (size_t)p * V, V));
    free(greedy);
    free(lc);
    free(lg);
}

static void compare_stream(const char *what, model *mc, model *mg, const int32_t *tokens,
                           int32_t n_prefill, int32_t n_decode, double tol, double argmax_min) {
    compare_stream_chunked(what, mc, mg, tokens, n_prefill, n_decode, 0, tol, argmax_min);
}

static void test_default_model(void **state) {
    if (!g_mg) TEST_SKIP(TEST_NEEDS_MODEL);
    int32_t *toks;
    size_t n;
    assert_int_equal(tokenizer_encode(g_mc->tok, TEXT, strlen(TEXT), true, false, &toks, &n),
                     IS_OK);
    const int32_t n_prefill = 256, n_decode = 64, total = n_prefill + n_decode;
    int32_t *stream = malloc((size_t)total * sizeof *stream);
    for (int32_t i = 0; i < total; i++) stream[i] = toks[(size_t)i % n]; /* the text, repeated */
    compare_stream("SmolLM2-135M Q4_1, 256 prefill + 64 decode", g_mc, g_mg, stream, n_prefill,
                   n_decode, REL_TOL, ARGMAX_MIN);
    /* The faster rounding (bf16 inputs): simulated at 9.8e-3 on this text
     * (cuda/predict_precision.py), so its bound is looser than the default's. */
    cuda_opts(g_gpu, "precision=bf16");
    compare_stream("  the same with CUDA_MATMUL_BF16", g_mc, g_mg, stream, n_prefill, n_decode,
                   REL_TOL_BF16, ARGMAX_MIN);
    /* The prefill in chunks of a 30-token query (bf16 inputs: 30 GEMM
     * columns) and of 16 tokens (bf16x2: 32), whose products are on the
     * wgmma kernel (cuda/wgmma_gemm.cuh), the head excepted: the same bars. */
    compare_stream_chunked("  the same, prefill in chunks of 30 (wgmma)", g_mc, g_mg, stream,
                           n_prefill, n_decode, 30, REL_TOL_BF16, ARGMAX_MIN);
    cuda_opts(g_gpu, "precision=bf16x2");
    compare_stream_chunked("  bf16x2, prefill in chunks of 16 (wgmma)", g_mc, g_mg, stream,
                           n_prefill, n_decode, 16, REL_TOL, ARGMAX_MIN);
    /* The bf16 KV cache (tiled attention: 7.7e-3 measured on the H200), and
     * the plainest configuration (the "before" of the benchmarks), both
     * held to the same bar. */
    cuda_opts(g_gpu, "kv=bf16");
    compare_stream("  the same with the bf16 KV cache", g_mc, g_mg, stream, n_prefill, n_decode,
                   REL_TOL, ARGMAX_MIN);
    cuda_opts(g_gpu, CUDA_OPTIONS_PLAINEST);
    compare_stream("  the same, plainest configuration", g_mc, g_mg, stream, n_prefill, n_decode,
                   REL_TOL, ARGMAX_MIN);
    cuda_opts_reset(g_gpu);
    /* One product per weight instead of one over the stacked q, k, v and
     * gate, up: the same bar. */
    cuda_opts(g_gpu, "stacked=off");
    compare_stream("  the same, products unstacked", g_mc, g_mg, stream, n_prefill, n_decode,
                   REL_TOL, ARGMAX_MIN);
    cuda_opts(g_gpu, "stacked=on");
    free(stream);
    free(toks);
}

static void test_tiny_models(void **state) {
    if (!g_gpu) TEST_SKIP("needs a CUDA device");
    const char *dir_path = IS_GOLDEN_DIR "/tiny";
    DIR *dir = opendir(dir_path);
    if (!dir) TEST_SKIP("needs the tiny golden models in tests/golden/tiny");
    int n_models = 0;
    uint64_t rng = 7;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        size_t len = strlen(de->d_name);
        if (len < 6 || strcmp(de->d_name + len - 5, ".gguf") != 0) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir_path, de->d_name);
        model *mc = NULL, *mg = NULL;
        assert_int_equal(model_load(path, g_cpu, &mc), IS_OK);
        is_status st = model_load(path, g_gpu, &mg);
        if (st != IS_OK) fprintf(stderr, "model_load(%s) on cuda: %s\n", path, is_error_last());
        assert_int_equal(st, IS_OK);
        const int32_t n_prefill = 200, n_decode = 40, V = mc->cfg.n_vocab;
        int32_t toks[240];
        for (int32_t i = 0; i < n_prefill + n_decode; i++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            toks[i] = (int32_t)(rng % (uint64_t)V);
        }
        char what[96];
        snprintf(what, sizeof what, "tiny %s", de->d_name);
        compare_stream(what, mc, mg, toks, n_prefill, n_decode, REL_TOL, ARGMAX_MIN_RANDOM);
        /* Every product on cuBLAS (no skinny, no wgmma kernel): the same bar. */
        cuda_opts(g_gpu, "skinny=off,wgmma=off");
        compare_stream("  the same, every product on cuBLAS", mc, mg, toks, n_prefill, n_decode,
                       REL_TOL, ARGMAX_MIN_RANDOM);
        /* Decode steps on the wgmma kernel (cuda/wgmma_gemm.cuh) where it
         * takes the shape: the same bar. */
        cuda_opts(g_gpu, "wgmma=on");
        compare_stream("  the same, decode products on the wgmma kernel", mc, mg, toks, n_prefill,
                       n_decode, REL_TOL, ARGMAX_MIN_RANDOM);
        cuda_opts(g_gpu, "skinny=on");
        /* Kernels launched as programmatic dependents or not: the same
         * kernels on the same arguments, so the same bits. */
        const size_t nl = (size_t)(n_prefill + n_decode) * V;
        float *with = malloc(nl * sizeof(float)), *without = malloc(nl * sizeof(float));
        assert_non_null(with);
        assert_non_null(without);
        run_stream(mg, toks, n_prefill, n_decode, with);
        cuda_opts(g_gpu, "pdl=off");
        run_stream(mg, toks, n_prefill, n_decode, without);
        cuda_opts(g_gpu, "pdl=on");
        gpu_ok();
        assert_memory_equal(with, without, nl * sizeof(float));
        printf("  the same with and without programmatic dependent launch: bitwise\n");
        free(with);
        free(without);
        model_free(mc);
        model_free(mg);
        n_models++;
    }
    closedir(dir);
    if (n_models == 0) TEST_SKIP("needs the tiny golden models in tests/golden/tiny");
}

/* ---- injection ------------------------------------------------------------------ */

static const char *FACTS[] = {
    "Caroline went to an LGBTQ support group on 7 May 2023.",
    "Melanie painted a sunrise over a lake last year.",
    "Caroline moved from Sweden four years ago.",
    "Melanie plays the clarinet and started as a child.",
};
static const char *TURNS[] = {
    "Caroline: I have been thinking a lot about family lately.",
    "Melanie: The kids and I went hiking again this weekend.",
};

typedef struct encoded {
    int32_t *ctx, n_ctx; /* context tokens */
    int32_t *toks, n;    /* fact tokens */
    float *k, *v;        /* [n_layers][n][kv_dim] pre-RoPE */
} encoded;

/* want_logits for a batch whose logits are not needed: token 0 only, the
 * one selection (with "all") that the engine never gathers by memcpy. */
static bool *first_only(int32_t n) {
    bool *w = calloc((size_t)n, 1);
    w[0] = true;
    return w;
}

/* Encodes a fact after the serving prefix and w context turns on `m`'s
 * engine, capturing its pre-RoPE keys and values. */
static void encode(engine *e, const model *m, const memory_prompt *mp, const char *text, int w,
                   encoded *out) {
    memset(out, 0, sizeof *out);
    assert_int_equal(memory_prompt_fact(mp, text, &out->toks, &out->n), IS_OK);
    assert_int_equal(memory_prompt_context(mp, TURNS, w, &out->ctx, &out->n_ctx), IS_OK);
    int32_t np;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    int32_t total = np + out->n_ctx + out->n;
    int32_t *toks = malloc((size_t)total * sizeof *toks),
            *seqs = malloc((size_t)total * sizeof *seqs);
    memcpy(toks, pre, (size_t)np * sizeof *toks);
    if (out->n_ctx) memcpy(toks + np, out->ctx, (size_t)out->n_ctx * sizeof *toks);
    memcpy(toks + np + out->n_ctx, out->toks, (size_t)out->n * sizeof *toks);
    size_t sz = (size_t)m->cfg.n_layers * out->n * m->cfg.n_kv_heads * m->cfg.head_dim;
    out->k = malloc(sz * sizeof(float));
    out->v = malloc(sz * sizeof(float));
    engine_kv_capture cap = {.first = np + out->n_ctx, .n = out->n, .k = out->k, .v = out->v};
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int32_t i = 0; i < total; i++) seqs[i] = seq;
    float *logits = malloc((size_t)m->cfg.n_vocab * sizeof(float));
    bool *want = first_only(total);
    engine_batch b = {
        .n_tokens = total, .tokens = toks, .seq = seqs, .want_logits = want, .capture = &cap};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    engine_seq_close(e, seq);
    free(want);
    free(logits);
    free(toks);
    free(seqs);
}

static void encoded_free(encoded *x) {
    free(x->ctx);
    free(x->toks);
    free(x->k);
    free(x->v);
}

/* When set, run_injection leaves out the values of the facts the backend
 * holds (and expects it to hold them all). */
static bool g_omit_resident;

/* Suffix logits [ns][V] after injecting the facts (encoded on m's backend),
 * with cache ids for the backend's fact-KV arena, or none (NULL). */
static void run_injection(model *m, const memory_prompt *mp, int n_facts, int w, const char *query,
                          const uint64_t *ids, float *out, int32_t *ns_out) {
    engine *e = make_engine(m, 2048);
    encoded enc[4];
    engine_fact facts[4];
    int n_omitted = 0;
    for (int i = 0; i < n_facts; i++) {
        encode(e, m, mp, FACTS[i], w, &enc[i]);
        facts[i] = (engine_fact){enc[i].n, enc[i].toks, enc[i].k, enc[i].v};
        /* As the server does: no values for a record the backend holds. */
        if (g_omit_resident && ids && engine_fact_resident(e, ids[i], enc[i].n)) {
            facts[i].k = facts[i].v = NULL;
            n_omitted++;
        }
    }
    if (g_omit_resident) assert_int_equal(n_omitted, n_facts);
    int32_t np, *suf, ns;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    assert_int_equal(memory_prompt_suffix(mp, query, &suf, &ns), IS_OK);
    int32_t seq, sq[1024];
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int i = 0; i < 1024; i++) sq[i] = seq;
    bool *want = first_only(np), all[1024];
    for (int i = 0; i < 1024; i++) all[i] = true;
    engine_batch bp = {.n_tokens = np, .tokens = pre, .seq = sq, .want_logits = want};
    assert_int_equal(engine_decode(e, &bp, out), IS_OK);
    assert_int_equal(engine_inject_ids(e, seq, facts, ids, n_facts), IS_OK);
    engine_batch bs = {.n_tokens = ns, .tokens = suf, .seq = sq, .want_logits = all};
    assert_int_equal(engine_decode(e, &bs, out), IS_OK);
    *ns_out = ns;
    for (int i = 0; i < n_facts; i++) encoded_free(&enc[i]);
    free(want);
    free(suf);
    engine_free(e);
}

/* Suffix logits [ns][V] of the segment-masked reference prefill: facts at
 * their serving positions, each after its context, seeing the prefix at
 * the distance they had when encoded (see tests/engine/test_inject.c). */
static void run_reference(model *m, const memory_prompt *mp, int n_facts, int w, const char *query,
                          float *out) {
    engine *e = make_engine(m, 2048);
    const int32_t V = m->cfg.n_vocab;
    int32_t np, *suf, ns;
    const int32_t *pre = memory_prompt_prefix(mp, &np);
    assert_int_equal(memory_prompt_suffix(mp, query, &suf, &ns), IS_OK);
    int32_t toks[1024], seg[1024], pos[1024], shift[1024], sq[1024];
    bool want[1024];
    int32_t t = 0, s_i = np;
    for (int32_t i = 0; i < np; i++, t++) {
        toks[t] = pre[i];
        seg[t] = 0;
        pos[t] = i;
        shift[t] = 0;
    }
    for (int f = 0; f < n_facts; f++) {
        int32_t *ft, nf, *ct, nc;
        assert_int_equal(memory_prompt_fact(mp, FACTS[f], &ft, &nf), IS_OK);
        assert_int_equal(memory_prompt_context(mp, TURNS, w, &ct, &nc), IS_OK);
        int32_t delta = s_i - nc - np;
        for (int32_t j = 0; j < nc; j++, t++) {
            toks[t] = ct[j];
            seg[t] = -(f + 1);
            pos[t] = s_i - nc + j;
            shift[t] = delta;
        }
        for (int32_t j = 0; j < nf; j++, t++) {
            toks[t] = ft[j];
            seg[t] = f + 1;
            pos[t] = s_i + j;
            shift[t] = delta;
        }
        s_i += nf;
        free(ft);
        free(ct);
    }
    for (int32_t j = 0; j < ns; j++, t++) {
        toks[t] = suf[j];
        seg[t] = 0;
        pos[t] = s_i + j;
        shift[t] = 0;
    }
    assert_true(t <= 1024);
    int32_t seq;
    assert_int_equal(engine_seq_open(e, &seq), IS_OK);
    for (int32_t i = 0; i < t; i++) {
        sq[i] = seq;
        want[i] = true;
    }
    float *all = malloc((size_t)t * V * sizeof(float));
    engine_batch b = {.n_tokens = t,
                      .tokens = toks,
                      .seq = sq,
                      .want_logits = want,
                      .segment = seg,
                      .pos = pos,
                      .prefix_shift = shift};
    assert_int_equal(engine_decode(e, &b, all), IS_OK);
    memcpy(out, all + (size_t)(t - ns) * V, (size_t)ns * V * sizeof(float));
    free(all);
    free(suf);
    engine_free(e);
}

static void test_injection_on_gpu(void **state) {
    if (!g_mg) TEST_SKIP(TEST_NEEDS_MODEL);
    const int32_t V = g_mg->cfg.n_vocab;
    memory_prompt *mp;
    assert_int_equal(memory_prompt_create(g_mg, NULL, &mp), IS_OK);
    const char *query = "Where did Caroline move from, and what does Melanie play?";
    float *inj = malloc((size_t)256 * V * sizeof(float)),
          *ref = malloc((size_t)256 * V * sizeof(float));
    float *cref = malloc((size_t)256 * V * sizeof(float));
    for (int w = 0; w <= 2; w += 2) {
        int32_t ns;
        run_injection(g_mg, mp, 4, w, query, NULL, inj, &ns);
        run_reference(g_mg, mp, 4, w, query, ref);
        run_reference(g_mc, mp, 4, w, query, cref);
        gpu_ok();
        char what[96];
        snprintf(what, sizeof what, "inject (GPU) vs masked ref (GPU), w=%d", w);
        expect_agreement(what, compare_logits(inj, ref, ns, V), ns, REL_TOL, ARGMAX_MIN);
        snprintf(what, sizeof what, "inject (GPU) vs masked ref (CPU), w=%d", w);
        expect_agreement(what, compare_logits(inj, cref, ns, V), ns, REL_TOL, ARGMAX_MIN);
        /* The bf16 cache: injection in one launch from the GPU arena,
         * against the masked reference over the same bf16 cache (6.7e-3
         * measured on the H200; the CPU's reference is 1.08e-2 away, past the
         * bar, which is why bf16 is not the default). The first run with ids
         * fills the arena, the second finds every record resident; both
         * inject the same bf16 values, so their logits are bit-identical to
         * the run without ids (transient pages). */
        cuda_opts(g_gpu, "kv=bf16");
        float *inj16 = malloc((size_t)256 * V * sizeof(float));
        int32_t ns16;
        run_injection(g_mg, mp, 4, w, query, NULL, inj16, &ns16);
        run_reference(g_mg, mp, 4, w, query, ref);
        gpu_ok();
        assert_int_equal(ns16, ns);
        snprintf(what, sizeof what, "bf16 cache: inject vs masked ref (GPU), w=%d", w);
        expect_agreement(what, compare_logits(inj16, ref, ns, V), ns, REL_TOL, ARGMAX_MIN);
        const uint64_t ids[4] = {100 + w, 200 + w, 300 + w, 400 + w};
        cuda_arena_stats a0, a1, a2;
        backend_cuda_arena_stats(g_gpu, &a0);
        cuda_arena_stats a3;
        for (int pass = 0; pass < 3; pass++) {
            float *again = malloc((size_t)256 * V * sizeof(float));
            int32_t ns2;
            g_omit_resident = pass == 2; /* the third: resident facts without values */
            run_injection(g_mg, mp, 4, w, query, ids, again, &ns2);
            g_omit_resident = false;
            gpu_ok();
            assert_int_equal(ns2, ns);
            assert_memory_equal(again, inj16, (size_t)ns * V * sizeof(float));
            free(again);
            backend_cuda_arena_stats(g_gpu, pass == 0 ? &a1 : pass == 1 ? &a2 : &a3);
        }
        assert_int_equal(a3.hits - a2.hits, 4);
        assert_int_equal(a3.bytes_uploaded, a2.bytes_uploaded);
        cuda_opts(g_gpu, "kv=f32");
        assert_int_equal(a1.misses - a0.misses, 4);
        assert_int_equal(a2.hits - a1.hits, 4);
        assert_int_equal(a2.bytes_uploaded, a1.bytes_uploaded);
        printf("  inject through the arena, w=%d: 4 fills, then 4 hits, then 4 hits without values;"
               " logits identical\n",
               w);
        free(inj16);
    }
    free(inj);
    free(ref);
    free(cref);
    memory_prompt_free(mp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_model),
        cmocka_unit_test(test_tiny_models),
        cmocka_unit_test(test_injection_on_gpu),
    };
    /* Without a device every test would skip: say so once and let ctest
     * report the program as skipped (SKIP_RETURN_CODE 77), not passed. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU tests are skipped\n");
        return 77;
    }
    return test_run_group(tests, setup, teardown);
}

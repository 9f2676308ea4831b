/*
 * CUDA graphs (backend_cuda_set_graphs): the same engine work on two CUDA
 * backends, graphs off and on, must give the same logits and the same
 * greedy tokens. The graph replays the kernels eager mode launches, with
 * the same arguments, so the logits should be bitwise equal; the bar is
 * 1e-5 of each row's logit range (the count of bitwise-equal rows is
 * printed).
 *
 *  - one sequence: a 20-token prefill (short: recorded as a graph), then
 *    40 greedy decode steps; run twice on the graph backend, cold and warm:
 *    every forward is recorded, the warm run breaks no capture, and
 *    executable graphs are mostly updated, not instantiated anew;
 *  - two sequences prefilled in one batch, then decoding in one batch;
 *  - growth inside a capture: a fresh backend whose pinned bump buffer
 *    starts at 64 bytes (IS_CUDA_GRAPH_PIN_BYTES), a 60-token prefill after
 *    a 20-token one (the matmul input scratch grows mid-capture), a
 *    300-token prefill (eager), then three sequences decoding together
 *    (longer attention metadata, more flash splits): captures end early
 *    (graph_break) and the rest of the forward runs eagerly, same logits.
 *
 * Each part runs with the f32 and the bf16 KV cache (tiled attention), on
 * the tiny random-weight Llama-3.1 model of tests/golden/tiny and, where
 * present (the first two), on the default model (SmolLM2-135M). Graphs are
 * off by default: the graph backends turn them on explicitly.
 * Without a usable GPU the program exits 77 (ctest: skipped).
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

#include "backend_cuda.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "test_util.h"

#define TOL 1e-5 /* of a row's logit range */
#define TINY_MODEL IS_GOLDEN_DIR "/tiny/llama31_f32.gguf"

static backend *g_off, *g_on, *g_pin; /* graphs off; on; on with a 64-byte bump buffer */
static model *g_tiny[3], *g_dflt[3];  /* the models on each of the three */

static void backend_ok(backend *be) {
    is_status st = backend_cuda_check(be);
    if (st != IS_OK) fprintf(stderr, "cuda: %s\n", is_error_last());
    assert_int_equal(st, IS_OK);
}

static int setup(void **state) {
    if (backend_cuda_create(0, &g_off) != IS_OK || backend_cuda_create(0, &g_on) != IS_OK) {
        fprintf(stderr, "backend_cuda_create: %s\n", is_error_last());
        return -1;
    }
    setenv("IS_CUDA_GRAPH_PIN_BYTES", "64", 1);
    is_status st = backend_cuda_create(0, &g_pin);
    unsetenv("IS_CUDA_GRAPH_PIN_BYTES");
    if (st != IS_OK) return -1;
    backend_cuda_set_graphs(g_off, false);
    backend_cuda_set_graphs(g_on, true);
    backend_cuda_set_graphs(g_pin, true);
    backend *bes[3] = {g_off, g_on, g_pin};
    for (int i = 0; i < 3; i++) {
        if (test_file_exists(TINY_MODEL) && model_load(TINY_MODEL, bes[i], &g_tiny[i]) != IS_OK) {
            fprintf(stderr, "model_load(%s): %s\n", TINY_MODEL, is_error_last());
            return -1;
        }
        if (i < 2 && test_file_exists(IS_DEFAULT_MODEL) &&
            model_load(IS_DEFAULT_MODEL, bes[i], &g_dflt[i]) != IS_OK) {
            fprintf(stderr, "model_load(%s): %s\n", IS_DEFAULT_MODEL, is_error_last());
            return -1;
        }
    }
    if (!g_tiny[0]) printf("%s is absent: the tiny-model parts skip\n", TINY_MODEL);
    if (!g_dflt[0]) printf("%s is absent: the default-model parts skip\n", IS_DEFAULT_MODEL);
    return 0;
}

static int teardown(void **state) {
    for (int i = 0; i < 3; i++) {
        model_free(g_tiny[i]);
        model_free(g_dflt[i]);
    }
    if (g_off) g_off->ops->free(g_off);
    if (g_on) g_on->ops->free(g_on);
    if (g_pin) g_pin->ops->free(g_pin);
    return 0;
}

/* ---- a script of prefills and decode steps -------------------------------- */

typedef struct script {
    int32_t n_seqs;
    int32_t prompt[4];  /* prompt length of each sequence */
    bool together;      /* prompts in one batch, else one batch per sequence */
    int32_t steps;      /* decode steps, each a batch of one token per sequence */
} script;

/* What a run produced: logits of each sequence's last prompt token, then of
 * every decode step ([n_rows][V]), and the greedy tokens ([steps][n_seqs]). */
typedef struct run_out {
    float *logits;
    int32_t n_rows;
    int32_t *tokens;
} run_out;

static void run_out_free(run_out *r) {
    free(r->logits);
    free(r->tokens);
}

static int32_t prompt_token(int32_t s, int32_t i, int32_t V) {
    return (int32_t)(((uint64_t)(s + 1) * 2654435761u + (uint64_t)i * 40503u) % (uint64_t)V);
}

static run_out run_script(model *m, const script *sc) {
    const int32_t V = m->cfg.n_vocab, S = sc->n_seqs;
    engine_params ep = engine_default_params();
    ep.n_ctx = 512;
    ep.max_seqs = 4;
    engine *e = NULL;
    assert_int_equal(engine_create(m, ep, &e), IS_OK);
    run_out r = {0};
    r.n_rows = S + sc->steps * S;
    r.logits = malloc((size_t)r.n_rows * V * sizeof(float));
    r.tokens = malloc((size_t)(sc->steps > 0 ? sc->steps : 1) * S * sizeof(int32_t));
    assert_non_null(r.logits);
    assert_non_null(r.tokens);
    int32_t seq[4], tok[512], sq[512], next[4];
    bool want[512];
    for (int32_t s = 0; s < S; s++) assert_int_equal(engine_seq_open(e, &seq[s]), IS_OK);
    /* Prefills: one batch, or one per sequence; logits of each last token. */
    int32_t n = 0;
    for (int32_t s = 0; s < S; s++) {
        for (int32_t i = 0; i < sc->prompt[s]; i++, n++) {
            tok[n] = prompt_token(s, i, V);
            sq[n] = seq[s];
            want[n] = i == sc->prompt[s] - 1;
        }
        if (!sc->together || s == S - 1) {
            const int32_t first = sc->together ? 0 : s;
            engine_batch b = {.n_tokens = n, .tokens = tok, .seq = sq, .want_logits = want};
            assert_int_equal(engine_decode(e, &b, r.logits + (size_t)first * V), IS_OK);
            n = 0;
        }
    }
    for (int32_t s = 0; s < S; s++) next[s] = sampler_argmax(r.logits + (size_t)s * V, V);
    for (int32_t t = 0; t < sc->steps; t++) {
        for (int32_t s = 0; s < S; s++) {
            tok[s] = next[s];
            sq[s] = seq[s];
            want[s] = true;
            r.tokens[t * S + s] = next[s];
        }
        float *out = r.logits + (size_t)(S + t * S) * V;
        engine_batch b = {.n_tokens = S, .tokens = tok, .seq = sq, .want_logits = want};
        assert_int_equal(engine_decode(e, &b, out), IS_OK);
        for (int32_t s = 0; s < S; s++) next[s] = sampler_argmax(out + (size_t)s * V, V);
    }
    engine_free(e);
    return r;
}

/* Graph run against eager run: every row within TOL of its range, and the
 * same greedy tokens. */
static void expect_same(const char *what, const run_out *on, const run_out *off, int32_t V,
                        int32_t n_tokens) {
    assert_int_equal(on->n_rows, off->n_rows);
    int32_t identical = 0;
    double worst = 0;
    for (int32_t r = 0; r < off->n_rows; r++) {
        const float *a = on->logits + (size_t)r * V, *b = off->logits + (size_t)r * V;
        float lo = b[0], hi = b[0];
        double d = 0;
        for (int32_t i = 0; i < V; i++) {
            lo = b[i] < lo ? b[i] : lo;
            hi = b[i] > hi ? b[i] : hi;
            double x = isfinite(a[i]) ? fabs((double)a[i] - b[i]) : INFINITY;
            d = x > d ? x : d;
        }
        double rel = d / ((double)hi - lo);
        if (!(rel <= worst)) worst = rel;
        if (memcmp(a, b, (size_t)V * sizeof(float)) == 0) identical++;
    }
    printf("  %-52s %4d rows, %4d bitwise equal, worst |diff| / range %.2e\n", what, off->n_rows,
           identical, worst);
    if (!(worst <= TOL)) fail_msg("%s: logits differ by %.3e of their range (> %.0e)", what, worst, TOL);
    for (int32_t i = 0; i < n_tokens; i++)
        if (on->tokens[i] != off->tokens[i])
            fail_msg("%s: greedy token %d differs (%d with graphs, %d without)", what, i,
                     on->tokens[i], off->tokens[i]);
}

static cuda_graph_stats stats_since(backend *be, const cuda_graph_stats *from) {
    cuda_graph_stats s;
    backend_cuda_graph_stats(be, &s);
    s.recorded -= from->recorded;
    s.instantiations -= from->instantiations;
    s.updates -= from->updates;
    s.breaks -= from->breaks;
    s.launches -= from->launches;
    return s;
}

static void print_stats(const char *what, const cuda_graph_stats *s) {
    printf("  %-52s graphs: %lld recorded, %lld launches, %lld instantiated, %lld updated, "
           "%lld breaks\n", what, (long long)s->recorded, (long long)s->launches,
           (long long)s->instantiations, (long long)s->updates, (long long)s->breaks);
}

static int32_t n_forwards(const script *sc) {
    return (sc->together ? 1 : sc->n_seqs) + sc->steps;
}

/* The script twice on m_on (cold, then warm), one graph per forward,
 * against its run without graphs. */
static void check_graphs(const char *name, const char *cache, model *m_on, const script *sc,
                         const run_out *off) {
    const int32_t V = m_on->cfg.n_vocab, nf = n_forwards(sc);
    cuda_graph_stats s0, s1;
    backend_cuda_graph_stats(g_on, &s0);
    run_out cold = run_script(m_on, sc);
    backend_ok(g_on);
    cuda_graph_stats d_cold = stats_since(g_on, &s0);
    backend_cuda_graph_stats(g_on, &s1);
    run_out warm = run_script(m_on, sc);
    backend_ok(g_on);
    cuda_graph_stats d_warm = stats_since(g_on, &s1);

    char what[160];
    snprintf(what, sizeof what, "%s, %s cache, one graph, cold", name, cache);
    expect_same(what, &cold, off, V, sc->steps * sc->n_seqs);
    print_stats(what, &d_cold);
    snprintf(what, sizeof what, "%s, %s cache, one graph, warm", name, cache);
    expect_same(what, &warm, off, V, sc->steps * sc->n_seqs);
    print_stats(what, &d_warm);
    /* Every forward is short: each is recorded, and launched unless a
     * capture broke (then what it recorded before is). */
    assert_int_equal(d_cold.recorded, nf);
    assert_int_equal(d_warm.recorded, nf);
    assert_true(d_cold.launches >= d_cold.recorded - d_cold.breaks);
    assert_true(d_warm.launches >= d_warm.recorded);
    /* Warm: every buffer is large enough already. */
    assert_int_equal(d_warm.breaks, 0);
    /* Updates do the work: few shapes (prefill, decode, a token array
     * copied or found unchanged, a flash split more), few instances. */
    assert_true(4 * (d_cold.instantiations + d_warm.instantiations) <=
                d_cold.launches + d_warm.launches);
    assert_true(d_warm.updates >= d_warm.launches / 2);
    run_out_free(&cold);
    run_out_free(&warm);
}

/* The script on m_off (graphs off), then on m_on with one graph per
 * forward, with each KV cache type. */
static void check_script(const char *name, model *m_off, model *m_on, const script *sc) {
    for (int kv = 0; kv < 2; kv++) {
        const cuda_kv_dtype dt = kv ? CUDA_KV_BF16 : CUDA_KV_F32;
        backend_cuda_set_kv_dtype(g_off, dt);
        backend_cuda_set_kv_dtype(g_on, dt);
        cuda_graph_stats s0;
        backend_cuda_graph_stats(g_off, &s0);
        run_out off = run_script(m_off, sc);
        backend_ok(g_off);
        cuda_graph_stats d_off = stats_since(g_off, &s0);
        assert_int_equal(d_off.recorded, 0); /* graphs off: nothing recorded */
        assert_int_equal(d_off.launches, 0);
        check_graphs(name, kv ? "bf16" : "f32", m_on, sc, &off);
        run_out_free(&off);
    }
    backend_cuda_set_kv_dtype(g_off, CUDA_KV_F32);
    backend_cuda_set_kv_dtype(g_on, CUDA_KV_F32);
}

static void test_one_sequence(void **state) {
    if (!g_tiny[0] && !g_dflt[0]) skip();
    const script sc = {.n_seqs = 1, .prompt = {20}, .together = true, .steps = 40};
    if (g_tiny[0]) check_script("tiny llama31: 20 prefill + 40 decode", g_tiny[0], g_tiny[1], &sc);
    if (g_dflt[0]) check_script("SmolLM2: 20 prefill + 40 decode", g_dflt[0], g_dflt[1], &sc);
}

static void test_two_sequences(void **state) {
    if (!g_tiny[0] && !g_dflt[0]) skip();
    const script sc = {.n_seqs = 2, .prompt = {20, 17}, .together = true, .steps = 40};
    if (g_tiny[0])
        check_script("tiny llama31: 2 seqs, 37 prefill + 40x2 decode", g_tiny[0], g_tiny[1], &sc);
    if (g_dflt[0])
        check_script("SmolLM2: 2 seqs, 37 prefill + 40x2 decode", g_dflt[0], g_dflt[1], &sc);
}

/* Buffers that grow while a forward is being captured: the capture ends
 * there, what it recorded is launched, the rest runs eagerly. */
static void test_growth_mid_capture(void **state) {
    if (!g_tiny[0]) skip();
    const script sc = {.n_seqs = 3, .prompt = {20, 60, 300}, .together = false, .steps = 24};
    const int32_t V = g_tiny[0]->cfg.n_vocab;
    for (int kv = 0; kv < 2; kv++) {
        const cuda_kv_dtype dt = kv ? CUDA_KV_BF16 : CUDA_KV_F32;
        backend_cuda_set_kv_dtype(g_off, dt);
        backend_cuda_set_kv_dtype(g_pin, dt);
        cuda_graph_stats s0;
        backend_cuda_graph_stats(g_pin, &s0);
        run_out off = run_script(g_tiny[0], &sc);
        backend_ok(g_off);
        run_out on = run_script(g_tiny[2], &sc);
        backend_ok(g_pin);
        cuda_graph_stats d = stats_since(g_pin, &s0);
        char what[128];
        snprintf(what, sizeof what, "tiny: 20, 60, 300 prefills + 24x3 decode, %s cache, one graph",
                 kv ? "bf16" : "f32");
        expect_same(what, &on, &off, V, sc.steps * sc.n_seqs);
        print_stats(what, &d);
        /* The 300-token prefill is long: not recorded. */
        assert_int_equal(d.recorded, n_forwards(&sc) - 1);
        assert_true(d.launches >= d.recorded - d.breaks);
        if (kv == 0) assert_true(d.breaks >= 1); /* a fresh backend, a 64-byte bump buffer */
        run_out_free(&off);
        run_out_free(&on);
    }
    backend_cuda_set_kv_dtype(g_off, CUDA_KV_F32);
    backend_cuda_set_kv_dtype(g_pin, CUDA_KV_F32);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_sequence),
        cmocka_unit_test(test_two_sequences),
        cmocka_unit_test(test_growth_mid_capture),
    };
    /* Without a device every test would skip: let ctest report the program
     * as skipped (SKIP_RETURN_CODE 77), not passed. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU tests are skipped\n");
        return 77;
    }
    if (getenv("IS_TEST_FILTER")) cmocka_set_test_filter(getenv("IS_TEST_FILTER"));
    return cmocka_run_group_tests(tests, setup, teardown);
}

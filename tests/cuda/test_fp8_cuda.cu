/*
 * test_fp8_cuda: fp8 e4m3 on the GPU against core/fp8.c, and the fp8 fact
 * arena.
 *
 *   - host: fp8.c's conversions against CUDA's own (cuda_fp8.h's host
 *     code, __nv_cvt_float_to_fp8 with __NV_SATFINITE): every code
 *     decoded, the reference inputs of tests/golden/fp8_e4m3.txt and a
 *     sweep of f32 bit patterns encoded. Needs no device (runs in CI).
 *   - device: the same with the GPU's conversion instructions
 *     (__nv_fp8_e4m3, as the arena's kernels use them), bit for bit (NaN:
 *     both NaN).
 *   - device: the arena's fp8 fill gives fp8_quantize_rows' codes and
 *     scales bit for bit.
 *   - device: injection from an fp8 arena. Facts whose values are already
 *     on the fp8 grid (what an fp8 record holds) give logits identical to
 *     a bf16 arena's; f32 facts quantised by the arena give the logits of
 *     a bf16 arena holding those facts quantised by fp8.c (so the GPU
 *     stores exactly what an fp8 record would); the facts are the model's
 *     own keys and values for some tokens; the stated tolerance
 *     against the bf16 arena with the unquantised facts: relative L2
 *     error of the logits <= 2e-2, same argmax (the CPU's measure,
 *     tests/eval/test_kv_precision.c); and a resident fact (values left
 *     out) gives the same logits as its fill.
 * On the default model when present, else the tiny Llama of tests/golden/tiny.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
extern "C" { /* this cmocka.h declares its functions for C only */
#include <cmocka.h>
}

#include <cuda_fp8.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "backend_cuda.h"
#include "kv.cuh"
extern "C" {
#include "engine/engine.h"
#include "core/fp8.h"
#include "model/model.h"
#include "test_util.h"
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The inputs: the reference file's, and every 4099th f32 bit pattern. */
static std::vector<uint32_t> inputs(void) {
    std::vector<uint32_t> in;
    FILE *fp = fopen(IS_GOLDEN_DIR "/fp8_e4m3.txt", "r");
    assert_non_null(fp);
    char line[128];
    unsigned a, b;
    while (fgets(line, sizeof line, fp))
        if (line[0] == 'e' && sscanf(line + 1, "%x %x", &a, &b) == 2) in.push_back(a);
    fclose(fp);
    for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) in.push_back((uint32_t)u);
    return in;
}

static void test_host_conversions(void **state) {
    (void)state;
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        __nv_fp8_e4m3 q;
        q.__x = (__nv_fp8_storage_t)c;
        const float want = (float)q, got = fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(want) ? !isnan(got) : bits_of(want) != bits_of(got)) {
            if (bad++ < 10)
                printf("decode %02x: cuda %08x, fp8.c %08x\n", c, bits_of(want), bits_of(got));
        }
    }
    const std::vector<uint32_t> in = inputs();
    for (uint32_t u : in) {
        const uint8_t want = __nv_cvt_float_to_fp8(float_of(u), __NV_SATFINITE, __NV_E4M3);
        const uint8_t got = fp8_e4m3_from_f32(float_of(u));
        if (want != got && bad++ < 10) printf("encode %08x: cuda %02x, fp8.c %02x\n", u, want, got);
    }
    printf("host: 256 codes decoded, %zu f32 encoded: %d differ from cuda_fp8.h\n", in.size(), bad);
    assert_int_equal(bad, 0);
}

static __global__ void convert_kernel(const float *x, uint8_t *codes, int64_t n, float *decoded) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) codes[i] = __nv_fp8_e4m3(x[i]).__x;
    if (i < 256) {
        __nv_fp8_e4m3 q;
        q.__x = (__nv_fp8_storage_t)i;
        decoded[i] = (float)q;
    }
}

static bool g_device;

static void test_device_conversions(void **state) {
    (void)state;
    if (!g_device) TEST_SKIP("needs a CUDA device");
    const std::vector<uint32_t> in = inputs();
    const int64_t n = (int64_t)in.size();
    float *dx, *ddec;
    uint8_t *dc;
    assert_int_equal(cudaMalloc(&dx, n * 4), cudaSuccess);
    assert_int_equal(cudaMalloc(&dc, n), cudaSuccess);
    assert_int_equal(cudaMalloc(&ddec, 256 * 4), cudaSuccess);
    assert_int_equal(cudaMemcpy(dx, in.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    convert_kernel<<<(unsigned)((n + 255) / 256), 256>>>(dx, dc, n, ddec);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> codes((size_t)n);
    float dec[256];
    assert_int_equal(cudaMemcpy(codes.data(), dc, n, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(cudaMemcpy(dec, ddec, sizeof dec, cudaMemcpyDeviceToHost), cudaSuccess);
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        const float got = fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(dec[c]) ? !isnan(got) : bits_of(dec[c]) != bits_of(got))
            if (bad++ < 10)
                printf("decode %02x: gpu %08x, fp8.c %08x\n", c, bits_of(dec[c]), bits_of(got));
    }
    for (int64_t i = 0; i < n; i++) {
        const uint8_t got = fp8_e4m3_from_f32(float_of(in[(size_t)i]));
        if (codes[(size_t)i] != got && bad++ < 10)
            printf("encode %08x: gpu %02x, fp8.c %02x\n", in[(size_t)i], codes[(size_t)i], got);
    }
    printf("device: 256 codes decoded, %lld f32 encoded: %d differ from fp8.c\n", (long long)n,
           bad);
    cudaFree(dx);
    cudaFree(dc);
    cudaFree(ddec);
    assert_int_equal(bad, 0);
}

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static float gauss(void) {
    float s = 0;
    for (int i = 0; i < 4; i++) {
        g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
        s += (float)(g_rng >> 40) / (float)(1u << 24) - 0.5f;
    }
    return s * 1.7320508f;
}

static void test_arena_fill(void **state) {
    (void)state;
    if (!g_device) TEST_SKIP("needs a CUDA device");
    const int32_t L = 3, H = 4, D = 64, T = 5, kv_dim = H * D;
    const size_t n = (size_t)L * T * kv_dim, page = cuda_arena_page_bytes(L, H, D, true);
    std::vector<float> k(n), v(n);
    for (size_t i = 0; i < n; i++) {
        const size_t row = i / D;
        const float mag = ldexpf(1.0f, (int)(row % 23) - 11);
        k[i] = row == 7 ? 0.0f : gauss() * mag;
        v[i] = gauss() * mag * 3.0f;
    }
    const int32_t pages[T] = {4, 0, 2, 1, 3}; /* token j into page pages[j] */
    float *dk, *dv;
    int32_t *dp;
    uint8_t *arena;
    assert_int_equal(cudaMalloc(&dk, n * 4), cudaSuccess);
    assert_int_equal(cudaMalloc(&dv, n * 4), cudaSuccess);
    assert_int_equal(cudaMalloc(&dp, sizeof pages), cudaSuccess);
    assert_int_equal(cudaMalloc(&arena, page * T), cudaSuccess);
    cudaMemset(arena, 0xAB, page * T);
    cudaMemcpy(dk, k.data(), n * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dv, v.data(), n * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dp, pages, sizeof pages, cudaMemcpyHostToDevice);
    assert_int_equal(cuda_arena_fill(0, arena, dp, dk, dv, T, L, H, D, true), IS_OK);
    std::vector<uint8_t> got(page * T);
    assert_int_equal(cudaMemcpy(got.data(), arena, got.size(), cudaMemcpyDeviceToHost),
                     cudaSuccess);
    /* Expected: fp8_quantize_rows of each (layer, token) row, placed as kv.cuh says. */
    std::vector<uint8_t> codes(n);
    std::vector<float> scales((size_t)L * T * H);
    const size_t codes_bytes = ((size_t)2 * L * kv_dim + 15) & ~(size_t)15;
    int bad = 0;
    for (int s = 0; s < 2; s++) {
        fp8_quantize_rows((s ? v : k).data(), (size_t)L * T * H, D, codes.data(), scales.data());
        for (int32_t l = 0; l < L; l++)
            for (int32_t j = 0; j < T; j++) {
                const uint8_t *pg = got.data() + (size_t)pages[j] * page;
                const uint8_t *c = pg + ((size_t)s * L + l) * kv_dim;
                const float *sc = (const float *)(pg + codes_bytes) + ((size_t)s * L + l) * H;
                const size_t row = (size_t)l * T + j;
                bad += memcmp(c, codes.data() + row * kv_dim, kv_dim) != 0;
                bad += memcmp(sc, scales.data() + row * H, H * sizeof(float)) != 0;
            }
    }
    printf("arena fill: %d of %d (K or V, layer, token) rows differ from fp8_quantize_rows\n", bad,
           2 * L * T * 2);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dp);
    cudaFree(arena);
    assert_int_equal(bad, 0);
}

/* ---- injection ------------------------------------------------------------- */

static backend *g_gpu;
static model *g_model;

enum { N_FACTS = 4, FACT_TOKENS = 7, N_PREFIX = 5, N_SUFFIX = 6 };

/* Cache ids name contents, and the arena outlives engines: each run's facts
 * get ids of their own. */
static uint64_t g_next_id = 1000;

/* Suffix logits [N_SUFFIX][V] after a prefix and the facts injected with
 * fresh cache ids, the arena in fp8 or not; `again`: a second request on
 * the same engine, values left out (resident). */
static void run(bool fp8, const std::vector<float> &k, const std::vector<float> &v, bool again,
                std::vector<float> &out) {
    assert_int_equal(backend_set_option(g_gpu, BACKEND_OPT_FACT_CACHE_FP8, fp8), IS_OK);
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.max_seqs = 2;
    engine *e;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    const int32_t V = g_model->cfg.n_vocab;
    const size_t per = k.size() / N_FACTS;
    int32_t toks[64], seqs[64];
    bool want[64];
    out.assign((size_t)N_SUFFIX * V, 0);
    std::vector<float> scratch((size_t)N_SUFFIX * V);
    const uint64_t id0 = g_next_id;
    g_next_id += N_FACTS;
    for (int rep = 0; rep < (again ? 2 : 1); rep++) {
        int32_t seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        for (int i = 0; i < 64; i++) {
            toks[i] = 1 + (i * 37) % (V - 1);
            seqs[i] = seq;
            want[i] = true;
        }
        engine_batch bp;
        memset(&bp, 0, sizeof bp);
        bp.n_tokens = N_PREFIX;
        bp.tokens = toks;
        bp.seq = seqs;
        bp.want_logits = want;
        assert_int_equal(engine_decode(e, &bp, scratch.data()), IS_OK);
        engine_fact facts[N_FACTS];
        uint64_t ids[N_FACTS];
        for (int f = 0; f < N_FACTS; f++) {
            ids[f] = id0 + (uint64_t)f;
            const bool omit = rep == 1;
            if (omit) assert_true(engine_fact_resident(e, ids[f], FACT_TOKENS));
            facts[f] = (engine_fact){FACT_TOKENS, toks + 10 + f, omit ? NULL : k.data() + f * per,
                                     omit ? NULL : v.data() + f * per};
        }
        assert_int_equal(engine_inject_ids(e, seq, facts, ids, N_FACTS), IS_OK);
        engine_batch bs = bp;
        bs.n_tokens = N_SUFFIX;
        bs.tokens = toks + 40;
        assert_int_equal(engine_decode(e, &bs, rep == 0 ? out.data() : scratch.data()), IS_OK);
        if (rep == 1) assert_memory_equal(scratch.data(), out.data(), out.size() * sizeof(float));
        engine_seq_close(e, seq);
    }
    engine_free(e);
}

/* Each fact's keys and values as the model computes them for FACT_TOKENS
 * tokens read after N_PREFIX others (what encoding a fact captures). */
static void capture_facts(std::vector<float> &k, std::vector<float> &v) {
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.max_seqs = 2;
    engine *e;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    const int32_t V = g_model->cfg.n_vocab, T = N_PREFIX + FACT_TOKENS;
    const size_t per = k.size() / N_FACTS;
    std::vector<float> logits((size_t)V);
    for (int f = 0; f < N_FACTS; f++) {
        int32_t toks[N_PREFIX + FACT_TOKENS], seqs[N_PREFIX + FACT_TOKENS], seq;
        assert_int_equal(engine_seq_open(e, &seq), IS_OK);
        for (int32_t i = 0; i < T; i++) {
            toks[i] = 1 + (int32_t)((i * 101 + f * 977 + 13) % (V - 1));
            seqs[i] = seq;
        }
        engine_kv_capture cap = {N_PREFIX, FACT_TOKENS, 0, k.data() + f * per, v.data() + f * per};
        engine_batch b;
        memset(&b, 0, sizeof b);
        b.n_tokens = T;
        b.tokens = toks;
        b.seq = seqs;
        b.capture = &cap;
        assert_int_equal(engine_decode(e, &b, logits.data()), IS_OK);
        engine_seq_close(e, seq);
    }
    engine_free(e);
}

static double rel_l2(const std::vector<float> &a, const std::vector<float> &ref) {
    double d = 0, r = 0;
    for (size_t i = 0; i < a.size(); i++) {
        d += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        r += (double)ref[i] * ref[i];
    }
    return sqrt(d / r);
}

static void test_injection(void **state) {
    (void)state;
    if (!g_device) TEST_SKIP("needs a CUDA device");
    const char *path = test_file_exists(IS_DEFAULT_MODEL) ? IS_DEFAULT_MODEL
                                                          : IS_GOLDEN_DIR "/tiny/llama31_f32.gguf";
    assert_int_equal(backend_set_option(g_gpu, BACKEND_OPT_KV_COMPACT, 1), IS_OK);
    assert_int_equal(model_load(path, g_gpu, &g_model), IS_OK);
    const model_config *c = &g_model->cfg;
    const size_t rows = (size_t)c->n_layers * FACT_TOKENS * c->n_kv_heads;
    const size_t n = rows * c->head_dim * N_FACTS;
    /* Facts: [fact][layer][token][kv_dim], the model's own keys and values
     * (captured while it reads tokens), so that the error below is the one
     * real facts see: random rows of arbitrary scale say nothing about it
     * (the fill's own test covers rows of many binades bit for bit). */
    std::vector<float> k(n), v(n), kq(n), vq(n);
    capture_facts(k, v);
    std::vector<uint8_t> codes(n);
    std::vector<float> sc(n / c->head_dim);
    fp8_quantize_rows(k.data(), n / c->head_dim, c->head_dim, codes.data(), sc.data());
    fp8_dequantize_rows(codes.data(), sc.data(), n / c->head_dim, c->head_dim, kq.data());
    fp8_quantize_rows(v.data(), n / c->head_dim, c->head_dim, codes.data(), sc.data());
    fp8_dequantize_rows(codes.data(), sc.data(), n / c->head_dim, c->head_dim, vq.data());

    std::vector<float> bf_q, f8_q, f8_raw, bf_raw;
    run(false, kq, vq, false, bf_q); /* bf16 arena, fp8-grid values */
    run(true, kq, vq, true, f8_q);   /* fp8 arena, the same values; then resident */
    run(true, k, v, true, f8_raw);   /* fp8 arena quantising f32 values */
    run(false, k, v, false, bf_raw); /* bf16 arena, f32 values */
    const size_t bytes = bf_q.size() * sizeof(float);
    const bool same_grid = memcmp(bf_q.data(), f8_q.data(), bytes) == 0;
    const bool same_quant = memcmp(bf_q.data(), f8_raw.data(), bytes) == 0;
    const double err = rel_l2(f8_raw, bf_raw);
    int same_top = 0;
    const int32_t V = c->n_vocab;
    for (int t = 0; t < N_SUFFIX; t++) {
        const float *a = f8_raw.data() + (size_t)t * V, *b = bf_raw.data() + (size_t)t * V;
        int32_t ia = 0, ib = 0;
        for (int32_t i = 1; i < V; i++) {
            if (a[i] > a[ia]) ia = i;
            if (b[i] > b[ib]) ib = i;
        }
        same_top += ia == ib;
    }
    printf("%s: fp8 arena vs bf16 arena on fp8-grid facts: %s; fp8 arena quantising f32 facts "
           "vs bf16 arena on fp8.c's quantisation: %s; vs bf16 arena on the f32 facts: rel L2 "
           "%.3e, same argmax %d/%d\n",
           path, same_grid ? "identical" : "DIFFER", same_quant ? "identical" : "DIFFER", err,
           same_top, (int)N_SUFFIX);
    assert_true(same_grid);
    assert_true(same_quant);
    assert_true(err <= 2e-2);
    assert_int_equal(same_top, N_SUFFIX);
    assert_true(err > 0); /* the arena did quantise */
    model_free(g_model);
    g_model = NULL;
}

static int setup(void **state) {
    (void)state;
    g_device = backend_cuda_available();
    if (!g_device) {
        printf("no usable CUDA device: the device tests skip\n");
        return 0;
    }
    return backend_cuda_create(0, &g_gpu) == IS_OK ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    if (g_gpu) g_gpu->ops->free(g_gpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_conversions),
        cmocka_unit_test(test_device_conversions),
        cmocka_unit_test(test_arena_fill),
        cmocka_unit_test(test_injection),
    };
    return test_run_group(tests, setup, teardown);
}

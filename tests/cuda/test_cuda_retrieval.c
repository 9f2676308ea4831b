/*
 * test_cuda_retrieval: GPU retrieval (cuda/retrieval_cuda.h) against the CPU.
 *
 *   embedder   two random-weight BERTs (tests/common/test_bert.h): A (hidden 64, 2 heads
 *              of 32, 2 layers, mean pooling, max_seq_length 24 of 40
 *              positions, LayerNorm eps 1e-12) and B (hidden 48, 2 heads of
 *              24, 3 layers, CLS pooling, 20 positions, eps 1e-5, embedding
 *              tables small enough that eps matters). Texts
 *              (empty, one word, longer than max_seq_length: truncated) and
 *              raw id sequences of 1 .. max tokens, one at a time and in a
 *              batch of 600 texts (two chunks of tokens, three tokenisation
 *              groups); every vector within cosine >= 0.99999 and 1e-4 per
 *              element of the CPU embedder's; the device-output variants
 *              equal the host ones (1e-6); bad arguments give statuses.
 *              The real MiniLM the same way when its folder exists
 *              (IS_EMBEDDER_DIR, else models/all-MiniLM-L6-v2), else skipped.
 *   top-k      against a brute force in double (score descending, then row
 *              ascending), same rows in the same order and scores within
 *              1e-6: random unit rows of 384 floats, n = 1, 7, 1000, 100003,
 *              k = 1, 10, 50, 1024 (clamped to n), aligned and unaligned
 *              queries, exact duplicate rows; 1,000,003 rows of 16 values in
 *              {-1, 0, 1} (integer scores: ties everywhere, several rounds
 *              of the device selection) and 50,000 rows of 13 (the scalar
 *              path), with a zero query (every score ties: rows 0..k-1);
 *              removes (swap with last, reported move), replacements and
 *              appends in any order, from host and device memory, then
 *              search again; refused updates leave the matrix unchanged;
 *              score_rows gives every listed row the score a search gave it.
 *
 * Without a usable GPU the program exits 77 (ctest: skipped). Seed:
 * IS_TEST_SEED (default 1).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend_cuda.h"
#include "core/status.h"
#include "memory/embedder.h"
#include "memory/embedder_weights.h"
#include "retrieval_cuda.h"
#include "test_bert.h"
#include "test_util.h"

/* ---- helpers -------------------------------------------------------------- */

static uint64_t g_rng = 1;

static uint64_t rng_next(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-a, a). */
static float urand(float a) {
    return (float)(((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0) * a);
}

static int32_t irand(int32_t n) { return (int32_t)(rng_next() % (uint64_t)n); }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static void cuda_ok(cudaError_t e) {
    if (e != cudaSuccess) fail_msg("cuda: %s", cudaGetErrorString(e));
}

static void ok(is_status st) {
    if (st != IS_OK) fail_msg("status %s: %s", is_status_to_string(st), is_error_last());
}

static float *dev_alloc(size_t n) {
    float *d = NULL;
    cuda_ok(cudaMalloc((void **)&d, n * sizeof(float)));
    return d;
}

/* The random BERTs (tests/common/test_bert.h) are written under g_tmp. */
static char g_tmp[256];

/* ---- comparing embeddings ------------------------------------------------------ */

/* Fails unless every row of got[n][dim] is within cosine 0.99999 and 1e-4
 * per element of want's; prints the worst of both. */
static void expect_embeddings(const char *what, const float *got, const float *want, int32_t n,
                              int32_t dim) {
    double worst_cos = 1.0, worst_abs = 0.0;
    for (int32_t i = 0; i < n; i++) {
        const float *a = got + (size_t)i * dim, *b = want + (size_t)i * dim;
        double ab = 0, aa = 0, bb = 0, mx = 0;
        for (int32_t d = 0; d < dim; d++) {
            if (!isfinite(a[d])) fail_msg("%s: text %d value %d is %f", what, i, d, (double)a[d]);
            ab += (double)a[d] * b[d];
            aa += (double)a[d] * a[d];
            bb += (double)b[d] * b[d];
            double e = fabs((double)a[d] - b[d]);
            if (e > mx) mx = e;
        }
        double cosv = ab / sqrt(aa * bb);
        if (fabs(aa - 1.0) > 1e-5) fail_msg("%s: text %d has norm^2 %.8f, not 1", what, i, aa);
        if (cosv < worst_cos) worst_cos = cosv;
        if (mx > worst_abs) worst_abs = mx;
        if (!(cosv >= 0.99999) || !(mx <= 1e-4))
            fail_msg("%s: text %d: cosine %.8f, max abs diff %.3g (need >= 0.99999, <= 1e-4)", what,
                     i, cosv, mx);
    }
    printf("  %-40s n=%-4d cosine >= %.9f, max abs diff %.3g\n", what, n, worst_cos, worst_abs);
}

/* max |a - b| over n values. */
static double max_diff(const float *a, const float *b, size_t n) {
    double mx = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= mx)) mx = e; /* NaN propagates */
    }
    return mx;
}

/* Embeds texts and id sequences with both embedders and compares. */
static void compare_embedders(const char *label, embedder *cpu, cuda_embedder *gpu,
                              const char *const *texts, int32_t n_texts) {
    const int32_t dim = embedder_dim(cpu), M = embedder_max_tokens(cpu);
    assert_int_equal(cuda_embedder_dim(gpu), dim);
    assert_int_equal(cuda_embedder_max_tokens(gpu), M);
    char what[128];

    /* Texts: the whole batch, then one at a time. */
    float *c = xmalloc((size_t)n_texts * dim * sizeof(float));
    float *g = xmalloc((size_t)n_texts * dim * sizeof(float));
    ok(embedder_embed(cpu, texts, n_texts, c));
    ok(cuda_embedder_embed(gpu, texts, n_texts, g));
    snprintf(what, sizeof what, "%s texts, batch", label);
    expect_embeddings(what, g, c, n_texts, dim);
    for (int32_t i = 0; i < n_texts && i < 8; i++) {
        float *one = xmalloc((size_t)dim * sizeof(float));
        ok(cuda_embedder_embed(gpu, &texts[i], 1, one));
        snprintf(what, sizeof what, "%s text %d alone", label, i);
        expect_embeddings(what, one, c + (size_t)i * dim, 1, dim);
        free(one);
    }

    /* The device variant: same vectors as the host one. */
    float *d = dev_alloc((size_t)n_texts * dim);
    float *back = xmalloc((size_t)n_texts * dim * sizeof(float));
    ok(cuda_embedder_embed_device(gpu, texts, n_texts, d));
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
    cuda_ok(cudaMemcpy(back, d, (size_t)n_texts * dim * sizeof(float), cudaMemcpyDeviceToHost));
    double e = max_diff(back, g, (size_t)n_texts * dim);
    printf("  %-40s max abs diff to the host variant %.3g\n", "device output", e);
    assert_true(e <= 1e-6);

    /* Raw ids: lengths 1, 2, 3, 7, M - 1, M, random ids (any id, even
     * [PAD] or [SEP] in the middle). */
    const int32_t lens[6] = {1, 2, 3, 7, M - 1, M};
    const int32_t n_vocab = wordpiece_n_vocab(embedder_tokenizer(cpu));
    int32_t *ids[6];
    for (int i = 0; i < 6; i++) {
        ids[i] = xmalloc((size_t)lens[i] * sizeof(int32_t));
        for (int32_t p = 0; p < lens[i]; p++) ids[i][p] = irand(n_vocab);
    }
    const int32_t *const *cids = (const int32_t *const *)ids;
    float ci[6 * 512], gi[6 * 512];
    assert_true(dim <= 512);
    ok(embedder_embed_ids(cpu, cids, lens, 6, ci));
    ok(cuda_embedder_embed_ids(gpu, cids, lens, 6, gi));
    snprintf(what, sizeof what, "%s ids, lengths 1..%d", label, M);
    expect_embeddings(what, gi, ci, 6, dim);
    ok(cuda_embedder_embed_ids_device(gpu, cids, lens, 6, d));
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
    cuda_ok(cudaMemcpy(back, d, (size_t)6 * dim * sizeof(float), cudaMemcpyDeviceToHost));
    assert_true(max_diff(back, gi, (size_t)6 * dim) <= 1e-6);
    for (int i = 0; i < 6; i++) free(ids[i]);
    cuda_ok(cudaFree(d));
    free(back);
    free(c);
    free(g);
}

/* The device copy of a loaded CPU embedder, made from the weights it hands out. */
static is_status gpu_from(const embedder *cpu, int32_t device, cuda_embedder **gpu) {
    encoder_weights w;
    embedder_get_weights(cpu, &w);
    return cuda_embedder_create(&w, device, gpu);
}

static void load_both(const char *dir, embedder **cpu, cuda_embedder **gpu) {
    if (embedder_load(dir, cpu) != IS_OK) fail_msg("embedder_load %s: %s", dir, is_error_last());
    if (gpu_from(*cpu, 0, gpu) != IS_OK) fail_msg("cuda_embedder_create: %s", is_error_last());
}

/* ---- embedder tests ------------------------------------------------------------- */

static const char *const short_texts[] = {
    "",
    "cat",
    "the cat sat on the mat.",
    "Caroline went to the beach with her kids last week!",
    "zzz qqq unable unknowable",
    "she likes painting, he likes pizza? the dog ran to the park and the cat sat on a mat in the "
    "park "
    "with her kids and the dog likes the beach and the cat likes pizza last week",
};
#define N_SHORT ((int32_t)(sizeof short_texts / sizeof *short_texts))

static const char *const words[] = {"the", "cat",    "dog",   "sat",      "on",       "mat",
                                    "a",   "and",    "ran",   "to",       "park",     "she",
                                    "he",  "likes",  "pizza", "caroline", "painting", "!",
                                    ",",   "unable", "xyz",   "kids",     "beach"};

/* A batch of n random texts of 0..40 words (many over max_seq_length). */
static char **random_texts(int32_t n) {
    char **t = xmalloc((size_t)n * sizeof *t);
    for (int32_t i = 0; i < n; i++) {
        t[i] = xmalloc(400);
        size_t at = 0;
        int32_t w = irand(41);
        t[i][0] = 0;
        for (int32_t j = 0; j < w; j++) {
            const char *s = words[irand((int32_t)(sizeof words / sizeof *words))];
            at += (size_t)snprintf(t[i] + at, 400 - at, "%s%s", j ? " " : "", s);
        }
    }
    return t;
}

static void test_embedder_random(void **state) {
    (void)state;
    const test_bert_cfg *cfgs[2] = {&test_bert_a, &test_bert_b};
    for (int m = 0; m < 2; m++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", g_tmp, cfgs[m]->name);
        embedder *cpu = NULL;
        cuda_embedder *gpu = NULL;
        load_both(dir, &cpu, &gpu);
        compare_embedders(cfgs[m]->name, cpu, gpu, short_texts, N_SHORT);
        /* 600 texts: more than one chunk of tokens on model A (8192) and
         * three tokenisation groups (256). */
        const int32_t n = 600;
        char **t = random_texts(n);
        float *c = xmalloc((size_t)n * embedder_dim(cpu) * sizeof(float));
        float *g = xmalloc((size_t)n * embedder_dim(cpu) * sizeof(float));
        ok(embedder_embed(cpu, (const char *const *)t, n, c));
        ok(cuda_embedder_embed(gpu, (const char *const *)t, n, g));
        char what[96];
        snprintf(what, sizeof what, "%s 600 random texts", cfgs[m]->name);
        expect_embeddings(what, g, c, n, embedder_dim(cpu));
        for (int32_t i = 0; i < n; i++) free(t[i]);
        free(t);
        free(c);
        free(g);
        cuda_embedder_free(gpu);
        embedder_free(cpu);
    }
}

/* The same encoder through the memory layer's interface (memory/embedder.h):
 * a device copy made by backend name gives the CPU's vectors, on the host
 * and in device memory, and refuses what the interface refuses. */
static void test_embedder_interface(void **state) {
    (void)state;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, test_bert_a.name);
    embedder *cpu = NULL, *dev = NULL;
    if (embedder_load(dir, &cpu) != IS_OK) fail_msg("embedder_load %s: %s", dir, is_error_last());
    ok(embedder_create_on(cpu, "cuda", 0, &dev));
    assert_string_equal(embedder_backend(dev), "cuda");
    const int32_t dim = embedder_dim(cpu);
    assert_int_equal(embedder_dim(dev), dim);
    assert_int_equal(embedder_max_tokens(dev), embedder_max_tokens(cpu));
    assert_ptr_equal(embedder_tokenizer(dev), embedder_tokenizer(cpu));
    float *c = xmalloc((size_t)N_SHORT * dim * sizeof(float));
    float *g = xmalloc((size_t)N_SHORT * dim * sizeof(float));
    float *back = xmalloc((size_t)N_SHORT * dim * sizeof(float));
    ok(embedder_embed(cpu, short_texts, N_SHORT, c));
    ok(embedder_embed(dev, short_texts, N_SHORT, g));
    expect_embeddings("interface, host", g, c, N_SHORT, dim);
    float *d = NULL;
    cuda_ok(cudaMalloc((void **)&d, (size_t)N_SHORT * dim * sizeof(float)));
    ok(embedder_embed_device(dev, short_texts, N_SHORT, d));
    cuda_ok(cudaStreamSynchronize(cudaStreamPerThread));
    cuda_ok(cudaMemcpy(back, d, (size_t)N_SHORT * dim * sizeof(float), cudaMemcpyDeviceToHost));
    expect_embeddings("interface, device", back, c, N_SHORT, dim);
    const int32_t ids[3] = {2, 5, 3}, *p = ids, len = 3;
    ok(embedder_embed_ids(cpu, &p, &len, 1, c));
    ok(embedder_embed_ids(dev, &p, &len, 1, g));
    expect_embeddings("interface, ids", g, c, 1, dim);
    embedder *keep = (embedder *)0x1;
    assert_int_equal(embedder_create_on(dev, "cuda", 0, &keep), IS_ERR_INVALID_ARG);
    assert_int_equal(embedder_create_on(cpu, "cuda", 999, &keep), IS_ERR_UNSUPPORTED);
    assert_ptr_equal(keep, (embedder *)0x1);
    assert_int_equal(embedder_embed_device(cpu, short_texts, 1, d), IS_ERR_UNSUPPORTED);
    cuda_ok(cudaFree(d));
    free(c);
    free(g);
    free(back);
    embedder_free(dev);
    embedder_free(cpu);
}

static void test_embedder_errors(void **state) {
    (void)state;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, test_bert_a.name);
    embedder *cpu = NULL;
    cuda_embedder *gpu = NULL, *keep = (cuda_embedder *)0x1;
    load_both(dir, &cpu, &gpu);
    const int32_t M = embedder_max_tokens(cpu);
    float out[64 * 2];
    float *d = dev_alloc(64 * 2);
    const int32_t ok_ids[3] = {2, 6, 3}, bad_id[3] = {2, 40, 3}, neg_id[3] = {2, -1, 3};
    const int32_t *p_ok = ok_ids, *p_bad = bad_id, *p_neg = neg_id, *p_null = NULL;
    const int32_t len3 = 3, len0 = 0, len_long = M + 1;
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_bad, &len3, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_neg, &len3, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_ok, &len0, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_ok, &len_long, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_null, &len3, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_ok, &len3, -1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, &p_ok, &len3, 1, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids_device(gpu, &p_bad, &len3, 1, d), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_ids(gpu, NULL, NULL, 0, NULL), IS_OK);
    assert_int_equal(cuda_embedder_embed_ids(NULL, &p_ok, &len3, 1, out), IS_ERR_INVALID_ARG);
    const char *texts[2] = {"cat", NULL};
    assert_int_equal(cuda_embedder_embed(gpu, texts, 2, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed_device(gpu, texts, 2, d), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed(gpu, NULL, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_embedder_embed(gpu, NULL, 0, NULL), IS_OK);
    /* Still works after the refusals. */
    float c[64];
    ok(embedder_embed(cpu, texts, 1, c));
    ok(cuda_embedder_embed(gpu, texts, 1, out));
    expect_embeddings("after refused calls", out, c, 1, embedder_dim(cpu));
    assert_int_equal(cuda_embedder_create(NULL, 0, &keep), IS_ERR_INVALID_ARG);
    assert_int_equal(gpu_from(cpu, 999, &keep), IS_ERR_UNSUPPORTED);
    assert_ptr_equal(keep, (cuda_embedder *)0x1);
    cuda_ok(cudaFree(d));
    cuda_embedder_free(gpu);
    cuda_embedder_free(NULL);
    embedder_free(cpu);
}

static void test_embedder_minilm(void **state) {
    (void)state;
    const char *env = getenv("IS_EMBEDDER_DIR");
    char dir[1024], path[1100];
    snprintf(dir, sizeof dir, "%s", env && *env ? env : IS_SOURCE_DIR "/models/all-MiniLM-L6-v2");
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (access(path, R_OK) != 0) {
        printf("  no MiniLM at %s (set IS_EMBEDDER_DIR)\n", dir);
        TEST_SKIP(TEST_NEEDS_EMBEDDER);
    }
    embedder *cpu = NULL;
    cuda_embedder *gpu = NULL;
    load_both(dir, &cpu, &gpu);
    /* The long one is about 40 * 9 = 360 tokens: truncated to 256. */
    char *long_text = xmalloc(40 * 64 + 1);
    long_text[0] = 0;
    for (int i = 0; i < 40; i++) strcat(long_text, "Melanie painted a lake sunrise last year. ");
    const char *texts[] = {
        "",
        "Hi",
        "Caroline attended an LGBTQ support group recently and found the transgender stories "
        "inspiring.",
        "Jon lost his job as a banker and decided to open his own dance studio.",
        "What did Melanie paint last year?",
        "Audrey adopted two dachshunds named Pepper and Panda last spring, caf\xc3\xa9 "
        "\xe6\x9d\xb1 ok.",
        long_text,
    };
    compare_embedders("MiniLM", cpu, gpu, texts, (int32_t)(sizeof texts / sizeof *texts));
    free(long_text);
    cuda_embedder_free(gpu);
    embedder_free(cpu);
}

/* ---- top-k --------------------------------------------------------------------- */

typedef struct ref_hit {
    double s;
    int32_t i;
} ref_hit;

static int cmp_ref(const void *a, const void *b) {
    const ref_hit *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* All n rows of M[n][dim] by their dot product with q, in double, best
 * first (ties: lower row first). */
static ref_hit *brute_force(const float *M, int32_t n, int32_t dim, const float *q) {
    ref_hit *r = xmalloc((size_t)n * sizeof *r);
    for (int32_t i = 0; i < n; i++) {
        const float *row = M + (size_t)i * dim;
        double s = 0;
        for (int32_t d = 0; d < dim; d++) s += (double)row[d] * q[d];
        r[i].s = s;
        r[i].i = i;
    }
    qsort(r, (size_t)n, sizeof *r, cmp_ref);
    return r;
}

static int32_t g_unaligned; /* searches with the query one float off alignment */

/* Searches m (whose rows are M[n][dim] on the host) for q with every k of
 * ks and compares with the brute force. */
static void expect_search(const char *what, cuda_fact_matrix *m, const float *M, int32_t n,
                          int32_t dim, const float *q) {
    assert_int_equal(cuda_fact_matrix_count(m), n);
    ref_hit *ref = brute_force(M, n, dim, q);
    float *dq = dev_alloc((size_t)dim + 1);
    float *qd = dq + (g_unaligned ? 1 : 0);
    cuda_ok(cudaMemcpy(qd, q, (size_t)dim * sizeof(float), cudaMemcpyHostToDevice));
    static const int32_t ks[] = {1, 10, 50, 1024};
    int32_t idx[CUDA_TOPK_MAX];
    float score[CUDA_TOPK_MAX];
    for (size_t t = 0; t < sizeof ks / sizeof *ks; t++) {
        const int32_t k = ks[t], want = k < n ? k : n;
        int32_t got = -1;
        ok(cuda_fact_matrix_search(m, qd, k, idx, score, &got));
        if (got != want) fail_msg("%s k=%d: %d results, want %d", what, k, got, want);
        for (int32_t i = 0; i < want; i++) {
            if (idx[i] != ref[i].i)
                fail_msg(
                    "%s n=%d k=%d: result %d is row %d (score %.9g), want row %d (score %.12g)",
                    what, n, k, i, idx[i], (double)score[i], ref[i].i, ref[i].s);
            if (!(fabs((double)score[i] - ref[i].s) <= 1e-6))
                fail_msg("%s n=%d k=%d: result %d score %.9g, want %.12g", what, n, k, i,
                         (double)score[i], ref[i].s);
        }
    }
    /* score_rows on the last search's rows, in reverse order: the very
     * scores the search gave them. */
    const int32_t last = n < 1024 ? n : 1024;
    int32_t rev[CUDA_TOPK_MAX];
    float rs[CUDA_TOPK_MAX];
    for (int32_t i = 0; i < last; i++) rev[i] = idx[last - 1 - i];
    ok(cuda_fact_matrix_score_rows(m, qd, rev, last, rs));
    for (int32_t i = 0; i < last; i++)
        if (rs[i] != score[last - 1 - i])
            fail_msg("%s: score_rows gives row %d %.9g, the search %.9g", what, rev[i],
                     (double)rs[i], (double)score[last - 1 - i]);
    if (n > 0) {
        const int32_t bad[2] = {0, n};
        assert_int_equal(cuda_fact_matrix_score_rows(m, qd, bad, 2, rs), IS_ERR_INVALID_ARG);
    }
    printf("  %-40s n=%-8d dim=%-4d k=1..1024 identical (top score %.6f)\n", what, n, dim,
           ref[0].s);
    cuda_ok(cudaFree(dq));
    free(ref);
}

static void unit_rows(float *M, int32_t n, int32_t dim) {
    for (int32_t i = 0; i < n; i++) {
        float *r = M + (size_t)i * dim;
        double ss = 0;
        for (int32_t d = 0; d < dim; d++) {
            r[d] = urand(1.0f);
            ss += (double)r[d] * r[d];
        }
        const float inv = (float)(1.0 / sqrt(ss));
        for (int32_t d = 0; d < dim; d++) r[d] *= inv;
    }
}

static cuda_fact_matrix *new_matrix(int32_t dim) {
    cuda_fact_matrix *m = NULL;
    if (cuda_fact_matrix_create(0, dim, &m) != IS_OK)
        fail_msg("cuda_fact_matrix_create: %s", is_error_last());
    assert_int_equal(cuda_fact_matrix_count(m), 0);
    assert_int_equal(cuda_fact_matrix_dim(m), dim);
    return m;
}

/* rows[0..n) = a random permutation of base .. base + n - 1. */
static int32_t *shuffled(int32_t base, int32_t n) {
    int32_t *r = xmalloc((size_t)n * sizeof *r);
    for (int32_t i = 0; i < n; i++) r[i] = base + i;
    for (int32_t i = n - 1; i > 0; i--) {
        int32_t j = irand(i + 1), t = r[i];
        r[i] = r[j];
        r[j] = t;
    }
    return r;
}

/* Uploads M[n][dim] as rows 0..n-1 in one call, in order or shuffled. */
static void upload(cuda_fact_matrix *m, const float *M, int32_t n, int32_t dim, int shuffle) {
    if (!shuffle) { /* one run: one copy */
        int32_t *rows = xmalloc((size_t)n * sizeof *rows);
        for (int32_t i = 0; i < n; i++) rows[i] = i;
        ok(cuda_fact_matrix_set_rows(m, rows, n, M));
        free(rows);
        return;
    }
    int32_t *rows = shuffled(0, n);
    float *data = xmalloc((size_t)n * dim * sizeof(float));
    for (int32_t i = 0; i < n; i++)
        memcpy(data + (size_t)i * dim, M + (size_t)rows[i] * dim, (size_t)dim * 4);
    ok(cuda_fact_matrix_set_rows(m, rows, n, data));
    free(data);
    free(rows);
}

static void test_topk_random(void **state) {
    (void)state;
    const int32_t dim = 384;
    static const int32_t ns[] = {1, 7, 1000, 100003};
    for (size_t t = 0; t < sizeof ns / sizeof *ns; t++) {
        const int32_t n = ns[t];
        float *M = xmalloc((size_t)n * dim * sizeof(float));
        unit_rows(M, n, dim);
        if (n >= 1000) /* exact duplicates of row 20: equal scores, ordered by row */
            for (int32_t r = 0; r < 3; r++)
                memcpy(M + (size_t)(r == 0   ? 10
                                    : r == 1 ? 500
                                             : n - 1) *
                               dim,
                       M + (size_t)20 * dim, (size_t)dim * sizeof(float));
        cuda_fact_matrix *m = new_matrix(dim);
        upload(m, M, n, dim, n == 1000);
        float q[384];
        unit_rows(q, 1, dim);
        char what[64];
        snprintf(what, sizeof what, "random unit rows, random query");
        expect_search(what, m, M, n, dim, q);
        memcpy(q, M + (size_t)(20 % n) * dim, sizeof q);
        expect_search("random unit rows, query = row 20", m, M, n, dim, q);
        if (n == 1000) {
            g_unaligned = 1;
            expect_search("unaligned query (scalar path)", m, M, n, dim, q);
            g_unaligned = 0;
        }
        cuda_fact_matrix_free(m);
        free(M);
    }
}

/* Values in {-1, 0, 1}: integer scores, exact in float and double, and
 * thousands of equal ones. */
static void ternary(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(irand(3) - 1);
}

static void test_topk_ties(void **state) {
    (void)state;
    static const struct { int32_t n, dim; } cases[] = {{1000003, 16}, {50000, 13}};
    for (size_t t = 0; t < sizeof cases / sizeof *cases; t++) {
        const int32_t n = cases[t].n, dim = cases[t].dim;
        float *M = xmalloc((size_t)n * dim * sizeof(float));
        ternary(M, (size_t)n * dim);
        cuda_fact_matrix *m = new_matrix(dim);
        upload(m, M, n, dim, 0);
        float q[16];
        ternary(q, (size_t)dim);
        expect_search("ternary rows and query (ties)", m, M, n, dim, q);
        memset(q, 0, sizeof q);
        expect_search("zero query (every score ties)", m, M, n, dim, q);
        cuda_fact_matrix_free(m);
        free(M);
    }
}

static void test_topk_updates(void **state) {
    (void)state;
    const int32_t dim = 64;
    int32_t n = 1000;
    float *M = xmalloc((size_t)(n + 100) * dim * sizeof(float)); /* the host mirror */
    unit_rows(M, n, dim);
    cuda_fact_matrix *m = new_matrix(dim);
    int32_t idx[4], got = -1, moved = 7;
    float score[4], q[64];
    unit_rows(q, 1, dim);
    float *dq = dev_alloc(dim);
    cuda_ok(cudaMemcpy(dq, q, sizeof q, cudaMemcpyHostToDevice));

    /* Empty: no hits. Bad arguments. */
    ok(cuda_fact_matrix_search(m, dq, 10, idx, score, &got));
    assert_int_equal(got, 0);
    assert_int_equal(cuda_fact_matrix_search(m, dq, -1, idx, score, &got), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_search(m, dq, CUDA_TOPK_MAX + 1, idx, score, &got),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_search(m, NULL, 1, idx, score, &got), IS_ERR_INVALID_ARG);
    cuda_fact_matrix *bad = (cuda_fact_matrix *)0x1;
    assert_int_equal(cuda_fact_matrix_create(0, 0, &bad), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_create(999, 8, &bad), IS_ERR_UNSUPPORTED);
    assert_ptr_equal(bad, (cuda_fact_matrix *)0x1);

    upload(m, M, n, dim, 1);
    expect_search("before updates", m, M, n, dim, q);
    got = -1;
    ok(cuda_fact_matrix_search(m, dq, 0, NULL, NULL, &got));
    assert_int_equal(got, 0);

    /* Refused updates leave everything as it was. */
    const int32_t gap[1] = {n + 1}, dup[2] = {3, 3}, neg[1] = {-1};
    assert_int_equal(cuda_fact_matrix_set_rows(m, gap, 1, M), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_set_rows(m, dup, 2, M), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_set_rows(m, neg, 1, M), IS_ERR_INVALID_ARG);
    float nan_row[64];
    memcpy(nan_row, M, sizeof nan_row);
    nan_row[5] = NAN;
    const int32_t row0[1] = {0};
    assert_int_equal(cuda_fact_matrix_set_rows(m, row0, 1, nan_row), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_remove_row(m, n, &moved), IS_ERR_INVALID_ARG);
    assert_int_equal(cuda_fact_matrix_remove_row(m, -1, &moved), IS_ERR_INVALID_ARG);
    assert_int_equal(moved, 7);
    expect_search("after refused updates", m, M, n, dim, q);

    /* 50 removes: the last row moves into the hole. */
    for (int i = 0; i < 50; i++) {
        const int32_t r = i == 0 ? n - 1 : irand(n);
        ok(cuda_fact_matrix_remove_row(m, r, &moved));
        assert_int_equal(moved, r == n - 1 ? -1 : n - 1);
        if (r != n - 1)
            memcpy(M + (size_t)r * dim, M + (size_t)(n - 1) * dim, (size_t)dim * sizeof(float));
        n--;
    }
    expect_search("after 50 removes", m, M, n, dim, q);

    /* One call: 30 replacements and 20 appends, in random order. */
    int32_t rows[50];
    int32_t *fresh = shuffled(0, n);
    memcpy(rows, fresh, 30 * sizeof(int32_t));
    free(fresh);
    int32_t *app = shuffled(n, 20);
    memcpy(rows + 30, app, 20 * sizeof(int32_t));
    free(app);
    for (int32_t i = 49; i > 0; i--) {
        int32_t j = irand(i + 1), tmp = rows[i];
        rows[i] = rows[j];
        rows[j] = tmp;
    }
    float *data = xmalloc((size_t)50 * dim * sizeof(float));
    unit_rows(data, 50, dim);
    memcpy(data + (size_t)7 * dim, q, sizeof q); /* one of them is the query: first hit */
    ok(cuda_fact_matrix_set_rows(m, rows, 50, data));
    for (int32_t i = 0; i < 50; i++)
        memcpy(M + (size_t)rows[i] * dim, data + (size_t)i * dim, (size_t)dim * 4);
    n += 20;
    expect_search("after replacements and appends", m, M, n, dim, q);

    /* From device memory: 10 appends (a run) and 2 replacements. */
    const int32_t drows[12] = {n,     n + 1, n + 2, n + 3, n + 4, 0,
                               n + 5, n + 6, n + 7, n + 8, n + 9, 17};
    unit_rows(data, 12, dim);
    float *dd = dev_alloc((size_t)12 * dim);
    cuda_ok(cudaMemcpy(dd, data, (size_t)12 * dim * sizeof(float), cudaMemcpyHostToDevice));
    ok(cuda_fact_matrix_set_rows_device(m, drows, 12, dd));
    for (int32_t i = 0; i < 12; i++)
        memcpy(M + (size_t)drows[i] * dim, data + (size_t)i * dim, (size_t)dim * 4);
    n += 10;
    expect_search("after updates from device memory", m, M, n, dim, q);

    /* Down to one row, then none. */
    while (n > 1) {
        ok(cuda_fact_matrix_remove_row(m, 0, &moved));
        assert_int_equal(moved, n - 1);
        memcpy(M, M + (size_t)(n - 1) * dim, (size_t)dim * sizeof(float));
        n--;
    }
    expect_search("one row left", m, M, n, dim, q);
    ok(cuda_fact_matrix_remove_row(m, 0, &moved));
    assert_int_equal(moved, -1);
    assert_int_equal(cuda_fact_matrix_count(m), 0);
    ok(cuda_fact_matrix_search(m, dq, 5, idx, score, &got));
    assert_int_equal(got, 0);

    cuda_ok(cudaFree(dd));
    cuda_ok(cudaFree(dq));
    free(data);
    free(M);
    cuda_fact_matrix_free(m);
    cuda_fact_matrix_free(NULL);
}

/* ---- setup -------------------------------------------------------------------- */

static int setup(void **state) {
    (void)state;
    const char *seed = getenv("IS_TEST_SEED");
    g_rng = seed ? strtoull(seed, NULL, 10) : 1;
    printf("seed %llu\n", (unsigned long long)g_rng);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/test_cuda_retrieval.XXXXXX");
    if (!mkdtemp(g_tmp)) return -1;
    return test_bert_write(g_tmp, &test_bert_a, &g_rng) ||
                   test_bert_write(g_tmp, &test_bert_b, &g_rng)
               ? -1
               : 0;
}

static int teardown(void **state) {
    (void)state;
    return test_remove_tree(g_tmp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedder_random), cmocka_unit_test(test_embedder_interface),
        cmocka_unit_test(test_embedder_errors), cmocka_unit_test(test_embedder_minilm),
        cmocka_unit_test(test_topk_random),     cmocka_unit_test(test_topk_ties),
        cmocka_unit_test(test_topk_updates),
    };
    if (getenv("IS_TEST_FILTER")) cmocka_set_test_filter(getenv("IS_TEST_FILTER"));
    /* Without a device every test would skip: let ctest report the program
     * as skipped (SKIP_RETURN_CODE 77), not passed. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU retrieval tests are skipped\n");
        return 77;
    }
    return test_run_group(tests, setup, teardown);
}

/*
 * test_index: the memory index (exact dense top-k, filters, isolation,
 * updates, RRF fusion, concurrency).
 *
 *   - exact top-k equals a brute-force sort (double precision dot products,
 *     ties by id) on random data: several dims and sizes, k > n, k = 0,
 *     exact duplicates, near-duplicates that defeat the int8 first pass,
 *     unnormalised vectors of very different norms, and rows built so that
 *     the int8 rounding error meets the query head-on (a first pass with a
 *     too small error bound fails there);
 *   - filters: agent_id, run_id, metadata equality with several keys,
 *     numbers and booleans as canonical strings, a missing key; random
 *     filters checked against a brute-force predicate;
 *   - tenant/user isolation: many tenants and users holding the same ids-
 *     like texts and identical embeddings; no search returns a fact of
 *     another partition; ("a", "bc") and ("ab", "c") are different users;
 *   - upsert replacing a fact (new text, embedding, filters; moving it to
 *     another user), remove then search, random churn with the invariant
 *     checker and a final brute-force comparison;
 *   - RRF on a hand example (scores worked out in the comments), ties by id;
 *   - an external dense list (mem_index_search_dense_list, what GPU
 *     retrieval hands in): fed the index's own dense list, dense and hybrid
 *     results equal mem_index_search's (a hybrid hit outside the list has
 *     dense NAN); ids of another user or of none are skipped; filters, BM25
 *     mode and bad entries are refused;
 *   - bad arguments give statuses and leave the index unchanged;
 *   - thread-safety smoke test: searches in three threads while a fourth
 *     upserts and removes (run it under -fsanitize=thread too).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/index.h"

/* ---- helpers --------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) { return (rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

static float rng_normal(uint64_t *s) {
    double u = rng_unit(s), v = rng_unit(s);
    return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

static void random_unit(uint64_t *s, float *x, int dim) {
    double n2 = 0;
    for (int j = 0; j < dim; j++) {
        x[j] = rng_normal(s);
        n2 += (double)x[j] * x[j];
    }
    float inv = (float)(1.0 / sqrt(n2));
    for (int j = 0; j < dim; j++) x[j] *= inv;
}

static double dot_d(const float *a, const float *b, int dim) {
    double s = 0;
    for (int j = 0; j < dim; j++) s += (double)a[j] * b[j];
    return s;
}

typedef struct ref_hit {
    const char *id;
    double score;
} ref_hit;

static int cmp_ref(const void *a, const void *b) {
    const ref_hit *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return strcmp(x->id, y->id);
}

static int cmp_ref_id(const void *a, const void *b) {
    return strcmp(((const ref_hit *)a)->id, ((const ref_hit *)b)->id);
}

/* Compares index hits to a brute-force ranking of `n` candidates (already
 * scored): the same length, each hit's score equal to its exact dot product,
 * and the same ids in the same order, except that two ids may trade places
 * when their exact scores are within float rounding of each other (then the
 * index ordered them by its float32 scores). */
static void expect_ranking(ref_hit *ref, int n, int k, const mem_hit *hits, int32_t n_hits) {
    ref_hit *by_id = malloc(sizeof *by_id * (size_t)(n > 0 ? n : 1));
    assert_non_null(by_id);
    memcpy(by_id, ref, sizeof *ref * (size_t)n);
    qsort(by_id, (size_t)n, sizeof *by_id, cmp_ref_id);
    qsort(ref, (size_t)n, sizeof *ref, cmp_ref);
    int want = n < k ? n : k;
    assert_int_equal(n_hits, want);
    for (int i = 0; i < want; i++) {
        /* the hit's exact score; the hit must be one of the candidates */
        ref_hit key = {hits[i].id, 0};
        const ref_hit *found = bsearch(&key, by_id, (size_t)n, sizeof *by_id, cmp_ref_id);
        assert_non_null(found);
        double e = found->score;
        assert_float_equal(hits[i].score, e, 2e-5 * (1 + fabs(e)));
        if (strcmp(ref[i].id, hits[i].id) != 0) {
            if (fabs(ref[i].score - e) > 1e-6 * (1 + fabs(e))) {
                fprintf(stderr, "rank %d: index %s (%.9f), brute force %s (%.9f)\n", i, hits[i].id,
                        e, ref[i].id, ref[i].score);
                fail();
            }
        }
        if (i > 0) {
            assert_true(
                hits[i - 1].score > hits[i].score ||
                (hits[i - 1].score == hits[i].score && strcmp(hits[i - 1].id, hits[i].id) < 0));
        }
    }
    free(by_id);
}

/* ---- exact top-k ----------------------------------------------------------- */

enum { DATA_UNIT, DATA_DUPLICATES, DATA_NEAR, DATA_NORMS, DATA_SCALES };

/* Fills n embeddings of one kind. */
static void make_data(uint64_t *s, int kind, int n, int dim, float *emb) {
    for (int i = 0; i < n; i++) {
        float *x = emb + (size_t)i * dim;
        switch (kind) {
        case DATA_UNIT: random_unit(s, x, dim); break;
        case DATA_DUPLICATES: /* a quarter of the rows repeat an earlier one exactly */
            if (i > 0 && rng_next(s) % 4 == 0)
                memcpy(x, emb + (size_t)(rng_next(s) % i) * dim, sizeof(float) * dim);
            else random_unit(s, x, dim);
            break;
        case DATA_NEAR: { /* one dominant axis: int8 rounds the rest away */
            random_unit(s, x, dim);
            for (int j = 0; j < dim; j++) x[j] *= 1e-3f;
            x[0] += 1.0f;
            break;
        }
        case DATA_NORMS: { /* norms from 1e-3 to 1e2 */
            random_unit(s, x, dim);
            float sc = powf(10.0f, (float)(rng_unit(s) * 5.0 - 3.0));
            for (int j = 0; j < dim; j++) x[j] *= sc;
            break;
        }
        case DATA_SCALES: {
            /* x = (v, A, 0, ...) with A in [1, 200] setting the row's int8
             * scale (A / 127) and v < A: for the query (1, 0, ...), the
             * score is v and the whole int8 rounding error of v shows, with
             * rows of different scales rounding differently. A first pass
             * whose error bound were too small would drop true winners. */
            memset(x, 0, sizeof(float) * dim);
            float a = 1.0f + 199.0f * (float)rng_unit(s);
            x[0] = (float)rng_unit(s) * 0.99f * a;
            if (dim > 1) x[1] = a;
            break;
        }
        }
    }
}

static void check_exact(int kind, int dim, int n, uint64_t seed) {
    uint64_t s = seed;
    mem_index *ix;
    assert_int_equal(mem_index_create(dim, &ix), IS_OK);
    float *emb = malloc(sizeof(float) * (size_t)n * dim);
    char(*ids)[16] = malloc(sizeof *ids * (size_t)n);
    assert_non_null(emb);
    make_data(&s, kind, n, dim, emb);
    for (int i = 0; i < n; i++) {
        /* ids in another order than insertion, so ties by id are not
         * ties by row by accident */
        snprintf(ids[i], sizeof ids[i], "f%07d", (int)(((int64_t)i * 7919 + 13) % 1000003));
        mem_doc d = {.id = ids[i], .tenant = "t", .user = "u", .embedding = emb + (size_t)i * dim};
        assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
    }
    assert_int_equal(mem_index_count(ix), n);
    assert_true(mem_index_check(ix));
    const int ks[] = {1, 5, 20, n, n + 10};
    float *q = malloc(sizeof(float) * dim);
    ref_hit *ref = malloc(sizeof *ref * (size_t)n);
    mem_hit *hits = malloc(sizeof *hits * (size_t)(n + 10));
    mem_filter f = {.tenant = "t", .user = "u"};
    for (int qi = 0; qi < 6; qi++) {
        if (qi == 0) memcpy(q, emb, sizeof(float) * dim); /* a stored row itself */
        else if (kind == DATA_NEAR && qi < 3) make_data(&s, DATA_NEAR, 1, dim, q);
        else if (kind == DATA_SCALES && qi < 4) {
            memset(q, 0, sizeof(float) * dim);
            q[0] = qi == 1 ? 1.0f : qi == 2 ? 0.5f : -1.0f;
            if (qi == 3 && dim > 1) q[1] = 0.01f;
        } else random_unit(&s, q, dim);
        for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++) {
            for (int i = 0; i < n; i++)
                ref[i] = (ref_hit){ids[i], dot_d(q, emb + (size_t)i * dim, dim)};
            int32_t nh = -1;
            assert_int_equal(mem_index_search(ix, &f, q, NULL, ks[ki], MEM_SEARCH_DENSE, hits, &nh),
                             IS_OK);
            expect_ranking(ref, n, ks[ki], hits, nh);
            for (int i = 0; i < nh; i++) {
                assert_int_equal(hits[i].dense_rank, i + 1);
                assert_int_equal(hits[i].bm25_rank, -1);
                assert_float_equal(hits[i].dense, hits[i].score, 0.0);
            }
        }
    }
    /* k = 0: no hits, out may be NULL. */
    int32_t nh = -1;
    assert_int_equal(mem_index_search(ix, &f, q, NULL, 0, MEM_SEARCH_DENSE, NULL, &nh), IS_OK);
    assert_int_equal(nh, 0);
    free(q);
    free(ref);
    free(hits);
    free(emb);
    free(ids);
    mem_index_free(ix);
}

static void test_exact_topk(void **state) {
    (void)state;
    const int dims[] = {3, 8, 33, 384};
    const int sizes[] = {1, 7, 100, 1000};
    uint64_t seed = 1;
    for (int di = 0; di < 4; di++)
        for (int si = 0; si < 4; si++)
            for (int kind = DATA_UNIT; kind <= DATA_SCALES; kind++)
                check_exact(kind, dims[di], sizes[si], seed++);
    check_exact(DATA_UNIT, 384, 5000, seed++);
    check_exact(DATA_DUPLICATES, 384, 5000, seed++);
    check_exact(DATA_NEAR, 64, 5000, seed++);
    check_exact(DATA_SCALES, 16, 5000, seed++);
}

/* Identical embeddings: every score ties, so the order is by id. */
static void test_ties_by_id(void **state) {
    (void)state;
    mem_index *ix;
    assert_int_equal(mem_index_create(4, &ix), IS_OK);
    const float e[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    const char *ids[] = {"m", "b", "z", "a", "k"};
    for (int i = 0; i < 5; i++) {
        mem_doc d = {.id = ids[i], .tenant = "t", .user = "u", .embedding = e};
        assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
    }
    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit hits[5];
    int32_t n;
    assert_int_equal(mem_index_search(ix, &f, e, NULL, 3, MEM_SEARCH_DENSE, hits, &n), IS_OK);
    assert_int_equal(n, 3);
    assert_string_equal(hits[0].id, "a");
    assert_string_equal(hits[1].id, "b");
    assert_string_equal(hits[2].id, "k");
    assert_float_equal(hits[0].score, 1.0, 1e-6);
    mem_index_free(ix);
}

/* ---- filters --------------------------------------------------------------- */

/* Documents with every combination of agent, run and a few metadata sets. */
static const char *const F_AGENTS[] = {NULL, "a1", "a2"};
static const char *const F_RUNS[] = {NULL, "r1", "r2"};
static const char *const F_META[] = {
    NULL,
    "{\"topic\": \"food\", \"priority\": 3, \"pinned\": true}",
    "{\"topic\": \"food\"}",
    "{\"topic\": \"travel\", \"priority\": \"3\", \"pinned\": false, \"score\": 0.5}",
    "{\"priority\": 3.0, \"topic\": \"travel\", \"topic\": \"food\", \"note\": null}",
};

/* What the test knows of each metadata set: its pairs as canonical strings. */
static const char *f_meta_value(int m, const char *key) {
    static const char *const table[][5][2] = {
        {{NULL, NULL}},
        {{"topic", "food"}, {"priority", "3"}, {"pinned", "true"}, {NULL, NULL}},
        {{"topic", "food"}, {NULL, NULL}},
        {{"topic", "travel"},
         {"priority", "3"},
         {"pinned", "false"},
         {"score", "0.5"},
         {NULL, NULL}},
        {{"priority", "3"},
         {"topic", "travel"},
         {"note", "null"},
         {NULL, NULL}}, /* first key wins */
    };
    for (int i = 0; i < 5 && table[m][i][0]; i++)
        if (strcmp(table[m][i][0], key) == 0) return table[m][i][1];
    return NULL;
}

typedef struct fdoc {
    char id[16];
    int agent, run, meta;
    float emb[16];
} fdoc;

static bool f_match(const fdoc *d, const char *agent, const char *run, const char *const *keys,
                    const char *const *values, int n_meta) {
    if (agent && (!F_AGENTS[d->agent] || strcmp(F_AGENTS[d->agent], agent) != 0)) return false;
    if (run && (!F_RUNS[d->run] || strcmp(F_RUNS[d->run], run) != 0)) return false;
    for (int i = 0; i < n_meta; i++) {
        const char *v = f_meta_value(d->meta, keys[i]);
        if (!v || strcmp(v, values[i]) != 0) return false;
    }
    return true;
}

static void test_filters(void **state) {
    (void)state;
    enum { DIM = 16, PER = 4 };
    mem_index *ix;
    assert_int_equal(mem_index_create(DIM, &ix), IS_OK);
    fdoc docs[3 * 3 * 5 * PER];
    int n = 0;
    uint64_t s = 77;
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < 3; r++)
            for (int m = 0; m < 5; m++)
                for (int c = 0; c < PER; c++) {
                    fdoc *d = &docs[n];
                    snprintf(d->id, sizeof d->id, "doc%03d", n);
                    d->agent = a;
                    d->run = r;
                    d->meta = m;
                    random_unit(&s, d->emb, DIM);
                    mem_doc md = {.id = d->id,
                                  .tenant = "t",
                                  .user = "u",
                                  .agent_id = F_AGENTS[a],
                                  .run_id = F_RUNS[r],
                                  .embedding = d->emb,
                                  .metadata_json = F_META[m],
                                  .text = "shared words here"};
                    assert_int_equal(mem_index_upsert(ix, &md), IS_OK);
                    n++;
                }
    assert_true(mem_index_check(ix));

    /* Explicit cases: the number of matches with k large. */
    struct {
        const char *agent, *run;
        const char *keys[3], *values[3];
        int n_meta;
        int expect;
    } cases[] = {
        {NULL, NULL, {0}, {0}, 0, n},
        {"a1", NULL, {0}, {0}, 0, n / 3},
        {"a1", "r2", {0}, {0}, 0, n / 9},
        {"a3", NULL, {0}, {0}, 0, 0},                          /* unknown agent */
        {NULL, NULL, {"topic"}, {"food"}, 1, 3 * 3 * 2 * PER}, /* sets 1, 2 (4: first wins) */
        {NULL, NULL, {"topic", "priority"}, {"food", "3"}, 2, 3 * 3 * 1 * PER}, /* set 1 */
        {NULL, NULL, {"priority"}, {"3"}, 1, 3 * 3 * 3 * PER},                  /* 3, "3", 3.0 */
        {NULL, NULL, {"pinned"}, {"true"}, 1, 3 * 3 * PER},
        {NULL, NULL, {"pinned"}, {"false"}, 1, 3 * 3 * PER},
        {NULL, NULL, {"score"}, {"0.5"}, 1, 3 * 3 * PER},
        {NULL, NULL, {"note"}, {"null"}, 1, 3 * 3 * PER},
        {NULL, NULL, {"missing"}, {"food"}, 1, 0}, /* missing key: no match */
        {NULL, NULL, {"topic", "topic"}, {"food", "travel"}, 2, 0},
        {"a2", "r1", {"topic", "pinned"}, {"travel", "false"}, 2, PER},
        {NULL, NULL, {"food"}, {"topic"}, 1, 0}, /* key and value swapped */
    };
    mem_hit hits[512];
    float q[DIM];
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        mem_filter f = {.tenant = "t",
                        .user = "u",
                        .agent_id = cases[ci].agent,
                        .run_id = cases[ci].run,
                        .meta_keys = cases[ci].keys,
                        .meta_values = cases[ci].values,
                        .n_meta = cases[ci].n_meta};
        random_unit(&s, q, DIM);
        for (int mode = MEM_SEARCH_DENSE; mode <= MEM_SEARCH_HYBRID; mode++) {
            int32_t nh = -1;
            assert_int_equal(mem_index_search(ix, &f, q, "words", 512, mode, hits, &nh), IS_OK);
            assert_int_equal(nh, cases[ci].expect);
            for (int i = 0; i < nh; i++) {
                int d = atoi(hits[i].id + 3);
                assert_true(f_match(&docs[d], cases[ci].agent, cases[ci].run, cases[ci].keys,
                                    cases[ci].values, cases[ci].n_meta));
            }
        }
    }

    /* Random filters against brute force, dense top-10. */
    const char *keys_pool[] = {"topic", "priority", "pinned", "note", "score"};
    const char *vals_pool[] = {"food", "travel", "3", "true", "false", "null", "0.5"};
    ref_hit ref[3 * 3 * 5 * PER];
    for (int it = 0; it < 200; it++) {
        const char *agent = F_AGENTS[rng_next(&s) % 3];
        const char *run = F_RUNS[rng_next(&s) % 3];
        const char *keys[2], *vals[2];
        int nm = (int)(rng_next(&s) % 3);
        for (int i = 0; i < nm; i++) {
            keys[i] = keys_pool[rng_next(&s) % 5];
            vals[i] = vals_pool[rng_next(&s) % 7];
        }
        random_unit(&s, q, DIM);
        int nr = 0;
        for (int i = 0; i < n; i++)
            if (f_match(&docs[i], agent, run, keys, vals, nm))
                ref[nr++] = (ref_hit){docs[i].id, dot_d(q, docs[i].emb, DIM)};
        mem_filter f = {.tenant = "t",
                        .user = "u",
                        .agent_id = agent,
                        .run_id = run,
                        .meta_keys = keys,
                        .meta_values = vals,
                        .n_meta = nm};
        int32_t nh = -1;
        assert_int_equal(mem_index_search(ix, &f, q, NULL, 10, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
        expect_ranking(ref, nr, 10, hits, nh);
    }

    /* Bad metadata is refused, and the index stays as it was. */
    const char *bad[] = {
        "{\"a\": {\"b\": 1}}", "{\"a\": [1, 2]}", "[1, 2]", "\"text\"", "{oops", "42"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        mem_doc md = {.id = "doc000",
                      .tenant = "t",
                      .user = "u",
                      .embedding = docs[1].emb,
                      .metadata_json = bad[i]};
        assert_int_equal(mem_index_upsert(ix, &md), IS_ERR_INVALID_ARG);
    }
    mem_filter f = {.tenant = "t", .user = "u"};
    int32_t nh;
    assert_int_equal(mem_index_search(ix, &f, docs[0].emb, NULL, 1, MEM_SEARCH_DENSE, hits, &nh),
                     IS_OK);
    assert_string_equal(hits[0].id, "doc000");
    assert_float_equal(hits[0].score, 1.0, 1e-5);
    assert_int_equal(mem_index_count(ix), n);
    assert_true(mem_index_check(ix));
    mem_index_free(ix);
}

/* ---- isolation ------------------------------------------------------------- */

static void test_isolation(void **state) {
    (void)state;
    enum { DIM = 8, T = 5, U = 6, PER = 7 };
    mem_index *ix;
    assert_int_equal(mem_index_create(DIM, &ix), IS_OK);
    uint64_t s = 5;
    float shared[PER][DIM];
    for (int i = 0; i < PER; i++) random_unit(&s, shared[i], DIM);
    char tenant[16], user[16], id[32], text[64];
    /* Every partition holds the same texts and embeddings; u0 of each
     * tenant has one more fact so counts differ too. */
    for (int t = 0; t < T; t++)
        for (int u = 0; u < U; u++)
            for (int i = 0; i < PER + (u == 0); i++) {
                snprintf(tenant, sizeof tenant, "tenant%d", t);
                snprintf(user, sizeof user, "user%d", u);
                snprintf(id, sizeof id, "t%d-u%d-%d", t, u, i);
                snprintf(text, sizeof text, "fact %d of user%d tenant0 t0-u0-%d", i % PER, u, i);
                mem_doc d = {.id = id,
                             .tenant = tenant,
                             .user = user,
                             .agent_id = "agent",
                             .text = text,
                             .embedding = shared[i % PER]};
                assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
            }
    /* Tricky keys: ("a", "bc") against ("ab", "c"). */
    mem_doc d1 = {.id = "x1", .tenant = "a", .user = "bc", .embedding = shared[0], .text = "fact"};
    mem_doc d2 = {.id = "x2", .tenant = "ab", .user = "c", .embedding = shared[0], .text = "fact"};
    assert_int_equal(mem_index_upsert(ix, &d1), IS_OK);
    assert_int_equal(mem_index_upsert(ix, &d2), IS_OK);
    assert_true(mem_index_check(ix));

    mem_hit hits[64];
    for (int t = 0; t < T; t++)
        for (int u = 0; u < U; u++) {
            snprintf(tenant, sizeof tenant, "tenant%d", t);
            snprintf(user, sizeof user, "user%d", u);
            char prefix[16];
            snprintf(prefix, sizeof prefix, "t%d-u%d-", t, u);
            mem_filter f = {.tenant = tenant, .user = user, .agent_id = "agent"};
            for (int mode = MEM_SEARCH_DENSE; mode <= MEM_SEARCH_HYBRID; mode++) {
                int32_t nh = -1;
                assert_int_equal(mem_index_search(ix, &f, shared[0], "fact user0 tenant0 t0 u0 0",
                                                  64, mode, hits, &nh),
                                 IS_OK);
                assert_int_equal(nh, PER + (u == 0));
                for (int i = 0; i < nh; i++)
                    assert_memory_equal(hits[i].id, prefix, strlen(prefix));
            }
        }
    const char *pairs[][2] = {{"a", "bc"}, {"ab", "c"}};
    for (int i = 0; i < 2; i++) {
        mem_filter f = {.tenant = pairs[i][0], .user = pairs[i][1]};
        int32_t nh;
        assert_int_equal(
            mem_index_search(ix, &f, shared[0], "fact", 64, MEM_SEARCH_HYBRID, hits, &nh), IS_OK);
        assert_int_equal(nh, 1);
        assert_string_equal(hits[0].id, i == 0 ? "x1" : "x2");
    }
    /* A user of one tenant is not the same-named user of another, and an
     * unknown user has nothing. */
    mem_filter f = {.tenant = "tenant9", .user = "user0"};
    int32_t nh = -1;
    assert_int_equal(mem_index_search(ix, &f, shared[0], "fact", 64, MEM_SEARCH_HYBRID, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 0);
    f = (mem_filter){.tenant = "tenant0", .user = "nobody"};
    assert_int_equal(mem_index_search(ix, &f, shared[0], "fact", 64, MEM_SEARCH_DENSE, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 0);
    /* A search must name both tenant and user. */
    nh = 42;
    f = (mem_filter){.tenant = "tenant0"};
    assert_int_equal(mem_index_search(ix, &f, shared[0], "fact", 64, MEM_SEARCH_DENSE, hits, &nh),
                     IS_ERR_INVALID_ARG);
    f = (mem_filter){.user = "user0"};
    assert_int_equal(mem_index_search(ix, &f, shared[0], "fact", 64, MEM_SEARCH_BM25, hits, &nh),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, NULL, shared[0], "fact", 64, MEM_SEARCH_DENSE, hits, &nh),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(nh, 42); /* unchanged on failure */
    mem_index_free(ix);
}

/* ---- updates ---------------------------------------------------------------- */

static void test_upsert_replace(void **state) {
    (void)state;
    enum { DIM = 4 };
    mem_index *ix;
    assert_int_equal(mem_index_create(DIM, &ix), IS_OK);
    const float e1[DIM] = {1, 0, 0, 0}, e2[DIM] = {0, 1, 0, 0}, e3[DIM] = {0, 0, 1, 0};
    mem_doc other = {.id = "other", .tenant = "t", .user = "u", .text = "pear", .embedding = e3};
    mem_doc x = {.id = "X",
                 .tenant = "t",
                 .user = "u",
                 .agent_id = "a1",
                 .text = "apple pie",
                 .embedding = e1,
                 .metadata_json = "{\"k\": \"v1\"}"};
    assert_int_equal(mem_index_upsert(ix, &other), IS_OK);
    assert_int_equal(mem_index_upsert(ix, &x), IS_OK);
    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit hits[4];
    int32_t nh;
    assert_int_equal(mem_index_search(ix, &f, e1, NULL, 1, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_string_equal(hits[0].id, "X");
    assert_float_equal(hits[0].score, 1.0, 1e-6);

    /* Replace: new text, embedding, agent and metadata. */
    x.text = "banana bread";
    x.embedding = e2;
    x.agent_id = "a2";
    x.metadata_json = "{\"k\": \"v2\"}";
    assert_int_equal(mem_index_upsert(ix, &x), IS_OK);
    assert_int_equal(mem_index_count(ix), 2);
    assert_true(mem_index_check(ix));
    assert_int_equal(mem_index_search(ix, &f, e1, NULL, 4, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_int_equal(nh, 2);
    for (int i = 0; i < nh; i++) assert_float_equal(hits[i].score, 0.0, 1e-6);
    assert_int_equal(mem_index_search(ix, &f, e2, NULL, 1, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_string_equal(hits[0].id, "X");
    assert_float_equal(hits[0].score, 1.0, 1e-6);
    assert_int_equal(mem_index_search(ix, &f, NULL, "apple", 4, MEM_SEARCH_BM25, hits, &nh), IS_OK);
    assert_int_equal(nh, 0);
    assert_int_equal(mem_index_search(ix, &f, NULL, "banana", 4, MEM_SEARCH_BM25, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 1);
    assert_string_equal(hits[0].id, "X");
    mem_filter fa1 = {.tenant = "t", .user = "u", .agent_id = "a1"};
    assert_int_equal(mem_index_search(ix, &fa1, e2, NULL, 4, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_int_equal(nh, 0);
    const char *k[] = {"k"}, *v2[] = {"v2"}, *v1[] = {"v1"};
    mem_filter fm = {.tenant = "t", .user = "u", .meta_keys = k, .meta_values = v2, .n_meta = 1};
    assert_int_equal(mem_index_search(ix, &fm, e2, NULL, 4, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_int_equal(nh, 1);
    fm.meta_values = v1;
    assert_int_equal(mem_index_search(ix, &fm, e2, NULL, 4, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
    assert_int_equal(nh, 0);

    /* Replace into another user: it leaves the first. */
    x.user = "w";
    assert_int_equal(mem_index_upsert(ix, &x), IS_OK);
    assert_int_equal(mem_index_count(ix), 2);
    assert_true(mem_index_check(ix));
    assert_int_equal(mem_index_search(ix, &f, e2, "banana", 4, MEM_SEARCH_HYBRID, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 1);
    assert_string_equal(hits[0].id, "other");
    mem_filter fw = {.tenant = "t", .user = "w"};
    assert_int_equal(mem_index_search(ix, &fw, e2, "banana", 4, MEM_SEARCH_HYBRID, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 1);
    assert_string_equal(hits[0].id, "X");

    /* Remove. */
    assert_int_equal(mem_index_remove(ix, "X"), IS_OK);
    assert_int_equal(mem_index_remove(ix, "X"), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_index_remove(ix, "never"), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_index_search(ix, &fw, e2, "banana", 4, MEM_SEARCH_HYBRID, hits, &nh),
                     IS_OK);
    assert_int_equal(nh, 0);
    assert_int_equal(mem_index_count(ix), 1);
    assert_true(mem_index_check(ix));
    mem_index_free(ix);
}

/* Random upserts (new and replacing, across three users) and removes, with
 * the invariant checker along the way and brute force at the end. */
static void test_churn(void **state) {
    (void)state;
    enum { DIM = 24, IDS = 300, OPS = 3000 };
    static const char *words[] = {"red", "green", "blue", "cat", "dog", "bird", "river", "hill"};
    mem_index *ix;
    assert_int_equal(mem_index_create(DIM, &ix), IS_OK);
    struct {
        bool alive;
        int user;
        float emb[DIM];
        char text[64];
        char id[16];
    } m[IDS];
    memset(m, 0, sizeof m);
    uint64_t s = 99;
    const char *users[] = {"u0", "u1", "u2"};
    for (int op = 0; op < OPS; op++) {
        int i = (int)(rng_next(&s) % IDS);
        snprintf(m[i].id, sizeof m[i].id, "id%03d", i);
        if (m[i].alive && rng_next(&s) % 3 == 0) {
            assert_int_equal(mem_index_remove(ix, m[i].id), IS_OK);
            m[i].alive = false;
        } else {
            m[i].alive = true;
            m[i].user = (int)(rng_next(&s) % 3);
            random_unit(&s, m[i].emb, DIM);
            m[i].text[0] = '\0';
            for (int w = 0; w < 3; w++) {
                strcat(m[i].text, words[rng_next(&s) % 8]);
                strcat(m[i].text, " ");
            }
            mem_doc d = {.id = m[i].id,
                         .tenant = "t",
                         .user = users[m[i].user],
                         .text = m[i].text,
                         .embedding = m[i].emb};
            assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
        }
        if (op % 250 == 0) assert_true(mem_index_check(ix));
    }
    assert_true(mem_index_check(ix));
    int alive = 0;
    for (int i = 0; i < IDS; i++) alive += m[i].alive;
    assert_int_equal(mem_index_count(ix), alive);
    ref_hit ref[IDS];
    mem_hit hits[IDS];
    for (int u = 0; u < 3; u++) {
        float q[DIM];
        random_unit(&s, q, DIM);
        int nr = 0;
        for (int i = 0; i < IDS; i++)
            if (m[i].alive && m[i].user == u)
                ref[nr++] = (ref_hit){m[i].id, dot_d(q, m[i].emb, DIM)};
        mem_filter f = {.tenant = "t", .user = users[u]};
        int32_t nh;
        assert_int_equal(mem_index_search(ix, &f, q, NULL, 25, MEM_SEARCH_DENSE, hits, &nh), IS_OK);
        expect_ranking(ref, nr, 25, hits, nh);
        /* BM25 matches exactly the alive docs of the user holding "cat". */
        assert_int_equal(mem_index_search(ix, &f, NULL, "cat", IDS, MEM_SEARCH_BM25, hits, &nh),
                         IS_OK);
        int want = 0;
        for (int i = 0; i < IDS; i++)
            if (m[i].alive && m[i].user == u && strstr(m[i].text, "cat ")) want++;
        assert_int_equal(nh, want);
    }
    mem_index_free(ix);
}

/* ---- RRF ------------------------------------------------------------------- */

/*
 * Four documents, dim 4, query q = (1, 0, 0, 0):
 *
 *   id  embedding             dot   dense rank  text            BM25 rank ("zebra")
 *   A   (0.9, 0.436, 0, 0)    0.9   1           "lion tiger"    -
 *   B   (0.5, 0, 0.866, 0)    0.5   2           "lion lion"     -
 *   C   (0.1, 0, 0, 0.995)    0.1   3           "zebra zebra"   1 (tf 2)
 *   D   (-0.2, 0.98, 0, 0)   -0.2   4           "zebra lion"    2 (tf 1, same length)
 *
 *   RRF = sum 1 / (60 + rank):
 *     A = 1/61                 = 0.0163934
 *     B = 1/62                 = 0.0161290
 *     C = 1/63 + 1/61 = 0.0158730 + 0.0163934 = 0.0322664
 *     D = 1/64 + 1/62 = 0.0156250 + 0.0161290 = 0.0317540
 *   Order: C, D, A, B.
 */
static void test_rrf_hand(void **state) {
    (void)state;
    mem_index *ix;
    assert_int_equal(mem_index_create(4, &ix), IS_OK);
    const float ea[4] = {0.9f, 0.436f, 0, 0}, eb[4] = {0.5f, 0, 0.866f, 0},
                ec[4] = {0.1f, 0, 0, 0.995f}, ed[4] = {-0.2f, 0.98f, 0, 0};
    mem_doc docs[] = {
        {.id = "A", .tenant = "t", .user = "u", .text = "lion tiger", .embedding = ea},
        {.id = "B", .tenant = "t", .user = "u", .text = "lion lion", .embedding = eb},
        {.id = "C", .tenant = "t", .user = "u", .text = "zebra zebra", .embedding = ec},
        {.id = "D", .tenant = "t", .user = "u", .text = "zebra lion", .embedding = ed},
    };
    for (int i = 0; i < 4; i++) assert_int_equal(mem_index_upsert(ix, &docs[i]), IS_OK);
    const float q[4] = {1, 0, 0, 0};
    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit h[4];
    int32_t n;
    assert_int_equal(mem_index_search(ix, &f, q, "zebra", 4, MEM_SEARCH_HYBRID, h, &n), IS_OK);
    assert_int_equal(n, 4);
    const char *order[] = {"C", "D", "A", "B"};
    const double rrf[] = {0.0322664, 0.0317540, 0.0163934, 0.0161290};
    const int dr[] = {3, 4, 1, 2}, br[] = {1, 2, -1, -1};
    const double dense[] = {0.1, -0.2, 0.9, 0.5};
    for (int i = 0; i < 4; i++) {
        assert_string_equal(h[i].id, order[i]);
        assert_float_equal(h[i].score, rrf[i], 1e-6);
        assert_int_equal(h[i].dense_rank, dr[i]);
        assert_int_equal(h[i].bm25_rank, br[i]);
        assert_float_equal(h[i].dense, dense[i], 1e-6);
    }
    assert_true(h[0].bm25 > h[1].bm25 && h[1].bm25 > 0.0f);
    assert_float_equal(h[2].bm25, 0.0, 0.0);
    /* k = 2 keeps the fused best two. */
    assert_int_equal(mem_index_search(ix, &f, q, "zebra", 2, MEM_SEARCH_HYBRID, h, &n), IS_OK);
    assert_int_equal(n, 2);
    assert_string_equal(h[0].id, "C");
    assert_string_equal(h[1].id, "D");
    /* Without query text, hybrid is the dense order. */
    assert_int_equal(mem_index_search(ix, &f, q, NULL, 4, MEM_SEARCH_HYBRID, h, &n), IS_OK);
    assert_int_equal(n, 4);
    assert_string_equal(h[0].id, "A");
    assert_string_equal(h[3].id, "D");
    assert_float_equal(h[0].score, 1.0 / 61, 1e-7);
    mem_index_free(ix);
}

/*
 * A tie: with query (1, 0) and text "kiwi",
 *   P: dot 0.8 (dense rank 1), "kiwi fig fig" (BM25 rank 2)
 *   Q: dot 0.6 (dense rank 2), "kiwi"         (BM25 rank 1: shorter)
 * both score 1/61 + 1/62, so the id decides: Q is "a-doc", P "p-doc", and Q
 * comes first although P leads the dense list.
 */
static void test_rrf_tie(void **state) {
    (void)state;
    mem_index *ix;
    assert_int_equal(mem_index_create(2, &ix), IS_OK);
    const float ep[2] = {0.8f, 0.6f}, eq[2] = {0.6f, 0.8f};
    mem_doc p = {
        .id = "p-doc", .tenant = "t", .user = "u", .text = "kiwi fig fig", .embedding = ep};
    mem_doc q = {.id = "a-doc", .tenant = "t", .user = "u", .text = "kiwi", .embedding = eq};
    assert_int_equal(mem_index_upsert(ix, &p), IS_OK);
    assert_int_equal(mem_index_upsert(ix, &q), IS_OK);
    const float qe[2] = {1, 0};
    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit h[2];
    int32_t n;
    assert_int_equal(mem_index_search(ix, &f, qe, "kiwi", 2, MEM_SEARCH_HYBRID, h, &n), IS_OK);
    assert_int_equal(n, 2);
    assert_float_equal(h[0].score, h[1].score, 0.0);
    assert_string_equal(h[0].id, "a-doc");
    assert_int_equal(h[0].dense_rank, 2);
    assert_int_equal(h[0].bm25_rank, 1);
    assert_string_equal(h[1].id, "p-doc");
    mem_index_free(ix);
}

/* ---- external dense list ------------------------------------------------------- */

static void test_dense_list(void **state) {
    (void)state;
    enum { DIM = 24, N = 300 };
    static const char *const words[] = {"lion", "tiger", "zebra", "kiwi",
                                        "fig",  "apple", "pear",  "plum"};
    uint64_t s = 42;
    mem_index *ix;
    assert_int_equal(mem_index_create(DIM, &ix), IS_OK);
    static char ids[N][16], texts[N][64];
    static float emb[N][DIM];
    for (int i = 0; i < N; i++) {
        snprintf(ids[i], sizeof ids[i], "d%03d", (i * 37) % N);
        int at = 0;
        for (int w = 0; w < 3; w++)
            at += snprintf(texts[i] + at, sizeof texts[i] - (size_t)at, "%s%s", w ? " " : "",
                           words[rng_next(&s) % 8]);
        if (i % 10 == 3) memcpy(emb[i], emb[i - 1], sizeof emb[i]); /* exact ties */
        else random_unit(&s, emb[i], DIM);
        mem_doc d = {.id = ids[i],
                     .tenant = "t",
                     .user = i < 250 ? "u" : "v",
                     .text = texts[i],
                     .embedding = emb[i]};
        assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
    }
    const mem_filter f = {.tenant = "t", .user = "u"};
    static mem_hit want[N + 2], got[N + 2], dl[N + 2];
    const char *dl_ids[N + 2];
    float dl_scores[N + 2];
    for (int qi = 0; qi < 6; qi++) {
        float q[DIM];
        random_unit(&s, q, DIM);
        const char *text = words[qi];
        static const int32_t ks[] = {1, 5, 50, 150};
        for (int ki = 0; ki < 4; ki++) {
            const int32_t k = ks[ki];
            for (int mode = MEM_SEARCH_DENSE; mode <= MEM_SEARCH_HYBRID; mode += 2) {
                const int32_t depth =
                    mode == MEM_SEARCH_HYBRID && k < MEM_HYBRID_DEPTH ? MEM_HYBRID_DEPTH : k;
                int32_t nd = 0, nw = 0, ng = 0;
                assert_int_equal(
                    mem_index_search(ix, &f, q, NULL, depth, MEM_SEARCH_DENSE, dl, &nd), IS_OK);
                /* An id of another user and one of nobody first: skipped. */
                dl_ids[0] = ids[260]; /* user v's */
                dl_scores[0] = 2.0f;
                dl_ids[1] = "nobody";
                dl_scores[1] = 2.0f;
                for (int32_t i = 0; i < nd; i++) {
                    dl_ids[i + 2] = dl[i].id;
                    dl_scores[i + 2] = dl[i].score;
                }
                assert_int_equal(mem_index_search(ix, &f, q, text, k, mode, want, &nw), IS_OK);
                assert_int_equal(mem_index_search_dense_list(ix, &f, dl_ids, dl_scores, nd + 2,
                                                             text, k, mode, got, &ng),
                                 IS_OK);
                assert_int_equal(ng, nw);
                for (int32_t i = 0; i < ng; i++) {
                    assert_string_equal(got[i].id, want[i].id);
                    assert_true(got[i].score == want[i].score && got[i].bm25 == want[i].bm25);
                    assert_int_equal(got[i].dense_rank, want[i].dense_rank);
                    assert_int_equal(got[i].bm25_rank, want[i].bm25_rank);
                    if (want[i].dense_rank > 0) assert_true(got[i].dense == want[i].dense);
                    else assert_true(isnan(got[i].dense));
                }
            }
        }
    }
    /* Refused: BM25 mode, filters, bad entries. */
    const char *one_id[1] = {"d000"};
    float one_score[1] = {0.5f};
    mem_hit h[4];
    int32_t n = -1;
    assert_int_equal(
        mem_index_search_dense_list(ix, &f, one_id, one_score, 1, "fig", 4, MEM_SEARCH_BM25, h, &n),
        IS_ERR_INVALID_ARG);
    const mem_filter fa = {.tenant = "t", .user = "u", .agent_id = "x"};
    assert_int_equal(mem_index_search_dense_list(ix, &fa, one_id, one_score, 1, "fig", 4,
                                                 MEM_SEARCH_HYBRID, h, &n),
                     IS_ERR_INVALID_ARG);
    one_score[0] = NAN;
    assert_int_equal(mem_index_search_dense_list(ix, &f, one_id, one_score, 1, "fig", 4,
                                                 MEM_SEARCH_HYBRID, h, &n),
                     IS_ERR_INVALID_ARG);
    one_id[0] = NULL;
    one_score[0] = 0.5f;
    assert_int_equal(mem_index_search_dense_list(ix, &f, one_id, one_score, 1, "fig", 4,
                                                 MEM_SEARCH_HYBRID, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(
        mem_index_search_dense_list(ix, &f, NULL, NULL, -1, "fig", 4, MEM_SEARCH_HYBRID, h, &n),
        IS_ERR_INVALID_ARG);
    assert_int_equal(n, -1);
    /* An empty list: hybrid is BM25's order, dense finds nothing. */
    assert_int_equal(
        mem_index_search_dense_list(ix, &f, NULL, NULL, 0, "fig", 4, MEM_SEARCH_HYBRID, h, &n),
        IS_OK);
    assert_true(n > 0 && h[0].dense_rank == -1 && h[0].bm25_rank == 1 && isnan(h[0].dense));
    assert_int_equal(
        mem_index_search_dense_list(ix, &f, NULL, NULL, 0, "fig", 4, MEM_SEARCH_DENSE, h, &n),
        IS_OK);
    assert_int_equal(n, 0);
    mem_index_free(ix);
}

/* ---- bad arguments ---------------------------------------------------------- */

static void test_bad_args(void **state) {
    (void)state;
    mem_index *ix = NULL;
    assert_int_equal(mem_index_create(0, &ix), IS_ERR_INVALID_ARG);
    assert_null(ix);
    assert_int_equal(mem_index_create(3, &ix), IS_OK);
    const float e[3] = {1, 0, 0};
    const float nan_e[3] = {1, NAN, 0};
    const float inf_e[3] = {INFINITY, 0, 0};
    char long_id[80];
    memset(long_id, 'x', sizeof long_id);
    long_id[MEM_ID_MAX + 1] = '\0'; /* 72 bytes */
    mem_doc bad[] = {
        {.id = NULL, .tenant = "t", .user = "u", .embedding = e},
        {.id = "", .tenant = "t", .user = "u", .embedding = e},
        {.id = long_id, .tenant = "t", .user = "u", .embedding = e},
        {.id = "a", .tenant = NULL, .user = "u", .embedding = e},
        {.id = "a", .tenant = "t", .user = NULL, .embedding = e},
        {.id = "a", .tenant = "", .user = "u", .embedding = e},
        {.id = "a", .tenant = "t", .user = "u", .embedding = NULL},
        {.id = "a", .tenant = "t", .user = "u", .embedding = nan_e},
        {.id = "a", .tenant = "t", .user = "u", .embedding = inf_e},
        {.id = "a", .tenant = "t", .user = "u", .embedding = e, .text = "bad \xc3\x28 utf8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(mem_index_upsert(ix, &bad[i]), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_upsert(ix, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_count(ix), 0);
    long_id[MEM_ID_MAX] = '\0'; /* 71 bytes: the longest allowed */
    mem_doc ok = {.id = long_id, .tenant = "t", .user = "u", .embedding = e, .text = "fine"};
    assert_int_equal(mem_index_upsert(ix, &ok), IS_OK);
    /* A failed replacement leaves the old document. */
    mem_doc worse = ok;
    worse.embedding = nan_e;
    assert_int_equal(mem_index_upsert(ix, &worse), IS_ERR_INVALID_ARG);

    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit h[2];
    int32_t n = 7;
    assert_int_equal(mem_index_search(ix, &f, e, NULL, 2, MEM_SEARCH_DENSE, h, &n), IS_OK);
    assert_int_equal(n, 1);
    assert_string_equal(h[0].id, long_id);
    n = 7;
    assert_int_equal(mem_index_search(ix, &f, e, NULL, -1, MEM_SEARCH_DENSE, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, NULL, "x", 2, MEM_SEARCH_DENSE, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, NULL, "x", 2, MEM_SEARCH_HYBRID, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, e, NULL, 2, MEM_SEARCH_BM25, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, nan_e, NULL, 2, MEM_SEARCH_DENSE, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, NULL, "\xff", 2, MEM_SEARCH_BM25, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, e, NULL, 2, (mem_search_mode)7, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(mem_index_search(ix, &f, e, NULL, 2, MEM_SEARCH_DENSE, NULL, &n),
                     IS_ERR_INVALID_ARG);
    const char *keys[] = {"k"};
    mem_filter fm = {
        .tenant = "t", .user = "u", .meta_keys = keys, .meta_values = NULL, .n_meta = 1};
    assert_int_equal(mem_index_search(ix, &fm, e, NULL, 2, MEM_SEARCH_DENSE, h, &n),
                     IS_ERR_INVALID_ARG);
    fm.n_meta = -1;
    assert_int_equal(mem_index_search(ix, &fm, e, NULL, 2, MEM_SEARCH_DENSE, h, &n),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(n, 7);
    assert_int_equal(mem_index_remove(ix, NULL), IS_ERR_INVALID_ARG);
    /* BM25 with text that has only stopwords: no hits, not an error. */
    assert_int_equal(mem_index_search(ix, &f, NULL, "the", 2, MEM_SEARCH_BM25, h, &n), IS_OK);
    assert_int_equal(n, 0);
    assert_true(mem_index_check(ix));
    mem_index_free(ix);
}

/* ---- threads ---------------------------------------------------------------- */

enum { TH_DIM = 32, TH_USERS = 3, TH_BASE = 300, TH_WRITES = 1500, TH_READERS = 3 };

typedef struct th_ctx {
    mem_index *ix;
    int stop; /* accessed with __atomic builtins */
    int searches;
    int failures;
} th_ctx;

static void *th_reader(void *arg) {
    th_ctx *c = arg;
    uint64_t s = (uint64_t)(uintptr_t)&s;
    float q[TH_DIM];
    mem_hit h[20];
    int local = 0, bad = 0;
    const char *users[TH_USERS] = {"u0", "u1", "u2"};
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) || local < 50) {
        int u = (int)(rng_next(&s) % TH_USERS);
        random_unit(&s, q, TH_DIM);
        mem_filter f = {.tenant = "t", .user = users[u]};
        int32_t n = -1;
        mem_search_mode mode = (mem_search_mode)(local % 3);
        if (mem_index_search(c->ix, &f, q, "alpha beta", 20, mode, h, &n) != IS_OK) bad++;
        char prefix[8];
        snprintf(prefix, sizeof prefix, "%s-", users[u]);
        for (int i = 0; i < n; i++) {
            if (strncmp(h[i].id, prefix, strlen(prefix)) != 0) bad++;
            if (i > 0 && h[i].score > h[i - 1].score) bad++;
        }
        if (n < 0 || n > 20) bad++;
        local++;
    }
    __atomic_add_fetch(&c->searches, local, __ATOMIC_RELAXED);
    __atomic_add_fetch(&c->failures, bad, __ATOMIC_RELAXED);
    return NULL;
}

static void th_upsert(mem_index *ix, uint64_t *s, int i) {
    static const char *users[TH_USERS] = {"u0", "u1", "u2"};
    char id[32];
    float e[TH_DIM];
    int u = i % TH_USERS;
    snprintf(id, sizeof id, "%s-%d", users[u], i);
    random_unit(s, e, TH_DIM);
    mem_doc d = {.id = id,
                 .tenant = "t",
                 .user = users[u],
                 .embedding = e,
                 .text = (i % 2) ? "alpha gamma" : "beta delta",
                 .agent_id = "ag"};
    assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
}

static void test_threads(void **state) {
    (void)state;
    th_ctx c = {0};
    assert_int_equal(mem_index_create(TH_DIM, &c.ix), IS_OK);
    uint64_t s = 3;
    for (int i = 0; i < TH_BASE; i++) th_upsert(c.ix, &s, i);
    pthread_t th[TH_READERS];
    for (int i = 0; i < TH_READERS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, th_reader, &c), 0);
    for (int w = 0; w < TH_WRITES; w++) {
        int i = (int)(rng_next(&s) % (2 * TH_BASE));
        if (rng_next(&s) % 3 == 0) {
            char id[32];
            snprintf(id, sizeof id, "u%d-%d", i % TH_USERS, i);
            is_status st = mem_index_remove(c.ix, id);
            assert_true(st == IS_OK || st == IS_ERR_NOT_FOUND);
        } else {
            th_upsert(c.ix, &s, i);
        }
    }
    __atomic_store_n(&c.stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < TH_READERS; i++) pthread_join(th[i], NULL);
    assert_int_equal(c.failures, 0);
    assert_true(c.searches >= 50 * TH_READERS);
    assert_true(mem_index_check(c.ix));
    mem_index_free(c.ix);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_topk),     cmocka_unit_test(test_ties_by_id),
        cmocka_unit_test(test_filters),        cmocka_unit_test(test_isolation),
        cmocka_unit_test(test_upsert_replace), cmocka_unit_test(test_churn),
        cmocka_unit_test(test_rrf_hand),       cmocka_unit_test(test_rrf_tie),
        cmocka_unit_test(test_dense_list),     cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_memory_gpu: GPU retrieval in the memory layer (memory_params.
 * gpu_retrieval, memory/dense_gpu.h) against the CPU path.
 *
 * One data directory, a random BERT (tests/common/test_bert.h, model A:
 * dim 64) as the embedder. The GPU memory gets ~330 facts: user t/u1 240
 * (110 copies of one text, so exact score ties straddle every cut: k = 1,
 * 5, 50 and the hybrid dense depth 100), t/u2 60 (four texts five times
 * each), t2/u1 20 (another tenant, same user id, texts shared with t/u1),
 * some with an agent_id. Copies are added one by one: the CPU embedder's
 * output depends on a text's place in its batch by an ulp, and only equal
 * vectors tie exactly. The dense reference is the CPU path itself: an
 * index (memory/index.h) built from the memory's rows (same ids,
 * embeddings, texts), the query embedded by the CPU embedder. For 32
 * queries (the tie text, the duplicated texts, random word strings, single
 * words) per user, dense and hybrid, k = 1, 5, 50:
 *
 *   dense   the GPU's top k is the prefix of its full list, which is sorted
 *           by (score descending, id ascending) (the host's tie fix, and the
 *           deepening fetch at a tie run cut by k); scores within 1e-5 of
 *           the CPU's position by position, and each hit's CPU score within
 *           1e-5 of the CPU's score at that position; same ids in the same
 *           order whenever no two different CPU scores near the cut are
 *           closer than 2e-5 (the GPU embeds the query in another summation
 *           order and sums in f64: facts closer than that may swap; the
 *           counts printed say how many comparisons were exact);
 *   hybrid  exactly the RRF fusion (ids, order, score, bm25) of the GPU's
 *           dense list at depth max(k, 100) with the memory's BM25 list;
 *           dense scores of BM25-only hits (scored on the device) within
 *           1e-5 of the CPU's. The CPU memory's hybrid results are the same
 *           fusion of the CPU's dense list (checked when the directory is
 *           opened with CPU retrieval), so where the two dense lists agree
 *           (counted) the results are identical.
 *
 * Rounds: after the adds (the GPU copy filled write by write), after
 * updates (text and metadata), deletes and delete_all, after concurrent
 * writes, and after closing and reopening (filled at open); in between the
 * directory is opened with CPU retrieval, whose dense results must equal
 * the reference bit for bit. memory_check (which checks the GPU copy too)
 * after every phase. Also: an agent_id filter, BM25 mode and k = 1024 stay
 * on the CPU (memory_gpu_stats counts them) with the CPU's exact results;
 * 1030 copies of one text make a tie run past CUDA_TOPK_MAX, which the GPU
 * declines; four threads search while a fifth adds, updates and deletes.
 *
 * Without a usable GPU the program exits 77 (ctest: skipped). Seed:
 * IS_TEST_SEED (default 1).
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
#include <sys/stat.h>
#include <unistd.h>

#include "backend_cuda.h"
#include "core/status.h"
#include "memory/memory.h"
#include "retrieval_cuda.h"
#include "test_bert.h"
#include "test_util.h"

#define TOL      1e-5 /* GPU against CPU scores */
#define AMBIG    2e-5 /* different CPU scores closer than this may swap */
#define TIE_TEXT "the cat sat on the mat"
#define N_TIE    110
#define BIG_TIE  1030
#define MAX_LIST 4096

static uint64_t g_rng = 1;
static char g_tmp[256], g_data[300];
static embedder *g_emb;

static uint64_t rng_next(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int32_t irand(int32_t n) { return (int32_t)(rng_next() % (uint64_t)n); }

static void ok(is_status st) {
    if (st != IS_OK) fail_msg("status %s: %s", is_status_to_string(st), is_error_last());
}

static int32_t n_words(void) {
    int32_t n = 0;
    while (test_bert_words[n]) n++;
    return n;
}

/* lo..hi random vocabulary words, into buf[cap]. */
static char *random_text(char *buf, size_t cap, int32_t lo, int32_t hi) {
    const int32_t w = lo + irand(hi - lo + 1);
    size_t at = 0;
    buf[0] = 0;
    for (int32_t j = 0; j < w; j++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s", j ? " " : "",
                               test_bert_words[irand(n_words())]);
    return buf;
}

/* ---- opening ------------------------------------------------------------------ */

static memory *open_mem(bool gpu) {
    memory_params p = memory_default_params();
    p.embedder = g_emb;
    p.embed_name = "bert-a";
    p.gpu_retrieval = gpu;
    memory *m = NULL;
    if (memory_open(g_data, &p, &m, NULL) != IS_OK)
        fail_msg("memory_open (gpu %d): %s", gpu, is_error_last());
    return m;
}

static void check(memory *m) {
    if (memory_check(m, false) != IS_OK) fail_msg("memory_check: %s", is_error_last());
}

/* Adds texts[0..n) to (tenant, user), every seventh with agent_id `agent`,
 * in batches of `batch`. Copies of a text are exact ties only when added
 * in batches of one: the CPU embedder's output depends on a text's place
 * in its batch (OpenBLAS's blocking), by an ulp or so. */
static void add_many(memory *m, const char *tenant, const char *user, const char *const *texts,
                     int32_t n, const char *agent, char (*ids)[MEMORY_ID_SIZE], int32_t batch) {
    for (int32_t at = 0; at < n; at += batch) {
        const int32_t b = n - at < batch ? n - at : batch;
        memory_add_req r[100];
        for (int32_t i = 0; i < b; i++)
            r[i] = (memory_add_req){.tenant = tenant,
                                    .user = user,
                                    .text = texts[at + i],
                                    .agent_id = (at + i) % 7 == 3 ? agent : NULL,
                                    .window = MEMORY_WINDOW_DEFAULT};
        ok(memory_add_batch(m, r, b, ids ? ids + at : NULL, NULL));
    }
}

/* ---- the reference: the CPU path on the memory's rows ---------------------------- */

static is_status ref_row(const mem_fact *f, void *ud) {
    mem_doc d = {.id = f->id,
                 .tenant = f->tenant,
                 .user = f->user,
                 .agent_id = f->agent_id,
                 .run_id = f->run_id,
                 .text = f->text,
                 .embedding = f->embedding,
                 .metadata_json = f->metadata};
    return mem_index_upsert(ud, &d);
}

static mem_index *build_ref(memory *m) {
    mem_index *ix = NULL;
    ok(mem_index_create(memory_dim(m), &ix));
    ok(mem_store_foreach(memory_fact_store(m), true, ref_row, ix));
    return ix;
}

/* The CPU's search into out[MAX_LIST]. */
static int32_t ref_search(mem_index *ix, const mem_filter *f, const char *q, int32_t k,
                          mem_search_mode mode, mem_hit *out) {
    float qv[64];
    assert_true(embedder_dim(g_emb) <= 64);
    ok(embedder_embed(g_emb, &q, 1, qv));
    int32_t n = 0;
    ok(mem_index_search(ix, f, mode == MEM_SEARCH_BM25 ? NULL : qv, q, k, mode, out, &n));
    return n;
}

/* The memory's search, as (id, score, dense, bm25) into out[MAX_LIST]. */
static int32_t mem_search(memory *m, const mem_filter *f, const char *q, int32_t k,
                          mem_search_mode mode, mem_hit *out) {
    memory_hit *h = NULL;
    int32_t n = 0;
    ok(memory_search_mode(m, f, q, k, mode, &h, &n));
    assert_true(n <= MAX_LIST);
    for (int32_t i = 0; i < n; i++) {
        assert_string_equal(h[i].fact.tenant, f->tenant);
        assert_string_equal(h[i].fact.user, f->user);
        memset(&out[i], 0, sizeof out[i]);
        snprintf(out[i].id, sizeof out[i].id, "%s", h[i].fact.id);
        out[i].score = h[i].score;
        out[i].dense = h[i].dense;
        out[i].bm25 = h[i].bm25;
    }
    memory_hits_free(h, n);
    return n;
}

static const mem_hit *find(const mem_hit *l, int32_t n, const char *id) {
    for (int32_t i = 0; i < n; i++)
        if (strcmp(l[i].id, id) == 0) return &l[i];
    return NULL;
}

/* ---- comparing ---------------------------------------------------------------- */

typedef struct tally {
    int64_t dense_strict, dense_ambiguous, hybrid_strict, hybrid_fused;
} tally;

/* Full lists of one (query, user): the CPU's dense (S), the GPU's dense (G),
 * BM25 (B). */
typedef struct lists {
    mem_hit S[MAX_LIST], G[MAX_LIST], B[MAX_LIST];
    int32_t nS, nG, nB;
} lists;

/* Whether the CPU's order of its first upto + 1 facts may differ from the
 * GPU's: two neighbours with different scores closer than AMBIG, or equal
 * CPU scores that the GPU tells apart (different embeddings whose float
 * sums happen to round alike), which the CPU orders by id and the GPU by
 * score. */
static bool ambiguous(const lists *L, int32_t upto) {
    for (int32_t i = 0; i + 1 < L->nS && i <= upto; i++) {
        const mem_hit *a = &L->S[i], *b = &L->S[i + 1];
        if (a->score != b->score) {
            if ((double)a->score - b->score < AMBIG) return true;
        } else if (find(L->G, L->nG, a->id)->score != find(L->G, L->nG, b->id)->score) {
            return true;
        }
    }
    return false;
}

static void check_dense(memory *m, mem_index *ix, const mem_filter *f, const char *q, int32_t k,
                        const lists *L, tally *t) {
    static mem_hit R[MAX_LIST], H[MAX_LIST];
    const int32_t nR = ref_search(ix, f, q, k, MEM_SEARCH_DENSE, R);
    const int32_t nH = mem_search(m, f, q, k, MEM_SEARCH_DENSE, H);
    if (nH != nR) fail_msg("dense '%s' k=%d: %d hits on the GPU, %d on the CPU", q, k, nH, nR);
    for (int32_t i = 0; i < nH; i++) {
        /* The prefix of the GPU's own full order: ties cut at k resolved by id. */
        if (strcmp(H[i].id, L->G[i].id) != 0 || H[i].score != L->G[i].score)
            fail_msg("dense '%s' k=%d: hit %d is %s (%.9g), the full GPU list has %s (%.9g)", q, k,
                     i, H[i].id, (double)H[i].score, L->G[i].id, (double)L->G[i].score);
        if (H[i].dense != H[i].score || H[i].bm25 != 0.0f)
            fail_msg("dense '%s': dense/bm25 fields", q);
        const mem_hit *s = find(L->S, L->nS, H[i].id);
        if (!s)
            fail_msg("dense '%s' k=%d: GPU hit %s is not among the user's facts", q, k, H[i].id);
        if (!(fabs((double)H[i].score - R[i].score) <= TOL) ||
            !(fabs((double)s->score - R[i].score) <= TOL))
            fail_msg("dense '%s' k=%d: position %d: GPU %s %.9g (CPU score %.9g), CPU %s %.9g", q,
                     k, i, H[i].id, (double)H[i].score, (double)s->score, R[i].id,
                     (double)R[i].score);
    }
    if (ambiguous(L, nR)) {
        t->dense_ambiguous++;
        return;
    }
    for (int32_t i = 0; i < nH; i++)
        if (strcmp(H[i].id, R[i].id) != 0)
            fail_msg("dense '%s' k=%d: position %d: GPU %s, CPU %s (no near tie)", q, k, i, H[i].id,
                     R[i].id);
    t->dense_strict++;
}

typedef struct fused {
    char id[MEM_ID_MAX + 1];
    int32_t dr, br;
    float rrf;
} fused;

static int cmp_fused(const void *a, const void *b) {
    const fused *x = a, *y = b;
    if (x->rrf != y->rrf) return x->rrf > y->rrf ? -1 : 1;
    return strcmp(x->id, y->id);
}

/* RRF of dl[0..nd) and bl[0..nb) as index.c fuses them, best first, into
 * out; the count. */
static int32_t fuse(const mem_hit *dl, int32_t nd, const mem_hit *bl, int32_t nb, fused *out) {
    int32_t n = 0;
    for (int32_t i = 0; i < nd; i++) {
        snprintf(out[n].id, sizeof out[n].id, "%s", dl[i].id);
        out[n].dr = i + 1;
        out[n].br = -1;
        n++;
    }
    for (int32_t i = 0; i < nb; i++) {
        int32_t j = 0;
        while (j < n && strcmp(out[j].id, bl[i].id) != 0) j++;
        if (j == n) {
            snprintf(out[n].id, sizeof out[n].id, "%s", bl[i].id);
            out[n].dr = -1;
            n++;
        }
        out[j].br = i + 1;
    }
    for (int32_t i = 0; i < n; i++) {
        double s = 0.0;
        if (out[i].dr > 0) s += 1.0 / (MEM_RRF_K + out[i].dr);
        if (out[i].br > 0) s += 1.0 / (MEM_RRF_K + out[i].br);
        out[i].rrf = (float)s;
    }
    qsort(out, (size_t)n, sizeof *out, cmp_fused);
    return n;
}

/* The hybrid hits H[0..nH) against the fusion of dl (dense, depth first
 * entries) and L->B: same ids in the same order, RRF and BM25 scores equal;
 * dense scores equal to dl's, and within TOL of the CPU's for hits outside
 * dl. */
static void expect_fused(const char *who, const char *q, int32_t k, const mem_hit *H, int32_t nH,
                         const mem_hit *dl, int32_t n_dl, const lists *L) {
    static fused E[2 * MAX_LIST];
    const int32_t depth = k > MEM_HYBRID_DEPTH ? k : MEM_HYBRID_DEPTH;
    const int32_t nd = n_dl < depth ? n_dl : depth, nb = L->nB < depth ? L->nB : depth;
    int32_t nE = fuse(dl, nd, L->B, nb, E);
    if (nE > k) nE = k;
    if (nH != nE) fail_msg("%s hybrid '%s' k=%d: %d hits, the fusion has %d", who, q, k, nH, nE);
    for (int32_t i = 0; i < nH; i++) {
        if (strcmp(H[i].id, E[i].id) != 0 || H[i].score != E[i].rrf)
            fail_msg("%s hybrid '%s' k=%d: hit %d is %s (%.9g), the fusion gives %s (%.9g)", who, q,
                     k, i, H[i].id, (double)H[i].score, E[i].id, (double)E[i].rrf);
        const mem_hit *b = find(L->B, L->nB, H[i].id), *s = find(L->S, L->nS, H[i].id);
        assert_non_null(s);
        if (H[i].bm25 != (b ? b->score : 0.0f))
            fail_msg("%s hybrid '%s' k=%d: bm25 of %s is %.9g, the BM25 list has %.9g", who, q, k,
                     H[i].id, (double)H[i].bm25, b ? (double)b->score : 0.0);
        if (E[i].dr > 0 ? H[i].dense != dl[E[i].dr - 1].score
                        : !(fabs((double)H[i].dense - s->score) <= TOL))
            fail_msg("%s hybrid '%s' k=%d: dense of %s (dense rank %d) is %.9g, CPU %.9g", who, q,
                     k, H[i].id, E[i].dr, (double)H[i].dense, (double)s->score);
    }
}

static void check_hybrid(memory *m, const mem_filter *f, const char *q, int32_t k, const lists *L,
                         tally *t) {
    static mem_hit H[MAX_LIST];
    const int32_t nH = mem_search(m, f, q, k, MEM_SEARCH_HYBRID, H);
    expect_fused("GPU", q, k, H, nH, L->G, L->nG, L);
    t->hybrid_fused++;
    /* Where the GPU's dense list at the depth is the CPU's, so is the
     * result (the fusion is the same code, checked in cpu_equals_ref). */
    const int32_t depth = k > MEM_HYBRID_DEPTH ? k : MEM_HYBRID_DEPTH;
    for (int32_t i = 0; i < L->nG && i < depth; i++)
        if (strcmp(L->G[i].id, L->S[i].id) != 0) return;
    t->hybrid_strict++;
}

static void get_lists(memory *m, mem_index *ix, const mem_filter *f, const char *q, lists *L) {
    L->nS = ref_search(ix, f, q, MAX_LIST, MEM_SEARCH_DENSE, L->S);
    /* The memory's own BM25 (always on the CPU): BM25 sums terms in the
     * order of the vocabulary's ids, which depends on the order facts were
     * indexed, so another index's scores may differ in the last bit. */
    L->nB = mem_search(m, f, q, MAX_LIST, MEM_SEARCH_BM25, L->B);
    assert_true(L->nS < CUDA_TOPK_MAX);
    L->nG = mem_search(m, f, q, L->nS, MEM_SEARCH_DENSE, L->G);
    assert_int_equal(L->nG, L->nS);
    for (int32_t i = 0; i + 1 < L->nG; i++) {
        const mem_hit *a = &L->G[i], *b = &L->G[i + 1];
        if (a->score < b->score || (a->score == b->score && strcmp(a->id, b->id) >= 0))
            fail_msg("'%s': the GPU's full list is out of order at %d: %s %.9g, %s %.9g", q, i,
                     a->id, (double)a->score, b->id, (double)b->score);
    }
}

/* ---- queries ------------------------------------------------------------------- */

#define N_QUERIES 32
static char g_queries[N_QUERIES][256];
static const char *const u2_dups[4] = {"she likes pizza", "he went to the park with her kids",
                                       "caroline and melanie ran", "painting"};

static void make_queries(void) {
    int32_t n = 0;
    snprintf(g_queries[n++], 256, "%s", TIE_TEXT);
    for (int i = 0; i < 4; i++) snprintf(g_queries[n++], 256, "%s", u2_dups[i]);
    for (int i = 0; i < 5; i++)
        snprintf(g_queries[n++], 256, "%s", test_bert_words[irand(n_words())]);
    snprintf(g_queries[n++], 256, "cat sat mat"); /* near the tie text */
    snprintf(g_queries[n++], 256, "zzz qqq");     /* [UNK]s only: no BM25 match */
    while (n < N_QUERIES) random_text(g_queries[n++], 256, 2, 14);
}

static const mem_filter g_users[3] = {
    {.tenant = "t", .user = "u1"}, {.tenant = "t", .user = "u2"}, {.tenant = "t2", .user = "u1"}};

static void round_compare(memory *m, const char *label) {
    mem_index *ix = build_ref(m);
    static lists L;
    tally t = {0};
    static const int32_t ks[3] = {1, 5, 50};
    for (int u = 0; u < 3; u++)
        for (int32_t qi = 0; qi < N_QUERIES; qi++) {
            get_lists(m, ix, &g_users[u], g_queries[qi], &L);
            for (int ki = 0; ki < 3; ki++) {
                check_dense(m, ix, &g_users[u], g_queries[qi], ks[ki], &L, &t);
                check_hybrid(m, &g_users[u], g_queries[qi], ks[ki], &L, &t);
            }
        }
    printf("  %-28s dense: %lld identical, %lld with near ties (scores within 1e-5); hybrid: %lld "
           "fused "
           "exactly, %lld identical to the CPU\n",
           label, (long long)t.dense_strict, (long long)t.dense_ambiguous,
           (long long)t.hybrid_fused, (long long)t.hybrid_strict);
    /* Most comparisons must be strict, or the test proves little. */
    assert_true(t.dense_strict >= (t.dense_strict + t.dense_ambiguous) / 2);
    assert_true(t.hybrid_strict >= t.hybrid_fused / 2);
    mem_index_free(ix);
}

/* The CPU-retrieval memory's results: dense equal to the reference bit
 * for bit, hybrid the fusion of the reference's dense list with BM25 (so
 * the test's fusion is the index's). */
static void cpu_equals_ref(memory *m) {
    mem_index *ix = build_ref(m);
    static mem_hit R[MAX_LIST], H[MAX_LIST];
    static lists L;
    static const int32_t ks[3] = {1, 5, 50};
    for (int u = 0; u < 3; u++)
        for (int32_t qi = 0; qi < N_QUERIES; qi++) {
            L.nS = ref_search(ix, &g_users[u], g_queries[qi], MAX_LIST, MEM_SEARCH_DENSE, L.S);
            L.nB = mem_search(m, &g_users[u], g_queries[qi], MAX_LIST, MEM_SEARCH_BM25, L.B);
            for (int ki = 0; ki < 3; ki++) {
                const int32_t nR =
                    ref_search(ix, &g_users[u], g_queries[qi], ks[ki], MEM_SEARCH_DENSE, R);
                int32_t nH = mem_search(m, &g_users[u], g_queries[qi], ks[ki], MEM_SEARCH_DENSE, H);
                assert_int_equal(nH, nR);
                for (int32_t i = 0; i < nH; i++) {
                    assert_string_equal(H[i].id, R[i].id);
                    assert_true(H[i].score == R[i].score && H[i].dense == R[i].dense &&
                                H[i].bm25 == R[i].bm25);
                }
                nH = mem_search(m, &g_users[u], g_queries[qi], ks[ki], MEM_SEARCH_HYBRID, H);
                expect_fused("CPU", g_queries[qi], ks[ki], H, nH, L.S, L.nS, &L);
            }
        }
    mem_index_free(ix);
}

/* ---- the test ---------------------------------------------------------------------- */

typedef struct searcher {
    memory *m;
    int32_t seed, n;
} searcher;

static void *search_thread(void *arg) {
    searcher *s = arg;
    for (int32_t i = 0; i < s->n; i++) {
        const mem_filter *f = &g_users[(s->seed + i) % 3];
        memory_hit *h = NULL;
        int32_t n = 0;
        if (memory_search(s->m, f, g_queries[(s->seed * 7 + i) % N_QUERIES], 1 + (i % 3) * 20, &h,
                          &n) != IS_OK)
            return (void *)1;
        memory_hits_free(h, n);
    }
    return NULL;
}

static void test_gpu_retrieval(void **state) {
    (void)state;
    make_queries();
    memory *m = open_mem(true);

    /* t/u1: the tie text N_TIE times among 130 random texts, one by one. */
    static char texts[400][256];
    const char *tp[400];
    int32_t n_tie = 0;
    for (int32_t i = 0; i < 240; i++) {
        if (i % 2 == 1 && n_tie < N_TIE) snprintf(texts[i], 256, "%s", TIE_TEXT), n_tie++;
        else random_text(texts[i], 256, 3, 12);
        tp[i] = texts[i];
    }
    static char u1_ids[240][MEMORY_ID_SIZE];
    add_many(m, "t", "u1", tp, 240, "ag", u1_ids, 1);
    /* t/u2: 40 random texts in batches, then four texts five times each. */
    for (int32_t i = 0; i < 40; i++) tp[i] = random_text(texts[240 + i], 256, 2, 10);
    add_many(m, "t", "u2", tp, 40, NULL, NULL, 16);
    for (int32_t i = 0; i < 20; i++) tp[i] = u2_dups[i % 4];
    add_many(m, "t", "u2", tp, 20, NULL, NULL, 1);
    /* t2/u1: another tenant, some of t/u1's texts. */
    for (int32_t i = 0; i < 20; i++) tp[i] = i % 4 == 0 ? TIE_TEXT : texts[i];
    add_many(m, "t2", "u1", tp, 20, NULL, NULL, 1);
    check(m);
    dense_gpu_stats gs;
    assert_true(memory_gpu_stats(m, &gs));
    assert_int_equal(gs.facts, 320);
    round_compare(m, "after adds:");

    /* Updates: texts (some into the tie run, some out of it), metadata only. */
    char buf[256];
    for (int32_t i = 0; i < 30; i++) {
        const char *id = u1_ids[i * 7 % 240];
        const char *text = i % 3 == 0 ? TIE_TEXT : random_text(buf, sizeof buf, 2, 9);
        ok(memory_update(m, "t", "u1", id, text, i % 5 == 0 ? "{\"x\": 1}" : NULL));
    }
    ok(memory_update(m, "t", "u1", u1_ids[5], NULL, "{\"y\": \"z\"}"));
    /* Deletes, single and all of t2/u1 (then a few back). */
    for (int32_t i = 0; i < 25; i++) ok(memory_delete(m, "t", "u1", u1_ids[1 + i * 9]));
    int32_t nd = 0;
    ok(memory_delete_all(m, &g_users[2], &nd));
    assert_int_equal(nd, 20);
    for (int32_t i = 0; i < 8; i++) tp[i] = i % 2 ? TIE_TEXT : texts[100 + i];
    add_many(m, "t2", "u1", tp, 8, NULL, NULL, 1);
    check(m);
    round_compare(m, "after updates and deletes:");

    /* What stays on the CPU gives the CPU's results exactly. */
    assert_true(memory_gpu_stats(m, &gs));
    const int64_t declined = gs.declined, served = gs.searches;
    assert_true(served > 1000); /* the rounds ran on the GPU */
    mem_index *ix = build_ref(m);
    static mem_hit R[MAX_LIST], H[MAX_LIST];
    const mem_filter fa = {.tenant = "t", .user = "u1", .agent_id = "ag"};
    int32_t nR = ref_search(ix, &fa, TIE_TEXT, 10, MEM_SEARCH_DENSE, R);
    int32_t nH = mem_search(m, &fa, TIE_TEXT, 10, MEM_SEARCH_DENSE, H);
    assert_true(nR > 0);
    assert_int_equal(nH, nR);
    for (int32_t i = 0; i < nH; i++)
        assert_true(strcmp(H[i].id, R[i].id) == 0 && H[i].score == R[i].score);
    nR = ref_search(ix, &g_users[0], "pizza park", 1024, MEM_SEARCH_DENSE, R);
    nH = mem_search(m, &g_users[0], "pizza park", 1024, MEM_SEARCH_DENSE, H);
    assert_int_equal(nH, nR);
    for (int32_t i = 0; i < nH; i++)
        assert_true(strcmp(H[i].id, R[i].id) == 0 && H[i].score == R[i].score);
    nH = mem_search(m, &g_users[0], "pizza park", 10, MEM_SEARCH_BM25, H);
    assert_true(nH > 0);
    mem_index_free(ix);
    assert_true(memory_gpu_stats(m, &gs));
    assert_int_equal(gs.declined, declined + 3);
    assert_int_equal(gs.searches, served);
    assert_int_equal(gs.stale_users, 0);

    /* Threads: four search while this one writes. */
    pthread_t th[4];
    searcher sr[4];
    for (int i = 0; i < 4; i++) {
        sr[i] = (searcher){m, i, 60};
        assert_int_equal(pthread_create(&th[i], NULL, search_thread, &sr[i]), 0);
    }
    for (int32_t i = 0; i < 30; i++) {
        char id[MEMORY_ID_SIZE];
        memory_add_req r = {.tenant = "t",
                            .user = i % 2 ? "u1" : "u2",
                            .text = random_text(buf, sizeof buf, 2, 8),
                            .window = MEMORY_WINDOW_DEFAULT};
        ok(memory_add(m, &r, id));
        if (i % 3 == 0) ok(memory_update(m, "t", r.user, id, TIE_TEXT, NULL));
        if (i % 5 == 0) ok(memory_delete(m, "t", r.user, id));
    }
    for (int i = 0; i < 4; i++) {
        void *ret = (void *)1;
        pthread_join(th[i], &ret);
        assert_null(ret);
    }
    check(m);
    round_compare(m, "after concurrent writes:");
    memory_close(m);

    /* The same directory with CPU retrieval: the reference's results. */
    m = open_mem(false);
    assert_false(memory_gpu_stats(m, &gs));
    cpu_equals_ref(m);
    memory_close(m);

    /* Reopened on the GPU: the copy is filled at open. */
    m = open_mem(true);
    check(m);
    round_compare(m, "after reopening:");

    /* A tie run longer than the device's top-k limit: left to the CPU. */
    static const char *big[BIG_TIE];
    for (int32_t i = 0; i < BIG_TIE; i++) big[i] = "pizza";
    add_many(m, "t", "u3", big, BIG_TIE, NULL, NULL, 1);
    assert_true(memory_gpu_stats(m, &gs));
    const int64_t before = gs.declined;
    ix = build_ref(m);
    const mem_filter f3 = {.tenant = "t", .user = "u3"};
    nR = ref_search(ix, &f3, "pizza", 5, MEM_SEARCH_DENSE, R);
    nH = mem_search(m, &f3, "pizza", 5, MEM_SEARCH_DENSE, H);
    assert_int_equal(nH, 5);
    assert_int_equal(nR, 5);
    for (int32_t i = 0; i < nH; i++) assert_string_equal(H[i].id, R[i].id);
    assert_true(memory_gpu_stats(m, &gs));
    assert_int_equal(gs.declined, before + 1);
    mem_index_free(ix);
    check(m);
    memory_close(m);
}

/* ---- setup ------------------------------------------------------------------------ */

static int setup(void **state) {
    (void)state;
    const char *seed = getenv("IS_TEST_SEED");
    g_rng = seed ? strtoull(seed, NULL, 10) : 1;
    printf("seed %llu\n", (unsigned long long)g_rng);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/test_memory_gpu.XXXXXX");
    if (!mkdtemp(g_tmp)) return -1;
    if (test_bert_write(g_tmp, &test_bert_a, &g_rng)) return -1;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, test_bert_a.name);
    if (embedder_load(dir, &g_emb) != IS_OK) {
        fprintf(stderr, "embedder_load: %s\n", is_error_last());
        return -1;
    }
    snprintf(g_data, sizeof g_data, "%s/data", g_tmp);
    return mkdir(g_data, 0755);
}

static int teardown(void **state) {
    (void)state;
    embedder_free(g_emb);
    return test_remove_tree(g_tmp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpu_retrieval),
    };
    if (getenv("IS_TEST_FILTER")) cmocka_set_test_filter(getenv("IS_TEST_FILTER"));
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU retrieval tests are skipped\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, setup, teardown);
}

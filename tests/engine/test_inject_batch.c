/*
 * engine_inject_batch: the facts of several sequences injected in one
 * backend call give exactly what injecting them one sequence at a time
 * gives, bit for bit: every cache row (K and V, every layer, every position
 * of each sequence, in the cache's own type) and the logits of a decode
 * that follows. The sequences start at different lengths (a forked prefix,
 * the prefix and a few query tokens, a prefix cut inside a block), so each
 * token's position and slot differ from its neighbours'.
 *
 * Semantics checked: all or nothing per sequence. A sequence whose facts
 * are refused (its context would overflow; a fact with no values that the
 * backend does not hold) is left exactly as it was, with its status in
 * results[], and the others are injected; a backend failure inside the
 * one call leaves every sequence as it was.
 *
 * Built as test_inject_batch (CPU, f32) and, with INJECT_BATCH_CUDA, as
 * test_inject_batch_cuda (label gpu, exits 77 without a device): the f32
 * cache, the bf16 cache injected from the fact arena in one launch (facts
 * the arena holds passed without values, as the server passes them), the
 * fp8 arena, and an arena too small for one call's facts (placed and
 * injected in parts, also where the facts it holds are passed without
 * values behind facts it must fill), each against the per-sequence path on
 * the same backend.
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

#ifdef INJECT_BATCH_CUDA
#include "backend_cuda.h"
#define INJECT_BATCH_BACKEND "cuda"
#else
#define INJECT_BATCH_BACKEND "cpu"
#endif

static backend *g_be;
static model *g_model;
static memory_prompt *g_mp;

#define N_FACTS 8 /* the first of test_locomo_facts */

/* Each fact's pre-RoPE K and V, encoded once. */
static test_fact g_enc[N_FACTS];

#define N_SEQS 3
/* The fact sets: different lengths, a fact shared by two sequences. */
static const int SET_LEN[N_SEQS] = {3, 2, 4};
static const int SET[N_SEQS][4] = {{0, 1, 2, -1}, {3, 4, -1, -1}, {5, 0, 6, 7}};

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

static int32_t kv_dim(void) { return g_model->cfg.n_kv_heads * g_model->cfg.head_dim; }

static engine *make_engine(int32_t n_ctx) {
    return test_engine_create(g_model, test_engine_params(n_ctx, 8, 256));
}

/* The serving prefix in one sequence, and N_SEQS sequences that start
 * from it at different lengths: the prefix; the prefix and 7 more tokens;
 * the prefix less 3 (a fork that ends inside a block). */
static void open_seqs(engine *e, int32_t *seqs) {
    int32_t np;
    memory_prompt_prefix(g_mp, &np);
    float *logits = malloc((size_t)g_model->cfg.n_vocab * sizeof(float));
    int32_t sp = test_prefix_open(e, g_mp, logits);
    for (int s = 0; s < N_SEQS; s++) {
        assert_int_equal(engine_seq_open(e, &seqs[s]), IS_OK);
        assert_int_equal(engine_seq_fork(e, seqs[s], sp, s == 2 ? np - 3 : np), IS_OK);
    }
    assert_true(g_enc[7].n >= 7);
    test_decode_seq(e, seqs[1], g_enc[7].toks, 7, logits);
    free(logits);
}

/* The facts of sequence s, with their content ids (fact index + 1: the
 * same id, the same values); values left out where the backend holds the
 * fact and omit_resident is set. */
static void set_facts(engine *e, int s, bool omit_resident, engine_fact *f, uint64_t *ids) {
    for (int j = 0; j < SET_LEN[s]; j++) {
        const test_fact *x = &g_enc[SET[s][j]];
        ids[j] = (uint64_t)SET[s][j] + 1;
        f[j] = (engine_fact){x->n, x->toks, x->k, x->v};
        if (omit_resident && engine_fact_resident(e, ids[j], x->n)) f[j].k = f[j].v = NULL;
    }
}

/* Every cache row of a sequence, K then V, in the cache's type. */
static void *read_all(engine *e, int32_t seq, size_t *bytes) {
    int32_t n = kv_seq_length(engine_kv(e), seq);
    size_t half = (size_t)g_model->cfg.n_layers * n * kv_dim() * engine_kv_elem_size(e);
    char *buf = malloc(2 * half + 1);
    assert_int_equal(engine_seq_read_kv(e, seq, 0, n, buf, buf + half), IS_OK);
    *bytes = 2 * half;
    return buf;
}

/* One decode step over every sequence: a short query each, logits of
 * each sequence's last token, [N_SEQS][n_vocab]. */
static float *decode_queries(engine *e, const int32_t *seqs) {
    int32_t tok[64], sq[64];
    bool want[64];
    int32_t n = 0;
    for (int s = 0; s < N_SEQS; s++) {
        const test_fact *q = &g_enc[(s + 4) % N_FACTS];
        int32_t m = q->n < 9 ? q->n : 9;
        for (int32_t i = 0; i < m; i++, n++) {
            tok[n] = q->toks[i];
            sq[n] = seqs[s];
            want[n] = i == m - 1;
        }
    }
    float *logits = malloc((size_t)N_SEQS * g_model->cfg.n_vocab * sizeof(float));
    engine_batch b = {.n_tokens = n, .tokens = tok, .seq = sq, .want_logits = want};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    return logits;
}

/* Sequence s of a and b hold the same length, memory segment and cache
 * bytes. */
static void assert_same_seq(engine *a, int32_t sa, engine *b, int32_t sb, const char *what) {
    assert_int_equal(kv_seq_length(engine_kv(a), sa), kv_seq_length(engine_kv(b), sb));
    int32_t ab, ae, bb, be_;
    engine_seq_memory(a, sa, &ab, &ae);
    engine_seq_memory(b, sb, &bb, &be_);
    assert_int_equal(ab, bb);
    assert_int_equal(ae, be_);
    size_t na, nb;
    void *ka = read_all(a, sa, &na), *kb = read_all(b, sb, &nb);
    assert_int_equal(na, nb);
    if (memcmp(ka, kb, na) != 0) fail_msg("%s: the cache rows differ", what);
    free(ka);
    free(kb);
}

/* Injects every sequence's facts one sequence at a time into `one` and in
 * one batched call into `all`, then checks caches and logits bit for bit. */
static void check_batch_equals_one_by_one(bool omit_resident, const char *what) {
    engine *one = make_engine(2048), *all = make_engine(2048);
    int32_t s1[N_SEQS], s2[N_SEQS];
    open_seqs(one, s1);
    open_seqs(all, s2);
    engine_fact f1[N_SEQS][4], f2[N_SEQS][4];
    uint64_t id1[N_SEQS][4], id2[N_SEQS][4];
    for (int s = 0; s < N_SEQS; s++) {
        set_facts(one, s, omit_resident, f1[s], id1[s]);
        assert_int_equal(engine_inject_ids(one, s1[s], f1[s], id1[s], SET_LEN[s]), IS_OK);
    }
    engine_inject_seq q[N_SEQS];
    is_status res[N_SEQS];
    for (int s = 0; s < N_SEQS; s++) {
        set_facts(all, s, omit_resident, f2[s], id2[s]);
        q[s] = (engine_inject_seq){s2[s], f2[s], id2[s], SET_LEN[s]};
    }
    assert_int_equal(engine_inject_batch(all, q, N_SEQS, res), IS_OK);
    for (int s = 0; s < N_SEQS; s++) {
        assert_int_equal(res[s], IS_OK);
        assert_same_seq(one, s1[s], all, s2[s], what);
        int32_t mb, me;
        engine_seq_memory(all, s2[s], &mb, &me);
        int32_t want = 0;
        for (int j = 0; j < SET_LEN[s]; j++) want += g_enc[SET[s][j]].n;
        assert_int_equal(me - mb, want);
    }
    float *l1 = decode_queries(one, s1), *l2 = decode_queries(all, s2);
    size_t nl = (size_t)N_SEQS * g_model->cfg.n_vocab;
    for (size_t i = 0; i < nl; i++)
        if (l1[i] != l2[i]) fail_msg("%s: logit %zu differs: %g vs %g", what, i, l1[i], l2[i]);
    printf("  %s: %d sequences, one call = one at a time, bit for bit\n", what, N_SEQS);
    free(l1);
    free(l2);
    assert_true(kv_cache_check(engine_kv(one)));
    assert_true(kv_cache_check(engine_kv(all)));
    engine_free(one);
    engine_free(all);
}

static void test_batch_equals_one_by_one(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
#ifdef INJECT_BATCH_CUDA
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_KV_COMPACT, 0), IS_OK);
    check_batch_equals_one_by_one(false, "f32 cache");
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_KV_COMPACT, 1), IS_OK);
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_FP8, 0), IS_OK);
    check_batch_equals_one_by_one(false, "bf16 cache, arena");
    check_batch_equals_one_by_one(true, "bf16 cache, arena, resident facts without values");
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_FP8, 1), IS_OK);
    check_batch_equals_one_by_one(false, "bf16 cache, fp8 arena");
    check_batch_equals_one_by_one(true, "bf16 cache, fp8 arena, resident facts without values");
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_FP8, 0), IS_OK);
    /* An arena of 64 token pages: a call's facts (up to about 60 tokens a
     * sequence, twice that for the three) go in as several placements and
     * launches. */
    const model_config *c = &g_model->cfg;
    const uint64_t page = (uint64_t)2 * c->n_layers * c->n_kv_heads * c->head_dim * 2;
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_BYTES, 64 * page), IS_OK);
    check_batch_equals_one_by_one(false, "bf16 cache, arena smaller than one call");
    /* The same from an empty arena, resident facts without values: the
     * one-at-a-time injections leave four of the eight facts resident (52
     * of the 64 pages), and the batched call names them without values
     * after facts that miss. */
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_BYTES, 64 * page), IS_OK);
    check_batch_equals_one_by_one(true, "bf16 cache, arena smaller than one call, resident facts "
                                        "without values");
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_FACT_CACHE_BYTES, 0), IS_OK);
    assert_int_equal(backend_set_option(g_be, BACKEND_OPT_KV_COMPACT, 0), IS_OK);
#else
    check_batch_equals_one_by_one(false, "cpu f32");
#endif
}

/* Two of four sequences refused (one would pass its context, one names a
 * fact with no values the backend does not hold): those two are left as
 * they were, the other two injected as one at a time injects them, and the
 * call returns the first refusal. */
static void test_refused_sequence_left_unchanged(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    const int32_t n_ctx = 512;
    engine *ref = make_engine(n_ctx), *e = make_engine(n_ctx);
    int32_t sr[N_SEQS], se[N_SEQS], extra;
    open_seqs(ref, sr);
    open_seqs(e, se);
    assert_int_equal(engine_seq_open(e, &extra), IS_OK); /* empty */
    /* The refused ones: se[1] with fact 0 repeated past the context, and
     * `extra` with a fact without values. */
    int32_t reps = n_ctx / g_enc[0].n + 1;
    engine_fact *big = malloc((size_t)reps * sizeof *big);
    for (int32_t i = 0; i < reps; i++)
        big[i] = (engine_fact){g_enc[0].n, g_enc[0].toks, g_enc[0].k, g_enc[0].v};
    engine_fact novals = {g_enc[1].n, g_enc[1].toks, NULL, NULL};
    const uint64_t noval_id = 99;
    engine_fact f[N_SEQS][4];
    uint64_t ids[N_SEQS][4];
    for (int s = 0; s < N_SEQS; s++) {
        set_facts(e, s, false, f[s], ids[s]);
        if (s != 1) {
            engine_fact fr[4];
            uint64_t ir[4];
            set_facts(ref, s, false, fr, ir);
            assert_int_equal(engine_inject_ids(ref, sr[s], fr, ir, SET_LEN[s]), IS_OK);
        }
    }
    size_t n_before;
    void *before = read_all(e, se[1], &n_before);
    int32_t len1 = kv_seq_length(engine_kv(e), se[1]), mb0, me0;
    engine_seq_memory(e, se[1], &mb0, &me0);
    engine_inject_seq q[4] = {
        {se[0], f[0], ids[0], SET_LEN[0]},
        {se[1], big, NULL, reps},
        {extra, &novals, &noval_id, 1},
        {se[2], f[2], ids[2], SET_LEN[2]},
    };
    is_status res[4];
    assert_int_equal(engine_inject_batch(e, q, 4, res), IS_ERR_CONTEXT_FULL);
    assert_non_null(strstr(is_error_last(), "context"));
    assert_int_equal(res[0], IS_OK);
    assert_int_equal(res[1], IS_ERR_CONTEXT_FULL);
    assert_int_equal(res[2], IS_ERR_INVALID_ARG);
    assert_int_equal(res[3], IS_OK);
    /* The refused sequences: as they were. */
    assert_int_equal(kv_seq_length(engine_kv(e), se[1]), len1);
    int32_t mb, me;
    engine_seq_memory(e, se[1], &mb, &me);
    assert_int_equal(mb, mb0);
    assert_int_equal(me, me0);
    size_t n_after;
    void *after = read_all(e, se[1], &n_after);
    assert_int_equal(n_before, n_after);
    assert_memory_equal(before, after, n_before);
    assert_int_equal(kv_seq_length(engine_kv(e), extra), 0);
    engine_seq_memory(e, extra, &mb, &me);
    assert_int_equal(me - mb, 0);
    /* The others: as one at a time. */
    assert_same_seq(ref, sr[0], e, se[0], "refusals beside: sequence 0");
    assert_same_seq(ref, sr[2], e, se[2], "refusals beside: sequence 2");
    assert_true(kv_cache_check(engine_kv(e)));
    free(before);
    free(after);
    free(big);
    engine_free(ref);
    engine_free(e);
}

/* A backend failure inside the one call: every sequence as it was, each
 * with the failure; after recovery the same call injects them all. */
static void test_backend_failure_undoes_every_sequence(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    engine *e = make_engine(2048);
    int32_t se[N_SEQS], len[N_SEQS];
    open_seqs(e, se);
    engine_fact f[N_SEQS][4];
    uint64_t ids[N_SEQS][4];
    engine_inject_seq q[N_SEQS];
    for (int s = 0; s < N_SEQS; s++) {
        set_facts(e, s, false, f[s], ids[s]);
        q[s] = (engine_inject_seq){se[s], f[s], ids[s], SET_LEN[s]};
        len[s] = kv_seq_length(engine_kv(e), se[s]);
    }
    is_status res[N_SEQS];
    backend_fault_arm(g_be, 1, false); /* the inject op: the call's first op */
    is_status st = engine_inject_batch(e, q, N_SEQS, res);
    assert_int_not_equal(st, IS_OK);
    for (int s = 0; s < N_SEQS; s++) {
        assert_int_equal(res[s], st);
        assert_int_equal(kv_seq_length(engine_kv(e), se[s]), len[s]);
        int32_t mb, me;
        engine_seq_memory(e, se[s], &mb, &me);
        assert_int_equal(me - mb, 0);
    }
    assert_int_equal(engine_recover(e), IS_OK);
    backend_fault_arm(g_be, 0, false);
    assert_int_equal(engine_inject_batch(e, q, N_SEQS, res), IS_OK);
    for (int s = 0; s < N_SEQS; s++) assert_true(kv_seq_length(engine_kv(e), se[s]) > len[s]);
    assert_true(kv_cache_check(engine_kv(e)));
    engine_free(e);
}

static int setup(void **state) {
    (void)state;
    if (test_model_open(INJECT_BATCH_BACKEND, &g_be, &g_model, &g_mp) != 0) return -1;
    if (!g_model) return 0;
    engine *e = make_engine(1024);
    for (int i = 0; i < N_FACTS; i++) test_fact_encode(e, g_mp, test_locomo_facts[i], &g_enc[i]);
    engine_free(e);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    test_facts_free(g_enc, N_FACTS);
    return test_model_close(g_be, g_model, g_mp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_equals_one_by_one),
        cmocka_unit_test(test_refused_sequence_left_unchanged),
        cmocka_unit_test(test_backend_failure_undoes_every_sequence),
    };
#ifdef INJECT_BATCH_CUDA
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: the GPU tests are skipped\n");
        return 77;
    }
#endif
    return test_run_group(tests, setup, teardown);
}

/*
 * Backend failures reach the engine's caller (engine.h, "Backend
 * failures"), on the default model: one request's engine calls (fork of a
 * cached prefix, injection of two facts with cache ids, prefill of a
 * query with logits, one greedy decode step) are run once cleanly to count
 * their backend ops, then again with a fault aimed at each of many of
 * those ops (in each call its first op, its last op and a spread between).
 * Each time: the call that ran the op returns
 * the failure, its sequence is left as it was before the call, the
 * backend refuses work until engine_recover, and after recovery the same
 * request gives the clean run's logits and token again, so nothing a
 * failed op left behind (KV rows, a resident fact record, staged arrays)
 * is read as valid.
 *
 * Built twice: for the CPU backend (CI) and, as test_engine_fault_cuda
 * (label gpu, exit 77 without a device), for the CUDA backend with its
 * bf16 cache, where injection goes through the GPU fact arena.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/status.h"
#include "engine/engine.h"
#include "test_util.h"
#ifdef FAULT_CUDA
#include "backend_cuda.h"
#define FAULT_BACKEND "cuda"
#else
#define FAULT_BACKEND "cpu"
#endif

#define N_PREFIX 21 /* not a multiple of the block size: the fork copies a tail block */
#define N_SUFFIX 6
#define PER_CALL 6 /* faults aimed inside each call, besides its first and last op */

static backend *g_be;
static model *g_model;
static engine *g_e;
static int32_t g_prefix_seq;
static int32_t g_suffix[N_SUFFIX];
static float *g_fk[2], *g_fv[2];
static const int32_t g_flen[2] = {5, 7};
static const uint64_t g_fid[2] = {0x5eed0001, 0x5eed0002};
static int32_t g_vocab;

/* What one request produced. */
typedef struct outcome {
    is_status st;       /* first failure, or IS_OK */
    const char *at;     /* the call that failed */
    float *logits;      /* [n_vocab] of the query's last token */
    int32_t tok;        /* greedy token after it */
    int64_t ops_end[4]; /* backend_op_count after fork, inject, prefill, decode */
} outcome;

static int setup(void **state) {
    struct stat sb;
    if (stat(IS_DEFAULT_MODEL, &sb) != 0) return 0;
    if (backend_create(FAULT_BACKEND, 0, &g_be) != IS_OK) return -1;
#ifdef FAULT_CUDA
    if (backend_set_option(g_be, BACKEND_OPT_KV_COMPACT, 1) != IS_OK)
        return -1; /* the fact arena */
#endif
    if (model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK) return -1;
    const model_config *c = &g_model->cfg;
    g_vocab = c->n_vocab;
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.max_seqs = 3;
    ep.max_batch = 64;
    if (engine_create(g_model, ep, &g_e) != IS_OK) return -1;
    /* Token ids of plain text, so the forwards are the usual kind. */
    int32_t toks[N_PREFIX];
    for (int32_t i = 0; i < N_PREFIX; i++) toks[i] = 300 + 37 * i;
    for (int32_t i = 0; i < N_SUFFIX; i++) g_suffix[i] = 900 + 53 * i;
    if (engine_seq_open(g_e, &g_prefix_seq) != IS_OK) return -1;
    engine_batch b = {.n_tokens = N_PREFIX, .tokens = toks};
    int32_t *seqs = calloc(N_PREFIX, sizeof *seqs);
    for (int32_t i = 0; i < N_PREFIX; i++) seqs[i] = g_prefix_seq;
    b.seq = seqs;
    float *lg = malloc((size_t)g_vocab * sizeof *lg);
    is_status st = engine_decode(g_e, &b, lg);
    free(lg);
    free(seqs);
    if (st != IS_OK) return -1;
    /* Two facts' pre-RoPE keys and values: any values do (injection only
     * moves them), fixed so that every run injects the same. */
    size_t kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    uint32_t x = 12345;
    for (int f = 0; f < 2; f++) {
        size_t n = (size_t)c->n_layers * g_flen[f] * kv_dim;
        g_fk[f] = malloc(n * sizeof(float));
        g_fv[f] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            x = x * 1664525u + 1013904223u;
            g_fk[f][i] = ((float)(x >> 8) / 16777216.0f - 0.5f) * 2.0f;
            x = x * 1664525u + 1013904223u;
            g_fv[f][i] = ((float)(x >> 8) / 16777216.0f - 0.5f) * 0.5f;
        }
    }
    return 0;
}

static int teardown(void **state) {
    for (int f = 0; f < 2; f++) {
        free(g_fk[f]);
        free(g_fv[f]);
    }
    engine_free(g_e);
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

/* One request on a new sequence; stops at the first failing call, checks
 * that the call left its sequence as it found it, and closes it. */
static outcome run_request(float *logits) {
    outcome o = {.st = IS_OK, .at = NULL, .logits = logits, .tok = -1};
    int32_t d;
    assert_int_equal(engine_seq_open(g_e, &d), IS_OK);
    kv_cache *kv = engine_kv(g_e);
    int32_t len = 0;
    if ((o.st = engine_seq_fork(g_e, d, g_prefix_seq, N_PREFIX)) != IS_OK) {
        o.at = "fork";
        goto done;
    }
    o.ops_end[0] = backend_op_count(g_be);
    assert_int_equal(kv_seq_length(kv, d), N_PREFIX);
    len = N_PREFIX;
    engine_fact facts[2] = {{g_flen[0], NULL, g_fk[0], g_fv[0]},
                            {g_flen[1], NULL, g_fk[1], g_fv[1]}};
    if ((o.st = engine_inject_ids(g_e, d, facts, g_fid, 2)) != IS_OK) {
        o.at = "inject";
        goto done;
    }
    o.ops_end[1] = backend_op_count(g_be);
    len += g_flen[0] + g_flen[1];
    assert_int_equal(kv_seq_length(kv, d), len);
    int32_t seqs[N_SUFFIX];
    for (int32_t i = 0; i < N_SUFFIX; i++) seqs[i] = d;
    engine_batch b = {.n_tokens = N_SUFFIX, .tokens = g_suffix, .seq = seqs};
    if ((o.st = engine_decode(g_e, &b, logits)) != IS_OK) {
        o.at = "prefill";
        goto done;
    }
    o.ops_end[2] = backend_op_count(g_be);
    len += N_SUFFIX;
    int32_t next = 0;
    for (int32_t i = 1; i < g_vocab; i++)
        if (logits[i] > logits[next]) next = i;
    engine_batch b1 = {.n_tokens = 1, .tokens = &next, .seq = &d};
    if ((o.st = engine_decode_greedy(g_e, &b1, &o.tok)) != IS_OK) {
        o.at = "decode";
        goto done;
    }
    o.ops_end[3] = backend_op_count(g_be);
    len += 1;
done:
    /* A failed call leaves the sequence where it was before the call. */
    assert_int_equal(kv_seq_length(kv, d), len);
    engine_seq_close(g_e, d);
    assert_int_equal(kv_seq_length(kv, g_prefix_seq), N_PREFIX);
    return o;
}

static void expect_same(const outcome *a, const outcome *ref) {
    assert_int_equal(a->st, IS_OK);
    double err = test_rel_range_err(a->logits, ref->logits, g_vocab);
    if (err != 0.0 || a->tok != ref->tok)
        fprintf(stderr, "after recovery: logits %.3g of the clean run's range, token %d vs %d\n",
                err, a->tok, ref->tok);
    /* The same ops on the same inputs: the same bits, on either backend. */
    assert_true(err == 0.0);
    assert_int_equal(a->tok, ref->tok);
}

static void test_every_aimed_fault_reaches_the_caller(void **state) {
    SKIP_WITHOUT_MODEL();
    float *ref_lg = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    int64_t c0 = backend_op_count(g_be);
    outcome ref = run_request(ref_lg);
    assert_int_equal(ref.st, IS_OK);
    const int64_t n_ops = ref.ops_end[3] - c0;
    /* Ops (1-based, from the request's start) to fail: in each call its
     * first and last op (for a forward: the embedding lookup, and the
     * download or sync after every kernel ran) and a spread between. */
    int64_t aims[4 * (PER_CALL + 2)];
    int32_t n_aims = 0;
    for (int32_t call = 0; call < 4; call++) {
        int64_t first = (call ? ref.ops_end[call - 1] : c0) - c0 + 1, last = ref.ops_end[call] - c0;
        assert_true(last >= first); /* every call runs ops */
        aims[n_aims++] = first;
        for (int32_t i = 1; i <= PER_CALL; i++) {
            int64_t k = first + (last - first) * i / (PER_CALL + 1);
            if (k > aims[n_aims - 1] && k < last) aims[n_aims++] = k;
        }
        if (last > aims[n_aims - 1]) aims[n_aims++] = last;
    }
    int32_t n_aimed = 0, at_fork = 0, at_inject = 0, at_prefill = 0, at_decode = 0;
    for (int32_t a = 0; a < n_aims; a++) {
        const int64_t k = aims[a];
        backend_fault_arm(g_be, k, false);
        outcome o = run_request(lg);
        backend_fault_arm(g_be, 0, false);
        if (o.st == IS_OK)
            fprintf(stderr, "the fault at op %lld of %lld was not reported\n", (long long)k,
                    (long long)n_ops);
        assert_int_not_equal(o.st, IS_OK);
        assert_non_null(strstr(is_error_last(), "injected fault"));
        assert_int_not_equal(engine_status(g_e), IS_OK);
        /* Failed: every call refuses until recovery, and runs nothing. */
        int64_t before = backend_op_count(g_be);
        outcome refused = run_request(lg);
        assert_int_not_equal(refused.st, IS_OK);
        assert_string_equal(refused.at, "fork");
        assert_int_equal(backend_op_count(g_be), before);
        assert_int_equal(engine_recover(g_e), IS_OK);
        assert_int_equal(engine_status(g_e), IS_OK);
        outcome again = run_request(lg);
        expect_same(&again, &ref);
        n_aimed++;
        at_fork += strcmp(o.at, "fork") == 0;
        at_inject += strcmp(o.at, "inject") == 0;
        at_prefill += strcmp(o.at, "prefill") == 0;
        at_decode += strcmp(o.at, "decode") == 0;
    }
    printf("  %s: %lld ops a request; %d faults aimed, failed in fork %d, inject %d, prefill %d, "
           "decode %d; each recovered to the clean logits\n",
           FAULT_BACKEND, (long long)n_ops, n_aimed, at_fork, at_inject, at_prefill, at_decode);
    /* Every call of the request was hit at least once. */
    assert_true(at_fork > 0 && at_inject > 0 && at_prefill > 0 && at_decode > 0);
    free(ref_lg);
    free(lg);
}

static void test_stuck_failure_holds_until_released(void **state) {
    SKIP_WITHOUT_MODEL();
    float *ref_lg = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    outcome ref = run_request(ref_lg);
    assert_int_equal(ref.st, IS_OK);
    backend_fault_arm(g_be, 200, true); /* inside a forward on either backend */
    outcome o = run_request(lg);
    assert_int_not_equal(o.st, IS_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_not_equal(engine_recover(g_e), IS_OK);
        assert_int_not_equal(run_request(lg).st, IS_OK);
    }
    backend_fault_arm(g_be, 0, false);
    assert_int_equal(engine_recover(g_e), IS_OK);
    outcome again = run_request(lg);
    expect_same(&again, &ref);
    free(ref_lg);
    free(lg);
}

int main(void) {
#ifdef FAULT_CUDA
    /* Without a device (CI) the program reports itself skipped. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_aimed_fault_reaches_the_caller),
        cmocka_unit_test(test_stuck_failure_holds_until_released),
    };
    return test_run_group(tests, setup, teardown);
}

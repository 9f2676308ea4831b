/*
 * Batched fact encoding (serve/encoder.h, ask_encode_facts) on the default
 * model, CPU backend, f32 records: a fact encoded in a batch gives the
 * record it gets encoded alone. Bit for bit where the batch takes the same
 * product kernels as the fact alone (the CPU backend multiplies up to 32
 * rows with its quantised kernel, more with sgemm over dequantised
 * weights); within a tolerance where it does not, since the two sum in
 * another order. The facts of a batch are separate sequences, so any
 * attention across them would show as a difference far past either bound.
 * Then the memory path: facts stored without KV, encoded by encoder_run,
 * pass memory_check with every record required; a deleted fact is reported
 * as not found and leaves no record.
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
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "serve/encoder.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static engine *g_engine;
static char g_dir[] = "/tmp/test_encoder_XXXXXX";

#define N_FACTS 12

static const char *k_texts[N_FACTS] = {
    "Melanie plays the clarinet and started as a child.",
    "Caroline moved from Sweden four years ago.",
    "Caroline has a guinea pig named Oscar.",
    "Melanie is learning to bake sourdough bread.",
    "Caroline attended a pride parade in June.",
    "Melanie took her kids camping at the lake last summer.",
    "Caroline is researching adoption agencies.",
    "Melanie painted a sunrise over the water.",
    "Caroline's friends gave her a necklace from her grandmother.",
    "Melanie ran a charity race for mental health.",
    "Caroline wants to work as a counselor for transgender youth.",
    "Melanie's favourite book is Charlotte's Web.",
};
static const char *k_turns[] = {
    "Caroline: Hey Mel! Good to see you again.",
    "Melanie: Hi Caroline, it has been a busy week with the kids.",
    "Caroline: I went to a support group yesterday and it was powerful.",
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int setup(void **state) {
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    if (!mkdtemp(g_dir)) return -1;
    engine_params ep = engine_default_params();
    ep.max_seqs = N_FACTS + 4;
    ep.n_ctx = 2048;
    if (backend_cpu_create(0, &g_be) != IS_OK ||
        model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK ||
        engine_create(g_model, ep, &g_engine) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    engine_free(g_engine);
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    if (g_model && test_remove_tree(g_dir) != 0) return -1;
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

/* A record store and ask context in a sub-directory of g_dir. */
static void open_ctx(const char *name, record_store **rs, ask_ctx **a) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    assert_int_equal(record_store_open(dir, 64 << 20, rs), IS_OK);
    assert_int_equal(ask_ctx_create(g_engine, *rs, KV_DTYPE_F32, a), IS_OK);
}

/* Fact i: its id, its text, and 0-3 context turns with window 0, 2 or -1. */
static void make_facts(ask_fact *f, int32_t *w, char ids[][16]) {
    for (int i = 0; i < N_FACTS; i++) {
        snprintf(ids[i], 16, "fact-%02d", i);
        f[i] = (ask_fact){ids[i], k_texts[i], k_turns, i % 4};
        w[i] = i % 5 == 4 ? -1 : (i % 3 == 0 ? 0 : 2);
    }
}

/* Largest |a - b| over the record's keys and values, and largest |a|. */
static void record_diff(record_store *ra, record_store *rb, const char *id, double *diff,
                        double *scale, bool *same_bits) {
    const fact_kv *a, *b;
    assert_int_equal(record_store_get(ra, id, NULL, &a), IS_OK);
    assert_int_equal(record_store_get(rb, id, NULL, &b), IS_OK);
    assert_int_equal(a->meta.n_tokens, b->meta.n_tokens);
    assert_int_equal(a->meta.window, b->meta.window);
    assert_true(a->meta.text_hash == b->meta.text_hash);
    assert_memory_equal(a->tokens, b->tokens, (size_t)a->meta.n_tokens * sizeof(int32_t));
    size_t n = (size_t)a->meta.n_layers * a->meta.n_tokens * a->meta.n_kv_heads * a->meta.head_dim;
    *same_bits = memcmp(a->k, b->k, n * 4) == 0 && memcmp(a->v, b->v, n * 4) == 0;
    for (int part = 0; part < 2; part++) {
        const float *x = part ? a->v : a->k, *y = part ? b->v : b->k;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)x[i] - y[i]);
            if (d > *diff) *diff = d;
            if (fabs(x[i]) > *scale) *scale = fabs(x[i]);
        }
    }
    record_store_release(ra, a);
    record_store_release(rb, b);
}

/* The reference: each fact alone (ask_encode_fact, one forward each). */
static void encode_alone(ask_ctx *a, const ask_fact *f, const int32_t *w, double *ms) {
    double t0 = now_ms();
    for (int i = 0; i < N_FACTS; i++) {
        bool did;
        assert_int_equal(ask_encode_fact(a, &f[i], w[i], &did), IS_OK);
        assert_true(did);
    }
    *ms = now_ms() - t0;
}

static void test_batch_equals_alone(void **state) {
    SKIP_WITHOUT_MODEL();
    ask_fact f[N_FACTS];
    int32_t w[N_FACTS];
    char ids[N_FACTS][16];
    make_facts(f, w, ids);
    record_store *ra, *rb, *rc;
    ask_ctx *aa, *ab, *ac;
    open_ctx("alone", &ra, &aa);
    open_ctx("batch", &rb, &ab);
    open_ctx("pairs", &rc, &ac);
    double t_alone, t0 = now_ms();
    encode_alone(aa, f, w, &t_alone);

    /* All twelve in one forward (past 32 rows: sgemm, another summation order). */
    is_status st[N_FACTS];
    bool did[N_FACTS];
    t0 = now_ms();
    assert_int_equal(ask_encode_facts(ab, f, w, N_FACTS, 0, st, did), IS_OK);
    double t_batch = now_ms() - t0;
    for (int i = 0; i < N_FACTS; i++) {
        assert_int_equal(st[i], IS_OK);
        assert_true(did[i]);
    }
    /* Groups of at most 32 tokens: facts two by two where they fit, so the
     * products take the same kernel as alone. */
    assert_int_equal(ask_encode_facts(ac, f, w, N_FACTS, 32, st, did), IS_OK);

    double worst = 0, worst_pairs = 0;
    int n_bits = 0;
    for (int i = 0; i < N_FACTS; i++) {
        double d = 0, sc = 0;
        bool bits;
        record_diff(ra, rb, ids[i], &d, &sc, &bits);
        if (d / sc > worst) worst = d / sc;
        d = 0, sc = 0;
        record_diff(ra, rc, ids[i], &d, &sc, &bits);
        if (d / sc > worst_pairs) worst_pairs = d / sc;
        n_bits += bits;
    }
    printf("  alone %.0f ms, one batch %.0f ms (%.1fx); max |diff| / max |kv|: batch %.2e, "
           "groups of <= 32 tokens %.2e (%d of %d records bit for bit)\n",
           t_alone, t_batch, t_alone / t_batch, worst, worst_pairs, n_bits, N_FACTS);
    /* f32 through 30 layers, products summed in another order: measured
     * differences are around 1e-6 of the largest value; 1e-4 is the
     * exactness bound of DESIGN.md, and attention leaking between facts
     * moves values by far more (their own scale). */
    assert_true(worst < 1e-4);
    assert_true(worst_pairs < 1e-4);
    /* Groups under 32 tokens take the kernels of a fact alone. */
    assert_int_equal(n_bits, N_FACTS);

    /* Stored already: nothing encoded again. */
    assert_int_equal(ask_encode_facts(ab, f, w, N_FACTS, 0, st, did), IS_OK);
    for (int i = 0; i < N_FACTS; i++) assert_false(did[i]);
    ask_ctx_free(aa), ask_ctx_free(ab), ask_ctx_free(ac);
    record_store_close(ra), record_store_close(rb), record_store_close(rc);
}

/* A bad id fails alone; the rest of its batch is written. */
static void test_bad_fact_alone_fails(void **state) {
    SKIP_WITHOUT_MODEL();
    record_store *rs;
    ask_ctx *a;
    open_ctx("bad", &rs, &a);
    ask_fact f[3] = {{"ok-1", k_texts[0], NULL, 0},
                     {"bad/id", k_texts[1], NULL, 0},
                     {"ok-2", k_texts[2], NULL, 0}};
    int32_t w[3] = {0, 0, 0};
    is_status st[3];
    bool did[3];
    assert_int_equal(ask_encode_facts(a, f, w, 3, 0, st, did), IS_ERR_INVALID_ARG);
    assert_int_equal(st[0], IS_OK);
    assert_int_equal(st[1], IS_ERR_INVALID_ARG);
    assert_int_equal(st[2], IS_OK);
    assert_true(did[0] && !did[1] && did[2]);
    assert_true(record_store_contains(rs, "ok-1") && record_store_contains(rs, "ok-2"));
    ask_ctx_free(a);
    record_store_close(rs);
}

/* Fails the n-th create of a record file (counting from 1). */
static bool fail_nth_create(record_store_step step, void *ud) {
    int *left = ud;
    return step != RECORD_STORE_STEP_CREATE || --*left != 0;
}

/* Groups' writes run beside the next group's forward: a group whose write
 * fails fails alone (every fact of it, with the store's message), the
 * groups after it are still encoded and written, and each written record
 * is bit for bit the fact's record encoded alone (groups of at most 32
 * tokens take the kernels of a fact alone, as test_batch_equals_alone
 * shows). */
static void test_failed_group_write(void **state) {
    SKIP_WITHOUT_MODEL();
    ask_fact f[N_FACTS];
    int32_t w[N_FACTS];
    char ids[N_FACTS][16];
    make_facts(f, w, ids);
    record_store *rs, *ra;
    ask_ctx *a, *aa;
    open_ctx("failed-write", &rs, &a);
    open_ctx("failed-write-ref", &ra, &aa);
    double t;
    encode_alone(aa, f, w, &t);
    int left = 5; /* the fifth fact's file: a group after the first */
    record_store_set_fault_hook(rs, fail_nth_create, &left);
    is_status st[N_FACTS];
    bool did[N_FACTS];
    is_error_clear();
    assert_int_equal(ask_encode_facts(a, f, w, N_FACTS, 32, st, did), IS_ERR_IO);
    assert_true(strlen(is_error_last()) > 0);
    record_store_set_fault_hook(rs, NULL, NULL);
    int first_bad = -1, last_bad = -1;
    for (int i = 0; i < N_FACTS; i++) {
        if (st[i] == IS_OK) {
            assert_true(did[i]);
            double d = 0, sc = 0;
            bool bits;
            record_diff(ra, rs, ids[i], &d, &sc, &bits);
            assert_true(bits);
            continue;
        }
        assert_int_equal(st[i], IS_ERR_IO);
        assert_false(did[i]);
        assert_false(record_store_contains(rs, ids[i]));
        if (first_bad < 0) first_bad = i;
        last_bad = i;
    }
    /* One group failed: the fifth fact's, its facts side by side. */
    assert_true(first_bad >= 1 && first_bad <= 4 && last_bad >= 4);
    for (int i = first_bad; i <= last_bad; i++) assert_int_equal(st[i], IS_ERR_IO);
    assert_true(last_bad < N_FACTS - 1);
    printf("  facts %d-%d failed with their group's write; the other %d written\n", first_bad,
           last_bad, N_FACTS - (last_bad - first_bad + 1));
    ask_ctx_free(a), ask_ctx_free(aa);
    record_store_close(rs), record_store_close(ra);
}

/* The memory path: facts stored without KV, then encoded in one batch. */
static void test_memory_encode_batch(void **state) {
    SKIP_WITHOUT_MODEL();
    char dir[256];
    snprintf(dir, sizeof dir, "%s/mem", g_dir);
    memory_params mp = memory_default_params();
    memory *m;
    assert_int_equal(memory_open(dir, &mp, &m, NULL), IS_OK);
    ask_ctx *a;
    assert_int_equal(ask_ctx_create(g_engine, memory_record_store(m), KV_DTYPE_F32, &a), IS_OK);
    memory_add_req r[N_FACTS];
    char ids[N_FACTS][MEMORY_ID_SIZE];
    for (int i = 0; i < N_FACTS; i++)
        r[i] = (memory_add_req){.tenant = "t",
                                .user = i % 2 ? "caroline" : "melanie",
                                .text = k_texts[i],
                                .context = k_turns,
                                .n_context = i % 4,
                                .window = i % 3 == 0 ? 0 : 2};
    assert_int_equal(memory_add_batch(m, r, N_FACTS, ids, NULL), IS_OK);
    assert_int_equal(memory_check(m, false), IS_OK);
    assert_int_not_equal(memory_check(m, true), IS_OK); /* no KV yet */

    /* One fact deleted after it was queued: reported, no record left. */
    assert_int_equal(memory_delete(m, "t", "melanie", ids[4]), IS_OK);
    memory_fact_ref refs[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) {
        memset(&refs[i], 0, sizeof refs[i]);
        memcpy(refs[i].id, ids[i], sizeof refs[i].id);
        refs[i].tenant = (char *)"t";
        refs[i].user = (char *)r[i].user;
    }
    encoder_params ep = {a, 0};
    is_status st[N_FACTS];
    bool did[N_FACTS];
    assert_int_equal(encoder_run(m, &ep, refs, N_FACTS, st, did), IS_OK);
    for (int i = 0; i < N_FACTS; i++) {
        assert_int_equal(st[i], i == 4 ? IS_ERR_NOT_FOUND : IS_OK);
        assert_int_equal(did[i], i != 4);
    }
    assert_int_equal(memory_check(m, true), IS_OK);
    /* Encoded already: nothing to do. */
    assert_int_equal(encoder_run(m, &ep, refs, N_FACTS, st, did), IS_OK);
    for (int i = 0; i < N_FACTS; i++) assert_false(did[i]);
    ask_ctx_free(a);
    memory_close(m);
}

/* KV on demand (encoder_run_for_request): the facts a request found
 * without KV are encoded and each gets the record its row names; a fact
 * deleted meanwhile, or whose row's text is no longer the request's, gets
 * none; a second call finds the records there and encodes nothing. */
static void test_run_for_request(void **state) {
    SKIP_WITHOUT_MODEL();
    char dir[256];
    snprintf(dir, sizeof dir, "%s/demand", g_dir);
    memory_params mp = memory_default_params();
    memory *m;
    assert_int_equal(memory_open(dir, &mp, &m, NULL), IS_OK);
    ask_ctx *a;
    assert_int_equal(ask_ctx_create(g_engine, memory_record_store(m), KV_DTYPE_F32, &a), IS_OK);
    enum { N = 4 };
    memory_add_req r[N];
    char ids[N][MEMORY_ID_SIZE];
    for (int i = 0; i < N; i++)
        r[i] = (memory_add_req){
            .tenant = "t", .user = "melanie", .text = k_texts[i], .window = MEMORY_WINDOW_DEFAULT};
    assert_int_equal(memory_add_batch(m, r, N, ids, NULL), IS_OK);
    assert_int_equal(memory_delete(m, "t", "melanie", ids[1]), IS_OK);
    memory_fact_ref refs[N];
    uint64_t hash[N];
    for (int i = 0; i < N; i++) {
        refs[i] = (memory_fact_ref){.tenant = (char *)"t", .user = (char *)"melanie"};
        memcpy(refs[i].id, ids[i], sizeof refs[i].id);
        /* Fact 2 as a request that read an older text would see it. */
        const char *t = i == 2 ? "an older text" : k_texts[i];
        hash[i] = fact_text_hash(t, strlen(t));
    }
    encoder_params ep = {a, 0};
    char *rec[N];
    bool did[N];
    int64_t failed = -1;
    encoder_run_for_request(m, &ep, refs, hash, N, rec, did, &failed);
    assert_int_equal(failed, 0);
    for (int i = 0; i < N; i++) {
        bool usable = i == 0 || i == 3;
        assert_int_equal(rec[i] != NULL, usable);
        assert_int_equal(did[i], usable);
        if (!usable) continue;
        mem_fact f;
        assert_int_equal(memory_get(m, "t", "melanie", ids[i], &f), IS_OK);
        assert_string_equal(rec[i], f.kv_record);
        assert_true(record_store_contains(memory_record_store(m), rec[i]));
        mem_fact_clear(&f);
    }
    for (int i = 0; i < N; i++) free(rec[i]);
    /* The records are there now: named, nothing encoded. */
    encoder_run_for_request(m, &ep, refs, hash, N, rec, did, NULL);
    for (int i = 0; i < N; i++) {
        assert_int_equal(rec[i] != NULL, i == 0 || i == 3);
        assert_false(did[i]);
        free(rec[i]);
    }
    assert_int_equal(memory_check(m, true), IS_OK);
    ask_ctx_free(a);
    memory_close(m);
}

/* Sleeps at the first write of every put (the hook is asked in the thread
 * that writes): a group's writes then start only after the next group's
 * forward and narrowing, which run into the other set of sections. */
static bool slow_first_write(record_store_step step, void *ud) {
    record_store_step *prev = ud;
    if (step == RECORD_STORE_STEP_WRITE && *prev != RECORD_STORE_STEP_WRITE) usleep(1500 * 1000);
    *prev = step;
    return true;
}

/* Writes beside the next forward: a group's sections stay untouched until
 * its writes are done, however late they start. Each record is bit for bit
 * the fact encoded alone (a section overwritten by the next group would
 * also fail the record's checksum, taken before the write). */
static void test_writes_beside_next_forward(void **state) {
    SKIP_WITHOUT_MODEL();
    enum { N = 6 };
    ask_fact f[N_FACTS];
    int32_t w[N_FACTS];
    char ids[N_FACTS][16];
    make_facts(f, w, ids);
    record_store *rs, *ra;
    ask_ctx *a, *aa;
    open_ctx("overlap", &rs, &a);
    open_ctx("overlap-ref", &ra, &aa);
    for (int i = 0; i < N; i++) {
        bool did;
        assert_int_equal(ask_encode_fact(aa, &f[i], w[i], &did), IS_OK);
    }
    record_store_step prev = RECORD_STORE_STEP_COUNT_;
    record_store_set_fault_hook(rs, slow_first_write, &prev);
    is_status st[N];
    bool did[N];
    assert_int_equal(ask_encode_facts(a, f, w, N, 32, st, did), IS_OK);
    record_store_set_fault_hook(rs, NULL, NULL);
    assert_true(ask_ctx_encode_stats(a).n_forwards >= 2);
    for (int i = 0; i < N; i++) {
        assert_int_equal(st[i], IS_OK);
        assert_true(did[i]);
        double d = 0, sc = 0;
        bool bits;
        record_diff(ra, rs, ids[i], &d, &sc, &bits);
        assert_true(bits);
    }
    ask_ctx_free(a), ask_ctx_free(aa);
    record_store_close(rs), record_store_close(ra);
}

/* A memory in g_dir/name with the first n of k_texts stored for tenant t,
 * user u (no KV yet; their ids in ids), and an f32 ask context on its
 * records (*a). */
static memory *stored_facts(const char *name, int n, char (*ids)[MEMORY_ID_SIZE], ask_ctx **a) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    memory_params mp = memory_default_params();
    memory *m;
    assert_int_equal(memory_open(dir, &mp, &m, NULL), IS_OK);
    assert_int_equal(ask_ctx_create(g_engine, memory_record_store(m), KV_DTYPE_F32, a), IS_OK);
    memory_add_req r[N_FACTS];
    assert_true(n <= N_FACTS);
    for (int i = 0; i < n; i++)
        r[i] = (memory_add_req){.tenant = "t", .user = "u", .text = k_texts[i], .window = 0};
    assert_int_equal(memory_add_batch(m, r, n, ids, NULL), IS_OK);
    return m;
}

/* The key of fact id of tenant t, user u. */
static memory_fact_ref ref_of(const char id[MEMORY_ID_SIZE]) {
    memory_fact_ref ref = {.tenant = (char *)"t", .user = (char *)"u"};
    memcpy(ref.id, id, sizeof ref.id);
    return ref;
}

/* One fact queued twice in one batch (an add's job and an update's, or a
 * scan's), the copies in different forwards, the later copy's write
 * failing: whatever the copies report, a row that names a record has it,
 * and a fact reported encoded has its record. */
static void test_duplicate_refs(void **state) {
    SKIP_WITHOUT_MODEL();
    enum { N = 3, NR = 4 };
    char ids[N][MEMORY_ID_SIZE];
    ask_ctx *a;
    memory *m = stored_facts("dups", N, ids, &a);
    record_store *rs = memory_record_store(m);
    const int which[NR] = {0, 1, 2, 0}; /* fact 0 first and last */
    memory_fact_ref refs[NR];
    for (int j = 0; j < NR; j++) refs[j] = ref_of(ids[which[j]]);
    /* One fact a forward (at least one goes in each): fact 0's second copy
     * is the fourth record file created. */
    encoder_params ep = {a, 1};
    int left = 4;
    record_store_set_fault_hook(rs, fail_nth_create, &left);
    is_status st[NR];
    bool did[NR];
    encoder_run(m, &ep, refs, NR, st, did);
    record_store_set_fault_hook(rs, NULL, NULL);
    for (int j = 0; j < NR; j++) {
        mem_fact row;
        assert_int_equal(memory_get(m, "t", "u", refs[j].id, &row), IS_OK);
        if (did[j]) assert_non_null(row.kv_record);
        if (row.kv_record && !record_store_contains(rs, row.kv_record))
            fail_msg("ref %d (fact %d, reported %s, encoded %d): its row names %s, which is gone",
                     j, which[j], is_status_to_string(st[j]), did[j], row.kv_record);
        mem_fact_clear(&row);
    }
    assert_int_equal(memory_check(m, true), IS_OK);
    ask_ctx_free(a);
    memory_close(m);
}

/* The batch encoder, then (the writer lock is not held during the forward
 * and the writes) fact 0 deleted, fact 1's text updated and fact 2's
 * metadata updated, as HTTP requests would meanwhile. */
typedef struct change_during {
    encoder_params ep;
    memory *m;
    char (*ids)[MEMORY_ID_SIZE];
} change_during;

static is_status encode_then_change(void *ud, record_store *store, const memory_encode_job *jobs,
                                    int32_t n, is_status *status) {
    change_during *c = ud;
    is_status st = encoder_batch_fn(&c->ep, store, jobs, n, status);
    for (int32_t j = 0; j < n; j++) assert_true(record_store_contains(store, jobs[j].record_id));
    assert_int_equal(memory_delete(c->m, "t", "u", c->ids[0]), IS_OK);
    assert_int_equal(memory_update(c->m, "t", "u", c->ids[1], "A text of later.", NULL), IS_OK);
    assert_int_equal(memory_update(c->m, "t", "u", c->ids[2], NULL, "{\"k\":\"v\"}"), IS_OK);
    return st;
}

/* Facts deleted or updated while their records are written: a deleted
 * fact and one whose text changed get no record, and none is left that no
 * row names; one whose metadata alone changed keeps its record (nothing
 * queues it again: a metadata update does not). */
static void test_changed_while_encoded(void **state) {
    SKIP_WITHOUT_MODEL();
    enum { N = 4 };
    char ids[N][MEMORY_ID_SIZE];
    ask_ctx *a;
    memory *m = stored_facts("changed", N, ids, &a);
    record_store *rs = memory_record_store(m);
    memory_fact_ref refs[N];
    for (int i = 0; i < N; i++) refs[i] = ref_of(ids[i]);
    change_during c = {{a, 1}, m, ids};
    is_status st[N];
    bool did[N];
    memory_encode_batch(m, refs, N, encode_then_change, &c, st, did);
    for (int i = 0; i < N; i++) {
        assert_int_equal(st[i], i < 2 ? IS_ERR_NOT_FOUND : IS_OK);
        assert_int_equal(did[i], i >= 2);
        char rid[80];
        snprintf(rid, sizeof rid, "%s-v1", ids[i]);
        assert_int_equal(record_store_contains(rs, rid), i >= 2);
    }
    /* The rows as the changes left them: fact 1 without KV yet. */
    assert_int_equal(memory_check(m, false), IS_OK);
    for (int i = 1; i < N; i++) {
        mem_fact row;
        assert_int_equal(memory_get(m, "t", "u", ids[i], &row), IS_OK);
        assert_int_equal(row.kv_record != NULL, i >= 2);
        if (i == 2) assert_int_equal(row.version, 2);
        mem_fact_clear(&row);
    }
    ask_ctx_free(a);
    memory_close(m);
}

/* A disk cap smaller than one call's records: a record written by one
 * forward's group commit must not be evicted by the next group's before
 * the row is pointed to it (the fact would be reported encoded, its row
 * naming a record that is gone). */
static void test_disk_cap_within_a_batch(void **state) {
    SKIP_WITHOUT_MODEL();
    enum { N = 3 };
    char ids[N][MEMORY_ID_SIZE];
    ask_ctx *a;
    memory *m = stored_facts("capped", N, ids, &a);
    record_store *rs = memory_record_store(m);
    assert_int_equal(record_store_set_disk_cap(rs, 1), IS_OK);
    memory_fact_ref refs[N];
    for (int i = 0; i < N; i++) refs[i] = ref_of(ids[i]);
    encoder_params ep = {a, 1}; /* one fact a forward: three group commits */
    is_status st[N];
    bool did[N];
    assert_int_equal(encoder_run(m, &ep, refs, N, st, did), IS_OK);
    for (int i = 0; i < N; i++) {
        assert_true(did[i]);
        mem_fact row;
        assert_int_equal(memory_get(m, "t", "u", ids[i], &row), IS_OK);
        assert_non_null(row.kv_record);
        if (!record_store_contains(rs, row.kv_record))
            fail_msg("fact %d reported encoded; its record %s is gone", i, row.kv_record);
        mem_fact_clear(&row);
    }
    ask_ctx_free(a);
    memory_close(m);
}

/* Records made in another dtype (the same data directory under
 * `--kv-dtype` bf16 after f32) are missing to an ask context of the new
 * one: encode_missing lists and encodes them again, in the new dtype, once. */
static void test_other_dtype_is_missing(void **state) {
    SKIP_WITHOUT_MODEL();
    enum { N = 3 };
    char ids[N][MEMORY_ID_SIZE];
    ask_ctx *a;
    memory *m = stored_facts("redtype", N, ids, &a);
    encoder_params ep = {a, 0};
    int64_t n_enc = 0;
    assert_int_equal(encoder_encode_missing(m, &ep, 0, NULL, NULL, &n_enc), IS_OK);
    assert_int_equal(n_enc, N);
    ask_ctx_free(a);
    record_store *rs = memory_record_store(m);
    assert_int_equal(ask_ctx_create(g_engine, rs, KV_DTYPE_BF16, &a), IS_OK);
    memory_fact_ref *missing = NULL;
    int64_t n_missing = 0;
    assert_int_equal(memory_list_missing(m, &missing, &n_missing), IS_OK);
    memory_fact_refs_free(missing, n_missing);
    assert_int_equal(n_missing, N);
    ep.ask = a;
    for (int pass = 0; pass < 2; pass++) {
        assert_int_equal(encoder_encode_missing(m, &ep, 0, NULL, NULL, &n_enc), IS_OK);
        assert_int_equal(n_enc, pass == 0 ? N : 0);
    }
    for (int i = 0; i < N; i++) {
        mem_fact row;
        assert_int_equal(memory_get(m, "t", "u", ids[i], &row), IS_OK);
        const fact_kv *kv = NULL;
        assert_int_equal(record_store_get(rs, row.kv_record, NULL, &kv), IS_OK);
        assert_int_equal(kv->meta.dtype, KV_DTYPE_BF16);
        record_store_release(rs, kv);
        mem_fact_clear(&row);
    }
    ask_ctx_free(a);
    memory_close(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_equals_alone),
        cmocka_unit_test(test_bad_fact_alone_fails),
        cmocka_unit_test(test_failed_group_write),
        cmocka_unit_test(test_memory_encode_batch),
        cmocka_unit_test(test_run_for_request),
        cmocka_unit_test(test_writes_beside_next_forward),
        cmocka_unit_test(test_duplicate_refs),
        cmocka_unit_test(test_changed_while_encoded),
        cmocka_unit_test(test_disk_cap_within_a_batch),
        cmocka_unit_test(test_other_dtype_is_missing),
    };
    return test_run_group(tests, setup, teardown);
}

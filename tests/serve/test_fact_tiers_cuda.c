/* Fact-KV tiers on the GPU (label gpu; exits 77 without a CUDA device or
 * the model): a fact that misses the GPU fact cache and comes through the
 * host tier (its record file read into pinned memory, copied at the
 * injection into a staging buffer by the copy engine, layer group by layer
 * group, each group scattered into the arena and injected just before the
 * query's forward reaches its layers; no values on the host) gives bit for
 * bit the logits of the same fact injected the way the arena was filled
 * before (values widened to f32 on the host and
 * narrowed to bf16 on the device), and of the same fact resident. Bitwise,
 * because both paths must put the same bf16 bits in the arena: a bf16
 * record's values are bf16 already (widening to f32 and rounding back is
 * exact), an f16 record's are rounded once from the same f16 value either
 * way; injection and the forward are then the same kernels on the same
 * inputs. Also: a fact whose arena pages another fact's copy reuses while
 * the first one's request is still queued keeps its request's logits; an
 * op other than the forward's between the injection and the query lands
 * the rest at once; a queue larger than the staging goes in parts; a
 * queued copy whose pin is dropped never reads its host memory, and a pin
 * through other memory holding the same contents is refused while it is
 * queued; a fork before the query copies landed rows; records overwritten
 * once host_wait returns leave the request's logits as they were; pins, a
 * resident record's too, refuse past half the cache.
 *
 * The model: $IS_TEST_MODEL, else the default model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend_cuda.h"
#include "core/status.h"
#include "engine/engine.h"
#include "kv/host_tier.h"
#include "kv/record_store.h"
#include "model/model.h"
#include "test_util.h"

#define N_PREFIX 21
#define N_QUERY  6
#define N_FACTS  4

static backend *g_be;
static model *g_model;
static engine *g_e;
static int32_t g_prefix_seq, g_vocab, g_kv_dim, g_layers;
static int32_t g_query[N_QUERY];
static const int32_t g_len[N_FACTS] = {5, 9, 7, 12};
static char g_dir[64];
static record_store *g_rs;
static host_tier *g_ht;

static is_status t_alloc(void *ud, size_t bytes, void **out) {
    return engine_host_alloc(ud, bytes, out);
}
static void t_free(void *ud, void *p) { engine_host_free(ud, p); }
static void t_quiesce(void *ud) { engine_host_wait(ud); }

static const char *model_path(void) {
    const char *m = getenv("IS_TEST_MODEL");
    return m && *m ? m : IS_DEFAULT_MODEL;
}

/* Fact f's record in `dtype` under id "<dtype>_<f>": values any (injection
 * only moves them), fixed by f so every run injects the same. */
static void put_fact(int f, kv_dtype dtype) {
    fact_kv_meta meta;
    fact_meta_for_model(g_model, dtype, &meta);
    meta.n_tokens = g_len[f];
    meta.text_hash = 1000 + (uint64_t)f;
    size_t n = (size_t)g_layers * g_len[f] * g_kv_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    uint16_t *k16 = malloc(n * 2), *v16 = malloc(n * 2);
    int32_t *toks = malloc((size_t)g_len[f] * sizeof *toks);
    assert_true(k && v && k16 && v16 && toks);
    uint32_t x = 777u + 31u * (uint32_t)f;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        k[i] = ((float)(x >> 8) / 16777216.0f - 0.5f) * 4.0f;
        x = x * 1664525u + 1013904223u;
        v[i] = ((float)(x >> 8) / 16777216.0f - 0.5f) * 0.5f;
    }
    for (int32_t i = 0; i < g_len[f]; i++) toks[i] = 400 + 11 * i + f;
    fact_kv_from_f32(dtype, k, k16, n);
    fact_kv_from_f32(dtype, v, v16, n);
    char id[32];
    snprintf(id, sizeof id, "%s_%d", kv_dtype_name(dtype), f);
    assert_int_equal(record_store_put(g_rs, id, &meta, toks, k16, v16), IS_OK);
    free(k);
    free(v);
    free(k16);
    free(v16);
    free(toks);
}

static int setup(void **state) {
    (void)state;
    struct stat sb;
    if (stat(model_path(), &sb) != 0) return 0;
    if (backend_create("cuda", 0, &g_be) != IS_OK) return -1;
    if (backend_cuda_configure(g_be, "kv=bf16") != IS_OK)
        fail_msg("kv=bf16: %s", is_error_last()); /* the serving configuration: the fact arena */
    if (model_load(model_path(), g_be, &g_model) != IS_OK) return -1;
    const model_config *c = &g_model->cfg;
    g_vocab = c->n_vocab;
    g_layers = c->n_layers;
    g_kv_dim = c->n_kv_heads * c->head_dim;
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.max_seqs = 4;
    ep.max_batch = 64;
    if (engine_create(g_model, ep, &g_e) != IS_OK) return -1;
    if (!engine_host_tier(g_e)) return -1;
    int32_t toks[N_PREFIX];
    for (int32_t i = 0; i < N_PREFIX; i++) toks[i] = 300 + 37 * i;
    for (int32_t i = 0; i < N_QUERY; i++) g_query[i] = 900 + 53 * i;
    if (engine_seq_open(g_e, &g_prefix_seq) != IS_OK) return -1;
    int32_t seqs[N_PREFIX];
    for (int32_t i = 0; i < N_PREFIX; i++) seqs[i] = g_prefix_seq;
    engine_batch b = {.n_tokens = N_PREFIX, .tokens = toks, .seq = seqs};
    float *lg = malloc((size_t)g_vocab * sizeof *lg);
    is_status st = engine_decode(g_e, &b, lg);
    free(lg);
    if (st != IS_OK) return -1;
    snprintf(g_dir, sizeof g_dir, "/tmp/test_fact_tiers.XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    if (record_store_open(g_dir, 0, &g_rs) != IS_OK) return -1;
    for (int f = 0; f < N_FACTS; f++) {
        put_fact(f, KV_DTYPE_BF16);
        put_fact(f, KV_DTYPE_F16);
    }
    host_tier_alloc al = {.alloc = t_alloc, .free = t_free, .quiesce = t_quiesce, .ud = g_e};
    if (host_tier_create(g_rs, (size_t)64 << 20, al, &g_ht) != IS_OK) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    host_tier_free(g_ht);
    record_store_close(g_rs);
    if (g_dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
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

/* The host tier's view of fact f in dtype. */
static const fact_kv *tier_get(int f, kv_dtype dtype) {
    char id[32];
    snprintf(id, sizeof id, "%s_%d", kv_dtype_name(dtype), f);
    fact_kv_meta want;
    fact_meta_for_model(g_model, dtype, &want);
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(g_ht, id, &want, &kv, NULL), IS_OK);
    return kv;
}

/* A sequence forked from the prefix with facts fs[0..n) injected: from
 * f32 host values (widened = true: the path without the host tier) or
 * with none (the backend holds them). Returns the sequence. */
static int32_t start(const int *fs, int n, kv_dtype dtype, bool widened) {
    int32_t d;
    assert_int_equal(engine_seq_open(g_e, &d), IS_OK);
    assert_int_equal(engine_seq_fork(g_e, d, g_prefix_seq, N_PREFIX), IS_OK);
    engine_fact facts[N_FACTS];
    uint64_t ids[N_FACTS];
    float *bufs[N_FACTS] = {0};
    const fact_kv *kvs[N_FACTS];
    for (int i = 0; i < n; i++) {
        kvs[i] = tier_get(fs[i], dtype);
        ids[i] = kvs[i]->content_id;
        facts[i] = (engine_fact){.n_tokens = kvs[i]->meta.n_tokens};
        if (widened) {
            size_t ne = (size_t)g_layers * facts[i].n_tokens * g_kv_dim;
            bufs[i] = malloc(2 * ne * sizeof(float));
            assert_non_null(bufs[i]);
            fact_kv_to_f32(dtype, kvs[i]->k, bufs[i], ne);
            fact_kv_to_f32(dtype, kvs[i]->v, bufs[i] + ne, ne);
            facts[i].k = bufs[i];
            facts[i].v = bufs[i] + ne;
        } else {
            assert_true(engine_fact_resident(g_e, ids[i], facts[i].n_tokens));
        }
    }
    assert_int_equal(engine_inject_ids(g_e, d, facts, ids, n), IS_OK);
    for (int i = 0; i < n; i++) {
        free(bufs[i]);
        host_tier_release(g_ht, kvs[i]);
    }
    return d;
}

static void finish(int32_t d, float *logits) {
    int32_t seqs[N_QUERY];
    for (int32_t i = 0; i < N_QUERY; i++) seqs[i] = d;
    engine_batch b = {.n_tokens = N_QUERY, .tokens = g_query, .seq = seqs};
    assert_int_equal(engine_decode(g_e, &b, logits), IS_OK);
    engine_seq_close(g_e, d);
}

/* Pins (and copies, when not resident) facts fs through the host tier. */
static void prefetch(const int *fs, int n, kv_dtype dtype, bool expect_copy) {
    for (int i = 0; i < n; i++) {
        const fact_kv *kv = tier_get(fs[i], dtype);
        bool resident = engine_fact_resident(g_e, kv->content_id, kv->meta.n_tokens);
        assert_true(resident != expect_copy);
        assert_true(engine_fact_prefetch(g_e, kv->content_id, kv->meta.n_tokens,
                                         (int32_t)kv->meta.dtype, kv->k, kv->v));
        assert_true(engine_fact_resident(g_e, kv->content_id, kv->meta.n_tokens));
        host_tier_release(g_ht, kv); /* the tier's memory stays until evicted, and it is not */
    }
}

static void unpin(const int *fs, int n, kv_dtype dtype) {
    for (int i = 0; i < n; i++) {
        const fact_kv *kv = tier_get(fs[i], dtype);
        engine_fact_unpin(g_e, kv->content_id);
        host_tier_release(g_ht, kv);
    }
}

static void expect_bitwise(const float *a, const float *ref, const char *what) {
    int32_t diff = 0;
    for (int32_t i = 0; i < g_vocab; i++) diff += memcmp(&a[i], &ref[i], sizeof(float)) != 0;
    if (diff) fprintf(stderr, "%s: %d of %d logits differ\n", what, (int)diff, (int)g_vocab);
    assert_int_equal(diff, 0);
}

static void drop_arena(size_t pages) {
    /* A fact-cache size drops what the arena holds: every fact misses. */
    backend_cuda_set_arena_bytes(g_be, pages * 2 * (size_t)g_layers * g_kv_dim * 2);
}

/* ref: the logits of facts fs injected the way without the host tier, in
 * an emptied cache of `pages`, emptied again after. */
static void widened_ref(const int *fs, int n, kv_dtype dtype, size_t pages, float *ref) {
    drop_arena(pages);
    finish(start(fs, n, dtype, true), ref);
    drop_arena(pages);
}

/* A request with facts fs through the host tier (misses: copied from the
 * pinned records), injected and unpinned, its query not run yet. */
static int32_t start_tiered(const int *fs, int n, kv_dtype dtype) {
    prefetch(fs, n, dtype, true);
    int32_t d = start(fs, n, dtype, false);
    unpin(fs, n, dtype);
    return d;
}

static void miss_equals_widened(kv_dtype dtype) {
    static const int all[N_FACTS] = {0, 1, 2, 3};
    float *ref = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    widened_ref(all, N_FACTS, dtype, 256, ref);
    int32_t d = start_tiered(all, N_FACTS, dtype);
    finish(d, lg);
    expect_bitwise(lg, ref, "host tier miss");
    prefetch(all, N_FACTS, dtype, false); /* resident now: pinned only */
    d = start(all, N_FACTS, dtype, false);
    unpin(all, N_FACTS, dtype);
    finish(d, lg);
    expect_bitwise(lg, ref, "resident");
    free(ref);
    free(lg);
}

static void test_miss_bf16(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    miss_equals_widened(KV_DTYPE_BF16);
}

static void test_miss_f16(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    miss_equals_widened(KV_DTYPE_F16);
}

/* A small cache (48 pages): fact 0 injected for request 1, fact 1 for
 * request 2, others filling the cache, then fact 3 (12 pages) copied in
 * over fact 0's pages while request 1's query has not run yet: request 1
 * still sees fact 0. Request 2's fork lands request 1's injection first,
 * so what this holds is stream order: fact 3's copy and scatter come after
 * that injection on the device. */
static void test_evicted_pages_wait_for_injection(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    static const int f0[1] = {0}, f1[1] = {1}, f3[1] = {3}, fill[3] = {1, 2, 3};
    const kv_dtype dt = KV_DTYPE_BF16;
    float *ref = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    widened_ref(f0, 1, dt, 48, ref);
    int32_t d1 = start_tiered(f0, 1, dt);
    int32_t d2 = start_tiered(f1, 1, dt);
    /* 48 - 5 - 9 - (9 + 7 + 12) = 6 pages free; fact 3 takes 12: facts 0
     * and 1 go (the least recently used), and fact 0's pages are rewritten
     * when request 3's injection lands fact 3. */
    engine_seq_close(g_e, start(fill, 3, KV_DTYPE_F16, true));
    prefetch(f3, 1, dt, true);
    const fact_kv *kv0 = tier_get(0, dt);
    assert_false(engine_fact_resident(g_e, kv0->content_id, kv0->meta.n_tokens));
    host_tier_release(g_ht, kv0);
    int32_t d3 = start(f3, 1, dt, false);
    unpin(f3, 1, dt);
    finish(d1, lg);
    expect_bitwise(lg, ref, "request whose fact was evicted after its injection");
    engine_seq_close(g_e, d2);
    engine_seq_close(g_e, d3);
    /* The pins refuse past half the cache (24): the caller injects itself. */
    const fact_kv *kv1 = tier_get(1, dt), *kv2 = tier_get(2, dt), *kv3 = tier_get(3, dt);
    assert_true(engine_fact_prefetch(g_e, kv3->content_id, kv3->meta.n_tokens, 2, NULL, NULL));
    assert_true(engine_fact_prefetch(g_e, kv2->content_id, kv2->meta.n_tokens, 2, kv2->k, kv2->v));
    assert_false(engine_fact_prefetch(g_e, kv1->content_id, kv1->meta.n_tokens, 2, kv1->k, kv1->v));
    engine_fact_unpin(g_e, kv2->content_id);
    engine_fact_unpin(g_e, kv3->content_id);
    /* And memory the device cannot read is refused, never copied from. */
    void *plain = malloc((size_t)g_layers * kv2->meta.n_tokens * g_kv_dim * 2);
    assert_false(engine_fact_prefetch(g_e, kv2->content_id, kv2->meta.n_tokens, 2, plain, plain));
    free(plain);
    host_tier_release(g_ht, kv1);
    host_tier_release(g_ht, kv2);
    host_tier_release(g_ht, kv3);
    assert_int_equal(engine_status(g_e), IS_OK);
    free(ref);
    free(lg);
}

/* Facts 0-3 (bf16) through the host tier give the widened path's logits
 * bit for bit, with between() run after the injection and before the
 * query, and after() once the query has run. */
static void tiered_equals_widened(void (*between)(void), void (*after)(void), const char *what) {
    static const int all[N_FACTS] = {0, 1, 2, 3};
    float *ref = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    widened_ref(all, N_FACTS, KV_DTYPE_BF16, 256, ref);
    int32_t d = start_tiered(all, N_FACTS, KV_DTYPE_BF16);
    between();
    finish(d, lg);
    if (after) after();
    expect_bitwise(lg, ref, what);
    free(ref);
    free(lg);
}

static void sync_op(void) { g_be->ops->sync(g_be); }

/* The injection's rows copied by an op that is not the forward's (a fork
 * copies the trailing block, 21 + 33 = 54 tokens: 6 of them, with copy_2d)
 * before any forward: a fork that ran before the deferred layers landed
 * holds rows never injected, and its logits differ (sync_op's case cannot
 * tell: the query lands whatever it was not given). */
static void test_fork_lands_first(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    static const int all[N_FACTS] = {0, 1, 2, 3};
    float *ref = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    widened_ref(all, N_FACTS, KV_DTYPE_BF16, 256, ref);
    int32_t d = start_tiered(all, N_FACTS, KV_DTYPE_BF16), d2;
    assert_int_equal(engine_seq_open(g_e, &d2), IS_OK);
    assert_int_equal(engine_seq_fork(g_e, d2, d, N_PREFIX + 5 + 9 + 7 + 12), IS_OK);
    engine_seq_close(g_e, d);
    finish(d2, lg);
    expect_bitwise(lg, ref, "forked before the query");
    free(ref);
    free(lg);
}

/* The injection's layers land between the forward's layers; here an op
 * that is not the forward's (a sync) comes first and lands them all. */
static void test_other_op_lands_all(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    tiered_equals_widened(sync_op, NULL, "landed by another op");
}

/* An arena of 40 pages staging at most 10 pages' bytes at a time: facts 0
 * and 2 (5 + 7 tokens) are copied in two parts, the first landed at the
 * injection, the second as the layers run. */
static void test_queue_in_parts(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    static const int fs[2] = {0, 2};
    const kv_dtype dt = KV_DTYPE_F16;
    float *ref = malloc((size_t)g_vocab * sizeof(float));
    float *lg = malloc((size_t)g_vocab * sizeof(float));
    widened_ref(fs, 2, dt, 40, ref);
    backend_cuda_set_staging_bytes(g_be, 10 * 2 * (size_t)g_layers * g_kv_dim * 2);
    int32_t d = start_tiered(fs, 2, dt);
    finish(d, lg);
    expect_bitwise(lg, ref, "staged in parts");
    cuda_arena_stats as;
    backend_cuda_arena_stats(g_be, &as);
    assert_int_equal(as.staged_batches, 2);
    /* A record larger than the staging is refused: the caller injects it. */
    const fact_kv *kv3 = tier_get(3, dt);
    assert_false(engine_fact_prefetch(g_e, kv3->content_id, kv3->meta.n_tokens, 1, kv3->k, kv3->v));
    host_tier_release(g_ht, kv3);
    backend_cuda_set_staging_bytes(g_be, 0);
    assert_int_equal(engine_status(g_e), IS_OK);
    free(ref);
    free(lg);
}

/* The records' memory as it was before overwrite_records. */
static const fact_kv *g_kv[N_FACTS];
static void *g_saved[N_FACTS];

/* host_wait, then the tier's copies of facts 0-3 overwritten, as a reuse
 * of their memory would. */
static void overwrite_records(void) {
    engine_host_wait(g_e);
    for (int f = 0; f < N_FACTS; f++) {
        g_kv[f] = tier_get(f, KV_DTYPE_BF16);
        const size_t bytes = (size_t)g_layers * g_kv[f]->meta.n_tokens * g_kv_dim * 2;
        g_saved[f] = malloc(2 * bytes);
        assert_non_null(g_saved[f]);
        memcpy(g_saved[f], g_kv[f]->k, bytes);
        memcpy((char *)g_saved[f] + bytes, g_kv[f]->v, bytes);
        memset((void *)g_kv[f]->k, 0x7f, bytes);
        memset((void *)g_kv[f]->v, 0x7f, bytes);
    }
}

static void restore_records(void) { /* for the tests after */
    for (int f = 0; f < N_FACTS; f++) {
        const size_t bytes = (size_t)g_layers * g_kv[f]->meta.n_tokens * g_kv_dim * 2;
        memcpy((void *)g_kv[f]->k, g_saved[f], bytes);
        memcpy((void *)g_kv[f]->v, (char *)g_saved[f] + bytes, bytes);
        free(g_saved[f]);
        host_tier_release(g_ht, g_kv[f]);
    }
}

/* The host tier reuses an unheld record's memory once host_wait returns:
 * an injection's later groups, whose copies start only as its forward
 * runs, are copied before host_wait returns. */
static void test_host_wait_covers_staged(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    tiered_equals_widened(overwrite_records, restore_records,
                          "records overwritten after host_wait");
}

/* A queued record (copy not started) whose only pin goes is dropped, so
 * its host memory is never read; a pin-only prefetch of a queued record is
 * refused (its caller holds no host memory the copy could read). */
static void test_queued_pin_dropped(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    const kv_dtype dt = KV_DTYPE_BF16;
    drop_arena(256);
    const fact_kv *kv = tier_get(1, dt);
    assert_true(engine_fact_prefetch(g_e, kv->content_id, kv->meta.n_tokens, 2, kv->k, kv->v));
    assert_true(engine_fact_resident(g_e, kv->content_id, kv->meta.n_tokens));
    assert_false(engine_fact_prefetch(g_e, kv->content_id, kv->meta.n_tokens, 2, NULL, NULL));
    engine_fact_unpin(g_e, kv->content_id);
    assert_false(engine_fact_resident(g_e, kv->content_id, kv->meta.n_tokens));
    host_tier_release(g_ht, kv);
    assert_int_equal(engine_status(g_e), IS_OK);
}

/* A queued record's copy reads the memory of the holder that queued it.
 * The same contents under another record id (same text, so the same
 * content id) sit in other host-tier memory: a pin through that memory is
 * refused while the copy is queued, since its holder could give the first
 * memory up and the copy would then read whatever replaced it. A second
 * pin through the same memory is taken. */
static void test_queued_pin_other_memory(void **state) {
    (void)state;
    SKIP_WITHOUT_MODEL();
    const kv_dtype dt = KV_DTYPE_BF16;
    drop_arena(256);
    const fact_kv *kv = tier_get(2, dt), *twin = NULL;
    assert_int_equal(record_store_put(g_rs, "bf16_twin", &kv->meta, kv->tokens, kv->k, kv->v),
                     IS_OK);
    assert_int_equal(host_tier_get(g_ht, "bf16_twin", NULL, &twin, NULL), IS_OK);
    assert_true(twin->content_id == kv->content_id);
    assert_ptr_not_equal(twin->k, kv->k);
    const int32_t n = kv->meta.n_tokens;
    assert_true(engine_fact_prefetch(g_e, kv->content_id, n, 2, kv->k, kv->v));
    assert_false(engine_fact_prefetch(g_e, twin->content_id, n, 2, twin->k, twin->v));
    assert_true(engine_fact_prefetch(g_e, kv->content_id, n, 2, kv->k, kv->v));
    engine_fact_unpin(g_e, kv->content_id);
    engine_fact_unpin(g_e, kv->content_id);
    assert_false(engine_fact_resident(g_e, kv->content_id, n)); /* dropped before its copy */
    host_tier_release(g_ht, twin);
    host_tier_release(g_ht, kv);
    assert_int_equal(engine_status(g_e), IS_OK);
}

int main(void) {
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
    struct stat sb;
    if (stat(model_path(), &sb) != 0) {
        printf("no model at %s: skipped\n", model_path());
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_miss_bf16),
        cmocka_unit_test(test_miss_f16),
        cmocka_unit_test(test_evicted_pages_wait_for_injection),
        cmocka_unit_test(test_other_op_lands_all),
        cmocka_unit_test(test_fork_lands_first),
        cmocka_unit_test(test_queue_in_parts),
        cmocka_unit_test(test_queued_pin_dropped),
        cmocka_unit_test(test_queued_pin_other_memory),
        cmocka_unit_test(test_host_wait_covers_staged),
    };
    return test_run_group(tests, setup, teardown);
}

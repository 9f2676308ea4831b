/*
 * The serving pipeline's fact tiers, end to end through the scheduler on
 * the default model: a kv chat answers with the greedy text of `ask`
 * (ask_run) on the same facts and records, whichever tier each fact comes
 * from, and usage.facts says which one it was.
 *
 * Built twice. As test_serve_tiers_cuda (label gpu, exit 77 without a
 * device), on the CUDA backend as `serve --backend cuda --host-cache-gb`
 * runs it (bf16 cache, a GPU fact cache far smaller than the default):
 * first every fact is read from disk into the pinned host tier and copied
 * to the GPU at submit; then it is resident (gpu); then, the GPU cache
 * dropped, it comes from the host tier (host); then many requests at once.
 * Each time the text is ask's: the copy path must put in the cache the
 * bits that the widening path put there (f16 -> bf16 rounds once either
 * way). As test_serve_tiers (CI), on the CPU backend with a stand-in for
 * the GPU's fact cache (the host-tier ops of backend.h over a small table
 * that evicts any unpinned record whenever it makes room, which the GPU's
 * spares for a while, and whose pins hold at most half of it, as the
 * GPU's do): the same sequence checks the scheduler's side of the
 * protocol: every fact injected without values was pinned, every pin is
 * dropped once, and the text is ask's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "serve/ask.h"
#include "serve/scheduler.h"
#include "test_model.h"
#include "test_sched.h"
#include "test_util.h"
#ifdef TIERS_CUDA
#include "backend_cuda.h"
#define TIERS_BACKEND "cuda"
#else
#define TIERS_BACKEND "cpu"
#endif

#define MAX_TOKENS 6
#define N_FACTS    3
#define N_PAR      4
#define N_SETS     3

static backend *g_be;
static model *g_model;
static char g_dir[] = "/tmp/test_serve_tiers_XXXXXX";

#ifndef TIERS_CUDA
/* ---- a stand-in for the GPU fact cache, over the CPU backend ------------------------- */

#include "kv/fact_record.h"

#define FAKE_MAX 64

typedef struct fake_rec {
    uint64_t id;
    int32_t n_tokens, pins;
    uint64_t stamp;
    float *k, *v; /* f32, as the CPU's inject takes them */
} fake_rec;

static struct {
    pthread_mutex_t mu;
    backend_ops ops;        /* the CPU's, with the host tier's ops added */
    const backend_ops *cpu; /* the CPU's own */
    fake_rec recs[FAKE_MAX];
    int64_t cap_tokens, used_tokens, pinned_tokens;
    uint64_t clock;
    int64_t copies, pin_hits, unpin_underflows, injected_unpinned, injected_missing, evictions;
    int64_t injected_values; /* facts given with their values: not pinned beforehand */
    /* A gate a copy waits at (the host tier's view held) while `gate` is set. */
    pthread_cond_t gate_cv;
    bool gate, gate_entered;
} g_fake = {.mu = PTHREAD_MUTEX_INITIALIZER, .gate_cv = PTHREAD_COND_INITIALIZER};

static fake_rec *fake_find(uint64_t id) {
    for (int i = 0; i < FAKE_MAX; i++)
        if (g_fake.recs[i].id == id) return &g_fake.recs[i];
    return NULL;
}

static void fake_drop(fake_rec *r) {
    g_fake.used_tokens -= r->n_tokens;
    free(r->k);
    memset(r, 0, sizeof *r);
}

/* Room for n tokens and a slot: evicts the least recently used unpinned
 * records (any of them, the latest injection's too: stricter than the GPU). */
static fake_rec *fake_make_room(int32_t n) {
    for (;;) {
        fake_rec *slot = NULL, *victim = NULL;
        for (int i = 0; i < FAKE_MAX; i++) {
            fake_rec *r = &g_fake.recs[i];
            if (!r->id) slot = slot ? slot : r;
            else if (r->pins == 0 && (!victim || r->stamp < victim->stamp)) victim = r;
        }
        if (slot && g_fake.used_tokens + n <= g_fake.cap_tokens) return slot;
        if (!victim) return NULL;
        fake_drop(victim);
        g_fake.evictions++;
    }
}

static fake_rec *fake_put(uint64_t id, int32_t n, int32_t dtype, const void *k, const void *v,
                          bool values_f32) {
    fake_rec *r = fake_make_room(n);
    if (!r) return NULL;
    size_t ne = (size_t)g_model->cfg.n_layers * n * g_model->cfg.n_kv_heads * g_model->cfg.head_dim;
    r->k = malloc(2 * ne * sizeof(float));
    assert_non_null(r->k);
    r->v = r->k + ne;
    if (values_f32) {
        memcpy(r->k, k, ne * sizeof(float));
        memcpy(r->v, v, ne * sizeof(float));
    } else {
        fact_kv_to_f32((kv_dtype)dtype, k, r->k, ne);
        fact_kv_to_f32((kv_dtype)dtype, v, r->v, ne);
    }
    r->id = id;
    r->n_tokens = n;
    r->stamp = ++g_fake.clock;
    g_fake.used_tokens += n;
    return r;
}

static is_status fake_host_alloc(backend *be, size_t bytes, void **out) {
    (void)be;
    *out = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    return *out ? IS_OK : is_error_set(IS_ERR_NOMEM, "fake: out of memory");
}

static void fake_host_free(backend *be, void *p) {
    (void)be;
    free(p);
}

static void fake_host_wait(backend *be) { (void)be; }

static bool fake_prefetch(backend *be, const backend_fact_host *f) {
    (void)be;
    pthread_mutex_lock(&g_fake.mu);
    if (f->k && g_fake.gate) {
        g_fake.gate_entered = true;
        pthread_cond_broadcast(&g_fake.gate_cv);
        while (g_fake.gate) pthread_cond_wait(&g_fake.gate_cv, &g_fake.mu);
    }
    fake_rec *r = fake_find(f->id);
    bool pinned = false;
    /* A resident record's first pin counts against the half as a copy's
     * does (the GPU arena's rule): else a request whose facts never fit
     * there beside each other would find them pinned here once resident. */
    if (r && r->n_tokens == f->n_tokens &&
        (r->pins > 0 || g_fake.pinned_tokens + r->n_tokens <= g_fake.cap_tokens / 2)) {
        if (r->pins++ == 0) g_fake.pinned_tokens += r->n_tokens;
        r->stamp = ++g_fake.clock;
        g_fake.pin_hits++;
        pinned = true;
    } else if (f->k && g_fake.pinned_tokens + f->n_tokens <= g_fake.cap_tokens / 2) {
        if (r && r->pins == 0) fake_drop(r);
        if ((r = fake_put(f->id, f->n_tokens, f->dtype, f->k, f->v, false))) {
            r->pins = 1;
            g_fake.pinned_tokens += r->n_tokens;
            g_fake.copies++;
            pinned = true;
        }
    }
    pthread_mutex_unlock(&g_fake.mu);
    return pinned;
}

static void fake_unpin(backend *be, uint64_t id) {
    (void)be;
    pthread_mutex_lock(&g_fake.mu);
    fake_rec *r = fake_find(id);
    if (!r || r->pins == 0) g_fake.unpin_underflows++;
    else if (--r->pins == 0) g_fake.pinned_tokens -= r->n_tokens;
    pthread_mutex_unlock(&g_fake.mu);
}

static bool fake_resident(backend *be, uint64_t id, int32_t n_tokens) {
    (void)be;
    pthread_mutex_lock(&g_fake.mu);
    fake_rec *r = fake_find(id);
    bool held = r && r->n_tokens == n_tokens;
    pthread_mutex_unlock(&g_fake.mu);
    return held;
}

/* Facts without values come from the table and must be pinned there;
 * facts with values enter it, as a GPU fill does. */
static void fake_inject(backend *be, float *const *k_cache, float *const *v_cache,
                        const backend_inject *in) {
    backend_fact *fs = malloc((size_t)in->n_facts * sizeof *fs);
    assert_non_null(fs);
    pthread_mutex_lock(&g_fake.mu);
    for (int32_t i = 0; i < in->n_facts; i++) {
        fs[i] = in->facts[i];
        if (fs[i].k) {
            g_fake.injected_values++;
            fake_rec *r = fs[i].id ? fake_find(fs[i].id) : NULL;
            if (fs[i].id && !r) fake_put(fs[i].id, fs[i].n_tokens, 0, fs[i].k, fs[i].v, true);
            continue;
        }
        fake_rec *r = fake_find(fs[i].id);
        if (!r) {
            g_fake.injected_missing++;
            continue;
        }
        if (r->pins == 0) g_fake.injected_unpinned++;
        r->stamp = ++g_fake.clock;
        fs[i].k = r->k;
        fs[i].v = r->v;
    }
    pthread_mutex_unlock(&g_fake.mu);
    backend_inject copy = *in;
    copy.facts = fs;
    /* The table's values stay: nothing evicts a pinned record meanwhile. */
    g_fake.cpu->inject(be, k_cache, v_cache, &copy);
    free(fs);
}

/* As the GPU's recover does (cu_recover frees its arena): every record
 * goes, pinned or not, and with them every pin. */
static is_status fake_recover(backend *be) {
    is_status st = g_fake.cpu->recover ? g_fake.cpu->recover(be) : IS_OK;
    if (st != IS_OK) return st;
    pthread_mutex_lock(&g_fake.mu);
    for (int i = 0; i < FAKE_MAX; i++)
        if (g_fake.recs[i].id) fake_drop(&g_fake.recs[i]);
    g_fake.pinned_tokens = 0;
    pthread_mutex_unlock(&g_fake.mu);
    return IS_OK;
}

static void fake_install(backend *be, int64_t cap_tokens) {
    g_fake.cpu = be->ops;
    g_fake.ops = *be->ops;
    g_fake.ops.inject = fake_inject;
    g_fake.ops.fact_resident = fake_resident;
    g_fake.ops.host_alloc = fake_host_alloc;
    g_fake.ops.host_free = fake_host_free;
    g_fake.ops.fact_prefetch = fake_prefetch;
    g_fake.ops.fact_unpin = fake_unpin;
    g_fake.ops.host_wait = fake_host_wait;
    g_fake.ops.recover = fake_recover;
    g_fake.cap_tokens = cap_tokens;
    be->ops = &g_fake.ops;
}

/* Drops every record (none may be pinned: nothing runs). */
static void fake_clear(void) {
    pthread_mutex_lock(&g_fake.mu);
    for (int i = 0; i < FAKE_MAX; i++) {
        assert_int_equal(g_fake.recs[i].pins, 0);
        if (g_fake.recs[i].id) fake_drop(&g_fake.recs[i]);
    }
    pthread_mutex_unlock(&g_fake.mu);
}
#endif

static int setup(void **state) {
    (void)state;
    if (backend_create(TIERS_BACKEND, 0, &g_be) != IS_OK) return -1;
#ifdef TIERS_CUDA
    if (backend_cuda_configure(g_be, "kv=bf16") != IS_OK)
        fail_msg("kv=bf16: %s", is_error_last()); /* the serving configuration */
#endif
    return test_model_open_scratch(g_be, &g_model, g_dir);
}

static int teardown(void **state) {
    (void)state;
    return test_model_close_scratch(g_be, g_model, g_dir);
}

/* Where the request's facts came from: gpu, host, disk, text. */
static void expect_tiers(const test_coll *c, int gpu, int host, int disk) {
    const sched_usage *u = &c->usage;
    if (u->facts_gpu != gpu || u->facts_host != host || u->facts_disk != disk || u->facts_text)
        fprintf(stderr, "facts: gpu %d host %d disk %d text %d; expected %d %d %d 0\n",
                (int)u->facts_gpu, (int)u->facts_host, (int)u->facts_disk, (int)u->facts_text, gpu,
                host, disk);
    assert_int_equal(u->facts_gpu, gpu);
    assert_int_equal(u->facts_host, host);
    assert_int_equal(u->facts_disk, disk);
    assert_int_equal(u->facts_text, 0);
}

/* A GPU fact cache of `pages` tokens, emptied (nothing may run). */
static void gpu_cache_pages(int64_t pages) {
#ifdef TIERS_CUDA
    const model_config *c = &g_model->cfg;
    backend_cuda_set_arena_bytes(g_be,
                                 (size_t)pages * 2 * c->n_layers * c->n_kv_heads * c->head_dim * 2);
#else
    if (g_fake.cpu) fake_clear();
    else fake_install(g_be, pages);
    g_fake.cap_tokens = pages;
#endif
}

static void test_chat_equals_ask_from_every_tier(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    engine *e = test_engine_create(g_model, test_engine_params(1024, N_PAR + 2, 0));
    char dir[400];
    snprintf(dir, sizeof dir, "%s/mem", g_dir);
    memory_params mp = memory_default_params(); /* BM25 only: retrieval is not tested here */
    memory *mem = NULL;
    assert_int_equal(memory_open(dir, &mp, &mem, NULL), IS_OK);
    /* Three requests' facts (subsets of N_FACTS) and questions. */
    const char *texts[N_SETS * N_FACTS] = {
        "Melanie plays the clarinet and started as a child.",
        "Caroline moved from Sweden four years ago.",
        "Melanie is learning to bake sourdough bread.",
        "Caroline has a guinea pig named Oscar.",
        "Caroline attended a pride parade in June.",
        "Melanie ran a charity race last Saturday.",
        "John works as a nurse in Lisbon.",
        "John's sister paints landscapes.",
        "John adopted a dog called Max.",
    };
    const char *qs[N_SETS] = {"What does Melanie play, and where is Caroline from?",
                              "What is the name of Caroline's pet?", "What is John's job?"};
    char rids[N_SETS * N_FACTS][RECORD_STORE_ID_MAX + 1];
    const char *rid_ptrs[N_SETS * N_FACTS];
    /* Records in f16, the server's default, encoded as the server does. */
    ask_ctx *ac = NULL;
    assert_int_equal(ask_ctx_create(e, memory_record_store(mem), KV_DTYPE_F16, &ac), IS_OK);
    test_add_with_records(mem, ac, texts, N_SETS * N_FACTS, NULL, rids);
    for (int i = 0; i < N_SETS * N_FACTS; i++) rid_ptrs[i] = rids[i];
    static test_text ref[N_SETS];
    int32_t tokens[N_SETS], most = 0;
    for (int k = 0; k < N_SETS; k++) {
        memset(&ref[k], 0, sizeof ref[k]);
        ask_request ar = test_ask_greedy(ASK_MODE_KV, qs[k], rid_ptrs + k * N_FACTS,
                                         texts + k * N_FACTS, N_FACTS, MAX_TOKENS);
        ask_timing t;
        assert_int_equal(ask_run(ac, &ar, test_text_collect, &ref[k], &t), IS_OK);
        printf("  ask %d: \"%s\"\n", k, ref[k].s);
        assert_true(ref[k].s[0] != '\0');
        tokens[k] = t.n_memory_tokens;
        if (tokens[k] > most) most = tokens[k];
    }
    ask_ctx_free(ac);

    /* Far smaller than the default, and empty: every fact misses at first.
     * (A request's facts must fit half of it beside other requests' pins.) */
    gpu_cache_pages(4 * (int64_t)most);
    sched_params sp = sched_default_params();
    sp.record_dtype = KV_DTYPE_F16;
    sp.host_tier_bytes = (int64_t)64 << 20;
    sched *s = NULL;
    assert_int_equal(sched_create(e, mem, &sp, &s), IS_OK);
    chat_message msgs[N_SETS][1];
    sched_fact facts[N_SETS * N_FACTS];
    sched_request rq[N_SETS];
    for (int i = 0; i < N_SETS * N_FACTS; i++) facts[i] = (sched_fact){texts[i], rids[i]};
    for (int k = 0; k < N_SETS; k++) {
        msgs[k][0] = (chat_message){"user", qs[k]};
        rq[k] = test_sched_greedy(msgs[k], 1, ASK_MODE_KV, MAX_TOKENS);
        rq[k].facts = facts + k * N_FACTS;
        rq[k].n_facts = N_FACTS;
    }
    test_coll c;
    /* 1. Cold: read from the record files. */
    test_coll_submit(s, &rq[0], &c);
    test_coll_done(&c);
    printf("  chat, facts from disk: \"%s\"\n", c.text);
    assert_string_equal(c.text, ref[0].s);
    assert_int_equal(c.usage.injected_tokens, tokens[0]);
    expect_tiers(&c, 0, 0, N_FACTS);
    /* 2. Again: resident on the GPU. */
    test_coll_submit(s, &rq[0], &c);
    test_coll_done(&c);
    assert_string_equal(c.text, ref[0].s);
    expect_tiers(&c, N_FACTS, 0, 0);
    /* 3. The GPU cache dropped (nothing runs meanwhile): the host tier. */
    gpu_cache_pages(4 * (int64_t)most);
    test_coll_submit(s, &rq[0], &c);
    test_coll_done(&c);
    printf("  chat, facts from the host tier: \"%s\"\n", c.text);
    assert_string_equal(c.text, ref[0].s);
    expect_tiers(&c, 0, N_FACTS, 0);
    /* 4. Many queued at once over a cache that holds two requests' facts,
     * not three, and pins one's: copies, pins, refusals and evictions of
     * several queued requests overlap. The facts that find no room beside
     * the pins at submit wait in the host tier for the pins the requests
     * ahead give back; none is widened and passed with its values. */
    gpu_cache_pages(2 * (int64_t)most);
#ifndef TIERS_CUDA
    int64_t values0 = g_fake.injected_values;
#endif
    test_coll par[N_PAR];
    sched_hold_admission(s, true);
    for (int i = 0; i < N_PAR; i++) test_coll_submit(s, &rq[i % N_SETS], &par[i]);
    sched_hold_admission(s, false);
    int64_t served = 0;
    for (int i = 0; i < N_PAR; i++) {
        test_coll_done(&par[i]);
        assert_string_equal(par[i].text, ref[i % N_SETS].s);
        assert_int_equal(par[i].usage.facts_text, 0);
        served += par[i].usage.facts_gpu + par[i].usage.facts_host + par[i].usage.facts_disk;
    }
    assert_int_equal(served, (int64_t)N_PAR * N_FACTS);
    sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.facts_gpu + st.facts_host + st.facts_disk, (int64_t)(N_PAR + 3) * N_FACTS);
    assert_int_equal(st.facts_text, 0);
#ifndef TIERS_CUDA
    printf("  queued together: %lld facts passed with their values\n",
           (long long)(g_fake.injected_values - values0));
    assert_int_equal(g_fake.injected_values - values0, 0);
    /* 5. One after the other over a stand-in cache that holds only the
     * largest request's facts: the largest, after another, must evict
     * (whether the burst above evicted depends on how its requests
     * overlapped). */
    int largest = 0;
    for (int k = 1; k < N_SETS; k++)
        if (tokens[k] > tokens[largest]) largest = k;
    int other = (largest + 1) % N_SETS;
    gpu_cache_pages(most);
    test_coll_submit(s, &rq[other], &c);
    test_coll_done(&c);
    assert_string_equal(c.text, ref[other].s);
    assert_int_equal(c.usage.facts_text, 0);
    test_coll_submit(s, &rq[largest], &c);
    test_coll_done(&c);
    assert_string_equal(c.text, ref[largest].s);
    assert_int_equal(c.usage.facts_text, 0);
#endif
    sched_free(s);
#ifndef TIERS_CUDA
    printf("  stand-in cache: %lld copies, %lld pinned resident, %lld evictions\n",
           (long long)g_fake.copies, (long long)g_fake.pin_hits, (long long)g_fake.evictions);
    assert_int_equal(g_fake.unpin_underflows, 0);
    assert_int_equal(g_fake.injected_unpinned, 0);
    assert_int_equal(g_fake.injected_missing, 0);
    assert_int_equal(g_fake.pinned_tokens, 0);
    assert_true(g_fake.copies >= 2 * N_FACTS);
    assert_true(g_fake.evictions > 0);
#endif
    memory_close(mem);
    engine_free(e);
}

#ifndef TIERS_CUDA
/* The stand-in emptied, with room for `pins` pinned tokens (half its
 * pages; nothing may run). */
static void fake_pin_room(int64_t pins) { gpu_cache_pages(2 * pins); }

/* ---- exits and failures of the tiered path, over the stand-in ------------------------- */

static const char *const k_fx_texts[N_FACTS] = {
    "Melanie plays the clarinet and started as a child.",
    "Caroline moved from Sweden four years ago.",
    "Melanie is learning to bake sourdough bread.",
};

#define FX_MAX_FACTS 4

typedef struct tiers_fx {
    engine *e;
    memory *mem;
    sched *s;
    char rids[FX_MAX_FACTS][RECORD_STORE_ID_MAX + 1];
    sched_fact facts[FX_MAX_FACTS];
    chat_message msg[1];
    sched_request rq; /* a kv chat over all the facts */
} tiers_fx;

/* A scheduler over the stand-in (empty, room for everything) and a memory
 * holding texts[0..n) with their records. */
static void fx_open_texts(tiers_fx *x, const char *name, int32_t max_running,
                          const char *const *texts, int n) {
    assert_true(n <= FX_MAX_FACTS);
    memset(x, 0, sizeof *x);
    x->e = test_engine_create(g_model, test_engine_params(1024, N_PAR + 2, 0));
    char dir[400];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    memory_params mp = memory_default_params();
    assert_int_equal(memory_open(dir, &mp, &x->mem, NULL), IS_OK);
    ask_ctx *ac = NULL;
    assert_int_equal(ask_ctx_create(x->e, memory_record_store(x->mem), KV_DTYPE_F16, &ac), IS_OK);
    test_add_with_records(x->mem, ac, texts, n, NULL, x->rids);
    ask_ctx_free(ac);
    gpu_cache_pages(4096); /* empty, and room for everything */
    sched_params sp = sched_default_params();
    sp.record_dtype = KV_DTYPE_F16;
    sp.host_tier_bytes = (int64_t)64 << 20;
    if (max_running > 0) sp.max_running = max_running;
    assert_int_equal(sched_create(x->e, x->mem, &sp, &x->s), IS_OK);
    for (int i = 0; i < n; i++) x->facts[i] = (sched_fact){texts[i], x->rids[i]};
    x->msg[0] = (chat_message){"user", "What does Melanie play, and where is Caroline from?"};
    x->rq = test_sched_greedy(x->msg, 1, ASK_MODE_KV, MAX_TOKENS);
    x->rq.facts = x->facts;
    x->rq.n_facts = n;
}

static void fx_open(tiers_fx *x, const char *name, int32_t max_running) {
    fx_open_texts(x, name, max_running, k_fx_texts, N_FACTS);
}

static void fx_close(tiers_fx *x) {
    sched_free(x->s); /* NULL when a case freed it itself */
    memory_close(x->mem);
    engine_free(x->e);
}

/* A backend failure the backend recovers from at once keeps the queued
 * requests; the recovery (as the GPU's) dropped the pins their submit
 * took. A queued request must neither inject a fact without values on
 * the strength of such a pin nor drop it later: the pin it would drop is
 * another request's, taken on the same record after the recovery. */
static void test_pins_after_recovery(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    tiers_fx x;
    fx_open(&x, "mem_recover", 1); /* one request at a time: q runs while r waits */
    test_coll c, q, r;
    test_coll_run(x.s, &x.rq, &c); /* the facts resident in the cache, unpinned */
    char ref[sizeof c.text];
    snprintf(ref, sizeof ref, "%s", c.text);
    /* A fact without a record, for an encode job that meets the fault. */
    memory_add_req ar = {.tenant = "t",
                         .user = "u",
                         .text = "John works as a nurse.",
                         .window = MEMORY_WINDOW_DEFAULT};
    char fid[MEMORY_ID_SIZE];
    assert_int_equal(memory_add(x.mem, &ar, fid), IS_OK);
    int64_t under0 = g_fake.unpin_underflows, unpinned0 = g_fake.injected_unpinned,
            missing0 = g_fake.injected_missing;
    sched_hold_admission(x.s, true);
    test_coll_submit(x.s, &x.rq, &q); /* pinned where they are, at submit */
    backend_fault_arm(g_be, 1, false);
    assert_int_equal(sched_encode(x.s, "t", "u", fid), IS_OK);
    sched_health hl = {0};
    for (int i = 0; i < 3000 && hl.recoveries == 0; i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        sched_get_health(x.s, &hl);
    }
    assert_int_equal(hl.recoveries, 1);
    assert_true(hl.healthy);
    test_coll_submit(x.s, &x.rq, &r); /* copied again from the host tier, and pinned */
    sched_hold_admission(x.s, false);
    test_coll_done(&q);
    test_coll_done(&r);
    assert_string_equal(q.text, ref);
    assert_string_equal(r.text, ref);
    fx_close(&x);
    printf("  after the recovery: %lld unpin underflows, %lld injected unpinned\n",
           (long long)(g_fake.unpin_underflows - under0),
           (long long)(g_fake.injected_unpinned - unpinned0));
    assert_int_equal(g_fake.unpin_underflows - under0, 0);
    assert_int_equal(g_fake.injected_unpinned - unpinned0, 0);
    assert_int_equal(g_fake.injected_missing - missing0, 0);
    assert_int_equal(g_fake.pinned_tokens, 0);
}

/* Pins in queue order, one request behind another that waits: A (one fact)
 * is pinned at submit; C (one fact) then finds no room beside it and waits
 * in the host tier; B (a resident fact that fits beside A, and a fact that
 * does not) comes behind C. B must not pin its resident fact at submit: it
 * would hold that room while it waits for its other fact, so that once A
 * has gone C still could not be pinned, and would be read and widened to
 * f32. Sizes are chosen from the facts' tokens so that the stand-in
 * cache's pins (half of it) hold C alone, or B alone, but not both. */
static void test_pins_in_queue_order(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    enum { N_TEXTS = 6 };
    static const char *const texts[N_TEXTS] = {
        "Melanie plays the clarinet and started as a child.",
        "Caroline moved from Sweden four years ago.",
        "Melanie is learning to bake sourdough bread every weekend with her two kids and "
        "her neighbour Anna, who taught her how to feed the starter.",
        "Caroline has a guinea pig named Oscar.",
        "John works as a nurse in Lisbon.",
        "Melanie ran a charity race.",
    };
    engine *e = test_engine_create(g_model, test_engine_params(1024, N_PAR + 2, 0));
    char dir[400];
    snprintf(dir, sizeof dir, "%s/mem_order", g_dir);
    memory_params mp = memory_default_params();
    memory *mem = NULL;
    assert_int_equal(memory_open(dir, &mp, &mem, NULL), IS_OK);
    ask_ctx *ac = NULL;
    assert_int_equal(ask_ctx_create(e, memory_record_store(mem), KV_DTYPE_F16, &ac), IS_OK);
    char rids[N_TEXTS][RECORD_STORE_ID_MAX + 1];
    test_add_with_records(mem, ac, texts, N_TEXTS, NULL, rids);
    const char *q = "What do they do?";
    /* Each fact's tokens, to build the requests from. */
    int32_t len[N_TEXTS];
    int order[N_TEXTS];
    for (int i = 0; i < N_TEXTS; i++) {
        const char *id = rids[i];
        ask_request ar = test_ask_greedy(ASK_MODE_KV, q, &id, &texts[i], 1, 1);
        static test_text t;
        memset(&t, 0, sizeof t);
        ask_timing tm;
        assert_int_equal(ask_run(ac, &ar, test_text_collect, &t, &tm), IS_OK);
        len[i] = tm.n_memory_tokens;
        order[i] = i;
    }
    for (int i = 1; i < N_TEXTS; i++) /* shortest first */
        for (int j = i; j > 0 && len[order[j]] < len[order[j - 1]]; j--) {
            int x = order[j];
            order[j] = order[j - 1];
            order[j - 1] = x;
        }
    int sh = order[0], s2 = order[1], s3 = order[2], c4 = order[N_TEXTS - 2];
    int32_t pin_room = len[c4];
    if (len[sh] + len[s3] > pin_room) pin_room = len[sh] + len[s3];
    if (len[s2] + len[sh] > pin_room) pin_room = len[s2] + len[sh];
    assert_true(len[s2] + len[c4] > pin_room);           /* C waits behind A */
    assert_true(len[s2] + len[sh] + len[s3] > pin_room); /* B's second fact does not fit */
    assert_true(len[c4] + len[sh] > pin_room);           /* C and B's first do not fit */
    const char *ta[1] = {texts[s2]}, *tb[2] = {texts[sh], texts[s3]}, *tc[1] = {texts[c4]};
    const char *ia[1] = {rids[s2]}, *ib[2] = {rids[sh], rids[s3]}, *ic[1] = {rids[c4]};
    const char *const *rt[3] = {ta, tb, tc}, *const * ri[3] = {ia, ib, ic};
    int32_t nf[3] = {1, 2, 1};
    static test_text ref[3];
    for (int r = 0; r < 3; r++) {
        memset(&ref[r], 0, sizeof ref[r]);
        ask_request ar = test_ask_greedy(ASK_MODE_KV, q, ri[r], rt[r], nf[r], MAX_TOKENS);
        ask_timing tm;
        assert_int_equal(ask_run(ac, &ar, test_text_collect, &ref[r], &tm), IS_OK);
    }
    ask_ctx_free(ac);

    gpu_cache_pages(2 * (int64_t)pin_room);
    sched_params sp = sched_default_params();
    sp.record_dtype = KV_DTYPE_F16;
    sp.host_tier_bytes = (int64_t)64 << 20;
    sched *s = NULL;
    assert_int_equal(sched_create(e, mem, &sp, &s), IS_OK);
    chat_message msg[1] = {{"user", q}};
    sched_fact fa[1] = {{ta[0], ia[0]}}, fb[2] = {{tb[0], ib[0]}, {tb[1], ib[1]}},
               fc[1] = {{tc[0], ic[0]}};
    sched_fact *fs[3] = {fa, fb, fc};
    sched_request rq[3];
    for (int r = 0; r < 3; r++) {
        rq[r] = test_sched_greedy(msg, 1, ASK_MODE_KV, MAX_TOKENS);
        rq[r].facts = fs[r];
        rq[r].n_facts = nf[r];
    }
    test_coll c[3];
    /* B's first fact resident, unpinned. */
    sched_request b1 = rq[1];
    b1.n_facts = 1;
    test_coll_run(s, &b1, &c[1]);
    int64_t values0 = g_fake.injected_values;
    sched_hold_admission(s, true);
    test_coll_submit(s, &rq[0], &c[0]); /* A: copied, pinned */
    test_coll_submit(s, &rq[2], &c[2]); /* C: no room for its first fact */
    test_coll_submit(s, &rq[1], &c[1]); /* B: one resident, one not, behind C */
    sched_hold_admission(s, false);
    for (int r = 0; r < 3; r++) {
        test_coll_done(&c[r]);
        assert_string_equal(c[r].text, ref[r].s);
        assert_int_equal(c[r].usage.facts_text, 0);
    }
    printf("  queue order: %lld facts passed with their values\n",
           (long long)(g_fake.injected_values - values0));
    assert_int_equal(g_fake.injected_values - values0, 0);
    sched_free(s);
    assert_int_equal(g_fake.pinned_tokens, 0);
    assert_int_equal(g_fake.unpin_underflows, 0);
    memory_close(mem);
    engine_free(e);
}

typedef struct submitter {
    sched *s;
    const sched_request *rq;
    test_coll c;
    is_status st;
} submitter;

static void *submit_thread(void *arg) {
    submitter *t = arg;
    test_coll_init(&t->c);
    t->st = sched_submit(t->s, t->rq, test_coll_on_event, &t->c, &t->c.h);
    return NULL;
}

static atomic_bool g_freed;

static void *free_thread(void *arg) {
    sched_free(arg);
    atomic_store(&g_freed, true);
    return NULL;
}

/* sched_free while a submit is taking its facts (its host-tier view held,
 * its copy being started): the submit is refused (scheduler.h: "Submits
 * racing with it are refused") and gives back what it took before the
 * scheduler's tier, index and pool go. */
static void test_free_racing_submit(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    tiers_fx x;
    fx_open(&x, "mem_race", 0);
    sched_request one = x.rq;
    one.n_facts = 1; /* taken on the submitting thread itself */
    pthread_mutex_lock(&g_fake.mu);
    g_fake.gate = true;
    g_fake.gate_entered = false;
    pthread_mutex_unlock(&g_fake.mu);
    static submitter t;
    t = (submitter){.s = x.s, .rq = &one};
    pthread_t th, fh;
    assert_int_equal(pthread_create(&th, NULL, submit_thread, &t), 0);
    pthread_mutex_lock(&g_fake.mu);
    while (!g_fake.gate_entered) pthread_cond_wait(&g_fake.gate_cv, &g_fake.mu);
    pthread_mutex_unlock(&g_fake.mu);
    atomic_store(&g_freed, false);
    assert_int_equal(pthread_create(&fh, NULL, free_thread, x.s), 0);
    struct timespec ts = {0, 300000000};
    nanosleep(&ts, NULL);
    bool freed_early = atomic_load(&g_freed);
    pthread_mutex_lock(&g_fake.mu);
    g_fake.gate = false;
    pthread_cond_broadcast(&g_fake.gate_cv);
    pthread_mutex_unlock(&g_fake.mu);
    pthread_join(th, NULL);
    pthread_join(fh, NULL);
    x.s = NULL;
    assert_false(freed_early); /* it waited for the submit */
    assert_int_equal(t.st, IS_ERR_CANCELLED);
    assert_int_equal(g_fake.pinned_tokens, 0);
    fx_close(&x);
}

/* Requests whose facts never fit beside each other in the pins' half of
 * the cache are served all the same (the facts without a pin read from
 * their records), and every pin goes back. */
static void test_facts_never_fit_beside_pins(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    tiers_fx x;
    fx_open(&x, "mem_never_fit", 1);
    test_coll c;
    test_coll_run(x.s, &x.rq, &c);
    char ref[sizeof c.text];
    snprintf(ref, sizeof ref, "%s", c.text);
    fake_pin_room(c.usage.injected_tokens / 2); /* half of one request's facts */
    int64_t under0 = g_fake.unpin_underflows, unpinned0 = g_fake.injected_unpinned;
    enum { N = 4 };
    test_coll q[N];
    sched_hold_admission(x.s, true);
    for (int i = 0; i < N; i++) test_coll_submit(x.s, &x.rq, &q[i]);
    sched_hold_admission(x.s, false);
    for (int i = 0; i < N; i++) {
        test_coll_done(&q[i]);
        assert_string_equal(q[i].text, ref);
        assert_int_equal(q[i].usage.facts_text, 0);
        assert_true(q[i].usage.facts_disk > 0); /* some read from their records */
    }
    fx_close(&x);
    assert_int_equal(g_fake.unpin_underflows - under0, 0);
    assert_int_equal(g_fake.injected_unpinned - unpinned0, 0);
    assert_int_equal(g_fake.pinned_tokens, 0);
}

/* One long fact and three short ones, for requests of one or two facts
 * whose pins fit beside each other or not by their lengths. */
static const char *const k_len_texts[FX_MAX_FACTS] = {
    "Caroline's grandmother, who lived in a small fishing village in Sweden, taught her to knit.",
    "John works as a nurse in Lisbon.",
    "John adopted a dog called Max.",
    "Melanie ran a charity race last Saturday.",
};

typedef struct len_fx {
    tiers_fx x;
    sched_request one[FX_MAX_FACTS]; /* a request over fact i alone */
    sched_request two;               /* over facts 2 and 3 */
    char ref_one[FX_MAX_FACTS][sizeof((test_coll *)0)->text], ref_two[sizeof((test_coll *)0)->text];
    int32_t len[FX_MAX_FACTS]; /* each fact's record tokens */
} len_fx;

/* The requests run once each, alone: their texts, their facts' lengths. */
static void len_fx_open(len_fx *f, const char *name, int32_t max_running) {
    fx_open_texts(&f->x, name, max_running, k_len_texts, FX_MAX_FACTS);
    test_coll c;
    for (int i = 0; i < FX_MAX_FACTS; i++) {
        f->one[i] = f->x.rq;
        f->one[i].facts = f->x.facts + i;
        f->one[i].n_facts = 1;
        test_coll_run(f->x.s, &f->one[i], &c);
        snprintf(f->ref_one[i], sizeof f->ref_one[i], "%s", c.text);
        f->len[i] = c.usage.injected_tokens;
    }
    f->two = f->x.rq;
    f->two.facts = f->x.facts + 2;
    f->two.n_facts = 2;
    test_coll_run(f->x.s, &f->two, &c);
    snprintf(f->ref_two, sizeof f->ref_two, "%s", c.text);
    printf("  fact lengths: %d %d %d %d\n", (int)f->len[0], (int)f->len[1], (int)f->len[2],
           (int)f->len[3]);
}

static int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }
static int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }

/* Two requests queued behind a third whose pins leave no room for either
 * get theirs once its injection gave them back, before the next
 * admission, and are admitted together (one injection), none passing its
 * facts with their values. */
static void test_waiting_facts_pinned_before_admission(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    len_fx f;
    len_fx_open(&f, "mem_pin_queued", 0);
    /* A (the long fact) pinned at submit; B and C (the short facts 2, 3)
     * find no room beside it, and fit together once it is gone. */
    const int32_t a = f.len[0], b = f.len[2], c = f.len[3];
    const int32_t room = imax(a, b + c);
    assert_true(room < a + imin(b, c));
    fake_pin_room(room);
    int64_t values0 = g_fake.injected_values;
    sched_stats st0;
    sched_get_stats(f.x.s, &st0);
    test_coll q[3];
    sched_hold_admission(f.x.s, true);
    test_coll_submit(f.x.s, &f.one[0], &q[0]);
    test_coll_submit(f.x.s, &f.one[2], &q[1]);
    test_coll_submit(f.x.s, &f.one[3], &q[2]);
    sched_hold_admission(f.x.s, false);
    const char *ref[3] = {f.ref_one[0], f.ref_one[2], f.ref_one[3]};
    for (int i = 0; i < 3; i++) {
        test_coll_done(&q[i]);
        assert_string_equal(q[i].text, ref[i]);
    }
    sched_stats st;
    sched_get_stats(f.x.s, &st);
    printf("  %lld injections for 3 requests, %lld facts passed with their values\n",
           (long long)(st.inject_calls - st0.inject_calls),
           (long long)(g_fake.injected_values - values0));
    assert_int_equal(g_fake.injected_values - values0, 0);
    assert_int_equal(st.inject_calls - st0.inject_calls, 2);
    fx_close(&f.x);
    assert_int_equal(g_fake.pinned_tokens, 0);
}

/* A request that comes behind one waiting for room beside the pins takes
 * none at submit, though some of its facts would fit: H (the long fact)
 * finds no room beside A's pin, and would find none after A's injection
 * either if B, behind it, held pins on some of its facts. Nothing passes
 * its facts with their values. */
static void test_no_pins_behind_a_waiting_request(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    len_fx f;
    len_fx_open(&f, "mem_pin_behind", 0);
    const int32_t a = f.len[1], h = f.len[0], b1 = f.len[2], b2 = f.len[3];
    /* A pinned at submit, H not beside it, one of B's two beside A but not
     * both; once A's pin is back H fits only without B's, and B after H. */
    const int32_t room = imax(h, imax(a + imin(b1, b2), b1 + b2));
    assert_true(room < imin(a + h, imin(a + b1 + b2, h + imin(b1, b2))));
    fake_pin_room(room);
    int64_t values0 = g_fake.injected_values;
    test_coll q[3];
    sched_hold_admission(f.x.s, true);
    test_coll_submit(f.x.s, &f.one[1], &q[0]);
    test_coll_submit(f.x.s, &f.one[0], &q[1]);
    test_coll_submit(f.x.s, &f.two, &q[2]);
    pthread_mutex_lock(&g_fake.mu);
    int64_t pinned = g_fake.pinned_tokens;
    pthread_mutex_unlock(&g_fake.mu);
    assert_int_equal(pinned, a); /* A's only */
    sched_hold_admission(f.x.s, false);
    const char *ref[3] = {f.ref_one[1], f.ref_one[0], f.ref_two};
    for (int i = 0; i < 3; i++) {
        test_coll_done(&q[i]);
        assert_string_equal(q[i].text, ref[i]);
    }
    printf("  %lld facts passed with their values\n",
           (long long)(g_fake.injected_values - values0));
    assert_int_equal(g_fake.injected_values - values0, 0);
    fx_close(&f.x);
    assert_int_equal(g_fake.pinned_tokens, 0);
}

static int64_t fake_pinned(void) {
    pthread_mutex_lock(&g_fake.mu);
    int64_t n = g_fake.pinned_tokens;
    pthread_mutex_unlock(&g_fake.mu);
    return n;
}

/* Waits (polling) until the stand-in holds `want` pinned tokens. */
static void wait_pinned(int64_t want) {
    for (int i = 0; i < 10000 && fake_pinned() != want; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(fake_pinned(), want);
}

/* One request at a time: A (the long fact) runs, pinned at submit and
 * unpinned by its injection; B and C queued behind it find no room beside
 * A's pin at submit and are pinned while they still wait (no slot). The
 * returned A is still running. */
static void start_pinned_waiters(len_fx *f, sched_request *a_rq, test_coll *a, test_coll *b,
                                 test_coll *c) {
    const int32_t la = f->len[0], lb = f->len[2], lc = f->len[3];
    const int32_t room = imax(la, lb + lc);
    assert_true(room < la + imin(lb, lc));
    fake_pin_room(room);
    *a_rq = f->one[0];
    a_rq->max_tokens = 200; /* runs while the others are pinned and cancelled */
    sched_hold_admission(f->x.s, true);
    test_coll_submit(f->x.s, a_rq, a);
    test_coll_submit(f->x.s, &f->one[2], b);
    test_coll_submit(f->x.s, &f->one[3], c);
    assert_int_equal(fake_pinned(), la);
    sched_hold_admission(f->x.s, false);
    wait_pinned(lb + lc);
}

/* Requests cancelled while they wait, holding pins they got in the queue,
 * give them back at once. */
static void test_cancel_pinned_waiting(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    len_fx f;
    len_fx_open(&f, "mem_pin_cancel", 1);
    int64_t under0 = g_fake.unpin_underflows;
    sched_request a_rq;
    test_coll a, b, c;
    start_pinned_waiters(&f, &a_rq, &a, &b, &c);
    sched_cancel(b.h);
    sched_cancel(c.h);
    test_coll_done(&b);
    test_coll_done(&c);
    assert_int_equal(b.finish, IS_FINISH_ABORT);
    assert_int_equal(c.finish, IS_FINISH_ABORT);
    pthread_mutex_lock(&a.mu);
    bool a_running = a.n_terminal == 0;
    pthread_mutex_unlock(&a.mu);
    assert_int_equal(fake_pinned(), 0);
    sched_cancel(a.h);
    test_coll_done(&a);
    assert_true(a_running); /* the pins went back with the cancels, not with A */
    fx_close(&f.x);
    assert_int_equal(g_fake.unpin_underflows - under0, 0);
    assert_int_equal(g_fake.pinned_tokens, 0);
}

/* Pins taken in the queue and dropped by a recovery (A's step meets the
 * fault) are taken again, not trusted nor given back: B and C inject
 * without values only what is pinned, and no unpin drops another's. */
static void test_recovery_drops_waiting_pins(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    len_fx f;
    len_fx_open(&f, "mem_pin_recover", 1);
    int64_t under0 = g_fake.unpin_underflows, unpinned0 = g_fake.injected_unpinned,
            missing0 = g_fake.injected_missing, values0 = g_fake.injected_values;
    sched_request a_rq;
    test_coll a, b, c;
    start_pinned_waiters(&f, &a_rq, &a, &b, &c);
    backend_fault_arm(g_be, 1, false);
    test_coll_wait(&a);
    assert_int_equal(a.kind, SCHED_EV_ERROR); /* the fault was A's */
    sched_release(a.h);
    test_coll_done(&b);
    test_coll_done(&c);
    assert_string_equal(b.text, f.ref_one[2]);
    assert_string_equal(c.text, f.ref_one[3]);
    sched_health hl;
    sched_get_health(f.x.s, &hl);
    assert_int_equal(hl.recoveries, 1);
    fx_close(&f.x);
    assert_int_equal(g_fake.unpin_underflows - under0, 0);
    assert_int_equal(g_fake.injected_unpinned - unpinned0, 0);
    assert_int_equal(g_fake.injected_missing - missing0, 0);
    assert_int_equal(g_fake.injected_values - values0, 0);
    assert_int_equal(g_fake.pinned_tokens, 0);
}
#endif

int main(void) {
#ifdef TIERS_CUDA
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_equals_ask_from_every_tier),
#ifndef TIERS_CUDA
        cmocka_unit_test(test_pins_in_queue_order),
        cmocka_unit_test(test_pins_after_recovery),
        cmocka_unit_test(test_free_racing_submit),
        cmocka_unit_test(test_facts_never_fit_beside_pins),
        cmocka_unit_test(test_waiting_facts_pinned_before_admission),
        cmocka_unit_test(test_no_pins_behind_a_waiting_request),
        cmocka_unit_test(test_cancel_pinned_waiting),
        cmocka_unit_test(test_recovery_drops_waiting_pins),
#endif
    };
    return test_run_group(tests, setup, teardown);
}

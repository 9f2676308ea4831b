/*
 * The serving pipeline's fact tiers, end to end through the scheduler on
 * the default model: a kv chat answers with the greedy text of `ask`
 * (ask_run) on the same facts and records, whichever tier each fact comes
 * from, and usage.facts says which one it was.
 *
 * Built twice: for the CPU backend (CI: no host tier; records are read
 * through the record store and widened per request, counted as disk) and,
 * as test_serve_tiers_cuda (label gpu, exit 77 without a device), for the
 * CUDA backend as `serve --backend cuda --host-cache-gb` runs it (bf16
 * cache, a GPU fact cache far smaller than the default): first every fact
 * is read from disk into the pinned host tier and copied to the GPU at
 * submit; then it is resident (gpu); then, the GPU cache dropped, it comes
 * from the host tier (host); then many requests at once. Each time the
 * text is ask's: the copy path must put in the cache the bits that the
 * widening path put there (f16 -> bf16 rounds once either way).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "serve/ask.h"
#include "serve/scheduler.h"
#include "test_util.h"
#ifdef TIERS_CUDA
#include "backend_cuda.h"
#define TIERS_BACKEND "cuda"
#else
#define TIERS_BACKEND "cpu"
#endif

#define MAX_TOKENS 12
#define N_FACTS 3
#define N_PAR 6

static backend *g_be;
static model *g_model;
static char g_dir[] = "/tmp/test_serve_tiers_XXXXXX";

static int setup(void **state) {
    (void)state;
    struct stat st;
    if (stat(IS_DEFAULT_MODEL, &st) != 0) return 0;
    if (!mkdtemp(g_dir)) return -1;
    if (backend_create(TIERS_BACKEND, 0, &g_be) != IS_OK) return -1;
#ifdef TIERS_CUDA
    backend_cuda_set_kv_dtype(g_be, CUDA_KV_BF16); /* the serving configuration */
#endif
    if (model_load(IS_DEFAULT_MODEL, g_be, &g_model) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    model_free(g_model);
    if (g_be) g_be->ops->free(g_be);
    if (g_model && test_remove_tree(g_dir) != 0) return -1;
    return 0;
}

/* ---- events ---------------------------------------------------------------------------- */

typedef struct coll {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool ended;
    sched_event_kind kind;
    char text[2048];
    size_t len;
    sched_usage usage;
    sched_handle *h;
} coll;

static void on_event(const sched_event *ev, void *ud) {
    coll *c = ud;
    pthread_mutex_lock(&c->mu);
    if (ev->kind == SCHED_EV_TEXT) {
        size_t n = ev->len < sizeof c->text - 1 - c->len ? ev->len : sizeof c->text - 1 - c->len;
        memcpy(c->text + c->len, ev->text, n);
        c->len += n;
        c->text[c->len] = '\0';
    } else {
        if (ev->kind == SCHED_EV_ERROR) fprintf(stderr, "request failed: %s\n", ev->message);
        c->kind = ev->kind;
        c->usage = ev->usage;
        c->ended = true;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

static void submit(sched *s, const sched_request *r, coll *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    assert_int_equal(sched_submit(s, r, on_event, c, &c->h), IS_OK);
}

static void wait_done(coll *c) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 300;
    pthread_mutex_lock(&c->mu);
    while (!c->ended)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &until) != 0) break;
    bool ended = c->ended;
    pthread_mutex_unlock(&c->mu);
    assert_true(ended);
    assert_int_equal(c->kind, SCHED_EV_DONE);
    sched_release(c->h);
}

static bool collect(const char *piece, size_t len, void *ud) {
    char *out = ud;
    size_t at = strlen(out);
    if (at + len >= 2048) len = 2047 - at;
    memcpy(out + at, piece, len);
    out[at + len] = '\0';
    return true; /* go on */
}

/* Where the request's facts came from: gpu, host, disk, text. */
static void expect_tiers(const coll *c, int gpu, int host, int disk) {
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

#ifdef TIERS_CUDA
/* A GPU fact cache of `pages` tokens (setting it drops what it held). */
static void gpu_cache_pages(int64_t pages) {
    const model_config *c = &g_model->cfg;
    backend_cuda_set_arena_bytes(g_be, (size_t)pages * 2 * c->n_layers * c->n_kv_heads * c->head_dim * 2);
}
#endif

static void test_chat_equals_ask_from_every_tier(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    engine_params ep = engine_default_params();
    ep.n_ctx = 1024;
    ep.max_seqs = N_PAR + 2;
    engine *e = NULL;
    assert_int_equal(engine_create(g_model, ep, &e), IS_OK);
    char dir[400];
    snprintf(dir, sizeof dir, "%s/mem", g_dir);
    memory_params mp = memory_default_params(); /* BM25 only: retrieval is not tested here */
    memory *mem = NULL;
    assert_int_equal(memory_open(dir, &mp, &mem, NULL), IS_OK);
    const char *texts[N_FACTS] = {"Melanie plays the clarinet and started as a child.",
                                  "Caroline moved from Sweden four years ago.",
                                  "Melanie is learning to bake sourdough bread."};
    const char *q = "What does Melanie play, and where is Caroline from?";
    char ids[N_FACTS][MEMORY_ID_SIZE], rids[N_FACTS][RECORD_STORE_ID_MAX + 1];
    const char *rid_ptrs[N_FACTS];
    /* Records in f16, the server's default, encoded as the server does. */
    ask_ctx *ac = NULL;
    assert_int_equal(ask_ctx_create(e, memory_record_store(mem), KV_DTYPE_F16, &ac), IS_OK);
    memory_set_encoder(mem, ask_memory_encoder, ac);
    for (int i = 0; i < N_FACTS; i++) {
        memory_add_req r = {.tenant = "t", .user = "u", .text = texts[i], .window = MEMORY_WINDOW_DEFAULT};
        assert_int_equal(memory_add(mem, &r, ids[i]), IS_OK);
        mem_fact f;
        assert_int_equal(memory_get(mem, "t", "u", ids[i], &f), IS_OK);
        assert_non_null(f.kv_record);
        snprintf(rids[i], sizeof rids[i], "%s", f.kv_record);
        rid_ptrs[i] = rids[i];
        mem_fact_clear(&f);
    }
    memory_set_encoder(mem, NULL, NULL);
    static char ref[2048];
    ref[0] = '\0';
    ask_request ar = {.mode = ASK_MODE_KV, .query = q, .fact_ids = rid_ptrs, .fact_texts = texts,
                      .n_facts = N_FACTS, .max_tokens = MAX_TOKENS, .temperature = 0, .top_k = 0,
                      .top_p = 1.0f};
    ask_timing t;
    assert_int_equal(ask_run(ac, &ar, collect, ref, &t), IS_OK);
    ask_ctx_free(ac);
    printf("  ask: \"%s\"\n", ref);
    assert_true(ref[0] != '\0');

#ifdef TIERS_CUDA
    /* Far smaller than the default, and empty: every fact misses at first.
     * (A request's facts must fit half of it beside other requests' pins.) */
    gpu_cache_pages(4 * (int64_t)t.n_memory_tokens);
#endif
    sched_params sp = sched_default_params();
    sp.record_dtype = KV_DTYPE_F16;
    sp.host_tier_bytes = (int64_t)64 << 20;
    sched *s = NULL;
    assert_int_equal(sched_create(e, mem, &sp, &s), IS_OK);
    chat_message msg[] = {{"user", q}};
    sched_fact facts[N_FACTS];
    for (int i = 0; i < N_FACTS; i++) facts[i] = (sched_fact){texts[i], rids[i]};
    sched_request rq = {.messages = msg, .n_messages = 1, .mode = ASK_MODE_KV, .facts = facts,
                        .n_facts = N_FACTS, .max_tokens = MAX_TOKENS, .temperature = 0.0f,
                        .top_p = 1.0f};
    coll c;
    /* 1. Cold: read from the record files. */
    submit(s, &rq, &c);
    wait_done(&c);
    printf("  chat, facts from disk: \"%s\"\n", c.text);
    assert_string_equal(c.text, ref);
    assert_int_equal(c.usage.injected_tokens, t.n_memory_tokens);
    expect_tiers(&c, 0, 0, N_FACTS);
    /* 2. Again: resident on the GPU (the CPU has no GPU cache: read again). */
    submit(s, &rq, &c);
    wait_done(&c);
    assert_string_equal(c.text, ref);
#ifdef TIERS_CUDA
    expect_tiers(&c, N_FACTS, 0, 0);
    /* 3. The GPU cache dropped (nothing runs meanwhile): the host tier. */
    gpu_cache_pages(4 * (int64_t)t.n_memory_tokens);
    submit(s, &rq, &c);
    wait_done(&c);
    printf("  chat, facts from the host tier: \"%s\"\n", c.text);
    assert_string_equal(c.text, ref);
    expect_tiers(&c, 0, N_FACTS, 0);
    gpu_cache_pages(4 * (int64_t)t.n_memory_tokens);
#else
    expect_tiers(&c, 0, 0, N_FACTS);
#endif
    /* 4. Many at once, copies and pins of several queued requests overlapping. */
    coll par[N_PAR];
    for (int i = 0; i < N_PAR; i++) submit(s, &rq, &par[i]);
    int64_t served = 0;
    for (int i = 0; i < N_PAR; i++) {
        wait_done(&par[i]);
        assert_string_equal(par[i].text, ref);
        assert_int_equal(par[i].usage.facts_text, 0);
        served += par[i].usage.facts_gpu + par[i].usage.facts_host + par[i].usage.facts_disk;
    }
    assert_int_equal(served, (int64_t)N_PAR * N_FACTS);
    sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.facts_gpu + st.facts_host + st.facts_disk, (int64_t)(N_PAR + 3) * N_FACTS -
#ifdef TIERS_CUDA
                                                                       0
#else
                                                                       N_FACTS
#endif
    );
    assert_int_equal(st.facts_text, 0);
    sched_free(s);
    memory_close(mem);
    engine_free(e);
}

int main(void) {
#ifdef TIERS_CUDA
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_equals_ask_from_every_tier),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

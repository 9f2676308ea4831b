/*
 * Backend failures reach the client (scheduler.h, "Backend failures"), on
 * the default model, with faults injected into the backend
 * (backend_fault_arm):
 *
 * Through the scheduler:
 *  - a fault in the middle of two running requests with a third queued:
 *    the running ones end with an ERROR naming it, the queued one is served
 *    after the recovery (at once, since the fault does not stick), and
 *    every request that finishes has the clean run's text (nothing is
 *    answered from stale logits);
 *  - a fault that sticks: the request fails, the scheduler is unhealthy
 *    and refuses submits (IS_ERR_BUSY) across several recovery attempts;
 *    once the backend can recover it serves the clean text again.
 *
 * Through the HTTP server (the whole app, kv-mode chats over two facts
 * encoded by the server itself):
 *  - a stuck fault: the chat is a 500 with an OpenAI error naming the
 *    failure, /health is a 503 with a JSON body saying why, a chat while
 *    unhealthy is a 503; after recovery /health is 200 and the chat gives
 *    the clean answer;
 *  - a fault aimed at the middle of a chat's ops (counted on a clean one):
 *    500, recovered at once, then the clean answer; and the same in a
 *    streaming chat, whose stream carries an error event.
 *
 * Built twice: for the CPU backend (CI) and, as test_serve_fault_cuda
 * (label gpu, exit 77 without a device), for the CUDA backend as `serve
 * --backend cuda` runs it (bf16 cache, GPU fact arena).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "serve/http/app.h"
#include "serve/scheduler.h"
#include "test_http_client.h"
#include "test_util.h"
#ifdef FAULT_CUDA
#include "backend_cuda.h"
#define FAULT_BACKEND "cuda"
#else
#define FAULT_BACKEND "cpu"
#endif

#define WAIT_S 120 /* longest wait for one request on a busy machine */

static bool g_model;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- through the scheduler ------------------------------------------------------------ */

static backend *g_be;
static model *g_m;
static engine *g_e;
static sched *g_s;

/* What a request received. */
typedef struct result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool ended;
    sched_event_kind kind; /* DONE or ERROR */
    is_status status;
    char message[700];
    char text[4096];
    size_t len;
} result;

static void on_event(const sched_event *ev, void *ud) {
    result *r = ud;
    pthread_mutex_lock(&r->mu);
    if (ev->kind == SCHED_EV_TEXT) {
        size_t n = ev->len < sizeof r->text - 1 - r->len ? ev->len : sizeof r->text - 1 - r->len;
        memcpy(r->text + r->len, ev->text, n);
        r->len += n;
        r->text[r->len] = '\0';
    } else {
        r->kind = ev->kind;
        r->status = ev->status;
        snprintf(r->message, sizeof r->message, "%s", ev->message ? ev->message : "");
        r->ended = true;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

static void result_init(result *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void result_wait(result *r) {
    double until = now_s() + WAIT_S;
    pthread_mutex_lock(&r->mu);
    while (!r->ended && now_s() < until) {
        pthread_mutex_unlock(&r->mu);
        sleep_ms(5);
        pthread_mutex_lock(&r->mu);
    }
    bool ended = r->ended;
    pthread_mutex_unlock(&r->mu);
    assert_true(ended);
}

static const chat_message MSG[] = {{"user", "Name three colors of the rainbow."}};

static is_status submit(result *r, sched_handle **h) {
    result_init(r);
    sched_request q = {.messages = MSG,
                       .n_messages = 1,
                       .mode = ASK_MODE_OFF,
                       .max_tokens = 12,
                       .temperature = 0.0f,
                       .top_p = 1.0f};
    return sched_submit(g_s, &q, on_event, r, h);
}

/* One greedy request to its end. */
static void run_one(result *r) {
    sched_handle *h;
    assert_int_equal(submit(r, &h), IS_OK);
    result_wait(r);
    sched_release(h);
}

static int sched_setup(void **state) {
    struct stat sb;
    g_model = stat(IS_DEFAULT_MODEL, &sb) == 0;
    if (!g_model) return 0;
    if (backend_create(FAULT_BACKEND, 0, &g_be) != IS_OK) return -1;
#ifdef FAULT_CUDA
    if (backend_set_option(g_be, BACKEND_OPT_KV_COMPACT, 1) != IS_OK) return -1;
#endif
    if (model_load(IS_DEFAULT_MODEL, g_be, &g_m) != IS_OK) return -1;
    engine_params ep = engine_default_params();
    ep.n_ctx = 512;
    ep.max_seqs = 3;
    if (engine_create(g_m, ep, &g_e) != IS_OK) return -1;
    sched_params sp = sched_default_params();
    sp.max_running = 2; /* a third request waits in the queue */
    return sched_create(g_e, NULL, &sp, &g_s) == IS_OK ? 0 : -1;
}

static int sched_teardown(void **state) {
    sched_free(g_s);
    engine_free(g_e);
    model_free(g_m);
    if (g_be) g_be->ops->free(g_be);
    g_s = NULL;
    g_e = NULL;
    g_m = NULL;
    g_be = NULL;
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) skip();                                                                      \
    } while (0)

static void test_sched_fault_mid_batch(void **state) {
    SKIP_WITHOUT_MODEL();
    result ref;
    int64_t c0 = backend_op_count(g_be);
    run_one(&ref);
    assert_int_equal(ref.kind, SCHED_EV_DONE);
    int64_t ops = backend_op_count(g_be) - c0;
    sched_health h0;
    sched_get_health(g_s, &h0);

    /* Two of three run at once, in about as many ops as one alone: half of
     * those lands while they run, and before the third is admitted (no
     * slot frees before the first has run all its ops). */
    result r[3];
    sched_handle *hs[3];
    backend_fault_arm(g_be, ops / 2, false);
    for (int i = 0; i < 3; i++) assert_int_equal(submit(&r[i], &hs[i]), IS_OK);
    int failed = 0;
    for (int i = 0; i < 3; i++) {
        result_wait(&r[i]);
        sched_release(hs[i]);
        if (r[i].kind == SCHED_EV_ERROR) {
            failed++;
            assert_int_not_equal(r[i].status, IS_OK);
            assert_non_null(strstr(r[i].message, "backend failure"));
            assert_non_null(strstr(r[i].message, "injected fault"));
        } else {
            /* Finished: from the logits of its own tokens, not stale ones. */
            assert_string_equal(r[i].text, ref.text);
        }
    }
    printf("  %s: fault at op %lld of a request's %lld: %d of 3 requests failed\n", FAULT_BACKEND,
           (long long)(ops / 2), (long long)ops, failed);
    assert_int_equal(r[0].kind, SCHED_EV_ERROR); /* running when the fault came */
    assert_int_equal(r[2].kind, SCHED_EV_DONE);  /* queued: served after the recovery */
    sched_health h;
    sched_get_health(g_s, &h);
    assert_true(h.healthy); /* the fault did not stick: recovered at once */
    assert_int_equal(h.backend_failures, h0.backend_failures + 1);
    assert_int_equal(h.recoveries, h0.recoveries + 1);
    assert_non_null(strstr(h.last_error, "injected fault"));
    result again;
    run_one(&again);
    assert_int_equal(again.kind, SCHED_EV_DONE);
    assert_string_equal(again.text, ref.text);
}

static void test_sched_stuck_fault(void **state) {
    SKIP_WITHOUT_MODEL();
    result ref;
    run_one(&ref);
    assert_int_equal(ref.kind, SCHED_EV_DONE);
    backend_fault_arm(g_be, 1, true);
    result bad;
    run_one(&bad);
    assert_int_equal(bad.kind, SCHED_EV_ERROR);
    assert_non_null(strstr(bad.message, "injected fault"));
    /* Unhealthy across recovery attempts (one at once, then one a second). */
    double until = now_s() + (SCHED_RECOVER_EVERY_MS * 1.5) / 1000.0;
    while (now_s() < until) {
        sched_health h;
        sched_get_health(g_s, &h);
        assert_false(h.healthy);
        assert_non_null(strstr(h.last_error, "injected fault"));
        result refused;
        sched_handle *hh = NULL;
        assert_int_equal(submit(&refused, &hh), IS_ERR_BUSY);
        assert_null(hh);
        sleep_ms(100);
    }
    backend_fault_arm(g_be, 0, false);
    sched_health h = {.healthy = false};
    until = now_s() + 10.0 + SCHED_RECOVER_EVERY_MS / 1000.0;
    while (!h.healthy && now_s() < until) {
        sleep_ms(20);
        sched_get_health(g_s, &h);
    }
    assert_true(h.healthy);
    result again;
    run_one(&again);
    assert_int_equal(again.kind, SCHED_EV_DONE);
    assert_string_equal(again.text, ref.text);
}

/* ---- through the HTTP server ------------------------------------------------------------ */

static http_app *g_app;
static int g_port;
static char g_dir[] = "/tmp/test_serve_fault_XXXXXX";
static char g_ref[4096];   /* the clean kv chat's answer */
static int64_t g_chat_ops; /* backend ops of one clean kv chat */

typedef test_resp resp;
#define resp_free test_resp_free

static resp request(const char *method, const char *path, const char *body) {
    resp r = test_http_request(g_port, method, path, NULL, body, body ? strlen(body) : 0, false,
                               (long)WAIT_S);
    assert_int_equal(r.curl_rc, CURLE_OK);
    return r;
}

static const char *CHAT_KV = "{\"messages\":[{\"role\":\"user\",\"content\":\"Where does my sister "
                             "live?\"}],\"user\":\"ann\",\"memory\":{\"mode\":\"kv\",\"k\":2},"
                             "\"max_tokens\":10,\"temperature\":0}";
static const char *CHAT_KV_STREAM =
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Where does my sister live?\"}],\"user\":"
    "\"ann\",\"memory\":{\"mode\":\"kv\",\"k\":2},\"max_tokens\":10,\"temperature\":0,"
    "\"stream\":true}";

static const char *content_of(const resp *r) {
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(r->json, "choices"), 0);
    return cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content"));
}

/* A 500 or 503 chat: an OpenAI error whose message names the failure. */
static void expect_chat_error(const resp *r, long status) {
    if (r->status != status)
        fprintf(stderr, "expected %ld, got %ld: %s\n", status, r->status, r->body);
    assert_int_equal(r->status, status);
    const cJSON *e = cJSON_GetObjectItem(r->json, "error");
    assert_true(cJSON_IsObject(e));
    const char *msg = cJSON_GetStringValue(cJSON_GetObjectItem(e, "message"));
    assert_non_null(msg);
    assert_non_null(strstr(msg, "injected fault"));
}

static void health(long *status, bool *healthy, int64_t *failures, int64_t *recoveries) {
    resp r = request("GET", "/health", NULL);
    *status = r.status;
    assert_non_null(r.json);
    const cJSON *b = cJSON_GetObjectItem(r.json, "backend");
    assert_true(cJSON_IsObject(b));
    *healthy = cJSON_IsTrue(cJSON_GetObjectItem(b, "healthy"));
    *failures = (int64_t)cJSON_GetNumberValue(cJSON_GetObjectItem(b, "failures"));
    *recoveries = (int64_t)cJSON_GetNumberValue(cJSON_GetObjectItem(b, "recoveries"));
    const char *st = cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "status"));
    assert_non_null(st);
    assert_string_equal(st, *healthy ? "ok" : "unhealthy");
    if (!*healthy) {
        const char *why = cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "error"));
        assert_non_null(why);
        assert_non_null(strstr(why, "injected fault"));
    }
    resp_free(&r);
}

static void expect_clean_chat(void) {
    resp r = request("POST", "/v1/chat/completions", CHAT_KV);
    if (r.status != 200) fprintf(stderr, "chat: %ld %s\n", r.status, r.body);
    assert_int_equal(r.status, 200);
    assert_string_equal(content_of(&r), g_ref);
    resp_free(&r);
}

static int http_setup(void **state) {
    struct stat sb;
    g_model = stat(IS_DEFAULT_MODEL, &sb) == 0;
    if (!g_model) return 0;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!mkdtemp(g_dir)) return -1;
    char data[600];
    snprintf(data, sizeof data, "%s/data", g_dir);
    http_app_params p = http_app_default_params();
    p.model_path = IS_DEFAULT_MODEL;
    p.backend = FAULT_BACKEND;
    p.data_dir = data;
    p.embedder_dir = "none";
    p.n_ctx = 1024;
    p.kv_bytes = (size_t)128 << 20;
    p.sched.max_running = 4;
    p.http.port = 0;
    p.http.no_auth = true;
    p.http.quiet = true;
    if (http_app_start(&p, &g_app) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    g_port = http_app_port(g_app);
    /* Two facts, encoded by the server's scheduler in the background. */
    resp r = request("POST", "/v1/memories/",
                     "{\"user_id\":\"ann\",\"facts\":[\"Ann's sister lives in Lisbon.\","
                     "\"Ann's sister works as a nurse.\"]}");
    long st = r.status;
    resp_free(&r);
    if (st != 200) return -1;
    sched_stats ss = {0};
    for (double until = now_s() + WAIT_S; now_s() < until; sleep_ms(20)) {
        sched_get_stats(http_app_sched(g_app), &ss);
        if (ss.facts_encoded >= 2 && ss.encode_queued == 0) break;
    }
    if (ss.facts_encoded < 2) return -1;
    /* The clean answer, and how many ops a chat takes. */
    backend *be = http_app_backend(g_app);
    int64_t c0 = backend_op_count(be);
    r = request("POST", "/v1/chat/completions", CHAT_KV);
    g_chat_ops = backend_op_count(be) - c0;
    st = r.status;
    const cJSON *u = cJSON_GetObjectItem(r.json, "usage");
    int injected = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(u, "injected_tokens"));
    if (st == 200) snprintf(g_ref, sizeof g_ref, "%s", content_of(&r));
    resp_free(&r);
    if (st != 200 || g_chat_ops <= 0) return -1;
    if (injected <= 0) fprintf(stderr, "setup: the chat injected no fact KV\n");
    return injected > 0 ? 0 : -1;
}

static int http_teardown(void **state) {
    if (!g_model) return 0;
    http_app_stop(g_app);
    g_app = NULL;
    curl_global_cleanup();
    return test_remove_tree(g_dir) == 0 ? 0 : -1;
}

static void test_http_stuck_fault(void **state) {
    SKIP_WITHOUT_MODEL();
    backend *be = http_app_backend(g_app);
    long code;
    bool healthy;
    int64_t f0, r0, f, rc;
    health(&code, &healthy, &f0, &r0);
    assert_int_equal(code, 200);
    assert_true(healthy);
    backend_fault_arm(be, 1, true);
    resp r = request("POST", "/v1/chat/completions", CHAT_KV);
    expect_chat_error(&r, 500);
    assert_string_equal(
        cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "error"), "code")),
        "internal_error");
    resp_free(&r);
    health(&code, &healthy, &f, &rc);
    assert_int_equal(code, 503);
    assert_false(healthy);
    assert_int_equal(f, f0 + 1);
    r = request("POST", "/v1/chat/completions", CHAT_KV);
    expect_chat_error(&r, 503); /* refused while unhealthy */
    resp_free(&r);
    backend_fault_arm(be, 0, false);
    double until = now_s() + 10.0 + SCHED_RECOVER_EVERY_MS / 1000.0;
    do {
        sleep_ms(50);
        health(&code, &healthy, &f, &rc);
    } while (code != 200 && now_s() < until);
    assert_int_equal(code, 200);
    assert_true(healthy);
    assert_int_equal(rc, r0 + 1);
    expect_clean_chat();
}

static void test_http_fault_mid_chat(void **state) {
    SKIP_WITHOUT_MODEL();
    backend *be = http_app_backend(g_app);
    long code;
    bool healthy;
    int64_t f0, r0, f, rc;
    health(&code, &healthy, &f0, &r0);
    backend_fault_arm(be, g_chat_ops / 2, false);
    resp r = request("POST", "/v1/chat/completions", CHAT_KV);
    expect_chat_error(&r, 500);
    resp_free(&r);
    health(&code, &healthy, &f, &rc);
    assert_int_equal(code, 200); /* it did not stick: recovered at once */
    assert_int_equal(f, f0 + 1);
    assert_int_equal(rc, r0 + 1);
    expect_clean_chat();

    /* Streaming: the 200 went out before the failure, so the stream
     * carries an error event (and no finish reason). */
    backend_fault_arm(be, g_chat_ops / 2, false);
    r = request("POST", "/v1/chat/completions", CHAT_KV_STREAM);
    assert_int_equal(r.status, 200);
    assert_non_null(r.body);
    assert_non_null(strstr(r.body, "\"error\""));
    assert_non_null(strstr(r.body, "injected fault"));
    assert_null(strstr(r.body, "\"finish_reason\":\""));
    resp_free(&r);
    health(&code, &healthy, &f, &rc);
    assert_int_equal(code, 200);
    assert_int_equal(f, f0 + 2);
    expect_clean_chat();
    printf("  %s: a kv chat is %lld backend ops; faults at op 1 (stuck) and %lld answered 500, "
           "then the clean answer\n",
           FAULT_BACKEND, (long long)g_chat_ops, (long long)(g_chat_ops / 2));
}

int main(void) {
#ifdef FAULT_CUDA
    /* Without a device (CI) the program reports itself skipped. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest sched_tests[] = {
        cmocka_unit_test(test_sched_fault_mid_batch),
        cmocka_unit_test(test_sched_stuck_fault),
    };
    const struct CMUnitTest http_tests[] = {
        cmocka_unit_test(test_http_stuck_fault),
        cmocka_unit_test(test_http_fault_mid_chat),
    };
    int fails = cmocka_run_group_tests_name("scheduler", sched_tests, sched_setup, sched_teardown);
    fails += cmocka_run_group_tests_name("http", http_tests, http_setup, http_teardown);
    return fails;
}

/*
 * Concurrency stress through the real serving stack (http_app: model,
 * scheduler, memory with the sentence embedder, libmicrohttpd) on
 * 127.0.0.1, once per CPU thread setting (-t 1, -t 2).
 *
 * While one client repeats one greedy chat, three clients repeat one
 * search and one client adds facts (each add embeds on an HTTP thread and
 * queues a KV encoding on the engine thread), every output must be
 * bitwise what the same request gave alone before: the same chat text, the
 * same search response body (ids, order, scores). Afterwards every fact
 * added under load must hold exactly the embedding of its text embedded
 * alone. Fact texts come from a fixed seed; the load phase stops at a
 * fixed number of chats or at a time limit, whichever comes first.
 *
 * The numerical libraries (OpenBLAS's OpenMP build, libgomp) keep state
 * that threads share; entering them from the engine thread and the HTTP
 * threads at once is what this test exists to catch.
 *
 * Each case prints `fault-matrix: concurrency|<case>|<tries>|<outcome>`
 * (scripts/fault_matrix.sh collects them). Skips (77) without the default
 * model or the embedder.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "memory/embedder.h"
#include "memory/memory.h"
#include "memory/store.h"
#include "serve/http/app.h"
#include "test_http_client.h"
#include "test_util.h"

#define SEED         27u
#define N_SEED_FACTS 24   /* the searched user's facts, added before the load */
#define MAX_CHATS    6    /* the load phase ends after this many chats ... */
#define LOAD_SECONDS 90.0 /* ... or after this long (a safety net on a slow machine) */
#define MAX_ADDS     60
#define N_SEARCHERS  3

static char g_emb_dir[512];

/* ---- HTTP client ------------------------------------------------------------------- */

/* POSTs body to path; the response body (malloc'd) or NULL on a transport
 * error or a status other than 200 (printed). */
static char *post(int port, const char *path, const char *body) {
    test_resp r = test_http_request(port, "POST", path, NULL, body, strlen(body), false, 120L);
    if (r.curl_rc != CURLE_OK || r.status != 200) {
        fprintf(stderr, "POST %s: curl %d, status %ld: %s\n", path, r.curl_rc, r.status,
                r.body ? r.body : "");
        test_resp_free(&r);
        return NULL;
    }
    char *body_out = r.body;
    r.body = NULL;
    test_resp_free(&r);
    return body_out;
}

/* ---- deterministic texts ------------------------------------------------------------- */

static uint32_t lcg(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static const char *const WORDS[] = {
    "Caroline", "Melanie", "adopted",   "a",       "dog",   "painted", "the",     "lake",
    "at",       "sunrise", "visited",   "Paris",   "with",  "her",     "sister",  "plays",
    "violin",   "on",      "Sundays",   "bakes",   "bread", "every",   "Friday",  "studied",
    "marine",   "biology", "in",        "college", "moved", "to",      "Seattle", "last",
    "spring",   "runs",    "marathons", "and",     "reads", "poetry",  "before",  "bed",
};
#define N_WORDS ((uint32_t)(sizeof WORDS / sizeof WORDS[0]))

/* A sentence of 8-19 words drawn with the generator s. */
static void make_fact(uint32_t *s, int i, char *out, size_t cap) {
    int n = 8 + (int)(lcg(s) % 12);
    size_t len = (size_t)snprintf(out, cap, "Fact %d:", i);
    for (int w = 0; w < n && len + 24 < cap; w++)
        len += (size_t)snprintf(out + len, cap - len, " %s", WORDS[lcg(s) % N_WORDS]);
    snprintf(out + len, cap - len, ".");
}

static char *add_body(const char *user, const char *const *facts, int n) {
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "user_id", user);
    cJSON *a = cJSON_AddArrayToObject(b, "facts");
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateString(facts[i]));
    char *t = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return t;
}

static const char CHAT_BODY[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Here is a long note about my week, "
    "please read it carefully. On Monday I walked to the market, bought apples, pears and a "
    "loaf of rye bread, then met my sister for coffee near the old harbour. On Tuesday I "
    "painted the fence green and fixed the gate. On Wednesday it rained all day, so I read a "
    "novel about sailors. Now tell me in one sentence: what colour is the fence?\"}], "
    "\"max_tokens\": 24, \"temperature\": 0, \"memory\": {\"mode\": \"off\"}}";

static const char SEARCH_BODY[] =
    "{\"query\": \"who plays the violin and bakes bread on Fridays\", \"user_id\": \"searched\", "
    "\"top_k\": 5}";

/* The assistant text of a chat response (malloc'd), or NULL. */
static char *chat_text(const char *body) {
    cJSON *j = cJSON_Parse(body);
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const char *t =
        cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content"));
    char *r = t ? strdup(t) : NULL;
    cJSON_Delete(j);
    return r;
}

/* The search response without fields that legitimately vary between
 * identical requests (none today; the whole results array is compared). */
static char *search_results(const char *body) {
    cJSON *j = cJSON_Parse(body);
    char *r = cJSON_PrintUnformatted(cJSON_GetObjectItem(j, "results"));
    cJSON_Delete(j);
    return r;
}

/* ---- the load phase --------------------------------------------------------------------- */

typedef struct load {
    int port;
    double deadline; /* CLOCK_MONOTONIC seconds */
    atomic_bool stop;
    const char *chat_ref, *search_ref;
    atomic_int chats, chat_diff, searches, search_diff, adds, errors;
    uint32_t add_seed;
} load;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static bool over(load *l) { return atomic_load(&l->stop) || now_s() > l->deadline; }

static void *chat_loop(void *ud) {
    load *l = ud;
    for (int i = 0; i < MAX_CHATS && !over(l); i++) {
        char *b = post(l->port, "/v1/chat/completions", CHAT_BODY);
        char *t = b ? chat_text(b) : NULL;
        if (!t) {
            atomic_fetch_add(&l->errors, 1);
        } else if (strcmp(t, l->chat_ref) != 0) {
            atomic_fetch_add(&l->chat_diff, 1);
            fprintf(stderr, "chat differs: \"%s\"\n", t);
        }
        atomic_fetch_add(&l->chats, 1);
        free(t);
        free(b);
    }
    atomic_store(&l->stop, true);
    return NULL;
}

static void *search_loop(void *ud) {
    load *l = ud;
    while (!over(l)) {
        char *b = post(l->port, "/v1/memories/search/", SEARCH_BODY);
        char *r = b ? search_results(b) : NULL;
        if (!r) {
            atomic_fetch_add(&l->errors, 1);
        } else if (strcmp(r, l->search_ref) != 0) {
            if (atomic_fetch_add(&l->search_diff, 1) < 3)
                fprintf(stderr, "search differs: %s\n", r);
        }
        atomic_fetch_add(&l->searches, 1);
        free(r);
        free(b);
    }
    return NULL;
}

static void *add_loop(void *ud) {
    load *l = ud;
    uint32_t s = l->add_seed;
    for (int i = 0; i < MAX_ADDS && !over(l); i++) {
        char text[256];
        make_fact(&s, 1000 + i, text, sizeof text);
        const char *f[1] = {text};
        char *body = add_body("added", f, 1);
        char *b = post(l->port, "/v1/memories/", body);
        if (!b) atomic_fetch_add(&l->errors, 1);
        else atomic_fetch_add(&l->adds, 1);
        free(b);
        free(body);
        usleep(150 * 1000); /* spread the adds over the whole load */
    }
    return NULL;
}

/* Waits (bounded) until the scheduler has nothing running, queued or to
 * encode, so the next request runs alone. */
static void wait_idle(int port) {
    for (int i = 0; i < 4800; i++) { /* 4 minutes: encoding is slow on a busy machine */
        test_resp r = test_http_request(port, "GET", "/health", NULL, NULL, 0, false, 10L);
        const cJSON *s = cJSON_GetObjectItem(r.json, "scheduler");
        int busy = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(s, "running")) +
                   (int)cJSON_GetNumberValue(cJSON_GetObjectItem(s, "queued")) +
                   (int)cJSON_GetNumberValue(cJSON_GetObjectItem(s, "encode_queued")) +
                   (int)cJSON_GetNumberValue(cJSON_GetObjectItem(s, "encode_running"));
        bool idle = s && busy == 0;
        test_resp_free(&r);
        if (idle) return;
        usleep(50 * 1000);
    }
    fail_msg("the scheduler did not become idle");
}

/* ---- one thread setting ------------------------------------------------------------------ */

static void run_setting(int32_t threads) {
    char dir[] = "/tmp/test_http_stress_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char data[600];
    snprintf(data, sizeof data, "%s/data", dir);

    http_app_params p = http_app_default_params();
    p.model_path = IS_DEFAULT_MODEL;
    p.data_dir = data;
    p.embedder_dir = g_emb_dir;
    p.threads = threads;
    p.n_ctx = 1024;
    p.kv_bytes = (size_t)128 << 20;
    p.http.port = 0;
    p.http.no_auth = true;
    p.http.limits.max_in_flight = 16;
    FILE *devnull = fopen("/dev/null", "w");
    p.http.log = devnull;
    p.notes = devnull;
    http_app *app = NULL;
    if (http_app_start(&p, &app) != IS_OK) fail_msg("http_app_start: %s", is_error_last());
    const int port = http_app_port(app);

    /* The searched user's facts, then each reference request alone. */
    uint32_t s = SEED;
    char texts[N_SEED_FACTS][256];
    const char *tp[N_SEED_FACTS];
    for (int i = 0; i < N_SEED_FACTS; i++) {
        make_fact(&s, i, texts[i], sizeof texts[i]);
        tp[i] = texts[i];
    }
    char *body = add_body("searched", tp, N_SEED_FACTS);
    char *b = post(port, "/v1/memories/", body);
    assert_non_null(b);
    free(b);
    free(body);
    wait_idle(port);
    b = post(port, "/v1/chat/completions", CHAT_BODY);
    assert_non_null(b);
    char *chat_ref = chat_text(b);
    free(b);
    assert_non_null(chat_ref);
    b = post(port, "/v1/memories/search/", SEARCH_BODY);
    assert_non_null(b);
    char *search_ref = search_results(b);
    free(b);
    assert_non_null(search_ref);
    assert_true(strlen(search_ref) > 10);

    /* The load. */
    load l = {.port = port,
              .deadline = now_s() + LOAD_SECONDS,
              .chat_ref = chat_ref,
              .search_ref = search_ref,
              .add_seed = SEED * 7919u};
    pthread_t tc, ta, ts[N_SEARCHERS];
    assert_int_equal(pthread_create(&tc, NULL, chat_loop, &l), 0);
    assert_int_equal(pthread_create(&ta, NULL, add_loop, &l), 0);
    for (int i = 0; i < N_SEARCHERS; i++)
        assert_int_equal(pthread_create(&ts[i], NULL, search_loop, &l), 0);
    pthread_join(tc, NULL);
    atomic_store(&l.stop, true);
    pthread_join(ta, NULL);
    for (int i = 0; i < N_SEARCHERS; i++) pthread_join(ts[i], NULL);
    wait_idle(port);

    /* Every fact added under load against its text embedded alone (with the
     * server's thread setting, after the load). */
    embedder *e = NULL;
    if (embedder_load(g_emb_dir, &e) != IS_OK) fail_msg("embedder_load: %s", is_error_last());
    embedder_set_n_threads(e, threads);
    const int32_t dim = embedder_dim(e);
    mem_filter f = {.tenant = "default", .user = "added"};
    mem_fact *facts = NULL;
    int32_t n_facts = 0;
    assert_int_equal(
        mem_store_list(memory_fact_store(http_app_memory(app)), &f, true, &facts, &n_facts), IS_OK);
    float *ref = malloc((size_t)dim * sizeof(float));
    int emb_diff = 0;
    for (int32_t i = 0; i < n_facts; i++) {
        const char *t = facts[i].text;
        assert_int_equal(embedder_embed(e, &t, 1, ref), IS_OK);
        if (!facts[i].embedding ||
            memcmp(ref, facts[i].embedding, (size_t)dim * sizeof(float)) != 0) {
            double dot = 0;
            for (int32_t d = 0; facts[i].embedding && d < dim; d++)
                dot += ref[d] * facts[i].embedding[d];
            fprintf(stderr, "stored embedding differs (cosine %.4f): %s\n", dot, t);
            emb_diff++;
        }
    }
    free(ref);
    mem_facts_free(facts, n_facts);
    embedder_free(e);
    http_app_stop(app);
    fclose(devnull);
    test_remove_tree(dir);

    const int chats = atomic_load(&l.chats), searches = atomic_load(&l.searches);
    const int chat_diff = atomic_load(&l.chat_diff), search_diff = atomic_load(&l.search_diff);
    const int errors = atomic_load(&l.errors);
    printf("t=%d: %d chats (%d differ), %d searches (%d differ), %d adds (%d of %d stored "
           "embeddings differ), %d errors\n",
           threads, chats, chat_diff, searches, search_diff, atomic_load(&l.adds), emb_diff,
           n_facts, errors);
    printf("fault-matrix: concurrency|-t %d: identical greedy chats under load|%d|%s\n", threads,
           chats, chat_diff ? "FAIL: answers differ" : "all identical");
    printf("fault-matrix: concurrency|-t %d: identical searches under load|%d|%s\n", threads,
           searches, search_diff ? "FAIL: top-k differs" : "all identical");
    printf("fault-matrix: concurrency|-t %d: embeddings of facts added under load|%d|%s\n", threads,
           n_facts, emb_diff ? "FAIL: stored embedding differs" : "all bitwise equal");
    fflush(stdout);
    free(chat_ref);
    free(search_ref);
    assert_int_equal(errors, 0);
    assert_true(chats >= 2 && searches >= 10 && n_facts >= 2); /* the load did overlap */
    assert_int_equal(chat_diff, 0);
    assert_int_equal(search_diff, 0);
    assert_int_equal(emb_diff, 0);
}

static void test_stress_t1(void **state) { run_setting(1); }
static void test_stress_t2(void **state) { run_setting(2); }

int main(void) {
    struct stat sb;
    snprintf(g_emb_dir, sizeof g_emb_dir, "%s/models/all-MiniLM-L6-v2", IS_SOURCE_DIR);
    if (stat(IS_DEFAULT_MODEL, &sb) != 0 || stat(g_emb_dir, &sb) != 0) {
        fprintf(stderr,
                "test_http_stress: the default model or the embedder is missing: skipped\n");
        return 77;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress_t1),
        cmocka_unit_test(test_stress_t2),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    curl_global_cleanup();
    return rc;
}

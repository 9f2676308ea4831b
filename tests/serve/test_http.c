/*
 * The HTTP API end to end: the real server (http_app: model, scheduler,
 * memory, libmicrohttpd) on 127.0.0.1 with a port picked by the kernel,
 * driven with libcurl.
 *
 * Covered: health, models, metrics; API keys; every memory route, with
 * filters, history after update and delete; tenant isolation (tenant A
 * can neither list, get, search, update, delete nor have injected tenant
 * B's memories); chat without and with memory (kv and prompt modes, an
 * unknown user), streaming (SSE chunks, final usage chunk, [DONE], the
 * same text as without streaming); bad input (malformed JSON, wrong types,
 * oversize bodies with and without Content-Length, invalid UTF-8, k out of
 * range, prompts past the context and past the prompt limit, unknown
 * routes and methods), each a 4xx with an OpenAI error object while the
 * server keeps serving; a client that disconnects mid-stream (its request
 * cancelled and its KV blocks freed, then a request that succeeds); the
 * in-flight limit (429); infer=true extraction through the scheduler; the
 * request log; and a clean stop after which the data directory reopens
 * with every fact intact.
 *
 * Without the default model the memory routes still run (a server without
 * a model) and the chat tests skip.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "memory/memory.h"
#include "test_http_client.h"
#include "test_util.h"
#include "serve/http/app.h"

#define KEY_A         "sk-test-tenant-a-0001"
#define KEY_B         "sk-test-tenant-b-0002"
#define N_CTX         2048
#define MAX_PROMPT    3000
#define MAX_BODY      (64 * 1024)
#define MAX_IN_FLIGHT 3

static http_app *g_app;
static bool g_model;
static bool g_dense; /* the server retrieves with MiniLM (else BM25 alone) */
static int g_port;
static char g_dir[] = "/tmp/test_http_XXXXXX";
static char g_data[512], g_keys[512], g_log[512];
static FILE *g_logf;
static int g_requests; /* requests made, for the log check */

/* ---- HTTP client ------------------------------------------------------------------- */

typedef test_resp resp;
#define resp_free test_resp_free

/* One request. key NULL: no Authorization header. chunked: send the body
 * without Content-Length. */
static resp request_ex(const char *method, const char *path, const char *key, const char *body,
                       size_t len, bool chunked) {
    g_requests++;
    return test_http_request(g_port, method, path, key, body, len, chunked, 120L);
}

static resp request(const char *method, const char *path, const char *key, const char *body) {
    return request_ex(method, path, key, body, body ? strlen(body) : 0, false);
}

/* Checks an OpenAI error: status, code and (if given) param. */
static void expect_error(resp *r, long status, const char *code, const char *param) {
    if (r->status != status || !r->json)
        fprintf(stderr, "expected %ld %s, got %ld: %s\n", status, code, r->status,
                r->body ? r->body : "(no body)");
    assert_int_equal(r->status, status);
    assert_non_null(r->json);
    const cJSON *e = cJSON_GetObjectItem(r->json, "error");
    assert_true(cJSON_IsObject(e));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    const cJSON *c = cJSON_GetObjectItem(e, "code");
    if (code) {
        if (!cJSON_IsString(c) || strcmp(c->valuestring, code) != 0)
            fprintf(stderr, "expected code %s: %s\n", code, r->body);
        assert_true(cJSON_IsString(c));
        assert_string_equal(c->valuestring, code);
    }
    if (param) {
        const cJSON *p = cJSON_GetObjectItem(e, "param");
        if (!cJSON_IsString(p) || strcmp(p->valuestring, param) != 0)
            fprintf(stderr, "expected param %s: %s\n", param, r->body);
        assert_true(cJSON_IsString(p));
        assert_string_equal(p->valuestring, param);
    }
}

static void expect_ok(resp *r) {
    if (r->status != 200)
        fprintf(stderr, "expected 200, got %ld: %s\n", r->status, r->body ? r->body : "");
    assert_int_equal(r->status, 200);
    assert_non_null(r->json);
}

/* The request log at path, a JSON array of its lines; *bad (may be NULL)
 * counts the lines that do not parse. */
static cJSON *read_log(const char *path, int *bad) {
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    cJSON *all = cJSON_CreateArray();
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        cJSON *j = cJSON_Parse(line);
        if (j) cJSON_AddItemToArray(all, j);
        else if (bad) (*bad)++;
    }
    free(line);
    fclose(f);
    return all;
}

/* ---- raw sockets, for what libcurl does not do ------------------------------------- */

/* Sends a POST with "Connection: close" on a new connection; the fd. */
static int raw_post(int port, const char *path, const char *key, const char *body) {
    int fd = test_connect_loopback(port);
    assert_true(fd >= 0);
    char head[512];
    int hl = snprintf(head, sizeof head,
                      "POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s%s%s"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      path, key ? "Authorization: Bearer " : "", key ? key : "", key ? "\r\n" : "",
                      strlen(body));
    assert_int_equal(send(fd, head, (size_t)hl, MSG_NOSIGNAL), hl);
    assert_int_equal(send(fd, body, strlen(body), MSG_NOSIGNAL), (ssize_t)strlen(body));
    return fd;
}

/* Reads until the server closes (or timeout_s pass) and closes fd: the
 * status (0 if none came) and the body after the head (owned). */
static char *raw_read_close(int fd, int timeout_s, long *status) {
    size_t cap = 1 << 16, len = 0;
    char *t = calloc(1, cap + 1);
    assert_non_null(t);
    time_t end = time(NULL) + timeout_s;
    while (time(NULL) < end && len < cap) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) <= 0) continue;
        ssize_t n = recv(fd, t + len, cap - len, 0);
        if (n <= 0) break;
        len += (size_t)n;
    }
    close(fd);
    *status = 0;
    sscanf(t, "HTTP/1.%*d %ld", status);
    char *b = strstr(t, "\r\n\r\n");
    char *body = strdup(b ? b + 4 : "");
    free(t);
    return body;
}

/* ---- helpers over the API ------------------------------------------------------------ */

/* Adds facts for user (with optional agent_id / metadata JSON); ids into ids[]. */
static int add_facts(const char *key, const char *user, const char *agent, const char *metadata,
                     const char *const *facts, int n, char ids[][80]) {
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "user_id", user);
    if (agent) cJSON_AddStringToObject(b, "agent_id", agent);
    if (metadata) cJSON_AddItemToObject(b, "metadata", cJSON_Parse(metadata));
    cJSON *arr = cJSON_AddArrayToObject(b, "facts");
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateString(facts[i]));
    char *txt = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    resp r = request("POST", "/v1/memories/", key, txt);
    free(txt);
    expect_ok(&r);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results"), *it;
    assert_int_equal(cJSON_GetArraySize(res), n);
    int i = 0;
    cJSON_ArrayForEach(it, res) {
        assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(it, "event")), "ADD");
        assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(it, "memory")), facts[i]);
        snprintf(ids[i], 80, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(it, "id")));
        i++;
    }
    resp_free(&r);
    return i;
}

/* Number of results of GET /v1/memories/?query, and whether id is among them. */
static int list_count(const char *key, const char *query, const char *id, bool *has) {
    char path[512];
    snprintf(path, sizeof path, "/v1/memories/?%s", query);
    resp r = request("GET", path, key, NULL);
    expect_ok(&r);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results"), *it;
    assert_true(cJSON_IsArray(res));
    if (has) *has = false;
    cJSON_ArrayForEach(it, res) {
        if (id && has && strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(it, "id")), id) == 0)
            *has = true;
    }
    int n = cJSON_GetArraySize(res);
    resp_free(&r);
    return n;
}

/* The value of an integer field of /health's scheduler object. */
static int health_sched(const char *field) {
    resp r = request("GET", "/health", NULL, NULL);
    expect_ok(&r);
    const cJSON *s = cJSON_GetObjectItem(r.json, "scheduler");
    assert_non_null(s);
    int v = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(s, field));
    resp_free(&r);
    return v;
}

/* A metric's value from /metrics (the first line starting with `line`). */
static double metric(const char *line) {
    resp r = request("GET", "/metrics", NULL, NULL);
    assert_int_equal(r.status, 200);
    double v = -1;
    size_t l = strlen(line);
    for (char *p = r.body; p && *p;) {
        if (strncmp(p, line, l) == 0 && p[l] == ' ') {
            v = strtod(p + l + 1, NULL);
            break;
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    resp_free(&r);
    return v;
}

/* Waits until the engine is idle: nothing running, queued or encoding. */
static void wait_idle(void) {
    for (int i = 0; i < 600; i++) {
        if (health_sched("running") == 0 && health_sched("queued") == 0 &&
            health_sched("encode_queued") == 0 && health_sched("encode_running") == 0)
            return;
        usleep(50 * 1000);
    }
    fail_msg("the scheduler did not become idle");
}

static char *chat_body(const char *user, const char *mode, int k, const char *content,
                       int max_tokens, bool stream) {
    cJSON *b = cJSON_CreateObject();
    cJSON *msgs = cJSON_AddArrayToObject(b, "messages"), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", content);
    cJSON_AddItemToArray(msgs, m);
    cJSON_AddNumberToObject(b, "max_tokens", max_tokens);
    cJSON_AddNumberToObject(b, "temperature", 0);
    cJSON_AddNumberToObject(b, "seed", 7);
    if (stream) cJSON_AddTrueToObject(b, "stream");
    if (user) cJSON_AddStringToObject(b, "user", user);
    if (mode || k >= 0) {
        cJSON *mem = cJSON_AddObjectToObject(b, "memory");
        if (mode) cJSON_AddStringToObject(mem, "mode", mode);
        if (k >= 0) cJSON_AddNumberToObject(mem, "k", k);
    }
    char *txt = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return txt;
}

/* ---- setup ---------------------------------------------------------------------------- */

static int setup(void **state) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!mkdtemp(g_dir)) return -1;
    snprintf(g_data, sizeof g_data, "%s/data", g_dir);
    snprintf(g_keys, sizeof g_keys, "%s/keys.txt", g_dir);
    snprintf(g_log, sizeof g_log, "%s/requests.log", g_dir);
    FILE *f = fopen(g_keys, "w");
    if (!f) return -1;
    fprintf(f, "# test keys\n%s tenant-a\n\n%s   tenant-b\n", KEY_A, KEY_B);
    fclose(f);
    if (!(g_logf = fopen(g_log, "w"))) return -1;
    struct stat sb;
    /* IS_TEST_NO_MODEL=1 runs the no-model configuration even where the model is. */
    g_model = stat(IS_DEFAULT_MODEL, &sb) == 0 && !getenv("IS_TEST_NO_MODEL");
    http_app_params p = http_app_default_params();
    p.model_path = g_model ? IS_DEFAULT_MODEL : NULL;
    if (!g_model) fprintf(stderr, "test_http: %s missing: chat tests skip\n", IS_DEFAULT_MODEL);
    p.data_dir = g_data;
    p.keys_path = g_keys;
    char emb[512];
    snprintf(emb, sizeof emb, "%s/models/all-MiniLM-L6-v2", IS_SOURCE_DIR);
    /* IS_TEST_NO_EMBEDDER=1 runs with BM25 retrieval only even where MiniLM is. */
    g_dense = stat(emb, &sb) == 0 && !getenv("IS_TEST_NO_EMBEDDER");
    p.embedder_dir = g_dense ? emb : "none";
    p.n_ctx = N_CTX;
    p.kv_bytes = (size_t)256 << 20;
    p.sched.max_running = 4;
    p.http.port = 0;
    p.http.limits.max_body_bytes = MAX_BODY;
    p.http.limits.max_prompt_tokens = MAX_PROMPT;
    p.http.limits.max_in_flight = MAX_IN_FLIGHT;
    /* The global limit alone (one tenant fills it below); the per-tenant
     * limit is test_http_hostile's. */
    p.http.limits.max_in_flight_tenant = 0;
    p.http.limits.extract_max_tokens = 48;
    p.http.log = g_logf;
    if (http_app_start(&p, &g_app) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    g_port = http_app_port(g_app);
    return g_port > 0 ? 0 : -1;
}

static int teardown(void **state) {
    http_app_stop(g_app);
    g_app = NULL;
    if (g_logf) fclose(g_logf);
    if (test_remove_tree(g_dir) != 0) return -1;
    curl_global_cleanup();
    return 0;
}

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);                                                 \
    } while (0)

/* ---- tests ------------------------------------------------------------------------------ */

static void test_health_models_metrics(void **state) {
    resp r = request("GET", "/health", NULL, NULL);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "status")), "ok");
    assert_true(cJSON_IsBool(cJSON_GetObjectItem(r.json, "chat")));
    resp_free(&r);

    r = request("GET", "/v1/models", NULL, NULL);
    expect_error(&r, 401, "invalid_api_key", NULL);
    resp_free(&r);
    r = request("GET", "/v1/models", KEY_A, NULL);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "object")), "list");
    const cJSON *data = cJSON_GetObjectItem(r.json, "data");
    assert_int_equal(cJSON_GetArraySize(data), g_model ? 1 : 0);
    if (g_model) {
        const char *id =
            cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(data, 0), "id"));
        assert_string_equal(id, "SmolLM2-135M-Instruct.Q4_1");
        resp_free(&r);
        r = request("GET", "/v1/models/SmolLM2-135M-Instruct.Q4_1", KEY_A, NULL);
        expect_ok(&r);
        resp_free(&r);
        r = request("GET", "/v1/models/gpt-4", KEY_A, NULL);
        expect_error(&r, 404, "model_not_found", "model");
    }
    resp_free(&r);

    r = request("GET", "/metrics", NULL, NULL);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "# TYPE inferscale_ttft_seconds histogram"));
    assert_non_null(strstr(r.body, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"+Inf\"}"));
    assert_non_null(strstr(r.body, "inferscale_request_duration_seconds_bucket{mode=\"prompt\""));
    assert_non_null(strstr(r.body, "inferscale_tokens_per_second"));
    assert_non_null(strstr(r.body, "inferscale_fact_kv_tier_total{tier=\"host\",result=\"hit\"}"));
    if (g_model) {
        assert_non_null(strstr(r.body, "inferscale_queue_depth "));
        assert_non_null(strstr(r.body, "inferscale_batch_tokens "));
        assert_non_null(strstr(r.body, "inferscale_kv_blocks_used "));
        assert_non_null(strstr(r.body, "inferscale_kv_blocks_free "));
        assert_non_null(strstr(r.body, "inferscale_fact_kv_total{result=\"miss\"}"));
    }
    resp_free(&r);
}

static void test_auth(void **state) {
    const char *body = "{\"query\":\"x\",\"user_id\":\"u\"}";
    resp r = request("POST", "/v1/memories/search/", NULL, body);
    expect_error(&r, 401, "invalid_api_key", NULL);
    resp_free(&r);
    r = request("POST", "/v1/memories/search/", "sk-test-not-a-key-000", body);
    expect_error(&r, 401, "invalid_api_key", NULL);
    resp_free(&r);
    /* A prefix of a real key is not the key. */
    r = request("POST", "/v1/memories/search/", "sk-test-tenant-a-000", body);
    expect_error(&r, 401, "invalid_api_key", NULL);
    resp_free(&r);
    r = request("POST", "/v1/memories/search/", KEY_A, body);
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 0);
    resp_free(&r);
    /* The scheme is case-insensitive; other schemes are refused. */
    CURL *c = curl_easy_init();
    resp r2 = {0};
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/models", g_port);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, test_http_on_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r2);
    struct curl_slist *h = curl_slist_append(NULL, "Authorization: bearer " KEY_B);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r2.status);
    assert_int_equal(r2.status, 200);
    curl_slist_free_all(h);
    free(r2.body);
    r2 = (resp){0};
    /* Mem0's clients send "Token KEY". */
    h = curl_slist_append(NULL, "Authorization: Token " KEY_B);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r2.status);
    assert_int_equal(r2.status, 200);
    curl_slist_free_all(h);
    free(r2.body);
    r2 = (resp){0};
    h = curl_slist_append(NULL, "Authorization: Tokens " KEY_B);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r2.status);
    assert_int_equal(r2.status, 401);
    curl_slist_free_all(h);
    free(r2.body);
    r2 = (resp){0};
    h = curl_slist_append(NULL, "Authorization: Basic " KEY_B);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r2.status);
    assert_int_equal(r2.status, 401);
    curl_slist_free_all(h);
    free(r2.body);
    curl_easy_cleanup(c);
    g_requests += 4; /* bearer, Token, Tokens, Basic */
}

static void test_memory_routes(void **state) {
    static const char *const facts[] = {"Dana plays the violin in a quartet",
                                        "Dana lives in Porto with two cats",
                                        "Dana is allergic to peanuts"};
    char ids[3][80], extra[1][80];
    add_facts(KEY_A, "dana", "assistant-1", "{\"source\":\"chat\",\"session\":3}", facts, 2, ids);
    static const char *const f3[] = {"Dana is allergic to peanuts"};
    add_facts(KEY_A, "dana", NULL, "{\"source\":\"form\"}", f3, 1, extra);
    snprintf(ids[2], 80, "%s", extra[0]);

    /* messages with infer=false: one memory per user/assistant message. */
    resp r = request("POST", "/v1/memories/", KEY_A,
                     "{\"user_id\":\"dana\",\"infer\":false,\"messages\":["
                     "{\"role\":\"system\",\"content\":\"ignored\"},"
                     "{\"role\":\"user\",\"content\":\"I started learning Portuguese\"},"
                     "{\"role\":\"assistant\",\"content\":\"Good luck with Portuguese!\"}]}");
    expect_ok(&r);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results");
    assert_int_equal(cJSON_GetArraySize(res), 2);
    char msg_id[80];
    snprintf(msg_id, sizeof msg_id, "%s",
             cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(res, 0), "id")));
    resp_free(&r);

    /* List, and list by filters. */
    assert_int_equal(list_count(KEY_A, "user_id=dana", NULL, NULL), 5);
    bool has;
    assert_int_equal(list_count(KEY_A, "user_id=dana&agent_id=assistant-1", ids[0], &has), 2);
    assert_true(has);
    assert_int_equal(
        list_count(KEY_A, "user_id=dana&metadata=%7B%22source%22%3A%22form%22%7D", ids[2], &has),
        1);
    assert_true(has);
    assert_int_equal(list_count(KEY_A, "user_id=dana&metadata=%7B%22session%22%3A3%7D", NULL, NULL),
                     2);
    assert_int_equal(list_count(KEY_A, "user_id=dana&run_id=nope", NULL, NULL), 0);
    assert_int_equal(list_count(KEY_A, "user_id=nobody", NULL, NULL), 0);
    r = request("GET", "/v1/memories/", KEY_A, NULL);
    expect_error(&r, 400, "missing_field", "user_id");
    resp_free(&r);

    /* Get one. */
    char path[256];
    snprintf(path, sizeof path, "/v1/memories/%s/", ids[1]);
    r = request("GET", path, KEY_A, NULL);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "memory")), facts[1]);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "user_id")), "dana");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "agent_id")),
                        "assistant-1");
    assert_int_equal((int)cJSON_GetNumberValue(
                         cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "metadata"), "session")),
                     3);
    resp_free(&r);
    snprintf(path, sizeof path, "/v1/memories/%s", ids[1]); /* no trailing slash */
    r = request("GET", path, KEY_A, NULL);
    expect_ok(&r);
    resp_free(&r);

    /* Search, with filters. BM25 alone needs a word of the fact ("quartet"); MiniLM does not. */
    r = request(
        "POST", "/v1/memories/search/", KEY_A,
        g_dense
            ? "{\"query\":\"Which instrument does Dana play?\",\"user_id\":\"dana\",\"top_k\":2}"
            : "{\"query\":\"Which instrument does Dana play in a "
              "quartet?\",\"user_id\":\"dana\",\"top_k\":2}");
    expect_ok(&r);
    res = cJSON_GetObjectItem(r.json, "results");
    assert_int_equal(cJSON_GetArraySize(res), 2);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(res, 0), "id")),
                        ids[0]);
    assert_true(cJSON_IsNumber(cJSON_GetObjectItem(cJSON_GetArrayItem(res, 0), "score")));
    resp_free(&r);
    r = request("POST", "/v1/memories/search/", KEY_A,
                "{\"query\":\"violin "
                "Dana\",\"filters\":{\"user_id\":\"dana\",\"metadata\":{\"source\":\"form\"}}}");
    expect_ok(&r);
    res = cJSON_GetObjectItem(r.json, "results");
    assert_int_equal(cJSON_GetArraySize(res), 1); /* "Dana" is the word BM25 alone matches */
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(res, 0), "id")),
                        ids[2]);
    resp_free(&r);

    /* Update, then history shows ADD and UPDATE. */
    snprintf(path, sizeof path, "/v1/memories/%s/", ids[0]);
    r = request("PUT", path, KEY_A, "{\"text\":\"Dana plays the cello in a quartet\"}");
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "memory")),
                        "Dana plays the cello in a quartet");
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "version")), 2);
    resp_free(&r);
    r = request("PUT", path, KEY_A, "{\"metadata\":{\"source\":\"edited\"}}");
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "memory")),
                        "Dana plays the cello in a quartet");
    assert_string_equal(cJSON_GetStringValue(
                            cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "metadata"), "source")),
                        "edited");
    resp_free(&r);
    r = request("PUT", path, KEY_A, "{}");
    expect_error(&r, 400, "missing_field", NULL);
    resp_free(&r);
    snprintf(path, sizeof path, "/v1/memories/%s/history/", ids[0]);
    r = request("GET", path, KEY_A, NULL);
    expect_ok(&r);
    assert_true(cJSON_IsArray(r.json));
    assert_int_equal(cJSON_GetArraySize(r.json), 3); /* ADD, UPDATE (text), UPDATE (metadata) */
    const cJSON *h0 = cJSON_GetArrayItem(r.json, 0), *h1 = cJSON_GetArrayItem(r.json, 1);
    const cJSON *hm = cJSON_GetArrayItem(r.json, 2);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(hm, "event")), "UPDATE");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(hm, "new_memory")),
                        "Dana plays the cello in a quartet");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h0, "event")), "ADD");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h0, "new_memory")), facts[0]);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h1, "event")), "UPDATE");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h1, "old_memory")), facts[0]);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h1, "new_memory")),
                        "Dana plays the cello in a quartet");
    resp_free(&r);

    /* Delete one: gone, history keeps it. */
    snprintf(path, sizeof path, "/v1/memories/%s/", ids[0]);
    r = request("DELETE", path, KEY_A, NULL);
    expect_ok(&r);
    resp_free(&r);
    r = request("GET", path, KEY_A, NULL);
    expect_error(&r, 404, "memory_not_found", NULL);
    resp_free(&r);
    r = request("DELETE", path, KEY_A, NULL);
    expect_error(&r, 404, "memory_not_found", NULL);
    resp_free(&r);
    snprintf(path, sizeof path, "/v1/memories/%s/history", ids[0]);
    r = request("GET", path, KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(r.json), 4);
    const cJSON *h2 = cJSON_GetArrayItem(r.json, 3);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h2, "event")), "DELETE");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(h2, "old_memory")),
                        "Dana plays the cello in a quartet");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(h2, "new_memory")));
    resp_free(&r);
    r = request("GET", "/v1/memories/00000000-0000-4000-8000-000000000000/history/", KEY_A, NULL);
    expect_error(&r, 404, "memory_not_found", NULL);
    resp_free(&r);

    /* Delete by filter: a filter is required, and only what matches goes. */
    r = request("DELETE", "/v1/memories/", KEY_A, NULL);
    expect_error(&r, 400, "missing_field", "user_id");
    resp_free(&r);
    r = request("DELETE", "/v1/memories/?user_id=dana&agentid=x", KEY_A, NULL);
    expect_error(&r, 400, "unknown_field", "agentid");
    resp_free(&r);
    assert_int_equal(list_count(KEY_A, "user_id=dana", NULL, NULL), 4);
    r = request("DELETE", "/v1/memories/?user_id=dana&metadata=%7B%22source%22%3A%22form%22%7D",
                KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "deleted")), 1);
    resp_free(&r);
    assert_int_equal(list_count(KEY_A, "user_id=dana", ids[1], &has), 3);
    assert_true(has);
    assert_int_equal(list_count(KEY_A, "user_id=dana", msg_id, &has), 3);
    assert_true(has);
    r = request("DELETE", "/v1/memories/?user_id=dana", KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "deleted")), 3);
    resp_free(&r);
    assert_int_equal(list_count(KEY_A, "user_id=dana", NULL, NULL), 0);
}

/* Tenant B's memories of a user named like one of tenant A's. */
static char g_b_ids[2][80], g_a_ids[2][80];

static void test_isolation(void **state) {
    static const char *const fb[] = {"Erin keeps bees on the roof of her flat",
                                     "Erin's bank PIN is written in her blue notebook"};
    static const char *const fa[] = {"Erin runs marathons", "Erin works as a nurse"};
    add_facts(KEY_B, "erin", NULL, NULL, fb, 2, g_b_ids);
    add_facts(KEY_A, "erin", NULL, NULL, fa, 2, g_a_ids);
    static const char *const fz[] = {"Zed only exists in tenant B"};
    char zid[1][80];
    add_facts(KEY_B, "zed", NULL, NULL, fz, 1, zid);

    /* List: A sees its two, never B's. */
    bool has;
    assert_int_equal(list_count(KEY_A, "user_id=erin", g_b_ids[0], &has), 2);
    assert_false(has);
    assert_int_equal(list_count(KEY_A, "user_id=zed", NULL, NULL), 0);
    /* Get, update, delete, history of B's ids from A: 404, as if they never existed. */
    for (int i = 0; i < 2; i++) {
        char path[256];
        snprintf(path, sizeof path, "/v1/memories/%s/", g_b_ids[i]);
        resp r = request("GET", path, KEY_A, NULL);
        expect_error(&r, 404, "memory_not_found", NULL);
        resp_free(&r);
        r = request("PUT", path, KEY_A, "{\"text\":\"overwritten by tenant A\"}");
        expect_error(&r, 404, "memory_not_found", NULL);
        resp_free(&r);
        r = request("DELETE", path, KEY_A, NULL);
        expect_error(&r, 404, "memory_not_found", NULL);
        resp_free(&r);
        snprintf(path, sizeof path, "/v1/memories/%s/history/", g_b_ids[i]);
        r = request("GET", path, KEY_A, NULL);
        expect_error(&r, 404, "memory_not_found", NULL);
        resp_free(&r);
    }
    /* Search with B's very words: only A's facts come back. */
    resp r = request(
        "POST", "/v1/memories/search/", KEY_A,
        "{\"query\":\"bees roof bank PIN blue notebook\",\"user_id\":\"erin\",\"top_k\":10}");
    expect_ok(&r);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results"), *it;
    assert_true(cJSON_GetArraySize(res) <= 2);
    cJSON_ArrayForEach(it, res) {
        const char *id = cJSON_GetStringValue(cJSON_GetObjectItem(it, "id"));
        assert_true(strcmp(id, g_a_ids[0]) == 0 || strcmp(id, g_a_ids[1]) == 0);
    }
    resp_free(&r);
    r = request("POST", "/v1/memories/search/", KEY_A,
                "{\"query\":\"exists\",\"user_id\":\"zed\"}");
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 0);
    resp_free(&r);
    /* Delete-all of A's erin leaves B's erin alone. */
    r = request("DELETE", "/v1/memories/?user_id=erin", KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "deleted")), 2);
    resp_free(&r);
    assert_int_equal(list_count(KEY_B, "user_id=erin", g_b_ids[1], &has), 2);
    assert_true(has);
    /* B's facts are unchanged. */
    char path[256];
    snprintf(path, sizeof path, "/v1/memories/%s/", g_b_ids[0]);
    r = request("GET", path, KEY_B, NULL);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "memory")), fb[0]);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "version")), 1);
    resp_free(&r);
    add_facts(KEY_A, "erin", NULL, NULL, fa, 2, g_a_ids); /* for the chat part */

    if (!g_model) return;
    /* Injection: A's chat as erin uses A's facts only; as zed, none. ("Erin" lets BM25
     * alone find A's facts; the rest of the query is about B's.) */
    char *body =
        chat_body("erin", "kv", 10, "What do you know about Erin, my bees and my PIN?", 4, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    const cJSON *mem = cJSON_GetObjectItem(r.json, "memory");
    assert_non_null(mem);
    const cJSON *used = cJSON_GetObjectItem(mem, "facts");
    assert_int_equal(cJSON_GetArraySize(used), 2);
    cJSON_ArrayForEach(it, used) {
        const char *id = cJSON_GetStringValue(it);
        assert_true(strcmp(id, g_a_ids[0]) == 0 || strcmp(id, g_a_ids[1]) == 0);
    }
    resp_free(&r);
    body = chat_body("zed", "kv", 10, "Where do I exist?", 4, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    mem = cJSON_GetObjectItem(r.json, "memory");
    assert_false(cJSON_IsTrue(cJSON_GetObjectItem(mem, "user_known")));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(mem, "facts")), 0);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(
                         cJSON_GetObjectItem(r.json, "usage"), "memory_tokens")),
                     0);
    resp_free(&r);
}

static const char *content_of(const cJSON *chat) {
    const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(chat, "choices"), 0);
    return cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(c0, "message"), "content"));
}

static int usage_of(const cJSON *chat, const char *field) {
    return (int)cJSON_GetNumberValue(
        cJSON_GetObjectItem(cJSON_GetObjectItem(chat, "usage"), field));
}

static void test_chat_plain(void **state) {
    SKIP_WITHOUT_MODEL();
    char *body = chat_body(NULL, NULL, -1, "Name a colour.", 5, false);
    resp r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "object")),
                        "chat.completion");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "model")),
                        "SmolLM2-135M-Instruct.Q4_1");
    assert_non_null(content_of(r.json));
    const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(r.json, "choices"), 0);
    const char *fin = cJSON_GetStringValue(cJSON_GetObjectItem(c0, "finish_reason"));
    assert_true(strcmp(fin, "stop") == 0 || strcmp(fin, "length") == 0);
    int ct = usage_of(r.json, "completion_tokens"), pt = usage_of(r.json, "prompt_tokens");
    assert_true(ct >= 1 && ct <= 5);
    assert_true(pt > 5);
    assert_int_equal(usage_of(r.json, "total_tokens"), pt + ct);
    assert_int_equal(usage_of(r.json, "memory_tokens"), 0);
    const cJSON *u0 = cJSON_GetObjectItem(r.json, "usage");
    assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(u0, "ttft_ms")) > 0);
    /* The time before the scheduler: positive, and far under the whole. */
    double prep = cJSON_GetNumberValue(cJSON_GetObjectItem(u0, "prepare_ms"));
    assert_true(prep > 0 && prep < cJSON_GetNumberValue(cJSON_GetObjectItem(u0, "total_ms")));
    assert_null(cJSON_GetObjectItem(r.json, "memory")); /* no user: no memory */
    if (strcmp(fin, "length") == 0) assert_int_equal(ct, 5);
    resp_free(&r);

    /* A system message and content parts are accepted; stop strings too. */
    r = request(
        "POST", "/v1/chat/completions", KEY_A,
        "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Count: 1, 2,\"}]}],"
        "\"max_tokens\":6,\"temperature\":0,\"stop\":[\"\\n\\n\"]}");
    expect_ok(&r);
    resp_free(&r);
}

/* Waits until every fact of (key, user) has its KV record. */
static void wait_kv_ready(const char *key, const char *user) {
    char path[256];
    snprintf(path, sizeof path, "/v1/memories/?user_id=%s", user);
    for (int i = 0; i < 400; i++) {
        resp r = request("GET", path, key, NULL);
        expect_ok(&r);
        const cJSON *it;
        bool all = true;
        cJSON_ArrayForEach(it, cJSON_GetObjectItem(r.json, "results")) {
            if (!cJSON_IsTrue(cJSON_GetObjectItem(it, "kv_ready"))) all = false;
        }
        resp_free(&r);
        if (all) return;
        usleep(50 * 1000);
    }
    fail_msg("the facts' KV was never encoded");
}

static void test_chat_memory(void **state) {
    SKIP_WITHOUT_MODEL();
    static const char *const facts[] = {"Frank's favourite food is ramen",
                                        "Frank has a dog called Biscuit",
                                        "Frank works night shifts at the airport"};
    char ids[3][80];
    add_facts(KEY_A, "frank", NULL, NULL, facts, 3, ids);
    wait_kv_ready(KEY_A, "frank");
    double hits0 = metric("inferscale_fact_kv_total{result=\"hit\"}");

    /* kv (the default with a user): the facts' KV is injected. The query names Frank so that
     * BM25 alone, like MiniLM, retrieves k = 2 facts, the dog's first. */
    char *body = chat_body("frank", NULL, 2, "What is the dog of Frank called?", 4, false);
    resp r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    const cJSON *mem = cJSON_GetObjectItem(r.json, "memory");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(mem, "mode")), "kv");
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(mem, "user_known")));
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(mem, "k")), 2);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(mem, "kv_ready")), 2);
    assert_string_equal(
        cJSON_GetStringValue(cJSON_GetArrayItem(cJSON_GetObjectItem(mem, "facts"), 0)), ids[1]);
    int kv_mem = usage_of(r.json, "memory_tokens"), kv_inj = usage_of(r.json, "injected_tokens");
    int kv_prompt = usage_of(r.json, "prompt_tokens"),
        kv_pref = usage_of(r.json, "prefilled_tokens");
    assert_true(kv_mem > 0);
    assert_int_equal(kv_inj, kv_mem);
    /* usage.facts: where the two facts came from (none as text). */
    const cJSON *uf = cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "usage"), "facts");
    int served = 0;
    for (int t = 0; t < 3; t++)
        served += (int)cJSON_GetNumberValue(
            cJSON_GetObjectItem(uf, (const char *[]){"gpu", "host", "disk"}[t]));
    assert_int_equal(served, 2);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(uf, "text")), 0);
    assert_true(metric("inferscale_facts_served_total{tier=\"gpu\"}") +
                    metric("inferscale_facts_served_total{tier=\"host\"}") +
                    metric("inferscale_facts_served_total{tier=\"disk\"}") >=
                2);
    assert_true(usage_of(r.json, "prefix_cached_tokens") > 0);
    assert_int_equal(
        (int)cJSON_GetNumberValue(cJSON_GetObjectItem(
            cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "usage"), "prompt_tokens_details"),
            "cached_tokens")),
        kv_prompt - kv_pref);
    char *kv_text = strdup(content_of(r.json));
    resp_free(&r);
    assert_true(metric("inferscale_fact_kv_total{result=\"hit\"}") >= hits0 + 2);

    /* prompt: the same facts, prefilled as text, at the same positions. */
    body = chat_body("frank", "prompt", 2, "What is the dog of Frank called?", 4, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    assert_string_equal(
        cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "memory"), "mode")),
        "prompt");
    assert_int_equal(usage_of(r.json, "memory_tokens"), kv_mem);
    assert_int_equal(usage_of(r.json, "injected_tokens"), 0);
    assert_int_equal(usage_of(r.json, "prompt_tokens"), kv_prompt);
    assert_int_equal(usage_of(r.json, "prefilled_tokens"), kv_pref + kv_mem);
    resp_free(&r);
    free(kv_text);

    /* off, with a user: no retrieval at all. */
    body = chat_body("frank", "off", -1, "What is my dog called?", 3, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    assert_int_equal(usage_of(r.json, "memory_tokens"), 0);
    resp_free(&r);

    /* k = 0 retrieves nothing but keeps the memory layout. */
    body = chat_body("frank", "kv", 0, "What is my dog called?", 3, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    assert_int_equal(usage_of(r.json, "memory_tokens"), 0);
    resp_free(&r);

    /* Filters narrow retrieval: a metadata filter nothing matches. */
    r = request("POST", "/v1/chat/completions", KEY_A,
                "{\"messages\":[{\"role\":\"user\",\"content\":\"What is my dog called?\"}],"
                "\"user\":\"frank\",\"max_tokens\":2,\"temperature\":0,"
                "\"memory\":{\"k\":5,\"filters\":{\"metadata\":{\"topic\":\"none\"}}}}");
    expect_ok(&r);
    mem = cJSON_GetObjectItem(r.json, "memory");
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(mem, "user_known")));
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(mem, "k")), 0);
    resp_free(&r);

    /* An unknown user: answered without memory, and the response says so. */
    body = chat_body("nobody-at-all", "kv", 5, "Who am I?", 3, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    mem = cJSON_GetObjectItem(r.json, "memory");
    assert_false(cJSON_IsTrue(cJSON_GetObjectItem(mem, "user_known")));
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(mem, "mode")), "off");
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(mem, "k")), 0);
    assert_non_null(cJSON_GetStringValue(cJSON_GetObjectItem(mem, "note")));
    resp_free(&r);

    /* A fact added just now is usable at once (as text until its KV is ready). */
    static const char *const fresh[] = {"Frank's sister is called Greta"};
    char fid[1][80];
    add_facts(KEY_A, "frank", NULL, NULL, fresh, 1, fid);
    body = chat_body("frank", "kv", 1, "What is my sister called?", 2, false);
    r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    mem = cJSON_GetObjectItem(r.json, "memory");
    assert_string_equal(
        cJSON_GetStringValue(cJSON_GetArrayItem(cJSON_GetObjectItem(mem, "facts"), 0)), fid[0]);
    assert_true(usage_of(r.json, "memory_tokens") > 0);
    resp_free(&r);
}

/* Parses an SSE body into its data payloads. */
static int sse_events(char *body, char **ev, int max) {
    int n = 0;
    for (char *p = body; p && *p && n < max;) {
        char *end = strstr(p, "\n\n");
        if (!end) break;
        *end = '\0';
        assert_memory_equal(p, "data: ", 6);
        ev[n++] = p + 6;
        p = end + 2;
    }
    return n;
}

static void test_chat_stream(void **state) {
    SKIP_WITHOUT_MODEL();
    char *body = chat_body("frank", "kv", 2, "Tell me about my dog.", 8, true);
    resp r = request("POST", "/v1/chat/completions", KEY_A, body);
    assert_int_equal(r.status, 200);
    char *ev[64];
    int n = sse_events(r.body, ev, 64);
    assert_true(n >= 4);
    assert_string_equal(ev[n - 1], "[DONE]");
    char text[4096] = "";
    bool saw_finish = false, saw_usage = false;
    for (int i = 0; i < n - 1; i++) {
        cJSON *j = cJSON_Parse(ev[i]);
        assert_non_null(j);
        assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(j, "object")),
                            "chat.completion.chunk");
        const cJSON *ch = cJSON_GetObjectItem(j, "choices");
        if (cJSON_GetArraySize(ch) == 0) {
            /* the final usage chunk, after the finish */
            assert_true(saw_finish);
            assert_int_equal(i, n - 2);
            const cJSON *u = cJSON_GetObjectItem(j, "usage");
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(u, "completion_tokens")) >= 1);
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(u, "injected_tokens")) > 0);
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(u, "ttft_ms")) > 0);
            /* A kv chat's memory search is before the scheduler. */
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(u, "prepare_ms")) > 0);
            assert_non_null(cJSON_GetObjectItem(j, "memory"));
            saw_usage = true;
        } else {
            const cJSON *c0 = cJSON_GetArrayItem(ch, 0), *d = cJSON_GetObjectItem(c0, "delta");
            if (i == 0)
                assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(d, "role")),
                                    "assistant");
            const char *t = cJSON_GetStringValue(cJSON_GetObjectItem(d, "content"));
            if (t) strncat(text, t, sizeof text - strlen(text) - 1);
            const cJSON *f = cJSON_GetObjectItem(c0, "finish_reason");
            if (cJSON_IsString(f)) {
                assert_false(saw_finish);
                saw_finish = true;
            } else {
                assert_true(cJSON_IsNull(f));
            }
        }
        cJSON_Delete(j);
    }
    assert_true(saw_finish && saw_usage);
    resp_free(&r);

    /* The same request without streaming says the same (greedy). */
    cJSON *b = cJSON_Parse(body);
    cJSON_ReplaceItemInObject(b, "stream", cJSON_CreateFalse());
    char *b2 = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    r = request("POST", "/v1/chat/completions", KEY_A, b2);
    expect_ok(&r);
    assert_string_equal(content_of(r.json), text);
    resp_free(&r);
    free(b2);
    free(body);

    /* stream_options.include_usage=false: no usage chunk. */
    r = request(
        "POST", "/v1/chat/completions", KEY_A,
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":false}}");
    assert_int_equal(r.status, 200);
    assert_null(strstr(r.body, "\"usage\""));
    assert_non_null(strstr(r.body, "data: [DONE]\n\n"));
    resp_free(&r);
}

static void test_bad_input(void **state) {
    bool has;
    static const char *const keep[] = {"Gina collects stamps"};
    char kid[1][80];
    add_facts(KEY_A, "gina", NULL, NULL, keep, 1, kid);
    struct {
        const char *path, *body;
        long status;
        const char *code, *param;
    } cases[] = {
        {"/v1/chat/completions", "{\"messages\":", 400, "invalid_json", NULL},
        {"/v1/chat/completions", "", 400, "invalid_json", NULL},
        {"/v1/chat/completions", "[1,2]", 400, "invalid_json", NULL},
        {"/v1/chat/completions", "{\"messages\":[]} trailing", 400, "invalid_json", NULL},
        {"/v1/chat/completions", "{}", 400, "missing_field", "messages"},
        {"/v1/chat/completions", "{\"messages\":\"hi\"}", 400, "invalid_type", "messages"},
        {"/v1/chat/completions", "{\"messages\":[]}", 400, "invalid_value", "messages"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400,
         "invalid_type", "messages[0]"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", 400,
         "invalid_value", "messages[0]"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":\"5\"}", 400,
         "invalid_type", "max_tokens"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2.5}", 400,
         "invalid_type", "max_tokens"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":0}", 400,
         "invalid_value", "max_tokens"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":100000}", 400,
         "invalid_value", "max_tokens"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":\"hot\"}", 400,
         "invalid_type", "temperature"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":3}", 400,
         "invalid_value", "temperature"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_p\":0}", 400, "invalid_value",
         "top_p"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":\"yes\"}", 400,
         "invalid_type", "stream"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[1]}", 400, "invalid_type",
         "stop"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":2}",
         400, "invalid_value", "n"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":7}", 400, "invalid_type",
         "user"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"gina\",\"memory\":{"
         "\"k\":101}}",
         400, "invalid_value", "memory.k"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"gina\",\"memory\":{"
         "\"k\":-1}}",
         400, "invalid_value", "memory.k"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"gina\",\"memory\":{"
         "\"k\":2.5}}",
         400, "invalid_type", "memory.k"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"gina\",\"memory\":{"
         "\"mode\":\"fast\"}}",
         400, "invalid_value", "memory.mode"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"gina\",\"memory\":{"
         "\"kk\":1}}",
         400, "unknown_field", "memory"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"memory\":[]}", 400,
         "invalid_type", "memory"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}",
         400, "invalid_json", NULL},
        {"/v1/memories/", "{\"facts\":[\"x\"]}", 400, "missing_field", "user_id"},
        {"/v1/memories/", "{\"user_id\":\"gina\"}", 400, "missing_field", "messages"},
        {"/v1/memories/", "{\"user_id\":\"gina\",\"facts\":\"x\"}", 400, "invalid_type", "facts"},
        {"/v1/memories/", "{\"user_id\":\"gina\",\"facts\":[\"  \"]}", 400, "invalid_value",
         "facts"},
        {"/v1/memories/", "{\"user_id\":\"gina\",\"facts\":[\"x\"],\"metadata\":{\"a\":{\"b\":1}}}",
         400, "invalid_value", "metadata"},
        {"/v1/memories/", "{\"user_id\":\"gina\",\"facts\":[\"x\"],\"infer\":\"no\"}", 400,
         "invalid_type", "infer"},
        {"/v1/memories/", "{\"user_id\":\"gina\",\"facts\":[\"x\"],\"colour\":1}", 400,
         "unknown_field", "colour"},
        {"/v1/memories/", "{\"user_id\":\"\",\"facts\":[\"x\"]}", 400, "invalid_value", "user_id"},
        {"/v1/memories/search/", "{\"user_id\":\"gina\"}", 400, "missing_field", "query"},
        {"/v1/memories/search/", "{\"query\":\"x\"}", 400, "missing_field", "user_id"},
        {"/v1/memories/search/", "{\"query\":\"x\",\"user_id\":\"gina\",\"top_k\":0}", 400,
         "invalid_value", "top_k"},
        {"/v1/memories/search/", "{\"query\":\"x\",\"user_id\":\"gina\",\"top_k\":1000}", 400,
         "invalid_value", "top_k"},
        {"/v1/memories/search/",
         "{\"query\":\"x\",\"user_id\":\"gina\",\"filters\":{\"user_id\":\"other\"}}", 400,
         "invalid_value", "user_id"},
        {"/v1/memories/search/",
         "{\"query\":\"x\",\"user_id\":\"gina\",\"filters\":{\"tags\":[1]}}", 400, "invalid_type",
         "filters"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        resp r = request("POST", cases[i].path, KEY_A, cases[i].body);
        expect_error(&r, cases[i].status, cases[i].code, cases[i].param);
        resp_free(&r);
    }
    /* Invalid UTF-8 in a body, in a query string. */
    const char bad[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xc3\x28\"}]}";
    resp r = request("POST", "/v1/chat/completions", KEY_A, bad);
    expect_error(&r, 400, "invalid_utf8", NULL);
    resp_free(&r);
    const char bad2[] = "{\"user_id\":\"gina\",\"facts\":[\"\xed\xa0\x80 surrogate\"]}";
    r = request("POST", "/v1/memories/", KEY_A, bad2);
    expect_error(&r, 400, "invalid_utf8", NULL);
    resp_free(&r);
    r = request("GET", "/v1/memories/?user_id=gina%FF", KEY_A, NULL);
    expect_error(&r, 400, "invalid_utf8", NULL);
    resp_free(&r);
    /* Oversize bodies: announced (Content-Length) and chunked. */
    size_t big = MAX_BODY + 100;
    char *blob = malloc(big + 1);
    memset(blob, 'a', big);
    blob[big] = '\0';
    r = request_ex("POST", "/v1/memories/", KEY_A, blob, big, false);
    expect_error(&r, 413, "request_too_large", NULL);
    resp_free(&r);
    r = request_ex("POST", "/v1/memories/", KEY_A, blob, big, true);
    expect_error(&r, 413, "request_too_large", NULL);
    resp_free(&r);
    free(blob);
    /* Routes and methods. */
    r = request("GET", "/v2/nothing", KEY_A, NULL);
    expect_error(&r, 404, "not_found", NULL);
    resp_free(&r);
    r = request("GET", "/v1/chat/completions", KEY_A, NULL);
    expect_error(&r, 405, "method_not_allowed", NULL);
    resp_free(&r);
    r = request("PATCH", "/v1/memories/", KEY_A, "{}");
    expect_error(&r, 405, "method_not_allowed", NULL);
    resp_free(&r);
    r = request("GET", "/v1/memories/..%2F..%2Fetc/", KEY_A, NULL);
    expect_error(&r, 404, NULL, NULL);
    resp_free(&r);
    r = request("GET", "/v1/memories/abc/def/ghi", KEY_A, NULL);
    expect_error(&r, 404, "not_found", NULL);
    resp_free(&r);
    r = request("GET", "/v1/memories/search/", KEY_A, NULL); /* search is POST only */
    expect_error(&r, 405, "method_not_allowed", NULL);
    resp_free(&r);
    r = request("GET", "/v1/memories/?user_id=gina&metadata=%7Bbad", KEY_A, NULL);
    expect_error(&r, 400, "invalid_value", "metadata");
    resp_free(&r);

    if (g_model) {
        /* A memory mode needs a user. */
        char *body = chat_body(NULL, "kv", 3, "hello", 2, false);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        expect_error(&r, 400, "missing_field", "user");
        resp_free(&r);
        /* Past the context (N_CTX), within the prompt limit: the scheduler refuses. */
        size_t words = 2400;
        char *text = malloc(words * 4 + 1);
        for (size_t i = 0; i < words; i++) memcpy(text + 4 * i, "the ", 5);
        body = chat_body(NULL, NULL, -1, text, 8, false);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        expect_error(&r, 400, "context_length_exceeded", NULL);
        assert_null(strstr(r.body, "this server accepts at most"));
        resp_free(&r);
        /* Past the prompt limit (MAX_PROMPT tokens of messages). */
        free(text);
        words = 3300;
        text = malloc(words * 4 + 1);
        for (size_t i = 0; i < words; i++) memcpy(text + 4 * i, "the ", 5);
        body = chat_body(NULL, NULL, -1, text, 8, true);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        free(text);
        expect_error(&r, 400, "context_length_exceeded", "messages");
        assert_non_null(strstr(r.body, "this server accepts at most 3000"));
        resp_free(&r);
        /* max_tokens past the context with a short prompt. */
        body = chat_body(NULL, NULL, -1, "hi", 4000, false);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        expect_error(&r, 400, "context_length_exceeded", NULL);
        resp_free(&r);
    } else {
        char *body = chat_body(NULL, NULL, -1, "hi", 2, false);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        expect_error(&r, 503, "no_model", NULL);
        resp_free(&r);
    }
    /* Still serving, and nothing stored was lost. */
    r = request("GET", "/health", NULL, NULL);
    expect_ok(&r);
    resp_free(&r);
    assert_int_equal(list_count(KEY_A, "user_id=gina", kid[0], &has), 1);
    assert_true(has);
    if (g_model) {
        char *body = chat_body("gina", "kv", 1, "What do I collect?", 2, false);
        r = request("POST", "/v1/chat/completions", KEY_A, body);
        free(body);
        expect_ok(&r);
        resp_free(&r);
    }
}

/* Aborts the transfer once a content delta has arrived: the first chunk
 * carries the role with an empty content, the second the first text. */
typedef struct abort_ctx {
    size_t got;
    char buf[8192];
} abort_ctx;

static size_t on_write_abort(char *p, size_t sz, size_t n, void *ud) {
    abort_ctx *a = ud;
    size_t l = sz * n;
    if (a->got + l < sizeof a->buf) {
        memcpy(a->buf + a->got, p, l);
        a->got += l;
        a->buf[a->got] = '\0';
    }
    int n_content = 0;
    for (char *q = a->buf; (q = strstr(q, "\"content\":")); q++) n_content++;
    return n_content >= 2 ? 0 : l;
}

static void test_disconnect_mid_stream(void **state) {
    SKIP_WITHOUT_MODEL();
    wait_idle();
    int used0 = health_sched("kv_blocks_used");
    double errs0 = metric("inferscale_chat_requests_total{mode=\"kv\",result=\"error\"}");
    double gen0 = metric("inferscale_tokens_generated_total");
    /* A long answer (1500 tokens: tens of seconds here) cut after its first token. */
    char *body = chat_body("frank", "kv", 3, "Write a very long story about my dog.", 1500, true);
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/chat/completions", g_port);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    abort_ctx ac = {0};
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write_abort);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &ac);
    struct curl_slist *h = curl_slist_append(NULL, "Authorization: Bearer " KEY_A);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    CURLcode rc = curl_easy_perform(c);
    assert_int_equal(rc, CURLE_WRITE_ERROR); /* we aborted it */
    curl_slist_free_all(h);
    curl_easy_cleanup(c); /* closes the connection */
    free(body);
    g_requests++;
    /* The request is cancelled: its blocks come back long before 1500
     * tokens could have been generated. */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    bool freed = false;
    for (int i = 0; i < 200 && !freed; i++) {
        freed = health_sched("running") == 0 && health_sched("kv_blocks_used") == used0;
        if (!freed) usleep(50 * 1000);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    assert_true(freed);
    double gen = metric("inferscale_tokens_generated_total") - gen0;
    fprintf(stderr, "disconnect: blocks freed after %.2f s, %.0f tokens generated of 1500\n",
            (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9, gen);
    assert_true(gen < 1500);
    assert_true(metric("inferscale_chat_requests_total{mode=\"kv\",result=\"error\"}") >=
                errs0 + 1);
    /* And the next request is served. */
    body = chat_body("frank", "kv", 2, "What is my dog called?", 3, false);
    resp r = request("POST", "/v1/chat/completions", KEY_A, body);
    free(body);
    expect_ok(&r);
    resp_free(&r);
    assert_int_equal(health_sched("kv_blocks_used"), used0);
}

/* A client that shuts down its sending side once the request is sent
 * (nc -N) looks, until the server writes, like one that closed: its
 * request is cancelled, and since it still reads, it is told so (503
 * cancelled, or the stream's error event), never given the cut answer as
 * a finished one (200, "finish_reason": "abort"). */
static void test_half_close(void **state) {
    SKIP_WITHOUT_MODEL();
    wait_idle();
    for (int stream = 0; stream < 2; stream++) {
        char *b = chat_body(NULL, NULL, -1, "Write a poem about the sea.", 40, stream);
        int fd = raw_post(g_port, "/v1/chat/completions", KEY_A, b);
        free(b);
        assert_int_equal(shutdown(fd, SHUT_WR), 0);
        g_requests++;
        long status;
        char *got = raw_read_close(fd, 120, &status);
        if (strstr(got, "abort") || !strstr(got, "cancelled"))
            fprintf(stderr, "half-close (stream %d): status %ld: %.600s\n", stream, status, got);
        assert_null(strstr(got, "abort"));
        assert_non_null(strstr(got, "\"cancelled\""));
        if (!stream) {
            assert_int_equal(status, 503);
        } else {
            assert_int_equal(status, 200); /* the head went out with the first event */
            assert_non_null(strstr(got, "\"error\""));
            assert_null(strstr(got, "\"finish_reason\":\"length\""));
            assert_null(strstr(got, "\"finish_reason\":\"stop\""));
        }
        free(got);
    }
    wait_idle();
    fprintf(stderr, "half-close: cancelled and told so, streamed and not\n");
}

/* Opens `n` streams that stay open (long answers), returns the multi handle. */
static void test_in_flight_limit(void **state) {
    SKIP_WITHOUT_MODEL();
    wait_idle();
    int used0 = health_sched("kv_blocks_used");
    CURLM *m = curl_multi_init();
    CURL *e[MAX_IN_FLIGHT];
    abort_ctx ac[MAX_IN_FLIGHT];
    char *body = chat_body(NULL, NULL, -1, "Write a very long poem about the sea.", 1000, true);
    struct curl_slist *h = curl_slist_append(NULL, "Authorization: Bearer " KEY_B);
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/chat/completions", g_port);
    for (int i = 0; i < MAX_IN_FLIGHT; i++) {
        memset(&ac[i], 0, sizeof ac[i]);
        e[i] = curl_easy_init();
        curl_easy_setopt(e[i], CURLOPT_URL, url);
        curl_easy_setopt(e[i], CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e[i], CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(e[i], CURLOPT_WRITEFUNCTION, test_http_on_write);
        resp *rr = calloc(1, sizeof *rr);
        curl_easy_setopt(e[i], CURLOPT_WRITEDATA, rr);
        curl_easy_setopt(e[i], CURLOPT_PRIVATE, rr);
        curl_multi_add_handle(m, e[i]);
    }
    /* Drive them until each has its first bytes (so each is in flight). */
    for (int it = 0; it < 600; it++) {
        int running;
        curl_multi_perform(m, &running);
        bool all = true;
        for (int i = 0; i < MAX_IN_FLIGHT; i++) {
            resp *rr;
            curl_easy_getinfo(e[i], CURLINFO_PRIVATE, (char **)&rr);
            if (!rr->len) all = false;
        }
        if (all) break;
        curl_multi_poll(m, NULL, 0, 50, NULL);
    }
    for (int i = 0; i < MAX_IN_FLIGHT; i++) {
        resp *rr;
        curl_easy_getinfo(e[i], CURLINFO_PRIVATE, (char **)&rr);
        assert_true(rr->len > 0);
    }
    resp r = request("GET", "/v1/models", KEY_A, NULL);
    expect_error(&r, 429, "too_many_requests", NULL);
    resp_free(&r);
    /* /health is not counted. */
    r = request("GET", "/health", NULL, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "requests_in_flight")),
                     MAX_IN_FLIGHT);
    resp_free(&r);
    for (int i = 0; i < MAX_IN_FLIGHT; i++) {
        resp *rr;
        curl_easy_getinfo(e[i], CURLINFO_PRIVATE, (char **)&rr);
        curl_multi_remove_handle(m, e[i]);
        curl_easy_cleanup(e[i]); /* hangs up */
        free(rr->body);
        free(rr);
    }
    curl_multi_cleanup(m);
    curl_slist_free_all(h);
    free(body);
    g_requests += MAX_IN_FLIGHT;
    /* All three are cancelled and their slots and blocks come back. */
    bool back = false;
    for (int i = 0; i < 200 && !back; i++) {
        resp hr = request("GET", "/health", NULL, NULL);
        back = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(hr.json, "requests_in_flight")) == 0 &&
               health_sched("running") == 0 && health_sched("kv_blocks_used") == used0;
        resp_free(&hr);
        if (!back) usleep(50 * 1000);
    }
    assert_true(back);
    r = request("GET", "/v1/models", KEY_A, NULL);
    expect_ok(&r);
    resp_free(&r);
}

static void test_infer_extraction(void **state) {
    SKIP_WITHOUT_MODEL();
    resp r = request(
        "POST", "/v1/memories/", KEY_A,
        "{\"user_id\":\"hana\",\"messages\":["
        "{\"role\":\"user\",\"content\":\"Hi, I'm Hana. I am vegetarian and I live in Kyoto.\"},"
        "{\"role\":\"assistant\",\"content\":\"Nice to meet you, Hana!\"}]}");
    expect_ok(&r);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results"), *it;
    assert_true(cJSON_IsArray(res));
    const cJSON *w = cJSON_GetObjectItem(r.json, "warnings");
    fprintf(stderr, "infer: %d facts extracted%s%s\n", cJSON_GetArraySize(res),
            w ? "; warning: " : "", w ? cJSON_GetStringValue(cJSON_GetArrayItem(w, 0)) : "");
    /* Whatever the small model wrote: what is reported stored is stored. */
    int n = cJSON_GetArraySize(res);
    cJSON_ArrayForEach(it, res) {
        const char *text = cJSON_GetStringValue(cJSON_GetObjectItem(it, "memory"));
        assert_non_null(text);
        assert_true(text[0] != '\0');
        char path[256];
        snprintf(path, sizeof path, "/v1/memories/%s/",
                 cJSON_GetStringValue(cJSON_GetObjectItem(it, "id")));
        resp g = request("GET", path, KEY_A, NULL);
        expect_ok(&g);
        assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(g.json, "memory")), text);
        resp_free(&g);
    }
    /* Never a 200 that stored nothing: with nothing usable extracted, the
     * user's message itself is stored (the default --infer-fallback). */
    assert_true(n >= 1);
    resp_free(&r);
    assert_int_equal(list_count(KEY_A, "user_id=hana", NULL, NULL), n);
}

/* A second server beside the suite's: the default model, no embedder, no
 * keys, any free port, over its own data directory. */
static http_app_params second_server(const char *data, size_t kv_bytes) {
    http_app_params p = http_app_default_params();
    p.model_path = IS_DEFAULT_MODEL;
    p.data_dir = data;
    p.embedder_dir = "none";
    p.n_ctx = N_CTX;
    p.kv_bytes = kv_bytes;
    p.http.port = 0;
    p.http.no_auth = true;
    return p;
}

/* --infer-fallback reject: an infer=true add from which nothing usable is
 * extracted fails with 422 and stores nothing. A second server whose
 * extraction may write one token makes that certain (the reply cannot
 * close its JSON object). */
static void test_infer_fallback_reject(void **state) {
    SKIP_WITHOUT_MODEL();
    char dir[] = "/tmp/test_http_reject_XXXXXX", data[512];
    assert_non_null(mkdtemp(dir));
    snprintf(data, sizeof data, "%s/data", dir);
    http_app_params p = second_server(data, (size_t)64 << 20);
    p.http.quiet = true;
    p.http.limits.extract_max_tokens = 1;
    p.http.infer_fallback = HTTP_INFER_FALLBACK_REJECT;
    http_app *app = NULL;
    assert_int_equal(http_app_start(&p, &app), IS_OK);
    int saved_port = g_port, saved_n = g_requests; /* this server logs nothing */
    g_port = http_app_port(app);
    resp r = request(
        "POST", "/v1/memories/", NULL,
        "{\"user_id\":\"ivy\",\"messages\":[{\"role\":\"user\",\"content\":\"I live in Oslo.\"}]}");
    expect_error(&r, 422, "extraction_failed", "infer");
    resp_free(&r);
    r = request("GET", "/v1/memories/?user_id=ivy", NULL, NULL);
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 0);
    resp_free(&r);
    /* infer=false still stores the messages as they are. */
    r = request("POST", "/v1/memories/", NULL,
                "{\"user_id\":\"ivy\",\"infer\":false,\"messages\":[{\"role\":\"user\",\"content\":"
                "\"I live in Oslo.\"}]}");
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 1);
    resp_free(&r);
    g_port = saved_port;
    g_requests = saved_n;
    http_app_stop(app);
    assert_int_equal(test_remove_tree(dir), 0);
}

/* A stop with chats in flight: each is cancelled and answered as such,
 * 503 shutting_down (a stream: its error event), never a 200 holding the
 * text cut short, and the request log says so. */
static void test_stop_with_chat_in_flight(void **state) {
    SKIP_WITHOUT_MODEL();
    char dir[] = "/tmp/test_http_stop_XXXXXX", data[512], logp[512];
    assert_non_null(mkdtemp(dir));
    snprintf(data, sizeof data, "%s/data", dir);
    snprintf(logp, sizeof logp, "%s/requests.log", dir);
    FILE *logf = fopen(logp, "w");
    assert_non_null(logf);
    http_app_params p = second_server(data, (size_t)256 << 20);
    p.http.log = logf;
    http_app *app = NULL;
    assert_int_equal(http_app_start(&p, &app), IS_OK);
    int port = http_app_port(app);
    char *body = chat_body(NULL, NULL, -1, "Write a very long story about the sea.", 600, false);
    char *sbody = chat_body(NULL, NULL, -1, "Write a very long story about the sea.", 600, true);
    int fd = raw_post(port, "/v1/chat/completions", NULL, body);
    int sfd = raw_post(port, "/v1/chat/completions", NULL, sbody);
    free(body);
    free(sbody);
    /* Both decoding: a token of each has been generated. */
    int saved_port = g_port, saved_n = g_requests;
    g_port = port;
    bool running = false;
    for (int i = 0; i < 600 && !running; i++) {
        running = health_sched("running") == 2 && metric("inferscale_tokens_generated_total") >= 2;
        if (!running) usleep(50 * 1000);
    }
    g_port = saved_port;
    g_requests = saved_n;
    assert_true(running);
    http_app_stop(app); /* the answers are written into the sockets before it closes them */
    fclose(logf);
    long st, sst;
    char *got = raw_read_close(fd, 10, &st), *sgot = raw_read_close(sfd, 10, &sst);
    fprintf(stderr, "stop: chat %ld %.200s\n      stream %ld ...%s\n", st, got, sst,
            strlen(sgot) > 300 ? sgot + strlen(sgot) - 300 : sgot);
    assert_int_equal(st, 503);
    cJSON *j = cJSON_Parse(got);
    assert_non_null(j);
    assert_string_equal(
        cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "code")),
        "shutting_down");
    assert_null(cJSON_GetObjectItem(j, "choices"));
    cJSON_Delete(j);
    /* The stream's head was sent long before: 200, then the error event
     * in place of a finish_reason chunk. */
    assert_int_equal(sst, 200);
    assert_non_null(strstr(sgot, "\"code\":\"shutting_down\""));
    assert_null(strstr(sgot, "\"finish_reason\":\"abort\""));
    free(got);
    free(sgot);
    /* The log: the chat as a 503, neither chat with finish "abort". */
    cJSON *log = read_log(logp, NULL);
    int chats = 0, refused = 0;
    const cJSON *l;
    cJSON_ArrayForEach(l, log) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItem(l, "path"));
        if (path && strcmp(path, "/v1/chat/completions") == 0) {
            chats++;
            const char *fin = cJSON_GetStringValue(cJSON_GetObjectItem(l, "finish"));
            assert_true(!fin || strcmp(fin, "abort") != 0);
            if ((int)cJSON_GetNumberValue(cJSON_GetObjectItem(l, "status")) == 503) refused++;
        }
    }
    cJSON_Delete(log);
    fprintf(stderr, "stop: %d chats logged, %d of them 503\n", chats, refused);
    assert_int_equal(chats, 2);
    assert_int_equal(refused, 1);
    assert_int_equal(test_remove_tree(dir), 0);
}

/* Mem0's platform routes (mem0.h) as the mem0ai clients call them; the
 * clients themselves are driven by test_mem0_client.py. */
static void test_mem0_routes(void **state) {
    (void)state;
    resp r = request("GET", "/v1/ping/", KEY_A, NULL);
    expect_ok(&r);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "org_id")), "inferscale");
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(r.json, "project_id")),
                        "tenant-a");
    resp_free(&r);
    /* An agent-only memory, with the fields 2.x always sends. */
    r = request("POST", "/v3/memories/add/", KEY_A,
                "{\"messages\":[{\"role\":\"user\",\"content\":\"Answer in French.\"}],"
                "\"filters\":{\"agent_id\":\"ag1\"},\"infer\":false,\"output_format\":\"v1.1\","
                "\"version\":\"v2\",\"async_mode\":true,\"org_id\":\"inferscale\",\"project_id\":"
                "\"tenant-a\"}");
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 1);
    resp_free(&r);
    r = request("POST", "/v3/memories/", KEY_A,
                "{\"filters\":{\"OR\":[{\"agent_id\":\"ag1\"},{\"run_id\":\"nope\"}]}}");
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "count")), 1);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(r.json, "next")));
    const cJSON *m0 = cJSON_GetArrayItem(cJSON_GetObjectItem(r.json, "results"), 0);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(m0, "user_id")));
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(m0, "agent_id")), "ag1");
    resp_free(&r);
    /* The other tenant does not see it. */
    r = request("POST", "/v3/memories/", KEY_B, "{\"filters\":{\"agent_id\":\"ag1\"}}");
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "count")), 0);
    resp_free(&r);
    r = request("POST", "/v3/memories/search/", KEY_A,
                "{\"query\":\"French\",\"filters\":{\"agent_id\":\"ag1\"}}");
    expect_ok(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")), 1);
    resp_free(&r);
    /* Refusals that name the field or the feature; never a 404 for a client route. */
    r = request("POST", "/v3/memories/", KEY_A,
                "{\"filters\":{\"agent_id\":\"ag1\"},\"app_id\":\"x\"}");
    expect_error(&r, 400, "unsupported_feature", "app_id");
    resp_free(&r);
    r = request("POST", "/v3/memories/", KEY_A,
                "{\"filters\":{\"agent_id\":\"ag1\"},\"colour\":1}");
    expect_error(&r, 400, "unknown_field", "colour");
    resp_free(&r);
    r = request("POST", "/v3/memories/", KEY_A, "{\"filters\":{\"metadata\":{\"a\":1}}}");
    expect_error(&r, 400, "missing_field", "user_id");
    resp_free(&r);
    r = request("POST", "/v3/memories/", KEY_A,
                "{\"filters\":{\"agent_id\":\"ag1\"},\"project_id\":\"tenant-b\"}");
    expect_error(&r, 400, "invalid_value", "project_id");
    resp_free(&r);
    r = request("POST", "/v1/summary/", KEY_A, "{}");
    expect_error(&r, 400, "unsupported_feature", NULL);
    resp_free(&r);
    r = request(
        "PUT", "/v1/batch/", KEY_A,
        "{\"memories\":[{\"memory_id\":\"00000000-0000-4000-8000-000000000000\",\"text\":\"x\"}]}");
    expect_error(&r, 404, "memory_not_found", "memory_id");
    resp_free(&r);
    /* delete_all with a Python-repr filters parameter (what httpx sends for a dict). */
    r = request("DELETE", "/v1/memories/?filters=%7B%27agent_id%27%3A%20%27ag9%27%7D", KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "deleted")), 0);
    resp_free(&r);
    r = request("DELETE", "/v2/entities/agent/ag1/", KEY_B, NULL);
    expect_error(&r, 404, "entity_not_found", NULL);
    resp_free(&r);
    r = request("DELETE", "/v2/entities/agent/ag1/", KEY_A, NULL);
    expect_ok(&r);
    assert_int_equal((int)cJSON_GetNumberValue(cJSON_GetObjectItem(r.json, "deleted")), 1);
    resp_free(&r);
}

/* Every request left one JSON line in the log; then a clean stop keeps
 * every fact (the data directory reopens and checks). */
static void test_log_and_clean_stop(void **state) {
    resp r = request("GET", "/v1/memories/?user_id=frank", KEY_A, NULL);
    int n_frank = g_model ? cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")) : 0;
    resp_free(&r);
    r = request("GET", "/v1/memories/?user_id=erin", KEY_B, NULL);
    int n_erin_b = cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results"));
    if (n_erin_b != 2) /* seen once in CI (0 results), not reproduced: say what came back */
        fprintf(stderr, "erin (tenant b): status %ld, curl rc %d, body: %.400s\n", r.status,
                r.curl_rc, r.body ? r.body : "(none)");
    resp_free(&r);
    assert_int_equal(n_erin_b, 2);
    http_app_stop(g_app); /* waits for every connection: all lines are written */
    g_app = NULL;
    fflush(g_logf);
    int lines = 0, bad = 0;
    cJSON *log = read_log(g_log, &bad);
    const cJSON *j;
    cJSON_ArrayForEach(j, log) {
        if (cJSON_GetObjectItem(j, "status") && cJSON_GetObjectItem(j, "path") &&
            cJSON_GetObjectItem(j, "ms"))
            lines++;
    }
    cJSON_Delete(log);
    fprintf(stderr, "log: %d request lines for %d requests\n", lines, g_requests);
    assert_int_equal(bad, 0);
    assert_int_equal(lines, g_requests);

    memory_params mp = memory_default_params();
    char emb[512];
    snprintf(emb, sizeof emb, "%s/models/all-MiniLM-L6-v2", IS_SOURCE_DIR);
    embedder *e = NULL;
    if (g_dense) { /* as the server opened it */
        assert_int_equal(embedder_load(emb, &e), IS_OK);
        mp.embedder = e;
        mp.embed_name = "all-MiniLM-L6-v2";
    } else {
        mp.embed_name = "none";
    }
    memory *m = NULL;
    memory_open_report rep;
    assert_int_equal(memory_open(g_data, &mp, &m, &rep), IS_OK);
    assert_int_equal(memory_check(m, false), IS_OK);
    mem_filter fa = {.tenant = "tenant-a", .user = "frank"},
               fb = {.tenant = "tenant-b", .user = "erin"};
    mem_fact *facts;
    int32_t n;
    assert_int_equal(memory_get_all(m, &fa, &facts, &n), IS_OK);
    assert_int_equal(n, n_frank);
    mem_facts_free(facts, n);
    assert_int_equal(memory_get_all(m, &fb, &facts, &n), IS_OK);
    assert_int_equal(n, 2);
    mem_facts_free(facts, n);
    memory_close(m);
    embedder_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_health_models_metrics),
        cmocka_unit_test(test_auth),
        cmocka_unit_test(test_memory_routes),
        cmocka_unit_test(test_isolation),
        cmocka_unit_test(test_chat_plain),
        cmocka_unit_test(test_chat_memory),
        cmocka_unit_test(test_chat_stream),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_disconnect_mid_stream),
        cmocka_unit_test(test_half_close),
        cmocka_unit_test(test_in_flight_limit),
        cmocka_unit_test(test_infer_extraction),
        cmocka_unit_test(test_mem0_routes),
        cmocka_unit_test(test_infer_fallback_reject),
        cmocka_unit_test(test_stop_with_chat_in_flight),
        cmocka_unit_test(test_log_and_clean_stop),
    };
    return test_run_group(tests, setup, teardown);
}

/*
 * The HTTP server against hostile and broken clients: the real server
 * (http_app without a model: memory routes, /health, /metrics) on a
 * loopback port picked by the kernel, driven over raw sockets so that
 * requests no well-behaved client library would send can be sent.
 *
 * One case per defect: ids cut short by a %00 (query string, path), ids
 * with control characters (query, JSON), "*" as an id (a wildcard only in
 * filters), "\u0000", trailing data and repeated ids on the Mem0 routes, clients without a key holding
 * in-flight slots, one tenant starving another, idle connections locking
 * new ones out, slow headers and slow bodies never closed, idle kept-alive
 * connections, a 100 KB URL,
 * a 100 KB header and 600 query parameters answered outside the JSON
 * contract, 429 and 503 without Retry-After, cross-tenant counts on
 * /health and /metrics. The errors libmicrohttpd answers itself (a bad
 * Content-Length or chunk size, HTTP/9.9, a garbage request line) are
 * checked to get an answer or a close and to leave the server serving.
 *
 * The limits are scaled down (a connection limit of 24 rather than 512,
 * timeouts of 2 s) so every case is bounded in connections and time.
 * Each case prints one line "fault-matrix: hostile-client|CASE|TRIES|OUTCOME"
 * for the reliability fault matrix.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "serve/http/app.h"
#include "test_util.h"

#define KEY_A                "sk-hostile-tenant-a-01"
#define KEY_B                "sk-hostile-tenant-b-02"
#define MAX_IN_FLIGHT        8
#define MAX_IN_FLIGHT_TENANT 4
#define MAX_CONNECTIONS      24
#define TIMEOUT_S            2
#define IDLE_S               3

static http_app *g_app;
static int g_port;
static char g_dir[] = "/tmp/test_http_hostile_XXXXXX";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void matrix(const char *name, int tries, const char *outcome) {
    printf("fault-matrix: hostile-client|%s|%d|%s\n", name, tries, outcome);
    fflush(stdout);
}

/* ---- raw HTTP ----------------------------------------------------------------------- */

static int conn_open(void) {
    int fd = test_connect_loopback(g_port);
    assert_true(fd >= 0);
    return fd;
}

/* Sends all of buf; false if the peer closed or reset. */
static bool send_all(int fd, const char *buf, size_t len) {
    while (len) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n <= 0) return false;
        buf += n;
        len -= (size_t)n;
    }
    return true;
}

typedef struct raw_resp {
    int status;  /* 0: no status line */
    bool closed; /* the server closed (or reset) the connection */
    char *text;  /* everything read */
    size_t len;
    cJSON *json; /* the body, if it parses */
} raw_resp;

static void raw_free(raw_resp *r) {
    free(r->text);
    cJSON_Delete(r->json);
    memset(r, 0, sizeof *r);
}

/* Reads a response until its body is complete (Content-Length), the peer
 * closes, or timeout_ms pass. */
static raw_resp raw_read(int fd, int timeout_ms) {
    raw_resp r = {0};
    size_t cap = 1 << 16;
    r.text = calloc(1, cap + 1);
    double end = now_s() + timeout_ms / 1e3;
    for (;;) {
        char *hdr_end = strstr(r.text, "\r\n\r\n");
        if (hdr_end) {
            const char *cl = strcasestr(r.text, "\r\ncontent-length:");
            size_t want = cl && cl < hdr_end ? strtoul(cl + 17, NULL, 10) : (size_t)-1;
            if (want != (size_t)-1 && r.len >= (size_t)(hdr_end + 4 - r.text) + want) break;
        }
        int left = (int)((end - now_s()) * 1e3);
        if (left <= 0) break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) continue;
        if (r.len == cap) break;
        ssize_t n = recv(fd, r.text + r.len, cap - r.len, 0);
        if (n <= 0) {
            r.closed = true;
            break;
        }
        r.len += (size_t)n;
        r.text[r.len] = '\0';
    }
    sscanf(r.text, "HTTP/1.%*d %d", &r.status);
    char *body = strstr(r.text, "\r\n\r\n");
    if (body) r.json = cJSON_Parse(body + 4);
    return r;
}

/* One request on a fresh connection ("Connection: close"). */
static raw_resp raw_request(const char *method, const char *target, const char *key,
                            const char *body) {
    int fd = conn_open();
    size_t blen = body ? strlen(body) : 0;
    size_t cap = strlen(target) + blen + 512;
    char *req = malloc(cap);
    int n = snprintf(req, cap,
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s%s"
                     "Content-Length: %zu\r\n\r\n%s",
                     method, target, key ? "Authorization: Bearer " : "", key ? key : "",
                     key ? "\r\n" : "", blen, body ? body : "");
    send_all(fd, req, (size_t)n);
    free(req);
    raw_resp r = raw_read(fd, 10000);
    close(fd);
    return r;
}

/* True if r is an OpenAI error object with this status (and code, if given). */
static bool is_json_error(const raw_resp *r, int status, const char *code) {
    if (r->status != status || !r->json) return false;
    const cJSON *e = cJSON_GetObjectItem(r->json, "error");
    if (!cJSON_IsObject(e) || !cJSON_IsString(cJSON_GetObjectItem(e, "message"))) return false;
    const cJSON *c = cJSON_GetObjectItem(e, "code");
    return !code || (cJSON_IsString(c) && strcmp(c->valuestring, code) == 0);
}

static void expect_json_error(raw_resp *r, int status, const char *code) {
    if (!is_json_error(r, status, code))
        fprintf(stderr, "expected %d %s, got:\n%.400s\n", status, code ? code : "",
                r->text ? r->text : "(nothing)");
    assert_true(is_json_error(r, status, code));
    assert_non_null(strcasestr(r->text, "content-type: application/json"));
}

static bool has_header(const raw_resp *r, const char *name) {
    char *end = strstr(r->text, "\r\n\r\n");
    char pat[80];
    snprintf(pat, sizeof pat, "\r\n%s:", name);
    char *h = strcasestr(r->text, pat);
    return h && (!end || h < end);
}

/* The number of memories GET /v1/memories/?user_id=U lists for key. */
static int count_memories(const char *key, const char *user) {
    char t[256];
    snprintf(t, sizeof t, "/v1/memories/?user_id=%s", user);
    raw_resp r = raw_request("GET", t, key, NULL);
    assert_int_equal(r.status, 200);
    const cJSON *res = cJSON_GetObjectItem(r.json, "results");
    int n = cJSON_IsArray(res) ? cJSON_GetArraySize(res) : cJSON_GetArraySize(r.json);
    raw_free(&r);
    return n;
}

/* Adds one fact for user; its id into id[80]. */
static void add_fact(const char *key, const char *user, const char *text, char id[80]) {
    char b[512];
    snprintf(b, sizeof b, "{\"user_id\":\"%s\",\"facts\":[\"%s\"],\"infer\":false}", user, text);
    raw_resp r = raw_request("POST", "/v1/memories/", key, b);
    if (r.status != 200) fprintf(stderr, "add: %.300s\n", r.text);
    assert_int_equal(r.status, 200);
    const cJSON *it = cJSON_GetArrayItem(cJSON_GetObjectItem(r.json, "results"), 0);
    const cJSON *jid = cJSON_GetObjectItem(it, "id");
    assert_true(cJSON_IsString(jid));
    snprintf(id, 80, "%s", jid->valuestring);
    raw_free(&r);
}

/* ---- set-up --------------------------------------------------------------------------- */

static int setup(void **state) {
    (void)state;
    if (!mkdtemp(g_dir)) return -1;
    char keys[512], data[512];
    snprintf(keys, sizeof keys, "%s/keys.txt", g_dir);
    snprintf(data, sizeof data, "%s/data", g_dir);
    FILE *f = fopen(keys, "w");
    if (!f) return -1;
    fprintf(f, "%s acme\n%s globex\n", KEY_A, KEY_B);
    fclose(f);
    http_app_params p = http_app_default_params();
    p.model_path = NULL; /* memory routes only: the cases are about HTTP */
    p.data_dir = data;
    p.keys_path = keys;
    p.embedder_dir = "none";
    p.http.port = 0;
    p.http.quiet = true;
    p.http.limits.max_in_flight = MAX_IN_FLIGHT;
    p.http.limits.max_connections = MAX_CONNECTIONS;
    p.http.limits.connection_timeout_s = IDLE_S;
    p.http.limits.max_in_flight_tenant = MAX_IN_FLIGHT_TENANT;
    p.http.limits.header_timeout_s = TIMEOUT_S;
    p.http.limits.body_timeout_s = TIMEOUT_S;
    p.notes = stderr;
    if (http_app_start(&p, &g_app) != IS_OK) {
        fprintf(stderr, "http_app_start: %s\n", is_error_last());
        return -1;
    }
    g_port = http_app_port(g_app);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    http_app_stop(g_app);
    test_remove_tree(g_dir);
    return 0;
}

/* ---- ids -------------------------------------------------------------------------------- */

/* "victim%00attacker" must not name "victim": not for a delete, not for a list. */
static void test_nul_in_query(void **state) {
    (void)state;
    char id[80];
    add_fact(KEY_A, "victim", "The victim keeps bees.", id);
    int before = count_memories(KEY_A, "victim");
    assert_true(before >= 1);
    raw_resp r = raw_request("DELETE", "/v1/memories/?user_id=victim%00attacker", KEY_A, NULL);
    int del_status = r.status;
    expect_json_error(&r, 400, NULL);
    raw_free(&r);
    assert_int_equal(count_memories(KEY_A, "victim"), before);
    r = raw_request("GET", "/v1/memories/?user_id=victim%00attacker", KEY_A, NULL);
    expect_json_error(&r, 400, NULL);
    raw_free(&r);
    r = raw_request("GET", "/v1/memories/?user_id=victim&agent_id=a%00b", KEY_A, NULL);
    expect_json_error(&r, 400, NULL);
    raw_free(&r);
    char out[64];
    snprintf(out, sizeof out, "%d json, nothing deleted", del_status);
    matrix("nul_in_query_string", 3, out);
}

static void test_nul_in_path(void **state) {
    (void)state;
    char id[80], t[200];
    add_fact(KEY_A, "pathuser", "The path user likes kites.", id);
    snprintf(t, sizeof t, "/v1/memories/%s%%00junk/", id);
    raw_resp r = raw_request("DELETE", t, KEY_A, NULL);
    expect_json_error(&r, 400, "invalid_url");
    raw_free(&r);
    snprintf(t, sizeof t, "/v1/memories/%s%%00junk/", id);
    r = raw_request("GET", t, KEY_A, NULL);
    expect_json_error(&r, 400, "invalid_url");
    raw_free(&r);
    assert_int_equal(count_memories(KEY_A, "pathuser"), 1);
    matrix("nul_in_path", 2, "400 json, memory kept");
}

static void test_control_chars_in_ids(void **state) {
    (void)state;
    int tries = 0;
    static const char *const targets[] = {"/v1/memories/?user_id=a%0Ab",
                                          "/v1/memories/?user_id=a%1Bb",
                                          "/v1/memories/?user_id=a%7Fb"};
    for (size_t i = 0; i < sizeof targets / sizeof *targets; i++, tries++) {
        raw_resp r = raw_request("GET", targets[i], KEY_A, NULL);
        expect_json_error(&r, 400, NULL);
        raw_free(&r);
    }
    static const char *const bodies[] = {
        "{\"query\":\"q\",\"user_id\":\"a\\u0001b\"}",
        "{\"query\":\"q\",\"user_id\":\"a\\u0085b\"}",
        "{\"query\":\"q\",\"user_id\":\"u\",\"agent_id\":\"x\\ny\"}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++, tries++) {
        raw_resp r = raw_request("POST", "/v1/memories/search/", KEY_A, bodies[i]);
        expect_json_error(&r, 400, "invalid_value");
        raw_free(&r);
    }
    raw_resp r = raw_request("POST", "/v1/memories/", KEY_A,
                             "{\"user_id\":\"a\\tb\",\"facts\":[\"x\"],\"infer\":false}");
    expect_json_error(&r, 400, "invalid_value");
    raw_free(&r);
    tries++;
    matrix("control_chars_in_ids", tries, "400 json");
}

/* ---- "*" and the Mem0 routes' bodies ------------------------------------------------------ */

/* One request that must be refused with a 400 JSON error. */
static void expect_400(const char *method, const char *target, const char *key, const char *body) {
    raw_resp r = raw_request(method, target, key, body);
    if (!is_json_error(&r, 400, NULL))
        fprintf(stderr, "%s %s %.200s\n", method, target, body ? body : "");
    expect_json_error(&r, 400, NULL);
    raw_free(&r);
}

/* The memories of tenant B whose user_id starts with prefix, listed
 * through the one place "*" means every user: a filters object. */
static int count_prefixed(const char *prefix) {
    raw_resp r = raw_request("POST", "/v2/memories/", KEY_B, "{\"filters\":{\"user_id\":\"*\"}}");
    assert_int_equal(r.status, 200);
    int n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(r.json, "results")) {
        const cJSON *u = cJSON_GetObjectItem(it, "user_id");
        n += cJSON_IsString(u) && strncmp(u->valuestring, prefix, strlen(prefix)) == 0;
    }
    raw_free(&r);
    return n;
}

/* A user named "*" would be one user when listed and every user of the
 * tenant when deleted: "*" is refused as an id on every route. */
static void test_star_refused_as_id(void **state) {
    (void)state;
    static const char *const adds[] = {
        "{\"user_id\":\"*\",\"facts\":[\"star fact\"],\"infer\":false}",
        "{\"user_id\":\"star-u\",\"agent_id\":\"*\",\"facts\":[\"star fact\"],\"infer\":false}",
        "{\"user_id\":\"star-u\",\"run_id\":\"*\",\"facts\":[\"star fact\"],\"infer\":false}",
        "{\"filters\":{\"user_id\":\"*\"},\"facts\":[\"star fact\"],\"infer\":false}",
    };
    int tries = 0;
    for (size_t i = 0; i < sizeof adds / sizeof *adds; i++, tries += 2) {
        expect_400("POST", "/v1/memories/", KEY_B, adds[i]);
        expect_400("POST", "/v3/memories/add/", KEY_B, adds[i]);
    }
    assert_int_equal(count_prefixed("star-"), 0);
    expect_400("GET", "/v1/memories/?user_id=*", KEY_B, NULL);
    expect_400("POST", "/v1/memories/search/", KEY_B, "{\"query\":\"q\",\"user_id\":\"*\"}");
    expect_400("POST", "/v2/memories/", KEY_B, "{\"user_id\":\"*\"}");
    expect_400("POST", "/v3/memories/search/", KEY_B, "{\"query\":\"q\",\"agent_id\":\"*\"}");
    tries += 4;
    matrix("star_as_id", tries, "400 json, nothing stored");
}

/* A path names one entity: "*" there is the name itself (which no id can
 * be, so 404), never every entity. In a delete's query "*" is Mem0's
 * documented wildcard (delete_all(run_id="*"): every memory with a run),
 * unambiguous since no stored id is "*": it deletes only those. */
static void test_star_delete_keeps_others(void **state) {
    (void)state;
    char id[80];
    add_fact(KEY_B, "star-alice", "Alice grows tomatoes.", id);
    add_fact(KEY_B, "star-alice", "Alice plays chess.", id);
    add_fact(KEY_B, "star-bob", "Bob repairs bikes.", id);
    raw_resp r = raw_request("POST", "/v3/memories/add/", KEY_B,
                             "{\"user_id\":\"star-dave\",\"run_id\":\"star-run\","
                             "\"facts\":[\"Dave is on a trip.\"],\"infer\":false}");
    assert_int_equal(r.status, 200);
    raw_free(&r);
    static const char *const paths[] = {"/v2/entities/user/*/", "/v2/entities/agent/*/",
                                        "/v2/entities/run/%2A/"};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++) {
        r = raw_request("DELETE", paths[i], KEY_B, NULL);
        expect_json_error(&r, 404, NULL);
        raw_free(&r);
    }
    expect_400("DELETE", "/v1/memories/?run_id=star-run&run_id=*", KEY_B, NULL);
    r = raw_request("DELETE", "/v1/memories/?run_id=%2A", KEY_B, NULL);
    assert_int_equal(r.status, 200);
    assert_int_equal(cJSON_GetObjectItem(r.json, "deleted")->valueint, 1);
    raw_free(&r);
    assert_int_equal(count_memories(KEY_B, "star-dave"), 0);
    assert_int_equal(count_memories(KEY_B, "star-alice"), 2);
    assert_int_equal(count_memories(KEY_B, "star-bob"), 1);
    matrix("star_in_deletes", 5,
           "path: 404, the name itself; query: Mem0's wildcard, only its matches deleted");
}

/* Inside an explicit filters object "*" keeps its meaning: any value. */
static void test_star_in_filters(void **state) {
    (void)state;
    char id[80];
    add_fact(KEY_B, "star-carol", "Carol sails.", id);
    assert_int_equal(count_prefixed("star-"), 4);
    raw_resp r = raw_request("POST", "/v2/memories/search/", KEY_B,
                             "{\"query\":\"Carol sails\",\"filters\":{\"user_id\":\"*\"}}");
    assert_int_equal(r.status, 200);
    assert_true(cJSON_GetArraySize(cJSON_GetObjectItem(r.json, "results")) >= 1);
    raw_free(&r);
    r = raw_request("POST", "/v3/memories/add/", KEY_B,
                    "{\"user_id\":\"star-carol\",\"agent_id\":\"star-bot\","
                    "\"facts\":[\"Carol told the bot a secret.\"],\"infer\":false}");
    assert_int_equal(r.status, 200);
    raw_free(&r);
    /* {"user_id":"*","agent_id":"star-bot"}: every user's memories with that agent. */
    r = raw_request("DELETE",
                    "/v1/memories/?filters=%7B%22user_id%22%3A%22*%22%2C%22agent_id%22%3A%22"
                    "star-bot%22%7D",
                    KEY_B, NULL);
    assert_int_equal(r.status, 200);
    assert_int_equal(cJSON_GetObjectItem(r.json, "deleted")->valueint, 1);
    raw_free(&r);
    assert_int_equal(count_memories(KEY_B, "star-alice"), 2);
    assert_int_equal(count_memories(KEY_B, "star-carol"), 1);
}

/* The text of memory id, as GET /v1/memories/{id}/ shows it (static). */
static const char *memory_text(const char *key, const char *id) {
    static char out[256];
    char t[160];
    snprintf(t, sizeof t, "/v1/memories/%s/", id);
    raw_resp r = raw_request("GET", t, key, NULL);
    assert_int_equal(r.status, 200);
    const cJSON *m = cJSON_GetObjectItem(r.json, "memory");
    snprintf(out, sizeof out, "%s", cJSON_IsString(m) ? m->valuestring : "");
    raw_free(&r);
    return out;
}

/* "\u0000" in a Mem0 route's body: "nulvictim\u0000attacker" must not name
 * nulvictim, and a text must not be stored cut at the NUL. */
static void test_nul_escape_mem0(void **state) {
    (void)state;
    char id[80], b[512];
    add_fact(KEY_A, "nulvictim", "The victim likes tea.", id);
    const char *bodies[][3] = {
        {"POST", "/v1/memories/",
         "{\"user_id\":\"nulvictim\\u0000attacker\",\"facts\":[\"planted\"],\"infer\":false}"},
        {"POST", "/v3/memories/add/",
         "{\"user_id\":\"nulvictim\\u0000attacker\",\"facts\":[\"planted\"],\"infer\":false}"},
        {"POST", "/v1/memories/",
         "{\"user_id\":\"nulvictim\",\"facts\":[\"hello\\u0000 secret tail\"],\"infer\":false}"},
        {"POST", "/v3/memories/add/",
         "{\"user_id\":\"nulvictim\",\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}],"
         "\"infer\":false}"},
        {"POST", "/v2/memories/", "{\"filters\":{\"user_id\":\"nulvictim\\u0000zzz\"}}"},
        {"POST", "/v3/memories/", "{\"user_id\":\"nulvictim\\u0000zzz\"}"},
        {"POST", "/v2/memories/search/",
         "{\"query\":\"tea\",\"filters\":{\"user_id\":\"nulvictim\\u0000z\"}}"},
        {"POST", "/v3/memories/search/", "{\"query\":\"tea\\u0000x\",\"user_id\":\"nulvictim\"}"},
    };
    int tries = 0;
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++, tries++)
        expect_400(bodies[i][0], bodies[i][1], KEY_A, bodies[i][2]);
    snprintf(b, sizeof b, "{\"memories\":[{\"memory_id\":\"%s\",\"text\":\"new\\u0000text\"}]}",
             id);
    expect_400("PUT", "/v1/batch/", KEY_A, b);
    snprintf(b, sizeof b, "{\"memories\":[{\"memory_id\":\"%s\\u0000x\"}]}", id);
    expect_400("DELETE", "/v1/batch/", KEY_A, b);
    expect_400("DELETE", "/v1/memories/?filters=%7B%22user_id%22%3A%22nulvictim%5Cu0000x%22%7D",
               KEY_A, NULL);
    tries += 3;
    assert_int_equal(count_memories(KEY_A, "nulvictim"), 1);
    assert_string_equal(memory_text(KEY_A, id), "The victim likes tea.");
    matrix("nul_escape_in_mem0_bodies", tries, "400 json, nothing stored, changed or deleted");
}

/* Data after the JSON object is a malformed body, not an ignored suffix. */
static void test_trailing_data_mem0(void **state) {
    (void)state;
    char id[80], b[512];
    add_fact(KEY_A, "trailuser", "The trail user hikes.", id);
    expect_400("POST", "/v1/memories/", KEY_A,
               "{\"user_id\":\"trailuser\",\"facts\":[\"trailing\"],\"infer\":false} }}garbage");
    expect_400("POST", "/v3/memories/add/", KEY_A,
               "{\"user_id\":\"trailuser\",\"facts\":[\"trailing\"],\"infer\":false}{}");
    expect_400("POST", "/v2/memories/", KEY_A, "{\"filters\":{\"user_id\":\"trailuser\"}} x");
    expect_400("POST", "/v2/memories/search/", KEY_A,
               "{\"query\":\"hikes\",\"user_id\":\"trailuser\"}]");
    snprintf(b, sizeof b, "{\"memories\":[{\"memory_id\":\"%s\",\"text\":\"changed\"}]} x", id);
    expect_400("PUT", "/v1/batch/", KEY_A, b);
    snprintf(b, sizeof b, "{\"memories\":[{\"memory_id\":\"%s\"}]}!", id);
    expect_400("DELETE", "/v1/batch/", KEY_A, b);
    expect_400("DELETE", "/v1/memories/?filters=%7B%22user_id%22%3A%22trailuser%22%7Dx", KEY_A,
               NULL);
    assert_int_equal(count_memories(KEY_A, "trailuser"), 1);
    assert_string_equal(memory_text(KEY_A, id), "The trail user hikes.");
    matrix("trailing_data_in_mem0_bodies", 7, "400 json, nothing stored, changed or deleted");
}

/* ?user_id=alice&user_id=bob is refused by GET; a DELETE must not take
 * the last one. */
static void test_repeated_query_id_delete(void **state) {
    (void)state;
    char id[80];
    add_fact(KEY_A, "rep-alice", "Alice rows.", id);
    add_fact(KEY_A, "rep-bob", "Bob rows too.", id);
    expect_400("GET", "/v1/memories/?user_id=rep-alice&user_id=rep-bob", KEY_A, NULL);
    expect_400("DELETE", "/v1/memories/?user_id=rep-alice&user_id=rep-bob", KEY_A, NULL);
    expect_400("DELETE", "/v1/memories/?user_id=rep-alice&agent_id=a&agent_id=b", KEY_A, NULL);
    expect_400("DELETE",
               "/v1/memories/?filters=%7B%22user_id%22%3A%22rep-alice%22%7D"
               "&filters=%7B%22user_id%22%3A%22rep-bob%22%7D",
               KEY_A, NULL);
    expect_400("POST", "/v2/memories/", KEY_A,
               "{\"user_id\":\"rep-alice\",\"user_id\":\"rep-bob\"}");
    /* One memory's routes too: the first value is not taken silently. */
    char t[200];
    snprintf(t, sizeof t, "/v1/memories/%s/?user_id=rep-bob&user_id=rep-alice", id);
    expect_400("GET", t, KEY_A, NULL);
    expect_400("DELETE", t, KEY_A, NULL);
    snprintf(t, sizeof t, "/v1/memories/%s/history/?user_id=rep-bob&user_id=rep-alice", id);
    expect_400("GET", t, KEY_A, NULL);
    assert_int_equal(count_memories(KEY_A, "rep-alice"), 1);
    assert_int_equal(count_memories(KEY_A, "rep-bob"), 1);
    raw_resp r =
        raw_request("DELETE", "/v1/memories/?user_id=rep-bob&user_id=rep-bob", KEY_A, NULL);
    assert_int_equal(r.status, 200);
    raw_free(&r);
    assert_int_equal(count_memories(KEY_A, "rep-alice"), 1);
    assert_int_equal(count_memories(KEY_A, "rep-bob"), 0);
    matrix("repeated_query_id", 8, "400 json, nothing deleted");
}

/* ---- slots ------------------------------------------------------------------------------ */

/* Clients without a key that announce a large body and send a few bytes:
 * each is answered 401 at once, without the body, and no slot is held. */
static void test_unauthenticated_hold(void **state) {
    (void)state;
    enum { N = MAX_IN_FLIGHT * 2 };
    int fds[N];
    int answered = 0;
    for (int i = 0; i < N; i++) {
        fds[i] = conn_open();
        static const char h[] =
            "POST /v1/memories/search/ HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"qu";
        send_all(fds[i], h, sizeof h - 1);
    }
    int closed = 0;
    for (int i = 0; i < N; i++) {
        raw_resp r = raw_read(fds[i], 3000);
        if (is_json_error(&r, 401, "invalid_api_key")) answered++;
        raw_free(&r);
        /* ... and the connection closed after the answer. */
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        char c;
        if (poll(&p, 1, 2000) > 0 && recv(fds[i], &c, 1, 0) <= 0) closed++;
    }
    /* While they are all still open, a keyed request gets through, at
     * once: their closing (which lingers to drop unread bytes) must not
     * hold up the daemon's accepting. */
    double t0 = now_s();
    raw_resp r = raw_request("GET", "/v1/memories/?user_id=victim", KEY_B, NULL);
    double keyed_s = now_s() - t0;
    int keyed = r.status;
    raw_free(&r);
    for (int i = 0; i < N; i++) close(fds[i]);
    char out[128];
    snprintf(out, sizeof out,
             "%d/%d answered 401 without the body, %d closed; keyed request %d in %.2f s", answered,
             N, closed, keyed, keyed_s);
    matrix("no_key_large_body_hold", N + 1, out);
    assert_int_equal(answered, N);
    assert_int_equal(closed, N);
    assert_int_equal(keyed, 200);
    assert_true(keyed_s < 2.0);
}

/* One round of tenant A filling every global slot with requests whose
 * bodies never come: how many were refused 429 (with Retry-After), how many
 * of the admitted ones timed out while the round watched, and tenant B's
 * status meanwhile. */
static void starve_round(int *refused_out, int *retry_after_out, int *timed_out_out,
                         int *other_out) {
    enum { N = MAX_IN_FLIGHT };
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = conn_open();
        char h[256];
        int n =
            snprintf(h, sizeof h,
                     "POST /v1/memories/search/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     "Content-Length: 1000\r\n\r\n{\"q",
                     KEY_A);
        send_all(fds[i], h, (size_t)n);
    }
    /* Collect the refusals as they come (a loaded machine takes its
     * time), then wait a little longer for any refusal too many. */
    int refused = 0, retry_after = 0, timed_out = 0;
    bool seen[N] = {false};
    double t0 = now_s(), settle = 0;
    while (now_s() - t0 < 10 && (!settle || now_s() < settle)) {
        for (int i = 0; i < N; i++) {
            struct pollfd p = {.fd = fds[i], .events = POLLIN};
            if (seen[i] || poll(&p, 1, 0) <= 0) continue;
            seen[i] = true;
            raw_resp r = raw_read(fds[i], 2000);
            if (r.status == 429) {
                refused++;
                /* ... and its connection closed. */
                char c;
                struct pollfd q = {.fd = fds[i], .events = POLLIN};
                assert_true(r.closed || (poll(&q, 1, 2000) > 0 && recv(fds[i], &c, 1, 0) <= 0));
                retry_after += has_header(&r, "Retry-After") && is_json_error(&r, 429, NULL);
            } else {
                timed_out++; /* admitted, then its body's time ran out */
            }
            raw_free(&r);
        }
        if (refused >= N - MAX_IN_FLIGHT_TENANT && !settle) settle = now_s() + 0.5;
        usleep(20 * 1000);
    }
    raw_resp r = raw_request("GET", "/v1/memories/?user_id=someone", KEY_B, NULL);
    *other_out = r.status;
    raw_free(&r);
    for (int i = 0; i < N; i++) close(fds[i]);
    *refused_out = refused;
    *retry_after_out = retry_after;
    *timed_out_out = timed_out;
}

/* Tenant A fills every global slot with requests whose bodies never come;
 * tenant B is still served, and A's requests past its share get 429 with
 * Retry-After. An admitted request whose body does not come within the
 * body timeout frees its slot, and a later one of A's may then take it:
 * a round in which that happened before all of A's requests were decided
 * (a slow machine) says nothing about the share, so it is run again,
 * after the round's requests have drained, up to three times. A server
 * that admits past the share keeps its extra requests until they time
 * out, so every round of it is unclean and the test fails. */
static void test_tenant_starvation(void **state) {
    (void)state;
    enum { N = MAX_IN_FLIGHT };
    int refused = 0, retry_after = 0, timed_out = 0, other = 0, round = 0;
    for (; round < 3; round++) {
        if (round) sleep(TIMEOUT_S + 1);
        starve_round(&refused, &retry_after, &timed_out, &other);
        if (timed_out == 0) break;
    }
    char out[160];
    snprintf(out, sizeof out,
             "tenant A: %d of %d refused 429 (%d with Retry-After); tenant B %d; rounds %d",
             refused, N, retry_after, other, round + (round < 3));
    matrix("one_tenant_fills_slots", N + 1, out);
    assert_int_equal(timed_out, 0);
    assert_int_equal(other, 200);
    assert_int_equal(refused, N - MAX_IN_FLIGHT_TENANT);
    assert_int_equal(retry_after, refused);
}

/* ---- connections --------------------------------------------------------------------- */

static void test_idle_connections(void **state) {
    (void)state;
    usleep(300 * 1000); /* the previous cases' connections close */
    enum { N = MAX_CONNECTIONS + 16 };
    int fds[N];
    for (int i = 0; i < N; i++) fds[i] = conn_open();
    usleep(200 * 1000);
    int ok = 0;
    for (int i = 0; i < 3; i++) {
        raw_resp r = raw_request("GET", "/health", NULL, NULL);
        ok += r.status == 200;
        raw_free(&r);
    }
    for (int i = 0; i < N; i++) close(fds[i]);
    char out[96];
    snprintf(out, sizeof out, "%d idle held (limit %d): %d/3 new requests served", N,
             MAX_CONNECTIONS, ok);
    matrix("idle_connections_past_limit", N + 3, out);
    assert_int_equal(ok, 3);
}

/* Keyless clients that announce a body and send it slowly, to a route
 * that takes no key or to one that refuses them (a DELETE's body is still
 * read after its 401): they hold no slot, so past the connection limit
 * they make room for new clients like idle connections do. */
static void test_keyless_bodies_past_limit(void **state) {
    (void)state;
    usleep(300 * 1000);
    enum { N = MAX_CONNECTIONS * 2 };
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = conn_open();
        const char *h = i % 4 ? "POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nab"
                              : "DELETE /v1/memories/?user_id=u HTTP/1.1\r\nHost: x\r\n"
                                "Content-Length: 100000\r\n\r\nab";
        send_all(fds[i], h, strlen(h));
    }
    usleep(200 * 1000);
    int ok = 0;
    for (int i = 0; i < 3; i++) {
        raw_resp r = raw_request("GET", "/health", NULL, NULL);
        ok += r.status == 200;
        raw_free(&r);
    }
    for (int i = 0; i < N; i++) close(fds[i]);
    char out[96];
    snprintf(out, sizeof out, "%d keyless slow bodies held (limit %d): %d/3 new requests served", N,
             MAX_CONNECTIONS, ok);
    matrix("keyless_bodies_past_limit", N + 3, out);
    assert_int_equal(ok, 3);
}

/* A request line, then one header byte every 200 ms: closed (with a 408)
 * within the header timeout, although bytes keep coming. */
static void test_slow_headers(void **state) {
    (void)state;
    int fd = conn_open();
    double t0 = now_s();
    send_all(fd, "GET /health HTTP/1.1\r\n", 22);
    bool closed = false;
    int sent = 0;
    while (now_s() - t0 < TIMEOUT_S + 4) {
        if (!send_all(fd, "X", 1)) {
            closed = true;
            break;
        }
        sent++;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) > 0) {
            closed = true;
            break;
        }
    }
    double took = now_s() - t0;
    raw_resp r = raw_read(fd, 1000);
    bool j408 = is_json_error(&r, 408, "request_timeout");
    raw_free(&r);
    close(fd);
    char out[96];
    snprintf(out, sizeof out, "%s after %.1f s (%d bytes trickled)%s", closed ? "closed" : "open",
             took, sent, j408 ? ", 408 json" : "");
    matrix("slow_headers", 1, out);
    assert_true(closed);
    assert_true(j408);
    assert_true(took < TIMEOUT_S + 2);
}

static void test_slow_body(void **state) {
    (void)state;
    int fd = conn_open();
    char h[256];
    int n = snprintf(h, sizeof h,
                     "POST /v1/memories/search/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     "Content-Length: 500\r\n\r\n{",
                     KEY_A);
    double t0 = now_s();
    send_all(fd, h, (size_t)n);
    bool closed = false;
    while (now_s() - t0 < TIMEOUT_S + 4) {
        if (!send_all(fd, " ", 1)) {
            closed = true;
            break;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) > 0) {
            closed = true;
            break;
        }
    }
    double took = now_s() - t0;
    raw_resp r = raw_read(fd, 1000);
    bool j408 = is_json_error(&r, 408, "request_timeout");
    raw_free(&r);
    close(fd);
    char out[64];
    snprintf(out, sizeof out, "%s after %.1f s%s", closed ? "closed" : "open", took,
             j408 ? ", 408 json" : "");
    matrix("slow_body", 1, out);
    assert_true(closed);
    assert_true(j408);
}

/* A kept-alive connection that sends nothing after its first request is
 * closed after the idle timeout, without a word (it has nothing to answer). */
static void test_idle_keepalive(void **state) {
    (void)state;
    int fd = conn_open();
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(fd, req, sizeof req - 1);
    raw_resp r = raw_read(fd, 5000);
    assert_int_equal(r.status, 200);
    assert_false(r.closed);
    raw_free(&r);
    double t0 = now_s();
    r = raw_read(fd, (IDLE_S + 3) * 1000);
    double took = now_s() - t0;
    close(fd);
    char out[64];
    snprintf(out, sizeof out, "%s after %.1f s", r.closed ? "closed" : "open", took);
    matrix("idle_keepalive", 1, out);
    assert_true(r.closed);
    assert_int_equal(r.len, 0);
    assert_true(took >= IDLE_S - 0.5);
    raw_free(&r);
}

/* ---- errors in the JSON shape ----------------------------------------------------------- */

static void test_oversize_requests(void **state) {
    (void)state;
    size_t big = 100 * 1024;
    char *t = malloc(big + 64);
    int n = snprintf(t, big + 64, "/v1/memories/?user_id=");
    memset(t + n, 'u', big);
    t[n + big] = '\0';
    raw_resp r = raw_request("GET", t, KEY_A, NULL);
    expect_json_error(&r, 414, "uri_too_long");
    raw_free(&r);

    int fd = conn_open();
    char *req = malloc(big + 256);
    n = snprintf(req, 256, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: ");
    memset(req + n, 'p', big);
    memcpy(req + n + big, "\r\n\r\n", 4);
    send_all(fd, req, (size_t)n + big + 4);
    r = raw_read(fd, 5000);
    close(fd);
    expect_json_error(&r, 431, "headers_too_large");
    raw_free(&r);

    /* 600 query parameters. */
    size_t cap = 600 * 8 + 64;
    char *q = malloc(cap);
    size_t at = (size_t)snprintf(q, cap, "/v1/memories/?user_id=u");
    for (int i = 0; i < 600; i++) at += (size_t)snprintf(q + at, cap - at, "&p%d=1", i);
    r = raw_request("GET", q, KEY_A, NULL);
    expect_json_error(&r, 400, NULL);
    raw_free(&r);
    free(q);
    free(req);
    free(t);
    matrix("oversize_url_header_params", 3, "414 / 431 / 400 json");
}

/* 503 (no model here) and 429 both say when to retry. */
static void test_retry_after(void **state) {
    (void)state;
    raw_resp r = raw_request("POST", "/v1/chat/completions", KEY_A,
                             "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}");
    expect_json_error(&r, 503, NULL);
    bool ra = has_header(&r, "Retry-After");
    raw_free(&r);
    matrix("retry_after_on_503", 1, ra ? "503 json with Retry-After" : "503 without Retry-After");
    assert_true(ra);
}

static void test_no_cross_tenant_counts(void **state) {
    (void)state;
    raw_resp h = raw_request("GET", "/health", NULL, NULL);
    raw_resp m = raw_request("GET", "/metrics", NULL, NULL);
    assert_int_equal(h.status, 200);
    assert_int_equal(m.status, 200);
    bool leak_h = cJSON_GetObjectItem(h.json, "facts") != NULL;
    bool leak_m = strstr(m.text, "inferscale_memory_facts") != NULL;
    /* The connections the earlier cases had closed are counted. */
    const char *ev = strstr(m.text, "\ninferscale_http_connections_evicted_total ");
    const char *to = strstr(m.text, "\ninferscale_http_connections_timed_out_total ");
    assert_non_null(ev);
    assert_non_null(to);
    assert_true(atof(ev + 43) >= 16);
    assert_true(atof(to + 45) >= 2);
    raw_free(&h);
    raw_free(&m);
    matrix("cross_tenant_counts", 2, leak_h || leak_m ? "fact count shown" : "no fact counts");
    assert_false(leak_h);
    assert_false(leak_m);
}

/* Errors libmicrohttpd answers itself, before any callback of ours (its
 * fixed HTML pages, or a close; libmicrohttpd has no hook to replace them,
 * see docs/reliability.md): each gets an answer or a close within a few
 * seconds, and the server keeps serving. The last case is a head larger
 * than the daemon's per-connection memory, past the 431 of our own check. */
static void test_mhd_errors(void **state) {
    (void)state;
    size_t huge = (size_t)600 << 10;
    char *big = malloc(huge + 128);
    int n0 = snprintf(big, 128, "GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ");
    memset(big + n0, 'p', huge);
    memcpy(big + n0 + huge, "\r\n\r\n", 5);
    const char *const reqs[] = {
        "POST /v1/memories/search/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " KEY_A
        "\r\nContent-Length: 12abc\r\n\r\n{}",
        "POST /v1/memories/search/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " KEY_A
        "\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        "\x01\x02garbage \xff\xfe\r\n\r\n",
        big,
    };
    static const char *const names[] = {"bad_content_length", "bad_chunk_size", "http_9_9",
                                        "garbage_request_line", "head_of_600_kib"};
    for (size_t i = 0; i < sizeof reqs / sizeof *reqs; i++) {
        int fd = conn_open();
        /* Bounded: a server that stops reading must not hang the test. */
        struct timeval tv = {.tv_sec = 5};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        send_all(fd, reqs[i], strlen(reqs[i]));
        raw_resp r = raw_read(fd, 4000);
        close(fd);
        char out[96];
        if (r.status)
            snprintf(out, sizeof out, "status %d %s", r.status,
                     r.json ? "json" : "not json (libmicrohttpd's own page)");
        else snprintf(out, sizeof out, "closed without a response (libmicrohttpd)");
        matrix(names[i], 1, out);
        assert_true(r.status >= 400 || r.closed);
        raw_free(&r);
        raw_resp ok = raw_request("GET", "/health", NULL, NULL);
        assert_int_equal(ok.status, 200);
        raw_free(&ok);
    }
    free(big);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nul_in_query),
        cmocka_unit_test(test_nul_in_path),
        cmocka_unit_test(test_control_chars_in_ids),
        cmocka_unit_test(test_star_refused_as_id),
        cmocka_unit_test(test_star_delete_keeps_others),
        cmocka_unit_test(test_star_in_filters),
        cmocka_unit_test(test_nul_escape_mem0),
        cmocka_unit_test(test_trailing_data_mem0),
        cmocka_unit_test(test_repeated_query_id_delete),
        cmocka_unit_test(test_unauthenticated_hold),
        cmocka_unit_test(test_tenant_starvation),
        cmocka_unit_test(test_idle_connections),
        cmocka_unit_test(test_keyless_bodies_past_limit),
        cmocka_unit_test(test_slow_headers),
        cmocka_unit_test(test_slow_body),
        cmocka_unit_test(test_idle_keepalive),
        cmocka_unit_test(test_oversize_requests),
        cmocka_unit_test(test_retry_after),
        cmocka_unit_test(test_no_cross_tenant_counts),
        cmocka_unit_test(test_mhd_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/*
 * In-flight slots and strictly sequential clients: a client that sends its
 * next request as soon as it has read an answer must never find its own
 * previous request still holding a slot. Two servers on loopback, driven
 * over raw sockets, each request on a new connection (the case where the
 * next request is handled by another thread than the one finishing the
 * previous one):
 *
 *   - all tenants limited to 1 in flight (--max-in-flight 1): memory
 *     routes, and with the default model non-streaming and streaming chats;
 *   - each tenant limited to 1 (--max-in-flight-tenant 1) with room in all:
 *     memory routes of two tenants in turn, and one tenant's streaming
 *     chats.
 *
 * Every answer must be a 200: one 429 fails the case. Bounded: a few
 * hundred requests, each read with a timeout.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "serve/http/app.h"
#include "test_util.h"

#define KEY_A    "sk-slots-tenant-a-0001"
#define KEY_B    "sk-slots-tenant-b-0002"
#define N_MEMORY 300 /* sequential memory requests per case */
#define N_CHAT   24  /* sequential chats per kind */

typedef struct server {
    http_app *app;
    int port;
    char dir[64];
} server;

static server g_all;    /* max_in_flight 1 */
static server g_tenant; /* max_in_flight 8, per tenant 1 */
static bool g_model;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- raw HTTP ----------------------------------------------------------------------- */

/* One request on a new connection; returns the status (0: none) once the
 * whole answer is in (Content-Length, or the chunked end "0\r\n\r\n"),
 * then closes. close_hdr: ask for "Connection: close" (else the server
 * keeps the connection and the client drops it). */
static int request(int port, const char *method, const char *target, const char *key,
                   const char *body, bool close_hdr, size_t *body_len) {
    int fd = test_connect_loopback(port);
    assert_true(fd >= 0);
    char req[2048];
    size_t blen = body ? strlen(body) : 0;
    int n = snprintf(req, sizeof req,
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sAuthorization: Bearer %s\r\n"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     method, target, close_hdr ? "Connection: close\r\n" : "", key, blen,
                     body ? body : "");
    assert_true(n > 0 && (size_t)n < sizeof req);
    assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    static char buf[1 << 16];
    size_t len = 0;
    double end = now_s() + 30;
    for (;;) {
        buf[len] = '\0';
        char *he = strstr(buf, "\r\n\r\n");
        if (he) {
            size_t head = (size_t)(he + 4 - buf);
            const char *cl = strcasestr(buf, "\r\ncontent-length:");
            if (cl && cl < he && len >= head + strtoul(cl + 17, NULL, 10)) break;
            if (strcasestr(buf, "\r\ntransfer-encoding: chunked") && len >= head + 5 &&
                memcmp(buf + len - 5, "0\r\n\r\n", 5) == 0)
                break;
        }
        int left = (int)((end - now_s()) * 1e3);
        assert_true(left > 0); /* an answer within 30 s */
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) continue;
        assert_true(len < sizeof buf - 1);
        ssize_t got = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        if (got <= 0) break;
        len += (size_t)got;
    }
    close(fd);
    int status = 0;
    sscanf(buf, "HTTP/1.%*d %d", &status);
    if (status != 200) fprintf(stderr, "%s %s: %.300s\n", method, target, buf);
    if (body_len) *body_len = len;
    return status;
}

/* ---- set-up --------------------------------------------------------------------------- */

static int start(server *s, int32_t max_in_flight, int32_t max_in_flight_tenant) {
    snprintf(s->dir, sizeof s->dir, "/tmp/test_http_slots_XXXXXX");
    if (!mkdtemp(s->dir)) return -1;
    char keys[128], data[128];
    snprintf(keys, sizeof keys, "%s/keys.txt", s->dir);
    snprintf(data, sizeof data, "%s/data", s->dir);
    FILE *f = fopen(keys, "w");
    if (!f) return -1;
    fprintf(f, "%s acme\n%s globex\n", KEY_A, KEY_B);
    fclose(f);
    http_app_params p = http_app_default_params();
    p.model_path = g_model ? IS_DEFAULT_MODEL : NULL;
    p.data_dir = data;
    p.keys_path = keys;
    p.embedder_dir = "none";
    p.threads = 1;
    p.n_ctx = 512;
    p.kv_bytes = (size_t)32 << 20;
    p.http.port = 0;
    p.http.quiet = true;
    p.http.limits.max_in_flight = max_in_flight;
    p.http.limits.max_in_flight_tenant = max_in_flight_tenant;
    p.notes = stderr;
    if (http_app_start(&p, &s->app) != IS_OK) {
        fprintf(stderr, "http_app_start: %s\n", is_error_last());
        return -1;
    }
    s->port = http_app_port(s->app);
    return 0;
}

static int setup(void **state) {
    (void)state;
    struct stat sb;
    g_model = stat(IS_DEFAULT_MODEL, &sb) == 0;
    if (!g_model)
        fprintf(stderr, "test_http_slots: %s missing: chat cases skip\n", IS_DEFAULT_MODEL);
    if (start(&g_all, 1, 1) != 0) return -1;
    return start(&g_tenant, 8, 1);
}

static int teardown(void **state) {
    (void)state;
    http_app_stop(g_all.app);
    http_app_stop(g_tenant.app);
    test_remove_tree(g_all.dir);
    test_remove_tree(g_tenant.dir);
    return 0;
}

/* ---- cases ----------------------------------------------------------------------------- */

static const char add_body[] = "{\"user_id\":\"u\",\"facts\":[\"I keep bees.\"],\"infer\":false}";

/* A loop of reads and writes of the memory API, alternating connections
 * closed by the server and by the client: every answer a 200. */
static void matrix(const char *name, int tries, int ok, int refused) {
    printf("fault-matrix: concurrency|%s|%d|%d answered 200, %d refused 429\n", name, tries, ok,
           refused);
    fflush(stdout);
}

static void memory_loop(server *s, bool two_tenants) {
    int ok = 0, refused = 0;
    for (int i = 0; i < N_MEMORY; i++) {
        const char *key = two_tenants && (i & 1) ? KEY_B : KEY_A;
        bool add = i % 10 == 0;
        int st = add ? request(s->port, "POST", "/v1/memories/", key, add_body, i & 2, NULL)
                     : request(s->port, "GET", "/v1/memories/?user_id=u", key, NULL, i & 2, NULL);
        ok += st == 200;
        refused += st == 429;
    }
    matrix(two_tenants ? "sequential memory requests, 1 in flight per tenant, new connection each"
                       : "sequential memory requests, 1 in flight in all, new connection each",
           N_MEMORY, ok, refused);
    assert_int_equal(refused, 0);
    assert_int_equal(ok, N_MEMORY);
}

static void test_all_limit_memory(void **state) {
    (void)state;
    memory_loop(&g_all, false);
}

static void test_tenant_limit_memory(void **state) {
    (void)state;
    memory_loop(&g_tenant, true);
}

static void chat_loop(server *s, bool stream, bool two_tenants) {
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    char body[256];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Say hi.\"}],\"max_tokens\":2,"
             "\"temperature\":0%s}",
             stream ? ",\"stream\":true" : "");
    int ok = 0, refused = 0;
    for (int i = 0; i < N_CHAT; i++) {
        const char *key = two_tenants && (i & 1) ? KEY_B : KEY_A;
        size_t len = 0;
        int st = request(s->port, "POST", "/v1/chat/completions", key, body, i & 1, &len);
        ok += st == 200;
        refused += st == 429;
    }
    char name[128];
    snprintf(name, sizeof name, "sequential %s chats, 1 in flight %s, new connection each",
             stream ? "streaming" : "non-streaming", s == &g_all ? "in all" : "per tenant");
    matrix(name, N_CHAT, ok, refused);
    assert_int_equal(refused, 0);
    assert_int_equal(ok, N_CHAT);
}

static void test_all_limit_chat(void **state) {
    (void)state;
    chat_loop(&g_all, false, false);
}

static void test_all_limit_stream(void **state) {
    (void)state;
    chat_loop(&g_all, true, false);
}

static void test_tenant_limit_stream(void **state) {
    (void)state;
    chat_loop(&g_tenant, true, false);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_limit_memory),    cmocka_unit_test(test_tenant_limit_memory),
        cmocka_unit_test(test_all_limit_chat),      cmocka_unit_test(test_all_limit_stream),
        cmocka_unit_test(test_tenant_limit_stream),
    };
    return test_run_group(tests, setup, teardown);
}

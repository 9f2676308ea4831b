/*
 * The HTTP layer's pure parts, without a server: request
 * body and query parsers (what the fuzz target drives), the keys file and
 * key lookup, and the Prometheus rendering of histograms.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "serve/http/auth.h"
#include "serve/http/guard.h"
#include "serve/http/metrics.h"
#include "serve/http/parse.h"

#define CHAT(body) parse_chat_request(body, strlen(body), NULL, &c, &e)

static void test_chat_parse(void **state) {
    parse_chat c;
    parse_error e;
    const char *ok =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"developer\",\"content\":\"sys\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\","
        "\"text\":\"b\"}]},"
        "{\"role\":\"assistant\",\"content\":\"c\"},{\"role\":\"user\",\"content\":\"last\"}],"
        "\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,\"seed\":42,\"stop\":[\"x\",\"\",\"y\"]"
        ","
        "\"stream\":true,\"stream_options\":{\"include_usage\":false},\"user\":\"u1\","
        "\"memory\":{\"k\":3,\"mode\":\"prompt\",\"filters\":{\"agent_id\":\"a\",\"topic\":"
        "\"food\","
        "\"metadata\":{\"n\":2.0,\"f\":0.5,\"b\":true}}},\"frequency_penalty\":0}";
    assert_int_equal(CHAT(ok), IS_OK);
    assert_string_equal(c.model, "m");
    assert_int_equal(c.n_messages, 4);
    assert_string_equal(c.messages[0].role, "system");
    assert_string_equal(c.messages[1].content, "ab");
    assert_string_equal(parse_chat_query(&c), "last");
    assert_int_equal(c.max_tokens, 7);
    assert_true(c.temperature == 0.5f && c.top_p == 0.9f);
    assert_true(c.has_seed);
    assert_int_equal(c.seed, 42);
    assert_int_equal(c.n_stop, 2); /* the empty one is dropped */
    assert_true(c.stream);
    assert_false(c.include_usage);
    assert_string_equal(c.user, "u1");
    assert_true(c.has_memory);
    assert_int_equal(c.k, 3);
    assert_int_equal(c.mode, PARSE_MODE_PROMPT);
    assert_string_equal(c.filters.agent_id, "a");
    assert_int_equal(c.filters.n_meta, 4);
    /* canonical values, as memory/index.h compares them */
    const char *want[][2] = {{"topic", "food"}, {"n", "2"}, {"f", "0.5"}, {"b", "true"}};
    for (int i = 0; i < 4; i++) {
        assert_string_equal(c.filters.meta_keys[i], want[i][0]);
        assert_string_equal(c.filters.meta_values[i], want[i][1]);
    }
    parse_chat_free(&c);

    /* Defaults. */
    assert_int_equal(CHAT("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"), IS_OK);
    parse_limits d = parse_default_limits();
    assert_int_equal(c.max_tokens, d.default_max_tokens);
    assert_int_equal(c.k, d.default_k);
    assert_int_equal(c.mode, PARSE_MODE_DEFAULT);
    assert_true(c.temperature == 1.0f);
    assert_true(c.include_usage);
    assert_false(c.has_memory);
    assert_null(c.user);
    parse_chat_free(&c);

    struct {
        const char *body, *param, *code;
    } bad[] = {
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":1e300}",
         "max_tokens", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":-0.1}",
         "temperature", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"seed\":1.5}", "seed",
         "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\"}]}", "messages[0]", "invalid_type"},
        {"{\"messages\":[{\"content\":\"x\"}]}", "messages[0]", "invalid_type"},
        {"{\"messages\":[1]}", "messages[0]", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}",
         "messages[0]", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", "tools",
         "unsupported"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"memory\":{\"filters\":{"
         "\"metadata\":[]}}}",
         "memory.filters", "invalid_type"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"memory\":{\"filters\":{\"a\":1,"
         "\"metadata\":{\"a\":2}}}}",
         "memory.filters", "invalid_value"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream_options\":1}",
         "stream_options", "invalid_type"},
        {"{\"a\":\"\\\\u0000\"}", "messages",
         "missing_field"}, /* an escaped backslash, not a NUL */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&e, 0, sizeof e);
        is_status st = CHAT(bad[i].body);
        if (st == IS_OK || strcmp(e.param, bad[i].param) != 0 || strcmp(e.code, bad[i].code) != 0)
            fprintf(stderr, "case %zu: %s -> %d %s %s: %s\n", i, bad[i].body, e.status, e.param,
                    e.code, e.message);
        assert_int_equal(st, IS_ERR_INVALID_ARG);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.param, bad[i].param);
        assert_string_equal(e.code, bad[i].code);
        parse_chat_free(&c);
    }
    /* Bodies that are not one UTF-8 JSON object. */
    const char with_nul[] = "{\"messages\":[]}\0x";
    assert_int_equal(parse_chat_request(with_nul, sizeof with_nul - 1, NULL, &c, &e),
                     IS_ERR_INVALID_ARG);
    assert_string_equal(e.code, "invalid_json");
    parse_chat_free(&c);
    assert_int_equal(parse_chat_request("{\"a\":\"\xff\"}", 8, NULL, &c, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.code, "invalid_utf8");
    parse_chat_free(&c);
    /* Deep nesting is refused by cJSON's limit, without a crash. */
    size_t depth = 5000;
    char *deep = malloc(depth * 2 + 1);
    for (size_t i = 0; i < depth; i++) deep[i] = '[';
    for (size_t i = 0; i < depth; i++) deep[depth + i] = ']';
    deep[2 * depth] = '\0';
    assert_int_equal(parse_chat_request(deep, 2 * depth, NULL, &c, &e), IS_ERR_INVALID_ARG);
    parse_chat_free(&c);
    free(deep);
    /* Limits are the caller's. */
    parse_limits lim = parse_default_limits();
    lim.max_k = 5;
    lim.max_tokens = 10;
    const char *b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"memory\":{\"k\":6}}";
    assert_int_equal(parse_chat_request(b, strlen(b), &lim, &c, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "memory.k");
    parse_chat_free(&c);
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":11}";
    assert_int_equal(parse_chat_request(b, strlen(b), &lim, &c, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "max_completion_tokens");
    parse_chat_free(&c);
}

static void test_memory_parse(void **state) {
    parse_mem_add a;
    parse_error e;
    const char *b =
        "{\"user_id\":\"u\",\"agent_id\":\"ag\",\"run_id\":\"r\",\"metadata\":{\"k\":1},"
        "\"messages\":[{\"role\":\"user\",\"content\":\"m1\"}],\"facts\":[\"f1\",\"f2\"],\"infer\":"
        "false}";
    assert_int_equal(parse_memory_add(b, strlen(b), NULL, &a, &e), IS_OK);
    assert_string_equal(a.user_id, "u");
    assert_string_equal(a.agent_id, "ag");
    assert_string_equal(a.run_id, "r");
    assert_string_equal(a.metadata_json, "{\"k\":1}");
    assert_int_equal(a.n_messages, 1);
    assert_int_equal(a.n_facts, 2);
    assert_false(a.infer);
    parse_mem_add_free(&a);
    b = "{\"user_id\":\"u\",\"messages\":[{\"role\":\"user\",\"content\":\"m1\"}]}";
    assert_int_equal(parse_memory_add(b, strlen(b), NULL, &a, &e), IS_OK);
    assert_true(a.infer); /* Mem0's default */
    parse_mem_add_free(&a);
    /* Content parts are a chat feature only. */
    b = "{\"user_id\":\"u\",\"messages\":[{\"role\":\"user\",\"content\":[]}]}";
    assert_int_equal(parse_memory_add(b, strlen(b), NULL, &a, &e), IS_ERR_INVALID_ARG);
    parse_mem_add_free(&a);
    char longid[400];
    memset(longid, 'x', sizeof longid);
    longid[sizeof longid - 1] = '\0';
    char body[600];
    snprintf(body, sizeof body, "{\"user_id\":\"%s\",\"facts\":[\"f\"]}", longid);
    assert_int_equal(parse_memory_add(body, strlen(body), NULL, &a, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "user_id");
    parse_mem_add_free(&a);

    parse_mem_search s;
    b = "{\"query\":\"q\",\"limit\":3,\"filters\":{\"user_id\":\"u\",\"run_id\":\"r\",\"lang\":"
        "\"pt\"}}";
    assert_int_equal(parse_memory_search(b, strlen(b), NULL, &s, &e), IS_OK);
    assert_int_equal(s.top_k, 3);
    assert_string_equal(s.filters.user_id, "u");
    assert_string_equal(s.filters.run_id, "r");
    assert_int_equal(s.filters.n_meta, 1);
    parse_mem_search_free(&s);
    b = "{\"query\":\"   \",\"user_id\":\"u\"}";
    assert_int_equal(parse_memory_search(b, strlen(b), NULL, &s, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "query");
    parse_mem_search_free(&s);

    parse_mem_update u;
    b = "{\"data\":\"new\",\"metadata\":null}";
    assert_int_equal(parse_memory_update(b, strlen(b), &u, &e), IS_OK);
    assert_string_equal(u.text, "new");
    assert_string_equal(u.metadata_json, "{}"); /* null clears */
    parse_mem_update_free(&u);
    b = "{\"text\":\"a\",\"memory\":\"b\"}";
    assert_int_equal(parse_memory_update(b, strlen(b), &u, &e), IS_ERR_INVALID_ARG);
    parse_mem_update_free(&u);

    parse_filters f;
    const char *k1[] = {"user_id", "metadata", "agent_id"};
    const char *v1[] = {"u", "{\"x\":1,\"y\":\"z\"}", "a"};
    assert_int_equal(parse_memory_query(k1, v1, 3, true, &f, &e), IS_OK);
    assert_string_equal(f.user_id, "u");
    assert_string_equal(f.agent_id, "a");
    assert_int_equal(f.n_meta, 2);
    assert_string_equal(f.meta_values[0], "1");
    parse_filters_free(&f);
    const char *k2[] = {"agent_id"};
    const char *v2[] = {"a"};
    assert_int_equal(parse_memory_query(k2, v2, 1, true, &f, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "user_id");
    const char *k3[] = {"user_id", "user_id"};
    const char *v3[] = {"u", "v"};
    assert_int_equal(parse_memory_query(k3, v3, 2, true, &f, &e), IS_ERR_INVALID_ARG);
    const char *k4[] = {"user_id", "page"};
    const char *v4[] = {"u", "2"};
    assert_int_equal(parse_memory_query(k4, v4, 2, true, &f, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.code, "unknown_field");
    /* The metadata filter of a query string is held to a body's rules: a
     * trailing word, or an escaped NUL that would cut "x\u0000y" to "x"
     * and widen a delete, is refused (found by fuzz_http_parse). */
    const char *k5[] = {"user_id", "metadata"};
    const char *bad_meta[] = {"{\"a\":\"x\"} garbage", "{\"a\":\"x\\u0000y\"}",
                              "{\"a\\u0000b\":1}"};
    for (size_t i = 0; i < sizeof bad_meta / sizeof *bad_meta; i++) {
        const char *v5[] = {"u", bad_meta[i]};
        assert_int_equal(parse_memory_query(k5, v5, 2, true, &f, &e), IS_ERR_INVALID_ARG);
        assert_string_equal(e.param, "metadata");
    }
    const char *v6[] = {"u", " {\"a\":\"x\"} "};
    assert_int_equal(parse_memory_query(k5, v6, 2, true, &f, &e), IS_OK);
    parse_filters_free(&f);

    assert_true(parse_memory_id_valid("0a1b-C_9", 8));
    assert_false(parse_memory_id_valid("", 0));
    assert_false(parse_memory_id_valid("../x", 4));
    assert_false(parse_memory_id_valid("a b", 3));
}

/* One id check for every source; query values are read with their length,
 * so a decoded %00 is refused instead of cutting the id short. */
static void test_ids_and_urls(void **state) {
    (void)state;
    parse_error e;
    assert_int_equal(parse_id_check("user_id", "alice", 5, &e), IS_OK);
    assert_int_equal(parse_id_check("user_id",
                                    "b\xc3\xb6"
                                    "b",
                                    4, &e),
                     IS_OK);
    assert_int_equal(parse_id_check("user_id", "", 0, &e), IS_ERR_INVALID_ARG);
    assert_int_equal(parse_id_check("user_id", "victim\0attacker", 15, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "user_id");
    assert_int_equal(parse_id_check("user_id", "a\nb", 3, &e), IS_ERR_INVALID_ARG);
    assert_int_equal(parse_id_check("user_id", "a\x7f", 2, &e), IS_ERR_INVALID_ARG);
    assert_int_equal(parse_id_check("user_id", "a\xc2\x85", 3, &e), IS_ERR_INVALID_ARG); /* C1 */
    assert_int_equal(parse_id_check("user_id", "a\xc3", 2, &e), IS_ERR_INVALID_ARG); /* cut UTF-8 */
    /* "*" is a filter's wildcard, never a name; "**" and "a*" are names. */
    assert_int_equal(parse_id_check("user_id", "*", 1, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "user_id");
    assert_int_equal(parse_id_check("agent_id", "*", 1, &e), IS_ERR_INVALID_ARG);
    assert_int_equal(parse_id_check("user_id", "**", 2, &e), IS_OK);
    assert_int_equal(parse_id_check("user_id", "a*", 2, &e), IS_OK);
    parse_mem_add a;
    assert_int_equal(parse_memory_add("{\"user_id\":\"*\",\"facts\":[\"x\"]}", 29, NULL, &a, &e),
                     IS_ERR_INVALID_ARG);
    parse_mem_add_free(&a);
    parse_mem_search q;
    const char *qs = "{\"query\":\"q\",\"filters\":{\"user_id\":\"*\"}}";
    assert_int_equal(parse_memory_search(qs, strlen(qs), NULL, &q, &e), IS_ERR_INVALID_ARG);
    parse_mem_search_free(&q);
    /* The checked parser, as the Mem0 routes now use it. */
    const char *nul = "{\"user_id\":\"v\\u0000x\"}", *trail = "{\"a\":1} x";
    assert_null(parse_object(nul, strlen(nul), NULL, &e));
    assert_null(parse_object(trail, strlen(trail), NULL, &e));
    cJSON *o = parse_object("{\"a\":1} \n", 9, NULL, &e);
    assert_non_null(o);
    cJSON_Delete(o);
    char long_id[PARSE_MAX_ID + 2];
    memset(long_id, 'x', sizeof long_id);
    assert_int_equal(parse_id_check("user_id", long_id, PARSE_MAX_ID, &e), IS_OK);
    assert_int_equal(parse_id_check("user_id", long_id, PARSE_MAX_ID + 1, &e), IS_ERR_INVALID_ARG);

    const char *k[] = {"user_id"};
    const char *v[] = {"victim\0attacker"};
    size_t kl[] = {7}, vl[] = {15};
    parse_filters f;
    assert_int_equal(parse_memory_query_n(k, kl, v, vl, 1, true, &f, &e), IS_ERR_INVALID_ARG);
    vl[0] = 6; /* "victim" alone is fine */
    assert_int_equal(parse_memory_query_n(k, kl, v, vl, 1, true, &f, &e), IS_OK);
    assert_string_equal(f.user_id, "victim");
    parse_filters_free(&f);

    const char *cb = "{\"query\":\"q\",\"user_id\":\"a\\u0001\"}";
    parse_mem_search ms;
    assert_int_equal(parse_memory_search(cb, strlen(cb), NULL, &ms, &e), IS_ERR_INVALID_ARG);
    parse_mem_search_free(&ms);
    const char *chat =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"user\":\"a\\u001bb\"}";
    parse_chat c;
    assert_int_equal(parse_chat_request(chat, strlen(chat), NULL, &c, &e), IS_ERR_INVALID_ARG);
    assert_string_equal(e.param, "user");
    parse_chat_free(&c);

    const char *ok = "/v1/memories/?user_id=caf%C3%A9&agent_id=a%2Fb";
    assert_int_equal(parse_url_check(ok, strlen(ok), &e), IS_OK);
    static const char *const bad[] = {"/v1/memories/?user_id=v%00a", "/v1/memories/x%0a/",
                                      "/v1/memories/?user_id=%7f", "/a\tb"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(parse_url_check(bad[i], strlen(bad[i]), &e), IS_ERR_INVALID_ARG);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.code, "invalid_url");
    }
    const char *pct = "/a%zz%4"; /* not escapes: kept as they are */
    assert_int_equal(parse_url_check(pct, strlen(pct), &e), IS_OK);
    char *huge = malloc(PARSE_MAX_URL + 2);
    memset(huge, 'a', PARSE_MAX_URL + 1);
    huge[PARSE_MAX_URL + 1] = '\0';
    assert_int_equal(parse_url_check(huge, PARSE_MAX_URL, &e), IS_OK);
    assert_int_equal(parse_url_check(huge, PARSE_MAX_URL + 1, &e), IS_ERR_INVALID_ARG);
    assert_int_equal(e.status, 414);
    free(huge);
}

/* The connection guard on its own: slots in all and per tenant; eviction
 * at the limit picks the oldest connection waiting for headers (or a
 * slotless body), never a busy one; the reaper answers a slow header with
 * a 408 and closes. Sockets are socketpairs: the test holds the client end. */
static void test_guard(void **state) {
    (void)state;
    http_guard *g;
    http_guard_params p = {.max_connections = 2,
                           .header_timeout_s = 1,
                           .body_timeout_s = 0,
                           .idle_timeout_s = 0,
                           .max_in_flight = 3,
                           .max_in_flight_tenant = 2};
    assert_int_equal(http_guard_create(&p, &g), IS_OK);
    assert_int_equal(http_guard_acquire(g, "a"), HTTP_GUARD_SLOT_OK);
    assert_int_equal(http_guard_acquire(g, "a"), HTTP_GUARD_SLOT_OK);
    assert_int_equal(http_guard_acquire(g, "a"), HTTP_GUARD_SLOT_TENANT);
    assert_int_equal(http_guard_acquire(g, "b"), HTTP_GUARD_SLOT_OK);
    assert_int_equal(http_guard_acquire(g, "c"), HTTP_GUARD_SLOT_FULL);
    assert_int_equal(http_guard_in_flight(g), 3);
    http_guard_release(g, "a");
    assert_int_equal(http_guard_acquire(g, "c"), HTTP_GUARD_SLOT_OK);
    http_guard_release(g, "a");
    http_guard_release(g, "b");
    http_guard_release(g, "c");
    assert_int_equal(http_guard_in_flight(g), 0);

    int s1[2], s2[2], s3[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, s1), 0);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, s2), 0);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, s3), 0);
    assert_true(http_guard_accept(g));
    http_guard_conn *c1 = http_guard_open(g, s1[0]);
    assert_true(http_guard_accept(g));
    http_guard_conn *c2 = http_guard_open(g, s2[0]);
    http_guard_set_state(g, c1, HTTP_GUARD_BUSY);
    /* At the limit: c2 (waiting for headers) is evicted, c1 (busy) is not. */
    assert_true(http_guard_accept(g));
    char b[512];
    assert_int_equal(recv(s2[1], b, sizeof b, MSG_DONTWAIT), 0); /* EOF: shut down */
    assert_true(recv(s1[1], b, sizeof b, MSG_DONTWAIT) < 0);     /* still open */
    http_guard_close(g, c2);
    http_guard_conn *c3 = http_guard_open(g, s3[0]);
    int64_t to, ev;
    http_guard_counts(g, &to, &ev);
    assert_int_equal(ev, 1);
    /* A third is refused while c1 is busy and c3 uploads a body that holds
     * a slot: neither may be evicted. */
    http_guard_set_state(g, c3, HTTP_GUARD_BODY);
    assert_false(http_guard_accept(g));
    /* c3 back to waiting for headers (not its first request: no header
     * timeout, idle timeout 0 = none) is evictable again. */
    http_guard_set_state(g, c3, HTTP_GUARD_HEAD);
    http_guard_close(g, c3);
    /* A new connection that sends no headers gets a 408 after 1 s. */
    int s4[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, s4), 0);
    http_guard_conn *c4 = http_guard_open(g, s4[0]);
    ssize_t n = 0;
    for (int i = 0; i < 40 && n <= 0; i++) {
        usleep(100 * 1000);
        n = recv(s4[1], b, sizeof b - 1, MSG_DONTWAIT);
    }
    assert_true(n > 0);
    b[n] = '\0';
    assert_non_null(strstr(b, "HTTP/1.1 408"));
    assert_non_null(strstr(b, "\"code\":\"request_timeout\""));
    http_guard_counts(g, &to, &ev);
    assert_int_equal(to, 1);
    http_guard_close(g, c4);
    http_guard_close(g, c1);
    http_guard_free(g);
    int *fds[] = {s1, s2, s3, s4};
    for (int i = 0; i < 4; i++) {
        close(fds[i][0]);
        close(fds[i][1]);
    }
}

static void test_auth_keys(void **state) {
    auth_keys *k = NULL;
    const char *txt =
        "# comment\n\n  sk-aaaaaaaa1 tenant-a\r\nsk-bbbbbbbb2\tglobex.eu # not allowed\n";
    assert_int_equal(auth_keys_parse(txt, strlen(txt), &k), IS_ERR_FORMAT); /* trailing words */
    txt =
        "# comment\n\n  sk-aaaaaaaa1 tenant-a\r\nsk-bbbbbbbb2\tglobex.eu\nsk-cccccccc3 tenant-a\n";
    assert_int_equal(auth_keys_parse(txt, strlen(txt), &k), IS_OK);
    assert_int_equal(auth_keys_count(k), 3);
    assert_string_equal(auth_tenant(k, "Bearer sk-aaaaaaaa1"), "tenant-a");
    assert_string_equal(auth_tenant(k, "bearer   sk-bbbbbbbb2 "), "globex.eu");
    assert_string_equal(auth_tenant(k, "Bearer sk-cccccccc3"), "tenant-a");
    assert_null(auth_tenant(k, "Bearer sk-aaaaaaaa"));   /* a prefix */
    assert_null(auth_tenant(k, "Bearer sk-aaaaaaaa12")); /* longer */
    assert_null(auth_tenant(k, "sk-aaaaaaaa1"));         /* no scheme */
    assert_null(auth_tenant(k, "Basic sk-aaaaaaaa1"));
    assert_null(auth_tenant(k, "Bearersk-aaaaaaaa1"));
    assert_null(auth_tenant(k, NULL));
    assert_null(auth_tenant(k, ""));
    auth_keys_free(k);
    const char *bad[] = {"",
                         "# only comments\n",
                         "short tenant\n",
                         "sk-aaaaaaaa1\n",
                         "sk-aaaaaaaa1 bad/tenant\n",
                         "sk-aaaaaaaa1 t\nsk-aaaaaaaa1 u\n",
                         "sk-aaaaaaa\x01 t\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k = NULL;
        assert_int_equal(auth_keys_parse(bad[i], strlen(bad[i]), &k), IS_ERR_FORMAT);
        assert_null(k);
    }
    assert_int_equal(auth_keys_load("/nonexistent/keys.txt", &k), IS_ERR_IO);
}

static void test_metrics_render(void **state) {
    metrics *m;
    assert_int_equal(metrics_create(&m), IS_OK);
    metrics_chat c = {.mode = 0,
                      .ok = true,
                      .ttft_s = 0.02,
                      .total_s = 0.3,
                      .prompt_tokens = 10,
                      .completion_tokens = 5,
                      .injected_tokens = 4};
    metrics_observe_chat(m, &c);
    c.ttft_s = 3.0;
    c.total_s = 200.0; /* past the last bound: +Inf only */
    metrics_observe_chat(m, &c);
    c.mode = 2;
    c.ok = false;
    metrics_observe_chat(m, &c);
    metrics_observe_http(m, METRICS_ROUTE_CHAT, 200);
    metrics_observe_http(m, METRICS_ROUTE_CHAT, 418);
    size_t len;
    char *t = metrics_render(m, NULL, &len);
    assert_non_null(t);
    assert_int_equal(strlen(t), len);
    /* Buckets are cumulative. */
    assert_non_null(strstr(t, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"0.01\"} 0\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"0.025\"} 1\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"2.5\"} 1\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"5\"} 2\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_bucket{mode=\"kv\",le=\"+Inf\"} 2\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_count{mode=\"kv\"} 2\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_sum{mode=\"kv\"} 3.020000\n"));
    assert_non_null(
        strstr(t, "inferscale_request_duration_seconds_bucket{mode=\"kv\",le=\"120\"} 1\n"));
    assert_non_null(
        strstr(t, "inferscale_request_duration_seconds_bucket{mode=\"kv\",le=\"+Inf\"} 2\n"));
    /* A failed request counts as an error, not in the latency histograms. */
    assert_non_null(strstr(t, "inferscale_chat_requests_total{mode=\"off\",result=\"error\"} 1\n"));
    assert_non_null(strstr(t, "inferscale_ttft_seconds_count{mode=\"off\"} 0\n"));
    assert_non_null(strstr(t, "inferscale_completion_tokens_total{mode=\"kv\"} 10\n"));
    assert_non_null(strstr(t, "inferscale_memory_tokens_total{mode=\"kv\",how=\"injected\"} 8\n"));
    assert_non_null(
        strstr(t, "inferscale_http_requests_total{route=\"chat_completions\",code=\"200\"} 1\n"));
    assert_non_null(
        strstr(t, "inferscale_http_requests_total{route=\"chat_completions\",code=\"other\"} 1\n"));
    assert_non_null(strstr(t, "inferscale_tokens_per_second 1.5\n")); /* 15 tokens / 10 s */
    /* Every line is a comment or "name{labels} value". */
    for (char *p = t; *p;) {
        char *nl = strchr(p, '\n');
        assert_non_null(nl);
        if (*p != '#') {
            char *sp = memchr(p, ' ', (size_t)(nl - p));
            assert_non_null(sp);
            char *end;
            strtod(sp + 1, &end);
            assert_ptr_equal(end, nl);
        }
        p = nl + 1;
    }
    free(t);
    metrics_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_parse),   cmocka_unit_test(test_memory_parse),
        cmocka_unit_test(test_ids_and_urls), cmocka_unit_test(test_guard),
        cmocka_unit_test(test_auth_keys),    cmocka_unit_test(test_metrics_render),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

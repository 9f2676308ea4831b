/*
 * test_http_client: the HTTP client the server tests share (libcurl): one
 * request to the server under test on loopback, its status, body and the
 * body parsed as JSON.
 */
#ifndef IS_TESTS_TEST_HTTP_CLIENT_H
#define IS_TESTS_TEST_HTTP_CLIENT_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct test_resp {
    long status; /* HTTP status, 0 when no response came */
    char *body;  /* malloc'd, NUL-terminated, or NULL when empty */
    size_t len;
    cJSON *json; /* the body parsed, or NULL */
    int curl_rc; /* CURLE_OK, or why the transfer failed */
} test_resp;

/* `method` `path` on http://127.0.0.1:port. key: sent as "Authorization:
 * Bearer key" (NULL: no header). body[0..len) (NULL: none) is sent as JSON,
 * with Content-Length, or chunked when `chunked`. Gives up after
 * timeout_s seconds. */
test_resp test_http_request(int port, const char *method, const char *path, const char *key,
                            const char *body, size_t len, bool chunked, long timeout_s);

void test_resp_free(test_resp *r);

/* libcurl's write callback appending to the test_resp `ud` (status and
 * json left to the caller), for tests that drive curl handles themselves. */
size_t test_http_on_write(char *p, size_t sz, size_t n, void *ud);

#endif

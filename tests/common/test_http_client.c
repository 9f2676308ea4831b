/*
 * test_http_client: see test_http_client.h.
 */
#include "test_http_client.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t test_http_on_write(char *p, size_t sz, size_t n, void *ud) {
    test_resp *r = ud;
    size_t l = sz * n;
    char *nb = realloc(r->body, r->len + l + 1);
    if (!nb) return 0;
    memcpy(nb + r->len, p, l);
    r->len += l;
    nb[r->len] = '\0';
    r->body = nb;
    return l;
}

typedef struct upload {
    const char *data;
    size_t len, pos;
} upload;

static size_t on_read(char *buf, size_t sz, size_t n, void *ud) {
    upload *u = ud;
    size_t l = sz * n;
    if (l > u->len - u->pos) l = u->len - u->pos;
    memcpy(buf, u->data + u->pos, l);
    u->pos += l;
    return l;
}

test_resp test_http_request(int port, const char *method, const char *path, const char *key,
                            const char *body, size_t len, bool chunked, long timeout_s) {
    test_resp r = {0};
    CURL *c = curl_easy_init();
    if (!c) {
        r.curl_rc = (int)CURLE_FAILED_INIT;
        return r;
    }
    char url[2048];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, test_http_on_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, timeout_s);
    struct curl_slist *h = NULL;
    char auth[256];
    if (key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        h = curl_slist_append(h, auth);
    }
    upload up = {body, len, 0};
    if (body) {
        h = curl_slist_append(h, "Content-Type: application/json");
        if (chunked) {
            h = curl_slist_append(h, "Transfer-Encoding: chunked");
            curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(c, CURLOPT_READFUNCTION, on_read);
            curl_easy_setopt(c, CURLOPT_READDATA, &up);
            curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
        } else {
            curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
            curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
        }
    }
    /* No "100 Continue" round trip before the body. */
    h = curl_slist_append(h, "Expect:");
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    r.curl_rc = (int)curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (r.body) r.json = cJSON_Parse(r.body);
    return r;
}

void test_resp_free(test_resp *r) {
    free(r->body);
    cJSON_Delete(r->json);
    memset(r, 0, sizeof *r);
}

/*
 * fuzz_http_parse: libFuzzer target for the HTTP API's request parsing
 * (src/serve/http/parse.h), the code every untrusted request body and
 * query string goes through before anything else sees it.
 *
 * Each input is given, as raw bytes, to every entry point:
 *   - the four body parsers (chat completion, memory add, search, update),
 *     once with the default limits and once with tiny ones (so the limit
 *     checks are reached by small inputs);
 *   - parse_memory_query, the input split into key=value pairs at '&' and
 *     the first '=' (as the HTTP layer hands it over: NUL-terminated
 *     strings), with and without a required user_id;
 *   - parse_memory_id_valid and the UTF-8 helpers, each against an
 *     independent reference written here.
 * Inputs are copied into a malloc'd buffer of exactly their size, so ASan
 * sees a read past the end. Beyond memory safety (ASan) and undefined
 * behaviour (UBSan), what parse.h promises is checked with
 * __builtin_trap(): a success gives fields within the limits, strings that
 * are valid UTF-8 and within their bounds, metadata that is a JSON object
 * of scalars; a failure gives status 400 or 413 (500 only with
 * IS_ERR_NOMEM) and a non-empty, terminated message; every output is freed
 * (LeakSanitizer).
 */
#include "core/utf8.h"
#include "serve/http/parse.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

/* ---- references ------------------------------------------------------------------ */

/* RFC 3629 by code point: decode, then refuse overlong forms, surrogates and
 * values above U+10FFFF. Written independently of parse.c's table. */
static bool ref_utf8_valid(const uint8_t *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        uint32_t cp;
        int n;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 2;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 3;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 4;
            cp = c & 0x07;
        } else return false;
        if (len - i < (size_t)n) return false;
        for (int k = 1; k < n; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += (size_t)n;
    }
    return true;
}

static bool ref_id_valid(const char *s, size_t len) {
    if (len < 1 || len > 71) return false;
    for (size_t i = 0; i < len; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", s[i]) ||
            s[i] == '\0')
            return false;
    return true;
}

/* ---- output checks ------------------------------------------------------------------ */

static void check_str(const char *s, size_t max_len, bool non_empty) {
    CHECK(s != NULL);
    size_t l = strlen(s);
    CHECK(ref_utf8_valid((const uint8_t *)s, l));
    if (max_len) CHECK(l <= max_len);
    if (non_empty) CHECK(l > 0);
}

static void check_opt_id(const char *s) {
    if (s) check_str(s, PARSE_MAX_ID, true);
}

static void check_metadata_json(const char *md) {
    if (!md) return;
    cJSON *o = cJSON_Parse(md);
    CHECK(cJSON_IsObject(o));
    const cJSON *it;
    cJSON_ArrayForEach(it, o) CHECK(!cJSON_IsObject(it) && !cJSON_IsArray(it));
    cJSON_Delete(o);
}

static void check_filters(const parse_filters *f) {
    check_opt_id(f->user_id);
    check_opt_id(f->agent_id);
    check_opt_id(f->run_id);
    CHECK(f->n_meta >= 0 && f->n_meta <= PARSE_MAX_META);
    for (int32_t i = 0; i < f->n_meta; i++) {
        CHECK(f->meta_keys[i] != NULL && f->meta_values[i] != NULL);
        for (int32_t j = 0; j < i; j++) CHECK(strcmp(f->meta_keys[i], f->meta_keys[j]) != 0);
    }
}

static void check_error(is_status st, const parse_error *e) {
    CHECK(st == IS_ERR_INVALID_ARG || st == IS_ERR_NOMEM);
    if (st == IS_ERR_INVALID_ARG) CHECK(e->status == 400 || e->status == 413);
    else CHECK(e->status == 500);
    CHECK(memchr(e->message, '\0', sizeof e->message) != NULL && e->message[0] != '\0');
    CHECK(memchr(e->param, '\0', sizeof e->param) != NULL);
    CHECK(memchr(e->code, '\0', sizeof e->code) != NULL);
}

static void check_messages(const parse_message *m, int32_t n, int32_t max) {
    CHECK(n >= 1 && n <= max && m != NULL);
    for (int32_t i = 0; i < n; i++) {
        CHECK(m[i].role != NULL);
        CHECK(strcmp(m[i].role, "system") == 0 || strcmp(m[i].role, "user") == 0 ||
              strcmp(m[i].role, "assistant") == 0);
        check_str(m[i].content, 0, false);
    }
}

/* ---- the entry points ---------------------------------------------------------------- */

static void fuzz_chat(const char *b, size_t n, const parse_limits *lim) {
    parse_chat c;
    parse_error e;
    memset(&e, 0, sizeof e);
    is_status st = parse_chat_request(b, n, lim, &c, &e);
    if (st == IS_OK) {
        check_messages(c.messages, c.n_messages, lim->max_messages);
        if (c.model) check_str(c.model, 256, false);
        CHECK(c.max_tokens >= 1 && c.max_tokens <= lim->max_tokens);
        CHECK(isfinite(c.temperature) && c.temperature >= 0.0f && c.temperature <= 2.0f);
        CHECK(isfinite(c.top_p) && c.top_p > 0.0f && c.top_p <= 1.0f);
        CHECK(c.top_k >= 0);
        CHECK(c.n_stop >= 0 && c.n_stop <= PARSE_MAX_STOP);
        for (int32_t i = 0; i < c.n_stop; i++) check_str(c.stop[i], 0, true);
        if (c.user) check_str(c.user, PARSE_MAX_ID, true);
        CHECK(c.k >= 0 && c.k <= lim->max_k);
        CHECK(c.mode >= PARSE_MODE_DEFAULT && c.mode <= PARSE_MODE_OFF);
        if (!c.has_memory) CHECK(c.mode == PARSE_MODE_DEFAULT && c.k == lim->default_k);
        check_filters(&c.filters);
        const char *q = parse_chat_query(&c);
        if (q) check_str(q, 0, false);
    } else {
        check_error(st, &e);
    }
    parse_chat_free(&c);
}

static void fuzz_add(const char *b, size_t n, const parse_limits *lim) {
    parse_mem_add a;
    parse_error e;
    memset(&e, 0, sizeof e);
    is_status st = parse_memory_add(b, n, lim, &a, &e);
    if (st == IS_OK) {
        check_str(a.user_id, PARSE_MAX_ID, true);
        check_opt_id(a.agent_id);
        check_opt_id(a.run_id);
        CHECK(a.n_messages > 0 || a.n_facts > 0);
        if (a.n_messages) check_messages(a.messages, a.n_messages, lim->max_messages);
        CHECK(a.n_facts >= 0 && a.n_facts <= lim->max_facts);
        for (int32_t i = 0; i < a.n_facts; i++) check_str(a.facts[i], 0, false);
        check_metadata_json(a.metadata_json);
    } else {
        check_error(st, &e);
    }
    parse_mem_add_free(&a);
}

static void fuzz_search(const char *b, size_t n, const parse_limits *lim) {
    parse_mem_search s;
    parse_error e;
    memset(&e, 0, sizeof e);
    is_status st = parse_memory_search(b, n, lim, &s, &e);
    if (st == IS_OK) {
        check_str(s.query, 0, false);
        CHECK(s.top_k >= 1 && s.top_k <= lim->max_k);
        check_filters(&s.filters);
        CHECK(s.filters.user_id != NULL);
    } else {
        check_error(st, &e);
    }
    parse_mem_search_free(&s);
}

static void fuzz_update(const char *b, size_t n) {
    parse_mem_update u;
    parse_error e;
    memset(&e, 0, sizeof e);
    is_status st = parse_memory_update(b, n, &u, &e);
    if (st == IS_OK) {
        CHECK(u.text != NULL || u.metadata_json != NULL);
        if (u.text) check_str(u.text, 0, false);
        check_metadata_json(u.metadata_json);
        check_opt_id(u.user_id);
    } else {
        check_error(st, &e);
    }
    parse_mem_update_free(&u);
}

#define MAX_ARGS 64

/* "k=v&k2=v2": keys and values as NUL-terminated strings (the HTTP layer
 * decodes them before; a NUL inside cuts the string there, as it would). */
static void fuzz_query(const char *b, size_t n) {
    char *copy = malloc(n + 1);
    if (!copy) return;
    memcpy(copy, b, n);
    copy[n] = '\0';
    const char *keys[MAX_ARGS], *vals[MAX_ARGS];
    int32_t na = 0;
    char *p = copy;
    while (na < MAX_ARGS) {
        char *amp = strchr(p, '&');
        if (amp) *amp = '\0';
        char *eq = strchr(p, '=');
        if (eq) *eq = '\0';
        keys[na] = p;
        vals[na] = eq ? eq + 1 : NULL; /* a key without '=' */
        na++;
        if (!amp) break;
        p = amp + 1;
    }
    for (int req = 0; req < 2; req++) {
        parse_filters f;
        parse_error e;
        memset(&e, 0, sizeof e);
        is_status st = parse_memory_query(keys, vals, na, req == 1, &f, &e);
        if (st == IS_OK) {
            check_filters(&f);
            if (req) CHECK(f.user_id != NULL);
        } else {
            check_error(st, &e);
        }
        parse_filters_free(&f);
    }
    free(copy);
}

static void fuzz_utf8(const char *b, size_t n) {
    bool valid = utf8_valid(b, n);
    CHECK(valid == ref_utf8_valid((const uint8_t *)b, n));

    size_t k = utf8_complete_prefix(b, n);
    CHECK(k <= n && n - k <= 3);
    if (valid) CHECK(k == n);
    /* A valid text cut anywhere: the prefix kept is the text up to the last
     * whole character, and the bytes held back complete to it. */
    if (valid) {
        for (size_t cut = n > 4 ? n - 4 : 0; cut <= n; cut++) {
            size_t kk = utf8_complete_prefix(b, cut);
            CHECK(kk <= cut && cut - kk <= 3);
            CHECK(ref_utf8_valid((const uint8_t *)b, kk));
        }
    }

    char *s = utf8_sanitized_copy(b, n);
    if (!s) return;
    size_t sl = strlen(s);
    CHECK(ref_utf8_valid((const uint8_t *)s, sl));
    CHECK(sl <= 3 * n);
    if (valid && !memchr(b, '\0', n)) CHECK(sl == n && memcmp(s, b, n) == 0);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *b = malloc(size ? size : 1);
    if (!b) return 0;
    if (size) memcpy(b, data, size);

    parse_limits def = parse_default_limits();
    parse_limits tiny = {.max_tokens = 8,
                         .default_max_tokens = 4,
                         .max_k = 3,
                         .default_k = 2,
                         .default_top_k = 1,
                         .max_messages = 2,
                         .max_facts = 2};
    fuzz_chat(b, size, &def);
    fuzz_chat(b, size, &tiny);
    fuzz_add(b, size, &def);
    fuzz_add(b, size, &tiny);
    fuzz_search(b, size, &def);
    fuzz_search(b, size, &tiny);
    fuzz_update(b, size);
    fuzz_query(b, size);
    fuzz_utf8(b, size);
    CHECK(parse_memory_id_valid(b, size) == ref_id_valid(b, size));

    free(b);
    return 0;
}

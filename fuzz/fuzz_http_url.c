/*
 * fuzz_http_url: libFuzzer target for request targets (path and query
 * string) as they reach the HTTP API: through libmicrohttpd's own URL
 * decoding (MHD_http_unescape, the decoder the daemon applies to the path
 * and to every query key and value), then through the server's checks.
 *
 * Each input is a raw request target. What is checked with
 * __builtin_trap():
 *   - parse_url_check never accepts a target whose MHD-decoded path, keys
 *     or values hold a NUL byte or a control character, nor one longer
 *     than PARSE_MAX_URL;
 *   - parse_memory_query_n, given the MHD-decoded pairs with their
 *     lengths (as MHD_get_connection_values_n hands them over), refuses
 *     every pair whose key or value holds a NUL, and what it accepts as
 *     user_id / agent_id / run_id is exactly the decoded value (never a
 *     prefix of it) and passes parse_id_check;
 *   - parse_id_check on the raw input agrees with an independent
 *     reference (length bounds, no C0, DEL or C1 control, valid UTF-8).
 * Memory safety and undefined behaviour through ASan and UBSan.
 */
#include "serve/http/parse.h"

#include <microhttpd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)
#define MAX_ARGS 64

static bool has_ctl(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7F) return true;
    }
    return false;
}

/* Decodes s (a NUL-terminated, writable copy) with MHD's decoder; the
 * decoded length (NULs inside count). */
static size_t mhd_decode(char *s) { return MHD_http_unescape(s); }

/* The reference of parse_id_check: written from its contract alone. */
static bool ref_id_ok(const uint8_t *s, size_t n) {
    if (n == 0 || n > PARSE_MAX_ID) return false;
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        uint32_t cp;
        int k;
        if (c < 0x80) {
            cp = c;
            k = 1;
        } else if ((c & 0xE0) == 0xC0) {
            cp = c & 0x1F;
            k = 2;
        } else if ((c & 0xF0) == 0xE0) {
            cp = c & 0x0F;
            k = 3;
        } else if ((c & 0xF8) == 0xF0) {
            cp = c & 0x07;
            k = 4;
        } else return false;
        if (n - i < (size_t)k) return false;
        for (int j = 1; j < k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[k] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) return false;
        i += (size_t)k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    parse_error e;
    char *raw = malloc(size + 1);
    if (!raw) return 0;
    memcpy(raw, data, size);
    raw[size] = '\0';

    CHECK((parse_id_check("user_id", raw, size, &e) == IS_OK) == ref_id_ok(data, size));

    bool url_ok = parse_url_check(raw, size, &e) == IS_OK;
    if (!url_ok) CHECK(e.status == 400 || e.status == 414);
    if (url_ok) CHECK(size <= PARSE_MAX_URL && !memchr(raw, '\0', size));
    if (memchr(raw, '\0', size)) { /* not a request target MHD could hand over */
        free(raw);
        return 0;
    }

    /* Split as MHD does: the path up to '?', then pairs at '&' and the
     * first '='; each part decoded in place. */
    char *q = strchr(raw, '?');
    if (q) *q++ = '\0';
    size_t plen = mhd_decode(raw);
    if (url_ok) CHECK(strlen(raw) == plen && !has_ctl(raw, plen));

    const char *keys[MAX_ARGS], *vals[MAX_ARGS];
    size_t klens[MAX_ARGS], vlens[MAX_ARGS];
    int32_t n = 0;
    bool pairs_clean = true;
    for (char *p = q; p && *p && n < MAX_ARGS;) {
        char *amp = strchr(p, '&');
        if (amp) *amp = '\0';
        char *eq = strchr(p, '=');
        if (eq) *eq = '\0';
        keys[n] = p;
        klens[n] = mhd_decode(p);
        vals[n] = eq ? eq + 1 : NULL;
        vlens[n] = eq ? mhd_decode(eq + 1) : 0;
        if (url_ok) {
            CHECK(strlen(keys[n]) == klens[n] && !has_ctl(keys[n], klens[n]));
            if (vals[n]) CHECK(strlen(vals[n]) == vlens[n] && !has_ctl(vals[n], vlens[n]));
        }
        if (memchr(keys[n], '\0', klens[n]) || (vals[n] && memchr(vals[n], '\0', vlens[n])))
            pairs_clean = false;
        n++;
        p = amp ? amp + 1 : NULL;
    }

    parse_filters f;
    if (parse_memory_query_n(keys, klens, vals, vlens, n, false, &f, &e) == IS_OK) {
        CHECK(pairs_clean);
        /* Each id accepted is one decoded value, whole. */
        char *const ids[3] = {f.user_id, f.agent_id, f.run_id};
        static const char *const names[3] = {"user_id", "agent_id", "run_id"};
        for (int k = 0; k < 3; k++) {
            if (!ids[k]) continue;
            CHECK(parse_id_check(names[k], ids[k], strlen(ids[k]), &e) == IS_OK);
            bool found = false;
            for (int32_t i = 0; i < n && !found; i++)
                found = strcmp(keys[i], names[k]) == 0 && vals[i] && vlens[i] == strlen(ids[k]) &&
                        memcmp(vals[i], ids[k], vlens[i]) == 0;
            CHECK(found);
        }
        parse_filters_free(&f);
    } else {
        CHECK(e.status == 400 && e.message[0]);
    }
    free(raw);
    return 0;
}

/*
 * utf8: decoding with Unicode's maximal-subpart rule, validity, streaming
 * boundaries and repair (see utf8.h). Encoding is utf8proc's.
 */
#include "core/utf8.h"

#include "core/status.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

int utf8_decode(const char *str, size_t n, uint32_t *cp) {
    const uint8_t *s = (const uint8_t *)str;
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        return 1;
    }
    /* Table 3-7: the lead byte fixes the length and the range of the
     * second byte (which excludes overlongs, surrogates and > U+10FFFF). */
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t c;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 1;
        c = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2;
        c = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3;
        c = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else {
        return -1;
    }
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return -k;
        uint8_t b = s[k];
        if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -k;
        c = (c << 6) | (b & 0x3F);
    }
    *cp = c;
    return need + 1;
}

size_t utf8_encode(uint32_t cp, char *out) {
    if (!utf8proc_codepoint_valid((utf8proc_int32_t)cp)) return 0;
    return (size_t)utf8proc_encode_char((utf8proc_int32_t)cp, (utf8proc_uint8_t *)out);
}

bool utf8_valid(const char *s, size_t n) {
    size_t i = 0;
    uint32_t cp;
    while (i < n) {
        /* ASCII fast path, 8 bytes at a time. */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL) break;
            i += 8;
        }
        if (i >= n) break;
        int k = utf8_decode(s + i, n - i, &cp);
        if (k < 0) return false;
        i += (size_t)k;
    }
    return true;
}

size_t utf8_complete_prefix(const char *s, size_t n) {
    /* Only the last 3 bytes can start an unfinished sequence: one whose
     * maximal subpart runs into the end of the buffer. */
    size_t start = n > 3 ? n - 3 : 0;
    uint32_t cp;
    for (size_t i = start; i < n; i++) {
        const uint8_t b = (uint8_t)s[i];
        if (b < 0xC2 || b > 0xF4) continue; /* not a lead byte */
        int k = utf8_decode(s + i, n - i, &cp);
        if (k < 0 && (size_t)-k == n - i) return i;
    }
    return n;
}

/* Copies s[0..n) to o (room for 3n bytes), each maximal ill-formed
 * subpart (and each NUL when nul_too) as U+FFFD; returns the bytes written. */
static size_t repair_into(const char *s, size_t n, char *o, bool nul_too) {
    size_t i = 0, m = 0;
    uint32_t cp;
    while (i < n) {
        int k = utf8_decode(s + i, n - i, &cp);
        if (k > 0 && !(nul_too && s[i] == '\0')) {
            memcpy(o + m, s + i, (size_t)k);
            m += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(o + m, UTF8_REPLACEMENT, 3);
            m += 3;
            i += k > 0 ? 1 : (size_t)-k;
        }
    }
    return m;
}

is_status utf8_sanitize(const char *s, size_t n, char **fixed, size_t *fixed_len) {
    size_t i = 0;
    uint32_t cp;
    while (i < n) {
        int k = utf8_decode(s + i, n - i, &cp);
        if (k < 0) break;
        i += (size_t)k;
    }
    *fixed = NULL;
    if (i == n) return IS_OK;
    /* Each bad subpart (>= 1 byte) becomes 3 bytes: at most 3x. */
    char *o = malloc(n * 3 + 1);
    if (!o) return is_error_set(IS_ERR_NOMEM, "utf8: out of memory");
    memcpy(o, s, i);
    size_t m = i + repair_into(s + i, n - i, o + i, false);
    o[m] = '\0';
    *fixed = o;
    *fixed_len = m;
    return IS_OK;
}

char *utf8_sanitized_copy(const char *s, size_t n) {
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    o[repair_into(s, n, o, true)] = '\0';
    return o;
}

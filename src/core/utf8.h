/*
 * utf8: the one home of UTF-8 handling below the layers that read text
 * (tokenizers, BM25, the HTTP parser, streamed output, evaluation).
 *
 * Validity is Unicode's (section 3.9, Table 3-7; RFC 3629): no overlong
 * forms, no surrogates, nothing past U+10FFFF. Invalid input is repaired
 * the way Python's bytes.decode(errors="replace") does it: each maximal
 * subpart of an ill-formed sequence (the longest prefix that could start a
 * well-formed one, at least one byte) becomes one U+FFFD, so the model's
 * tokenizer and the reference scripts see the same text. Encoding and the
 * character properties are utf8proc's.
 */
#ifndef IS_CORE_UTF8_H
#define IS_CORE_UTF8_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define UTF8_REPLACEMENT "\xEF\xBF\xBD" /* U+FFFD */

/* Length (1..4) of the well-formed sequence at s[0..n) and its code point
 * in *cp; or, when ill-formed, minus the length of its maximal subpart
 * (*cp unchanged). n >= 1. */
int utf8_decode(const char *s, size_t n, uint32_t *cp);

/* Writes code point cp (a Unicode scalar value) to out[0..4) and returns
 * its length; 0 for a value that is not one (nothing written). */
size_t utf8_encode(uint32_t cp, char *out);

/* Length of the sequence that lead byte b starts, in text known valid. */
static inline size_t utf8_seq_len(uint8_t b) {
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

/* Whether s[0..n) is valid UTF-8. */
bool utf8_valid(const char *s, size_t n);

/* The longest prefix of s[0..n) that does not end inside a sequence the
 * bytes after it could still complete (streamed text: hold the rest back
 * until more arrives). An invalid byte at the end is not held. */
size_t utf8_complete_prefix(const char *s, size_t n);

/* Valid text: IS_OK with *fixed = NULL. Otherwise IS_OK with *fixed a
 * malloc'd NUL-terminated copy (length *fixed_len) in which each maximal
 * ill-formed subpart is U+FFFD. IS_ERR_NOMEM (nothing allocated). */
is_status utf8_sanitize(const char *s, size_t n, char **fixed, size_t *fixed_len);

/* As utf8_sanitize, but always a malloc'd NUL-terminated copy (of valid
 * text too), in which a NUL byte becomes U+FFFD as well, so the copy is the
 * whole text as a C string (JSON output); NULL when out of memory. */
char *utf8_sanitized_copy(const char *s, size_t n);

#endif

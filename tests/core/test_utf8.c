/*
 * core/utf8: validity per Unicode's Table 3-7, the streaming boundary, and
 * repair as Python's bytes.decode("utf-8", errors="replace") does it (one
 * U+FFFD per maximal subpart; the expected strings below are what CPython
 * gives for the same bytes, among them Unicode's own example from section
 * 3.9, Table 3-8).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* After the headers it needs. */
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"

#define R "\xef\xbf\xbd" /* U+FFFD */

static void test_valid(void **state) {
    (void)state;
    struct {
        const char *s;
        bool ok;
    } cases[] = {
        {"", true},
        {"plain ascii, long enough to take the 8-byte path", true},
        {"caf\xc3\xa9", true},
        {"\xe2\x82\xac \xf0\x9f\x98\x80", true}, /* euro sign, emoji */
        {"\xf4\x8f\xbf\xbf", true},              /* U+10FFFF */
        {"\xc3\x28", false},                     /* bad continuation */
        {"\xc0\xaf", false},                     /* overlong '/' */
        {"\xe0\x80\xaf", false},                 /* overlong */
        {"\xed\xa0\x80", false},                 /* surrogate U+D800 */
        {"\xf4\x90\x80\x80", false},             /* > U+10FFFF */
        {"\xf8\x88\x80\x80\x80", false},         /* 5-byte form */
        {"abc\xe2\x82", false},                  /* cut short */
        {"\x80", false},                         /* lone continuation */
        {"\xff", false},
        {"0123456789abcdef\xff", false}, /* past the 8-byte path */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        assert_int_equal(utf8_valid(cases[i].s, strlen(cases[i].s)), cases[i].ok);
}

static void test_decode_encode(void **state) {
    (void)state;
    uint32_t cp = 0;
    assert_int_equal(utf8_decode("\xf0\x9f\x98\x80", 4, &cp), 4);
    assert_int_equal(cp, 0x1F600);
    assert_int_equal(utf8_decode("\xc3\xa9", 2, &cp), 2);
    assert_int_equal(cp, 0xE9);
    /* Maximal subparts: how many bytes one U+FFFD stands for. */
    assert_int_equal(utf8_decode("\xf1\x80\x80\xe1", 4, &cp), -3);
    assert_int_equal(utf8_decode("\xe1\x80\xc2", 3, &cp), -2);
    assert_int_equal(utf8_decode("\xed\xa0\x80", 3, &cp), -1); /* surrogate: the lead alone */
    assert_int_equal(utf8_decode("\xe2\x82", 2, &cp), -2);     /* cut by the end */
    char buf[4];
    assert_int_equal(utf8_encode(0x20AC, buf), 3);
    assert_memory_equal(buf, "\xe2\x82\xac", 3);
    assert_int_equal(utf8_encode(0x10FFFF, buf), 4);
    assert_int_equal(utf8_encode(0xD800, buf), 0); /* not a scalar value */
    assert_int_equal(utf8_encode(0x110000, buf), 0);
    assert_int_equal(utf8_seq_len(0xF0), 4);
    assert_int_equal(utf8_seq_len('a'), 1);
}

static void test_complete_prefix(void **state) {
    (void)state;
    /* Streaming boundary: a cut sequence is held back, a bad byte is not. */
    const char *euro = "ab\xe2\x82\xac";
    assert_int_equal(utf8_complete_prefix(euro, 5), 5);
    assert_int_equal(utf8_complete_prefix(euro, 4), 2);
    assert_int_equal(utf8_complete_prefix(euro, 3), 2);
    assert_int_equal(utf8_complete_prefix("ab\xff", 3), 3);
    assert_int_equal(utf8_complete_prefix("ab\xc0", 3), 3);     /* never a lead byte */
    assert_int_equal(utf8_complete_prefix("ab\xe0\x80", 4), 4); /* can never complete */
    assert_int_equal(utf8_complete_prefix("\xf0\x9f\x98", 3), 0);
    assert_int_equal(utf8_complete_prefix("", 0), 0);
}

static void expect_fixed(const char *in, size_t n, const char *want) {
    char *fixed = (char *)0x1;
    size_t len = 0;
    assert_int_equal(utf8_sanitize(in, n, &fixed, &len), IS_OK);
    if (!want) {
        assert_null(fixed);
        return;
    }
    assert_non_null(fixed);
    assert_int_equal(len, strlen(want));
    assert_string_equal(fixed, want);
    free(fixed);
    char *copy = utf8_sanitized_copy(in, n);
    assert_string_equal(copy, want);
    free(copy);
}

static void test_sanitize(void **state) {
    (void)state;
    expect_fixed("caf\xc3\xa9", 5, NULL); /* valid: no copy */
    expect_fixed("a\xff"
                 "b\xc3\xa9",
                 5, "a" R "b\xc3\xa9");
    expect_fixed("x\xe2\x82", 3, "x" R); /* a cut sequence at the end is one subpart */
    expect_fixed("\xed\xa0\x80z", 4, R R R "z");
    /* Unicode 15, Table 3-8. */
    expect_fixed("\x61\xf1\x80\x80\xe1\x80\xc2\x62\x80\x63\x80\xbf\x64", 13,
                 "a" R R R "b" R "c" R R "d");
    /* The C-string copy keeps valid text as it is and turns NUL into U+FFFD. */
    char *c = utf8_sanitized_copy("ok\xc3\xa9", 4);
    assert_string_equal(c, "ok\xc3\xa9");
    free(c);
    c = utf8_sanitized_copy("a\0b", 3);
    assert_string_equal(c, "a" R "b");
    free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_decode_encode),
        cmocka_unit_test(test_complete_prefix),
        cmocka_unit_test(test_sanitize),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

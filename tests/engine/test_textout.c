/*
 * textout: stop strings are never given out (their beginnings are held
 * until the text after them is known), half UTF-8 characters are held until
 * complete, invalid bytes are not held forever, the earliest stop wins,
 * and the end of generation gives out what was held.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "engine/textout.h"

/* Pushes a piece and returns what may be given out now, NUL-terminated. */
static const char *push(textout *o, const char *piece, size_t len, bool *stopped) {
    static char buf[256];
    assert_int_equal(textout_push(o, piece, len, stopped), IS_OK);
    size_t n;
    const char *t = textout_take(o, &n);
    assert_true(n < sizeof buf);
    memcpy(buf, t, n);
    buf[n] = 0;
    return buf;
}

#define PUSH(o, s, st) push(o, s, strlen(s), st)

static void test_no_stop(void **state) {
    textout o;
    bool st;
    textout_init(&o, NULL, 0);
    assert_string_equal(PUSH(&o, "Hello", &st), "Hello");
    assert_false(st);
    assert_string_equal(PUSH(&o, " world", &st), " world");
    size_t n;
    textout_flush(&o, &n);
    assert_int_equal(n, 0);
    textout_free(&o);
}

static void test_utf8_held(void **state) {
    textout o;
    bool st;
    textout_init(&o, NULL, 0);
    /* é = C3 A9, split across pieces. */
    assert_string_equal(PUSH(&o, "caf\xC3", &st), "caf");
    assert_string_equal(PUSH(&o, "\xA9!", &st), "\xC3\xA9!");
    /* U+1F600 = F0 9F 98 80 in three pieces. */
    assert_string_equal(PUSH(&o, "\xF0", &st), "");
    assert_string_equal(PUSH(&o, "\x9F\x98", &st), "");
    assert_string_equal(PUSH(&o, "\x80", &st), "\xF0\x9F\x98\x80");
    /* A lone continuation byte can never complete: not held. */
    assert_string_equal(PUSH(&o, "a\x80", &st), "a\x80");
    /* A lead byte followed by a non-continuation: given out as it is. */
    assert_string_equal(PUSH(&o, "\xE2", &st), "");
    assert_string_equal(PUSH(&o, "x", &st), "\xE2x");
    /* At the end a half character is given out rather than lost. */
    assert_string_equal(PUSH(&o, "\xE2\x82", &st), "");
    size_t n;
    const char *rest = textout_flush(&o, &n);
    assert_int_equal(n, 2);
    assert_memory_equal(rest, "\xE2\x82", 2);
    textout_free(&o);
}

static void test_stop_held_and_cut(void **state) {
    const char *stops[] = {"END"};
    textout o;
    bool st;
    textout_init(&o, stops, 1);
    assert_string_equal(PUSH(&o, "hello E", &st), "hello ");
    assert_string_equal(PUSH(&o, "N", &st), "");
    assert_false(st);
    assert_string_equal(PUSH(&o, "D and more", &st), "");
    assert_true(st);
    size_t n;
    textout_flush(&o, &n);
    assert_int_equal(n, 0);
    textout_free(&o);

    /* A false start is given out once it cannot be the stop string. */
    textout_init(&o, stops, 1);
    assert_string_equal(PUSH(&o, "E", &st), "");
    assert_string_equal(PUSH(&o, "x", &st), "Ex");
    assert_string_equal(PUSH(&o, "EN", &st), "");
    const char *rest = textout_flush(&o, &n);
    assert_int_equal(n, 2);
    assert_memory_equal(rest, "EN", 2);
    textout_free(&o);
}

static void test_earliest_stop_wins(void **state) {
    const char *stops[] = {"xyz", "b", ""};
    textout o;
    bool st;
    textout_init(&o, stops, 3);
    /* "" is ignored; "b" is earlier than "xyz" in the same piece. */
    assert_string_equal(PUSH(&o, "a", &st), "a");
    assert_false(st);
    assert_string_equal(PUSH(&o, "-bxyz", &st), "-");
    assert_true(st);
    textout_free(&o);

    /* Bytes, not C strings: a NUL inside a piece is text. */
    const char *stop2[] = {"q"};
    textout_init(&o, stop2, 1);
    assert_int_equal(textout_push(&o, "a\0bq", 4, &st), IS_OK);
    assert_true(st);
    size_t n;
    const char *t = textout_take(&o, &n);
    assert_int_equal(n, 3);
    assert_memory_equal(t, "a\0b", 3);
    textout_free(&o);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stop),
        cmocka_unit_test(test_utf8_held),
        cmocka_unit_test(test_stop_held_and_cut),
        cmocka_unit_test(test_earliest_stop_wins),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

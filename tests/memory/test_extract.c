/*
 * test_extract: the parser and validator of the extraction reply on
 * hand-made replies (valid, with text around, code fences, braces inside
 * strings, junk, cut short at every byte, nested, wrong types, too many or
 * too long facts, invalid UTF-8) and the argument checks. The model's side
 * runs in the HTTP server (tests/serve/test_http.c, infer=true).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/extract.h"

/* Parses a NUL-terminated reply. */
static is_status parse(const char *reply, char ***f, int32_t *n) {
    return extract_parse(reply, strlen(reply), f, n);
}

static void expect_facts(const char *reply, int32_t n_want, const char *const *want) {
    char **f = NULL;
    int32_t n = -1;
    is_status st = parse(reply, &f, &n);
    if (st != IS_OK) fprintf(stderr, "reply %s: %s\n", reply, is_error_last());
    assert_int_equal(st, IS_OK);
    assert_non_null(f);
    assert_int_equal(n, n_want);
    for (int32_t i = 0; i < n; i++) assert_string_equal(f[i], want[i]);
    extract_facts_free(f, n);
}

static void expect_format(const char *reply, const char *msg_part) {
    char **f = (char **)(uintptr_t)0x1;
    int32_t n = -7;
    assert_int_equal(parse(reply, &f, &n), IS_ERR_FORMAT);
    /* Outputs untouched on failure. */
    assert_ptr_equal(f, (char **)(uintptr_t)0x1);
    assert_int_equal(n, -7);
    if (msg_part && !strstr(is_error_last(), msg_part)) {
        fprintf(stderr, "message '%s' lacks '%s'\n", is_error_last(), msg_part);
        fail();
    }
}

static void test_valid(void **state) {
    const char *two[] = {"Name is Sam", "Lives in Lisbon"};
    expect_facts("{\"facts\": [\"Name is Sam\", \"Lives in Lisbon\"]}", 2, two);
    /* Text around the object, a code fence, trailing chatter. */
    expect_facts("Sure! Here are the facts:\n```json\n{\"facts\": [\"Name is Sam\", \"Lives in "
                 "Lisbon\"]}\n```\n"
                 "Let me know if you need more.",
                 2, two);
    /* Empty list: nothing to remember, still a valid answer. */
    expect_facts("{\"facts\": []}", 0, NULL);
    /* Other keys are ignored; whitespace around each fact is trimmed. */
    const char *one[] = {"Has two cats"};
    expect_facts("{\"note\": \"x\", \"facts\": [\"  Has two cats\\n\"], \"n\": 1}", 1, one);
    /* Braces and escaped quotes inside strings do not end the object. */
    const char *br[] = {"Likes {curly} braces", "Said \"hi}\""};
    expect_facts("{\"facts\": [\"Likes {curly} braces\", \"Said \\\"hi}\\\"\"]} }}", 2, br);
    /* Duplicates are dropped, order kept. */
    const char *dd[] = {"A", "B"};
    expect_facts("{\"facts\": [\"A\", \"B\", \"A\", \" B \"]}", 2, dd);
    /* Unicode escapes decode to UTF-8. */
    const char *uni[] = {"Lives in S\xc3\xa3o Paulo \xf0\x9f\x98\x80"};
    expect_facts("{\"facts\": [\"Lives in S\\u00e3o Paulo \\ud83d\\ude00\"]}", 1, uni);
    /* Nested objects: facts written as objects keep their text (a text-like
     * field, else their scalar fields), and a "facts" array nested in
     * another object is found. */
    const char *nested[] = {"I love pizza", "name: Pizza; type: food"};
    expect_facts("{\"facts\": [{\"name\": \"Pizza\", \"description\": \"I love pizza\"}, "
                 "{\"name\": \"Pizza\", \"type\": \"food\", \"tags\": [\"x\"]}]}",
                 2, nested);
    const char *wrapped[] = {"Name is Sam"};
    expect_facts("{\"result\": {\"facts\": [\"Name is Sam\"]}}", 1, wrapped);
    expect_facts("{\"facts\": [{\"text\": \"Name is Sam\", \"meta\": {\"a\": {\"b\": 1}}}]}", 1,
                 wrapped);
    /* The first balanced object is the one taken. */
    const char *first[] = {"first"};
    expect_facts("{\"facts\": [\"first\"]} {\"facts\": [\"second\"]}", 1, first);
}

/* The object above that starts with a stray quote: the quote opens a
 * string only if it is inside the object, so "ok {" leaves '{' as the
 * start and the facts are read. Checked separately for clarity. */
static void test_stray_quote(void **state) {
    char **f;
    int32_t n;
    assert_int_equal(parse("He said \"ok {\"facts\": [\"Has two cats\"]}", &f, &n), IS_OK);
    assert_int_equal(n, 1);
    assert_string_equal(f[0], "Has two cats");
    extract_facts_free(f, n);
}

static void test_junk(void **state) {
    expect_format("", "no JSON object");
    expect_format("I cannot help with that.", "no JSON object");
    expect_format("[\"Name is Sam\"]", "no JSON object");
    expect_format("{facts: [\"Name is Sam\"]}", "not valid JSON");
    expect_format("{\"facts\": [\"a\",]}", "not valid JSON");
    expect_format("{\"fact\": [\"Name is Sam\"]}", "no \"facts\" array");
    expect_format("{\"Facts\": [\"Name is Sam\"]}", "no \"facts\" array");
    expect_format("{}", "no \"facts\" array");
}

static void test_partial(void **state) {
    /* Every prefix of a valid reply: an error until the object closes, then
     * the facts (the trailing text changes nothing). */
    const char *full = "Facts: {\"facts\": [\"Name is Sam\", \"Likes {jazz}\"]} done";
    size_t close = strstr(full, "]}") - full + 2;
    for (size_t l = 0; l <= strlen(full); l++) {
        char **f = NULL;
        int32_t n = 0;
        is_status st = extract_parse(full, l, &f, &n);
        if (l < close) {
            assert_int_equal(st, IS_ERR_FORMAT);
        } else {
            assert_int_equal(st, IS_OK);
            assert_int_equal(n, 2);
            assert_string_equal(f[1], "Likes {jazz}");
            extract_facts_free(f, n);
        }
    }
    expect_format("{\"facts\": [\"Name is Sam\", \"Lives in", "not closed");
    /* Not NUL-terminated: the length bounds the scan. */
    char buf[] = {'{', '}', 'x'};
    char **f;
    int32_t n;
    assert_int_equal(extract_parse(buf, 1, &f, &n), IS_ERR_FORMAT);
}

static void test_nested_and_types(void **state) {
    expect_format("{\"facts\": [[\"Name is Sam\"]]}", "not a string");
    expect_format("{\"facts\": [\"ok\", 42]}", "fact 1");
    expect_format("{\"facts\": [null]}", "not a string");
    expect_format("{\"facts\": \"Name is Sam\"}", "no \"facts\" array");
    expect_format("{\"facts\": {\"a\": \"b\"}}", "no \"facts\" array");
    /* The facts must be at the top level of the object. */
    expect_format("{\"facts\": [{}]}", "object with no text");
    expect_format("{\"facts\": [\"\"]}", "empty");
    expect_format("{\"facts\": [\"   \\n\"]}", "empty");
    /* Invalid UTF-8 inside a fact. */
    expect_format("{\"facts\": [\"caf\xc3\"]}", "UTF-8");
}

static void test_huge(void **state) {
    /* 50 facts pass, 51 fail. */
    char *buf = malloc(1 << 20);
    for (int count = 50; count <= 51; count++) {
        size_t o = (size_t)sprintf(buf, "{\"facts\": [");
        for (int i = 0; i < count; i++)
            o += (size_t)sprintf(buf + o, "%s\"fact %d\"", i ? ", " : "", i);
        sprintf(buf + o, "]}");
        char **f;
        int32_t n;
        is_status st = parse(buf, &f, &n);
        if (count == 50) {
            assert_int_equal(st, IS_OK);
            assert_int_equal(n, 50);
            assert_string_equal(f[49], "fact 49");
            extract_facts_free(f, n);
        } else {
            assert_int_equal(st, IS_ERR_FORMAT);
            assert_non_null(strstr(is_error_last(), "51 facts"));
        }
    }
    /* A fact of exactly 500 bytes passes, 501 fails (trimmed length). */
    for (int len = 500; len <= 501; len++) {
        size_t o = (size_t)sprintf(buf, "{\"facts\": [\"  ");
        memset(buf + o, 'x', (size_t)len);
        o += (size_t)len;
        sprintf(buf + o, "  \"]}");
        char **f;
        int32_t n;
        is_status st = parse(buf, &f, &n);
        if (len == 500) {
            assert_int_equal(st, IS_OK);
            assert_int_equal((int)strlen(f[0]), 500);
            extract_facts_free(f, n);
        } else {
            assert_int_equal(st, IS_ERR_FORMAT);
        }
    }
    /* A megabyte of junk, and a megabyte of nesting that never closes. */
    memset(buf, 'a', (1 << 20) - 1);
    buf[(1 << 20) - 1] = 0;
    expect_format(buf, "no JSON object");
    memset(buf, '{', (1 << 20) - 1);
    expect_format(buf, "not closed");
    /* Deep but balanced nesting: cJSON refuses it (its nesting limit), no
     * stack overflow. */
    int depth = 100000;
    size_t o = (size_t)sprintf(buf, "{\"facts\": ");
    memset(buf + o, '[', (size_t)depth);
    o += (size_t)depth;
    memset(buf + o, ']', (size_t)depth);
    o += (size_t)depth;
    buf[o++] = '}';
    buf[o] = 0;
    expect_format(buf, "not valid JSON");
    free(buf);
}

static void test_bad_args(void **state) {
    char **f;
    int32_t n;
    assert_int_equal(extract_parse(NULL, 3, &f, &n), IS_ERR_INVALID_ARG);
    assert_int_equal(extract_parse("{}", 2, NULL, &n), IS_ERR_INVALID_ARG);
    assert_int_equal(extract_parse("{}", 2, &f, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(extract_parse(NULL, 0, &f, &n), IS_ERR_FORMAT);
    assert_non_null(extract_system_prompt());
    assert_true(strstr(extract_system_prompt(), "\"facts\"") != NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_stray_quote),
        cmocka_unit_test(test_junk),
        cmocka_unit_test(test_partial),
        cmocka_unit_test(test_nested_and_types),
        cmocka_unit_test(test_huge),
        cmocka_unit_test(test_bad_args),
    };
    return test_run_group(tests, NULL, NULL);
}

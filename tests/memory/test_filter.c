/*
 * test_filter: Mem0's filter language (memory/filter.h) on hand-made facts:
 * every operator on ids, metadata and dates, AND / OR / NOT, the pinned
 * user, and the errors that name what is wrong or unsupported.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "core/status.h"
#include "memory/filter.h"

#include <stdlib.h>
#include <string.h>

/* 2024-07-15T12:00:00Z */
#define T_JULY 1721044800000LL

static mem_fact fact(const char *user, const char *agent, const char *run, const char *meta,
                     int64_t created) {
    mem_fact f;
    memset(&f, 0, sizeof f);
    strcpy(f.id, "f");
    f.user = (char *)user;
    f.agent_id = (char *)agent;
    f.run_id = (char *)run;
    f.metadata = (char *)meta;
    f.created_at = created;
    f.updated_at = created + 1000;
    return f;
}

static bool m(const char *json, const mem_fact *f) {
    mem_filter_expr *e = NULL;
    is_status st = mem_filter_parse(json, strlen(json), &e);
    if (st != IS_OK) fail_msg("parse %s: %s", json, is_error_last());
    bool r = mem_filter_match(e, f);
    mem_filter_expr_free(e);
    return r;
}

static void refused(const char *json, const char *words) {
    mem_filter_expr *e = NULL;
    assert_int_equal(mem_filter_parse(json, strlen(json), &e), IS_ERR_INVALID_ARG);
    assert_null(e);
    if (!strstr(is_error_last(), words))
        fail_msg("%s: message '%s' lacks '%s'", json, is_error_last(), words);
}

static void test_ids(void **state) {
    (void)state;
    mem_fact a = fact("alice", "bot", NULL, NULL, T_JULY),
             none = fact(NULL, "bot", "r1", NULL, T_JULY);
    assert_true(m("{\"user_id\": \"alice\"}", &a));
    assert_false(m("{\"user_id\": \"bob\"}", &a));
    assert_false(m("{\"user_id\": \"alice\"}", &none));
    assert_true(m("{\"user_id\": {\"ne\": \"alice\"}}", &none)); /* absent: ne holds */
    assert_true(m("{\"user_id\": {\"in\": [\"bob\", \"alice\"]}}", &a));
    assert_false(m("{\"user_id\": {\"nin\": [\"bob\", \"alice\"]}}", &a));
    assert_true(m("{\"user_id\": \"*\"}", &a));
    assert_false(m("{\"user_id\": \"*\"}", &none));
    assert_true(m("{\"run_id\": \"*\", \"agent_id\": \"bot\"}", &none));
    assert_true(m("{\"user_id\": {\"contains\": \"lic\"}}", &a));
    assert_true(m("{\"user_id\": {\"icontains\": \"LIC\"}}", &a));
    assert_false(m("{\"user_id\": {\"contains\": \"LIC\"}}", &a));
    assert_true(m("{\"user_id\": {\"gt\": \"aardvark\", \"lt\": \"b\"}}", &a));
}

static void test_logic(void **state) {
    (void)state;
    mem_fact a = fact("alice", "bot", NULL, "{\"topic\":\"food\",\"stars\":4}", T_JULY);
    assert_true(m("{\"OR\": [{\"user_id\": \"bob\"}, {\"agent_id\": \"bot\"}]}", &a));
    assert_false(m("{\"AND\": [{\"user_id\": \"bob\"}, {\"agent_id\": \"bot\"}]}", &a));
    assert_false(m("{\"NOT\": [{\"user_id\": \"bob\"}, {\"agent_id\": \"bot\"}]}", &a));
    assert_true(m("{\"NOT\": [{\"user_id\": \"bob\"}]}", &a));
    assert_true(m("{\"AND\": [{\"OR\": [{\"user_id\": \"x\"}, {\"user_id\": \"alice\"}]}, "
                  "{\"NOT\": {\"metadata\": {\"topic\": \"travel\"}}}]}",
                  &a));
    assert_true(m("{}", &a)); /* no condition: everything */
}

static void test_metadata(void **state) {
    (void)state;
    mem_fact a =
        fact("alice", NULL, NULL,
             "{\"topic\":\"food\",\"stars\":4,\"tags\":[\"x\",\"y\"],\"ok\":true}", T_JULY);
    mem_fact bare = fact("alice", NULL, NULL, NULL, T_JULY);
    assert_true(m("{\"metadata\": {\"topic\": \"food\"}}", &a));
    assert_true(m("{\"topic\": \"food\"}", &a)); /* shorthand */
    assert_true(m("{\"metadata\": {\"stars\": {\"gte\": 4}}}", &a));
    assert_false(m("{\"metadata\": {\"stars\": {\"gt\": 4}}}", &a));
    assert_true(
        m("{\"metadata\": {\"stars\": \"4\"}}", &a)); /* canonical equality, as the store's */
    assert_true(m("{\"metadata\": {\"stars\": {\"in\": [1, 4]}}}", &a));
    assert_true(m("{\"metadata\": {\"tags\": {\"contains\": \"y\"}}}", &a));
    assert_true(m("{\"metadata\": {\"topic\": {\"icontains\": \"OO\"}}}", &a));
    assert_true(m("{\"metadata\": {\"ok\": true}}", &a));
    assert_false(m("{\"metadata\": {\"topic\": \"food\"}}", &bare));
    assert_true(m("{\"metadata\": {\"topic\": {\"ne\": \"food\"}}}", &bare));
    assert_false(m("{\"metadata\": {\"missing\": {\"gte\": 0}}}", &a));
}

static void test_dates(void **state) {
    (void)state;
    mem_fact a = fact("alice", NULL, NULL, NULL, T_JULY);
    assert_true(m("{\"created_at\": {\"gte\": \"2024-07-01\", \"lte\": \"2024-07-31\"}}", &a));
    assert_false(m("{\"created_at\": {\"gte\": \"2024-08-01\"}}", &a));
    assert_true(m("{\"created_at\": \"2024-07-15T12:00:00Z\"}", &a));
    assert_true(m("{\"created_at\": {\"lt\": \"2024-07-15T14:00:01+02:00\"}}", &a)); /* 12:00:01Z */
    assert_false(m("{\"created_at\": {\"lt\": \"2024-07-15T14:00:00+02:00\"}}", &a));
    assert_true(m("{\"created_at\": {\"gte\": 1721044800}}", &a)); /* unix seconds */
    assert_true(m("{\"updated_at\": {\"gt\": \"2024-07-15T12:00:00.500Z\"}}", &a));
    int64_t ms;
    assert_true(mem_filter_parse_time("1970-01-01", &ms));
    assert_int_equal(ms, 0);
    assert_true(mem_filter_parse_time("2000-03-01T00:00:00Z", &ms));
    assert_int_equal(ms, 951868800000LL);
    assert_false(mem_filter_parse_time("2024-13-01", &ms));
    assert_false(mem_filter_parse_time("yesterday", &ms));
    assert_false(mem_filter_parse_time("2024-07-01T25:00", &ms));
}

static void test_user_and_scope(void **state) {
    (void)state;
    mem_filter_expr *e = NULL;
    const char *j = "{\"AND\": [{\"user_id\": \"alice\"}, {\"metadata\": {\"a\": 1}}]}";
    assert_int_equal(mem_filter_parse(j, strlen(j), &e), IS_OK);
    assert_string_equal(mem_filter_user(e), "alice");
    assert_true(mem_filter_has_scope(e));
    mem_filter_expr_free(e);
    j = "{\"OR\": [{\"user_id\": \"alice\"}, {\"user_id\": \"bob\"}]}";
    assert_int_equal(mem_filter_parse(j, strlen(j), &e), IS_OK);
    assert_null(mem_filter_user(e)); /* several users possible */
    mem_filter_expr_free(e);
    j = "{\"metadata\": {\"a\": 1}}";
    assert_int_equal(mem_filter_parse(j, strlen(j), &e), IS_OK);
    assert_false(mem_filter_has_scope(e));
    mem_filter_expr_free(e);
}

static void test_errors(void **state) {
    (void)state;
    refused("{\"app_id\": \"x\"}", "\"app_id\" is not supported");
    refused("{\"categories\": {\"contains\": \"x\"}}", "\"categories\" is not supported");
    refused("{\"user_id\": {\"like\": \"x\"}}", "unknown operator \"like\"");
    refused("{\"user_id\": {\"in\": \"x\"}}", "needs a list");
    refused("{\"user_id\": [\"x\"]}", "use {\"in\"");
    refused("{\"created_at\": {\"gte\": \"last week\"}}", "ISO 8601");
    refused("{\"created_at\": {\"gte\": 1e300}}", "unix seconds"); /* would overflow the ms */
    refused("{\"AND\": []}", "non-empty list");
    refused("{\"OR\": [1]}", "must be objects");
    refused("{\"metadata\": 3}", "must be an object");
    refused("[1]", "JSON object");
    refused("{\"user_id\": ", "not valid JSON");
    refused("{\"meta\": {\"a\": {\"b\": 1}}}", "metadata key");
    /* Deep nesting is refused, not a stack overflow. */
    char deep[4096] = "";
    for (int i = 0; i < 100; i++) strcat(deep, "{\"NOT\": ");
    strcat(deep, "{}");
    for (int i = 0; i < 100; i++) strcat(deep, "}");
    refused(deep, "nested deeper");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ids),
        cmocka_unit_test(test_logic),
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_dates),
        cmocka_unit_test(test_user_and_scope),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

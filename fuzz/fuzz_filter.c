/*
 * fuzz_filter: libFuzzer target for Mem0's filter language
 * (src/memory/filter.h), which every list, search and delete of the Mem0
 * routes hands untrusted JSON to.
 *
 * Each input is parsed as a filter; a success is then matched against a few
 * facts (with and without ids, metadata of every JSON type, or malformed
 * metadata), and mem_filter_user / mem_filter_has_scope are called. What
 * filter.h promises is checked with __builtin_trap(): a failure is
 * IS_ERR_INVALID_ARG or IS_ERR_NOMEM with a non-empty message and a NULL
 * tree; a pinned user is a string some match needs (a fact of another user
 * never matches). ASan, UBSan and LeakSanitizer check the rest. The ISO 8601
 * reader gets the raw bytes too.
 */
#include "core/status.h"
#include "memory/filter.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

static mem_fact fact(const char *user, const char *agent, const char *run, const char *meta,
                     int64_t t) {
    mem_fact f;
    memset(&f, 0, sizeof f);
    f.user = (char *)user;
    f.agent_id = (char *)agent;
    f.run_id = (char *)run;
    f.metadata = (char *)meta;
    f.created_at = t;
    f.updated_at = t + 1;
    return f;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    int64_t ms;
    (void)mem_filter_parse_time(buf, &ms);
    mem_filter_expr *e = (mem_filter_expr *)1;
    is_status st = mem_filter_parse(buf, size, &e);
    if (st != IS_OK) {
        CHECK(st == IS_ERR_INVALID_ARG || st == IS_ERR_NOMEM);
        CHECK(e == NULL);
        CHECK(is_error_last()[0] != '\0');
        free(buf);
        return 0;
    }
    CHECK(e != NULL);
    mem_fact facts[] = {
        fact("alice", "bot", "r1",
             "{\"topic\":\"food\",\"stars\":4,\"tags\":[\"x\"],\"ok\":true,\"n\":null}",
             1721044800000LL),
        fact(NULL, "bot", NULL, NULL, 0),
        fact("bob", NULL, "r2", "{\"nested\":{\"a\":1}}", -5),
        fact("", "", "", "not json", INT64_MAX / 2),
    };
    const char *pinned = mem_filter_user(e);
    for (size_t i = 0; i < sizeof facts / sizeof facts[0]; i++) {
        bool m = mem_filter_match(e, &facts[i]);
        if (m && pinned) CHECK(facts[i].user && strcmp(facts[i].user, pinned) == 0);
    }
    (void)mem_filter_has_scope(e);
    mem_filter_expr_free(e);
    free(buf);
    return 0;
}

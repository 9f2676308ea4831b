/*
 * test_memory_nodes: two memory services (memory/memory.h) as two serving
 * nodes, one PostgreSQL fact store (IS_PG_URL; ctest's test_memory_nodes
 * runs beside a throwaway server from scripts/pg_temp.sh), each with a data
 * directory of its own for its KV records. Without IS_PG_URL it skips (77).
 *
 *   - a fact added through A: B's search finds it once B heard of it, and
 *     B's change callback asks for its encoding; B then encodes it into its
 *     own record store under the record id the row names (the same name on
 *     every node);
 *   - updated through A: B's search returns the new text at once (rows are
 *     the truth), its index ranks by the new text once heard, B's record of
 *     the old version is deleted from its disk, and the record B encodes
 *     carries the new text's hash;
 *   - deleted through A: B's search no longer finds it and B's record is
 *     deleted; memory_check passes on both nodes throughout.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kv/fact_record.h"
#include "memory/memory.h"
#include "test_fakes.h"
#include "test_util.h"

#define FAKE_DIM TEST_FAKE_DIM

static char g_dir[256];
static const char *g_pg;

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_memory_nodes_XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    if (g_pg) return test_pg_reset(g_pg) ? 0 : -1; /* every case starts from an empty database */
    return 0;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

/* A small valid record carrying the text's hash. */
static is_status fake_encode(void *ud, record_store *rs, const memory_encode_job *job) {
    return test_fake_record_put(rs, job, 0);
}

/* What node B's change callback heard (the fact ids it was asked to encode). */
typedef struct asked {
    pthread_mutex_t mu;
    int n;
    char id[8][MEMORY_ID_SIZE];
} asked;

static void on_change(const char *tenant, const char *user, const char *id, void *ud) {
    asked *a = ud;
    pthread_mutex_lock(&a->mu);
    if (a->n < 8) snprintf(a->id[a->n++], MEMORY_ID_SIZE, "%s", id);
    pthread_mutex_unlock(&a->mu);
}

static int n_asked(asked *a) {
    pthread_mutex_lock(&a->mu);
    int n = a->n;
    pthread_mutex_unlock(&a->mu);
    return n;
}

static memory *open_node(const char *name) {
    char dir[320];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    memory_params p = memory_default_params();
    p.embed = test_fake_embed;
    p.embed_dim = FAKE_DIM;
    p.embed_name = "fake-bow";
    p.store_url = g_pg;
    memory *m = NULL;
    is_status st = memory_open(dir, &p, &m, NULL);
    if (st != IS_OK) fail_msg("memory_open %s: %s", name, is_error_last());
    return m;
}

static bool record_file(const char *node, const char *rid) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/kv/%s.fkv", g_dir, node, rid);
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* The top hit of B's search for `query` by (tenant, user), or NULL: its
 * text (static buffer), and its KV record id into rid. */
static const char *top_text(memory *m, const char *query, char *rid, size_t cap) {
    static char text[256];
    mem_filter f = {.tenant = "acme", .user = "alice"};
    memory_hit *h = NULL;
    int32_t n = 0;
    assert_int_equal(memory_search(m, &f, query, 1, &h, &n), IS_OK);
    const char *out = NULL;
    if (n > 0) {
        snprintf(text, sizeof text, "%s", h[0].fact.text);
        if (rid) snprintf(rid, cap, "%s", h[0].fact.kv_record ? h[0].fact.kv_record : "");
        out = text;
    }
    memory_hits_free(h, n);
    return out;
}

/* Waits up to 10 s for cond; true if it came. */
#define WAIT_FOR(cond)                                                                             \
    ({                                                                                             \
        bool ok_ = false;                                                                          \
        for (int i_ = 0; i_ < 1000 && !(ok_ = (cond)); i_++) usleep(10000);                        \
        ok_;                                                                                       \
    })

static void test_two_nodes(void **state) {
    if (!g_pg)
        TEST_SKIP("needs a PostgreSQL store: IS_PG_URL (ctest runs it under scripts/pg_temp.sh)");
    memory *a = open_node("a"), *b = open_node("b");
    memory_set_encoder(a, fake_encode, NULL);
    asked heard = {.mu = PTHREAD_MUTEX_INITIALIZER};
    memory_set_change_fn(b, on_change, &heard);
    usleep(200000); /* both watches listen */

    /* Added through A. */
    memory_add_req r = {.tenant = "acme",
                        .user = "alice",
                        .text = "Alice keeps bees in Lyon.",
                        .window = MEMORY_WINDOW_DEFAULT};
    char id[MEMORY_ID_SIZE];
    assert_int_equal(memory_add(a, &r, id), IS_OK);
    /* Another fact, which a query of the updated text's words must rank
     * below it only if B's index follows the update. */
    memory_add_req r2 = {.tenant = "acme",
                         .user = "alice",
                         .text = "Marseille hives are sold at the market.",
                         .window = MEMORY_WINDOW_DEFAULT};
    char id2[MEMORY_ID_SIZE];
    assert_int_equal(memory_add(a, &r2, id2), IS_OK);
    assert_true(WAIT_FOR(n_asked(&heard) == 2));
    assert_string_equal(heard.id[0], id);
    assert_string_equal(heard.id[1], id2);
    char rid[RECORD_STORE_ID_MAX + 1];
    const char *t = top_text(b, "bees Lyon", rid, sizeof rid);
    assert_non_null(t);
    assert_string_equal(t, "Alice keeps bees in Lyon.");
    assert_true(record_file("a", rid));
    assert_false(record_file("b", rid)); /* A's record is A's cache */
    bool did = false;
    assert_int_equal(memory_encode_one(b, "acme", "alice", id, fake_encode, NULL, &did), IS_OK);
    assert_true(did);
    assert_true(record_file("b", rid)); /* under the name the row gives */
    assert_int_equal(memory_encode_one(b, "acme", "alice", id2, fake_encode, NULL, &did), IS_OK);
    char rid_v1[RECORD_STORE_ID_MAX + 1];
    snprintf(rid_v1, sizeof rid_v1, "%s", rid);

    /* Updated through A. */
    assert_int_equal(
        memory_update(a, "acme", "alice", id, "Alice moved her hives to Marseille.", NULL), IS_OK);
    t = top_text(b, "keeps bees Lyon", rid, sizeof rid);
    assert_non_null(t);
    assert_string_equal(t, "Alice moved her hives to Marseille."); /* the row, at once */
    assert_true(WAIT_FOR(n_asked(&heard) == 3));
    assert_string_equal(heard.id[2], id);
    assert_false(record_file("b", rid_v1)); /* the gone version's KV left B's disk */
    assert_string_not_equal(rid, rid_v1);
    /* B's index ranks by the new text: it beats the other fact on the new words. */
    t = top_text(a, "moved hives Marseille", NULL, 0);
    assert_non_null(t);
    assert_string_equal(t, "Alice moved her hives to Marseille."); /* the writer's own index */
    t = top_text(b, "moved hives Marseille", rid, sizeof rid);
    assert_non_null(t);
    assert_string_equal(t, "Alice moved her hives to Marseille.");
    assert_int_equal(memory_encode_one(b, "acme", "alice", id, fake_encode, NULL, &did), IS_OK);
    assert_true(did && record_file("b", rid));
    if (memory_check(a, true) != IS_OK) fail_msg("memory_check a: %s", is_error_last());
    if (memory_check(b, true) != IS_OK) fail_msg("memory_check b: %s", is_error_last());

    /* Deleted through A. */
    assert_int_equal(memory_delete(a, "acme", "alice", id), IS_OK);
    char rid_v2[RECORD_STORE_ID_MAX + 1];
    snprintf(rid_v2, sizeof rid_v2, "%s", rid);
    /* The row is gone: never returned, even before B heard (its index may
     * still rank it first, and the search drops it); once B heard, the other
     * fact is first. */
    t = top_text(b, "moved her hives", NULL, 0);
    assert_true(!t || strcmp(t, "Marseille hives are sold at the market.") == 0);
    assert_true(WAIT_FOR((t = top_text(b, "moved her hives", NULL, 0)) != NULL &&
                         strcmp(t, "Marseille hives are sold at the market.") == 0));
    assert_true(WAIT_FOR(!record_file("b", rid_v2)));
    assert_int_equal(n_asked(&heard), 3); /* a delete asks for no encoding */
    if (memory_check(b, false) != IS_OK) fail_msg("memory_check b: %s", is_error_last());

    memory_close(a);
    memory_close(b);
}

int main(void) {
    g_pg = getenv("IS_PG_URL");
    if (g_pg && !*g_pg) g_pg = NULL;
#ifndef IS_HAVE_LIBPQ
    g_pg = NULL;
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_two_nodes, setup, teardown),
    };
    return test_run_group(tests, NULL, NULL);
}

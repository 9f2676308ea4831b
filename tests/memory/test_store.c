/*
 * test_store: the fact store (memory/store.h), every operation, against
 * SQLite, or against PostgreSQL when IS_PG_URL names a database
 * (scripts/pg_temp.sh starts a throwaway server and sets it: ctest's
 * test_store_pg; every table is dropped before each case). The same cases
 * must give the same results on both.
 *
 *   - insert then get: every field round-trips (metadata canonicalised,
 *     embedding bytes, context turns, source, hash, versions, times);
 *     persistence across close and reopen; a duplicate id is refused and
 *     changes nothing;
 *   - get_all filters: agent_id, run_id, metadata equality (strings,
 *     numbers in canonical form, booleans, several keys, a missing key),
 *     order oldest first;
 *   - update: text and metadata, version check (a stale version is refused
 *     and changes nothing), history ADD -> UPDATE with old and new text;
 *   - delete: the row goes, history keeps the old text; delete_all by
 *     filter deletes exactly the matching facts, each with a history row;
 *   - isolation: get, update, delete and history of a fact under another
 *     tenant (same user id, same text) or another user behave as not found
 *     and leave the fact unchanged;
 *   - find_source (resumable imports), get_many (found and missing ids,
 *     another user's, ids that need quoting), set_kv, count, foreach;
 *   - a fault before COMMIT rolls the transaction back;
 *   - refusals: a file that is not a fact store, a newer schema version,
 *     non-object or nested metadata;
 *   - PostgreSQL only, two stores as two nodes: a version checked by one
 *     is refused to the other after it moved on, and every add, update and
 *     delete of one reaches the other's watch (not its own), in order, with
 *     the version and the KV record the row named before; after the server
 *     drops every connection, calls work again and the watches say they
 *     may have missed changes (RESYNC) and hear the next ones.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "memory/store.h"
#include "test_util.h"

#ifdef IS_HAVE_LIBPQ
#include <libpq-fe.h>
#endif

static char g_dir[256];
static char g_path[1024]; /* the SQLite file, or the PostgreSQL URL */
static const char *g_pg;  /* IS_PG_URL, NULL: SQLite */

/* One SQL statement on the store's database behind the store's back,
 * returning the first column of the first row as an integer (-1 on error). */
static long long raw_sql(const char *sql) {
    long long v = -1;
    if (g_pg) {
#ifdef IS_HAVE_LIBPQ
        PGconn *c = PQconnectdb(g_pg);
        PQclear(PQexec(c, "SET client_min_messages = warning"));
        PGresult *r = PQexec(c, sql);
        ExecStatusType es = PQresultStatus(r);
        if (es == PGRES_TUPLES_OK && PQntuples(r) > 0) v = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        else if (es == PGRES_COMMAND_OK || es == PGRES_TUPLES_OK) v = 0;
        else fprintf(stderr, "raw_sql %s: %s", sql, PQresultErrorMessage(r));
        PQclear(r);
        PQfinish(c);
#endif
        return v;
    }
    sqlite3 *db;
    if (sqlite3_open(g_path, &db) != SQLITE_OK) return -1;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(db, sql, -1, &q, NULL) == SQLITE_OK) {
        int rc = sqlite3_step(q);
        v = rc == SQLITE_ROW ? sqlite3_column_int64(q, 0) : rc == SQLITE_DONE ? 0 : -1;
        sqlite3_finalize(q);
    }
    sqlite3_close(db);
    return v;
}

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_store_XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    if (g_pg) {
        snprintf(g_path, sizeof g_path, "%s", g_pg);
        /* Every case starts from an empty database. */
        return raw_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public") == 0 ? 0 : -1;
    }
    snprintf(g_path, sizeof g_path, "%s/memory.db", g_dir);
    return 0;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

/* A fact with a 4-float embedding derived from `seed`. */
typedef struct test_fact {
    mem_fact f;
    float emb[4];
} test_fact;

static void make_fact(test_fact *t, const char *id, const char *tenant, const char *user,
                      const char *text, const char *metadata, float seed) {
    memset(t, 0, sizeof *t);
    snprintf(t->f.id, sizeof t->f.id, "%s", id);
    t->f.tenant = (char *)tenant;
    t->f.user = (char *)user;
    t->f.text = (char *)text;
    t->f.metadata = (char *)metadata;
    mem_text_hash_hex(text, t->f.hash);
    for (int i = 0; i < 4; i++) t->emb[i] = seed + 0.25f * (float)i;
    t->f.embedding = t->emb;
    t->f.dim = 4;
    t->f.version = 1;
}

static mem_store *open_store(void) {
    mem_store *s = NULL;
    is_status st = mem_store_open(g_path, &s);
    if (st != IS_OK) fprintf(stderr, "open: %s\n", is_error_last());
    assert_int_equal(st, IS_OK);
    return s;
}

static void test_insert_get_roundtrip(void **state) {
    mem_store *s = open_store();
    test_fact t;
    char *meta = NULL;
    assert_int_equal(mem_metadata_canonical("{ \"topic\" : \"food\", \"n\": 3 }", &meta), IS_OK);
    assert_string_equal(meta, "{\"topic\":\"food\",\"n\":3}");
    make_fact(&t, "id-1", "acme", "alice", "Alice likes sushi.", meta, 1.0f);
    char *ctx[2] = {"Bob: what do you like?", "Alice: \"sushi\", of course"};
    t.f.context = ctx;
    t.f.n_context = 2;
    t.f.kv_window = 20;
    t.f.kv_record = "id-1-v1";
    t.f.source = "locomo:26:D1:3";
    t.f.agent_id = "agent-x";
    t.f.run_id = "run-7";
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    assert_int_equal(mem_store_count(s), 1);

    /* Reopen: it is on disk. */
    mem_store_close(s);
    s = open_store();
    mem_fact g;
    assert_int_equal(mem_store_get(s, "acme", "alice", "id-1", true, &g), IS_OK);
    assert_string_equal(g.id, "id-1");
    assert_string_equal(g.tenant, "acme");
    assert_string_equal(g.user, "alice");
    assert_string_equal(g.agent_id, "agent-x");
    assert_string_equal(g.run_id, "run-7");
    assert_string_equal(g.text, "Alice likes sushi.");
    assert_string_equal(g.metadata, meta);
    assert_string_equal(g.source, "locomo:26:D1:3");
    assert_string_equal(g.hash, t.f.hash);
    assert_int_equal(strlen(g.hash), 16);
    assert_int_equal(g.dim, 4);
    assert_memory_equal(g.embedding, t.emb, sizeof t.emb);
    assert_int_equal(g.n_context, 2);
    assert_string_equal(g.context[0], ctx[0]);
    assert_string_equal(g.context[1], ctx[1]);
    assert_int_equal(g.kv_window, 20);
    assert_string_equal(g.kv_record, "id-1-v1");
    assert_int_equal(g.version, 1);
    assert_true(g.created_at > 1600000000000LL);
    assert_true(g.updated_at == g.created_at);
    mem_fact_clear(&g);

    /* Without embedding: the pointer stays NULL, dim still reported. */
    assert_int_equal(mem_store_get(s, "acme", "alice", "id-1", false, &g), IS_OK);
    assert_null(g.embedding);
    assert_int_equal(g.dim, 4);
    mem_fact_clear(&g);

    /* A duplicate id is refused, even under another tenant, and nothing changes. */
    test_fact d;
    make_fact(&d, "id-1", "other", "bob", "Bob likes tea.", NULL, 2.0f);
    assert_int_equal(mem_store_insert(s, &d.f), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_store_count(s), 1);
    assert_int_equal(mem_store_get(s, "other", "bob", "id-1", false, &g), IS_ERR_NOT_FOUND);

    /* Missing fields are refused. */
    make_fact(&d, "id-2", "acme", "", "x", NULL, 0);
    assert_int_equal(mem_store_insert(s, &d.f), IS_ERR_INVALID_ARG);
    make_fact(&d, "id-2", "acme", "alice", "x", NULL, 0);
    d.f.embedding = NULL;
    assert_int_equal(mem_store_insert(s, &d.f), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_store_count(s), 1);

    free(meta);
    mem_store_close(s);
}

static int32_t ids_of(mem_fact *f, int32_t n, const char **out) {
    for (int32_t i = 0; i < n; i++) out[i] = f[i].id;
    return n;
}

static void test_list_filters(void **state) {
    mem_store *s = open_store();
    /* f1..f6 for (acme, alice), one for (acme, bob), one for (other, alice). */
    struct {
        const char *id, *tenant, *user, *agent, *run, *meta;
    } rows[] = {
        {"f1", "acme", "alice", NULL, NULL, NULL},
        {"f2", "acme", "alice", "a1", NULL, "{\"topic\":\"food\",\"n\":3}"},
        {"f3", "acme", "alice", "a1", "r1", "{\"topic\":\"food\",\"n\":3.0,\"ok\":true}"},
        {"f4", "acme", "alice", "a2", "r1", "{\"topic\":\"work\",\"n\":0.5}"},
        {"f5", "acme", "alice", NULL, "r2", "{\"topic\":\"food\",\"ok\":false}"},
        {"f6", "acme", "alice", "a1", "r2", "{\"topic\":3}"},
        {"g1", "acme", "bob", "a1", "r1", "{\"topic\":\"food\"}"},
        {"h1", "other", "alice", "a1", "r1", "{\"topic\":\"food\"}"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        test_fact t;
        char *meta = NULL;
        assert_int_equal(mem_metadata_canonical(rows[i].meta, &meta), IS_OK);
        make_fact(&t, rows[i].id, rows[i].tenant, rows[i].user, "same text", meta, (float)i);
        t.f.agent_id = (char *)rows[i].agent;
        t.f.run_id = (char *)rows[i].run;
        assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
        free(meta);
    }
    const char *ids[16];
    mem_fact *out;
    int32_t n;
#define LIST(...)                                                                                  \
    do {                                                                                           \
        mem_filter f_ = {__VA_ARGS__};                                                             \
        assert_int_equal(mem_store_list(s, &f_, false, &out, &n), IS_OK);                          \
        ids_of(out, n, ids);                                                                       \
    } while (0)
#define EXPECT(...)                                                                                \
    do {                                                                                           \
        const char *want_[] = {__VA_ARGS__};                                                       \
        int32_t nw_ = (int32_t)(sizeof want_ / sizeof want_[0]);                                   \
        if (nw_ == 1 && want_[0] == NULL) nw_ = 0;                                                 \
        assert_int_equal(n, nw_);                                                                  \
        for (int32_t i_ = 0; i_ < nw_; i_++) assert_string_equal(ids[i_], want_[i_]);              \
        mem_facts_free(out, n);                                                                    \
    } while (0)

    LIST(.tenant = "acme", .user = "alice");
    EXPECT("f1", "f2", "f3", "f4", "f5", "f6"); /* oldest first (same ms: by id) */
    LIST(.tenant = "acme", .user = "alice", .agent_id = "a1");
    EXPECT("f2", "f3", "f6");
    LIST(.tenant = "acme", .user = "alice", .run_id = "r1");
    EXPECT("f3", "f4");
    LIST(.tenant = "acme", .user = "alice", .agent_id = "a1", .run_id = "r2");
    EXPECT("f6");
    const char *k1[] = {"topic"}, *v1[] = {"food"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k1, .meta_values = v1, .n_meta = 1);
    EXPECT("f2", "f3", "f5");
    /* Numbers compare in canonical form: 3 and 3.0 are "3"; a string "3" equals number 3. */
    const char *k2[] = {"n"}, *v2[] = {"3"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k2, .meta_values = v2, .n_meta = 1);
    EXPECT("f2", "f3");
    const char *k3[] = {"topic"}, *v3[] = {"3"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k3, .meta_values = v3, .n_meta = 1);
    EXPECT("f6");
    const char *k4[] = {"n"}, *v4[] = {"0.5"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k4, .meta_values = v4, .n_meta = 1);
    EXPECT("f4");
    const char *k5[] = {"topic", "ok"}, *v5[] = {"food", "true"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k5, .meta_values = v5, .n_meta = 2);
    EXPECT("f3");
    const char *k6[] = {"ok"}, *v6[] = {"false"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k6, .meta_values = v6, .n_meta = 1);
    EXPECT("f5");
    const char *k7[] = {"missing"}, *v7[] = {"food"};
    LIST(.tenant = "acme", .user = "alice", .meta_keys = k7, .meta_values = v7, .n_meta = 1);
    EXPECT(NULL);
    /* Combined with agent: only a1's food facts. */
    LIST(.tenant = "acme", .user = "alice", .agent_id = "a1", .meta_keys = k1, .meta_values = v1,
         .n_meta = 1);
    EXPECT("f2", "f3");
    /* Other partitions see only their own. */
    LIST(.tenant = "acme", .user = "bob");
    EXPECT("g1");
    LIST(.tenant = "other", .user = "alice");
    EXPECT("h1");
    LIST(.tenant = "nobody", .user = "alice");
    EXPECT(NULL);
    /* ("acm", "ealice") is not ("acme", "alice"). */
    LIST(.tenant = "acm", .user = "ealice");
    EXPECT(NULL);

    /* A filter without tenant or user is refused. */
    mem_filter bad = {.tenant = "acme"};
    assert_int_equal(mem_store_list(s, &bad, false, &out, &n), IS_ERR_INVALID_ARG);
    mem_filter bad2 = {.user = "alice"};
    assert_int_equal(mem_store_list(s, &bad2, false, &out, &n), IS_ERR_INVALID_ARG);
#undef LIST
#undef EXPECT
    mem_store_close(s);
}

static void test_update_and_history(void **state) {
    mem_store *s = open_store();
    test_fact t;
    make_fact(&t, "u1", "acme", "alice", "Alice likes sushi.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);

    mem_fact g;
    assert_int_equal(mem_store_get(s, "acme", "alice", "u1", true, &g), IS_OK);
    int64_t created = g.created_at;
    /* New text, metadata, embedding, record and version. */
    test_fact n;
    make_fact(&n, "u1", "acme", "alice", "Alice prefers ramen now.", "{\"topic\":\"food\"}", 5.0f);
    n.f.version = 2;
    n.f.kv_record = "u1-v2";
    usleep(2000);
    assert_int_equal(mem_store_update(s, &n.f, 1), IS_OK);
    mem_fact_clear(&g);
    assert_int_equal(mem_store_get(s, "acme", "alice", "u1", true, &g), IS_OK);
    assert_string_equal(g.text, "Alice prefers ramen now.");
    assert_string_equal(g.metadata, "{\"topic\":\"food\"}");
    assert_string_equal(g.hash, n.f.hash);
    assert_memory_equal(g.embedding, n.emb, sizeof n.emb);
    assert_string_equal(g.kv_record, "u1-v2");
    assert_int_equal(g.version, 2);
    assert_int_equal(g.created_at, created);
    assert_true(g.updated_at > created);
    mem_fact_clear(&g);

    /* A stale version is refused and changes nothing. */
    make_fact(&n, "u1", "acme", "alice", "stale write", NULL, 9.0f);
    n.f.version = 2;
    assert_int_equal(mem_store_update(s, &n.f, 1), IS_ERR_MISMATCH);
    assert_int_equal(mem_store_get(s, "acme", "alice", "u1", false, &g), IS_OK);
    assert_string_equal(g.text, "Alice prefers ramen now.");
    mem_fact_clear(&g);

    /* set_kv: only at the current version. */
    assert_int_equal(mem_store_set_kv(s, "u1", 1, "u1-other"), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_set_kv(s, "u1", 2, "u1-v2b"), IS_OK);
    assert_int_equal(mem_store_get(s, "acme", "alice", "u1", false, &g), IS_OK);
    assert_string_equal(g.kv_record, "u1-v2b");
    assert_int_equal(g.version, 2);
    mem_fact_clear(&g);

    /* Delete; the row goes, the old row comes back to the caller. */
    mem_fact old;
    assert_int_equal(mem_store_delete(s, "acme", "alice", "u1", &old), IS_OK);
    assert_string_equal(old.kv_record, "u1-v2b");
    assert_string_equal(old.text, "Alice prefers ramen now.");
    mem_fact_clear(&old);
    assert_int_equal(mem_store_get(s, "acme", "alice", "u1", false, &g), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_delete(s, "acme", "alice", "u1", NULL), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_update(s, &n.f, 2), IS_ERR_NOT_FOUND);

    /* History: ADD, UPDATE (old -> new), DELETE (old text kept). */
    mem_history *h;
    int32_t nh;
    assert_int_equal(mem_store_history(s, "acme", "alice", "u1", &h, &nh), IS_OK);
    assert_int_equal(nh, 3);
    assert_int_equal(h[0].event, MEM_EVENT_ADD);
    assert_null(h[0].old_text);
    assert_string_equal(h[0].new_text, "Alice likes sushi.");
    assert_int_equal(h[1].event, MEM_EVENT_UPDATE);
    assert_string_equal(h[1].old_text, "Alice likes sushi.");
    assert_string_equal(h[1].new_text, "Alice prefers ramen now.");
    assert_int_equal(h[2].event, MEM_EVENT_DELETE);
    assert_string_equal(h[2].old_text, "Alice prefers ramen now.");
    assert_null(h[2].new_text);
    assert_true(h[0].id < h[1].id && h[1].id < h[2].id);
    assert_true(h[0].at <= h[1].at && h[1].at <= h[2].at);
    assert_string_equal(h[2].fact_id, "u1");
    assert_string_equal(mem_event_name(h[1].event), "UPDATE");
    mem_history_free(h, nh);
    assert_int_equal(mem_store_history(s, "acme", "alice", "never", &h, &nh), IS_ERR_NOT_FOUND);
    mem_store_close(s);
}

static void test_isolation(void **state) {
    mem_store *s = open_store();
    /* Same user id and same text under two tenants, and another user of A. */
    test_fact a, b, c;
    make_fact(&a, "fa", "tenant-a", "alice", "Alice's PIN is 1234.", NULL, 1.0f);
    make_fact(&b, "fb", "tenant-b", "alice", "Alice's PIN is 1234.", NULL, 1.0f);
    make_fact(&c, "fc", "tenant-a", "bob", "Bob's PIN is 9999.", NULL, 2.0f);
    assert_int_equal(mem_store_insert(s, &a.f), IS_OK);
    assert_int_equal(mem_store_insert(s, &b.f), IS_OK);
    assert_int_equal(mem_store_insert(s, &c.f), IS_OK);

    mem_fact g;
    /* get */
    assert_int_equal(mem_store_get(s, "tenant-b", "alice", "fa", false, &g), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_get(s, "tenant-a", "bob", "fa", false, &g), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_get(s, "tenant-a", "alice", "fb", false, &g), IS_ERR_NOT_FOUND);
    /* update */
    test_fact n;
    make_fact(&n, "fa", "tenant-b", "alice", "overwritten by B", NULL, 3.0f);
    n.f.version = 2;
    assert_int_equal(mem_store_update(s, &n.f, 1), IS_ERR_NOT_FOUND);
    /* delete and delete_all */
    assert_int_equal(mem_store_delete(s, "tenant-b", "alice", "fa", NULL), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_delete(s, "tenant-a", "bob", "fa", NULL), IS_ERR_NOT_FOUND);
    mem_fact *del;
    int32_t nd;
    mem_filter fb = {.tenant = "tenant-b", .user = "alice"};
    assert_int_equal(mem_store_delete_all(s, &fb, &del, &nd), IS_OK);
    assert_int_equal(nd, 1);
    assert_string_equal(del[0].id, "fb");
    mem_facts_free(del, nd);
    /* history of A's fact is invisible from B */
    mem_history *h;
    int32_t nh;
    assert_int_equal(mem_store_history(s, "tenant-b", "alice", "fa", &h, &nh), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_history(s, "tenant-b", "alice", "fb", &h, &nh), IS_OK);
    assert_int_equal(nh, 2);
    mem_history_free(h, nh);
    /* find_source is scoped too */
    char id[MEM_ID_MAX + 1];
    assert_int_equal(mem_store_find_source(s, "tenant-b", "alice", NULL, a.f.hash, id),
                     IS_ERR_NOT_FOUND);
    /* A's facts are untouched. */
    assert_int_equal(mem_store_get(s, "tenant-a", "alice", "fa", false, &g), IS_OK);
    assert_string_equal(g.text, "Alice's PIN is 1234.");
    assert_int_equal(g.version, 1);
    mem_fact_clear(&g);
    assert_int_equal(mem_store_get(s, "tenant-a", "bob", "fc", false, &g), IS_OK);
    mem_fact_clear(&g);
    assert_int_equal(mem_store_count(s), 2);
    mem_store_close(s);
}

static void test_delete_all_filtered(void **state) {
    mem_store *s = open_store();
    const char *agents[] = {"a1", "a2", "a1", NULL, "a1"};
    for (int i = 0; i < 5; i++) {
        test_fact t;
        char id[8], text[32];
        snprintf(id, sizeof id, "d%d", i);
        snprintf(text, sizeof text, "fact %d", i);
        make_fact(&t, id, "acme", "alice", text, i == 4 ? "{\"keep\":true}" : NULL, (float)i);
        t.f.agent_id = (char *)agents[i];
        assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    }
    mem_fact *del;
    int32_t nd;
    const char *k[] = {"keep"}, *v[] = {"true"};
    /* agent a1 AND keep=true: d4 only. */
    mem_filter f1 = {.tenant = "acme",
                     .user = "alice",
                     .agent_id = "a1",
                     .meta_keys = k,
                     .meta_values = v,
                     .n_meta = 1};
    assert_int_equal(mem_store_delete_all(s, &f1, &del, &nd), IS_OK);
    assert_int_equal(nd, 1);
    assert_string_equal(del[0].id, "d4");
    mem_facts_free(del, nd);
    mem_filter f2 = {.tenant = "acme", .user = "alice", .agent_id = "a1"};
    assert_int_equal(mem_store_delete_all(s, &f2, &del, &nd), IS_OK);
    assert_int_equal(nd, 2);
    assert_string_equal(del[0].id, "d0");
    assert_string_equal(del[1].id, "d2");
    mem_facts_free(del, nd);
    assert_int_equal(mem_store_count(s), 2);
    mem_history *h;
    int32_t nh;
    assert_int_equal(mem_store_history(s, "acme", "alice", "d2", &h, &nh), IS_OK);
    assert_int_equal(nh, 2);
    assert_int_equal(h[1].event, MEM_EVENT_DELETE);
    assert_string_equal(h[1].old_text, "fact 2");
    mem_history_free(h, nh);
    mem_filter all = {.tenant = "acme", .user = "alice"};
    assert_int_equal(mem_store_delete_all(s, &all, &del, &nd), IS_OK);
    assert_int_equal(nd, 2);
    mem_facts_free(del, nd);
    assert_int_equal(mem_store_delete_all(s, &all, &del, &nd), IS_OK);
    assert_int_equal(nd, 0);
    assert_int_equal(mem_store_count(s), 0);
    mem_store_close(s);
}

static is_status foreach_fn(const mem_fact *f, void *ud) {
    (*(int *)ud)++;
    return f->embedding && f->dim == 4 ? IS_OK : IS_ERR_INTERNAL;
}

static is_status stop_fn(const mem_fact *f, void *ud) {
    (*(int *)ud)++;
    return IS_ERR_NOT_FOUND;
}

static void test_find_source_meta_foreach(void **state) {
    mem_store *s = open_store();
    test_fact t;
    make_fact(&t, "s1", "acme", "alice", "From the dialogue.", NULL, 1.0f);
    t.f.source = "locomo:26:D1:3";
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    make_fact(&t, "s2", "acme", "alice", "Another fact.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    char id[MEM_ID_MAX + 1], hash[17];
    mem_text_hash_hex("From the dialogue.", hash);
    assert_int_equal(mem_store_find_source(s, "acme", "alice", "locomo:26:D1:3", hash, id), IS_OK);
    assert_string_equal(id, "s1");
    /* Same source, other text: not the same fact. */
    mem_text_hash_hex("From the dialogue!", hash);
    assert_int_equal(mem_store_find_source(s, "acme", "alice", "locomo:26:D1:3", hash, id),
                     IS_ERR_NOT_FOUND);

    char *v = NULL;
    assert_int_equal(mem_store_meta_get(s, "embed_dim", &v), IS_ERR_NOT_FOUND);
    assert_int_equal(mem_store_meta_set(s, "embed_dim", "384"), IS_OK);
    assert_int_equal(mem_store_meta_set(s, "embed_dim", "385"), IS_OK);
    assert_int_equal(mem_store_meta_get(s, "embed_dim", &v), IS_OK);
    assert_string_equal(v, "385");
    free(v);

    /* get_many: the hits of a search in one read; missing ids, another
     * user's id and ids that need quoting in an SQL array. */
    make_fact(&t, "q\"1\\x,{}", "acme", "alice", "Quoted id.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    make_fact(&t, "s3", "acme", "bob", "Bob's fact.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    const char *want_ids[] = {"s2", "nope", "q\"1\\x,{}", "s3", "s1"};
    mem_fact got[5];
    bool found[5];
    assert_int_equal(mem_store_get_many(s, "acme", "alice", want_ids, 5, got, found), IS_OK);
    assert_true(found[0] && !found[1] && found[2] && !found[3] && found[4]);
    assert_string_equal(got[0].text, "Another fact.");
    assert_string_equal(got[2].id, "q\"1\\x,{}");
    assert_string_equal(got[2].text, "Quoted id.");
    assert_string_equal(got[4].text, "From the dialogue.");
    assert_null(got[1].text);
    assert_null(got[3].text);
    assert_null(got[0].embedding);
    assert_int_equal(got[0].dim, 4);
    for (int i = 0; i < 5; i++) mem_fact_clear(&got[i]);
    assert_int_equal(mem_store_get_many(s, "acme", "alice", want_ids, 0, got, found), IS_OK);
    assert_int_equal(mem_store_get_many(s, NULL, "alice", want_ids, 5, got, found),
                     IS_ERR_INVALID_ARG);

    int n = 0;
    assert_int_equal(mem_store_foreach(s, true, foreach_fn, &n), IS_OK);
    assert_int_equal(n, 4);
    n = 0;
    assert_int_equal(mem_store_foreach(s, false, stop_fn, &n), IS_ERR_NOT_FOUND);
    assert_int_equal(n, 1);
    mem_store_close(s);
}

static bool fail_commit(void *ud) {
    (*(int *)ud)++;
    return false;
}

static void test_fault_rolls_back(void **state) {
    mem_store *s = open_store();
    test_fact t;
    make_fact(&t, "r1", "acme", "alice", "before", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &t.f), IS_OK);
    int calls = 0;
    mem_store_set_fault_hook(s, fail_commit, &calls);
    test_fact n;
    make_fact(&n, "r2", "acme", "carol", "never committed", NULL, 1.0f);
    assert_int_equal(mem_store_insert(s, &n.f), IS_ERR_IO);
    make_fact(&n, "r1", "acme", "alice", "after", NULL, 2.0f);
    n.f.version = 2;
    assert_int_equal(mem_store_update(s, &n.f, 1), IS_ERR_IO);
    assert_int_equal(mem_store_delete(s, "acme", "alice", "r1", NULL), IS_ERR_IO);
    assert_int_equal(calls, 3);
    mem_store_set_fault_hook(s, NULL, NULL);
    mem_fact g;
    assert_int_equal(mem_store_get(s, "acme", "alice", "r1", true, &g), IS_OK);
    assert_string_equal(g.text, "before");
    assert_int_equal(g.version, 1);
    mem_fact_clear(&g);
    assert_int_equal(mem_store_get(s, "acme", "carol", "r2", false, &g), IS_ERR_NOT_FOUND);
    mem_history *h;
    int32_t nh;
    assert_int_equal(mem_store_history(s, "acme", "alice", "r1", &h, &nh), IS_OK);
    assert_int_equal(nh, 1); /* the rolled-back history rows are gone too */
    mem_history_free(h, nh);
    assert_int_equal(mem_store_history(s, "acme", "carol", "r2", &h, &nh), IS_ERR_NOT_FOUND);
    /* The user row of the rolled-back insert is gone too: foreign keys hold. */
    mem_store_close(s);
    assert_int_equal(raw_sql("SELECT count(*) FROM users WHERE user_id = 'carol'"), 0);
    assert_int_equal(raw_sql("SELECT count(*) FROM users WHERE user_id = 'alice'"), 1);
}

static bool count_commit(void *ud) {
    (*(int *)ud)++;
    return true;
}

/* A batch is one transaction (the fault hook runs once); a bad fact in it
 * costs only itself (the batch is then written fact by fact); a failed
 * batch commit leaves none of it. */
static void test_insert_many(void **state) {
    mem_store *s = open_store();
    test_fact t[4];
    make_fact(&t[0], "b1", "acme", "alice", "Alice likes tea.", NULL, 1.0f);
    make_fact(&t[1], "b2", "acme", "alice", "Alice has a cat.", NULL, 2.0f);
    make_fact(&t[2], "b3", "acme", "bob", "Bob runs.", NULL, 3.0f);
    mem_fact f[4] = {t[0].f, t[1].f, t[2].f};
    is_status st[4];
    int calls = 0;
    mem_store_set_fault_hook(s, count_commit, &calls);
    assert_int_equal(mem_store_insert_many(s, f, 3, st), IS_OK);
    assert_int_equal(calls, 1);
    for (int i = 0; i < 3; i++) assert_int_equal(st[i], IS_OK);
    assert_int_equal(mem_store_count(s), 3);
    mem_history *h;
    int32_t nh;
    assert_int_equal(mem_store_history(s, "acme", "bob", "b3", &h, &nh), IS_OK);
    assert_int_equal(nh, 1);
    assert_int_equal(h[0].event, MEM_EVENT_ADD);
    mem_history_free(h, nh);

    /* b1 exists: the batch falls back to one transaction a fact. */
    make_fact(&t[3], "b4", "acme", "alice", "Alice swims.", NULL, 4.0f);
    mem_fact g2[3] = {t[3].f, t[0].f, t[3].f};
    snprintf(g2[2].id, sizeof g2[2].id, "b5");
    g2[2].embedding = NULL; /* fails the checks: never written */
    calls = 0;
    assert_int_equal(mem_store_insert_many(s, g2, 3, st), IS_ERR_INVALID_ARG);
    assert_int_equal(st[0], IS_OK);
    assert_int_equal(st[1], IS_ERR_INVALID_ARG);
    assert_int_equal(st[2], IS_ERR_INVALID_ARG);
    /* The batch and b1 alone fail before their commit; b4 alone commits. */
    assert_int_equal(calls, 1);
    assert_int_equal(mem_store_count(s), 4);

    /* A batch whose commit fails leaves nothing. */
    mem_store_set_fault_hook(s, fail_commit, &calls);
    make_fact(&t[0], "c1", "acme", "carol", "Carol sings.", NULL, 5.0f);
    make_fact(&t[1], "c2", "acme", "carol", "Carol paints.", NULL, 6.0f);
    mem_fact g3[2] = {t[0].f, t[1].f};
    assert_int_equal(mem_store_insert_many(s, g3, 2, st), IS_ERR_IO);
    assert_int_equal(st[0], IS_ERR_IO);
    assert_int_equal(st[1], IS_ERR_IO);
    mem_store_set_fault_hook(s, NULL, NULL);
    assert_int_equal(mem_store_count(s), 4);
    mem_fact g;
    assert_int_equal(mem_store_get(s, "acme", "carol", "c1", false, &g), IS_ERR_NOT_FOUND);
    mem_store_close(s);
}

/* set_kv_many: one transaction; a fact whose version moved on is its own
 * IS_ERR_NOT_FOUND and does not undo the others. */
static void test_set_kv_many(void **state) {
    mem_store *s = open_store();
    test_fact t[2];
    make_fact(&t[0], "k1", "acme", "alice", "Alice likes tea.", NULL, 1.0f);
    make_fact(&t[1], "k2", "acme", "alice", "Alice has a cat.", NULL, 2.0f);
    assert_int_equal(mem_store_insert(s, &t[0].f), IS_OK);
    assert_int_equal(mem_store_insert(s, &t[1].f), IS_OK);
    mem_store_kv_set sets[2] = {{"k1", 1, "k1-v1"}, {"k2", 7, "k2-v7"}};
    is_status st[2];
    int calls = 0;
    mem_store_set_fault_hook(s, count_commit, &calls);
    assert_int_equal(mem_store_set_kv_many(s, sets, 2, st), IS_ERR_NOT_FOUND);
    mem_store_set_fault_hook(s, NULL, NULL);
    assert_int_equal(calls, 1);
    assert_int_equal(st[0], IS_OK);
    assert_int_equal(st[1], IS_ERR_NOT_FOUND);
    mem_fact g;
    assert_int_equal(mem_store_get(s, "acme", "alice", "k1", false, &g), IS_OK);
    assert_string_equal(g.kv_record, "k1-v1");
    mem_fact_clear(&g);
    assert_int_equal(mem_store_get(s, "acme", "alice", "k2", false, &g), IS_OK);
    assert_null(g.kv_record);
    mem_fact_clear(&g);
    mem_store_close(s);
}

static void test_refusals(void **state) {
    char *out = (char *)"unchanged";
    assert_int_equal(mem_metadata_canonical("[1,2]", &out), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_metadata_canonical("{\"a\":{\"b\":1}}", &out), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_metadata_canonical("{\"a\":[1]}", &out), IS_ERR_INVALID_ARG);
    assert_int_equal(mem_metadata_canonical("{\"a\":", &out), IS_ERR_INVALID_ARG);
    assert_string_equal(out, "unchanged");
    assert_int_equal(mem_metadata_canonical("", &out), IS_OK);
    assert_null(out);
    mem_store *s = NULL;
    if (g_pg) {
        /* Someone else's facts table, with no schema_version. */
        assert_int_equal(raw_sql("CREATE TABLE facts (x int)"), 0);
        assert_int_equal(mem_store_open(g_path, &s), IS_ERR_FORMAT);
        assert_null(s);
        assert_int_equal(raw_sql("DROP TABLE facts"), 0);
        /* A newer schema. */
        assert_int_equal(mem_store_open(g_path, &s), IS_OK);
        assert_string_equal(mem_store_kind(s), "postgres");
        mem_store_close(s);
        assert_int_equal(raw_sql("SELECT max(version) FROM schema_version"),
                         MEM_STORE_SCHEMA_VERSION);
        assert_int_equal(raw_sql("UPDATE schema_version SET version = 99"), 0);
        s = NULL;
        assert_int_equal(mem_store_open(g_path, &s), IS_ERR_FORMAT);
        assert_null(s);
        /* A server that is not there. */
        char bad[1200];
        snprintf(bad, sizeof bad, "postgresql://inferscale@/postgres?host=%s/nowhere", g_dir);
        assert_int_equal(mem_store_open(bad, &s), IS_ERR_IO);
        assert_null(s);
        return;
    }

    /* Not a database at all. */
    char p[320];
    snprintf(p, sizeof p, "%s/junk.db", g_dir);
    FILE *f = fopen(p, "wb");
    for (int i = 0; i < 100; i++) fputs("this is not sqlite ", f);
    fclose(f);
    assert_int_equal(mem_store_open(p, &s), IS_ERR_FORMAT);
    assert_null(s);
    /* Someone else's database. */
    snprintf(p, sizeof p, "%s/other.db", g_dir);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(p, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "CREATE TABLE t (x)", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(mem_store_open(p, &s), IS_ERR_FORMAT);
    /* A newer schema. */
    snprintf(p, sizeof p, "%s/newer.db", g_dir);
    assert_int_equal(mem_store_open(p, &s), IS_OK);
    mem_store_close(s);
    assert_int_equal(sqlite3_open(p, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "PRAGMA user_version=99", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    s = NULL;
    assert_int_equal(mem_store_open(p, &s), IS_ERR_FORMAT);
    assert_null(s);
    /* A directory that does not exist. */
    assert_int_equal(mem_store_open("/nonexistent/dir/memory.db", &s), IS_ERR_IO);
    assert_int_equal(mem_store_open(NULL, &s), IS_ERR_INVALID_ARG);
}

/* ---- two nodes on one PostgreSQL store ------------------------------------------ */

typedef struct heard {
    pthread_mutex_t mu;
    int n;
    int resyncs;
    mem_change_op op[16];
    char id[16][MEM_ID_MAX + 1];
    int32_t version[16];
    char old_record[16][64];
} heard;

static void on_change(const mem_change *c, void *ud) {
    heard *h = ud;
    pthread_mutex_lock(&h->mu);
    if (c->op == MEM_CHANGE_RESYNC) h->resyncs++;
    if (h->n < 16 && c->op != MEM_CHANGE_RESYNC) {
        h->op[h->n] = c->op;
        snprintf(h->id[h->n], sizeof h->id[0], "%s", c->id);
        h->version[h->n] = c->version;
        snprintf(h->old_record[h->n], sizeof h->old_record[0], "%s",
                 c->old_record ? c->old_record : "");
        h->n++;
    }
    pthread_mutex_unlock(&h->mu);
}

/* Waits (at most 10 s) until h heard n changes; returns how many it heard. */
static int wait_heard(heard *h, int n) {
    for (int i = 0; i < 1000; i++) {
        pthread_mutex_lock(&h->mu);
        int got = h->n;
        pthread_mutex_unlock(&h->mu);
        if (got >= n) return got;
        usleep(10000);
    }
    return h->n;
}

static void test_two_nodes(void **state) {
    if (!g_pg) {
        mem_store *s = open_store();
        assert_int_equal(mem_store_watch(s, on_change, NULL), IS_ERR_UNSUPPORTED);
        mem_store_close(s);
        TEST_SKIP("two nodes need a PostgreSQL store (IS_PG_URL; ctest test_store_pg)");
        return;
    }
    mem_store *a = open_store(), *b = open_store();
    heard ha = {.mu = PTHREAD_MUTEX_INITIALIZER}, hb = {.mu = PTHREAD_MUTEX_INITIALIZER};
    assert_int_equal(mem_store_watch(a, on_change, &ha), IS_OK);
    assert_int_equal(mem_store_watch(b, on_change, &hb), IS_OK);
    assert_int_equal(mem_store_watch(b, on_change, &hb), IS_ERR_INVALID_ARG);
    usleep(300000); /* both LISTEN before the first change */

    test_fact t;
    make_fact(&t, "n1", "acme", "alice", "Alice lives in Paris.", NULL, 1.0f);
    t.f.kv_record = "n1-v1";
    assert_int_equal(mem_store_insert(a, &t.f), IS_OK);
    /* b sees a's row at once: one truth. */
    mem_fact g;
    assert_int_equal(mem_store_get(b, "acme", "alice", "n1", false, &g), IS_OK);
    assert_int_equal(g.version, 1);
    mem_fact_clear(&g);

    /* Both read version 1; a's update wins, b's is refused, not lost over a's. */
    test_fact u;
    make_fact(&u, "n1", "acme", "alice", "Alice lives in Lyon.", NULL, 2.0f);
    u.f.version = 2;
    u.f.kv_record = "n1-v2";
    assert_int_equal(mem_store_update(a, &u.f, 1), IS_OK);
    test_fact u2;
    make_fact(&u2, "n1", "acme", "alice", "Alice lives in Rome.", NULL, 3.0f);
    u2.f.version = 2;
    assert_int_equal(mem_store_update(b, &u2.f, 1), IS_ERR_MISMATCH);
    assert_int_equal(mem_store_get(b, "acme", "alice", "n1", false, &g), IS_OK);
    assert_string_equal(g.text, "Alice lives in Lyon.");
    mem_fact_clear(&g);
    assert_int_equal(mem_store_delete(a, "acme", "alice", "n1", NULL), IS_OK);
    /* A rolled-back change is never announced. */
    int calls = 0;
    mem_store_set_fault_hook(a, fail_commit, &calls);
    make_fact(&t, "n2", "acme", "alice", "never committed", NULL, 1.0f);
    assert_int_equal(mem_store_insert(a, &t.f), IS_ERR_IO);
    mem_store_set_fault_hook(a, NULL, NULL);
    make_fact(&t, "n3", "acme", "bob", "Bob likes tea.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(b, &t.f), IS_OK);

    assert_int_equal(wait_heard(&hb, 3), 3);
    assert_int_equal(wait_heard(&ha, 1), 1);
    usleep(300000); /* nothing more comes: not n2, not a's own changes back to a */
    assert_int_equal(hb.n, 3);
    assert_int_equal(ha.n, 1);
    assert_int_equal(hb.op[0], MEM_CHANGE_ADD);
    assert_string_equal(hb.id[0], "n1");
    assert_int_equal(hb.version[0], 1);
    assert_int_equal(hb.op[1], MEM_CHANGE_UPDATE);
    assert_int_equal(hb.version[1], 2);
    assert_string_equal(hb.old_record[1], "n1-v1");
    assert_int_equal(hb.op[2], MEM_CHANGE_DELETE);
    assert_string_equal(hb.old_record[2], "n1-v2");
    assert_int_equal(ha.op[0], MEM_CHANGE_ADD);
    assert_string_equal(ha.id[0], "n3");

    /* The server drops every connection of the stores (as a restart does):
     * the next call opens its connection again, and each watch, once it
     * listens again, says that it may have missed changes. */
    assert_int_equal(
        raw_sql("SELECT (count(pg_terminate_backend(pid)) > 0)::int FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND usename = current_user"),
        1);
    assert_int_equal(mem_store_get(a, "acme", "bob", "n3", false, &g), IS_OK);
    mem_fact_clear(&g);
    for (int i = 0; i < 500 && (ha.resyncs == 0 || hb.resyncs == 0); i++) usleep(10000);
    assert_true(ha.resyncs >= 1 && hb.resyncs >= 1);
    make_fact(&t, "n4", "acme", "bob", "Bob likes coffee too.", NULL, 1.0f);
    assert_int_equal(mem_store_insert(a, &t.f), IS_OK);
    assert_int_equal(wait_heard(&hb, 4), 4);
    assert_string_equal(hb.id[3], "n4");
    mem_store_close(a);
    mem_store_close(b);
}

int main(void) {
    g_pg = getenv("IS_PG_URL");
    if (g_pg && !*g_pg) g_pg = NULL;
#ifndef IS_HAVE_LIBPQ
    if (g_pg) {
        fprintf(stderr, "skip: IS_PG_URL is set but this build has no libpq (libpq-dev)\n");
        return TEST_SKIP_CODE;
    }
#endif
    fprintf(stderr, "test_store: %s store\n", g_pg ? "PostgreSQL" : "SQLite");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_insert_get_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_list_filters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_update_and_history, setup, teardown),
        cmocka_unit_test_setup_teardown(test_isolation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_delete_all_filtered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_find_source_meta_foreach, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault_rolls_back, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_insert_many, setup, teardown),
        cmocka_unit_test_setup_teardown(test_set_kv_many, setup, teardown),
        cmocka_unit_test_setup_teardown(test_two_nodes, setup, teardown),
    };
    return test_run_group(tests, NULL, NULL);
}

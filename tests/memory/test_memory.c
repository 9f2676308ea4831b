/*
 * test_memory: the memory service facade (memory/memory.h): store +
 * embedding + index + KV records kept in agreement.
 *
 * Most tests use a fake embedder (hashed bag of words, so lexical overlap
 * decides the dense ranking too) and a fake encoder that writes small but
 * valid KV records carrying the text hash and the context length it was
 * given; the last test uses the real MiniLM embedder when it is installed.
 *
 *   - add, get, get_all, update (text, metadata), delete, delete_all,
 *     history, each followed by memory_check (rows, records, index agree):
 *     a new text gets a new record id and the old record is gone; search
 *     sees the new text and never the deleted fact;
 *   - isolation: the same user id and the same text under two tenants; get,
 *     search, update, delete and history under A never see or touch B's;
 *   - search filters (agent_id, run_id, metadata);
 *   - failures leave nothing: an encoder error, a record-store write error,
 *     a failed commit; bad input (invalid UTF-8, empty text, nested
 *     metadata) is refused before anything is written;
 *   - reconciliation at open: orphan records deleted, a missing record
 *     listed and re-encoded by memory_encode_missing; no encoder: facts
 *     without KV, an update drops the stale record;
 *   - memory_encode_one (the HTTP server's deferred encoding): one fact at
 *     a time, in its current text, not for a deleted fact or another
 *     tenant's, nothing left by a failing encoder, and an update that
 *     lands while the encoder runs waits for it and drops its record;
 *   - a second open of the same directory fails; another embedding model is
 *     refused; GPU retrieval asked for without a usable GPU (or in a build
 *     without CUDA) fails with IS_ERR_UNSUPPORTED before anything is opened,
 *     and without a loaded embedder with IS_ERR_INVALID_ARG
 *     (tests/cuda/test_memory_gpu.c tests it on a GPU);
 *   - the LoCoMo importer on conversation 26: facts = observations, per
 *     speaker, with source refs, metadata and context windows; a second
 *     import adds 0; an interrupted import (facts removed) resumes.
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

#include "core/status.h"
#include "test_bert.h"
#include "test_fakes.h"
#include "test_util.h"
#include "kv/fact_record.h"
#include "memory/memory.h"
#ifdef IS_HAVE_CUDA
#include "backend_cuda.h"
#endif

#define LOCOMO_26    IS_SOURCE_DIR "/../shared/data/locomo/26.json"
#define EMBEDDER_DIR IS_SOURCE_DIR "/models/all-MiniLM-L6-v2"

static char g_dir[256];

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_memory_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

/* ---- fakes --------------------------------------------------------------------- */

#define FAKE_DIM TEST_FAKE_DIM

typedef struct fake_encoder {
    int32_t calls;
    int32_t fail_at; /* call number that fails (1-based), 0: never */
} fake_encoder;

/* A valid record: tokens = {n_context used, window}, text hash of the text. */
static is_status fake_encode(void *ud, record_store *rs, const memory_encode_job *job) {
    fake_encoder *fe = ud;
    fe->calls++;
    if (fe->fail_at && fe->calls == fe->fail_at)
        return is_error_set(IS_ERR_INTERNAL, "fake encoder: injected failure");
    int32_t used =
        job->window < 0 ? 0 : (job->window < job->n_context ? job->window : job->n_context);
    return test_fake_record_put(rs, job, used);
}

static memory *open_fake(fake_encoder *fe, memory_open_report *rep) {
    memory_params p = memory_default_params();
    p.embed = test_fake_embed;
    p.embed_dim = FAKE_DIM;
    p.embed_name = "fake-bow";
    p.kv_window = 2;
    memory *m = NULL;
    is_status st = memory_open(g_dir, &p, &m, rep);
    if (st != IS_OK) fail_msg("memory_open: %s", is_error_last());
    if (fe) memory_set_encoder(m, fake_encode, fe);
    return m;
}

static void check_ok(memory *m, bool require_kv) {
    is_status st = memory_check(m, require_kv);
    if (st != IS_OK) fail_msg("memory_check: %s", is_error_last());
}

static char *kv_path(const char *rid) {
    static char p[512];
    snprintf(p, sizeof p, "%s/kv/%s.fkv", g_dir, rid);
    return p;
}

static int32_t count_kv_files(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "ls '%s/kv' | grep -c '\\.fkv$'", g_dir);
    FILE *f = popen(cmd, "r");
    int n = 0;
    if (fscanf(f, "%d", &n) != 1) n = -1;
    pclose(f);
    return n;
}

static is_status add(memory *m, const char *tenant, const char *user, const char *text,
                     const char *meta, char id[MEMORY_ID_SIZE]) {
    memory_add_req r = {.tenant = tenant,
                        .user = user,
                        .text = text,
                        .metadata_json = meta,
                        .window = MEMORY_WINDOW_DEFAULT};
    return memory_add(m, &r, id);
}

/* Ids of a search, best first. */
static int32_t search_ids(memory *m, const mem_filter *f, const char *q, int32_t k,
                          char ids[][MEMORY_ID_SIZE]) {
    memory_hit *h;
    int32_t n;
    assert_int_equal(memory_search(m, f, q, k, &h, &n), IS_OK);
    for (int32_t i = 0; i < n; i++) {
        snprintf(ids[i], MEMORY_ID_SIZE, "%s", h[i].fact.id);
        assert_non_null(h[i].fact.text);
        assert_string_equal(h[i].fact.tenant, f->tenant);
        assert_string_equal(h[i].fact.user, f->user);
    }
    memory_hits_free(h, n);
    return n;
}

/* ---- tests ----------------------------------------------------------------------- */

static void test_crud_history_search(void **state) {
    fake_encoder fe = {0};
    memory *m = open_fake(&fe, NULL);
    char a[MEMORY_ID_SIZE], b[MEMORY_ID_SIZE], c[MEMORY_ID_SIZE];
    const char *ctx[] = {"Bob: where do you eat?", "Alice: at the sushi bar", "Bob: nice"};
    memory_add_req r = {.tenant = "acme",
                        .user = "alice",
                        .agent_id = "planner",
                        .text = "Alice eats sushi every Friday.",
                        .metadata_json = "{\"topic\": \"food\"}",
                        .source = "chat:1",
                        .context = ctx,
                        .n_context = 3,
                        .window = MEMORY_WINDOW_DEFAULT};
    assert_int_equal(memory_add(m, &r, a), IS_OK);
    assert_int_equal(strlen(a), 36);
    assert_int_equal(a[14], '4'); /* uuid version 4 */
    assert_int_equal(add(m, "acme", "alice", "Alice works as a nurse in Boston.", NULL, b), IS_OK);
    assert_int_equal(
        add(m, "acme", "alice", "Alice has a dog named Rex.", "{\"topic\":\"pets\"}", c), IS_OK);
    assert_int_equal(fe.calls, 3);
    check_ok(m, true);

    mem_fact f;
    assert_int_equal(memory_get(m, "acme", "alice", a, &f), IS_OK);
    assert_string_equal(f.text, "Alice eats sushi every Friday.");
    assert_string_equal(f.agent_id, "planner");
    assert_string_equal(f.metadata, "{\"topic\":\"food\"}");
    assert_string_equal(f.source, "chat:1");
    assert_int_equal(f.kv_window, 2);
    assert_int_equal(f.n_context, 2); /* the last 2 turns: window 2 */
    assert_string_equal(f.context[0], ctx[1]);
    assert_string_equal(f.context[1], ctx[2]);
    char rid_a1[80];
    snprintf(rid_a1, sizeof rid_a1, "%s", f.kv_record);
    assert_true(test_file_exists(kv_path(rid_a1)));
    mem_fact_clear(&f);
    /* The record was encoded with those 2 turns. */
    const fact_kv *kv;
    assert_int_equal(record_store_get(memory_record_store(m), rid_a1, NULL, &kv), IS_OK);
    assert_int_equal(kv->tokens[0], 2);
    record_store_release(memory_record_store(m), kv);

    mem_filter fa = {.tenant = "acme", .user = "alice"};
    char ids[8][MEMORY_ID_SIZE];
    assert_int_equal(search_ids(m, &fa, "Where does Alice eat sushi?", 3, ids), 3);
    assert_string_equal(ids[0], a);
    assert_int_equal(search_ids(m, &fa, "nurse in Boston", 1, ids), 1);
    assert_string_equal(ids[0], b);

    /* Update the text: new embedding, new record, old record gone. */
    assert_int_equal(memory_update(m, "acme", "alice", a, "Alice now eats ramen on Fridays.", NULL),
                     IS_OK);
    assert_int_equal(fe.calls, 4);
    assert_false(test_file_exists(kv_path(rid_a1)));
    assert_int_equal(memory_get(m, "acme", "alice", a, &f), IS_OK);
    assert_string_equal(f.text, "Alice now eats ramen on Fridays.");
    assert_string_equal(f.metadata, "{\"topic\":\"food\"}"); /* kept */
    assert_int_equal(f.version, 2);
    assert_string_not_equal(f.kv_record, rid_a1);
    assert_true(test_file_exists(kv_path(f.kv_record)));
    assert_int_equal(f.n_context, 2); /* context kept for re-encoding */
    mem_fact_clear(&f);
    check_ok(m, true);
    assert_int_equal(search_ids(m, &fa, "ramen", 1, ids), 1);
    assert_string_equal(ids[0], a);

    /* Metadata-only update: no re-encoding, same record. */
    assert_int_equal(memory_update(m, "acme", "alice", a, NULL, "{\"topic\":\"food\",\"v\":2}"),
                     IS_OK);
    assert_int_equal(fe.calls, 4);
    const char *mk[] = {"v"}, *mv[] = {"2"};
    mem_filter fv = {
        .tenant = "acme", .user = "alice", .meta_keys = mk, .meta_values = mv, .n_meta = 1};
    assert_int_equal(search_ids(m, &fv, "Alice", 5, ids), 1);
    assert_string_equal(ids[0], a);
    /* Same text again: nothing to re-encode either. */
    assert_int_equal(memory_update(m, "acme", "alice", a, "Alice now eats ramen on Fridays.", NULL),
                     IS_OK);
    assert_int_equal(fe.calls, 4);
    check_ok(m, true);

    /* Delete: row, record and index entry go; history keeps the text. */
    assert_int_equal(memory_get(m, "acme", "alice", b, &f), IS_OK);
    char rid_b[80];
    snprintf(rid_b, sizeof rid_b, "%s", f.kv_record);
    mem_fact_clear(&f);
    assert_int_equal(memory_delete(m, "acme", "alice", b), IS_OK);
    assert_false(test_file_exists(kv_path(rid_b)));
    assert_int_equal(memory_get(m, "acme", "alice", b, &f), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_delete(m, "acme", "alice", b), IS_ERR_NOT_FOUND);
    int32_t n = search_ids(m, &fa, "nurse in Boston", 5, ids);
    for (int32_t i = 0; i < n; i++) assert_string_not_equal(ids[i], b);
    check_ok(m, true);

    mem_history *h;
    int32_t nh;
    assert_int_equal(memory_history(m, "acme", "alice", a, &h, &nh), IS_OK);
    assert_int_equal(nh, 4);
    assert_int_equal(h[0].event, MEM_EVENT_ADD);
    assert_int_equal(h[1].event, MEM_EVENT_UPDATE);
    assert_string_equal(h[1].old_text, "Alice eats sushi every Friday.");
    assert_string_equal(h[1].new_text, "Alice now eats ramen on Fridays.");
    mem_history_free(h, nh);
    assert_int_equal(memory_history(m, "acme", "alice", b, &h, &nh), IS_OK);
    assert_int_equal(nh, 2);
    assert_int_equal(h[1].event, MEM_EVENT_DELETE);
    assert_string_equal(h[1].old_text, "Alice works as a nurse in Boston.");
    mem_history_free(h, nh);

    /* get_all with filters; delete_all by filter. */
    mem_fact *all;
    int32_t na;
    mem_filter fp = {.tenant = "acme", .user = "alice", .agent_id = "planner"};
    assert_int_equal(memory_get_all(m, &fp, &all, &na), IS_OK);
    assert_int_equal(na, 1);
    assert_string_equal(all[0].id, a);
    mem_facts_free(all, na);
    int32_t nd = -1;
    assert_int_equal(memory_delete_all(m, &fp, &nd), IS_OK);
    assert_int_equal(nd, 1);
    assert_int_equal(memory_get_all(m, &fa, &all, &na), IS_OK);
    assert_int_equal(na, 1);
    assert_string_equal(all[0].id, c);
    mem_facts_free(all, na);
    assert_int_equal(count_kv_files(), 1);
    check_ok(m, true);

    /* Everything survives a reopen (index rebuilt from the rows). */
    memory_close(m);
    memory_open_report rep;
    m = open_fake(&fe, &rep);
    assert_int_equal(rep.n_facts, 1);
    assert_int_equal(rep.n_orphans, 0);
    assert_int_equal(rep.n_missing_kv, 0);
    assert_int_equal(search_ids(m, &fa, "dog named Rex", 5, ids), 1);
    assert_string_equal(ids[0], c);
    check_ok(m, true);
    memory_close(m);
}

static void test_isolation(void **state) {
    fake_encoder fe = {0};
    memory *m = open_fake(&fe, NULL);
    char ia[MEMORY_ID_SIZE], ib[MEMORY_ID_SIZE], ic[MEMORY_ID_SIZE];
    const char *text = "Alice's door code is 4321.";
    assert_int_equal(add(m, "tenant-a", "alice", text, "{\"k\":\"v\"}", ia), IS_OK);
    assert_int_equal(add(m, "tenant-b", "alice", text, "{\"k\":\"v\"}", ib), IS_OK);
    assert_int_equal(add(m, "tenant-a", "bob", text, "{\"k\":\"v\"}", ic), IS_OK);

    /* Search: each partition returns its own fact only, whatever the query and filters. */
    const char *mk[] = {"k"}, *mv[] = {"v"};
    const char *tenants[] = {"tenant-a", "tenant-b", "tenant-a"};
    const char *users[] = {"alice", "alice", "bob"};
    const char *owns[] = {ia, ib, ic};
    for (int t = 0; t < 3; t++) {
        mem_filter f = {.tenant = tenants[t],
                        .user = users[t],
                        .meta_keys = mk,
                        .meta_values = mv,
                        .n_meta = 1};
        char ids[8][MEMORY_ID_SIZE];
        assert_int_equal(search_ids(m, &f, text, 10, ids), 1);
        assert_string_equal(ids[0], owns[t]);
        mem_fact *all;
        int32_t na;
        assert_int_equal(memory_get_all(m, &f, &all, &na), IS_OK);
        assert_int_equal(na, 1);
        assert_string_equal(all[0].id, owns[t]);
        mem_facts_free(all, na);
    }
    mem_filter none = {.tenant = "tenant-c", .user = "alice"};
    char ids[8][MEMORY_ID_SIZE];
    assert_int_equal(search_ids(m, &none, text, 10, ids), 0);

    /* Under tenant A, B's fact does not exist. */
    mem_fact f;
    assert_int_equal(memory_get(m, "tenant-a", "alice", ib, &f), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_get(m, "tenant-b", "bob", ic, &f), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_update(m, "tenant-a", "alice", ib, "hijacked", NULL), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_delete(m, "tenant-a", "alice", ib), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_delete(m, "tenant-a", "bob", ia), IS_ERR_NOT_FOUND);
    mem_history *h;
    int32_t nh;
    assert_int_equal(memory_history(m, "tenant-a", "alice", ib, &h, &nh), IS_ERR_NOT_FOUND);
    mem_filter fa = {.tenant = "tenant-a", .user = "alice"};
    int32_t nd;
    assert_int_equal(memory_delete_all(m, &fa, &nd), IS_OK);
    assert_int_equal(nd, 1);
    /* B's and bob's facts are intact, with their records. */
    assert_int_equal(memory_get(m, "tenant-b", "alice", ib, &f), IS_OK);
    assert_string_equal(f.text, text);
    assert_int_equal(f.version, 1);
    assert_true(test_file_exists(kv_path(f.kv_record)));
    mem_fact_clear(&f);
    assert_int_equal(memory_get(m, "tenant-a", "bob", ic, &f), IS_OK);
    mem_fact_clear(&f);
    check_ok(m, true);
    memory_close(m);
}

static void test_search_filters(void **state) {
    memory *m = open_fake(NULL, NULL);
    struct {
        const char *agent, *run, *meta, *text;
    } rows[] = {
        {"a1", "r1", "{\"topic\":\"food\",\"n\":1}", "likes apples"},
        {"a1", "r2", "{\"topic\":\"food\",\"n\":2}", "likes apples and pears"},
        {"a2", "r1", "{\"topic\":\"work\"}", "likes apples at work"},
        {NULL, NULL, NULL, "likes apples a lot"},
    };
    char ids[4][MEMORY_ID_SIZE];
    for (int i = 0; i < 4; i++) {
        memory_add_req r = {.tenant = "t",
                            .user = "u",
                            .agent_id = rows[i].agent,
                            .run_id = rows[i].run,
                            .text = rows[i].text,
                            .metadata_json = rows[i].meta,
                            .window = MEMORY_WINDOW_DEFAULT};
        assert_int_equal(memory_add(m, &r, ids[i]), IS_OK);
    }
    char got[8][MEMORY_ID_SIZE];
    mem_filter f1 = {.tenant = "t", .user = "u", .agent_id = "a1"};
    assert_int_equal(search_ids(m, &f1, "apples", 10, got), 2);
    mem_filter f2 = {.tenant = "t", .user = "u", .run_id = "r1"};
    assert_int_equal(search_ids(m, &f2, "apples", 10, got), 2);
    mem_filter f3 = {.tenant = "t", .user = "u", .agent_id = "a1", .run_id = "r1"};
    assert_int_equal(search_ids(m, &f3, "apples", 10, got), 1);
    assert_string_equal(got[0], ids[0]);
    const char *mk[] = {"n"}, *mv[] = {"2"};
    mem_filter f4 = {.tenant = "t", .user = "u", .meta_keys = mk, .meta_values = mv, .n_meta = 1};
    assert_int_equal(search_ids(m, &f4, "apples", 10, got), 1);
    assert_string_equal(got[0], ids[1]);
    mem_filter f5 = {.tenant = "t", .user = "u"};
    assert_int_equal(search_ids(m, &f5, "apples", 10, got), 4);
    assert_int_equal(search_ids(m, &f5, "apples", 2, got), 2);
    assert_int_equal(search_ids(m, &f5, "apples", 0, got), 0);
    memory_hit *h;
    int32_t n;
    assert_int_equal(memory_search(m, &f5, "", 3, &h, &n), IS_ERR_INVALID_ARG);
    mem_filter nouser = {.tenant = "t"};
    assert_int_equal(memory_search(m, &nouser, "apples", 3, &h, &n), IS_ERR_INVALID_ARG);
    /* No encoder: facts have no KV, and that is consistent. */
    check_ok(m, false);
    assert_int_equal(count_kv_files(), 0);
    memory_close(m);
}

static bool fail_rename(record_store_step s, void *ud) { return s != RECORD_STORE_STEP_RENAME; }
static bool fail_commit(void *ud) { return false; }

static void expect_empty(memory *m) {
    mem_fact *all;
    int32_t na;
    mem_filter f = {.tenant = "t", .user = "u"};
    assert_int_equal(memory_get_all(m, &f, &all, &na), IS_OK);
    assert_int_equal(na, 0);
    free(all);
    assert_int_equal(count_kv_files(), 0);
    char ids[2][MEMORY_ID_SIZE];
    assert_int_equal(search_ids(m, &f, "anything at all", 5, ids), 0);
    check_ok(m, true);
}

static void test_failures_leave_nothing(void **state) {
    fake_encoder fe = {.fail_at = 1};
    memory *m = open_fake(&fe, NULL);
    char id[MEMORY_ID_SIZE];
    /* Encoder fails. */
    assert_int_equal(add(m, "t", "u", "anything at all", NULL, id), IS_ERR_INTERNAL);
    expect_empty(m);
    /* The record store's rename fails. */
    record_store_set_fault_hook(memory_record_store(m), fail_rename, NULL);
    assert_int_equal(add(m, "t", "u", "anything at all", NULL, id), IS_ERR_IO);
    record_store_set_fault_hook(memory_record_store(m), NULL, NULL);
    expect_empty(m);
    /* The commit fails after the record was written: the record goes. */
    mem_store_set_fault_hook(memory_fact_store(m), fail_commit, NULL);
    assert_int_equal(add(m, "t", "u", "anything at all", NULL, id), IS_ERR_IO);
    mem_store_set_fault_hook(memory_fact_store(m), NULL, NULL);
    expect_empty(m);
    /* Bad input: refused before the encoder is called. */
    int32_t calls = fe.calls;
    assert_int_equal(add(m, "t", "u", "bad \xff\xfe utf-8", NULL, id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "t", "u", "overlong \xc0\xaf", NULL, id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "t", "u", "", NULL, id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "t", "", "text", NULL, id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "", "u", "text", NULL, id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "t", "u", "text", "{\"a\":{\"b\":1}}", id), IS_ERR_INVALID_ARG);
    assert_int_equal(add(m, "t", "u", "text", "[]", id), IS_ERR_INVALID_ARG);
    assert_int_equal(fe.calls, calls);
    expect_empty(m);

    /* An update whose encoding fails leaves the old version whole. */
    assert_int_equal(add(m, "t", "u", "version one", NULL, id), IS_OK);
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", id, &f), IS_OK);
    char rid[80];
    snprintf(rid, sizeof rid, "%s", f.kv_record);
    mem_fact_clear(&f);
    fe.fail_at = fe.calls + 1;
    assert_int_equal(memory_update(m, "t", "u", id, "version two", NULL), IS_ERR_INTERNAL);
    mem_store_set_fault_hook(memory_fact_store(m), fail_commit, NULL);
    assert_int_equal(memory_update(m, "t", "u", id, "version two", NULL), IS_ERR_IO);
    mem_store_set_fault_hook(memory_fact_store(m), NULL, NULL);
    assert_int_equal(memory_update(m, "t", "u", id, "bad \xff", NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(memory_update(m, "t", "u", id, NULL, "{\"x\":[1]}"), IS_ERR_INVALID_ARG);
    assert_int_equal(memory_get(m, "t", "u", id, &f), IS_OK);
    assert_string_equal(f.text, "version one");
    assert_string_equal(f.kv_record, rid);
    assert_int_equal(f.version, 1);
    mem_fact_clear(&f);
    assert_int_equal(count_kv_files(), 1);
    check_ok(m, true);
    /* A delete whose commit fails keeps everything. */
    mem_store_set_fault_hook(memory_fact_store(m), fail_commit, NULL);
    assert_int_equal(memory_delete(m, "t", "u", id), IS_ERR_IO);
    mem_store_set_fault_hook(memory_fact_store(m), NULL, NULL);
    assert_true(test_file_exists(kv_path(rid)));
    check_ok(m, true);
    memory_close(m);
}

/* A row naming a record made for another model (the store now serves
 * another) has no KV to use, but the record is not an orphan. */
static void test_check_other_model(void **state) {
    (void)state;
    fake_encoder fe = {0};
    memory *m = open_fake(&fe, NULL);
    char id[MEMORY_ID_SIZE];
    assert_int_equal(add(m, "t", "u", "a fact with a record", NULL, id), IS_OK);
    check_ok(m, true);
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", id, &f), IS_OK);
    record_store *rs = memory_record_store(m);
    const fact_kv *kv = NULL;
    assert_int_equal(record_store_get(rs, f.kv_record, NULL, &kv), IS_OK);
    fact_kv_meta other = kv->meta;
    record_store_release(rs, kv);
    mem_fact_clear(&f);
    other.dtype = other.dtype == KV_DTYPE_F32 ? KV_DTYPE_F16 : KV_DTYPE_F32;
    record_store_set_model(rs, &other);
    check_ok(m, false);
    assert_int_equal(memory_check(m, true), IS_ERR_INTERNAL);
    assert_non_null(strstr(is_error_last(), "has no KV record"));
    record_store_set_model(rs, NULL);
    check_ok(m, true);
    memory_close(m);
}

static void test_reconcile(void **state) {
    fake_encoder fe = {0};
    memory *m = open_fake(&fe, NULL);
    char ids[5][MEMORY_ID_SIZE];
    for (int i = 0; i < 5; i++) {
        char text[64];
        snprintf(text, sizeof text, "fact number %d about things", i);
        assert_int_equal(add(m, "t", "u", text, NULL, ids[i]), IS_OK);
    }
    /* Orphans, as a crash leaves them: records with no row. */
    memory_encode_job orphan1 = {"0f0f0f0f-dead-4bad-8bad-000000000001-v1", "lost fact", NULL, 0,
                                 0};
    memory_encode_job orphan2 = {"00000000-0000-4000-8000-000000000002-v3", "lost update", NULL, 0,
                                 0};
    assert_int_equal(fake_encode(&fe, memory_record_store(m), &orphan1), IS_OK);
    assert_int_equal(fake_encode(&fe, memory_record_store(m), &orphan2), IS_OK);
    /* And a missing record: fact 2's file removed behind our back. */
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", ids[2], &f), IS_OK);
    char rid2[80];
    snprintf(rid2, sizeof rid2, "%s", f.kv_record);
    mem_fact_clear(&f);
    assert_int_equal(memory_check(m, true), IS_ERR_INTERNAL); /* the checker sees the orphans */
    memory_close(m);
    assert_int_equal(unlink(kv_path(rid2)), 0);
    assert_int_equal(count_kv_files(), 6);

    memory_open_report rep;
    m = open_fake(NULL, &rep);
    assert_int_equal(rep.n_facts, 5);
    assert_int_equal(rep.n_orphans, 2);
    assert_int_equal(rep.n_missing_kv, 1);
    assert_int_equal(count_kv_files(), 4);
    check_ok(m, false);
    assert_int_equal(memory_check(m, true), IS_ERR_INTERNAL); /* fact 2 lacks its record */
    /* Without an encoder, missing KV cannot be re-encoded. */
    assert_int_equal(memory_encode_missing(m, NULL, NULL, NULL), IS_ERR_INVALID_ARG);
    memory_set_encoder(m, fake_encode, &fe);
    int64_t n_enc = -1;
    assert_int_equal(memory_encode_missing(m, NULL, NULL, &n_enc), IS_OK);
    assert_int_equal(n_enc, 1);
    assert_true(test_file_exists(kv_path(rid2)));
    check_ok(m, true);

    /* No encoder: an update drops the record that described the old text. */
    memory_set_encoder(m, NULL, NULL);
    assert_int_equal(memory_update(m, "t", "u", ids[0], "fact zero, rewritten", NULL), IS_OK);
    assert_int_equal(memory_get(m, "t", "u", ids[0], &f), IS_OK);
    assert_null(f.kv_record);
    mem_fact_clear(&f);
    char id_new[MEMORY_ID_SIZE];
    assert_int_equal(add(m, "t", "u", "added without a model", NULL, id_new), IS_OK);
    assert_int_equal(count_kv_files(), 4);
    check_ok(m, false);
    memory_close(m);
    m = open_fake(NULL, &rep);
    assert_int_equal(rep.n_missing_kv, 2);
    assert_int_equal(rep.n_orphans, 0);
    memory_set_encoder(m, fake_encode, &fe);
    assert_int_equal(memory_encode_missing(m, NULL, NULL, &n_enc), IS_OK);
    assert_int_equal(n_enc, 2);
    check_ok(m, true);
    memory_close(m);
    m = open_fake(NULL, &rep);
    assert_int_equal(rep.n_missing_kv, 0);
    assert_int_equal(rep.n_facts, 6);
    memory_close(m);
}

/* An encoder that takes its time, so another thread's write lands while
 * it runs (the write must wait for its commit). */
typedef struct slow_encoder {
    fake_encoder fe;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started;
} slow_encoder;

static is_status slow_encode(void *ud, record_store *rs, const memory_encode_job *job) {
    slow_encoder *se = ud;
    pthread_mutex_lock(&se->mu);
    se->started = true;
    pthread_cond_broadcast(&se->cv);
    pthread_mutex_unlock(&se->mu);
    usleep(100 * 1000);
    return fake_encode(&se->fe, rs, job);
}

typedef struct encode_one_arg {
    memory *m;
    const char *id;
    slow_encoder *se;
    is_status st;
    bool did;
} encode_one_arg;

static void *encode_one_thread(void *ud) {
    encode_one_arg *a = ud;
    a->st = memory_encode_one(a->m, "t", "u", a->id, slow_encode, a->se, &a->did);
    return NULL;
}

static void test_encode_one(void **state) {
    memory *m = open_fake(NULL, NULL); /* facts stored without KV, as the HTTP add does */
    fake_encoder fe = {0};
    char a[MEMORY_ID_SIZE], b[MEMORY_ID_SIZE], c[MEMORY_ID_SIZE], d[MEMORY_ID_SIZE];
    assert_int_equal(add(m, "t", "u", "alice likes green tea", NULL, a), IS_OK);
    assert_int_equal(add(m, "t", "u", "bob keeps two cats", NULL, b), IS_OK);
    assert_int_equal(add(m, "t", "u", "carol moved to Lyon", NULL, c), IS_OK);
    assert_int_equal(add(m, "t", "u", "dave runs on Sundays", NULL, d), IS_OK);
    memory_fact_ref *refs;
    int64_t n;
    assert_int_equal(memory_list_missing(m, &refs, &n), IS_OK);
    assert_int_equal(n, 4);
    memory_fact_refs_free(refs, n);
    assert_int_equal(count_kv_files(), 0);

    /* No encoder given and none set. */
    bool did = true;
    assert_int_equal(memory_encode_one(m, "t", "u", a, NULL, NULL, &did), IS_ERR_INVALID_ARG);
    assert_false(did);

    /* Encoded once: record written, row points to it, checker agrees. */
    assert_int_equal(memory_encode_one(m, "t", "u", a, fake_encode, &fe, &did), IS_OK);
    assert_true(did);
    assert_int_equal(fe.calls, 1);
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", a, &f), IS_OK);
    assert_non_null(f.kv_record);
    assert_true(test_file_exists(kv_path(f.kv_record)));
    mem_fact_clear(&f);
    assert_int_equal(memory_encode_one(m, "t", "u", a, fake_encode, &fe, &did), IS_OK);
    assert_false(did);
    assert_int_equal(fe.calls, 1);

    /* Another tenant or user: not found, nothing encoded. */
    assert_int_equal(memory_encode_one(m, "other", "u", b, fake_encode, &fe, &did),
                     IS_ERR_NOT_FOUND);
    assert_int_equal(memory_encode_one(m, "t", "someone", b, fake_encode, &fe, &did),
                     IS_ERR_NOT_FOUND);
    assert_int_equal(fe.calls, 1);

    /* Updated before the job runs: encoded in its current text (the
     * checker compares the record's text hash with the row's). */
    assert_int_equal(memory_update(m, "t", "u", b, "bob keeps three cats", NULL), IS_OK);
    assert_int_equal(memory_encode_one(m, "t", "u", b, fake_encode, &fe, &did), IS_OK);
    assert_true(did);
    assert_int_equal(memory_get(m, "t", "u", b, &f), IS_OK);
    assert_int_equal(f.version, 2);
    assert_non_null(strstr(f.kv_record, "-v2"));
    mem_fact_clear(&f);

    /* Deleted before the job runs: not found, no record. */
    int32_t files = count_kv_files();
    assert_int_equal(memory_delete(m, "t", "u", c), IS_OK);
    assert_int_equal(memory_encode_one(m, "t", "u", c, fake_encode, &fe, &did), IS_ERR_NOT_FOUND);
    assert_int_equal(count_kv_files(), files);

    /* An encoder failure leaves no record and the fact still missing. */
    fe.fail_at = fe.calls + 1;
    assert_int_equal(memory_encode_one(m, "t", "u", d, fake_encode, &fe, &did), IS_ERR_INTERNAL);
    assert_false(did);
    assert_int_equal(count_kv_files(), files);
    assert_int_equal(memory_list_missing(m, &refs, &n), IS_OK);
    assert_int_equal(n, 1);
    assert_string_equal(refs[0].id, d);
    memory_fact_refs_free(refs, n);
    check_ok(m, false);

    /* Updated while the encoder runs: the update waits for the encoding's
     * commit, then replaces the text and drops the record that described
     * the old one; no stale record survives. */
    slow_encoder se = {.fe = {0}, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    encode_one_arg arg = {.m = m, .id = d, .se = &se};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, encode_one_thread, &arg), 0);
    pthread_mutex_lock(&se.mu);
    while (!se.started) pthread_cond_wait(&se.cv, &se.mu);
    pthread_mutex_unlock(&se.mu);
    assert_int_equal(memory_update(m, "t", "u", d, "dave runs on Saturdays", NULL), IS_OK);
    pthread_join(th, NULL);
    assert_int_equal(arg.st, IS_OK);
    assert_true(arg.did);
    assert_int_equal(memory_get(m, "t", "u", d, &f), IS_OK);
    assert_string_equal(f.text, "dave runs on Saturdays");
    assert_null(f.kv_record);
    mem_fact_clear(&f);
    assert_int_equal(count_kv_files(), files);
    check_ok(m, false);
    assert_int_equal(memory_encode_one(m, "t", "u", d, fake_encode, &fe, &did), IS_OK);
    assert_true(did);
    check_ok(m, true);
    assert_int_equal(memory_list_missing(m, &refs, &n), IS_OK);
    assert_int_equal(n, 0);
    memory_fact_refs_free(refs, n);
    memory_close(m);
}

static void test_open_refusals(void **state) {
    memory *m = open_fake(NULL, NULL);
    char id[MEMORY_ID_SIZE];
    assert_int_equal(add(m, "t", "u", "a fact", NULL, id), IS_OK);
    /* A second open of the same directory: the record store's lock. */
    memory_params p = memory_default_params();
    p.embed = test_fake_embed;
    p.embed_dim = FAKE_DIM;
    p.embed_name = "fake-bow";
    memory *m2 = NULL;
    assert_int_equal(memory_open(g_dir, &p, &m2, NULL), IS_ERR_IO);
    assert_null(m2);
    memory_close(m);
    /* Another embedding model (name or dimension) would make the stored vectors meaningless. */
    p.embed_name = "another-model";
    assert_int_equal(memory_open(g_dir, &p, &m2, NULL), IS_ERR_MISMATCH);
    p.embed_name = "fake-bow";
    p.embed_dim = 32;
    assert_int_equal(memory_open(g_dir, &p, &m2, NULL), IS_ERR_MISMATCH);
    memory_params none = memory_default_params();
    assert_int_equal(memory_open(g_dir, &none, &m2, NULL), IS_ERR_MISMATCH);
    assert_null(m2);
    /* The failed opens released the lock: the right one works. */
    m = open_fake(NULL, NULL);
    memory_close(m);
    assert_int_equal(memory_open(NULL, &p, &m2, NULL), IS_ERR_INVALID_ARG);
}

/* GPU retrieval where it cannot run: memory_open says so, it does not fall
 * back to the CPU. Where a GPU is present the open works instead. */
static void test_gpu_retrieval_refused(void **state) {
#ifdef IS_HAVE_CUDA
    const bool gpu = backend_cuda_available();
#else
    const bool gpu = false;
#endif
    uint64_t rng = 1;
    assert_int_equal(test_bert_write(g_dir, &test_bert_a, &rng), 0);
    char edir[512], data[512], db[600];
    snprintf(edir, sizeof edir, "%s/%s", g_dir, test_bert_a.name);
    snprintf(data, sizeof data, "%s/data", g_dir);
    snprintf(db, sizeof db, "%s/memory.db", data);
    assert_int_equal(mkdir(data, 0755), 0);
    embedder *e = NULL;
    assert_int_equal(embedder_load(edir, &e), IS_OK);
    memory_params p = memory_default_params();
    p.embedder = e;
    p.gpu_retrieval = true;
    memory *m = NULL;
    is_status st = memory_open(data, &p, &m, NULL);
    if (gpu) {
        assert_int_equal(st, IS_OK);
        dense_gpu_stats gs;
        assert_true(memory_gpu_stats(m, &gs));
        memory_close(m);
        m = NULL;
    } else {
        assert_int_equal(st, IS_ERR_UNSUPPORTED);
        assert_null(m);
        assert_non_null(strstr(is_error_last(), "GPU retrieval"));
        assert_false(test_file_exists(db)); /* refused before anything was opened */
    }
    /* A device that does not exist, whatever the machine. */
    p.gpu_device = 1000;
    assert_int_equal(memory_open(data, &p, &m, NULL), IS_ERR_UNSUPPORTED);
    assert_null(m);
    /* An embed function cannot be copied to a GPU. */
    memory_params q = memory_default_params();
    q.embed = test_fake_embed;
    q.embed_dim = FAKE_DIM;
    q.gpu_retrieval = true;
    assert_int_equal(memory_open(data, &q, &m, NULL), IS_ERR_INVALID_ARG);
    assert_null(m);
    /* Asked for nothing, the same directory opens on the CPU. */
    p.gpu_retrieval = false;
    assert_int_equal(memory_open(data, &p, &m, NULL), IS_OK);
    dense_gpu_stats gs;
    assert_false(memory_gpu_stats(m, &gs));
    memory_close(m);
    embedder_free(e);
}

/* ---- LoCoMo importer ---------------------------------------------------------------- */

static void test_locomo_import(void **state) {
    locomo_conv *c = NULL;
    if (locomo_load(LOCOMO_26, &c) != IS_OK) TEST_SKIP(TEST_NEEDS_LOCOMO);
    fake_encoder fe = {0};
    memory *m = open_fake(&fe, NULL);
    memory_locomo_opts o = {.tenant = "demo", .window = 3, .batch = 16};
    memory_import_stats st = {0};
    assert_int_equal(memory_import_locomo(m, c, &o, &st), IS_OK);
    assert_int_equal(st.added, c->n_facts);
    assert_int_equal(st.skipped, 0);
    assert_int_equal(st.failed, 0);
    assert_int_equal(st.first_error[0], '\0');
    assert_int_equal(c->n_facts, 184); /* the data set's README count for this file */
    assert_int_equal(fe.calls, c->n_facts);

    /* Per speaker: as many facts as that speaker's observations. */
    const char *speakers[2] = {c->speaker_a, c->speaker_b};
    int32_t total = 0;
    for (int s = 0; s < 2; s++) {
        int32_t want = 0;
        for (int32_t i = 0; i < c->n_facts; i++)
            want += strcmp(c->facts[i].speaker, speakers[s]) == 0;
        char user[256];
        memory_locomo_user(c, speakers[s], false, user, sizeof user);
        mem_filter f = {.tenant = "demo", .user = user};
        mem_fact *all;
        int32_t na;
        assert_int_equal(memory_get_all(m, &f, &all, &na), IS_OK);
        assert_int_equal(na, want);
        total += na;
        /* Each fact: its source ref, metadata, and the w turns before its evidence turn. */
        for (int32_t i = 0; i < na; i++) {
            const locomo_fact *lf = NULL;
            for (int32_t j = 0; j < c->n_facts && !lf; j++) {
                char src[256];
                snprintf(src, sizeof src, "locomo:%s:%s", c->name, c->facts[j].dia_id);
                if (strcmp(c->facts[j].text, all[i].text) == 0 && strcmp(src, all[i].source) == 0)
                    lf = &c->facts[j];
            }
            assert_non_null(lf);
            assert_string_equal(lf->speaker, speakers[s]);
            const char *turns[8];
            int32_t nt = locomo_fact_context(c, lf, 3, turns);
            assert_int_equal(all[i].n_context, nt);
            for (int32_t t = 0; t < nt; t++) assert_string_equal(all[i].context[t], turns[t]);
            assert_int_equal(all[i].kv_window, 3);
            assert_non_null(strstr(all[i].metadata, "\"dia_id\":\""));
        }
        mem_facts_free(all, na);
    }
    assert_int_equal(total, c->n_facts);
    char user_a[256];
    memory_locomo_user(c, c->speaker_a, false, user_a, sizeof user_a);
    assert_string_equal(user_a, "26-caroline");
    check_ok(m, true);

    /* Again: nothing added. */
    memory_import_stats st2 = {0};
    assert_int_equal(memory_import_locomo(m, c, &o, &st2), IS_OK);
    assert_int_equal(st2.added, 0);
    assert_int_equal(st2.skipped, c->n_facts);
    assert_int_equal(fe.calls, c->n_facts);

    /* An interrupted import: the last 50 facts never made it; a re-run adds exactly them. */
    mem_filter fa = {.tenant = "demo", .user = user_a};
    mem_fact *all;
    int32_t na;
    assert_int_equal(memory_get_all(m, &fa, &all, &na), IS_OK);
    int32_t removed = 0;
    for (int32_t i = na - 1; i >= 0 && removed < 50; i--, removed++)
        assert_int_equal(memory_delete(m, "demo", user_a, all[i].id), IS_OK);
    mem_facts_free(all, na);
    memory_close(m);
    m = open_fake(&fe, NULL);
    memory_import_stats st3 = {0};
    assert_int_equal(memory_import_locomo(m, c, &o, &st3), IS_OK);
    assert_int_equal(st3.added, 50);
    assert_int_equal(st3.skipped, c->n_facts - 50);
    assert_int_equal(mem_store_count(memory_fact_store(m)), c->n_facts);
    check_ok(m, true);

    memory_close(m);
    locomo_free(c);
}

/* ---- real embedder ----------------------------------------------------------------- */

static void test_real_embedder(void **state) {
    if (!test_file_exists(EMBEDDER_DIR "/model.safetensors")) TEST_SKIP(TEST_NEEDS_EMBEDDER);
    embedder *e = NULL;
    assert_int_equal(embedder_load(EMBEDDER_DIR, &e), IS_OK);
    memory_params p = memory_default_params();
    p.embedder = e;
    p.embed_name = "all-MiniLM-L6-v2";
    memory *m = NULL;
    assert_int_equal(memory_open(g_dir, &p, &m, NULL), IS_OK);
    const char *facts[] = {
        "Melanie ran a charity race for mental health last Saturday.",
        "Caroline is researching adoption agencies.",
        "Melanie painted a sunrise over a lake.",
        "Caroline moved from Sweden four years ago.",
    };
    char ids[4][MEMORY_ID_SIZE];
    memory_add_req r[4];
    for (int i = 0; i < 4; i++)
        r[i] = (memory_add_req){
            .tenant = "t", .user = "u", .text = facts[i], .window = MEMORY_WINDOW_DEFAULT};
    is_status sts[4];
    assert_int_equal(memory_add_batch(m, r, 4, ids, sts), IS_OK);
    mem_filter f = {.tenant = "t", .user = "u"};
    memory_hit *h;
    int32_t n;
    /* The query shares no word with the right fact but "Caroline": meaning
     * decides the dense ranking. (The fused order may tie: RRF of ranks
     * (1, 2) equals that of (2, 1), and ties go by the random ids.) */
    const char *queries[2] = {"Where did Caroline live before?",
                              "What kind of art does Melanie make?"};
    const int want[2] = {3, 2};
    for (int q = 0; q < 2; q++) {
        assert_int_equal(memory_search(m, &f, queries[q], 4, &h, &n), IS_OK);
        assert_int_equal(n, 4);
        int best = 0;
        for (int i = 1; i < n; i++)
            if (h[i].dense > h[best].dense) best = i;
        assert_string_equal(h[best].fact.id, ids[want[q]]);
        assert_true(h[best].dense > 0.3f);
        memory_hits_free(h, n);
    }
    /* Stored embeddings are the model's: equal to embedding the text now. */
    mem_fact g;
    assert_int_equal(mem_store_get(memory_fact_store(m), "t", "u", ids[1], true, &g), IS_OK);
    float v[384];
    assert_int_equal(embedder_dim(e), 384);
    assert_int_equal(embedder_embed(e, &facts[1], 1, v), IS_OK);
    double dot = 0;
    for (int j = 0; j < 384; j++) dot += (double)v[j] * g.embedding[j];
    assert_true(dot > 0.9999);
    mem_fact_clear(&g);
    check_ok(m, false);
    memory_close(m);
    embedder_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_crud_history_search, setup, teardown),
        cmocka_unit_test_setup_teardown(test_isolation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_search_filters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failures_leave_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_check_other_model, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reconcile, setup, teardown),
        cmocka_unit_test_setup_teardown(test_encode_one, setup, teardown),
        cmocka_unit_test_setup_teardown(test_open_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gpu_retrieval_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_locomo_import, setup, teardown),
        cmocka_unit_test_setup_teardown(test_real_embedder, setup, teardown),
    };
    return test_run_group(tests, NULL, NULL);
}

/*
 * Recovery that never destroys (memory_open, memory/store.h's repair,
 * memory/fsck.h), on data directories damaged the ways an operator meets:
 *
 *   - memory.db missing, of 0 bytes, or a fresh store without facts or
 *     history, beside KV records: refused with an error naming the file,
 *     every record left where it was;
 *   - a store missing its history (or users) table: opens, says so, the
 *     facts are served and adds work;
 *   - bad rows (a text that does not match its hash, an embedding of the
 *     wrong size, a NULL text): moved to facts_quarantine with the reason,
 *     the rest served; their records set aside in kv/orphans/;
 *   - records no row points to (a crash's leftovers): set aside, not deleted;
 *   - a crash inside the very first batch add of a new store, after some of
 *     its records were written and before any row committed (a forked
 *     writer stopped at the fault hook, at the same step every run): the
 *     store's note that writes began beside those records lets it open,
 *     the records set aside, and it works; without the note the same
 *     directory is refused as a lost store;
 *   - fsck: reports each case without writing; --repair rebuilds a lost
 *     store from the records (exact text, id, version), sets aside the
 *     record whose text cannot be recovered, and refuses to run while the
 *     directory is open.
 *
 * Each case prints `fault-matrix: damaged-files|<case>|<tries>|<outcome>`.
 * The fake encoder's records carry the fact's bytes as token ids, so the
 * fake text_of decodes them without a model.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/status.h"
#include "kv/fact_record.h"
#include "memory/fsck.h"
#include "memory/memory.h"
#include "test_fakes.h"
#include "test_util.h"

#define DIM     16
#define N_FACTS 6

static char g_dir[256];
static char g_db[300];

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_recovery_XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    snprintf(g_db, sizeof g_db, "%s/memory.db", g_dir);
    return 0;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

/* A fresh, empty directory for each case. */
static void reset_dir(void) {
    assert_int_equal(test_remove_tree(g_dir), 0);
    assert_int_equal(mkdir(g_dir, 0755), 0);
}

static void matrix(const char *c, int tries, const char *outcome) {
    printf("fault-matrix: damaged-files|%s|%d|%s\n", c, tries, outcome);
    fflush(stdout);
}

/* ---- fakes ------------------------------------------------------------------------- */

static is_status fake_embed(void *ud, const char *const *texts, int32_t n, float *out) {
    for (int32_t i = 0; i < n; i++) {
        float *e = out + (size_t)i * DIM;
        double s = 0;
        for (int d = 0; d < DIM; d++) {
            e[d] = (float)((unsigned char)texts[i][d % (strlen(texts[i]) + 1)] + d);
            s += (double)e[d] * e[d];
        }
        for (int d = 0; d < DIM; d++) e[d] = (float)(e[d] / sqrt(s));
    }
    return IS_OK;
}

/* A record whose tokens are the bytes of tok_text and whose hash is that
 * of hash_text (the same text for a sound record). */
static is_status put_record(record_store *rs, const char *rid, const char *tok_text,
                            const char *hash_text) {
    fact_kv_meta m;
    test_fake_meta(&m, (int32_t)strlen(tok_text), 0, hash_text);
    int32_t *tok = malloc((size_t)m.n_tokens * sizeof *tok);
    float *k = calloc((size_t)m.n_tokens * 4, sizeof(float));
    for (int32_t i = 0; i < m.n_tokens; i++) tok[i] = (unsigned char)tok_text[i];
    is_status st = record_store_put(rs, rid, &m, tok, k, k);
    free(tok);
    free(k);
    return st;
}

static is_status fake_encode(void *ud, record_store *rs, const memory_encode_job *job) {
    return put_record(rs, job->record_id, job->text, job->text);
}

static is_status fake_text_of(void *ud, const int32_t *tokens, int32_t n, char **text) {
    char *s = malloc((size_t)n + 1);
    if (!s) return IS_ERR_NOMEM;
    for (int32_t i = 0; i < n; i++) s[i] = (char)tokens[i];
    s[n] = '\0';
    *text = s;
    return IS_OK;
}

static memory_params params(void) {
    memory_params p = memory_default_params();
    p.embed = fake_embed;
    p.embed_dim = DIM;
    p.embed_name = "fake";
    return p;
}

static is_status try_open(memory **m, memory_open_report *rep) {
    memory_params p = params();
    return memory_open(g_dir, &p, m, rep);
}

static memory *open_ok(memory_open_report *rep) {
    memory *m = NULL;
    if (try_open(&m, rep) != IS_OK) fail_msg("memory_open: %s", is_error_last());
    memory_set_encoder(m, fake_encode, NULL);
    return m;
}

static const char *fact_text(int i) {
    static char buf[64];
    snprintf(buf, sizeof buf, "fact %d: the user likes item %d", i, i * 7);
    return buf;
}

/* A directory with N_FACTS facts of tenant t / user u, each with its record. */
static void make_store(char ids[N_FACTS][MEMORY_ID_SIZE]) {
    reset_dir();
    memory *m = open_ok(NULL);
    for (int i = 0; i < N_FACTS; i++) {
        memory_add_req r = {
            .tenant = "t", .user = "u", .text = fact_text(i), .window = MEMORY_WINDOW_DEFAULT};
        assert_int_equal(memory_add(m, &r, ids[i]), IS_OK);
    }
    memory_close(m);
}

static int count_files(const char *sub) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "ls '%s/%s' 2>/dev/null | grep -c '\\.fkv$'", g_dir, sub);
    FILE *f = popen(cmd, "r");
    int n = 0;
    if (fscanf(f, "%d", &n) != 1) n = -1;
    pclose(f);
    return n;
}

static void sql(const char *stmt) {
    sqlite3 *db;
    assert_int_equal(sqlite3_open(g_db, &db), SQLITE_OK);
    char *err = NULL;
    if (sqlite3_exec(db, stmt, NULL, NULL, &err) != SQLITE_OK) fail_msg("%s: %s", stmt, err);
    sqlite3_close(db);
}

static void remove_db(void) {
    char p[400];
    const char *suf[] = {"", "-wal", "-shm"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s%s", g_db, suf[i]);
        unlink(p);
    }
}

/* ---- cases ----------------------------------------------------------------------------- */

/* The store gone three ways: each refused naming the file, no record touched. */
static void test_lost_store_refused(void **state) {
    char ids[N_FACTS][MEMORY_ID_SIZE];
    const char *cases[] = {"memory.db missing beside KV records",
                           "memory.db of 0 bytes beside KV records",
                           "a fresh store (no facts, no history) beside KV records"};
    for (int c = 0; c < 3; c++) {
        make_store(ids);
        remove_db();
        if (c == 1) {
            FILE *f = fopen(g_db, "w");
            fclose(f);
        } else if (c == 2) {
            /* A store created empty by hand: the records are still there. */
            char kv[400], tmp[420];
            snprintf(kv, sizeof kv, "%s/kv", g_dir);
            snprintf(tmp, sizeof tmp, "%s.away", kv);
            assert_int_equal(rename(kv, tmp), 0);
            memory *m = open_ok(NULL);
            memory_close(m);
            assert_int_equal(test_remove_tree(kv), 0);
            assert_int_equal(rename(tmp, kv), 0);
        }
        memory *m = NULL;
        is_status st = try_open(&m, NULL);
        bool ok =
            st == IS_ERR_IO && strstr(is_error_last(), "memory.db") && count_files("kv") == N_FACTS;
        if (!ok) fprintf(stderr, "case %d: status %d: %s\n", c, st, is_error_last());
        matrix(cases[c], 1, ok ? "refused, naming the file; every KV record kept" : "FAIL");
        assert_true(ok);
        assert_null(m);
    }
}

static void test_missing_tables(void **state) {
    char ids[N_FACTS][MEMORY_ID_SIZE];
    const char *tables[] = {"history", "users"};
    for (int c = 0; c < 2; c++) {
        make_store(ids);
        char stmt[128];
        snprintf(stmt, sizeof stmt, "PRAGMA foreign_keys=OFF; DROP TABLE %s;", tables[c]);
        sql(stmt);
        memory_open_report rep;
        memory *m = open_ok(&rep);
        assert_int_equal(rep.n_facts, N_FACTS);
        assert_non_null(strstr(rep.repairs, tables[c]));
        memory_add_req r = {.tenant = "t",
                            .user = "u",
                            .text = "added after the repair",
                            .window = MEMORY_WINDOW_DEFAULT};
        char id[MEMORY_ID_SIZE];
        assert_int_equal(memory_add(m, &r, id), IS_OK);
        mem_history *h = NULL;
        int32_t nh = 0;
        assert_int_equal(memory_history(m, "t", "u", id, &h, &nh), IS_OK);
        assert_int_equal(nh, 1);
        mem_history_free(h, nh);
        assert_int_equal(memory_check(m, true), IS_OK);
        memory_close(m);
        char name[96];
        snprintf(name, sizeof name, "store missing its %s table", tables[c]);
        matrix(name, 1, "table recreated and reported; facts served, adds work");
    }
}

static void test_bad_rows_quarantined(void **state) {
    char ids[N_FACTS][MEMORY_ID_SIZE];
    make_store(ids);
    char stmt[512];
    snprintf(stmt, sizeof stmt,
             "UPDATE facts SET text = 'tampered' WHERE id = '%s';"
             "UPDATE facts SET embedding = x'00000000' WHERE id = '%s';"
             "PRAGMA ignore_check_constraints=ON; UPDATE facts SET context = '{not json' WHERE id "
             "= '%s';",
             ids[1], ids[3], ids[4]);
    sql(stmt);
    memory_open_report rep;
    memory *m = open_ok(&rep);
    assert_int_equal(rep.n_quarantined, 3);
    assert_int_equal(rep.n_facts, N_FACTS - 3);
    assert_int_equal(rep.n_orphans, 3); /* their records, set aside */
    assert_non_null(strstr(rep.repairs, "facts_quarantine"));
    assert_int_equal(count_files("kv/orphans"), 3);
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", ids[0], &f), IS_OK);
    mem_fact_clear(&f);
    assert_int_equal(memory_get(m, "t", "u", ids[1], &f), IS_ERR_NOT_FOUND);
    assert_int_equal(memory_check(m, true), IS_OK);
    assert_int_equal(mem_store_count_quarantined(memory_fact_store(m)), 3);
    memory_close(m);
    /* Reopening finds nothing more to do. */
    m = open_ok(&rep);
    assert_int_equal(rep.n_quarantined, 0);
    assert_int_equal(rep.n_facts, N_FACTS - 3);
    memory_close(m);
    matrix("bad rows (text not matching its hash, wrong-size embedding, bad context)", 3,
           "quarantined with the reason, the rest served");
}

static void test_orphans_set_aside(void **state) {
    char ids[N_FACTS][MEMORY_ID_SIZE];
    make_store(ids);
    memory *m = open_ok(NULL);
    memory_encode_job j = {"0f0f0f0f-dead-4bad-8bad-000000000001-v1", "lost fact", NULL, 0, 0};
    assert_int_equal(fake_encode(NULL, memory_record_store(m), &j), IS_OK);
    memory_close(m);
    memory_open_report rep;
    m = open_ok(&rep);
    assert_int_equal(rep.n_orphans, 1);
    memory_close(m);
    assert_int_equal(count_files("kv"), N_FACTS);
    assert_int_equal(count_files("kv/orphans"), 1);
    /* A crash during the very first add of a new store leaves one record
     * and no row: that store still opens. */
    reset_dir();
    m = open_ok(NULL);
    memory_encode_job first = {"0f0f0f0f-dead-4bad-8bad-000000000002-v1", "first fact", NULL, 0, 0};
    assert_int_equal(fake_encode(NULL, memory_record_store(m), &first), IS_OK);
    memory_close(m);
    m = open_ok(&rep);
    assert_int_equal(rep.n_orphans, 1);
    memory_close(m);
    assert_int_equal(count_files("kv/orphans"), 1);
    matrix("KV record no fact points to (a crash's leftover, also in a new store)", 2,
           "moved to kv/orphans/, not deleted; the store opens");
}

/* The value of meta's key in the store file, or "" when it has none. */
static void meta_value(const char *key, char *out, size_t cap) {
    sqlite3 *db;
    sqlite3_stmt *q;
    out[0] = '\0';
    assert_int_equal(sqlite3_open(g_db, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT value FROM meta WHERE key = ?", -1, &q, NULL),
                     SQLITE_OK);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    if (sqlite3_step(q) == SQLITE_ROW) snprintf(out, cap, "%s", sqlite3_column_text(q, 0));
    sqlite3_finalize(q);
    sqlite3_close(db);
}

/* Fault hook: the writer dies, as abruptly as a crash, once the second
 * record of its batch is written (the rows are committed after all of a
 * batch's records). */
static void die_at_second_record(memory_step s, void *ud) {
    int *written = ud;
    if (s == MEMORY_STEP_KV_WRITTEN && ++*written == 2) _exit(0);
}

/* A new store in a fresh directory whose very first write, a batch of
 * three facts, crashes after two records: what a crash leaves there. */
static void crash_first_batch(void) {
    reset_dir();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        memory *m = NULL;
        memory_params p = params();
        if (memory_open(g_dir, &p, &m, NULL) != IS_OK) _exit(2);
        memory_set_encoder(m, fake_encode, NULL);
        int written = 0;
        memory_set_fault_hook(m, die_at_second_record, &written);
        char texts[3][64];
        memory_add_req r[3];
        for (int i = 0; i < 3; i++) {
            snprintf(texts[i], sizeof texts[i], "first batch fact %d", i);
            r[i] = (memory_add_req){
                .tenant = "t", .user = "u", .text = texts[i], .window = MEMORY_WINDOW_DEFAULT};
        }
        memory_add_batch(m, r, 3, NULL, NULL);
        _exit(3); /* the hook never fired */
    }
    int ws;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        fail_msg("the writer did not stop at its second record (status %d)", ws);
    /* The state the crash left: two records, no row, the note. */
    char begun[16];
    meta_value("writes_begun", begun, sizeof begun);
    assert_int_equal(count_files("kv"), 2);
    assert_string_equal(begun, "1");
}

static void test_first_batch_crash(void **state) {
    crash_first_batch();
    memory_open_report rep;
    memory *m = NULL;
    is_status st = try_open(&m, &rep);
    if (st != IS_OK) fail_msg("reopening after the crash: %s", is_error_last());
    memory_set_encoder(m, fake_encode, NULL);
    assert_int_equal(rep.n_facts, 0);
    assert_int_equal(rep.n_orphans, 2);
    assert_int_equal(count_files("kv"), 0);
    assert_int_equal(count_files("kv/orphans"), 2);
    /* It works: an add, a check, and a reopen that finds nothing to do. */
    memory_add_req r = {
        .tenant = "t", .user = "u", .text = "after the crash", .window = MEMORY_WINDOW_DEFAULT};
    char id[MEMORY_ID_SIZE];
    assert_int_equal(memory_add(m, &r, id), IS_OK);
    assert_int_equal(memory_check(m, true), IS_OK);
    memory_close(m);
    m = open_ok(&rep);
    assert_int_equal(rep.n_facts, 1);
    assert_int_equal(rep.n_orphans, 0);
    mem_fact f;
    assert_int_equal(memory_get(m, "t", "u", id, &f), IS_OK);
    assert_string_equal(f.text, "after the crash");
    mem_fact_clear(&f);
    memory_close(m);

    /* The note is what tells a crash from a lost store: the same leftovers
     * without it are refused, every record left where it was. */
    crash_first_batch();
    sql("DELETE FROM meta WHERE key = 'writes_begun'");
    m = NULL;
    st = try_open(&m, NULL);
    assert_int_equal(st, IS_ERR_IO);
    assert_non_null(strstr(is_error_last(), "memory.db"));
    assert_null(m);
    assert_int_equal(count_files("kv"), 2);
    matrix("crash inside the very first batch add (two records, no rows)", 2,
           "records set aside, the store opens and works; without its note: refused");
}

static void test_fsck(void **state) {
    char ids[N_FACTS][MEMORY_ID_SIZE];
    make_store(ids);
    memory_fsck_params p = {.text_of = fake_text_of, .embed_name = "none"};
    memory_fsck_report r;
    /* Healthy: nothing to report. */
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_false(r.problems);
    assert_int_equal(r.n_facts, N_FACTS);
    /* Open by someone else: refused. */
    memory *m = open_ok(NULL);
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_ERR_IO);
    memory_close(m);
    matrix("fsck while the data directory is in use", 1, "refused (the record store's lock)");

    /* A bad row, found by the check without writing. */
    char stmt[256];
    snprintf(stmt, sizeof stmt, "UPDATE facts SET text = 'tampered' WHERE id = '%s';", ids[2]);
    sql(stmt);
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_true(r.problems);
    assert_int_equal(r.n_bad_rows, 1);
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_int_equal(r.n_bad_rows, 1); /* the check wrote nothing */
    matrix("fsck check of a store with a bad row", 2, "reported, nothing written");

    /* The store lost: the check says so, --repair rebuilds from records,
     * except one record whose text cannot be recovered. */
    make_store(ids);
    char rec[400];
    snprintf(rec, sizeof rec, "%s/kv/%s-v1.fkv", g_dir, ids[5]);
    remove_db();
    assert_int_equal(unlink(rec), 0);
    m = NULL;
    {
        /* ids[5]'s record replaced by one whose tokens do not give its text. */
        record_store *rs;
        char kv[400], rid[80];
        snprintf(kv, sizeof kv, "%s/kv", g_dir);
        snprintf(rid, sizeof rid, "%s-v1", ids[5]);
        assert_int_equal(record_store_open(kv, 0, &rs), IS_OK);
        assert_int_equal(put_record(rs, rid, "some other text", fact_text(5)), IS_OK);
        record_store_close(rs);
    }
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_true(r.problems && r.db_missing);
    assert_int_equal(r.n_unclaimed, N_FACTS);
    p.repair = true;
    p.tenant = "t";
    p.user = "u";
    /* Rebuilt facts are embedded by the embedder given (none here: BM25). */
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_int_equal(r.n_rebuilt, N_FACTS - 1);
    assert_int_equal(r.n_not_rebuilt, 1);
    memory_params np = memory_default_params();
    np.embed_name = "none";
    memory_open_report rep;
    assert_int_equal(memory_open(g_dir, &np, &m, &rep), IS_OK);
    assert_int_equal(rep.n_facts, N_FACTS - 1);
    assert_int_equal(rep.n_missing_kv, 0);
    assert_int_equal(count_files("kv/orphans"), 1); /* the record that could not be rebuilt */
    mem_fact g;
    assert_int_equal(memory_get(m, "t", "u", ids[5], &g), IS_ERR_NOT_FOUND);
    for (int i = 0; i < N_FACTS - 1; i++) {
        mem_fact f;
        assert_int_equal(memory_get(m, "t", "u", ids[i], &f), IS_OK);
        assert_string_equal(f.text, fact_text(i));
        assert_int_equal(f.version, 1);
        mem_fact_clear(&f);
    }
    memory_close(m);
    p.repair = false;
    assert_int_equal(memory_fsck(g_dir, &p, &r, NULL), IS_OK);
    assert_false(r.problems);
    matrix("memory.db missing beside KV records: fsck --repair", N_FACTS,
           "facts rebuilt from records (exact text, id, version; owner given, metadata lost); "
           "the record whose tokens do not match its hash set aside");

    /* Without a way to decode tokens, a rebuild is refused, nothing moved. */
    remove_db();
    memory_fsck_params q = {.repair = true, .embed_name = "none"};
    assert_int_equal(memory_fsck(g_dir, &q, &r, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(count_files("kv"), N_FACTS - 1);
    matrix("fsck --repair of a lost store without the model", 1, "refused, records untouched");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lost_store_refused),   cmocka_unit_test(test_missing_tables),
        cmocka_unit_test(test_bad_rows_quarantined), cmocka_unit_test(test_orphans_set_aside),
        cmocka_unit_test(test_first_batch_crash),    cmocka_unit_test(test_fsck),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

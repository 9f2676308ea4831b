/*
 * store_sqlite: the fact store in one SQLite file (memory/store.h), the
 * embedded default: no server to run, one process at a time.
 */
#include "memory/store.h"

#include "core/status.h"
#include "memory/store_impl.h"
#include "kv/fact_record.h"
#include "memory/metadata.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct sq_store {
    mem_store base; /* first: a mem_store * is a sq_store * */
    sqlite3 *db;
    char *path;         /* for messages */
    pthread_mutex_t mu; /* one caller at a time on the connection */
} sq_store;

#define SQ(s) ((sq_store *)(s))

/* ---- small helpers ------------------------------------------------------------ */

static is_status sql_err(mem_store *s, const char *what) {
    return is_error_set(IS_ERR_IO, "fact store %s: %s: %s", SQ(s)->path, what,
                        sqlite3_errmsg(SQ(s)->db));
}

static char *dup_or_null(const unsigned char *t) { return t ? strdup((const char *)t) : NULL; }

/* True if the fact's metadata holds every (key, value) of the filter, with
 * the first of a repeated key counting (as the index does). */

/* ---- open / close ------------------------------------------------------------- */

static const char *SCHEMA =
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS tenants (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS users ("
    "  tenant TEXT NOT NULL REFERENCES tenants(id),"
    "  user_id TEXT NOT NULL,"
    "  created_at INTEGER NOT NULL,"
    "  PRIMARY KEY (tenant, user_id));"
    "CREATE TABLE IF NOT EXISTS facts ("
    "  id TEXT PRIMARY KEY,"
    "  tenant TEXT NOT NULL,"
    "  user_id TEXT NOT NULL,"
    "  agent_id TEXT,"
    "  run_id TEXT,"
    "  text TEXT NOT NULL,"
    "  metadata TEXT,"
    "  created_at INTEGER NOT NULL,"
    "  updated_at INTEGER NOT NULL,"
    "  source TEXT,"
    "  hash TEXT NOT NULL,"
    "  embedding BLOB NOT NULL,"
    "  context TEXT,"
    "  kv_window INTEGER NOT NULL,"
    "  kv_record TEXT,"
    "  version INTEGER NOT NULL,"
    "  FOREIGN KEY (tenant, user_id) REFERENCES users(tenant, user_id));"
    "CREATE INDEX IF NOT EXISTS facts_by_user ON facts(tenant, user_id, created_at);"
    "CREATE INDEX IF NOT EXISTS facts_by_source ON facts(tenant, user_id, source, hash);"
    "CREATE TABLE IF NOT EXISTS history ("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  fact_id TEXT NOT NULL,"
    "  tenant TEXT NOT NULL,"
    "  user_id TEXT NOT NULL,"
    "  event TEXT NOT NULL CHECK (event IN ('ADD', 'UPDATE', 'DELETE')),"
    "  old_text TEXT,"
    "  new_text TEXT,"
    "  at INTEGER NOT NULL);"
    "CREATE INDEX IF NOT EXISTS history_by_fact ON history(fact_id);";

/* The tables of the schema, facts first. */
static const char *const TABLES[] = {"facts", "meta", "tenants", "users", "history"};

/* Recreates the tables an existing store lacks (the schema's statements
 * all say IF NOT EXISTS), refilling tenants and users from the facts, so a
 * store that lost its history table serves (without that history) instead
 * of failing every write. A lost facts table comes back empty: the caller
 * (memory_open) refuses an empty store that has KV records. */
static void find_missing_tables(mem_store *s, char *missing, size_t cap) {
    missing[0] = '\0';
    for (size_t i = 0; i < sizeof TABLES / sizeof TABLES[0]; i++) {
        sqlite3_stmt *q;
        int found = 0;
        if (sqlite3_prepare_v2(
                SQ(s)->db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                -1, &q, NULL) == SQLITE_OK) {
            sqlite3_bind_text(q, 1, TABLES[i], -1, SQLITE_STATIC);
            if (sqlite3_step(q) == SQLITE_ROW) found = sqlite3_column_int(q, 0);
            sqlite3_finalize(q);
        }
        if (!found) {
            size_t l = strlen(missing);
            snprintf(missing + l, cap - l, "%s%s", l ? ", " : "", TABLES[i]);
        }
    }
}

static is_status repair_schema(mem_store *s) {
    char missing[128];
    find_missing_tables(s, missing, sizeof missing);
    if (!missing[0]) return IS_OK;
    char sql[4096];
    snprintf(
        sql, sizeof sql,
        "BEGIN; %s"
        "INSERT OR IGNORE INTO tenants SELECT tenant, min(created_at) FROM facts GROUP BY tenant;"
        "INSERT OR IGNORE INTO users SELECT tenant, user_id, min(created_at) FROM facts "
        "GROUP BY tenant, user_id; COMMIT;",
        SCHEMA);
    char *err = NULL;
    if (sqlite3_exec(SQ(s)->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: recreating missing tables (%s): %s",
                                    SQ(s)->path, missing, err ? err : "?");
        sqlite3_free(err);
        sqlite3_exec(SQ(s)->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    store_note_repair(s, "recreated missing tables: %s", missing);
    return IS_OK;
}

static const mem_store_ops SQ_OPS;

static void sq_close(mem_store *s) {
    if (!s) return;
    sqlite3_close(SQ(s)->db); /* every statement is finalized by the function that made it */
    pthread_mutex_destroy(&SQ(s)->mu);
    free(SQ(s)->path);
    free(s);
}

/* A store on a connection to the file at path, opened with SQLite's open
 * flags (both opens start here: a read-only one stops here). On failure
 * nothing is left open and *out is unchanged. */
static is_status sq_connect(const char *path, int flags, mem_store **out) {
    mem_store *s = calloc(1, sizeof(sq_store));
    if (!s || !(SQ(s)->path = strdup(path))) {
        free(s);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    s->ops = &SQ_OPS;
    s->where = SQ(s)->path;
    pthread_mutex_init(&SQ(s)->mu, NULL);
    int rc = sqlite3_open_v2(path, &SQ(s)->db, flags | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: cannot open: %s", path,
                                    SQ(s)->db ? sqlite3_errmsg(SQ(s)->db) : sqlite3_errstr(rc));
        sq_close(s);
        return st;
    }
    *out = s;
    return IS_OK;
}

/* Opens (or creates) the store read-write: WAL, full sync, foreign keys,
 * the schema made, checked or repaired. */
static is_status sq_open(const char *path, mem_store **out) {
    mem_store *s = NULL;
    is_status st = sq_connect(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, &s);
    if (st != IS_OK) return st;
    sqlite3_busy_timeout(SQ(s)->db, 5000);
    char *err = NULL;
    /* journal_mode returns a row; exec ignores it. NOTADB shows up here. */
    int rc = sqlite3_exec(
        SQ(s)->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;",
        NULL, NULL, &err);
    if (rc != SQLITE_OK) {
        st = is_error_set(rc == SQLITE_NOTADB || rc == SQLITE_CORRUPT ? IS_ERR_FORMAT : IS_ERR_IO,
                          "fact store %s: %s", path, err ? err : sqlite3_errstr(rc));
        sqlite3_free(err);
        goto fail;
    }
    sqlite3_stmt *q;
    int32_t version = -1;
    if (sqlite3_prepare_v2(SQ(s)->db, "PRAGMA user_version", -1, &q, NULL) == SQLITE_OK) {
        if (sqlite3_step(q) == SQLITE_ROW) version = sqlite3_column_int(q, 0);
        sqlite3_finalize(q);
    }
    if (version < 0) {
        st = sql_err(s, "reading the schema version");
        goto fail;
    }
    if (version > MEM_STORE_SCHEMA_VERSION) {
        st = is_error_set(IS_ERR_FORMAT,
                          "fact store %s: schema version %d is newer than this "
                          "program's (%d)",
                          path, version, MEM_STORE_SCHEMA_VERSION);
        goto fail;
    }
    if (version == MEM_STORE_SCHEMA_VERSION && (st = repair_schema(s)) != IS_OK) goto fail;
    if (version == 0) {
        /* A database that holds tables but no version is someone else's. */
        int64_t n_tables = 0;
        if (sqlite3_prepare_v2(SQ(s)->db, "SELECT count(*) FROM sqlite_master", -1, &q, NULL) ==
            SQLITE_OK) {
            if (sqlite3_step(q) == SQLITE_ROW) n_tables = sqlite3_column_int64(q, 0);
            sqlite3_finalize(q);
        }
        if (n_tables > 0) {
            st = is_error_set(IS_ERR_FORMAT,
                              "fact store %s: a database but not a fact store "
                              "(no schema version)",
                              path);
            goto fail;
        }
        char sql[4096];
        snprintf(sql, sizeof sql, "BEGIN; %s PRAGMA user_version=%d; COMMIT;", SCHEMA,
                 MEM_STORE_SCHEMA_VERSION);
        if (sqlite3_exec(SQ(s)->db, sql, NULL, NULL, &err) != SQLITE_OK) {
            st = is_error_set(IS_ERR_IO, "fact store %s: creating the schema: %s", path,
                              err ? err : "?");
            sqlite3_free(err);
            sqlite3_exec(SQ(s)->db, "ROLLBACK", NULL, NULL, NULL);
            goto fail;
        }
    }
    *out = s;
    return IS_OK;
fail:
    sq_close(s);
    return st;
}

/* ---- statements --------------------------------------------------------------- */

static is_status prepare(mem_store *s, const char *sql, sqlite3_stmt **q) {
    if (sqlite3_prepare_v2(SQ(s)->db, sql, -1, q, NULL) != SQLITE_OK) return sql_err(s, "prepare");
    return IS_OK;
}

static void bind_text(sqlite3_stmt *q, int i, const char *t) {
    if (t) sqlite3_bind_text(q, i, t, -1, SQLITE_TRANSIENT);
    else sqlite3_bind_null(q, i);
}

/* Runs a statement that returns no rows, then finalizes it. */
static is_status step_done(mem_store *s, sqlite3_stmt *q, const char *what) {
    int rc = sqlite3_step(q);
    is_status st = rc == SQLITE_DONE ? IS_OK : sql_err(s, what);
    sqlite3_finalize(q);
    return st;
}

static is_status exec(mem_store *s, const char *sql) {
    char *err = NULL;
    if (sqlite3_exec(SQ(s)->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: %s: %s", SQ(s)->path, sql,
                                    err ? err : sqlite3_errmsg(SQ(s)->db));
        sqlite3_free(err);
        return st;
    }
    return IS_OK;
}

/* ---- the transaction of a write (store.c runs the bodies inside it) --------------- */

static void sq_lock(mem_store *s) { pthread_mutex_lock(&SQ(s)->mu); }
static void sq_unlock(mem_store *s) { pthread_mutex_unlock(&SQ(s)->mu); }
/* IMMEDIATE: the write lock at BEGIN, so a busy database waits there (busy
 * timeout) rather than failing at the first write. */
static is_status sq_begin(mem_store *s) { return exec(s, "BEGIN IMMEDIATE"); }
static is_status sq_commit(mem_store *s) { return exec(s, "COMMIT"); }
static void sq_rollback(mem_store *s) { sqlite3_exec(SQ(s)->db, "ROLLBACK", NULL, NULL, NULL); }

static is_status history_add(mem_store *s, const char *fact_id, const char *tenant,
                             const char *user, mem_event ev, const char *old_text,
                             const char *new_text, int64_t at) {
    sqlite3_stmt *q;
    is_status st = prepare(s,
                           "INSERT INTO history (fact_id, tenant, user_id, event, old_text, "
                           "new_text, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           &q);
    if (st != IS_OK) return st;
    bind_text(q, 1, fact_id);
    bind_text(q, 2, tenant);
    bind_text(q, 3, user);
    bind_text(q, 4, mem_event_name(ev));
    bind_text(q, 5, old_text);
    bind_text(q, 6, new_text);
    sqlite3_bind_int64(q, 7, at);
    return step_done(s, q, "insert history");
}

#define FACT_COLUMNS                                                                               \
    "id, tenant, user_id, agent_id, run_id, text, metadata, created_at, updated_at, source, "      \
    "hash, context, kv_window, kv_record, version, embedding"

/* Reads the current row of a statement that selected FACT_COLUMNS. */
static is_status row_to_fact(sqlite3_stmt *q, bool with_embedding, mem_fact *f) {
    memset(f, 0, sizeof *f);
    const unsigned char *id = sqlite3_column_text(q, 0);
    snprintf(f->id, sizeof f->id, "%s", id ? (const char *)id : "");
    f->tenant = dup_or_null(sqlite3_column_text(q, 1));
    f->user = dup_or_null(sqlite3_column_text(q, 2));
    f->agent_id = dup_or_null(sqlite3_column_text(q, 3));
    f->run_id = dup_or_null(sqlite3_column_text(q, 4));
    f->text = dup_or_null(sqlite3_column_text(q, 5));
    f->metadata = dup_or_null(sqlite3_column_text(q, 6));
    f->created_at = sqlite3_column_int64(q, 7);
    f->updated_at = sqlite3_column_int64(q, 8);
    f->source = dup_or_null(sqlite3_column_text(q, 9));
    const unsigned char *h = sqlite3_column_text(q, 10);
    snprintf(f->hash, sizeof f->hash, "%s", h ? (const char *)h : "");
    is_status st = store_context_from_json((const char *)sqlite3_column_text(q, 11), f);
    f->kv_window = sqlite3_column_int(q, 12);
    f->kv_record = dup_or_null(sqlite3_column_text(q, 13));
    f->version = sqlite3_column_int(q, 14);
    int bytes = sqlite3_column_bytes(q, 15);
    f->dim = bytes / (int)sizeof(float);
    if (st == IS_OK && (!f->tenant || !f->user || !f->text))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK && with_embedding) {
        const void *blob = sqlite3_column_blob(q, 15);
        if (bytes <= 0 || bytes % sizeof(float) != 0 || !blob) {
            st = is_error_set(IS_ERR_FORMAT, "fact %s: embedding blob of %d bytes", f->id, bytes);
        } else if (!(f->embedding = malloc((size_t)bytes))) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
        } else {
            memcpy(f->embedding, blob, (size_t)bytes);
        }
    }
    if (st != IS_OK) mem_fact_clear(f);
    return st;
}

/* ---- meta ---------------------------------------------------------------------- */

static is_status sq_meta_get(mem_store *s, const char *key, char **value) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "SELECT value FROM meta WHERE key = ?", &q);
    if (st == IS_OK) {
        bind_text(q, 1, key);
        int rc = sqlite3_step(q);
        if (rc == SQLITE_ROW) {
            char *v = dup_or_null(sqlite3_column_text(q, 0));
            if (v) *value = v;
            else st = is_error_set(IS_ERR_NOMEM, "out of memory");
        } else if (rc == SQLITE_DONE) {
            st = is_error_set(IS_ERR_NOT_FOUND, "fact store: no setting '%s'", key);
        } else {
            st = sql_err(s, "read meta");
        }
        sqlite3_finalize(q);
    }
    return st;
}

static is_status sq_meta_set(mem_store *s, const char *key, const char *value) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", &q);
    if (st == IS_OK) {
        bind_text(q, 1, key);
        bind_text(q, 2, value);
        st = step_done(s, q, "write meta");
    }
    return st;
}

/* ---- insert ---------------------------------------------------------------------- */

static is_status sq_insert(mem_store *s, const mem_fact *f, int64_t now) {
    char *ctx = store_context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    sqlite3_stmt *q = NULL;
    is_status st;
    if ((st = prepare(s, "INSERT OR IGNORE INTO tenants (id, created_at) VALUES (?, ?)", &q)) ==
        IS_OK) {
        bind_text(q, 1, f->tenant);
        sqlite3_bind_int64(q, 2, now);
        st = step_done(s, q, "insert tenant");
    }
    if (st == IS_OK &&
        (st = prepare(s,
                      "INSERT OR IGNORE INTO users (tenant, user_id, created_at) VALUES (?, ?, ?)",
                      &q)) == IS_OK) {
        bind_text(q, 1, f->tenant);
        bind_text(q, 2, f->user);
        sqlite3_bind_int64(q, 3, now);
        st = step_done(s, q, "insert user");
    }
    if (st == IS_OK) {
        /* A duplicate id is the caller's error, not an I/O failure. */
        if ((st = prepare(s, "SELECT 1 FROM facts WHERE id = ?", &q)) == IS_OK) {
            bind_text(q, 1, f->id);
            int rc = sqlite3_step(q);
            sqlite3_finalize(q);
            if (rc == SQLITE_ROW)
                st = is_error_set(IS_ERR_INVALID_ARG, "fact store: fact id %s exists already",
                                  f->id);
            else if (rc != SQLITE_DONE) st = sql_err(s, "look up fact id");
        }
    }
    if (st == IS_OK && (st = prepare(s,
                                     "INSERT INTO facts (" FACT_COLUMNS ") VALUES "
                                     "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                     &q)) == IS_OK) {
        bind_text(q, 1, f->id);
        bind_text(q, 2, f->tenant);
        bind_text(q, 3, f->user);
        bind_text(q, 4, f->agent_id);
        bind_text(q, 5, f->run_id);
        bind_text(q, 6, f->text);
        bind_text(q, 7, f->metadata);
        sqlite3_bind_int64(q, 8, f->created_at ? f->created_at : now);
        sqlite3_bind_int64(q, 9, f->updated_at ? f->updated_at : now);
        bind_text(q, 10, f->source);
        bind_text(q, 11, f->hash);
        bind_text(q, 12, ctx);
        sqlite3_bind_int(q, 13, f->kv_window);
        bind_text(q, 14, f->kv_record);
        sqlite3_bind_int(q, 15, f->version);
        sqlite3_bind_blob(q, 16, f->embedding, f->dim * (int)sizeof(float), SQLITE_TRANSIENT);
        st = step_done(s, q, "insert fact");
    }
    if (st == IS_OK)
        st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_ADD, NULL, f->text, now);
    free(ctx);
    return st;
}

/* ---- reads ------------------------------------------------------------------------- */

static is_status get_locked(mem_store *s, const char *tenant, const char *user, const char *id,
                            bool with_embedding, mem_fact *out) {
    sqlite3_stmt *q;
    is_status st = prepare(
        s, "SELECT " FACT_COLUMNS " FROM facts WHERE id = ? AND tenant = ? AND user_id = ?", &q);
    if (st != IS_OK) return st;
    bind_text(q, 1, id);
    bind_text(q, 2, tenant);
    bind_text(q, 3, user);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) st = row_to_fact(q, with_embedding, out);
    else if (rc == SQLITE_DONE) st = is_error_set(IS_ERR_NOT_FOUND, "no memory with id %s", id);
    else st = sql_err(s, "read fact");
    sqlite3_finalize(q);
    return st;
}

static is_status sq_get(mem_store *s, const char *tenant, const char *user, const char *id,
                        bool with_embedding, mem_fact *out) {
    memset(out, 0, sizeof *out);
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: get needs tenant, user and id");
    is_status st = get_locked(s, tenant, user, id, with_embedding, out);
    return st;
}

/* One statement prepared once and stepped per id (a search's k hits),
 * inside one read transaction, so all the rows come from one snapshot. */
static is_status sq_get_many(mem_store *s, const char *tenant, const char *user,
                             const char *const *ids, int32_t n, mem_fact *out, bool *found) {
    sqlite3_stmt *q = NULL;
    is_status st = exec(s, "BEGIN");
    if (st == IS_OK) {
        st = prepare(
            s, "SELECT " FACT_COLUMNS " FROM facts WHERE id = ? AND tenant = ? AND user_id = ?",
            &q);
        for (int32_t i = 0; st == IS_OK && i < n; i++) {
            sqlite3_reset(q);
            bind_text(q, 1, ids[i]);
            bind_text(q, 2, tenant);
            bind_text(q, 3, user);
            int rc = sqlite3_step(q);
            if (rc == SQLITE_ROW) found[i] = (st = row_to_fact(q, false, &out[i])) == IS_OK;
            else if (rc != SQLITE_DONE) st = sql_err(s, "read facts");
        }
        sqlite3_finalize(q); /* NULL when prepare failed: a no-op */
        sqlite3_exec(SQ(s)->db, "COMMIT", NULL, NULL, NULL);
    }
    return st; /* store.c clears out and found on failure */
}

static is_status list_locked(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                             int32_t *n_out) {
    sqlite3_stmt *q;
    is_status st = prepare(s,
                           "SELECT " FACT_COLUMNS " FROM facts WHERE tenant = ?1 AND user_id = ?2 "
                           "AND (?3 IS NULL OR agent_id = ?3) AND (?4 IS NULL OR run_id = ?4) "
                           "ORDER BY created_at, id",
                           &q);
    if (st != IS_OK) return st;
    bind_text(q, 1, f->tenant);
    bind_text(q, 2, f->user);
    bind_text(q, 3, f->agent_id);
    bind_text(q, 4, f->run_id);
    mem_fact *facts = NULL;
    int32_t n = 0, cap = 0;
    int rc;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const unsigned char *meta = sqlite3_column_text(q, 6);
        if (!store_meta_matches((const char *)meta, f)) continue;
        if (n == cap) {
            int32_t nc = cap ? cap * 2 : 16;
            mem_fact *nf = realloc(facts, (size_t)nc * sizeof *nf);
            if (!nf) {
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            facts = nf;
            cap = nc;
        }
        if ((st = row_to_fact(q, with_embedding, &facts[n])) != IS_OK) break;
        n++;
    }
    if (st == IS_OK && rc != SQLITE_DONE) st = sql_err(s, "list facts");
    sqlite3_finalize(q);
    if (st != IS_OK) {
        mem_facts_free(facts, n);
        return st;
    }
    *out = facts;
    *n_out = n;
    return IS_OK;
}

static is_status sq_list(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                         int32_t *n) {
    is_status st = store_check_filter(f);
    if (st != IS_OK) return st;
    st = list_locked(s, f, with_embedding, out, n);
    return st;
}

/* ---- update ------------------------------------------------------------------------ */

static is_status sq_update(mem_store *s, const mem_fact *f, int32_t expected_version, int64_t now) {
    char *ctx = store_context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    mem_fact old = {0};
    is_status st = get_locked(s, f->tenant, f->user, f->id, false, &old);
    if (st == IS_OK && old.version != expected_version)
        st = is_error_set(IS_ERR_MISMATCH, "memory %s changed meanwhile (version %d, expected %d)",
                          f->id, old.version, expected_version);
    sqlite3_stmt *q;
    if (st == IS_OK &&
        (st = prepare(s,
                      "UPDATE facts SET text = ?, metadata = ?, hash = ?, embedding = ?, "
                      "context = ?, kv_window = ?, kv_record = ?, version = ?, updated_at = ? "
                      "WHERE id = ? AND tenant = ? AND user_id = ?",
                      &q)) == IS_OK) {
        bind_text(q, 1, f->text);
        bind_text(q, 2, f->metadata);
        bind_text(q, 3, f->hash);
        sqlite3_bind_blob(q, 4, f->embedding, f->dim * (int)sizeof(float), SQLITE_TRANSIENT);
        bind_text(q, 5, ctx);
        sqlite3_bind_int(q, 6, f->kv_window);
        bind_text(q, 7, f->kv_record);
        sqlite3_bind_int(q, 8, f->version);
        sqlite3_bind_int64(q, 9, now);
        bind_text(q, 10, f->id);
        bind_text(q, 11, f->tenant);
        bind_text(q, 12, f->user);
        st = step_done(s, q, "update fact");
    }
    if (st == IS_OK)
        st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_UPDATE, old.text, f->text, now);
    mem_fact_clear(&old);
    free(ctx);
    return st;
}

static is_status sq_set_kv(mem_store *s, const char *id, int32_t version, const char *kv_record) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "UPDATE facts SET kv_record = ? WHERE id = ? AND version = ?", &q);
    if (st == IS_OK) {
        bind_text(q, 1, kv_record);
        bind_text(q, 2, id);
        sqlite3_bind_int(q, 3, version);
        st = step_done(s, q, "set kv record");
        if (st == IS_OK && sqlite3_changes(SQ(s)->db) == 0)
            st = is_error_set(IS_ERR_NOT_FOUND, "no memory %s at version %d", id, version);
    }
    return st;
}

/* ---- delete ------------------------------------------------------------------------ */

/* Deletes one row (already read into f) and writes its history, inside a
 * transaction. */
static is_status delete_row(mem_store *s, const mem_fact *f, int64_t now) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "DELETE FROM facts WHERE id = ? AND tenant = ? AND user_id = ?", &q);
    if (st != IS_OK) return st;
    bind_text(q, 1, f->id);
    bind_text(q, 2, f->tenant);
    bind_text(q, 3, f->user);
    if ((st = step_done(s, q, "delete fact")) != IS_OK) return st;
    return history_add(s, f->id, f->tenant, f->user, MEM_EVENT_DELETE, f->text, NULL, now);
}

static is_status sq_delete(mem_store *s, const char *tenant, const char *user, const char *id,
                           mem_fact *row, int64_t now) {
    is_status st = get_locked(s, tenant, user, id, false, row);
    return st != IS_OK ? st : delete_row(s, row, now);
}

static is_status sq_delete_all(mem_store *s, const mem_filter *f, mem_fact **rows, int32_t *n,
                               int64_t now) {
    is_status st = list_locked(s, f, false, rows, n);
    for (int32_t i = 0; st == IS_OK && i < *n; i++) st = delete_row(s, &(*rows)[i], now);
    return st;
}

/* ---- history, sources, iteration ------------------------------------------------- */

static is_status sq_history(mem_store *s, const char *tenant, const char *user, const char *id,
                            mem_history **out, int32_t *n_out) {
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: history needs tenant, user and id");
    sqlite3_stmt *q;
    mem_history *h = NULL;
    int32_t n = 0, cap = 0;
    is_status st =
        prepare(s,
                "SELECT id, event, old_text, new_text, at FROM history WHERE fact_id = ? "
                "AND tenant = ? AND user_id = ? ORDER BY id",
                &q);
    if (st == IS_OK) {
        bind_text(q, 1, id);
        bind_text(q, 2, tenant);
        bind_text(q, 3, user);
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            if (n == cap) {
                int32_t nc = cap ? cap * 2 : 8;
                mem_history *nh = realloc(h, (size_t)nc * sizeof *nh);
                if (!nh) {
                    st = is_error_set(IS_ERR_NOMEM, "out of memory");
                    break;
                }
                h = nh;
                cap = nc;
            }
            mem_history *e = &h[n++];
            memset(e, 0, sizeof *e);
            e->id = sqlite3_column_int64(q, 0);
            snprintf(e->fact_id, sizeof e->fact_id, "%s", id);
            const char *ev = (const char *)sqlite3_column_text(q, 1);
            e->event = ev && strcmp(ev, "ADD") == 0      ? MEM_EVENT_ADD
                       : ev && strcmp(ev, "UPDATE") == 0 ? MEM_EVENT_UPDATE
                                                         : MEM_EVENT_DELETE;
            e->old_text = dup_or_null(sqlite3_column_text(q, 2));
            e->new_text = dup_or_null(sqlite3_column_text(q, 3));
            e->at = sqlite3_column_int64(q, 4);
        }
        if (st == IS_OK && rc != SQLITE_DONE) st = sql_err(s, "read history");
        sqlite3_finalize(q);
    }
    if (st == IS_OK && n == 0) st = is_error_set(IS_ERR_NOT_FOUND, "no memory with id %s", id);
    if (st != IS_OK) {
        mem_history_free(h, n);
        return st;
    }
    *out = h;
    *n_out = n;
    return IS_OK;
}

static is_status sq_find_source(mem_store *s, const char *tenant, const char *user,
                                const char *source, const char *hash, char id_out[MEM_ID_MAX + 1]) {
    sqlite3_stmt *q;
    is_status st = prepare(s,
                           "SELECT id FROM facts WHERE tenant = ? AND user_id = ? AND source = ? "
                           "AND hash = ? LIMIT 1",
                           &q);
    if (st == IS_OK) {
        bind_text(q, 1, tenant);
        bind_text(q, 2, user);
        bind_text(q, 3, source);
        bind_text(q, 4, hash);
        int rc = sqlite3_step(q);
        if (rc == SQLITE_ROW)
            snprintf(id_out, MEM_ID_MAX + 1, "%s", (const char *)sqlite3_column_text(q, 0));
        else if (rc == SQLITE_DONE)
            st = is_error_set(IS_ERR_NOT_FOUND, "no memory from source %s", source ? source : "");
        else st = sql_err(s, "find source");
        sqlite3_finalize(q);
    }
    return st;
}

static is_status sq_owner(mem_store *s, const char *tenant, const char *id, char **user) {
    if (!s || !tenant || !id || !user)
        return is_error_set(IS_ERR_INVALID_ARG, "mem_store_owner: NULL argument");
    sqlite3_stmt *q;
    is_status st = prepare(s,
                           "SELECT user_id FROM facts WHERE id = ? AND tenant = ? "
                           "UNION ALL SELECT user_id FROM history WHERE fact_id = ? AND tenant = ? "
                           "LIMIT 1",
                           &q);
    if (st == IS_OK) {
        bind_text(q, 1, id);
        bind_text(q, 2, tenant);
        bind_text(q, 3, id);
        bind_text(q, 4, tenant);
        int rc = sqlite3_step(q);
        if (rc == SQLITE_ROW) {
            *user = strdup((const char *)sqlite3_column_text(q, 0));
            if (!*user) st = is_error_set(IS_ERR_NOMEM, "out of memory");
        } else if (rc == SQLITE_DONE) {
            st = is_error_set(IS_ERR_NOT_FOUND, "no memory %s", id);
        } else {
            st = sql_err(s, "owner");
        }
        sqlite3_finalize(q);
    }
    return st;
}

/* The rows of one table, or `absent` where it cannot be counted (a
 * missing table among them). */
static int64_t count_rows(mem_store *s, const char *sql, int64_t absent) {
    int64_t n = absent;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(SQ(s)->db, sql, -1, &q, NULL) == SQLITE_OK) {
        if (sqlite3_step(q) == SQLITE_ROW) n = sqlite3_column_int64(q, 0);
        sqlite3_finalize(q);
    }
    return n;
}

static int64_t sq_count(mem_store *s) { return count_rows(s, "SELECT count(*) FROM facts", -1); }

static is_status sq_foreach(mem_store *s, bool with_embedding, mem_store_fact_fn fn, void *ud) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "SELECT " FACT_COLUMNS " FROM facts ORDER BY id", &q);
    if (st == IS_OK) {
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            mem_fact f;
            if ((st = row_to_fact(q, with_embedding, &f)) != IS_OK) break;
            st = fn(&f, ud);
            mem_fact_clear(&f);
            if (st != IS_OK) break;
        }
        if (st == IS_OK && rc != SQLITE_DONE) st = sql_err(s, "scan facts");
        sqlite3_finalize(q);
    }
    return st;
}

/* ---- repair ----------------------------------------------------------------------- */

/* Why the current row (FACT_COLUMNS) cannot be served, or NULL if it can:
 * SQLite's own column types first (it stores whatever it is given), then
 * the rules both stores share. */
static const char *row_problem(sqlite3_stmt *q, int32_t dim) {
    static const int text_cols[] = {0, 1, 2, 5, 10};
    for (size_t i = 0; i < sizeof text_cols / sizeof text_cols[0]; i++)
        if (sqlite3_column_type(q, text_cols[i]) != SQLITE_TEXT)
            return "a required text column is not text";
    if (sqlite3_column_type(q, 15) != SQLITE_BLOB) return "embedding is not a blob";
    return store_row_problem((const char *)sqlite3_column_text(q, 0),
                             (const char *)sqlite3_column_text(q, 5),
                             (const char *)sqlite3_column_text(q, 10), sqlite3_column_int(q, 14),
                             sqlite3_column_blob(q, 15), sqlite3_column_bytes(q, 15), dim,
                             (const char *)sqlite3_column_text(q, 11));
}

static void sq_missing_tables(mem_store *s, char *out, size_t cap) {
    find_missing_tables(s, out, cap);
}

static is_status sq_integrity(mem_store *s, char *out, size_t cap) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "PRAGMA quick_check", &q);
    if (st == IS_OK) {
        if (sqlite3_step(q) == SQLITE_ROW) {
            const unsigned char *t = sqlite3_column_text(q, 0);
            snprintf(out, cap, "%s", t ? (const char *)t : "?");
        } else {
            st = sql_err(s, "quick_check");
        }
        sqlite3_finalize(q);
    }
    return st;
}

static is_status sq_foreach_record(mem_store *s, mem_store_record_fn fn, void *ud) {
    sqlite3_stmt *q;
    is_status st = prepare(s, "SELECT kv_record FROM facts WHERE kv_record IS NOT NULL", &q);
    if (st == IS_OK) {
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            const unsigned char *r = sqlite3_column_text(q, 0);
            if (r && (st = fn((const char *)r, ud)) != IS_OK) break;
        }
        if (st == IS_OK && rc != SQLITE_DONE) st = sql_err(s, "scan records");
        sqlite3_finalize(q);
    }
    return st;
}

static is_status sq_quarantine(mem_store *s, int32_t dim, bool move, int64_t *n_out) {
    if (n_out) *n_out = 0;
    sqlite3_stmt *q;
    int64_t *rowids = NULL;
    const char **why = NULL;
    int64_t n = 0, cap = 0;
    is_status st = prepare(s, "SELECT " FACT_COLUMNS ", rowid FROM facts", &q);
    if (st == IS_OK) {
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            const char *p = row_problem(q, dim);
            if (!p) continue;
            if (n == cap) {
                int64_t nc = cap ? cap * 2 : 16;
                int64_t *nr = realloc(rowids, (size_t)nc * sizeof *nr);
                if (nr) rowids = nr;
                const char **nw = nr ? realloc(why, (size_t)nc * sizeof *nw) : NULL;
                if (!nr || !nw) {
                    st = is_error_set(IS_ERR_NOMEM, "out of memory");
                    break;
                }
                why = nw;
                cap = nc;
            }
            rowids[n] = sqlite3_column_int64(q, 16);
            why[n++] = p;
        }
        if (st == IS_OK && rc != SQLITE_DONE) st = sql_err(s, "scan facts");
        sqlite3_finalize(q);
    }
    /* Bad rows move, whole and as stored, to facts_quarantine (with the
     * reason), in one transaction: the rest is served, nothing is lost. */
    if (st == IS_OK && !move && n_out) *n_out = n;
    if (st == IS_OK && move && n > 0) {
        char *err = NULL;
        if (sqlite3_exec(SQ(s)->db,
                         "BEGIN; CREATE TABLE IF NOT EXISTS facts_quarantine AS SELECT *, "
                         "'' AS reason, 0 AS quarantined_at FROM facts WHERE 0;",
                         NULL, NULL, &err) != SQLITE_OK) {
            st = is_error_set(IS_ERR_IO, "fact store %s: quarantine: %s", SQ(s)->path,
                              err ? err : "?");
            sqlite3_free(err);
        }
        sqlite3_stmt *ins = NULL, *del = NULL;
        if (st == IS_OK)
            st = prepare(
                s, "INSERT INTO facts_quarantine SELECT *, ?, ? FROM facts WHERE rowid = ?", &ins);
        if (st == IS_OK) st = prepare(s, "DELETE FROM facts WHERE rowid = ?", &del);
        for (int64_t i = 0; st == IS_OK && i < n; i++) {
            sqlite3_reset(ins);
            sqlite3_bind_text(ins, 1, why[i], -1, SQLITE_STATIC);
            sqlite3_bind_int64(ins, 2, (int64_t)time(NULL) * 1000);
            sqlite3_bind_int64(ins, 3, rowids[i]);
            if (sqlite3_step(ins) != SQLITE_DONE) {
                st = sql_err(s, "quarantine a row");
                break;
            }
            sqlite3_reset(del);
            sqlite3_bind_int64(del, 1, rowids[i]);
            if (sqlite3_step(del) != SQLITE_DONE) st = sql_err(s, "remove a quarantined row");
        }
        sqlite3_finalize(ins);
        sqlite3_finalize(del);
        if (st == IS_OK && sqlite3_exec(SQ(s)->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
            st = sql_err(s, "commit the quarantine");
        if (st != IS_OK) sqlite3_exec(SQ(s)->db, "ROLLBACK", NULL, NULL, NULL);
        if (st == IS_OK) {
            char msg[160];
            snprintf(msg, sizeof msg, "%lld bad rows moved to table facts_quarantine (first: %s)",
                     (long long)n, why[0]);
            store_note_repair(s, "%s", msg);
            if (n_out) *n_out = n;
        }
    }
    free(rowids);
    free(why);
    return st;
}

static int64_t sq_count_history(mem_store *s) {
    return count_rows(s, "SELECT count(*) FROM history", -1);
}

static int64_t sq_count_quarantined(mem_store *s) {
    return count_rows(s, "SELECT count(*) FROM facts_quarantine", 0);
}

static is_status sq_users(mem_store *s, const char *tenant, char ***out, int32_t *n_out) {
    if (!s || !tenant || !out || !n_out)
        return is_error_set(IS_ERR_INVALID_ARG, "mem_store_users: NULL argument");
    sqlite3_stmt *q;
    char **u = NULL;
    int32_t n = 0, cap = 0;
    is_status st =
        prepare(s, "SELECT DISTINCT user_id FROM facts WHERE tenant = ? ORDER BY user_id", &q);
    if (st == IS_OK) {
        bind_text(q, 1, tenant);
        int rc;
        while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
            if (n == cap) {
                int32_t nc = cap ? cap * 2 : 16;
                char **nu = realloc(u, (size_t)nc * sizeof *nu);
                if (!nu) break;
                u = nu;
                cap = nc;
            }
            if (!(u[n] = strdup((const char *)sqlite3_column_text(q, 0)))) break;
            n++;
        }
        if (rc == SQLITE_ROW) st = is_error_set(IS_ERR_NOMEM, "out of memory");
        else if (rc != SQLITE_DONE) st = sql_err(s, "list users");
        sqlite3_finalize(q);
    }
    if (st != IS_OK) {
        for (int32_t i = 0; i < n; i++) free(u[i]);
        free(u);
        return st;
    }
    *out = u;
    *n_out = n;
    return IS_OK;
}

static const mem_store_ops SQ_OPS = {
    .name = "sqlite",
    .close = sq_close,
    .meta_get = sq_meta_get,
    .meta_set = sq_meta_set,
    .lock = sq_lock,
    .unlock = sq_unlock,
    .begin = sq_begin,
    .commit = sq_commit,
    .rollback = sq_rollback,
    .insert = sq_insert,
    .get = sq_get,
    .get_many = sq_get_many,
    .list = sq_list,
    .update = sq_update,
    .set_kv = sq_set_kv,
    .del = sq_delete,
    .delete_all = sq_delete_all,
    .history = sq_history,
    .find_source = sq_find_source,
    .count = sq_count,
    .owner = sq_owner,
    .users = sq_users,
    .foreach = sq_foreach,
    .quarantine = sq_quarantine,
    .missing_tables = sq_missing_tables,
    .integrity = sq_integrity,
    .foreach_record = sq_foreach_record,
    .count_history = sq_count_history,
    .count_quarantined = sq_count_quarantined,
    .watch = NULL,
};

is_status store_sqlite_open(const char *path, bool readonly, mem_store **out) {
    return readonly ? sq_connect(path, SQLITE_OPEN_READONLY, out) : sq_open(path, out);
}

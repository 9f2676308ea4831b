#include "memory/store.h"

#include "core/status.h"
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

struct mem_store {
    sqlite3 *db;
    char *path;              /* for messages */
    pthread_mutex_t mu;      /* one caller at a time on the connection */
    mem_store_fault_fn fault;
    void *fault_user;
    char repairs[512];       /* what open and mem_store_quarantine_bad_rows repaired ("" if nothing) */
};

/* ---- small helpers ------------------------------------------------------------ */

static int64_t now_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static is_status sql_err(mem_store *s, const char *what) {
    return is_error_set(IS_ERR_IO, "fact store %s: %s: %s", s->path, what, sqlite3_errmsg(s->db));
}

static char *dup_or_null(const unsigned char *t) { return t ? strdup((const char *)t) : NULL; }

const char *mem_event_name(mem_event e) {
    switch (e) {
    case MEM_EVENT_ADD: return "ADD";
    case MEM_EVENT_UPDATE: return "UPDATE";
    case MEM_EVENT_DELETE: return "DELETE";
    }
    return "?";
}

void mem_fact_clear(mem_fact *f) {
    if (!f) return;
    free(f->tenant);
    free(f->user);
    free(f->agent_id);
    free(f->run_id);
    free(f->text);
    free(f->metadata);
    free(f->source);
    free(f->embedding);
    for (int32_t i = 0; i < f->n_context; i++) free(f->context[i]);
    free(f->context);
    free(f->kv_record);
    memset(f, 0, sizeof *f);
}

void mem_facts_free(mem_fact *f, int32_t n) {
    if (!f) return;
    for (int32_t i = 0; i < n; i++) mem_fact_clear(&f[i]);
    free(f);
}

void mem_history_free(mem_history *h, int32_t n) {
    if (!h) return;
    for (int32_t i = 0; i < n; i++) {
        free(h[i].old_text);
        free(h[i].new_text);
    }
    free(h);
}

void mem_text_hash_hex(const char *text, char out[17]) {
    snprintf(out, 17, "%016llx", (unsigned long long)fact_text_hash(text, text ? strlen(text) : 0));
}

is_status mem_metadata_canonical(const char *json, char **out) {
    if (!json || !*json) {
        *out = NULL;
        return IS_OK;
    }
    cJSON *root = cJSON_Parse(json);
    if (!root) return is_error_set(IS_ERR_INVALID_ARG, "metadata is not valid JSON");
    is_status st = IS_OK;
    if (!cJSON_IsObject(root)) {
        st = is_error_set(IS_ERR_INVALID_ARG, "metadata is not a JSON object");
        goto done;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (cJSON_IsObject(it) || cJSON_IsArray(it)) {
            st = is_error_set(IS_ERR_INVALID_ARG,
                              "metadata key \"%s\": values must be strings, numbers, booleans "
                              "or null",
                              it->string);
            goto done;
        }
    }
    char *txt = cJSON_PrintUnformatted(root);
    if (!txt) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }
    *out = txt;
done:
    cJSON_Delete(root);
    return st;
}

/* True if the fact's metadata holds every (key, value) of the filter, with
 * the first of a repeated key counting (as the index does). */
static bool meta_matches(const char *metadata, const mem_filter *f) {
    if (f->n_meta <= 0) return true;
    if (!metadata) return false;
    cJSON *root = cJSON_Parse(metadata);
    if (!root) return false;
    bool ok = true;
    for (int32_t i = 0; i < f->n_meta && ok; i++) {
        const cJSON *it, *hit = NULL;
        cJSON_ArrayForEach(it, root) {
            if (strcmp(it->string, f->meta_keys[i]) == 0) {
                hit = it;
                break;
            }
        }
        char *v = hit ? metadata_scalar_string(hit) : NULL;
        ok = v && strcmp(v, f->meta_values[i]) == 0;
        free(v);
    }
    cJSON_Delete(root);
    return ok;
}

static char *context_to_json(char *const *ctx, int32_t n) {
    cJSON *arr = cJSON_CreateArray();
    if (!arr) return NULL;
    for (int32_t i = 0; i < n; i++) {
        cJSON *s = cJSON_CreateString(ctx[i] ? ctx[i] : "");
        if (!s) {
            cJSON_Delete(arr);
            return NULL;
        }
        cJSON_AddItemToArray(arr, s);
    }
    char *txt = cJSON_PrintUnformatted(arr);
    cJSON_Delete(arr);
    return txt;
}

static is_status context_from_json(const char *txt, mem_fact *f) {
    if (!txt || !*txt) return IS_OK;
    cJSON *arr = cJSON_Parse(txt);
    if (!cJSON_IsArray(arr)) {
        cJSON_Delete(arr);
        return is_error_set(IS_ERR_FORMAT, "fact %s: context column is not a JSON array", f->id);
    }
    int32_t n = cJSON_GetArraySize(arr);
    f->context = calloc((size_t)(n ? n : 1), sizeof *f->context);
    if (!f->context) {
        cJSON_Delete(arr);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        const char *v = cJSON_GetStringValue(it);
        if (!(f->context[f->n_context] = strdup(v ? v : ""))) {
            cJSON_Delete(arr);
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
        f->n_context++;
    }
    cJSON_Delete(arr);
    return IS_OK;
}

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

static void note_repair(mem_store *s, const char *fmt, const char *arg) {
    size_t l = strlen(s->repairs);
    if (l + 3 >= sizeof s->repairs) return;
    if (l) l += (size_t)snprintf(s->repairs + l, sizeof s->repairs - l, "; ");
    snprintf(s->repairs + l, sizeof s->repairs - l, fmt, arg);
}

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
        if (sqlite3_prepare_v2(s->db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
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
    snprintf(sql, sizeof sql,
             "BEGIN; %s"
             "INSERT OR IGNORE INTO tenants SELECT tenant, min(created_at) FROM facts GROUP BY tenant;"
             "INSERT OR IGNORE INTO users SELECT tenant, user_id, min(created_at) FROM facts "
             "GROUP BY tenant, user_id; COMMIT;",
             SCHEMA);
    char *err = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: recreating missing tables (%s): %s",
                                    s->path, missing, err ? err : "?");
        sqlite3_free(err);
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    note_repair(s, "recreated missing tables: %s", missing);
    return IS_OK;
}

is_status mem_store_open_readonly(const char *path, mem_store **out) {
    if (!path || !*path || !out) return is_error_set(IS_ERR_INVALID_ARG, "fact store: no path");
    mem_store *s = calloc(1, sizeof *s);
    if (!s || !(s->path = strdup(path))) {
        free(s);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&s->mu, NULL);
    int rc = sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: cannot open: %s", path,
                                    s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
        sqlite3_close(s->db);
        pthread_mutex_destroy(&s->mu);
        free(s->path);
        free(s);
        return st;
    }
    *out = s;
    return IS_OK;
}

is_status mem_store_open(const char *path, mem_store **out) {
    if (!path || !*path || !out) return is_error_set(IS_ERR_INVALID_ARG, "fact store: no path");
    mem_store *s = calloc(1, sizeof *s);
    if (!s || !(s->path = strdup(path))) {
        free(s);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&s->mu, NULL);
    is_status st = IS_OK;
    int rc = sqlite3_open_v2(path, &s->db,
                             SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        st = is_error_set(IS_ERR_IO, "fact store %s: cannot open: %s", path,
                          s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
        goto fail;
    }
    sqlite3_busy_timeout(s->db, 5000);
    char *err = NULL;
    /* journal_mode returns a row; exec ignores it. NOTADB shows up here. */
    rc = sqlite3_exec(s->db,
                      "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;",
                      NULL, NULL, &err);
    if (rc != SQLITE_OK) {
        st = is_error_set(rc == SQLITE_NOTADB || rc == SQLITE_CORRUPT ? IS_ERR_FORMAT : IS_ERR_IO,
                          "fact store %s: %s", path, err ? err : sqlite3_errstr(rc));
        sqlite3_free(err);
        goto fail;
    }
    sqlite3_stmt *q;
    int32_t version = -1;
    if (sqlite3_prepare_v2(s->db, "PRAGMA user_version", -1, &q, NULL) == SQLITE_OK) {
        if (sqlite3_step(q) == SQLITE_ROW) version = sqlite3_column_int(q, 0);
        sqlite3_finalize(q);
    }
    if (version < 0) {
        st = sql_err(s, "reading the schema version");
        goto fail;
    }
    if (version > MEM_STORE_SCHEMA_VERSION) {
        st = is_error_set(IS_ERR_FORMAT, "fact store %s: schema version %d is newer than this "
                                         "program's (%d)",
                          path, version, MEM_STORE_SCHEMA_VERSION);
        goto fail;
    }
    if (version == MEM_STORE_SCHEMA_VERSION && (st = repair_schema(s)) != IS_OK) goto fail;
    if (version == 0) {
        /* A database that holds tables but no version is someone else's. */
        int64_t n_tables = 0;
        if (sqlite3_prepare_v2(s->db, "SELECT count(*) FROM sqlite_master", -1, &q, NULL) ==
            SQLITE_OK) {
            if (sqlite3_step(q) == SQLITE_ROW) n_tables = sqlite3_column_int64(q, 0);
            sqlite3_finalize(q);
        }
        if (n_tables > 0) {
            st = is_error_set(IS_ERR_FORMAT, "fact store %s: a database but not a fact store "
                                             "(no schema version)",
                              path);
            goto fail;
        }
        char sql[4096];
        snprintf(sql, sizeof sql, "BEGIN; %s PRAGMA user_version=%d; COMMIT;", SCHEMA,
                 MEM_STORE_SCHEMA_VERSION);
        if (sqlite3_exec(s->db, sql, NULL, NULL, &err) != SQLITE_OK) {
            st = is_error_set(IS_ERR_IO, "fact store %s: creating the schema: %s", path,
                              err ? err : "?");
            sqlite3_free(err);
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            goto fail;
        }
    }
    *out = s;
    return IS_OK;
fail:
    sqlite3_close(s->db);
    pthread_mutex_destroy(&s->mu);
    free(s->path);
    free(s);
    return st;
}

void mem_store_close(mem_store *s) {
    if (!s) return;
    sqlite3_close(s->db); /* every statement is finalized by the function that made it */
    pthread_mutex_destroy(&s->mu);
    free(s->path);
    free(s);
}

void mem_store_set_fault_hook(mem_store *s, mem_store_fault_fn fn, void *user_data) {
    pthread_mutex_lock(&s->mu);
    s->fault = fn;
    s->fault_user = user_data;
    pthread_mutex_unlock(&s->mu);
}

/* ---- statements --------------------------------------------------------------- */

static is_status prepare(mem_store *s, const char *sql, sqlite3_stmt **q) {
    if (sqlite3_prepare_v2(s->db, sql, -1, q, NULL) != SQLITE_OK) return sql_err(s, "prepare");
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
    if (sqlite3_exec(s->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        is_status st = is_error_set(IS_ERR_IO, "fact store %s: %s: %s", s->path, sql,
                                    err ? err : sqlite3_errmsg(s->db));
        sqlite3_free(err);
        return st;
    }
    return IS_OK;
}

static is_status tx_begin(mem_store *s) { return exec(s, "BEGIN IMMEDIATE"); }

/* Commits when st is IS_OK (after the fault hook), else rolls back. */
static is_status tx_end(mem_store *s, is_status st) {
    if (st == IS_OK && s->fault && !s->fault(s->fault_user))
        st = is_error_set(IS_ERR_IO, "fact store %s: injected fault before commit", s->path);
    if (st == IS_OK) {
        st = exec(s, "COMMIT");
        if (st == IS_OK) return IS_OK;
    }
    sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return st;
}

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

#define FACT_COLUMNS                                                                           \
    "id, tenant, user_id, agent_id, run_id, text, metadata, created_at, updated_at, source, "  \
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
    is_status st = context_from_json((const char *)sqlite3_column_text(q, 11), f);
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

is_status mem_store_meta_get(mem_store *s, const char *key, char **value) {
    pthread_mutex_lock(&s->mu);
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
    pthread_mutex_unlock(&s->mu);
    return st;
}

is_status mem_store_meta_set(mem_store *s, const char *key, const char *value) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *q;
    is_status st = prepare(s, "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", &q);
    if (st == IS_OK) {
        bind_text(q, 1, key);
        bind_text(q, 2, value);
        st = step_done(s, q, "write meta");
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* ---- insert ---------------------------------------------------------------------- */

static is_status check_fact(const mem_fact *f) {
    if (!f || !f->id[0] || !f->tenant || !*f->tenant || !f->user || !*f->user || !f->text ||
        strlen(f->hash) != 16 || !f->embedding || f->dim <= 0 || f->version < 1)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fact store: a fact needs id, tenant, user, text, hash, embedding "
                            "and a version >= 1");
    return IS_OK;
}

is_status mem_store_insert(mem_store *s, const mem_fact *f) {
    is_status st = check_fact(f);
    if (st != IS_OK) return st;
    char *ctx = context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    int64_t now = now_unix_ms();
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *q = NULL;
    if ((st = tx_begin(s)) != IS_OK) goto out;
    if ((st = prepare(s, "INSERT OR IGNORE INTO tenants (id, created_at) VALUES (?, ?)", &q)) ==
        IS_OK) {
        bind_text(q, 1, f->tenant);
        sqlite3_bind_int64(q, 2, now);
        st = step_done(s, q, "insert tenant");
    }
    if (st == IS_OK &&
        (st = prepare(s, "INSERT OR IGNORE INTO users (tenant, user_id, created_at) VALUES (?, ?, ?)",
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
            else if (rc != SQLITE_DONE)
                st = sql_err(s, "look up fact id");
        }
    }
    if (st == IS_OK &&
        (st = prepare(s, "INSERT INTO facts (" FACT_COLUMNS ") VALUES "
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
    if (st == IS_OK) st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_ADD, NULL, f->text, now);
    st = tx_end(s, st);
out:
    pthread_mutex_unlock(&s->mu);
    free(ctx);
    return st;
}

/* ---- reads ------------------------------------------------------------------------- */

static is_status get_locked(mem_store *s, const char *tenant, const char *user, const char *id,
                            bool with_embedding, mem_fact *out) {
    sqlite3_stmt *q;
    is_status st = prepare(s,
                           "SELECT " FACT_COLUMNS
                           " FROM facts WHERE id = ? AND tenant = ? AND user_id = ?",
                           &q);
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

is_status mem_store_get(mem_store *s, const char *tenant, const char *user, const char *id,
                        bool with_embedding, mem_fact *out) {
    memset(out, 0, sizeof *out);
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: get needs tenant, user and id");
    pthread_mutex_lock(&s->mu);
    is_status st = get_locked(s, tenant, user, id, with_embedding, out);
    pthread_mutex_unlock(&s->mu);
    return st;
}

static is_status check_filter(const mem_filter *f) {
    if (!f || !f->tenant || !f->user || f->n_meta < 0 ||
        (f->n_meta > 0 && (!f->meta_keys || !f->meta_values)))
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: a filter needs tenant and user");
    for (int32_t i = 0; i < f->n_meta; i++)
        if (!f->meta_keys[i] || !f->meta_values[i])
            return is_error_set(IS_ERR_INVALID_ARG, "fact store: NULL metadata filter key or value");
    return IS_OK;
}

static is_status list_locked(mem_store *s, const mem_filter *f, bool with_embedding,
                             mem_fact **out, int32_t *n_out) {
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
        if (!meta_matches((const char *)meta, f)) continue;
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

is_status mem_store_list(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                         int32_t *n) {
    is_status st = check_filter(f);
    if (st != IS_OK) return st;
    pthread_mutex_lock(&s->mu);
    st = list_locked(s, f, with_embedding, out, n);
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* ---- update ------------------------------------------------------------------------ */

is_status mem_store_update(mem_store *s, const mem_fact *f, int32_t expected_version) {
    is_status st = check_fact(f);
    if (st != IS_OK) return st;
    char *ctx = context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    int64_t now = now_unix_ms();
    pthread_mutex_lock(&s->mu);
    mem_fact old = {0};
    if ((st = tx_begin(s)) != IS_OK) goto out;
    st = get_locked(s, f->tenant, f->user, f->id, false, &old);
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
    st = tx_end(s, st);
out:
    pthread_mutex_unlock(&s->mu);
    mem_fact_clear(&old);
    free(ctx);
    return st;
}

is_status mem_store_set_kv(mem_store *s, const char *id, int32_t version, const char *kv_record) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *q;
    is_status st = prepare(s, "UPDATE facts SET kv_record = ? WHERE id = ? AND version = ?", &q);
    if (st == IS_OK) {
        bind_text(q, 1, kv_record);
        bind_text(q, 2, id);
        sqlite3_bind_int(q, 3, version);
        st = step_done(s, q, "set kv record");
        if (st == IS_OK && sqlite3_changes(s->db) == 0)
            st = is_error_set(IS_ERR_NOT_FOUND, "no memory %s at version %d", id, version);
    }
    pthread_mutex_unlock(&s->mu);
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

is_status mem_store_delete(mem_store *s, const char *tenant, const char *user, const char *id,
                           mem_fact *old) {
    if (old) memset(old, 0, sizeof *old);
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: delete needs tenant, user and id");
    int64_t now = now_unix_ms();
    pthread_mutex_lock(&s->mu);
    mem_fact row = {0};
    is_status st = tx_begin(s);
    if (st == IS_OK) {
        st = get_locked(s, tenant, user, id, false, &row);
        if (st == IS_OK) st = delete_row(s, &row, now);
        st = tx_end(s, st);
    }
    pthread_mutex_unlock(&s->mu);
    if (st == IS_OK && old) *old = row;
    else mem_fact_clear(&row);
    return st;
}

is_status mem_store_delete_all(mem_store *s, const mem_filter *f, mem_fact **deleted, int32_t *n) {
    is_status st = check_filter(f);
    if (st != IS_OK) return st;
    int64_t now = now_unix_ms();
    pthread_mutex_lock(&s->mu);
    mem_fact *rows = NULL;
    int32_t nr = 0;
    if ((st = tx_begin(s)) == IS_OK) {
        st = list_locked(s, f, false, &rows, &nr);
        for (int32_t i = 0; st == IS_OK && i < nr; i++) st = delete_row(s, &rows[i], now);
        st = tx_end(s, st);
    }
    pthread_mutex_unlock(&s->mu);
    if (st != IS_OK) {
        mem_facts_free(rows, nr);
        return st;
    }
    *deleted = rows;
    *n = nr;
    return IS_OK;
}

/* ---- history, sources, iteration ------------------------------------------------- */

is_status mem_store_history(mem_store *s, const char *tenant, const char *user, const char *id,
                            mem_history **out, int32_t *n_out) {
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: history needs tenant, user and id");
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *q;
    mem_history *h = NULL;
    int32_t n = 0, cap = 0;
    is_status st = prepare(s,
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
    pthread_mutex_unlock(&s->mu);
    if (st == IS_OK && n == 0) st = is_error_set(IS_ERR_NOT_FOUND, "no memory with id %s", id);
    if (st != IS_OK) {
        mem_history_free(h, n);
        return st;
    }
    *out = h;
    *n_out = n;
    return IS_OK;
}

is_status mem_store_find_source(mem_store *s, const char *tenant, const char *user,
                                const char *source, const char *hash,
                                char id_out[MEM_ID_MAX + 1]) {
    pthread_mutex_lock(&s->mu);
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
        else
            st = sql_err(s, "find source");
        sqlite3_finalize(q);
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

is_status mem_store_owner(mem_store *s, const char *tenant, const char *id, char **user) {
    if (!s || !tenant || !id || !user) return is_error_set(IS_ERR_INVALID_ARG, "mem_store_owner: NULL argument");
    pthread_mutex_lock(&s->mu);
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
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* The rows of one table, or `absent` where it cannot be counted (a
 * missing table among them). */
static int64_t count_rows(mem_store *s, const char *sql, int64_t absent) {
    pthread_mutex_lock(&s->mu);
    int64_t n = absent;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s->db, sql, -1, &q, NULL) == SQLITE_OK) {
        if (sqlite3_step(q) == SQLITE_ROW) n = sqlite3_column_int64(q, 0);
        sqlite3_finalize(q);
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

int64_t mem_store_count(mem_store *s) { return count_rows(s, "SELECT count(*) FROM facts", -1); }

is_status mem_store_foreach(mem_store *s, bool with_embedding, mem_store_fact_fn fn, void *ud) {
    pthread_mutex_lock(&s->mu);
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
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* ---- repair ----------------------------------------------------------------------- */

const char *mem_store_repairs(const mem_store *s) { return s->repairs; }

/* Why the current row (FACT_COLUMNS) cannot be served, or NULL if it can. */
static const char *row_problem(sqlite3_stmt *q, int32_t dim) {
    static const int text_cols[] = {0, 1, 2, 5, 10};
    for (size_t i = 0; i < sizeof text_cols / sizeof text_cols[0]; i++)
        if (sqlite3_column_type(q, text_cols[i]) != SQLITE_TEXT) return "a required text column is not text";
    const char *id = (const char *)sqlite3_column_text(q, 0);
    if (!id || !*id || strlen(id) > MEM_ID_MAX) return "bad id";
    if (sqlite3_column_int(q, 14) < 1) return "bad version";
    const char *text = (const char *)sqlite3_column_text(q, 5);
    char h[17];
    mem_text_hash_hex(text ? text : "", h);
    const char *hash = (const char *)sqlite3_column_text(q, 10);
    if (!hash || strcmp(hash, h) != 0) return "the text does not match its hash";
    if (sqlite3_column_type(q, 15) != SQLITE_BLOB) return "embedding is not a blob";
    const void *emb = sqlite3_column_blob(q, 15);
    int bytes = sqlite3_column_bytes(q, 15);
    if (!emb || bytes <= 0 || bytes % (int)sizeof(float) != 0 || (dim > 0 && bytes != dim * (int)sizeof(float)))
        return "embedding of the wrong size";
    for (int i = 0; i < bytes / (int)sizeof(float); i++) {
        float v;
        memcpy(&v, (const char *)emb + (size_t)i * sizeof v, sizeof v);
        if (!isfinite(v)) return "embedding not finite";
    }
    const char *ctx = (const char *)sqlite3_column_text(q, 11);
    if (ctx) {
        cJSON *j = cJSON_Parse(ctx);
        bool ok = cJSON_IsArray(j);
        cJSON_Delete(j);
        if (!ok) return "context is not a JSON array";
    }
    return NULL;
}

static is_status quarantine(mem_store *s, int32_t dim, bool move, int64_t *n_out);

is_status mem_store_quarantine_bad_rows(mem_store *s, int32_t dim, int64_t *n_out) {
    return quarantine(s, dim, true, n_out);
}

is_status mem_store_count_bad_rows(mem_store *s, int32_t dim, int64_t *n_out) {
    return quarantine(s, dim, false, n_out);
}

void mem_store_missing_tables(mem_store *s, char *out, size_t cap) {
    pthread_mutex_lock(&s->mu);
    find_missing_tables(s, out, cap);
    pthread_mutex_unlock(&s->mu);
}

is_status mem_store_integrity(mem_store *s, char *out, size_t cap) {
    pthread_mutex_lock(&s->mu);
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
    pthread_mutex_unlock(&s->mu);
    return st;
}

is_status mem_store_foreach_record(mem_store *s, mem_store_record_fn fn, void *ud) {
    pthread_mutex_lock(&s->mu);
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
    pthread_mutex_unlock(&s->mu);
    return st;
}

static is_status quarantine(mem_store *s, int32_t dim, bool move, int64_t *n_out) {
    if (n_out) *n_out = 0;
    pthread_mutex_lock(&s->mu);
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
        if (sqlite3_exec(s->db,
                         "BEGIN; CREATE TABLE IF NOT EXISTS facts_quarantine AS SELECT *, "
                         "'' AS reason, 0 AS quarantined_at FROM facts WHERE 0;",
                         NULL, NULL, &err) != SQLITE_OK) {
            st = is_error_set(IS_ERR_IO, "fact store %s: quarantine: %s", s->path, err ? err : "?");
            sqlite3_free(err);
        }
        sqlite3_stmt *ins = NULL, *del = NULL;
        if (st == IS_OK) st = prepare(s, "INSERT INTO facts_quarantine SELECT *, ?, ? FROM facts WHERE rowid = ?", &ins);
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
        if (st == IS_OK && sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
            st = sql_err(s, "commit the quarantine");
        if (st != IS_OK) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        if (st == IS_OK) {
            char msg[160];
            snprintf(msg, sizeof msg, "%lld bad rows moved to table facts_quarantine (first: %s)",
                     (long long)n, why[0]);
            note_repair(s, "%s", msg);
            if (n_out) *n_out = n;
        }
    }
    free(rowids);
    free(why);
    pthread_mutex_unlock(&s->mu);
    return st;
}

int64_t mem_store_count_history(mem_store *s) { return count_rows(s, "SELECT count(*) FROM history", -1); }

int64_t mem_store_count_quarantined(mem_store *s) {
    return count_rows(s, "SELECT count(*) FROM facts_quarantine", 0);
}

is_status mem_store_users(mem_store *s, const char *tenant, char ***out, int32_t *n_out) {
    if (!s || !tenant || !out || !n_out) return is_error_set(IS_ERR_INVALID_ARG, "mem_store_users: NULL argument");
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *q;
    char **u = NULL;
    int32_t n = 0, cap = 0;
    is_status st = prepare(s, "SELECT DISTINCT user_id FROM facts WHERE tenant = ? ORDER BY user_id", &q);
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
    pthread_mutex_unlock(&s->mu);
    if (st != IS_OK) {
        for (int32_t i = 0; i < n; i++) free(u[i]);
        free(u);
        return st;
    }
    *out = u;
    *n_out = n;
    return IS_OK;
}

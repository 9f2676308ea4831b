/*
 * store_pg: the fact store in a PostgreSQL database (memory/store.h), the
 * shared record store of several serving nodes. Same tables, same
 * semantics and same results as the SQLite store, through libpq.
 *
 * Schema: the tables of store.h (embedding as bytea, times as bigint unix
 * ms, history.id a bigserial) plus schema_version (one row: the version).
 * MIGRATIONS[v] takes a database from version v to v + 1; open runs the
 * missing ones in one transaction under an advisory lock, so two nodes
 * that start together migrate once, and refuses a database whose version
 * is newer than this program's, or that holds a facts table with no
 * schema_version (someone else's table).
 *
 * Transactions: each mutating call is one transaction (READ COMMITTED);
 * where it reads a row it then changes (update, delete, delete_all) it
 * takes the row's lock first (SELECT ... FOR UPDATE), so a version checked
 * is still the version when it commits, whichever node writes. A commit
 * returns once the server made it durable (synchronous_commit's default),
 * which is what the memory service's ordering needs.
 *
 * Changes: add, update and delete send pg_notify on the channel
 * inferscale_facts inside their transaction, so a change is announced
 * exactly when it commits. The payload is a JSON object
 * {"o": origin, "op": "add"|"update"|"delete", "t": tenant, "u": user,
 *  "id": id, "v": version, "r": the KV record the row named before}, where
 * origin names the mem_store that wrote it (its own watch skips it).
 *
 * Connections: one for the calls (a mutex serialises them), one more for a
 * watch. A call that finds its connection broken resets it first, so a
 * restarted server costs the calls made while it was down, not the node.
 */
#include "memory/store.h"

#include "core/status.h"
#include "memory/store_impl.h"

#ifdef IS_HAVE_LIBPQ

#include <cjson/cJSON.h>
#include <libpq-fe.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PG_CHANNEL    "inferscale_facts"
#define PG_MAX_PARAMS 20

typedef struct pg_store {
    mem_store base; /* first: a mem_store * is a pg_store * */
    PGconn *conn;
    char *url;       /* to open the watch's connection */
    char where[160]; /* "postgres db@host" for messages (no password) */
    char origin[17]; /* this store's name in the changes it announces */
    bool readonly;
    pthread_mutex_t mu; /* one caller at a time on conn */
    /* the watch */
    pthread_t watch_thread;
    bool watching;
    atomic_bool stop;
    mem_store_change_fn watch_fn;
    void *watch_ud;
} pg_store;

#define PG(s) ((pg_store *)(s))

/* ---- parameters and results ------------------------------------------------------ */

typedef struct pq_params {
    const char *v[PG_MAX_PARAMS];
    int len[PG_MAX_PARAMS];
    int fmt[PG_MAX_PARAMS];
    char num[PG_MAX_PARAMS][24];
    int n;
} pq_params;

static void p_text(pq_params *p, const char *t) {
    p->v[p->n] = t;
    p->len[p->n] = 0;
    p->fmt[p->n] = 0;
    p->n++;
}

static void p_int(pq_params *p, int64_t x) {
    snprintf(p->num[p->n], sizeof p->num[0], "%lld", (long long)x);
    p_text(p, p->num[p->n]);
}

static void p_bin(pq_params *p, const void *b, int len) {
    p->v[p->n] = b;
    p->len[p->n] = len;
    p->fmt[p->n] = 1;
    p->n++;
}

/* A failed result's SQLSTATE ("" if none). */
static const char *sqlstate(const PGresult *r) {
    const char *c = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
    return c ? c : "";
}

static is_status pg_err(mem_store *s, const PGresult *r, const char *what) {
    const char *m = r ? PQresultErrorMessage(r) : NULL;
    if (!m || !*m) m = PQerrorMessage(PG(s)->conn);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", m ? m : "?");
    size_t l = strlen(msg);
    while (l && (msg[l - 1] == '\n' || msg[l - 1] == ' ')) msg[--l] = '\0';
    return is_error_set(IS_ERR_IO, "fact store %s: %s: %s", PG(s)->where, what, msg);
}

/* Runs sql; *out (PQclear it) gets the result, also of a failure (for its
 * SQLSTATE). Without parameters sql may hold several statements (the
 * migrations). */
static PGresult *exec_once(mem_store *s, const char *sql, const pq_params *p) {
    return p ? PQexecParams(PG(s)->conn, sql, p->n, NULL, p->v, p->len, p->fmt, 0)
             : PQexec(PG(s)->conn, sql);
}

static is_status run(mem_store *s, const char *sql, const pq_params *p, const char *what,
                     PGresult **out) {
    bool outside_tx = PQtransactionStatus(PG(s)->conn) == PQTRANS_IDLE;
    PGresult *r = exec_once(s, sql, p);
    ExecStatusType es = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    if (es != PGRES_COMMAND_OK && es != PGRES_TUPLES_OK && outside_tx &&
        PQstatus(PG(s)->conn) == CONNECTION_BAD) {
        /* The server went away since the last call (a restart, a failover):
         * a statement outside a transaction is tried once more on a new
         * connection; inside one, the transaction is lost and fails. */
        PQclear(r);
        PQreset(PG(s)->conn);
        r = exec_once(s, sql, p);
        es = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    }
    if (es != PGRES_COMMAND_OK && es != PGRES_TUPLES_OK) {
        is_status st = pg_err(s, r, what);
        if (out) *out = r; /* the caller reads its SQLSTATE */
        else PQclear(r);
        return st;
    }
    if (out) *out = r;
    else PQclear(r);
    return IS_OK;
}

static is_status run0(mem_store *s, const char *sql, const pq_params *p, const char *what) {
    return run(s, sql, p, what, NULL);
}

static char *col_dup(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col) ? NULL : strdup(PQgetvalue(r, row, col));
}

static int64_t col_i64(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col) ? 0 : strtoll(PQgetvalue(r, row, col), NULL, 10);
}

/* A call on a broken connection first tries to open it again. */
static void ensure_conn(mem_store *s) {
    if (PQstatus(PG(s)->conn) != CONNECTION_OK) PQreset(PG(s)->conn);
}

/* ---- transactions ------------------------------------------------------------------ */

/* store.c runs the write bodies below inside these. */
static void pg_lock(mem_store *s) {
    pthread_mutex_lock(&PG(s)->mu);
    ensure_conn(s);
}
static void pg_unlock(mem_store *s) { pthread_mutex_unlock(&PG(s)->mu); }
static is_status pg_begin(mem_store *s) { return run0(s, "BEGIN", NULL, "begin"); }
static is_status pg_commit(mem_store *s) { return run0(s, "COMMIT", NULL, "commit"); }
static void pg_rollback(mem_store *s) { PQclear(PQexec(PG(s)->conn, "ROLLBACK")); }

static is_status notify(mem_store *s, const char *op, const char *tenant, const char *user,
                        const char *id, int32_t version, const char *old_record) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return is_error_set(IS_ERR_NOMEM, "out of memory");
    cJSON_AddStringToObject(o, "o", PG(s)->origin);
    cJSON_AddStringToObject(o, "op", op);
    cJSON_AddStringToObject(o, "t", tenant);
    cJSON_AddStringToObject(o, "u", user);
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddNumberToObject(o, "v", version);
    if (old_record) cJSON_AddStringToObject(o, "r", old_record);
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!txt) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pq_params p = {0};
    p_text(&p, txt);
    is_status st = run0(s, "SELECT pg_notify('" PG_CHANNEL "', $1)", &p, "notify");
    free(txt);
    return st;
}

static is_status history_add(mem_store *s, const char *fact_id, const char *tenant,
                             const char *user, mem_event ev, const char *old_text,
                             const char *new_text, int64_t at) {
    pq_params p = {0};
    p_text(&p, fact_id);
    p_text(&p, tenant);
    p_text(&p, user);
    p_text(&p, mem_event_name(ev));
    p_text(&p, old_text);
    p_text(&p, new_text);
    p_int(&p, at);
    return run0(s,
                "INSERT INTO history (fact_id, tenant, user_id, event, old_text, new_text, at) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &p, "insert history");
}

/* ---- schema and migrations ------------------------------------------------------------- */

/* MIGRATIONS[v]: version v -> v + 1. */
static const char *const MIGRATIONS[] = {
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE tenants (id TEXT PRIMARY KEY, created_at BIGINT NOT NULL);"
    "CREATE TABLE users ("
    "  tenant TEXT NOT NULL REFERENCES tenants(id),"
    "  user_id TEXT NOT NULL,"
    "  created_at BIGINT NOT NULL,"
    "  PRIMARY KEY (tenant, user_id));"
    "CREATE TABLE facts ("
    "  id TEXT PRIMARY KEY,"
    "  tenant TEXT NOT NULL,"
    "  user_id TEXT NOT NULL,"
    "  agent_id TEXT,"
    "  run_id TEXT,"
    "  text TEXT NOT NULL,"
    "  metadata TEXT,"
    "  created_at BIGINT NOT NULL,"
    "  updated_at BIGINT NOT NULL,"
    "  source TEXT,"
    "  hash TEXT NOT NULL,"
    "  embedding BYTEA NOT NULL,"
    "  context TEXT,"
    "  kv_window INTEGER NOT NULL,"
    "  kv_record TEXT,"
    "  version INTEGER NOT NULL,"
    "  FOREIGN KEY (tenant, user_id) REFERENCES users(tenant, user_id));"
    "CREATE INDEX facts_by_user ON facts(tenant, user_id, created_at);"
    "CREATE INDEX facts_by_source ON facts(tenant, user_id, source, hash);"
    "CREATE TABLE history ("
    "  id BIGSERIAL PRIMARY KEY,"
    "  fact_id TEXT NOT NULL,"
    "  tenant TEXT NOT NULL,"
    "  user_id TEXT NOT NULL,"
    "  event TEXT NOT NULL CHECK (event IN ('ADD', 'UPDATE', 'DELETE')),"
    "  old_text TEXT,"
    "  new_text TEXT,"
    "  at BIGINT NOT NULL);"
    "CREATE INDEX history_by_fact ON history(fact_id);",
};
_Static_assert(sizeof MIGRATIONS / sizeof MIGRATIONS[0] == MEM_STORE_SCHEMA_VERSION,
               "one migration per schema version");

static const char *const TABLES[] = {"facts", "meta", "tenants", "users", "history"};

/* The version in schema_version (0 when the table is absent or empty), or -1 on error. */
static int32_t read_version(mem_store *s, bool *facts_exist) {
    PGresult *r = NULL;
    int32_t v = -1;
    if (run(s, "SELECT to_regclass('schema_version') IS NOT NULL, to_regclass('facts') IS NOT NULL",
            NULL, "read the schema version", &r) == IS_OK) {
        bool have = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
        *facts_exist = strcmp(PQgetvalue(r, 0, 1), "t") == 0;
        PQclear(r);
        r = NULL;
        if (!have) return 0;
        if (run(s, "SELECT coalesce(max(version), 0) FROM schema_version", NULL,
                "read the schema version", &r) == IS_OK)
            v = (int32_t)col_i64(r, 0, 0);
    }
    PQclear(r);
    return v;
}

static is_status migrate(mem_store *s) {
    is_status st = pg_begin(s);
    if (st != IS_OK) return st;
    /* One node migrates; the others wait here and then find it done. */
    st = run0(s, "SELECT pg_advisory_xact_lock(7303146025713)", NULL, "lock for the migration");
    bool facts_exist = false;
    int32_t v = st == IS_OK ? read_version(s, &facts_exist) : -1;
    if (st == IS_OK && v < 0) st = pg_err(s, NULL, "read the schema version");
    if (st == IS_OK && v > MEM_STORE_SCHEMA_VERSION)
        st = is_error_set(IS_ERR_FORMAT,
                          "fact store %s: schema version %d is newer than this "
                          "program's (%d)",
                          PG(s)->where, v, MEM_STORE_SCHEMA_VERSION);
    if (st == IS_OK && v == 0 && facts_exist)
        st = is_error_set(IS_ERR_FORMAT,
                          "fact store %s: the database has a facts table but no "
                          "schema_version: not a fact store",
                          PG(s)->where);
    if (st == IS_OK && v < MEM_STORE_SCHEMA_VERSION) {
        st = run0(s, "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)", NULL,
                  "create schema_version");
        for (int32_t i = v; st == IS_OK && i < MEM_STORE_SCHEMA_VERSION; i++)
            st = run0(s, MIGRATIONS[i], NULL, "migrate the schema");
        pq_params p = {0};
        p_int(&p, MEM_STORE_SCHEMA_VERSION);
        if (st == IS_OK) st = run0(s, "DELETE FROM schema_version", NULL, "set the version");
        if (st == IS_OK)
            st = run0(s, "INSERT INTO schema_version (version) VALUES ($1)", &p, "set the version");
    }
    if (st != IS_OK) {
        PQclear(PQexec(PG(s)->conn, "ROLLBACK"));
        return st;
    }
    return run0(s, "COMMIT", NULL, "commit the migration");
}

/* ---- open / close ------------------------------------------------------------------------ */

static const mem_store_ops PG_OPS;

static void quiet_notices(void *arg, const char *message) { (void)arg, (void)message; }

static void make_origin(char out[17]) {
    static atomic_uint_fast64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 16) ^
                 (atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull);
    FILE *f = fopen("/dev/urandom", "rb");
    uint64_t r = 0;
    if (f) {
        if (fread(&r, sizeof r, 1, f) == 1) x ^= r;
        fclose(f);
    }
    snprintf(out, 17, "%016llx", (unsigned long long)x);
}

static void pg_close(mem_store *s) {
    if (!s) return;
    if (PG(s)->watching) {
        atomic_store(&PG(s)->stop, true);
        pthread_join(PG(s)->watch_thread, NULL);
    }
    PQfinish(PG(s)->conn);
    pthread_mutex_destroy(&PG(s)->mu);
    free(PG(s)->url);
    free(s);
}

is_status store_pg_open(const char *url, bool readonly, mem_store **out) {
    mem_store *s = calloc(1, sizeof(pg_store));
    if (!s || !(PG(s)->url = strdup(url))) {
        free(s);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    s->ops = &PG_OPS;
    s->where = PG(s)->where;
    pthread_mutex_init(&PG(s)->mu, NULL);
    PG(s)->readonly = readonly;
    make_origin(PG(s)->origin);
    snprintf(PG(s)->where, sizeof PG(s)->where, "postgres (%s)", "connecting");
    is_status st = IS_OK;
    PG(s)->conn = PQconnectdb(url);
    if (!PG(s)->conn || PQstatus(PG(s)->conn) != CONNECTION_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s",
                 PG(s)->conn ? PQerrorMessage(PG(s)->conn) : "out of memory");
        size_t l = strlen(msg);
        while (l && (msg[l - 1] == '\n' || msg[l - 1] == ' ')) msg[--l] = '\0';
        st = is_error_set(IS_ERR_IO, "fact store: cannot connect to PostgreSQL: %s", msg);
        goto fail;
    }
    const char *host = PQhost(PG(s)->conn);
    snprintf(PG(s)->where, sizeof PG(s)->where, "postgres %s@%s", PQdb(PG(s)->conn),
             host && *host ? host : "local");
    PQsetNoticeProcessor(PG(s)->conn, quiet_notices, NULL);
    if (readonly) {
        bool facts_exist = false;
        int32_t v = read_version(s, &facts_exist);
        if (v < 0) st = pg_err(s, NULL, "read the schema version");
        else if (v > MEM_STORE_SCHEMA_VERSION || (v == 0 && facts_exist))
            st = is_error_set(IS_ERR_FORMAT,
                              "fact store %s: schema version %d is not this "
                              "program's (%d)",
                              PG(s)->where, v, MEM_STORE_SCHEMA_VERSION);
        if (st == IS_OK)
            st = run0(s, "SET default_transaction_read_only = on", NULL, "set read-only");
    } else {
        st = migrate(s);
    }
    if (st != IS_OK) goto fail;
    *out = s;
    return IS_OK;
fail:
    pg_close(s);
    return st;
}

/* ---- rows ------------------------------------------------------------------------------------- */

/* Columns 0..14 as in the SQLite store, 15 the embedding's bytes, 16 the
 * embedding itself (NULL unless asked for). */
#define COLS_BASE                                                                                  \
    "id, tenant, user_id, agent_id, run_id, text, metadata, created_at, updated_at, source, "      \
    "hash, context, kv_window, kv_record, version, octet_length(embedding)"
#define COLS_EMB   COLS_BASE ", embedding"
#define COLS_NOEMB COLS_BASE ", NULL::bytea"

static is_status row_to_fact(const PGresult *r, int row, bool with_embedding, mem_fact *f) {
    memset(f, 0, sizeof *f);
    snprintf(f->id, sizeof f->id, "%s", PQgetvalue(r, row, 0));
    f->tenant = col_dup(r, row, 1);
    f->user = col_dup(r, row, 2);
    f->agent_id = col_dup(r, row, 3);
    f->run_id = col_dup(r, row, 4);
    f->text = col_dup(r, row, 5);
    f->metadata = col_dup(r, row, 6);
    f->created_at = col_i64(r, row, 7);
    f->updated_at = col_i64(r, row, 8);
    f->source = col_dup(r, row, 9);
    snprintf(f->hash, sizeof f->hash, "%s", PQgetvalue(r, row, 10));
    is_status st =
        store_context_from_json(PQgetisnull(r, row, 11) ? NULL : PQgetvalue(r, row, 11), f);
    f->kv_window = (int32_t)col_i64(r, row, 12);
    f->kv_record = col_dup(r, row, 13);
    f->version = (int32_t)col_i64(r, row, 14);
    int64_t bytes = col_i64(r, row, 15);
    f->dim = (int32_t)(bytes / (int64_t)sizeof(float));
    if (st == IS_OK && (!f->tenant || !f->user || !f->text))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK && with_embedding) {
        size_t n = 0;
        unsigned char *b = PQgetisnull(r, row, 16)
                               ? NULL
                               : PQunescapeBytea((const unsigned char *)PQgetvalue(r, row, 16), &n);
        if (!b || n == 0 || n % sizeof(float) != 0) {
            st = is_error_set(IS_ERR_FORMAT, "fact %s: embedding of %zu bytes", f->id, n);
        } else if (!(f->embedding = malloc(n))) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
        } else {
            memcpy(f->embedding, b, n);
            f->dim = (int32_t)(n / sizeof(float));
        }
        PQfreemem(b);
    }
    if (st != IS_OK) mem_fact_clear(f);
    return st;
}

/* ---- meta --------------------------------------------------------------------------------------- */

static is_status pg_meta_get(mem_store *s, const char *key, char **value) {
    pq_params p = {0};
    p_text(&p, key);
    PGresult *r = NULL;
    is_status st = run(s, "SELECT value FROM meta WHERE key = $1", &p, "read meta", &r);
    if (st == IS_OK && PQntuples(r) == 0)
        st = is_error_set(IS_ERR_NOT_FOUND, "fact store: no setting '%s'", key);
    else if (st == IS_OK && !(*value = col_dup(r, 0, 0)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    PQclear(r);
    return st;
}

static is_status pg_meta_set(mem_store *s, const char *key, const char *value) {
    pq_params p = {0};
    p_text(&p, key);
    p_text(&p, value);
    is_status st = run0(s,
                        "INSERT INTO meta (key, value) VALUES ($1, $2) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                        &p, "write meta");
    return st;
}

/* ---- insert ------------------------------------------------------------------------------------- */

static is_status pg_insert(mem_store *s, const mem_fact *f, int64_t now) {
    char *ctx = store_context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pq_params p = {0};
    p_text(&p, f->tenant);
    p_int(&p, now);
    is_status st =
        run0(s, "INSERT INTO tenants (id, created_at) VALUES ($1, $2) ON CONFLICT DO NOTHING", &p,
             "insert tenant");
    if (st == IS_OK) {
        p = (pq_params){0};
        p_text(&p, f->tenant);
        p_text(&p, f->user);
        p_int(&p, now);
        st = run0(s,
                  "INSERT INTO users (tenant, user_id, created_at) VALUES ($1, $2, $3) "
                  "ON CONFLICT DO NOTHING",
                  &p, "insert user");
    }
    if (st == IS_OK) {
        /* A duplicate id is the caller's error, not an I/O failure. */
        p = (pq_params){0};
        p_text(&p, f->id);
        PGresult *r = NULL;
        st = run(s, "SELECT 1 FROM facts WHERE id = $1", &p, "look up fact id", &r);
        if (st == IS_OK && PQntuples(r) > 0)
            st = is_error_set(IS_ERR_INVALID_ARG, "fact store: fact id %s exists already", f->id);
        PQclear(r);
    }
    if (st == IS_OK) {
        p = (pq_params){0};
        p_text(&p, f->id);
        p_text(&p, f->tenant);
        p_text(&p, f->user);
        p_text(&p, f->agent_id);
        p_text(&p, f->run_id);
        p_text(&p, f->text);
        p_text(&p, f->metadata);
        p_int(&p, f->created_at ? f->created_at : now);
        p_int(&p, f->updated_at ? f->updated_at : now);
        p_text(&p, f->source);
        p_text(&p, f->hash);
        p_text(&p, ctx);
        p_int(&p, f->kv_window);
        p_text(&p, f->kv_record);
        p_int(&p, f->version);
        p_bin(&p, f->embedding, f->dim * (int)sizeof(float));
        PGresult *r = NULL;
        st = run(s,
                 "INSERT INTO facts (id, tenant, user_id, agent_id, run_id, text, metadata, "
                 "created_at, updated_at, source, hash, context, kv_window, kv_record, version, "
                 "embedding) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, "
                 "$15, $16)",
                 &p, "insert fact", &r);
        /* Another node inserted the same id meanwhile. */
        if (st != IS_OK && strcmp(sqlstate(r), "23505") == 0)
            st = is_error_set(IS_ERR_INVALID_ARG, "fact store: fact id %s exists already", f->id);
        PQclear(r);
    }
    if (st == IS_OK)
        st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_ADD, NULL, f->text, now);
    if (st == IS_OK) st = notify(s, "add", f->tenant, f->user, f->id, f->version, NULL);
    free(ctx);
    return st;
}

/* ---- reads ---------------------------------------------------------------------------------------- */

static is_status get_locked(mem_store *s, const char *tenant, const char *user, const char *id,
                            bool with_embedding, bool for_update, mem_fact *out) {
    char sql[512];
    snprintf(sql, sizeof sql,
             "SELECT %s FROM facts WHERE id = $1 AND tenant = $2 AND user_id = $3%s",
             with_embedding ? COLS_EMB : COLS_NOEMB, for_update ? " FOR UPDATE" : "");
    pq_params p = {0};
    p_text(&p, id);
    p_text(&p, tenant);
    p_text(&p, user);
    PGresult *r = NULL;
    is_status st = run(s, sql, &p, "read fact", &r);
    if (st == IS_OK && PQntuples(r) == 0)
        st = is_error_set(IS_ERR_NOT_FOUND, "no memory with id %s", id);
    else if (st == IS_OK) st = row_to_fact(r, 0, with_embedding, out);
    PQclear(r);
    return st;
}

static is_status pg_get(mem_store *s, const char *tenant, const char *user, const char *id,
                        bool with_embedding, mem_fact *out) {
    is_status st = get_locked(s, tenant, user, id, with_embedding, false, out);
    return st;
}

/* ids as a PostgreSQL text[] literal: every element quoted, with " and \
 * escaped (free() it). */
static char *text_array(const char *const *ids, int32_t n) {
    size_t cap = 3;
    for (int32_t i = 0; i < n; i++) cap += 2 * strlen(ids[i]) + 3;
    char *out = malloc(cap), *p = out;
    if (!out) return NULL;
    *p++ = '{';
    for (int32_t i = 0; i < n; i++) {
        if (i) *p++ = ',';
        *p++ = '"';
        for (const char *c = ids[i]; *c; c++) {
            if (*c == '"' || *c == '\\') *p++ = '\\';
            *p++ = *c;
        }
        *p++ = '"';
    }
    *p++ = '}';
    *p = '\0';
    return out;
}

static is_status pg_get_many(mem_store *s, const char *tenant, const char *user,
                             const char *const *ids, int32_t n, mem_fact *out, bool *found) {
    char *arr = text_array(ids, n);
    if (!arr) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pq_params p = {0};
    p_text(&p, tenant);
    p_text(&p, user);
    p_text(&p, arr);
    PGresult *r = NULL;
    is_status st = run(s,
                       "SELECT " COLS_NOEMB " FROM facts WHERE tenant = $1 AND user_id = $2 "
                       "AND id = ANY($3::text[])",
                       &p, "read facts", &r);
    free(arr);
    int rows = st == IS_OK ? PQntuples(r) : 0;
    for (int row = 0; st == IS_OK && row < rows; row++) {
        const char *id = PQgetvalue(r, row, 0);
        for (int32_t i = 0; i < n; i++) {
            /* An id asked for twice gets its row twice. */
            if (found[i] || strcmp(ids[i], id) != 0) continue;
            if ((st = row_to_fact(r, row, false, &out[i])) != IS_OK) break;
            found[i] = true;
        }
    }
    PQclear(r);
    return st; /* store.c clears out and found on failure */
}

/* Ids compare bytewise (COLLATE "C"), as SQLite compares them. */
static is_status list_locked(mem_store *s, const mem_filter *f, bool with_embedding,
                             bool for_update, mem_fact **out, int32_t *n_out) {
    char sql[768];
    snprintf(sql, sizeof sql,
             "SELECT %s FROM facts WHERE tenant = $1 AND user_id = $2 "
             "AND ($3::text IS NULL OR agent_id = $3) AND ($4::text IS NULL OR run_id = $4) "
             "ORDER BY created_at, id COLLATE \"C\"%s",
             with_embedding ? COLS_EMB : COLS_NOEMB, for_update ? " FOR UPDATE" : "");
    pq_params p = {0};
    p_text(&p, f->tenant);
    p_text(&p, f->user);
    p_text(&p, f->agent_id);
    p_text(&p, f->run_id);
    PGresult *r = NULL;
    is_status st = run(s, sql, &p, "list facts", &r);
    if (st != IS_OK) {
        PQclear(r);
        return st;
    }
    int rows = PQntuples(r);
    mem_fact *facts = rows ? calloc((size_t)rows, sizeof *facts) : NULL;
    int32_t n = 0;
    if (rows && !facts) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int i = 0; st == IS_OK && i < rows; i++) {
        if (!store_meta_matches(PQgetisnull(r, i, 6) ? NULL : PQgetvalue(r, i, 6), f)) continue;
        if ((st = row_to_fact(r, i, with_embedding, &facts[n])) != IS_OK) break;
        n++;
    }
    PQclear(r);
    if (st != IS_OK) {
        mem_facts_free(facts, n);
        return st;
    }
    if (n == 0) {
        free(facts);
        facts = NULL;
    }
    *out = facts;
    *n_out = n;
    return IS_OK;
}

static is_status pg_list(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                         int32_t *n) {
    is_status st = list_locked(s, f, with_embedding, false, out, n);
    return st;
}

/* ---- update ------------------------------------------------------------------------------------------ */

static is_status pg_update(mem_store *s, const mem_fact *f, int32_t expected_version, int64_t now) {
    char *ctx = store_context_to_json(f->context, f->n_context);
    if (!ctx) return is_error_set(IS_ERR_NOMEM, "out of memory");
    mem_fact old = {0};
    /* The row's lock: a concurrent update on another node waits for our
     * commit and then sees the version we wrote. */
    is_status st = get_locked(s, f->tenant, f->user, f->id, false, true, &old);
    if (st == IS_OK && old.version != expected_version)
        st = is_error_set(IS_ERR_MISMATCH, "memory %s changed meanwhile (version %d, expected %d)",
                          f->id, old.version, expected_version);
    if (st == IS_OK) {
        pq_params p = {0};
        p_text(&p, f->text);
        p_text(&p, f->metadata);
        p_text(&p, f->hash);
        p_bin(&p, f->embedding, f->dim * (int)sizeof(float));
        p_text(&p, ctx);
        p_int(&p, f->kv_window);
        p_text(&p, f->kv_record);
        p_int(&p, f->version);
        p_int(&p, now);
        p_text(&p, f->id);
        p_text(&p, f->tenant);
        p_text(&p, f->user);
        st = run0(s,
                  "UPDATE facts SET text = $1, metadata = $2, hash = $3, embedding = $4, "
                  "context = $5, kv_window = $6, kv_record = $7, version = $8, updated_at = $9 "
                  "WHERE id = $10 AND tenant = $11 AND user_id = $12",
                  &p, "update fact");
    }
    if (st == IS_OK)
        st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_UPDATE, old.text, f->text, now);
    if (st == IS_OK) st = notify(s, "update", f->tenant, f->user, f->id, f->version, old.kv_record);
    mem_fact_clear(&old);
    free(ctx);
    return st;
}

static is_status pg_set_kv(mem_store *s, const char *id, int32_t version, const char *kv_record) {
    pq_params p = {0};
    p_text(&p, kv_record);
    p_text(&p, id);
    p_int(&p, version);
    PGresult *r = NULL;
    is_status st = run(s, "UPDATE facts SET kv_record = $1 WHERE id = $2 AND version = $3", &p,
                       "set kv record", &r);
    if (st == IS_OK && strcmp(PQcmdTuples(r), "0") == 0)
        st = is_error_set(IS_ERR_NOT_FOUND, "no memory %s at version %d", id, version);
    PQclear(r);
    return st;
}

/* ---- delete ------------------------------------------------------------------------------------------ */

static is_status delete_row(mem_store *s, const mem_fact *f, int64_t now) {
    pq_params p = {0};
    p_text(&p, f->id);
    p_text(&p, f->tenant);
    p_text(&p, f->user);
    is_status st = run0(s, "DELETE FROM facts WHERE id = $1 AND tenant = $2 AND user_id = $3", &p,
                        "delete fact");
    if (st == IS_OK)
        st = history_add(s, f->id, f->tenant, f->user, MEM_EVENT_DELETE, f->text, NULL, now);
    if (st == IS_OK) st = notify(s, "delete", f->tenant, f->user, f->id, 0, f->kv_record);
    return st;
}

/* The rows are locked (FOR UPDATE) before they are deleted. */
static is_status pg_delete(mem_store *s, const char *tenant, const char *user, const char *id,
                           mem_fact *row, int64_t now) {
    is_status st = get_locked(s, tenant, user, id, false, true, row);
    return st != IS_OK ? st : delete_row(s, row, now);
}

static is_status pg_delete_all(mem_store *s, const mem_filter *f, mem_fact **rows, int32_t *n,
                               int64_t now) {
    is_status st = list_locked(s, f, false, true, rows, n);
    for (int32_t i = 0; st == IS_OK && i < *n; i++) st = delete_row(s, &(*rows)[i], now);
    return st;
}

/* ---- history, sources, owners, users --------------------------------------------------------------- */

static is_status pg_history(mem_store *s, const char *tenant, const char *user, const char *id,
                            mem_history **out, int32_t *n_out) {
    pq_params p = {0};
    p_text(&p, id);
    p_text(&p, tenant);
    p_text(&p, user);
    PGresult *r = NULL;
    is_status st = run(s,
                       "SELECT id, event, old_text, new_text, at FROM history WHERE fact_id = $1 "
                       "AND tenant = $2 AND user_id = $3 ORDER BY id",
                       &p, "read history", &r);
    int32_t n = st == IS_OK ? PQntuples(r) : 0;
    mem_history *h = NULL;
    if (st == IS_OK && n == 0) st = is_error_set(IS_ERR_NOT_FOUND, "no memory with id %s", id);
    if (st == IS_OK && !(h = calloc((size_t)n, sizeof *h)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == IS_OK && i < n; i++) {
        mem_history *e = &h[i];
        e->id = col_i64(r, i, 0);
        snprintf(e->fact_id, sizeof e->fact_id, "%s", id);
        const char *ev = PQgetvalue(r, i, 1);
        e->event = strcmp(ev, "ADD") == 0      ? MEM_EVENT_ADD
                   : strcmp(ev, "UPDATE") == 0 ? MEM_EVENT_UPDATE
                                               : MEM_EVENT_DELETE;
        e->old_text = col_dup(r, i, 2);
        e->new_text = col_dup(r, i, 3);
        e->at = col_i64(r, i, 4);
    }
    PQclear(r);
    if (st != IS_OK) {
        mem_history_free(h, h ? n : 0);
        return st;
    }
    *out = h;
    *n_out = n;
    return IS_OK;
}

static is_status pg_find_source(mem_store *s, const char *tenant, const char *user,
                                const char *source, const char *hash, char id_out[MEM_ID_MAX + 1]) {
    pq_params p = {0};
    p_text(&p, tenant);
    p_text(&p, user);
    p_text(&p, source);
    p_text(&p, hash);
    PGresult *r = NULL;
    is_status st = run(s,
                       "SELECT id FROM facts WHERE tenant = $1 AND user_id = $2 AND source = $3 "
                       "AND hash = $4 LIMIT 1",
                       &p, "find source", &r);
    if (st == IS_OK && PQntuples(r) == 0)
        st = is_error_set(IS_ERR_NOT_FOUND, "no memory from source %s", source ? source : "");
    else if (st == IS_OK) snprintf(id_out, MEM_ID_MAX + 1, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
    return st;
}

static is_status pg_owner(mem_store *s, const char *tenant, const char *id, char **user) {
    pq_params p = {0};
    p_text(&p, id);
    p_text(&p, tenant);
    PGresult *r = NULL;
    is_status st =
        run(s,
            "SELECT user_id, 0 AS o FROM facts WHERE id = $1 AND tenant = $2 "
            "UNION ALL SELECT user_id, 1 FROM history WHERE fact_id = $1 AND tenant = $2 "
            "ORDER BY o LIMIT 1",
            &p, "owner", &r);
    if (st == IS_OK && PQntuples(r) == 0) st = is_error_set(IS_ERR_NOT_FOUND, "no memory %s", id);
    else if (st == IS_OK && !(*user = col_dup(r, 0, 0)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    PQclear(r);
    return st;
}

static is_status pg_users(mem_store *s, const char *tenant, char ***out, int32_t *n_out) {
    pq_params p = {0};
    p_text(&p, tenant);
    PGresult *r = NULL;
    is_status st = run(s,
                       "SELECT user_id FROM facts WHERE tenant = $1 GROUP BY user_id "
                       "ORDER BY user_id COLLATE \"C\"",
                       &p, "list users", &r);
    int32_t n = st == IS_OK ? PQntuples(r) : 0;
    char **u = NULL;
    if (n > 0 && !(u = calloc((size_t)n, sizeof *u)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == IS_OK && i < n; i++)
        if (!(u[i] = col_dup(r, i, 0))) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    PQclear(r);
    if (st != IS_OK) {
        for (int32_t i = 0; u && i < n; i++) free(u[i]);
        free(u);
        return st;
    }
    *out = u;
    *n_out = n;
    return IS_OK;
}

/* ---- scans -------------------------------------------------------------------------------------------- */

/* Runs a query in single-row mode and calls row_fn on each row, so a scan
 * of every fact holds one row in memory at a time. */
typedef is_status (*row_fn)(mem_store *s, const PGresult *r, void *ud);

static is_status scan(mem_store *s, const char *sql, row_fn fn, void *ud, const char *what) {
    PGconn *c = PG(s)->conn;
    if (!PQsendQueryParams(c, sql, 0, NULL, NULL, NULL, NULL, 0) || !PQsetSingleRowMode(c))
        return pg_err(s, NULL, what);
    is_status st = IS_OK;
    PGresult *r;
    while ((r = PQgetResult(c)) != NULL) {
        ExecStatusType es = PQresultStatus(r);
        if (es == PGRES_SINGLE_TUPLE) {
            if (st == IS_OK) st = fn(s, r, ud); /* after a failure, drain the rest */
        } else if (es != PGRES_TUPLES_OK && st == IS_OK) {
            st = pg_err(s, r, what);
        }
        PQclear(r);
    }
    return st;
}

typedef struct foreach_ctx {
    bool with_embedding;
    mem_store_fact_fn fn;
    void *ud;
} foreach_ctx;

static is_status foreach_row(mem_store *s, const PGresult *r, void *ud) {
    foreach_ctx *c = ud;
    mem_fact f;
    is_status st = row_to_fact(r, 0, c->with_embedding, &f);
    if (st != IS_OK) return st;
    st = c->fn(&f, c->ud);
    mem_fact_clear(&f);
    return st;
}

static is_status pg_foreach(mem_store *s, bool with_embedding, mem_store_fact_fn fn, void *ud) {
    foreach_ctx c = {with_embedding, fn, ud};
    is_status st =
        scan(s,
             with_embedding ? "SELECT " COLS_EMB " FROM facts ORDER BY id COLLATE \"C\""
                            : "SELECT " COLS_NOEMB " FROM facts ORDER BY id COLLATE \"C\"",
             foreach_row, &c, "scan facts");
    return st;
}

typedef struct record_ctx {
    mem_store_record_fn fn;
    void *ud;
} record_ctx;

static is_status record_row(mem_store *s, const PGresult *r, void *ud) {
    record_ctx *c = ud;
    return PQgetisnull(r, 0, 0) ? IS_OK : c->fn(PQgetvalue(r, 0, 0), c->ud);
}

static is_status pg_foreach_record(mem_store *s, mem_store_record_fn fn, void *ud) {
    record_ctx c = {fn, ud};
    is_status st = scan(s, "SELECT kv_record FROM facts WHERE kv_record IS NOT NULL", record_row,
                        &c, "scan records");
    return st;
}

static int64_t count_sql(mem_store *s, const char *sql, int64_t absent) {
    PGresult *r = NULL;
    int64_t n = absent;
    if (run(s, sql, NULL, "count", &r) == IS_OK && PQntuples(r) == 1) n = col_i64(r, 0, 0);
    PQclear(r);
    return n;
}

static int64_t pg_count(mem_store *s) { return count_sql(s, "SELECT count(*) FROM facts", -1); }
static int64_t pg_count_history(mem_store *s) {
    return count_sql(s, "SELECT count(*) FROM history", -1);
}
static int64_t pg_count_quarantined(mem_store *s) {
    if (count_sql(s, "SELECT (to_regclass('facts_quarantine') IS NOT NULL)::int", 0) == 0) return 0;
    return count_sql(s, "SELECT count(*) FROM facts_quarantine", 0);
}

/* ---- repair ------------------------------------------------------------------------------------------- */

typedef struct bad_rows {
    int32_t dim;
    char (*ids)[MEM_ID_MAX + 1];
    const char **why;
    int64_t n, cap;
} bad_rows;

static is_status bad_row(mem_store *s, const PGresult *r, void *ud) {
    bad_rows *b = ud;
    size_t n = 0;
    unsigned char *emb = PQgetisnull(r, 0, 16)
                             ? NULL
                             : PQunescapeBytea((const unsigned char *)PQgetvalue(r, 0, 16), &n);
    const char *p = store_row_problem(
        PQgetvalue(r, 0, 0), PQgetvalue(r, 0, 5), PQgetvalue(r, 0, 10), (int32_t)col_i64(r, 0, 14),
        emb, (int64_t)n, b->dim, PQgetisnull(r, 0, 11) ? NULL : PQgetvalue(r, 0, 11));
    PQfreemem(emb);
    if (!p) return IS_OK;
    if (b->n == b->cap) {
        int64_t nc = b->cap ? b->cap * 2 : 16;
        void *ni = realloc(b->ids, (size_t)nc * sizeof *b->ids);
        if (ni) b->ids = ni;
        const char **nw = ni ? realloc(b->why, (size_t)nc * sizeof *nw) : NULL;
        if (!ni || !nw) return is_error_set(IS_ERR_NOMEM, "out of memory");
        b->why = nw;
        b->cap = nc;
    }
    snprintf(b->ids[b->n], sizeof b->ids[0], "%s", PQgetvalue(r, 0, 0));
    b->why[b->n++] = p;
    return IS_OK;
}

static is_status pg_quarantine(mem_store *s, int32_t dim, bool move, int64_t *n_out) {
    if (n_out) *n_out = 0;
    bad_rows b = {.dim = dim};
    is_status st = scan(s, "SELECT " COLS_EMB " FROM facts", bad_row, &b, "scan facts");
    if (st == IS_OK && !move && n_out) *n_out = b.n;
    if (st == IS_OK && move && b.n > 0) {
        /* Bad rows move, whole and as stored, to facts_quarantine (with the
         * reason), in one transaction: the rest is served, nothing is lost. */
        st = pg_begin(s);
        if (st == IS_OK)
            st =
                run0(s,
                     "CREATE TABLE IF NOT EXISTS facts_quarantine AS SELECT *, ''::text AS reason, "
                     "0::bigint AS quarantined_at FROM facts WHERE false",
                     NULL, "quarantine");
        for (int64_t i = 0; st == IS_OK && i < b.n; i++) {
            pq_params p = {0};
            p_text(&p, b.why[i]);
            p_int(&p, store_now_unix_ms());
            p_text(&p, b.ids[i]);
            st = run0(s, "INSERT INTO facts_quarantine SELECT *, $1, $2 FROM facts WHERE id = $3",
                      &p, "quarantine a row");
            pq_params d = {0};
            p_text(&d, b.ids[i]);
            if (st == IS_OK)
                st = run0(s, "DELETE FROM facts WHERE id = $1", &d, "remove a quarantined row");
        }
        if (st == IS_OK) st = pg_commit(s);
        if (st != IS_OK) pg_rollback(s);
        if (st == IS_OK) {
            char msg[160];
            snprintf(msg, sizeof msg, "%lld bad rows moved to table facts_quarantine (first: %s)",
                     (long long)b.n, b.why[0]);
            store_note_repair(s, "%s", msg);
            if (n_out) *n_out = b.n;
        }
    }
    free(b.ids);
    free(b.why);
    return st;
}

static void pg_missing_tables(mem_store *s, char *out, size_t cap) {
    out[0] = '\0';
    for (size_t i = 0; i < sizeof TABLES / sizeof TABLES[0]; i++) {
        pq_params p = {0};
        p_text(&p, TABLES[i]);
        PGresult *r = NULL;
        bool found = run(s, "SELECT to_regclass($1) IS NOT NULL", &p, "find table", &r) == IS_OK &&
                     strcmp(PQgetvalue(r, 0, 0), "t") == 0;
        PQclear(r);
        if (!found) {
            size_t l = strlen(out);
            snprintf(out + l, cap - l, "%s%s", l ? ", " : "", TABLES[i]);
        }
    }
}

static is_status pg_integrity(mem_store *s, char *out, size_t cap) {
    is_status st = run0(s, "SELECT 1", NULL, "integrity");
    if (st == IS_OK) snprintf(out, cap, "ok");
    return st;
}

/* ---- watch -------------------------------------------------------------------------------------------- */

static void deliver(pg_store *p, const char *payload) {
    cJSON *o = cJSON_Parse(payload);
    const char *origin = cJSON_GetStringValue(cJSON_GetObjectItem(o, "o"));
    const char *op = cJSON_GetStringValue(cJSON_GetObjectItem(o, "op"));
    mem_change c = {
        .tenant = cJSON_GetStringValue(cJSON_GetObjectItem(o, "t")),
        .user = cJSON_GetStringValue(cJSON_GetObjectItem(o, "u")),
        .id = cJSON_GetStringValue(cJSON_GetObjectItem(o, "id")),
        .version = (int32_t)cJSON_GetNumberValue(cJSON_GetObjectItem(o, "v")),
        .old_record = cJSON_GetStringValue(cJSON_GetObjectItem(o, "r")),
    };
    bool ok = origin && op && c.tenant && c.user && c.id;
    if (ok && strcmp(origin, p->origin) != 0) {
        c.op = strcmp(op, "add") == 0      ? MEM_CHANGE_ADD
               : strcmp(op, "update") == 0 ? MEM_CHANGE_UPDATE
                                           : MEM_CHANGE_DELETE;
        p->watch_fn(&c, p->watch_ud);
    }
    cJSON_Delete(o);
}

static bool listen_on(PGconn *c) {
    PGresult *r = PQexec(c, "LISTEN " PG_CHANNEL);
    bool ok = r && PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    return ok;
}

static void *watch_main(void *arg) {
    pg_store *p = arg;
    PGconn *c = PQconnectdb(p->url);
    bool up = c && PQstatus(c) == CONNECTION_OK && listen_on(c);
    while (!atomic_load(&p->stop)) {
        if (!up) {
            /* Changes made while we were not listening are lost: say so. */
            struct timespec ts = {0, 200 * 1000 * 1000};
            nanosleep(&ts, NULL);
            if (c) PQreset(c);
            else c = PQconnectdb(p->url);
            if (c && PQstatus(c) == CONNECTION_OK && listen_on(c)) {
                up = true;
                mem_change rs = {.op = MEM_CHANGE_RESYNC};
                p->watch_fn(&rs, p->watch_ud);
            }
            continue;
        }
        struct pollfd pfd = {.fd = PQsocket(c), .events = POLLIN};
        int pr = poll(&pfd, 1, 100);
        if (pr < 0) continue;
        if (pr > 0 && !PQconsumeInput(c)) {
            up = false;
            continue;
        }
        PGnotify *n;
        while ((n = PQnotifies(c)) != NULL) {
            deliver(p, n->extra);
            PQfreemem(n);
        }
        if (PQstatus(c) != CONNECTION_OK) up = false;
    }
    PQfinish(c);
    return NULL;
}

static is_status pg_watch(mem_store *s, mem_store_change_fn fn, void *ud) {
    pg_store *p = PG(s);
    if (p->watching) return is_error_set(IS_ERR_INVALID_ARG, "fact store: a watch runs already");
    p->watch_fn = fn;
    p->watch_ud = ud;
    atomic_store(&p->stop, false);
    if (pthread_create(&p->watch_thread, NULL, watch_main, p) != 0)
        return is_error_set(IS_ERR_IO, "fact store: cannot start the watch thread");
    p->watching = true;
    return IS_OK;
}

static const mem_store_ops PG_OPS = {
    .name = "postgres",
    .close = pg_close,
    .meta_get = pg_meta_get,
    .meta_set = pg_meta_set,
    .lock = pg_lock,
    .unlock = pg_unlock,
    .begin = pg_begin,
    .commit = pg_commit,
    .rollback = pg_rollback,
    .insert = pg_insert,
    .get = pg_get,
    .get_many = pg_get_many,
    .list = pg_list,
    .update = pg_update,
    .set_kv = pg_set_kv,
    .del = pg_delete,
    .delete_all = pg_delete_all,
    .history = pg_history,
    .find_source = pg_find_source,
    .count = pg_count,
    .owner = pg_owner,
    .users = pg_users,
    .foreach = pg_foreach,
    .quarantine = pg_quarantine,
    .missing_tables = pg_missing_tables,
    .integrity = pg_integrity,
    .foreach_record = pg_foreach_record,
    .count_history = pg_count_history,
    .count_quarantined = pg_count_quarantined,
    .watch = pg_watch,
};

#else /* !IS_HAVE_LIBPQ */

is_status store_pg_open(const char *url, bool readonly, mem_store **out) {
    (void)url, (void)readonly, (void)out;
    return is_error_set(IS_ERR_UNSUPPORTED, "fact store: this build has no PostgreSQL client "
                                            "(libpq); scripts/setup.sh installs libpq-dev");
}

#endif

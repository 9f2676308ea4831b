/*
 * store: the fact store, the durable part of the memory layer: every
 * tenant's users, their facts and the history of every change, with the
 * semantics of Mem0's memory API (add, get, get all with filters, update,
 * delete, delete all, history). Two implementations behind these functions
 * (memory/store_impl.h): an SQLite file (the default: WAL journal, foreign
 * keys on, synchronous=FULL, busy timeout; one process) and a PostgreSQL
 * database named by a postgres:// URL (several serving nodes share it; see
 * mem_store_watch). Both give the same results for the same calls: the
 * tests in tests/memory/test_store.c run against each.
 *
 * Schema (version 1; SQLite keeps it in PRAGMA user_version, PostgreSQL in
 * the table schema_version, which its migrations advance):
 *
 *   meta     (key PK, value)                      store-wide settings (the
 *                                                 embedding model and dim)
 *   tenants  (id PK, created_at)
 *   users    (tenant -> tenants, user_id, created_at; PK (tenant, user_id))
 *   facts    (id PK: uuid4 text, tenant, user_id -> users, agent_id, run_id,
 *             text, metadata: canonical flat JSON object or NULL,
 *             created_at, updated_at: unix ms, source: where the fact came
 *             from ("locomo:26:D1:3") or NULL, hash: 16 hex digits of
 *             fact_text_hash(text), embedding: f32[dim] blob, context: JSON
 *             array of the turns it is encoded with, kv_window: w, kv_record:
 *             its record id in the record store or NULL, version: 1 at add,
 *             +1 per update)
 *   history  (id INTEGER PK, fact_id, tenant, user_id, event ADD | UPDATE |
 *             DELETE, old_text, new_text, at)
 *
 * History rows are not tied to facts by a foreign key: a deleted fact keeps
 * its history (old_text holds what was deleted).
 *
 * Isolation: every function that reads or changes a fact takes its tenant
 * and user, and the SQL matches all three of id, tenant and user_id, so a
 * fact of another tenant or user behaves exactly as one that does not exist
 * (IS_ERR_NOT_FOUND), whatever its id.
 *
 * Atomicity: each mutating function is one transaction (the fact row and
 * its history row commit together or not at all); the _many functions are
 * one transaction for the whole batch. With synchronous=FULL a
 * commit is durable when the function returns, which the memory service
 * relies on to delete an old KV record only after the row that replaced it
 * is safe.
 *
 * Threads: a mem_store holds one connection and a mutex; every function
 * takes it, so calls from several threads are serialised and a transaction
 * is never interleaved with another thread's statements. Several processes
 * on one PostgreSQL store: a transaction's rows are locked (SELECT ... FOR
 * UPDATE) where it checks a version, so the version check of
 * mem_store_update holds across nodes too.
 */
#ifndef IS_MEMORY_STORE_H
#define IS_MEMORY_STORE_H

#include "inferscale.h"
#include "memory/index.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct mem_store mem_store;

#define MEM_STORE_SCHEMA_VERSION 1

/* One fact as stored. Strings are owned (mem_fact_clear frees them). */
typedef struct mem_fact {
    char id[MEM_ID_MAX + 1];
    char *tenant;
    char *user;
    char *agent_id; /* NULL if none */
    char *run_id;   /* NULL if none */
    char *text;
    char *metadata;     /* canonical JSON object (cJSON unformatted), NULL if none */
    char *source;       /* NULL if none */
    char hash[17];      /* 16 lowercase hex digits of fact_text_hash(text) */
    int64_t created_at; /* unix ms */
    int64_t updated_at; /* unix ms */
    float *embedding;   /* [dim], NULL when not asked for */
    int32_t dim;
    char **context; /* [n_context] turns the KV is encoded with, oldest first */
    int32_t n_context;
    int32_t kv_window; /* w given at encoding (-1: no context at all) */
    char *kv_record;   /* record store id, NULL when the fact has no KV record */
    int32_t version;   /* 1 at add, +1 per update */
} mem_fact;

typedef enum mem_event { MEM_EVENT_ADD = 0, MEM_EVENT_UPDATE = 1, MEM_EVENT_DELETE = 2 } mem_event;

/* "ADD", "UPDATE", "DELETE". */
const char *mem_event_name(mem_event e);

typedef struct mem_history {
    int64_t id; /* increasing with time */
    char fact_id[MEM_ID_MAX + 1];
    mem_event event;
    char *old_text; /* NULL for ADD */
    char *new_text; /* NULL for DELETE */
    int64_t at;     /* unix ms */
} mem_history;

/* Frees the strings and embedding of f and zeroes it. NULL is a no-op. */
void mem_fact_clear(mem_fact *f);
/* Clears n facts and frees the array. */
void mem_facts_free(mem_fact *f, int32_t n);
void mem_history_free(mem_history *h, int32_t n);

/* Hex of fact_text_hash(text) into out[17]. */
void mem_text_hash_hex(const char *text, char out[17]);

/* Checks and canonicalises metadata: NULL or "" is none (*out = NULL);
 * otherwise a JSON object whose values are scalars (string, number, bool,
 * null), rewritten unformatted into *out (free() it). IS_ERR_INVALID_ARG
 * (message says why), IS_ERR_NOMEM; *out unchanged on failure. */
is_status mem_metadata_canonical(const char *json, char **out);

/* True if `path` names a PostgreSQL store (postgres:// or postgresql://). */
bool mem_store_is_url(const char *path);

/* Opens (creating it and its schema if missing) the database at `path`: an
 * SQLite file, or a PostgreSQL connection URL (mem_store_is_url), whose
 * schema is migrated to this program's version under a lock, so nodes
 * starting together migrate once.
 * IS_ERR_INVALID_ARG (NULL path), IS_ERR_IO (cannot open, or SQLite
 * refuses: message names the file), IS_ERR_FORMAT (not a fact store, or a
 * newer schema version). *out unchanged on failure. */
is_status mem_store_open(const char *path, mem_store **out);
/* NULL is a no-op. */
void mem_store_close(mem_store *s);

/* Store-wide settings. get: IS_ERR_NOT_FOUND when unset; *value (free()
 * it) unchanged on failure. */
is_status mem_store_meta_get(mem_store *s, const char *key, char **value);
is_status mem_store_meta_set(mem_store *s, const char *key, const char *value);

/* Inserts a new fact and its ADD history row in one transaction, creating
 * its tenant and user rows if needed. Required: id, tenant, user, text,
 * hash, embedding (dim > 0), version >= 1; created_at/updated_at are taken
 * as given (0: now). metadata must be canonical (mem_metadata_canonical).
 * IS_ERR_INVALID_ARG (missing field, or the id exists already: a fact id is
 * unique across tenants), IS_ERR_IO. Nothing is written on failure. */
is_status mem_store_insert(mem_store *s, const mem_fact *f);

/* Inserts n facts (each as mem_store_insert) in one transaction: one
 * durable commit for the batch (a group commit), so a crash leaves the
 * whole batch or none of it. Should that transaction fail, each fact is
 * inserted again in a transaction of its own, so status[i] is fact i's own
 * outcome (a fact failing the checks is never written). Returns IS_OK or
 * the first failure. */
is_status mem_store_insert_many(mem_store *s, const mem_fact *f, int32_t n, is_status *status);

/* The fact `id` of (tenant, user) into *out (clear it with mem_fact_clear),
 * with its embedding when with_embedding. IS_ERR_NOT_FOUND when no fact of
 * that id belongs to that tenant and user. *out is zeroed on failure. */
is_status mem_store_get(mem_store *s, const char *tenant, const char *user, const char *id,
                        bool with_embedding, mem_fact *out);

/* The facts ids[0..n) of (tenant, user), without embeddings, in one read
 * (a search's hits: one round trip to PostgreSQL instead of n): out[i]
 * (mem_fact_clear each) gets fact ids[i] and found[i] whether it exists for
 * that tenant and user (out[i] zeroed if not). IS_ERR_INVALID_ARG, IS_ERR_IO,
 * IS_ERR_NOMEM; on failure every out[i] is zeroed. */
is_status mem_store_get_many(mem_store *s, const char *tenant, const char *user,
                             const char *const *ids, int32_t n, mem_fact *out, bool *found);

/* The facts of f->tenant and f->user (both required) that match the
 * optional agent_id, run_id and metadata equality filters (semantics of
 * mem_filter in index.h), oldest first (created_at, then id). *out (free
 * with mem_facts_free; NULL when *n is 0). IS_ERR_INVALID_ARG, IS_ERR_IO,
 * IS_ERR_NOMEM; outputs unchanged on failure. */
is_status mem_store_list(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                         int32_t *n);

/* Replaces the fact's text, metadata, hash, embedding, context, kv_window,
 * kv_record and version with f's (updated_at = now) if the stored row of
 * (f->id, f->tenant, f->user) still has version `expected_version`, and adds
 * an UPDATE history row (old text -> new text), in one transaction.
 * IS_ERR_NOT_FOUND (no such fact for that tenant and user), IS_ERR_MISMATCH
 * (the version moved on: a concurrent update), IS_ERR_INVALID_ARG, IS_ERR_IO.
 * Nothing changes on failure. */
is_status mem_store_update(mem_store *s, const mem_fact *f, int32_t expected_version);

/* Sets the KV record of fact `id` if its version is still `version`, with
 * no history (the record is derived data). IS_ERR_NOT_FOUND otherwise. */
is_status mem_store_set_kv(mem_store *s, const char *id, int32_t version, const char *kv_record);

/* mem_store_set_kv for n facts in one transaction (one group commit),
 * with mem_store_insert_many's fallback: status[i] per fact. */
typedef struct mem_store_kv_set {
    const char *id;
    int32_t version;
    const char *kv_record;
} mem_store_kv_set;
is_status mem_store_set_kv_many(mem_store *s, const mem_store_kv_set *sets, int32_t n,
                                is_status *status);

/* Deletes the fact and adds a DELETE history row (old_text = its text), in
 * one transaction. The deleted row goes to *old when old is non-NULL (for
 * its KV record id). IS_ERR_NOT_FOUND (as mem_store_get), IS_ERR_IO. */
is_status mem_store_delete(mem_store *s, const char *tenant, const char *user, const char *id,
                           mem_fact *old);

/* Deletes every fact mem_store_list(f) would return, each with a DELETE
 * history row, in one transaction; the deleted rows (no embeddings) go to
 * *deleted / *n (mem_facts_free). On failure nothing is deleted. */
is_status mem_store_delete_all(mem_store *s, const mem_filter *f, mem_fact **deleted, int32_t *n);

/* History of fact `id` of (tenant, user), oldest first. A fact deleted
 * since still has its history; an id never seen under that tenant and user
 * gives IS_ERR_NOT_FOUND. */
is_status mem_store_history(mem_store *s, const char *tenant, const char *user, const char *id,
                            mem_history **out, int32_t *n);

/* The id of a fact of (tenant, user) with this source and content hash
 * into id_out. IS_ERR_NOT_FOUND if none. Used to make imports resumable. */
is_status mem_store_find_source(mem_store *s, const char *tenant, const char *user,
                                const char *source, const char *hash, char id_out[MEM_ID_MAX + 1]);

/* Number of facts (all tenants). */
int64_t mem_store_count(mem_store *s);

/* The user that fact `id` of `tenant` belongs to, or belonged to if it was
 * deleted since (its history remembers), into *user (free() it). For APIs
 * that name a fact by id alone (Mem0's get/update/delete/history): the
 * caller then goes through the calls above with (tenant, *user, id), so
 * another tenant's fact stays IS_ERR_NOT_FOUND. */
is_status mem_store_owner(mem_store *s, const char *tenant, const char *id, char **user);

/* The distinct users of `tenant` that have facts, sorted, into *out / *n
 * (free each string and the array). IS_ERR_INVALID_ARG, IS_ERR_IO,
 * IS_ERR_NOMEM; outputs unchanged on failure. */
is_status mem_store_users(mem_store *s, const char *tenant, char ***out, int32_t *n);

/* Calls fn on every fact of every tenant (with embeddings when asked), in
 * id order; stops early and returns fn's status if it is not IS_OK. The
 * fact passed is only valid during the call. The store's mutex is held
 * throughout: fn must not call back into the store. */
typedef is_status (*mem_store_fact_fn)(const mem_fact *f, void *user_data);
is_status mem_store_foreach(mem_store *s, bool with_embedding, mem_store_fact_fn fn,
                            void *user_data);

/* "sqlite" or "postgres". */
const char *mem_store_kind(const mem_store *s);

/* ---- changes by other writers (shared stores) -----------------------------------
 * Every committed add, update and delete of a PostgreSQL store is announced
 * (NOTIFY, sent in the same transaction, so it is heard only if it
 * committed, and after the commit). mem_store_watch starts a thread with a
 * connection of its own that LISTENs and calls fn for each change made
 * through another mem_store (another node; its own changes are not
 * repeated). A lost connection is opened again; since changes made
 * meanwhile were not heard, fn is then called once with op
 * MEM_CHANGE_RESYNC (every cached entry may be stale). fn runs on that
 * thread and may call this store. IS_ERR_UNSUPPORTED on SQLite (one
 * process owns the file: nothing to hear), IS_ERR_INVALID_ARG if a watch
 * runs already, IS_ERR_IO. The thread ends in mem_store_close. */
typedef enum mem_change_op {
    MEM_CHANGE_ADD = 0,
    MEM_CHANGE_UPDATE = 1,
    MEM_CHANGE_DELETE = 2,
    MEM_CHANGE_RESYNC = 3,
} mem_change_op;

typedef struct mem_change {
    mem_change_op op;
    const char *tenant; /* NULL for RESYNC */
    const char *user;
    const char *id;
    int32_t version;        /* the row's version after the change (0 for DELETE) */
    const char *old_record; /* the KV record the row named before (NULL if none) */
} mem_change;

typedef void (*mem_store_change_fn)(const mem_change *c, void *user_data);
is_status mem_store_watch(mem_store *s, mem_store_change_fn fn, void *user_data);

/* ---- fault injection (tests) ------------------------------------------------
 * Called inside every mutating transaction after its statements ran and
 * just before COMMIT; a test's child process _exit()s there to simulate a
 * crash with an uncommitted transaction in the WAL. Returning false makes
 * the transaction roll back (the function then returns IS_ERR_IO). */
typedef bool (*mem_store_fault_fn)(void *user_data);
void mem_store_set_fault_hook(mem_store *s, mem_store_fault_fn fn, void *user_data);

/* ---- repair -------------------------------------------------------------------------
 * A store is never emptied or refused whole for part of it: mem_store_open
 * recreates the tables an existing store lacks (tenants and users refilled
 * from the facts; a lost history stays lost), and
 * mem_store_quarantine_bad_rows moves rows that cannot be served (a
 * required column NULL or not text, a bad id or version, a text that does
 * not match its hash, an embedding of another size than dim or not finite,
 * a context that is not a JSON array) to the table facts_quarantine, whole,
 * with the reason. */

/* What open and the quarantine repaired, one line ("" if nothing). */
const char *mem_store_repairs(const mem_store *s);

/* Moves the bad rows (see above; dim <= 0: any embedding size) to
 * facts_quarantine in one transaction; *n_out (may be NULL) gets their
 * number. IS_ERR_IO / IS_ERR_NOMEM with nothing moved. */
is_status mem_store_quarantine_bad_rows(mem_store *s, int32_t dim, int64_t *n_out);

/* The same check without moving anything: *n_out gets the number of bad rows. */
is_status mem_store_count_bad_rows(mem_store *s, int32_t dim, int64_t *n_out);

/* Opens an existing store for reading only: no schema is created or
 * repaired, nothing is written (for inferscale fsck's check). */
is_status mem_store_open_readonly(const char *path, mem_store **out);

/* The schema's tables the store lacks, comma-separated, into out ("" if none). */
void mem_store_missing_tables(mem_store *s, char *out, size_t cap);

/* SQLite's quick_check ("ok" or its first complaint) into out; on
 * PostgreSQL, "ok" once the server answers (it checks its own pages). */
is_status mem_store_integrity(mem_store *s, char *out, size_t cap);

/* Calls fn with every row's KV record id (rows without one are skipped). */
typedef is_status (*mem_store_record_fn)(const char *kv_record, void *user_data);
is_status mem_store_foreach_record(mem_store *s, mem_store_record_fn fn, void *user_data);

/* Rows of history (-1 on error) and of facts_quarantine (0 if none). */
int64_t mem_store_count_history(mem_store *s);
int64_t mem_store_count_quarantined(mem_store *s);

#endif

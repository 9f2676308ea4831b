/*
 * store_impl: what a fact-store implementation provides behind
 * memory/store.h. Private to src/memory/store*.c: the rest of the project
 * sees only mem_store and its functions.
 *
 * store.c owns the public functions: it checks their arguments where both
 * implementations would check them alike, keeps the helpers both need
 * (context and metadata encodings, the row checks of the quarantine) and
 * dispatches every call through the ops table of the store it was given.
 * store_sqlite.c is the embedded default (one file, one process);
 * store_pg.c is the shared store of several serving nodes (PostgreSQL via
 * libpq), chosen by a postgres:// or postgresql:// URL.
 *
 * Every op has the contract of the mem_store_ function of the same name in
 * store.h; an implementation embeds `mem_store` as its first member.
 *
 * Locking: store.c takes the connection's lock (ops->lock) around every
 * op but close and watch, so an op never locks itself.
 *
 * Writes: the mutating ops (insert, update, set_kv, del, delete_all) are
 * transaction bodies. store.c runs each one, or a batch of them (one
 * group commit: mem_store_insert_many, mem_store_set_kv_many), as lock,
 * begin, the bodies, the fault hook, commit (rollback on any failure),
 * unlock; so the transaction handling is written once, and a batch costs
 * one durable commit instead of one per row.
 */
#ifndef IS_MEMORY_STORE_IMPL_H
#define IS_MEMORY_STORE_IMPL_H

#include "memory/store.h"

#include <stddef.h>

typedef struct mem_store_ops {
    const char *name; /* "sqlite", "postgres" */
    void (*close)(mem_store *s);
    is_status (*meta_get)(mem_store *s, const char *key, char **value);
    is_status (*meta_set)(mem_store *s, const char *key, const char *value);
    /* The transaction of a write: lock takes the connection's mutex (and
     * reopens a broken connection where the store can), begin opens the
     * write transaction, commit makes it durable, rollback undoes it. */
    void (*lock)(mem_store *s);
    void (*unlock)(mem_store *s);
    is_status (*begin)(mem_store *s);
    is_status (*commit)(mem_store *s);
    void (*rollback)(mem_store *s);
    /* Transaction bodies (lock held, transaction open; `now` in unix ms).
     * f was checked by store_check_fact. */
    is_status (*insert)(mem_store *s, const mem_fact *f, int64_t now);
    is_status (*get)(mem_store *s, const char *tenant, const char *user, const char *id,
                     bool with_embedding, mem_fact *out);
    /* Optional (NULL: one get per id). */
    is_status (*get_many)(mem_store *s, const char *tenant, const char *user,
                          const char *const *ids, int32_t n, mem_fact *out, bool *found);
    is_status (*list)(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                      int32_t *n);
    is_status (*update)(mem_store *s, const mem_fact *f, int32_t expected_version, int64_t now);
    is_status (*set_kv)(mem_store *s, const char *id, int32_t version, const char *kv_record);
    /* *old gets the deleted row (the caller clears it, also on failure). */
    is_status (*del)(mem_store *s, const char *tenant, const char *user, const char *id,
                     mem_fact *old, int64_t now);
    /* *deleted / *n get the deleted rows (the caller frees them, also on failure). */
    is_status (*delete_all)(mem_store *s, const mem_filter *f, mem_fact **deleted, int32_t *n,
                            int64_t now);
    is_status (*history)(mem_store *s, const char *tenant, const char *user, const char *id,
                         mem_history **out, int32_t *n);
    is_status (*find_source)(mem_store *s, const char *tenant, const char *user, const char *source,
                             const char *hash, char id_out[MEM_ID_MAX + 1]);
    int64_t (*count)(mem_store *s);
    is_status (*owner)(mem_store *s, const char *tenant, const char *id, char **user);
    is_status (*users)(mem_store *s, const char *tenant, char ***out, int32_t *n);
    is_status (*foreach)(mem_store *s, bool with_embedding, mem_store_fact_fn fn, void *ud);
    /* move: quarantine the bad rows; else only count them. */
    is_status (*quarantine)(mem_store *s, int32_t dim, bool move, int64_t *n_out);
    void (*missing_tables)(mem_store *s, char *out, size_t cap);
    is_status (*integrity)(mem_store *s, char *out, size_t cap);
    is_status (*foreach_record)(mem_store *s, mem_store_record_fn fn, void *ud);
    int64_t (*count_history)(mem_store *s);
    int64_t (*count_quarantined)(mem_store *s);
    /* Optional (NULL: the store has no other writers to hear of). */
    is_status (*watch)(mem_store *s, mem_store_change_fn fn, void *ud);
} mem_store_ops;

struct mem_store {
    const mem_store_ops *ops;
    const char *where;        /* the store in messages: a file path, "postgres db@host" */
    mem_store_fault_fn fault; /* called before every COMMIT (tests) */
    void *fault_user;
    char repairs[512]; /* what open and the quarantine repaired ("" if nothing) */
};

/* The implementations' open functions (store.c picks one by the name). */
is_status store_sqlite_open(const char *path, bool readonly, mem_store **out);
is_status store_pg_open(const char *url, bool readonly, mem_store **out);

/* ---- helpers both implementations use (store.c) ---------------------------- */

int64_t store_now_unix_ms(void);
/* The context turns as a JSON array (free() it), NULL when out of memory. */
char *store_context_to_json(char *const *ctx, int32_t n);
/* Parses the context column into f->context / f->n_context. IS_ERR_FORMAT, IS_ERR_NOMEM. */
is_status store_context_from_json(const char *txt, mem_fact *f);
/* True if metadata holds every (key, value) of the filter's equality list. */
bool store_meta_matches(const char *metadata, const mem_filter *f);
is_status store_check_fact(const mem_fact *f);
is_status store_check_filter(const mem_filter *f);
/* Why a row cannot be served (the quarantine's rules), NULL if it can. The
 * columns as stored: text may be NULL, emb/bytes the raw embedding, ctx
 * the context column or NULL. */
const char *store_row_problem(const char *id, const char *text, const char *hash, int32_t version,
                              const void *emb, int64_t bytes, int32_t dim, const char *ctx);
/* Appends "; "-separated text to s->repairs (fmt has one %s). */
void store_note_repair(mem_store *s, const char *fmt, const char *arg);

#endif

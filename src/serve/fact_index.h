/*
 * fact_index: what the scheduler knows of each KV record it has seen, so a
 * fact the GPU already holds is injected without touching its record.
 *
 * A record id names one encoding of one version of a fact (memory.c gives a
 * new id to every re-encoding), so what a record id maps to never changes:
 * the record's content id (the GPU arena's key), its length in tokens, the
 * hash of the text it was encoded from, and a hint that the backend held it
 * at its last injection. The hint is only a hint: the engine thread asks
 * the backend (engine_fact_resident) before it leaves a record unread.
 *
 * Threads: every function may be called from any thread at once (one
 * mutex). Bounded: past max_entries the table is emptied and starts again
 * (a lost entry costs one record read, never a wrong injection).
 */
#ifndef IS_SERVE_FACT_INDEX_H
#define IS_SERVE_FACT_INDEX_H

#include "core/status.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct fact_index fact_index;

typedef struct fact_index_entry {
    uint64_t content_id; /* fact_kv.content_id */
    uint64_t text_hash;  /* fact_kv_meta.text_hash */
    int32_t n_tokens;    /* the record's tokens */
    bool resident;       /* the backend held it after its last injection (a hint) */
} fact_index_entry;

/* IS_ERR_INVALID_ARG (max_entries < 1), IS_ERR_NOMEM. */
is_status fact_index_create(int64_t max_entries, fact_index **out);
void fact_index_free(fact_index *x); /* NULL is a no-op */

/* Copies the entry of `record` into *out; false if none. */
bool fact_index_get(fact_index *x, const char *record, fact_index_entry *out);

/* Sets the entry of `record` (adding it). Out of memory leaves the index
 * without it, which only costs a record read later. */
void fact_index_put(fact_index *x, const char *record, const fact_index_entry *e);

/* Sets the resident hint of an existing entry; no-op if there is none. */
void fact_index_set_resident(fact_index *x, const char *record, bool resident);

int64_t fact_index_size(fact_index *x);

#endif

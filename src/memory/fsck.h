/*
 * fsck: checks a memory data directory (memory/memory.h's layout) and,
 * when asked, repairs what can be repaired without destroying anything.
 * `inferscale fsck` is its thin main.
 *
 * Check (nothing is written): whether memory.db is there, SQLite's
 * quick_check, the schema's tables, rows, bad rows (memory/store.h's
 * quarantine rules), rows already quarantined, history rows; KV records in
 * kv/, records no row points to, rows whose record is missing, records set
 * aside in kv/orphans/.
 *
 * Repair:
 *  - a store that is there: memory_open's own recovery (missing tables
 *    recreated, bad rows moved to facts_quarantine, records no row points
 *    to moved to kv/orphans/);
 *  - a store that is missing, empty, or without facts and history beside
 *    KV records: rebuilt from the records. A record keeps the fact's
 *    token ids and its text's hash (kv/fact_record.h), not its text,
 *    tenant, user or metadata. The caller's text_of turns tokens back into
 *    text (the served model's tokenizer); a text is taken only if its hash
 *    equals the record's, so a rebuilt fact's text is exactly the stored
 *    one. Fact id and version come from the record's id ("<id>-v<n>"),
 *    the window from the record. What cannot come back: the owner (all
 *    rebuilt facts go to params.tenant / params.user), metadata, agent and
 *    run ids, source, context turns, timestamps (now) and history. The
 *    damaged file is renamed memory.db.damaged-<unix time>, never deleted;
 *    records that cannot be rebuilt are set aside in kv/orphans/.
 */
#ifndef IS_MEMORY_FSCK_H
#define IS_MEMORY_FSCK_H

#include "inferscale.h"
#include "memory/embedder.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* Turns a record's fact tokens into the fact's text (*text malloc'd), or
 * fails; the hash is checked by the caller. */
typedef is_status (*memory_text_fn)(void *user_data, const int32_t *tokens, int32_t n, char **text);

typedef struct memory_fsck_params {
    bool repair;
    memory_text_fn text_of; /* NULL: a store cannot be rebuilt from records */
    void *text_user_data;
    embedder *embedder;     /* embeds rebuilt facts; NULL: none (BM25 only) */
    const char *embed_name; /* as serve names it: the embedder's folder name, or "none" */
    const char *tenant;     /* owner of rebuilt facts (default "default") */
    const char *user;       /* (default "recovered") */
} memory_fsck_params;

typedef struct memory_fsck_report {
    bool db_missing, db_empty; /* memory.db absent / of 0 bytes (and no WAL) */
    char integrity[128];       /* quick_check: "ok" or its first complaint */
    char missing_tables[128];  /* "" if none */
    int64_t n_facts, n_bad_rows, n_quarantined, n_history;
    int64_t n_records;     /* files in kv/ */
    int64_t n_unclaimed;   /* records in kv/ no row points to */
    int64_t n_missing_kv;  /* rows whose record is not in kv/ */
    int64_t n_set_aside;   /* files in kv/orphans/ */
    int64_t n_rebuilt;     /* repair: facts rebuilt from records */
    int64_t n_not_rebuilt; /* repair: records whose text could not be recovered */
    bool problems;         /* anything above that needs a repair */
} memory_fsck_report;

/* Checks (and with p->repair, repairs) data_dir, writing one line per
 * finding to out (may be NULL). IS_OK when the check ran (see
 * report->problems); IS_ERR_IO (the directory is in use by a server: the
 * record store's lock, or unreadable), IS_ERR_INVALID_ARG (a rebuild is
 * needed but p->text_of is NULL), others from the store. */
is_status memory_fsck(const char *data_dir, const memory_fsck_params *p, memory_fsck_report *report,
                      FILE *out);

#endif

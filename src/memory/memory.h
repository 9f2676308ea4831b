/*
 * memory: the memory service, one facade over the four parts a fact lives
 * in: its row in the fact store (memory/store.h: text, metadata, embedding,
 * history), its entry in the retrieval index (memory/index.h, in memory and
 * rebuilt at open), its embedding (the sentence embedder) and its KV record
 * in the record store (kv/record_store.h). The CLI's ingest command and the
 * HTTP server use this, never the parts directly, so that the four agree.
 *
 * Layout of a data directory:
 *
 *   <data_dir>/memory.db (+ -wal, -shm)   the fact store
 *   <data_dir>/kv/                        the record store (its .lock makes
 *                                         a data directory single-process)
 *
 * ---- Crash atomicity --------------------------------------------------------
 * The invariant: after a crash at any moment and memory_open(), every fact
 * is either fully present (its row, with the embedding of its text; its KV
 * record, whose text hash is that of the row's text; its index entry) or
 * fully absent, and an update shows either the old version or the new one.
 * The row is the single commit point; everything else is ordered around it:
 *
 *   add:    embed -> write KV record R -> COMMIT row(R) + history -> index
 *   update: embed -> write KV record R' (a new id: fact id + "-v" + version)
 *           -> COMMIT row(R') + history -> delete R -> index
 *   delete: COMMIT row deleted + history -> delete R -> index
 *
 * A crash before the commit leaves at most a record no row points to; one
 * after it leaves at most a record no row points to any more. Records never
 * change in place (record_store writes a temporary file and renames it), so
 * a row always points to a complete record. memory_open() rebuilds the index
 * from the rows (so the index cannot disagree after a restart) and
 * reconciles the record store with them: it moves every record no row
 * points to (the orphans a crash leaves) to kv/orphans/ and lists the facts whose record
 * is missing (facts added while no encoder was set, or records removed by
 * hand), which memory_encode_missing() encodes. Commits are durable
 * (synchronous=FULL) before an old record is deleted. tests/memory/
 * test_crash.c kills a writer at every step and at random times to check it.
 *
 * ---- Embeddings and KV encoding -------------------------------------------
 * Embedding is done by an embedder (memory/embedder.h) or, for tests, by any
 * function of the same shape; with neither, facts get a constant 1-float
 * embedding and search is BM25 alone. The store remembers the embedding
 * model's name and dimension and refuses to open with another
 * (IS_ERR_MISMATCH): the stored embeddings would be meaningless.
 *
 * KV encoding is a callback (memory_encoder): encoding needs the served
 * model, which lives above this layer (serve/ask.h's ask_encode_fact is the
 * usual one; tests plug in a fake that writes small records). The encoder is
 * set after open because it writes into this service's record store
 * (memory_record_store). With no encoder, facts are stored without KV.
 *
 * ---- GPU retrieval ------------------------------------------------------------
 * With memory_params.gpu_retrieval (a build with CUDA, a usable device and
 * a loaded embedder), the service also keeps every user's fact embeddings
 * in device memory (memory/dense_gpu.h), filled at open and kept in step by
 * every add, update and delete. Dense and hybrid searches without an
 * agent_id, run_id or metadata filter then embed the query on the GPU and
 * take the user's top-k there: only the query's token ids go up and the
 * dense list's (row, score) pairs come back (k + 1 of them, or 101 for a
 * hybrid search with k <= 100), no text or vector. BM25 and the RRF fusion
 * stay on the CPU, on the same index, so results are those of the CPU path
 * (same ordering rules; scores within about 1e-6, so facts whose scores are
 * closer than that may swap). Searches with filters, BM25-only ones, k
 * (or the hybrid depth) of CUDA_TOPK_MAX (1024) or more, and users whose
 * device copy failed an update (see memory_gpu_stats) run on the CPU. Facts
 * are still embedded on the CPU when written (the stored embedding is the
 * one the device holds). GPU searches are serialised (one mutex, held from
 * the query's embedding to the end of the fusion); CPU searches still run
 * in parallel beside them.
 *
 * ---- Isolation ------------------------------------------------------------------
 * Every call names a tenant and a user; a fact of another tenant or user is
 * never returned, changed or deleted (it behaves as not found), whatever
 * its id, its text or the filters.
 *
 * ---- Several nodes ----------------------------------------------------------------
 * With a PostgreSQL store (memory_params.store_url) every node opens the
 * same rows, and the rows are the truth: a search re-reads every hit's row
 * (its text, its KV record id) from the store, so a node's in-memory index
 * only ranks. Each node keeps its own index and its own KV records
 * (<data_dir>/kv/) as caches. Changes made through other nodes reach this
 * one through the store's watch (memory/store.h, LISTEN/NOTIFY): the row is
 * read again and the index entry replaced or removed, the KV record the
 * row named before is deleted here, and the change callback
 * (memory_set_change_fn) tells the layer above (the server sets none: it
 * encodes a fact's new KV at the first request that needs it). A record id names one version of one fact (the
 * version only grows, under the store's row lock), so a record id means
 * the same KV on every node; and every injection checks the record's text
 * hash against the row's text, so a record left stale by a change not yet
 * heard is prefilled as text, never injected.
 *
 * ---- Threads ---------------------------------------------------------------------
 * All functions may be called from several threads. Writes (add, update,
 * delete, encode_missing) are serialised by one writer lock; reads and
 * searches run beside them (the store and the index lock themselves, the
 * embedder has its own lock). A write that encodes KV holds the writer lock
 * for the encoding's duration, but does not block searches.
 */
#ifndef IS_MEMORY_MEMORY_H
#define IS_MEMORY_MEMORY_H

#include "inferscale.h"
#include "kv/record_store.h"
#include "memory/dense_gpu.h"
#include "memory/embedder.h"
#include "memory/index.h"
#include "memory/locomo.h"
#include "memory/store.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct memory memory;

/* Room for a fact id and its NUL. Ids made here are uuid4 text (36
 * characters); the room is the index's limit. */
#define MEMORY_ID_SIZE (MEM_ID_MAX + 1)
/* memory_add_req.window: use the service's default window. */
#define MEMORY_WINDOW_DEFAULT INT32_MIN
/* Most context turns kept with a fact. */
#define MEMORY_MAX_CONTEXT 1024

/* Embeds n texts into out[n][dim] (rows L2-normalised, finite). */
typedef is_status (*memory_embed_fn)(void *user_data, const char *const *texts, int32_t n,
                                     float *out);

/* What an encoder is asked to do: encode `text` with the last `window`
 * turns of `context` (window < 0: no context, not even the serving prefix)
 * and put the record under `record_id` into the service's record store,
 * with meta.text_hash = fact_text_hash(text) (the invariant checker reads
 * it). It must write the record atomically (record_store_put does). */
typedef struct memory_encode_job {
    const char *record_id;
    const char *text;
    const char *const *context; /* [n_context], oldest first */
    int32_t n_context;
    int32_t window;
} memory_encode_job;

typedef is_status (*memory_encode_fn)(void *user_data, record_store *store,
                                      const memory_encode_job *job);

typedef struct memory_params {
    /* Embedding: an embedder, else embed/embed_dim/embed_name, else none
     * (BM25 only). */
    embedder *embedder; /* borrowed; must outlive the service */
    memory_embed_fn embed;
    void *embed_user_data;
    int32_t embed_dim;
    const char
        *embed_name;   /* identifies the model in the store (default: "embedder:<dim>" or "none") */
    int32_t kv_window; /* default w for facts added without one (default 0) */
    size_t kv_cache_bytes; /* record store cache (default 64 MiB) */
    /* GPU retrieval (see the top of this file; default off). Needs
     * `embedder` (IS_ERR_INVALID_ARG with an embed function or none) and a
     * build with CUDA and a usable device gpu_device: without them
     * memory_open fails with IS_ERR_UNSUPPORTED, it never falls back to the
     * CPU silently. Device memory: the embedder's weights (90 MB for
     * MiniLM) plus 4 * dim bytes a fact (1.5 KB at dim 384). */
    bool gpu_retrieval;
    int32_t gpu_device; /* CUDA device (default 0) */
    /* The fact store: NULL for <data_dir>/memory.db (SQLite), or a
     * postgres:// URL of a store several nodes share (see "Several nodes"
     * below); the KV records stay in <data_dir>/kv/, this node's cache. */
    const char *store_url;
} memory_params;

memory_params memory_default_params(void);

/* What memory_open found. */
typedef struct memory_open_report {
    int64_t n_facts;       /* rows, all tenants */
    int64_t n_orphans;     /* KV records no row points to, moved to kv/orphans/ */
    int64_t n_missing_kv;  /* facts without a KV record (see memory_encode_missing) */
    int64_t n_quarantined; /* bad rows moved to the table facts_quarantine */
    char repairs[512];     /* what the store's open repaired, one line ("" if nothing) */
} memory_open_report;

/* Opens (creating it if missing) the data directory: the fact store, the
 * record store (its lock: a second open of the same directory fails with
 * IS_ERR_IO), rebuilds the index from the rows and reconciles the records
 * (see the top of this file). report may be NULL. Recovery never destroys:
 * a store that is missing or empty (no facts, no history) beside KV
 * records is refused with IS_ERR_IO naming the file; missing tables are
 * recreated and bad rows quarantined (memory/store.h), the rest served;
 * records no row points to are set aside in kv/orphans/, not deleted.
 * IS_ERR_INVALID_ARG, IS_ERR_IO, IS_ERR_FORMAT (a corrupt store), IS_ERR_MISMATCH (the store's
 * embeddings come from another model or dimension), IS_ERR_NOMEM. *out is
 * unchanged on failure and nothing is left open. */
is_status memory_open(const char *data_dir, const memory_params *p, memory **out,
                      memory_open_report *report);
/* NULL is a no-op. No call may be running or follow. */
void memory_close(memory *m);

/* The record store the facts' KV records live in (for the encoder, and for
 * the request path that fetches records). Owned by m. */
record_store *memory_record_store(memory *m);
mem_store *memory_fact_store(memory *m);
int32_t memory_dim(const memory *m);

/* Called on the store's watch thread, with the writer lock held, after a
 * fact was added or changed through another node and this node's index
 * follows it (deletes need nothing more), so the caller can queue its KV
 * encoding here: it must only queue, never write to this service. After
 * memory_set_change_fn(m, NULL, NULL) returns, no call runs or follows. */
typedef void (*memory_change_fn)(const char *tenant, const char *user, const char *id,
                                 void *user_data);
void memory_set_change_fn(memory *m, memory_change_fn fn, void *user_data);

/* Sets (NULL: clears) the KV encoder for later writes. */
void memory_set_encoder(memory *m, memory_encode_fn fn, void *user_data);

/* ---- writes -------------------------------------------------------------------- */

typedef struct memory_add_req {
    const char *tenant;         /* required, non-empty */
    const char *user;           /* required, non-empty */
    const char *agent_id;       /* optional */
    const char *run_id;         /* optional */
    const char *text;           /* required, non-empty, valid UTF-8 */
    const char *metadata_json;  /* optional flat JSON object */
    const char *source;         /* optional: where the fact came from */
    const char *const *context; /* optional: turns before the fact, oldest first */
    int32_t n_context;
    int32_t window; /* turns of context to encode with; MEMORY_WINDOW_DEFAULT */
} memory_add_req;

/* Adds one fact (embed, encode, commit, index: see the top of this file);
 * its new id into id_out (may be NULL). IS_ERR_INVALID_ARG (missing field,
 * invalid UTF-8, bad metadata: message says which), IS_ERR_IO, IS_ERR_NOMEM,
 * or the encoder's status. On failure nothing of the fact remains. */
is_status memory_add(memory *m, const memory_add_req *r, char id_out[MEMORY_ID_SIZE]);

/* Adds n facts, embedding them in one batch; each one is encoded (with an
 * encoder set), then the rows of all commit in one transaction (a group
 * commit: a crash keeps the whole batch or none of it; should the batch's
 * transaction fail, each fact is committed on its own). status[i] and
 * ids[i] (both may be NULL) per fact; returns IS_OK if all were added, else
 * the first failure's status (the others are still attempted). */
is_status memory_add_batch(memory *m, const memory_add_req *r, int32_t n,
                           char (*ids)[MEMORY_ID_SIZE], is_status *status);

/* Replaces the text (NULL: keep) and/or the metadata (NULL: keep; "" or
 * "{}": none) of a fact. A new text gets a new embedding and a new KV
 * record (encoded with the fact's stored context and window). IS_ERR_NOT_FOUND
 * (no such fact for this tenant and user), IS_ERR_INVALID_ARG, IS_ERR_IO, the
 * encoder's status. Unchanged on failure. */
is_status memory_update(memory *m, const char *tenant, const char *user, const char *id,
                        const char *text, const char *metadata_json);

/* Deletes a fact: row (with a DELETE history entry), KV record, index
 * entry. IS_ERR_NOT_FOUND, IS_ERR_IO.
 *
 * With GPU retrieval, add, update, delete and delete_all also change the
 * user's device copy after the commit. An add that fails there is undone
 * (its status returned); an update or delete stands and returns the
 * device's status (IS_ERR_INTERNAL, IS_ERR_NOMEM). After a device failure
 * the user's searches run on the CPU until the next open (memory_gpu_stats:
 * stale_users). */
is_status memory_delete(memory *m, const char *tenant, const char *user, const char *id);

/* Deletes every fact matching the filter (tenant and user required) in one
 * transaction; the count into *n_deleted (may be NULL). */
is_status memory_delete_all(memory *m, const mem_filter *f, int32_t *n_deleted);

/* Encodes the facts that have no KV record (see memory_open_report; a
 * record made for another model or dtype than the one the record store
 * serves, record_store_set_model, counts as none), with the encoder set. progress (may be NULL) is called after each fact.
 * *n_encoded (may be NULL) counts them. IS_ERR_INVALID_ARG without an
 * encoder; stops at the first failure. */
typedef void (*memory_progress_fn)(int64_t done, int64_t total, void *user_data);
is_status memory_encode_missing(memory *m, memory_progress_fn progress, void *user_data,
                                int64_t *n_encoded);

/* Encodes the KV record of one stored fact that has none (added while no
 * encoder was set, e.g. by the HTTP server, which queues this on its
 * engine thread), with fn/user_data (NULL: the encoder set). The row is
 * read, encoded and made to point to the new record under the writer lock,
 * with the same order as an add (record written, then the row updated in
 * one commit, conditional on the version read), so a fact updated or
 * deleted before the call is encoded in its current text or not at all,
 * and one changed after waits for it. *encoded (may be NULL) is false when
 * the fact already had its record. IS_ERR_NOT_FOUND (no such fact for
 * this tenant and user: deleted meanwhile), IS_ERR_INVALID_ARG (no
 * encoder), the encoder's status (no record is left behind). The encoder
 * runs on the calling thread while the writer lock is held: it must not
 * wait for another thread that may be writing to this service. */
is_status memory_encode_one(memory *m, const char *tenant, const char *user, const char *id,
                            memory_encode_fn fn, void *user_data, bool *encoded);

/* A batch encoder: encodes jobs[0..n) like n calls of a memory_encode_fn
 * (one forward for many facts, one group commit of their records), each
 * job's outcome into status[i]. Returns IS_OK or the first failure. */
typedef is_status (*memory_encode_batch_fn)(void *user_data, record_store *store,
                                            const memory_encode_job *jobs, int32_t n,
                                            is_status *status);

/* A fact's key. */
typedef struct memory_fact_ref {
    char id[MEMORY_ID_SIZE];
    char *tenant;
    char *user;
} memory_fact_ref;

/* memory_encode_one for n stored facts at once, with the batch encoder
 * fn: the rows are read under the writer lock, the records written by fn
 * with the lock released (adds, updates and deletes go on meanwhile), and
 * the rows made to point to them under the lock again, each conditional on
 * the version read, so a fact updated or deleted while it was encoded has
 * its new record dropped (status IS_ERR_NOT_FOUND; an update queues its own
 * encoding). Same order as an add (records durable, then the rows' one commit):
 * a crash leaves at most records no row points to. status[i] and
 * encoded[i] per fact (IS_ERR_NOT_FOUND: deleted or changed meanwhile;
 * encoded false when it had its record already). Returns IS_OK or the first
 * failure other than IS_ERR_NOT_FOUND. fn runs on the calling thread. */
is_status memory_encode_batch(memory *m, const memory_fact_ref *refs, int32_t n,
                              memory_encode_batch_fn fn, void *user_data, is_status *status,
                              bool *encoded);

/* The facts that have no KV record now, as memory_encode_missing counts
 * them (what it would encode), for a caller that encodes them one at a time with
 * memory_encode_one (memory_fact_refs_free). */
is_status memory_list_missing(memory *m, memory_fact_ref **out, int64_t *n);
void memory_fact_refs_free(memory_fact_ref *r, int64_t n);

/* ---- reads --------------------------------------------------------------------- */

/* One fact (no embedding) into *out (mem_fact_clear it). IS_ERR_NOT_FOUND. */
is_status memory_get(memory *m, const char *tenant, const char *user, const char *id,
                     mem_fact *out);

/* The facts matching the filter (tenant and user required), oldest first
 * (mem_facts_free). */
is_status memory_get_all(memory *m, const mem_filter *f, mem_fact **out, int32_t *n);

/* History of a fact, oldest first (mem_history_free). IS_ERR_NOT_FOUND for
 * an id never seen under this tenant and user. */
is_status memory_history(memory *m, const char *tenant, const char *user, const char *id,
                         mem_history **out, int32_t *n);

/* The id of the fact of (tenant, user) with this source and text, if any
 * (IS_ERR_NOT_FOUND otherwise): what makes imports resumable. */
is_status memory_find_source(memory *m, const char *tenant, const char *user, const char *source,
                             const char *text, char id_out[MEMORY_ID_SIZE]);

typedef struct memory_hit {
    mem_fact fact; /* no embedding */
    float score;   /* RRF (hybrid) or BM25 (no embedder) */
    float dense;   /* dot product with the query embedding */
    float bm25;
} memory_hit;

/* The k facts of f->tenant / f->user (optional agent, run and metadata
 * filters) most relevant to `query`: hybrid dense + BM25 with RRF, or BM25
 * alone without an embedder. *out (memory_hits_free), *n <= k.
 * IS_ERR_INVALID_ARG (no tenant or user, empty query, k < 0), IS_ERR_NOMEM. */
is_status memory_search(memory *m, const mem_filter *f, const char *query, int32_t k,
                        memory_hit **out, int32_t *n);

/* memory_search with the ranking chosen: MEM_SEARCH_HYBRID is
 * memory_search (BM25 alone without an embedder); MEM_SEARCH_DENSE, by dot
 * product alone (score = dense), needs an embedder (IS_ERR_INVALID_ARG
 * otherwise); MEM_SEARCH_BM25 (score = bm25, dense 0). Dense and hybrid
 * searches run on the GPU with GPU retrieval (see the top of this file). */
is_status memory_search_mode(memory *m, const mem_filter *f, const char *query, int32_t k,
                             mem_search_mode mode, memory_hit **out, int32_t *n);
void memory_hits_free(memory_hit *h, int32_t n);

/* GPU retrieval's counters into *out (searches served on the GPU, those
 * it left to the CPU, facts held, users whose device copy is stale); false
 * (and *out zeroed) when GPU retrieval is off. */
bool memory_gpu_stats(memory *m, dense_gpu_stats *out);

/* Checks that the index, the rows and the records agree: every row has an
 * embedding of the service's dimension and the hash of its text; its KV
 * record, if present (required when require_kv), loads and carries the hash
 * of the row's text; it has an index entry in its user's partition; the
 * index holds nothing else; no record file lacks a row; with GPU retrieval,
 * the device holds exactly the indexed facts, under their users, and no
 * user's copy is stale. IS_OK, else IS_ERR_INTERNAL naming the first
 * disagreement. For tests and asserts; reads every record, so it is slow
 * on big stores. */
is_status memory_check(memory *m, bool require_kv);

/* ---- import ------------------------------------------------------------------ */

typedef struct memory_import_stats {
    int64_t added, skipped, failed;
    char first_error[512]; /* what went wrong with the first failed fact, "" if none */
} memory_import_stats;

typedef struct memory_locomo_opts {
    const char *tenant;
    bool user_by_speaker; /* user = speaker lowercased; default (false): "<conv>-<speaker>" */
    int32_t window;       /* context turns per fact (MEMORY_WINDOW_DEFAULT: the service's) */
    int32_t batch;        /* facts embedded per batch (<= 0: 32) */
    memory_progress_fn progress;
    void *progress_user_data;
} memory_locomo_opts;

/* The user id a LoCoMo speaker's facts are stored under, into out[cap]. */
void memory_locomo_user(const locomo_conv *c, const char *speaker, bool by_speaker, char *out,
                        size_t cap);

/* Imports a conversation's observations as its speakers' facts: source
 * "locomo:<conv>:<dia_id>" (the evidence turn), the turns before it as
 * context, metadata {"conversation", "session", "dia_id", "speaker"}.
 * Facts already present (same user, source and text) are skipped, so an
 * interrupted import run again continues where it stopped. Counts are
 * added to *stats. A fact that fails (bad text, encoder failure) is counted,
 * the first failure's message kept in stats->first_error, and the import
 * goes on; returns IS_OK unless looking facts up in the store fails. */
is_status memory_import_locomo(memory *m, const locomo_conv *c, const memory_locomo_opts *o,
                               memory_import_stats *stats);

/* ---- fault injection (tests) ------------------------------------------------
 * The service's own steps, around the store commit; the hook is called just
 * before each (a test's child _exit()s there). Together with the record
 * store's hook (record_store_set_fault_hook on memory_record_store) and the
 * store's (mem_store_set_fault_hook on memory_fact_store), they cover every
 * point of a write. */
typedef enum memory_step {
    MEMORY_STEP_EMBEDDED = 0,   /* embedding done, nothing written */
    MEMORY_STEP_KV_WRITTEN = 1, /* new record written, row not committed */
    MEMORY_STEP_COMMITTED = 2,  /* row committed, old record / index not yet updated */
    MEMORY_STEP_KV_DELETED = 3, /* old record deleted, index not yet updated */
    MEMORY_STEP_COUNT_ = 4,
} memory_step;

typedef void (*memory_fault_fn)(memory_step step, void *user_data);
void memory_set_fault_hook(memory *m, memory_fault_fn fn, void *user_data);

#endif

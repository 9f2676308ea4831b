/*
 * record_store: fact-KV records on disk, one file per fact, with a bounded
 * in-memory cache in front.
 *
 * A fact is encoded once and read at every request that retrieves it, so
 * records are kept on disk (they outlive the process and can outnumber
 * memory) and the hot ones in memory. Layout of the directory:
 *
 *   <dir>/<id>.fkv                 one record (fact_record.h), complete
 *   <dir>/<id>.fkv.tmp.<pid>.<n>   a record being written (only during a put)
 *   <dir>/.lock                    flock()ed while a store is open
 *
 * Ids are 1-64 characters of [A-Za-z0-9_-], so they never name a path
 * outside the directory and never collide with temporary names.
 *
 * Crash safety: a put writes the whole record to a temporary name, fsyncs
 * it, renames it over <id>.fkv and fsyncs the directory, so after a crash
 * at any moment <id>.fkv holds either the old record or the new one, never a
 * mix. Leftover temporary files are removed by the next record_store_open().
 * A record file is never modified in place, which is what makes reading it
 * through mmap safe (a file truncated behind our back by another program
 * would raise SIGBUS on access: don't edit the directory by hand while a
 * store is open). Every load verifies the record's checksum, so a damaged
 * file is refused (IS_ERR_FORMAT naming it) and touches nothing else.
 *
 * Cache: records read from disk or just put (either way the file
 * memory-mapped: a put writes from the caller's buffers and never
 * assembles a record in memory) are kept in an LRU list bounded by `cache_bytes`; a record larger
 * than the bound is served but not kept. Records handed out by
 * record_store_get() are reference counted: eviction, overwrite and delete
 * only unlink them from the cache, and the memory goes when the last holder
 * calls record_store_release(). A held record keeps the content it had when
 * it was got, even if the fact is overwritten or deleted meanwhile.
 *
 * Threads: every function may be called from any thread at once; one mutex
 * guards the store's bookkeeping, and disk reads and writes happen outside
 * it. Handed-out records are immutable and may be read from any thread
 * until released. One process opens a directory at a time (the .lock file;
 * a second open, in this process or another, fails with IS_ERR_IO).
 */
#ifndef IS_KV_RECORD_STORE_H
#define IS_KV_RECORD_STORE_H

#include "kv/fact_record.h"

#include <stdbool.h>

typedef struct record_store record_store;

#define RECORD_STORE_ID_MAX 64

typedef struct record_store_stats {
    uint64_t hits;       /* gets served from the memory cache */
    uint64_t misses;     /* gets that went to disk (whatever the outcome) */
    uint64_t evictions;  /* records dropped from the cache to make room */
    size_t bytes_cached; /* bytes of the records in the cache */
    size_t n_cached;     /* records in the cache */
    size_t n_held;       /* records handed out and not yet released */
    /* With a disk cap (record_store_set_disk_cap; all 0 without one): */
    uint64_t disk_bytes;     /* bytes of the record files in the directory */
    uint64_t n_disk;         /* record files in the directory */
    uint64_t disk_evictions; /* record files deleted to stay within the cap */
    uint64_t n_corrupt;      /* record files a read found corrupt, moved to corrupt/ */
} record_store_stats;

/* Opens (creating it, and its parents, if missing) the store in `dir` with a
 * cache of at most `cache_bytes` (0: no caching), takes the directory's
 * lock and removes leftover temporary files. IS_ERR_INVALID_ARG (NULL or
 * empty dir), IS_ERR_IO (cannot create or open the directory, or it is
 * locked by another open store), IS_ERR_NOMEM. *out unchanged on failure. */
is_status record_store_open(const char *dir, size_t cache_bytes, record_store **out);

/* Closes the store and releases the directory's lock. Every record got
 * from it must have been released (asserted: a held record would point into
 * freed memory), and no other call on `s` may be running or follow. NULL is
 * a no-op. */
void record_store_close(record_store *s);

/* True if `id` is a valid fact id: 1-64 characters of [A-Za-z0-9_-]. */
bool record_store_id_valid(const char *id);

/* Encodes a record (fact_record_encode) and stores it under `id`,
 * replacing any record of that id atomically. The new record enters the
 * cache. IS_ERR_INVALID_ARG (bad id, meta or pointers, message says which),
 * IS_ERR_IO (create, write, fsync or rename failed: the previous record of
 * `id`, if any, is still there and no temporary file is left; or, rarely,
 * the directory fsync after the rename failed: the new record is in place
 * but may not survive a crash), IS_ERR_NOMEM. The cache always agrees with
 * the disk: it is unchanged by a put that fails before the rename. */
is_status record_store_put(record_store *s, const char *id, const fact_kv_meta *meta,
                           const int32_t *tokens, const void *k, const void *v);

/* record_store_put of n records with one group commit: every record is
 * written to its temporary name, all are flushed to disk together (their
 * writeback started at once, then an fsync each, which then finds its
 * data on the way and the file system's journal committed by the first),
 * renamed, and the directory fsynced once. What a crash leaves is what n
 * puts would leave: each <id>.fkv the old record or the new one. ids[i],
 * metas[i], tokens[i], k[i], v[i] as for record_store_put; status[i] (may
 * be NULL) gets each record's outcome. A failure before the renames
 * (a bad argument, create, write, fsync, close) writes none of them: every
 * status is that failure and nothing changed on disk or in the cache; a
 * failed rename keeps the records renamed before it; a failed directory
 * fsync is reported for every record, as by record_store_put. Returns IS_OK
 * or the first failure. n = 0 is a no-op. */
is_status record_store_put_batch(record_store *s, int32_t n, const char *const *ids,
                                 const fact_kv_meta *const *metas, const int32_t *const *tokens,
                                 const void *const *k, const void *const *v, is_status *status);

/* Looks `id` up (cache, then disk) and, if `expected` is not NULL, checks
 * the record against it with fact_meta_check(). On IS_OK *out is a record
 * the caller must hand back with record_store_release(). Failures:
 * IS_ERR_INVALID_ARG (bad id), IS_ERR_NOT_FOUND (no such record),
 * IS_ERR_FORMAT (the file is corrupt or truncated; the message names it),
 * IS_ERR_MISMATCH (made for another model, dtype or RoPE setting),
 * IS_ERR_IO, IS_ERR_NOMEM. A bad record is never returned, never cached,
 * and nothing else in the store is touched, except that a corrupt file is
 * moved to <dir>/corrupt/ (RECORD_STORE_CORRUPT_DIR): a record is derived
 * from its fact's text, so the store then reads as without it and the fact
 * is encoded again, where leaving the file would turn every later request
 * for it into a text fallback. *out is unchanged on failure. */
is_status record_store_get(record_store *s, const char *id, const fact_kv_meta *expected,
                           const fact_kv **out);

/* Reads the record of `id` from its file straight into memory the caller
 * gives (the host tier's pinned buffers: no mapping, no copy), bypassing
 * and not filling the cache: alloc(ud, len) returns len bytes, or NULL
 * (IS_ERR_NOMEM). The bytes are checked as record_store_get checks them
 * (checksum, and `expected` if not NULL), then *out points into the
 * buffer, which the caller owns (*buf, *len) and frees with its own
 * allocator; on failure the buffer is given back through release(ud, p)
 * and *out, *buf, *len are unchanged. Failures as record_store_get's. */
is_status record_store_read_into(record_store *s, const char *id, const fact_kv_meta *expected,
                                 void *(*alloc)(void *ud, size_t len),
                                 void (*release)(void *ud, void *p), void *ud, fact_kv *out,
                                 void **buf, size_t *len);

/* Hands back a record got from record_store_get() on `s`. NULL is a no-op. */
void record_store_release(record_store *s, const fact_kv *kv);

/* Removes the record of `id` from disk and cache (holders keep their copy).
 * IS_ERR_INVALID_ARG (bad id), IS_ERR_NOT_FOUND (no such file), IS_ERR_IO. */
is_status record_store_delete(record_store *s, const char *id);

/* Sub-directory of the store where records nothing refers to are set aside
 * (never deleted by recovery: only an operator removes them). */
#define RECORD_STORE_ASIDE_DIR "orphans"

/* Sub-directory where record files found corrupt by a read are kept (the
 * latest of each id), for an operator to look at; nothing reads them. */
#define RECORD_STORE_CORRUPT_DIR "corrupt"

/* Moves the record of `id` out of the store into <dir>/orphans/ (created
 * if missing), keeping its file name, and drops it from the cache. The
 * move is a rename inside one file system, so the record is either still
 * in the store or set aside, never lost. IS_ERR_INVALID_ARG (bad id),
 * IS_ERR_NOT_FOUND, IS_ERR_IO. */
is_status record_store_set_aside(record_store *s, const char *id);

/* True if a record of `id` is cached or its file exists (a get may still
 * refuse it as corrupt) and, once record_store_set_model has named the
 * serving model, was made for it (the file's header is read, not the
 * record): a record of another model or dtype is as good as none, so the
 * writers that encode what is missing encode over it. False for an
 * invalid id. */
bool record_store_contains(record_store *s, const char *id);

/* The model and dtype (fact_meta_for_model's fields; n_tokens, window and
 * text_hash ignored) whose records record_store_contains counts; NULL:
 * any record. A store serves one model at a time: ask_ctx_create names
 * its engine's. Thread-safe. */
void record_store_set_model(record_store *s, const fact_kv_meta *model);

/* ---- the disk cap ---------------------------------------------------------------
 * Where the records are a cache of facts kept elsewhere (a serving node's
 * KV, which it can encode again from the fact's row), the directory may be
 * bounded: past `bytes` of record files, the least recently used records
 * are deleted from disk (and from the memory cache). Use is a put or a get
 * (record_store_get, record_store_read_into) of the record; at the first
 * call the records already in the directory are listed, the least recently
 * modified first. Never deleted to make room: a record handed out and not
 * yet released, a pinned id (record_store_pin), or a record of the put or
 * batch that makes the room; so the directory can exceed the cap while those
 * alone fill it, and the next put brings it back. An eviction is the unlink
 * of a complete file: a crash leaves the record or nothing, and a holder's
 * mapped copy stays readable. */

/* Sets the cap in bytes (0: none, the default, and nothing is tracked) and
 * evicts down to it at once. IS_ERR_IO when the directory cannot be
 * listed (no cap is set then). */
is_status record_store_set_disk_cap(record_store *s, uint64_t bytes);

/* Keeps the record of `id` (present now or put later) from being evicted
 * until as many record_store_unpin calls: for a request that names a
 * record at submit and reads it later. No-op without a cap, or for an
 * invalid id; unpinning an id not pinned is a no-op. */
void record_store_pin(record_store *s, const char *id);
void record_store_unpin(record_store *s, const char *id);

/* A snapshot of the counters. */
record_store_stats record_store_get_stats(record_store *s);

/* ---- fault injection (tests) ------------------------------------------------
 * A put goes through these system calls in order; the hook, if set, is
 * called just before each and may return false to make that call fail (the
 * put then cleans up and returns IS_ERR_IO), or never return at all (a
 * test's child process calls _exit() there to simulate a crash). */
typedef enum record_store_step {
    RECORD_STORE_STEP_CREATE = 0,     /* create the temporary file */
    RECORD_STORE_STEP_WRITE = 1,      /* write the first half of the record */
    RECORD_STORE_STEP_WRITE_REST = 2, /* write the second half */
    RECORD_STORE_STEP_FSYNC = 3,      /* fsync the temporary file */
    RECORD_STORE_STEP_RENAME = 4,     /* rename it over <id>.fkv */
    RECORD_STORE_STEP_DIR_FSYNC = 5,  /* fsync the directory */
    RECORD_STORE_STEP_COUNT_ = 6,
} record_store_step;

typedef bool (*record_store_fault_fn)(record_store_step step, void *user_data);

/* Sets (or with NULL clears) the hook for later puts on `s`. */
void record_store_set_fault_hook(record_store *s, record_store_fault_fn fn, void *user_data);

#endif

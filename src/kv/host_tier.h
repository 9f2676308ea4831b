/*
 * host_tier: fact-KV records in host memory the GPU can read (pinned), in
 * the records' own dtype, between the GPU's fact arena and the disk.
 *
 * A request names its facts when retrieval returns; a fact the GPU arena
 * does not hold must come from somewhere the copy engine (or a kernel) can
 * read at PCIe speed while the engine computes, which is pinned memory,
 * not the page cache or a malloc'd buffer. So this tier keeps whole
 * records (the record file's bytes, fact_record.h: header, tokens, k, v)
 * in buffers carved from pinned chunks, read there straight from the file
 * (record_store_read_into: one pread, no mapping, no copy, no widening),
 * and hands out views whose k and v point into them.
 *
 * Memory: chunks come from the caller's allocator (the backend's pinned
 * host memory; malloc in tests) up to max_bytes, taken as needed (a cold
 * start reads only the records requests name). A record's buffer is a
 * power-of-two block of at least 64 KiB; free blocks of a size are kept
 * for records of that size, and when the bound is reached the least
 * recently used unheld record of that size or larger makes room (a larger
 * block is split). A record no block can hold is not cached: the get fails
 * with IS_ERR_NOMEM and the caller takes its ordinary path.
 *
 * Keys are record ids (a record id names one encoding of one version of a
 * fact; a re-encoding gets a new id), so a cached record never goes stale.
 *
 * Threads: every function may be called from any thread at once. Reads
 * run outside the lock; two gets of the same missing record read it once
 * (the second waits for the first).
 */
#ifndef IS_KV_HOST_TIER_H
#define IS_KV_HOST_TIER_H

#include "kv/record_store.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct host_tier host_tier;

/* Where the buffers come from: alloc returns IS_OK and *out, or a failure
 * (called under the tier's lock: a chunk at a time); free takes back what
 * alloc gave (and may wait for device copies still reading it). */
typedef struct host_tier_alloc {
    is_status (*alloc)(void *ud, size_t bytes, void **out);
    void (*free)(void *ud, void *p);
    /* Optional: waits until no device copy reads any of this memory; called
     * before an evicted record's memory is written again. */
    void (*quiesce)(void *ud);
    void *ud;
} host_tier_alloc;

typedef struct host_tier_stats {
    int64_t hits;          /* gets served from the tier */
    int64_t disk_reads;    /* gets that read the record file */
    int64_t evictions;     /* records dropped to make room */
    int64_t no_room;       /* gets refused for room (IS_ERR_NOMEM) */
    int64_t records;       /* records held now */
    int64_t bytes_records; /* bytes of their blocks */
    int64_t bytes_chunks;  /* bytes taken from the allocator */
} host_tier_stats;

/* A tier in front of `store` of at most max_bytes (>= 1 MiB). The store
 * and the allocator must outlive it. IS_ERR_INVALID_ARG, IS_ERR_NOMEM. */
is_status host_tier_create(record_store *store, size_t max_bytes, host_tier_alloc al,
                           host_tier **out);
/* Every view must have been released. NULL is a no-op. */
void host_tier_free(host_tier *t);

/* The record of `id` (checked against `expected` if not NULL, as
 * record_store_get does), from the tier or read from its file into it.
 * *out: a view to hand back with host_tier_release; *from_disk (may be
 * NULL): whether this get read the file. Failures: record_store_get's
 * (IS_ERR_NOT_FOUND, IS_ERR_FORMAT, IS_ERR_MISMATCH, IS_ERR_IO,
 * IS_ERR_INVALID_ARG) and IS_ERR_NOMEM when the tier has no room for it;
 * *out unchanged. */
is_status host_tier_get(host_tier *t, const char *id, const fact_kv_meta *expected,
                        const fact_kv **out, bool *from_disk);

/* Hands back a view from host_tier_get. NULL is a no-op. */
void host_tier_release(host_tier *t, const fact_kv *kv);

host_tier_stats host_tier_get_stats(host_tier *t);

#endif

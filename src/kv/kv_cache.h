/*
 * kv_cache: the paged key/value cache.
 *
 * Keys and values live in fixed-size blocks of `block_size` token slots
 * drawn from one pool; each sequence owns a block table mapping its logical
 * positions to blocks, so sequences grow without copying, many run at once,
 * and a block can be shared by several sequences (a cached serving prefix)
 * through its reference count. This module is host-side bookkeeping only:
 * the storage itself belongs to a backend and is addressed through
 * kv_cache_slot(), which gives the slot index a position maps to.
 *
 * Storage layout for one layer, as the backend keeps it:
 *   K, V: [n_blocks][n_kv_heads][block_size][head_dim]
 * so one (block, head) holds block_size consecutive tokens contiguously,
 * which is what the attention kernels read.
 *
 * Sequence ids are small integers handed out by kv_seq_create().
 */
#ifndef IS_KV_KV_CACHE_H
#define IS_KV_KV_CACHE_H

#include "inferscale.h"

typedef struct kv_cache kv_cache;

typedef struct kv_cache_params {
    int32_t n_layers;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t block_size; /* token slots per block */
    int32_t n_blocks;   /* blocks in the pool */
    int32_t max_seqs;   /* sequences alive at once */
} kv_cache_params;

/* Creates the bookkeeping for a pool. IS_ERR_INVALID_ARG on non-positive
 * sizes, IS_ERR_NOMEM. */
is_status kv_cache_create(kv_cache_params p, kv_cache **out);
void kv_cache_free(kv_cache *c);

kv_cache_params kv_cache_get_params(const kv_cache *c);
int32_t kv_cache_free_blocks(const kv_cache *c);

/* Opens an empty sequence; IS_ERR_CONTEXT_FULL when max_seqs are alive. */
is_status kv_seq_create(kv_cache *c, int32_t *seq_out);

/* Releases the sequence and drops its references to its blocks. */
void kv_seq_free(kv_cache *c, int32_t seq);

/* Number of positions the sequence holds. */
int32_t kv_seq_length(const kv_cache *c, int32_t seq);

/* Makes room for `n` more positions after the current length, taking new
 * blocks from the pool as needed, and advances the length by n. On
 * IS_ERR_CONTEXT_FULL (pool exhausted) the sequence is unchanged. */
is_status kv_seq_grow(kv_cache *c, int32_t seq, int32_t n);

/* Drops positions >= new_len (blocks no longer needed are released). */
void kv_seq_truncate(kv_cache *c, int32_t seq, int32_t new_len);

/* Makes `dst` (empty) share the first `n` positions of `src`: whole blocks
 * are shared by reference; a trailing partial block is shared too, and is
 * copied on the first write by the caller's choice (see kv_block_is_shared).
 * n must be a multiple of block_size so no block is ever written by two
 * sequences; IS_ERR_INVALID_ARG otherwise. */
is_status kv_seq_share_prefix(kv_cache *c, int32_t dst, int32_t src, int32_t n);

/* Storage slot of a position: block_id * block_size + offset. The backend
 * turns it into an address with its layout. Position must be < length. */
int32_t kv_cache_slot(const kv_cache *c, int32_t seq, int32_t pos);

/* The slots of positions pos .. pos + n - 1 (all < length) into out[n]: a
 * block's run at a time (a request's 1,250 memory tokens were 1,250 calls). */
void kv_cache_slots(const kv_cache *c, int32_t seq, int32_t pos, int32_t n, int32_t *out);

/* The block table of a sequence (valid until the next grow/truncate/free)
 * and its number of entries. */
const int32_t *kv_seq_blocks(const kv_cache *c, int32_t seq, int32_t *n_blocks);

/* Checks internal consistency (reference counts equal the number of block
 * table entries, free list disjoint from used blocks). For asserts/tests. */
bool kv_cache_check(const kv_cache *c);

#endif

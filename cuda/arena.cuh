/*
 * arena: the GPU fact-KV arena. Fact records (pre-RoPE keys and values of
 * every layer) resident in device memory as bf16, so injecting a fact that
 * is already there moves nothing across PCIe; an LRU over the records makes
 * room, and a miss fills the record from the host copy the caller passed.
 *
 * Storage is one device allocation of pages, one token per page (kv.cuh:
 * [2][n_layers][kv_dim] bf16, or in fp8 e4m3 with a scale per layer and
 * KV head: half the bytes, twice the records), so records of any length share it without
 * fragmentation and the injection kernel finds each token's page directly.
 * Records are named by the caller's 64-bit id (backend_fact.id: same id,
 * same content); id 0 means "do not keep": its pages are used for this call
 * only. Records used by the current call are never evicted by it, the
 * ones it finds resident included, whatever their place in the call.
 *
 * Host-side bookkeeping; every device operation of a place is queued on
 * the caller's stream, so pages freed there are rewritten only after the
 * work already queued has read them. Prefetches (the host tier's copies)
 * run on the arena's own stream, ordered against the caller's by two
 * events (cuda_arena_prefetch). Not locked: the backend serialises calls.
 */
#ifndef IS_CUDA_ARENA_CUH
#define IS_CUDA_ARENA_CUH

#include "common.cuh"

extern "C" {
#include "backend/backend.h"
}
#include "backend_cuda.h"

typedef struct cuda_arena cuda_arena;

/* An arena of at most max_bytes for records of this shape (the device
 * memory is taken at once), in bf16 or fp8 pages (kv.cuh). IS_ERR_NOMEM
 * when not even one page fits. */
is_status cuda_arena_create(size_t max_bytes, int32_t n_layers, int32_t n_kv_heads,
                            int32_t head_dim, bool fp8, cuda_arena **out);
void cuda_arena_free(cuda_arena *a);

bool cuda_arena_matches(const cuda_arena *a, int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                        bool fp8);
const void *cuda_arena_data(const cuda_arena *a);

/* Makes the facts resident (filling misses from the host on stream s) and
 * writes the page of each token, in order, to pages[sum of n_tokens]. All
 * of them when they fit together; otherwise the first *n_placed (at least
 * one): the caller injects those, then places the rest in another call
 * (the facts of many requests injected at once may outgrow the arena; a
 * later call may evict an earlier one's records, its injection already
 * queued on s). The claim of the call's resident records covers the whole
 * list, so a record left out of this call stays for the next. IS_ERR_NOMEM
 * when not even the first fact fits. */
is_status cuda_arena_place(cuda_arena *a, cudaStream_t s, const backend_fact *facts,
                           int32_t n_facts, int32_t *pages, int32_t *n_placed);

void cuda_arena_get_stats(const cuda_arena *a, cuda_arena_stats *out);

/* The host tier's way in (upload.cuh): makes f's record resident and pins
 * it, or only pins it when it is resident already (f->k NULL: pin only).
 * A miss is copied from f's host memory by a kernel on the arena's own
 * stream, after the injections already queued on other streams have read
 * any pages it reuses (cuda_arena_injected); the next cuda_arena_place
 * makes its stream wait for the copies. Pinned records are never evicted,
 * and pins hold at most half the pages (a resident record's pin as a
 * miss's), so a place always has room.
 * *pinned: whether a pin was taken (false: the caller injects the values
 * itself). A failure (a launch) leaves no record and no pin. */
is_status cuda_arena_prefetch(cuda_arena *a, const backend_fact_host *f, bool *pinned);

/* Drops one pin of the record of this id (no-op if none). */
void cuda_arena_unpin(cuda_arena *a, uint64_t id);

/* After an injection kernel that reads the arena was queued on s: the
 * arena's own copies wait for it before they rewrite an evicted page. */
is_status cuda_arena_injected(cuda_arena *a, cudaStream_t s);

/* Waits (host) for every copy queued on the arena's stream, so the host
 * memory they read may be freed. */
void cuda_arena_wait_uploads(cuda_arena *a);

/* Whether the record of this id holds n_tokens tokens here: the next
 * cuda_arena_place will not read its values (it spares the records of its
 * own call while making room for the others). */
bool cuda_arena_holds(const cuda_arena *a, uint64_t id, int32_t n_tokens);

#endif

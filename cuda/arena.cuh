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
 * memory is taken at once), in bf16 or fp8 pages (kv.cuh), whose host-tier
 * copies are staged in at most staging_bytes at a time (taken as needed; 0:
 * the default, the arena's bytes up to 1 GiB). IS_ERR_NOMEM when not even
 * one page fits. */
is_status cuda_arena_create(size_t max_bytes, size_t staging_bytes, int32_t n_layers,
                            int32_t n_kv_heads, int32_t head_dim, bool fp8, cuda_arena **out);
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
 * A miss takes its pages at once and is queued; its copy starts at the
 * next cuda_arena_stage, so f's host memory must stay until then (or until
 * its pin is dropped: a queued record whose last pin goes is dropped too).
 * Pinned records are never evicted, and pins hold at most half the pages,
 * so a place always has room. *pinned: whether a pin was taken (false: the
 * caller injects the values itself). */
is_status cuda_arena_prefetch(cuda_arena *a, const backend_fact_host *f, bool *pinned);

/* Drops one pin of the record of this id (no-op if none). */
void cuda_arena_unpin(cuda_arena *a, uint64_t id);

/* Layer groups of a staged batch: the copies of group g land in one step,
 * layers [l0, l1) of it. */
#define CUDA_ARENA_GROUPS 4
void cuda_arena_group(const cuda_arena *a, int32_t g, int32_t *l0, int32_t *l1);
/* The group that holds layer l of n_layers. */
int32_t cuda_arena_group_of(int32_t n_layers, int32_t l);

/* Starts the copies of every queued prefetch: host -> staging on the
 * arena's stream, a layer group after another (each group's copies of
 * every record before the next group's), the first group's at once, the
 * others at cuda_arena_send or when their group lands. *staged: the caller
 * then lands groups 0 .. CUDA_ARENA_GROUPS - 1 in order on its stream s
 * (before anything there reads or rewrites those records' pages, and
 * before the next stage), each as late as the layers it holds allow: the
 * copy of the later groups runs while earlier layers compute. A queue
 * larger than the staging lands on s here, in parts, except its last part.
 * Called before any cuda_arena_place (which refuses while records are
 * queued). */
is_status cuda_arena_stage(cuda_arena *a, cudaStream_t s, bool *staged);

/* Queues the copies of the staged batch's later groups (stage queues the
 * first one's): after the caller's forward has queued its own uploads,
 * which would otherwise wait behind them. */
is_status cuda_arena_send(cuda_arena *a);

/* Group g of the staged batch into its pages, on s after its copy. */
is_status cuda_arena_land(cuda_arena *a, cudaStream_t s, int32_t g);

/* Queues the copies of a staged batch not queued yet, and waits (host) for
 * every copy on the arena's stream, so the host memory they read may be
 * reused or freed. */
void cuda_arena_wait_uploads(cuda_arena *a);

/* Whether the record of this id holds n_tokens tokens here: the next
 * cuda_arena_place will not read its values (it spares the records of its
 * own call while making room for the others). */
bool cuda_arena_holds(const cuda_arena *a, uint64_t id, int32_t n_tokens);

#endif

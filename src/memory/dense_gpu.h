/*
 * dense_gpu: the dense half of the memory's retrieval on the GPU. It
 * keeps, per (tenant, user), that user's fact embeddings as the
 * rows of a device matrix (backend/retrieval.h's retrieval_matrix) with
 * the row <-> fact id map on the host, and a device copy of the sentence
 * embedder. A search embeds the query on the GPU (only its token ids go
 * up), takes the exact top-k of the user's rows on the GPU (only k (row,
 * score) pairs come down) and hands that list to the CPU index
 * (mem_index_search_dense_list), which runs BM25 and the RRF fusion as it
 * always does. No text or vector crosses PCIe on the request path.
 *
 * The caller (memory.c, the ask command) keeps it in step with its index:
 * every fact put with its embedding, every deleted fact removed.
 *
 * ---- Same results as the CPU index -----------------------------------------
 * The device orders by f64 scores, ties by row, and returns the scores
 * rounded to float; mem_index_search orders by float scores, ties by id
 * (bytewise). So the host re-sorts what comes back by (float score
 * descending, id ascending). Two f64 scores may round to one float, and
 * rows tie in any order of ids, so a run of equal float scores that the
 * cut at depth d splits could go on past what came back with smaller ids:
 * d + 1 rows are fetched, and while the d-th and the last fetched score
 * are equal (and rows remain), the fetch deepens (doubling, at least 64
 * more). Rounding is monotone, so no row left on the device scores above
 * the last fetched one: once the d-th score is above the last fetched
 * score, the first d after the re-sort are exactly the first d of the
 * whole order. Scores themselves differ from the CPU's by the query
 * embedding's and the summation's rounding (about 1e-6: the CPU sums in
 * float, the device in f64), so facts whose CPU scores are that close may
 * come out in the other order.
 *
 * ---- What stays on the CPU ---------------------------------------------------
 * dense_gpu_search leaves a search to the caller (*handled = false,
 * nothing done) when: it has an agent_id, run_id or metadata filter (the
 * device keeps no filter fields), it is BM25 only, its dense depth is
 * RETRIEVAL_TOPK_MAX or more, a tie run at the cut runs past RETRIEVAL_TOPK_MAX rows,
 * or the user's device copy is stale (below).
 *
 * ---- Failures ----------------------------------------------------------------
 * A put or remove that fails on the device marks the user's copy stale:
 * its rows may no longer match the facts. A stale user's searches go to the
 * CPU until the next open (dense_gpu_stats counts them); everything else
 * goes on. The failing call returns its status.
 *
 * ---- Threads ---------------------------------------------------------------------
 * One mutex serialises everything: puts, removes and searches, the GPU
 * work (the query's embedding lives in one device buffer) and the CPU
 * fusion of a hybrid search, which runs under it too (it needs the query
 * on the device to score BM25-only hits). Lock order: this mutex, then the
 * index's lock; never call in here while holding the index's lock.
 *
 * The device work goes through the CUDA backend's retrieval calls
 * (backend/retrieval.h) and the embedder's device copy
 * (embedder_create_on). In a build without CUDA, dense_gpu_create is
 * IS_ERR_UNSUPPORTED.
 */
#ifndef IS_MEMORY_DENSE_GPU_H
#define IS_MEMORY_DENSE_GPU_H

#include "inferscale.h"
#include "memory/embedder.h"
#include "memory/index.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct dense_gpu dense_gpu;

/* Copies the embedder `emb` (borrowed: it must outlive g) to `device`.
 * IS_ERR_UNSUPPORTED (a build without CUDA, no such device or no driver,
 * a model the GPU embedder does not handle), IS_ERR_INVALID_ARG (NULL),
 * IS_ERR_NOMEM; the message says which. *out unchanged on failure. */
is_status dense_gpu_create(const embedder *emb, int32_t device, dense_gpu **out);
/* NULL is a no-op. No call may be running. */
void dense_gpu_free(dense_gpu *g);

/* Makes fact `id` of (tenant, user) present with embedding[dim] (finite):
 * appended, or replacing its row. Ids are unique within a user.
 * IS_ERR_INVALID_ARG, IS_ERR_NOMEM (host or device), IS_ERR_INTERNAL; on a
 * device failure the user's copy is stale (see Failures). */
is_status dense_gpu_put(dense_gpu *g, const char *tenant, const char *user, const char *id,
                        const float *embedding);

/* Bulk load (memory_open): as dense_gpu_put, but new facts are staged on
 * the host and uploaded with one copy per user by dense_gpu_flush (or
 * once 4096 are staged). Searches must wait for the flush. */
is_status dense_gpu_stage(dense_gpu *g, const char *tenant, const char *user, const char *id,
                          const float *embedding);
is_status dense_gpu_flush(dense_gpu *g);

/* Removes a fact (its row is replaced by the user's last). IS_ERR_NOT_FOUND
 * (the user has no such fact), IS_ERR_INTERNAL (stale then). */
is_status dense_gpu_remove(dense_gpu *g, const char *tenant, const char *user, const char *id);

/* The search of mem_index_search (same filter, query text, k, mode, out
 * and *n_out rules) with the dense list from the GPU and BM25 from ix,
 * which must hold the same facts. *handled = false: nothing was done, the
 * caller runs the search on the CPU (see What stays on the CPU). Errors:
 * mem_index_search's, IS_ERR_INTERNAL for a device failure. */
is_status dense_gpu_search(dense_gpu *g, mem_index *ix, const mem_filter *f, const char *query,
                           int32_t k, mem_search_mode mode, mem_hit *out, int32_t *n_out,
                           bool *handled);

typedef struct dense_gpu_stats {
    int64_t facts;       /* rows held, all users (staged ones included) */
    int64_t searches;    /* searches served */
    int64_t declined;    /* searches left to the CPU */
    int32_t stale_users; /* users whose copy is stale */
} dense_gpu_stats;

void dense_gpu_get_stats(dense_gpu *g, dense_gpu_stats *out);

/* Whether (tenant, user) holds `id` on the device (staged facts do not
 * count) and its copy is not stale. For invariant checks. */
bool dense_gpu_has(dense_gpu *g, const char *tenant, const char *user, const char *id);

#endif

/*
 * index: the retrieval index of the memory layer. Given a user and a query,
 * it finds that user's most relevant facts: exact top-k by embedding dot
 * product, BM25 over the facts' text, or both fused by reciprocal rank.
 *
 * Facts are partitioned by (tenant, user): a search names both and touches
 * only that partition, so another user's facts cannot be returned whatever
 * the query or the other filters (isolation by construction), and the cost
 * of a search depends on the user's facts only. Within a partition a search
 * may further require agent_id, run_id and metadata equality.
 *
 * The index lives in memory and is rebuilt from the fact store at startup;
 * it does not persist itself. It copies what it needs from each document
 * (id, filter fields, embedding, BM25 terms; not the text itself).
 *
 * Dense search is exact (the k best dot products, as a full sort would
 * give) but does not read every float: each embedding also has an int8 copy
 * with a per-row scale, a first pass over those (a quarter of the bytes,
 * integer SIMD) bounds every row's score from above and below with a proven
 * error bound, and only rows whose upper bound reaches the k-th best lower
 * bound are rescored with float32 dot products. Embeddings are expected to
 * be L2-normalised (cosine = dot), but the bounds hold for any norm.
 *
 * Threads: a mem_index holds a reader-writer lock (writers preferred, so a
 * stream of searches cannot starve an upsert). Any number of threads may
 * search at once; upsert and remove take the lock exclusively. Each thread
 * that searches keeps work buffers of 12 bytes per fact of the largest
 * partition it searched (1.2 MB at 100k facts), reused by its next search
 * and freed when the thread exits.
 */
#ifndef IS_MEMORY_INDEX_H
#define IS_MEMORY_INDEX_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct mem_index mem_index;

/* Longest fact id, in bytes (mem_hit.id holds it and a NUL). */
#define MEM_ID_MAX 71
/* RRF constant: a document at rank r (from 1) of a list adds 1 / (60 + r). */
#define MEM_RRF_K 60
/* Each ranking fused by hybrid search is taken to depth max(k, this). */
#define MEM_HYBRID_DEPTH 100

/* Which documents a search may return. tenant and user are required; the
 * other fields are optional (NULL: any value). A document matches a field
 * only if it has that field with exactly that value (a document without an
 * agent_id never matches an agent_id filter). */
typedef struct mem_filter {
    const char *tenant;
    const char *user;
    const char *agent_id;
    const char *run_id;
    /* Metadata equality, all pairs must match: key meta_keys[i] present in
     * the document's metadata with the canonical value meta_values[i] (see
     * mem_doc.metadata_json). A missing key never matches. */
    const char *const *meta_keys;   /* [n_meta] */
    const char *const *meta_values; /* [n_meta] */
    int32_t n_meta;
} mem_filter;

/* One fact, as given to mem_index_upsert (which copies what it keeps). */
typedef struct mem_doc {
    const char *id;         /* 1..MEM_ID_MAX bytes, unique across the index */
    const char *tenant;     /* required, non-empty */
    const char *user;       /* required, non-empty */
    const char *agent_id;   /* optional (NULL) */
    const char *run_id;     /* optional (NULL) */
    const char *text;       /* UTF-8, for BM25; NULL is empty */
    const float *embedding; /* [dim], finite */
    /* Optional flat JSON object (NULL or "" for none). Values that are
     * strings compare as themselves, numbers as their shortest round-trip
     * form ("3", "0.5", "1e+100"; integers without a fraction), booleans as
     * "true"/"false", null as "null". Nested objects or arrays are
     * rejected. With a repeated key the first wins. */
    const char *metadata_json;
} mem_doc;

typedef struct mem_hit {
    char id[MEM_ID_MAX + 1];
    float score;        /* what the hits are ordered by: dense, bm25 or RRF */
    float dense;        /* dot product with the query (0 in BM25 mode) */
    float bm25;         /* BM25 score (0 in dense mode, or no term matched) */
    int32_t dense_rank; /* 1-based rank in the dense list, -1 if not in it */
    int32_t bm25_rank;  /* 1-based rank in the BM25 list, -1 if not in it */
} mem_hit;

typedef enum mem_search_mode {
    MEM_SEARCH_DENSE = 0,  /* needs query_embedding */
    MEM_SEARCH_BM25 = 1,   /* needs query_text */
    MEM_SEARCH_HYBRID = 2, /* needs query_embedding; query_text may be NULL */
} mem_search_mode;

/* Creates an empty index for embeddings of `dim` floats (1..65536).
 * IS_ERR_INVALID_ARG, IS_ERR_NOMEM; *out unchanged on failure. */
is_status mem_index_create(int32_t dim, mem_index **out);
void mem_index_free(mem_index *ix);

int32_t mem_index_dim(const mem_index *ix);

/* Number of documents in the index (all partitions). */
int64_t mem_index_count(mem_index *ix);

/* Adds a document, or replaces the one with the same id (which may then
 * move to another tenant or user). IS_ERR_INVALID_ARG: missing id, tenant,
 * user or embedding, an id longer than MEM_ID_MAX, a non-finite embedding
 * value, invalid UTF-8 text, metadata that is not a flat JSON object.
 * IS_ERR_NOMEM. On failure the index is unchanged. */
is_status mem_index_upsert(mem_index *ix, const mem_doc *doc);

/* Removes a document. IS_ERR_NOT_FOUND if no document has this id. */
is_status mem_index_remove(mem_index *ix, const char *id);

/* The k best documents of the user named by f->tenant and f->user that
 * match the filter, best first, into out[0..*n_out) (*n_out <= k; fewer
 * when fewer match).
 *
 *   DENSE:  by dot product with query_embedding ([dim] floats, finite);
 *   BM25:   by BM25 of query_text; only documents sharing a term with it;
 *   HYBRID: by RRF over the dense list and the BM25 list, each computed to
 *           depth max(k, MEM_HYBRID_DEPTH) over the filtered documents; a
 *           document gets sum of 1 / (MEM_RRF_K + rank) over the lists it is
 *           in; its dense and bm25 scores are filled either way.
 *
 * Equal scores are ordered by id (bytewise ascending), so results are
 * deterministic. k = 0 gives no hits (out may then be NULL).
 * IS_ERR_INVALID_ARG: f, f->tenant or f->user NULL (a search is always
 * scoped to one user), a metadata key or value NULL, k < 0, a missing query
 * for the mode, a non-finite query value, invalid UTF-8 query text.
 * IS_ERR_NOMEM. On failure *n_out and out are unchanged. */
is_status mem_index_search(mem_index *ix, const mem_filter *f, const float *query_embedding,
                           const char *query_text, int32_t k, mem_search_mode mode, mem_hit *out,
                           int32_t *n_out);

/* mem_index_search with the dense list computed elsewhere (memory/
 * dense_gpu.h computes it on the GPU): dense_ids[0..n_dense) with
 * dense_scores, best first, meant to be the user's top min(depth, size)
 * documents by dot product in this index's order (score descending, equal
 * scores by id), depth = k (DENSE) or max(k, MEM_HYBRID_DEPTH) (HYBRID).
 * The list is taken as is (entries past depth are ignored; ids not in the
 * user's partition, e.g. removed since, are skipped); BM25 and the RRF
 * fusion run here exactly as in mem_index_search. A HYBRID hit outside
 * the list gets dense = NAN (the index has no query embedding to score it
 * with): the caller fills it in. For unfiltered searches only: an
 * agent_id, run_id or metadata filter is IS_ERR_INVALID_ARG (the list was
 * not filtered), as are mode BM25, a NULL or non-finite entry. Otherwise as
 * mem_index_search. */
is_status mem_index_search_dense_list(mem_index *ix, const mem_filter *f,
                                      const char *const *dense_ids, const float *dense_scores,
                                      int32_t n_dense, const char *query_text, int32_t k,
                                      mem_search_mode mode, mem_hit *out, int32_t *n_out);

/* Checks the invariants: the id map agrees with every partition's rows,
 * int8 copies agree with the float rows, BM25 postings agree (bm25_check).
 * Takes the read lock. For asserts and tests. */
bool mem_index_check(mem_index *ix);

#endif

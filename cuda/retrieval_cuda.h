/*
 * retrieval_cuda: the CUDA backend's implementation of the retrieval
 * interface (backend/retrieval.h): the sentence embedder (a copy of the
 * encoder weights a memory/embedder.h model hands out) and an exact top-k
 * over one user's fact embeddings held in device memory. The memory layer
 * reaches these calls only through retrieval_cuda_ops(); tests and
 * benchmarks of the backend call them directly.
 *
 * Why: on the request path the CPU embeds the query and scans the user's
 * facts; with both on the GPU only the query's token ids go up and the k
 * (row, score) pairs come back, so neither text nor vectors cross PCIe, and
 * the scan runs at HBM bandwidth.
 *
 * cuda_embedder: f32 throughout, the CPU embedder's forward pass mirrored
 * step for step (embeddings + LayerNorm, post-LN layers with cuBLAS SGEMM
 * projections, attention per (text, head), GELU with the same erf
 * approximation, mean or CLS pooling, L2 normalisation); only summation
 * orders differ, so vectors agree with the CPU's to about 1e-6
 * (tests/cuda/test_cuda_retrieval.c holds them to cosine >= 0.99999 and
 * 1e-4 per element). Inputs follow embedder_embed_ids: texts packed without
 * padding, each attending to itself only; 1 <= lens[i] <= max_tokens. The
 * text variants tokenise on the host with the weights' tokenizer callback
 * (the CPU embedder's WordPiece, truncating to max_tokens as the CPU does).
 *
 * cuda_fact_matrix: one user's facts, rows [0, count) of a [capacity][dim]
 * f32 device matrix; the caller maps rows to fact ids. Search scores every
 * row against a device query with f64 accumulation (each product of two
 * floats is exact in f64), then selects the k best on the device by
 * (score descending, row ascending) on the f64 scores: the result is the
 * order a double-precision brute force gives, ties broken by the lower row,
 * for any n. Scores come back rounded to float.
 *
 * Streams and threads: all work runs on the calling thread's per-thread
 * default stream (cudaStreamPerThread of the object's device), so the calls
 * one thread makes are ordered among themselves and run beside other
 * threads' work (and the LLM backend's own stream). In particular a query
 * embedded by cuda_embedder_embed_device is ready for cuda_fact_matrix_search
 * called next by the same thread, without waiting on the host; a thread
 * that reads out_dev otherwise must synchronise that stream first
 * (cudaStreamSynchronize(cudaStreamPerThread) on the embedding thread).
 * Every other call returns with its work finished. Each object is used by
 * one thread at a time (they keep work buffers), but may change threads
 * between calls: an embedder's next call waits, on the device, for its
 * previous one. Calls make the object's device current on the calling
 * thread. A cuda_embedder keeps the weights' tokenizer pointer: free it
 * before the CPU embedder that lent it.
 *
 * Errors: IS_ERR_INVALID_ARG for bad arguments (nothing is done),
 * IS_ERR_UNSUPPORTED without a usable device or for a model the kernels do
 * not handle, IS_ERR_NOMEM when device memory runs out, IS_ERR_INTERNAL for
 * another CUDA or cuBLAS failure (a message is set, see is_error_last).
 *
 * Usable from C11 and C++ (extern "C"); the caller allocates device memory
 * for the _device variants (cudaMalloc from cuda_runtime_api.h).
 */
#ifndef IS_CUDA_RETRIEVAL_CUDA_H
#define IS_CUDA_RETRIEVAL_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend/retrieval.h"

/* The table of the calls below that retrieval_backend_get("cuda") returns. */
const retrieval_ops *retrieval_cuda_ops(void);

/* ---- the embedder ------------------------------------------------------ */

typedef struct retrieval_encoder cuda_embedder;

/* Copies the encoder weights `w` (memory/embedder_weights.h gives a loaded
 * CPU embedder's) to `device` (about
 * 90 MB for MiniLM). IS_ERR_UNSUPPORTED without a usable device, or when
 * attention over max_tokens tokens of one head does not fit the device's
 * shared memory (max_tokens * (2 * head_dim + 5) * 4 bytes and a little
 * more: 70 KB for MiniLM, 139 KB for a 512-token model with head_dim 32;
 * 512 tokens with head_dim 64 is too much for an H200's 227 KB);
 * IS_ERR_NOMEM; *out unchanged on failure. */
is_status cuda_embedder_create(const encoder_weights *w, int32_t device, cuda_embedder **out);

/* Frees the device copy. NULL is a no-op. */
void cuda_embedder_free(cuda_embedder *g);

int32_t cuda_embedder_dim(const cuda_embedder *g);        /* H: floats per embedding */
int32_t cuda_embedder_max_tokens(const cuda_embedder *g); /* per text, [CLS] and [SEP] included */

/* Embeds n texts of token ids (text i is ids[i][0..lens[i]), with its [CLS]
 * and [SEP]; 1 <= lens[i] <= max_tokens, every id < vocabulary size) into
 * out_dev[n][H] in device memory, each row L2-normalised. Returns once the
 * work is queued (see Streams). IS_ERR_INVALID_ARG for n < 0, NULL pointers
 * (ids, lens, out_dev may be NULL when n == 0), a bad length or id.
 * out_dev is unspecified on failure. */
is_status cuda_embedder_embed_ids_device(cuda_embedder *g, const int32_t *const *ids,
                                         const int32_t *lens, int32_t n, float *out_dev);

/* The same into host memory out[n][H]; returns when out holds the result. */
is_status cuda_embedder_embed_ids(cuda_embedder *g, const int32_t *const *ids, const int32_t *lens,
                                  int32_t n, float *out);

/* Tokenises n NUL-terminated texts on the host (the CPU embedder's
 * tokenizer, truncated to max_tokens) and embeds them into out_dev[n][H].
 * Only token ids cross PCIe. IS_ERR_INVALID_ARG for n < 0 or a NULL text. */
is_status cuda_embedder_embed_device(cuda_embedder *g, const char *const *texts, int32_t n,
                                     float *out_dev);

/* The same into host memory out[n][H] (for tests and bulk embedding). */
is_status cuda_embedder_embed(cuda_embedder *g, const char *const *texts, int32_t n, float *out);

/* ---- the fact matrix and exact top-k ---------------------------------- */

typedef struct retrieval_matrix cuda_fact_matrix;

/* The largest k a search takes. */
#define CUDA_TOPK_MAX RETRIEVAL_TOPK_MAX

/* Creates an empty matrix of rows of `dim` floats (1..65536) on `device`.
 * Device memory grows with the rows: 4 * dim bytes a row, plus 8 bytes a
 * row of search scratch. IS_ERR_INVALID_ARG, IS_ERR_UNSUPPORTED,
 * IS_ERR_NOMEM; *out unchanged on failure. */
is_status cuda_fact_matrix_create(int32_t device, int32_t dim, cuda_fact_matrix **out);

void cuda_fact_matrix_free(cuda_fact_matrix *m);

int32_t cuda_fact_matrix_count(const cuda_fact_matrix *m); /* rows in use */
int32_t cuda_fact_matrix_dim(const cuda_fact_matrix *m);

/* Writes data[i][0..dim) (host memory, finite) into row rows[i], i < n.
 * Rows below the current count are replaced; rows at or past it append:
 * the new count is max(count, max(rows) + 1), and every row in
 * [count, new count) must be among rows[] (no gaps). rows[] must be
 * distinct. Capacity grows as needed (doubling). Each run of consecutive
 * rows is one transfer, so bulk loads should come in row order; the caller
 * keeps the row -> fact map. IS_ERR_INVALID_ARG (a negative or repeated
 * row, a gap, a non-finite value, NULL pointers when n > 0, a count past
 * INT32_MAX - 1): the matrix is unchanged. IS_ERR_NOMEM when growing
 * fails: unchanged too. IS_ERR_INTERNAL when a copy fails: rows unspecified. */
is_status cuda_fact_matrix_set_rows(cuda_fact_matrix *m, const int32_t *rows, int32_t n,
                                    const float *data);

/* The same with data_dev[n][dim] in device memory (e.g. embeddings left
 * there by cuda_embedder_embed_device on this thread); values are not
 * checked for finiteness. */
is_status cuda_fact_matrix_set_rows_device(cuda_fact_matrix *m, const int32_t *rows, int32_t n,
                                           const float *data_dev);

/* Removes row `row` by moving the last row into its place: *moved_from
 * gets the index of the row that moved (count - 1 before the call, now
 * `row`), or -1 when `row` was the last one and nothing moved; the caller
 * remaps that fact. IS_ERR_INVALID_ARG when row is not in [0, count). */
is_status cuda_fact_matrix_remove_row(cuda_fact_matrix *m, int32_t row, int32_t *moved_from);

/* The k best rows for query_dev[dim] (device memory, finite; any
 * alignment), by dot product: rows into idx_out[0..*n_out) and their scores
 * into score_out, best first, *n_out = min(k, count). Equal scores (in f64)
 * are ordered by row, ascending. IS_ERR_INVALID_ARG for k < 0,
 * k > CUDA_TOPK_MAX, NULL pointers (idx_out, score_out may be NULL when
 * k == 0). Only the k pairs cross PCIe. On failure *n_out and the outputs
 * are unchanged. */
is_status cuda_fact_matrix_search(cuda_fact_matrix *m, const float *query_dev, int32_t k,
                                  int32_t *idx_out, float *score_out, int32_t *n_out);

/* The scores of the listed rows rows[0..n) (each in [0, count), repeats
 * allowed) against query_dev[dim] into score_out[n]: the values a search
 * gives those rows (the same f64 sums, rounded to float). For the few
 * documents a caller needs beside a search's top k, e.g. a hybrid search's
 * BM25-only hits (memory/dense_gpu.h); 4 bytes a row go up and come back.
 * IS_ERR_INVALID_ARG for n < 0, n > CUDA_TOPK_MAX, a row out of range,
 * NULL pointers when n > 0. */
is_status cuda_fact_matrix_score_rows(cuda_fact_matrix *m, const float *query_dev,
                                      const int32_t *rows, int32_t n, float *score_out);

#ifdef __cplusplus
}
#endif

#endif

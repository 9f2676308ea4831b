/*
 * encoder: batched KV encoding of stored facts, the ingestion half of the
 * serving engine.
 *
 * A fact added through the API is stored at once (text, embedding) and
 * its KV encoded later: in the server on the scheduler's encoder thread,
 * whose forwards run on the engine thread (ask_ctx_create_beside). One
 * fact a forward leaves the GPU idle between small products and pays a
 * durable write per record; so the facts waiting (from every concurrent
 * add request, and the many facts of one request) are taken together:
 * one multi-sequence forward (serve/ask.h ask_encode_facts: each fact its
 * own sequence, forked from the serving prefix), one group commit of
 * their records (record_store_put_batch), then each row made to point to
 * its record (memory_encode_batch: the rows are read and updated under the
 * memory's writer lock, the forward runs without it). The same path
 * encodes, when a request is admitted, the facts it retrieved whose KV is
 * not on this node (encoder_run_for_request: KV on demand).
 */
#ifndef IS_SERVE_ENCODER_H
#define IS_SERVE_ENCODER_H

#include "memory/memory.h"
#include "serve/ask.h"

/* Most facts the scheduler takes into one batch. */
#define ENCODER_MAX_FACTS 256

/* What a batch encoder needs: the ask context whose engine, serving
 * prefix and record dtype encode the facts, and the tokens of one forward
 * (<= 0: ASK_ENCODE_MAX_TOKENS). */
typedef struct encoder_params {
    ask_ctx *ask;
    int32_t max_tokens;
} encoder_params;

/* A memory_encode_batch_fn over ask_encode_facts; user_data is a
 * const encoder_params * whose ask context writes into `store`
 * (IS_ERR_INVALID_ARG otherwise). */
is_status encoder_batch_fn(void *user_data, record_store *store, const memory_encode_job *jobs,
                           int32_t n, is_status *status);

/* Encodes the stored facts refs[0..n) in batches (memory_encode_batch with
 * encoder_batch_fn). status[i] and encoded[i] per fact, as
 * memory_encode_batch's; returns its status. Must run on the thread that
 * owns the ask context's engine. */
is_status encoder_run(memory *mem, const encoder_params *p, const memory_fact_ref *refs, int32_t n,
                      is_status *status, bool *encoded);

/* KV on demand, for a request that retrieved the stored facts refs[0..n)
 * (texts whose fact_text_hash is text_hash[i]) and finds their KV missing
 * on this node: encodes them (encoder_run; a fact whose record appeared
 * meanwhile is left as it is) and gives each the record id its row names
 * now in record[i] (malloc'd, the caller frees), or NULL when it cannot be
 * injected: not encoded (no free sequence or KV blocks, deleted, failed),
 * or its row's text is no longer the request's (changed meanwhile).
 * encoded[i]: its record was written by this call. *n_failed (may be
 * NULL) counts failures other than those of a fact deleted or changed, or
 * of no room. The caller checks its engine's status after (a backend
 * failure fails every fact). Must run on the thread that owns the ask
 * context's engine. */
void encoder_run_for_request(memory *mem, const encoder_params *p, const memory_fact_ref *refs,
                             const uint64_t *text_hash, int32_t n, char **record, bool *encoded,
                             int64_t *n_failed);

/* Encodes every stored fact that has no KV record (memory_list_missing),
 * `batch` facts at a time (<= 0: ENCODER_MAX_FACTS; the engine needs a free
 * sequence for each, besides the serving prefix's), calling progress (may
 * be NULL) after each batch. *n_encoded (may be NULL) counts the records
 * written. Stops at the first batch with a failure other than a fact
 * deleted meanwhile, and returns it. For the CLI's ingest; the server's
 * scheduler batches its own queue. */
is_status encoder_encode_missing(memory *mem, const encoder_params *p, int32_t batch,
                                 memory_progress_fn progress, void *user_data, int64_t *n_encoded);

#endif

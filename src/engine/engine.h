/*
 * engine: the forward pass of a Llama-family decoder over the paged KV
 * cache, for batches that mix tokens of several sequences (prefill chunks
 * and single decode steps alike).
 *
 * The engine owns the KV cache (bookkeeping in kv/, storage on the model's
 * backend) and the activation scratch. Every token of a batch is appended to
 * its sequence: its position is the sequence's length before it, its keys
 * and values are written into the sequence's blocks, and its query reads the
 * sequence's keys through the block table. Optional segment ids give the
 * segment-masked attention that is the reference for memory injection
 * (see backend.h, attn_batch).
 */
#ifndef IS_ENGINE_ENGINE_H
#define IS_ENGINE_ENGINE_H

#include "kv/kv_cache.h"
#include "model/model.h"

typedef struct engine engine;

typedef struct engine_params {
    int32_t n_ctx;      /* most positions one sequence may hold (0 = model's training context) */
    int32_t max_seqs;   /* sequences alive at once */
    int32_t n_blocks;   /* KV blocks in the pool (0 = enough for max_seqs full sequences, capped) */
    int32_t block_size; /* token slots per KV block */
    int32_t max_batch;  /* tokens per internal forward chunk */
} engine_params;

engine_params engine_default_params(void);

/* Creates an engine for `m` (borrowed; must outlive the engine). */
is_status engine_create(model *m, engine_params p, engine **out);
void engine_free(engine *e);

const model *engine_model(const engine *e);
kv_cache *engine_kv(engine *e);
int32_t engine_n_ctx(const engine *e);

/* Opens and frees sequences (thin wrappers over the KV cache that also reset
 * the engine's per-sequence state). */
is_status engine_seq_open(engine *e, int32_t *seq);
void engine_seq_close(engine *e, int32_t seq);

typedef struct engine_batch {
    int32_t n_tokens;
    const int32_t *tokens;      /* [n] token ids */
    const int32_t *seq;         /* [n] sequence of each token */
    const int32_t *segment;     /* [n] segment ids for masked attention, or NULL */
    const bool *want_logits;    /* [n] which tokens produce logits; NULL = the last token only */
} engine_batch;

/* Runs the batch. Tokens are appended in order to their sequences. Logits of
 * the selected tokens are written in batch order to logits[n_selected][n_vocab]
 * (host memory). On failure (IS_ERR_CONTEXT_FULL when a sequence would pass
 * n_ctx or the pool runs out, IS_ERR_INVALID_ARG for bad ids) every sequence
 * is left at its previous length. */
is_status engine_decode(engine *e, const engine_batch *b, float *logits);

#endif

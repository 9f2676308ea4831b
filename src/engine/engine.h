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
    /* Attention over injected memory (backend.h attn_batch.mem_span): queries
     * after a sequence's memory segment score its keys as score / mem_temp
     * + ln(mem_mass). 1 and 1 (the default): plain attention, exact against
     * the segment-masked reference. Both > 0. */
    float mem_temp, mem_mass;
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

/* Makes the empty sequence `dst` start with the first n positions of `src`:
 * whole blocks are shared by reference (never copied); the positions of a
 * trailing partial block are copied into a block of dst's own, so later
 * writes never touch src. On failure dst stays empty. */
is_status engine_seq_fork(engine *e, int32_t dst, int32_t src, int32_t n);

/* Keys (before RoPE) and values of a range of batch tokens, copied out
 * during the forward pass: how a fact's KV is captured at encoding time.
 * The rows are converted to dtype on the backend (0 f32, 1 f16, 2 bf16, as
 * kv_dtype numbers them; rounded as quant's conversions, bit for bit) and
 * written to k and v when the forward ends. Host memory from
 * engine_host_alloc makes that copy fastest. */
typedef struct engine_kv_capture {
    int32_t first; /* first batch token captured */
    int32_t n;     /* tokens captured */
    int32_t dtype;
    void *k; /* [n_layers][n][n_kv_heads*head_dim] host memory, pre-RoPE */
    void *v; /* [n_layers][n][n_kv_heads*head_dim] host memory */
} engine_kv_capture;

typedef struct engine_blend engine_blend; /* below */

typedef struct engine_batch {
    int32_t n_tokens;
    const int32_t *tokens;   /* [n] token ids */
    const int32_t *seq;      /* [n] sequence of each token */
    const bool *want_logits; /* [n] which tokens produce logits; NULL = the last token only */
    /* Optional, for the segment-masked reference and for encoding: */
    const int32_t *segment; /* [n] segment ids (backend.h attn_batch), or NULL */
    const int32_t *pos;     /* [n] RoPE positions, or NULL = the slot index */
    const int32_t
        *prefix_shift; /* [n] the token scores segment-0 keys as if at pos - shift, or NULL */
    engine_kv_capture *capture; /* or NULL */
    /* Optional, for recomputation fused into a forward (NULL = every token
     * appended): [n] the position a token recomputes in place, a slot its
     * sequence already holds inside its memory segment (its keys and
     * values written over that slot, as engine_recompute writes them), or
     * -1 for a token appended as usual. A sequence's recomputed tokens come
     * before its appended ones in the batch, at strictly increasing
     * positions; each attends causally by position, so the appended tokens
     * read the recomputed keys and values of the same layer, and the
     * recomputation costs its tokens' share of one pass over the weights.
     * Bad positions: IS_ERR_INVALID_ARG, nothing run; on a backend failure
     * the rewritten slots are undefined (close the sequence). */
    const int32_t *rewrite;
    /* Optional (NULL = none): CacheBlend recomputation of the sequence's
     * memory fused into this batch's forward (see engine_recompute_blend
     * for the choice): the batch's tokens, all appended to one sequence,
     * go through the first layer alone, then with the chosen memory tokens
     * (first, at their slots) through the other layers in one forward; the
     * logits equal engine_recompute_blend followed by the batch, and the
     * recomputation costs about two first-layer passes over the weights
     * more than the batch alone. Errors as engine_recompute_blend's (and
     * IS_ERR_INVALID_ARG for a batch of several sequences or with rewrite,
     * capture, segment, pos or prefix_shift), nothing run; on a backend
     * failure the memory's slots are undefined (close the sequence). */
    const engine_blend *blend;
} engine_batch;

/* Runs the batch. Tokens are appended in order to their sequences (but
 * for those b->rewrite recomputes in place). Logits of
 * the selected tokens are written in batch order to logits[n_selected][n_vocab]
 * (host memory). On failure (IS_ERR_CONTEXT_FULL when a sequence would pass
 * n_ctx or the pool runs out, IS_ERR_INVALID_ARG for bad ids, the backend's
 * failure: see engine_status) every sequence is left at its previous
 * length, and the logits are not to be used. */
is_status engine_decode(engine *e, const engine_batch *b, float *logits);

/* engine_decode, but each selected token's greedy choice (vmath_argmax of
 * its logits row) is written to tokens[n_selected] instead of the logits:
 * where the backend has an argmax op the logits never leave it (on the
 * GPU: 4 bytes a row come back instead of the vocabulary's floats). */
is_status engine_decode_greedy(engine *e, const engine_batch *b, int32_t *tokens);

/* One fact to inject: its pre-RoPE keys and values for every layer, as
 * f32, [n_layers][n_tokens][n_kv_heads*head_dim] in host memory. */
typedef struct engine_fact {
    int32_t n_tokens;
    const int32_t *tokens; /* [n_tokens] for the record in the session */
    const float *k;
    const float *v;
} engine_fact;

/* engine_batch.blend: the facts as injected (with their tokens and values)
 * and the share recomputed; selected, deviation: as engine_recompute_blend's. */
struct engine_blend {
    const engine_fact *facts;
    int32_t n_facts;
    float ratio;
    bool *selected;
    float *deviation;
};

/* Chunked RoPE + injection: appends the facts, in order, as one contiguous
 * segment at the end of `seq`; each stored key is rotated to its position
 * there and keys and values are written through the block table. No
 * attention runs. On failure (IS_ERR_CONTEXT_FULL, the backend's) the
 * sequence is unchanged. */
is_status engine_inject(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts);

/* The same, with a cache id per fact (or NULL): a nonzero id names that
 * fact's content (same id, same k and v, for this model), so a backend may
 * keep the record resident (the CUDA backend's fact-KV arena) and skip
 * reading k and v; 0 means read them this time. */
is_status engine_inject_ids(engine *e, int32_t seq, const engine_fact *facts,
                            const uint64_t *cache_ids, int32_t n_facts);

/* One sequence's facts for engine_inject_batch (as engine_inject_ids takes
 * them). */
typedef struct engine_inject_seq {
    int32_t seq;
    const engine_fact *facts;
    const uint64_t *cache_ids; /* [n_facts], or NULL */
    int32_t n_facts;
} engine_inject_seq;

/* engine_inject_ids for several sequences at once: the facts of every
 * sequence go to the backend in one inject call (on the CUDA backend one
 * kernel launch for all of them), so admitting many requests in one step
 * costs one injection, not one per request. All or nothing per sequence:
 * a sequence whose facts are refused before the backend runs
 * (IS_ERR_INVALID_ARG, IS_ERR_CONTEXT_FULL for its context or the pool) is
 * left unchanged and the others are injected; a backend failure leaves
 * every sequence of the call unchanged. results[n] (or NULL) gets each
 * sequence's status. Returns IS_OK when every sequence was injected, else
 * the failure of the first sequence in the list that failed (its message
 * set). A sequence named twice gets its second list after its first. */
is_status engine_inject_batch(engine *e, const engine_inject_seq *seqs, int32_t n,
                              is_status *results);

/* Bytes of one KV cache element: 4 (f32) or the backend's compact type's. */
size_t engine_kv_elem_size(const engine *e);

/* Copies the cache rows of positions [pos, pos + n) of a sequence, every
 * layer, to host memory: k and v [n_layers][n][n_kv_heads*head_dim], each
 * element in the cache's own type (engine_kv_elem_size bytes). For tests
 * and tools that compare caches bit for bit; waits for the copies.
 * IS_ERR_INVALID_ARG for a range outside the sequence (nothing copied),
 * or the backend's failure. */
is_status engine_seq_read_kv(engine *e, int32_t seq, int32_t pos, int32_t n, void *k, void *v);

/* Static recomputation of memory tokens: runs a forward over n tokens that
 * the sequence already holds, at slot positions pos[n] (strictly
 * increasing, inside the sequence's memory segment), and writes their keys
 * and values over those slots; tokens[n] are the tokens at those positions.
 * Each one attends causally to what the sequence holds before it: the
 * prefix, the facts before its own (injected, or recomputed in this call)
 * and its own fact's earlier tokens. No logits. The memory segment's blocks
 * are the sequence's own (injection wrote them after the forked prefix), so
 * no shared block is written. IS_ERR_INVALID_ARG for positions or tokens
 * out of range (nothing run); on a backend failure the recomputed slots are
 * undefined: close the sequence. */
is_status engine_recompute(engine *e, int32_t seq, const int32_t *pos, const int32_t *tokens,
                           int32_t n);

/* CacheBlend-style selective recomputation of a sequence's memory: the
 * facts, as engine_inject laid them out from the start of its memory
 * segment (their tokens and their stored f32 keys and values, which must
 * be present), go through the first layer, each token attending causally
 * to what the sequence holds (nothing written: a first layer's keys and
 * values depend on the token alone, so the injected ones are already
 * those); the second layer's keys and values of that output are compared
 * with the injected ones, deviation = |K - K_inj|^2 + |V - V_inj|^2 summed
 * over the row (before RoPE); the ceil(ratio * n) tokens that deviate most
 * (ties: the earlier first) are recomputed through the other layers from
 * that first layer's output, their keys and values written over their own
 * slots (the memory segment's blocks are the sequence's own; a shared
 * block is never written), the others keep the injected ones. ratio 0
 * writes nothing; ratio 1 is engine_recompute of every memory token up to
 * the first layer's rounding. selected[n] and deviation[n] (host, or NULL)
 * receive the choice and the deviations, n = the facts' tokens.
 * IS_ERR_INVALID_ARG (nothing run) for a ratio outside [0, 1], facts
 * without values or that do not lie in the memory segment, a model of one
 * layer; on a backend failure the memory's slots are undefined: close the
 * sequence. */
is_status engine_recompute_blend(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts,
                                 float ratio, bool *selected, float *deviation);

/* Sets mem_temp and mem_mass (engine_params) for the forwards from here
 * on. IS_ERR_INVALID_ARG (nothing changed) unless both are positive and
 * finite. */
is_status engine_set_memory_scale(engine *e, float temp, float mass);

/* The memory segment of a sequence: slots [*begin, *end) from the first
 * token engine_inject placed in it to the last (both 0 when it has none;
 * a fork keeps the part of it that the fork keeps). */
void engine_seq_memory(const engine *e, int32_t seq, int32_t *begin, int32_t *end);

/* Marks slots [begin, end) of a sequence as its memory segment (what
 * engine_inject records), so that a prefill of the same tokens in place is
 * the reference of an injected one under mem_temp and mem_mass.
 * IS_ERR_INVALID_ARG for a range outside 0 <= begin <= end <= n_ctx. */
is_status engine_seq_set_memory(engine *e, int32_t seq, int32_t begin, int32_t end);

/* Backend failures. Every call above that runs ops (decode, inject,
 * fork) checks the backend after them and returns its failure (the
 * sequences as before the call); while the backend is failed they refuse
 * at once. engine_status: IS_OK or that failure (message set), without
 * waiting. engine_recover: brings the backend back (backend_recover),
 * IS_OK when it had not failed; the sequences, the KV pool and its
 * contents stay, so a caller decides which of them to trust (the
 * scheduler drops every request that was running). */
is_status engine_status(engine *e);
is_status engine_recover(engine *e);

/* Whether the backend holds the fact of this cache id and length, so the
 * next engine_inject_ids may pass k = v = NULL for it (no other injection
 * in between): the caller skips fetching or widening its values. Always
 * false for id 0 and for backends without a resident store (the CPU). A
 * fact with NULL values that is not resident is refused by
 * engine_inject_ids (IS_ERR_INVALID_ARG). */
bool engine_fact_resident(engine *e, uint64_t cache_id, int32_t n_tokens);

/* The fact-KV host tier (backend.h host_alloc, fact_prefetch): callable
 * from any thread. engine_host_tier: whether the backend has one (then
 * host memory for records comes from engine_host_alloc and facts are
 * prefetched from it); the CPU has none. */
bool engine_host_tier(engine *e);
is_status engine_host_alloc(engine *e, size_t bytes, void **out);
void engine_host_free(engine *e, void *ptr);
/* Waits until no prefetch copy reads host memory (before it is reused). */
void engine_host_wait(engine *e);
/* Starts copying a fact's record (k, v [n_layers][n_tokens][kv_dim] in
 * dtype 1 f16 or 2 bf16, memory from engine_host_alloc, kept until the
 * fact is injected) to the backend, or with k = v = NULL only finds it
 * resident; either way pins it until engine_fact_unpin. True: the next
 * engine_inject_ids may pass k = v = NULL for it (engine_fact_resident
 * says so). False: nothing pinned; inject its values as usual. */
bool engine_fact_prefetch(engine *e, uint64_t cache_id, int32_t n_tokens, int32_t dtype,
                          const void *k, const void *v);
void engine_fact_unpin(engine *e, uint64_t cache_id);

#endif

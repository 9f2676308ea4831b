/*
 * ask: one question answered with memory, the request path of DESIGN.md
 * minus retrieval (the caller picks the facts):
 *
 *   kv:     fork the cached serving prefix -> fetch the facts' KV records ->
 *           inject them (chunked RoPE + scatter) -> prefill the suffix ->
 *           first token -> decode;
 *   prompt: fork the cached serving prefix -> prefill the facts' tokens and
 *           the suffix -> first token -> decode;
 *   off:    no memory segment at all.
 *
 * The two memory modes share the layout of serve/memory_prompt.h, the
 * same tokens at the same positions. Facts are encoded once, offline, with
 * context-window encoding (ask_encode_fact) and stored in the record store.
 */
#ifndef IS_SERVE_ASK_H
#define IS_SERVE_ASK_H

#include "engine/engine.h"
#include "kv/record_store.h"
#include "memory/memory.h"
#include "serve/memory_prompt.h"

typedef enum ask_mode { ASK_MODE_KV = 0, ASK_MODE_PROMPT = 1, ASK_MODE_OFF = 2 } ask_mode;

const char *ask_mode_name(ask_mode m);
/* Parses "kv", "prompt", "off"; false for anything else. */
bool ask_mode_parse(const char *s, ask_mode *out);

typedef struct ask_ctx ask_ctx;

/* Borrows the engine (needs max_seqs >= 2: the cached prefix plus one
 * request) and the record store (may be NULL), whose records of another
 * model or dtype then count as missing (record_store_set_model). Prefills
 * the serving prefix once. */
is_status ask_ctx_create(engine *e, record_store *store, kv_dtype dtype, ask_ctx **out);

/* Runs fn(arg) on the thread that owns the engine and returns its status,
 * with its error message set on the calling thread. */
typedef is_status (*ask_engine_fn)(void *arg);
typedef is_status (*ask_engine_runner)(void *user_data, ask_engine_fn fn, void *arg);

/* A context for encodings (ask_encode_facts) on a thread other than the
 * engine's: base's engine, record store, dtype and serving prefix (base
 * must outlive it), and buffers of its own; every use of the engine goes
 * through runner(user_data, ...), so the facts' tokenisation, record reads
 * and writes stay on the calling thread and only the forwards take the
 * engine's. Each context is used by one thread at a time: base by the
 * engine's, this one by its caller. */
is_status ask_ctx_create_beside(ask_ctx *base, ask_engine_runner runner, void *user_data,
                                ask_ctx **out);
void ask_ctx_free(ask_ctx *a);

const memory_prompt *ask_ctx_prompt(const ask_ctx *a);
/* The record store the encodings are written to. */
record_store *ask_ctx_store(const ask_ctx *a);

/* Where the encodings' time went, summed since the context was created
 * (written by the thread that encodes: read it there, or when it is quiet). */
typedef struct ask_encode_stats {
    double forward_ms; /* the forwards, their captured rows downloaded */
    double convert_ms; /* rows cut into records and narrowed to the record dtype */
    double write_ms;   /* records written and group-committed */
    int64_t n_forwards, n_tokens, n_facts;
} ask_encode_stats;
ask_encode_stats ask_ctx_encode_stats(const ask_ctx *a);

/* The sequence holding the serving prefix (for callers that fork it, like
 * the scheduler) and its length into *n_prefix. */
int32_t ask_ctx_prefix_seq(const ask_ctx *a, int32_t *n_prefix);

/* A fact to encode: its text and the conversation turns before it. */
typedef struct ask_fact {
    const char *id; /* record store id */
    const char *text;
    const char *const *context; /* turns before the fact, oldest first */
    int32_t n_context;
} ask_fact;

/* Encodes the fact with the last `window` turns of its context as encoding
 * context (window < 0: no context at all, not even the serving prefix: the
 * ablation) and writes its record. Skips the work and returns IS_OK with
 * *encoded = false when a record for the same model, dtype, window and text
 * is already stored. */
is_status ask_encode_fact(ask_ctx *a, const ask_fact *f, int32_t window, bool *encoded);

/* Tokens of one encoding forward when the caller gives none. */
#define ASK_ENCODE_MAX_TOKENS 2048

/* ask_encode_fact for n facts, batched: facts are grouped in order, as
 * many as fit max_tokens (<= 0: ASK_ENCODE_MAX_TOKENS; a fact longer than
 * that still goes alone) and the engine's free sequences, and each group is
 * one forward in which every fact is a sequence of its own (forked from the
 * serving prefix, then its context, then its text: the sequences do not
 * see each other, so a fact's keys and values are those it gets alone, up
 * to the summation order of the batched products), and its records are
 * written with one group commit (record_store_put_batch). window[i],
 * status[i] and encoded[i] per fact, as ask_encode_fact's. When the pool
 * cannot hold a group it is retried with half as many facts; when not even
 * one sequence is free, or one fact alone does not fit, or the backend
 * fails, the facts not yet encoded get that status (IS_ERR_CONTEXT_FULL,
 * the backend's) and the rest are not tried. Returns IS_OK or the first
 * fact's failure. */
is_status ask_encode_facts(ask_ctx *a, const ask_fact *f, const int32_t *window, int32_t n,
                           int32_t max_tokens, is_status *status, bool *encoded);

/* A memory_encode_fn over ask_encode_fact: user_data is an ask_ctx whose
 * record store is `store` (the memory service's). */
is_status ask_memory_encoder(void *user_data, record_store *store, const memory_encode_job *job);

/* ask_fetch_record without asking the backend: the values are always
 * there (widened to f32 where stored narrower). Safe from any thread (it
 * does not touch the engine), so a request's records can be made ready
 * before the engine thread takes it. */
is_status ask_load_record(ask_ctx *a, const char *id, const fact_kv **held, engine_fact *out,
                          float **buf);

/* Reads the record `id` (record_store_get, checked as ask_fetch_record
 * checks it) and gives its content id, length and text hash, without
 * converting anything; the record is left in the store's cache. Safe from
 * any thread (it does not touch the engine): the scheduler calls it on a
 * submitting thread, so that the engine thread finds the record in memory.
 * Errors as record_store_get. */
is_status ask_peek_record(ask_ctx *a, const char *id, uint64_t *content_id, int32_t *n_tokens,
                          uint64_t *text_hash);

/* The record `id` as an engine fact in f32 (converted into *buf, which the
 * caller frees, when stored in another dtype), checked against the serving
 * model and the ask_ctx's dtype. When the backend already holds the record
 * (engine_fact_resident of its content_id: the GPU arena), k and v are NULL
 * and nothing is converted; the caller must then inject it, with the
 * content_id as its cache id, before any other injection. Hand *held back
 * with record_store_release once the fact is injected. Errors as
 * record_store_get. */
is_status ask_fetch_record(ask_ctx *a, const char *id, const fact_kv **held, engine_fact *out,
                           float **buf);

typedef struct ask_timing {
    double fetch_ms;   /* records from the store (kv) */
    double inject_ms;  /* fork + rotate + scatter (kv) */
    double prefill_ms; /* the forward pass up to the first token's logits */
    double ttft_ms;    /* from the call to the first sampled token */
    double decode_ms;  /* the rest */
    int32_t n_memory_tokens;
    int32_t n_prefilled; /* tokens that went through the forward pass before the first token */
    int32_t n_generated;
} ask_timing;

typedef bool (*ask_text_cb)(const char *text, size_t len, void *user_data);

typedef struct ask_request {
    ask_mode mode;
    const char *query;
    const char *const *fact_ids;   /* kv: record ids */
    const char *const *fact_texts; /* prompt: texts (same order) */
    int32_t n_facts;
    int32_t max_tokens;
    float temperature;
    int32_t top_k;
    float top_p;
    uint64_t seed;
    /* Recovery of the facts' cross-attention (kv mode; 0 = none): the
     * first `recompute` tokens of every fact computed again in the query's
     * own forward (engine_batch.rewrite), and/or the CacheBlend share
     * `blend` of the memory's tokens recomputed after the injection
     * (engine_recompute_blend, which reads the records' values). */
    int32_t recompute;
    float blend;
} ask_request;

/* Answers a request. In kv mode every record must exist and match the
 * serving model (IS_ERR_NOT_FOUND / IS_ERR_MISMATCH / IS_ERR_FORMAT
 * otherwise, before anything is generated). */
is_status ask_run(ask_ctx *a, const ask_request *r, ask_text_cb cb, void *user_data, ask_timing *t);

#endif

/*
 * scheduler: continuous batching on one engine thread (DESIGN.md, serving).
 *
 * One thread owns the engine (and so the model and the KV cache). Other
 * threads (HTTP handlers) submit requests and encode jobs into a queue and
 * are answered through callbacks; they never touch the engine and never
 * wait for it while holding anything it needs.
 *
 * Each step of the engine thread:
 *   1. takes cancellations (a cancelled request frees its blocks at once);
 *   2. admits queued requests, oldest first, while a running slot is free
 *      and the KV pool has blocks for the request's whole prompt plus its
 *      max_tokens (a request that could never fit fails at submit with
 *      IS_ERR_CONTEXT_FULL); one that does not fit yet waits, and younger
 *      ones that fit are admitted past it up to max_bypass times, after
 *      which admission stops until it fits;
 *      an admitted request forks the cached serving prefix (memory modes),
 *      encodes its facts that have no KV on this node (one batch), fetches
 *      its facts' KV records and injects them (kv mode);
 *   3. builds one engine batch: one token for every request that is
 *      decoding, plus prompt chunks (at most prefill_chunk tokens of one
 *      request, at most step_tokens in all) of requests still prefilling,
 *      so a long prompt never stalls the others' decoding;
 *   4. runs the batch, samples for every request whose prompt is complete,
 *      emits text (stop strings held back), finishes requests (EOG, length,
 *      stop string, context end) and frees their sequences at once;
 *   5. when no request is running, runs the encoder's waiting forward
 *      (also between steps once it has waited SCHED_ENCODE_EVERY steps).
 *
 * Encode jobs run on a thread of their own, the encoder: it reads the
 * facts' rows, tokenises them, writes their records and points the rows to
 * them, and hands only each forward (serve/ask.h ask_ctx_create_beside) to
 * the engine thread, so no record write or commit ever holds a step. While
 * requests run or wait, its forwards take at most SCHED_ENCODE_BUSY_TOKENS
 * tokens, since each holds the running requests' next step.
 *
 * Admission reserves: a running request may still need the blocks for
 * the rest of its prompt and max_tokens; a new one is admitted only if the
 * free blocks minus every running request's outstanding need cover its
 * own, so a running request never runs out of KV mid-answer.
 *
 * Prompt layout. A request with memory (mode kv or prompt) is laid out as
 * serve/memory_prompt.h describes: [serving prefix][facts][suffix], where
 * the suffix holds the client's messages rendered with the chat template
 * (a client system message becomes a system turn after the memory one).
 * In kv mode, facts whose KV record is ready are injected; facts without
 * one (kv_record NULL or not in the record store) are encoded at admission
 * and injected too, when the caller named their rows; the rest (and a
 * record that cannot be used: see sched_submit) are prefilled as text
 * after the injected ones, so a fact is usable the moment it is stored. A request
 * with mode off renders the messages alone (no memory segment, no shared
 * prefix; memory_prompt_chat_plain).
 *
 * Backend failures. When the backend fails during a step, an injection
 * or an encode job (engine_status), every running request ends with an
 * ERROR carrying the failure's status and message (the HTTP layer answers
 * 500), since their KV lives on the failed device; the scheduler is
 * unhealthy (sched_get_health) and refuses submits with IS_ERR_BUSY. It
 * tries to recover at once (engine_recover), and while that fails, ends
 * the queued requests (IS_ERR_BUSY) and tries again every
 * SCHED_RECOVER_EVERY_MS; encode jobs wait. Once recovered it serves as
 * before (the serving prefix is only ever read, so it stays).
 *
 * Callbacks run on the engine thread: they must return quickly and must
 * not call back into the scheduler except sched_cancel, sched_release (of
 * their own handle, after its last event) and sched_get_stats.
 */
#ifndef IS_SERVE_SCHEDULER_H
#define IS_SERVE_SCHEDULER_H

#include "engine/engine.h"
#include "inferscale.h"
#include "kv/fact_record.h"
#include "memory/memory.h"
#include "model/chat.h"
#include "serve/ask.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct sched sched;

typedef struct sched_params {
    int32_t max_running;     /* requests in the running batch at once (default 32) */
    int32_t max_queued;      /* waiting requests beyond which submit refuses (default 256) */
    int32_t step_tokens;     /* most tokens in one engine step (0, the default: by backend,
                              SCHED_CPU_STEP_TOKENS or SCHED_GPU_STEP_TOKENS) */
    int32_t prefill_chunk;   /* most prompt tokens of one request per step (0, the default:
                              SCHED_CPU_PREFILL_CHUNK or SCHED_GPU_PREFILL_CHUNK) */
    kv_dtype record_dtype;   /* dtype of the KV records the encode jobs write and the kv
                              requests read; a record of another dtype is a miss (default f16) */
    int64_t prefetch_bytes;  /* host memory for records loaded (widened to f32) on the
                               submitting threads ahead of admission (default
                               SCHED_PREFETCH_MAX_BYTES; 0: only read into the record store's
                               cache, the engine thread widens them) */
    int64_t host_tier_bytes; /* pinned host memory for records in their own dtype, where the
                                backend has a host tier (CUDA, bf16 cache; f16 or bf16
                                records): a miss is read there
                                from its file and copied to the GPU as soon as submit names it
                                (default SCHED_HOST_TIER_BYTES or a quarter of the memory the
                                process may use, the machine's or its control group's, the
                                less; 0: off, the path above) */
    int32_t recompute;       /* kv requests: the first tokens of every injected fact computed
                              again in the request's first prefill forward (engine_batch
                              .rewrite; default 0: none) */
    int32_t max_bypass;      /* younger requests that may be admitted past a queued request
                              whose reservation does not fit yet; past that count nothing more
                              passes it until it fits (default SCHED_MAX_BYPASS; 0: strictly
                              oldest first) */
} sched_params;

/* Enough to keep short requests flowing while the running answers free a
 * long one's room; the bound on how many answers it may wait for beyond
 * those admitted before it. */
#define SCHED_MAX_BYPASS 16

/* The host tier's default size, or a quarter of the process's memory where
 * that is less. Taken a chunk at a time as records come, so a server whose
 * records fit the GPU cache pins little of it. */
#define SCHED_HOST_TIER_BYTES ((int64_t)8 << 30)

#define SCHED_PREFETCH_MAX_BYTES ((int64_t)4 << 30)

/* Step sizes by backend (a step_tokens or prefill_chunk of 0 takes these). */
#define SCHED_CPU_STEP_TOKENS   256
#define SCHED_CPU_PREFILL_CHUNK 128
#define SCHED_GPU_STEP_TOKENS   2048
#define SCHED_GPU_PREFILL_CHUNK 2048

sched_params sched_default_params(void);

/* Starts the engine thread (and, with a memory service, the encoder
 * thread). Borrows the engine (its max_seqs bounds
 * max_running + 1: one sequence holds the serving prefix; max_running is
 * also capped at step_tokens and at 64, the most sequences one engine
 * batch may mix) and the memory service (records are read from and encode
 * jobs write into its record store; may be NULL: then only mode off is
 * accepted). Both must outlive the scheduler and nothing else may use the
 * engine meanwhile. Prefills the serving prefix before returning.
 * IS_ERR_INVALID_ARG (a parameter < 0, or <= 0 but for the step sizes,
 * max_seqs < 2), IS_ERR_NOMEM, the
 * prefill's errors. An encode job needs a free sequence: with every
 * sequence in use it waits, and once it has waited, admission holds back
 * a sequence for it. */
is_status sched_create(engine *e, memory *mem, const sched_params *p, sched **out);

/* Stops the engine thread: requests still queued or running end with an
 * ERROR event (IS_ERR_CANCELLED, "server shutting down"); queued encode
 * jobs are dropped (the facts stay without
 * KV until a request needs them, or memory_encode_missing).
 * Submits racing with it are refused (IS_ERR_CANCELLED, no event); no
 * call on `s` may follow it, but handles may still be released after. */
void sched_free(sched *s);

/* A fact chosen for a request (by the caller's retrieval). */
typedef struct sched_fact {
    const char *text;      /* always set: used as text when no KV is ready */
    const char *kv_record; /* record store id, or NULL */
} sched_fact;

typedef struct sched_request {
    const chat_message *messages; /* the client's conversation, at least one */
    int32_t n_messages;
    ask_mode mode;           /* kv, prompt, off */
    const sched_fact *facts; /* copied at submit (ignored in mode off) */
    int32_t n_facts;
    /* The stored rows of facts[] ([n_facts], copied at submit), or NULL.
     * With its row (a non-empty id, tenant and user), a kv request's fact
     * whose KV is not on this node (no record named, or its file gone:
     * another node's add, a record evicted by the disk cap, a lost data
     * directory) is encoded when the request is admitted, in one batch with
     * the request's other such facts (serve/encoder.h), and injected;
     * without one it is prefilled as text. */
    const memory_fact_ref *fact_rows;
    int32_t max_tokens;      /* > 0 */
    float temperature;       /* 0 = greedy */
    float top_p;             /* (0, 1] */
    int32_t top_k;           /* 0 = off */
    uint64_t seed;           /* 0 = random */
    const char *const *stop; /* stop strings (copied, non-empty), or NULL */
    int32_t n_stop;          /* at most SCHED_MAX_STOP */
    /* Text that begins the assistant's reply (e.g. the opening of a JSON
     * object the model is to complete), or NULL: prefilled after the
     * assistant header as plain text (no control tokens) and not emitted;
     * the events carry only what the model adds. */
    const char *reply_prefix;
} sched_request;

typedef enum sched_event_kind {
    SCHED_EV_TEXT = 0,  /* text: the next piece of the answer */
    SCHED_EV_DONE = 1,  /* finished normally: finish reason and usage set */
    SCHED_EV_ERROR = 2, /* failed: status and message set; nothing follows */
} sched_event_kind;

typedef struct sched_usage {
    int32_t prompt_tokens;    /* every token of the laid-out prompt, memory included */
    int32_t prefilled_tokens; /* tokens that went through the forward pass */
    int32_t cached_tokens;    /* serving-prefix tokens shared from the cache */
    int32_t injected_tokens;  /* memory tokens injected as KV */
    int32_t memory_tokens;    /* memory tokens in all (injected + prefilled as text) */
    int32_t completion_tokens;
    /* Where each fact of a kv request was served from, as found at submit:
     * resident on the GPU, in the host tier, read from disk (the record
     * file; without a host tier: through the record store), encoded at
     * admission (no KV on this node: fact_rows), or prefilled as text (no
     * usable KV, and none could be encoded). */
    int32_t facts_gpu, facts_host, facts_disk, facts_encoded, facts_text;
    double queue_ms; /* submit -> admitted */
    double admit_ms; /* admitted -> its facts injected: fork, the facts' checks and loads, the
                      * step's one injection (the rest of ttft_ms is the forward) */
    double ttft_ms;  /* submit -> first token sampled */
    double total_ms; /* submit -> done */
} sched_usage;

typedef struct sched_event {
    sched_event_kind kind;
    const char *text; /* TEXT: not NUL-terminated */
    size_t len;
    is_finish_reason finish; /* DONE */
    sched_usage usage;       /* DONE (and ERROR, as far as it got) */
    is_status status;        /* ERROR */
    const char *message;     /* ERROR */
} sched_event;

typedef void (*sched_event_fn)(const sched_event *ev, void *user_data);

#define SCHED_ENCODE_EVERY       8    /* steps an encode job waits at most for an idle engine */
#define SCHED_ENCODE_BUSY_TOKENS 512  /* most tokens of an encoding forward while requests run */
#define SCHED_MAX_STOP           16   /* stop strings per request */
#define SCHED_MAX_FACTS          1024 /* facts per request */
#define SCHED_RECOVER_EVERY_MS   1000 /* between attempts to recover a failed backend */

typedef struct sched_handle sched_handle;

/* Queues a request; everything it points to is copied. The prompt is laid
 * out and tokenised here, on the caller's thread. Events then arrive
 * on the engine thread, ending with exactly one DONE or ERROR. Fails at
 * once, with no event, for: IS_ERR_INVALID_ARG (bad parameters: no
 * messages, a role other than system/user/assistant, max_tokens <= 0,
 * temperature < 0, top_p outside (0, 1], top_k < 0, an empty stop string,
 * a fact with no text; messages the chat template cannot render; mode
 * kv/prompt without a memory service), IS_ERR_CONTEXT_FULL (the prompt
 * plus max_tokens can never fit the context or the pool), IS_ERR_BUSY when
 * max_queued requests already wait or the backend has failed and not yet
 * recovered, IS_ERR_CANCELLED when the scheduler is shutting down. *h is the caller's until sched_release.
 *
 * In kv mode a fact whose record cannot be used (none named, missing,
 * made for another model or dtype, corrupt, or encoded from another text
 * than the fact's) is encoded at admission when its stored row is named
 * (fact_rows), else, or when that fails, prefilled as text and
 * counted as a miss; the request never fails for it. The records a
 * request names are pinned in the record store (record_store_pin) from
 * submit until it ends, so the disk cap never evicts them meanwhile. */
is_status sched_submit(sched *s, const sched_request *r, sched_event_fn fn, void *user_data,
                       sched_handle **h);

/* Asks the request to stop (client gone). Its blocks are freed at the next
 * step; a DONE with IS_FINISH_ABORT follows (unless it already ended).
 * Safe from any thread, also from inside its callback. */
void sched_cancel(sched_handle *h);

/* Gives the handle back; call after the last event (or after a cancel's
 * final event), also from inside that event's callback. A handle released
 * before its last event cancels the request and gets no more events:
 * called from another thread while one of its callbacks runs, release
 * waits for that callback to return, so user_data may be freed after it
 * (and so must not be called holding a lock the callback takes;
 * sched_cancel takes no lock a callback could be holding). */
void sched_release(sched_handle *h);

/* Queues the KV encoding of a stored fact that has no record yet (HTTP
 * add returns before it). The encoder thread runs it, with the jobs queued
 * behind it, through encoder_run; their forwards run on the engine thread
 * when no request is running, or between steps once one has waited
 * SCHED_ENCODE_EVERY steps, so a steady stream of requests does not starve
 * it. A fact deleted meanwhile is skipped; one updated is
 * encoded in its new text. Never blocks. IS_ERR_INVALID_ARG (no memory
 * service, NULL or empty ids), IS_ERR_NOMEM, IS_ERR_CANCELLED (shutting
 * down). */
is_status sched_encode(sched *s, const char *tenant, const char *user, const char *fact_id);

/* Queues the encoding of every fact without KV (memory_list_missing():
 * facts left without KV by a previous run), as one encode job per fact. */
is_status sched_encode_missing(sched *s);

/* Whether this node can inject the KV of the fact record `record` without
 * encoding it: the GPU holds the KV the fact index knows the record by, or
 * the memory's record store holds the record (as the scheduler decides at
 * admission, so a fact added through another node or evicted from disk is
 * not ready). False for a NULL or empty record. Any thread. */
bool sched_fact_kv_here(sched *s, const char *record);

/* A snapshot for /metrics and /health. */
typedef struct sched_stats {
    int32_t queued;         /* requests waiting */
    int32_t running;        /* requests in the batch */
    int32_t encode_queued;  /* encode jobs waiting */
    int32_t encode_running; /* encode jobs taken from the queue, not yet done */
    int32_t kv_blocks_used;
    int32_t kv_blocks_free;
    int32_t kv_blocks_reserved; /* free blocks promised to running requests (prompt +
                                   max_tokens not yet written): admission needs a request's
                                   whole reservation within free minus these */
    int64_t steps;              /* engine steps run */
    int64_t tokens_prefilled;   /* tokens through the forward pass, prompt side */
    int64_t tokens_generated;
    int64_t last_batch_tokens; /* tokens in the latest step */
    int64_t facts_kv_hits;     /* facts injected from a ready record */
    int64_t facts_kv_misses;   /* facts of kv requests prefilled as text (no record yet) */
    int64_t facts_encoded;
    int64_t encode_failures;
    int64_t facts_gpu, facts_host, facts_disk, facts_text; /* sched_usage's, summed */
    int64_t facts_encoded_served; /* sched_usage.facts_encoded, summed (not in facts_encoded) */
    int64_t requests_done;        /* DONE events (finished or cancelled) */
    int64_t requests_failed;      /* ERROR events */
    int64_t inject_calls;         /* injections: one a step that admitted kv requests */
    int64_t inject_requests;      /* requests injected by them */
    int32_t inject_max_requests;  /* most requests one injection took */
} sched_stats;

void sched_get_stats(sched *s, sched_stats *out);

/* hold true: the engine thread admits no queued request (running ones go
 * on) until it is called with false; the requests queued meanwhile are
 * then admitted together, as far as sequences and KV blocks go, their
 * facts injected in one call. For tests of that admission, and for a
 * caller that drains a server before it stops. */
void sched_hold_admission(sched *s, bool hold);

/* Whether the backend is serving (for /health). */
typedef struct sched_health {
    bool healthy;             /* false from a backend failure until it recovers */
    int64_t backend_failures; /* failures since start */
    int64_t recoveries;       /* successful recoveries since start */
    char last_error[600];     /* the latest failure's message ("" if none) */
} sched_health;

void sched_get_health(sched *s, sched_health *out);

#endif

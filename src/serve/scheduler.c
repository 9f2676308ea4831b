/*
 * scheduler: continuous batching on one engine thread (see scheduler.h).
 *
 * Threads and locks. s->mu guards the request queue, the encode-job
 * queue, the stop flag and the stats; the engine thread holds it only to
 * move things in and out of those, never while it computes or calls back.
 * A handle has two locks of its own, so that it can outlive the scheduler
 * (a caller may release after sched_free): h->mu guards its reference
 * count and whether it ended; h->cb_mu (recursive) is held while one of
 * its events is delivered, which is what lets sched_release from another
 * thread wait for a running callback, and a callback release its own
 * handle. Lock order: h->mu before s->mu; the engine thread never takes a
 * handle's h->mu while holding s->mu. Cancellation is an atomic flag the
 * engine thread reads at every step.
 *
 * Everything that touches the engine, the KV cache or the samplers runs on
 * the engine thread.
 */
#include "serve/scheduler.h"

#include "core/status.h"
#include "engine/sampler.h"
#include "engine/textout.h"
#include "kv/host_tier.h"
#include "serve/encoder.h"
#include "serve/fact_index.h"
#include "serve/io_pool.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_BATCH_SEQS 64 /* sequences one engine batch may mix (engine.c) */
/* Threads that take a request's facts beside the submitting one (tokenise
 * them, find or read their records): enough to keep a disk and the copy
 * engine busy, few beside the cores. */
#define SCHED_IO_THREADS        8
#define SCHED_JOB_BACKEND_TRIES 3 /* backend failures an encode job may meet before it is dropped */

typedef enum req_state { RS_QUEUED = 0, RS_PREFILL = 1, RS_DECODE = 2, RS_ENDED = 3 } req_state;

/* A fact as the request keeps it: record id, the hash of its text (a
 * record encoded from another text is not used) and its text's tokens;
 * and, when the record was seen before (fact_index), what injecting it
 * from the GPU needs: its content id and length. */
typedef struct req_fact {
    char *record;
    uint64_t text_hash;
    int32_t *toks;
    int32_t n_toks;
    bool known; /* content_id and n_kv_tokens are the record's */
    uint64_t content_id;
    int32_t n_kv_tokens;
    /* Loaded on the submitting thread (prefetch_fact) for the engine
     * thread to inject, unless the GPU turns out to hold it: */
    const fact_kv *pre_held; /* the record, or NULL */
    float *pre_buf;          /* its values widened to f32 (owned), or NULL */
    engine_fact pre;         /* as engine_inject takes it */
    int64_t pre_bytes;       /* counted in sched.prefetch_bytes */
    /* The host tier's path (prefetch_tiered): the record's view, held until
     * the request ends (a copy may read it until its injection ran), and a
     * pin on its GPU copy, held until its injection. */
    const fact_kv *ht_held;
    bool pinned;
    uint64_t pin_epoch; /* sched.pin_epoch when pinned: a recovery drops every pin */
    uint8_t tier;       /* FACT_TIER_*: where submit found it */
    /* The stored fact (sched_request.fact_rows), for encoding its KV on demand: */
    char *tenant, *user, *id; /* all set, or all NULL */
    bool rec_pinned;          /* `record` is pinned in the record store */
    bool encoded;             /* its record was encoded at admission */
    bool late_tried;          /* admission's late load ran: the record is not read again */
} req_fact;

enum { FACT_TIER_GPU = 0, FACT_TIER_HOST = 1, FACT_TIER_DISK = 2, FACT_TIER_ENCODED = 3 };

/* Records known to the fact index at most (about 100 bytes each). */
#define SCHED_FACT_INDEX_MAX ((int64_t)1 << 22)

struct sched_handle {
    sched *s; /* valid until the request ended */
    sched_event_fn fn;
    void *ud;
    pthread_mutex_t mu;    /* refs, ended */
    pthread_mutex_t cb_mu; /* held while delivering; recursive */
    int refs;              /* the caller's and the scheduler's */
    bool ended;            /* terminal event sent (or never will be) */
    bool released;         /* under cb_mu: no more events */
    atomic_bool cancelled;
    sched_handle *next; /* queue link (s->mu) */

    /* The request, fixed at submit. */
    ask_mode mode;
    req_fact *facts;
    int32_t n_facts;
    int32_t *suffix; /* after the memory segment (memory modes), the whole prompt (off) */
    int32_t n_suffix;
    int32_t est_prompt; /* prompt tokens, facts as text */
    int32_t max_tokens;
    sampler_params sp;
    char **stop;
    int32_t n_stop;
    double t_submit;
    double t_admit;

    /* Engine thread. */
    req_state state;
    int32_t seq;
    int32_t *prompt; /* tokens still to prefill after fork + inject (owned) */
    int32_t n_prompt, n_fed, chunk;
    int32_t *rw_pos; /* [n_rw] positions the first n_rw prompt tokens recompute (owned) */
    int32_t n_rw;
    int32_t reserve;       /* blocks the sequence will own at most */
    int32_t bypassed;      /* younger requests admitted while this one waited (admit) */
    int32_t shared_blocks; /* prefix blocks shared by reference, not owned */
    sampler *smp;
    textout out;
    bool out_init;
    int32_t next_tok;
    int32_t n_gen;
    sched_usage usage;
};

typedef enum job_kind { JOB_ONE = 0, JOB_MISSING = 1 } job_kind;

typedef struct sched_job {
    job_kind kind;
    char *tenant, *user, *id;
    int32_t backend_failures; /* runs that the backend failed */
    struct sched_job *next;
} sched_job;

struct sched {
    engine *e;
    memory *mem;
    sched_params p;
    int32_t max_running;
    int32_t n_vocab, n_ctx, block_size, n_blocks;
    ask_ctx *ask;                   /* the serving prefix, its layout and the encoder */
    fact_index *facts;              /* records seen: what injecting a resident one needs */
    host_tier *ht;                  /* pinned records (NULL: the backend has no host tier) */
    io_pool *io;                    /* takes a request's facts at once (tokens, records) */
    _Atomic int64_t prefetch_bytes; /* held by loaded records of queued requests */
    /* Queued requests with facts waiting for a GPU pin (counted again at
     * each admission): while there are any, a submit pins nothing, so
     * the room goes in queue order (pin_queued). */
    _Atomic int32_t n_waiting;
    int32_t prefix_seq, n_prefix, prefix_blocks;
    /* Pins on the backend's fact cache (engine_fact_prefetch): a recovery
     * drops all of them (backend.h recover), so each pin carries the epoch
     * it was taken in and one of an earlier epoch is neither trusted nor
     * dropped. pin_lock, shared around a pin or an unpin, exclusive around
     * engine_recover, keeps a pin from straddling a recovery; pin_epoch is
     * written only by the engine thread, under it exclusive. */
    pthread_rwlock_t pin_lock;
    uint64_t pin_epoch;
    int32_t n_submitting;     /* sched_submit calls inside (s->mu): sched_free waits for them */
    pthread_cond_t submit_cv; /* n_submitting went to 0 */

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    bool hold; /* sched_hold_admission */
    sched_handle *q_head, *q_tail;
    int32_t n_queued;
    sched_job *j_head, *j_tail;
    int32_t n_jobs;
    sched_stats st;

    /* Engine thread. */
    sched_handle **run;
    int32_t n_run;
    int32_t *b_tok, *b_seq;
    int32_t *b_rw; /* [step_tokens] engine_batch.rewrite */
    bool *b_want;
    sched_handle **rows;  /* owner of each logits row */
    float *logits;        /* [max_running][n_vocab] */
    int32_t *greedy;      /* [max_running]: a step's choices when every row is greedy */
    int64_t steps_waited; /* steps since the encoder's forward could have run */
    /* The encoder's forward found no free sequence while requests ran:
     * admission holds back until one frees (written by the encoder). */
    _Atomic bool encode_starved;

    /* Encode jobs run on a thread of their own (enc_main): the rows read,
     * the facts tokenised, the records written and the rows pointed to
     * them there, so none of that holds a step; only each group's forward
     * comes to the engine thread, as a call it runs between steps
     * (run_call). */
    pthread_t enc_thread;
    bool enc_started;
    pthread_cond_t enc_cv;    /* (s->mu) a job, a recovery or the stop */
    ask_ctx *enc_ask;         /* the encoder's, beside s->ask */
    struct engine_call *call; /* (s->mu) the encoder's forward, waiting for the engine thread */
    pthread_cond_t call_cv;   /* (s->mu) a call done */
    bool enc_busy;            /* encoder thread: a call of its batch ran while requests ran */
    is_status enc_backend;    /* encoder thread: the backend failed in a call of its batch */

    /* Backend failures (s->mu): while failed, submits are refused and the
     * engine thread only tries to recover, every SCHED_RECOVER_EVERY_MS. */
    bool failed;
    double recover_at; /* engine clock (now_ms) of the next attempt */
    int64_t n_failures, n_recoveries;
    char fail_msg[600]; /* the latest failure */
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The memory this process may use: the machine's, or its control group's
 * limit where that is less (a container sees the host's pages in sysconf). */
static int64_t memory_available(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    int64_t mem = pages > 0 && size > 0 ? (int64_t)pages * size : 0;
    static const char *const limits[] = {"/sys/fs/cgroup/memory.max",
                                         "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
    for (size_t i = 0; i < sizeof limits / sizeof *limits; i++) {
        FILE *f = fopen(limits[i], "r");
        if (!f) continue;
        long long v = 0;
        /* "max" (no limit) does not scan. */
        if (fscanf(f, "%lld", &v) == 1 && v > 0 && v < mem) mem = v;
        fclose(f);
    }
    return mem;
}

/* SCHED_HOST_TIER_BYTES, or a quarter of the memory this process may use
 * where that is less: pinned pages cannot be swapped, and the rest (the
 * page cache the record files are read through, the process's own heap)
 * needs the remainder. */
static int64_t host_tier_default(void) {
    int64_t quarter = memory_available() / 4;
    return quarter < SCHED_HOST_TIER_BYTES ? quarter : SCHED_HOST_TIER_BYTES;
}

sched_params sched_default_params(void) {
    sched_params p = {
        .max_running = 32,
        .max_queued = 256,
        .step_tokens = 0,
        .prefill_chunk = 0,
        .record_dtype = KV_DTYPE_F16,
        .prefetch_bytes = SCHED_PREFETCH_MAX_BYTES,
        .host_tier_bytes = host_tier_default(),
        .max_bypass = SCHED_MAX_BYPASS,
    };
    return p;
}

static int32_t blocks_for(int32_t positions, int32_t bs) { return (positions + bs - 1) / bs; }

/* ---- handles ----------------------------------------------------------------------- */

static void handle_destroy(sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++) {
        free(h->facts[i].record);
        free(h->facts[i].toks);
        free(h->facts[i].tenant);
        free(h->facts[i].user);
        free(h->facts[i].id);
    }
    free(h->facts);
    free(h->suffix);
    for (int32_t i = 0; i < h->n_stop; i++) free(h->stop[i]);
    free(h->stop);
    free(h->prompt);
    free(h->rw_pos);
    sampler_free(h->smp);
    if (h->out_init) textout_free(&h->out);
    pthread_mutex_destroy(&h->mu);
    pthread_mutex_destroy(&h->cb_mu);
    free(h);
}

static void handle_unref(sched_handle *h) {
    pthread_mutex_lock(&h->mu);
    bool last = --h->refs == 0;
    pthread_mutex_unlock(&h->mu);
    if (last) handle_destroy(h);
}

static void deliver(sched_handle *h, const sched_event *ev) {
    pthread_mutex_lock(&h->cb_mu);
    if (!h->released && h->fn) h->fn(ev, h->ud);
    pthread_mutex_unlock(&h->cb_mu);
}

/* ---- stats ---------------------------------------------------------------------------- */

static int32_t outstanding_blocks(sched *s);

/* Publishes the pool and batch figures; called before any event that a
 * reader might use to look at them (a cancel's DONE: blocks already back). */
static void publish(sched *s, int64_t done, int64_t failed) {
    int32_t free_blocks = kv_cache_free_blocks(engine_kv(s->e)), running = 0;
    for (int32_t i = 0; i < s->n_run; i++) running += s->run[i]->state != RS_ENDED;
    int32_t reserved = outstanding_blocks(s);
    pthread_mutex_lock(&s->mu);
    s->st.kv_blocks_free = free_blocks;
    s->st.kv_blocks_used = s->n_blocks - free_blocks;
    s->st.kv_blocks_reserved = reserved;
    s->st.running = running;
    s->st.requests_done += done;
    s->st.requests_failed += failed;
    pthread_mutex_unlock(&s->mu);
}

/* ---- pins ----------------------------------------------------------------------------- */

/* engine_fact_prefetch for f (any thread): true with f pinned, in this epoch. */
static bool fact_pin(sched *s, req_fact *f, uint64_t id, int32_t n_tokens, int32_t dtype,
                     const void *k, const void *v) {
    pthread_rwlock_rdlock(&s->pin_lock);
    bool ok = engine_fact_prefetch(s->e, id, n_tokens, dtype, k, v);
    if (ok) f->pinned = true, f->pin_epoch = s->pin_epoch;
    pthread_rwlock_unlock(&s->pin_lock);
    return ok;
}

/* Drops f's pin (any thread), unless a recovery dropped it already. */
static void fact_unpin(sched *s, req_fact *f) {
    if (!f->pinned) return;
    pthread_rwlock_rdlock(&s->pin_lock);
    if (f->pin_epoch == s->pin_epoch) engine_fact_unpin(s->e, f->content_id);
    pthread_rwlock_unlock(&s->pin_lock);
    f->pinned = false;
}

/* Whether f holds a pin the backend still keeps (engine thread: the only
 * writer of pin_epoch). */
static bool pin_live(const sched *s, const req_fact *f) {
    return f->pinned && f->pin_epoch == s->pin_epoch;
}

/* ---- ending a request ------------------------------------------------------------------ */

/* Gives back the records loaded ahead for a fact that did not use them. */
static void drop_loaded(sched *s, req_fact *f) {
    if (f->ht_held) host_tier_release(s->ht, f->ht_held);
    f->ht_held = NULL;
    if (f->pre_held) record_store_release(memory_record_store(s->mem), f->pre_held);
    free(f->pre_buf);
    if (f->pre_bytes) atomic_fetch_sub(&s->prefetch_bytes, f->pre_bytes);
    f->pre_held = NULL;
    f->pre_buf = NULL;
    f->pre_bytes = 0;
}

/* Gives back the pin and the records loaded ahead for a fact. */
static void drop_prefetch_fact(sched *s, req_fact *f) {
    fact_unpin(s, f);
    drop_loaded(s, f);
}

static void drop_prefetch(sched *s, sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++) drop_prefetch_fact(s, &h->facts[i]);
}

/* Lets the disk cap evict the request's records again. */
static void unpin_records(sched *s, sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++)
        if (h->facts[i].rec_pinned) {
            record_store_unpin(memory_record_store(s->mem), h->facts[i].record);
            h->facts[i].rec_pinned = false;
        }
}

/* Frees what the request holds on the engine side (at once: blocks go
 * back to the pool before the terminal event). */
static void release_engine_side(sched *s, sched_handle *h) {
    drop_prefetch(s, h);
    unpin_records(s, h);
    if (h->seq >= 0) engine_seq_close(s->e, h->seq);
    h->seq = -1;
    h->state = RS_ENDED;
}

/* Sends the terminal event. The scheduler's reference is dropped by
 * compact_run for a running request (the run list still points to it),
 * by the caller for a queued one. */
static void finish(sched *s, sched_handle *h, const sched_event *ev) {
    release_engine_side(s, h);
    publish(s, ev->kind == SCHED_EV_DONE, ev->kind != SCHED_EV_DONE);
    deliver(h, ev);
    pthread_mutex_lock(&h->mu);
    h->ended = true;
    pthread_mutex_unlock(&h->mu);
}

static void finish_done(sched *s, sched_handle *h, is_finish_reason why) {
    h->usage.completion_tokens = h->n_gen;
    h->usage.total_ms = now_ms() - h->t_submit;
    sched_event ev = {.kind = SCHED_EV_DONE, .finish = why, .usage = h->usage};
    finish(s, h, &ev);
}

static void finish_error(sched *s, sched_handle *h, is_status st, const char *msg) {
    h->usage.completion_tokens = h->n_gen;
    h->usage.total_ms = now_ms() - h->t_submit;
    sched_event ev = {.kind = SCHED_EV_ERROR, .status = st, .message = msg, .usage = h->usage};
    finish(s, h, &ev);
}

/* Drops ended requests from the run list (and the scheduler's reference
 * to them), keeping admission order. */
static void compact_run(sched *s) {
    int32_t k = 0;
    for (int32_t i = 0; i < s->n_run; i++) {
        if (s->run[i]->state != RS_ENDED) s->run[k++] = s->run[i];
        else handle_unref(s->run[i]);
    }
    s->n_run = k;
}

/* ---- backend failures ------------------------------------------------------------------ */

/* Ends every queued request (they never ran) with IS_ERR_BUSY: the
 * backend is down, so they would wait for an unknown time. */
static void fail_queued(sched *s, const char *msg) {
    pthread_mutex_lock(&s->mu);
    sched_handle *q = s->q_head;
    s->q_head = s->q_tail = NULL;
    s->n_queued = 0;
    s->st.queued = 0;
    pthread_mutex_unlock(&s->mu);
    while (q) {
        sched_handle *h = q;
        q = h->next;
        finish_error(s, h, IS_ERR_BUSY, msg);
        handle_unref(h);
    }
}

/* One attempt to bring the backend back; true when it is (or was) fine. */
static bool try_recover(sched *s) {
    pthread_rwlock_wrlock(&s->pin_lock);
    bool was_failed = engine_status(s->e) != IS_OK;
    is_status st = engine_recover(s->e);
    if (st == IS_OK && was_failed) s->pin_epoch++; /* the backend dropped every pin */
    pthread_rwlock_unlock(&s->pin_lock);
    pthread_mutex_lock(&s->mu);
    if (st == IS_OK) {
        s->failed = false;
        s->n_recoveries++;
        pthread_cond_signal(&s->enc_cv); /* encode jobs waited for it */
    } else {
        s->recover_at = now_ms() + SCHED_RECOVER_EVERY_MS;
    }
    pthread_mutex_unlock(&s->mu);
    return st == IS_OK;
}

/* The backend latched a failure (engine_status) during an engine call.
 * Every running request's KV lives on it, so all of them end with an
 * ERROR carrying the failure (the HTTP layer answers 500); the scheduler
 * is unhealthy from here (sched_get_health) and refuses submits. One
 * recovery is tried at once, before those requests hear of it, so a
 * client that sees its error and asks /health sees the outcome (a failure
 * that does not stick costs only the requests it hit); if it fails, the
 * queued requests end too (IS_ERR_BUSY) and the engine thread tries again
 * every SCHED_RECOVER_EVERY_MS. */
static void backend_failed(sched *s, is_status st) {
    char msg[600];
    snprintf(msg, sizeof msg, "backend failure: %s", is_error_last());
    pthread_mutex_lock(&s->mu);
    s->failed = true;
    s->n_failures++;
    snprintf(s->fail_msg, sizeof s->fail_msg, "%s", msg);
    pthread_mutex_unlock(&s->mu);
    bool back = try_recover(s);
    for (int32_t i = 0; i < s->n_run; i++) finish_error(s, s->run[i], st, msg);
    compact_run(s);
    if (back) return;
    char busy[700];
    snprintf(busy, sizeof busy, "%s; the server is recovering, retry later", msg);
    fail_queued(s, busy);
}

/* ---- encode jobs ----------------------------------------------------------------------- */

static void job_free(sched_job *j) {
    if (!j) return;
    free(j->tenant);
    free(j->user);
    free(j->id);
    free(j);
}

static is_status job_push(sched *s, sched_job *j, bool front) {
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        job_free(j);
        return is_error_set(IS_ERR_CANCELLED, "scheduler: shutting down");
    }
    if (front) {
        j->next = s->j_head;
        s->j_head = j;
        if (!s->j_tail) s->j_tail = j;
    } else {
        j->next = NULL;
        if (s->j_tail) s->j_tail->next = j;
        else s->j_head = j;
        s->j_tail = j;
    }
    s->n_jobs++;
    s->st.encode_queued = s->n_jobs;
    pthread_cond_signal(&s->enc_cv);
    pthread_mutex_unlock(&s->mu);
    return IS_OK;
}

static sched_job *job_pop(sched *s) {
    pthread_mutex_lock(&s->mu);
    sched_job *j = s->j_head;
    if (j) {
        s->j_head = j->next;
        if (!s->j_head) s->j_tail = NULL;
        s->n_jobs--;
        s->st.encode_queued = s->n_jobs;
        s->st.encode_running = 1;
    }
    pthread_mutex_unlock(&s->mu);
    return j;
}

static sched_job *job_new(job_kind kind, const char *tenant, const char *user, const char *id) {
    sched_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->kind = kind;
    if (kind == JOB_ONE) {
        j->tenant = strdup(tenant);
        j->user = strdup(user);
        j->id = strdup(id);
        if (!j->tenant || !j->user || !j->id) {
            job_free(j);
            return NULL;
        }
    }
    return j;
}

/* An encoder's use of the engine (ask_engine_runner), run on the engine
 * thread by run_call. */
typedef struct engine_call {
    ask_engine_fn fn;
    void *arg;
    is_status st;
    is_status backend; /* the engine's status after it */
    bool busy;         /* requests were running when it ran */
    bool done;
    char msg[512];
} engine_call;

/* ask_engine_runner of the encoder's ask context, on the encoder thread:
 * hands fn to the engine thread and waits for it. */
static is_status run_on_engine(void *ud, ask_engine_fn fn, void *arg) {
    sched *s = ud;
    engine_call c = {.fn = fn, .arg = arg};
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        return is_error_set(IS_ERR_CANCELLED, "scheduler: shutting down");
    }
    s->call = &c;
    pthread_cond_signal(&s->cv);
    while (!c.done) pthread_cond_wait(&s->call_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    s->enc_busy |= c.busy;
    if (c.backend != IS_OK && s->enc_backend == IS_OK) s->enc_backend = c.backend;
    return c.st == IS_OK ? IS_OK : is_error_set(c.st, "%s", c.msg);
}

/* Ends the call taken from s->call with st. */
static void call_done(sched *s, engine_call *c, is_status st, const char *msg) {
    c->st = st;
    if (st != IS_OK) snprintf(c->msg, sizeof c->msg, "%s", msg);
    pthread_mutex_lock(&s->mu);
    c->done = true;
    pthread_cond_broadcast(&s->call_cv);
    pthread_mutex_unlock(&s->mu);
}

/* Runs the encoder's waiting call, if any (engine thread). A backend
 * failure in it is handled here, as one in a step is. */
static void run_call(sched *s) {
    pthread_mutex_lock(&s->mu);
    engine_call *c = s->call;
    s->call = NULL;
    pthread_mutex_unlock(&s->mu);
    if (!c) return;
    s->steps_waited = 0;
    c->busy = s->n_run > 0;
    is_status st = c->fn(c->arg);
    c->backend = engine_status(s->e);
    char msg[sizeof c->msg];
    snprintf(msg, sizeof msg, "%s", st != IS_OK ? is_error_last() : "");
    if (c->backend != IS_OK) backend_failed(s, c->backend);
    call_done(s, c, st, msg);
}

static void run_job_taken(sched *s, sched_job *j);

/* Runs the next encode job (encoder thread). */
static void run_job(sched *s) {
    sched_job *j = job_pop(s); /* counted running from here (job_pop) */
    if (!j) return;
    run_job_taken(s, j);
    pthread_mutex_lock(&s->mu);
    s->st.encode_running = 0;
    pthread_mutex_unlock(&s->mu);
}

/* The job j, then those that join its batch. */
static void run_job_taken(sched *s, sched_job *j) {
    if (j->kind == JOB_MISSING) {
        memory_fact_ref *refs = NULL;
        int64_t n = 0;
        if (memory_list_missing(s->mem, &refs, &n) == IS_OK) {
            for (int64_t i = 0; i < n; i++) {
                sched_job *one = job_new(JOB_ONE, refs[i].tenant, refs[i].user, refs[i].id);
                if (!one || job_push(s, one, false) != IS_OK) break;
            }
            memory_fact_refs_free(refs, n);
        } else {
            pthread_mutex_lock(&s->mu);
            s->st.encode_failures++;
            pthread_mutex_unlock(&s->mu);
        }
        job_free(j);
        s->encode_starved = false;
        return;
    }
    /* The jobs behind it join its batch: forwards of one step's tokens and
     * one group commit each for the facts waiting (serve/encoder.h); the
     * engine thread runs one forward between its steps, so a request that
     * comes meanwhile waits for one forward at most. */
    sched_job *batch[ENCODER_MAX_FACTS];
    memory_fact_ref refs[ENCODER_MAX_FACTS];
    is_status sts[ENCODER_MAX_FACTS];
    bool did[ENCODER_MAX_FACTS];
    int32_t nb = 0;
    batch[nb++] = j;
    pthread_mutex_lock(&s->mu);
    while (nb < ENCODER_MAX_FACTS && s->j_head && s->j_head->kind == JOB_ONE) {
        sched_job *h = s->j_head;
        s->j_head = h->next;
        if (!s->j_head) s->j_tail = NULL;
        s->n_jobs--;
        batch[nb++] = h;
    }
    s->st.encode_queued = s->n_jobs;
    s->st.encode_running = nb;
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < nb; i++) {
        memset(&refs[i], 0, sizeof refs[i]);
        snprintf(refs[i].id, sizeof refs[i].id, "%s", batch[i]->id);
        refs[i].tenant = batch[i]->tenant;
        refs[i].user = batch[i]->user;
    }
    s->enc_busy = false;
    s->enc_backend = IS_OK;
    /* A forward of one step's tokens at most, as a step of requests is;
     * while requests run, a shorter one, since each holds their next step
     * for as long as it takes. */
    pthread_mutex_lock(&s->mu);
    bool serving = s->st.running > 0 || s->st.queued > 0;
    pthread_mutex_unlock(&s->mu);
    int32_t tokens = s->p.step_tokens;
    if (serving && tokens > SCHED_ENCODE_BUSY_TOKENS) tokens = SCHED_ENCODE_BUSY_TOKENS;
    encoder_params ep = {s->enc_ask, tokens};
    encoder_run(s->mem, &ep, refs, nb, sts, did);
    if (s->enc_backend != IS_OK) {
        s->encode_starved = false; /* the running requests were failed: nothing to wait for */
        /* Not the facts' fault (the engine thread has failed the running
         * requests): they run again once the backend is back. A job the
         * backend fails every time would run forever, so after a few it
         * is dropped like any failed job (the fact stays, prefilled as
         * text, and is encoded at the next start). */
        for (int32_t i = nb - 1; i >= 0; i--) {
            if (sts[i] == IS_OK || sts[i] == IS_ERR_NOT_FOUND) {
                if (sts[i] == IS_OK && did[i]) {
                    pthread_mutex_lock(&s->mu);
                    s->st.facts_encoded++;
                    pthread_mutex_unlock(&s->mu);
                }
                job_free(batch[i]);
            } else if (++batch[i]->backend_failures < SCHED_JOB_BACKEND_TRIES) {
                job_push(s, batch[i], true);
            } else {
                pthread_mutex_lock(&s->mu);
                s->st.encode_failures++;
                pthread_mutex_unlock(&s->mu);
                job_free(batch[i]);
            }
        }
        return;
    }
    bool starved = false;
    for (int32_t i = nb - 1; i >= 0; i--) {
        if (sts[i] == IS_ERR_CONTEXT_FULL && s->enc_busy) {
            /* No free sequence or blocks while requests ran: wait for them. */
            starved = true;
            job_push(s, batch[i], true); /* stopping: dropped */
            continue;
        }
        pthread_mutex_lock(&s->mu);
        if (sts[i] == IS_OK && did[i]) s->st.facts_encoded++;
        else if (sts[i] != IS_OK && sts[i] != IS_ERR_NOT_FOUND && sts[i] != IS_ERR_CANCELLED)
            s->st.encode_failures++; /* not found: deleted; cancelled: stopping */
        pthread_mutex_unlock(&s->mu);
        job_free(batch[i]);
    }
    s->encode_starved = starved;
}

static void *enc_main(void *arg) {
    sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        /* A failed backend: the jobs wait for the recovery. */
        while (!s->stop && (!s->j_head || s->failed)) pthread_cond_wait(&s->enc_cv, &s->mu);
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        run_job(s);
    }
    return NULL;
}

/* ---- admission -------------------------------------------------------------------------- */

/* Blocks the running requests may still take: reserved minus owned. */
static int32_t outstanding_blocks(sched *s) {
    int32_t out = 0;
    for (int32_t i = 0; i < s->n_run; i++) {
        sched_handle *h = s->run[i];
        if (h->seq < 0) continue; /* ended: its blocks are back */
        int32_t nb = 0;
        kv_seq_blocks(engine_kv(s->e), h->seq, &nb);
        int32_t owned = nb - h->shared_blocks;
        if (h->reserve > owned) out += h->reserve - owned;
    }
    return out;
}

/* Blocks a request needs: all its positions, less the prefix's full
 * blocks that it shares. */
static void reserve_for(const sched *s, sched_handle *h, int32_t prompt_len) {
    int32_t positions = prompt_len + h->max_tokens;
    if (positions > s->n_ctx) positions = s->n_ctx;
    h->shared_blocks = h->mode == ASK_MODE_OFF ? 0 : s->n_prefix / s->block_size;
    h->reserve = blocks_for(positions, s->block_size) - h->shared_blocks;
}

static is_status append_toks(int32_t **dst, int32_t *n, const int32_t *src, int32_t k) {
    if (k == 0) return IS_OK;
    int32_t *g = realloc(*dst, (size_t)(*n + k) * sizeof *g);
    if (!g) return is_error_set(IS_ERR_NOMEM, "out of memory");
    memcpy(g + *n, src, (size_t)k * sizeof *g);
    *dst = g;
    *n += k;
    return IS_OK;
}

/* Whether a kv request's fact has no KV this node can inject: not pinned
 * at submit (the host tier's path), not loaded ahead, and neither on the
 * GPU nor in the record store under a record of its text. */
static bool fact_needs_kv(sched *s, const req_fact *f) {
    if (!f->id || pin_live(s, f) || f->pre_held) return false;
    if (!f->record || !f->known) return true;
    /* The GPU first: a hash lookup, where the store may ask the disk. */
    return !engine_fact_resident(s->e, f->content_id, f->n_kv_tokens) &&
           !record_store_contains(memory_record_store(s->mem), f->record);
}

/* KV on demand: the request's facts with no KV on this node are encoded
 * now, before it takes its own sequence (the encoding needs free ones),
 * in batches of the free sequences and one step's tokens, as the encode
 * jobs are (serve/encoder.h; the rows are read again, so a fact changed
 * meanwhile is encoded in its current text or not at all). Each encoded
 * fact then takes the record path of start_request, which checks the
 * record against the request's text. A fact that cannot be encoded (no
 * sequence or blocks, deleted, failed) is left to be prefilled as text;
 * the status returned is a backend failure's, else IS_OK. */
static is_status encode_on_demand(sched *s, sched_handle *h) {
    if (h->mode != ASK_MODE_KV || !s->mem) return IS_OK;
    memory_fact_ref refs[ENCODER_MAX_FACTS];
    uint64_t hash[ENCODER_MAX_FACTS];
    int32_t at[ENCODER_MAX_FACTS];
    char *rec[ENCODER_MAX_FACTS];
    bool did[ENCODER_MAX_FACTS];
    for (int32_t i = 0; i < h->n_facts;) {
        int32_t n = 0;
        for (; i < h->n_facts && n < ENCODER_MAX_FACTS; i++) {
            req_fact *f = &h->facts[i];
            if (!fact_needs_kv(s, f)) continue;
            refs[n] = (memory_fact_ref){.tenant = f->tenant, .user = f->user};
            snprintf(refs[n].id, sizeof refs[n].id, "%s", f->id);
            hash[n] = f->text_hash;
            at[n++] = i;
        }
        if (n == 0) break;
        encoder_params ep = {s->ask, s->p.step_tokens};
        int64_t failed = 0;
        encoder_run_for_request(s->mem, &ep, refs, hash, n, rec, did, &failed);
        is_status st = engine_status(s->e);
        for (int32_t j = 0; j < n; j++) {
            req_fact *f = &h->facts[at[j]];
            if (st != IS_OK || !rec[j]) {
                free(rec[j]);
                continue;
            }
            if (f->rec_pinned) record_store_unpin(memory_record_store(s->mem), f->record);
            free(f->record);
            f->record = rec[j];
            record_store_pin(memory_record_store(s->mem), f->record);
            f->rec_pinned = true;
            f->known = false; /* its record is read at injection, and checked there */
            f->encoded = did[j];
        }
        if (st != IS_OK) return st;
        if (failed) {
            pthread_mutex_lock(&s->mu);
            s->st.encode_failures += failed;
            pthread_mutex_unlock(&s->mu);
        }
    }
    return IS_OK;
}

/* An admitted request between its start and the step's one injection:
 * the facts it injects, in order, and the records it holds for them. */
typedef struct admission {
    sched_handle *h;
    engine_fact *inj;     /* [n_facts] */
    const fact_kv **held; /* [n_facts] records to release (NULL entries) */
    float **bufs;         /* [n_facts] widened values to free (NULL entries) */
    uint64_t *ids;        /* [n_facts] content ids: the GPU arena's keys */
    const char **rec;     /* [n_facts] record ids of inj */
    int32_t n, n_inj, n_text_tokens;
} admission;

static void admission_free(sched *s, admission *a) {
    for (int32_t i = 0; i < a->n; i++) {
        if (a->held && a->held[i]) record_store_release(memory_record_store(s->mem), a->held[i]);
        if (a->bufs) free(a->bufs[i]);
    }
    free(a->inj);
    free(a->held);
    free(a->bufs);
    free(a->ids);
    free(a->rec);
    *a = (admission){.h = a->h}; /* the request stays named */
}

/* Whether admission would read this fact's record on the engine thread:
 * a kv fact with a record that submit neither pinned nor loaded, and that
 * the backend does not hold (without a host tier; with one a resident
 * fact is pinned at admission, which may fail, and then it is read). */
static bool needs_late_load(sched *s, const sched_handle *h, const req_fact *f) {
    if (h->mode != ASK_MODE_KV || !f->record || f->pre_held || pin_live(s, f)) return false;
    return !(f->known && engine_fact_resident(s->e, f->content_id, f->n_kv_tokens));
}

/* One late load (any thread: the record store, the fact index and ask_load_record are
 * safe from any; only this request's fact is written). As prefetch_fact
 * keeps a loaded record: only when it was encoded from the fact's text. */
static void late_load_item(void *arg, int32_t i) {
    void **args = arg;
    sched *s = args[0];
    req_fact *f = ((req_fact **)args[1])[i];
    f->late_tried = true;
    if (ask_load_record(s->ask, f->record, &f->pre_held, &f->pre, &f->pre_buf) == IS_OK) {
        const fact_kv *kv = f->pre_held;
        fact_index_entry e = {.content_id = kv->content_id,
                              .text_hash = kv->meta.text_hash,
                              .n_tokens = kv->meta.n_tokens};
        fact_index_put(s->facts, f->record, &e);
        if (kv->meta.text_hash == f->text_hash) {
            f->known = true;
            f->content_id = kv->content_id;
            f->n_kv_tokens = kv->meta.n_tokens;
            return;
        }
    }
    if (f->pre_held) record_store_release(memory_record_store(s->mem), f->pre_held);
    free(f->pre_buf);
    f->pre_held = NULL;
    f->pre_buf = NULL;
    is_error_clear();
}

/* The records of a request's facts that submit did not load (past the
 * prefetch budget, or the GPU gave up one it was said to hold) are read
 * and widened on the I/O threads all at once, so the engine thread waits
 * for about one read, not k (without an I/O pool, the CPU's case, they are
 * read in turn here); a fact whose record fails or is stale is prefilled
 * as text. */
static void late_loads(sched *s, sched_handle *h) {
    req_fact **late = malloc((size_t)(h->n_facts ? h->n_facts : 1) * sizeof *late);
    if (!late) return; /* each is read in line below */
    int32_t n = 0;
    for (int32_t i = 0; i < h->n_facts; i++)
        if (needs_late_load(s, h, &h->facts[i])) late[n++] = &h->facts[i];
    void *args[2] = {s, late};
    if (n > 0) io_pool_run(s->io, late_load_item, args, n);
    free(late);
}

/* A fact's text tokens where they are its record's (the record's own are
 * not read when the GPU holds it), else NULL. */
static const int32_t *fact_toks(const req_fact *f) {
    return f->toks && f->n_toks == f->n_kv_tokens ? f->toks : NULL;
}

/* The first s->p.recompute tokens of every injected fact (those whose
 * tokens are known) go before the request's prompt, each to recompute its
 * slot in the first prefill forward (engine_batch.rewrite). */
static is_status add_recompute(sched *s, sched_handle *h, const engine_fact *inj, int32_t n_inj) {
    int32_t mb, me, off, n = 0;
    engine_seq_memory(s->e, h->seq, &mb, &me);
    for (int32_t i = 0; i < n_inj; i++)
        if (inj[i].tokens) n += inj[i].n_tokens < s->p.recompute ? inj[i].n_tokens : s->p.recompute;
    if (n == 0) return IS_OK;
    int32_t *pos = malloc((size_t)n * sizeof *pos);
    int32_t *prompt = malloc((size_t)(n + h->n_prompt) * sizeof *prompt);
    if (!pos || !prompt) {
        free(pos);
        free(prompt);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    off = mb;
    n = 0;
    for (int32_t i = 0; i < n_inj; i++) {
        for (int32_t j = 0; inj[i].tokens && j < inj[i].n_tokens && j < s->p.recompute; j++) {
            pos[n] = off + j;
            prompt[n++] = inj[i].tokens[j];
        }
        off += inj[i].n_tokens;
    }
    if (h->n_prompt) memcpy(prompt + n, h->prompt, (size_t)h->n_prompt * sizeof *prompt);
    free(h->prompt);
    free(h->rw_pos);
    h->prompt = prompt;
    h->n_prompt += n;
    h->rw_pos = pos;
    h->n_rw = n;
    return IS_OK;
}

/* Whether every fact of h that waits in the host tier for room beside the
 * GPU's pins has its pin (engine thread, or under s->mu for a queued h). */
static bool pins_ready(const sched *s, const sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++)
        if (h->facts[i].ht_held && !pin_live(s, &h->facts[i])) return false;
    return true;
}

/* On the submitting thread, after prepare: whether a fact of h waits in
 * the host tier for its pin (its epoch is not needed: nothing it pinned
 * can have been dropped by a recovery it has not seen yet, and if one
 * was, the next count at admission puts it right). */
static bool submit_waits(const sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++)
        if (h->facts[i].ht_held && !h->facts[i].pinned) return true;
    return false;
}

/* Engine thread: counts the queued requests whose facts wait (s->n_waiting). */
static void count_waiting(sched *s) {
    int32_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (sched_handle *h = s->q_head; h; h = h->next) n += !pins_ready(s, h);
    atomic_store(&s->n_waiting, n);
    pthread_mutex_unlock(&s->mu);
}

/* Engine thread: pins h's facts that wait in the host tier, in order,
 * starting their copies; false at the first that finds no room. */
static bool pin_waiting(sched *s, sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++) {
        req_fact *f = &h->facts[i];
        if (!f->ht_held || pin_live(s, f)) continue;
        if (!fact_pin(s, f, f->content_id, f->n_kv_tokens, (int32_t)f->ht_held->meta.dtype,
                      f->ht_held->k, f->ht_held->v))
            return false;
    }
    return true;
}

/* Engine thread: gives back the pins of h's facts held in the host tier. */
static void unpin_waiting(sched *s, sched_handle *h) {
    for (int32_t i = 0; i < h->n_facts; i++)
        if (h->facts[i].ht_held) fact_unpin(s, &h->facts[i]);
}

/* Engine thread, before admission: the pins the last step's injection
 * gave back go to the queued requests' waiting facts, oldest request
 * first, until one does not fit. That one also gets the pins of the
 * requests behind it that hold only some of theirs (taken at submit):
 * they could not start on them, and split that way the room would serve
 * no request. Queued requests stay valid without s->mu: only this thread
 * takes them off the queue. */
static void pin_queued(sched *s) {
    enum { LOOK_AHEAD = 64 };
    sched_handle *w[LOOK_AHEAD];
    int32_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (sched_handle *h = s->q_head; h && n < LOOK_AHEAD; h = h->next)
        if (!pins_ready(s, h)) w[n++] = h;
    atomic_store(&s->n_waiting, n);
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < n; i++) {
        if (pin_waiting(s, w[i])) continue;
        for (int32_t j = i + 1; j < n; j++) unpin_waiting(s, w[j]);
        pin_waiting(s, w[i]);
        return;
    }
}

/* Engine thread, host tier: a pin on f's resident record for this
 * admission's injection, in place of any pin f had (one a recovery
 * dropped, or on a record no longer resident). */
static bool repin(sched *s, req_fact *f) {
    req_fact old = {.pinned = f->pinned, .pin_epoch = f->pin_epoch, .content_id = f->content_id};
    if (!fact_pin(s, f, f->content_id, f->n_kv_tokens, 0, NULL, NULL)) return false;
    fact_unpin(s, &old);
    return true;
}

/* Starts an admitted request up to its injection: sampler, sequence,
 * prefix fork, the kv facts' records found (resident, pinned, loaded) into
 * a, the text facts and the tokens left to prefill. The caller injects a's
 * facts (one call for every request of the step), then finish_start. */
static is_status start_request(sched *s, sched_handle *h, admission *a, int64_t *hits,
                               int64_t *misses) {
    a->h = h;
    h->t_admit = now_ms();
    h->usage.queue_ms = h->t_admit - h->t_submit;
    is_status st = encode_on_demand(s, h);
    if (st != IS_OK) return st;
    textout_init(&h->out, (const char *const *)h->stop, (size_t)h->n_stop);
    h->out_init = true;
    st = sampler_create(h->sp, s->n_vocab, &h->smp);
    if (st == IS_OK) st = engine_seq_open(s->e, &h->seq);
    if (st != IS_OK) return st;
    if (h->mode == ASK_MODE_OFF) {
        st = append_toks(&h->prompt, &h->n_prompt, h->suffix, h->n_suffix);
        if (st == IS_OK && h->n_prompt == 0) st = is_error_set(IS_ERR_INVALID_ARG, "empty prompt");
        h->usage.prompt_tokens = h->n_prompt;
        return st;
    }
    if ((st = engine_seq_fork(s->e, h->seq, s->prefix_seq, s->n_prefix)) != IS_OK) return st;
    h->usage.cached_tokens = s->n_prefix;
    int32_t n = h->n_facts;
    a->n = n;
    engine_fact *inj = a->inj = calloc((size_t)(n ? n : 1), sizeof *inj);
    const fact_kv **held = a->held = calloc((size_t)(n ? n : 1), sizeof *held);
    float **bufs = a->bufs = calloc((size_t)(n ? n : 1), sizeof *bufs);
    uint64_t *ids = a->ids = calloc((size_t)(n ? n : 1), sizeof *ids);
    const char **rec = a->rec = calloc((size_t)(n ? n : 1), sizeof *rec);
    if (!inj || !held || !bufs || !ids || !rec) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    /* A fact still without room beside the GPU's pins is read as any
     * record is (late_loads). */
    if (st == IS_OK && h->mode == ASK_MODE_KV) pin_waiting(s, h);
    if (st == IS_OK) late_loads(s, h);
    int32_t n_inj = 0, n_text_tokens = 0;
    for (int32_t i = 0; st == IS_OK && i < n; i++) {
        req_fact *f = &h->facts[i];
        bool ok = false;
        int32_t tier = FACT_TIER_DISK;
        if (h->mode == ASK_MODE_KV && pin_live(s, f) &&
            engine_fact_resident(s->e, f->content_id, f->n_kv_tokens)) {
            /* Pinned at submit (resident, or its copy started then): the
             * injection waits for the copy on the GPU, not here. */
            inj[n_inj] = (engine_fact){.n_tokens = f->n_kv_tokens, .tokens = fact_toks(f)};
            ids[n_inj] = f->content_id;
            rec[n_inj++] = f->record;
            tier = f->tier;
            ok = true;
        } else if (h->mode == ASK_MODE_KV && f->record && f->known &&
                   (s->ht ? repin(s, f)
                          : engine_fact_resident(s->e, f->content_id, f->n_kv_tokens))) {
            /* The GPU holds it: injected from there, its record not read.
             * With a host tier other threads copy into the GPU cache at any
             * time, so "resident" holds only pinned (until the injection). */
            tier = FACT_TIER_GPU;
            inj[n_inj] = (engine_fact){.n_tokens = f->n_kv_tokens, .tokens = fact_toks(f)};
            ids[n_inj] = f->content_id;
            rec[n_inj++] = f->record;
            ok = true;
            drop_loaded(s, f); /* with a host tier, f->pinned: repin's pin */
        } else if (h->mode == ASK_MODE_KV && f->pre_held) {
            /* Loaded and widened off the engine thread (at submit, or by the
             * late loads, which read what encode_on_demand just wrote): only
             * injected here. */
            if (f->known) fact_index_set_resident(s->facts, f->record, false);
            if (f->encoded) tier = FACT_TIER_ENCODED;
            held[n_inj] = f->pre_held;
            bufs[n_inj] = f->pre_buf;
            inj[n_inj] = f->pre;
            ids[n_inj] = f->pre_held->content_id;
            rec[n_inj++] = f->record;
            f->pre_held = NULL; /* held[] and bufs[] own them now */
            f->pre_buf = NULL;
            atomic_fetch_sub(&s->prefetch_bytes, f->pre_bytes);
            f->pre_bytes = 0;
            ok = true;
        } else if (h->mode == ASK_MODE_KV && f->record && !f->late_tried) {
            if (f->known) fact_index_set_resident(s->facts, f->record, false);
            if (f->encoded) tier = FACT_TIER_ENCODED;
            /* With a host tier, always with its values (see above). */
            is_status fs =
                s->ht
                    ? ask_load_record(s->ask, f->record, &held[n_inj], &inj[n_inj], &bufs[n_inj])
                    : ask_fetch_record(s->ask, f->record, &held[n_inj], &inj[n_inj], &bufs[n_inj]);
            /* A record made from another text (the fact changed since) is stale. */
            ok = fs == IS_OK && held[n_inj]->meta.text_hash == f->text_hash;
            if (fs == IS_ERR_NOMEM) st = fs;
            if (ok) {
                const fact_kv *kv = held[n_inj];
                fact_index_entry e = {.content_id = kv->content_id,
                                      .text_hash = kv->meta.text_hash,
                                      .n_tokens = kv->meta.n_tokens};
                fact_index_put(s->facts, f->record, &e);
                ids[n_inj] = kv->content_id;
                rec[n_inj++] = f->record;
            } else {
                if (held[n_inj]) record_store_release(memory_record_store(s->mem), held[n_inj]);
                free(bufs[n_inj]);
                held[n_inj] = NULL;
                bufs[n_inj] = NULL;
            }
        }
        if (h->mode == ASK_MODE_KV) {
            if (ok) (*hits)++;
            else (*misses)++;
            if (!ok) h->usage.facts_text++;
            else if (tier == FACT_TIER_GPU) h->usage.facts_gpu++;
            else if (tier == FACT_TIER_HOST) h->usage.facts_host++;
            else if (tier == FACT_TIER_ENCODED) h->usage.facts_encoded++;
            else h->usage.facts_disk++;
        }
        if (!ok && st == IS_OK) {
            /* Prefilled as text after the injected facts. */
            st = append_toks(&h->prompt, &h->n_prompt, f->toks, f->n_toks);
            n_text_tokens += f->n_toks;
        }
    }
    a->n_inj = n_inj;
    a->n_text_tokens = n_text_tokens;
    for (int32_t i = 0; i < n_inj; i++) h->usage.injected_tokens += inj[i].n_tokens;
    if (st == IS_OK) st = append_toks(&h->prompt, &h->n_prompt, h->suffix, h->n_suffix);
    /* Logits come from the last prompt token, so there must be one. */
    if (st == IS_OK && h->n_prompt == 0) st = is_error_set(IS_ERR_INVALID_ARG, "empty prompt");
    h->usage.memory_tokens = h->usage.injected_tokens + n_text_tokens;
    h->usage.prompt_tokens = s->n_prefix + h->usage.injected_tokens + h->n_prompt - h->n_rw;
    if (st == IS_OK && h->usage.prompt_tokens + h->max_tokens > s->n_ctx)
        st = is_error_set(IS_ERR_CONTEXT_FULL,
                          "prompt of %d tokens plus max_tokens %d is past the "
                          "context of %d",
                          (int)h->usage.prompt_tokens, (int)h->max_tokens, (int)s->n_ctx);
    return st;
}

/* After the step's injection (inject: its status for this request): the
 * pins go, the fact index learns what the backend kept, the records are
 * released. The host views stay until the request ends, when its first
 * token has come back after the copies. */
static is_status finish_start(sched *s, admission *a, is_status inject) {
    sched_handle *h = a->h;
    h->usage.admit_ms = now_ms() - h->t_admit;
    /* Before the records go: the recomputed tokens are theirs. */
    is_status st = inject;
    if (st == IS_OK && a->n_inj > 0 && s->p.recompute > 0)
        st = add_recompute(s, h, a->inj, a->n_inj);
    for (int32_t i = 0; i < h->n_facts; i++) fact_unpin(s, &h->facts[i]);
    /* Whether the backend kept them: the next request's submit skips their prefetch. */
    for (int32_t i = 0; inject == IS_OK && i < a->n_inj; i++)
        fact_index_set_resident(s->facts, a->rec[i],
                                engine_fact_resident(s->e, a->ids[i], a->inj[i].n_tokens));
    admission_free(s, a);
    return st;
}

/* Cancelled requests: running ones free their blocks, queued ones leave
 * the queue; each gets its DONE (abort). */
static void reap_cancelled(sched *s) {
    bool any = false;
    for (int32_t i = 0; i < s->n_run; i++) {
        sched_handle *h = s->run[i];
        if (!atomic_load(&h->cancelled)) continue;
        finish_done(s, h, IS_FINISH_ABORT);
        any = true;
    }
    if (any) compact_run(s);
    sched_handle *gone = NULL, **tail = &gone;
    pthread_mutex_lock(&s->mu);
    for (sched_handle **pp = &s->q_head; *pp;) {
        sched_handle *h = *pp;
        if (atomic_load(&h->cancelled)) {
            *pp = h->next;
            h->next = NULL;
            *tail = h;
            tail = &h->next;
            s->n_queued--;
        } else {
            pp = &h->next;
        }
    }
    s->q_tail = NULL;
    for (sched_handle *h = s->q_head; h; h = h->next) s->q_tail = h;
    s->st.queued = s->n_queued;
    pthread_mutex_unlock(&s->mu);
    while (gone) {
        sched_handle *h = gone;
        gone = h->next;
        finish_done(s, h, IS_FINISH_ABORT);
        handle_unref(h);
    }
}

/* The facts of every request admitted in this step, injected in one
 * engine call (one backend launch on the GPU); a request whose injection
 * is refused (its own sequence: context, pool) ends with that error, the
 * others go on. A backend failure ends them all (backend_failed). */
static void inject_admitted(sched *s, admission *adm, int32_t n_adm) {
    engine_inject_seq q[MAX_BATCH_SEQS];
    is_status res[MAX_BATCH_SEQS];
    int32_t nq = 0;
    for (int32_t i = 0; i < n_adm; i++) {
        res[i] = IS_OK;
        if (adm[i].n_inj > 0)
            q[nq++] = (engine_inject_seq){adm[i].h->seq, adm[i].inj, adm[i].ids, adm[i].n_inj};
    }
    is_status st = IS_OK;
    char first_msg[512] = "";
    if (nq > 0) {
        is_status qres[MAX_BATCH_SEQS];
        st = engine_inject_batch(s->e, q, nq, qres);
        pthread_mutex_lock(&s->mu);
        s->st.inject_calls++;
        s->st.inject_requests += nq;
        if (nq > s->st.inject_max_requests) s->st.inject_max_requests = nq;
        pthread_mutex_unlock(&s->mu);
        if (st != IS_OK) snprintf(first_msg, sizeof first_msg, "%s", is_error_last());
        for (int32_t i = 0, j = 0; i < n_adm; i++)
            if (adm[i].n_inj > 0) res[i] = qres[j++];
    }
    for (int32_t i = 0; i < n_adm; i++) res[i] = finish_start(s, &adm[i], res[i]);
    if (st != IS_OK && engine_status(s->e) != IS_OK) {
        backend_failed(s, engine_status(s->e));
        return;
    }
    bool ended = false, first = true;
    for (int32_t i = 0; i < n_adm; i++) {
        sched_handle *h = adm[i].h;
        if (res[i] != IS_OK) {
            /* The engine's message is the first failed sequence's. */
            char msg[600];
            if (first && first_msg[0]) snprintf(msg, sizeof msg, "%s", first_msg);
            else snprintf(msg, sizeof msg, "inject: %s", is_status_to_string(res[i]));
            first = false;
            finish_error(s, h, res[i], msg);
            ended = true;
            continue;
        }
        h->state = RS_PREFILL;
        h->n_fed = 0;
    }
    if (ended) compact_run(s);
    publish(s, 0, 0);
}

/* Admits queued requests, oldest first, while a slot and the blocks for
 * the whole request are there, and injects their facts together. Until
 * that injection a started request is in the run list (its reservation
 * counts) in state RS_QUEUED.
 *
 * A request that does not fit does not stop the ones behind it: one that
 * fits is admitted past it, else a large max_tokens at the head holds
 * every tenant's small requests while the pool sits nearly unused. Each
 * admission past a waiting request counts against it; once one has been
 * passed max_bypass times, nothing more is admitted past it, so the
 * running requests drain until it fits. */
static void admit(sched *s) {
    int32_t limit = s->max_running;
    /* An encode job waiting for a sequence gets the next one that frees. */
    if (s->encode_starved && s->n_run > 0) return;
    if (s->ht) pin_queued(s);
    admission adm[MAX_BATCH_SEQS];
    int32_t n_adm = 0;
    while (s->n_run < limit) {
        int32_t avail = kv_cache_free_blocks(engine_kv(s->e)) - outstanding_blocks(s);
        pthread_mutex_lock(&s->mu);
        sched_handle *h = s->q_head, *prev = NULL, *unpinned = NULL, *unpinned_prev = NULL;
        bool fits = false;
        for (; h; prev = h, h = h->next) {
            reserve_for(s, h, h->est_prompt);
            fits = h->reserve <= avail;
            /* Facts still waiting for room beside the GPU's pins, which this
             * step's injection gives back: a request behind it whose facts
             * are pinned goes first, and it goes only as a step's first (its
             * waiting facts then read from their records) or once passed
             * max_bypass times. */
            if (fits && h->bypassed < s->p.max_bypass && !pins_ready(s, h)) {
                if (!unpinned) unpinned = h, unpinned_prev = prev;
                continue;
            }
            /* Nothing running and still no room: it never will be. */
            if (fits || s->n_run == 0) break;
            if (h->bypassed >= s->p.max_bypass) {
                h = NULL;
                break;
            }
        }
        if (!h && unpinned && n_adm == 0) h = unpinned, prev = unpinned_prev, fits = true;
        if (h) {
            for (sched_handle *o = s->q_head; o != h; o = o->next) o->bypassed++;
            if (prev) prev->next = h->next;
            else s->q_head = h->next;
            if (s->q_tail == h) s->q_tail = prev;
            s->n_queued--;
            s->st.queued = s->n_queued;
        }
        pthread_mutex_unlock(&s->mu);
        if (!h) break;
        h->next = NULL;
        if (!fits) {
            char msg[160];
            snprintf(msg, sizeof msg, "the request needs %d KV blocks, %d are free",
                     (int)h->reserve, (int)avail);
            finish_error(s, h, IS_ERR_CONTEXT_FULL, msg);
            handle_unref(h);
            continue;
        }
        int64_t hits = 0, misses = 0;
        admission *a = &adm[n_adm];
        memset(a, 0, sizeof *a);
        is_status st = start_request(s, h, a, &hits, &misses);
        pthread_mutex_lock(&s->mu);
        s->st.facts_kv_hits += hits;
        s->st.facts_kv_misses += misses;
        s->st.facts_gpu += h->usage.facts_gpu;
        s->st.facts_host += h->usage.facts_host;
        s->st.facts_disk += h->usage.facts_disk;
        s->st.facts_text += h->usage.facts_text;
        s->st.facts_encoded_served += h->usage.facts_encoded;
        pthread_mutex_unlock(&s->mu);
        if (st != IS_OK && engine_status(s->e) != IS_OK) {
            /* The backend failed forking: this request is one of those it
             * hit, and so are the ones started before it. */
            n_adm++;
            s->run[s->n_run++] = h;
            for (int32_t i = 0; i < n_adm; i++) finish_start(s, &adm[i], st);
            backend_failed(s, engine_status(s->e));
            return;
        }
        if (st != IS_OK) {
            finish_start(s, a, st);
            finish_error(s, h, st, is_error_last());
            handle_unref(h);
            continue;
        }
        /* The reservation from the actual layout (records may differ in
         * length from their text's tokens in odd cases), before the next
         * request's room is counted. */
        int32_t est = h->reserve;
        reserve_for(s, h, h->usage.prompt_tokens);
        if (h->reserve < est) h->reserve = est;
        s->run[s->n_run++] = h;
        n_adm++;
    }
    inject_admitted(s, adm, n_adm);
    if (s->ht) count_waiting(s);
}

/* ---- a step -------------------------------------------------------------------------- */

static void emit_text(sched_handle *h, const char *t, size_t n) {
    if (n == 0) return;
    sched_event ev = {.kind = SCHED_EV_TEXT, .text = t, .len = n};
    deliver(h, &ev);
}

/* What happens to a request once a token has been sampled for it. */
static void on_token(sched *s, sched_handle *h, int32_t tok, int64_t *generated) {
    const tokenizer *tk = engine_model(s->e)->tok;
    if (h->n_gen == 0 && h->usage.ttft_ms == 0) h->usage.ttft_ms = now_ms() - h->t_submit;
    if (tokenizer_is_eog(tk, tok)) {
        size_t n;
        const char *rest = textout_flush(&h->out, &n);
        emit_text(h, rest, n);
        finish_done(s, h, IS_FINISH_EOG);
        return;
    }
    h->n_gen++;
    (*generated)++;
    char piece[256];
    size_t pl = tokenizer_token_to_piece(tk, tok, false, piece, sizeof piece);
    if (pl > sizeof piece) pl = sizeof piece;
    bool stopped = false;
    is_status st = textout_push(&h->out, piece, pl, &stopped);
    if (st != IS_OK) {
        finish_error(s, h, st, is_error_last());
        return;
    }
    size_t n;
    const char *ready = textout_take(&h->out, &n);
    emit_text(h, ready, n);
    if (stopped) {
        finish_done(s, h, IS_FINISH_STOP);
        return;
    }
    /* The length limit, or the end of the context (as if by length). */
    if (h->n_gen >= h->max_tokens || kv_seq_length(engine_kv(s->e), h->seq) >= s->n_ctx) {
        const char *rest = textout_flush(&h->out, &n);
        emit_text(h, rest, n);
        finish_done(s, h, IS_FINISH_LENGTH);
        return;
    }
    h->next_tok = tok;
    h->state = RS_DECODE;
}

static void step(sched *s) {
    int32_t n = 0, n_rows = 0;
    bool any_rw = false;
    for (int32_t i = 0; i < s->n_run; i++) {
        sched_handle *h = s->run[i];
        h->chunk = 0;
        if (h->state != RS_DECODE) continue;
        s->b_tok[n] = h->next_tok;
        s->b_seq[n] = h->seq;
        s->b_rw[n] = -1;
        s->b_want[n] = true;
        s->rows[n_rows++] = h;
        h->chunk = 1;
        n++;
    }
    /* Prompt chunks fill what the decoding tokens leave, oldest first. */
    for (int32_t i = 0; i < s->n_run && n < s->p.step_tokens; i++) {
        sched_handle *h = s->run[i];
        if (h->state != RS_PREFILL) continue;
        int32_t left = h->n_prompt - h->n_fed, c = left;
        if (left <= 0) continue;
        if (c > s->p.prefill_chunk) c = s->p.prefill_chunk;
        if (c > s->p.step_tokens - n) c = s->p.step_tokens - n;
        for (int32_t k = 0; k < c; k++) {
            s->b_tok[n + k] = h->prompt[h->n_fed + k];
            s->b_seq[n + k] = h->seq;
            s->b_rw[n + k] = h->n_fed + k < h->n_rw ? h->rw_pos[h->n_fed + k] : -1;
            if (h->n_fed + k < h->n_rw) any_rw = true;
            s->b_want[n + k] = false;
        }
        if (c == left) {
            s->b_want[n + c - 1] = true;
            s->rows[n_rows++] = h;
        }
        h->chunk = c;
        n += c;
    }
    if (n == 0) return;
    engine_batch b = {.n_tokens = n,
                      .tokens = s->b_tok,
                      .seq = s->b_seq,
                      .want_logits = s->b_want,
                      .rewrite = any_rw ? s->b_rw : NULL};
    /* A step whose every row is greedy takes its choices from the backend:
     * no logits leave it (on the GPU, 4 bytes a row instead of the
     * vocabulary's floats). */
    bool greedy = n_rows > 0;
    for (int32_t r = 0; r < n_rows && greedy; r++) greedy = sampler_is_greedy(s->rows[r]->smp);
    is_status st =
        greedy ? engine_decode_greedy(s->e, &b, s->greedy) : engine_decode(s->e, &b, s->logits);
    int64_t prefilled = 0, generated = 0;
    if (st != IS_OK && engine_status(s->e) != IS_OK) {
        backend_failed(s, st);
        return;
    }
    if (st != IS_OK) {
        /* Nothing was appended; the requests of this batch cannot go on. */
        char msg[512];
        snprintf(msg, sizeof msg, "engine step failed: %s", is_error_last());
        for (int32_t i = 0; i < s->n_run; i++)
            if (s->run[i]->chunk > 0) finish_error(s, s->run[i], st, msg);
        compact_run(s);
        return;
    }
    for (int32_t i = 0; i < s->n_run; i++) {
        sched_handle *h = s->run[i];
        if (h->state == RS_PREFILL && h->chunk > 0) {
            h->n_fed += h->chunk;
            h->usage.prefilled_tokens += h->chunk;
            prefilled += h->chunk;
        }
    }
    for (int32_t r = 0; r < n_rows; r++) {
        sched_handle *h = s->rows[r];
        int32_t tok =
            greedy ? s->greedy[r] : sampler_sample(h->smp, s->logits + (size_t)r * s->n_vocab);
        on_token(s, h, tok, &generated);
    }
    compact_run(s);
    pthread_mutex_lock(&s->mu);
    s->st.steps++;
    s->st.tokens_prefilled += prefilled;
    s->st.tokens_generated += generated;
    s->st.last_batch_tokens = n;
    pthread_mutex_unlock(&s->mu);
    publish(s, 0, 0);
}

/* ---- the engine thread ---------------------------------------------------------------- */

static void shutdown_all(sched *s) {
    for (int32_t i = 0; i < s->n_run; i++)
        finish_error(s, s->run[i], IS_ERR_CANCELLED, "server shutting down");
    compact_run(s);
    pthread_mutex_lock(&s->mu);
    sched_handle *q = s->q_head;
    s->q_head = s->q_tail = NULL;
    s->n_queued = 0;
    s->st.queued = 0;
    sched_job *j = s->j_head;
    s->j_head = s->j_tail = NULL;
    s->n_jobs = 0;
    s->st.encode_queued = 0;
    engine_call *c = s->call;
    s->call = NULL;
    pthread_mutex_unlock(&s->mu);
    if (c) call_done(s, c, IS_ERR_CANCELLED, "scheduler: shutting down");
    while (q) {
        sched_handle *h = q;
        q = h->next;
        finish_error(s, h, IS_ERR_CANCELLED, "server shutting down");
        handle_unref(h);
    }
    while (j) {
        sched_job *next = j->next;
        job_free(j);
        j = next;
    }
}

static void *engine_main(void *arg) {
    sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        /* A failed backend: nothing runs or queues until it recovers. */
        while (!s->stop && s->failed && now_ms() < s->recover_at) {
            double at = s->recover_at;
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            double ms = at - (ts.tv_sec * 1e3 + ts.tv_nsec / 1e6);
            clock_gettime(CLOCK_REALTIME, &ts); /* the condvar's clock */
            long long ns = ts.tv_nsec + (long long)(ms * 1e6);
            ts.tv_sec += ns / 1000000000LL;
            ts.tv_nsec = ns % 1000000000LL;
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        bool failed = s->failed;
        while (!s->stop && !failed && (!s->q_head || s->hold) && s->n_run == 0 && !s->call)
            pthread_cond_wait(&s->cv, &s->mu);
        bool stop = s->stop, call = s->call != NULL, hold = s->hold;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        if (failed && !try_recover(s)) continue;
        reap_cancelled(s);
        if (!hold) admit(s);
        if (s->n_run == 0) {
            if (call) run_call(s);
            continue;
        }
        step(s);
        if (call) {
            /* Requests keep coming: the encoder's forward still gets a turn
             * now and then. */
            if (++s->steps_waited >= SCHED_ENCODE_EVERY || s->encode_starved) run_call(s);
        }
    }
    shutdown_all(s);
    return NULL;
}

/* ---- create / free ----------------------------------------------------------------------- */

/* The host tier's memory is the backend's (pinned, where the GPU reads it). */
static is_status tier_alloc(void *ud, size_t bytes, void **out) {
    return engine_host_alloc(ud, bytes, out);
}
static void tier_free(void *ud, void *p) { engine_host_free(ud, p); }
static void tier_quiesce(void *ud) { engine_host_wait(ud); }

is_status sched_create(engine *e, memory *mem, const sched_params *pp, sched **out) {
    if (!e || !out) return is_error_set(IS_ERR_INVALID_ARG, "sched_create: NULL argument");
    sched_params p = pp ? *pp : sched_default_params();
    /* Zero: sized for the backend. A GPU forward costs about the same for
     * one token as for a few hundred (it reads the weights either way), so
     * there a whole prompt goes in one step; two CPU cores are better
     * served by small chunks between the others' decode tokens. */
    bool gpu = strcmp(engine_model(e)->be->ops->name, "cpu") != 0;
    if (p.step_tokens == 0) p.step_tokens = gpu ? SCHED_GPU_STEP_TOKENS : SCHED_CPU_STEP_TOKENS;
    if (p.prefill_chunk == 0)
        p.prefill_chunk = gpu ? SCHED_GPU_PREFILL_CHUNK : SCHED_CPU_PREFILL_CHUNK;
    if (p.max_running <= 0 || p.max_queued <= 0 || p.step_tokens <= 0 || p.prefill_chunk <= 0 ||
        p.prefetch_bytes < 0 || p.host_tier_bytes < 0 || p.recompute < 0 || p.max_bypass < 0 ||
        (unsigned)p.record_dtype >= KV_DTYPE_COUNT)
        return is_error_set(IS_ERR_INVALID_ARG, "sched_create: parameters must be positive");
    kv_cache_params kp = kv_cache_get_params(engine_kv(e));
    if (kp.max_seqs < 2)
        return is_error_set(IS_ERR_INVALID_ARG, "sched_create: the engine needs max_seqs >= 2 "
                                                "(the serving prefix and one request)");
    sched *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    s->e = e;
    s->mem = mem;
    s->p = p;
    s->max_running = p.max_running;
    if (s->max_running > kp.max_seqs - 1) s->max_running = kp.max_seqs - 1;
    if (s->max_running > p.step_tokens) s->max_running = p.step_tokens;
    if (s->max_running > MAX_BATCH_SEQS) s->max_running = MAX_BATCH_SEQS;
    s->n_vocab = engine_model(e)->cfg.n_vocab;
    s->n_ctx = engine_n_ctx(e);
    s->block_size = kp.block_size;
    s->n_blocks = kp.n_blocks;
    s->prefix_seq = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->submit_cv, NULL);
    pthread_cond_init(&s->enc_cv, NULL);
    pthread_cond_init(&s->call_cv, NULL);
    pthread_rwlock_init(&s->pin_lock, NULL);
    s->run = calloc((size_t)s->max_running, sizeof *s->run);
    s->rows = calloc((size_t)s->max_running, sizeof *s->rows);
    s->b_tok = malloc((size_t)p.step_tokens * sizeof *s->b_tok);
    s->b_seq = malloc((size_t)p.step_tokens * sizeof *s->b_seq);
    s->b_want = malloc((size_t)p.step_tokens * sizeof *s->b_want);
    s->b_rw = malloc((size_t)p.step_tokens * sizeof *s->b_rw);
    s->logits = malloc((size_t)s->max_running * s->n_vocab * sizeof *s->logits);
    s->greedy = malloc((size_t)s->max_running * sizeof *s->greedy);
    is_status st =
        s->run && s->rows && s->b_tok && s->b_seq && s->b_want && s->b_rw && s->logits && s->greedy
            ? IS_OK
            : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) st = fact_index_create(SCHED_FACT_INDEX_MAX, &s->facts);
    /* The copy takes f16 and bf16 records (an fp8 fact cache is filled
     * the ordinary way): for other dtypes a tier would hold records no
     * copy reads, each read again by the ordinary path. */
    const bool tier_dtype = p.record_dtype == KV_DTYPE_F16 || p.record_dtype == KV_DTYPE_BF16;
    if (st == IS_OK && mem && p.host_tier_bytes >= ((int64_t)1 << 20) && tier_dtype &&
        engine_host_tier(e)) {
        host_tier_alloc al = {
            .alloc = tier_alloc, .free = tier_free, .quiesce = tier_quiesce, .ud = e};
        st = host_tier_create(memory_record_store(mem), (size_t)p.host_tier_bytes, al, &s->ht);
    }
    if (st == IS_OK) st = io_pool_create(SCHED_IO_THREADS, &s->io);
    if (st == IS_OK)
        st = ask_ctx_create(e, mem ? memory_record_store(mem) : NULL, p.record_dtype, &s->ask);
    if (st == IS_OK) {
        s->prefix_seq = ask_ctx_prefix_seq(s->ask, &s->n_prefix);
        int32_t nb = 0;
        kv_seq_blocks(engine_kv(e), s->prefix_seq, &nb);
        s->prefix_blocks = nb;
    }
    if (st == IS_OK) {
        int32_t free_blocks = kv_cache_free_blocks(engine_kv(e));
        s->st.kv_blocks_free = free_blocks;
        s->st.kv_blocks_used = s->n_blocks - free_blocks;
        if (pthread_create(&s->thread, NULL, engine_main, s) != 0)
            st = is_error_set(IS_ERR_INTERNAL, "sched_create: cannot start the engine thread");
        else s->thread_started = true;
    }
    if (st == IS_OK && mem) st = ask_ctx_create_beside(s->ask, run_on_engine, s, &s->enc_ask);
    if (st == IS_OK && mem) {
        if (pthread_create(&s->enc_thread, NULL, enc_main, s) != 0)
            st = is_error_set(IS_ERR_INTERNAL, "sched_create: cannot start the encoder thread");
        else s->enc_started = true;
    }
    if (st != IS_OK) {
        sched_free(s);
        return st;
    }
    *out = s;
    return IS_OK;
}

void sched_free(sched *s) {
    if (!s) return;
    if (s->thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        pthread_cond_broadcast(&s->cv);
        pthread_cond_broadcast(&s->enc_cv);
        /* Submits inside are refused now; they give back what they took
         * (pins, host-tier views) through the tier, index and pool below. */
        while (s->n_submitting > 0) pthread_cond_wait(&s->submit_cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL); /* it ends the encoder's waiting call */
    }
    if (s->enc_started) pthread_join(s->enc_thread, NULL);
    ask_ctx_free(s->enc_ask);
    ask_ctx_free(s->ask);
    fact_index_free(s->facts);
    io_pool_free(s->io);
    host_tier_free(s->ht); /* every request ended: no view or copy is left */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->submit_cv);
    pthread_cond_destroy(&s->enc_cv);
    pthread_cond_destroy(&s->call_cv);
    pthread_rwlock_destroy(&s->pin_lock);
    free(s->run);
    free(s->rows);
    free(s->b_tok);
    free(s->b_rw);
    free(s->b_seq);
    free(s->b_want);
    free(s->logits);
    free(s->greedy);
    free(s);
}

/* ---- submit ------------------------------------------------------------------------------- */

static is_status check_request(const sched *s, const sched_request *r) {
    if (!r->messages || r->n_messages <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "request: no messages");
    if (r->mode != ASK_MODE_KV && r->mode != ASK_MODE_PROMPT && r->mode != ASK_MODE_OFF)
        return is_error_set(IS_ERR_INVALID_ARG, "request: unknown memory mode %d", (int)r->mode);
    if (r->mode != ASK_MODE_OFF && !s->mem)
        return is_error_set(IS_ERR_INVALID_ARG, "request: memory mode '%s' needs a memory service",
                            ask_mode_name(r->mode));
    if (r->max_tokens <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "request: max_tokens must be > 0");
    if (!(r->temperature >= 0.0f) || !isfinite(r->temperature))
        return is_error_set(IS_ERR_INVALID_ARG, "request: temperature must be >= 0");
    if (!(r->top_p > 0.0f && r->top_p <= 1.0f))
        return is_error_set(IS_ERR_INVALID_ARG, "request: top_p must be in (0, 1]");
    if (r->top_k < 0) return is_error_set(IS_ERR_INVALID_ARG, "request: top_k must be >= 0");
    if (r->n_stop < 0 || r->n_stop > SCHED_MAX_STOP || (r->n_stop > 0 && !r->stop))
        return is_error_set(IS_ERR_INVALID_ARG, "request: at most %d stop strings", SCHED_MAX_STOP);
    for (int32_t i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !*r->stop[i])
            return is_error_set(IS_ERR_INVALID_ARG, "request: stop string %d is empty", (int)i);
    int32_t nf = r->mode == ASK_MODE_OFF ? 0 : r->n_facts;
    if (nf < 0 || nf > SCHED_MAX_FACTS || (nf > 0 && !r->facts))
        return is_error_set(IS_ERR_INVALID_ARG, "request: at most %d facts", SCHED_MAX_FACTS);
    for (int32_t i = 0; i < nf; i++)
        if (!r->facts[i].text || !*r->facts[i].text)
            return is_error_set(IS_ERR_INVALID_ARG, "request: fact %d has no text", (int)i);
    return IS_OK;
}

/* On the submitting thread, as soon as retrieval has named the fact: what
 * the fact index knows of its record, and, unless the index says the GPU
 * held it last time, the record loaded and widened to f32 here (within
 * prefetch_bytes; past it only read into the record store's
 * cache), so that the engine thread only injects it, and when the GPU
 * holds the record does not read it at all. A record that cannot be read
 * is left for the engine thread to find so (and prefill the fact as text). */
static bool prefetch_tiered(sched *s, req_fact *rf);

static void prefetch_fact(sched *s, req_fact *rf) {
    if (s->ht && prefetch_tiered(s, rf)) return;
    fact_index_entry e;
    bool have = fact_index_get(s->facts, rf->record, &e);
    if (!have || !e.resident) {
        fact_index_entry ne = {0};
        const model *m = engine_model(s->e);
        /* What its f32 values take, from what the index knows of it (or a
         * guess from its text's tokens: the budget is a bound, not a count). */
        int64_t per_token = 2 * (int64_t)m->cfg.n_layers * m->cfg.n_kv_heads * m->cfg.head_dim * 4;
        int64_t bytes = per_token * (have ? e.n_tokens : rf->n_toks);
        if (atomic_fetch_add(&s->prefetch_bytes, bytes) + bytes <= s->p.prefetch_bytes &&
            ask_load_record(s->ask, rf->record, &rf->pre_held, &rf->pre, &rf->pre_buf) == IS_OK) {
            const fact_kv *kv = rf->pre_held;
            rf->pre_bytes = bytes;
            ne = (fact_index_entry){.content_id = kv->content_id,
                                    .text_hash = kv->meta.text_hash,
                                    .n_tokens = kv->meta.n_tokens};
        } else {
            if (rf->pre_held) record_store_release(memory_record_store(s->mem), rf->pre_held);
            free(rf->pre_buf);
            rf->pre_held = NULL;
            rf->pre_buf = NULL;
            atomic_fetch_sub(&s->prefetch_bytes, bytes);
            if (ask_peek_record(s->ask, rf->record, &ne.content_id, &ne.n_tokens, &ne.text_hash) !=
                IS_OK)
                return; /* the engine thread finds it unusable and prefills the text */
        }
        ne.resident = have && e.content_id == ne.content_id && e.resident;
        fact_index_put(s->facts, rf->record, &ne);
        e = ne;
        have = true;
    }
    if (e.text_hash == rf->text_hash) {
        rf->known = true;
        rf->content_id = e.content_id;
        rf->n_kv_tokens = e.n_tokens;
    } else {
        drop_prefetch_fact(s, rf); /* encoded from another text: not to be injected */
    }
}

/* The host tier's path, on the submitting thread as soon as retrieval
 * has named the fact: a fact the GPU holds is pinned there; any other is
 * got from the host tier (read from its file into pinned memory on a miss,
 * in the record's own dtype) and its copy to the GPU started at once on
 * the backend's own stream, pinned until its injection, which waits for
 * the copy on the GPU, or, with no room beside the GPU's pins, when
 * admission comes near (pin_queued). True when handled (the fact is held
 * in the tier, or it cannot be used and the engine thread will find so);
 * false: the ordinary path (no room in the tier). */
static bool prefetch_tiered(sched *s, req_fact *rf) {
    fact_index_entry e;
    bool have = fact_index_get(s->facts, rf->record, &e);
    if (have && e.text_hash != rf->text_hash) return true; /* another text: prefilled */
    /* Behind a request that waits for room, even a resident fact waits in
     * the tier (its view kept, in case it is evicted before its turn). */
    bool wait = atomic_load(&s->n_waiting) > 0;
    if (have && e.resident && !wait && fact_pin(s, rf, e.content_id, e.n_tokens, 0, NULL, NULL)) {
        rf->known = true;
        rf->content_id = e.content_id;
        rf->n_kv_tokens = e.n_tokens;
        rf->tier = FACT_TIER_GPU;
        return true;
    }
    fact_kv_meta want;
    fact_meta_for_model(engine_model(s->e), s->p.record_dtype, &want);
    const fact_kv *kv = NULL;
    bool from_disk = false;
    is_status st = host_tier_get(s->ht, rf->record, &want, &kv, &from_disk);
    if (st != IS_OK) {
        is_error_clear();
        return st != IS_ERR_NOMEM; /* unusable: the engine thread finds so */
    }
    fact_index_entry ne = {.content_id = kv->content_id,
                           .text_hash = kv->meta.text_hash,
                           .n_tokens = kv->meta.n_tokens};
    fact_index_put(s->facts, rf->record, &ne);
    if (kv->meta.text_hash != rf->text_hash) {
        host_tier_release(s->ht, kv);
        return true;
    }
    /* No room beside the GPU's pins: the view is kept and the pin taken
     * later (pin_queued), when the requests ahead have injected theirs;
     * widening it to f32 here instead is what a cache smaller than the
     * queue's facts used to cost. */
    if (!wait)
        fact_pin(s, rf, kv->content_id, kv->meta.n_tokens, (int32_t)kv->meta.dtype, kv->k, kv->v);
    rf->ht_held = kv;
    rf->known = true;
    rf->content_id = kv->content_id;
    rf->n_kv_tokens = kv->meta.n_tokens;
    rf->tier = from_disk ? FACT_TIER_DISK : FACT_TIER_HOST;
    return true;
}

/* A request's facts as prepare hands them to the I/O pool. */
typedef struct prep_facts {
    sched_handle *h;
    const sched_request *r;
    const memory_prompt *mp;
    bool *failed; /* [n_facts]: tokenising failed (prepare says why) */
} prep_facts;

/* One fact of a request, on the I/O pool beside the others (a k = 50
 * request's facts are tokenised in the time of a few): its tokens and
 * text hash, then in kv mode its record found ahead of admission. */
static void prepare_fact(void *arg, int32_t i) {
    prep_facts *pf = arg;
    req_fact *rf = &pf->h->facts[i];
    const char *text = pf->r->facts[i].text;
    rf->text_hash = fact_text_hash(text, strlen(text));
    if (memory_prompt_fact(pf->mp, text, &rf->toks, &rf->n_toks) != IS_OK) {
        is_error_clear();
        pf->failed[i] = true;
        return;
    }
    if (pf->r->mode == ASK_MODE_KV && rf->record) prefetch_fact(pf->h->s, rf);
}

/* Lays out and tokenises the request into h (caller's thread: the
 * tokenizer and the layout are read-only). */
static is_status prepare(sched *s, const sched_request *r, sched_handle *h) {
    const memory_prompt *mp = ask_ctx_prompt(s->ask);
    is_status st =
        r->mode == ASK_MODE_OFF
            ? memory_prompt_chat_plain(mp, r->messages, r->n_messages, &h->suffix, &h->n_suffix)
            : memory_prompt_chat_suffix(mp, r->messages, r->n_messages, &h->suffix, &h->n_suffix);
    if (st != IS_OK) return st;
    if (r->reply_prefix && *r->reply_prefix) {
        int32_t *rp = NULL, *grown;
        size_t n_rp = 0;
        const tokenizer *tok = engine_model(s->e)->tok;
        st = tokenizer_encode(tok, r->reply_prefix, strlen(r->reply_prefix), false, false, &rp,
                              &n_rp);
        if (st != IS_OK) return st;
        grown = realloc(h->suffix, ((size_t)h->n_suffix + n_rp) * sizeof *grown);
        if (!grown) {
            free(rp);
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
        memcpy(grown + h->n_suffix, rp, n_rp * sizeof *grown);
        h->suffix = grown;
        h->n_suffix += (int32_t)n_rp;
        free(rp);
    }
    int64_t est = h->n_suffix;
    int32_t nf = r->mode == ASK_MODE_OFF ? 0 : r->n_facts;
    if (nf > 0 && !(h->facts = calloc((size_t)nf, sizeof *h->facts)))
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    h->n_facts = nf;
    for (int32_t i = 0; i < nf; i++) {
        const sched_fact *f = &r->facts[i];
        req_fact *rf = &h->facts[i];
        if (f->kv_record && !(rf->record = strdup(f->kv_record)))
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        const memory_fact_ref *row = r->fact_rows ? &r->fact_rows[i] : NULL;
        if (r->mode == ASK_MODE_KV && row && row->id[0] && row->tenant && *row->tenant &&
            row->user && *row->user) {
            if (!(rf->tenant = strdup(row->tenant)) || !(rf->user = strdup(row->user)) ||
                !(rf->id = strdup(row->id)))
                return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
        /* Before its record is read: the disk cap spares it until the end. */
        if (r->mode == ASK_MODE_KV && rf->record) {
            record_store_pin(memory_record_store(s->mem), rf->record);
            rf->rec_pinned = true;
        }
    }
    /* Every fact at once: the tokenisers run side by side, the misses'
     * reads and copies overlap. */
    bool *failed = nf > 0 ? calloc((size_t)nf, sizeof *failed) : NULL;
    if (nf > 0 && !failed) return is_error_set(IS_ERR_NOMEM, "out of memory");
    prep_facts pf = {h, r, mp, failed};
    io_pool_run(s->io, prepare_fact, &pf, nf);
    for (int32_t i = 0; i < nf && st == IS_OK; i++) {
        /* Again here for the failure's message (a thread's own). */
        if (failed[i])
            st = memory_prompt_fact(mp, r->facts[i].text, &h->facts[i].toks, &h->facts[i].n_toks);
        est += h->facts[i].n_toks;
    }
    free(failed);
    if (st != IS_OK) return st;
    if (r->mode != ASK_MODE_OFF) est += s->n_prefix;
    if (est + r->max_tokens > s->n_ctx)
        return is_error_set(IS_ERR_CONTEXT_FULL,
                            "the prompt (%lld tokens) plus max_tokens (%d) is longer than the "
                            "context of %d tokens",
                            (long long)est, (int)r->max_tokens, (int)s->n_ctx);
    h->est_prompt = (int32_t)est;
    h->max_tokens = r->max_tokens;
    h->mode = r->mode;
    reserve_for(s, h, h->est_prompt);
    /* Every block but the prefix's is there when nothing else runs. */
    int32_t capacity = s->n_blocks - s->prefix_blocks;
    if (h->reserve > capacity)
        return is_error_set(IS_ERR_CONTEXT_FULL,
                            "the request needs %d KV blocks; the pool has %d for requests",
                            (int)h->reserve, (int)capacity);
    if (r->n_stop > 0) {
        if (!(h->stop = calloc((size_t)r->n_stop, sizeof *h->stop)))
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        h->n_stop = r->n_stop;
        for (int32_t i = 0; i < r->n_stop; i++)
            if (!(h->stop[i] = strdup(r->stop[i])))
                return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    h->sp = (sampler_params){
        .temperature = r->temperature, .top_k = r->top_k, .top_p = r->top_p, .seed = r->seed};
    return IS_OK;
}

/* A sched_submit is out (s->n_submitting); it keeps the error it set. */
static void submit_leave(sched *s) {
    pthread_mutex_lock(&s->mu);
    if (--s->n_submitting == 0) pthread_cond_broadcast(&s->submit_cv);
    pthread_mutex_unlock(&s->mu);
}

is_status sched_submit(sched *s, const sched_request *r, sched_event_fn fn, void *ud,
                       sched_handle **out) {
    if (!s || !r || !out) return is_error_set(IS_ERR_INVALID_ARG, "sched_submit: NULL argument");
    is_status st = check_request(s, r);
    if (st != IS_OK) return st;
    pthread_mutex_lock(&s->mu);
    bool stopping = s->stop;
    if (!stopping) s->n_submitting++;
    pthread_mutex_unlock(&s->mu);
    if (stopping) return is_error_set(IS_ERR_CANCELLED, "scheduler: shutting down");
    sched_handle *h = calloc(1, sizeof *h);
    if (!h) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        submit_leave(s);
        return st;
    }
    pthread_mutexattr_t ra;
    pthread_mutexattr_init(&ra);
    pthread_mutexattr_settype(&ra, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&h->cb_mu, &ra);
    pthread_mutexattr_destroy(&ra);
    pthread_mutex_init(&h->mu, NULL);
    atomic_init(&h->cancelled, false);
    h->s = s;
    h->fn = fn;
    h->ud = ud;
    h->refs = 2;
    h->seq = -1;
    h->t_submit = now_ms();
    st = prepare(s, r, h);
    if (st == IS_OK) {
        pthread_mutex_lock(&s->mu);
        if (s->stop) {
            st = is_error_set(IS_ERR_CANCELLED, "scheduler: shutting down");
        } else if (s->failed) {
            st = is_error_set(IS_ERR_BUSY, "%s (recovering)", s->fail_msg);
        } else if (s->n_queued >= s->p.max_queued) {
            st = is_error_set(IS_ERR_BUSY, "scheduler: %d requests already wait", (int)s->n_queued);
        } else {
            /* Before the engine thread can see it: events may follow at once. */
            *out = h;
            if (s->q_tail) s->q_tail->next = h;
            else s->q_head = h;
            s->q_tail = h;
            s->n_queued++;
            s->st.queued = s->n_queued;
            if (submit_waits(h)) atomic_fetch_add(&s->n_waiting, 1);
            pthread_cond_signal(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (st != IS_OK) {
        drop_prefetch(s, h);
        unpin_records(s, h);
        handle_destroy(h);
    }
    submit_leave(s); /* last: sched_free may free s once it is out */
    return st;
}

void sched_cancel(sched_handle *h) {
    if (!h) return;
    atomic_store(&h->cancelled, true);
    pthread_mutex_lock(&h->mu);
    if (!h->ended) {
        /* The request is still the scheduler's, so s is alive: wake it. */
        pthread_mutex_lock(&h->s->mu);
        pthread_cond_signal(&h->s->cv);
        pthread_mutex_unlock(&h->s->mu);
    }
    pthread_mutex_unlock(&h->mu);
}

void sched_release(sched_handle *h) {
    if (!h) return;
    pthread_mutex_lock(&h->cb_mu);
    h->released = true;
    pthread_mutex_unlock(&h->cb_mu);
    sched_cancel(h); /* a no-op once it ended */
    handle_unref(h);
}

is_status sched_encode(sched *s, const char *tenant, const char *user, const char *fact_id) {
    if (!s || !tenant || !*tenant || !user || !*user || !fact_id || !*fact_id)
        return is_error_set(IS_ERR_INVALID_ARG, "sched_encode: needs tenant, user and fact id");
    if (!s->mem) return is_error_set(IS_ERR_INVALID_ARG, "sched_encode: no memory service");
    sched_job *j = job_new(JOB_ONE, tenant, user, fact_id);
    if (!j) return is_error_set(IS_ERR_NOMEM, "out of memory");
    return job_push(s, j, false);
}

is_status sched_encode_missing(sched *s) {
    if (!s) return is_error_set(IS_ERR_INVALID_ARG, "sched_encode_missing: NULL argument");
    if (!s->mem) return is_error_set(IS_ERR_INVALID_ARG, "sched_encode_missing: no memory service");
    sched_job *j = job_new(JOB_MISSING, NULL, NULL, NULL);
    if (!j) return is_error_set(IS_ERR_NOMEM, "out of memory");
    return job_push(s, j, false);
}

bool sched_fact_kv_here(sched *s, const char *record) {
    if (!s || !record || !*record) return false;
    /* The GPU first: a hash lookup, where the store may ask the disk. */
    fact_index_entry e;
    if (fact_index_get(s->facts, record, &e) &&
        engine_fact_resident(s->e, e.content_id, e.n_tokens))
        return true;
    return s->mem && record_store_contains(memory_record_store(s->mem), record);
}

void sched_hold_admission(sched *s, bool hold) {
    pthread_mutex_lock(&s->mu);
    s->hold = hold;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void sched_get_health(sched *s, sched_health *out) {
    pthread_mutex_lock(&s->mu);
    out->healthy = !s->failed;
    out->backend_failures = s->n_failures;
    out->recoveries = s->n_recoveries;
    snprintf(out->last_error, sizeof out->last_error, "%s", s->fail_msg);
    pthread_mutex_unlock(&s->mu);
}

void sched_get_stats(sched *s, sched_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
}

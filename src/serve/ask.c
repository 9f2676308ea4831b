#include "serve/ask.h"

#include "engine/recompute.h"

#include "core/status.h"
#include "core/threads.h"
#include "engine/sampler.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ask_ctx {
    engine *e;
    record_store *store;
    kv_dtype dtype;
    memory_prompt *mp;
    int32_t prefix_seq; /* holds the serving prefix for every request to fork */
    int32_t n_prefix;
    float *logits;        /* [n_vocab] */
    ask_encode_stats enc; /* what the encodings took, since creation */
    /* The captured rows of the last forward (in the capture's dtype),
     * kept for the next: fresh pages cost the kernel a zero-fill each
     * (over 5 MB a fact for an 8B model), pinning them costs more, and a
     * forward of the same size needs them again. Grown, never shrunk: what
     * stays is the largest group's peak, which the encoding needed anyway.
     * From engine_host_alloc where the backend has it (pinned: the capture
     * comes down at the bus's rate), else malloc. */
    void *cap_k, *cap_v;
    size_t cap_bytes;
    bool cap_pinned;
    /* The facts' narrowed sections until their group is written, kept
     * between groups for the same reason; two sets, so that one group's
     * records are written while the next group's forward runs into the
     * other (`cur` is the one the next forward fills). */
    uint8_t *sections[2];
    size_t sections_bytes[2];
    int cur;
    /* Where the engine is used (ask_ctx_create_beside), or NULL: here. */
    ask_engine_runner runner;
    void *runner_ud;
    bool owns_prefix; /* prefix_seq is this context's own, closed with it */
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

const char *ask_mode_name(ask_mode m) {
    switch (m) {
    case ASK_MODE_KV: return "kv";
    case ASK_MODE_PROMPT: return "prompt";
    case ASK_MODE_OFF: return "off";
    }
    return "?";
}

bool ask_mode_parse(const char *s, ask_mode *out) {
    for (int m = 0; m < 3; m++) {
        if (strcmp(s, ask_mode_name((ask_mode)m)) == 0) {
            *out = (ask_mode)m;
            return true;
        }
    }
    return false;
}

/* Feeds tokens to a sequence in one batch: the last token's logits into
 * a->logits, or with `greedy` its greedy choice there instead, chosen on
 * the backend (engine_decode_greedy: no logits brought back). */
static is_status feed(ask_ctx *a, int32_t seq, const int32_t *toks, int32_t n,
                      engine_kv_capture *cap, const int32_t *rw, const engine_blend *bl,
                      int32_t *greedy) {
    int32_t *seqs = malloc((size_t)(n ? n : 1) * sizeof *seqs);
    if (!seqs) return is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < n; i++) seqs[i] = seq;
    engine_batch b = {
        .n_tokens = n, .tokens = toks, .seq = seqs, .capture = cap, .rewrite = rw, .blend = bl};
    is_status st =
        greedy ? engine_decode_greedy(a->e, &b, greedy) : engine_decode(a->e, &b, a->logits);
    free(seqs);
    return st;
}

/* feed, then the next token chosen by smp into *next. */
static is_status feed_choose(ask_ctx *a, int32_t seq, const int32_t *toks, int32_t n,
                             const int32_t *rw, const engine_blend *bl, sampler *smp,
                             int32_t *next) {
    if (sampler_is_greedy(smp)) return feed(a, seq, toks, n, NULL, rw, bl, next);
    is_status st = feed(a, seq, toks, n, NULL, rw, bl, NULL);
    if (st == IS_OK) *next = sampler_sample(smp, a->logits);
    return st;
}

/* A context on e, store and dtype with its own buffers and prompt
 * builder, no serving prefix yet (freed on failure). */
static is_status ctx_new(engine *e, record_store *store, kv_dtype dtype, ask_ctx **out) {
    ask_ctx *a = calloc(1, sizeof *a);
    if (!a) return is_error_set(IS_ERR_NOMEM, "out of memory");
    a->e = e;
    a->store = store;
    a->dtype = dtype;
    a->prefix_seq = -1;
    const model *m = engine_model(e);
    a->logits = malloc((size_t)m->cfg.n_vocab * sizeof(float));
    is_status st = a->logits ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) st = memory_prompt_create(m, NULL, &a->mp);
    if (st != IS_OK) {
        ask_ctx_free(a);
        return st;
    }
    *out = a;
    return IS_OK;
}

is_status ask_ctx_create(engine *e, record_store *store, kv_dtype dtype, ask_ctx **out) {
    ask_ctx *a = NULL;
    is_status st = ctx_new(e, store, dtype, &a);
    if (st != IS_OK) return st;
    st = engine_seq_open(e, &a->prefix_seq);
    a->owns_prefix = st == IS_OK;
    if (st == IS_OK) {
        const int32_t *pre = memory_prompt_prefix(a->mp, &a->n_prefix);
        st = feed(a, a->prefix_seq, pre, a->n_prefix, NULL, NULL, NULL, NULL);
    }
    if (st != IS_OK) {
        ask_ctx_free(a);
        return st;
    }
    if (store) {
        /* Records of another model or dtype count as missing, so what
         * encodes the missing facts encodes over them. */
        fact_kv_meta want;
        fact_meta_for_model(engine_model(e), dtype, &want);
        record_store_set_model(store, &want);
    }
    *out = a;
    return IS_OK;
}

is_status ask_ctx_create_beside(ask_ctx *base, ask_engine_runner runner, void *user_data,
                                ask_ctx **out) {
    ask_ctx *a = NULL;
    is_status st = ctx_new(base->e, base->store, base->dtype, &a);
    if (st != IS_OK) return st;
    a->prefix_seq = base->prefix_seq;
    a->n_prefix = base->n_prefix;
    a->runner = runner;
    a->runner_ud = user_data;
    *out = a;
    return IS_OK;
}

/* fn(arg) where the engine may be used: through the context's runner, or
 * here. */
static is_status on_engine(ask_ctx *a, ask_engine_fn fn, void *arg) {
    return a->runner ? a->runner(a->runner_ud, fn, arg) : fn(arg);
}

static void cap_release(ask_ctx *a) {
    void *bufs[] = {a->cap_k, a->cap_v};
    for (int i = 0; i < 2; i++) {
        if (a->cap_pinned) engine_host_free(a->e, bufs[i]);
        else free(bufs[i]);
    }
    a->cap_k = a->cap_v = NULL;
    a->cap_bytes = 0;
}

/* Room for a capture of `bytes` a side in a->cap_k and a->cap_v. */
static is_status cap_reserve(ask_ctx *a, size_t bytes) {
    if (bytes <= a->cap_bytes) return IS_OK;
    cap_release(a);
    a->cap_pinned = engine_host_alloc(a->e, bytes, &a->cap_k) == IS_OK &&
                    engine_host_alloc(a->e, bytes, &a->cap_v) == IS_OK;
    if (!a->cap_pinned) {
        is_error_clear();                 /* no pinned memory here: ordinary memory does */
        engine_host_free(a->e, a->cap_k); /* the first of two, or NULL */
        a->cap_k = malloc(bytes);
        a->cap_v = malloc(bytes);
    }
    if (!a->cap_k || !a->cap_v) {
        cap_release(a);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    a->cap_bytes = bytes;
    return IS_OK;
}

void ask_ctx_free(ask_ctx *a) {
    if (!a) return;
    if (a->owns_prefix) engine_seq_close(a->e, a->prefix_seq);
    memory_prompt_free(a->mp);
    free(a->logits);
    cap_release(a);
    free(a->sections[0]);
    free(a->sections[1]);
    free(a);
}

const memory_prompt *ask_ctx_prompt(const ask_ctx *a) { return a->mp; }

record_store *ask_ctx_store(const ask_ctx *a) { return a->store; }

ask_encode_stats ask_ctx_encode_stats(const ask_ctx *a) { return a->enc; }

int32_t ask_ctx_prefix_seq(const ask_ctx *a, int32_t *n_prefix) {
    if (n_prefix) *n_prefix = a->n_prefix;
    return a->prefix_seq;
}

is_status ask_memory_encoder(void *ud, record_store *store, const memory_encode_job *job) {
    ask_ctx *a = ud;
    if (store != a->store)
        return is_error_set(IS_ERR_INVALID_ARG, "ask encoder: the memory's record store is not "
                                                "the one this ask context writes to");
    ask_fact af = {job->record_id, job->text, job->context, job->n_context};
    bool did;
    return ask_encode_fact(a, &af, job->window, &did);
}

is_status ask_encode_fact(ask_ctx *a, const ask_fact *f, int32_t window, bool *encoded) {
    is_status st_one = IS_OK;
    is_status st = ask_encode_facts(a, f, &window, 1, 0, &st_one, encoded);
    return st != IS_OK ? st : st_one;
}

/* One fact of a batched encoding: its tokens and where they go. */
typedef struct enc_item {
    int32_t *fact, *ctx; /* tokens (malloc'd) */
    int32_t n_fact, n_ctx;
    int32_t meta_window;
    uint64_t text_hash;
    bool todo;       /* still to encode (checked, not skipped, not failed) */
    int32_t seq;     /* while in a forward */
    int32_t cap_off; /* first row of its tokens in the capture */
    void *k, *v;     /* the record's keys and values in the ask_ctx's dtype
                      * (in the ask_ctx's sections: not the item's to free) */
} enc_item;

/* The dtype a record of `dtype` is captured in: its own, narrowed on the
 * backend, where that is element-wise; fp8 needs every row of a fact for
 * its scales, so it comes as f32 and fact_kv_narrow quantises it here. */
static int32_t capture_dtype(kv_dtype dtype) {
    return dtype == KV_DTYPE_FP8 ? KV_DTYPE_F32 : (int32_t)dtype;
}

/* Copies fact j's rows out of the capture ([n_layers][n_cap][kv_dim] in
 * capture_dtype) into its own record sections ([n_layers][n_fact][kv_dim]
 * in the record dtype): a copy a layer, or for fp8 the rows gathered and
 * quantised by fact_kv_narrow as one section (its scales after the codes). */
static is_status take_rows(ask_ctx *a, enc_item *it, const void *ck, const void *cv,
                           int32_t n_cap) {
    const model_config *c = &engine_model(a->e)->cfg;
    fact_kv_meta meta;
    fact_meta_for_model(engine_model(a->e), a->dtype, &meta);
    meta.n_tokens = it->n_fact;
    size_t kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t rows = (size_t)it->n_fact * kv_dim;
    bool gather = a->dtype == KV_DTYPE_FP8;
    float *wide = gather ? malloc((size_t)c->n_layers * rows * sizeof(float)) : NULL;
    if (gather && !wide) return is_error_set(IS_ERR_NOMEM, "out of memory");
    size_t esz = kv_dtype_size((kv_dtype)capture_dtype(a->dtype));
    for (int pass = 0; pass < 2; pass++) {
        const uint8_t *cap = pass == 0 ? ck : cv;
        uint8_t *dst = gather ? (uint8_t *)wide : pass == 0 ? it->k : it->v;
        for (int32_t l = 0; l < c->n_layers; l++)
            memcpy(dst + (size_t)l * rows * esz,
                   cap + ((size_t)l * n_cap + it->cap_off) * kv_dim * esz, rows * esz);
        if (gather) fact_kv_narrow(&meta, wide, pass == 0 ? it->k : it->v);
    }
    free(wide);
    return IS_OK;
}

/* One forward over the facts it[g[0..n)] (each in a sequence of its own,
 * forked from the serving prefix unless its window is < 0), on the
 * engine's thread: the batch holds every context first, then every fact,
 * so the facts' rows are one captured range (a->cap_k, a->cap_v; each
 * item's cap_off says where its rows start). *ms and *n_tokens: what it
 * took. */
static is_status encode_forward(ask_ctx *a, enc_item *it, const int32_t *g, int32_t n, double *ms,
                                int32_t *n_tokens) {
    const model_config *c = &engine_model(a->e)->cfg;
    int32_t n_ctx = 0, n_fact = 0;
    for (int32_t j = 0; j < n; j++) {
        n_ctx += it[g[j]].n_ctx;
        n_fact += it[g[j]].n_fact;
    }
    int32_t total = n_ctx + n_fact;
    double t0 = now_ms();
    const int32_t cap_dtype = capture_dtype(a->dtype);
    size_t cap_bytes = (size_t)c->n_layers * n_fact * c->n_kv_heads * c->head_dim *
                       kv_dtype_size((kv_dtype)cap_dtype);
    int32_t *toks = malloc((size_t)total * sizeof *toks);
    int32_t *seqs = malloc((size_t)total * sizeof *seqs);
    is_status st =
        toks && seqs ? cap_reserve(a, cap_bytes) : is_error_set(IS_ERR_NOMEM, "out of memory");
    int32_t at = 0, off = 0;
    for (int32_t j = 0; st == IS_OK && j < n; j++) {
        enc_item *e = &it[g[j]];
        memcpy(toks + at, e->ctx, (size_t)e->n_ctx * sizeof *toks);
        for (int32_t t = 0; t < e->n_ctx; t++) seqs[at + t] = e->seq;
        at += e->n_ctx;
    }
    for (int32_t j = 0; st == IS_OK && j < n; j++) {
        enc_item *e = &it[g[j]];
        memcpy(toks + at, e->fact, (size_t)e->n_fact * sizeof *toks);
        for (int32_t t = 0; t < e->n_fact; t++) seqs[at + t] = e->seq;
        e->cap_off = off;
        at += e->n_fact;
        off += e->n_fact;
    }
    if (st == IS_OK) {
        /* Tokens keep their order within each sequence, so every fact
         * still follows its own context. Only the last token's greedy
         * choice comes back: the forward is run for its keys and values. */
        engine_kv_capture cap = {
            .first = n_ctx, .n = n_fact, .dtype = cap_dtype, .k = a->cap_k, .v = a->cap_v};
        engine_batch b = {.n_tokens = total, .tokens = toks, .seq = seqs, .capture = &cap};
        int32_t next;
        st = engine_decode_greedy(a->e, &b, &next);
    }
    free(toks);
    free(seqs);
    *ms = now_ms() - t0;
    *n_tokens = total;
    return st;
}

/* Cuts the facts it[g[0..n)]'s rows out of the last forward's capture into
 * their record sections (any thread: no engine). */
static is_status cut_rows(ask_ctx *a, enc_item *it, const int32_t *g, int32_t n) {
    int32_t n_fact = 0;
    for (int32_t j = 0; j < n; j++) n_fact += it[g[j]].n_fact;
    double t1 = now_ms();
    /* Every fact's sections, one after another (each at a multiple of 64
     * bytes, as the conversions like it). */
    fact_kv_meta meta;
    fact_meta_for_model(engine_model(a->e), a->dtype, &meta);
    size_t need = 0;
    for (int32_t j = 0; j < n; j++) {
        meta.n_tokens = it[g[j]].n_fact;
        need += 2 * ((fact_kv_bytes(&meta) + 63) & ~(size_t)63);
    }
    int c = a->cur;
    if (need > a->sections_bytes[c]) {
        free(a->sections[c]);
        a->sections[c] = aligned_alloc(64, need);
        a->sections_bytes[c] = a->sections[c] ? need : 0;
    }
    if (!a->sections[c]) return is_error_set(IS_ERR_NOMEM, "out of memory");
    for (size_t at_b = 0, j = 0; j < (size_t)n; j++) {
        meta.n_tokens = it[g[j]].n_fact;
        size_t b = (fact_kv_bytes(&meta) + 63) & ~(size_t)63;
        it[g[j]].k = a->sections[c] + at_b;
        it[g[j]].v = a->sections[c] + at_b + b;
        at_b += 2 * b;
    }
    /* Every fact's rows are megabytes (and fp8's are quantised here): the
     * facts are cut out in parallel. */
    int fail = 0;
    const void *ck = a->cap_k, *cv = a->cap_v;
    threads_attach();
#pragma omp parallel for schedule(dynamic) reduction(| : fail) if (n > 1)
    for (int32_t j = 0; j < n; j++) fail |= take_rows(a, &it[g[j]], ck, cv, n_fact) != IS_OK;
    if (fail) return is_error_set(IS_ERR_NOMEM, "out of memory");
    a->enc.convert_ms += now_ms() - t1;
    return IS_OK;
}

/* The next group of an encoding, chosen and run on the engine's thread (it
 * takes the engine's free sequences): as many facts of it[i..n) still to
 * do as fit max_tokens (at least one) and the free sequences, at most
 * limit, each forked from the serving prefix, one forward over them, their
 * sequences closed again. Its members into g[0..*ng). */
typedef struct group_job {
    ask_ctx *a;
    enc_item *it;
    const int32_t *window;
    int32_t i, n, limit, max_tokens;
    int32_t *g;
    int32_t ng;
    double ms;
    int32_t n_tokens;
} group_job;

static is_status group_forward(void *arg) {
    group_job *q = arg;
    ask_ctx *a = q->a;
    enc_item *it = q->it;
    int32_t ng = 0, tokens = 0;
    for (int32_t j = q->i; j < q->n && ng < q->limit; j++) {
        if (!it[j].todo) continue;
        int32_t t = it[j].n_ctx + it[j].n_fact;
        if (ng > 0 && tokens + t > q->max_tokens) break;
        int32_t seq;
        if (engine_seq_open(a->e, &seq) != IS_OK) break;
        it[j].seq = seq;
        q->g[ng++] = j;
        tokens += t;
    }
    is_status st = ng > 0 ? IS_OK : is_error_set(IS_ERR_CONTEXT_FULL, "encode: no free sequence");
    /* The serving prefix is shared from the cached sequence, not recomputed. */
    for (int32_t j = 0; st == IS_OK && j < ng; j++)
        if (q->window[q->g[j]] >= 0)
            st = engine_seq_fork(a->e, it[q->g[j]].seq, a->prefix_seq, a->n_prefix);
    if (st == IS_OK) st = encode_forward(a, it, q->g, ng, &q->ms, &q->n_tokens);
    for (int32_t j = 0; j < ng; j++) {
        engine_seq_close(a->e, it[q->g[j]].seq);
        it[q->g[j]].seq = -1;
    }
    q->ng = ng;
    return st;
}

/* One group's record writes (one group commit), on a thread of its own
 * while the next group's forward runs: the forward is the GPU's work and
 * the writes are the host's, so in series each waits for the other. The
 * thread only calls the record store; what the results change (statuses,
 * counts, the error message) is done by the encoding thread when it
 * collects them, so nothing else is shared. Writes never overlap each
 * other: a group's start waits for the one before, so records are written
 * (and the store's fault hook asked) in group order. */
typedef struct group_write {
    record_store *store;
    int32_t n;
    int32_t *g; /* the items written, a copy */
    const char **ids;
    fact_kv_meta *meta;
    const fact_kv_meta **metas;
    const int32_t **toks;
    const void **k, **v;
    is_status *sts;
    is_status st;
    double ms;
    char msg[512];
    pthread_t thread;
    bool threaded; /* thread to join */
    bool pending;  /* results to collect */
} group_write;

static void group_write_clear(group_write *w) {
    free(w->g);
    free(w->ids);
    free(w->meta);
    free(w->metas);
    free(w->toks);
    free(w->k);
    free(w->v);
    free(w->sts);
    memset(w, 0, sizeof *w);
}

static void *group_write_run(void *p) {
    group_write *w = p;
    double t0 = now_ms();
    w->st = record_store_put_batch(w->store, w->n, w->ids, w->metas, w->toks, w->k, w->v, w->sts);
    w->ms = now_ms() - t0;
    if (w->st != IS_OK) snprintf(w->msg, sizeof w->msg, "%s", is_error_last());
    return NULL;
}

/* Waits for w's writes and gives their results to the items: status,
 * `encoded` and the counts. */
static void group_write_collect(ask_ctx *a, group_write *w, is_status *status, bool *encoded) {
    if (!w->pending) return;
    if (w->threaded) pthread_join(w->thread, NULL);
    if (w->st != IS_OK) is_error_set(w->st, "%s", w->msg);
    a->enc.write_ms += w->ms;
    for (int32_t j = 0; j < w->n; j++) {
        is_status sj = w->sts[j];
        status[w->g[j]] = sj;
        if (sj == IS_OK) encoded[w->g[j]] = true, a->enc.n_facts++;
    }
    group_write_clear(w);
}

/* Starts the writes of it[g[0..n)] (their sections stay untouched until
 * collected), on a thread when `overlap`, else here before returning. */
static is_status group_write_start(ask_ctx *a, const ask_fact *f, enc_item *it, const int32_t *g,
                                   int32_t n, bool overlap, group_write *w) {
    const model *m = engine_model(a->e);
    *w = (group_write){.store = a->store, .n = n};
    w->g = malloc((size_t)n * sizeof *w->g);
    w->ids = malloc((size_t)n * sizeof *w->ids);
    w->meta = malloc((size_t)n * sizeof *w->meta);
    w->metas = malloc((size_t)n * sizeof *w->metas);
    w->toks = malloc((size_t)n * sizeof *w->toks);
    w->k = malloc((size_t)n * sizeof *w->k);
    w->v = malloc((size_t)n * sizeof *w->v);
    w->sts = malloc((size_t)n * sizeof *w->sts);
    if (!w->g || !w->ids || !w->meta || !w->metas || !w->toks || !w->k || !w->v || !w->sts) {
        group_write_clear(w);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    for (int32_t j = 0; j < n; j++) {
        enc_item *e = &it[g[j]];
        fact_meta_for_model(m, a->dtype, &w->meta[j]);
        w->meta[j].n_tokens = e->n_fact;
        w->meta[j].window = e->meta_window;
        w->meta[j].text_hash = e->text_hash;
        w->g[j] = g[j];
        w->ids[j] = f[g[j]].id;
        w->metas[j] = &w->meta[j];
        w->toks[j] = e->fact;
        w->k[j] = e->k;
        w->v[j] = e->v;
        w->sts[j] = IS_OK;
    }
    w->pending = true;
    w->threaded = overlap && pthread_create(&w->thread, NULL, group_write_run, w) == 0;
    if (!w->threaded) group_write_run(w);
    return IS_OK;
}

is_status ask_encode_facts(ask_ctx *a, const ask_fact *f, const int32_t *window, int32_t n,
                           int32_t max_tokens, is_status *status, bool *encoded) {
    if (n <= 0) return IS_OK;
    if (max_tokens <= 0) max_tokens = ASK_ENCODE_MAX_TOKENS;
    const model *m = engine_model(a->e);
    fact_kv_meta want;
    fact_meta_for_model(m, a->dtype, &want);
    enc_item *it = calloc((size_t)n, sizeof *it);
    int32_t *g = malloc((size_t)n * sizeof *g);
    if (!it || !g) {
        free(it);
        free(g);
        is_status st = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; i < n; i++) status[i] = st, encoded[i] = false;
        return st;
    }
    /* Check and tokenise every fact; a fact whose record is already
     * stored (same model, dtype, window and text) is skipped. */
    for (int32_t i = 0; i < n; i++) {
        enc_item *e = &it[i];
        e->seq = -1;
        encoded[i] = false;
        status[i] = IS_OK;
        int32_t w = window[i];
        int32_t n_turns = w < 0 ? 0 : (w < f[i].n_context ? w : f[i].n_context);
        e->meta_window = w < 0 ? -1 : n_turns;
        e->text_hash = fact_text_hash(f[i].text, strlen(f[i].text));
        /* A bad id would fail its whole group's commit: refused here alone. */
        if (!record_store_id_valid(f[i].id)) {
            status[i] = is_error_set(IS_ERR_INVALID_ARG, "encode: bad record id '%s'",
                                     f[i].id ? f[i].id : "(null)");
            continue;
        }
        if (record_store_contains(a->store, f[i].id)) {
            const fact_kv *kv = NULL;
            if (record_store_get(a->store, f[i].id, &want, &kv) == IS_OK) {
                bool same = kv->meta.text_hash == e->text_hash && kv->meta.window == e->meta_window;
                record_store_release(a->store, kv);
                if (same) continue;
            }
            /* Stale, corrupt or from another model: encode again over it. */
        }
        is_status st = memory_prompt_fact(a->mp, f[i].text, &e->fact, &e->n_fact);
        if (st == IS_OK)
            st = memory_prompt_context(a->mp, f[i].context + (f[i].n_context - n_turns), n_turns,
                                       &e->ctx, &e->n_ctx);
        if (st == IS_OK && e->n_fact == 0)
            st = is_error_set(IS_ERR_INVALID_ARG, "fact '%s' has no tokens", f[i].id);
        status[i] = st;
        e->todo = st == IS_OK;
    }
    /* Groups in order: as many facts as fit max_tokens (at least one) and
     * the free sequences. A pool too small for a group is retried with
     * half of it; a single fact that does not fit fails. */
    int32_t limit = n; /* facts a group may hold */
    is_status fatal = IS_OK;
    group_write w = {0};
    for (int32_t i = 0; i < n && fatal == IS_OK;) {
        if (!it[i].todo) {
            i++;
            continue;
        }
        group_job q = {.a = a,
                       .it = it,
                       .window = window,
                       .i = i,
                       .n = n,
                       .limit = limit,
                       .max_tokens = max_tokens,
                       .g = g};
        is_status st = on_engine(a, group_forward, &q);
        int32_t ng = q.ng;
        if (st == IS_OK) st = cut_rows(a, it, g, ng);
        if (st == IS_OK) {
            a->enc.forward_ms += q.ms;
            a->enc.n_forwards++;
            a->enc.n_tokens += q.n_tokens;
        }
        if (st == IS_ERR_CONTEXT_FULL && ng > 1) {
            limit = ng / 2;
            for (int32_t j = 0; j < ng; j++) it[g[j]].k = it[g[j]].v = NULL;
            continue;
        }
        if (st != IS_OK) {
            /* A fact alone that does not fit, or the backend failed: the
             * facts not yet encoded get this status. */
            fatal = st;
            for (int32_t j = i; j < n; j++)
                if (it[j].todo) status[j] = st, it[j].todo = false;
            break;
        }
        /* This group's writes go beside the next group's forward, into
         * the other set of sections; the writes before them are done first. */
        group_write_collect(a, &w, status, encoded);
        for (int32_t j = 0; j < ng; j++) it[g[j]].todo = false;
        bool more = false;
        for (int32_t j = i; j < n && !more; j++) more = it[j].todo;
        st = group_write_start(a, f, it, g, ng, more, &w);
        if (st != IS_OK)
            for (int32_t j = 0; j < ng; j++) status[g[j]] = st;
        a->cur ^= 1;
        for (int32_t j = 0; j < ng; j++) it[g[j]].k = it[g[j]].v = NULL;
    }
    group_write_collect(a, &w, status, encoded);
    is_status first = IS_OK;
    for (int32_t i = 0; i < n; i++) {
        free(it[i].fact);
        free(it[i].ctx);
        if (first == IS_OK && status[i] != IS_OK) first = status[i];
    }
    free(it);
    free(g);
    return first;
}

static is_status fetch_record(ask_ctx *a, const char *id, bool may_skip, const fact_kv **held,
                              engine_fact *out, float **buf) {
    *buf = NULL;
    *held = NULL;
    if (!a->store) return is_error_set(IS_ERR_NOT_FOUND, "no record store");
    const model *m = engine_model(a->e);
    fact_kv_meta want;
    fact_meta_for_model(m, a->dtype, &want);
    is_status st = record_store_get(a->store, id, &want, held);
    if (st != IS_OK) return st;
    const fact_kv *kv = *held;
    size_t elems =
        (size_t)m->cfg.n_layers * kv->meta.n_tokens * m->cfg.n_kv_heads * m->cfg.head_dim;
    const float *k = kv->k, *v = kv->v;
    if (may_skip && engine_fact_resident(a->e, kv->content_id, kv->meta.n_tokens)) {
        k = v = NULL; /* the backend has it: no widening on the request path */
    } else if (kv->meta.dtype != KV_DTYPE_F32) {
        *buf = malloc(2 * elems * sizeof(float));
        if (!*buf) return is_error_set(IS_ERR_NOMEM, "out of memory");
        fact_kv_widen(&kv->meta, kv->k, *buf);
        fact_kv_widen(&kv->meta, kv->v, *buf + elems);
        k = *buf;
        v = *buf + elems;
    }
    *out = (engine_fact){.n_tokens = kv->meta.n_tokens, .tokens = kv->tokens, .k = k, .v = v};
    return IS_OK;
}

is_status ask_fetch_record(ask_ctx *a, const char *id, const fact_kv **held, engine_fact *out,
                           float **buf) {
    return fetch_record(a, id, true, held, out, buf);
}

is_status ask_load_record(ask_ctx *a, const char *id, const fact_kv **held, engine_fact *out,
                          float **buf) {
    return fetch_record(a, id, false, held, out, buf);
}

is_status ask_peek_record(ask_ctx *a, const char *id, uint64_t *content_id, int32_t *n_tokens,
                          uint64_t *text_hash) {
    if (!a->store) return is_error_set(IS_ERR_NOT_FOUND, "no record store");
    fact_kv_meta want;
    fact_meta_for_model(engine_model(a->e), a->dtype, &want);
    const fact_kv *kv = NULL;
    is_status st = record_store_get(a->store, id, &want, &kv);
    if (st != IS_OK) return st;
    *content_id = kv->content_id;
    *n_tokens = kv->meta.n_tokens;
    *text_hash = kv->meta.text_hash;
    record_store_release(a->store, kv);
    return IS_OK;
}

/* Fetches the records of a kv request as f32 engine facts (with their
 * values always where the blend reads them). */
static is_status fetch_facts(ask_ctx *a, const ask_request *r, const fact_kv **held,
                             engine_fact *facts, float **bufs) {
    for (int32_t i = 0; i < r->n_facts; i++) {
        const char *id = r->fact_ids[i];
        is_status st = r->blend > 0 ? ask_load_record(a, id, &held[i], &facts[i], &bufs[i])
                                    : ask_fetch_record(a, id, &held[i], &facts[i], &bufs[i]);
        if (st != IS_OK) return st;
    }
    return IS_OK;
}

is_status ask_run(ask_ctx *a, const ask_request *r, ask_text_cb cb, void *ud, ask_timing *t) {
    const model *m = engine_model(a->e);
    ask_timing tm = {0};
    double t0 = now_ms();
    int32_t n = r->mode == ASK_MODE_OFF ? 0 : r->n_facts;
    const fact_kv **held = calloc((size_t)(n ? n : 1), sizeof *held);
    engine_fact *facts = calloc((size_t)(n ? n : 1), sizeof *facts);
    float **bufs = calloc((size_t)(n ? n : 1), sizeof *bufs);
    int32_t *suffix = NULL, n_suffix = 0, *mem = NULL, n_mem = 0;
    int32_t seq = -1, next = -1;
    sampler *smp = NULL;
    is_status st = held && facts && bufs ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) st = memory_prompt_suffix(a->mp, r->query, &suffix, &n_suffix);
    sampler_params sp = {
        .temperature = r->temperature, .top_k = r->top_k, .top_p = r->top_p, .seed = r->seed};
    if (st == IS_OK) st = sampler_create(sp, m->cfg.n_vocab, &smp);
    if (st == IS_OK && r->mode == ASK_MODE_KV) st = fetch_facts(a, r, held, facts, bufs);
    if (st == IS_OK && r->mode == ASK_MODE_PROMPT) {
        /* The memory segment as tokens, laid out exactly as kv mode injects it. */
        for (int32_t i = 0; i < n && st == IS_OK; i++) {
            int32_t *ft, nf;
            st = memory_prompt_fact(a->mp, r->fact_texts[i], &ft, &nf);
            if (st != IS_OK) break;
            int32_t *grown = realloc(mem, (size_t)(n_mem + nf) * sizeof *mem);
            if (!grown) {
                free(ft);
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            mem = grown;
            memcpy(mem + n_mem, ft, (size_t)nf * sizeof *mem);
            n_mem += nf;
            free(ft);
        }
    }
    double t1 = now_ms();
    tm.fetch_ms = t1 - t0;
    if (st == IS_OK) st = engine_seq_open(a->e, &seq);
    if (st == IS_OK) st = engine_seq_fork(a->e, seq, a->prefix_seq, a->n_prefix);
    if (st == IS_OK && r->mode == ASK_MODE_KV) {
        /* Content ids let a backend keep records resident (the GPU arena). */
        uint64_t *ids = calloc((size_t)(n ? n : 1), sizeof *ids);
        if (!ids) st = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; ids && i < n; i++) ids[i] = held[i] ? held[i]->content_id : 0;
        if (st == IS_OK) st = engine_inject_ids(a->e, seq, facts, ids, n);
        /* The blend goes into the suffix's forward, unless that carries
         * the static recomputation's rewrites too. */
        if (st == IS_OK && r->blend > 0 && r->recompute > 0)
            st = engine_recompute_blend(a->e, seq, facts, n, r->blend, NULL, NULL);
        free(ids);
        for (int32_t i = 0; i < n; i++) tm.n_memory_tokens += facts[i].n_tokens;
    }
    double t2 = now_ms();
    tm.inject_ms = t2 - t1;
    /* kv with recompute: the first tokens of every fact go first in the
     * suffix's forward, rewritten in place (one pass over the weights). */
    int32_t n_rw = r->mode == ASK_MODE_KV && r->recompute > 0
                       ? recompute_first_count(facts, n, r->recompute)
                       : 0;
    int32_t *rw = NULL;
    if (st == IS_OK) {
        /* Prompt mode prefills memory and suffix in one pass, as a prompt would be. */
        int32_t total = n_mem + n_rw + n_suffix;
        int32_t *toks = malloc((size_t)total * sizeof *toks);
        rw = n_rw ? malloc((size_t)total * sizeof *rw) : NULL;
        if (!toks || (n_rw && !rw)) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            free(toks);
        } else {
            if (n_mem) memcpy(toks, mem, (size_t)n_mem * sizeof *toks);
            if (n_rw) {
                int32_t mb, me;
                engine_seq_memory(a->e, seq, &mb, &me);
                recompute_first_list(facts, n, r->recompute, mb, rw, toks);
                for (int32_t i = n_rw; i < total; i++) rw[i] = -1;
            }
            memcpy(toks + n_mem + n_rw, suffix, (size_t)n_suffix * sizeof *toks);
            engine_blend bl = {facts, n, r->blend, NULL, NULL};
            const bool fuse_blend = r->mode == ASK_MODE_KV && r->blend > 0 && !n_rw;
            st = feed_choose(a, seq, toks, total, rw, fuse_blend ? &bl : NULL, smp, &next);
            free(toks);
            if (r->mode == ASK_MODE_PROMPT) tm.n_memory_tokens = n_mem;
            tm.n_prefilled = total;
        }
    }
    free(rw);
    /* The records are no longer needed once their KV is in the cache. */
    for (int32_t i = 0; i < n; i++) {
        if (held[i]) record_store_release(a->store, held[i]);
        free(bufs[i]);
    }
    double t3 = now_ms();
    tm.prefill_ms = t3 - t2;
    if (st == IS_OK) {
        const tokenizer *tok = m->tok;
        for (int32_t i = 0; i < r->max_tokens; i++) {
            if (i == 0) tm.ttft_ms = now_ms() - t0;
            if (tokenizer_is_eog(tok, next)) break;
            tm.n_generated++;
            char piece[256];
            size_t pl = tokenizer_token_to_piece(tok, next, false, piece, sizeof piece);
            if (cb && !cb(piece, pl < sizeof piece ? pl : sizeof piece, ud)) break;
            if (i + 1 == r->max_tokens) break;
            if (kv_seq_length(engine_kv(a->e), seq) >= engine_n_ctx(a->e)) break;
            const int32_t fed = next;
            if ((st = feed_choose(a, seq, &fed, 1, NULL, NULL, smp, &next)) != IS_OK) break;
        }
        tm.decode_ms = now_ms() - t0 - tm.ttft_ms;
    }
    if (seq >= 0) engine_seq_close(a->e, seq);
    sampler_free(smp);
    free(held);
    free(facts);
    free(bufs);
    free(suffix);
    free(mem);
    if (t) *t = tm;
    return st;
}

/*
 * api_memory: the public memory API (include/inferscale.h, is_memory_*)
 * over the memory stack (serve/stack.h): the same set-up the CLI uses.
 */
#include "inferscale.h"

#include "core/status.h"
#include "serve/stack.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(IS_MEMORY_ID_SIZE == MEMORY_ID_SIZE, "the public id size is the store's");

struct is_memory {
    stack *st;
    char *tenant;
    pthread_mutex_t ask_mu; /* the ask context answers one request at a time */
};

is_memory_params is_memory_default_params(void) {
    return (is_memory_params){.tenant = "default", .backend = "cpu"};
}

is_status is_memory_open(const char *data_dir, is_memory_params params, is_memory **out) {
    if (!data_dir || !out) return is_error_set(IS_ERR_INVALID_ARG, "is_memory_open: NULL argument");
    const char *tenant = params.tenant ? params.tenant : "default";
    if (!*tenant) return is_error_set(IS_ERR_INVALID_ARG, "is_memory_open: empty tenant");
    if (params.window < -1 || params.window > MEMORY_MAX_CONTEXT)
        return is_error_set(IS_ERR_INVALID_ARG, "is_memory_open: window %d out of range (-1..%d)",
                            (int)params.window, MEMORY_MAX_CONTEXT);
    is_memory *m = calloc(1, sizeof *m);
    if (!m || !(m->tenant = strdup(tenant))) {
        free(m);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    stack_params sp = stack_default_params();
    sp.data_dir = data_dir;
    sp.embedder_dir = params.embedder_dir;
    sp.model_path = params.model_path;
    if (params.backend) sp.backend = params.backend;
    sp.n_threads = params.n_threads;
    sp.window = params.window;
    is_status st = stack_open(&sp, &m->st);
    if (st != IS_OK) {
        free(m->tenant);
        free(m);
        return st;
    }
    pthread_mutex_init(&m->ask_mu, NULL);
    *out = m;
    return IS_OK;
}

void is_memory_close(is_memory *m) {
    if (!m) return;
    stack_close(m->st);
    pthread_mutex_destroy(&m->ask_mu);
    free(m->tenant);
    free(m);
}

is_status is_memory_add(is_memory *m, const char *user, const char *text,
                        const char *const *context, size_t n_context,
                        char id_out[IS_MEMORY_ID_SIZE]) {
    if (!m || !user || !*user || !text)
        return is_error_set(IS_ERR_INVALID_ARG, "is_memory_add: needs a store, a user and a text");
    if (n_context > MEMORY_MAX_CONTEXT || (n_context && !context))
        return is_error_set(IS_ERR_INVALID_ARG, "is_memory_add: at most %d context turns",
                            MEMORY_MAX_CONTEXT);
    memory_add_req r = {.tenant = m->tenant,
                        .user = user,
                        .text = text,
                        .context = context,
                        .n_context = (int32_t)n_context,
                        .window = MEMORY_WINDOW_DEFAULT};
    return memory_add(m->st->mem, &r, id_out);
}

is_status is_memory_search(is_memory *m, const char *user, const char *query, int32_t k,
                           is_memory_hit **hits, int32_t *n_hits) {
    if (!m || !user || !*user || !query || k < 0 || !hits || !n_hits)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "is_memory_search: needs a store, a user, a query and k >= 0");
    mem_filter f = {.tenant = m->tenant, .user = user};
    memory_hit *mh = NULL;
    int32_t n = 0;
    is_status st = memory_search(m->st->mem, &f, query, k, &mh, &n);
    if (st != IS_OK) return st;
    is_memory_hit *out = calloc((size_t)(n ? n : 1), sizeof *out);
    if (!out) {
        memory_hits_free(mh, n);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    for (int32_t i = 0; i < n; i++) {
        memcpy(out[i].id, mh[i].fact.id, sizeof out[i].id);
        out[i].score = mh[i].score;
        if (!(out[i].text = strdup(mh[i].fact.text))) {
            memory_hits_free(mh, n);
            is_memory_hits_free(out, i);
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
    }
    memory_hits_free(mh, n);
    *hits = out;
    *n_hits = n;
    return IS_OK;
}

void is_memory_hits_free(is_memory_hit *hits, int32_t n) {
    for (int32_t i = 0; hits && i < n; i++) free(hits[i].text);
    free(hits);
}

/* The caller's callback, remembering whether it asked to stop. */
typedef struct ask_relay {
    is_text_cb cb;
    void *user_data;
    bool aborted;
} ask_relay;

static bool relay(const char *text, size_t len, void *ud) {
    ask_relay *r = ud;
    if (!r->cb || r->cb(text, len, r->user_data)) return true;
    r->aborted = true;
    return false;
}

is_status is_memory_ask(is_memory *m, const char *user, const char *query, int32_t k,
                        is_memory_mode mode, is_gen_params params, is_text_cb cb, void *user_data,
                        is_gen_stats *stats) {
    if (!m || !user || !*user || !query || !*query || k < 0)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "is_memory_ask: needs a store, a user, a query and k >= 0");
    if (mode != IS_MEMORY_KV && mode != IS_MEMORY_PROMPT && mode != IS_MEMORY_OFF)
        return is_error_set(IS_ERR_INVALID_ARG, "is_memory_ask: unknown mode %d", (int)mode);
    if (!m->st->ask)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "is_memory_ask: the store was opened without a model");
    if (params.n_stop)
        return is_error_set(IS_ERR_UNSUPPORTED, "is_memory_ask: stop strings are not applied here");
    memory_hit *mh = NULL;
    int32_t n = 0;
    is_status st = IS_OK;
    if (mode != IS_MEMORY_OFF && k > 0) {
        mem_filter f = {.tenant = m->tenant, .user = user};
        if ((st = memory_search(m->st->mem, &f, query, k, &mh, &n)) != IS_OK) return st;
    }
    const char **ids = calloc((size_t)n + 1, sizeof *ids),
               **texts = calloc((size_t)n + 1, sizeof *texts);
    if (!ids || !texts) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == IS_OK && i < n; i++) {
        if (mode == IS_MEMORY_KV && !mh[i].fact.kv_record)
            st = is_error_set(IS_ERR_NOT_FOUND, "is_memory_ask: fact %s has no KV yet",
                              mh[i].fact.id);
        ids[i] = mh[i].fact.kv_record;
        texts[i] = mh[i].fact.text;
    }
    ask_timing t = {0};
    ask_relay r = {cb, user_data, false};
    if (st == IS_OK) {
        ask_request req = {.mode = mode == IS_MEMORY_KV       ? ASK_MODE_KV
                                   : mode == IS_MEMORY_PROMPT ? ASK_MODE_PROMPT
                                                              : ASK_MODE_OFF,
                           .query = query,
                           .fact_ids = ids,
                           .fact_texts = texts,
                           .n_facts = n,
                           .max_tokens = params.max_tokens,
                           .temperature = params.temperature,
                           .top_k = params.top_k,
                           .top_p = params.top_p,
                           .seed = params.seed};
        pthread_mutex_lock(&m->ask_mu);
        st = ask_run(m->st->ask, &req, relay, &r, &t);
        pthread_mutex_unlock(&m->ask_mu);
    }
    if (st == IS_OK && stats)
        *stats = (is_gen_stats){.n_prompt = t.n_prefilled,
                                .n_generated = t.n_generated,
                                .prefill_ms = t.ttft_ms,
                                .decode_ms = t.decode_ms,
                                .finish = r.aborted                            ? IS_FINISH_ABORT
                                          : t.n_generated >= params.max_tokens ? IS_FINISH_LENGTH
                                                                               : IS_FINISH_EOG};
    free(ids);
    free(texts);
    memory_hits_free(mh, n);
    return st;
}

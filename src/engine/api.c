/*
 * api: the public C API of include/inferscale.h over the internal modules:
 * a model with its backend, and sessions that generate over one sequence of
 * an engine while keeping its KV between calls.
 */
#include "inferscale.h"

#include "core/status.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/textout.h"
#include "model/chat.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

struct is_model {
    backend *be;
    model *m;
};

struct is_session {
    is_model *model;
    engine *eng;
    int32_t seq;
    int32_t *tokens; /* [n_ctx] tokens whose KV the sequence holds */
    int32_t n_tokens;
    float *logits; /* [n_vocab] */
};

is_model_params is_model_default_params(void) {
    is_model_params p = {.backend = "cpu", .n_threads = 0};
    return p;
}

is_status is_model_load(const char *path, is_model_params params, is_model **out) {
    if (!path) return is_error_set(IS_ERR_INVALID_ARG, "no model path given");
    if (!backend_available(params.backend))
        return is_error_set(IS_ERR_UNSUPPORTED, "backend '%s' is not available in this build",
                            params.backend);
    is_model *im = calloc(1, sizeof *im);
    if (!im) return is_error_set(IS_ERR_NOMEM, "out of memory");
    is_status st = backend_create(params.backend, params.n_threads, &im->be);
    if (st == IS_OK) st = model_load(path, im->be, &im->m);
    if (st != IS_OK) {
        if (im->be) im->be->ops->free(im->be);
        free(im);
        return st;
    }
    *out = im;
    return IS_OK;
}

void is_model_free(is_model *m) {
    if (!m) return;
    model_free(m->m);
    m->be->ops->free(m->be);
    free(m);
}

const char *is_model_arch(const is_model *m) { return m->m->cfg.arch; }
const char *is_model_fingerprint(const is_model *m) { return m->m->fingerprint; }
int32_t is_model_n_vocab(const is_model *m) { return m->m->cfg.n_vocab; }
int32_t is_model_n_ctx_train(const is_model *m) { return m->m->cfg.n_ctx_train; }

is_status is_tokenize(const is_model *m, const char *text, size_t len, bool add_bos,
                      bool parse_special, int32_t **out, size_t *n_out) {
    return tokenizer_encode(m->m->tok, text, len, add_bos, parse_special, out, n_out);
}

size_t is_token_to_piece(const is_model *m, int32_t id, char *buf, size_t cap) {
    return tokenizer_token_to_piece(m->m->tok, id, false, buf, cap);
}

bool is_token_is_eog(const is_model *m, int32_t id) { return tokenizer_is_eog(m->m->tok, id); }

is_status is_chat_render(const is_model *m, const is_chat_message *msgs, size_t n,
                         bool add_assistant, char **out) {
    chat_template_kind kind = chat_template_detect(m->m->gguf);
    /* is_chat_message and chat_message have the same layout by design. */
    chat_message *cm = malloc((n ? n : 1) * sizeof *cm);
    if (!cm) return is_error_set(IS_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        cm[i].role = msgs[i].role;
        cm[i].content = msgs[i].content;
    }
    is_status st = chat_render(kind, m->m->gguf, cm, n, add_assistant, out);
    free(cm);
    return st;
}

is_session_params is_session_default_params(void) {
    is_session_params p = {.n_ctx = 0};
    return p;
}

is_status is_session_create(is_model *m, is_session_params params, is_session **out) {
    is_session *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    s->model = m;
    engine_params ep = engine_default_params();
    ep.n_ctx = params.n_ctx > 0 ? params.n_ctx : m->m->cfg.n_ctx_train;
    ep.max_seqs = 1;
    is_status st = engine_create(m->m, ep, &s->eng);
    if (st == IS_OK) st = engine_seq_open(s->eng, &s->seq);
    if (st == IS_OK) {
        s->tokens = malloc((size_t)engine_n_ctx(s->eng) * sizeof *s->tokens);
        s->logits = malloc((size_t)m->m->cfg.n_vocab * sizeof *s->logits);
        if (!s->tokens || !s->logits) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    if (st != IS_OK) {
        is_session_free(s);
        return st;
    }
    *out = s;
    return IS_OK;
}

void is_session_free(is_session *s) {
    if (!s) return;
    engine_free(s->eng);
    free(s->tokens);
    free(s->logits);
    free(s);
}

is_gen_params is_gen_default_params(void) {
    is_gen_params p = {
        .max_tokens = 256,
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .seed = 0,
        .stop = NULL,
        .n_stop = 0,
    };
    return p;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Appends tokens to the session's sequence and chooses the next token
 * with smp into *next: from the last token's logits (in s->logits), or for
 * a greedy sampler on the backend, with no logits brought back. On failure
 * the session forgets everything (its KV would not match its token list
 * otherwise). */
static is_status session_feed(is_session *s, const int32_t *toks, int32_t n, sampler *smp,
                              int32_t *next) {
    int32_t *seq = malloc((size_t)n * sizeof *seq);
    if (!seq) return is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < n; i++) seq[i] = s->seq;
    engine_batch b = {.n_tokens = n, .tokens = toks, .seq = seq};
    is_status st;
    if (sampler_is_greedy(smp)) {
        st = engine_decode_greedy(s->eng, &b, next);
    } else {
        st = engine_decode(s->eng, &b, s->logits);
        if (st == IS_OK) *next = sampler_sample(smp, s->logits);
    }
    free(seq);
    if (st != IS_OK) return st;
    memcpy(s->tokens + s->n_tokens, toks, (size_t)n * sizeof *toks);
    s->n_tokens += n;
    return IS_OK;
}

is_status is_session_generate(is_session *s, const int32_t *prompt, size_t n_prompt,
                              is_gen_params p, is_text_cb cb, void *ud, is_gen_stats *stats) {
    const model_config *c = &s->model->m->cfg;
    is_gen_stats st_out = {0};
    st_out.n_prompt = (int32_t)n_prompt;
    if (n_prompt == 0) return is_error_set(IS_ERR_INVALID_ARG, "empty prompt");
    int32_t n_ctx = engine_n_ctx(s->eng);
    if ((int64_t)n_prompt > n_ctx)
        return is_error_set(IS_ERR_CONTEXT_FULL,
                            "prompt of %zu tokens is longer than the context of %d", n_prompt,
                            n_ctx);
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= c->n_vocab)
            return is_error_set(IS_ERR_INVALID_ARG, "token id %d out of range", prompt[i]);
    sampler_params sp = {
        .temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .seed = p.seed};
    sampler *smp = NULL;
    is_status st = sampler_create(sp, c->n_vocab, &smp);
    if (st != IS_OK) return st;

    /* Reuse the longest common prefix, but always recompute at least the
     * last prompt token so its logits are fresh. */
    int32_t keep = 0;
    while (keep < s->n_tokens && (size_t)keep < n_prompt - 1 && s->tokens[keep] == prompt[keep])
        keep++;
    kv_seq_truncate(engine_kv(s->eng), s->seq, keep);
    s->n_tokens = keep;
    st_out.n_prompt_reused = keep;

    double t0 = now_ms();
    int32_t tok = -1;
    st = session_feed(s, prompt + keep, (int32_t)n_prompt - keep, smp, &tok);
    if (st != IS_OK) {
        kv_seq_truncate(engine_kv(s->eng), s->seq, 0);
        s->n_tokens = 0;
        sampler_free(smp);
        return st;
    }
    double t1 = now_ms();
    st_out.prefill_ms = t1 - t0;

    textout o;
    textout_init(&o, p.stop, p.n_stop);
    st_out.finish = IS_FINISH_LENGTH;
    for (int32_t i = 0; i < p.max_tokens; i++) {
        if (tokenizer_is_eog(s->model->m->tok, tok)) {
            st_out.finish = IS_FINISH_EOG;
            break;
        }
        st_out.n_generated++;
        char piece[256];
        size_t pl = tokenizer_token_to_piece(s->model->m->tok, tok, false, piece, sizeof piece);
        if (pl > sizeof piece) pl = sizeof piece;
        bool stopped;
        if ((st = textout_push(&o, piece, pl, &stopped)) != IS_OK) break;
        size_t n;
        const char *ready = textout_take(&o, &n);
        /* A completed stop string ends generation before it is emitted. */
        if (stopped) {
            if (cb && n) cb(ready, n, ud);
            st_out.finish = IS_FINISH_STOP;
            break;
        }
        if (cb && n && !cb(ready, n, ud)) {
            st_out.finish = IS_FINISH_ABORT;
            break;
        }
        if (i + 1 == p.max_tokens) break;
        if (s->n_tokens >= n_ctx) break; /* context full: stop as if by length */
        const int32_t fed = tok;
        if ((st = session_feed(s, &fed, 1, smp, &tok)) != IS_OK) break;
    }
    if (st == IS_OK && st_out.finish != IS_FINISH_STOP && st_out.finish != IS_FINISH_ABORT && cb) {
        size_t n;
        const char *rest = textout_flush(&o, &n);
        if (n) cb(rest, n, ud);
    }
    st_out.decode_ms = now_ms() - t1;
    textout_free(&o);
    sampler_free(smp);
    if (stats) *stats = st_out;
    return st;
}

/*
 * teacher: see teacher.h.
 */
#include "eval/teacher.h"

#include "core/status.h"
#include "engine/recompute.h"
#include "eval/nll_stats.h"
#include "kv/record_store.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

is_status teacher_score_tokens(engine *e, int32_t seq, const int32_t *context, int32_t n_context,
                               const int32_t *answer, int32_t n_answer, double *nll_mean,
                               float *first_logits) {
    if (!e || !context || !answer || n_context < 1 || n_answer < 1 || !nll_mean)
        return is_error_set(IS_ERR_INVALID_ARG, "teacher: empty context or answer");
    const int32_t nv = engine_model(e)->cfg.n_vocab;
    const int32_t n = n_context + n_answer - 1;
    int32_t *toks = malloc((size_t)n * sizeof *toks), *seqs = malloc((size_t)n * sizeof *seqs);
    bool *want = calloc((size_t)n, sizeof *want);
    float *logits = malloc((size_t)n_answer * nv * sizeof *logits);
    is_status st =
        toks && seqs && want && logits ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) {
        memcpy(toks, context, (size_t)n_context * sizeof *toks);
        memcpy(toks + n_context, answer, (size_t)(n_answer - 1) * sizeof *toks);
        for (int32_t i = 0; i < n; i++) seqs[i] = seq;
        /* Position n_context-1 predicts answer[0]; every answer token but the
         * last predicts the next one. */
        for (int32_t i = n_context - 1; i < n; i++) want[i] = true;
        engine_batch b = {.n_tokens = n, .tokens = toks, .seq = seqs, .want_logits = want};
        st = engine_decode(e, &b, logits);
    }
    if (st == IS_OK) {
        double sum = 0;
        for (int32_t j = 0; j < n_answer; j++) {
            float *row = logits + (size_t)j * nv;
            if (j == 0 && first_logits) memcpy(first_logits, row, (size_t)nv * sizeof *row);
            double lse = nll_log_softmax(row, nv, row);
            (void)lse;
            sum -= row[answer[j]];
        }
        *nll_mean = sum / n_answer;
    }
    free(toks);
    free(seqs);
    free(want);
    free(logits);
    return st;
}

/* Appends the tokens of a fact line to *mem. */
static is_status append_fact(const memory_prompt *mp, const char *text, int32_t **mem,
                             int32_t *n_mem) {
    int32_t *ft, nf;
    is_status st = memory_prompt_fact(mp, text, &ft, &nf);
    if (st != IS_OK) return st;
    int32_t *grown = realloc(*mem, (size_t)(*n_mem + nf) * sizeof **mem);
    if (!grown) {
        free(ft);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    *mem = grown;
    memcpy(*mem + *n_mem, ft, (size_t)nf * sizeof **mem);
    *n_mem += nf;
    free(ft);
    return IS_OK;
}

/* The first m tokens of every injected fact recomputed (engine_recompute),
 * the facts laid out from the memory segment's start. The scores equal
 * those of the fused forward that ask_run uses (test_recompute). */
static is_status recompute_first(engine *e, int32_t seq, const engine_fact *facts, int32_t n,
                                 int32_t m) {
    int32_t mb = 0, me = 0, off = 0, total = recompute_first_count(facts, n, m);
    engine_seq_memory(e, seq, &mb, &me);
    for (int32_t i = 0; i < n; i++) off += facts[i].n_tokens;
    if (total == 0) return IS_OK;
    if (off != me - mb)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "teacher: memory segment [%d, %d) is not the "
                            "facts' %d tokens",
                            mb, me, off);
    int32_t *pos = malloc((size_t)total * sizeof *pos),
            *toks = malloc((size_t)total * sizeof *toks);
    is_status st = pos && toks ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) {
        recompute_first_list(facts, n, m, mb, pos, toks);
        st = engine_recompute(e, seq, pos, toks, total);
    }
    free(pos);
    free(toks);
    return st;
}

is_status teacher_score_request_m(engine *e, record_store *store, ask_ctx *a, const ask_request *r,
                                  int32_t recompute_m, const int32_t *answer, int32_t n_answer,
                                  double *nll_mean, float *first_logits) {
    ask_request rm = *r;
    rm.recompute = recompute_m;
    return teacher_score_request(e, store, a, &rm, answer, n_answer, nll_mean, first_logits);
}

is_status teacher_score_request(engine *e, record_store *store, ask_ctx *a, const ask_request *r,
                                const int32_t *answer, int32_t n_answer, double *nll_mean,
                                float *first_logits) {
    const int32_t recompute_m = r->recompute;
    const memory_prompt *mp = ask_ctx_prompt(a);
    int32_t n = r->mode == ASK_MODE_OFF ? 0 : r->n_facts;
    int32_t *suffix = NULL, n_suffix = 0, *ctx = NULL, n_ctx = 0, seq = -1;
    const fact_kv **held = calloc((size_t)(n ? n : 1), sizeof *held);
    engine_fact *facts = calloc((size_t)(n ? n : 1), sizeof *facts);
    float **bufs = calloc((size_t)(n ? n : 1), sizeof *bufs);
    uint64_t *ids = calloc((size_t)(n ? n : 1), sizeof *ids);
    is_status st =
        held && facts && bufs && ids ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK) st = memory_prompt_suffix(mp, r->query, &suffix, &n_suffix);
    if (st == IS_OK && r->mode == ASK_MODE_PROMPT)
        for (int32_t i = 0; i < n && st == IS_OK; i++)
            st = append_fact(mp, r->fact_texts[i], &ctx, &n_ctx);
    /* All records are fetched, then injected together, as ask_run does (a
     * record the backend holds resident comes back without values and must
     * be injected before any other injection). */
    if (st == IS_OK && r->mode == ASK_MODE_KV) {
        for (int32_t i = 0; i < n && st == IS_OK; i++) {
            /* The blend reads the values even where the backend holds them. */
            st = r->blend > 0 ? ask_load_record(a, r->fact_ids[i], &held[i], &facts[i], &bufs[i])
                              : ask_fetch_record(a, r->fact_ids[i], &held[i], &facts[i], &bufs[i]);
            if (st == IS_OK) ids[i] = held[i] ? held[i]->content_id : 0;
        }
    }
    if (st == IS_OK) {
        int32_t *grown = realloc(ctx, (size_t)(n_ctx + n_suffix) * sizeof *ctx);
        if (!grown) st = is_error_set(IS_ERR_NOMEM, "out of memory");
        else {
            ctx = grown;
            memcpy(ctx + n_ctx, suffix, (size_t)n_suffix * sizeof *ctx);
            n_ctx += n_suffix;
        }
    }
    int32_t n_prefix = 0;
    int32_t prefix_seq = ask_ctx_prefix_seq(a, &n_prefix);
    if (st == IS_OK) st = engine_seq_open(e, &seq);
    if (st == IS_OK) st = engine_seq_fork(e, seq, prefix_seq, n_prefix);
    if (st == IS_OK && r->mode == ASK_MODE_KV) st = engine_inject_ids(e, seq, facts, ids, n);
    /* Before the records go: their tokens are the facts'. */
    if (st == IS_OK && r->mode == ASK_MODE_KV && r->blend > 0)
        st = engine_recompute_blend(e, seq, facts, n, r->blend, NULL, NULL);
    if (st == IS_OK && r->mode == ASK_MODE_KV && recompute_m > 0)
        st = recompute_first(e, seq, facts, n, recompute_m);
    for (int32_t i = 0; i < n; i++) {
        if (held[i]) record_store_release(store, held[i]);
        free(bufs[i]);
    }
    if (st == IS_OK)
        st = teacher_score_tokens(e, seq, ctx, n_ctx, answer, n_answer, nll_mean, first_logits);
    if (seq >= 0) engine_seq_close(e, seq);
    free(held);
    free(facts);
    free(bufs);
    free(ids);
    free(suffix);
    free(ctx);
    return st;
}

is_status teacher_answer_tokens(const model *m, const char *answer, int32_t **toks, int32_t *n) {
    if (!answer || !*answer) return is_error_set(IS_ERR_INVALID_ARG, "teacher: empty gold answer");
    size_t nt = 0;
    int32_t *t = NULL;
    is_status st = tokenizer_encode(m->tok, answer, strlen(answer), false, false, &t, &nt);
    if (st != IS_OK) return st;
    if (nt == 0) {
        free(t);
        return is_error_set(IS_ERR_INVALID_ARG, "teacher: gold answer has no tokens");
    }
    *toks = t;
    *n = (int32_t)nt;
    return IS_OK;
}

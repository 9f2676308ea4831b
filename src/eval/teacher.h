/*
 * teacher: teacher-forced scoring of a gold answer, the likelihood side of
 * the accuracy instrument (eval/nll_stats.h has the arithmetic).
 *
 * One pass per (question, mode): the request is laid out exactly as ask_run
 * lays it out (serve/ask.h: the cached serving prefix forked, then the
 * memory segment injected (kv) or prefilled (prompt) or left out (off),
 * then the suffix with the query and the assistant header), the gold
 * answer's tokens are appended, and the logits at every answer position
 * give the answer's mean negative log-likelihood. Nothing is sampled, so
 * two modes are compared on the same tokens.
 */
#ifndef IS_EVAL_TEACHER_H
#define IS_EVAL_TEACHER_H

#include "engine/engine.h"
#include "serve/ask.h"

/* Scores `answer` after `context` on the open sequence `seq` (which may
 * already hold a prefix): feeds context and answer[0..n_answer-2] and reads
 * the logits that predict each answer token. *nll_mean: the mean over the
 * answer's tokens of -log p(token). first_logits (or NULL) receives the raw
 * logits [n_vocab] that predict answer[0]. n_context >= 1, n_answer >= 1
 * (IS_ERR_INVALID_ARG otherwise); engine errors as engine_decode. */
is_status teacher_score_tokens(engine *e, int32_t seq, const int32_t *context, int32_t n_context,
                               const int32_t *answer, int32_t n_answer, double *nll_mean,
                               float *first_logits);

/* One request's gold answer under one mode (r->query, r->fact_ids for kv,
 * r->fact_texts for prompt, r->n_facts, and in kv mode r->blend then
 * r->recompute, the recovery ask_run applies; sampling fields unused): opens a
 * sequence of its own on `e`, the engine that `a` borrows (its records come
 * from `store`, a's record store), scores, closes it. Errors as ask_run and
 * teacher_score_tokens. */
is_status teacher_score_request(engine *e, record_store *store, ask_ctx *a, const ask_request *r,
                                const int32_t *answer, int32_t n_answer, double *nll_mean,
                                float *first_logits);

/* teacher_score_request with r->recompute = recompute_m: after the
 * injection, the first recompute_m tokens of every fact are computed again
 * with the prefix and the facts before them visible (engine_recompute). */
is_status teacher_score_request_m(engine *e, record_store *store, ask_ctx *a, const ask_request *r,
                                  int32_t recompute_m, const int32_t *answer, int32_t n_answer,
                                  double *nll_mean, float *first_logits);

/* The gold answer as the model would write it right after the assistant
 * header: its text tokenised alone (no BOS, control tokens not parsed).
 * *toks malloc'd. IS_ERR_INVALID_ARG for an empty answer. */
is_status teacher_answer_tokens(const model *m, const char *answer, int32_t **toks, int32_t *n);

#endif

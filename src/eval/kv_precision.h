/*
 * kv_precision: what storing fact KV in a narrower dtype costs in accuracy,
 * measured where it matters, on the next-token distribution.
 *
 * For LoCoMo questions, k facts of the conversation are encoded once in f32
 * (ask_encode_fact), and the same f32 capture is narrowed to every other
 * record dtype (f16, bf16, fp8) exactly as ask_encode_fact would narrow it,
 * into one record store per dtype. Each question's gold answer is then
 * teacher-forced (eval/teacher.h) in kv mode with each dtype's records,
 * and the logits that predict the answer's first token, and the answer's
 * mean NLL, are compared with those of the f32 records: max |delta logit|
 * (also relative to the f32 logits' range), the relative L2 error,
 * KL(p_f32 || p_dtype), top-1
 * agreement, |delta NLL|. Same engine, same tokens, same layout: the only
 * difference is the records' dtype.
 *
 * Which facts: question i (the i-th with a gold answer) takes k consecutive
 * observations starting at (fact_stride * i) mod (n_facts - k + 1), so with
 * a stride the questions see different facts (0: all see the first k, one
 * encoding for all); retrieval is not what is measured here.
 */
#ifndef IS_EVAL_KV_PRECISION_H
#define IS_EVAL_KV_PRECISION_H

#include "engine/engine.h"
#include "kv/fact_record.h"
#include "memory/locomo.h"

typedef struct kv_precision_params {
    int32_t k;           /* facts per question, >= 1 */
    int32_t n_questions; /* questions scored, >= 1 (fewer if the conversation has fewer) */
    int32_t window;      /* context turns encoded with each fact (ask_encode_fact's w) */
    int32_t fact_stride; /* where question i's facts start (above), >= 0 */
} kv_precision_params;

/* One record dtype against f32 records, over the questions scored. */
typedef struct kv_precision_row {
    kv_dtype dtype;
    int32_t n;              /* questions scored */
    double max_abs_dlogit;  /* max over questions and vocabulary of |logit - logit_f32| */
    double max_rel_dlogit;  /* the same, each question's divided by its f32 logits' range */
    double max_rel_l2;      /* max over questions of |logits - logits_f32|_2 / |logits_f32|_2
                              * (the measure of the project's bf16 tolerance, 1e-2) */
    double mean_kl, max_kl; /* KL(p_f32 || p) of the first answer token, nats */
    double mean_abs_dnll;   /* mean |NLL - NLL_f32| of the whole gold answer, nats/token */
    int32_t top1_agree;     /* questions whose most likely first token is f32's */
    size_t kv_bytes;        /* k and v sections of the k facts of the last question */
} kv_precision_row;

/* Runs the comparison on `e` (an engine with at least KV_DTYPE_COUNT + 2
 * sequences free) over `conv`, keeping one record store per dtype under
 * tmp_dir (an existing, writable directory the caller removes afterwards).
 * rows[d] for every dtype d < KV_DTYPE_COUNT (rows[KV_DTYPE_F32] compares
 * f32 with itself: zeros, a check of determinism). IS_ERR_INVALID_ARG for
 * bad parameters or a conversation with fewer than k facts or no question
 * with an answer; errors of the engine, the record stores and teacher. */
is_status kv_precision_run(engine *e, const locomo_conv *conv, const kv_precision_params *p,
                           const char *tmp_dir, kv_precision_row rows[KV_DTYPE_COUNT]);

#endif

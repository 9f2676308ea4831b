/*
 * locomo_eval: LoCoMo's answer scoring, in C, so that `inferscale eval
 * locomo` reports numbers comparable with the papers that use LoCoMo.
 *
 * It mirrors task_eval/evaluation.py of the LoCoMo release (Maharana et
 * al., ACL 2024), function by function:
 *
 *   normalize_answer   delete ',', lowercase (Python's str.lower), delete
 *                      ASCII punctuation (string.punctuation), replace the
 *                      words a / an / the / and (regex \b...\b, Unicode word
 *                      characters) by a space, collapse whitespace (Python's
 *                      str.split: Unicode whitespace)
 *   exact_match_score  the SETS of normalised words are equal (so word order
 *                      and repetition do not matter; no stemming)
 *   f1_score           token F1 of the normalised words, each Porter-stemmed
 *                      (NLTK's PorterStemmer, its default NLTK_EXTENSIONS
 *                      mode); 0 when nothing is shared
 *   f1                 (multi-hop) prediction and gold split at ',', each
 *                      part stripped: the mean over gold parts of the best
 *                      f1_score against any predicted part
 *   per question       category 1: f1; 2, 3, 4: f1_score, with a category-3
 *                      gold answer cut at its first ';'; 5 (adversarial): 1
 *                      if the lowercased prediction contains "no information
 *                      available" or "not mentioned", else 0
 *   recall             the fraction of the question's evidence dia_ids found
 *                      among the retrieved ones; 1 for a question without
 *                      evidence (as LoCoMo counts it)
 *
 * Text is UTF-8; invalid bytes read as U+FFFD each. Equality with the
 * reference is tested on golden values produced by LoCoMo's own functions
 * (tools/make_locomo_eval_golden.py -> tests/golden/locomo_eval.json).
 * Known differences, none reachable from English answers: Unicode tables
 * are utf8proc's (15.0) where Python/regex have theirs; Python's
 * context-dependent lowercasing of a final capital sigma is approximated
 * (letter before, no letter after).
 */
#ifndef IS_EVAL_LOCOMO_EVAL_H
#define IS_EVAL_LOCOMO_EVAL_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

/* LoCoMo's normalize_answer. *out is a malloc'd NUL-terminated string.
 * IS_ERR_INVALID_ARG (NULL), IS_ERR_NOMEM; *out unchanged on failure. */
is_status locomo_eval_normalize(const char *text, char **out);

/* NLTK PorterStemmer().stem(word) (NLTK_EXTENSIONS; lowercases first).
 * `word` is one token without whitespace. *out malloc'd. IS_ERR_INVALID_ARG,
 * IS_ERR_NOMEM; *out unchanged on failure. */
is_status locomo_eval_stem(const char *word, char **out);

/* exact_match_score: the normalised word sets are equal. */
is_status locomo_eval_exact_match(const char *prediction, const char *gold, bool *out);

/* f1_score: stemmed token F1 in [0, 1]. */
is_status locomo_eval_f1(const char *prediction, const char *gold, double *out);

/* f1: the comma-split multi-answer F1 of category 1. */
is_status locomo_eval_f1_multi(const char *prediction, const char *gold, double *out);

/* The per-question score of LoCoMo's eval_question_answering for a
 * category in 1..5 (IS_ERR_INVALID_ARG otherwise). */
is_status locomo_eval_score(const char *prediction, const char *gold, int32_t category,
                            double *out);

/* Exact match as reported for a question: exact_match_score against the
 * gold answer as the score uses it (category 3 cut at ';'); category 5
 * gives the adversarial rule's 0 or 1. */
is_status locomo_eval_exact(const char *prediction, const char *gold, int32_t category, bool *out);

/* Recall of evidence turns: |evidence found in retrieved| / n_evidence, or
 * 1 when n_evidence == 0. Duplicates in `evidence` count each time, as in
 * LoCoMo. NULL arrays are allowed with a count of 0. */
double locomo_eval_recall(const char *const *evidence, int32_t n_evidence,
                          const char *const *retrieved, int32_t n_retrieved);

/* ---- aggregation ------------------------------------------------------- */

/* Sums for one group of questions (a category, under one mode). Fields
 * that do not apply to a question are left out of their mean (agreement
 * only exists for modes compared with prompt mode). */
typedef struct locomo_eval_acc {
    int64_t n;
    double f1, em, recall, ttft_ms;
    int64_t n_agree; /* questions with an agreement value */
    double agree, f1_vs_prompt;
} locomo_eval_acc;

/* One question's result under one mode. agree < 0: not compared. */
typedef struct locomo_eval_result {
    double f1, em, recall, ttft_ms;
    double agree, f1_vs_prompt;
} locomo_eval_result;

void locomo_eval_acc_add(locomo_eval_acc *acc, const locomo_eval_result *r);

/* Means of the accumulated values (0 for an empty group; agreement means
 * are negative when nothing was compared). */
locomo_eval_result locomo_eval_acc_mean(const locomo_eval_acc *acc);

#endif

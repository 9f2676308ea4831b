/*
 * nll_stats: the arithmetic of the low-noise accuracy instrument of
 * `inferscale eval locomo --nll`: log-softmax, KL divergence and top-1 of a
 * next-token distribution, the probability that the next token starts a
 * list item, and paired bootstrap confidence intervals.
 *
 * Why these: token F1 of a small model's answer is near 0 for most
 * questions in every mode, so a real change in how well the model uses its
 * memory hides in the noise. The gold answer's likelihood under teacher
 * forcing moves continuously with it; comparing modes question by question
 * (paired) removes the spread between questions from the comparison.
 *
 * The list-item statistic: a model whose memory was written as "- fact\n"
 * lines may answer by continuing the list ("- ..."). Its probability mass
 * on list-item openers at the first answer position measures that failure
 * without sampling. A vocabulary entry opens a list item when its text,
 * after leading spaces, tabs and newlines, begins with '-', '*', '+' or
 * U+2022 (bullet), or is one or more ASCII digits followed by '.' or ')'
 * ("1.", "2)"). Bare digits do not count: they start answers such as years
 * and counts.
 */
#ifndef IS_EVAL_NLL_STATS_H
#define IS_EVAL_NLL_STATS_H

#include "model/tokenizer.h"

#include <stdbool.h>
#include <stdint.h>

/* out[i] = logits[i] - logsumexp(logits), in double inside (out may equal
 * logits). Returns logsumexp. n >= 1. */
double nll_log_softmax(const float *logits, int32_t n, float *out);

/* KL(p || q) = sum_i p_i (log p_i - log q_i), from log-probabilities
 * (nats). Terms with p_i == 0 add nothing. */
double nll_kl(const float *logp, const float *logq, int32_t n);

/* Index of the largest value (the lowest index among ties). */
int32_t nll_argmax(const float *x, int32_t n);

/* Whether the raw piece of a token opens a list item (rule above). */
bool nll_piece_is_list_item(const char *piece, size_t len);

/* mask[n_vocab]: which tokens of `t` open a list item (by their decoded
 * piece, control tokens excluded). Returns how many do. */
int32_t nll_list_mask(const tokenizer *t, bool *mask);

/* Probability mass of the masked tokens: sum of exp(logp[i]) where mask[i]. */
double nll_mass(const float *logp, const bool *mask, int32_t n);

/* Paired bootstrap of a ratio of sums: the statistic is
 * sum(a[i]) / sum(b[i]) over the questions i of a resample (b == NULL: the
 * mean of a). n_boot resamples of n questions drawn with replacement by a
 * generator seeded with `seed` (the same seed gives the same interval), and
 * the percentile interval [lo, hi] at level 1 - alpha (alpha = 0.05: 95%).
 * *point is the statistic on the data itself. Resamples whose denominator
 * is 0 are skipped. Returns false (outputs NaN) when n == 0, n_boot < 10 or
 * no resample had a nonzero denominator. */
bool nll_bootstrap(const double *a, const double *b, int32_t n, int32_t n_boot, uint64_t seed,
                   double alpha, double *point, double *lo, double *hi);

#endif

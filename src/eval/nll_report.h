/*
 * nll_report: the per-category summary of the teacher-forced instrument,
 * with paired bootstrap confidence intervals (eval/nll_stats.h).
 *
 * A report has slots, one per mode: slot 0 is prompt mode (the reference
 * every other slot is compared with), slot 1 is no memory (off), slots 2..
 * are kv modes. Each question adds one row with a value per slot; the
 * recovered share of a kv slot is
 *
 *     sum_i (nll_off_i - nll_kv_i) / sum_i (nll_off_i - nll_prompt_i)
 *
 * over the questions of a group (a ratio of sums, so that questions where
 * the text helps little do not blow the ratio up), and its interval comes
 * from resampling questions, the same resample for numerator and
 * denominator (paired).
 */
#ifndef IS_EVAL_NLL_REPORT_H
#define IS_EVAL_NLL_REPORT_H

#include "inferscale.h"

#include <stdint.h>
#include <stdio.h>

#define NLL_REPORT_MAX_SLOTS 16

typedef struct nll_row {
    int32_t category;                   /* 1..4 (others are not reported) */
    double nll[NLL_REPORT_MAX_SLOTS];   /* gold answer's mean token NLL (nats) */
    double plist[NLL_REPORT_MAX_SLOTS]; /* P(first answer token opens a list item) */
    double kl[NLL_REPORT_MAX_SLOTS]; /* KL(prompt || slot) of the first answer token (slot 0: 0) */
    double agree[NLL_REPORT_MAX_SLOTS]; /* 1 when its top-1 first token is prompt's (slot 0: 1) */
    double f1[NLL_REPORT_MAX_SLOTS]; /* LoCoMo F1 of the generated answer, < 0 if not generated */
    double em[NLL_REPORT_MAX_SLOTS]; /* exact match, < 0 if not generated */
} nll_row;

typedef struct nll_report nll_report;

/* names[n_slots]: slot labels (copied); n_slots in 2..NLL_REPORT_MAX_SLOTS.
 * IS_ERR_INVALID_ARG, IS_ERR_NOMEM. */
is_status nll_report_create(const char *const *names, int32_t n_slots, nll_report **out);
void nll_report_free(nll_report *r);

/* Adds a row (copied). IS_ERR_NOMEM leaves the report as it was. */
is_status nll_report_add(nll_report *r, const nll_row *row);

int32_t nll_report_n_rows(const nll_report *r);

/* Prints the markdown tables: by category (1-4 and all together) and slot,
 * the mean NLL, the recovered share, KL and top-1 agreement with prompt
 * mode, P(list item), F1 and EM, each mean with its 95% paired bootstrap
 * interval from n_boot resamples drawn with `seed`. */
void nll_report_print(const nll_report *r, FILE *f, int32_t n_boot, uint64_t seed);

#endif

/*
 * nll_report: see nll_report.h.
 */
#include "eval/nll_report.h"

#include "core/status.h"
#include "eval/nll_stats.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct nll_report {
    char names[NLL_REPORT_MAX_SLOTS][32];
    int32_t n_slots;
    nll_row *rows;
    int32_t n, cap;
};

is_status nll_report_create(const char *const *names, int32_t n_slots, nll_report **out) {
    if (!names || n_slots < 2 || n_slots > NLL_REPORT_MAX_SLOTS)
        return is_error_set(IS_ERR_INVALID_ARG, "nll report: %d slots (2..%d)", n_slots,
                            NLL_REPORT_MAX_SLOTS);
    nll_report *r = calloc(1, sizeof *r);
    if (!r) return is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < n_slots; i++) snprintf(r->names[i], sizeof r->names[i], "%s", names[i]);
    r->n_slots = n_slots;
    *out = r;
    return IS_OK;
}

void nll_report_free(nll_report *r) {
    if (!r) return;
    free(r->rows);
    free(r);
}

is_status nll_report_add(nll_report *r, const nll_row *row) {
    if (r->n == r->cap) {
        int32_t cap = r->cap ? 2 * r->cap : 256;
        nll_row *g = realloc(r->rows, (size_t)cap * sizeof *g);
        if (!g) return is_error_set(IS_ERR_NOMEM, "out of memory");
        r->rows = g;
        r->cap = cap;
    }
    r->rows[r->n++] = *row;
    return IS_OK;
}

int32_t nll_report_n_rows(const nll_report *r) { return r->n; }

/* "0.123 [0.100, 0.150]" or "-" */
static void fmt_ci(char *buf, size_t cap, const double *a, const double *b, int32_t n,
                   int32_t n_boot, uint64_t seed, double scale, int prec) {
    double p, lo, hi;
    if (n == 0 || !nll_bootstrap(a, b, n, n_boot, seed, 0.05, &p, &lo, &hi) || isnan(p)) {
        snprintf(buf, cap, "-");
        return;
    }
    snprintf(buf, cap, "%.*f [%.*f, %.*f]", prec, p * scale, prec, lo * scale, prec, hi * scale);
}

void nll_report_print(const nll_report *r, FILE *f, int32_t n_boot, uint64_t seed) {
    static const char *const cat_names[] = {"1-4 all", "1 multi-hop", "2 temporal", "3 open-domain",
                                            "4 single-hop"};
    double *a = malloc((size_t)(r->n ? r->n : 1) * sizeof *a);
    double *b = malloc((size_t)(r->n ? r->n : 1) * sizeof *b);
    if (!a || !b) {
        free(a);
        free(b);
        fprintf(f, "(out of memory)\n");
        return;
    }
    fprintf(f, "| category | mode | n | gold NLL | recovered share %% | KL(prompt‖mode) | top-1 = "
               "prompt %% "
               "| P(list item) %% | F1 | EM |\n");
    fprintf(f, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int cat = 1; cat <= 5; cat++) {
        int want = cat == 5 ? 0 : cat;
        for (int32_t s = 0; s < r->n_slots; s++) {
            int32_t n = 0, nf = 0;
            char c_nll[64], c_rec[64] = "-", c_kl[64] = "-", c_ag[64] = "-", c_pl[64],
                            c_f1[64] = "-", c_em[64] = "-";
#define COLLECT(expr)                                                                              \
    do {                                                                                           \
        n = 0;                                                                                     \
        for (int32_t i = 0; i < r->n; i++) {                                                       \
            const nll_row *w = &r->rows[i];                                                        \
            if (want && w->category != want) continue;                                             \
            expr;                                                                                  \
            n++;                                                                                   \
        }                                                                                          \
    } while (0)
            uint64_t sd = seed + (uint64_t)cat * 131 + (uint64_t)s;
            COLLECT(a[n] = w->nll[s]);
            fmt_ci(c_nll, sizeof c_nll, a, NULL, n, n_boot, sd, 1, 3);
            COLLECT(a[n] = w->plist[s]);
            fmt_ci(c_pl, sizeof c_pl, a, NULL, n, n_boot, sd, 100, 1);
            if (s >= 1) {
                COLLECT(a[n] = w->kl[s]);
                fmt_ci(c_kl, sizeof c_kl, a, NULL, n, n_boot, sd, 1, 3);
                COLLECT(a[n] = w->agree[s]);
                fmt_ci(c_ag, sizeof c_ag, a, NULL, n, n_boot, sd, 100, 1);
            }
            if (s >= 2) {
                COLLECT((a[n] = w->nll[1] - w->nll[s], b[n] = w->nll[1] - w->nll[0]));
                fmt_ci(c_rec, sizeof c_rec, a, b, n, n_boot, sd, 100, 1);
            }
            /* F1 and EM over the questions that were answered in this mode. */
            nf = 0;
            for (int32_t i = 0; i < r->n; i++) {
                const nll_row *w = &r->rows[i];
                if ((want && w->category != want) || w->f1[s] < 0) continue;
                a[nf] = w->f1[s];
                b[nf++] = w->em[s];
            }
            if (nf > 0) {
                fmt_ci(c_f1, sizeof c_f1, a, NULL, nf, n_boot, sd, 1, 3);
                fmt_ci(c_em, sizeof c_em, b, NULL, nf, n_boot, sd, 1, 3);
            }
#undef COLLECT
            if (n == 0) continue;
            fprintf(f, "| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s |\n", cat_names[want],
                    r->names[s], n, c_nll, c_rec, c_kl, c_ag, c_pl, c_f1, c_em);
        }
    }
    fprintf(
        f,
        "\nTeacher-forced on the gold answer: mean token NLL (nats); recovered share = "
        "sum(NLL_off - NLL_mode) / sum(NLL_off - NLL_prompt); KL and top-1 of the first answer "
        "token's distribution against prompt mode's; P(list item): its probability of opening a "
        "list item ('-', '*', '+', bullet, '1.'). Brackets: 95%% paired bootstrap intervals "
        "(%d resamples of questions, fixed seed).\n",
        n_boot);
    free(a);
    free(b);
}

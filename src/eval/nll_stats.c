/*
 * nll_stats: see nll_stats.h.
 */
#include "eval/nll_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double nll_log_softmax(const float *logits, int32_t n, float *out) {
    double mx = logits[0];
    for (int32_t i = 1; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    double s = 0;
    for (int32_t i = 0; i < n; i++) s += exp((double)logits[i] - mx);
    double lse = mx + log(s);
    for (int32_t i = 0; i < n; i++) out[i] = (float)((double)logits[i] - lse);
    return lse;
}

double nll_kl(const float *logp, const float *logq, int32_t n) {
    double kl = 0;
    for (int32_t i = 0; i < n; i++) {
        double p = exp((double)logp[i]);
        if (p > 0) kl += p * ((double)logp[i] - (double)logq[i]);
    }
    return kl;
}

int32_t nll_argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

bool nll_piece_is_list_item(const char *s, size_t len) {
    size_t i = 0;
    while (i < len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    if (i == len) return false;
    if (s[i] == '-' || s[i] == '*' || s[i] == '+') return true;
    /* U+2022 BULLET in UTF-8 */
    if (len - i >= 3 && (unsigned char)s[i] == 0xE2 && (unsigned char)s[i + 1] == 0x80 &&
        (unsigned char)s[i + 2] == 0xA2)
        return true;
    size_t d = i;
    while (d < len && s[d] >= '0' && s[d] <= '9') d++;
    return d > i && d < len && (s[d] == '.' || s[d] == ')');
}

int32_t nll_list_mask(const tokenizer *t, bool *mask) {
    int32_t n = tokenizer_n_vocab(t), count = 0;
    char buf[256];
    for (int32_t id = 0; id < n; id++) {
        tokenizer_token_type ty = tokenizer_token_get_type(t, id);
        size_t l = ty == TOKENIZER_TOKEN_CONTROL
                       ? 0
                       : tokenizer_token_to_piece(t, id, false, buf, sizeof buf);
        if (l > sizeof buf) l = sizeof buf;
        mask[id] = nll_piece_is_list_item(buf, l);
        count += mask[id];
    }
    return count;
}

double nll_mass(const float *logp, const bool *mask, int32_t n) {
    double s = 0;
    for (int32_t i = 0; i < n; i++)
        if (mask[i]) s += exp((double)logp[i]);
    return s;
}

/* splitmix64: small, seedable, good enough to draw resample indices. */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Linear interpolation between order statistics (numpy's default
 * percentile rule). */
static double quantile(const double *sorted, int32_t n, double q) {
    double h = q * (n - 1);
    int32_t lo = (int32_t)floor(h);
    if (lo >= n - 1) return sorted[n - 1];
    return sorted[lo] + (h - lo) * (sorted[lo + 1] - sorted[lo]);
}

bool nll_bootstrap(const double *a, const double *b, int32_t n, int32_t n_boot, uint64_t seed,
                   double alpha, double *point, double *lo, double *hi) {
    *point = *lo = *hi = NAN;
    if (n <= 0 || n_boot < 10) return false;
    double sa = 0, sb = 0;
    for (int32_t i = 0; i < n; i++) {
        sa += a[i];
        sb += b ? b[i] : 1.0;
    }
    if (sb != 0) *point = sa / sb;
    double *stat = malloc((size_t)n_boot * sizeof *stat);
    if (!stat) return false;
    int32_t m = 0;
    uint64_t x = seed;
    for (int32_t r = 0; r < n_boot; r++) {
        double ra = 0, rb = 0;
        for (int32_t j = 0; j < n; j++) {
            int32_t i = (int32_t)(splitmix64(&x) % (uint64_t)n);
            ra += a[i];
            rb += b ? b[i] : 1.0;
        }
        if (rb != 0) stat[m++] = ra / rb;
    }
    bool ok = m > 0;
    if (ok) {
        qsort(stat, (size_t)m, sizeof *stat, cmp_double);
        *lo = quantile(stat, m, alpha / 2);
        *hi = quantile(stat, m, 1 - alpha / 2);
    }
    free(stat);
    return ok;
}

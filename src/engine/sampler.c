/*
 * sampler: temperature, top-k, top-p and a seeded draw (see sampler.h).
 *
 * Candidates are kept best first, ordered by (logit descending, token id
 * ascending), so every tie is broken the same way by every path. Weights are
 * exp((logit - max) / T), unnormalised; sums are in double.
 */
#include "engine/sampler.h"

#include "core/status.h"
#include "core/vmath.h"

#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Top-p without top-k groups the weights (0, 1] by their top 15 bits
 * (exponent and 6 mantissa bits: buckets 0.8-1.6% wide), so that only the
 * bucket where the nucleus ends needs sorting. */
#define NUCLEUS_BUCKETS ((0x3f800000u >> 17) + 1) /* key of weight 1.0, plus 1 */

static inline uint32_t nucleus_bucket(float w) {
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    return u >> 17;
}

typedef struct cand {
    float logit; /* NaN already replaced by -inf */
    int32_t id;
} cand;

struct sampler {
    sampler_params params;
    int32_t n_vocab;
    uint64_t seed;       /* the seed in use (never 0) */
    uint64_t rng[4];     /* xoshiro256** state */
    cand *cand;          /* [n_vocab] candidates (best first on the top-k path) */
    float *w_by_pos;     /* [n_vocab] weight of cand[j] */
    float *w_by_id;      /* [n_vocab] weight of token i (paths over all tokens) */
    cand *edge;          /* [n_vocab] tokens of the nucleus' boundary bucket */
    double *bucket_mass; /* [NUCLEUS_BUCKETS] weight held by each bucket */
};

/* ---- random numbers ---------------------------------------------------- */

/* splitmix64 (Steele, Lea, Flood 2014): expands a seed into generator state. */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** (Blackman, Vigna 2018). */
static uint64_t rng_next(uint64_t *s) {
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

/* A seed for p.seed == 0: the clock, the sampler's address and a counter,
 * so that two samplers created in the same nanosecond still differ. */
static uint64_t seed_from_clock(const void *salt) {
    static atomic_uint_fast64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    x ^= (uint64_t)(uintptr_t)salt;
    x ^= (uint64_t)atomic_fetch_add(&counter, 1) << 48;
    x = splitmix64(&x);
    return x ? x : 1;
}

/* ---- lifecycle ----------------------------------------------------------- */

sampler_params sampler_default_params(void) {
    sampler_params p = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 0};
    return p;
}

is_status sampler_create(sampler_params p, int32_t n_vocab, sampler **out) {
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "sampler: out is NULL");
    if (n_vocab <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "sampler: n_vocab %d must be positive", n_vocab);
    if (!(p.temperature >= 0.0f) || isinf(p.temperature))
        return is_error_set(IS_ERR_INVALID_ARG, "sampler: temperature %g must be finite and >= 0",
                            (double)p.temperature);
    if (p.top_k < 0)
        return is_error_set(IS_ERR_INVALID_ARG, "sampler: top_k %d must be >= 0", p.top_k);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
        return is_error_set(IS_ERR_INVALID_ARG, "sampler: top_p %g must be in (0, 1]",
                            (double)p.top_p);

    sampler *s = calloc(1, sizeof *s);
    if (s == NULL) return is_error_set(IS_ERR_NOMEM, "sampler: out of memory");
    s->params = p;
    /* Greedy choice reads none of the tables, and a server creates a
     * sampler a request: four vocabulary-sized allocations (mapped and
     * unmapped again, for a large vocabulary) are not for nothing. */
    if (!sampler_is_greedy(s)) {
        s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
        s->w_by_pos = malloc((size_t)n_vocab * sizeof *s->w_by_pos);
        s->w_by_id = malloc((size_t)n_vocab * sizeof *s->w_by_id);
        s->edge = malloc((size_t)n_vocab * sizeof *s->edge);
        s->bucket_mass = malloc(NUCLEUS_BUCKETS * sizeof *s->bucket_mass);
        if (s->cand == NULL || s->w_by_pos == NULL || s->w_by_id == NULL || s->edge == NULL ||
            s->bucket_mass == NULL) {
            sampler_free(s);
            return is_error_set(IS_ERR_NOMEM, "sampler: out of memory for %d candidates", n_vocab);
        }
    }
    s->n_vocab = n_vocab;
    s->seed = p.seed ? p.seed : seed_from_clock(s);
    uint64_t x = s->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
    *out = s;
    return IS_OK;
}

void sampler_free(sampler *s) {
    if (s == NULL) return;
    free(s->cand);
    free(s->w_by_pos);
    free(s->w_by_id);
    free(s->edge);
    free(s->bucket_mass);
    free(s);
}

uint64_t sampler_seed(const sampler *s) { return s ? s->seed : 0; }

/* ---- selection ------------------------------------------------------------ */

static inline float clean_logit(float x) { return isnan(x) ? -INFINITY : x; }

int32_t sampler_argmax(const float *logits, int32_t n) { return vmath_argmax(logits, n); }

bool sampler_is_greedy(const sampler *s) {
    return s && (s->params.temperature == 0.0f || s->params.top_k == 1);
}

/* True if a ranks strictly below b. */
static inline bool cand_worse(cand a, cand b) {
    return a.logit < b.logit || (a.logit == b.logit && a.id > b.id);
}

static int cand_cmp_best_first(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    if (cand_worse(*a, *b)) return 1;
    if (cand_worse(*b, *a)) return -1;
    return 0;
}

/* Restores the heap below position i of a heap whose root is its worst. */
static void heap_sift_down(cand *h, int32_t k, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && cand_worse(h[l], h[w])) w = l;
        if (r < k && cand_worse(h[r], h[w])) w = r;
        if (w == i) return;
        cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* The k best of logits[n] into c[0..k), best first. */
static void select_top_k(const float *logits, int32_t n, int32_t k, cand *c) {
    for (int32_t i = 0; i < k; i++) c[i] = (cand){clean_logit(logits[i]), i};
    for (int32_t i = k / 2 - 1; i >= 0; i--) heap_sift_down(c, k, i);
    for (int32_t i = k; i < n; i++) {
        float l = clean_logit(logits[i]);
        /* a later id never wins a tie, so only a strictly larger logit enters */
        if (l > c[0].logit) {
            c[0] = (cand){l, i};
            heap_sift_down(c, k, 0);
        }
    }
    qsort(c, (size_t)k, sizeof *c, cand_cmp_best_first);
}

/* exp((l - max) / T); exactly 1 for the maximum itself, so that a +inf
 * maximum gives 1 rather than exp(NaN). */
static inline float weight(float l, float max, float temp) {
    return l == max ? 1.0f : expf((l - max) / temp);
}

/* Position of the drawn entry of w[n] (mass = their sum, > 0). */
static int32_t draw(uint64_t *rng, const float *w, int32_t n, double mass) {
    double u = rng_uniform(rng) * mass, cum = 0.0;
    int32_t last = 0;
    for (int32_t j = 0; j < n; j++) {
        if (w[j] <= 0.0f) continue;
        cum += w[j];
        last = j;
        if (u < cum) return j;
    }
    return last; /* u rounded up to the mass itself */
}

/* Top-p over all tokens, whose weights are in s->w_by_id (sum `total`).
 * The nucleus is the best-first prefix reaching top_p * total; sorting all
 * tokens would cost O(n log n) per call, so the mass is first summed per
 * weight bucket: buckets above the one where the prefix reaches the target
 * are kept whole, and only that boundary bucket is sorted. */
static int32_t sample_nucleus_all(sampler *s, const float *logits, double total) {
    const int32_t n = s->n_vocab;
    const double target = (double)s->params.top_p * total;
    double *mass = s->bucket_mass;
    memset(mass, 0, NUCLEUS_BUCKETS * sizeof *mass);
    for (int32_t i = 0; i < n; i++)
        if (s->w_by_id[i] > 0.0f) mass[nucleus_bucket(s->w_by_id[i])] += s->w_by_id[i];
    uint32_t edge_bucket = NUCLEUS_BUCKETS - 1;
    double above = 0.0; /* mass of the buckets above edge_bucket */
    for (; edge_bucket > 0; edge_bucket--) {
        if (above + mass[edge_bucket] >= target) break;
        above += mass[edge_bucket];
    }
    int32_t nc = 0, ne = 0;
    for (int32_t i = 0; i < n; i++) {
        const float w = s->w_by_id[i];
        if (!(w > 0.0f)) continue;
        const uint32_t b = nucleus_bucket(w);
        if (b > edge_bucket) s->cand[nc++] = (cand){clean_logit(logits[i]), i};
        else if (b == edge_bucket) s->edge[ne++] = (cand){clean_logit(logits[i]), i};
    }
    /* gathered in id order: already best first when their logits are equal */
    bool sorted = true;
    for (int32_t j = 1; j < ne && sorted; j++) sorted = !cand_worse(s->edge[j - 1], s->edge[j]);
    if (!sorted) qsort(s->edge, (size_t)ne, sizeof *s->edge, cand_cmp_best_first);
    double cum = above;
    for (int32_t j = 0; j < ne; j++) {
        s->cand[nc++] = s->edge[j];
        cum += s->w_by_id[s->edge[j].id];
        if (cum >= target) break;
    }
    double kept = 0.0;
    for (int32_t j = 0; j < nc; j++) {
        s->w_by_pos[j] = s->w_by_id[s->cand[j].id];
        kept += s->w_by_pos[j];
    }
    return s->cand[draw(s->rng, s->w_by_pos, nc, kept)].id;
}

int32_t sampler_sample(sampler *s, const float *logits) {
    if (s == NULL || logits == NULL) return -1;
    const sampler_params *p = &s->params;
    const int32_t n = s->n_vocab;
    const float temp = p->temperature;
    if (sampler_is_greedy(s)) return sampler_argmax(logits, n);

    if (p->top_k == 0 || p->top_k >= n) { /* every token is a candidate */
        const float max = clean_logit(logits[sampler_argmax(logits, n)]);
        if (max == -INFINITY) return 0;
        double total = 0.0;
        for (int32_t i = 0; i < n; i++) {
            s->w_by_id[i] = weight(clean_logit(logits[i]), max, temp);
            total += s->w_by_id[i];
        }
        if (p->top_p < 1.0f) return sample_nucleus_all(s, logits, total);
        return draw(s->rng, s->w_by_id, n, total); /* no order needed */
    }

    const int32_t k = p->top_k;
    select_top_k(logits, n, k, s->cand);
    const float max = s->cand[0].logit;
    if (max == -INFINITY) return s->cand[0].id; /* token 0: ties go to low ids */
    double total = 0.0;
    for (int32_t j = 0; j < k; j++) {
        s->w_by_pos[j] = weight(s->cand[j].logit, max, temp);
        total += s->w_by_pos[j];
    }
    int32_t keep = k; /* top-p: the best-first prefix reaching top_p */
    if (p->top_p < 1.0f) {
        const double target = (double)p->top_p * total;
        double cum = 0.0;
        for (int32_t j = 0; j < k; j++) {
            cum += s->w_by_pos[j];
            if (cum >= target) {
                keep = j + 1;
                break;
            }
        }
    }
    double mass = 0.0;
    for (int32_t j = 0; j < keep; j++) mass += s->w_by_pos[j];
    return s->cand[draw(s->rng, s->w_by_pos, keep, mass)].id;
}

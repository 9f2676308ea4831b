/*
 * bench_util: what every benchmark program needs and nothing else: a
 * monotonic clock, the median of repeated runs, a seeded generator
 * (splitmix64) so runs draw the same data, and a small vocabulary for
 * synthetic text. Header-only: each bench/
 * program stays one file plus the library it measures.
 */
#ifndef IS_BENCH_UTIL_H
#define IS_BENCH_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static inline double bench_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* qsort order for doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0, n) (sorts v in place); NAN when n <= 0. */
static inline double bench_median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* splitmix64: the next value of the stream whose state is *s. */
static inline uint64_t bench_splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1), 53 bits. */
static inline double bench_unit(uint64_t *s) {
    return (double)(bench_splitmix(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* Standard normal (Box-Muller). */
static inline float bench_normal(uint64_t *s) {
    double u = bench_unit(s), v = bench_unit(s);
    return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

/* Words of LoCoMo-like facts, for synthetic text where the data is absent. */
static inline const char *const *bench_vocab(int *n) {
    static const char *const words[] = {
        "Caroline",    "Melanie",    "went",      "to",       "the",      "a",        "with",
        "her",         "his",        "family",    "kids",     "adoption", "agency",   "painting",
        "pottery",     "class",      "camping",   "beach",    "museum",   "concert",  "support",
        "group",       "LGBTQ",      "community", "mentor",   "friends",  "hiking",   "mountain",
        "road",        "trip",       "Grand",     "Canyon",   "son",      "daughter", "birthday",
        "violin",      "guitar",     "reading",   "running",  "charity",  "race",     "mental",
        "health",      "counseling", "career",    "school",   "event",    "speech",   "necklace",
        "grandmother", "Sweden",     "bowl",      "art",      "show",     "library",  "books",
        "dog",         "cat",        "guinea",    "pig",      "Oscar",    "horse",    "riding",
        "park",        "volunteer",  "shelter",   "last",     "week",     "year",     "month",
        "Friday",      "Saturday",   "summer",    "2022",     "2023",     "loves",    "enjoys",
        "plans",       "started",    "finished",  "recently", "is",       "and",      "in",
        "of",          "for",        "on",
    };
    *n = (int)(sizeof words / sizeof *words);
    return words;
}

#endif

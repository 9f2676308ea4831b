/*
 * bench_util: what every benchmark program needs and nothing else: a
 * monotonic clock, the median of repeated runs, and a seeded generator
 * (splitmix64) so runs draw the same data. Header-only: each bench/
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

#endif

/*
 * test_sampler: greedy and argmax ties, seeded determinism, top-k and top-p
 * supports, and the empirical distribution of 100k draws against a softmax
 * computed here in double (chi-square and 5 sigma per bin). Seeds are fixed,
 * so the statistical checks are deterministic; the thresholds are set so that
 * a correct sampler would fail them for about one seed in a million.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"

static sampler *make(float temp, int32_t top_k, float top_p, uint64_t seed, int32_t n) {
    sampler_params p = {.temperature = temp, .top_k = top_k, .top_p = top_p, .seed = seed};
    sampler *s = NULL;
    assert_int_equal(sampler_create(p, n, &s), IS_OK);
    assert_non_null(s);
    return s;
}

/* Deterministic test data (not the sampler's generator). */
static uint64_t lcg(uint64_t *x) {
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

/* logits[n] with values in a few coarse levels, so that ties are common. */
static void random_logits(float *l, int32_t n, uint64_t *x) {
    for (int32_t i = 0; i < n; i++) l[i] = (float)((int)(lcg(x) % 13) - 6) * 0.75f;
}

/* softmax(l / temp) over the tokens in keep[] (all if keep == NULL), in double. */
static void ref_softmax(const float *l, int32_t n, double temp, const int *keep, double *p) {
    double m = -INFINITY, sum = 0;
    for (int32_t i = 0; i < n; i++)
        if (!keep || keep[i]) m = fmax(m, l[i]);
    for (int32_t i = 0; i < n; i++) {
        p[i] = (!keep || keep[i]) ? exp((l[i] - m) / temp) : 0.0;
        sum += p[i];
    }
    for (int32_t i = 0; i < n; i++) p[i] /= sum;
}

typedef struct ranked {
    double p;
    int32_t id;
} ranked;

static int cmp_ranked(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* keep[i] = 1 for the tokens of the top-p nucleus of softmax(l / temp),
 * renormalised over the top_k best tokens (all if top_k is 0), found by a
 * full sort (probability down, id up); returns its size. Fails if the cut
 * lies within rounding distance of top_p, where a float sampler could
 * legitimately decide either way. */
static int32_t ref_nucleus(const float *l, int32_t n, double temp, int32_t top_k, double top_p,
                           int *keep) {
    double *p = malloc((size_t)n * sizeof *p);
    ranked *r = malloc((size_t)n * sizeof *r);
    ref_softmax(l, n, temp, NULL, p);
    for (int32_t i = 0; i < n; i++) r[i] = (ranked){p[i], i};
    qsort(r, (size_t)n, sizeof *r, cmp_ranked);
    int32_t n_top = (top_k > 0 && top_k < n) ? top_k : n;
    double total = 0, cum = 0;
    for (int32_t j = 0; j < n_top; j++) total += r[j].p;
    for (int32_t j = 0; j < n_top; j++) r[j].p /= total;
    int32_t size = 0;
    while (size < n_top && cum < top_p) cum += r[size++].p;
    assert_true(cum - top_p > 1e-6 && top_p - (cum - r[size - 1].p) > 1e-6);
    for (int32_t i = 0; i < n; i++) keep[i] = 0;
    for (int32_t j = 0; j < size; j++) keep[r[j].id] = 1;
    free(r);
    free(p);
    return size;
}

/* Chi-square value exceeded with probability ~1e-6 at `df` degrees of
 * freedom (Wilson-Hilferty; z = 4.753 is the normal 1e-6 upper quantile). */
static double chi2_limit(int df) {
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + 4.753 * sqrt(a), 3);
}

/* Draws `draws` tokens and checks the counts against p[n]: every count within
 * 5 sigma of its expectation, tokens of p = 0 never drawn, and, if
 * `use_chi2`, the chi-square statistic over the tokens of p > 0 below its
 * 1e-6 tail (only meaningful when every expected count is >= 5). */
static void check_frequencies(sampler *s, const float *logits, const double *p, int32_t n,
                              int32_t draws, bool use_chi2) {
    int32_t *count = calloc((size_t)n, sizeof *count);
    for (int32_t t = 0; t < draws; t++) {
        int32_t tok = sampler_sample(s, logits);
        assert_true(tok >= 0 && tok < n);
        count[tok]++;
    }
    double chi2 = 0;
    int df = -1;
    for (int32_t i = 0; i < n; i++) {
        double e = draws * p[i];
        if (p[i] == 0) {
            assert_int_equal(count[i], 0);
            continue;
        }
        double sigma = sqrt(draws * p[i] * (1 - p[i]));
        if (fabs(count[i] - e) > 5 * sigma) {
            print_error("token %d: %d draws, expected %.1f (5 sigma = %.1f)\n", i, count[i], e,
                        5 * sigma);
            fail();
        }
        chi2 += (count[i] - e) * (count[i] - e) / e;
        df++;
    }
    if (use_chi2 && chi2 > chi2_limit(df)) {
        print_error("chi-square %.2f > %.2f (df %d)\n", chi2, chi2_limit(df), df);
        fail();
    }
    free(count);
}

/* ---- greedy ------------------------------------------------------------------ */

static void test_argmax(void **state) {
    (void)state;
    const float a[] = {1, 3, -2, 3, 0};
    assert_int_equal(sampler_argmax(a, 5), 1); /* tie: lowest index */
    const float b[] = {NAN, -5, NAN, -1, -1};
    assert_int_equal(sampler_argmax(b, 5), 3); /* NaN skipped, even first */
    const float c[] = {NAN, NAN, NAN};
    assert_int_equal(sampler_argmax(c, 3), 0);
    const float d[] = {-INFINITY, -INFINITY, INFINITY, INFINITY};
    assert_int_equal(sampler_argmax(d, 4), 2);
    assert_int_equal(sampler_argmax(d, 2), 0);
    assert_int_equal(sampler_argmax(a, 0), -1);
    assert_int_equal(sampler_argmax(NULL, 5), -1);
}

/* Rows long enough for the vector loops (32 a step, then 8, then single
 * elements): the answer against a plain scan, with the maximum, its ties,
 * NaNs and signed zeros in every part of the row. */
static int32_t argmax_scan(const float *x, int32_t n) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++)
        if (!isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 || x[best] == -INFINITY ? 0 : best;
}

static void test_argmax_long_rows(void **state) {
    (void)state;
    enum { N = 203 }; /* 6 steps of 32, one of 8, then 3 single elements */
    static float l[N];
    uint64_t x = 11;
    for (int r = 0; r < 2000; r++) {
        const int32_t n = 1 + (int32_t)(lcg(&x) % N);
        random_logits(l, n, &x);
        const int32_t at = (int32_t)(lcg(&x) % (uint64_t)n);
        switch (r % 5) {
        case 0: /* a tie for the maximum */
            l[at] = 50.0f;
            l[(at + 1 + (int32_t)(lcg(&x) % (uint64_t)n)) % n] = 50.0f;
            break;
        case 1: l[at] = NAN; break;
        case 2: /* +0 and -0 tie: the first wins */
            for (int32_t i = 0; i < n; i++) l[i] = i == at ? 0.0f : -1.0f;
            l[n - 1 - at / 2] = -0.0f;
            break;
        case 3: /* nothing above -inf */
            for (int32_t i = 0; i < n; i++) l[i] = i % 7 ? NAN : -INFINITY;
            break;
        default: l[at] = INFINITY; break;
        }
        assert_int_equal(sampler_argmax(l, n), argmax_scan(l, n));
    }
}

static void test_greedy_and_top_k_1(void **state) {
    (void)state;
    enum { N = 1000 };
    static float l[N];
    uint64_t x = 7;
    /* temperature 0 with any k/p, and top_k 1 at any temperature */
    sampler *ss[] = {make(0, 0, 1, 1, N),    make(0, 40, 0.5f, 2, N), make(0.1f, 1, 1, 3, N),
                     make(1, 1, 0.9f, 4, N), make(5, 1, 1, 5, N),     make(100, 1, 0.1f, 6, N)};
    for (int r = 0; r < 300; r++) {
        random_logits(l, N, &x);
        if (r % 3 == 0) l[lcg(&x) % N] = NAN;
        int32_t want = sampler_argmax(l, N);
        /* independent check of the argmax itself */
        for (int32_t i = 0; i < want; i++) assert_false(l[i] >= l[want]);
        for (int32_t i = want + 1; i < N; i++) assert_false(l[i] > l[want]);
        for (size_t k = 0; k < sizeof ss / sizeof ss[0]; k++)
            assert_int_equal(sampler_sample(ss[k], l), want);
    }
    for (size_t k = 0; k < sizeof ss / sizeof ss[0]; k++) sampler_free(ss[k]);
}

/* ---- determinism -------------------------------------------------------- */

static void sequence(sampler *s, const float *l, int32_t *out, int count) {
    for (int i = 0; i < count; i++) out[i] = sampler_sample(s, l);
}

static void test_seeds(void **state) {
    (void)state;
    enum { N = 200, T = 500 };
    float l[N];
    uint64_t x = 99;
    for (int32_t i = 0; i < N; i++) l[i] = (float)(lcg(&x) % 1000) / 500.0f; /* near flat */
    const struct {
        int32_t k;
        float p;
    } cfg[] = {{0, 1}, {50, 1}, {0, 0.9f}, {40, 0.95f}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        int32_t a[T], b[T], d[T];
        sampler *s1 = make(0.9f, cfg[c].k, cfg[c].p, 42, N);
        sampler *s2 = make(0.9f, cfg[c].k, cfg[c].p, 42, N);
        sampler *s3 = make(0.9f, cfg[c].k, cfg[c].p, 43, N);
        assert_int_equal(sampler_seed(s1), 42);
        sequence(s1, l, a, T);
        sequence(s2, l, b, T);
        sequence(s3, l, d, T);
        assert_memory_equal(a, b, sizeof a);
        int differ = 0;
        for (int i = 0; i < T; i++) differ += a[i] != d[i];
        assert_true(differ > T / 2);
        sampler_free(s1);
        sampler_free(s2);
        sampler_free(s3);
    }
    /* seed 0: a drawn seed, reported, which replays the same sequence */
    int32_t a[T], b[T], d[T];
    sampler *r1 = make(1, 0, 1, 0, N), *r2 = make(1, 0, 1, 0, N);
    assert_true(sampler_seed(r1) != 0);
    assert_true(sampler_seed(r1) != sampler_seed(r2));
    sampler *again = make(1, 0, 1, sampler_seed(r1), N);
    sequence(r1, l, a, T);
    sequence(again, l, b, T);
    sequence(r2, l, d, T);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_not_equal(a, d, sizeof a);
    sampler_free(r1);
    sampler_free(r2);
    sampler_free(again);
}

/* ---- top-k / top-p supports ------------------------------------------------ */

static void test_top_p_support(void **state) {
    (void)state;
    /* tokens 7 and 3 hold 0.5 and 0.4, eight others 0.0125 each (T = 1) */
    enum { N = 10 };
    float l[N];
    for (int i = 0; i < N; i++) l[i] = (float)log(0.0125);
    l[7] = (float)log(0.5);
    l[3] = (float)log(0.4);
    const int32_t ks[] = {0, 5, N, 100};
    for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++) {
        sampler *s = make(1, ks[k], 0.8f, 1234 + k, N);
        int32_t count[N] = {0};
        for (int t = 0; t < 10000; t++) count[sampler_sample(s, l)]++;
        assert_int_equal(count[7] + count[3], 10000);
        /* inside the nucleus the ratio stays 5:4 */
        double p7 = 0.5 / 0.9, sigma = sqrt(10000 * p7 * (1 - p7));
        assert_true(fabs(count[7] - 10000 * p7) < 5 * sigma);
        sampler_free(s);
    }
    /* the nucleus grows to a third token when two are not enough:
     * {0.5, 0.3, 0.15, 0.05}, top_p 0.85 keeps three (0.95 of the mass) */
    const float l4[4] = {(float)log(0.05), (float)log(0.3), (float)log(0.5), (float)log(0.15)};
    double p4[4] = {0, 0.3 / 0.95, 0.5 / 0.95, 0.15 / 0.95};
    for (int k = 0; k < 2; k++) {
        sampler *s = make(1, k ? 3 : 0, 0.85f, 77, 4);
        check_frequencies(s, l4, p4, 4, 100000, true);
        sampler_free(s);
    }
    /* a tiny top_p keeps exactly the best token, the lowest id on a tie */
    const float tie[5] = {0, 2, 1, 2, -1};
    sampler *s = make(3, 0, 0.01f, 5, 5);
    for (int t = 0; t < 1000; t++) assert_int_equal(sampler_sample(s, tie), 1);
    sampler_free(s);
}

static void test_top_k_support(void **state) {
    (void)state;
    enum { N = 8 };
    const float l[N] = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f, 1.5f};
    int keep[N] = {1, 1, 0, 0, 0, 0, 0, 1}; /* the three largest */
    double p[N];
    ref_softmax(l, N, 0.7, keep, p);
    sampler *s = make(0.7f, 3, 1, 2024, N);
    check_frequencies(s, l, p, N, 100000, true);
    sampler_free(s);
    /* ties at the k-th place go to the lower ids */
    const float t[6] = {1, 5, 1, 1, 0, 1};
    s = make(1, 3, 1, 3, 6);
    for (int i = 0; i < 2000; i++) {
        int32_t tok = sampler_sample(s, t);
        assert_true(tok == 0 || tok == 1 || tok == 2);
    }
    sampler_free(s);
}

/* ---- distribution --------------------------------------------------------- */

static void test_distribution(void **state) {
    (void)state;
    enum { N = 8 };
    const float l[N] = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f, 1.5f};
    const float temps[] = {0.7f, 1.0f, 2.5f};
    for (size_t t = 0; t < sizeof temps / sizeof temps[0]; t++) {
        double p[N];
        ref_softmax(l, N, temps[t], NULL, p);
        sampler *s = make(temps[t], 0, 1, 555 + t, N);
        check_frequencies(s, l, p, N, 100000, true);
        sampler_free(s);
        s = make(temps[t], N, 1, 666 + t, N); /* top_k == n_vocab is off */
        check_frequencies(s, l, p, N, 100000, true);
        sampler_free(s);
    }
}

/* top-p alone over a large vocabulary (the threshold path): the drawn tokens
 * are exactly the nucleus found by a full sort here. */
static void test_top_p_large_vocab(void **state) {
    (void)state;
    enum { N = 16384 };
    float *l = malloc(N * sizeof *l);
    uint64_t x = 31337;
    for (int32_t i = 0; i < N; i++) {
        double u1 = (lcg(&x) + 1.0) / 2147483649.0, u2 = lcg(&x) / 2147483648.0;
        l[i] = (float)(4.0 * sqrt(-2 * log(u1)) * cos(2 * M_PI * u2)); /* N(0, 16) */
    }
    int *keep = calloc(N, sizeof *keep);
    assert_true(ref_nucleus(l, N, 1.0, 0, 0.9, keep) > 5);
    double *pk = malloc(N * sizeof *pk);
    ref_softmax(l, N, 1.0, keep, pk);
    sampler *s = make(1, 0, 0.9f, 8, N);
    check_frequencies(s, l, pk, N, 10000, false); /* support, 5 sigma per bin */
    sampler_free(s);
    free(pk);
    free(keep);
    free(l);
}

/* Nuclei whose border falls inside a run of equal logits (ties go to the
 * lower ids) and nuclei spread over many weight buckets, through both the
 * all-token path (top_k 0 or >= n) and the top-k path. */
static void test_top_p_borders(void **state) {
    (void)state;
    enum { N = 100 };
    float l[N];
    int keep[N];
    double p[N];
    /* token 50 at 2.0, the rest tied at 0: total 1 + 99 e^-2 = 14.40; half of
     * it needs token 50 and the 46 lowest ids of the tie (1 + 46 e^-2 = 7.23) */
    for (int i = 0; i < N; i++) {
        l[i] = 0.0f;
        keep[i] = i < 46;
    }
    l[50] = 2.0f;
    keep[50] = 1;
    ref_softmax(l, N, 1.0, keep, p);
    const int32_t ks[] = {0, N, N - 1}; /* N - 1: heap path, same nucleus */
    for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++) {
        sampler *s = make(1, ks[k], 0.5f, 100 + k, N);
        check_frequencies(s, l, p, N, 100000, true);
        sampler_free(s);
    }
    /* weights e^(-0.005 r) for ranks r = 0..999 scattered over the ids, so
     * that a weight bucket of the sampler holds several tokens out of id
     * order */
    enum { M = 1000 };
    static float lm[M];
    static int keepm[M];
    static double pm[M];
    for (int i = 0; i < M; i++) lm[i] = -0.005f * (float)((i * 37) % M);
    for (int k = 0; k < 2; k++) {
        int32_t top_k = k ? 500 : 0;
        /* top-k 500 renormalises over ranks < 500, so its nucleus is smaller */
        assert_int_equal(ref_nucleus(lm, M, 1.0, top_k, 0.5, keepm), k ? 123 : 138);
        ref_softmax(lm, M, 1.0, keepm, pm);
        sampler *s = make(1, top_k, 0.5f, 7 + k, M);
        check_frequencies(s, lm, pm, M, 30000, true);
        sampler_free(s);
    }
}

/* ---- odd input ------------------------------------------------------------ */

static void test_nan_and_inf(void **state) {
    (void)state;
    const float nan3[3] = {NAN, NAN, NAN};
    const float half[6] = {NAN, 1.0f, NAN, 1.0f, -INFINITY, NAN};
    const float infs[5] = {0, INFINITY, 3, INFINITY, NAN};
    const float neg[4] = {-INFINITY, NAN, -INFINITY, -INFINITY};
    const struct {
        int32_t k;
        float p;
    } cfg[] = {{0, 1}, {2, 1}, {0, 0.5f}, {3, 0.99f}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        sampler *s3 = make(1, cfg[c].k, cfg[c].p, 9, 3);
        sampler *s6 = make(1, cfg[c].k, cfg[c].p, 9, 6);
        sampler *s5 = make(1, cfg[c].k, cfg[c].p, 9, 5);
        sampler *s4 = make(1, cfg[c].k, cfg[c].p, 9, 4);
        int32_t seen[6] = {0};
        for (int t = 0; t < 2000; t++) {
            assert_int_equal(sampler_sample(s3, nan3), 0);
            assert_int_equal(sampler_sample(s4, neg), 0);
            int32_t a = sampler_sample(s6, half);
            assert_true(a == 1 || a == 3);
            seen[a]++;
            int32_t b = sampler_sample(s5, infs);
            assert_true(b == 1 || b == 3);
        }
        if (cfg[c].p == 1) assert_true(seen[1] > 800 && seen[3] > 800);
        sampler_free(s3);
        sampler_free(s6);
        sampler_free(s5);
        sampler_free(s4);
    }
    assert_int_equal(sampler_sample(NULL, half), -1);
    sampler *s = make(1, 0, 1, 1, 6);
    assert_int_equal(sampler_sample(s, NULL), -1);
    sampler_free(s);
    sampler_free(NULL);
}

static void test_params(void **state) {
    (void)state;
    sampler_params d = sampler_default_params();
    assert_true(d.temperature == 0.8f && d.top_k == 40 && d.top_p == 0.95f && d.seed == 0);
    sampler *s = make(d.temperature, d.top_k, d.top_p, d.seed, 10);
    sampler_free(s);

    const sampler_params bad[] = {
        {-0.1f, 40, 0.9f, 1}, {NAN, 40, 0.9f, 1},   {INFINITY, 40, 0.9f, 1}, {0.8f, -1, 0.9f, 1},
        {0.8f, 40, 0.0f, 1},  {0.8f, 40, -0.5f, 1}, {0.8f, 40, 1.01f, 1},    {0.8f, 40, NAN, 1},
    };
    sampler *const sentinel = (sampler *)&d;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sampler *out = sentinel;
        assert_int_equal(sampler_create(bad[i], 10, &out), IS_ERR_INVALID_ARG);
        assert_ptr_equal(out, sentinel);
        assert_true(strlen(is_error_last()) > 0);
    }
    sampler *out = sentinel;
    assert_int_equal(sampler_create(d, 0, &out), IS_ERR_INVALID_ARG);
    assert_int_equal(sampler_create(d, -3, &out), IS_ERR_INVALID_ARG);
    assert_ptr_equal(out, sentinel);
    assert_int_equal(sampler_create(d, 10, NULL), IS_ERR_INVALID_ARG);
    /* the edges that are allowed */
    const sampler_params ok[] = {{0, 0, 1, 0}, {0.8f, 0, 1e-6f, 1}, {1e-3f, 100000, 1, 1}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        assert_int_equal(sampler_create(ok[i], 10, &out), IS_OK);
        sampler_free(out);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_argmax_long_rows),
        cmocka_unit_test(test_greedy_and_top_k_1),
        cmocka_unit_test(test_seeds),
        cmocka_unit_test(test_top_p_support),
        cmocka_unit_test(test_top_k_support),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_top_p_borders),
        cmocka_unit_test(test_top_p_large_vocab),
        cmocka_unit_test(test_nan_and_inf),
        cmocka_unit_test(test_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

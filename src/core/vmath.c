#include "core/vmath.h"

#include "core/status.h"

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f);
    const __m256 c2 = _mm256_set1_ps(-2.12194440e-4f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(x, hi);
    x = _mm256_max_ps(x, lo);
    __m256 fx =
        _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, c1, x);
    x = _mm256_fnmadd_ps(fx, c2, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_cvtps_epi32(fx);
    e = _mm256_add_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}
#endif

float vmath_exp_sub_sum(float *x, int32_t n, float m) {
    int32_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, v);
        acc = _mm256_add_ps(acc, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    return sum;
}

/* ---- argmax ---------------------------------------------------------------- */

/* The largest non-NaN value of x[n] (-inf if none). Comparisons are false
 * for NaN, and vmaxps(x, m) returns m when x is NaN, so both skip NaNs. */
static float max_value(const float *x, int32_t n) {
    float m = -INFINITY;
    int32_t i = 0;
#ifdef __AVX__
    /* Four independent chains: one waits on vmaxps's latency every step. */
    __m256 v0 = _mm256_set1_ps(-INFINITY), v1 = v0, v2 = v0, v3 = v0;
    for (; i + 32 <= n; i += 32) {
        v0 = _mm256_max_ps(_mm256_loadu_ps(x + i), v0);
        v1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), v1);
        v2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), v2);
        v3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), v3);
    }
    for (; i + 8 <= n; i += 8) v0 = _mm256_max_ps(_mm256_loadu_ps(x + i), v0);
    v0 = _mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3));
    float lanes[8];
    _mm256_storeu_ps(lanes, v0);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The first i with x[i] == m (-0 == +0: the first zero wins, as a tie). */
static int32_t first_equal(const float *x, int32_t n, float m) {
    int32_t i = 0;
#ifdef __AVX__
    const __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return -1;
}

int32_t vmath_argmax(const float *x, int32_t n) {
    if (x == NULL || n <= 0) return -1;
    const float m = max_value(x, n);
    if (m == -INFINITY) return 0;
    const int32_t i = first_equal(x, n, m);
    IS_ASSERT(i >= 0 && "max_value returned a value not in the row");
    return i;
}

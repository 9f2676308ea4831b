#include "core/vmath.h"

#include <immintrin.h>
#include <math.h>

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
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

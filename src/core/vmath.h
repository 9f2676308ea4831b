/*
 * vmath: vectorised math kernels shared by the CPU code paths.
 *
 * Softmax over long attention rows is dominated by exp; libm's expf is
 * scalar, so this module provides an AVX2 exp (Cephes-style range reduction
 * and a degree-5 polynomial, max relative error about 2e-7, i.e. within a
 * couple of float ulps) with a scalar tail.
 */
#ifndef IS_CORE_VMATH_H
#define IS_CORE_VMATH_H

#include <stdint.h>

/* x[i] = exp(x[i] - m) for i < n; returns the sum of the results.
 * Entries equal to -INFINITY become exactly 0. */
float vmath_exp_sub_sum(float *x, int32_t n, float m);

/* Index of the largest of x[n], the lowest one on ties (-0 == +0); NaNs are
 * skipped; 0 if every value is NaN or -inf; -1 if x is NULL or n <= 0. The
 * one rule for a greedy choice: the sampler's and every backend's argmax. */
int32_t vmath_argmax(const float *x, int32_t n);

#endif

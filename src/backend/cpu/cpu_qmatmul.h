/*
 * cpu_qmatmul: y = x W^T read straight from a weight's GGUF blocks, for
 * batches of a few tokens.
 *
 * Decode and short prefills are bound by the bytes of weight streamed per
 * forward, not by arithmetic: the f32 copy of SmolLM2-135M is 540 MB, its
 * Q4_1 blocks 98 MB. This kernel expands each 32-value block in registers
 * (AVX2/FMA) and multiplies it into every token row, so each weight byte is
 * read from memory once per call. Activations stay f32 and every expanded
 * weight is bit-identical to what gguf/quant.c writes into the f32 copy,
 * so the result equals an f32 product up to summation order.
 *
 * Weight rows are split across threads with OpenMP; the caller picks this
 * path for small T (for large T, sgemm on the f32 copy reuses each weight
 * many times and wins).
 */
#ifndef IS_BACKEND_CPU_QMATMUL_H
#define IS_BACKEND_CPU_QMATMUL_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

/* True if cpu_qmatmul() reads weights of `type` (a tensor_type id) with rows
 * of `cols` values: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and F16, with cols a
 * multiple of the type's block size (256 for the K types, 32 otherwise). */
bool cpu_qmatmul_supports(uint32_t type, int64_t cols);

/* y[T][rows] = x[T][cols] W^T, where W[rows][cols] is stored as `rows`
 * consecutive rows of packed blocks of `type` (tensor_type_row_bytes(type,
 * cols) bytes each, any alignment), as in a GGUF file. Overwrites y; x and W
 * are not modified and y must not overlap them. Uses the OpenMP threads of
 * the calling context. cpu_qmatmul_supports(type, cols) must hold, T >= 1
 * and rows >= 1 (asserted).
 * Returns IS_OK, or IS_ERR_NOMEM (y unchanged) if the T * cols floats of
 * scratch for T > 1 cannot be allocated. */
is_status cpu_qmatmul(float *y, const float *x, const void *w, uint32_t type, int64_t rows,
                      int64_t cols, int32_t T);

#endif

/*
 * quant: turning the stored element types of GGUF weights back into f32.
 *
 * A GGUF tensor is a row of blocks (see gguf/tensor_type.h); each quantised
 * block holds a few f16 scales and packed small integers. The forward pass
 * works in f32, so every weight we read goes through quant_dequantize() at
 * model load (or block by block in a kernel). The bit layouts are ggml's
 * (ggml-quants.c, dequantize_row_*), because they are part of the file
 * format; results are bit-identical to the reference dequantiser of the
 * Python `gguf` package (checked by tests/gguf/test_quant.c against golden
 * files written by tools/make_quant_golden.py).
 *
 * Why results are exact whatever the compiler does: in every formula here
 * the product scale * small-integer is exact in f32 (an f16 scale has 11
 * significant bits, a 6-bit sub-block scale and a <= 8-bit quant add at most
 * 14 more, except for Q6_K, whose (d * scale) * q order is kept), so fused
 * multiply-add and plain multiply-then-add round identically.
 *
 * These conversions are part of the file format, so they sit in the format
 * layer, below the backends: the CPU and CUDA backends place weights with
 * them, the KV records narrow and widen with them, and the embedder reads its
 * f16/bf16 safetensors with them.
 *
 * Readable types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
 * Q6_K. Others (Q2_K, Q3_K, the IQ family, ...) return IS_ERR_UNSUPPORTED.
 */
#ifndef IS_GGUF_QUANT_H
#define IS_GGUF_QUANT_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

/* ---- scalar conversions ------------------------------------------------- */

/* IEEE binary16 -> binary32. Exact for every input: subnormals become normal
 * floats, +-inf stay inf, a NaN stays a NaN of the same sign with its payload
 * shifted up 13 bits and the quiet bit set (what F16C's vcvtph2ps does). */
float quant_f16_to_f32(uint16_t h);

/* binary32 -> binary16, round to nearest, ties to even. Values at or above
 * 65520 in magnitude become inf; values too small for the smallest subnormal
 * round to (signed) zero; a NaN becomes a quiet NaN of the same sign keeping
 * the top 10 payload bits. */
uint16_t quant_f32_to_f16(float f);

/* bfloat16 -> binary32: the upper 16 bits of the float; exact, NaN payloads
 * kept bit for bit. */
float quant_bf16_to_f32(uint16_t b);

/* binary32 -> bfloat16, round to nearest, ties to even (subnormals rounded,
 * not flushed; overflow gives inf); a NaN becomes a quiet NaN of the same
 * sign, as ggml_compute_fp32_to_bf16 does. */
uint16_t quant_f32_to_bf16(float f);

/* Rows of the two conversions above: dst[i] (2 bytes each, any alignment)
 * gets exactly quant_f32_to_f16(src[i]) / quant_f32_to_bf16(src[i]) for
 * i < n. A fact's KV is millions of values, so these run vectorised (the
 * f16 one with F16C where the build targets it). */
void quant_f32_to_f16_row(const float *src, void *dst, size_t n);
void quant_f32_to_bf16_row(const float *src, void *dst, size_t n);

/* ---- rows ----------------------------------------------------------------- */

/* True if quant_dequantize() reads `type` (a tensor_type id). */
bool quant_can_dequantize(uint32_t type);

/* Dequantises `n` values of `type` from `src` (n / block_elems packed blocks,
 * tensor_type_row_bytes(type, n) bytes, any alignment) into `dst[n]`.
 * Returns IS_OK; IS_ERR_UNSUPPORTED if quant_can_dequantize(type) is false;
 * IS_ERR_INVALID_ARG if n is negative or not a multiple of the type's block
 * size, or if src/dst is NULL while n > 0. `dst` is untouched on failure.
 * n == 0 is a no-op. Single-threaded; callers split large tensors by rows. */
is_status quant_dequantize(uint32_t type, const void *src, float *dst, int64_t n);

#endif

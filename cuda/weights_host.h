/*
 * weights_host: the host half of weight loading for the CUDA backend. A
 * GGUF tensor of any type the CPU side reads is dequantised row by row with
 * quant_dequantize (so both backends start from the same f32 values) and
 * narrowed to what the GPU keeps: bf16 for matrices, f32 for vectors.
 * Plain C11 with OpenMP across rows, so loading a large model is bounded by
 * the upload, not by one core.
 */
#ifndef IS_CUDA_WEIGHTS_HOST_H
#define IS_CUDA_WEIGHTS_HOST_H

#include "gguf/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes t's ne[1] rows of ne[0] values into dst[rows][cols] as bf16 bit
 * patterns (round to nearest even, quant_f32_to_bf16). IS_ERR_UNSUPPORTED
 * for a type quant cannot read, IS_ERR_FORMAT if a row fails to decode,
 * IS_ERR_NOMEM; dst is partly written on failure. */
is_status cuda_host_weight_bf16(const gguf_tensor *t, uint16_t *dst);

/* The same into f32 (vectors: norm gains, biases). */
is_status cuda_host_weight_f32(const gguf_tensor *t, float *dst);

#ifdef __cplusplus
}
#endif

#endif

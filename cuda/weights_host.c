/*
 * weights_host: dequantise GGUF rows on the host for the CUDA backend (see
 * weights_host.h).
 */
#include "weights_host.h"

#include "core/status.h"
#include "gguf/tensor_type.h"
#include "gguf/quant.h"

#include <stdlib.h>

/* Decodes every row of t into dst[rows][cols], as bf16 bit patterns or f32. */
static is_status for_each_row(const gguf_tensor *t, void *dst, bool bf16) {
    if (!quant_can_dequantize(t->type))
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda backend: tensor '%s' has unsupported type %u",
                            t->name, t->type);
    const int64_t rows = t->ne[1], cols = t->ne[0];
    const size_t row_bytes = tensor_type_row_bytes(t->type, cols);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *tmp = bf16 ? malloc((size_t)cols * sizeof(float)) : NULL;
        if (bf16 && !tmp) failed |= 2;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (failed) continue;
            const uint8_t *src = (const uint8_t *)t->data + (size_t)r * row_bytes;
            if (!bf16) {
                if (quant_dequantize(t->type, src, (float *)dst + r * cols, cols) != IS_OK)
                    failed |= 1;
                continue;
            }
            if (quant_dequantize(t->type, src, tmp, cols) != IS_OK) {
                failed |= 1;
                continue;
            }
            uint16_t *out = (uint16_t *)dst + r * cols;
            for (int64_t i = 0; i < cols; i++) out[i] = quant_f32_to_bf16(tmp[i]);
        }
        free(tmp);
    }
    if (failed & 2) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    if (failed)
        return is_error_set(IS_ERR_FORMAT, "cuda backend: cannot dequantise tensor '%s'", t->name);
    return IS_OK;
}

is_status cuda_host_weight_bf16(const gguf_tensor *t, uint16_t *dst) {
    return for_each_row(t, dst, true);
}

is_status cuda_host_weight_f32(const gguf_tensor *t, float *dst) {
    return for_each_row(t, dst, false);
}

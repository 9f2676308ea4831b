/*
 * safetensors: a read-only, zero-copy reader for .safetensors weight files.
 *
 * The memory layer's embedding model comes as a Hugging Face safetensors
 * file, not GGUF, so it gets its own small reader. Like gguf/, we map the
 * file read-only and hand out pointers into the mapping. Every offset,
 * shape and size is checked against the file before use: a corrupt or
 * truncated file gives IS_ERR_FORMAT with a message naming the tensor,
 * never a crash.
 *
 * ---- Byte layout ---------------------------------------------------------
 *
 *   u64 (little-endian)  N: length of the header
 *   u8[N]                header: a UTF-8 JSON object (may be padded with
 *                        trailing spaces), one member per tensor
 *                          "name": {"dtype": "F32", "shape": [d0, d1, ...],
 *                                   "data_offsets": [begin, end]}
 *                        plus an optional "__metadata__": {string: string}
 *   data                 the byte buffer; tensor bytes are data[begin, end),
 *                        row-major (last dimension fastest), little-endian;
 *                        end - begin = product(shape) * dtype size
 */
#ifndef IS_MEMORY_SAFETENSORS_H
#define IS_MEMORY_SAFETENSORS_H

#include "inferscale.h"

#include <stddef.h>
#include <stdint.h>

#define SAFETENSORS_MAX_DIMS 8

typedef enum safetensors_dtype {
    SAFETENSORS_DTYPE_F32 = 0,
    SAFETENSORS_DTYPE_F16 = 1,
    SAFETENSORS_DTYPE_BF16 = 2,
    SAFETENSORS_DTYPE_I64 = 3,
    SAFETENSORS_DTYPE_I32 = 4,
    SAFETENSORS_DTYPE_OTHER = 5, /* a dtype we read past but do not interpret */
} safetensors_dtype;

typedef struct safetensors_tensor {
    const char *name; /* NUL-terminated, owned by the file handle */
    safetensors_dtype dtype;
    int32_t n_dims; /* 0..SAFETENSORS_MAX_DIMS */
    int64_t shape[SAFETENSORS_MAX_DIMS];
    int64_t n_elements; /* product of shape (1 for a scalar) */
    const void *data;   /* into the mapping; n_bytes long */
    uint64_t n_bytes;
} safetensors_tensor;

typedef struct safetensors safetensors;

/* Maps `path` and parses its header. IS_ERR_IO (cannot open/map),
 * IS_ERR_FORMAT (bad header, offsets or sizes), IS_ERR_NOMEM. *out is
 * unchanged on failure. */
is_status safetensors_open(const char *path, safetensors **out);

/* Unmaps the file; every pointer handed out becomes invalid. NULL is a no-op. */
void safetensors_close(safetensors *st);

int32_t safetensors_n_tensors(const safetensors *st);

/* Tensor `i` in header order, or NULL when out of range. */
const safetensors_tensor *safetensors_tensor_at(const safetensors *st, int32_t i);

/* The tensor named `name`, or NULL. */
const safetensors_tensor *safetensors_find(const safetensors *st, const char *name);

#endif

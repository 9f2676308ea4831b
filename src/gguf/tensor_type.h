/*
 * tensor_type: the element types a GGUF tensor can have, with ggml's ids
 * (they are part of the file format) and the size of one block of each.
 *
 * A quantised type stores `block_elems` values in `block_bytes` bytes; plain
 * types have block_elems == 1. A row of n values (n a multiple of
 * block_elems) takes n / block_elems * block_bytes bytes.
 */
#ifndef IS_GGUF_TENSOR_TYPE_H
#define IS_GGUF_TENSOR_TYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum tensor_type {
    TENSOR_TYPE_F32 = 0,
    TENSOR_TYPE_F16 = 1,
    TENSOR_TYPE_Q4_0 = 2,
    TENSOR_TYPE_Q4_1 = 3,
    TENSOR_TYPE_Q5_0 = 6,
    TENSOR_TYPE_Q5_1 = 7,
    TENSOR_TYPE_Q8_0 = 8,
    TENSOR_TYPE_Q8_1 = 9,
    TENSOR_TYPE_Q2_K = 10,
    TENSOR_TYPE_Q3_K = 11,
    TENSOR_TYPE_Q4_K = 12,
    TENSOR_TYPE_Q5_K = 13,
    TENSOR_TYPE_Q6_K = 14,
    TENSOR_TYPE_Q8_K = 15,
    TENSOR_TYPE_I8 = 24,
    TENSOR_TYPE_I16 = 25,
    TENSOR_TYPE_I32 = 26,
    TENSOR_TYPE_I64 = 27,
    TENSOR_TYPE_F64 = 28,
    TENSOR_TYPE_BF16 = 30,
    TENSOR_TYPE_COUNT_ = 40, /* upper bound on ids, not a type */
} tensor_type;

typedef struct tensor_type_info {
    const char *name;     /* "q4_K"; NULL for ids that are not types */
    uint32_t block_elems; /* values per block */
    uint32_t block_bytes; /* bytes per block */
} tensor_type_info;

/* Returns the block layout of `type`, or NULL for an id GGUF does not define
 * (or one whose layout we do not know): the file is then malformed. */
const tensor_type_info *tensor_type_get(uint32_t type);

/* Bytes taken by `n` values of `type`; 0 if the type is unknown or `n` is not
 * a multiple of its block size. */
size_t tensor_type_row_bytes(uint32_t type, int64_t n);

#endif

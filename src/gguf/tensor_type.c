#include "gguf/tensor_type.h"

#define QK_K 256

static const tensor_type_info type_table[TENSOR_TYPE_COUNT_] = {
    [TENSOR_TYPE_F32] = {"f32", 1, 4},
    [TENSOR_TYPE_F16] = {"f16", 1, 2},
    [TENSOR_TYPE_Q4_0] = {"q4_0", 32, 2 + 16},
    [TENSOR_TYPE_Q4_1] = {"q4_1", 32, 2 + 2 + 16},
    [TENSOR_TYPE_Q5_0] = {"q5_0", 32, 2 + 4 + 16},
    [TENSOR_TYPE_Q5_1] = {"q5_1", 32, 2 + 2 + 4 + 16},
    [TENSOR_TYPE_Q8_0] = {"q8_0", 32, 2 + 32},
    [TENSOR_TYPE_Q8_1] = {"q8_1", 32, 4 + 4 + 32},
    [TENSOR_TYPE_Q2_K] = {"q2_K", QK_K, QK_K / 16 + QK_K / 4 + 2 + 2},
    [TENSOR_TYPE_Q3_K] = {"q3_K", QK_K, QK_K / 8 + QK_K / 4 + 12 + 2},
    [TENSOR_TYPE_Q4_K] = {"q4_K", QK_K, 2 + 2 + 12 + QK_K / 2},
    [TENSOR_TYPE_Q5_K] = {"q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2},
    [TENSOR_TYPE_Q6_K] = {"q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2},
    [TENSOR_TYPE_Q8_K] = {"q8_K", QK_K, 4 + QK_K + QK_K / 16 * 2},
    [TENSOR_TYPE_I8] = {"i8", 1, 1},
    [TENSOR_TYPE_I16] = {"i16", 1, 2},
    [TENSOR_TYPE_I32] = {"i32", 1, 4},
    [TENSOR_TYPE_I64] = {"i64", 1, 8},
    [TENSOR_TYPE_F64] = {"f64", 1, 8},
    [TENSOR_TYPE_BF16] = {"bf16", 1, 2},
};

const tensor_type_info *tensor_type_get(uint32_t type) {
    if (type >= TENSOR_TYPE_COUNT_ || type_table[type].name == NULL) return NULL;
    return &type_table[type];
}

size_t tensor_type_row_bytes(uint32_t type, int64_t n) {
    const tensor_type_info *info = tensor_type_get(type);
    if (info == NULL || n < 0 || n % info->block_elems != 0) return 0;
    return (size_t)(n / info->block_elems) * info->block_bytes;
}

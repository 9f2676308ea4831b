/*
 * argmax: the greedy choice of each logits row on the device, so that a
 * greedy request's token comes back as 4 bytes instead of the vocabulary's
 * floats (128,256 of them for Llama 3: a 513 KB copy through pageable
 * memory, then a host scan; bench_gpu -L put the two at ~55 us of a TTFT).
 */
#ifndef IS_CUDA_ARGMAX_CUH
#define IS_CUDA_ARGMAX_CUH

#include "common.cuh"

/* out[r] (device) = vmath_argmax of row r of x[rows][n] (device), its rule
 * exactly: the first of equal maxima (-0 == +0), NaN skipped, 0 where no
 * value passes -inf. A block a row. */
is_status cuda_argmax_rows(cudaStream_t s, int32_t *out, const float *x, int32_t rows, int32_t n);

#endif

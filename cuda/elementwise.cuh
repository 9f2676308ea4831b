/*
 * elementwise: the ops that touch each element once (SwiGLU, residual add,
 * bias add, f32 -> bf16 conversion of matmul inputs, embedding rows).
 * Memory-bound: one pass, coalesced, grid-stride.
 */
#ifndef IS_CUDA_ELEMENTWISE_CUH
#define IS_CUDA_ELEMENTWISE_CUH

#include "common.cuh"

/* out[i] = silu(gate[i]) * up[i], i < n (out may alias gate or up); with
 * obf, also in bf16 as cuda_rmsnorm writes it (split: hi then lo). */
is_status cuda_swiglu(cudaStream_t s, float *out, const float *gate, const float *up, int64_t n,
                      __nv_bfloat16 *obf, bool split);

/* The same from a stacked product of gate and up: out[t][r] = silu(g) * u
 * with g = part[t][r], u = part[t][rows + r] (part [T][2 rows]; halves:
 * plus the lo half that follows, [2][T][2 rows]), the bits of
 * cuda_split_columns then cuda_swiglu without the split's write and read.
 * pdl: launched as a programmatic dependent (common.cuh). */
is_status cuda_swiglu_stacked(cudaStream_t s, float *out, const float *part, int64_t rows,
                              int32_t T, bool halves, __nv_bfloat16 *obf, bool split, bool pdl);

/* x[i] += y[i], i < n. */
is_status cuda_add(cudaStream_t s, float *x, const float *y, int64_t n);

/* y[t][i] += bias[i] for t < T, i < rows. */
is_status cuda_add_bias(cudaStream_t s, float *y, const float *bias, int32_t T, int64_t rows);

/* dst[i] = bf16(src[i]) rounded to nearest even, i < n. */
is_status cuda_f32_to_bf16(cudaStream_t s, __nv_bfloat16 *dst, const float *src, int64_t n);

/* dst[i] = src[i] in dtype (0 f32, 1 f16, 2 bf16), rounded bit for bit
 * as quant_f32_to_f16 / quant_f32_to_bf16 (the record conversions), i < n. */
is_status cuda_narrow(cudaStream_t s, void *dst, int32_t dtype, const float *src, int64_t n);

/* The activation split of the accurate matmul: hi[i] = bf16(src[i]) and
 * lo[i] = bf16(src[i] - hi[i]) (both to nearest even), so hi + lo carries
 * about 16 significant bits; dst = [hi: n][lo: n]. */
is_status cuda_f32_to_bf16_split(cudaStream_t s, __nv_bfloat16 *dst, const float *src, int64_t n);

/* y[t][i] = part[t][i] + part[T + t][i] (+ bias[i] when bias is not NULL),
 * t < T, i < rows: the two halves of a split product summed. */
is_status cuda_sum_halves(cudaStream_t s, float *y, const float *part, const float *bias, int32_t T,
                          int64_t rows);

/* The outputs of a product of stacked weights: columns [off_i, off_i +
 * rows_i) of its [T][sum rows] result go to y_i[T][rows_i], off_i the sum
 * of the rows before. */
#define CUDA_SPLIT_MAX 4
typedef struct cuda_split_out {
    float *y;
    const float *bias; /* [rows] or NULL */
    int64_t rows;
    int64_t off; /* set by cuda_split_columns */
} cuda_split_out;
typedef struct cuda_split {
    cuda_split_out out[CUDA_SPLIT_MAX];
    int32_t n;
} cuda_split;

/* y_i[t][r] = part[t][off_i + r] (+ part[T + t][off_i + r] when halves: a
 * split product) (+ bias_i[r]): the same sums, in the same order, as
 * cuda_sum_halves and cuda_add_bias on separate products. */
is_status cuda_split_columns(cudaStream_t s, cuda_split *sp, const float *part, int64_t rows,
                             int32_t T, bool halves);

/* out[t][cols] = row tokens[t] of emb ([rows][cols], bf16 when emb_bf16,
 * else f32), widened to f32; tokens in device memory, already checked. */
is_status cuda_get_rows(cudaStream_t s, float *out, const void *emb, bool emb_bf16, int64_t cols,
                        const int32_t *tokens, int32_t T);

#endif

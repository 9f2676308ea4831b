/*
 * products: which kernel a bf16 matrix product of the backend runs on, and
 * the launch. Three candidates, tried in order:
 *   - skinny.cuh's weight-streaming kernel, for decode steps (at most 8 GEMM
 *     columns) where its plan is one wave of blocks (option skinny);
 *   - wgmma_gemm.cuh's TMA + wgmma kernel, for up to 32 GEMM columns where it
 *     takes the shape and the GPU is a Hopper (option wgmma);
 *   - cuBLAS, with its own choice of algorithm (timing cuBLASLt's candidates
 *     for each shape instead measured no faster: docs/notes/cuda-diary.md).
 * A GEMM column is an input row, or half of one where the inputs are split
 * hi + lo (CUDA_MATMUL_BF16X2).
 */
#ifndef IS_CUDA_PRODUCTS_CUH
#define IS_CUDA_PRODUCTS_CUH

#include <cublas_v2.h>

#include "common.cuh"
#include "options.h"
#include "skinny.cuh"

typedef enum cuda_product_kernel {
    CUDA_PRODUCT_CUBLAS,
    CUDA_PRODUCT_SKINNY,
    CUDA_PRODUCT_WGMMA,
} cuda_product_kernel;

/* Decode steps of up to 8 GEMM columns take the skinny kernel (a
 * one-sequence 8B step measured 2.2% faster than on cuBLAS); at a query's
 * 30 rows it is slower than cuBLAS, so it takes no more. */
#define CUDA_SKINNY_DECODE_COLS 8

/* The kernel a product of n_cols GEMM columns of a [rows][cols] weight
 * takes under o; *plan (where not NULL) the skinny kernel's plan when that
 * is the one. */
cuda_product_kernel cuda_product_on(const cuda_options *o, int32_t n_cols, int64_t rows,
                                    int64_t cols, skinny_plan *plan);

/* out[n_cols][rows] (f32) = W x^T, W bf16 [rows][cols], x bf16 [n_cols][cols],
 * on the kernel cuda_product_on chooses (cuBLAS where the wgmma kernel's
 * operands are not 16-byte aligned). pdl: its own kernels launched as
 * programmatic dependents. */
is_status cuda_product_bf16(cudaStream_t s, cublasHandle_t cublas, const cuda_options *o,
                            float *out, const void *w, const __nv_bfloat16 *x, int64_t rows,
                            int32_t n_cols, int64_t cols);

#endif

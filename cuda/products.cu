/*
 * products: the backend's product dispatch (see products.cuh).
 */
#include "products.cuh"
#include "wgmma_gemm.cuh"

cuda_product_kernel cuda_product_on(const cuda_options *o, int32_t n_cols, int64_t rows,
                                    int64_t cols, skinny_plan *plan) {
    if (o->skinny && n_cols <= CUDA_SKINNY_DECODE_COLS &&
        cuda_skinny_supports(n_cols, rows, cols)) {
        const skinny_plan p = cuda_skinny_plan(n_cols, rows, cols, o->skinny_splits);
        if (plan) *plan = p;
        if (cuda_skinny_one_wave(&p, n_cols)) return CUDA_PRODUCT_SKINNY;
    }
    if (o->wgmma && cuda_wgmma_supports(n_cols, rows, cols)) return CUDA_PRODUCT_WGMMA;
    return CUDA_PRODUCT_CUBLAS;
}

is_status cuda_product_bf16(cudaStream_t s, cublasHandle_t cublas, const cuda_options *o,
                            float *out, const void *w, const __nv_bfloat16 *x, int64_t rows,
                            int32_t n_cols, int64_t cols) {
    skinny_plan p;
    const cuda_product_kernel k = cuda_product_on(o, n_cols, rows, cols, &p);
    if (k == CUDA_PRODUCT_SKINNY)
        return cuda_skinny_gemm(s, &p, out, (const __nv_bfloat16 *)w, x, n_cols, rows, cols,
                                o->pdl);
    if (k == CUDA_PRODUCT_WGMMA && cuda_aligned16(w) && cuda_aligned16(x))
        return cuda_wgmma_gemm(s, out, (const __nv_bfloat16 *)w, x, n_cols, rows, cols, o->pdl,
                               false, NULL);
    const float one = 1.0f, zero = 0.0f;
    /* Column-major view: out^T[rows][n] = W[cols][rows]^T x^T[cols][n]. */
    CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, n_cols, (int)cols, &one,
                              w, CUDA_R_16BF, (int)cols, x, CUDA_R_16BF, (int)cols, &zero, out,
                              CUDA_R_32F, (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return IS_OK;
}

/*
 * tma: tensor maps (see tma.cuh).
 */
#include "tma.cuh"

#include <cudaTypedefs.h>

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    static bool tried = false;
    if (!tried) {
        tried = true;
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                             cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        cudaGetLastError();
    }
    return fn;
}

bool cuda_tma_available(void) { return encode_fn() != NULL; }

is_status cuda_tma_map_sw128(CUtensorMap *m, const void *p, int64_t inner, int64_t outer,
                             uint32_t box_outer, const char *what) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
    if (!fn) return is_error_set(IS_ERR_UNSUPPORTED, "%s: no cuTensorMapEncodeTiled", what);
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)inner * 2};
    const cuuint32_t box[2] = {TMA_BOX_COLS, box_outer}, estr[2] = {1, 1};
    const CUresult r = fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims,
                          strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return is_error_set(IS_ERR_INTERNAL, "%s: cuTensorMapEncodeTiled failed (%d)", what,
                            (int)r);
    return IS_OK;
}

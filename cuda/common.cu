/*
 * common: CUDA and cuBLAS failures as is_status values (see common.cuh).
 */
#include "common.cuh"

is_status cuda_status_from(cudaError_t err, const char *expr, const char *file, int line) {
    is_status st = IS_ERR_INTERNAL;
    switch (err) {
    case cudaErrorMemoryAllocation: st = IS_ERR_NOMEM; break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDevice: st = IS_ERR_UNSUPPORTED; break;
    default: break;
    }
    return is_error_set(st, "cuda: %s failed at %s:%d: %s (%s)", expr, file, line,
                        cudaGetErrorString(err), cudaGetErrorName(err));
}

is_status cublas_status_from(cublasStatus_t s, const char *expr, const char *file, int line) {
    is_status st = s == CUBLAS_STATUS_ALLOC_FAILED ? IS_ERR_NOMEM
                   : s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH
                       ? IS_ERR_UNSUPPORTED
                       : IS_ERR_INTERNAL;
    return is_error_set(st, "cublas: %s failed at %s:%d: %s (%s)", expr, file, line,
                        cublasGetStatusString(s), cublasGetStatusName(s));
}

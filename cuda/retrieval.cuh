/*
 * retrieval: what the two halves of GPU retrieval (embed.cu, topk.cu;
 * public header retrieval_cuda.h) share: taking a device and checking it
 * can run them, and the stream they run on.
 */
#ifndef IS_CUDA_RETRIEVAL_CUH
#define IS_CUDA_RETRIEVAL_CUH

#include "common.cuh"

/* Every retrieval call runs on the calling thread's default stream of the
 * object's device (see retrieval_cuda.h, Streams). */
#define RETRIEVAL_STREAM cudaStreamPerThread

/* Makes `device` current if it exists, has at least `smem` bytes of shared
 * memory per block (opt-in; *optin gets the device's limit), and has code
 * in this build (`probe`, one of the caller's kernels). IS_ERR_UNSUPPORTED
 * otherwise, with a message. */
static inline is_status retrieval_use_device(int32_t device, size_t smem, const void *probe,
                                             const char *who, int *optin) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(IS_ERR_UNSUPPORTED, "%s: no usable CUDA driver or device (%s)", who,
                            cudaGetErrorString(e));
    }
    if (device < 0 || device >= n)
        return is_error_set(IS_ERR_UNSUPPORTED, "%s: no device %d (%d present)", who, device, n);
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if ((size_t)*optin < smem)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "%s: needs %zu bytes of shared memory per block, device %d has %d", who,
                            smem, device, *optin);
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, probe);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(IS_ERR_UNSUPPORTED, "%s: this build has no code for device %d: %s", who,
                            device, cudaGetErrorString(e));
    }
    return IS_OK;
}

#endif

/*
 * bench_cuda: what the CUDA micro-benchmarks (bench_gemm_gpu, bench_attn_gpu)
 * share: a CUDA call that must succeed (a benchmark has nothing to recover,
 * so it says which call failed and exits), the device, the median of timings.
 */
#ifndef IS_BENCH_CUDA_CUH
#define IS_BENCH_CUDA_CUH

#include <algorithm>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The first device's properties; false, with a line saying so, when this
 * machine has none (the benchmark then measures nothing and succeeds). */
static inline bool bench_device(cudaDeviceProp *prop) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("no CUDA device: nothing to measure\n");
        return false;
    }
    CK(cudaGetDeviceProperties(prop, 0));
    return true;
}

static inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

#endif

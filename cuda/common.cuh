/*
 * common: what every source of the CUDA backend shares: the checks that turn
 * a failed CUDA or cuBLAS call into an is_status with a message (never
 * exit()), and the launch check that follows every kernel launch.
 *
 * Launchers (the host functions each kernel family exports) return
 * is_status; the backend's ops, whose interface returns void, record the
 * first failure in their context (backend_cuda_check reads it).
 */
#ifndef IS_CUDA_COMMON_CUH
#define IS_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <utility>

extern "C" {
#include "core/status.h"
}

/* Records "cuda: <expr> failed at file:line: <reason>" and returns the
 * status that names the failure: IS_ERR_NOMEM for an allocation,
 * IS_ERR_UNSUPPORTED for a missing device, driver or kernel image,
 * IS_ERR_INTERNAL otherwise. */
is_status cuda_status_from(cudaError_t err, const char *expr, const char *file, int line);
is_status cublas_status_from(cublasStatus_t st, const char *expr, const char *file, int line);

/* In a function returning is_status: returns the failure of `call`. */
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t cuda_check_err_ = (call);                                                      \
        if (cuda_check_err_ != cudaSuccess)                                                        \
            return cuda_status_from(cuda_check_err_, #call, __FILE__, __LINE__);                   \
    } while (0)

#define CUBLAS_CHECK(call)                                                                         \
    do {                                                                                           \
        cublasStatus_t cublas_check_st_ = (call);                                                  \
        if (cublas_check_st_ != CUBLAS_STATUS_SUCCESS)                                             \
            return cublas_status_from(cublas_check_st_, #call, __FILE__, __LINE__);                \
    } while (0)

/* After a launch: a bad configuration shows up here, a fault in the kernel
 * at the next synchronising call. */
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* Blocks of `threads` covering n items, capped (grid-stride loops do the rest). */
static inline unsigned cuda_blocks_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > 65535 * 8) b = 65535 * 8;
    return (unsigned)b;
}

/* Whether 16-byte (float4, uint4) accesses may start at p. */
static inline bool cuda_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* The rotation of one RoPE pair (a, b) by the angle whose cosine and sine
 * are (c, sn), with its roundings pinned (a product rounded, then a fused
 * multiply-add): rope, rope_store and both inject kernels then give the
 * same bits, whatever the compiler would contract in each. */
static __device__ __forceinline__ float rope_first(float a, float b, float c, float sn) {
    return __fmaf_rn(a, c, -__fmul_rn(b, sn));
}
static __device__ __forceinline__ float rope_second(float a, float b, float c, float sn) {
    return __fmaf_rn(a, sn, __fmul_rn(b, c));
}

/* Element i of the bf16 copy of an op's f32 output y[n], as the matrix
 * products convert their input (cuda_f32_to_bf16 / _split): y rounded to
 * bf16, and when split the rounded remainder at n + i (y - hi is exact).
 * An op that writes it lets the next product skip its conversion pass. */
static __device__ __forceinline__ void bf16_copy_put(__nv_bfloat16 *obf, int64_t n, int64_t i,
                                                     float y, bool split) {
    const __nv_bfloat16 hi = __float2bfloat16_rn(y);
    obf[i] = hi;
    if (split) obf[n + i] = __float2bfloat16_rn(y - __bfloat162float(hi));
}

/* Programmatic dependent launch (PDL, sm_90). A kernel launched by
 * cuda_launch_dependent may start while the stream's previous kernel is
 * still ending (its blocks exiting, its writes being flushed), which hides
 * the launch of the next op behind the end of the last. Such a kernel must
 * call pdl_wait() before anything else, in every block (a product's kernel
 * may first read weights, which no kernel writes): it returns once the
 * previous kernel has finished and its writes are visible, and since every
 * such kernel waits, a kernel's end implies that of all before it. No
 * kernel of the request path triggers its dependents early: with the
 * trigger at the start of the op before a product, products in sequence
 * measured 5-10% slower, and an attention started early by the RoPE + KV
 * store before it measured a trade within 2% (docs/notes/cuda-diary.md); so
 * a dependent starts as the previous kernel's blocks exit. Whether a launch
 * is a dependent at all is the caller's choice (the backend's option pdl),
 * passed to every launcher: nothing here is process-wide. */
static __device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/* Lets the stream's next kernel, if a programmatic dependent, launch now
 * rather than as this kernel's blocks exit (it still waits, in pdl_wait, for
 * this kernel's end before reading what this one writes). Only the
 * product kernel's trigger argument uses it, for bench_gemm_gpu (see above). */
static __device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* A launch's configuration: grid, block, dynamic shared memory, stream,
 * thread-block cluster (1 x 1 x 1: none) and whether the kernel is a
 * programmatic dependent (it must then begin with pdl_wait()). Filled in
 * place (cfg points at its own attributes); cudaLaunchKernelEx and
 * cudaOccupancyMaxActiveClusters read cfg. */
struct cuda_launch_cfg {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[2];
};

static inline void cuda_launch_cfg_init(cuda_launch_cfg *l, dim3 grid, dim3 block, size_t smem,
                                        cudaStream_t s, dim3 cluster, bool pdl) {
    l->cfg = cudaLaunchConfig_t{};
    l->cfg.gridDim = grid;
    l->cfg.blockDim = block;
    l->cfg.dynamicSmemBytes = smem;
    l->cfg.stream = s;
    unsigned na = 0;
    if (cluster.x * cluster.y * cluster.z > 1) {
        l->at[na].id = cudaLaunchAttributeClusterDimension;
        l->at[na].val.clusterDim.x = cluster.x;
        l->at[na].val.clusterDim.y = cluster.y;
        l->at[na].val.clusterDim.z = cluster.z;
        na++;
    }
    if (pdl) {
        l->at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        l->at[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    l->cfg.attrs = l->at;
    l->cfg.numAttrs = na;
}

/* kernel<<<grid, block, smem, s>>>(args...) in clusters of `cluster`
 * blocks, as a programmatic dependent of the stream's previous kernel where
 * pdl. */
template <typename... KArgs, typename... Args>
static inline cudaError_t cuda_launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                         size_t smem, cudaStream_t s, dim3 cluster, bool pdl,
                                         Args &&...args) {
    cuda_launch_cfg l;
    cuda_launch_cfg_init(&l, grid, block, smem, s, cluster, pdl);
    return cudaLaunchKernelEx(&l.cfg, kernel, std::forward<Args>(args)...);
}

/* kernel<<<grid, block, smem, s>>>(args...), as a programmatic dependent of
 * the stream's previous kernel where pdl. Only for kernels that begin with
 * pdl_wait(). */
template <typename... KArgs, typename... Args>
static inline cudaError_t cuda_launch_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                                size_t smem, cudaStream_t s, bool pdl,
                                                Args &&...args) {
    return cuda_launch_ex(kernel, grid, block, smem, s, dim3(1, 1, 1), pdl,
                          std::forward<Args>(args)...);
}

/* Butterfly reductions over the 32 lanes of a warp (every lane gets the
 * result); the attention kernels' softmax uses them. */
#define FULL_MASK 0xffffffffu

static __device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

#endif

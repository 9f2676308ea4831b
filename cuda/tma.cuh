/*
 * tma: the Hopper tensor memory accelerator, as the sm_90a kernels use it
 * (wgmma_gemm's weight and input tiles, the tiled attention's K/V tiles on
 * the wgmma engine): 2-D tensor maps over row-major bf16 matrices read in
 * boxes of 64 columns (one 128-byte row of the 128-byte swizzle that
 * wgmma's shared-memory operands take), and the mbarriers that count a
 * stage's bytes in.
 *
 * A box lands in shared memory with 16-byte unit u of row r at unit
 * u ^ (r % 8) of the row: the swizzle is a function of the shared-memory
 * address, so a box must start on a 1024-byte boundary (8 rows) for its
 * rows to take that pattern from its own first row.
 */
#ifndef IS_CUDA_TMA_CUH
#define IS_CUDA_TMA_CUH

#include "common.cuh"

#include <cuda.h>

#define TMA_BOX_COLS 64 /* bf16 columns a box: the 128-byte swizzle's row */

/* Whether the driver gives cuTensorMapEncodeTiled (asked once). */
bool cuda_tma_available(void);

/* *m: the tensor map of a row-major bf16 matrix [outer][inner] at p
 * (16-byte aligned; inner a multiple of 8), read in boxes of TMA_BOX_COLS
 * columns x box_outer rows (1..256) with the 128-byte swizzle; rows past
 * outer read as zeros. IS_ERR_UNSUPPORTED without the driver's encoder,
 * IS_ERR_INTERNAL where it refuses the shape; `what` names the caller in
 * the message. */
is_status cuda_tma_map_sw128(CUtensorMap *m, const void *p, int64_t inner, int64_t outer,
                             uint32_t box_outer, const char *what);

/* Device side: sm_90 instructions (a kernel for an older GPU that calls
 * one does not assemble). */
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
/* After thread 0's inits, before any other thread or the TMA uses them (a
 * block barrier follows). */
static __device__ __forceinline__ void mbar_init_fence(void) {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* This thread's arrival, and `bytes` more for the phase to wait for. */
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Until the phase of this parity has completed. */
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
/* A box of the 2-D tensor map at (c0 = column, c1 = row) into shared memory
 * at dst, counted on bar. */
static __device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int32_t c0,
                                                int32_t c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
/* The map's descriptor into the cache before its first use. */
static __device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)map) : "memory");
}

#endif

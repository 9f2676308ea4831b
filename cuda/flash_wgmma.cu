/*
 * flash_wgmma: the tiled attention's wgmma engine (flash_kernel.cuh with
 * WG), in the sm_90a library beside wgmma_gemm.cu: wgmma is an
 * architecture-specific instruction. flash.cu launches what this returns.
 *
 * Why (measured with SASS counts and phase traces, docs/notes/cuda-diary.md):
 * on mma.sync a key tile
 * costs a warp ~830 instructions (64 HMMA, 32 LDSM and the softmax between)
 * and ~1.75 us, most of it the chain of dependent steps, so a 30-token
 * query's attention grows by ~7.5 us a layer from k = 5 to k = 50 (three
 * more tiles a block). wgmma issues a warpgroup's 64 x 64 S tile in 8
 * instructions and its P V in 4, from the same register fragments.
 * Measured: a key tile ~10% (one key part) to ~22% (two)
 * faster than on mma.sync; the chain around the products (the tile's copies,
 * the softmax, the barrier) is most of a tile now, about half of it the
 * issue of its instructions (Nsight Compute). A 30-token query after 1,340
 * keys: 17.3 us a layer against 18.6, a 1,280-token prefill 94 against 113.
 */
#include "flash_kernel.cuh"
#include "wgmma_gemm.cuh"

flash_fn cuda_flash_wgmma_kernel(int32_t head_dim, int32_t key_warps, int32_t key_tile) {
    if (!cuda_sm90a_runs()) return NULL;
    if (key_tile == FLASH_BN_WIDE) { /* two key parts of 64 keys */
        if (key_warps != 2) return NULL;
        if (head_dim == 64) return flash_kernel<64, FLASH_BM, FLASH_STAGES, 2, true, FLASH_BN_WIDE>;
        if (head_dim == 128)
            return flash_kernel<128, FLASH_BM, FLASH_STAGES, 2, true, FLASH_BN_WIDE>;
        return NULL;
    }
    if (head_dim == 64)
        return key_warps == 2 ? flash_kernel<64, FLASH_BM, FLASH_STAGES, 2, true, FLASH_BN>
                              : flash_kernel<64, FLASH_BM, FLASH_STAGES, 1, true, FLASH_BN>;
    if (head_dim == 128)
        return key_warps == 2 ? flash_kernel<128, FLASH_BM, FLASH_STAGES, 2, true, FLASH_BN>
                              : flash_kernel<128, FLASH_BM, FLASH_STAGES, 1, true, FLASH_BN>;
    return NULL;
}

is_status cuda_flash_wgmma_set_trace(unsigned long long *trace) {
    if (!cuda_sm90a_runs()) return IS_OK; /* nothing of this engine runs here */
    CUDA_CHECK(cudaMemcpyToSymbol(g_flash_trace, &trace, sizeof trace));
    return IS_OK;
}

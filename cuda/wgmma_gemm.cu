/*
 * wgmma_gemm: TMA + wgmma products of few rows (see wgmma_gemm.cuh).
 */
#include "wgmma_gemm.cuh"

#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>

namespace cg = cooperative_groups;

#define WG_THREADS 160 /* one consumer warpgroup (warps 0-3), one producer warp */
#define WG_BK      64  /* columns a stage: 128 bytes of bf16, the swizzle's row */
#define WG_PLD     36  /* floats a row of a block's partial sums (16-byte rows) */

static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n"
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
/* A K-major operand in shared memory with the 128-byte swizzle: rows of 128
 * bytes, 8-row groups 1024 bytes apart. */
static __device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
/* d[64 x 32] += A[64 x 16] B[16 x 32]^T, A and B K-major in shared memory. */
static __device__ __forceinline__ void wgmma_m64n32k16(float *d, uint64_t da, uint64_t db) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %18, 0;\n" /* accumulate into d */
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "%16, %17, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "n"(1));
}
#endif

/* y = g / (1 + e^-g) u, as cuda_swiglu's kernels compute it (expf, not
 * __expf: the CPU reference uses expf too), and its bf16 copy. */
static __device__ __forceinline__ void glu_put(float *y, __nv_bfloat16 *obf, int64_t i, float g,
                                               float u) {
    const float v = g / (1.0f + expf(-g)) * u;
    y[i] = v;
    bf16_copy_put(obf, 0, i, v, false);
}

/* Block (row block, column range): BM = 64 MB weight rows, column tiles
 * [kt0, kt1) of the range, STAGES stages of W and x tiles.
 * glu > 0 (MB = 2): W stacks gate [glu rows] over up [glu rows]; a block
 * takes 64 gate rows as its first tile and the same 64 up rows as its
 * second, and writes y[n][glu] = SwiGLU(gate, up) and its bf16 copy obf
 * instead of the product. */
template <int MB, int STAGES>
static __global__ void __launch_bounds__(WG_THREADS)
    wgmma_gemm_kernel(const __grid_constant__ CUtensorMap tw,
                      const __grid_constant__ CUtensorMap tx, float *y, int32_t n, int32_t rows,
                      int32_t kt_total, int32_t splits, int32_t trigger, int32_t glu,
                      __nv_bfloat16 *obf) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (trigger) pdl_trigger(); /* measured slower: benchmarks only */
    constexpr int BM = 64 * MB;
    constexpr uint32_t W_BYTES = BM * 128, X_BYTES = WGMMA_MAX_N * 128;
    constexpr uint32_t STAGE_BYTES = W_BYTES + X_BYTES;
    extern __shared__ unsigned char smem_raw[];
    /* The swizzle wants 1024-byte aligned tiles. */
    const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    unsigned char *const sm = smem_raw + (base - raw);
    const uint32_t full0 = base + STAGES * STAGE_BYTES, empty0 = full0 + 8 * STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int32_t row0 = blockIdx.x * (glu ? 64 : BM), split = blockIdx.y;
    const int32_t kt0 = (int32_t)((int64_t)split * kt_total / splits);
    const int32_t kt1 = (int32_t)((int64_t)(split + 1) * kt_total / splits);
    const int32_t nkt = kt1 - kt0;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 4); /* a consumer warp each */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    float acc[MB][16];
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int e = 0; e < 16; e++) acc[mb][e] = 0.0f;

    /* A stage's weights: one box of BM rows, or with glu two of 64. */
    auto load_w = [&](uint32_t dst, int32_t kt, uint32_t bar) {
        tma_load(dst, &tw, kt * WG_BK, row0, bar);
        if (glu) tma_load(dst + 64 * 128, &tw, kt * WG_BK, glu + row0, bar);
    };

    if (warp == 4) {
        if (lane == 0) {
            /* The weights of the first stages before the wait (no kernel
             * writes them), x after it. */
            const int32_t pre = nkt < STAGES ? nkt : STAGES;
            for (int32_t i = 0; i < pre; i++) {
                mbar_expect_tx(full0 + 8 * i, STAGE_BYTES);
                load_w(base + i * STAGE_BYTES, kt0 + i, full0 + 8 * i);
            }
            pdl_wait();
            for (int32_t i = 0; i < pre; i++)
                tma_load(base + i * STAGE_BYTES + W_BYTES, &tx, (kt0 + i) * WG_BK, 0,
                         full0 + 8 * i);
            for (int32_t i = pre; i < nkt; i++) {
                const int s = i % STAGES;
                mbar_wait(empty0 + 8 * s, (uint32_t)((i / STAGES - 1) & 1));
                mbar_expect_tx(full0 + 8 * s, STAGE_BYTES);
                load_w(base + s * STAGE_BYTES, kt0 + i, full0 + 8 * s);
                tma_load(base + s * STAGE_BYTES + W_BYTES, &tx, (kt0 + i) * WG_BK, 0,
                         full0 + 8 * s);
            }
        }
    } else {
        for (int32_t i = 0; i < nkt; i++) {
            const int s = i % STAGES;
            mbar_wait(full0 + 8 * s, (uint32_t)((i / STAGES) & 1));
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            const uint32_t wa = base + s * STAGE_BYTES, xa = wa + W_BYTES;
#pragma unroll
            for (int ks = 0; ks < WG_BK / 16; ks++)
#pragma unroll
                for (int mb = 0; mb < MB; mb++)
                    wgmma_m64n32k16(acc[mb], desc_sw128(wa + mb * 64 * 128 + ks * 32),
                                    desc_sw128(xa + ks * 32));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            if (lane == 0) mbar_arrive(empty0 + 8 * s);
        }
    }
    pdl_wait(); /* every thread, before writing y: the kernel before may still read it */

    /* acc[mb][4j + e]: weight row 64 mb + 16 warp + lane / 4 (+ 8 for e >=
     * 2), input row 8 j + 2 (lane % 4) (+ 1 for odd e). */
    if (splits == 1) {
        if (warp < 4 && glu) {
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int32_t r = row0 + 16 * warp + lane / 4 + (e & 2 ? 8 : 0);
                const int32_t t = 8 * (e >> 2) + 2 * (lane & 3) + (e & 1);
                if (t < n) glu_put(y, obf, (int64_t)t * glu + r, acc[0][e], acc[MB - 1][e]);
            }
        } else if (warp < 4) {
#pragma unroll
            for (int mb = 0; mb < MB; mb++)
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    const int32_t r = row0 + mb * 64 + 16 * warp + lane / 4 + (e & 2 ? 8 : 0);
                    const int32_t t = 8 * (e >> 2) + 2 * (lane & 3) + (e & 1);
                    if (t < n) y[(int64_t)t * rows + r] = acc[mb][e];
                }
        }
        return;
    }
    /* Column ranges: each block leaves its sums in shared memory (the ring
     * is free: every stage was consumed), then sums its share of the rows
     * over the cluster's blocks in range order. */
    float *part = reinterpret_cast<float *>(sm);
    __syncthreads();
    if (warp < 4) {
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 16; e++) {
                const int32_t r = mb * 64 + 16 * warp + lane / 4 + (e & 2 ? 8 : 0);
                const int32_t t = 8 * (e >> 2) + 2 * (lane & 3) + (e & 1);
                part[r * WG_PLD + t] = acc[mb][e];
            }
    }
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    const int32_t rank = (int32_t)cl.block_rank();
    /* Four columns of tile row r summed over the cluster in range order. */
    auto sum_ranks = [&](int32_t r, int32_t c4) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int32_t z = 0; z < splits; z++) {
            const float4 v = *reinterpret_cast<const float4 *>(cl.map_shared_rank(part, z) +
                                                               r * WG_PLD + 4 * c4);
            a.x += v.x;
            a.y += v.y;
            a.z += v.z;
            a.w += v.w;
        }
        return a;
    };
    /* With glu the shares are of the 64 gate rows, each with its up row. */
    const int32_t share = glu ? 64 : BM;
    const int32_t r0 = rank * share / splits, r1 = (rank + 1) * share / splits, nr = r1 - r0;
    for (int32_t u = tid; u < nr * (WGMMA_MAX_N / 4); u += WG_THREADS) {
        const int32_t r = r0 + u % nr, c4 = u / nr;
        const float4 a = sum_ranks(r, c4);
        const float av[4] = {a.x, a.y, a.z, a.w};
        if (glu) {
            const float4 b = sum_ranks(r + 64, c4);
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (4 * c4 + e < n)
                    glu_put(y, obf, (int64_t)(4 * c4 + e) * glu + row0 + r, av[e], bv[e]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (4 * c4 + e < n) y[(int64_t)(4 * c4 + e) * rows + row0 + r] = av[e];
        }
    }
    cl.sync(); /* no block leaves while another reads its sums */
#endif
}

/* ---- host ------------------------------------------------------------------ */

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    static bool tried = false;
    if (!tried) {
        tried = true;
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        cudaGetLastError();
    }
    return fn;
}

/* A row-major bf16 matrix [outer][inner] read in boxes of box_outer rows of
 * WG_BK columns, 128-byte swizzle; rows past outer read as zeros. */
static is_status tensor_map(CUtensorMap *m, const void *p, int64_t inner, int64_t outer,
                            uint32_t box_outer) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
    if (!fn) return is_error_set(IS_ERR_UNSUPPORTED, "cuda wgmma gemm: no cuTensorMapEncodeTiled");
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)inner * 2};
    const cuuint32_t box[2] = {WG_BK, box_outer}, estr[2] = {1, 1};
    const CUresult r =
        fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims, strides, box, estr,
           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return is_error_set(IS_ERR_INTERNAL, "cuda wgmma gemm: cuTensorMapEncodeTiled failed (%d)",
                            (int)r);
    return IS_OK;
}

bool cuda_sm90a_runs(void) {
    static int ok = -1;
    if (ok < 0) {
        cudaFuncAttributes a;
        ok = cudaFuncGetAttributes(&a, wgmma_gemm_kernel<1, 8>) == cudaSuccess;
        cudaGetLastError();
    }
    return ok == 1;
}

/* The shared memory a block of this shape takes. */
static size_t wgmma_smem(int32_t mb, int32_t stages) {
    return (size_t)stages * (64 * mb * 128 + WGMMA_MAX_N * 128) + 16 * (size_t)stages + 1024;
}

template <int MB, int STAGES>
static is_status wgmma_launch(cudaStream_t s, float *y, const CUtensorMap &tw,
                              const CUtensorMap &tx, int32_t n, int64_t rows, int64_t cols,
                              int32_t splits, bool pdl, bool trigger, int32_t glu = 0,
                              __nv_bfloat16 *obf = NULL) {
    const size_t smem = wgmma_smem(MB, STAGES);
    const int32_t row_blocks = (int32_t)(glu ? glu / 64 : rows / (64 * MB));
    const int32_t kt_total = (int32_t)(cols / WG_BK);
    CUDA_CHECK(cuda_launch_ex(wgmma_gemm_kernel<MB, STAGES>,
                              dim3((unsigned)row_blocks, (unsigned)splits), dim3(WG_THREADS), smem,
                              s, dim3(1, (unsigned)splits, 1), pdl, tw, tx, y, n, (int32_t)rows,
                              kt_total, splits, (int32_t)trigger, glu, obf));
    return IS_OK;
}

int32_t cuda_wgmma_blocks_per_sm(int32_t mb, int32_t stages) {
    return wgmma_smem(mb, stages) <= 114 * 1024 ? 2 : 1;
}

/* Every (mb, stages) compiled: one block an SM with the most stages, two
 * an SM (under 114 KiB each), and the defaults. */
#define WGMMA_VARIANTS(X) X(1, 8) X(1, 16) X(2, 5) X(2, 6) X(2, 10) X(4, 3) X(4, 5) X(4, 6)

static const cuda_wgmma_cfg k_variants[] = {
#define X(MB_, ST_) {MB_, ST_, 0},
    WGMMA_VARIANTS(X)
#undef X
};

is_status cuda_wgmma_prepare(void) {
    static bool done = false;
    if (done || !cuda_sm90a_runs()) return IS_OK;
#define X(MB_, ST_)                                                                                \
    CUDA_CHECK(cudaFuncSetAttribute(wgmma_gemm_kernel<MB_, ST_>,                                   \
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,                   \
                                    (int)wgmma_smem(MB_, ST_)));
    WGMMA_VARIANTS(X)
#undef X
    done = true;
    return IS_OK;
}

const cuda_wgmma_cfg *cuda_wgmma_variants(int *count) {
    *count = (int)(sizeof k_variants / sizeof k_variants[0]);
    return k_variants;
}

/* The current device's SMs, asked once (as skinny.cu's plan does: a process
 * serves from one kind of GPU). */
static int32_t sm_count(void) {
    static int32_t n_sms = 0;
    if (n_sms == 0) {
        int v = 0, dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            v = 0;
        cudaGetLastError();
        n_sms = v > 0 ? v : 132;
    }
    return n_sms;
}

/* Column ranges for row_blocks blocks while the grid stays one block an SM
 * and each range keeps at least 4 stages of columns. */
static int32_t default_splits(int64_t row_blocks, int64_t kt_total) {
    int32_t splits = 1;
    while (splits < 8 && row_blocks * (splits + 1) <= sm_count() && kt_total / (splits + 1) >= 4)
        splits++;
    return splits;
}

/* The default block shape, the fastest of a sweep on the H200 on each of
 * the 8B layer's products at 30 rows: the smallest block of weight rows
 * (64, 128, 256) whose row blocks are at most one an SM, with the stages
 * that let two blocks share an SM (the next kernel's may start beside),
 * and default_splits. mb 0: none fits (more than 256 rows an SM). */
static cuda_wgmma_cfg default_cfg(int64_t rows, int64_t cols) {
    static const cuda_wgmma_cfg shapes[] = {{1, 8, 0}, {2, 5, 0}, {4, 3, 0}};
    for (cuda_wgmma_cfg c : shapes) {
        const int64_t bm = 64 * (int64_t)c.mb;
        if (rows % bm != 0 || rows / bm > sm_count()) continue;
        c.splits = default_splits(rows / bm, cols / WG_BK);
        return c;
    }
    return cuda_wgmma_cfg{0, 0, 0};
}

bool cuda_wgmma_supports(int32_t n, int64_t rows, int64_t cols) {
    return n >= 1 && n <= WGMMA_MAX_N && rows > 0 && rows <= INT32_MAX && cols > 0 &&
           cols % WG_BK == 0 && default_cfg(rows, cols).mb != 0 && encode_fn() && cuda_sm90a_runs();
}

is_status cuda_wgmma_gemm(cudaStream_t s, float *y, const __nv_bfloat16 *w, const __nv_bfloat16 *x,
                          int32_t n, int64_t rows, int64_t cols, bool pdl, bool trigger,
                          const cuda_wgmma_cfg *cfg) {
    if (n < 1 || n > WGMMA_MAX_N || rows <= 0 || rows > INT32_MAX || cols <= 0 ||
        cols % WG_BK != 0 || !cuda_aligned16(w) || !cuda_aligned16(x))
        return is_error_set(IS_ERR_INVALID_ARG, "cuda wgmma gemm: n %d, %lld x %lld", n,
                            (long long)rows, (long long)cols);
    const int64_t kt_total = cols / WG_BK;
    cuda_wgmma_cfg c = cfg ? *cfg : default_cfg(rows, cols);
    if (c.mb == 0)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda wgmma gemm: %lld rows take no block shape",
                            (long long)rows);
    const int64_t bm = 64 * (int64_t)c.mb;
    if (rows % bm != 0)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda wgmma gemm: %lld rows in blocks of %lld",
                            (long long)rows, (long long)bm);
    if (c.splits == 0) c.splits = default_splits(rows / bm, kt_total);
    is_status st = cuda_wgmma_prepare();
    if (st != IS_OK) return st;
    if (c.splits < 1 || c.splits > 8 || c.splits > kt_total)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda wgmma gemm: %d column ranges of %lld",
                            c.splits, (long long)kt_total);
    CUtensorMap tw, tx;
    st = tensor_map(&tw, w, cols, rows, (uint32_t)bm);
    if (st == IS_OK) st = tensor_map(&tx, x, cols, n, WGMMA_MAX_N);
    if (st != IS_OK) return st;
#define X(MB_, ST_)                                                                                \
    if (c.mb == MB_ && c.stages == ST_)                                                            \
        return wgmma_launch<MB_, ST_>(s, y, tw, tx, n, rows, cols, c.splits, pdl, trigger);
    WGMMA_VARIANTS(X)
#undef X
    return is_error_set(IS_ERR_INVALID_ARG,
                        "cuda wgmma gemm: no kernel for %d x 64 rows, %d stages", c.mb, c.stages);
}

bool cuda_wgmma_swiglu_supports(int32_t n, int64_t ffn, int64_t cols) {
    return n >= 1 && n <= WGMMA_MAX_N && ffn > 0 && ffn % 64 == 0 && ffn <= INT32_MAX / 2 &&
           ffn / 64 <= 2 * (int64_t)sm_count() && cols > 0 && cols % WG_BK == 0 &&
           default_cfg(2 * ffn, cols).mb != 0 && encode_fn() && cuda_sm90a_runs();
}

is_status cuda_wgmma_swiglu(cudaStream_t s, float *y, __nv_bfloat16 *obf, const __nv_bfloat16 *w,
                            const __nv_bfloat16 *x, int32_t n, int64_t ffn, int64_t cols,
                            bool pdl) {
    if (!cuda_wgmma_swiglu_supports(n, ffn, cols) || !cuda_aligned16(w) || !cuda_aligned16(x))
        return is_error_set(IS_ERR_INVALID_ARG, "cuda wgmma swiglu: n %d, ffn %lld, cols %lld", n,
                            (long long)ffn, (long long)cols);
    is_status st = cuda_wgmma_prepare();
    if (st != IS_OK) return st;
    /* The column ranges of the stacked product on its own, so that each
     * gate and up value is the same sum as there (the same bits). */
    const int32_t splits = default_cfg(2 * ffn, cols).splits;
    CUtensorMap tw, tx;
    st = tensor_map(&tw, w, cols, 2 * ffn, 64);
    if (st == IS_OK) st = tensor_map(&tx, x, cols, n, WGMMA_MAX_N);
    if (st != IS_OK) return st;
    return wgmma_launch<2, 5>(s, y, tw, tx, n, ffn, cols, splits, pdl, false, (int32_t)ffn, obf);
}

/*
 * flash_kernel: the tiled attention's kernel (flash.cuh), private to
 * flash.cu, which instantiates it on mma.sync for any sm_90 build, and
 * flash_wgmma.cu, which instantiates it on wgmma (the WG engine) in the
 * sm_90a library; one body, so both engines share the tiling, the online
 * softmax and the merges, and differ only in how S and P V are multiplied
 * and how the K/V tiles sit in shared memory.
 *
 * Fragments are those of mma.sync m16n8k16 (bf16 in, f32 out). With
 * g = lane / 4 and c = lane % 4, a thread holds rows g and g + 8 of its
 * warp's 16, and columns 2c, 2c + 1 of each 8-wide tile of S and O; the
 * accumulator layout of S is the A-operand layout of P once pairs are
 * packed to bf16, so P never leaves registers. K tiles are read with
 * ldmatrix (keys are the B operand's columns), V tiles with ldmatrix.trans.
 * A row's softmax statistics are reduced over the 4 threads of its quad.
 */
#ifndef IS_CUDA_FLASH_KERNEL_CUH
#define IS_CUDA_FLASH_KERNEL_CUH

#include "flash.cuh"

#include <cooperative_groups.h>
#include <math.h>

namespace cg = cooperative_groups;

#define FLASH_STAGES 2 /* K/V tiles in shared memory: one used, the next in flight */

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* 2^x by the SFU's instruction alone. exp2f gives the same bits wherever
 * 2^x >= 2^-126; below, it halves x, exponentiates and squares so that the
 * result comes out subnormal, which costs a compare, two predicated
 * multiplies and a predicate per element of a tile (the softmax had more
 * predicates live than the warp has, and ptxas spilled them to registers:
 * ~200 of a wide tile's ~1,100 instructions a thread). Here such a weight
 * is 0: next to the row's largest weight, 1, it was below f32's precision. */
static __device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ void mma_bf16(float *d, const uint32_t *a, uint32_t b0,
                                                uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 16 bytes global -> shared without passing through registers; zeros when
 * !in (src-size 0). */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, bool in) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src),
                 "r"(in ? 16 : 0));
}

static __device__ __forceinline__ void ldsm_x4(uint32_t *r, const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t *r, const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* ---- wgmma (sm_90a; the WG engine) ----------------------------------------
 * The K and V tiles of the WG engine are 128-byte-swizzled: a tile of BN
 * keys is D / 64 chunks of [BN keys][64 columns], 128-byte rows, 8-row
 * groups 1024 bytes apart, the 16-byte unit u of row r at unit u ^ (r % 8)
 * (TMA's CU_TENSOR_MAP_SWIZZLE_128B, written here by cp.async). K is then
 * S = Q K^T's K-major B operand (columns contiguous) and V is O += P V's
 * N-major B operand (the same rows, transposed by the instruction). Q's tile
 * is S's A operand, stored the same way once a block; P comes from
 * registers in the mma.sync A-fragment layout, which is wgmma's register
 * layout for A, and S and O are wgmma's accumulators in the layout of
 * mma.sync's, so the softmax and the merges are shared. */
/* The byte offset of 16-byte unit u (0 .. D / 8 - 1) of row r in a tile
 * of ROWS rows (its 64-column chunks ROWS * 128 bytes apart). */
template <int ROWS> static __device__ __forceinline__ uint32_t swz_offset(int r, int u) {
    return (uint32_t)((u >> 3) * (ROWS * 128) + r * 128 + (((u & 7) ^ (r & 7)) << 4));
}

/* Shared-memory matrix descriptor, 128-byte swizzle (mode 1 in bits 62-63):
 * lbo the byte distance between 64-column chunks (N-major), sbo between
 * 8-row groups. */
static __device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32) | ((uint64_t)1 << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_WG_ASM 1
#endif

static __device__ __forceinline__ void wg_fence() {
#ifdef FLASH_WG_ASM
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_fence_proxy() {
#ifdef FLASH_WG_ASM
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_commit() {
#ifdef FLASH_WG_ASM
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_wait() {
#ifdef FLASH_WG_ASM
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_commit_wait() {
    wg_commit();
    wg_wait();
}

/* The compiler sees wgmma as an ordinary asm statement that writes its
 * accumulators and reads its A registers at once; the instruction does both
 * asynchronously, until wgmma.wait_group. These empty statements tie the
 * registers to points before the issue and after the wait, so that no
 * accumulator is read (or A register reused) in between, as CUTLASS's
 * warpgroup_fence_operand does. (They were not the cause of the wrong D = 64
 * results the first wgmma build gave: Q's tile in the kernel below says what was.) */
template <int N> static __device__ __forceinline__ void wg_pin(float *d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
static __device__ __forceinline__ void wg_pin(uint32_t *a) {
    asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3])::"memory");
}

#define WG_R4(i)  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_R16(i) WG_R4(i), WG_R4(i + 4), WG_R4(i + 8), WG_R4(i + 12)
/* d[64 x N] += A[64 x 16] B[16 x N], A in registers (a: this thread's 4
 * words of the warpgroup's fragment), B N-major by descriptor: P V. */
template <int N>
static __device__ __forceinline__ void wg_mma_rs(float *d, const uint32_t *a, uint64_t db) {
#ifdef FLASH_WG_ASM
    if constexpr (N == 64) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                     "{%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
                     : WG_R16(0), WG_R16(16)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    } else {
        static_assert(N == 128, "wg_mma_rs: N is the head size, 64 or 128");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                     "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                     "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                     "{%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_R16(0), WG_R16(16), WG_R16(32), WG_R16(48)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    }
#else
    __trap(); /* the WG engine is built for sm_90a only (flash_wgmma.cu) */
#endif
}
/* d[64 x N] += A[64 x 16] B[16 x N], A and B K-major by descriptor. */
template <int N>
static __device__ __forceinline__ void wg_mma_ss(float *d, uint64_t da, uint64_t db) {
#ifdef FLASH_WG_ASM
    if constexpr (N == 32) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
                     "%16, %17, p, 1, 1, 0, 0;\n}\n"
                     : WG_R16(0)
                     : "l"(da), "l"(db));
    } else {
        static_assert(N == 64, "wg_mma_ss: N is 32 or 64");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                     "%32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WG_R16(0), WG_R16(16)
                     : "l"(da), "l"(db));
    }
#else
    __trap(); /* the WG engine is built for sm_90a only (flash_wgmma.cu) */
#endif
}
#undef WG_R16
#undef WG_R4

/* The kernel's dynamic shared memory: the K/V stages (WG: unpadded,
 * swizzled, then Q's tile, plus 1024 bytes to align them), or what the
 * merges after the loop take in them, whichever is more. */
template <int D, int BM, int STAGES, int KS, bool WG, int BN>
__host__ __device__ constexpr size_t flash_smem_bytes() {
    /* WG: the stages, then Q's tile */
    constexpr size_t stages =
        (size_t)STAGES * 2 * BN * (WG ? D : D + 8) * 2 + (WG ? (size_t)BM * D * 2 : 0);
    constexpr size_t merges = (size_t)KS * (BM / 16) * 32 * (D / 8 / KS * 4 + 4) * sizeof(float) +
                              (size_t)BM * (D + 4) * sizeof(float);
    constexpr size_t need = (stages > merges ? stages : merges) + (WG ? 1024 : 0);
    /* Two key parts: one block an SM, which registers alone no longer
     * ensure on the wgmma engine (128 a thread since Q's tile moved to shared
     * memory). Two of them on one SM made a short query's attention slower
     * (the plan's 7 splits in a cluster 20.4 us a layer at k = 50, against
     * 6 at one block an SM 18.5): its key tiles are chains
     * of latency, which a second block on the SM lengthens. */
    constexpr size_t one_an_sm = 120 * 1024;
    return KS == 2 && need < one_an_sm ? one_an_sm : need;
}

/* Phase timestamps (cuda_flash_set_trace; NULL: none): thread 0 of each
 * block writes FLASH_TRACE_SLOTS values at trace + block * SLOTS, block =
 * (split * gridDim.y + kv head) * gridDim.x + tile. */
static __device__ unsigned long long *g_flash_trace;

static __device__ __forceinline__ unsigned long long global_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* The cluster merge's sums (flash_kernel, below): acc[u] = sum over the
 * n_splits splits, in split order, of split z's float4 chunk tid + u *
 * THREADS of this block's rows (from r0; PLD = D + 4 floats a row) times
 * the row's weight for z (wrow, WS floats a row). A split's loads are
 * unconditional (a chunk past n_u reads chunk 0 and its sum is not used),
 * so none waits for another; two splits a step. (Every split unrolled, one
 * body for each split count, made the kernel's one-time code long enough
 * that its instruction fetches stalled the output after it, in Nsight
 * Compute's stall reasons.) */
template <int UMAX, int D, int WS, int THREADS>
static __device__ __forceinline__ void cluster_sum(float4 *acc, cg::cluster_group &cl, float *mine,
                                                   const float *wrow, int32_t r0, int32_t n_u,
                                                   int32_t n_splits) {
    constexpr int CH = D / 4, PLD = D + 4;
    int32_t off[UMAX], wi[UMAX];
#pragma unroll
    for (int u = 0; u < UMAX; u++) {
        const int32_t i = (int32_t)threadIdx.x + u * THREADS, ic = i < n_u ? i : 0;
        off[u] = (r0 + ic / CH) * PLD + (ic % CH) * 4;
        wi[u] = (ic / CH) * WS;
        acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll 2
    for (int z = 0; z < n_splits; z++) {
        const float *pz = cl.map_shared_rank(mine, z);
#pragma unroll
        for (int u = 0; u < UMAX; u++) {
            const float4 v = *reinterpret_cast<const float4 *>(pz + off[u]);
            const float wz = wrow[wi[u] + z];
            acc[u].x += v.x * wz;
            acc[u].y += v.y * wz;
            acc[u].z += v.z * wz;
            acc[u].w += v.w * wz;
        }
    }
}

/* WG: S and P V on wgmma (one warpgroup a key part: BM = 64; sm_90a only,
 * instantiated in flash_wgmma.cu), else on mma.sync. BN keys a tile:
 * FLASH_BN, or FLASH_BN_WIDE with two key parts (flash.cuh). */
template <int D, int BM, int STAGES, int KS, bool WG, int BN>
static __global__ void __launch_bounds__(BM * 2 * KS)
    flash_kernel(float *out, const float *q, const __nv_bfloat16 *k_cache,
                 const __nv_bfloat16 *v_cache, const int32_t *flat, const int32_t *tiles,
                 int32_t n_heads, int32_t n_kv_heads, int32_t block_size, float scale_log2,
                 int32_t n_splits, bool cluster, float *partial, __nv_bfloat16 *obf, int64_t out_n,
                 bool obf_split, const int32_t *mem, float mem_mul, float mem_add) {
    /* A warp per 16 rows and 1/KS of each key tile: with KS = 2, two warps
     * take a tile's halves for the same rows and merge at the end, so a
     * tile costs half the chain of dependent steps (see flash.cuh). */
    constexpr int THREADS = BM * 2 * KS;
    constexpr int LD = WG ? D : D + 8; /* bf16 per smem row (WG: swizzled, not padded) */
    constexpr int NT = BN / 8 / KS;    /* 8-key tiles of S a warp takes */
    constexpr int DT = D / 8;          /* 8-wide tiles of O */
    constexpr int STAGE = 2 * BN * LD; /* bf16 of one stage's K and V */
    static_assert(!WG || BM == 64, "flash: the WG engine takes one warpgroup of rows");
    /* STAGES stages of K and V tiles: tiles kt + 1 .. kt + STAGES - 1 are
     * in flight while kt is used. */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* The swizzle's pattern repeats every 1024 bytes: WG's stages start on one. */
    unsigned char *const smem =
        WG ? smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u)
           : smem_raw;
    __nv_bfloat16 *const sKV = reinterpret_cast<__nv_bfloat16 *>(smem);
    /* Launched as a dependent, the kernel reads before its wait only its
     * tile (a host upload, complete before this kernel can start). */

    unsigned long long *const tr =
        g_flash_trace && threadIdx.x == 0
            ? g_flash_trace +
                  (((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) *
                      FLASH_TRACE_SLOTS
            : nullptr;
    if (tr) {
        tr[FLASH_TRACE_ENTRY_NS] = global_ns();
        tr[FLASH_TRACE_ENTRY] = clock64();
        tr[FLASH_TRACE_WAIT] = tr[FLASH_TRACE_COMPUTE] = tr[FLASH_TRACE_TILES] = 0;
    }
    const int32_t tile = blockIdx.x, kh = blockIdx.y, split = blockIdx.z;
    const int32_t *tl = tiles + FLASH_TILE_INTS * tile;
    const int32_t t0 = tl[0], n = tl[1], bt_at = tl[2], pos0 = tl[3];
    /* The tile's memory keys [mb, me) (cuda_flash_attention_mem), scored
     * x * mem_mul + mem_add in the log2 domain by rows after them; a host
     * upload, like the tile, so read before the wait. */
    const int32_t mb = mem ? mem[2 * tile] : 0, me = mem ? mem[2 * tile + 1] : 0;
    const int32_t G = n_heads / n_kv_heads;
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = (tid >> 5) % (BM / 16); /* the warp's 16 rows */
    const int kq = (tid >> 5) / (BM / 16);   /* its part of each key tile */
    const int g = lane >> 2, c = lane & 3;
    const int32_t *bt = flat + bt_at;
    const int64_t q_stride = (int64_t)n_heads * D;

    /* This thread's two rows (h = 0: row g, h = 1: row g + 8 of the warp's
     * 16): the query token and head, and the last key it may see (-1: a
     * padding row past the tile's tokens). */
    int32_t last[2];
    const float *qrow[2];
    for (int h = 0; h < 2; h++) {
        const int r = warp * 16 + g + 8 * h;
        const int32_t ti = r / G;
        last[h] = ti < n ? pos0 + ti : -1;
        qrow[h] = ti < n ? q + (int64_t)(t0 + ti) * q_stride + (int64_t)(kh * G + r % G) * D : NULL;
    }
    const int32_t n_keys = pos0 + n; /* the last token sees keys [0, pos0 + n - 1] */
    const int32_t n_kt = (n_keys + BN - 1) / BN;
    const int32_t per = (n_kt + n_splits - 1) / n_splits;
    const int32_t kt0 = split * per, kt1 = min(n_kt, kt0 + per);
    const int32_t warp_last = max(last[0], last[1]); /* per thread; the warp's max below */
    int32_t wl = warp_last;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) wl = max(wl, __shfl_xor_sync(FULL_MASK, wl, off));

    /* The block size is a power of two (cuda_flash_supports): a key's page
     * and slot by shift and mask (divisions were ~20 instructions a copy). */
    const int bs_shift = __ffs(block_size) - 1;
    /* A key's element offset: its page's, then this head's and its slot's
     * within the page (one 64-bit product a copy). */
    const int64_t page_elems = (int64_t)n_kv_heads * block_size * D;
    const int32_t head_elems = kh * block_size * D;
    pdl_wait();

    /* Copies tile kt into stage `st` with cp.async (16 bytes a copy, keys
     * past the last zero-filled); unrolled, so the block-table reads overlap
     * (on the wgmma engine they also run beside S, issued before them).
     * (Reading the pages ahead, into registers (on mma.sync) or into
     * shared memory once a block, measured no faster.) The caller
     * commits the group. */
    auto load_tile = [&](int32_t kt, int st) {
        __nv_bfloat16 *dK = sKV + (size_t)st * STAGE, *dV = dK + BN * LD;
#pragma unroll
        for (int it = 0; it < BN * (D / 8) / THREADS; it++) {
            const int i = tid + it * THREADS;
            const int r = i / (D / 8), d = (i % (D / 8)) * 8;
            const int32_t j = kt * BN + r;
            const bool in = j < n_keys;
            const int32_t page = j >> bs_shift, slot = j & (block_size - 1);
            const int64_t off = in ? bt[page] * page_elems + (head_elems + slot * D + d) : 0;
            if constexpr (WG) {
                const uint32_t at = swz_offset<BN>(r, d / 8);
                cp_async16(reinterpret_cast<unsigned char *>(dK) + at, k_cache + off, in);
                cp_async16(reinterpret_cast<unsigned char *>(dV) + at, v_cache + off, in);
            } else {
                cp_async16(dK + r * LD + d, k_cache + off, in);
                cp_async16(dV + r * LD + d, v_cache + off, in);
            }
        }
    };
    /* One commit group per tile, empty past kt1, so that before tile kt is
     * used exactly kt - kt0 + STAGES - 1 groups are committed and waiting
     * for all but the last STAGES - 2 means tile kt has landed. */
    /* Q's reads are issued before the other copies, so that they are in
     * flight while those wait on their block-table reads (the prologue was
     * 3.2-3.6 us of dependent global reads in a phase trace). */
    float2 qlo[D / 16][2], qhi[D / 16][2];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            qlo[ks][h] = qhi[ks][h] = make_float2(0.f, 0.f);
            if (qrow[h]) {
                qlo[ks][h] = *reinterpret_cast<const float2 *>(qrow[h] + ks * 16 + 2 * c);
                qhi[ks][h] = *reinterpret_cast<const float2 *>(qrow[h] + ks * 16 + 8 + 2 * c);
            }
        }
    }
    for (int i = 0; i < STAGES - 1; i++) {
        if (kt0 + i < kt1) load_tile(kt0 + i, i);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    /* Q as A fragments, rounded to bf16: qa[k-step] = rows g / g+8, columns
     * 16 ks + 2c (+1) and 16 ks + 8 + 2c (+1). */
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            qa[ks][h] = pack_bf16(qlo[ks][h].x, qlo[ks][h].y);
            qa[ks][2 + h] = pack_bf16(qhi[ks][h].x, qhi[ks][h].y);
        }
    }
    /* WG: Q's tile, [BM rows][D] bf16 swizzled as the K tiles, after the
     * stages: S's A operand from shared memory. (From registers, as qa, ptxas
     * gave the D = 64 one-key-part kernel's P fragments the registers of qa
     * while the key loop still needed them: its SASS read P as Q from the
     * second tile on; the PTX keeps them apart.) The first key
     * tile's fence and barrier publish it to the async proxy. */
    const uint32_t qsb = (uint32_t)__cvta_generic_to_shared(sKV + (size_t)STAGES * STAGE);
    /* WG: the descriptors of Q's tile and of stage 0's K and V rows of this
     * key part, once; a k-step's or a stage's is then an addition to the
     * address field (16-byte units; every address of the block's shared
     * memory fits the field's 14 bits, so no carry leaves it). */
    constexpr uint32_t STAGE_DESC = STAGE * 2 / 16;
    const uint32_t kv0 = (uint32_t)__cvta_generic_to_shared(sKV) + kq * (BN / KS) * 128;
    const uint64_t dq = desc_sw128(qsb, 16, 1024), dk0 = desc_sw128(kv0, 16, 1024),
                   dv0 = desc_sw128(kv0 + BN * LD * 2, BN * 128, 1024);
    if constexpr (WG) {
        if (kq == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = warp * 16 + g + 8 * h;
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        const int col = ks * 16 + half * 8 + 2 * c; /* its unit: col / 8 */
                        const uint32_t at = swz_offset<BM>(r, col / 8) + (col % 8) * 2;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(qsb + at),
                                     "r"(qa[ks][2 * half + h]));
                    }
                }
        }
    }
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    if (tr) tr[FLASH_TRACE_PROLOGUE] = clock64();
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int32_t kt = kt0; kt < kt1; kt++) {
        const int st = (kt - kt0) % STAGES;
        unsigned long long t_top = tr ? clock64() : 0;
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        /* wgmma reads shared memory through the async proxy: this thread's
         * copies (generic proxy) must be made visible to it. */
        if constexpr (WG) wg_fence_proxy();
        /* Every thread's copies of tile kt have landed, and every warp is
         * done with the stage read in the previous iteration, which is
         * refilled next. */
        __syncthreads();
        if (tr) {
            const unsigned long long t = clock64();
            tr[FLASH_TRACE_WAIT] += t - t_top;
            tr[FLASH_TRACE_TILES] += 1;
            t_top = t;
        }
        /* This warp's keys of the tile: [kt * BN + k0, + BN / KS). */
        constexpr int KW = BN / KS;
        const int k0 = kq * KW;
        const __nv_bfloat16 *sK = sKV + (size_t)st * STAGE + k0 * LD,
                            *sV = sKV + (size_t)st * STAGE + BN * LD + k0 * LD;
        /* Every key it takes is after the warp's rows (WG: the warpgroup's,
         * which must all issue its instructions; the tile's last row's). */
        const bool past = kt * BN + k0 > (WG ? pos0 + n - 1 : wl);
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        if constexpr (WG) {
            /* S = Q K^T: 16 columns a step, 64 of them to a swizzled chunk;
             * issued before the next tile's copies, which it runs beside.
             * (Also where the warpgroup's keys are past its rows, and then
             * not used: under a branch ptxas serialises the wgmma.) */
            const uint64_t dk = dk0 + (uint64_t)(st * STAGE_DESC);
            wg_pin<NT * 4>(&s[0][0]);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                /* Q's chunks are BM rows apart, K's BN */
                const uint32_t aq = ((ks >> 2) * (BM * 128) + (ks & 3) * 32) >> 4;
                const uint32_t ak = ((ks >> 2) * (BN * 128) + (ks & 3) * 32) >> 4;
                wg_mma_ss<KW>(&s[0][0], dq + aq, dk + ak);
            }
            wg_commit();
        }
        if (kt + STAGES - 1 < kt1) load_tile(kt + STAGES - 1, (kt - kt0 + STAGES - 1) % STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        if constexpr (WG) {
            wg_wait();
            wg_pin<NT * 4>(&s[0][0]);
        }
        if (past) continue;
        if constexpr (!WG) {
            /* S = Q K^T: ldmatrix x4 gives the B fragments of two 8-key tiles. */
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
                for (int nt = 0; nt < NT; nt += 2) {
                    /* matrices: keys of tile nt x cols 16ks..+7, +8..+15; then tile nt+1 */
                    const int mi = lane >> 3, rr = lane & 7;
                    uint32_t b[4];
                    ldsm_x4(b, sK + ((nt + (mi >> 1)) * 8 + rr) * LD + ks * 16 + (mi & 1) * 8);
                    mma_bf16(s[nt], qa[ks], b[0], b[1]);
                    mma_bf16(s[nt + 1], qa[ks], b[2], b[3]);
                }
            }
        }

        /* Online softmax in the log2 domain; masked keys are -inf. Only a
         * tile that reaches past a row's last key needs the mask (the same
         * values either way; the per-element test was ~50 instructions). */
        /* A row's maximum in two chains of fmaxf (even and odd 8-key
         * tiles), joined at the end: the same value (fmaxf is exact), half
         * the chain's length. */
        float mx[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
        const bool mem_hit = mb < kt * BN + k0 + KW && kt * BN + k0 < me;
        if (kt * BN + k0 + KW - 1 <= min(last[0], last[1]) && !mem_hit) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float x = s[nt][e] * scale_log2;
                    s[nt][e] = x;
                    mx[e >> 1][nt & 1] = fmaxf(mx[e >> 1][nt & 1], x);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1;
                    const int32_t j = kt * BN + k0 + nt * 8 + 2 * c + (e & 1);
                    float x = j <= last[h] ? s[nt][e] * scale_log2 : -INFINITY;
                    if (mem_hit && j >= mb && j < me && last[h] >= me) x = x * mem_mul + mem_add;
                    s[nt][e] = x;
                    mx[h][nt & 1] = fmaxf(mx[h][nt & 1], x);
                }
        }
        /* The weights are 2^(x - m) on the SFU alone (ex2_ftz), and a row
         * whose keys are all masked (m = -inf, its x too) subtracts 0
         * instead, which gives 2^-inf = 0: the same weights as a per-element
         * test, without the predicate an element that test and exp2f's
         * handling of results under 2^-126 cost (see ex2_ftz). */
        float alpha[2], m_sub[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float x = fmaxf(mx[h][0], mx[h][1]);
            x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
            x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
            const float m_new = fmaxf(m[h], x);
            alpha[h] = m_new == -INFINITY ? 1.0f : ex2_ftz(m[h] - m_new);
            m[h] = m_new;
            m_sub[h] = m_new == -INFINITY ? 0.0f : m_new;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                const float p = ex2_ftz(s[nt][e] - m_sub[h]);
                s[nt][e] = p;
                rs[h] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; h++) l[h] = l[h] * alpha[h] + rs[h]; /* per-thread part of l */
        /* O is still +0 on the block's first tile, where alpha is 0 or 1:
         * its rescale would leave it so. */
        if (kt > kt0) {
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                o[dt][0] *= alpha[0];
                o[dt][1] *= alpha[0];
                o[dt][2] *= alpha[1];
                o[dt][3] *= alpha[1];
            }
        }

        /* O += P V: P's A fragment for keys 16kk..+15 is S tiles 2kk, 2kk+1;
         * ldmatrix.trans of V gives the B fragments of two 8-wide O tiles
         * (WG: V's rows of those keys, N-major, one instruction). */
        if constexpr (WG) {
            uint32_t pa[KW / 16][4];
#pragma unroll
            for (int kk = 0; kk < KW / 16; kk++) {
                pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
            const uint64_t dv = dv0 + (uint64_t)(st * STAGE_DESC);
            wg_pin<DT * 4>(&o[0][0]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KW / 16; kk++)
                wg_mma_rs<D>(&o[0][0], pa[kk], dv + ((16 * kk * 128) >> 4));
            wg_commit_wait();
            wg_pin<DT * 4>(&o[0][0]);
#pragma unroll
            for (int kk = 0; kk < KW / 16; kk++) wg_pin(pa[kk]);
        } else {
#pragma unroll
            for (int kk = 0; kk < KW / 16; kk++) {
                uint32_t pa[4];
                pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int dt = 0; dt < DT; dt += 2) {
                    /* matrices: keys 16kk..+7 and +8..+15 x cols of tile dt; then dt+1 */
                    const int mi = lane >> 3, rr = lane & 7;
                    uint32_t b[4];
                    ldsm_x4_trans(b,
                                  sV + (kk * 16 + (mi & 1) * 8 + rr) * LD + (dt + (mi >> 1)) * 8);
                    mma_bf16(o[dt], pa, b[0], b[1]);
                    mma_bf16(o[dt + 1], pa, b[2], b[3]);
                }
            }
        }
        if (tr) tr[FLASH_TRACE_COMPUTE] += clock64() - t_top;
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    }
    if (tr) tr[FLASH_TRACE_LOOP] = clock64();
    /* Past the loop the K/V stages are free: the key warps' merge uses
     * their first KS_BYTES, a cluster's merge the rows after them. */
    constexpr int DTK = DT / KS;   /* 8-wide tiles of O a key part keeps past its merge */
    constexpr int W = DTK * 4 + 4; /* floats a lane leaves its partner: O's half, m, l */
    constexpr size_t KS_BYTES = (size_t)KS * (BM / 16) * 32 * W * sizeof(float);
    /* Whether 8-wide O tile dt is this key part's to merge and write. */
    auto own = [&](int dt) { return KS == 1 || (dt < DTK) == (kq == 0); };
    constexpr int PLD = D + 4; /* floats a row of a cluster's partials (16-byte rows) */
    static_assert(KS_BYTES + (size_t)BM * PLD * sizeof(float) + (WG ? 1024 : 0) <=
                      flash_smem_bytes<D, BM, STAGES, KS, WG, BN>(),
                  "flash: merge buffers exceed the shared memory");
    asm volatile("cp.async.wait_group 0;\n" ::); /* (none is left in flight; cheap) */
    if (KS == 2) {
        /* The two key parts' warps of the same rows hold the same rows and
         * columns in the same lanes. Each leaves its partner the half of O
         * the partner keeps (the first part keeps the first DTK 8-wide
         * tiles) with its m and l, then merges its own half: both halves
         * at once, half the shared-memory traffic a thread. The same
         * expressions as one warp merging all of it (the first part's term
         * first); both compute the merged m and l. */
        float *const base = reinterpret_cast<float *>(smem);
        float *mo = base + (((size_t)kq * (BM / 16) + warp) * 32 + lane) * W;
        const float *po = base + (((size_t)(1 - kq) * (BM / 16) + warp) * 32 + lane) * W;
        __syncthreads();
        /* 16-byte pieces: a lane's W floats are 16-byte multiples (DTK * 4 + 4). */
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            if (!own(dt))
                *reinterpret_cast<float4 *>(mo + (dt % DTK) * 4) =
                    make_float4(o[dt][0], o[dt][1], o[dt][2], o[dt][3]);
        *reinterpret_cast<float4 *>(mo + DTK * 4) = make_float4(m[0], m[1], l[0], l[1]);
        __syncthreads();
        const float4 pml = *reinterpret_cast<const float4 *>(po + DTK * 4);
        const float pm[2] = {pml.x, pml.y}, pl[2] = {pml.z, pml.w};
        float a0[2], a1[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            /* part 0's statistics, part 1's */
            const float m0 = kq == 0 ? m[h] : pm[h], m1 = kq == 0 ? pm[h] : m[h];
            const float l0 = kq == 0 ? l[h] : pl[h], l1 = kq == 0 ? pl[h] : l[h];
            const float mn = fmaxf(m0, m1);
            a0[h] = m0 == -INFINITY ? 0.0f : exp2f(m0 - mn);
            a1[h] = m1 == -INFINITY ? 0.0f : exp2f(m1 - mn);
            l[h] = l0 * a0[h] + l1 * a1[h];
            m[h] = mn;
        }
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            if (own(dt)) {
                const float4 p4 = *reinterpret_cast<const float4 *>(po + (dt % DTK) * 4);
                const float other[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float o0 = kq == 0 ? o[dt][e] : other[e];
                    const float o1 = kq == 0 ? other[e] : o[dt][e];
                    o[dt][e] = o0 * a0[e >> 1] + o1 * a1[e >> 1];
                }
            }
    }
    if (tr) tr[FLASH_TRACE_KS_MERGE] = clock64();
    if (n_splits == 1) {
        if (tr) tr[FLASH_TRACE_EXIT_NS] = global_ns();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (last[h] < 0) continue;
            const int r = warp * 16 + g + 8 * h;
            const int64_t at = (int64_t)(t0 + r / G) * q_stride + (int64_t)(kh * G + r % G) * D;
            float *dst = out + at;
            const float inv = 1.0f / l[h];
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                if (!own(dt)) continue;
                const float y0 = o[dt][2 * h] * inv, y1 = o[dt][2 * h + 1] * inv;
                *reinterpret_cast<float2 *>(dst + dt * 8 + 2 * c) = make_float2(y0, y1);
                if (obf) {
                    bf16_copy_put(obf, out_n, at + dt * 8 + 2 * c, y0, obf_split);
                    bf16_copy_put(obf, out_n, at + dt * 8 + 2 * c + 1, y1, obf_split);
                }
            }
        }
        return;
    }
    if (cluster) {
        /* The splits of this (tile, KV head) are one thread-block cluster:
         * each leaves its unnormalised rows in shared memory, then merges
         * its share of the rows from all of them (distributed shared
         * memory), in split order whichever block does it. */
        float *mine = reinterpret_cast<float *>(smem + KS_BYTES);
        __syncthreads(); /* every warp is done with the K/V stages these rows overwrite */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float *pr = mine + (warp * 16 + g + 8 * h) * PLD;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                if (own(dt))
                    *reinterpret_cast<float2 *>(pr + dt * 8 + 2 * c) =
                        make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
            if (c == 0 && kq == 0) {
                pr[D] = m[h];
                pr[D + 1] = l[h];
            }
        }
        cg::cluster_group cl = cg::this_cluster();
        cl.sync(); /* every block's rows written */
        if (tr) tr[FLASH_TRACE_CLUSTER_SYNC] = clock64();
        const int32_t rows = n * G, per_rows = (rows + n_splits - 1) / n_splits;
        const int32_t r0 = split * per_rows, r1 = min(rows, r0 + per_rows);
        /* First each of this block's rows gets its splits' weights and
         * 1 / denominator, once (thread per row; the first KS_BYTES are
         * free again: the key warps' merge is done), then every thread
         * sums float4 chunks with them, the remote loads of a chunk all
         * independent (a phase trace: 2.2-2.5 us when each chunk read the
         * statistics itself). */
        constexpr int WS = FLASH_CLUSTER_MAX + 1; /* floats a row: weights, then 1 / den */
        static_assert((size_t)BM * WS * sizeof(float) <= KS_BYTES, "flash: merge weights");
        float *wrow = reinterpret_cast<float *>(smem);
        for (int32_t r = r0 + tid; r < r1; r += THREADS) {
            float mz[FLASH_CLUSTER_MAX], lz[FLASH_CLUSTER_MAX], mx = -INFINITY;
#pragma unroll
            for (int z = 0; z < FLASH_CLUSTER_MAX; z++) {
                mz[z] = -INFINITY;
                lz[z] = 0.0f;
                if (z < n_splits) {
                    const float *pz = cl.map_shared_rank(mine, z) + r * PLD;
                    mz[z] = pz[D];
                    lz[z] = pz[D + 1];
                    mx = fmaxf(mx, mz[z]);
                }
            }
            float den = 0.0f;
            float *w = wrow + (r - r0) * WS;
#pragma unroll
            for (int z = 0; z < FLASH_CLUSTER_MAX; z++) {
                const float wz = mz[z] == -INFINITY ? 0.0f : exp2f(mz[z] - mx); /* empty: 0 */
                den += lz[z] * wz;
                w[z] = wz;
            }
            w[FLASH_CLUSTER_MAX] = 1.0f / den;
        }
        __syncthreads();
        constexpr int CH = D / 4; /* float4 chunks a row */
        /* A thread's chunks (at most UMAX: a block merges at most BM / 2
         * rows, since n_splits >= 2), split by split, with no store and no
         * branch between the remote loads (cluster_sum). (A loop that
         * stored each chunk before the next one's loads, and one that put
         * each load under its own branch, took 2.4 and 3.2 us, each remote load
         * waited for before the next.) The sums in split order, as before. */
        constexpr int UMAX = (BM / 2 * CH + THREADS - 1) / THREADS;
        const int32_t n_u = (r1 - r0) * CH;
        float4 acc[UMAX];
        cluster_sum<UMAX, D, WS, THREADS>(acc, cl, mine, wrow, r0, n_u, n_splits);
        /* This block has read the others' rows: it may leave once they
         * have read its own (the wait below), and writes its output first. */
        asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
        if (tr) tr[FLASH_TRACE_MERGED] = clock64();
#pragma unroll
        for (int u = 0; u < UMAX; u++) {
            const int32_t i = tid + u * THREADS;
            if (i >= n_u) continue;
            const int32_t r = r0 + i / CH, ch = i % CH;
            const float inv = wrow[(r - r0) * WS + FLASH_CLUSTER_MAX];
            const float4 y =
                make_float4(acc[u].x * inv, acc[u].y * inv, acc[u].z * inv, acc[u].w * inv);
            const int64_t at =
                (int64_t)(t0 + r / G) * q_stride + (int64_t)(kh * G + r % G) * D + ch * 4;
            *reinterpret_cast<float4 *>(out + at) = y;
            if (obf) {
                bf16_copy_put(obf, out_n, at, y.x, obf_split);
                bf16_copy_put(obf, out_n, at + 1, y.y, obf_split);
                bf16_copy_put(obf, out_n, at + 2, y.z, obf_split);
                bf16_copy_put(obf, out_n, at + 3, y.w, obf_split);
            }
        }
        /* no block leaves while another reads its rows */
        asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
        if (tr) {
            tr[FLASH_TRACE_END] = clock64();
            tr[FLASH_TRACE_EXIT_NS] = global_ns();
        }
        return;
    }
    if (tr) tr[FLASH_TRACE_EXIT_NS] = global_ns();
    /* Padding rows are not written: the merge reads only the tile's rows. */
    float *part = partial + (((int64_t)tile * n_kv_heads + kh) * n_splits + split) * BM * (D + 2);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (last[h] < 0) continue;
        const int r = warp * 16 + g + 8 * h;
        float *pr = part + r * (D + 2);
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            if (!own(dt)) continue;
            pr[dt * 8 + 2 * c] = o[dt][2 * h];
            pr[dt * 8 + 2 * c + 1] = o[dt][2 * h + 1];
        }
        if (c == 0 && kq == 0) {
            pr[D] = m[h];
            pr[D + 1] = l[h];
        }
    }
}

/* The kernel's type, the same for every instantiation. */
typedef void (*flash_fn)(float *, const float *, const __nv_bfloat16 *, const __nv_bfloat16 *,
                         const int32_t *, const int32_t *, int32_t, int32_t, int32_t, float,
                         int32_t, bool, float *, __nv_bfloat16 *, int64_t, bool, const int32_t *,
                         float, float);

/* flash_wgmma.cu: the WG engine's kernel for this head size, key warps and
 * keys a tile (FLASH_BN_WIDE with two key warps only),
 * or NULL where this GPU cannot run sm_90a code; and its trace pointer
 * (cuda_flash_set_trace sets both engines'). */
flash_fn cuda_flash_wgmma_kernel(int32_t head_dim, int32_t key_warps, int32_t key_tile);
is_status cuda_flash_wgmma_set_trace(unsigned long long *trace);

#endif

/*
 * flash: tiled paged attention on the tensor cores (see flash.cuh), in the
 * FlashAttention-2 arrangement: each warp owns 16 query rows (with two key
 * warps, the keys of its half of every tile) and keeps everything about
 * them in registers (its Q fragments, the S tile, the P fragments made from
 * it and the O accumulator); shared memory holds only the block's K and V
 * tiles, [BN][D+8] bf16 each (the padding puts the 8 rows an ldmatrix reads
 * in distinct banks), in STAGES stages so the next tiles load while one is
 * used, and at the end, with two key warps, the second half's state for
 * the merge. D = 128: 68 KiB a block of 64 rows (two stages; two blocks a
 * multiprocessor with one key warp, one with two).
 *
 * Fragments are those of mma.sync m16n8k16 (bf16 in, f32 out). With
 * g = lane / 4 and c = lane % 4, a thread holds rows g and g + 8 of its
 * warp's 16, and columns 2c, 2c + 1 of each 8-wide tile of S and O; the
 * accumulator layout of S is the A-operand layout of P once pairs are
 * packed to bf16, so P never leaves registers. K tiles are read with
 * ldmatrix (keys are the B operand's columns), V tiles with ldmatrix.trans.
 * A row's softmax statistics are reduced over the 4 threads of its quad.
 */
#include "flash.cuh"

#include <cooperative_groups.h>
#include <math.h>
#include <stdlib.h>

namespace cg = cooperative_groups;

bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads,
                         int32_t block_size) {
    if (head_dim != 64 && head_dim != 128) return false;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return false;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return false;
    return n_heads / n_kv_heads <= FLASH_BM;
}

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
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

/* Phase timestamps (cuda_flash_set_trace; NULL: none): thread 0 of each
 * block writes FLASH_TRACE_SLOTS values at trace + block * SLOTS, block =
 * (split * gridDim.y + kv head) * gridDim.x + tile. */
static __device__ unsigned long long *g_flash_trace;

static __device__ __forceinline__ unsigned long long global_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <int D, int BM, int STAGES, int KS>
static __global__ void __launch_bounds__(BM * 2 * KS)
    flash_kernel(float *out, const float *q, const __nv_bfloat16 *k_cache,
                 const __nv_bfloat16 *v_cache, const int32_t *flat, const int32_t *tiles,
                 int32_t n_heads, int32_t n_kv_heads, int32_t block_size, float scale_log2,
                 int32_t n_splits, bool cluster, float *partial,
                 __nv_bfloat16 *obf, int64_t out_n, bool obf_split, bool early) {
    /* A warp per 16 rows and 1/KS of each key tile: with KS = 2, two warps
     * take a tile's halves for the same rows and merge at the end, so a
     * tile costs half the chain of dependent steps (see flash.cuh). */
    constexpr int THREADS = BM * 2 * KS;
    constexpr int LD = D + 8; /* bf16 per smem row */
    constexpr int NT = FLASH_BN / 8 / KS; /* 8-key tiles of S a warp takes */
    constexpr int DT = D / 8;        /* 8-wide tiles of O */
    constexpr int STAGE = 2 * FLASH_BN * LD; /* bf16 of one stage's K and V */
    /* STAGES stages of K and V tiles: tiles kt + 1 .. kt + STAGES - 1 are
     * in flight while kt is used. */
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *const sKV = reinterpret_cast<__nv_bfloat16 *>(smem);
    /* Launched as a dependent: nothing before the wait, except, when early,
     * the copies of key tiles written before this forward (below). */
    if (!early) pdl_wait();

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
    const int32_t t0 = tl[0], n = tl[1], bt_at = tl[2], pos0 = tl[3], old_keys = tl[4];
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
    const int32_t n_kt = (n_keys + FLASH_BN - 1) / FLASH_BN;
    const int32_t per = (n_kt + n_splits - 1) / n_splits;
    const int32_t kt0 = split * per, kt1 = min(n_kt, kt0 + per);
    const int32_t warp_last = max(last[0], last[1]); /* per thread; the warp's max below */
    int32_t wl = warp_last;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) wl = max(wl, __shfl_xor_sync(FULL_MASK, wl, off));

    /* Copies tile kt into stage `st` with cp.async (16 bytes a copy, keys
     * past the last zero-filled); unrolled, so the block-table reads overlap.
     * (Reading the pages a tile ahead, so that no copy waits on its
     * block-table read, measured slower: run 28.) The caller commits the
     * group. */
    /* The block size is a power of two (cuda_flash_supports): a key's page
     * and slot by shift and mask (divisions were ~20 instructions a copy). */
    const int bs_shift = __ffs(block_size) - 1;
    auto load_tile = [&](int32_t kt, int st) {
        __nv_bfloat16 *dK = sKV + (size_t)st * STAGE, *dV = dK + FLASH_BN * LD;
#pragma unroll
        for (int it = 0; it < FLASH_BN * (D / 8) / THREADS; it++) {
            const int i = tid + it * THREADS;
            const int r = i / (D / 8), d = (i % (D / 8)) * 8;
            const int32_t j = kt * FLASH_BN + r;
            const bool in = j < n_keys;
            const int32_t page = j >> bs_shift, slot = j & (block_size - 1);
            const int64_t off =
                in ? (((int64_t)bt[page] * n_kv_heads + kh) * block_size + slot) * D + d : 0;
            cp_async16(dK + r * LD + d, k_cache + off, in);
            cp_async16(dV + r * LD + d, v_cache + off, in);
        }
    };
    /* One commit group per tile, empty past kt1, so that before tile kt is
     * used exactly kt - kt0 + STAGES - 1 groups are committed and waiting
     * for all but the last STAGES - 2 means tile kt has landed. Early: the
     * first tiles whose keys all precede the sequence's first position in
     * the batch (written before this forward, not by the kernel before)
     * are copied before the wait, while that kernel ends. */
    int pre = 0;
    if (early) {
        for (; pre < STAGES - 1 && kt0 + pre < kt1 && (kt0 + pre + 1) * FLASH_BN <= old_keys;
             pre++) {
            load_tile(kt0 + pre, pre);
            asm volatile("cp.async.commit_group;\n" ::);
        }
        pdl_wait(); /* Q and the query's own keys: the kernel before wrote them */
    }
    /* Q's reads are issued before the other copies, so that they are in
     * flight while those wait on their block-table reads (the prologue was
     * 3.2-3.6 us of dependent global reads in run 30's trace). */
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
    for (int i = pre; i < STAGES - 1; i++) {
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
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    if (tr) tr[FLASH_TRACE_PROLOGUE] = clock64();
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int32_t kt = kt0; kt < kt1; kt++) {
        const int st = (kt - kt0) % STAGES;
        unsigned long long t_top = tr ? clock64() : 0;
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
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
        if (kt + STAGES - 1 < kt1) load_tile(kt + STAGES - 1, (kt - kt0 + STAGES - 1) % STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        /* This warp's keys of the tile: [kt * FLASH_BN + k0, + FLASH_BN / KS). */
        constexpr int KW = FLASH_BN / KS;
        const int k0 = kq * KW;
        const __nv_bfloat16 *sK = sKV + (size_t)st * STAGE + k0 * LD,
                            *sV = sKV + (size_t)st * STAGE + FLASH_BN * LD + k0 * LD;
        if (kt * FLASH_BN + k0 > wl) continue; /* every key it takes is after the warp's rows */

        /* S = Q K^T: ldmatrix x4 gives the B fragments of two 8-key tiles. */
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
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

        /* Online softmax in the log2 domain; masked keys are -inf. Only a
         * tile that reaches past a row's last key needs the mask (the same
         * values either way; the per-element test was ~50 instructions). */
        float mx[2] = {-INFINITY, -INFINITY};
        if (kt * FLASH_BN + k0 + KW - 1 <= min(last[0], last[1])) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float x = s[nt][e] * scale_log2;
                    s[nt][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1;
                    const int32_t j = kt * FLASH_BN + k0 + nt * 8 + 2 * c + (e & 1);
                    const float x = j <= last[h] ? s[nt][e] * scale_log2 : -INFINITY;
                    s[nt][e] = x;
                    mx[h] = fmaxf(mx[h], x);
                }
        }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 2));
            const float m_new = fmaxf(m[h], mx[h]);
            alpha[h] = m_new == -INFINITY ? 1.0f : exp2f(m[h] - m_new);
            m[h] = m_new;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                const float p = m[h] == -INFINITY ? 0.0f : exp2f(s[nt][e] - m[h]);
                s[nt][e] = p;
                rs[h] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; h++) l[h] = l[h] * alpha[h] + rs[h]; /* per-thread part of l */
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }

        /* O += P V: P's A fragment for keys 16kk..+15 is S tiles 2kk, 2kk+1;
         * ldmatrix.trans of V gives the B fragments of two 8-wide O tiles. */
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
                ldsm_x4_trans(b, sV + (kk * 16 + (mi & 1) * 8 + rr) * LD + (dt + (mi >> 1)) * 8);
                mma_bf16(o[dt], pa, b[0], b[1]);
                mma_bf16(o[dt + 1], pa, b[2], b[3]);
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
    constexpr int W = DT * 4 + 4; /* floats a lane of a second key warp leaves */
    constexpr size_t KS_BYTES = (size_t)(BM / 16) * 32 * W * sizeof(float);
    constexpr int PLD = D + 4; /* floats a row of a cluster's partials (16-byte rows) */
    static_assert(KS_BYTES + (size_t)BM * PLD * sizeof(float) <=
                      (size_t)STAGES * STAGE * sizeof(__nv_bfloat16),
                  "flash: merge buffers exceed the K/V stages");
    asm volatile("cp.async.wait_group 0;\n" ::); /* (none is left in flight; cheap) */
    if (KS == 2) {
        /* The second half's warps leave their state in shared memory; each
         * first-half warp merges its partner's, which holds the same rows
         * and columns in the same lanes, then goes on alone (the others
         * stay for a cluster's barriers). */
        float *mo = reinterpret_cast<float *>(smem) + ((size_t)warp * 32 + lane) * W;
        __syncthreads();
        if (kq == 1) {
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
#pragma unroll
                for (int e = 0; e < 4; e++) mo[dt * 4 + e] = o[dt][e];
            mo[DT * 4] = m[0];
            mo[DT * 4 + 1] = m[1];
            mo[DT * 4 + 2] = l[0];
            mo[DT * 4 + 3] = l[1];
        }
        __syncthreads();
        if (kq == 0) {
            float a0[2], a1[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float m1 = mo[DT * 4 + h], mn = fmaxf(m[h], m1);
                a0[h] = m[h] == -INFINITY ? 0.0f : exp2f(m[h] - mn);
                a1[h] = m1 == -INFINITY ? 0.0f : exp2f(m1 - mn);
                l[h] = l[h] * a0[h] + mo[DT * 4 + 2 + h] * a1[h];
                m[h] = mn;
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[dt][e] = o[dt][e] * a0[e >> 1] + mo[dt * 4 + e] * a1[e >> 1];
        }
    }
    if (tr) tr[FLASH_TRACE_KS_MERGE] = clock64();
    if (n_splits == 1) {
        if (tr) tr[FLASH_TRACE_EXIT_NS] = global_ns();
        if (kq != 0) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (last[h] < 0) continue;
            const int r = warp * 16 + g + 8 * h;
            const int64_t at = (int64_t)(t0 + r / G) * q_stride + (int64_t)(kh * G + r % G) * D;
            float *dst = out + at;
            const float inv = 1.0f / l[h];
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
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
        if (kq == 0) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float *pr = mine + (warp * 16 + g + 8 * h) * PLD;
#pragma unroll
                for (int dt = 0; dt < DT; dt++)
                    *reinterpret_cast<float2 *>(pr + dt * 8 + 2 * c) =
                        make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
                if (c == 0) {
                    pr[D] = m[h];
                    pr[D + 1] = l[h];
                }
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
         * independent (run 30's trace: 2.2-2.5 us when each chunk read the
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
        for (int32_t u = tid; u < (r1 - r0) * CH; u += THREADS) {
            const int32_t r = r0 + u / CH, ch = u % CH;
            const float *w = wrow + (r - r0) * WS;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int z = 0; z < FLASH_CLUSTER_MAX; z++) {
                if (z >= n_splits) break;
                const float *pz = cl.map_shared_rank(mine, z) + r * PLD;
                const float4 v = *reinterpret_cast<const float4 *>(pz + ch * 4);
                acc.x += v.x * w[z];
                acc.y += v.y * w[z];
                acc.z += v.z * w[z];
                acc.w += v.w * w[z];
            }
            const float inv = w[FLASH_CLUSTER_MAX];
            const float4 y = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
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
        if (tr) tr[FLASH_TRACE_MERGED] = clock64();
        cl.sync(); /* no block leaves while another reads its rows */
        if (tr) {
            tr[FLASH_TRACE_END] = clock64();
            tr[FLASH_TRACE_EXIT_NS] = global_ns();
        }
        return;
    }
    if (tr) tr[FLASH_TRACE_EXIT_NS] = global_ns();
    if (kq != 0) return;
    /* Padding rows are not written: the merge reads only the tile's rows. */
    float *part = partial + (((int64_t)tile * n_kv_heads + kh) * n_splits + split) * BM * (D + 2);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (last[h] < 0) continue;
        const int r = warp * 16 + g + 8 * h;
        float *pr = part + r * (D + 2);
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            pr[dt * 8 + 2 * c] = o[dt][2 * h];
            pr[dt * 8 + 2 * c + 1] = o[dt][2 * h + 1];
        }
        if (c == 0) {
            pr[D] = m[h];
            pr[D + 1] = l[h];
        }
    }
}

/* Blocks per (tile, KV head) over its rows, a warp per row: lanes first
 * hold the splits' statistics (split z in lane z % 32) to form the row's
 * weights, then each lane merges 4 (D = 128) or 2 (D = 64) columns over the
 * splits with independent loads. */
#define MERGE_THREADS 256

template <int D, int BM>
static __global__ void __launch_bounds__(MERGE_THREADS)
    flash_merge_kernel(float *out, const float *partial, const int32_t *tiles, int32_t n_heads,
                       int32_t n_kv_heads, int32_t n_splits, __nv_bfloat16 *obf, int64_t out_n,
                       bool split) {
    constexpr int PER = D / 32; /* columns a lane merges */
    __shared__ float w_s[MERGE_THREADS / 32][FLASH_MAX_SPLITS];
    pdl_wait();
    const int32_t tile = blockIdx.x, kh = blockIdx.y;
    const int32_t t0 = tiles[FLASH_TILE_INTS * tile], n = tiles[FLASH_TILE_INTS * tile + 1];
    const int32_t G = n_heads / n_kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *base = partial + ((int64_t)tile * n_kv_heads + kh) * n_splits * BM * (D + 2);
    const int64_t split_stride = (int64_t)BM * (D + 2);
    float *w = w_s[warp];
    for (int r = blockIdx.z * (MERGE_THREADS / 32) + warp; r < BM && r / G < n;
         r += gridDim.z * (MERGE_THREADS / 32)) {
        float mz[2], lz[2], mx = -INFINITY;
        for (int h = 0; h < 2; h++) {
            const int z = lane + 32 * h;
            mz[h] = -INFINITY;
            lz[h] = 0.0f;
            if (z < n_splits) {
                mz[h] = base[z * split_stride + r * (D + 2) + D];
                lz[h] = base[z * split_stride + r * (D + 2) + D + 1];
            }
            mx = fmaxf(mx, mz[h]);
        }
        mx = warp_max(mx);
        float den = 0.0f;
        for (int h = 0; h < 2; h++) {
            const int z = lane + 32 * h;
            const float wz = mz[h] == -INFINITY ? 0.0f : exp2f(mz[h] - mx);
            if (z < n_splits) w[z] = wz;
            den += lz[h] * wz;
        }
        den = warp_sum(den);
        __syncwarp();
        float acc[PER];
#pragma unroll
        for (int e = 0; e < PER; e++) acc[e] = 0.0f;
        const float *col = base + r * (D + 2) + lane * PER;
#pragma unroll 4
        for (int z = 0; z < n_splits; z++) {
            const float wz = w[z];
            if (wz == 0.0f) continue; /* an empty split: its O is 0, its m -inf */
#pragma unroll
            for (int e = 0; e < PER; e++) acc[e] += col[z * split_stride + e] * wz;
        }
        const int64_t at = (int64_t)(t0 + r / G) * n_heads * D + (int64_t)(kh * G + r % G) * D +
                           lane * PER;
        const float inv = 1.0f / den;
#pragma unroll
        for (int e = 0; e < PER; e++) {
            const float y = acc[e] * inv;
            out[at + e] = y;
            if (obf) bf16_copy_put(obf, out_n, at + e, y, split);
        }
        __syncwarp(); /* w is rewritten for the next row */
    }
}

is_status cuda_flash_set_trace(unsigned long long *trace) {
    CUDA_CHECK(cudaMemcpyToSymbol(g_flash_trace, &trace, sizeof trace));
    return IS_OK;
}

#define FLASH_STAGES 2 /* K/V tiles in shared memory: one used, the next in flight */

/* The kernel's shared memory, and the attribute that lets it take more
 * than 48 KiB, set once a process (the attribute is per function). */
template <int D, int KS>
static is_status flash_prepare(size_t *smem) {
    static bool attr_set = false;
    *smem = (size_t)FLASH_STAGES * 2 * FLASH_BN * (D + 8) * sizeof(__nv_bfloat16);
    if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(flash_kernel<D, FLASH_BM, FLASH_STAGES, KS>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*smem));
        attr_set = true;
    }
    return IS_OK;
}

/* How many clusters of `size` blocks of this kernel the GPU holds at
 * once (0: none; asked once a size). The plan counts its waves by it: with
 * one block a multiprocessor (two key warps) a cluster needs that many
 * free multiprocessors in one GPC. */
template <int D, int KS>
static int32_t max_clusters(int32_t size) {
    static int32_t n_of[FLASH_CLUSTER_MAX + 1];
    static bool asked[FLASH_CLUSTER_MAX + 1];
    if (size < 2 || size > FLASH_CLUSTER_MAX) return 0;
    if (!asked[size]) {
        asked[size] = true;
        size_t smem;
        if (flash_prepare<D, KS>(&smem) != IS_OK) {
            is_error_clear();
            return 0;
        }
        cuda_launch_cfg l;
        cuda_launch_cfg_init(&l, dim3(1, 1, (unsigned)size), dim3(FLASH_BM * 2 * KS), smem, 0,
                             dim3(1, 1, (unsigned)size), false);
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, flash_kernel<D, FLASH_BM, FLASH_STAGES, KS>,
                                           &l.cfg) != cudaSuccess)
            n = 0;
        cudaGetLastError(); /* a refusal is an answer, not an error for the next check */
        n_of[size] = n;
    }
    return n_of[size];
}

int32_t cuda_flash_max_clusters(int32_t head_dim, int32_t key_warps, int32_t size) {
    if (head_dim == 64)
        return key_warps == 2 ? max_clusters<64, 2>(size) : max_clusters<64, 1>(size);
    if (head_dim == 128)
        return key_warps == 2 ? max_clusters<128, 2>(size) : max_clusters<128, 1>(size);
    return 0;
}

template <int D, int KS>
static is_status flash_launch(cudaStream_t s, float *out, const float *q,
                              const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                              const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                              float *partial, int32_t n_heads, int32_t n_kv_heads,
                              int32_t block_size, cuda_bf16_out ob, bool early) {
    size_t smem;
    is_status st = flash_prepare<D, KS>(&smem);
    if (st != IS_OK) return st;
    const bool cluster = plan.splits > 1 && plan.cluster;
    if (cluster && max_clusters<D, KS>(plan.splits) <= 0)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda flash attention: clusters of %d blocks do not fit this GPU",
                            plan.splits);
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    /* The kernel begins with pdl_wait() (early: after its first copies). */
    CUDA_CHECK(cuda_launch_ex(flash_kernel<D, FLASH_BM, FLASH_STAGES, KS>,
                              dim3((unsigned)plan.n_tiles, (unsigned)n_kv_heads,
                                   (unsigned)plan.splits),
                              dim3(FLASH_BM * 2 * KS), smem, s,
                              dim3(1, 1, cluster ? (unsigned)plan.splits : 1u), cuda_pdl_on(),
                              out, q, k_cache, v_cache, flat, tiles, n_heads, n_kv_heads,
                              block_size, scale_log2, plan.splits, cluster, partial, ob.p, ob.n,
                              ob.split, early && cuda_pdl_on()));
    if (plan.splits > 1 && !cluster) {
        CUDA_CHECK(cuda_launch_dependent(
            flash_merge_kernel<D, FLASH_BM>,
            dim3((unsigned)plan.n_tiles, (unsigned)n_kv_heads, FLASH_BM / (MERGE_THREADS / 32)),
            dim3(MERGE_THREADS), 0, s, out, (const float *)partial, tiles, n_heads, n_kv_heads,
            plan.splits, ob.p, ob.n, ob.split));
    }
    return IS_OK;
}

is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                               float *partial, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                               cuda_bf16_out ob, bool early) {
    if (plan.n_tiles <= 0) return IS_OK;
    if (!cuda_flash_supports(head_dim, n_heads, n_kv_heads, block_size))
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda flash attention: head_dim %d, %d/%d heads, blocks of %d",
                            head_dim, n_heads, n_kv_heads, block_size);
    if (plan.splits < 1 || plan.splits > FLASH_MAX_SPLITS ||
        (plan.splits > 1 && !plan.cluster && !partial) ||
        (plan.cluster && plan.splits > FLASH_CLUSTER_MAX))
        return is_error_set(IS_ERR_INVALID_ARG, "cuda flash attention: %d splits", plan.splits);
    if (plan.key_warps != 1 && plan.key_warps != 2)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda flash attention: %d key warps",
                            plan.key_warps);
#define FLASH_LAUNCH(D, KS)                                                                        \
    flash_launch<D, KS>(s, out, q, k_cache, v_cache, flat, tiles, plan, partial, \
                                  n_heads, n_kv_heads, block_size, ob, early)
    if (head_dim == 64) return plan.key_warps == 2 ? FLASH_LAUNCH(64, 2) : FLASH_LAUNCH(64, 1);
    return plan.key_warps == 2 ? FLASH_LAUNCH(128, 2) : FLASH_LAUNCH(128, 1);
#undef FLASH_LAUNCH
}

/* ---- plan ------------------------------------------------------------------ */

/* The split cost model, in microseconds, fitted to bench_attn_gpu's sweeps
 * (8B shape, 64-row blocks; T = 30 after 215-2590 keys and a decode step;
 * cuda/NOTES.md). One split alone, least squares over run 29's one-split
 * columns: 4.8 us plus 3.26 us a key tile with one key warp (the warps'
 * S / softmax / P V chain on tiles whose loads follow each other, latency
 * that a block's 4 warps do not hide), 5.6 + 2.23 with two (each takes
 * half a tile's chain, then their merge in shared memory; 8 warps a block,
 * one block a multiprocessor). Splitting adds either the merge kernel's
 * launch, 4.7 us, and the partial results, 1.9 us a MB (written, then read
 * back; run 24's fit, within 1.5 us of run 29's sweep), or a cluster
 * merge: 3.8 us with two key warps, 5.5 with one (run 29's 4c columns; its
 * waves counted by the clusters resident at once). Blocks beyond one wave
 * run in a second one. On run 29's sweep it picks, for the 30-token query
 * after 215 .. 2590 keys, the fastest measured plan or one not measured
 * (6c) that then ran fastest; for a decode step it prefers the merge
 * kernel's 21 splits (16.8 us) to 8c with two key warps (13.6): a 4-row
 * tile's fixed cost is lower than the model's. */
#define PLAN_TILE_US 3.26
#define PLAN_FIXED_US 4.8
#define PLAN_MERGE_US 4.7
#define PLAN_PART_US_PER_MB 1.9
#define PLAN_KW2_TILE 0.684
#define PLAN_KW2_FIXED_US 0.8
#define PLAN_CLUSTER_US 5.5
#define PLAN_KW2_CLUSTER_US 3.8

/* Splits, key warps and merge for tiles of up to max_kt key tiles: the
 * cheapest by the model, counting only splits that all get keys (per
 * first, then splits = ceil(max_kt / per)); a tie goes to fewer splits,
 * one key warp, the merge kernel. */
static void plan_splits(cuda_flash_plan *plan, int32_t pairs, int32_t max_kt, int64_t rows_total,
                        int32_t head_dim, int32_t n_sms, bool clusters) {
    plan->splits = 1;
    plan->key_warps = 1;
    plan->cluster = 0;
    if (pairs >= 2 * n_sms || max_kt <= 1) return; /* the tiles fill the GPU (prefill) */
    const double part_mb = (double)rows_total * (head_dim + 2) * sizeof(float) / 1e6;
    double best_us = -1.0;
    for (int32_t kw = 1; kw <= 2; kw++) {
        const int32_t slots = kw == 1 ? 2 * n_sms : n_sms;
        const double tile_us = kw == 1 ? PLAN_TILE_US : PLAN_TILE_US * PLAN_KW2_TILE;
        const double fixed_us = kw == 1 ? PLAN_FIXED_US : PLAN_FIXED_US + PLAN_KW2_FIXED_US;
        for (int32_t splits = 1; splits <= max_kt && splits <= FLASH_MAX_SPLITS; splits++) {
            const int32_t per = (max_kt + splits - 1) / splits;
            if ((splits - 1) * per >= max_kt) continue; /* the last split would be empty */
            const int32_t cl_slots =
                clusters && splits > 1 ? cuda_flash_max_clusters(head_dim, kw, splits) : 0;
            for (int32_t cl = 0; cl <= (cl_slots > 0); cl++) {
                const int64_t waves = cl ? ((int64_t)pairs + cl_slots - 1) / cl_slots
                                         : ((int64_t)pairs * splits + slots - 1) / slots;
                double us = (double)waves * (fixed_us + per * tile_us);
                if (splits > 1)
                    us += cl ? (kw == 1 ? PLAN_CLUSTER_US : PLAN_KW2_CLUSTER_US)
                             : PLAN_MERGE_US + PLAN_PART_US_PER_MB * part_mb * splits;
                if (best_us < 0.0 || us < best_us) {
                    plan->splits = splits;
                    plan->key_warps = kw;
                    plan->cluster = cl;
                    best_us = us;
                }
            }
        }
    }
}

cuda_flash_plan cuda_flash_plan_batch(const int32_t *seq_of_token, const int32_t *pos, int32_t T,
                                      const int32_t *bt_off, int32_t n_heads, int32_t n_kv_heads,
                                      int32_t head_dim, int32_t n_sms, cuda_flash_choice choice,
                                      int32_t *tiles) {
    const bool legacy = choice == CUDA_FLASH_CHOICE_LEGACY;
    const int32_t G = n_heads / n_kv_heads;
    cuda_flash_plan plan = {0, 1, 1, 0};
    int32_t max_kt = 0;
    int64_t rows_total = 0; /* query rows of all tiles and KV heads */
    /* Each sequence's first position in the batch; without the scratch, 0:
     * no key counts as written before. */
    int32_t n_seqs = 0;
    for (int32_t t = 0; t < T; t++)
        if (seq_of_token[t] + 1 > n_seqs) n_seqs = seq_of_token[t] + 1;
    int32_t *first = (int32_t *)malloc((size_t)(n_seqs > 0 ? n_seqs : 1) * sizeof(int32_t));
    if (first) {
        for (int32_t i = 0; i < n_seqs; i++) first[i] = INT32_MAX;
        for (int32_t t = 0; t < T; t++)
            if (pos[t] < first[seq_of_token[t]]) first[seq_of_token[t]] = pos[t];
    }
    for (int32_t t = 0; t < T;) {
        /* A tile: batch tokens of one sequence at consecutive positions. */
        int32_t n = 1;
        while (t + n < T && n < FLASH_BM / G && seq_of_token[t + n] == seq_of_token[t] &&
               pos[t + n] == pos[t] + n)
            n++;
        int32_t *tl = tiles + FLASH_TILE_INTS * plan.n_tiles++;
        tl[0] = t;
        tl[1] = n;
        tl[2] = bt_off[seq_of_token[t]];
        tl[3] = pos[t];
        tl[4] = first ? first[seq_of_token[t]] : 0;
        const int32_t kt = (pos[t] + n + FLASH_BN - 1) / FLASH_BN;
        if (kt > max_kt) max_kt = kt;
        rows_total += (int64_t)n * G * n_kv_heads;
        t += n;
    }
    free(first);
    const int32_t pairs = plan.n_tiles * n_kv_heads;
    if (legacy) {
        /* Two resident blocks a multiprocessor, one wave (run 11). */
        const int32_t want = 2 * n_sms;
        if (pairs < want) {
            plan.splits = want / pairs;
            if (plan.splits > max_kt) plan.splits = max_kt;
            if (plan.splits > FLASH_MAX_SPLITS) plan.splits = FLASH_MAX_SPLITS;
            if (plan.splits < 1) plan.splits = 1;
        }
        return plan;
    }
    plan_splits(&plan, pairs, max_kt, rows_total, head_dim, n_sms,
                choice != CUDA_FLASH_CHOICE_NO_CLUSTER);
    return plan;
}

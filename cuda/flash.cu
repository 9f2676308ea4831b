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
 * multiprocessor with one key warp; with two, 120 KiB are reserved so that
 * it stays one: flash_smem_bytes).
 *
 * The kernel itself is in flash_kernel.cuh, shared with flash_wgmma.cu's
 * wgmma engine; this file holds the mma.sync engine's instantiations, the
 * merge kernel, the launches and the plan.
 */
#include "flash_kernel.cuh"

#include <stdlib.h>

bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads,
                         int32_t block_size) {
    if (head_dim != 64 && head_dim != 128) return false;
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return false;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return false;
    return n_heads / n_kv_heads <= FLASH_BM;
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
        const int64_t at =
            (int64_t)(t0 + r / G) * n_heads * D + (int64_t)(kh * G + r % G) * D + lane * PER;
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
    return cuda_flash_wgmma_set_trace(trace);
}

bool cuda_flash_wgmma_supports(int32_t head_dim) {
    return cuda_flash_wgmma_kernel(head_dim, 1, FLASH_BN) != NULL;
}

/* The kernel of this head size, key warps, keys a tile and engine, its
 * shared memory, and the attribute that lets it take more than 48 KiB, set
 * once a process (the attribute is per function). Wide tiles take two key
 * warps (a key part of 64 keys each). */
template <int D, int KS, int BN>
static is_status flash_prepare(bool wg, flash_fn *fn, size_t *smem) {
    static_assert(BN == FLASH_BN || KS == 2, "flash: wide tiles take two key warps");
    static bool attr_set[2];
    *smem = 0;
    *fn = wg ? cuda_flash_wgmma_kernel(D, KS, BN)
             : flash_kernel<D, FLASH_BM, FLASH_STAGES, KS, false, BN>;
    if (!*fn)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda flash attention: the wgmma engine needs an sm_90a GPU");
    *smem = wg ? flash_smem_bytes<D, FLASH_BM, FLASH_STAGES, KS, true, BN>()
               : flash_smem_bytes<D, FLASH_BM, FLASH_STAGES, KS, false, BN>();
    if (!attr_set[wg]) {
        CUDA_CHECK(
            cudaFuncSetAttribute(*fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*smem));
        attr_set[wg] = true;
    }
    return IS_OK;
}

/* What the GPU holds of this kernel at once, asked once each (0: none, or
 * the runtime cannot say, e.g. without a GPU): size 0, blocks an SM (by
 * registers and shared memory); 2..FLASH_CLUSTER_MAX, clusters of that many
 * blocks. The plan counts its waves by them: with one block a
 * multiprocessor (two key warps) a cluster needs that many free
 * multiprocessors in one GPC. */
template <int D, int KS, int BN> static int32_t resident(bool wg, int32_t size) {
    static int32_t n_of[2][FLASH_CLUSTER_MAX + 1];
    static bool asked[2][FLASH_CLUSTER_MAX + 1];
    if (size == 1 || size < 0 || size > FLASH_CLUSTER_MAX) return 0;
    if (!asked[wg][size]) {
        asked[wg][size] = true;
        flash_fn fn = NULL;
        size_t smem = 0;
        int n = 0;
        if (flash_prepare<D, KS, BN>(wg, &fn, &smem) != IS_OK) {
            is_error_clear();
        } else if (size == 0) {
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, FLASH_BM * 2 * KS, smem) !=
                cudaSuccess)
                n = 0;
        } else {
            cuda_launch_cfg l;
            cuda_launch_cfg_init(&l, dim3(1, 1, (unsigned)size), dim3(FLASH_BM * 2 * KS), smem, 0,
                                 dim3(1, 1, (unsigned)size), false);
            if (cudaOccupancyMaxActiveClusters(&n, fn, &l.cfg) != cudaSuccess) n = 0;
        }
        cudaGetLastError(); /* a refusal is an answer, not an error for the next check */
        n_of[wg][size] = n;
    }
    return n_of[wg][size];
}

static int32_t flash_resident(int32_t head_dim, int32_t key_warps, bool wgmma, int32_t size,
                              int32_t key_tile) {
    if (key_tile == FLASH_BN_WIDE) {
        if (key_warps != 2) return 0;
        return head_dim == 64    ? resident<64, 2, FLASH_BN_WIDE>(wgmma, size)
               : head_dim == 128 ? resident<128, 2, FLASH_BN_WIDE>(wgmma, size)
                                 : 0;
    }
    if (head_dim == 64)
        return key_warps == 2 ? resident<64, 2, FLASH_BN>(wgmma, size)
                              : resident<64, 1, FLASH_BN>(wgmma, size);
    if (head_dim == 128)
        return key_warps == 2 ? resident<128, 2, FLASH_BN>(wgmma, size)
                              : resident<128, 1, FLASH_BN>(wgmma, size);
    return 0;
}

int32_t cuda_flash_max_clusters(int32_t head_dim, int32_t key_warps, int32_t size, bool wgmma,
                                int32_t key_tile) {
    return size >= 2 ? flash_resident(head_dim, key_warps, wgmma, size, key_tile) : 0;
}

template <int D, int KS, int BN>
static is_status
flash_launch(cudaStream_t s, float *out, const float *q, const __nv_bfloat16 *k_cache,
             const __nv_bfloat16 *v_cache, const int32_t *flat, const int32_t *tiles,
             cuda_flash_plan plan, float *partial, int32_t n_heads, int32_t n_kv_heads,
             int32_t block_size, cuda_bf16_out ob, bool pdl, const cuda_flash_mem &mem) {
    flash_fn fn = NULL;
    size_t smem = 0;
    is_status st = flash_prepare<D, KS, BN>(plan.wgmma != 0, &fn, &smem);
    if (st != IS_OK) return st;
    const bool cluster = plan.splits > 1 && plan.cluster;
    if (cluster && resident<D, KS, BN>(plan.wgmma != 0, plan.splits) <= 0)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda flash attention: clusters of %d blocks do not fit this GPU",
                            plan.splits);
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    /* The kernel begins with pdl_wait(). */
    CUDA_CHECK(cuda_launch_ex(
        fn, dim3((unsigned)plan.n_tiles, (unsigned)n_kv_heads, (unsigned)plan.splits),
        dim3(FLASH_BM * 2 * KS), smem, s, dim3(1, 1, cluster ? (unsigned)plan.splits : 1u), pdl,
        out, q, k_cache, v_cache, flat, tiles, n_heads, n_kv_heads, block_size, scale_log2,
        plan.splits, cluster, partial, ob.p, ob.n, ob.split, mem.span, mem.mul_log2, mem.add_log2));
    if (plan.splits > 1 && !cluster) {
        CUDA_CHECK(cuda_launch_dependent(
            flash_merge_kernel<D, FLASH_BM>,
            dim3((unsigned)plan.n_tiles, (unsigned)n_kv_heads, FLASH_BM / (MERGE_THREADS / 32)),
            dim3(MERGE_THREADS), 0, s, pdl, out, (const float *)partial, tiles, n_heads, n_kv_heads,
            plan.splits, ob.p, ob.n, ob.split));
    }
    return IS_OK;
}

is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                               float *partial, int32_t n_heads, int32_t n_kv_heads,
                               int32_t head_dim, int32_t block_size, cuda_bf16_out ob, bool pdl) {
    const cuda_flash_mem none = {NULL, 1.0f, 0.0f};
    return cuda_flash_attention_mem(s, out, q, k_cache, v_cache, flat, tiles, plan, partial,
                                    n_heads, n_kv_heads, head_dim, block_size, ob, pdl, none);
}

is_status cuda_flash_attention_mem(cudaStream_t s, float *out, const float *q,
                                   const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                                   const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                                   float *partial, int32_t n_heads, int32_t n_kv_heads,
                                   int32_t head_dim, int32_t block_size, cuda_bf16_out ob, bool pdl,
                                   cuda_flash_mem mem) {
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
    if (plan.key_tile != FLASH_BN && (plan.key_tile != FLASH_BN_WIDE || plan.key_warps != 2))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda flash attention: tiles of %d keys with %d key warps",
                            plan.key_tile, plan.key_warps);
#define FLASH_LAUNCH(D, KS, BN)                                                                    \
    flash_launch<D, KS, BN>(s, out, q, k_cache, v_cache, flat, tiles, plan, partial, n_heads,      \
                            n_kv_heads, block_size, ob, pdl, mem)
    if (plan.key_tile == FLASH_BN_WIDE)
        return head_dim == 64 ? FLASH_LAUNCH(64, 2, FLASH_BN_WIDE)
                              : FLASH_LAUNCH(128, 2, FLASH_BN_WIDE);
    if (head_dim == 64)
        return plan.key_warps == 2 ? FLASH_LAUNCH(64, 2, FLASH_BN) : FLASH_LAUNCH(64, 1, FLASH_BN);
    return plan.key_warps == 2 ? FLASH_LAUNCH(128, 2, FLASH_BN) : FLASH_LAUNCH(128, 1, FLASH_BN);
#undef FLASH_LAUNCH
}

/* ---- plan ------------------------------------------------------------------ */

/* The split cost model, in microseconds, fitted to bench_attn_gpu's sweeps
 * (8B shape, 64-row blocks; T = 30 after 215-2590 keys and a decode step;
 * docs/notes/cuda-diary.md). One split alone, least squares over a sweep's
 * one-split columns: 4.8 us plus 3.26 us a key tile with one key warp (the warps'
 * S / softmax / P V chain on tiles whose loads follow each other, latency
 * that a block's 4 warps do not hide), 5.6 + 2.23 with two (each takes
 * half a tile's chain, then their merge in shared memory; 8 warps a block,
 * one block a multiprocessor). Splitting adds either the merge kernel's
 * launch, 4.7 us, and the partial results, 1.9 us a MB (written, then read
 * back; an earlier fit, within 1.5 us of the later sweep), or a cluster
 * merge: 3.8 us with two key warps, 5.5 with one (the sweep's 4c columns;
 * its waves counted by the clusters resident at once). Blocks beyond one
 * wave run in a second one. On that sweep it picks, for the 30-token query
 * after 215 .. 2590 keys, the fastest measured plan or one not measured
 * (6c) that then ran fastest; for a decode step it prefers the merge
 * kernel's 21 splits (16.8 us) to 8c with two key warps (13.6): a 4-row
 * tile's fixed cost is lower than the model's. The wgmma engine's key tile
 * costs PLAN_WG_TILE of the mma.sync engine's: a sweep of one split
 * from 590 to 2590 keys, 0.90 of it with one key warp, 0.78 with two; with
 * 0.85 the plans are mma.sync's (4c, 2 at k = 5; 6c, 2 at k = 50). (A first
 * guess of 0.35 chose one split at k = 5: 14.6 us against 4c's 12.4.) */
#define PLAN_WG_TILE        0.85
#define PLAN_TILE_US        3.26
#define PLAN_FIXED_US       4.8
#define PLAN_MERGE_US       4.7
#define PLAN_PART_US_PER_MB 1.9
#define PLAN_KW2_TILE       0.684
#define PLAN_KW2_FIXED_US   0.8
#define PLAN_CLUSTER_US     5.5
#define PLAN_KW2_CLUSTER_US 3.8
/* Wide tiles (FLASH_BN_WIDE keys, two key warps, wgmma): a wide tile costs
 * PLAN_WIDE_TILE of two 64-key tiles (the per-tile steps paid once for both
 * halves), and a block PLAN_WIDE_FIXED_US more (its first tile, twice as
 * large, in the prologue). First fitted to phase traces (0.86: 1.84 us a
 * wide tile at k = 50 against 1.10 a 64-key one, the prologue 2.39
 * against 2.09). The softmax without exp2f's subnormal path took more off a
 * wide tile than off a 64-key one: in a sweep at k = 100
 * a wide tile adds 1.87 us a block (2cw 33.0, 4cw 23.7, 6cw 19.9 us a
 * layer) and a 64-key one 1.1-1.4 (2c 39.0, 4c 25.3, 6c 20.8), so 0.78:
 * k = 20, 50 and now 100 take wide tiles (6cw 19.9 against 6c 20.8), k = 5
 * and 10 keep 64-key ones (one tile a block either way). */
#define PLAN_WIDE_TILE     0.78
#define PLAN_WIDE_FIXED_US 0.3

/* Splits, key warps, keys a tile and merge for tiles of up to max_keys
 * keys: the cheapest by the model, counting only splits that all get keys
 * (per first, then splits = ceil(key tiles / per)); a tie goes to 64-key
 * tiles, fewer splits, one key warp, the merge kernel. */
static void plan_splits(cuda_flash_plan *plan, int32_t pairs, int32_t max_keys, int64_t rows_total,
                        int32_t head_dim, int32_t n_sms, bool clusters, bool wide) {
    const bool wg = plan->wgmma != 0;
    plan->splits = 1;
    plan->key_warps = 1;
    plan->cluster = 0;
    plan->key_tile = FLASH_BN;
    /* the tiles fill the GPU (prefill), or one key tile */
    if (pairs >= 2 * n_sms || max_keys <= FLASH_BN) return;
    const double part_mb = (double)rows_total * (head_dim + 2) * sizeof(float) / 1e6;
    double best_us = -1.0;
    for (const auto &shape : FLASH_TILE_SHAPES) {
        const int32_t bn = shape[0], kw = shape[1];
        if (bn == FLASH_BN_WIDE && !(wide && wg)) continue;
        const int32_t max_kt = (max_keys + bn - 1) / bn;
        /* Blocks resident at once: the runtime's count, else (no GPU) two an
         * SM with one key warp and one with two, as on mma.sync at D = 128. */
        const int32_t per_sm = flash_resident(head_dim, kw, wg, 0, bn);
        const int32_t slots = (per_sm > 0 ? per_sm : kw == 1 ? 2 : 1) * n_sms;
        const double tile_us = (kw == 1 ? PLAN_TILE_US : PLAN_TILE_US * PLAN_KW2_TILE) *
                               (wg ? PLAN_WG_TILE : 1.0) *
                               (bn == FLASH_BN ? 1.0 : 2.0 * PLAN_WIDE_TILE);
        const double fixed_us = (kw == 1 ? PLAN_FIXED_US : PLAN_FIXED_US + PLAN_KW2_FIXED_US) +
                                (bn == FLASH_BN ? 0.0 : PLAN_WIDE_FIXED_US);
        for (int32_t splits = 1; splits <= max_kt && splits <= FLASH_MAX_SPLITS; splits++) {
            const int32_t per = (max_kt + splits - 1) / splits;
            if ((splits - 1) * per >= max_kt) continue; /* the last split would be empty */
            const int32_t cl_slots =
                clusters && splits > 1 ? cuda_flash_max_clusters(head_dim, kw, splits, wg, bn) : 0;
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
                    plan->key_tile = bn;
                    best_us = us;
                }
            }
        }
    }
}

cuda_flash_plan cuda_flash_plan_batch(const int32_t *seq_of_token, const int32_t *pos, int32_t T,
                                      const int32_t *bt_off, int32_t n_heads, int32_t n_kv_heads,
                                      int32_t head_dim, int32_t n_sms, cuda_flash_choice choice,
                                      bool wgmma, int32_t *tiles) {
    const bool legacy = choice == CUDA_FLASH_CHOICE_LEGACY;
    const int32_t G = n_heads / n_kv_heads;
    cuda_flash_plan plan = {0, 1, 1, 0, 0, FLASH_BN};
    plan.wgmma = wgmma && !legacy && cuda_flash_wgmma_supports(head_dim);
    int32_t max_keys = 0;
    int64_t rows_total = 0; /* query rows of all tiles and KV heads */
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
        if (pos[t] + n > max_keys) max_keys = pos[t] + n;
        rows_total += (int64_t)n * G * n_kv_heads;
        t += n;
    }
    const int32_t pairs = plan.n_tiles * n_kv_heads;
    if (legacy) {
        /* Two resident blocks a multiprocessor, one wave. */
        const int32_t want = 2 * n_sms, max_kt = (max_keys + FLASH_BN - 1) / FLASH_BN;
        if (pairs < want) {
            plan.splits = want / pairs;
            if (plan.splits > max_kt) plan.splits = max_kt;
            if (plan.splits > FLASH_MAX_SPLITS) plan.splits = FLASH_MAX_SPLITS;
            if (plan.splits < 1) plan.splits = 1;
        }
        return plan;
    }
    plan_splits(&plan, pairs, max_keys, rows_total, head_dim, n_sms,
                choice != CUDA_FLASH_CHOICE_NO_CLUSTER, choice == CUDA_FLASH_CHOICE_AUTO);
    return plan;
}

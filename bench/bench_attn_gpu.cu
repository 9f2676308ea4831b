/*
 * bench_attn_gpu: the tiled attention (cuda/flash.cuh) on the Llama-3.1-8B
 * shape (32 query heads, 8 KV heads, head_dim 128, bf16 paged cache of
 * 16-token blocks), one layer per launch, for the request shapes of BENCHMARKS.md:
 * a 30-token query after 215 .. 2590 keys of memory (k = 5 .. 100 facts),
 * a 1280-token prefill and a decode step. Each row runs, in the same
 * process on the same cache and queries, cuda_flash_plan_batch's first
 * plan ("old") and serving's ("new": splits by the cost
 * model, none empty, on the wgmma engine where the GPU runs it), the new
 * plan on the mma.sync engine ("new, mma.sync") and the new model on 64-key
 * tiles only ("new, narrow": serving's plan before wide tiles), checking
 * that the outputs agree within the bf16 bar (relative L2 <= 1e-2); then
 * the new plan's tiles with fixed numbers of splits, merged by the second
 * kernel or in clusters ("c"), on 64- or 128-key tiles ("w", two key warps
 * only), with one and two key warps, on each engine: the sweep the cost
 * model is fitted against.
 *
 * Like a forward, each launch finds its K/V, block table and tiles in
 * memory, not in L2: a read of a buffer larger than L2 runs before it
 * (outside the timed span), then Q is rewritten (rope_store writes it just
 * before attention, so it is in L2 there). Times are medians of the launches'
 * event spans (flash kernel and merge together).
 *
 * Usage: bench_attn_gpu [-r reps] [-T] [-P case] [-p GB]   (default 50 reps)
 * -p GB: the sequences' cache blocks drawn from a pool of GB gigabytes (keys;
 * as many of values), so that their pages lie far apart, as a fact-KV
 * arena's records do.
 * -T: one more launch of the new plan a case with cuda_flash_set_trace's
 * phase timestamps, summarised per phase (where a block's time goes).
 * -P case: only that case's new plan, reps launches and nothing else, for
 * a profiler (ncu --kernel-name regex:flash_kernel).
 */
#include "bench_cuda.cuh"
#include "common.cuh"
#include "flash.cuh"

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#define H  32  /* query heads */
#define KH 8   /* KV heads */
#define D  128 /* head_dim */
#define BS 16  /* tokens a cache block */

/* Uniform in [-scale, scale), from the element's index and a seed. */
static __device__ float hash_unit(int64_t i, uint64_t seed) {
    uint64_t z = (uint64_t)i + seed * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
}

static __global__ void fill_bf16(__nv_bfloat16 *p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(hash_unit(i, seed));
}

static __global__ void fill_f32(float *p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        p[i] = hash_unit(i, seed);
}

/* Reads n float4 (evicting L2 of what the timed launch will read); the sum
 * is written only if it is NaN, which it never is, so the loads stay. */
static __global__ void flush_l2(const float4 *p, int64_t n, float *sink) {
    float s = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = p[i];
        s += v.x + v.y + v.z + v.w;
    }
    if (s != s) *sink = s;
}

struct bench_case {
    const char *name;
    int32_t T, keys; /* one sequence: queries at positions keys - T .. keys - 1 */
};

static __global__ void empty_kernel(void) {}

/* Variants of a row before the sweep (see main). */
#define N_MAIN 5

/* A plan's splits and merge as the tables write it: "6cw" is 6 splits
 * merged in a cluster, on 128-key tiles. */
static std::string plan_name(const cuda_flash_plan &p) {
    return std::to_string(p.splits) + (p.splits > 1 && p.cluster ? "c" : "") +
           (p.key_tile == FLASH_BN_WIDE ? "w" : "");
}

/* One traced launch's phases (cuda_flash_set_trace), medians over blocks,
 * in us at the SM clock (clock_khz), and its span by the global timer. */
static std::string trace_summary(const std::vector<unsigned long long> &t, size_t blocks,
                                 double clock_khz, bool cluster) {
    std::vector<double> skew, pro, wait, comp, tiles, tail, sync, merge, end, life;
    unsigned long long t0 = ~0ull, t1 = 0;
    for (size_t b = 0; b < blocks; b++) {
        const unsigned long long *r = &t[b * FLASH_TRACE_SLOTS];
        t0 = std::min(t0, r[FLASH_TRACE_ENTRY_NS]);
        t1 = std::max(t1, r[FLASH_TRACE_EXIT_NS]);
    }
    const double us_per_cycle = 1e3 / clock_khz;
    for (size_t b = 0; b < blocks; b++) {
        const unsigned long long *r = &t[b * FLASH_TRACE_SLOTS];
        skew.push_back((r[FLASH_TRACE_ENTRY_NS] - t0) * 1e-3);
        life.push_back((r[FLASH_TRACE_EXIT_NS] - r[FLASH_TRACE_ENTRY_NS]) * 1e-3);
        pro.push_back((r[FLASH_TRACE_PROLOGUE] - r[FLASH_TRACE_ENTRY]) * us_per_cycle);
        wait.push_back(r[FLASH_TRACE_WAIT] * us_per_cycle);
        comp.push_back(r[FLASH_TRACE_COMPUTE] * us_per_cycle);
        tiles.push_back((double)r[FLASH_TRACE_TILES]);
        tail.push_back((r[FLASH_TRACE_KS_MERGE] - r[FLASH_TRACE_LOOP]) * us_per_cycle);
        if (cluster) {
            sync.push_back((r[FLASH_TRACE_CLUSTER_SYNC] - r[FLASH_TRACE_KS_MERGE]) * us_per_cycle);
            merge.push_back((r[FLASH_TRACE_MERGED] - r[FLASH_TRACE_CLUSTER_SYNC]) * us_per_cycle);
            end.push_back((r[FLASH_TRACE_END] - r[FLASH_TRACE_MERGED]) * us_per_cycle);
        }
    }
    /* The cluster columns: "-" where the launch merged no cluster. */
    char cl[3][16];
    std::vector<double> *cv[3] = {&sync, &merge, &end};
    for (int i = 0; i < 3; i++) {
        if (cluster) snprintf(cl[i], sizeof cl[i], "%.2f", median(*cv[i]));
        else snprintf(cl[i], sizeof cl[i], "-");
    }
    char buf[512];
    snprintf(buf, sizeof buf,
             "| %.1f | %.2f / %.2f | %.2f | %.0f | %.2f | %.2f | %.2f | %s | %s | %s | %.2f |",
             (t1 - t0) * 1e-3, median(skew), *std::max_element(skew.begin(), skew.end()),
             median(pro), median(tiles), median(wait), median(comp), median(tail), cl[0], cl[1],
             cl[2], median(life));
    return buf;
}

int main(int argc, char **argv) {
    int reps = 50, profile_case = -1;
    double pool_gb = 0.0;
    bool trace = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-p") && i + 1 < argc) pool_gb = atof(argv[++i]);
        else if (!strcmp(argv[i], "-T")) trace = true;
        else if (!strcmp(argv[i], "-P") && i + 1 < argc) profile_case = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [-r reps] [-T] [-P case] [-p GB]\n"
                    "-T: after the tables, the new plan's phases in one traced launch "
                    "a case\n"
                    "-P case: only the new plan of that case (0-6, the table's rows in "
                    "order), reps launches, no table: for a profiler\n"
                    "-p GB: the pool the sequence's cache blocks are drawn from spans\n"
                    "GB gigabytes of keys and as many of values (default: 4 x the blocks\n"
                    "of the longest case), so its pages lie far apart\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    cudaDeviceProp prop;
    if (!bench_device(&prop)) return 0;
    const int n_sms = prop.multiProcessorCount;
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, n_sms, prop.l2CacheSize >> 20);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));

    const bench_case cases[] = {
        {"query, k = 5", 30, 215},   {"query, k = 10", 30, 340},   {"query, k = 20", 30, 590},
        {"query, k = 50", 30, 1340}, {"query, k = 100", 30, 2590}, {"prefill", 1280, 1280},
        {"decode, k = 50", 1, 1340},
    };
    const int n_cases = (int)(sizeof cases / sizeof cases[0]);
    int32_t max_keys = 0, max_T = 0;
    for (int i = 0; i < n_cases; i++) {
        max_keys = std::max(max_keys, cases[i].keys);
        max_T = std::max(max_T, cases[i].T);
    }

    /* The cache: a pool of blocks, each [KH][BS][D]; a sequence takes a
     * shuffled subset (fixed seed), as the paged cache hands them out. -p:
     * a pool of that many gigabytes, so that a sequence's pages are spread
     * over it (the fact-KV arena's records lie across gigabytes: whether
     * reads that far apart cost the attention). */
    const int64_t block_bytes = (int64_t)KH * BS * D * (int64_t)sizeof(__nv_bfloat16);
    const int32_t seq_blocks = (max_keys + BS - 1) / BS; /* the longest case's */
    const int32_t pool =
        pool_gb > 0.0
            ? (int32_t)std::max<int64_t>((int64_t)(pool_gb * 1e9 / block_bytes), seq_blocks)
            : 4 * seq_blocks;
    printf("cache pool: %d blocks of %lld bytes (%.2f GB of keys, as many of values)\n", pool,
           (long long)block_bytes, (double)pool * block_bytes / 1e9);
    const int64_t cache_n = (int64_t)pool * KH * BS * D;
    __nv_bfloat16 *kc = NULL, *vc = NULL;
    CK(cudaMalloc(&kc, cache_n * sizeof(__nv_bfloat16)));
    CK(cudaMalloc(&vc, cache_n * sizeof(__nv_bfloat16)));
    fill_bf16<<<1024, 256, 0, st>>>(kc, cache_n, 1);
    fill_bf16<<<1024, 256, 0, st>>>(vc, cache_n, 2);
    CK(cudaGetLastError());
    const int64_t q_n = (int64_t)max_T * H * D;
    float *q_src = NULL, *q = NULL, *outs[3] = {NULL, NULL, NULL}, *partial = NULL;
    CK(cudaMalloc(&q_src, q_n * sizeof(float)));
    CK(cudaMalloc(&q, q_n * sizeof(float)));
    for (int i = 0; i < 3; i++) CK(cudaMalloc(&outs[i], q_n * sizeof(float)));
    fill_f32<<<1024, 256, 0, st>>>(q_src, q_n, 3);
    CK(cudaGetLastError());
    const int64_t flush_n = (int64_t)4 * prop.l2CacheSize / (int64_t)sizeof(float4);
    float4 *flush = NULL;
    float *sink = NULL;
    CK(cudaMalloc(&flush, flush_n * sizeof(float4)));
    CK(cudaMemsetAsync(flush, 0, flush_n * sizeof(float4), st));
    CK(cudaMalloc(&sink, sizeof(float)));
    size_t partial_cap = 0;
    int32_t *d_tables = NULL, *d_tiles = NULL;
    const int32_t bt_off[1] = {0}; /* one sequence, its table first in d_tables */
    CK(cudaMalloc(&d_tables, (size_t)pool * sizeof(int32_t)));
    CK(cudaMalloc(&d_tiles, (size_t)max_T * FLASH_TILE_INTS * sizeof(int32_t)));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    std::vector<int32_t> perm(pool), pos(max_T), sot(max_T, 0),
        tiles((size_t)max_T * FLASH_TILE_INTS);
    for (int32_t i = 0; i < pool; i++) perm[i] = i;
    uint64_t rng = 12345;
    for (int32_t i = pool - 1; i > 0; i--) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(perm[i], perm[(int32_t)((rng >> 33) % (uint64_t)(i + 1))]);
    }
    CK(cudaMemcpyAsync(d_tables, perm.data(), (size_t)pool * sizeof(int32_t),
                       cudaMemcpyHostToDevice, st));

    printf("\nattention, one layer of the 8B shape (H %d, KV heads %d, d %d, block %d), "
           "median of %d launches; plan = splits, key warps (blocks)\n\n",
           H, KH, D, BS, reps);
    const bool wg_ok = cuda_flash_wgmma_supports(D);
    printf("wgmma engine: %s\n\n", wg_ok ? "yes" : "no (this GPU runs no sm_90a code)");
    printf("| case | T | keys | old plan | old us | new plan | new us | new, 1 key warp us | "
           "new, mma.sync us | new, narrow: plan | us | old / new | rel err new |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    /* Variants: the old plan, the new one, then the new one's tiles with
     * each split count of the sweep (what the cost model chooses among). */
    /* Splits merged by the second kernel, then (c) in clusters, on 64-key
     * tiles, then on 128-key ones (w: two key warps only); with one key
     * warp, then two. */
    const int32_t sweep_splits[] = {1, 2, 4, 8, 16, 32, 2, 4, 6, 8, 1, 2, 4, 2, 4, 6, 8};
    const bool sweep_cl[] = {false, false, false, false, false, false, true, true, true,
                             true,  false, false, false, true,  true,  true, true};
    const bool sweep_wide[] = {false, false, false, false, false, false, false, false, false,
                               false, true,  true,  true,  true,  true,  true,  true};
    const int n_per_kw = (int)(sizeof sweep_splits / sizeof sweep_splits[0]);
    /* Each split count with 1 and 2 key warps on mma.sync, then on wgmma. */
    const int n_sweep = 4 * n_per_kw;
    printf("clusters resident at once (cudaOccupancyMaxActiveClusters), size 2..%d:",
           FLASH_CLUSTER_MAX);
    for (int wg = 0; wg <= (int)wg_ok; wg++)
        for (int kw = 1; kw <= 2; kw++) {
            printf(" %s, %d key warp%s:", wg ? "wgmma" : "mma.sync", kw, kw > 1 ? "s" : "");
            for (int32_t z = 2; z <= FLASH_CLUSTER_MAX; z++)
                printf(" %d", cuda_flash_max_clusters(D, kw, z, wg, FLASH_BN));
            printf(";");
        }
    printf("\n");
    std::vector<std::vector<double>> sweep_us((size_t)n_cases);
    std::vector<std::string> traces((size_t)n_cases);
    int clock_khz_i = 0;
    CK(cudaDeviceGetAttribute(&clock_khz_i, cudaDevAttrClockRate, 0));
    const double clock_khz = clock_khz_i > 0 ? clock_khz_i : 1.98e6;
    int failed = 0;
    /* One launch of a plan on the case's batch set up above (tiles in d_tiles). */
    auto attend = [&](const cuda_flash_plan &plan, float *o) {
        return cuda_flash_attention(st, o, q, kc, vc, d_tables, d_tiles, plan, partial, H, KH, D,
                                    BS, cuda_bf16_out{}, true) == IS_OK;
    };
    if (profile_case >= 0) {
        if (profile_case >= n_cases) {
            fprintf(stderr, "-P: case %d of %d\n", profile_case, n_cases);
            return 2;
        }
        const bench_case &bc = cases[profile_case];
        for (int32_t t = 0; t < bc.T; t++) pos[t] = bc.keys - bc.T + t;
        const cuda_flash_plan plan =
            cuda_flash_plan_batch(sot.data(), pos.data(), bc.T, bt_off, H, KH, D, n_sms,
                                  CUDA_FLASH_CHOICE_AUTO, true, tiles.data());
        CK(cudaMemcpyAsync(d_tiles, tiles.data(),
                           (size_t)plan.n_tiles * FLASH_TILE_INTS * sizeof(int32_t),
                           cudaMemcpyHostToDevice, st));
        const size_t need = cuda_flash_partial_floats(plan, KH, D);
        if (need > 0) CK(cudaMalloc(&partial, need * sizeof(float)));
        CK(cudaMemcpyAsync(q, q_src, (size_t)bc.T * H * D * sizeof(float), cudaMemcpyDeviceToDevice,
                           st));
        for (int r = 0; r < reps; r++) {
            flush_l2<<<4 * n_sms, 256, 0, st>>>(flush, flush_n, sink);
            CK(cudaGetLastError());
            if (!attend(plan, outs[0])) {
                fprintf(stderr, "cuda_flash_attention: %s\n", is_error_last());
                return 1;
            }
        }
        CK(cudaStreamSynchronize(st));
        printf("%s: %d launches of plan %s, %d key warps%s\n", bc.name, reps,
               plan_name(plan).c_str(), plan.key_warps, plan.wgmma ? ", wgmma" : "");
        return 0;
    }
    for (int ci = 0; ci < n_cases; ci++) {
        const bench_case &bc = cases[ci];
        for (int32_t t = 0; t < bc.T; t++) pos[t] = bc.keys - bc.T + t;
        double us[N_MAIN];
        cuda_flash_plan plans[3];
        const size_t n = (size_t)bc.T * H * D;
        std::vector<float> ref(n), a(n);
        double rel = 0.0;
        bool sweep_bad = false;
        for (int variant = 0; variant < N_MAIN + n_sweep; variant++) {
            /* 0 old, 1 new, 2 new with one key warp, 3 new on mma.sync, 4 new
             * on 64-key tiles only, then the sweep */
            cuda_flash_plan plan =
                cuda_flash_plan_batch(sot.data(), pos.data(), bc.T, bt_off, H, KH, D, n_sms,
                                      variant == 0   ? CUDA_FLASH_CHOICE_LEGACY
                                      : variant == 4 ? CUDA_FLASH_CHOICE_NO_WIDE
                                                     : CUDA_FLASH_CHOICE_AUTO,
                                      variant != 3, tiles.data());
            if (variant == 2) { /* the new splits, one warp a key tile (so 64 keys) */
                plan.key_warps = 1;
                plan.key_tile = FLASH_BN;
            }
            if (variant >= N_MAIN) {
                const int v = variant - N_MAIN;
                plan.splits = sweep_splits[v % n_per_kw];
                plan.cluster = sweep_cl[v % n_per_kw];
                plan.key_tile = sweep_wide[v % n_per_kw] ? FLASH_BN_WIDE : FLASH_BN;
                plan.key_warps = 1 + (v / n_per_kw) % 2;
                plan.wgmma = v / (2 * n_per_kw);
                const int32_t max_kt = (bc.keys + plan.key_tile - 1) / plan.key_tile;
                if (plan.splits > max_kt || /* more splits than key tiles: not a plan */
                    (plan.wgmma && !wg_ok) ||
                    (plan.key_tile == FLASH_BN_WIDE && plan.key_warps != 2) ||
                    (plan.cluster && cuda_flash_max_clusters(D, plan.key_warps, plan.splits,
                                                             plan.wgmma, plan.key_tile) <= 0)) {
                    sweep_us[(size_t)ci].push_back(-1.0);
                    continue;
                }
            } else if (variant < 2 || variant == 4) {
                plans[variant < 2 ? variant : 2] = plan;
            }
            CK(cudaMemcpyAsync(d_tiles, tiles.data(),
                               (size_t)plan.n_tiles * FLASH_TILE_INTS * sizeof(int32_t),
                               cudaMemcpyHostToDevice, st));
            const size_t need = plan.splits > 1 ? cuda_flash_partial_floats(plan, KH, D) : 0;
            if (need > partial_cap) {
                CK(cudaStreamSynchronize(st));
                CK(cudaFree(partial));
                CK(cudaMalloc(&partial, need * sizeof(float)));
                partial_cap = need;
            }
            float *out = outs[variant < 2 ? variant : 2];
            std::vector<double> v;
            for (int r = -3; r < reps; r++) { /* 3 warm-up launches */
                flush_l2<<<4 * n_sms, 256, 0, st>>>(flush, flush_n, sink);
                CK(cudaGetLastError());
                CK(cudaMemcpyAsync(q, q_src, (size_t)bc.T * H * D * sizeof(float),
                                   cudaMemcpyDeviceToDevice, st));
                CK(cudaEventRecord(e0, st));
                if (!attend(plan, out)) {
                    fprintf(stderr, "cuda_flash_attention: %s\n", is_error_last());
                    return 1;
                }
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms = 0.0f;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 0) v.push_back(1e3 * ms);
            }
            if (variant < N_MAIN) us[variant] = median(v);
            else sweep_us[(size_t)ci].push_back(median(v));
            if (trace && variant == 1) {
                const size_t blocks = (size_t)plan.n_tiles * KH * plan.splits;
                unsigned long long *d_trace;
                CK(cudaMalloc(&d_trace, blocks * FLASH_TRACE_SLOTS * sizeof(unsigned long long)));
                flush_l2<<<4 * n_sms, 256, 0, st>>>(flush, flush_n, sink);
                CK(cudaMemcpyAsync(q, q_src, (size_t)bc.T * H * D * sizeof(float),
                                   cudaMemcpyDeviceToDevice, st));
                CK(cudaStreamSynchronize(st));
                if (cuda_flash_set_trace(d_trace) != IS_OK || !attend(plan, out) ||
                    cuda_flash_set_trace(NULL) != IS_OK) {
                    fprintf(stderr, "traced launch: %s\n", is_error_last());
                    return 1;
                }
                std::vector<unsigned long long> t(blocks * FLASH_TRACE_SLOTS);
                CK(cudaMemcpy(t.data(), d_trace, t.size() * sizeof t[0], cudaMemcpyDeviceToHost));
                CK(cudaFree(d_trace));
                traces[(size_t)ci] =
                    trace_summary(t, blocks, clock_khz, plan.splits > 1 && plan.cluster);
            }
            /* Relative L2 error of each variant's output against the old
             * plan's (the new plan's is the table's; the sweep's must pass
             * the bar too, or the row fails). */
            if (variant == 0) {
                CK(cudaMemcpy(ref.data(), outs[0], n * sizeof(float), cudaMemcpyDeviceToHost));
                continue;
            }
            CK(cudaMemcpy(a.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
            double num = 0.0, den = 0.0;
            for (size_t i = 0; i < n; i++) {
                const double d = (double)a[i] - ref[i];
                num += d * d;
                den += (double)ref[i] * ref[i];
            }
            const double e = den > 0.0 ? sqrt(num / den) : sqrt(num);
            if (variant == 1) rel = e;
            if (!(e <= 1e-2)) sweep_bad = true; /* NaN too */
        }
        const bool ok = rel <= 1e-2 && !sweep_bad;
        failed += !ok;
        char pl[3][48];
        for (int i = 0; i < 3; i++)
            snprintf(pl[i], sizeof pl[i], "%s, %d (%d)", plan_name(plans[i]).c_str(),
                     plans[i].key_warps, plans[i].n_tiles * KH * plans[i].splits);
        printf("| %s | %d | %d | %s | %.1f | %s%s | %.1f | %.1f | %.1f | %s | %.1f | %.2fx | "
               "%.1e%s |\n",
               bc.name, bc.T, bc.keys, pl[0], us[0], pl[1], plans[1].wgmma ? " wg" : "", us[1],
               us[2], us[3], pl[2], us[4], us[0] / us[1], rel,
               ok          ? ""
               : sweep_bad ? " FAIL (a sweep variant)"
                           : " FAIL");
        fflush(stdout);
    }
    for (int combo = 0; combo < 4; combo++) {
        const int kw = 1 + combo % 2;
        printf("\nThe new plan's tiles on %s with %d key warp%s and a fixed number of splits, us "
               "(- : more splits than key tiles, clusters that do not fit, or no such engine "
               "here):\n\n| case |",
               combo / 2 ? "wgmma" : "mma.sync", kw, kw > 1 ? "s" : "");
        for (int i = 0; i < n_per_kw; i++)
            printf(" %d%s%s |", sweep_splits[i], sweep_cl[i] ? "c" : "", sweep_wide[i] ? "w" : "");
        printf("\n|---|");
        for (int i = 0; i < n_per_kw; i++) printf("---|");
        printf("\n");
        for (int ci = 0; ci < n_cases; ci++) {
            printf("| %s |", cases[ci].name);
            for (int i = 0; i < n_per_kw; i++) {
                const double u = sweep_us[(size_t)ci][(size_t)(combo * n_per_kw + i)];
                if (u < 0) printf(" - |");
                else printf(" %.1f |", u);
            }
            printf("\n");
        }
    }
    if (trace) {
        /* The floor under every row: an empty kernel timed the same way. */
        std::vector<double> v;
        for (int r = -3; r < reps; r++) {
            flush_l2<<<4 * n_sms, 256, 0, st>>>(flush, flush_n, sink);
            CK(cudaEventRecord(e0, st));
            empty_kernel<<<1, 32, 0, st>>>();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 0) v.push_back(1e3 * ms);
        }
        printf("\nOne traced launch of the new plan a case (medians over blocks, us; SM clock "
               "%.0f MHz; the compute part ends when its last mma issues, so the next wait "
               "holds the rest). Empty kernel timed as the rows: %.1f us.\n\n"
               "| case | span | start skew median / max | prologue | tiles | waiting | "
               "computing | key-warp merge | cluster sync | cluster merge (reads) | output + last "
               "sync | "
               "block life |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
               clock_khz / 1e3, median(v));
        for (int ci = 0; ci < n_cases; ci++)
            printf("| %s %s\n", cases[ci].name, traces[(size_t)ci].c_str());
    }
    printf("\n(x 32 layers for a forward's attention; rel err: against the old output, "
           "bar 1e-2)\n");
    cudaFree(kc);
    cudaFree(vc);
    cudaFree(q_src);
    cudaFree(q);
    for (int i = 0; i < 3; i++) cudaFree(outs[i]);
    cudaFree(partial);
    cudaFree(flush);
    cudaFree(sink);
    cudaFree(d_tables);
    cudaFree(d_tiles);
    cudaStreamDestroy(st);
    return failed ? 1 : 0;
}

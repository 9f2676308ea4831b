/*
 * bench_gemm_gpu: the skinny products (cuda/skinny.cuh) against cuBLAS
 * (cublasGemmEx, as the backend calls it) on the matrix shapes of the
 * Llama-3.1-8B layer, for the input rows of a decode step (1) and of a query
 * prefill (30), bf16.
 *
 *  1. Each product alone: medians of events around it, weights rotating
 *     through copies totalling more than the L2 cache (read from memory, as
 *     in a forward); every kernel's result checked against cuBLAS's (max abs
 *     difference over max |y|). -s adds the sweep of column ranges 1..8.
 *  2. Layers in sequence: a layer's four stacked products (qkv, o, gate+up,
 *     down), 8 layers of distinct weights, with or without a small kernel
 *     between products that turns one product's output into the next one's
 *     bf16 input (as RMSNorm, attention and SwiGLU do in a forward): cuBLAS
 *     and skinny, each op launched as usual or as a programmatic dependent
 *     (PDL) of the one before. This is where a product's ramp and tail, and
 *     the boundaries between kernels, show: alone, each is timed with them.
 *  3. A product after a gap: a kernel that holds 96 multiprocessors for
 *     about as long as a 30-token query's attention and reads no memory,
 *     then the product (cuBLAS, 30 rows), with the product's weights (up to
 *     a cap) asked into L2 at the gap's start or not: in line, by plain
 *     loads, by bulk prefetches of 4 KiB, by one prefetch a 128-byte line;
 *     on a second stream, beside the gap, by plain loads or bulk prefetches
 *     of 8 KiB; or the weights read by the same product just before
 *     (untimed: as much of them in L2 as it holds). Says whether a product
 *     reads its weights faster from L2 than from memory, and whether a
 *     prefetch can bring them there without costing the time it saves
 *     (measured: it runs faster after its own read, and slower after
 *     every prefetch; so the backend has none).
 *
 *  4. (-w only) The TMA + wgmma kernel (cuda/wgmma_gemm.cuh) against cuBLAS
 *     at 30 rows: every block shape that fits one wave, each product 8
 *     times in sequence (plain and as dependents), its result against
 *     cuBLAS's (max difference over max |y|, NaN-filled output); then a
 *     layer's products in sequence with a small op between them launched as
 *     a dependent: cuBLAS, the kernel's default and fastest shapes, plain and
 *     as dependents, and with the ops letting their dependents launch at
 *     their start (so that a product streams its first weights while the
 *     op before it runs), on the fastest shapes and on the fastest of those
 *     that hold one block an SM.
 *
 * Usage: bench_gemm_gpu [-r reps] [-s] [-P] [-g] [-w]
 *   -g: only section 3; -w: only section 4.
 *   -P: profile mode for ncu: each stacked product once at 30 rows, cuBLAS
 *       then skinny, nothing else.
 */
#include "bench_cuda.cuh"
#include "common.cuh"
#include "skinny.cuh"
#include "wgmma_gemm.cuh"

#include <math.h>
#include <string.h>

static __global__ void fill_kernel(__nv_bfloat16 *p, int64_t n, uint64_t seed, float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t z = (uint64_t)i + seed * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        p[i] = __float2bfloat16(((float)(z >> 40) / (float)(1 << 24) * 2.0f - 1.0f) * scale);
    }
}

/* The op between two products: the next input in bf16 from the last
 * output (n values; n <= m, the floats it has, on the 8B layer). MODE 1: an
 * ordinary kernel; 2: launched as a programmatic dependent (it waits first,
 * as the backend's ops do); 3: letting a dependent launch start at once;
 * 4: both (a dependent that lets the next dependent launch at once). */
enum { BETWEEN_NONE, BETWEEN_PLAIN, BETWEEN_DEPENDENT, BETWEEN_TRIGGER, BETWEEN_CHAIN };
template <int MODE>
static __global__ void between_kernel(__nv_bfloat16 *x, const float *y, int64_t n, int64_t m) {
    if (MODE == BETWEEN_TRIGGER || MODE == BETWEEN_CHAIN) pdl_trigger();
    if (MODE == BETWEEN_DEPENDENT || MODE == BETWEEN_CHAIN) pdl_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(i < m ? y[i] * 0.01f : 0.0f);
}

/* The gap: each block spins `cycles` clocks and touches no memory. */
static __global__ void spin_kernel(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}

/* Bulk prefetches of `chunk` bytes (a multiple of 16), grid-stride. */
static __global__ void prefetch_bulk_kernel(const char *p, size_t bytes, uint32_t chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const size_t step = (size_t)gridDim.x * blockDim.x * chunk;
    for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < bytes;
         off += step) {
        const size_t left = bytes - off;
        const uint32_t n = (uint32_t)(left < chunk ? left : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p + off), "r"(n)
                     : "memory");
    }
#endif
}

/* Plain loads (L2 only), 8 of 16 bytes in flight a thread; the xor keeps
 * them (the store never happens). The backend's prefetch was this, when
 * it had one, with 64 blocks of 256 threads. */
__device__ volatile unsigned g_load_sink;
static __global__ void load_l2_kernel(const uint4 *p, int64_t n16) {
    unsigned acc = 0;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n16; i += step * 8) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            v[u] = i + u * step < n16 ? __ldcg(p + i + u * step) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9E3779B9u) g_load_sink = acc;
}

/* One prefetch.global.L2 a 128-byte line. */
static __global__ void prefetch_lines_kernel(const char *p, size_t bytes) {
    for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 128; off < bytes;
         off += (size_t)gridDim.x * blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + off));
}

struct shape {
    const char *name;
    int64_t rows, cols;
};

static const shape k_shapes[] = {{"qkv", 6144, 4096},      {"o", 4096, 4096},
                                 {"gate+up", 28672, 4096}, {"down", 4096, 14336},
                                 {"k,v", 1024, 4096},      {"head", 128256, 4096}};
/* The layer's four stacked products, in forward order. */
static const int k_layer[] = {0, 1, 2, 3};

struct bench {
    cudaStream_t st;
    cublasHandle_t cb;
    float *y, *yref;
    __nv_bfloat16 *x;
};

static void run_between(bench &b, int mode, int64_t n, int64_t m) {
    const dim3 grid(cuda_blocks_for(n, 256)), block(256);
    if (mode == BETWEEN_PLAIN)
        between_kernel<BETWEEN_PLAIN><<<grid, block, 0, b.st>>>(b.x, b.y, n, m);
    if (mode == BETWEEN_TRIGGER)
        between_kernel<BETWEEN_TRIGGER><<<grid, block, 0, b.st>>>(b.x, b.y, n, m);
    if (mode == BETWEEN_DEPENDENT)
        CK(cuda_launch_dependent(between_kernel<BETWEEN_DEPENDENT>, grid, block, 0, b.st, true, b.x,
                                 (const float *)b.y, n, m));
    if (mode == BETWEEN_CHAIN)
        CK(cuda_launch_dependent(between_kernel<BETWEEN_CHAIN>, grid, block, 0, b.st, true, b.x,
                                 (const float *)b.y, n, m));
}

static void run_cublas(bench &b, float *out, const __nv_bfloat16 *w, const shape &sh, int n) {
    const float one = 1.0f, zero = 0.0f;
    if (cublasGemmEx(b.cb, CUBLAS_OP_T, CUBLAS_OP_N, (int)sh.rows, n, (int)sh.cols, &one, w,
                     CUDA_R_16BF, (int)sh.cols, b.x, CUDA_R_16BF, (int)sh.cols, &zero, out,
                     CUDA_R_32F, (int)sh.rows, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasGemmEx failed\n");
        exit(1);
    }
}

static void run_skinny(bench &b, float *out, const __nv_bfloat16 *w, const shape &sh, int n,
                       const skinny_plan &p, bool pdl) {
    if (cuda_skinny_gemm(b.st, &p, out, w, b.x, n, sh.rows, sh.cols, pdl) != IS_OK) {
        fprintf(stderr, "skinny failed: %s\n", is_error_last());
        exit(1);
    }
}

/* Copies of a shape's weights totalling more than the L2 cache. */
static std::vector<__nv_bfloat16 *> weight_copies(bench &b, const shape &sh, int min_copies,
                                                  uint64_t seed) {
    const size_t wn = (size_t)(sh.rows * sh.cols);
    int copies = (int)((400ull << 20) / (wn * 2)) + 1;
    if (copies > 16) copies = 16;
    if (copies < min_copies) copies = min_copies;
    std::vector<__nv_bfloat16 *> ws((size_t)copies);
    for (int i = 0; i < copies; i++) {
        CK(cudaMalloc(&ws[(size_t)i], wn * 2));
        fill_kernel<<<4096, 256, 0, b.st>>>(ws[(size_t)i], (int64_t)wn, seed + i,
                                            1.0f / sqrtf((float)sh.cols));
    }
    CK(cudaGetLastError());
    return ws;
}

static void free_copies(std::vector<__nv_bfloat16 *> &ws) {
    for (__nv_bfloat16 *w : ws) CK(cudaFree(w));
    ws.clear();
}

static double max_rel_diff(bench &b, const float *got_d, const float *ref_d, int64_t n) {
    std::vector<float> ref((size_t)n), got((size_t)n);
    CK(cudaMemcpyAsync(ref.data(), ref_d, n * sizeof(float), cudaMemcpyDeviceToHost, b.st));
    CK(cudaMemcpyAsync(got.data(), got_d, n * sizeof(float), cudaMemcpyDeviceToHost, b.st));
    CK(cudaStreamSynchronize(b.st));
    double d = 0, ymax = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[(size_t)i])) return INFINITY; /* fmax would skip a NaN */
        ymax = fmax(ymax, fabs(ref[(size_t)i]));
        d = fmax(d, fabs((double)got[(size_t)i] - ref[(size_t)i]));
    }
    return d / (ymax > 0 ? ymax : 1);
}

/* Median over reps calls of fn(i), i = 3, 4, ... (after fn(0..2) untimed),
 * us from events around each; before(i) runs first, outside the events. */
struct bench_timer {
    bench &b;
    int reps;
    cudaEvent_t e0, e1;
    template <typename F, typename B> double median_us(F &&fn, B &&before) const {
        std::vector<double> v;
        for (int r = 0; r < 3; r++) fn(r);
        for (int r = 0; r < reps; r++) {
            before(r + 3);
            CK(cudaEventRecord(e0, b.st));
            fn(r + 3);
            CK(cudaEventRecord(e1, b.st));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            v.push_back(ms * 1e3);
        }
        CK(cudaGetLastError());
        return median(v);
    }
    template <typename F> double median_us(F &&fn) const {
        return median_us(fn, [](int) {});
    }
};

/* 3. A product after a gap, its weights prefetched into L2 or not. */
static void gap_bench(bench &b, const cudaDeviceProp &prop, int reps, cudaEvent_t e0,
                      cudaEvent_t e1) {
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const double gap_us = 15.0;
    const long long cycles = (long long)(gap_us * khz / 1e3);
    const int n = 30;
    enum {
        PF_NONE,
        PF_LOADS,
        PF_BULK4K,
        PF_LINES,
        PF_SIDE,
        PF_SIDE_WIDE,
        PF_BULK_SIDE,
        PF_WARM,
        PF_WARM_OTHER,
        PF_N
    };
    const char *pf_name[PF_N] = {"none",
                                 "loads, 64 x 256 threads, in line",
                                 "bulk 4 KiB, 132 blocks, in line",
                                 "lines, 132 x 256 threads, in line",
                                 "loads, 64 x 256 threads, on a second stream",
                                 "loads, 132 x 512 threads, on a second stream",
                                 "bulk 8 KiB, 32 blocks, on a second stream",
                                 "none; the same weights just read (untimed)",
                                 "none; the same weights just read by the skinny kernel, 1 row"};
    cudaStream_t side;
    cudaEvent_t go;
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&go, cudaEventDisableTiming));
    const size_t caps[] = {(size_t)16 << 20, (size_t)40 << 20};
    const bench_timer timer{b, reps, e0, e1};
    const double t_gap = timer.median_us([&](int) { spin_kernel<<<96, 256, 0, b.st>>>(cycles); });
    printf("\nA product (cuBLAS, %d rows) after a gap of %.1f us (96 blocks spinning), its "
           "weights' first CAP bytes prefetched into L2 at the gap's start or not; L2 %d MiB; "
           "us, medians of %d:\n\n| shape | MB | prefetch | cap MB | gap + product | product "
           "after the gap | vs none |\n|---|---|---|---|---|---|---|\n",
           n, t_gap, prop.l2CacheSize >> 20, reps);
    for (int li : k_layer) {
        const shape &sh = k_shapes[li];
        std::vector<__nv_bfloat16 *> ws = weight_copies(b, sh, 2, 300);
        const size_t wbytes = (size_t)(sh.rows * sh.cols) * 2;
        double t_none = 0;
        for (int pf = 0; pf < PF_N; pf++)
            for (size_t ci = 0; ci < sizeof caps / sizeof caps[0]; ci++) {
                if ((pf == PF_NONE || pf == PF_WARM || pf == PF_WARM_OTHER) && ci > 0) continue;
                const size_t cap = wbytes < caps[ci] ? wbytes : caps[ci];
                if (ci > 0 && cap == (wbytes < caps[0] ? wbytes : caps[0])) continue;
                const double t = timer.median_us(
                    [&](int r) {
                        const __nv_bfloat16 *w = ws[(size_t)r % ws.size()];
                        const char *p = (const char *)w;
                        if (pf == PF_LOADS)
                            load_l2_kernel<<<64, 256, 0, b.st>>>((const uint4 *)w,
                                                                 (int64_t)(cap / 16));
                        if (pf == PF_BULK4K)
                            prefetch_bulk_kernel<<<132, 128, 0, b.st>>>(p, cap, 4096);
                        if (pf == PF_LINES) prefetch_lines_kernel<<<132, 256, 0, b.st>>>(p, cap);
                        if (pf == PF_SIDE || pf == PF_SIDE_WIDE || pf == PF_BULK_SIDE) {
                            CK(cudaEventRecord(go, b.st));
                            CK(cudaStreamWaitEvent(side, go, 0));
                            if (pf == PF_SIDE)
                                load_l2_kernel<<<64, 256, 0, side>>>((const uint4 *)w,
                                                                     (int64_t)(cap / 16));
                            else if (pf == PF_SIDE_WIDE)
                                load_l2_kernel<<<132, 512, 0, side>>>((const uint4 *)w,
                                                                      (int64_t)(cap / 16));
                            else prefetch_bulk_kernel<<<32, 128, 0, side>>>(p, cap, 8192);
                        }
                        spin_kernel<<<96, 256, 0, b.st>>>(cycles);
                        run_cublas(b, b.yref, w, sh, n);
                    },
                    [&](int r) {
                        if (pf == PF_WARM) run_cublas(b, b.y, ws[(size_t)r % ws.size()], sh, n);
                        if (pf == PF_WARM_OTHER)
                            run_skinny(b, b.y, ws[(size_t)r % ws.size()], sh, 1,
                                       cuda_skinny_plan(1, sh.rows, sh.cols, 0), false);
                    });
                if (pf == PF_NONE) t_none = t;
                printf("| %s | %.1f | %s | %.0f | %.1f | %.1f | %+.1f |\n", sh.name, wbytes / 1e6,
                       pf_name[pf], pf == PF_NONE ? 0.0 : cap / 1048576.0, t, t - t_gap,
                       t - t_none);
            }
        free_copies(ws);
    }
    CK(cudaStreamSynchronize(side));
    CK(cudaStreamDestroy(side));
    CK(cudaEventDestroy(go));
}

static void run_wgmma(bench &b, float *out, const __nv_bfloat16 *w, const shape &sh, int n,
                      bool pdl, const cuda_wgmma_cfg *cfg = NULL, bool trigger = false) {
    if (cuda_wgmma_gemm(b.st, out, w, b.x, n, sh.rows, sh.cols, pdl, trigger, cfg) != IS_OK) {
        fprintf(stderr, "wgmma gemm failed: %s\n", is_error_last());
        exit(1);
    }
}

/* 4. The TMA + wgmma kernel against cuBLAS. */
static void wgmma_bench(bench &b, int reps, cudaEvent_t e0, cudaEvent_t e1) {
    const int n = 30, seq = 8;
    const bench_timer timer{b, reps, e0, e1};
    int n_sms = 0, n_var = 0;
    CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
    const cuda_wgmma_cfg *var = cuda_wgmma_variants(&n_var);
    /* The best block shape of each product, and the best of those that
     * hold one block an SM, for the layers below. */
    cuda_wgmma_cfg best[4], best_one[4];
    printf("\nThe TMA + wgmma kernel against cuBLAS, %d rows, each product %d times in sequence "
           "(distinct weights, from memory), us a product, medians of %d; every block shape "
           "that fits one wave (mb x 64 weight rows a block, stages, column ranges), the fastest "
           "8 and the default:\n\n| shape | kernel | mb | stages | splits | us | as a "
           "dependent (PDL) | rel diff vs cuBLAS |\n|---|---|---|---|---|---|---|---|\n",
           n, seq, reps);
    for (int j = 0; j < 4; j++) {
        const shape &sh = k_shapes[k_layer[j]];
        std::vector<__nv_bfloat16 *> ws = weight_copies(b, sh, 2, 500);
        auto in_seq = [&](auto &&one) {
            return timer.median_us([&](int) {
                for (int i = 0; i < seq; i++) one(ws[(size_t)i % ws.size()]);
            }) / seq;
        };
        run_cublas(b, b.yref, ws[0], sh, n);
        /* The kernel's result with this shape against cuBLAS's, into
         * NaN-filled output (an element never written reads as inf). */
        auto diff_of = [&](const cuda_wgmma_cfg *c) {
            CK(cudaMemsetAsync(b.y, 0xff, (size_t)n * sh.rows * sizeof(float), b.st));
            run_wgmma(b, b.y, ws[0], sh, n, false, c);
            CK(cudaStreamSynchronize(b.st));
            return max_rel_diff(b, b.y, b.yref, (int64_t)n * sh.rows);
        };
        const double tc = in_seq([&](const __nv_bfloat16 *w) { run_cublas(b, b.y, w, sh, n); });
        printf("| %s | cuBLAS | | | | %.1f | | |\n", sh.name, tc);
        struct row {
            cuda_wgmma_cfg c;
            double t, t_pdl, diff;
        };
        std::vector<row> rows;
        const int64_t kt_total = sh.cols / 64;
        for (int v = 0; v < n_var; v++)
            for (int sp = 1; sp <= 8; sp++) {
                const cuda_wgmma_cfg c = {var[v].mb, var[v].stages, sp};
                const int64_t bm = 64 * c.mb;
                const int64_t per_sm = cuda_wgmma_blocks_per_sm(c.mb, c.stages);
                if (sh.rows % bm || sh.rows / bm * sp > n_sms * per_sm || kt_total / sp < 2)
                    continue;
                row r = {c, 0, 0, diff_of(&c)};
                r.t =
                    in_seq([&](const __nv_bfloat16 *w) { run_wgmma(b, b.y, w, sh, n, false, &c); });
                r.t_pdl =
                    in_seq([&](const __nv_bfloat16 *w) { run_wgmma(b, b.y, w, sh, n, true, &c); });
                rows.push_back(r);
            }
        std::sort(rows.begin(), rows.end(), [](const row &a, const row &c) { return a.t < c.t; });
        best[j] = best_one[j] = cuda_wgmma_cfg{0, 0, 0};
        if (!rows.empty()) best[j] = rows[0].c;
        for (const row &r : rows)
            if (cuda_wgmma_blocks_per_sm(r.c.mb, r.c.stages) == 1) {
                best_one[j] = r.c;
                break;
            }
        double worst_diff = 0;
        for (const row &r : rows) worst_diff = fmax(worst_diff, r.diff);
        for (size_t i = 0; i < rows.size() && i < 8; i++)
            printf("| %s | wgmma | %d | %d | %d | %.1f | %.1f | %.2e |\n", sh.name, rows[i].c.mb,
                   rows[i].c.stages, rows[i].c.splits, rows[i].t, rows[i].t_pdl, rows[i].diff);
        const double dd = diff_of(NULL);
        const double td =
            in_seq([&](const __nv_bfloat16 *w) { run_wgmma(b, b.y, w, sh, n, false); });
        const double tdp =
            in_seq([&](const __nv_bfloat16 *w) { run_wgmma(b, b.y, w, sh, n, true); });
        printf("| %s | wgmma, default | | | | %.1f | %.1f | %.2e |\n", sh.name, td, tdp, dd);
        printf("| %s | (%zu block shapes, largest rel diff %.2e) | | | | | | |\n", sh.name,
               rows.size(), worst_diff);
        free_copies(ws);
    }
    /* A layer's products in sequence, a small op between them launched as
     * a dependent; the wgmma kernel as a dependent too (its weights read
     * before its wait). */
    const int n_layers = 8;
    std::vector<__nv_bfloat16 *> lw[4];
    for (int j = 0; j < 4; j++) {
        const shape &sh = k_shapes[k_layer[j]];
        for (int l = 0; l < n_layers; l++) {
            __nv_bfloat16 *p;
            CK(cudaMalloc(&p, (size_t)(sh.rows * sh.cols) * 2));
            fill_kernel<<<4096, 256, 0, b.st>>>(p, sh.rows * sh.cols, 2000 + 16 * j + l,
                                                1.0f / sqrtf((float)sh.cols));
            lw[j].push_back(p);
        }
    }
    printf("\n%d layers' products in sequence, a small op between them as a dependent, us a "
           "layer, medians of %d:\n\n| kernel | us a layer |\n|---|---|\n",
           n_layers, reps);
    const char *kind_name[] = {
        "cuBLAS",
        "wgmma",
        "wgmma as a dependent (PDL)",
        "wgmma, each product's fastest shape",
        "wgmma, each product's fastest shape, as a dependent (PDL)",
        "the same, the op between letting the next product launch at its start",
        "the same, each product letting the op after it launch at its start too",
        "wgmma, each product's fastest shape of one block an SM, as a dependent (PDL)",
        "the same, the ops between and the products letting the next launch at their start"};
    for (int kind = 0; kind < 9; kind++) {
        auto layers = [&](int) {
            for (int l = 0; l < n_layers; l++)
                for (int j = 0; j < 4; j++) {
                    const shape &sh = k_shapes[k_layer[j]];
                    const int64_t next_cols = k_shapes[k_layer[(j + 1) % 4]].cols;
                    if (kind == 0) run_cublas(b, b.y, lw[j][(size_t)l], sh, n);
                    else
                        run_wgmma(b, b.y, lw[j][(size_t)l], sh, n, kind == 2 || kind >= 4,
                                  kind >= 7   ? &best_one[j]
                                  : kind >= 3 ? &best[j]
                                              : NULL,
                                  kind == 6 || kind == 8);
                    run_between(
                        b, kind == 5 || kind == 6 || kind == 8 ? BETWEEN_CHAIN : BETWEEN_DEPENDENT,
                        (int64_t)n * next_cols, (int64_t)n * sh.rows);
                }
        };
        printf("| %s | %.1f |\n", kind_name[kind], timer.median_us(layers) / n_layers);
    }
    for (int j = 0; j < 4; j++) free_copies(lw[j]);
}

int main(int argc, char **argv) {
    int reps = 20;
    bool sweep = false, profile = false, gap_only = false, wgmma_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s")) sweep = true;
        else if (!strcmp(argv[i], "-P")) profile = true;
        else if (!strcmp(argv[i], "-g")) gap_only = true;
        else if (!strcmp(argv[i], "-w")) wgmma_only = true;
        else {
            fprintf(stderr,
                    "usage: %s [-r reps] [-s] [-P] [-g] [-w]\n"
                    "  -r  timed runs a median is taken of (20)\n"
                    "  -s  also sweep the skinny kernel's column ranges 1..8\n"
                    "  -P  each stacked product once at 30 rows (for ncu)\n"
                    "  -g  only the products after a gap, with and without\n"
                    "      their weights prefetched into L2\n"
                    "  -w  only the TMA + wgmma kernel against cuBLAS\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    cudaDeviceProp prop;
    if (!bench_device(&prop)) return 0;
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    bench b;
    CK(cudaStreamCreate(&b.st));
    if (cuda_skinny_prepare() != IS_OK) {
        fprintf(stderr, "cuda_skinny_prepare: %s\n", is_error_last());
        return 1;
    }
    if (cublasCreate(&b.cb) != CUBLAS_STATUS_SUCCESS) return 1;
    cublasSetStream(b.cb, b.st);
    const int64_t y_max = (int64_t)64 * 128256;
    CK(cudaMalloc(&b.y, y_max * sizeof(float)));
    CK(cudaMalloc(&b.yref, y_max * sizeof(float)));
    CK(cudaMalloc(&b.x, (size_t)64 * 14336 * sizeof(__nv_bfloat16)));
    fill_kernel<<<1024, 256, 0, b.st>>>(b.x, (int64_t)64 * 14336, 7, 1.0f);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    if (gap_only) {
        gap_bench(b, prop, reps, e0, e1);
        return 0;
    }
    if (wgmma_only) {
        wgmma_bench(b, reps, e0, e1);
        return 0;
    }
    if (profile) {
        for (int li : k_layer) {
            const shape &sh = k_shapes[li];
            std::vector<__nv_bfloat16 *> ws = weight_copies(b, sh, 1, 100);
            run_cublas(b, b.yref, ws[0], sh, 30);
            run_skinny(b, b.y, ws[0], sh, 30, cuda_skinny_plan(30, sh.rows, sh.cols, 0), false);
            CK(cudaStreamSynchronize(b.st));
            printf("%s: rel diff %.2e\n", sh.name, max_rel_diff(b, b.y, b.yref, 30 * sh.rows));
            free_copies(ws);
        }
        return 0;
    }

    /* 1. Each product alone. */
    const bench_timer timer{b, reps, e0, e1};
    /* Weights rotating through the copies (read from memory). */
    auto time_it = [&](auto &&fn, const std::vector<__nv_bfloat16 *> &ws) {
        return timer.median_us([&](int i) { fn(ws[(size_t)i % ws.size()]); });
    };
    printf("\nEach product alone (weights from memory), us, medians of %d:\n\n"
           "| shape | rows x cols | n | kernel | ranges (kc) | us | TB/s | rel diff vs cuBLAS |\n"
           "|---|---|---|---|---|---|---|---|\n",
           reps);
    const int ns[] = {1, 30};
    double layer[2][2] = {{0}}; /* [n = 1, 30][cuBLAS, skinny auto] */
    for (size_t si = 0; si < sizeof k_shapes / sizeof k_shapes[0]; si++) {
        const shape &sh = k_shapes[si];
        std::vector<__nv_bfloat16 *> ws = weight_copies(b, sh, 2, 100);
        const double gb = (double)sh.rows * sh.cols * 2 / 1e9;
        for (int ni = 0; ni < 2; ni++) {
            const int n = ns[ni];
            if (!strcmp(sh.name, "head") && n != 1) continue;
            const double t_cb =
                time_it([&](const __nv_bfloat16 *w) { run_cublas(b, b.yref, w, sh, n); }, ws);
            printf("| %s | %lld x %lld | %d | cuBLAS | - | %.1f | %.2f | - |\n", sh.name,
                   (long long)sh.rows, (long long)sh.cols, n, t_cb, gb * 1e3 / t_cb);
            run_cublas(b, b.yref, ws[0], sh, n);
            std::vector<skinny_plan> plans = {cuda_skinny_plan(n, sh.rows, sh.cols, 0)};
            if (sweep)
                for (int s = 1; s <= SKINNY_MAX_SPLITS; s++)
                    plans.push_back(cuda_skinny_plan(n, sh.rows, sh.cols, s));
            double t_auto = 0;
            for (size_t pi = 0; pi < plans.size(); pi++) {
                const skinny_plan &p = plans[pi];
                const double t = time_it(
                    [&](const __nv_bfloat16 *w) { run_skinny(b, b.y, w, sh, n, p, false); }, ws);
                run_skinny(b, b.y, ws[0], sh, n, p, false);
                printf("| %s | %lld x %lld | %d | skinny%s | %d (%d) | %.1f | %.2f | %.2e |\n",
                       sh.name, (long long)sh.rows, (long long)sh.cols, n, pi == 0 ? " (auto)" : "",
                       p.splits, p.kc, t, gb * 1e3 / t,
                       max_rel_diff(b, b.y, b.yref, (int64_t)n * sh.rows));
                if (pi == 0) t_auto = t;
            }
            if (si < 4) {
                layer[ni][0] += t_cb;
                layer[ni][1] += t_auto;
            }
        }
        free_copies(ws);
    }
    printf("\nA layer's four stacked products, each alone (sum of the medians), us:\n\n"
           "| n | cuBLAS | skinny | cuBLAS / skinny |\n|---|---|---|---|\n");
    for (int ni = 0; ni < 2; ni++)
        printf("| %d | %.1f | %.1f | %.2fx |\n", ns[ni], layer[ni][0], layer[ni][1],
               layer[ni][0] / layer[ni][1]);

    /* 2. Layers in sequence. */
    const int n_layers = 8;
    std::vector<__nv_bfloat16 *> lw[4];
    for (int j = 0; j < 4; j++) {
        lw[j].resize(n_layers);
        const shape &sh = k_shapes[k_layer[j]];
        for (int l = 0; l < n_layers; l++) {
            CK(cudaMalloc(&lw[j][(size_t)l], (size_t)(sh.rows * sh.cols) * 2));
            fill_kernel<<<4096, 256, 0, b.st>>>(lw[j][(size_t)l], sh.rows * sh.cols,
                                                1000 + 16 * j + l, 1.0f / sqrtf((float)sh.cols));
        }
    }
    CK(cudaGetLastError());
    /* The products' kernel, whether it is launched as a dependent (PDL),
     * and the op between products. */
    struct seq_kind {
        const char *name;
        bool skinny, pdl;
        int between;
    };
    const seq_kind kinds[] = {
        {"cuBLAS, op between", false, false, BETWEEN_PLAIN},
        {"cuBLAS, op between as a dependent", false, false, BETWEEN_DEPENDENT},
        {"skinny, op between", true, false, BETWEEN_PLAIN},
        {"skinny + PDL, op between as a dependent", true, true, BETWEEN_DEPENDENT},
        {"skinny + PDL, op between triggering at once", true, true, BETWEEN_TRIGGER},
        {"cuBLAS, back to back", false, false, BETWEEN_NONE},
        {"skinny, back to back", true, false, BETWEEN_NONE},
        {"skinny + PDL, back to back", true, true, BETWEEN_NONE}};
    const int n_kinds = (int)(sizeof kinds / sizeof kinds[0]);
    double layer_gb = 0;
    for (int j = 0; j < 4; j++)
        layer_gb += (double)k_shapes[k_layer[j]].rows * k_shapes[k_layer[j]].cols * 2 / 1e9;
    printf("\n%d layers' stacked products in sequence (%.1f GB of weights), a kernel between "
           "products unless back to back, us a layer, medians of %d:\n\n| n | kernel | us a layer "
           "| TB/s | vs cuBLAS |\n"
           "|---|---|---|---|---|\n",
           n_layers, n_layers * layer_gb, reps);
    for (int ni = 0; ni < 2; ni++) {
        const int n = ns[ni];
        double t_cublas = 0;
        for (int kind = 0; kind < n_kinds; kind++) {
            const seq_kind &k = kinds[kind];
            auto seq = [&]() {
                for (int l = 0; l < n_layers; l++)
                    for (int j = 0; j < 4; j++) {
                        const shape &sh = k_shapes[k_layer[j]];
                        const int64_t next_cols = k_shapes[k_layer[(j + 1) % 4]].cols;
                        if (!k.skinny) run_cublas(b, b.y, lw[j][(size_t)l], sh, n);
                        else
                            run_skinny(b, b.y, lw[j][(size_t)l], sh, n,
                                       cuda_skinny_plan(n, sh.rows, sh.cols, 0), k.pdl);
                        run_between(b, k.between, (int64_t)n * next_cols, (int64_t)n * sh.rows);
                    }
            };
            std::vector<double> v;
            seq();
            for (int r = 0; r < reps; r++) {
                CK(cudaEventRecord(e0, b.st));
                seq();
                CK(cudaEventRecord(e1, b.st));
                CK(cudaEventSynchronize(e1));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                v.push_back(ms * 1e3 / n_layers);
            }
            CK(cudaGetLastError());
            const double t = median(v);
            if (kind == 0) t_cublas = t;
            printf("| %d | %s | %.1f | %.2f | %.2fx |\n", n, k.name, t, layer_gb * 1e3 / t,
                   t_cublas / t);
        }
    }
    printf("\n(weight reading alone at 4.2 TB/s: %.0f us a layer)\n", layer_gb / 4.2 * 1e3);
    for (int j = 0; j < 4; j++) free_copies(lw[j]);
    gap_bench(b, prop, reps, e0, e1);
    return 0;
}

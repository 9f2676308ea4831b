/*
 * gemm: cuBLASLt products with timed algorithm choice (see gemm.cuh).
 *
 * The view is cuBLAS's column-major one the backend already uses with
 * cublasGemmEx: y^T[rows][n] = W^T x^T, W stored as a cols x rows matrix
 * (ld cols) taken transposed, x as cols x n (ld cols), y as rows x n (ld
 * rows); f32 accumulation and output.
 */
#include "gemm.cuh"

#include <algorithm>
#include <chrono>
#include <cublasLt.h>
#include <stdlib.h>

#define GEMM_CACHE 256      /* problems remembered; past that, the caller's product */
#define GEMM_CANDIDATES 16  /* heuristic results timed */
#define GEMM_TIMED_RUNS 3   /* after one warm-up; the median decides */
/* Written before each timed run so the weights come from memory, as in a
 * forward where every product reads weights no other product touched (L2:
 * 50 MB on the H100/H200). */
#define GEMM_FLUSH_BYTES ((size_t)96 << 20)

typedef struct gemm_entry {
    int64_t rows, cols;
    int32_t n, align;
    bool usable; /* an algorithm was found and chosen */
    cublasLtMatmulAlgo_t algo;
    cublasLtMatrixLayout_t a, b, c;
} gemm_entry;

struct cuda_gemm {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    gemm_entry cache[GEMM_CACHE];
    int32_t n_cache;
    void *flush;
    cudaEvent_t e0, e1;
    cuda_gemm_stats stats;
};

static is_status lt_status(cublasStatus_t st, const char *what) {
    return cublas_status_from(st, what, __FILE__, __LINE__);
}

#define LT_CHECK(call)                                                                             \
    do {                                                                                           \
        cublasStatus_t lt_check_st_ = (call);                                                      \
        if (lt_check_st_ != CUBLAS_STATUS_SUCCESS) return lt_status(lt_check_st_, #call);          \
    } while (0)

is_status cuda_gemm_create(cuda_gemm **out) {
    *out = NULL;
    cuda_gemm *g = (cuda_gemm *)calloc(1, sizeof *g);
    if (!g) return is_error_set(IS_ERR_NOMEM, "cuda gemm: out of memory");
    is_status st = IS_OK;
    cublasStatus_t bs = cublasLtCreate(&g->lt);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        g->lt = NULL;
        st = lt_status(bs, "cublasLtCreate");
    }
    if (st == IS_OK) {
        bs = cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        if (bs != CUBLAS_STATUS_SUCCESS) {
            g->op = NULL;
            st = lt_status(bs, "cublasLtMatmulDescCreate");
        }
    }
    if (st == IS_OK) {
        const cublasOperation_t t = CUBLAS_OP_T;
        bs = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
        if (bs != CUBLAS_STATUS_SUCCESS) st = lt_status(bs, "cublasLtMatmulDescSetAttribute");
    }
    if (st == IS_OK) {
        cudaError_t e = cudaEventCreate(&g->e0);
        if (e == cudaSuccess) e = cudaEventCreate(&g->e1);
        if (e != cudaSuccess) st = cuda_status_from(e, "cudaEventCreate", __FILE__, __LINE__);
    }
    if (st != IS_OK) {
        cuda_gemm_free(g);
        return st;
    }
    *out = g;
    return IS_OK;
}

void cuda_gemm_free(cuda_gemm *g) {
    if (!g) return;
    for (int32_t i = 0; i < g->n_cache; i++) {
        gemm_entry *e = &g->cache[i];
        if (e->a) cublasLtMatrixLayoutDestroy(e->a);
        if (e->b) cublasLtMatrixLayoutDestroy(e->b);
        if (e->c) cublasLtMatrixLayoutDestroy(e->c);
    }
    if (g->op) cublasLtMatmulDescDestroy(g->op);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->e0) cudaEventDestroy(g->e0);
    if (g->e1) cudaEventDestroy(g->e1);
    cudaFree(g->flush);
    free(g);
}

/* The largest power of two up to 256 that divides every address: an
 * algorithm chosen for aligned operands may not run on less aligned ones,
 * so the alignment is part of the problem. */
static int32_t alignment_of(const void *w, const void *x, const void *y) {
    const uintptr_t any = (uintptr_t)w | (uintptr_t)x | (uintptr_t)y;
    int32_t a = 256;
    while (a > 1 && (any & (uintptr_t)(a - 1))) a >>= 1;
    return a;
}

static is_status entry_layouts(gemm_entry *e) {
    LT_CHECK(cublasLtMatrixLayoutCreate(&e->a, CUDA_R_16BF, (uint64_t)e->cols, (uint64_t)e->rows,
                                        e->cols));
    LT_CHECK(cublasLtMatrixLayoutCreate(&e->b, CUDA_R_16BF, (uint64_t)e->cols, (uint64_t)e->n,
                                        e->cols));
    LT_CHECK(cublasLtMatrixLayoutCreate(&e->c, CUDA_R_32F, (uint64_t)e->rows, (uint64_t)e->n,
                                        e->rows));
    return IS_OK;
}

static cublasStatus_t run_algo(cuda_gemm *g, cudaStream_t s, const gemm_entry *e,
                               const cublasLtMatmulAlgo_t *algo, float *y, const __nv_bfloat16 *w,
                               const __nv_bfloat16 *x, void *ws, size_t ws_bytes) {
    const float one = 1.0f, zero = 0.0f;
    return cublasLtMatmul(g->lt, g->op, &one, w, e->a, x, e->b, &zero, y, e->c, y, e->c, algo, ws,
                          ws_bytes, s);
}

/* The heuristic's candidates, each run once cold and GEMM_TIMED_RUNS times
 * timed; e->usable when one of them ran. Leaves y holding some candidate's
 * result: the caller runs the chosen one after. */
static is_status tune(cuda_gemm *g, cudaStream_t s, gemm_entry *e, float *y,
                      const __nv_bfloat16 *w, const __nv_bfloat16 *x, void *ws, size_t ws_bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws_max = ws_bytes;
    const uint32_t al = (uint32_t)e->align;
    cublasLtMatmulHeuristicResult_t res[GEMM_CANDIDATES];
    int found = 0;
    cublasStatus_t bs = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_max, sizeof ws_max);
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && bs == CUBLAS_STATUS_SUCCESS; i++)
        bs = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &al, sizeof al);
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasLtMatmulAlgoGetHeuristic(g->lt, g->op, e->a, e->b, e->c, e->c, pref,
                                            GEMM_CANDIDATES, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (bs == CUBLAS_STATUS_NOT_SUPPORTED) found = 0; /* no algorithm: the caller's product */
    else if (bs != CUBLAS_STATUS_SUCCESS) return lt_status(bs, "cublasLtMatmulAlgoGetHeuristic");
    if (found > 0 && !g->flush) CUDA_CHECK(cudaMalloc(&g->flush, GEMM_FLUSH_BYTES));
    double best = 1e30;
    for (int i = 0; i < found; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ws_bytes) continue;
        float ms[GEMM_TIMED_RUNS];
        bool ok = true;
        for (int r = -1; r < GEMM_TIMED_RUNS && ok; r++) {
            CUDA_CHECK(cudaMemsetAsync(g->flush, r & 0xff, GEMM_FLUSH_BYTES, s));
            CUDA_CHECK(cudaEventRecord(g->e0, s));
            ok = run_algo(g, s, e, &res[i].algo, y, w, x, ws, ws_bytes) == CUBLAS_STATUS_SUCCESS;
            CUDA_CHECK(cudaEventRecord(g->e1, s));
            CUDA_CHECK(cudaEventSynchronize(g->e1));
            if (ok && r >= 0) CUDA_CHECK(cudaEventElapsedTime(&ms[r], g->e0, g->e1));
        }
        if (!ok) continue; /* offered but refused at launch: not a candidate */
        g->stats.candidates++;
        std::sort(ms, ms + GEMM_TIMED_RUNS);
        if (ms[GEMM_TIMED_RUNS / 2] < best) {
            best = ms[GEMM_TIMED_RUNS / 2];
            e->algo = res[i].algo;
            e->usable = true;
        }
    }
    (void)cudaGetLastError(); /* a candidate refused at launch leaves no error behind */
    g->stats.problems++;
    g->stats.tune_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return IS_OK;
}

is_status cuda_gemm_bf16(cuda_gemm *g, cudaStream_t s, float *y, const __nv_bfloat16 *w,
                         const __nv_bfloat16 *x, int64_t rows, int32_t n, int64_t cols, void *ws,
                         size_t ws_bytes, bool may_tune, bool *ran) {
    *ran = false;
    if (n < 1 || n > CUDA_GEMM_TUNE_MAX_N || rows < 1 || cols < 1) return IS_OK;
    const int32_t align = alignment_of(w, x, y);
    gemm_entry *e = NULL;
    for (int32_t i = 0; i < g->n_cache && !e; i++) {
        gemm_entry *c = &g->cache[i];
        if (c->rows == rows && c->cols == cols && c->n == n && c->align == align) e = c;
    }
    if (!e) {
        if (!may_tune || g->n_cache == GEMM_CACHE) return IS_OK;
        e = &g->cache[g->n_cache++];
        *e = gemm_entry{};
        e->rows = rows;
        e->cols = cols;
        e->n = n;
        e->align = align;
        is_status st = entry_layouts(e);
        if (st == IS_OK) st = tune(g, s, e, y, w, x, ws, ws_bytes);
        if (st != IS_OK) {
            e->usable = false; /* remembered as unusable: the caller's product from now on */
            return st;
        }
    }
    if (!e->usable) return IS_OK;
    cublasStatus_t bs = run_algo(g, s, e, &e->algo, y, w, x, ws, ws_bytes);
    if (bs != CUBLAS_STATUS_SUCCESS) return lt_status(bs, "cublasLtMatmul");
    g->stats.calls++;
    *ran = true;
    return IS_OK;
}

void cuda_gemm_stats_get(const cuda_gemm *g, cuda_gemm_stats *out) {
    *out = g ? g->stats : cuda_gemm_stats{};
}

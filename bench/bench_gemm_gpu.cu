/*
 * bench_gemm_gpu: the skinny products (cuda/skinny.cuh) against cuBLAS
 * (cublasGemmEx, as the backend called it before) on the matrix shapes of
 * the Llama-3.1-8B layer, for the token counts of a decode step (1) and of a
 * query prefill (30), bf16 inputs and split bf16x2 inputs. Every timing also
 * checks the kernel's result against cuBLAS's (max abs difference over the
 * max |y|). Weights rotate through copies totalling more than the L2
 * cache, so each product reads its weights from memory as in a forward.
 * The stacked shapes (qkv, gate+up: the backend's matmul_n) against the
 * separate products, cuBLAS for both.
 *
 * Usage: bench_gemm_gpu [-r reps] [-s]   (-s: the whole cut sweep, else auto only)
 */
#include "bench_cuda.cuh"
#include "common.cuh"
#include "skinny.cuh"

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

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

static __global__ void sum_halves_kernel(float *y, const float *part, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = part[i] + part[n + i];
}

struct shape {
    const char *name;
    int64_t rows, cols;
};

/* A per-layer table, [T = 1, 30][bf16, bf16x2]: a against b and their ratio. */
static void layer_table(const char *title, const char *cols, const double a[2][2],
                        const double b[2][2]) {
    printf("\n%s:\n\n| T | input | %s | ratio |\n|---|---|---|---|---|\n", title, cols);
    for (int ti = 0; ti < 2; ti++)
        for (int split = 0; split < 2; split++)
            printf("| %d | %s | %.1f | %.1f | %.2fx |\n", ti ? 30 : 1, split ? "bf16x2" : "bf16",
                   a[ti][split], b[ti][split], a[ti][split] / b[ti][split]);
}

int main(int argc, char **argv) {
    int reps = 20;
    bool sweep = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s")) sweep = true;
        else {
            fprintf(stderr, "usage: %s [-r reps] [-s]\n", argv[0]);
            return 2;
        }
    }
    cudaDeviceProp prop;
    if (!bench_device(&prop)) return 0;
    const int n_sms = prop.multiProcessorCount;
    printf("device: %s, %d SMs\n", prop.name, n_sms);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    if (cuda_skinny_prepare() != IS_OK) {
        fprintf(stderr, "cuda_skinny_prepare: %s\n", is_error_last());
        return 1;
    }
    cublasHandle_t cb;
    if (cublasCreate(&cb) != CUBLAS_STATUS_SUCCESS) return 1;
    cublasSetStream(cb, st);

    /* qkv and gate+up: the stacked weights the backend multiplies in one
     * product (matmul_n). */
    const shape shapes[] = {{"q,o", 4096, 4096},       {"k,v", 1024, 4096},
                            {"gate,up", 14336, 4096},  {"down", 4096, 14336},
                            {"head", 128256, 4096},    {"qkv", 6144, 4096},
                            {"gate+up", 28672, 4096}};
    const int Ts[] = {1, 30};
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float *partial = NULL, *y = NULL, *yref = NULL, *ypart = NULL;
    CK(cudaMalloc(&partial, ((size_t)32 << 20) * sizeof(float)));
    CK(cudaMalloc(&y, (size_t)64 * 128256 * sizeof(float)));
    CK(cudaMalloc(&yref, (size_t)64 * 128256 * sizeof(float)));
    CK(cudaMalloc(&ypart, (size_t)128 * 128256 * sizeof(float)));
    __nv_bfloat16 *x = NULL;
    CK(cudaMalloc(&x, (size_t)128 * 14336 * sizeof(__nv_bfloat16)));
    fill_kernel<<<1024, 256, 0, st>>>(x, (int64_t)128 * 14336, 7, 1.0f);

    printf("\n| shape | rows x cols | T | input | kernel | cut (mt, kc, splits) | us (median) | GB/s | "
           "rel diff vs cuBLAS |\n|---|---|---|---|---|---|---|---|---|\n");
    double layer_cublas[2][2] = {{0}}, layer_skinny[2][2] = {{0}}, layer_stacked[2][2] = {{0}};
    for (const shape &sh : shapes) {
        const size_t wn = (size_t)(sh.rows * sh.cols);
        const size_t wbytes = wn * sizeof(__nv_bfloat16);
        int copies = (int)((400ull << 20) / wbytes) + 1;
        if (copies > 16) copies = 16;
        if (copies < 2) copies = 2;
        std::vector<__nv_bfloat16 *> ws((size_t)copies);
        for (int i = 0; i < copies; i++) {
            CK(cudaMalloc(&ws[(size_t)i], wbytes));
            fill_kernel<<<4096, 256, 0, st>>>(ws[(size_t)i], (int64_t)wn, 100 + i,
                                              1.0f / sqrtf((float)sh.cols));
        }
        for (int T : Ts) {
            if (!strcmp(sh.name, "head") && T != 1) continue;
            for (int split = 0; split < 2; split++) {
                const int ncol = split ? 2 * T : T;
                const int64_t yn = (int64_t)T * sh.rows;
                const float one = 1.0f, zero = 0.0f;
                auto run_cublas = [&](const __nv_bfloat16 *w) {
                    float *out = split ? ypart : yref;
                    cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, (int)sh.rows, ncol, (int)sh.cols,
                                 &one, w, CUDA_R_16BF, (int)sh.cols, x, CUDA_R_16BF, (int)sh.cols,
                                 &zero, out, CUDA_R_32F, (int)sh.rows, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT);
                    if (split) sum_halves_kernel<<<512, 256, 0, st>>>(yref, ypart, yn);
                };
                auto time_it = [&](auto &&fn) {
                    std::vector<double> v;
                    for (int r = 0; r < 3; r++) fn(ws[(size_t)r % copies]);
                    for (int r = 0; r < reps; r++) {
                        CK(cudaEventRecord(e0, st));
                        fn(ws[(size_t)(r + 3) % copies]);
                        CK(cudaEventRecord(e1, st));
                        CK(cudaEventSynchronize(e1));
                        float ms = 0;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        v.push_back(ms * 1e3);
                    }
                    return median(v);
                };
                const double t_cb = time_it(run_cublas);
                printf("| %s | %lld x %lld | %d | %s | cuBLAS | - | %.1f | %.0f | - |\n", sh.name,
                       (long long)sh.rows, (long long)sh.cols, T, split ? "bf16x2" : "bf16", t_cb,
                       wbytes / t_cb / 1e3);
                /* The reference once more on copy 0, for the checks. */
                run_cublas(ws[0]);
                std::vector<float> ref((size_t)yn), got((size_t)yn);
                CK(cudaMemcpyAsync(ref.data(), yref, yn * sizeof(float), cudaMemcpyDeviceToHost, st));
                CK(cudaStreamSynchronize(st));
                double ymax = 0;
                for (float f : ref) ymax = fmax(ymax, fabs(f));

                std::vector<skinny_plan> plans;
                plans.push_back(cuda_skinny_plan(T, sh.rows, sh.cols, split, n_sms, 0, 0));
                if (sweep)
                    for (int mt = 1; mt <= 2; mt++)
                        for (int kc = 128; kc <= 8192; kc *= 2) {
                            skinny_plan p = cuda_skinny_plan(T, sh.rows, sh.cols, split, n_sms, mt, kc);
                            if (p.kc == kc) plans.push_back(p);
                        }
                double best = 1e30;
                for (size_t pi = 0; pi < plans.size(); pi++) {
                    const skinny_plan &p = plans[pi];
                    auto run = [&](const __nv_bfloat16 *w) {
                        is_status s = cuda_skinny_matmul(st, &p, y, w, x, NULL, T, sh.rows,
                                                         sh.cols, split, partial);
                        if (s != IS_OK) {
                            fprintf(stderr, "skinny failed: %s\n", is_error_last());
                            exit(1);
                        }
                    };
                    const double t = time_it(run);
                    run(ws[0]);
                    CK(cudaMemcpyAsync(got.data(), y, yn * sizeof(float), cudaMemcpyDeviceToHost, st));
                    CK(cudaStreamSynchronize(st));
                    double d = 0;
                    for (int64_t i = 0; i < yn; i++) d = fmax(d, fabs((double)got[(size_t)i] - ref[(size_t)i]));
                    printf("| %s | %lld x %lld | %d | %s | skinny%s | %d, %d, %d | %.1f | %.0f | %.2e |\n",
                           sh.name, (long long)sh.rows, (long long)sh.cols, T,
                           split ? "bf16x2" : "bf16", pi == 0 ? " (auto)" : "", p.mt, p.kc,
                           p.n_splits, t, wbytes / t / 1e3, d / (ymax > 0 ? ymax : 1));
                    if (pi == 0) best = t;
                }
                /* One layer: q, k, v, o, gate, up, down; stacked: qkv, o,
                 * gate+up, down. */
                const bool stk = !strcmp(sh.name, "qkv") || !strcmp(sh.name, "gate+up");
                const double mult = !strcmp(sh.name, "head") || stk ? 0
                                    : !strcmp(sh.name, "down")      ? 1
                                                                    : 2;
                layer_cublas[T == 30][split] += mult * t_cb;
                layer_skinny[T == 30][split] += mult * best;
                if (stk || !strcmp(sh.name, "down")) layer_stacked[T == 30][split] += t_cb;
                if (!strcmp(sh.name, "q,o")) layer_stacked[T == 30][split] += t_cb;
            }
        }
        for (__nv_bfloat16 *w : ws) CK(cudaFree(w));
    }
    layer_table("One 8B layer's seven products (auto cut), us", "cuBLAS | skinny", layer_cublas,
                layer_skinny);
    layer_table("The same on cuBLAS with stacked weights (qkv, o, gate+up, down), us",
                "seven products | four stacked", layer_cublas, layer_stacked);
    printf("\n(weight reading alone at 4.2 TB/s: 104 us a layer)\n");
    return 0;
}

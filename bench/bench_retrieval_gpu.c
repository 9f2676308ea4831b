/*
 * bench_retrieval_gpu: one request's retrieval on the CPU and on the GPU,
 * for one user holding N facts.
 *
 *   bench_retrieval_gpu [-e MODEL_DIR] [-n 1000,10000,100000] [-k 50] [-r REPS] [-t THREADS]
 *                       [-s SEED] [-o CSV]
 *
 *   CPU: embedder_embed of a ~30-token query (memory/embedder.h, THREADS
 *        threads, default all cores), then mem_index_search, dense, top-k
 *        (memory/index.h: exact, int8 bounds then f32 rescoring, one thread);
 *   GPU: cuda_embedder_embed_device of the same query into device memory,
 *        then cuda_fact_matrix_search, top-k (cuda/retrieval_cuda.h);
 *        "embed" waits for the stream, "search" includes copying the k
 *        (row, score) pairs back, "request" runs both back to back with one
 *        wait at the end (the serving path: the query vector stays on the
 *        device).
 * Medians of REPS runs (default 50, at least 20) after 5 warm-up runs.
 *
 * Facts: with the model (MODEL_DIR, default models/all-MiniLM-L6-v2), the
 * MiniLM embeddings of synthetic sentences of 8-20 words drawn from a
 * LoCoMo-like word list, embedded once on the GPU (and checked against the
 * CPU embedder on a sample): real embeddings cluster, which is what the CPU
 * index's int8 pruning meets in practice. Without the model, random unit
 * vectors of 384 floats, and only the search columns are timed.
 *
 * PCIe bytes per request, GPU path: up the query's token ids and the two
 * offsets of its text (4 bytes each), down k rows and k scores (4 bytes
 * each); kernel arguments aside.
 *
 * Prints a markdown table and, for scripts, one CSV line per N:
 * retrieval,<N>,<k>,<cpu embed ms>,<cpu search ms>,<gpu embed ms>,<gpu search ms>,<gpu request ms>,
 *   <pcie bytes>,<same top-k> (one line).
 */
#include "backend_cuda.h"
#include "core/status.h"
#include "memory/embedder.h"
#include "memory/embedder_weights.h"
#include "memory/index.h"
#include "memory/wordpiece.h"
#include "retrieval_cuda.h"
#include "bench_util.h"

#include <cuda_runtime_api.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WARMUP 5

static uint64_t rng_state = 42;

static void unit_vector(float *x, int32_t dim) {
    double ss = 0;
    for (int32_t d = 0; d < dim; d++) {
        x[d] = bench_normal(&rng_state);
        ss += (double)x[d] * x[d];
    }
    for (int32_t d = 0; d < dim; d++) x[d] = (float)(x[d] / sqrt(ss));
}

static void die(const char *what, is_status st) {
    fprintf(stderr, "bench_retrieval_gpu: %s: %s (%s)\n", what, is_status_to_string(st),
            is_error_last());
    exit(1);
}

static void cuda_die(const char *what, cudaError_t e) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "bench_retrieval_gpu: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
}

/* A sentence of 8-20 words (words cycle with a Zipf-like skew). */
static char *sentence(void) {
    int nw;
    const char *const *words = bench_vocab(&nw);
    const int len = 8 + (int)(bench_splitmix(&rng_state) % 13);
    char *s = malloc(400);
    size_t at = 0;
    for (int i = 0; i < len; i++) {
        int w = (int)(pow(bench_unit(&rng_state), 1.7) * nw);
        if (w >= nw) w = nw - 1;
        at += (size_t)snprintf(s + at, 400 - at, "%s%s", i ? " " : "", words[w]);
    }
    snprintf(s + at, 400 - at, ".");
    return s;
}

static void parse_list(const char *s, int32_t *v, int *n) {
    *n = 0;
    for (const char *p = s; *p && *n < 16;) {
        v[(*n)++] = (int32_t)strtol(p, (char **)&p, 10);
        if (*p == ',') p++;
        else break;
    }
}

int main(int argc, char **argv) {
    const char *model_dir = "models/all-MiniLM-L6-v2", *csv = NULL;
    int32_t sizes[16] = {1000, 10000, 100000};
    int n_sizes = 3, reps = 50, threads = 0;
    int32_t k = 50;
    int opt;
    while ((opt = getopt(argc, argv, "e:n:k:r:t:s:o:h")) != -1) {
        switch (opt) {
        case 'e': model_dir = optarg; break;
        case 'n': parse_list(optarg, sizes, &n_sizes); break;
        case 'k': k = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 's': rng_state = strtoull(optarg, NULL, 10); break;
        case 'o': csv = optarg; break;
        default:
            fprintf(
                stderr,
                "usage: %s [-e MODEL_DIR] [-n 1000,10000,100000] [-k 50] [-r REPS] [-t THREADS] "
                "[-s SEED] [-o CSV]\n",
                argv[0]);
            return 2;
        }
    }
    if (reps < 20) reps = 20;
    if (k < 1 || k > CUDA_TOPK_MAX) {
        fprintf(stderr, "bench_retrieval_gpu: k must be in [1, %d]\n", CUDA_TOPK_MAX);
        return 2;
    }
    if (!backend_cuda_available()) {
        fprintf(stderr, "bench_retrieval_gpu: no usable CUDA device\n");
        return 1;
    }
    int32_t max_n = 0;
    for (int i = 0; i < n_sizes; i++)
        if (sizes[i] > max_n) max_n = sizes[i];

    /* The embedders, when the model is there. */
    embedder *cpu = NULL;
    cuda_embedder *gpu = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", model_dir);
    if (access(path, R_OK) == 0) {
        is_status st = embedder_load(model_dir, &cpu);
        if (st != IS_OK) die("embedder_load", st);
        embedder_set_n_threads(cpu, threads);
        encoder_weights w;
        embedder_get_weights(cpu, &w);
        if ((st = cuda_embedder_create(&w, 0, &gpu)) != IS_OK) die("cuda_embedder_create", st);
    } else {
        printf("no model at %s: random unit facts, search only\n", model_dir);
    }
    const int32_t dim = cpu ? embedder_dim(cpu) : 384;

    const char *query =
        "What did Caroline say about the adoption agency she visited with her kids after the "
        "LGBTQ support group meeting in the city last Friday?";
    int32_t q_tokens = 0;
    float *qv = malloc((size_t)dim * sizeof(float));
    if (cpu) {
        int32_t ids[512];
        is_status st = wordpiece_encode(embedder_tokenizer(cpu), query, strlen(query),
                                        embedder_max_tokens(cpu), ids, &q_tokens);
        if (st != IS_OK) die("tokenise", st);
        if ((st = embedder_embed(cpu, &query, 1, qv)) != IS_OK) die("embedder_embed", st);
    } else {
        unit_vector(qv, dim);
    }

    /* Facts: max_n of them; the sizes take the first N. */
    float *facts = malloc((size_t)max_n * (size_t)dim * sizeof(float));
    double t0 = bench_now_ms();
    if (gpu) {
        const int32_t batch = 4096;
        char **texts = malloc((size_t)batch * sizeof *texts);
        for (int32_t i0 = 0; i0 < max_n; i0 += batch) {
            const int32_t m = max_n - i0 < batch ? max_n - i0 : batch;
            for (int32_t i = 0; i < m; i++) texts[i] = sentence();
            is_status st =
                cuda_embedder_embed(gpu, (const char *const *)texts, m, facts + (size_t)i0 * dim);
            if (st != IS_OK) die("cuda_embedder_embed (facts)", st);
            if (i0 == 0) { /* the GPU's fact vectors against the CPU's, on a sample */
                float *c = malloc((size_t)64 * dim * sizeof(float));
                const int32_t s = m < 64 ? m : 64;
                if ((st = embedder_embed(cpu, (const char *const *)texts, s, c)) != IS_OK)
                    die("embedder_embed", st);
                double worst = 1.0;
                for (int32_t i = 0; i < s; i++) {
                    double dot = 0;
                    for (int32_t d = 0; d < dim; d++)
                        dot += (double)c[i * dim + d] * facts[(size_t)i * dim + d];
                    if (dot < worst) worst = dot;
                }
                printf("fact embeddings: GPU vs CPU cosine >= %.7f on %d sentences\n", worst, s);
                free(c);
            }
            for (int32_t i = 0; i < m; i++) free(texts[i]);
        }
        free(texts);
        printf(
            "facts: MiniLM embeddings of %d synthetic sentences (embedded on the GPU in %.0f ms)\n",
            max_n, bench_now_ms() - t0);
    } else {
        for (size_t i = 0; i < (size_t)max_n; i++) { unit_vector(facts + i * dim, dim); }
        printf("facts: %d random unit vectors of %d floats\n", max_n, dim);
    }

    float *qdev = NULL;
    cuda_die("cudaMalloc", cudaMalloc((void **)&qdev, (size_t)dim * sizeof(float)));
    if (!gpu)
        cuda_die("cudaMemcpy",
                 cudaMemcpy(qdev, qv, (size_t)dim * sizeof(float), cudaMemcpyHostToDevice));
    const int64_t pcie = gpu ? (int64_t)(q_tokens + 2) * 4 + (int64_t)k * 8 : (int64_t)k * 8;

    FILE *out = csv ? fopen(csv, "w") : NULL;
    printf("\nquery: %d tokens; k = %d; medians of %d runs after %d warm-up\n\n", q_tokens, k, reps,
           WARMUP);
    printf("| facts N | CPU embed ms | CPU search ms | GPU embed ms | GPU search ms | GPU "
           "embed+search ms "
           "| PCIe bytes/request (GPU) | same top-%d |\n",
           k);
    printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    double *tc_e = malloc((size_t)reps * sizeof(double)),
           *tc_s = malloc((size_t)reps * sizeof(double));
    double *tg_e = malloc((size_t)reps * sizeof(double)),
           *tg_s = malloc((size_t)reps * sizeof(double));
    double *tg_r = malloc((size_t)reps * sizeof(double));
    char lines[16 * 128]; /* the CSV lines, printed after the table */
    size_t at = 0;
    mem_hit *hits = malloc((size_t)k * sizeof *hits);
    int32_t *idx = malloc((size_t)k * sizeof *idx);
    float *score = malloc((size_t)k * sizeof *score);
    for (int si = 0; si < n_sizes; si++) {
        const int32_t N = sizes[si];
        mem_index *ix = NULL;
        is_status st = mem_index_create(dim, &ix);
        if (st != IS_OK) die("mem_index_create", st);
        char id[32];
        for (int32_t i = 0; i < N; i++) {
            snprintf(id, sizeof id, "%d", i);
            mem_doc d = {
                .id = id, .tenant = "bench", .user = "user", .embedding = facts + (size_t)i * dim};
            if ((st = mem_index_upsert(ix, &d)) != IS_OK) die("mem_index_upsert", st);
        }
        cuda_fact_matrix *m = NULL;
        if ((st = cuda_fact_matrix_create(0, dim, &m)) != IS_OK) die("cuda_fact_matrix_create", st);
        int32_t *rows = malloc((size_t)N * sizeof *rows);
        for (int32_t i = 0; i < N; i++) rows[i] = i;
        if ((st = cuda_fact_matrix_set_rows(m, rows, N, facts)) != IS_OK)
            die("cuda_fact_matrix_set_rows", st);
        free(rows);
        const mem_filter f = {.tenant = "bench", .user = "user"};
        int32_t nh = 0, ng = 0;

        for (int r = -WARMUP; r < reps; r++) {
            double a = bench_now_ms();
            if (cpu && (st = embedder_embed(cpu, &query, 1, qv)) != IS_OK)
                die("embedder_embed", st);
            double b = bench_now_ms();
            if ((st = mem_index_search(ix, &f, qv, NULL, k, MEM_SEARCH_DENSE, hits, &nh)) != IS_OK)
                die("mem_index_search", st);
            double c = bench_now_ms();
            if (gpu) {
                if ((st = cuda_embedder_embed_device(gpu, &query, 1, qdev)) != IS_OK)
                    die("embed_device", st);
                cuda_die("sync", cudaStreamSynchronize(cudaStreamPerThread));
            }
            double d = bench_now_ms();
            if ((st = cuda_fact_matrix_search(m, qdev, k, idx, score, &ng)) != IS_OK)
                die("search", st);
            double e = bench_now_ms();
            if (gpu && (st = cuda_embedder_embed_device(gpu, &query, 1, qdev)) != IS_OK)
                die("embed_device", st);
            if ((st = cuda_fact_matrix_search(m, qdev, k, idx, score, &ng)) != IS_OK)
                die("search", st);
            double g = bench_now_ms();
            if (r >= 0) {
                tc_e[r] = b - a;
                tc_s[r] = c - b;
                tg_e[r] = d - c;
                tg_s[r] = e - d;
                tg_r[r] = g - e;
            }
        }
        /* Agreement: the CPU's hits (ids are rows) against the GPU's rows. */
        int same = 0;
        for (int32_t i = 0; i < nh && i < ng; i++)
            for (int32_t j = 0; j < ng; j++)
                if (atoi(hits[i].id) == idx[j]) {
                    same++;
                    break;
                }
        const double ce = cpu ? bench_median(tc_e, reps) : NAN, cs = bench_median(tc_s, reps);
        const double ge = gpu ? bench_median(tg_e, reps) : NAN, gs = bench_median(tg_s, reps),
                     gr = bench_median(tg_r, reps);
        printf("| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %lld | %d/%d |\n", N, ce, cs, ge, gs, gr,
               (long long)pcie, same, nh);
        at += snprintf(lines + at, sizeof lines - at,
                       "retrieval,%d,%d,%.4f,%.4f,%.4f,%.4f,%.4f,%lld,%d\n", N, k, ce, cs, ge, gs,
                       gr, (long long)pcie, same);
        cuda_fact_matrix_free(m);
        mem_index_free(ix);
    }
    printf("\n%s", lines);
    if (out) {
        fputs(lines, out);
        fclose(out);
    }
    free(tc_e);
    free(tc_s);
    free(tg_e);
    free(tg_s);
    free(tg_r);
    free(hits);
    free(idx);
    free(score);
    cudaFree(qdev);
    free(facts);
    free(qv);
    cuda_embedder_free(gpu);
    embedder_free(cpu);
    return 0;
}

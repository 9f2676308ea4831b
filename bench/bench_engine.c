/*
 * bench_engine: prefill and decode throughput of the CPU engine.
 *
 *   bench_engine [-m MODEL] [-t THREADS] [-r REPS] [-p 128,512,2048] [-n 128]
 *
 * Prefill: a fresh sequence takes a prompt of N tokens in one call; decode:
 * after a short prompt, N single-token steps. Prompts are token ids drawn
 * from a fixed-seed generator (throughput does not depend on which tokens).
 * Prints a table of medians and, for scripts, one CSV line per measurement:
 * inferscale,<prefill|decode>,<n>,<median tok/s>
 */
#include "engine/engine.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <getopt.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    int threads = 2, reps = 5, n_decode = 128;
    char lens_arg[128] = "128,512,2048";
    int c;
    while ((c = getopt(argc, argv, "m:t:r:p:n:h")) != -1) {
        switch (c) {
        case 'm': path = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'p': snprintf(lens_arg, sizeof lens_arg, "%s", optarg); break;
        case 'n': n_decode = atoi(optarg); break;
        default:
            fprintf(stderr, "usage: bench_engine [-m MODEL] [-t THREADS] [-r REPS] "
                            "[-p LEN,LEN,...] [-n DECODE_TOKENS]\n");
            return c == 'h' ? 0 : 1;
        }
    }
    if (reps < 1 || threads < 1 || n_decode < 1) {
        fprintf(stderr, "error: -t, -r and -n must be positive\n");
        return 1;
    }
    backend *be;
    model *m;
    if (backend_cpu_create(threads, &be) != IS_OK || model_load(path, be, &m) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    int lens[16], n_lens = 0;
    for (char *tok = strtok(lens_arg, ","); tok && n_lens < 16; tok = strtok(NULL, ","))
        lens[n_lens++] = atoi(tok);
    int max_len = n_decode + 16;
    for (int i = 0; i < n_lens; i++)
        if (lens[i] > max_len) max_len = lens[i];
    engine_params ep = engine_default_params();
    ep.n_ctx = max_len;
    ep.max_seqs = 1;
    ep.max_batch = 512;
    engine *e;
    if (engine_create(m, ep, &e) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    int32_t V = m->cfg.n_vocab;
    int32_t *toks = malloc((size_t)max_len * sizeof *toks);
    int32_t *seqs = calloc((size_t)max_len, sizeof *seqs);
    float *logits = malloc((size_t)V * sizeof *logits);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < max_len; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        toks[i] = (int32_t)(rng % (uint64_t)(V - 100)) + 100;
    }
    double *runs = malloc((size_t)reps * sizeof *runs);
    printf("model %s, %d threads, %d runs each (median)\n\n", path, threads, reps);
    printf("| test | tokens | tok/s (median) | min | max |\n|---|---:|---:|---:|---:|\n");
    char csv[4096] = "";
    for (int li = 0; li < n_lens; li++) {
        int n = lens[li];
        for (int r = -1; r < reps; r++) { /* r = -1 warms up */
            int32_t seq;
            engine_seq_open(e, &seq);
            engine_batch b = {.n_tokens = n, .tokens = toks, .seq = seqs};
            double t0 = now_s();
            if (engine_decode(e, &b, logits) != IS_OK) {
                fprintf(stderr, "error: %s\n", is_error_last());
                return 1;
            }
            double dt = now_s() - t0;
            if (r >= 0) runs[r] = n / dt;
            engine_seq_close(e, seq);
        }
        double mn = runs[0], mx = runs[0];
        for (int r = 0; r < reps; r++) {
            if (runs[r] < mn) mn = runs[r];
            if (runs[r] > mx) mx = runs[r];
        }
        double med = bench_median(runs, reps);
        printf("| prefill | %d | %.1f | %.1f | %.1f |\n", n, med, mn, mx);
        snprintf(csv + strlen(csv), sizeof csv - strlen(csv), "inferscale,prefill,%d,%.2f\n", n,
                 med);
    }
    for (int r = -1; r < reps; r++) {
        int32_t seq;
        engine_seq_open(e, &seq);
        engine_batch b = {.n_tokens = 8, .tokens = toks, .seq = seqs};
        engine_decode(e, &b, logits);
        double t0 = now_s();
        for (int i = 0; i < n_decode; i++) {
            engine_batch d = {.n_tokens = 1, .tokens = &toks[8 + i], .seq = seqs};
            if (engine_decode(e, &d, logits) != IS_OK) {
                fprintf(stderr, "error: %s\n", is_error_last());
                return 1;
            }
        }
        double dt = now_s() - t0;
        if (r >= 0) runs[r] = n_decode / dt;
        engine_seq_close(e, seq);
    }
    double mn = runs[0], mx = runs[0];
    for (int r = 0; r < reps; r++) {
        if (runs[r] < mn) mn = runs[r];
        if (runs[r] > mx) mx = runs[r];
    }
    double med = bench_median(runs, reps);
    printf("| decode | %d | %.1f | %.1f | %.1f |\n\n", n_decode, med, mn, mx);
    snprintf(csv + strlen(csv), sizeof csv - strlen(csv), "inferscale,decode,%d,%.2f\n", n_decode,
             med);
    fputs(csv, stdout);
    free(runs);
    free(toks);
    free(seqs);
    free(logits);
    engine_free(e);
    model_free(m);
    be->ops->free(be);
    return 0;
}

/*
 * bench_widen: what widening one fact-KV record to f32 costs on the host
 * (fact_kv_to_f32), the step a served miss takes before its upload, against
 * the scalar per-value conversion it replaced (quant_f16_to_f32 and
 * quant_bf16_to_f32 in a loop). Records of 37 tokens (the LoCoMo
 * observations' mean on the Llama-3 tokenizer) for two shapes: SmolLM2-135M
 * (30 layers, 3 KV heads of 64) and Llama-3.1-8B (32 layers, 8 of 128).
 *
 *   bench_widen [-r REPS] [-t TOKENS]
 *
 * Prints a table of medians of REPS (9) runs, in ms, after one untimed run
 * (so the destination's pages are mapped).
 */
#include "kv/fact_record.h"
#include "gguf/quant.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct shape {
    const char *name;
    int layers, kv_heads, head_dim;
} shape;

int main(int argc, char **argv) {
    int reps = 9, tokens = 37, c;
    while ((c = getopt(argc, argv, "r:t:h")) != -1) {
        switch (c) {
        case 'r': reps = atoi(optarg); break;
        case 't': tokens = atoi(optarg); break;
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: bench_widen [-r REPS (9)] [-t TOKENS a record (37)]\n"
                    "Medians of REPS runs (ms) of widening one fact-KV record to f32.\n");
            return c == 'h' ? 0 : 1;
        }
    }
    if (reps < 1 || reps > 1000 || tokens < 1 || tokens > 4096) {
        fprintf(stderr, "bench_widen: -r in [1, 1000], -t in [1, 4096]\n");
        return 1;
    }
    const shape shapes[] = {{"SmolLM2-135M", 30, 3, 64}, {"Llama-3.1-8B", 32, 8, 128}};
    double *t = malloc((size_t)reps * sizeof *t);
    printf("| shape | dtype | values (K and V) | scalar loop, ms | fact_kv_to_f32, ms | ratio |\n");
    printf("|---|---|---:|---:|---:|---:|\n");
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const shape *sh = &shapes[si];
        size_t n = 2 * (size_t)sh->layers * tokens * sh->kv_heads * sh->head_dim;
        uint16_t *src = malloc(n * sizeof *src);
        float *dst = malloc(n * sizeof *dst);
        if (!src || !dst || !t) return 1;
        uint64_t seed = 42;
        for (int dt = 0; dt < 2; dt++) {
            kv_dtype type = dt ? KV_DTYPE_BF16 : KV_DTYPE_F16;
            /* Values of a KV record's size: finite, mixed signs. */
            for (size_t i = 0; i < n; i++) {
                float v = (float)((int64_t)(bench_splitmix(&seed) % 20001) - 10000) / 1000.0f;
                src[i] = dt ? quant_f32_to_bf16(v) : quant_f32_to_f16(v);
            }
            double med[2];
            for (int way = 0; way < 2; way++) {
                for (int r = -1; r < reps; r++) {
                    double t0 = bench_now_ms();
                    if (way == 0) {
                        for (size_t i = 0; i < n; i++)
                            dst[i] = dt ? quant_bf16_to_f32(src[i]) : quant_f16_to_f32(src[i]);
                    } else {
                        fact_kv_to_f32(type, src, dst, n);
                    }
                    if (r >= 0) t[r] = bench_now_ms() - t0;
                }
                med[way] = bench_median(t, reps);
            }
            printf("| %s | %s | %zu | %.3f | %.3f | %.1fx |\n", sh->name, dt ? "bf16" : "f16", n,
                   med[0], med[1], med[1] > 0 ? med[0] / med[1] : 0);
        }
        free(src);
        free(dst);
    }
    free(t);
    return 0;
}

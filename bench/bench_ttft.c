/*
 * bench_ttft: time to first token vs the number of memory facts k, in the
 * `prompt` mode (facts pasted as text and prefilled) and the `kv` mode
 * (facts' KV injected, only the query prefilled), same layout and tokens.
 *
 *   bench_ttft [-m MODEL] [-l LOCOMO.json] [-k 5,10,20,50,100] [-r REPS] [-w W]
 *              [-t THREADS] [-d f32|f16|bf16] [-o CSV]
 *
 * Facts are the LoCoMo observations of one conversation (encoded once into a
 * temporary record store, not timed); the query is one of its questions.
 * TTFT runs from the request to the first sampled token and includes
 * fetching the records, forking the cached serving prefix, injection and the
 * prefill; retrieval is the same in both modes and is not included.
 * Medians of REPS runs (after one warm-up) are printed as a table, with the
 * kv/prompt ratio measured in the same run.
 */
#include "memory/locomo.h"
#include "serve/ask.h"
#include "bench_util.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    const char *model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *locomo = "../shared/data/locomo/26.json";
    const char *csv = NULL;
    char ks_arg[128] = "5,10,20,50,100";
    int reps = 5, window = 0, threads = 2;
    kv_dtype dtype = KV_DTYPE_F32;
    int c;
    while ((c = getopt(argc, argv, "m:l:k:r:w:t:d:o:h")) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'l': locomo = optarg; break;
        case 'k': snprintf(ks_arg, sizeof ks_arg, "%s", optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'd':
            if (!kv_dtype_parse(optarg, &dtype)) {
                fprintf(stderr, "error: -d must be f32, f16, bf16 or fp8, got '%s'\n", optarg);
                return 1;
            }
            break;
        case 'o': csv = optarg; break;
        default:
            fprintf(stderr, "usage: bench_ttft [-m MODEL] [-l LOCOMO.json] [-k K,K,...] [-r REPS] "
                            "[-w W] [-t THREADS] [-d f32|f16|bf16|fp8] [-o CSV]\n");
            return c == 'h' ? 0 : 1;
        }
    }
    if (reps < 1) reps = 1;
    int ks[16], n_k = 0, k_max = 0;
    for (char *tok = strtok(ks_arg, ","); tok && n_k < 16; tok = strtok(NULL, ",")) {
        ks[n_k] = atoi(tok);
        if (ks[n_k] > k_max) k_max = ks[n_k];
        n_k++;
    }
    locomo_conv *conv;
    backend *be;
    model *m;
    engine *e;
    record_store *store;
    ask_ctx *ac;
    if (locomo_load(locomo, &conv) != IS_OK || backend_cpu_create(threads, &be) != IS_OK ||
        model_load(model_path, be, &m) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    if (conv->n_facts < k_max) {
        fprintf(stderr, "error: %s has %d facts, fewer than k = %d\n", locomo, conv->n_facts,
                k_max);
        return 1;
    }
    engine_params ep = engine_default_params();
    ep.max_seqs = 3;
    ep.n_ctx = 8192;
    char dir[] = "/tmp/bench_ttft_XXXXXX";
    if (!mkdtemp(dir) || engine_create(m, ep, &e) != IS_OK ||
        record_store_open(dir, (size_t)1 << 30, &store) != IS_OK ||
        ask_ctx_create(e, store, dtype, &ac) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    char(*ids)[32] = calloc((size_t)k_max, sizeof *ids);
    const char **idp = calloc((size_t)k_max, sizeof *idp),
               **texts = calloc((size_t)k_max, sizeof *texts);
    const char **ctx = calloc((size_t)(window > 0 ? window : 1), sizeof *ctx);
    for (int i = 0; i < k_max; i++) {
        snprintf(ids[i], sizeof ids[i], "fact%d", i);
        idp[i] = ids[i];
        texts[i] = conv->facts[i].text;
        int32_t nc = locomo_fact_context(conv, &conv->facts[i], window, ctx);
        ask_fact af = {ids[i], conv->facts[i].text, ctx, nc};
        bool did;
        if (ask_encode_fact(ac, &af, window, &did) != IS_OK) {
            fprintf(stderr, "error: %s\n", is_error_last());
            return 1;
        }
    }
    const char *query = conv->questions[0].question;
    printf("model %s, %d threads, facts from %s (w=%d, %s records), query \"%s\"\n", model_path,
           threads, locomo, window, kv_dtype_name(dtype), query);
    printf("TTFT medians of %d runs, ms\n\n", reps);
    printf("| k | memory tokens | prompt TTFT | kv TTFT | kv: fetch | inject | prefill | prompt / "
           "kv |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    FILE *out = csv ? fopen(csv, "w") : NULL;
    if (out)
        fprintf(
            out,
            "k,memory_tokens,prompt_ttft_ms,kv_ttft_ms,kv_fetch_ms,kv_inject_ms,kv_prefill_ms\n");
    double *pr = malloc(sizeof(double) * reps), *kv = malloc(sizeof(double) * reps);
    double *fe = malloc(sizeof(double) * reps), *in = malloc(sizeof(double) * reps),
           *pf = malloc(sizeof(double) * reps);
    for (int ki = 0; ki < n_k; ki++) {
        int k = ks[ki];
        int mem_tokens = 0;
        for (int r = -1; r < reps; r++) {
            /* Alternate the modes so drift hits both alike. */
            for (int mode = 0; mode < 2; mode++) {
                ask_request req = {.mode = mode == 0 ? ASK_MODE_PROMPT : ASK_MODE_KV,
                                   .query = query,
                                   .fact_ids = idp,
                                   .fact_texts = texts,
                                   .n_facts = k,
                                   .max_tokens = 1,
                                   .temperature = 0,
                                   .top_k = 0,
                                   .top_p = 1.0f};
                ask_timing t;
                if (ask_run(ac, &req, NULL, NULL, &t) != IS_OK) {
                    fprintf(stderr, "error: %s\n", is_error_last());
                    return 1;
                }
                if (r < 0) continue;
                if (mode == 0) {
                    pr[r] = t.ttft_ms;
                } else {
                    kv[r] = t.ttft_ms;
                    fe[r] = t.fetch_ms;
                    in[r] = t.inject_ms;
                    pf[r] = t.prefill_ms;
                    mem_tokens = t.n_memory_tokens;
                }
            }
        }
        double mp = bench_median(pr, reps), mk = bench_median(kv, reps);
        double mf = bench_median(fe, reps), mi = bench_median(in, reps),
               mpf = bench_median(pf, reps);
        printf("| %d | %d | %.1f | %.1f | %.2f | %.2f | %.1f | %.1fx |\n", k, mem_tokens, mp, mk,
               mf, mi, mpf, mp / mk);
        fflush(stdout);
        if (out)
            fprintf(out, "%d,%d,%.3f,%.3f,%.3f,%.3f,%.3f\n", k, mem_tokens, mp, mk, mf, mi, mpf);
    }
    if (out) fclose(out);
    ask_ctx_free(ac);
    record_store_close(store);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
    engine_free(e);
    model_free(m);
    be->ops->free(be);
    locomo_free(conv);
    return 0;
}

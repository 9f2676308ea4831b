/*
 * bench_kv_precision: the accuracy cost of each fact-KV record dtype (f16,
 * bf16, fp8) against f32 records, on the CPU backend (f32 compute), with
 * LoCoMo facts injected as KV (eval/kv_precision.h says exactly what is
 * compared). Prints one table row per dtype, and a CSV with -o.
 *
 *   bench_kv_precision [-m MODEL] [-l LOCOMO.json] [-k 20] [-q 8] [-w 0]
 *                      [-t THREADS] [-o CSV]
 */
#define _XOPEN_SOURCE 700
#include "backend/backend.h"
#include "eval/kv_precision.h"
#include "model/model.h"

#include <ftw.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_kv_precision [-m MODEL] [-l LOCOMO.json] [-k K] [-q QUESTIONS] [-w W]\n"
            "                          [-t THREADS] [-o CSV]\n"
            "  -m MODEL      GGUF (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
            "  -l FILE       LoCoMo conversation (default ../shared/data/locomo/26.json)\n"
            "  -k K          facts injected per question (default 20)\n"
            "  -q N          questions with a gold answer scored (default 8)\n"
            "  -w W          context turns encoded with each fact (default 0)\n"
            "  -t N          CPU threads (default 2)\n"
            "  -o CSV        also write the rows as CSV\n");
}

int main(int argc, char **argv) {
    const char *model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *locomo = "../shared/data/locomo/26.json", *csv = NULL;
    kv_precision_params p = {.k = 20, .n_questions = 8, .window = 0, .fact_stride = 37};
    int threads = 2, c;
    while ((c = getopt(argc, argv, "m:l:k:q:w:t:o:h")) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'l': locomo = optarg; break;
        case 'k': p.k = atoi(optarg); break;
        case 'q': p.n_questions = atoi(optarg); break;
        case 'w': p.window = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'o': csv = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 1;
        }
    }
    if (p.k < 1 || p.n_questions < 1 || threads < 1 || p.window < -1) {
        usage(stderr);
        return 1;
    }
    locomo_conv *conv;
    backend *be;
    model *m;
    engine *e;
    if (locomo_load(locomo, &conv) != IS_OK || backend_cpu_create(threads, &be) != IS_OK ||
        model_load(model_path, be, &m) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    engine_params ep = engine_default_params();
    ep.max_seqs = KV_DTYPE_COUNT + 3;
    ep.n_ctx = 4096;
    char dir[] = "/tmp/bench_kv_precision_XXXXXX";
    if (!mkdtemp(dir) || engine_create(m, ep, &e) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    kv_precision_row rows[KV_DTYPE_COUNT];
    is_status st = kv_precision_run(e, conv, &p, dir, rows);
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (st != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    printf("model %s, CPU backend (f32 compute), %d threads; %s, k = %d facts a question, "
           "w = %d, %d questions;\nfirst answer token's logits and the gold answer's NLL with each "
           "record dtype against f32 records\n\n",
           model_path, threads, locomo, p.k, p.window, rows[0].n);
    printf("| records | K+V bytes (k facts) | vs f32 | max abs dlogit | max dlogit / range | "
           "max rel L2 | mean KL | max KL | top-1 = f32 | mean abs dNLL |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    FILE *out = csv ? fopen(csv, "w") : NULL;
    if (out)
        fprintf(
            out,
            "dtype,kv_bytes,max_abs_dlogit,max_rel_dlogit,max_rel_l2,mean_kl,max_kl,top1_agree,n,"
            "mean_abs_dnll\n");
    for (int d = 0; d < KV_DTYPE_COUNT; d++) {
        const kv_precision_row *r = &rows[d];
        printf("| %s | %zu | %.3f | %.4f | %.2e | %.2e | %.2e | %.2e | %d/%d | %.4f |\n",
               kv_dtype_name(r->dtype), r->kv_bytes,
               (double)r->kv_bytes / (double)rows[KV_DTYPE_F32].kv_bytes, r->max_abs_dlogit,
               r->max_rel_dlogit, r->max_rel_l2, r->mean_kl, r->max_kl, r->top1_agree, r->n,
               r->mean_abs_dnll);
        if (out)
            fprintf(out, "%s,%zu,%.6g,%.6g,%.6g,%.6g,%.6g,%d,%d,%.6g\n", kv_dtype_name(r->dtype),
                    r->kv_bytes, r->max_abs_dlogit, r->max_rel_dlogit, r->max_rel_l2, r->mean_kl,
                    r->max_kl, r->top1_agree, r->n, r->mean_abs_dnll);
    }
    if (out) fclose(out);
    engine_free(e);
    model_free(m);
    be->ops->free(be);
    locomo_free(conv);
    return 0;
}

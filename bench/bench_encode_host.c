/*
 * bench_encode_host: the host (CPU) half of encoding facts' KV, on
 * synthetic captured rows, so no model forward is needed: everything
 * ask_encode_facts does after the forward's capture, stage by stage.
 *
 *   bench_encode_host [-B FACTS] [-T TOKENS] [-r REPS] [--dtype f16|bf16]
 *                     [--layers L --heads H --head-dim D] [--dir DIR]
 *   (bench_encode_host --help lists every option)
 *
 * A batch of B facts of T tokens is captured as the forward leaves it
 * ([n_layers][B*T][kv_dim] f32 for K and for V; default the Llama-3.1-8B
 * shape: 32 layers, 8 KV heads of 128). Stages, each timed per fact (median
 * of the repetitions, one thread):
 *   capture rows      the forward's f32 rows written into new buffers
 *                     (malloc'd per batch, as before: the kernel zero-fills
 *                     every page) and into buffers kept from the last batch
 *   narrow (scalar)   the rows narrowed one value at a time through
 *                     quant_f32_to_f16/bf16 into sections malloc'd for each
 *                     fact, as the encode path did before: the "before" line
 *   narrow (rows)     fact_kv_from_f32 layer by layer into sections kept
 *                     from the last batch, as take_rows does now
 *   record encode     fact_record_encode: header, sections, xxh64 checksum
 *   put_batch         record_store_put_batch of the B records (header and
 *                     checksum, the files written from the sections, fsyncs,
 *                     renames, one directory fsync), wall and CPU time
 */
#include "core/status.h"
#include "gguf/quant.h"
#include "kv/fact_record.h"
#include "kv/record_store.h"
#include "bench_util.h"

#include <ftw.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* CPU time of the process (the record store writes on threads of its own);
 * the fsyncs' waits are not CPU work. */
static double cpu_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void usage(FILE *f) {
    fprintf(f, "usage: bench_encode_host [options]\n\n"
               "Times the host stages of encoding facts' KV (narrowing, record encoding, the\n"
               "record store's batch put) on synthetic captured rows; prints ms a fact.\n\n"
               "  -B, --batch N      facts a batch (default 50)\n"
               "  -T, --tokens N     tokens a fact (default 40)\n"
               "  -r, --reps R       repetitions; the table gives medians (default 5)\n"
               "      --dtype D      record dtype: f16 (default) or bf16\n"
               "      --layers L     model blocks (default 32)\n"
               "      --heads H      KV heads (default 8)\n"
               "      --head-dim D   per head (default 128)\n"
               "      --dir DIR      where the record store goes (default: a new directory\n"
               "                     under $TMPDIR or /tmp, removed at the end)\n"
               "  -h, --help         this help\n");
}

int main(int argc, char **argv) {
    int32_t B = 50, T = 40, reps = 5, L = 32, H = 8, D = 128;
    kv_dtype dtype = KV_DTYPE_F16;
    const char *dir_opt = NULL;
    static const struct option opts[] = {
        {"batch", 1, 0, 'B'},  {"tokens", 1, 0, 'T'}, {"reps", 1, 0, 'r'},     {"dtype", 1, 0, 'd'},
        {"layers", 1, 0, 'L'}, {"heads", 1, 0, 'H'},  {"head-dim", 1, 0, 'D'}, {"dir", 1, 0, 'o'},
        {"help", 0, 0, 'h'},   {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "B:T:r:h", opts, NULL)) != -1) {
        switch (c) {
        case 'B': B = atoi(optarg); break;
        case 'T': T = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'L': L = atoi(optarg); break;
        case 'H': H = atoi(optarg); break;
        case 'D': D = atoi(optarg); break;
        case 'o': dir_opt = optarg; break;
        case 'd':
            if (!strcmp(optarg, "f16")) dtype = KV_DTYPE_F16;
            else if (!strcmp(optarg, "bf16")) dtype = KV_DTYPE_BF16;
            else {
                fprintf(stderr, "bench_encode_host: --dtype must be f16 or bf16\n");
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (B < 1 || T < 1 || reps < 1 || L < 1 || H < 1 || D < 1 || reps > 100) {
        fprintf(stderr, "bench_encode_host: -B, -T, -r (<= 100) and the shape must be >= 1\n");
        return 2;
    }
    size_t kv_dim = (size_t)H * D, n_cap = (size_t)B * T, rows = (size_t)T * kv_dim;
    size_t cap_elems = (size_t)L * n_cap * kv_dim;
    float *ck = malloc(cap_elems * sizeof(float)), *cv = malloc(cap_elems * sizeof(float));
    int32_t *toks = malloc((size_t)T * sizeof *toks);
    fact_kv_meta meta = {.model_fingerprint = "0123456789abcdef",
                         .dtype = dtype,
                         .n_layers = L,
                         .n_kv_heads = H,
                         .head_dim = D,
                         .n_tokens = T,
                         .rope_layout = 0,
                         .rope_n_rot = D,
                         .rope_freq_base = 500000.0f,
                         .rope_freq_scale = 1.0f,
                         .window = 0};
    size_t sec = fact_kv_bytes(&meta), esz = kv_dtype_size(dtype);
    void **k = malloc((size_t)B * sizeof *k), **v = malloc((size_t)B * sizeof *v);
    if (!ck || !cv || !toks || !k || !v) {
        fprintf(stderr, "bench_encode_host: out of memory\n");
        return 1;
    }
    uint64_t seed = 42;
    for (size_t i = 0; i < cap_elems; i++)
        ck[i] = (float)(4 * bench_unit(&seed) - 2), cv[i] = (float)(4 * bench_unit(&seed) - 2);
    for (int32_t t = 0; t < T; t++) toks[t] = 1000 + t;
    for (int32_t j = 0; j < B; j++)
        if (!(k[j] = malloc(sec)) || !(v[j] = malloc(sec))) return 1;

    char dir[512];
    if (dir_opt) snprintf(dir, sizeof dir, "%s", dir_opt);
    else {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/bench_encode_host.XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) {
            perror("bench_encode_host: mkdtemp");
            return 1;
        }
    }
    record_store *store;
    if (record_store_open(dir, 0, &store) != IS_OK) {
        fprintf(stderr, "bench_encode_host: %s\n", is_error_last());
        return 1;
    }
    char(*ids)[32] = malloc((size_t)B * sizeof *ids);
    const char **idp = malloc((size_t)B * sizeof *idp);
    const fact_kv_meta **mp = malloc((size_t)B * sizeof *mp);
    const int32_t **tp = malloc((size_t)B * sizeof *tp);
    for (int32_t j = 0; j < B; j++) {
        snprintf(ids[j], sizeof ids[j], "f%d", j);
        idp[j] = ids[j], mp[j] = &meta, tp[j] = toks;
    }

    double t_scalar[100], t_rows[100], t_enc[100], t_put[100], c_put[100];
    double t_fresh[100], t_kept[100];
    uint64_t sink = 0;
    float *kept_k = malloc(cap_elems * sizeof(float)), *kept_v = malloc(cap_elems * sizeof(float));
    if (!kept_k || !kept_v) return 1;
    memset(kept_k, 0, cap_elems * sizeof(float)), memset(kept_v, 0, cap_elems * sizeof(float));
    for (int r = 0; r < reps; r++) {
        /* The forward's capture written into new buffers each batch (as
         * encode_group did) against buffers kept from the last batch. */
        double f0 = bench_now_ms();
        float *fk = malloc(cap_elems * sizeof(float)), *fv = malloc(cap_elems * sizeof(float));
        if (!fk || !fv) return 1;
        memcpy(fk, ck, cap_elems * sizeof(float)), memcpy(fv, cv, cap_elems * sizeof(float));
        sink += ((uint8_t *)fk)[r] + ((uint8_t *)fv)[r];
        free(fk), free(fv);
        double f1 = bench_now_ms();
        memcpy(kept_k, ck, cap_elems * sizeof(float)),
            memcpy(kept_v, cv, cap_elems * sizeof(float));
        sink += ((uint8_t *)kept_k)[r] + ((uint8_t *)kept_v)[r];
        double f2 = bench_now_ms();
        t_fresh[r] = (f1 - f0) / B, t_kept[r] = (f2 - f1) / B;
        /* before: one value at a time through the scalar conversion, into
         * sections malloc'd for each fact */
        double t0 = bench_now_ms();
        void **nk = malloc((size_t)B * sizeof *nk), **nv = malloc((size_t)B * sizeof *nv);
        if (!nk || !nv) return 1;
        for (int32_t j = 0; j < B; j++)
            if (!(nk[j] = malloc(sec)) || !(nv[j] = malloc(sec))) return 1;
        for (int32_t j = 0; j < B; j++)
            for (int pass = 0; pass < 2; pass++) {
                const float *cap = pass ? cv : ck;
                uint8_t *dst = pass ? nv[j] : nk[j];
                for (int32_t l = 0; l < L; l++) {
                    const float *src = cap + ((size_t)l * n_cap + (size_t)j * T) * kv_dim;
                    uint8_t *d = dst + (size_t)l * rows * esz;
                    for (size_t i = 0; i < rows; i++) {
                        uint16_t h = dtype == KV_DTYPE_F16 ? quant_f32_to_f16(src[i])
                                                           : quant_f32_to_bf16(src[i]);
                        memcpy(d + 2 * i, &h, 2);
                    }
                }
            }
        sink += ((uint8_t *)nk[B - 1])[sec - 1];
        for (int32_t j = 0; j < B; j++) free(nk[j]), free(nv[j]);
        free(nk), free(nv);
        double t1 = bench_now_ms();
        /* now: take_rows' loop, into sections kept from the last batch */
        for (int32_t j = 0; j < B; j++)
            for (int pass = 0; pass < 2; pass++) {
                const float *cap = pass ? cv : ck;
                uint8_t *dst = pass ? v[j] : k[j];
                for (int32_t l = 0; l < L; l++)
                    fact_kv_from_f32(dtype, cap + ((size_t)l * n_cap + (size_t)j * T) * kv_dim,
                                     dst + (size_t)l * rows * esz, rows);
            }
        double t2 = bench_now_ms();
        for (int32_t j = 0; j < B; j++) {
            void *buf;
            size_t len;
            if (fact_record_encode(&meta, toks, k[j], v[j], &buf, &len) != IS_OK) return 1;
            sink += ((uint8_t *)buf)[len - 1];
            free(buf);
        }
        double t3 = bench_now_ms(), c3 = cpu_ms();
        if (record_store_put_batch(store, B, idp, mp, tp, (const void *const *)k,
                                   (const void *const *)v, NULL) != IS_OK) {
            fprintf(stderr, "bench_encode_host: %s\n", is_error_last());
            return 1;
        }
        double t4 = bench_now_ms(), c4 = cpu_ms();
        t_scalar[r] = (t1 - t0) / B, t_rows[r] = (t2 - t1) / B, t_enc[r] = (t3 - t2) / B;
        t_put[r] = (t4 - t3) / B, c_put[r] = (c4 - c3) / B;
    }
    double ms = bench_median(t_scalar, reps), mr = bench_median(t_rows, reps);
    double me = bench_median(t_enc, reps), mpw = bench_median(t_put, reps);
    double mpc = bench_median(c_put, reps);
    printf("# %d facts of %d tokens, %d layers x %d KV heads x %d, %s records of %.2f MB; "
           "medians of %d runs, one thread (sink %llu)\n",
           B, T, L, H, D, dtype == KV_DTYPE_F16 ? "f16" : "bf16", 2.0 * sec / 1e6 + 0.0, reps,
           (unsigned long long)(sink & 1));
    double mf = bench_median(t_fresh, reps), mk = bench_median(t_kept, reps);
    printf("| stage | ms a fact |\n|---|---:|\n");
    printf("| capture rows written, new buffers (before) | %.3f |\n", mf);
    printf("| capture rows written, kept buffers (now) | %.3f |\n", mk);
    printf("| narrow K+V, scalar, new sections (before) | %.3f |\n", ms);
    printf("| narrow K+V, rows, kept sections (now) | %.3f |\n", mr);
    printf("| record encode (copy + xxh64) | %.3f |\n", me);
    printf("| put_batch wall (encode, write, fsync, rename) | %.3f |\n", mpw);
    printf("| put_batch CPU | %.3f |\n", mpc);
    printf("| host total before (new capture + scalar + put wall) | %.3f |\n", mf + ms + mpw);
    printf("| host total now (kept capture + rows + put wall) | %.3f |\n", mk + mr + mpw);
    record_store_close(store);
    if (!dir_opt) nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    for (int32_t j = 0; j < B; j++) free(k[j]), free(v[j]);
    free(k), free(v), free(ck), free(cv), free(kept_k), free(kept_v), free(toks), free(ids),
        free(idp), free(mp), free(tp);
    return 0;
}

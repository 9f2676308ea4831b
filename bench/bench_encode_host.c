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
 * ([n_layers][B*T][kv_dim] for K and for V; default the Llama-3.1-8B shape:
 * 32 layers, 8 KV heads of 128). Stages, each timed per fact (median of the
 * repetitions, one thread), the path before (the capture in f32, narrowed
 * on the host) against now (the capture narrowed on the backend):
 *   capture rows      the capture written into buffers kept from the last
 *                     batch: f32 (before) or the record dtype (now, half
 *                     the bytes; on the GPU this is the download)
 *   narrow / cut      fact_kv_from_f32 layer by layer into each fact's
 *                     sections (before) against one copy a layer of rows
 *                     already in the record dtype (take_rows now)
 *   record encode     fact_record_encode: header, sections, xxh64 checksum
 *   put_batch         record_store_put_batch of the B records (header and
 *                     checksum, the files written from the sections, fsyncs,
 *                     renames, one directory fsync), wall and CPU time
 *   raw write         the same bytes written to plain files on one thread,
 *                     nothing synced: the page cache's share of the put
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
#include <fcntl.h>
#include <sys/uio.h>
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

    double t_narrow[100], t_cut[100], t_enc[100], t_put[100], c_put[100], t_raw[100];
    double t_cap32[100], t_cap16[100];
    uint64_t sink = 0;
    float *kept_k = malloc(cap_elems * sizeof(float)), *kept_v = malloc(cap_elems * sizeof(float));
    uint8_t *nk = malloc(cap_elems * esz), *nv = malloc(cap_elems * esz);
    if (!kept_k || !kept_v || !nk || !nv) return 1;
    memset(kept_k, 0, cap_elems * sizeof(float)), memset(kept_v, 0, cap_elems * sizeof(float));
    memset(nk, 0, cap_elems * esz), memset(nv, 0, cap_elems * esz);
    for (int32_t side = 0; side < 2; side++) /* what the backend's narrow gives */
        fact_kv_from_f32(dtype, side ? cv : ck, side ? nv : nk, cap_elems);
    uint8_t *dk = malloc(cap_elems * esz), *dv = malloc(cap_elems * esz);
    if (!dk || !dv) return 1;
    memset(dk, 0, cap_elems * esz), memset(dv, 0, cap_elems * esz);
    for (int r = 0; r < reps; r++) {
        /* The capture landing in kept buffers: f32, or the record dtype. */
        double f0 = bench_now_ms();
        memcpy(kept_k, ck, cap_elems * sizeof(float)),
            memcpy(kept_v, cv, cap_elems * sizeof(float));
        sink += ((uint8_t *)kept_k)[r] + ((uint8_t *)kept_v)[r];
        double f1 = bench_now_ms();
        memcpy(dk, nk, cap_elems * esz), memcpy(dv, nv, cap_elems * esz);
        sink += dk[r] + dv[r];
        double f2 = bench_now_ms();
        t_cap32[r] = (f1 - f0) / B, t_cap16[r] = (f2 - f1) / B;
        /* before: each fact's rows narrowed from the f32 capture */
        double t0 = bench_now_ms();
        for (int32_t j = 0; j < B; j++)
            for (int pass = 0; pass < 2; pass++) {
                const float *cap = pass ? kept_v : kept_k;
                uint8_t *dst = pass ? v[j] : k[j];
                for (int32_t l = 0; l < L; l++)
                    fact_kv_from_f32(dtype, cap + ((size_t)l * n_cap + (size_t)j * T) * kv_dim,
                                     dst + (size_t)l * rows * esz, rows);
            }
        sink += ((uint8_t *)k[B - 1])[sec - 1];
        double t1 = bench_now_ms();
        /* now: take_rows' copy a layer from a capture in the record dtype */
        for (int32_t j = 0; j < B; j++)
            for (int pass = 0; pass < 2; pass++) {
                const uint8_t *cap = pass ? dv : dk;
                uint8_t *dst = pass ? v[j] : k[j];
                for (int32_t l = 0; l < L; l++)
                    memcpy(dst + (size_t)l * rows * esz,
                           cap + ((size_t)l * n_cap + (size_t)j * T) * kv_dim * esz, rows * esz);
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
        /* The same bytes into files of their own, one thread, nothing
         * synced or renamed: what the page cache alone costs, so the put's
         * wall says how much of it is durability. */
        for (int32_t j = 0; j < B; j++) {
            char path[600];
            snprintf(path, sizeof path, "%s/raw%d", dir, j);
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            struct iovec iov[2] = {{k[j], sec}, {v[j], sec}};
            if (fd < 0 || writev(fd, iov, 2) != (ssize_t)(2 * sec)) {
                perror("bench_encode_host: raw write");
                return 1;
            }
            close(fd);
        }
        t_raw[r] = (bench_now_ms() - t4) / B;
        t_narrow[r] = (t1 - t0) / B, t_cut[r] = (t2 - t1) / B, t_enc[r] = (t3 - t2) / B;
        t_put[r] = (t4 - t3) / B, c_put[r] = (c4 - c3) / B;
    }
    double mn = bench_median(t_narrow, reps), mc = bench_median(t_cut, reps);
    double me = bench_median(t_enc, reps), mpw = bench_median(t_put, reps);
    double mpc = bench_median(c_put, reps);
    printf("# %d facts of %d tokens, %d layers x %d KV heads x %d, %s records of %.2f MB; "
           "medians of %d runs, one thread (sink %llu)\n",
           B, T, L, H, D, dtype == KV_DTYPE_F16 ? "f16" : "bf16", 2.0 * sec / 1e6 + 0.0, reps,
           (unsigned long long)(sink & 1));
    double m32 = bench_median(t_cap32, reps), m16 = bench_median(t_cap16, reps);
    printf("| stage | ms a fact |\n|---|---:|\n");
    printf("| capture rows written, f32 (before) | %.3f |\n", m32);
    printf("| capture rows written, record dtype (now) | %.3f |\n", m16);
    printf("| narrow K+V from the f32 capture (before) | %.3f |\n", mn);
    printf("| cut K+V from the record-dtype capture (now) | %.3f |\n", mc);
    printf("| record encode (copy + xxh64) | %.3f |\n", me);
    printf("| put_batch wall (encode, write, fsync, rename) | %.3f |\n", mpw);
    printf("| put_batch CPU | %.3f |\n", mpc);
    printf("| the same bytes written, one thread, no fsync or rename | %.3f |\n",
           bench_median(t_raw, reps));
    printf("| host total before (f32 capture + narrow + put wall) | %.3f |\n", m32 + mn + mpw);
    printf("| host total now (dtype capture + cut + put wall) | %.3f |\n", m16 + mc + mpw);
    record_store_close(store);
    if (!dir_opt) nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    for (int32_t j = 0; j < B; j++) free(k[j]), free(v[j]);
    free(k), free(v), free(ck), free(cv), free(kept_k), free(kept_v), free(nk), free(nv), free(dk),
        free(dv), free(toks), free(ids), free(idp), free(mp), free(tp);
    return 0;
}

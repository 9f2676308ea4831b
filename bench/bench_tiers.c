/*
 * bench_tiers: the host's work for one request's k fact records before
 * they can go to the GPU, on the path the scheduler took before the host
 * tier and on the host tier's:
 *   widened   record_store_get (map the file, check its checksum), then
 *             fact_kv_to_f32 of k and v (prefetch_fact without a host tier);
 *   tier miss host_tier_get of a record the tier lacks: one pread into the
 *             tier's memory and the checksum, no widening (the disk tier);
 *   tier hit  host_tier_get of a record the tier holds (the host tier);
 *   miss, pool  the tier misses spread over the I/O pool (8 threads) and
 *             the caller, as the scheduler reads a request's facts.
 * Records of the Llama-3.1-8B shape (32 layers, 8 KV heads of 128, bf16),
 * 40 tokens each (LoCoMo observations' mean), in a record store in a
 * temporary directory; the page cache holds them after the first run, so
 * this is host work, not disk speed. The tier's memory is malloc'd here
 * (the server's is pinned; the host work is the same) and holds k records:
 * the miss runs alternate between two sets of k records, so each get
 * evicts one and reads into memory already touched, as a server's tier
 * does once its memory is taken (a fresh malloc's page faults would be
 * measured otherwise; pinned memory has none). The copy to the GPU is not
 * in it.
 *
 *   bench_tiers [-k LIST (5,20,50)] [-r REPS (7)] [-t TOKENS (40)] [-o CSV]
 *
 * Prints medians of REPS runs (ms for the whole request) after one untimed
 * run of each.
 */
#include "bench_util.h"
#include "kv/host_tier.h"
#include "kv/record_store.h"
#include "serve/io_pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_K 200

static is_status b_alloc(void *ud, size_t bytes, void **out) {
    (void)ud;
    *out = malloc(bytes);
    return *out ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
}
static void b_free(void *ud, void *p) {
    (void)ud;
    free(p);
}

typedef struct job {
    host_tier *t;
    const fact_kv_meta *want;
    char (*ids)[16];
    const fact_kv **got;
} job;

static void get_one(void *arg, int32_t i) {
    job *j = arg;
    if (host_tier_get(j->t, j->ids[i], j->want, &j->got[i], NULL) != IS_OK) {
        fprintf(stderr, "host_tier_get: %s\n", is_error_last());
        exit(1);
    }
}

int main(int argc, char **argv) {
    int ks[8] = {5, 20, 50}, n_k = 3, reps = 7, tokens = 40, c;
    const char *csv = NULL;
    while ((c = getopt(argc, argv, "k:r:t:o:h")) != -1) {
        switch (c) {
        case 'k': {
            n_k = 0;
            for (char *s = optarg; *s && n_k < 8;) {
                ks[n_k] = atoi(s);
                if (ks[n_k] < 1 || ks[n_k] > MAX_K) {
                    fprintf(stderr, "error: -k values in [1, %d]\n", MAX_K);
                    return 1;
                }
                n_k++;
                s = strchr(s, ',');
                if (!s) break;
                s++;
            }
            break;
        }
        case 'r': reps = atoi(optarg); break;
        case 't': tokens = atoi(optarg); break;
        case 'o': csv = optarg; break;
        default:
            fprintf(
                c == 'h' ? stdout : stderr,
                "usage: bench_tiers [-k LIST (5,20,50)] [-r REPS (7)] [-t TOKENS (40)] [-o CSV]\n"
                "Host work (ms, medians of REPS) for one request's k fact records of the\n"
                "Llama-3.1-8B shape: widened (record store + f32), host tier miss, hit, miss\n"
                "over the I/O pool.\n");
            return c == 'h' ? 0 : 1;
        }
    }
    if (reps < 1 || tokens < 1 || tokens > 4096) {
        fprintf(stderr, "error: -r >= 1, -t in [1, 4096]\n");
        return 1;
    }
    int kmax = 0;
    for (int i = 0; i < n_k; i++) kmax = ks[i] > kmax ? ks[i] : kmax;
    char dir[] = "/tmp/bench_tiers_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    record_store *rs = NULL;
    if (record_store_open(dir, 0, &rs) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    fact_kv_meta m = {0};
    strcpy(m.model_fingerprint, "0123456789abcdef");
    m.dtype = KV_DTYPE_BF16;
    m.n_layers = 32;
    m.n_kv_heads = 8;
    m.head_dim = 128;
    m.n_tokens = tokens;
    m.rope_n_rot = 128;
    m.rope_freq_base = 500000.0f;
    m.rope_freq_scale = 1.0f;
    const size_t ne = (size_t)m.n_layers * tokens * m.n_kv_heads * m.head_dim;
    uint16_t *k = malloc(ne * 2), *v = malloc(ne * 2);
    int32_t *toks = calloc((size_t)tokens, sizeof *toks);
    float *wide = malloc(2 * ne * sizeof(float));
    static char ids[2 * MAX_K][16];
    static const fact_kv *got[MAX_K];
    if (!k || !v || !toks || !wide) return 1;
    uint64_t seed = 7;
    for (int r = 0; r < 2 * kmax; r++) {
        for (size_t i = 0; i < ne; i++) {
            k[i] = (uint16_t)bench_splitmix(&seed);
            v[i] = (uint16_t)bench_splitmix(&seed);
        }
        m.text_hash = (uint64_t)r + 1;
        snprintf(ids[r], sizeof ids[r], "f%d", r);
        if (record_store_put(rs, ids[r], &m, toks, k, v) != IS_OK) {
            fprintf(stderr, "error: %s\n", is_error_last());
            return 1;
        }
    }
    fact_kv_meta want = m;
    io_pool *pool = NULL;
    if (io_pool_create(8, &pool) != IS_OK) return 1;
    host_tier_alloc al = {.alloc = b_alloc, .free = b_free};
    printf("bench_tiers: %d-token records of the Llama-3.1-8B shape (%.2f MB each, bf16), "
           "%ld cores, medians of %d\n\n",
           tokens, (double)(ne * 4 + 4 * tokens + 128) / 1e6, sysconf(_SC_NPROCESSORS_ONLN), reps);
    printf("| k | widened ms | tier miss ms | tier miss, I/O pool ms | tier hit ms | widened / "
           "miss | widened / hit |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|\n");
    FILE *out = csv ? fopen(csv, "w") : NULL;
    if (out) fprintf(out, "k,tokens,widened_ms,tier_miss_ms,tier_miss_pool_ms,tier_hit_ms\n");
    double *t = malloc((size_t)reps * 4 * sizeof *t);
    for (int ki = 0; ki < n_k; ki++) {
        const int kk = ks[ki];
        double med[4];
        /* Room for kk records (blocks of the next power of two). */
        size_t block = (size_t)1 << 16;
        while (block < ne * 4 + 4 * (size_t)tokens + 128 + 3 * 64) block <<= 1;
        host_tier *ht = NULL;
        if (host_tier_create(rs, block * (size_t)kk, al, &ht) != IS_OK) return 1;
        for (int mode = 0; mode < 4; mode++) {
            for (int r = -2; r < reps; r++) {
                /* Misses alternate two sets of records; hits read set 0. */
                job j = {ht, &want, mode == 3 || (r & 1) == 0 ? ids : ids + kmax, got};
                if (mode == 3) { /* resident before timing */
                    io_pool_run(NULL, get_one, &j, kk);
                    for (int f = 0; f < kk; f++) host_tier_release(ht, got[f]);
                }
                double t0 = bench_now_ms();
                if (mode == 0) {
                    for (int f = 0; f < kk; f++) {
                        const fact_kv *kv = NULL;
                        if (record_store_get(rs, ids[f], &want, &kv) != IS_OK) return 1;
                        fact_kv_to_f32(kv->meta.dtype, kv->k, wide, ne);
                        fact_kv_to_f32(kv->meta.dtype, kv->v, wide + ne, ne);
                        record_store_release(rs, kv);
                    }
                } else {
                    io_pool_run(mode == 2 ? pool : NULL, get_one, &j, kk);
                }
                double dt = bench_now_ms() - t0;
                if (mode > 0)
                    for (int f = 0; f < kk; f++) host_tier_release(ht, got[f]);
                if (r >= 0) t[r] = dt;
            }
            med[mode] = bench_median(t, reps);
        }
        host_tier_stats hs = host_tier_get_stats(ht);
        if (hs.no_room)
            fprintf(stderr, "warning: %lld gets found no room\n", (long long)hs.no_room);
        host_tier_free(ht);
        printf("| %d | %.2f | %.2f | %.2f | %.3f | %.1fx | %.0fx |\n", kk, med[0], med[1], med[2],
               med[3], med[0] / med[1], med[0] / med[3]);
        if (out)
            fprintf(out, "%d,%d,%.3f,%.3f,%.3f,%.4f\n", kk, tokens, med[0], med[1], med[2], med[3]);
    }
    if (out) fclose(out);
    io_pool_free(pool);
    record_store_close(rs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    free(t);
    free(k);
    free(v);
    free(toks);
    free(wide);
    return 0;
}

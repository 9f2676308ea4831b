/*
 * bench_store: latency of the fact store's operations (memory/store.h) on
 * SQLite and on PostgreSQL, same calls, same data.
 *
 *   bench_store [-n FACTS] [-u USERS] [-r REPEATS] [-D DIM] [-b BATCH] [-s SEED]
 *   scripts/pg_temp.sh build/bench/bench_store     (adds PostgreSQL: IS_PG_URL)
 *
 * Each repeat starts from an empty store (a new SQLite file in a temporary
 * directory; every table of the PostgreSQL database dropped) and runs, one
 * thread: FACTS inserts spread over USERS users (embeddings of DIM floats,
 * each insert one committed transaction, as an add is), FACTS gets of a
 * random fact, 4 * USERS reads of 50 random facts of a user in one call
 * (get50: a search's hits at k = 50, mem_store_get_many), 4 * USERS lists of a user's facts (FACTS / USERS each, no
 * embeddings), FACTS / 4 updates (version-checked), FACTS / 4 deletes, and
 * FACTS more inserts in batches of BATCH (mem_store_insert_many: one
 * transaction, one durable commit a batch; its latency is a batch's time
 * divided by BATCH, a fact's share, beside `insert`'s one commit a fact).
 * Both stores commit durably (SQLite synchronous=FULL, PostgreSQL's fsync),
 * so a write's time is mostly the disk's flush. Prints, per store and
 * operation, the median over repeats of each repeat's median and p99
 * latency, and one CSV line per row:
 *   store,<store>,<op>,<ops per repeat>,<median us>,<p99 us>
 */
#include "memory/store.h"
#include "bench_util.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { OP_INSERT, OP_GET, OP_GET50, OP_LIST, OP_UPDATE, OP_DELETE, OP_INSERT_MANY, N_OPS };
static const char *const OP_NAME[N_OPS] = {"insert", "get",    "get50",   "list",
                                           "update", "delete", "insert/b"};
static int g_batch = 16; /* -b: facts a batch of OP_INSERT_MANY */

typedef struct run_result {
    double median_us[N_OPS], p99_us[N_OPS];
    int n[N_OPS];
} run_result;

static double p99(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n ? v[(int)((n - 1) * 0.99)] : NAN;
}

static void summarise(double *lat, int n, run_result *r, int op) {
    double *copy = malloc((size_t)n * sizeof *copy);
    memcpy(copy, lat, (size_t)n * sizeof *copy);
    r->p99_us[op] = p99(copy, n) * 1e3;
    r->median_us[op] = bench_median(lat, n) * 1e3;
    r->n[op] = n;
    free(copy);
}

static int one_run(const char *path, int n_facts, int n_users, int dim, uint64_t seed,
                   run_result *res) {
    mem_store *s = NULL;
    if (mem_store_open(path, &s) != IS_OK) {
        fprintf(stderr, "bench_store: %s\n", is_error_last());
        return 1;
    }
    uint64_t rs = seed;
    double *lat = malloc((size_t)(n_facts > 4 * n_users ? n_facts : 4 * n_users) * sizeof *lat);
    float *emb = malloc((size_t)dim * sizeof *emb);
    char(*ids)[MEM_ID_MAX + 1] = calloc((size_t)n_facts, sizeof *ids);
    int vocab_n;
    const char *const *vocab = bench_vocab(&vocab_n);
    char user[32], text[256];
    int rc = 0;
    for (int i = 0; i < n_facts && !rc; i++) {
        for (int d = 0; d < dim; d++) emb[d] = bench_normal(&rs);
        size_t l = 0;
        for (int w = 0; w < 12; w++)
            l += (size_t)snprintf(text + l, sizeof text - l, "%s%s", w ? " " : "",
                                  vocab[bench_splitmix(&rs) % (uint64_t)vocab_n]);
        snprintf(ids[i], sizeof ids[i], "fact-%08d", i);
        snprintf(user, sizeof user, "user-%d", i % n_users);
        mem_fact f = {.tenant = "bench",
                      .user = user,
                      .text = text,
                      .embedding = emb,
                      .dim = dim,
                      .version = 1,
                      .kv_window = 0};
        snprintf(f.id, sizeof f.id, "%s", ids[i]);
        mem_text_hash_hex(text, f.hash);
        double t = bench_now_ms();
        rc = mem_store_insert(s, &f) != IS_OK;
        lat[i] = bench_now_ms() - t;
    }
    if (!rc) summarise(lat, n_facts, res, OP_INSERT);
    for (int i = 0; i < n_facts && !rc; i++) {
        int k = (int)(bench_splitmix(&rs) % (uint64_t)n_facts);
        snprintf(user, sizeof user, "user-%d", k % n_users);
        mem_fact g;
        double t = bench_now_ms();
        rc = mem_store_get(s, "bench", user, ids[k], false, &g) != IS_OK;
        lat[i] = bench_now_ms() - t;
        mem_fact_clear(&g);
    }
    if (!rc) summarise(lat, n_facts, res, OP_GET);
    /* A search's k = 50 hits: one user's facts read in one call. */
    int n_get50 = 4 * n_users;
    const char *want[50];
    mem_fact got[50];
    bool found[50];
    for (int i = 0; i < n_get50 && !rc; i++) {
        int u = i % n_users, per_user = n_facts / n_users;
        snprintf(user, sizeof user, "user-%d", u);
        int k = per_user < 50 ? per_user : 50;
        for (int j = 0; j < k; j++) {
            int f = (int)(bench_splitmix(&rs) % (uint64_t)per_user) * n_users + u;
            want[j] = ids[f];
        }
        double t = bench_now_ms();
        rc = mem_store_get_many(s, "bench", user, want, k, got, found) != IS_OK;
        lat[i] = bench_now_ms() - t;
        for (int j = 0; j < k; j++) mem_fact_clear(&got[j]);
    }
    if (!rc) summarise(lat, n_get50, res, OP_GET50);
    for (int i = 0; i < 4 * n_users && !rc; i++) {
        snprintf(user, sizeof user, "user-%d", i % n_users);
        mem_filter flt = {.tenant = "bench", .user = user};
        mem_fact *all = NULL;
        int32_t na = 0;
        double t = bench_now_ms();
        rc = mem_store_list(s, &flt, false, &all, &na) != IS_OK;
        lat[i] = bench_now_ms() - t;
        mem_facts_free(all, na);
    }
    if (!rc) summarise(lat, 4 * n_users, res, OP_LIST);
    int n_upd = n_facts / 4;
    for (int i = 0; i < n_upd && !rc; i++) {
        snprintf(user, sizeof user, "user-%d", i % n_users);
        snprintf(text, sizeof text, "updated fact number %d", i);
        mem_fact f = {.tenant = "bench",
                      .user = user,
                      .text = text,
                      .embedding = emb,
                      .dim = dim,
                      .version = 2};
        snprintf(f.id, sizeof f.id, "%s", ids[i]);
        mem_text_hash_hex(text, f.hash);
        double t = bench_now_ms();
        rc = mem_store_update(s, &f, 1) != IS_OK;
        lat[i] = bench_now_ms() - t;
    }
    if (!rc) summarise(lat, n_upd, res, OP_UPDATE);
    for (int i = 0; i < n_upd && !rc; i++) {
        int k = n_facts - 1 - i;
        snprintf(user, sizeof user, "user-%d", k % n_users);
        double t = bench_now_ms();
        rc = mem_store_delete(s, "bench", user, ids[k], NULL) != IS_OK;
        lat[i] = bench_now_ms() - t;
    }
    if (!rc) summarise(lat, n_upd, res, OP_DELETE);
    /* Batched inserts: a fact's share of its batch's one transaction. */
    mem_fact *batch = calloc((size_t)g_batch, sizeof *batch);
    char(*btext)[256] = calloc((size_t)g_batch, sizeof *btext);
    char(*buser)[32] = calloc((size_t)g_batch, sizeof *buser);
    float *bemb = malloc((size_t)g_batch * (size_t)dim * sizeof *bemb);
    is_status *bst = malloc((size_t)g_batch * sizeof *bst);
    int n_batches = 0;
    for (int i0 = 0; i0 + g_batch <= n_facts && !rc; i0 += g_batch) {
        for (int j = 0; j < g_batch; j++) {
            int i = i0 + j;
            float *e = bemb + (size_t)j * dim;
            for (int d = 0; d < dim; d++) e[d] = bench_normal(&rs);
            size_t l = 0;
            for (int w = 0; w < 12; w++)
                l += (size_t)snprintf(btext[j] + l, sizeof btext[j] - l, "%s%s", w ? " " : "",
                                      vocab[bench_splitmix(&rs) % (uint64_t)vocab_n]);
            snprintf(buser[j], sizeof buser[j], "user-%d", i % n_users);
            batch[j] = (mem_fact){.tenant = "bench",
                                  .user = buser[j],
                                  .text = btext[j],
                                  .embedding = e,
                                  .dim = dim,
                                  .version = 1};
            snprintf(batch[j].id, sizeof batch[j].id, "batch-%08d", i);
            mem_text_hash_hex(btext[j], batch[j].hash);
        }
        double t = bench_now_ms();
        rc = mem_store_insert_many(s, batch, g_batch, bst) != IS_OK;
        lat[n_batches++] = (bench_now_ms() - t) / g_batch;
    }
    if (!rc) summarise(lat, n_batches, res, OP_INSERT_MANY);
    free(batch);
    free(btext);
    free(buser);
    free(bemb);
    free(bst);
    if (rc) fprintf(stderr, "bench_store: %s\n", is_error_last());
    free(lat);
    free(emb);
    free(ids);
    mem_store_close(s);
    return rc;
}

/* Runs the repeats on one kind of store: each repeat on a new SQLite file,
 * or on PostgreSQL in a new schema (created with psql, named in the URL's
 * search_path), so each starts empty. */
static int run_store(const char *kind, const char *base, int n_facts, int n_users, int repeats,
                     int dim, uint64_t seed) {
    run_result *rr = calloc((size_t)repeats, sizeof *rr);
    for (int r = 0; r < repeats; r++) {
        char path[1200];
        char dir[] = "/tmp/bench_store_XXXXXX";
        if (base) {
            /* A schema of its own per repeat: libpq's options parameter sets the search_path. */
            char schema[64];
            snprintf(schema, sizeof schema, "bench_%d_%d", (int)getpid(), r);
            char cmd[1400];
            snprintf(cmd, sizeof cmd, "psql -q '%s' -c 'CREATE SCHEMA %s' >/dev/null", base,
                     schema);
            if (system(cmd) != 0) {
                fprintf(stderr, "bench_store: cannot create schema %s (psql)\n", schema);
                return 1;
            }
            snprintf(path, sizeof path, "%s%coptions=-csearch_path%%3D%s", base,
                     strchr(base, '?') ? '&' : '?', schema);
        } else {
            if (!mkdtemp(dir)) return 1;
            snprintf(path, sizeof path, "%s/memory.db", dir);
        }
        if (one_run(path, n_facts, n_users, dim, seed + (uint64_t)r, &rr[r])) return 1;
        if (!base) {
            char cmd[128];
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            if (system(cmd) != 0) fprintf(stderr, "bench_store: could not remove %s\n", dir);
        }
    }
    double *v = malloc((size_t)repeats * sizeof *v);
    for (int op = 0; op < N_OPS; op++) {
        for (int r = 0; r < repeats; r++) v[r] = rr[r].median_us[op];
        double med = bench_median(v, repeats);
        for (int r = 0; r < repeats; r++) v[r] = rr[r].p99_us[op];
        double p = bench_median(v, repeats);
        printf("%-10s %-7s %8d %12.1f %12.1f\n", kind, OP_NAME[op], rr[0].n[op], med, p);
        printf("store,%s,%s,%d,%.1f,%.1f\n", kind, OP_NAME[op], rr[0].n[op], med, p);
    }
    free(v);
    free(rr);
    return 0;
}

int main(int argc, char **argv) {
    int n_facts = 2000, n_users = 20, repeats = 3, dim = 384;
    uint64_t seed = 1;
    int c;
    while ((c = getopt(argc, argv, "n:u:r:D:b:s:h")) != -1) {
        switch (c) {
        case 'n': n_facts = atoi(optarg); break;
        case 'u': n_users = atoi(optarg); break;
        case 'r': repeats = atoi(optarg); break;
        case 'D': dim = atoi(optarg); break;
        case 'b': g_batch = atoi(optarg); break;
        case 's': seed = strtoull(optarg, NULL, 10); break;
        default:
            fprintf(
                stderr,
                "usage: bench_store [-n FACTS] [-u USERS] [-r REPEATS] [-D DIM] [-b BATCH] "
                "[-s SEED]\n"
                "  -b BATCH  facts a transaction in the batched inserts (insert/b; default 16)\n"
                "  PostgreSQL too when IS_PG_URL is set (scripts/pg_temp.sh bench_store)\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (n_facts < 4 || n_users < 1 || n_users > n_facts || repeats < 1 || dim < 1 || g_batch < 1 ||
        g_batch > n_facts) {
        fprintf(stderr,
                "bench_store: need FACTS >= 4, 1 <= USERS <= FACTS, REPEATS >= 1, DIM >= 1, "
                "1 <= BATCH <= FACTS\n");
        return 2;
    }
    const char *pg = getenv("IS_PG_URL");
    printf("fact store: %d facts of %d floats over %d users, %d repeats (median of each "
           "repeat's median / p99; insert/b: a fact's share of a batch of %d)\n",
           n_facts, dim, n_users, repeats, g_batch);
    printf("%-10s %-7s %8s %12s %12s\n", "store", "op", "ops", "median us", "p99 us");
    if (run_store("sqlite", NULL, n_facts, n_users, repeats, dim, seed)) return 1;
    if (pg && *pg && run_store("postgres", pg, n_facts, n_users, repeats, dim, seed)) return 1;
    if (!pg || !*pg) printf("(PostgreSQL: run under scripts/pg_temp.sh, which sets IS_PG_URL)\n");
    return 0;
}

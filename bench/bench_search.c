/*
 * bench_search: search latency of the memory index (memory/index.h) for one
 * user holding many facts.
 *
 *   bench_search [-n 1000,10000,100000] [-q QUERIES] [-k K] [-D DIM] [-d LOCOMO_DIR] [-s SEED]
 *                [-m dense,bm25,hybrid]
 *
 * Facts: LoCoMo-like sentences of 6-20 words drawn from the unigram word
 * distribution of LoCoMo's observations (LOCOMO_DIR/ *.json; a built-in word
 * list when that folder is absent), all of one (tenant, user), with random
 * L2-normalised embeddings of DIM floats. Queries: LoCoMo's questions (or
 * generated sentences) with random normalised embeddings. A second set of
 * facts has clustered embeddings (100 centres, fact = centre + noise, the
 * query drawn the same way, so many facts score close to the k-th best),
 * to show the exact top-k's int8 first pass does not rely on random data.
 *
 * For each size: build time per upsert, then for dense, BM25 and hybrid
 * search (k results) the median, p99 and mean latency over QUERIES queries,
 * one thread, after 20 warm-up queries. Prints a table and, for scripts,
 * one CSV line per row: search,<facts>,<mode>,<median ms>,<p99 ms>,<mean ms>,<cpu median ms>
 * (wall-clock latencies, and the median of the thread's CPU time, which on
 * a shared machine leaves out the time other processes held the core).
 */
#include "memory/index.h"
#include "memory/strmap.h"
#include "bench_util.h"

#include <cJSON.h>
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU time of this thread: on a shared machine, wall time also counts the
 * time other processes held our core. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng_state = 42;

static void normalize(float *x, int dim) {
    double n2 = 0;
    for (int j = 0; j < dim; j++) n2 += (double)x[j] * x[j];
    float inv = (float)(1.0 / sqrt(n2));
    for (int j = 0; j < dim; j++) x[j] *= inv;
}

/* ---- words ------------------------------------------------------------------ */

typedef struct words {
    char **w;    /* distinct words */
    double *cum; /* cumulative frequency, for sampling */
    int n, cap;
    char **questions;
    int n_q, cap_q;
    strmap map; /* word -> index */
} words;

static void words_add(words *ws, const char *s, size_t len, double count) {
    int64_t i;
    if (strmap_get(&ws->map, s, len, &i)) {
        ws->cum[i] += count;
        return;
    }
    if (ws->n == ws->cap) {
        ws->cap = ws->cap ? ws->cap * 2 : 1024;
        ws->w = realloc(ws->w, sizeof *ws->w * ws->cap);
        ws->cum = realloc(ws->cum, sizeof *ws->cum * ws->cap);
    }
    ws->w[ws->n] = strndup(s, len);
    ws->cum[ws->n] = count;
    if (strmap_reserve(&ws->map, 1) != IS_OK) exit(1);
    strmap_put(&ws->map, ws->w[ws->n], len, ws->n);
    ws->n++;
}

static void words_add_text(words *ws, const char *t) {
    while (*t) {
        while (*t == ' ' || *t == '"' || *t == '(' || *t == ')') t++;
        const char *e = t;
        while (*e && *e != ' ') e++;
        size_t len = (size_t)(e - t);
        while (len > 0 && strchr(".,!?;:\")", t[len - 1])) len--;
        if (len > 0) words_add(ws, t, len, 1.0);
        t = e;
    }
}

static void words_add_question(words *ws, const char *q) {
    if (ws->n_q == ws->cap_q) {
        ws->cap_q = ws->cap_q ? ws->cap_q * 2 : 1024;
        ws->questions = realloc(ws->questions, sizeof *ws->questions * ws->cap_q);
    }
    ws->questions[ws->n_q++] = strdup(q);
}

/* Observations' words and the questions of every LoCoMo file in dir. */
static int words_load_locomo(words *ws, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *de;
    int files = 0;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l < 6 || strcmp(de->d_name + l - 5, ".json") != 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        fseek(f, 0, SEEK_END);
        long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        char *buf = malloc((size_t)sz + 1);
        size_t got = fread(buf, 1, (size_t)sz, f);
        buf[got] = '\0';
        fclose(f);
        cJSON *root = cJSON_Parse(buf);
        free(buf);
        if (!root) continue;
        const cJSON *it;
        cJSON_ArrayForEach(it, root) {
            if (strstr(it->string, "_observation") && cJSON_IsObject(it)) {
                const cJSON *speaker;
                cJSON_ArrayForEach(speaker, it) {
                    const cJSON *obs;
                    cJSON_ArrayForEach(obs, speaker) {
                        const cJSON *text = cJSON_GetArrayItem(obs, 0);
                        if (cJSON_IsString(text)) words_add_text(ws, text->valuestring);
                    }
                }
            }
        }
        const cJSON *qa = cJSON_GetObjectItem(root, "qa"), *q;
        cJSON_ArrayForEach(q, qa) {
            const cJSON *qt = cJSON_GetObjectItem(q, "question");
            if (cJSON_IsString(qt)) words_add_question(ws, qt->valuestring);
        }
        cJSON_Delete(root);
        files++;
    }
    closedir(d);
    return files;
}

static void words_builtin(words *ws) {
    int n;
    const char *const *builtin_words = bench_vocab(&n);
    for (int i = 0; i < n; i++) /* Zipf-like counts */
        words_add(ws, builtin_words[i], strlen(builtin_words[i]), 100.0 / (1 + i % 30));
}

static void words_finish(words *ws) {
    for (int i = 1; i < ws->n; i++) ws->cum[i] += ws->cum[i - 1];
}

static const char *words_sample(const words *ws) {
    double r = bench_unit(&rng_state) * ws->cum[ws->n - 1];
    int lo = 0, hi = ws->n - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (ws->cum[mid] < r) lo = mid + 1;
        else hi = mid;
    }
    return ws->w[lo];
}

static void make_sentence(const words *ws, int min_w, int max_w, char *out, size_t cap) {
    int n = min_w + (int)(bench_splitmix(&rng_state) % (uint64_t)(max_w - min_w + 1));
    out[0] = '\0';
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        const char *w = words_sample(ws);
        size_t l = strlen(w);
        if (len + l + 2 >= cap) break;
        if (i) out[len++] = ' ';
        memcpy(out + len, w, l);
        len += l;
        out[len] = '\0';
    }
    if (len + 2 < cap) {
        out[len++] = '.';
        out[len] = '\0';
    }
}

/* ---- bench ----------------------------------------------------------------- */

typedef struct stats {
    double median, p99, mean; /* wall time, ms */
    double cpu_median;        /* thread CPU time, ms */
} stats;

static stats run_queries(mem_index *ix, int dim, int n_queries, int k, mem_search_mode mode,
                         const float *qemb, char **qtext) {
    mem_filter f = {.tenant = "bench", .user = "user"};
    mem_hit *hits = malloc(sizeof *hits * (size_t)k);
    double *t = malloc(sizeof *t * (size_t)n_queries);
    double *tc = malloc(sizeof *tc * (size_t)n_queries);
    for (int i = 0; i < 20 + n_queries; i++) {
        int qi = i % n_queries;
        int32_t n = 0;
        double c0 = cpu_s(), t0 = now_s();
        is_status st =
            mem_index_search(ix, &f, qemb + (size_t)qi * dim, qtext[qi], k, mode, hits, &n);
        double t1 = now_s(), c1 = cpu_s();
        if (st != IS_OK) {
            fprintf(stderr, "search failed: %s\n", is_status_to_string(st));
            exit(1);
        }
        if (i >= 20) {
            t[i - 20] = (t1 - t0) * 1e3;
            tc[i - 20] = (c1 - c0) * 1e3;
        }
    }
    stats s = {0};
    for (int i = 0; i < n_queries; i++) s.mean += t[i];
    s.mean /= n_queries;
    qsort(t, (size_t)n_queries, sizeof *t, bench_cmp_double);
    s.median = n_queries % 2 ? t[n_queries / 2] : 0.5 * (t[n_queries / 2 - 1] + t[n_queries / 2]);
    int i99 = (int)ceil(0.99 * n_queries) - 1;
    s.p99 = t[i99 < 0 ? 0 : i99];
    qsort(tc, (size_t)n_queries, sizeof *tc, bench_cmp_double);
    s.cpu_median =
        n_queries % 2 ? tc[n_queries / 2] : 0.5 * (tc[n_queries / 2 - 1] + tc[n_queries / 2]);
    free(hits);
    free(t);
    free(tc);
    return s;
}

/* Fills n embeddings: random unit vectors, or clustered around `centres`. */
static void make_embeddings(float *e, int n, int dim, const float *centres, int n_centres) {
    for (int i = 0; i < n; i++) {
        float *x = e + (size_t)i * dim;
        if (centres) {
            const float *c =
                centres + (size_t)(bench_splitmix(&rng_state) % (uint64_t)n_centres) * dim;
            for (int j = 0; j < dim; j++) x[j] = c[j] + 0.06f * bench_normal(&rng_state);
        } else {
            for (int j = 0; j < dim; j++) x[j] = bench_normal(&rng_state);
        }
        normalize(x, dim);
    }
}

int main(int argc, char **argv) {
    char sizes_arg[256] = "1000,10000,100000";
    const char *locomo = "/work/shared/data/locomo";
    int n_queries = 1000, k = 20, dim = 384, c;
    char modes_arg[64] = "dense,bm25,hybrid";
    while ((c = getopt(argc, argv, "n:q:k:D:d:s:m:h")) != -1) {
        switch (c) {
        case 'n': snprintf(sizes_arg, sizeof sizes_arg, "%s", optarg); break;
        case 'q': n_queries = atoi(optarg); break;
        case 'k': k = atoi(optarg); break;
        case 'D': dim = atoi(optarg); break;
        case 'd': locomo = optarg; break;
        case 's': rng_state = strtoull(optarg, NULL, 10); break;
        case 'm': snprintf(modes_arg, sizeof modes_arg, "%s", optarg); break;
        default:
            fprintf(stderr,
                    "usage: %s [-n 1000,10000,100000] [-q QUERIES] [-k K] [-D DIM] "
                    "[-d LOCOMO_DIR] [-s SEED] [-m dense,bm25,hybrid]\n",
                    argv[0]);
            return c == 'h' ? 0 : 2;
        }
    }
    if (n_queries < 1 || k < 1 || dim < 1) return 2;

    words ws = {0};
    int files = words_load_locomo(&ws, locomo);
    if (files == 0) words_builtin(&ws);
    words_finish(&ws);

    /* Queries: LoCoMo questions when available, else generated. */
    char **qtext = malloc(sizeof *qtext * (size_t)n_queries);
    for (int i = 0; i < n_queries; i++) {
        if (ws.n_q > 0) {
            qtext[i] = strdup(ws.questions[i % ws.n_q]);
        } else {
            char buf[256];
            make_sentence(&ws, 5, 10, buf, sizeof buf);
            qtext[i] = strdup(buf);
        }
    }
    float *qemb = malloc(sizeof(float) * (size_t)n_queries * dim);
    make_embeddings(qemb, n_queries, dim, NULL, 0);
    enum { N_CENTRES = 100 };
    float *centres = malloc(sizeof(float) * N_CENTRES * dim);
    make_embeddings(centres, N_CENTRES, dim, NULL, 0);
    float *qemb_cl = malloc(sizeof(float) * (size_t)n_queries * dim);
    make_embeddings(qemb_cl, n_queries, dim, centres, N_CENTRES);

    printf("bench_search: dim %d, k %d, %d queries, texts from %s (%d words%s)\n", dim, k,
           n_queries, files ? locomo : "a built-in word list", ws.n,
           ws.n_q ? ", LoCoMo questions as queries" : "");
    printf("%9s  %-18s %10s %10s %10s %12s\n", "facts", "mode", "median ms", "p99 ms", "mean ms",
           "cpu med ms");

    char *sz = sizes_arg;
    char csv[64][128];
    int n_csv = 0;
    for (char *tok = strtok(sz, ","); tok; tok = strtok(NULL, ",")) {
        int n = atoi(tok);
        if (n < 1) continue;
        for (int clustered = 0; clustered <= 1; clustered++) {
            mem_index *ix;
            if (mem_index_create(dim, &ix) != IS_OK) return 1;
            float *emb = malloc(sizeof(float) * dim);
            char text[512], id[32];
            double build = 0;
            for (int i = 0; i < n; i++) {
                make_embeddings(emb, 1, dim, clustered ? centres : NULL, N_CENTRES);
                make_sentence(&ws, 6, 20, text, sizeof text);
                snprintf(id, sizeof id, "fact-%08d", i);
                mem_doc d = {
                    .id = id, .tenant = "bench", .user = "user", .text = text, .embedding = emb};
                double t0 = now_s();
                if (mem_index_upsert(ix, &d) != IS_OK) return 1;
                build += now_s() - t0;
            }
            free(emb);
            static const char *names[] = {"dense", "bm25", "hybrid"};
            for (int mode = MEM_SEARCH_DENSE; mode <= MEM_SEARCH_HYBRID; mode++) {
                if (clustered && mode == MEM_SEARCH_BM25) continue; /* same texts: same numbers */
                if (!strstr(modes_arg, names[mode])) continue;
                stats s = run_queries(ix, dim, n_queries, k, (mem_search_mode)mode,
                                      clustered ? qemb_cl : qemb, qtext);
                char label[32];
                snprintf(label, sizeof label, "%s%s", names[mode], clustered ? " (clustered)" : "");
                printf("%9d  %-18s %10.3f %10.3f %10.3f %12.3f\n", n, label, s.median, s.p99,
                       s.mean, s.cpu_median);
                fflush(stdout);
                if (n_csv < 64)
                    snprintf(csv[n_csv++], sizeof csv[0], "search,%d,%s%s,%.4f,%.4f,%.4f,%.4f", n,
                             names[mode], clustered ? "_clustered" : "", s.median, s.p99, s.mean,
                             s.cpu_median);
            }
            if (!clustered)
                printf("%9d  %-18s %10.2f us per fact\n", n, "(build)", build / n * 1e6);
            mem_index_free(ix);
        }
    }
    for (int i = 0; i < n_csv; i++) printf("%s\n", csv[i]);
    for (int i = 0; i < n_queries; i++) free(qtext[i]);
    free(qtext);
    free(qemb);
    free(qemb_cl);
    free(centres);
    for (int i = 0; i < ws.n; i++) free(ws.w[i]);
    for (int i = 0; i < ws.n_q; i++) free(ws.questions[i]);
    free(ws.w);
    free(ws.cum);
    free(ws.questions);
    strmap_free(&ws.map);
    return 0;
}

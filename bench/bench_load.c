/*
 * bench_load: a bounded load test of the HTTP server: C
 * concurrent loopback clients, each a different user with memory, send a
 * fixed number of streaming chat completions per memory mode; the table
 * gives errors, throughput and latency percentiles per (clients, mode).
 *
 *   bench_load [--clients 1,10,50,100] [--modes kv,prompt,off] [--requests N]
 *              [--max-tokens 16] [-k 10[,20,...]] [--facts-per-user 10] [-m MODEL] ...
 *   bench_load --runs K/CLIENTS/MODE/MAX_TOKENS,... [--zipf 1] [--fact-cache-gb GB] ...
 *   (bench_load --help lists every option)
 *
 * The runs are --runs, or every (k, clients, mode) of the lists. With
 * --zipf S each request's user is drawn from --users with popularity
 * rank^-S (so a few users are hot and the rest come and go, as on a real
 * server); without it client t is always user t.
 *
 * One program: the whole serving stack (http_app: model, scheduler, memory,
 * libmicrohttpd) is started in-process on 127.0.0.1 with a port picked by
 * the kernel and a temporary data directory, and driven over loopback with
 * libcurl, one thread (and one keep-alive connection) per client. Nothing
 * but 127.0.0.1 is contacted (proxies are disabled).
 *
 * Memory: users load-u000, load-u001, ... each get --facts-per-user LoCoMo
 * observations (user i: conversation i mod 7, the i/7-th slice of its
 * facts) through POST /v1/memories/ ({"facts": [...], "infer": false});
 * the bench then waits until the server has encoded every fact's KV in the
 * background (polling /metrics: inferscale_facts_encoded_total) and checks
 * with GET /v1/memories/ that each fact reports kv_ready, so kv mode
 * measures injection and not the text fallback.
 *
 * A run (clients C, mode M): C threads start together, then take request
 * numbers from a shared counter until --requests are taken (closed loop:
 * each client sends its next request when its previous answer is
 * complete). Client t is user t and asks its conversation's LoCoMo
 * questions in turn (category 5, adversarial, left out), greedy, with
 * "memory": {"k": K, "mode": M}. Per request: client TTFT (request sent ->
 * first chunk with non-empty content), end-to-end (-> "[DONE]"), and the
 * server's own TTFT and token counts from the final usage chunk. An error
 * is anything but HTTP 200 with a well-formed stream that ends in a usage
 * chunk and [DONE] (curl failures, timeouts, error events included).
 * requests/s and tokens/s are over the run's wall time (start -> last
 * answer). Percentiles are nearest-rank over the successful requests.
 *
 * Bounds: --requests per run, --time-limit seconds per run (after it no new
 * request starts; the ones not started are reported and count as a
 * failure), --request-timeout per request, --encode-timeout for the KV
 * encoding wait. Exit status: 0 only if every run completed every request
 * with zero errors.
 */
#include "core/status.h"
#include "memory/locomo.h"
#include "serve/http/app.h"
#include "bench_util.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef IS_SOURCE_DIR
#define IS_SOURCE_DIR "."
#endif

#define MAX_LEVELS        16
#define OPT_COLD_SESSIONS 0x1300 /* long options without a short one */
#define OPT_RECOMPUTE     0x1301
#define OPT_ADDS_DURING   0x1302
#define MAX_RUNS          128
#define MAX_CONVS         64
#define ERR_LEN           200

static const char *k_mode_names[3] = {"kv", "prompt", "off"};

/* One measured run: k facts a request, C clients, one mode, max_tokens. */
typedef struct run_spec {
    int32_t k, clients, max_tokens;
    int mode;
} run_spec;

typedef struct opts {
    const char *model;
    const char *locomo_dir;
    const char *embedder; /* NULL: the repository's default if present, else none */
    const char *backend;
    const char *cuda_opts; /* --cuda-opt: the CUDA backend's options (NULL: its defaults) */
    const char *data_dir;  /* NULL: a temporary one, removed at the end */
    const char *log_path;  /* NULL: no request log */
    const char *csv_path;
    int32_t levels[MAX_LEVELS];
    int n_levels;
    int modes[3];
    int n_modes;
    int32_t requests; /* per run; 0: max(min_requests, per_client * clients) */
    int32_t min_requests;
    int32_t per_client;
    int32_t max_tokens;     /* of the run under way (chat_body) */
    int32_t k;              /* of the run under way (chat_body) */
    int32_t ks[MAX_LEVELS]; /* --k list */
    int n_ks;
    run_spec runs[MAX_RUNS]; /* --runs, or the product of --k, --clients and --modes */
    int n_runs;
    double zipf;          /* > 0: each request's user drawn with popularity rank^-zipf */
    double fact_cache_gb; /* 0: the server's default */
    double host_cache_gb; /* < 0: the server's default */
    int32_t step_tokens, prefill_chunk; /* 0: the server's defaults */
    int32_t recompute;                  /* the server's --recompute (kv requests) */
    const char *label;                  /* first CSV column (e.g. the regime) */
    int32_t facts_per_user;
    int32_t users; /* 0: the largest client count */
    int32_t threads;
    int32_t max_running;
    int32_t kv_mib;
    int32_t n_ctx; /* 0: the model's */
    int32_t time_limit_s;
    int32_t request_timeout_s;
    int32_t encode_timeout_s;
    bool warmup;
    int32_t ingest_clients; /* concurrent clients adding the users' facts */
    bool ingest_only;       /* measure the ingestion, run no chat */
    double adds_during;     /* > 0: a client adds new facts at this rate during every run */
    bool cold_sessions;     /* restart the server without its KV records before each run */
} opts;

/* ---- time and statistics ------------------------------------------------------------- */

/* Nearest rank on a sorted array; NAN when empty. */
static double pct(const double *sorted, int n, double p) {
    if (n <= 0) return NAN;
    int i = (int)ceil(p * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return sorted[i];
}

/* ---- HTTP helpers ------------------------------------------------------------------ */

typedef struct buf {
    char *p;
    size_t len, cap;
} buf;

static bool buf_add(buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 4096;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) return false;
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return true;
}

static size_t on_write_buf(char *p, size_t sz, size_t n, void *ud) {
    return buf_add(ud, p, sz * n) ? sz * n : 0;
}

/* Loopback only: no proxy from the environment may take the traffic elsewhere. */
static void curl_common(CURL *c, int timeout_s) {
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROXY, "");
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, (long)timeout_s);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
}

/* One request on a handle of the caller's (NULL: a fresh one). Returns the
 * HTTP status, or -1 on a transport error (message in out as text). */
static long http_do(CURL *c, int port, const char *method, const char *path, const char *body,
                    buf *out) {
    bool own = c == NULL;
    if (own && !(c = curl_easy_init())) return -1;
    char url[512];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    curl_easy_reset(c);
    curl_common(c, 120);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    struct curl_slist *h = NULL;
    if (body) {
        h = curl_slist_append(h, "Content-Type: application/json");
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write_buf);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
    CURLcode rc = curl_easy_perform(c);
    long status = -1;
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    else {
        out->len = 0;
        const char *m = curl_easy_strerror(rc);
        buf_add(out, m, strlen(m));
    }
    curl_slist_free_all(h);
    if (own) curl_easy_cleanup(c);
    return status;
}

/* The value of the sample `series` (name with labels, exactly as printed)
 * in Prometheus text; -1 if absent. */
static double metric(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *l = text; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
        if (strncmp(l, series, n) == 0 && l[n] == ' ') return strtod(l + n + 1, NULL);
    }
    return -1;
}

static bool get_metrics(int port, buf *b) {
    b->len = 0;
    return http_do(NULL, port, "GET", "/metrics", NULL, b) == 200;
}

/* ---- users and their memory ----------------------------------------------------------- */

typedef struct conv_info {
    locomo_conv *c;
    int32_t *questions; /* indices of questions with an answer (not category 5) */
    int32_t n_questions;
} conv_info;

typedef struct user {
    char id[32];
    const conv_info *conv;
    int32_t first_fact, n_facts;
} user;

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool load_locomo(const char *dir, conv_info *convs, int *n_convs) {
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "error: cannot open LoCoMo folder '%s': %s\n", dir, strerror(errno));
        return false;
    }
    char *names[MAX_CONVS];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < MAX_CONVS) {
        size_t l = strlen(e->d_name);
        if (l > 5 && strcmp(e->d_name + l - 5, ".json") == 0) names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    int got = 0;
    bool ok = true;
    for (int i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        free(names[i]);
        if (!ok) continue;
        locomo_conv *c;
        if (locomo_load(path, &c) != IS_OK) {
            fprintf(stderr, "error: %s: %s\n", path, is_error_last());
            ok = false;
            continue;
        }
        conv_info *ci = &convs[got];
        ci->c = c;
        ci->questions = malloc(sizeof(int32_t) * (size_t)(c->n_questions ? c->n_questions : 1));
        ci->n_questions = 0;
        for (int32_t q = 0; q < c->n_questions; q++)
            if (c->questions[q].category != 5) ci->questions[ci->n_questions++] = q;
        if (c->n_facts == 0 || ci->n_questions == 0) {
            locomo_free(c);
            free(ci->questions);
            continue;
        }
        got++;
    }
    if (ok && got == 0) {
        fprintf(stderr, "error: no LoCoMo conversation with facts and questions in '%s'\n", dir);
        ok = false;
    }
    *n_convs = got;
    return ok;
}

/* The number of facts of `uid` and how many of them have KV ready; false
 * if the list cannot be had. */
static bool count_facts(int port, const char *uid, buf *b, int64_t *total, int64_t *ready) {
    char path[128];
    snprintf(path, sizeof path, "/v1/memories/?user_id=%s", uid);
    b->len = 0;
    long st = http_do(NULL, port, "GET", path, NULL, b);
    cJSON *r = st == 200 ? cJSON_Parse(b->p) : NULL;
    cJSON *it, *res = r ? cJSON_GetObjectItem(r, "results") : NULL;
    if (!cJSON_IsArray(res)) {
        fprintf(stderr, "error: GET %s: HTTP %ld: %.200s\n", path, st, b->p ? b->p : "");
        cJSON_Delete(r);
        return false;
    }
    *total = *ready = 0;
    cJSON_ArrayForEach(it, res) {
        (*total)++;
        if (cJSON_IsTrue(cJSON_GetObjectItem(it, "kv_ready"))) (*ready)++;
    }
    cJSON_Delete(r);
    return true;
}

/* Adds user u's facts (a user of a reused --data folder that already has
 * exactly its facts is left as it is): how many were added, 0 when kept,
 * -1 on an error (printed). */
static int64_t add_user(int port, user *us, buf *b, bool *kept) {
    int64_t have, ready;
    *kept = false;
    if (!count_facts(port, us->id, b, &have, &ready)) return -1;
    if (have == us->n_facts) {
        *kept = true;
        return 0;
    }
    if (have != 0) {
        fprintf(stderr, "error: %s already has %lld facts, not %d (use another --data folder)\n",
                us->id, (long long)have, us->n_facts);
        return -1;
    }
    const locomo_conv *c = us->conv->c;
    cJSON *o = cJSON_CreateObject();
    cJSON *facts = cJSON_AddArrayToObject(o, "facts");
    for (int32_t i = 0; i < us->n_facts; i++)
        cJSON_AddItemToArray(facts,
                             cJSON_CreateString(c->facts[(us->first_fact + i) % c->n_facts].text));
    cJSON_AddStringToObject(o, "user_id", us->id);
    cJSON_AddBoolToObject(o, "infer", false);
    cJSON *md = cJSON_AddObjectToObject(o, "metadata");
    cJSON_AddStringToObject(md, "source", "locomo");
    cJSON_AddStringToObject(md, "conversation", c->name);
    char *body = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    b->len = 0;
    long st = http_do(NULL, port, "POST", "/v1/memories/", body, b);
    free(body);
    cJSON *r = st == 200 ? cJSON_Parse(b->p) : NULL;
    cJSON *res = r ? cJSON_GetObjectItem(r, "results") : NULL;
    int n = cJSON_IsArray(res) ? cJSON_GetArraySize(res) : -1;
    cJSON_Delete(r);
    if (n != us->n_facts) {
        fprintf(stderr, "error: adding %s's memories: HTTP %ld, %d of %d stored: %.300s\n", us->id,
                st, n, us->n_facts, b->p ? b->p : "");
        return -1;
    }
    return n;
}

/* One adding client: users t, t + C, t + 2C, ... */
typedef struct add_worker {
    pthread_t th;
    int port;
    user *users;
    int32_t n_users, first, stride;
    int64_t added, kept;
    bool failed;
} add_worker;

static void *add_worker_main(void *arg) {
    add_worker *w = arg;
    buf b = {0};
    for (int32_t u = w->first; u < w->n_users && !w->failed; u += w->stride) {
        bool kept;
        int64_t n = add_user(w->port, &w->users[u], &b, &kept);
        if (n < 0) w->failed = true;
        else w->added += n, w->kept += kept;
    }
    free(b.p);
    return NULL;
}

/* Adds every user's facts with `clients` concurrent clients (one request
 * a user, all its facts); returns how many were added, -1 on an error. */
static int64_t add_memories(int port, user *users, int32_t n_users, int32_t clients) {
    if (clients < 1) clients = 1;
    if (clients > n_users) clients = n_users;
    add_worker *w = calloc((size_t)clients, sizeof *w);
    if (!w) return -1;
    int32_t started = 0;
    for (; started < clients; started++) {
        w[started] = (add_worker){
            .port = port, .users = users, .n_users = n_users, .first = started, .stride = clients};
        if (pthread_create(&w[started].th, NULL, add_worker_main, &w[started]) != 0) break;
    }
    int64_t added = 0, kept = 0;
    bool failed = started < clients;
    for (int32_t t = 0; t < started; t++) {
        pthread_join(w[t].th, NULL);
        added += w[t].added;
        kept += w[t].kept;
        failed |= w[t].failed;
    }
    free(w);
    if (kept)
        fprintf(stderr, "memory: %lld users already had their facts (reused --data)\n",
                (long long)kept);
    return failed ? -1 : added;
}

/* --adds-during: one client adding facts at a steady rate while a run's
 * chat clients run (the users' conversations' observations, 8 a request,
 * each request under a new user of its own, so the measured users'
 * memories do not change), so that the run measures serving beside
 * ingestion. */
typedef struct bg_adder {
    pthread_t th;
    int port;
    const user *users;
    int32_t n_users;
    int32_t run;
    double rate; /* facts/s */
    atomic_bool stop;
    int64_t added;
    int32_t errors;
} bg_adder;

#define BG_ADD_FACTS 8

static void *bg_add_main(void *arg) {
    bg_adder *a = arg;
    buf b = {0};
    const double t0 = bench_now_ms();
    for (int32_t i = 0; !atomic_load(&a->stop);) {
        /* Request i is due once i * 8 facts have been added at the rate. */
        double due = t0 + 1e3 * i * BG_ADD_FACTS / a->rate, now = bench_now_ms();
        if (due > now) {
            usleep((useconds_t)((due - now < 50 ? due - now : 50) * 1e3));
            continue;
        }
        const locomo_conv *c = a->users[i % a->n_users].conv->c;
        cJSON *o = cJSON_CreateObject();
        cJSON *facts = cJSON_AddArrayToObject(o, "facts");
        for (int32_t j = 0; j < BG_ADD_FACTS; j++)
            cJSON_AddItemToArray(
                facts, cJSON_CreateString(c->facts[(i * BG_ADD_FACTS + j) % c->n_facts].text));
        char uid[48];
        snprintf(uid, sizeof uid, "bg-%d-%d", (int)a->run, (int)i);
        cJSON_AddStringToObject(o, "user_id", uid);
        cJSON_AddBoolToObject(o, "infer", false);
        char *body = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        b.len = 0;
        long st = body ? http_do(NULL, a->port, "POST", "/v1/memories/", body, &b) : 0;
        free(body);
        i++;
        if (st == 200) a->added += BG_ADD_FACTS;
        else if (a->errors++ == 0)
            fprintf(stderr, "error: background add: HTTP %ld: %.200s\n", st, b.p ? b.p : "");
    }
    free(b.p);
    return NULL;
}

/* Waits until every user's facts report kv_ready. /metrics is polled
 * (cheap): once `want` facts more than `base` are encoded and no encode
 * job waits, or every 10 s, the users' lists are checked. */
static bool wait_encoded(int port, double base_encoded, int64_t want, const user *users,
                         int32_t n_users, int timeout_s, double *t_done) {
    double t0 = bench_now_ms(), last_print = 0, last_check = t0;
    *t_done = 0;
    int64_t expect = 0;
    for (int32_t u = 0; u < n_users; u++) expect += users[u].n_facts;
    buf b = {0};
    bool ok = false;
    for (;;) {
        if (!get_metrics(port, &b)) {
            fprintf(stderr, "error: GET /metrics failed\n");
            break;
        }
        double enc = metric(b.p, "inferscale_facts_encoded_total") - base_encoded;
        double fail = metric(b.p, "inferscale_encode_failures_total");
        double q = metric(b.p, "inferscale_encode_queue_depth");
        if (fail > 0) {
            fprintf(stderr, "error: the server failed to encode %.0f facts' KV\n", fail);
            break;
        }
        double t = bench_now_ms();
        if (enc >= (double)want && q == 0 && !*t_done) *t_done = t;
        if ((enc >= (double)want && q == 0) || t - last_check > 10e3) {
            last_check = t;
            int64_t total = 0, ready = 0;
            bool listed = true;
            for (int32_t u = 0; listed && u < n_users; u++) {
                int64_t a, r;
                listed = count_facts(port, users[u].id, &b, &a, &r);
                total += a;
                ready += r;
            }
            if (!listed) break;
            if (total != expect) {
                fprintf(stderr, "error: the users have %lld facts, expected %lld\n",
                        (long long)total, (long long)expect);
                break;
            }
            if (ready == total) {
                if (!*t_done) *t_done = t;
                fprintf(stderr,
                        "memory: %lld facts of %d users, all with KV ready (waited %.1f s)\n",
                        (long long)total, n_users, (t - t0) / 1e3);
                ok = true;
                break;
            }
        }
        if (t - t0 > timeout_s * 1e3) {
            fprintf(stderr,
                    "error: not every fact's KV was encoded after %d s (--encode-timeout)\n",
                    timeout_s);
            break;
        }
        if (t - last_print > 5e3) {
            fprintf(stderr, "  encoding facts' KV: %.0f / %lld (%.0f s)\n", enc, (long long)want,
                    (t - t0) / 1e3);
            last_print = t;
        }
        usleep(50 * 1000);
    }
    free(b.p);
    return ok;
}

/* ---- one streaming chat request ------------------------------------------------------ */

typedef struct sample {
    bool ok;
    double ttft_ms;     /* client: sent -> first non-empty content */
    double e2e_ms;      /* client: sent -> stream complete */
    double srv_ttft_ms; /* usage.ttft_ms */
    double prep_ms;     /* usage.prepare_ms: received -> handed to the scheduler (NAN: absent) */
    double queue_ms;    /* usage.queue_ms: handed to the scheduler -> admitted (NAN: absent) */
    double admit_ms;    /* usage.admit_ms: admitted -> facts injected (NAN: absent) */
    int32_t completion_tokens, memory_tokens, injected_tokens;
    int32_t tiers[5]; /* usage.facts: gpu, host, disk, text, encoded */
    char err[ERR_LEN];
} sample;

typedef struct stream_state {
    CURL *c;
    double t0;
    long status; /* 0 until the first bytes */
    buf raw;     /* a non-200 body */
    buf pend;    /* SSE bytes not yet split into events */
    bool got_content, got_usage, got_done, got_error;
    sample *s;
} stream_state;

static void set_err(sample *s, const char *fmt, const char *detail) {
    if (s->err[0]) return; /* keep the first */
    snprintf(s->err, ERR_LEN, fmt, detail);
}

static void on_event(stream_state *st, char *data) {
    sample *s = st->s;
    if (st->got_done) {
        set_err(s, "%s", "data after [DONE]");
        return;
    }
    if (strcmp(data, "[DONE]") == 0) {
        st->got_done = true;
        return;
    }
    cJSON *o = cJSON_Parse(data);
    if (!o) {
        set_err(s, "unparsable chunk: %.120s", data);
        st->got_error = true;
        return;
    }
    cJSON *e = cJSON_GetObjectItem(o, "error");
    if (e) {
        cJSON *m = cJSON_GetObjectItem(e, "message");
        set_err(s, "error event: %.150s", cJSON_IsString(m) ? m->valuestring : "?");
        st->got_error = true;
    }
    cJSON *ch = cJSON_GetObjectItem(o, "choices");
    cJSON *c0 = cJSON_IsArray(ch) ? cJSON_GetArrayItem(ch, 0) : NULL;
    cJSON *delta = c0 ? cJSON_GetObjectItem(c0, "delta") : NULL;
    cJSON *content = delta ? cJSON_GetObjectItem(delta, "content") : NULL;
    if (!st->got_content && cJSON_IsString(content) && content->valuestring[0]) {
        st->got_content = true;
        s->ttft_ms = bench_now_ms() - st->t0;
    }
    cJSON *u = cJSON_GetObjectItem(o, "usage");
    if (cJSON_IsObject(u)) {
        cJSON *ct = cJSON_GetObjectItem(u, "completion_tokens");
        cJSON *mt = cJSON_GetObjectItem(u, "memory_tokens");
        cJSON *it = cJSON_GetObjectItem(u, "injected_tokens");
        cJSON *tt = cJSON_GetObjectItem(u, "ttft_ms");
        if (!cJSON_IsNumber(ct) || !cJSON_IsNumber(tt)) {
            set_err(s, "%s", "usage chunk without completion_tokens or ttft_ms");
            st->got_error = true;
        } else {
            st->got_usage = true;
            s->completion_tokens = (int32_t)ct->valuedouble;
            s->srv_ttft_ms = tt->valuedouble;
            cJSON *pm = cJSON_GetObjectItem(u, "prepare_ms");
            cJSON *qm = cJSON_GetObjectItem(u, "queue_ms");
            s->prep_ms = cJSON_IsNumber(pm) ? pm->valuedouble : NAN;
            s->queue_ms = cJSON_IsNumber(qm) ? qm->valuedouble : NAN;
            cJSON *am = cJSON_GetObjectItem(u, "admit_ms");
            s->admit_ms = cJSON_IsNumber(am) ? am->valuedouble : NAN;
            s->memory_tokens = cJSON_IsNumber(mt) ? (int32_t)mt->valuedouble : 0;
            s->injected_tokens = cJSON_IsNumber(it) ? (int32_t)it->valuedouble : 0;
            cJSON *fs = cJSON_GetObjectItem(u, "facts");
            static const char *const names[5] = {"gpu", "host", "disk", "text", "encoded"};
            for (int t = 0; t < 5; t++) {
                cJSON *x = fs ? cJSON_GetObjectItem(fs, names[t]) : NULL;
                s->tiers[t] = cJSON_IsNumber(x) ? (int32_t)x->valuedouble : 0;
            }
        }
    }
    cJSON_Delete(o);
}

static size_t on_stream(char *p, size_t sz, size_t n, void *ud) {
    stream_state *st = ud;
    size_t len = sz * n;
    if (st->status == 0) curl_easy_getinfo(st->c, CURLINFO_RESPONSE_CODE, &st->status);
    if (st->status != 200) return buf_add(&st->raw, p, len) ? len : 0;
    if (!buf_add(&st->pend, p, len)) return 0;
    /* Events end with a blank line; each of their lines is "data: ...". */
    char *start = st->pend.p, *end;
    while ((end = strstr(start, "\n\n"))) {
        *end = '\0';
        for (char *line = start; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = '\0';
            if (strncmp(line, "data:", 5) == 0) on_event(st, line + 5 + (line[5] == ' '));
            line = nl ? nl + 1 : NULL;
        }
        start = end + 2;
    }
    size_t used = (size_t)(start - st->pend.p);
    memmove(st->pend.p, start, st->pend.len - used + 1);
    st->pend.len -= used;
    return len;
}

static void chat_once(CURL *c, int port, const char *body, int timeout_s, sample *s) {
    memset(s, 0, sizeof *s);
    stream_state st = {.c = c, .s = s};
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/chat/completions", port);
    curl_easy_reset(c);
    curl_common(c, timeout_s);
    curl_easy_setopt(c, CURLOPT_URL, url);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    h = curl_slist_append(h, "Accept: text/event-stream");
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_stream);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &st);
    st.t0 = bench_now_ms();
    CURLcode rc = curl_easy_perform(c);
    s->e2e_ms = bench_now_ms() - st.t0;
    curl_slist_free_all(h);
    if (rc != CURLE_OK) set_err(s, "curl: %s", curl_easy_strerror(rc));
    else if (st.status != 200) {
        char m[ERR_LEN];
        snprintf(m, sizeof m, "HTTP %ld: %.150s", st.status, st.raw.p ? st.raw.p : "");
        set_err(s, "%s", m);
    } else if (!st.got_error && !st.got_done) set_err(s, "%s", "stream ended without [DONE]");
    else if (!st.got_error && !st.got_usage) set_err(s, "%s", "stream without a usage chunk");
    else if (!st.got_error && s->completion_tokens > 0 && !st.got_content)
        set_err(s, "%s", "tokens counted but no content chunk");
    if (!st.got_content) s->ttft_ms = s->e2e_ms; /* an empty answer: first byte = end */
    s->ok = s->err[0] == '\0';
    free(st.raw.p);
    free(st.pend.p);
}

/* ---- a run: C clients, one mode ----------------------------------------------------- */

typedef struct run {
    const opts *o;
    int port;
    int mode;
    const user *users;
    int32_t clients, n_requests;
    atomic_int next;
    double deadline_ms;
    pthread_mutex_t mu; /* ready, go: every client starts at once */
    pthread_cond_t cv;
    int ready;
    bool go;
    sample *samples; /* by request number */
    atomic_int taken;
    const double *zipf_cdf; /* [n_users], or NULL: client t is user t */
    int32_t n_users;
} run;

/* A user index drawn from the cumulative popularity cdf (xorshift64*). */
static int32_t zipf_draw(const double *cdf, int32_t n, uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    double u = (double)((x * 2685821657736338717ull) >> 11) / 9007199254740992.0;
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t mid = (lo + hi) / 2;
        if (cdf[mid] > u) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

typedef struct client_arg {
    run *r;
    int32_t t;
} client_arg;

static char *chat_body(const opts *o, const user *u, int mode, int32_t seq) {
    const conv_info *ci = u->conv;
    int32_t user_no = atoi(u->id + 6); /* "load-uNNN" */
    const locomo_question *q =
        &ci->c->questions[ci->questions[(user_no * 7 + seq) % ci->n_questions]];
    cJSON *o_ = cJSON_CreateObject();
    cJSON_AddStringToObject(o_, "model", "bench");
    cJSON *msgs = cJSON_AddArrayToObject(o_, "messages");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", q->question);
    cJSON_AddItemToArray(msgs, m);
    cJSON_AddNumberToObject(o_, "max_tokens", o->max_tokens);
    cJSON_AddNumberToObject(o_, "temperature", 0);
    cJSON_AddBoolToObject(o_, "stream", true);
    cJSON_AddTrueToObject(cJSON_AddObjectToObject(o_, "stream_options"), "include_usage");
    cJSON_AddStringToObject(o_, "user", u->id);
    cJSON *mem = cJSON_AddObjectToObject(o_, "memory");
    cJSON_AddNumberToObject(mem, "k", o->k);
    cJSON_AddStringToObject(mem, "mode", k_mode_names[mode]);
    char *s = cJSON_PrintUnformatted(o_);
    cJSON_Delete(o_);
    return s;
}

static void *client_main(void *arg) {
    client_arg *a = arg;
    run *r = a->r;
    CURL *c = curl_easy_init();
    pthread_mutex_lock(&r->mu);
    r->ready++;
    pthread_cond_broadcast(&r->cv);
    while (!r->go) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    if (!c) {
        int i = atomic_fetch_add(&r->next, 1);
        if (i < r->n_requests) {
            atomic_fetch_add(&r->taken, 1);
            snprintf(r->samples[i].err, ERR_LEN, "curl_easy_init failed");
        }
        return NULL;
    }
    const user *u = &r->users[a->t];
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(a->t + 1) ^ (uint64_t)r->clients << 32;
    for (int32_t seq = 0;; seq++) {
        if (bench_now_ms() > r->deadline_ms) break;
        int i = atomic_fetch_add(&r->next, 1);
        if (i >= r->n_requests) break;
        atomic_fetch_add(&r->taken, 1);
        if (r->zipf_cdf) u = &r->users[zipf_draw(r->zipf_cdf, r->n_users, &rng)];
        char *body = chat_body(r->o, u, r->mode, seq);
        if (!body) {
            snprintf(r->samples[i].err, ERR_LEN, "out of memory");
            continue;
        }
        chat_once(c, r->port, body, r->o->request_timeout_s, &r->samples[i]);
        free(body);
    }
    curl_easy_cleanup(c);
    return NULL;
}

typedef struct row {
    int32_t k, max_tokens;
    int32_t clients;
    int mode;
    int32_t requests, done, errors, not_started;
    double wall_s, rps, tok_s;
    double ttft50, ttft99, sttft50, sttft99, e2e50, e2e99;
    /* Medians of the client TTFT's parts: received -> scheduler, queued,
     * admitted -> first token, and the rest (HTTP both ways, the client). */
    double prep50, queue50, engine50, rest50, admit50;
    double mem_tok, inj_tok, kv_hit;
    char first_err[ERR_LEN];
} row;

static bool run_one(const opts *o, int port, const user *users, const double *zipf_cdf,
                    int32_t clients, int mode, int32_t n_requests, row *out) {
    run r;
    memset(&r, 0, sizeof r);
    r.zipf_cdf = zipf_cdf;
    r.n_users = o->users;
    r.o = o;
    r.port = port;
    r.mode = mode;
    r.users = users;
    r.clients = clients;
    r.n_requests = n_requests;
    atomic_init(&r.next, 0);
    atomic_init(&r.taken, 0);
    r.samples = calloc((size_t)n_requests, sizeof *r.samples);
    pthread_t *th = calloc((size_t)clients, sizeof *th);
    client_arg *args = calloc((size_t)clients, sizeof *args);
    if (!r.samples || !th || !args) {
        fprintf(stderr, "error: out of memory\n");
        free(r.samples);
        free(th);
        free(args);
        return false;
    }
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);

    buf mb = {0};
    /* The server's counters around the run: its facts' hits, and how its
     * engine batched the requests (steps, prompt tokens, injections). */
    static const char *const counters[] = {"inferscale_fact_kv_total{result=\"hit\"}",
                                           "inferscale_fact_kv_total{result=\"miss\"}",
                                           "inferscale_engine_steps_total",
                                           "inferscale_tokens_prefilled_total",
                                           "inferscale_inject_calls_total",
                                           "inferscale_inject_requests_total",
                                           "inferscale_facts_encoded_total"};
    enum { N_COUNTERS = sizeof counters / sizeof counters[0] };
    double c0[N_COUNTERS] = {0}, c1[N_COUNTERS] = {0};
    if (get_metrics(port, &mb))
        for (int i = 0; i < N_COUNTERS; i++) c0[i] = metric(mb.p, counters[i]);
    int32_t started = 0;
    for (int32_t t = 0; t < clients; t++) {
        args[t] = (client_arg){.r = &r, .t = t};
        if (pthread_create(&th[t], NULL, client_main, &args[t]) != 0) break;
        started++;
    }
    if (started < clients) {
        fprintf(stderr, "error: could only start %d of %d client threads\n", started, clients);
        atomic_store(&r.next, n_requests); /* the ones started end at once */
    }
    static int32_t n_runs_so_far;
    bg_adder bg = {.port = port,
                   .users = users,
                   .n_users = o->users,
                   .run = n_runs_so_far++,
                   .rate = o->adds_during};
    atomic_init(&bg.stop, false);
    bool bg_started = o->adds_during > 0 && pthread_create(&bg.th, NULL, bg_add_main, &bg) == 0;
    if (o->adds_during > 0 && !bg_started) fprintf(stderr, "error: no background adding client\n");
    pthread_mutex_lock(&r.mu);
    while (r.ready < started) pthread_cond_wait(&r.cv, &r.mu);
    r.deadline_ms = bench_now_ms() + o->time_limit_s * 1e3; /* published by the mutex */
    r.go = true;
    pthread_cond_broadcast(&r.cv);
    pthread_mutex_unlock(&r.mu);
    double t0 = bench_now_ms();
    for (int32_t t = 0; t < started; t++) pthread_join(th[t], NULL);
    double wall_s = (bench_now_ms() - t0) / 1e3;
    if (bg_started) {
        atomic_store(&bg.stop, true);
        pthread_join(bg.th, NULL);
    }
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);

    memcpy(c1, c0, sizeof c1);
    if (get_metrics(port, &mb))
        for (int i = 0; i < N_COUNTERS; i++) c1[i] = metric(mb.p, counters[i]);
    free(mb.p);
    double hit0 = c0[0], miss0 = c0[1], hit1 = c1[0], miss1 = c1[1];
    double steps = c1[2] - c0[2], prefilled = c1[3] - c0[3];
    double inj_calls = c1[4] - c0[4], inj_reqs = c1[5] - c0[5];
    if (bg_started)
        fprintf(stderr,
                "adds during: k %d, %d clients: %lld facts added (%.1f/s, %d errors), %.0f "
                "encoded (%.1f/s) while the run's requests ran\n",
                (int)o->k, (int)clients, (long long)bg.added, bg.added / wall_s, bg.errors,
                c1[6] - c0[6], (c1[6] - c0[6]) / wall_s);
    if (steps > 0)
        fprintf(stderr,
                "engine: k %d, %d clients: %.0f steps, %.0f prompt tokens a step, %.2f steps a "
                "request; %.0f injections of %.1f requests each\n",
                (int)o->k, (int)clients, steps, prefilled / steps, steps / n_requests, inj_calls,
                inj_calls > 0 ? inj_reqs / inj_calls : 0.0);

    row w;
    memset(&w, 0, sizeof w);
    w.clients = clients;
    w.k = o->k;
    w.max_tokens = o->max_tokens;
    w.mode = mode;
    w.requests = n_requests;
    int taken = atomic_load(&r.taken);
    if (taken > n_requests) taken = n_requests;
    w.not_started = n_requests - taken;
    w.wall_s = wall_s;
    double *ttft = calloc((size_t)n_requests + 1, sizeof(double));
    double *sttft = calloc((size_t)n_requests + 1, sizeof(double));
    double *e2e = calloc((size_t)n_requests + 1, sizeof(double));
    double *parts[5];
    bool parts_ok = true;
    for (int p = 0; p < 5; p++)
        parts_ok &= (parts[p] = calloc((size_t)n_requests + 1, sizeof(double))) != NULL;
    int n_ok = 0, n_parts = 0;
    int64_t toks = 0, mem = 0, inj = 0;
    long long tiers[5] = {0, 0, 0, 0, 0};
    /* Client TTFTs of the requests whose facts were encoded for them (a
     * session's first on this node) and of the others. */
    double *ttft_first = calloc((size_t)n_requests + 1, sizeof(double));
    double *ttft_later = calloc((size_t)n_requests + 1, sizeof(double));
    int n_first = 0, n_later = 0;
    for (int i = 0; i < n_requests; i++) {
        sample *s = &r.samples[i];
        if (i >= taken && !s->ok && !s->err[0]) continue; /* not started */
        if (!s->ok) {
            w.errors++;
            if (!w.first_err[0]) snprintf(w.first_err, ERR_LEN, "%s", s->err[0] ? s->err : "?");
            continue;
        }
        ttft[n_ok] = s->ttft_ms;
        sttft[n_ok] = s->srv_ttft_ms;
        e2e[n_ok] = s->e2e_ms;
        n_ok++;
        if (!isnan(s->prep_ms) && !isnan(s->queue_ms) && !isnan(s->admit_ms) && parts_ok) {
            parts[0][n_parts] = s->prep_ms;
            parts[1][n_parts] = s->queue_ms;
            parts[2][n_parts] = s->srv_ttft_ms - s->queue_ms;
            parts[3][n_parts] = s->ttft_ms - s->prep_ms - s->srv_ttft_ms;
            parts[4][n_parts] = s->admit_ms;
            n_parts++;
        }
        toks += s->completion_tokens;
        mem += s->memory_tokens;
        inj += s->injected_tokens;
        for (int t = 0; t < 5; t++) tiers[t] += s->tiers[t];
        if (ttft_first && ttft_later) {
            if (s->tiers[4] > 0) ttft_first[n_first++] = s->ttft_ms;
            else ttft_later[n_later++] = s->ttft_ms;
        }
    }
    w.done = n_ok;
    /* Where the run's facts came from (usage.facts), for reading a tiered run. */
    if (tiers[0] + tiers[1] + tiers[2] + tiers[3] + tiers[4] > 0)
        fprintf(stderr,
                "note: k %d, %d clients: facts from gpu %lld, host tier %lld, disk %lld, "
                "encoded for the request %lld, as text %lld\n",
                (int)o->k, (int)clients, tiers[0], tiers[1], tiers[2], tiers[4], tiers[3]);
    if (n_first > 0 && ttft_first && ttft_later) {
        qsort(ttft_first, (size_t)n_first, sizeof(double), bench_cmp_double);
        qsort(ttft_later, (size_t)n_later, sizeof(double), bench_cmp_double);
        printf("sessions: k %d, %d clients, %s: first request of a session (KV encoded on demand) "
               "%d, ttft p50 %.2f p99 %.2f ms; later requests %d, ttft p50 %.2f p99 %.2f ms\n",
               (int)o->k, (int)clients, k_mode_names[mode], n_first, pct(ttft_first, n_first, 0.5),
               pct(ttft_first, n_first, 0.99), n_later, pct(ttft_later, n_later, 0.5),
               pct(ttft_later, n_later, 0.99));
    }
    free(ttft_first);
    free(ttft_later);
    qsort(ttft, (size_t)n_ok, sizeof(double), bench_cmp_double);
    qsort(sttft, (size_t)n_ok, sizeof(double), bench_cmp_double);
    qsort(e2e, (size_t)n_ok, sizeof(double), bench_cmp_double);
    w.ttft50 = pct(ttft, n_ok, 0.5);
    w.ttft99 = pct(ttft, n_ok, 0.99);
    w.sttft50 = pct(sttft, n_ok, 0.5);
    w.sttft99 = pct(sttft, n_ok, 0.99);
    w.e2e50 = pct(e2e, n_ok, 0.5);
    w.e2e99 = pct(e2e, n_ok, 0.99);
    double *p50[5] = {&w.prep50, &w.queue50, &w.engine50, &w.rest50, &w.admit50};
    for (int p = 0; p < 5; p++) {
        *p50[p] = NAN;
        if (n_parts == 0) continue;
        qsort(parts[p], (size_t)n_parts, sizeof(double), bench_cmp_double);
        *p50[p] = pct(parts[p], n_parts, 0.5);
    }
    if (n_parts > 0)
        fprintf(stderr,
                "timing: k %d, %d clients, %s: client TTFT p50 %.2f ms; medians of its parts: "
                "received -> scheduler (parse, memory search) %.2f, queued %.2f, admitted -> "
                "first token %.2f (admitted -> facts injected %.2f), the rest (HTTP both ways) "
                "%.2f ms\n",
                (int)o->k, (int)clients, k_mode_names[mode], w.ttft50, w.prep50, w.queue50,
                w.engine50, w.admit50, w.rest50);
    w.rps = wall_s > 0 ? n_ok / wall_s : 0;
    w.tok_s = wall_s > 0 ? (double)toks / wall_s : 0;
    w.mem_tok = n_ok ? (double)mem / n_ok : 0;
    w.inj_tok = n_ok ? (double)inj / n_ok : 0;
    double dh = hit1 - hit0, dm = miss1 - miss0;
    w.kv_hit = dh + dm > 0 ? 100.0 * dh / (dh + dm) : NAN;
    free(ttft);
    free(sttft);
    free(e2e);
    for (int p = 0; p < 5; p++) free(parts[p]);
    free(r.samples);
    free(th);
    free(args);
    *out = w;
    return started == clients;
}

static void print_header(FILE *f) {
    fprintf(f, "%4s %4s %7s %-6s %8s %6s %8s %9s %9s %9s %9s %9s %9s %8s %8s %8s %6s\n", "k", "max",
            "clients", "mode", "requests", "errors", "req/s", "ttft_p50", "ttft_p99", "sttft_p50",
            "sttft_p99", "e2e_p50", "e2e_p99", "tok/s", "mem_tok", "inj_tok", "kv_hit");
    fprintf(f, "%4s %4s %7s %-6s %8s %6s %8s %9s %9s %9s %9s %9s %9s %8s %8s %8s %6s\n", "", "tok",
            "", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "", "/req", "/req", "%");
}

static void print_row(FILE *f, const row *w) {
    char hit[16];
    if (isnan(w->kv_hit)) snprintf(hit, sizeof hit, "-");
    else snprintf(hit, sizeof hit, "%.1f", w->kv_hit);
    fprintf(f,
            "%4d %4d %7d %-6s %8d %6d %8.2f %9.2f %9.2f %9.2f %9.2f %9.1f %9.1f %8.1f %8.1f %8.1f "
            "%6s\n",
            w->k, w->max_tokens, w->clients, k_mode_names[w->mode], w->requests,
            w->errors + w->not_started, w->rps, w->ttft50, w->ttft99, w->sttft50, w->sttft99,
            w->e2e50, w->e2e99, w->tok_s, w->mem_tok, w->inj_tok, hit);
    fflush(f);
}

/* A CSV row, written (and flushed) as soon as its run ends, so that a run
 * stopped by a time limit keeps the rows before it. */
static void csv_row(FILE *f, const char *label, const row *w) {
    if (!f) return;
    fprintf(f,
            "%s,%d,%d,%d,%s,%d,%d,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,"
            "%.3f,%.3f,%.3f,%.3f,%.3f\n",
            label ? label : "", w->k, w->max_tokens, w->clients, k_mode_names[w->mode], w->requests,
            w->errors, w->not_started, w->wall_s, w->rps, w->ttft50, w->ttft99, w->sttft50,
            w->sttft99, w->e2e50, w->e2e99, w->tok_s, w->mem_tok, w->inj_tok, w->kv_hit, w->prep50,
            w->queue50, w->engine50, w->rest50, w->admit50);
    fflush(f);
}

/* ---- options ------------------------------------------------------------------------ */

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: bench_load [options]\n\n"
        "A bounded load test of the HTTP server, started in-process on 127.0.0.1 (a free port,\n"
        "a temporary data directory): for each client count and memory mode, that many\n"
        "concurrent loopback clients (each a different user with LoCoMo facts in memory) send\n"
        "a fixed number of streaming chat completions. Prints errors, requests/s, tokens/s and\n"
        "TTFT / end-to-end percentiles per (clients, mode). Exit status 0 only with zero "
        "errors.\n\n"
        "  -c, --clients LIST       client counts (default 1,10,50,100)\n"
        "      --modes LIST         memory modes, of kv,prompt,off (default kv,prompt,off)\n"
        "  -n, --requests N         requests per (clients, mode) run (default: max(MIN, PER x "
        "clients))\n"
        "      --per-client PER     (default 2)\n"
        "      --min-requests MIN   (default 20)\n"
        "      --max-tokens N       max_tokens of each request (default 16; greedy decoding)\n"
        "  -k, --k LIST             memory.k: facts retrieved per request (default 10); a list\n"
        "                           (5,20,50,100) runs every client count and mode at each\n"
        "      --runs SPEC          the runs instead of the product of --k, --clients, --modes "
        "and\n"
        "                           --max-tokens: K/CLIENTS/MODE/MAX_TOKENS,... (e.g. "
        "50/1/kv/1,50/100/kv/32)\n"
        "      --zipf S             each request's user drawn from --users with popularity "
        "rank^-S\n"
        "                           (1: Zipf's law; default 0: client t is always user t)\n"
        "      --fact-cache-gb GB   the server's GPU fact cache (cuda; default: what is left)\n"
        "      --host-cache-gb GB   the server's pinned host tier (cuda; default: the server's; 0: "
        "off)\n"
        "      --step-tokens N      the server's tokens per engine step (default: by backend)\n"
        "      --prefill-chunk N    the server's prompt tokens of one request a step (default: by "
        "backend)\n"
        "      --recompute M        the server recomputes the first M tokens of each fact\n"
        "                           in kv requests (default 0)\n"
        "      --label NAME         first column of the CSV (e.g. the regime: hot, tiered, cold)\n"
        "      --facts-per-user F   LoCoMo facts stored for each user (default 10)\n"
        "      --users U            users with memory (default: the largest client count)\n"
        "  -m, --model PATH         GGUF model (default "
        "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
        "      --locomo DIR         LoCoMo conversations (default %s/../shared/data/locomo)\n"
        "      --embedder DIR       sentence embedder for retrieval (default "
        "models/all-MiniLM-L6-v2\n"
        "                           of the repository if present; 'none': BM25 only)\n"
        "      --backend B          cpu | cuda (default cpu)\n"
        "      --cuda-opt LIST      the server's CUDA backend options, key=value,...\n"
        "                           (cuda/options.h; bench_gpu -h lists them)\n"
        "  -t, --threads N          engine threads (default: all cores)\n"
        "      --max-running N      requests in the server's running batch (default 32)\n"
        "      --kv-mem MIB         KV cache pool (default 1024)\n"
        "      --ctx N              context per request (default: the model's)\n"
        "      --time-limit S       per run: no request starts after S seconds (default 300)\n"
        "      --request-timeout S  per request (default 120)\n"
        "      --encode-timeout S   wait for the facts' KV encoding (default 900)\n"
        "      --no-warmup          skip the one untimed request per mode before the runs\n"
        "      --ingest-clients N   concurrent clients adding the users' facts (default 1); the\n"
        "                           line 'ingestion:' gives facts/s stored and with KV encoded\n"
        "      --ingest-only        stop after the ingestion (no chat runs)\n"
        "      --adds-during R      during every run one more client adds R new facts a second\n"
        "                           (8 a request, under users of its own): serving beside\n"
        "                           ingestion; the line 'adds during:' gives facts/s added and\n"
        "                           encoded\n"
        "      --cold-sessions      before each run, restart the server without its KV records "
        "(the\n"
        "                           facts stay), so a user's first request of the run is the first "
        "of\n"
        "                           a session on this node: its facts' KV is encoded on demand. A\n"
        "                           'sessions:' line splits the TTFT of those first requests from\n"
        "                           the later ones' (use --zipf or more requests than clients)\n"
        "      --data DIR           memory data directory to use and keep (default: temporary);\n"
        "                           users that already hold their facts are not loaded again\n"
        "      --log FILE           the server's request log (default: none)\n"
        "  -o, --csv FILE           also write the table as CSV\n"
        "  -h, --help               this help\n",
        IS_SOURCE_DIR, IS_SOURCE_DIR);
}

static bool parse_int(const char *s, const char *what, long lo, long hi, int32_t *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "error: %s must be an integer in [%ld, %ld], got '%s'\n", what, lo, hi, s);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

static bool parse_double(const char *s, const char *what, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "error: %s must be a number in [%g, %g], got '%s'\n", what, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_ks(const char *s, opts *o) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s", s);
    o->n_ks = 0;
    for (char *sv, *t = strtok_r(tmp, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
        if (o->n_ks == MAX_LEVELS) {
            fprintf(stderr, "error: at most %d values of -k\n", MAX_LEVELS);
            return false;
        }
        if (!parse_int(t, "-k", 1, 1000, &o->ks[o->n_ks])) return false;
        o->n_ks++;
    }
    if (!o->n_ks) {
        fprintf(stderr, "error: -k needs at least one value\n");
        return false;
    }
    return true;
}

static int mode_of(const char *t) {
    for (int i = 0; i < 3; i++)
        if (strcmp(t, k_mode_names[i]) == 0) return i;
    return -1;
}

/* K/CLIENTS/MODE/MAX_TOKENS,... */
static bool parse_runs(const char *s, opts *o) {
    char tmp[4096];
    if (strlen(s) >= sizeof tmp) {
        fprintf(stderr, "error: --runs is too long\n");
        return false;
    }
    snprintf(tmp, sizeof tmp, "%s", s);
    o->n_runs = 0;
    for (char *sv, *t = strtok_r(tmp, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
        char mode[16];
        int k, c, x, used = 0;
        if (sscanf(t, "%d/%d/%15[a-z]/%d%n", &k, &c, mode, &x, &used) != 4 || t[used] || k < 1 ||
            k > 1000 || c < 1 || c > 1000 || x < 1 || x > 4096 || mode_of(mode) < 0) {
            fprintf(stderr,
                    "error: --runs entry '%s' is not K/CLIENTS/MODE/MAX_TOKENS (k 1-1000, "
                    "clients 1-1000, mode kv|prompt|off, max_tokens 1-4096)\n",
                    t);
            return false;
        }
        if (o->n_runs == MAX_RUNS) {
            fprintf(stderr, "error: at most %d runs\n", MAX_RUNS);
            return false;
        }
        o->runs[o->n_runs++] =
            (run_spec){.k = k, .clients = c, .max_tokens = x, .mode = mode_of(mode)};
    }
    if (!o->n_runs) {
        fprintf(stderr, "error: --runs needs at least one run\n");
        return false;
    }
    return true;
}

static bool parse_levels(const char *s, opts *o) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s", s);
    o->n_levels = 0;
    for (char *sv, *t = strtok_r(tmp, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
        if (o->n_levels == MAX_LEVELS) {
            fprintf(stderr, "error: at most %d client counts\n", MAX_LEVELS);
            return false;
        }
        if (!parse_int(t, "a client count", 1, 1000, &o->levels[o->n_levels])) return false;
        o->n_levels++;
    }
    if (!o->n_levels) {
        fprintf(stderr, "error: --clients needs at least one count\n");
        return false;
    }
    return true;
}

static bool parse_modes(const char *s, opts *o) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%s", s);
    o->n_modes = 0;
    for (char *sv, *t = strtok_r(tmp, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
        int m = -1;
        for (int i = 0; i < 3; i++)
            if (strcmp(t, k_mode_names[i]) == 0) m = i;
        if (m < 0 || o->n_modes == 3) {
            fprintf(stderr, "error: --modes takes kv, prompt and off, got '%s'\n", s);
            return false;
        }
        o->modes[o->n_modes++] = m;
    }
    if (!o->n_modes) {
        fprintf(stderr, "error: --modes needs at least one mode\n");
        return false;
    }
    return true;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

/* Deletes the KV record files of a data directory (the .fkv files in kv/) while
 * no server has it open. */
static bool remove_records(const char *data) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/kv", data);
    DIR *d = opendir(dir);
    if (!d) return true; /* none yet */
    struct dirent *de;
    bool ok = true;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        if (l <= 4 || strcmp(de->d_name + l - 4, ".fkv") != 0) continue;
        char path[PATH_MAX + 300];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (unlink(path) != 0) {
            fprintf(stderr, "error: cannot remove %s: %s\n", path, strerror(errno));
            ok = false;
            break;
        }
    }
    closedir(d);
    return ok;
}

int main(int argc, char **argv) {
    opts o = {
        .model = IS_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        .locomo_dir = IS_SOURCE_DIR "/../shared/data/locomo",
        .backend = "cpu",
        .min_requests = 20,
        .per_client = 2,
        .max_tokens = 16,
        .k = 10,
        .facts_per_user = 10,
        .kv_mib = 1024,
        .time_limit_s = 300,
        .request_timeout_s = 120,
        .encode_timeout_s = 900,
        .warmup = true,
        .host_cache_gb = -1,
        .ingest_clients = 1,
    };
    parse_levels("1,10,50,100", &o);
    parse_modes("kv,prompt,off", &o);
    parse_ks("10", &o);
    static const struct option longopts[] = {
        {"clients", required_argument, 0, 'c'},
        {"modes", required_argument, 0, 'M'},
        {"requests", required_argument, 0, 'n'},
        {"per-client", required_argument, 0, 'P'},
        {"min-requests", required_argument, 0, 'N'},
        {"max-tokens", required_argument, 0, 'x'},
        {"k", required_argument, 0, 'k'},
        {"facts-per-user", required_argument, 0, 'F'},
        {"users", required_argument, 0, 'U'},
        {"model", required_argument, 0, 'm'},
        {"locomo", required_argument, 0, 'l'},
        {"embedder", required_argument, 0, 'E'},
        {"backend", required_argument, 0, 'B'},
        {"threads", required_argument, 0, 't'},
        {"max-running", required_argument, 0, 'R'},
        {"kv-mem", required_argument, 0, 'V'},
        {"time-limit", required_argument, 0, 'T'},
        {"request-timeout", required_argument, 0, 'O'},
        {"encode-timeout", required_argument, 0, 'e'},
        {"no-warmup", no_argument, 0, 'W'},
        {"cold-sessions", no_argument, 0, OPT_COLD_SESSIONS},
        {"data", required_argument, 0, 'D'},
        {"log", required_argument, 0, 'L'},
        {"csv", required_argument, 0, 'o'},
        {"help", no_argument, 0, 'h'},
        {"runs", required_argument, 0, 'r'},
        {"zipf", required_argument, 0, 'z'},
        {"fact-cache-gb", required_argument, 0, 'g'},
        {"step-tokens", required_argument, 0, 'S'},
        {"prefill-chunk", required_argument, 0, 'C'},
        {"recompute", required_argument, 0, OPT_RECOMPUTE},
        {"label", required_argument, 0, 'b'},
        {"ctx", required_argument, 0, 'X'},
        {"host-cache-gb", required_argument, 0, 'H'},
        {"ingest-clients", required_argument, 0, 'I'},
        {"ingest-only", no_argument, 0, 'Y'},
        {"adds-during", required_argument, 0, OPT_ADDS_DURING},
        {"cuda-opt", required_argument, 0, 'Z'},
        {0, 0, 0, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "c:n:k:m:t:o:h", longopts, NULL)) != -1) {
        bool ok = true;
        switch (ch) {
        case 'c': ok = parse_levels(optarg, &o); break;
        case 'M': ok = parse_modes(optarg, &o); break;
        case 'n': ok = parse_int(optarg, "--requests", 1, 1000000, &o.requests); break;
        case 'P': ok = parse_int(optarg, "--per-client", 1, 100000, &o.per_client); break;
        case 'N': ok = parse_int(optarg, "--min-requests", 1, 1000000, &o.min_requests); break;
        case 'x': ok = parse_int(optarg, "--max-tokens", 1, 4096, &o.max_tokens); break;
        case 'k': ok = parse_ks(optarg, &o); break;
        case 'r': ok = parse_runs(optarg, &o); break;
        case 'z': ok = parse_double(optarg, "--zipf", 0, 10, &o.zipf); break;
        case 'g': ok = parse_double(optarg, "--fact-cache-gb", 0.001, 1e4, &o.fact_cache_gb); break;
        case 'H': ok = parse_double(optarg, "--host-cache-gb", 0, 1e4, &o.host_cache_gb); break;
        case 'S': ok = parse_int(optarg, "--step-tokens", 1, 1 << 16, &o.step_tokens); break;
        case 'C': ok = parse_int(optarg, "--prefill-chunk", 1, 1 << 16, &o.prefill_chunk); break;
        case OPT_RECOMPUTE: ok = parse_int(optarg, "--recompute", 0, 100000, &o.recompute); break;
        case 'b': o.label = optarg; break;
        case 'X': ok = parse_int(optarg, "--ctx", 16, 1 << 20, &o.n_ctx); break;
        case 'F': ok = parse_int(optarg, "--facts-per-user", 1, 1000, &o.facts_per_user); break;
        case 'U': ok = parse_int(optarg, "--users", 1, 100000, &o.users); break;
        case 'm': o.model = optarg; break;
        case 'l': o.locomo_dir = optarg; break;
        case 'E': o.embedder = optarg; break;
        case 'B': o.backend = optarg; break;
        case 'Z': o.cuda_opts = optarg; break;
        case 't': ok = parse_int(optarg, "--threads", 1, 1024, &o.threads); break;
        case 'R': ok = parse_int(optarg, "--max-running", 1, 4096, &o.max_running); break;
        case 'V': ok = parse_int(optarg, "--kv-mem", 16, 1 << 20, &o.kv_mib); break;
        case 'T': ok = parse_int(optarg, "--time-limit", 1, 86400, &o.time_limit_s); break;
        case 'O': ok = parse_int(optarg, "--request-timeout", 1, 3600, &o.request_timeout_s); break;
        case 'e': ok = parse_int(optarg, "--encode-timeout", 1, 86400, &o.encode_timeout_s); break;
        case 'W': o.warmup = false; break;
        case 'I': ok = parse_int(optarg, "--ingest-clients", 1, 1024, &o.ingest_clients); break;
        case 'Y': o.ingest_only = true; break;
        case OPT_ADDS_DURING:
            ok = parse_double(optarg, "--adds-during", 0.1, 1e6, &o.adds_during);
            break;
        case OPT_COLD_SESSIONS: o.cold_sessions = true; break;
        case 'D': o.data_dir = optarg; break;
        case 'L': o.log_path = optarg; break;
        case 'o': o.csv_path = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 1;
        }
        if (!ok) return 1;
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 1;
    }
    if (o.n_runs == 0) { /* the product of the lists */
        for (int ki = 0; ki < o.n_ks; ki++)
            for (int li = 0; li < o.n_levels; li++)
                for (int mi = 0; mi < o.n_modes; mi++) {
                    if (o.n_runs == MAX_RUNS) {
                        fprintf(stderr, "error: more than %d runs (fewer -k, clients or modes)\n",
                                MAX_RUNS);
                        return 1;
                    }
                    o.runs[o.n_runs++] = (run_spec){.k = o.ks[ki],
                                                    .clients = o.levels[li],
                                                    .max_tokens = o.max_tokens,
                                                    .mode = o.modes[mi]};
                }
    }
    int32_t max_clients = 0, max_k = 0;
    for (int i = 0; i < o.n_runs; i++) {
        if (o.runs[i].clients > max_clients) max_clients = o.runs[i].clients;
        if (o.runs[i].k > max_k) max_k = o.runs[i].k;
    }
    o.k = max_k;
    if (!o.users) o.users = max_clients;
    if (o.users < max_clients && o.zipf == 0) {
        fprintf(stderr,
                "error: --users %d is fewer than %d clients (each client is a different "
                "user)\n",
                o.users, max_clients);
        return 1;
    }
    if (max_k > o.facts_per_user)
        fprintf(stderr, "note: k = %d but each user has only %d facts: every fact is retrieved\n",
                max_k, o.facts_per_user);
    /* Zipf popularity: user i (rank i + 1) has weight (i + 1)^-zipf. */
    double *zipf_cdf = NULL;
    if (o.zipf > 0) {
        if (!(zipf_cdf = malloc((size_t)o.users * sizeof *zipf_cdf))) return 1;
        double sum = 0;
        for (int32_t i = 0; i < o.users; i++) sum += pow(i + 1.0, -o.zipf);
        double acc = 0;
        for (int32_t i = 0; i < o.users; i++) zipf_cdf[i] = (acc += pow(i + 1.0, -o.zipf) / sum);
        zipf_cdf[o.users - 1] = 1.0;
    }
    struct stat sb;
    if (stat(o.model, &sb) != 0) {
        fprintf(stderr, "error: model '%s' not found (scripts/setup.sh installs the default one)\n",
                o.model);
        return 1;
    }

    conv_info convs[MAX_CONVS];
    int n_convs = 0;
    if (!load_locomo(o.locomo_dir, convs, &n_convs)) return 1;
    user *users = calloc((size_t)o.users, sizeof *users);
    if (!users) return 1;
    for (int32_t u = 0; u < o.users; u++) {
        snprintf(users[u].id, sizeof users[u].id, "load-u%03d", u);
        users[u].conv = &convs[u % n_convs];
        users[u].first_fact = (u / n_convs) * o.facts_per_user;
        users[u].n_facts = o.facts_per_user;
    }

    char tmpdir[] = "/tmp/bench_load_XXXXXX";
    const char *data = o.data_dir;
    if (!data) {
        if (!mkdtemp(tmpdir)) {
            fprintf(stderr, "error: mkdtemp: %s\n", strerror(errno));
            return 1;
        }
        data = tmpdir;
    }
    char embedder[1024];
    if (o.embedder) snprintf(embedder, sizeof embedder, "%s", o.embedder);
    else {
        snprintf(embedder, sizeof embedder, "%s/%s", IS_SOURCE_DIR, HTTP_APP_DEFAULT_EMBEDDER);
        if (stat(embedder, &sb) != 0) {
            fprintf(stderr, "warning: %s not found: retrieval is BM25 only\n", embedder);
            snprintf(embedder, sizeof embedder, "none");
        }
    }
    FILE *logf = NULL;
    if (o.log_path && !(logf = fopen(o.log_path, "w"))) {
        fprintf(stderr, "error: cannot open '%s': %s\n", o.log_path, strerror(errno));
        return 1;
    }

    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    http_app_params p = http_app_default_params();
    p.model_path = o.model;
    p.model_name = "bench";
    p.backend = o.backend;
    p.backend_options = o.cuda_opts;
    p.data_dir = data;
    p.embedder_dir = embedder;
    p.threads = o.threads;
    p.kv_bytes = (size_t)o.kv_mib << 20;
    p.n_ctx = o.n_ctx;
    if (o.max_running) p.sched.max_running = o.max_running;
    if (o.step_tokens) p.sched.step_tokens = o.step_tokens;
    if (o.prefill_chunk) p.sched.prefill_chunk = o.prefill_chunk;
    p.sched.recompute = o.recompute;
    p.fact_cache_bytes = (size_t)(o.fact_cache_gb * (double)(1 << 30));
    if (o.host_cache_gb >= 0)
        p.sched.host_tier_bytes = (int64_t)(o.host_cache_gb * (double)(1 << 30));
    if (p.sched.max_queued < 2 * max_clients) p.sched.max_queued = 2 * max_clients;
    p.http.host = "127.0.0.1";
    p.http.port = 0;
    p.http.no_auth = true;
    p.http.no_auth_tenant = "bench";
    /* Every client (plus the bench's own /metrics polls) must be admitted:
     * a 429 would be an error of the bench's making. */
    if (p.http.limits.max_in_flight < 2 * max_clients + 8)
        p.http.limits.max_in_flight = 2 * max_clients + 8;
    if (p.http.limits.max_connections < 2 * max_clients + 8)
        p.http.limits.max_connections = 2 * max_clients + 8;
    if (p.http.limits.parse.max_k < max_k) p.http.limits.parse.max_k = max_k;
    p.http.log = logf;
    p.http.quiet = logf == NULL;

    int rc = 1;
    row *rows = NULL;
    int n_rows = 0;
    http_app *app = NULL;
    FILE *csvf = NULL;
    double t_all = bench_now_ms();
    if (http_app_start(&p, &app) != IS_OK) {
        fprintf(stderr, "error: starting the server: %s\n", is_error_last());
        goto done;
    }
    int port = http_app_port(app);
    fprintf(stderr, "server: http://127.0.0.1:%d, data %s\n", port, data);

    buf mb = {0};
    double enc0 = 0;
    if (get_metrics(port, &mb)) enc0 = metric(mb.p, "inferscale_facts_encoded_total");
    free(mb.p);
    if (enc0 < 0) {
        fprintf(stderr, "error: /metrics has no inferscale_facts_encoded_total\n");
        goto done;
    }
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    double t_add = bench_now_ms();
    int64_t added = add_memories(port, users, o.users, o.ingest_clients);
    if (added < 0) goto done;
    double t_added = bench_now_ms(), t_enc;
    fprintf(stderr, "memory: added %lld facts for %d users in %.1f s\n", (long long)added, o.users,
            (t_added - t_add) / 1e3);
    if (!wait_encoded(port, enc0, added, users, o.users, o.encode_timeout_s, &t_enc)) goto done;
    if (added > 0) {
        /* Stored = the adds answered (text, embedding, row durable); with KV
         * = every fact's record encoded and committed, as /metrics counts. */
        double add_s = (t_added - t_add) / 1e3, kv_s = ((t_enc ? t_enc : t_added) - t_add) / 1e3;
        /* The process is client and server: its CPU time a fact is what the
         * whole ingestion cost, whatever the neighbours on a shared machine took. */
        getrusage(RUSAGE_SELF, &ru1);
        double cpu_s = (ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) +
                       (ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) +
                       ((ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) +
                        (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec)) /
                           1e6;
        printf("ingestion: %lld facts, %d users, %d clients: stored in %.2f s (%.1f facts/s), "
               "with KV in %.2f s (%.1f facts/s); CPU %.1f ms a fact\n",
               (long long)added, o.users, o.ingest_clients < o.users ? o.ingest_clients : o.users,
               add_s, added / add_s, kv_s, added / kv_s, cpu_s * 1e3 / added);
        fflush(stdout);
    }
    if (o.ingest_only) {
        rc = 0;
        goto done;
    }

    if (o.warmup) {
        CURL *c = curl_easy_init();
        for (int mi = 0; c && mi < o.n_modes; mi++) {
            char *body = chat_body(&o, &users[0], o.modes[mi], 0);
            sample s;
            chat_once(c, port, body, o.request_timeout_s, &s);
            free(body);
            if (!s.ok) {
                fprintf(stderr, "error: warm-up request (%s) failed: %s\n",
                        k_mode_names[o.modes[mi]], s.err);
                curl_easy_cleanup(c);
                goto done;
            }
        }
        if (c) curl_easy_cleanup(c);
    }

    rows = calloc((size_t)o.n_runs, sizeof *rows);
    if (!rows) goto done;
    printf("bench_load%s%s: model %s, backend %s, %d users x %d facts%s\n", o.label ? " " : "",
           o.label ? o.label : "", o.model, o.backend, o.users, o.facts_per_user,
           o.zipf > 0 ? ", users drawn by Zipf popularity" : "");
    print_header(stdout);
    bool all_ok = true;
    if (o.csv_path) {
        if (!(csvf = fopen(o.csv_path, "w"))) {
            fprintf(stderr, "error: cannot write '%s': %s\n", o.csv_path, strerror(errno));
            goto done;
        }
        fprintf(csvf,
                "label,k,max_tokens,clients,mode,requests,errors,not_started,wall_s,req_per_s,"
                "ttft_p50_ms,ttft_p99_ms,server_ttft_p50_ms,server_ttft_p99_ms,e2e_p50_ms,"
                "e2e_p99_ms,tokens_per_s,memory_tokens_per_req,injected_tokens_per_req,"
                "kv_hit_pct,prepare_p50_ms,queue_p50_ms,admitted_to_token_p50_ms,"
                "rest_p50_ms,admit_p50_ms\n");
        fflush(csvf);
    }
    for (int ri = 0; ri < o.n_runs; ri++) {
        const run_spec *rs = &o.runs[ri];
        int32_t c = rs->clients;
        int32_t n = o.requests;
        if (!n) n = c * o.per_client > o.min_requests ? c * o.per_client : o.min_requests;
        o.k = rs->k;
        o.max_tokens = rs->max_tokens;
        row *w = &rows[n_rows];
        if (o.cold_sessions) {
            /* A node that lost its cache: the facts stay in the store. */
            http_app_stop(app);
            app = NULL;
            if (!remove_records(data)) goto done;
            if (http_app_start(&p, &app) != IS_OK) {
                fprintf(stderr, "error: restarting the server: %s\n", is_error_last());
                goto done;
            }
            port = http_app_port(app);
        }
        if (!run_one(&o, port, users, zipf_cdf, c, rs->mode, n, w)) all_ok = false;
        n_rows++;
        print_row(stdout, w);
        csv_row(csvf, o.label, w);
        if (w->errors || w->not_started) {
            all_ok = false;
            if (w->not_started)
                fprintf(stderr, "  %d requests not started: --time-limit %d s reached\n",
                        w->not_started, o.time_limit_s);
            if (w->errors) fprintf(stderr, "  first error: %s\n", w->first_err);
        }
    }
    printf("total %.1f s (including start-up, memory load and KV encoding)\n",
           (bench_now_ms() - t_all) / 1e3);
    rc = all_ok ? 0 : 1;
    if (!all_ok)
        fprintf(stderr, "bench_load: FAILED (errors or requests not started; see above)\n");

done:
    if (csvf) fclose(csvf);
    http_app_stop(app);
    curl_global_cleanup();
    if (logf) fclose(logf);
    if (!o.data_dir && data == tmpdir) nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    for (int i = 0; i < n_convs; i++) {
        locomo_free(convs[i].c);
        free(convs[i].questions);
    }
    free(users);
    free(rows);
    free(zipf_cdf);
    return rc;
}

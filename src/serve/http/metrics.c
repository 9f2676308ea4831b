#include "serve/http/metrics.h"

#include "core/status.h"
#include "kv/record_store.h"
#include "serve/scheduler.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Seconds: from a few ms (a cached prefix on a GPU) to minutes (a long
 * answer on a CPU). */
static const double k_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,
                                  1.0,   2.5,  5.0,   10.0, 30.0, 60.0, 120.0};
#define N_BOUNDS    ((int)(sizeof k_bounds / sizeof k_bounds[0]))
#define RATE_WINDOW 10

static const char *const k_modes[METRICS_N_MODES] = {"kv", "prompt", "off"};
static const char *const k_routes[METRICS_ROUTE_COUNT_] = {
    "chat_completions", "models", "memories", "memories_search", "health", "metrics", "other"};

typedef struct histogram {
    uint64_t counts[N_BOUNDS + 1]; /* per bucket (not cumulative); last: +Inf */
    double sum;
    uint64_t n;
} histogram;

/* Status codes counted individually; others fall into "other". */
static const int k_codes[] = {200, 400, 401, 404, 405, 413, 422, 429, 500, 503};
#define N_CODES ((int)(sizeof k_codes / sizeof k_codes[0]))

struct metrics {
    pthread_mutex_t mu;
    histogram ttft[METRICS_N_MODES], total[METRICS_N_MODES];
    uint64_t chat_ok[METRICS_N_MODES], chat_failed[METRICS_N_MODES];
    uint64_t prompt_tokens[METRICS_N_MODES], completion_tokens[METRICS_N_MODES];
    uint64_t injected[METRICS_N_MODES], mem_prefilled[METRICS_N_MODES];
    uint64_t http[METRICS_ROUTE_COUNT_][N_CODES + 1];
    /* Completion tokens per second of wall time, last RATE_WINDOW seconds. */
    int64_t rate_sec[RATE_WINDOW];
    uint64_t rate_tok[RATE_WINDOW];
};

const char *metrics_route_name(metrics_route r) {
    return (unsigned)r < METRICS_ROUTE_COUNT_ ? k_routes[r] : "other";
}

is_status metrics_create(metrics **out) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return IS_OK;
}

void metrics_free(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static void hist_add(histogram *h, double v) {
    int b = 0;
    while (b < N_BOUNDS && v > k_bounds[b]) b++;
    h->counts[b]++;
    h->sum += v;
    h->n++;
}

static int64_t now_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec;
}

void metrics_observe_chat(metrics *m, const metrics_chat *c) {
    if (!m || !c || c->mode < 0 || c->mode >= METRICS_N_MODES) return;
    int64_t s = now_sec();
    pthread_mutex_lock(&m->mu);
    int md = c->mode;
    if (c->ok) {
        m->chat_ok[md]++;
        if (c->ttft_s >= 0) hist_add(&m->ttft[md], c->ttft_s);
        hist_add(&m->total[md], c->total_s);
    } else {
        m->chat_failed[md]++;
    }
    m->prompt_tokens[md] += (uint64_t)(c->prompt_tokens > 0 ? c->prompt_tokens : 0);
    m->completion_tokens[md] += (uint64_t)(c->completion_tokens > 0 ? c->completion_tokens : 0);
    m->injected[md] += (uint64_t)(c->injected_tokens > 0 ? c->injected_tokens : 0);
    m->mem_prefilled[md] +=
        (uint64_t)(c->memory_prefilled_tokens > 0 ? c->memory_prefilled_tokens : 0);
    int slot = (int)(s % RATE_WINDOW);
    if (m->rate_sec[slot] != s) {
        m->rate_sec[slot] = s;
        m->rate_tok[slot] = 0;
    }
    m->rate_tok[slot] += (uint64_t)(c->completion_tokens > 0 ? c->completion_tokens : 0);
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe_http(metrics *m, metrics_route r, int status) {
    if (!m) return;
    if ((unsigned)r >= METRICS_ROUTE_COUNT_) r = METRICS_ROUTE_OTHER;
    int ci = N_CODES;
    for (int i = 0; i < N_CODES; i++)
        if (k_codes[i] == status) ci = i;
    pthread_mutex_lock(&m->mu);
    m->http[r][ci]++;
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ---------------------------------------------------------------------- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2 + (size_t)n + 1;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

static void render_hist(sbuf *b, const char *name, const char *help, const histogram *h) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int md = 0; md < METRICS_N_MODES; md++) {
        uint64_t cum = 0;
        for (int i = 0; i < N_BOUNDS; i++) {
            cum += h[md].counts[i];
            sb_printf(b, "%s_bucket{mode=\"%s\",le=\"%g\"} %llu\n", name, k_modes[md], k_bounds[i],
                      (unsigned long long)cum);
        }
        cum += h[md].counts[N_BOUNDS];
        sb_printf(b, "%s_bucket{mode=\"%s\",le=\"+Inf\"} %llu\n", name, k_modes[md],
                  (unsigned long long)cum);
        sb_printf(b, "%s_sum{mode=\"%s\"} %.6f\n", name, k_modes[md], h[md].sum);
        sb_printf(b, "%s_count{mode=\"%s\"} %llu\n", name, k_modes[md],
                  (unsigned long long)h[md].n);
    }
}

static void render_mode_counter(sbuf *b, const char *name, const char *help, const uint64_t *v) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s counter\n", name, help, name);
    for (int md = 0; md < METRICS_N_MODES; md++)
        sb_printf(b, "%s{mode=\"%s\"} %llu\n", name, k_modes[md], (unsigned long long)v[md]);
}

static void gauge(sbuf *b, const char *name, const char *help, const char *type, double v) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

char *metrics_render(metrics *m, const metrics_live *live, size_t *len) {
    sbuf b = {.cap = 16384};
    if (!(b.p = malloc(b.cap))) return NULL;
    b.p[0] = '\0';
    metrics cp;
    pthread_mutex_lock(&m->mu);
    cp = *m;
    pthread_mutex_unlock(&m->mu);

    render_hist(&b, "inferscale_ttft_seconds", "Time to first token of chat completions.", cp.ttft);
    render_hist(&b, "inferscale_request_duration_seconds",
                "End-to-end time of chat completions (submit to last token).", cp.total);
    sb_printf(&b, "# HELP inferscale_chat_requests_total Chat completions finished, by mode and "
                  "result.\n# TYPE inferscale_chat_requests_total counter\n");
    for (int md = 0; md < METRICS_N_MODES; md++) {
        sb_printf(&b, "inferscale_chat_requests_total{mode=\"%s\",result=\"ok\"} %llu\n",
                  k_modes[md], (unsigned long long)cp.chat_ok[md]);
        sb_printf(&b, "inferscale_chat_requests_total{mode=\"%s\",result=\"error\"} %llu\n",
                  k_modes[md], (unsigned long long)cp.chat_failed[md]);
    }
    render_mode_counter(&b, "inferscale_prompt_tokens_total",
                        "Prompt tokens of chat completions (memory included).", cp.prompt_tokens);
    render_mode_counter(&b, "inferscale_completion_tokens_total",
                        "Tokens generated for chat completions.", cp.completion_tokens);
    sb_printf(&b, "# HELP inferscale_memory_tokens_total Memory tokens of chat completions, "
                  "injected as KV or prefilled as text.\n"
                  "# TYPE inferscale_memory_tokens_total counter\n");
    for (int md = 0; md < METRICS_N_MODES; md++) {
        sb_printf(&b, "inferscale_memory_tokens_total{mode=\"%s\",how=\"injected\"} %llu\n",
                  k_modes[md], (unsigned long long)cp.injected[md]);
        sb_printf(&b, "inferscale_memory_tokens_total{mode=\"%s\",how=\"prefilled\"} %llu\n",
                  k_modes[md], (unsigned long long)cp.mem_prefilled[md]);
    }
    sb_printf(&b, "# HELP inferscale_http_requests_total HTTP requests answered, by route and "
                  "status.\n# TYPE inferscale_http_requests_total counter\n");
    for (int r = 0; r < METRICS_ROUTE_COUNT_; r++)
        for (int c = 0; c <= N_CODES; c++) {
            if (!cp.http[r][c]) continue;
            char code[16];
            if (c < N_CODES) snprintf(code, sizeof code, "%d", k_codes[c]);
            else snprintf(code, sizeof code, "other");
            sb_printf(&b, "inferscale_http_requests_total{route=\"%s\",code=\"%s\"} %llu\n",
                      k_routes[r], code, (unsigned long long)cp.http[r][c]);
        }
    int64_t s = now_sec();
    uint64_t tok = 0;
    for (int i = 0; i < RATE_WINDOW; i++)
        if (cp.rate_sec[i] > s - RATE_WINDOW && cp.rate_sec[i] <= s) tok += cp.rate_tok[i];
    gauge(&b, "inferscale_tokens_per_second",
          "Completion tokens of requests finished in the last 10 s, per second.", "gauge",
          (double)tok / RATE_WINDOW);

    if (live) {
        gauge(&b, "inferscale_requests_in_flight", "HTTP API requests being served.", "gauge",
              live->in_flight);
        gauge(&b, "inferscale_http_connections_timed_out_total",
              "Connections closed for slow headers, a slow body or idleness.", "counter",
              (double)live->conns_timed_out);
        gauge(&b, "inferscale_http_connections_evicted_total",
              "Idle connections closed to admit a new one at the connection limit.", "counter",
              (double)live->conns_evicted);
        if (live->n_facts >= 0)
            gauge(&b, "inferscale_memory_facts", "Facts in the memory store (all tenants).",
                  "gauge", (double)live->n_facts);
        const sched_stats *ss = live->sched_stats;
        if (ss) {
            gauge(&b, "inferscale_queue_depth", "Requests waiting for a slot in the batch.",
                  "gauge", ss->queued);
            gauge(&b, "inferscale_running_requests", "Requests in the running batch.", "gauge",
                  ss->running);
            gauge(&b, "inferscale_batch_tokens", "Tokens in the latest engine step (batch size).",
                  "gauge", (double)ss->last_batch_tokens);
            gauge(&b, "inferscale_encode_queue_depth", "Fact KV encodings waiting.", "gauge",
                  ss->encode_queued);
            gauge(&b, "inferscale_encodes_running", "Fact KV encodings taken, not yet done.",
                  "gauge", ss->encode_running);
            gauge(&b, "inferscale_kv_blocks_used", "KV cache blocks in use.", "gauge",
                  ss->kv_blocks_used);
            gauge(&b, "inferscale_kv_blocks_free", "KV cache blocks free.", "gauge",
                  ss->kv_blocks_free);
            gauge(&b, "inferscale_kv_blocks_reserved",
                  "Free KV cache blocks promised to running requests.", "gauge",
                  ss->kv_blocks_reserved);
            gauge(&b, "inferscale_engine_steps_total", "Engine steps run.", "counter",
                  (double)ss->steps);
            gauge(&b, "inferscale_tokens_prefilled_total",
                  "Prompt tokens through the forward pass.", "counter",
                  (double)ss->tokens_prefilled);
            gauge(&b, "inferscale_tokens_generated_total", "Tokens generated.", "counter",
                  (double)ss->tokens_generated);
            gauge(&b, "inferscale_inject_calls_total",
                  "Fact injections: one a step that admitted kv requests.", "counter",
                  (double)ss->inject_calls);
            gauge(&b, "inferscale_inject_requests_total", "Requests whose facts those injected.",
                  "counter", (double)ss->inject_requests);
            gauge(&b, "inferscale_facts_encoded_total",
                  "Facts whose KV was encoded in the background.", "counter",
                  (double)ss->facts_encoded);
            gauge(&b, "inferscale_encode_failures_total", "Background KV encodings that failed.",
                  "counter", (double)ss->encode_failures);
            sb_printf(&b,
                      "# HELP inferscale_scheduler_requests_total Requests the scheduler ended: "
                      "done (finished or cancelled) or failed.\n"
                      "# TYPE inferscale_scheduler_requests_total counter\n"
                      "inferscale_scheduler_requests_total{result=\"done\"} %lld\n"
                      "inferscale_scheduler_requests_total{result=\"failed\"} %lld\n",
                      (long long)ss->requests_done, (long long)ss->requests_failed);
            sb_printf(&b,
                      "# HELP inferscale_fact_kv_total Facts of kv-mode requests: injected from "
                      "a ready KV record (hit) or prefilled as text (miss).\n"
                      "# TYPE inferscale_fact_kv_total counter\n"
                      "inferscale_fact_kv_total{result=\"hit\"} %lld\n"
                      "inferscale_fact_kv_total{result=\"miss\"} %lld\n",
                      (long long)ss->facts_kv_hits, (long long)ss->facts_kv_misses);
            sb_printf(&b,
                      "# HELP inferscale_facts_served_total Facts of kv-mode requests by where "
                      "submit found them: resident on the GPU, in the pinned host tier, read "
                      "from disk, encoded for the request (no KV on this node), or prefilled "
                      "as text.\n"
                      "# TYPE inferscale_facts_served_total counter\n"
                      "inferscale_facts_served_total{tier=\"gpu\"} %lld\n"
                      "inferscale_facts_served_total{tier=\"host\"} %lld\n"
                      "inferscale_facts_served_total{tier=\"disk\"} %lld\n"
                      "inferscale_facts_served_total{tier=\"encoded\"} %lld\n"
                      "inferscale_facts_served_total{tier=\"text\"} %lld\n",
                      (long long)ss->facts_gpu, (long long)ss->facts_host,
                      (long long)ss->facts_disk, (long long)ss->facts_encoded_served,
                      (long long)ss->facts_text);
        }
        const record_store_stats *rs = live->store_stats;
        if (rs) {
            sb_printf(&b,
                      "# HELP inferscale_fact_kv_tier_total KV record lookups by storage tier: "
                      "the host-memory cache served it (hit) or it was read from disk (miss).\n"
                      "# TYPE inferscale_fact_kv_tier_total counter\n"
                      "inferscale_fact_kv_tier_total{tier=\"host\",result=\"hit\"} %llu\n"
                      "inferscale_fact_kv_tier_total{tier=\"host\",result=\"miss\"} %llu\n",
                      (unsigned long long)rs->hits, (unsigned long long)rs->misses);
            gauge(&b, "inferscale_fact_kv_cache_bytes", "Bytes of KV records in the host cache.",
                  "gauge", (double)rs->bytes_cached);
            gauge(&b, "inferscale_fact_kv_corrupt_total",
                  "KV record files found corrupt when read, moved to the record directory's "
                  "corrupt/ (their facts are encoded again).",
                  "counter", (double)rs->n_corrupt);
            if (rs->n_disk || rs->disk_evictions) {
                gauge(&b, "inferscale_fact_kv_disk_bytes",
                      "Bytes of KV record files on this node's disk (serve --record-cache-gb).",
                      "gauge", (double)rs->disk_bytes);
                gauge(&b, "inferscale_fact_kv_disk_evictions_total",
                      "KV record files deleted to stay within serve --record-cache-gb.", "counter",
                      (double)rs->disk_evictions);
            }
        }
    }
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    if (len) *len = b.len;
    return b.p;
}

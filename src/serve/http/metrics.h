/*
 * metrics: what the server counts, rendered in Prometheus' text format
 * (version 0.0.4) for GET /metrics.
 *
 * Kept here (all thread-safe, one mutex; observations are a few adds):
 *   inferscale_ttft_seconds{mode}              histogram, chat requests
 *   inferscale_request_duration_seconds{mode}  histogram, chat end to end
 *   inferscale_chat_requests_total{mode,result}
 *   inferscale_prompt_tokens_total{mode}, inferscale_completion_tokens_total{mode},
 *   inferscale_memory_tokens_total{mode,how="injected"|"prefilled"}
 *   inferscale_http_requests_total{route,code}
 *   inferscale_tokens_per_second               completion tokens of requests
 *                                              finished in the last 10 s / 10
 * Read at scrape time from the scheduler and the record store (passed in):
 *   queue depth, running requests, last batch size, KV blocks used and free,
 *   encode queue, steps, tokens prefilled and generated, fact-KV hits and
 *   misses (injected from a ready record vs prefilled as text), record
 *   store cache hits and misses (tier "host": the in-memory cache; a miss
 *   goes to tier "disk"), requests in flight, connections closed by the
 *   connection guard (timed out, evicted).
 */
#ifndef IS_SERVE_HTTP_METRICS_H
#define IS_SERVE_HTTP_METRICS_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct metrics metrics;

/* Routes counted by inferscale_http_requests_total (a fixed set keeps the
 * label's cardinality bounded whatever clients send). */
typedef enum metrics_route {
    METRICS_ROUTE_CHAT = 0,
    METRICS_ROUTE_MODELS,
    METRICS_ROUTE_MEMORIES,
    METRICS_ROUTE_SEARCH,
    METRICS_ROUTE_HEALTH,
    METRICS_ROUTE_METRICS,
    METRICS_ROUTE_OTHER,
    METRICS_ROUTE_COUNT_,
} metrics_route;

const char *metrics_route_name(metrics_route r);

/* Chat modes, as labels: 0 kv, 1 prompt, 2 off (ask_mode's values). */
#define METRICS_N_MODES 3

is_status metrics_create(metrics **out);
void metrics_free(metrics *m);

typedef struct metrics_chat {
    int mode;      /* 0..2 */
    bool ok;       /* finished normally (not an error or a cancel) */
    double ttft_s; /* < 0: no first token */
    double total_s;
    int32_t prompt_tokens;
    int32_t completion_tokens;
    int32_t injected_tokens;
    int32_t memory_prefilled_tokens;
} metrics_chat;

void metrics_observe_chat(metrics *m, const metrics_chat *c);
void metrics_observe_http(metrics *m, metrics_route r, int status);

/* Gauges read at scrape time; any pointer may be NULL (not exported). */
typedef struct metrics_live {
    const void *sched_stats; /* const sched_stats * */
    const void *store_stats; /* const record_store_stats * */
    int32_t in_flight;
    int64_t n_facts;         /* facts in the store, < 0: unknown (or not shown) */
    int64_t conns_timed_out; /* connections closed for slow headers, body or idleness */
    int64_t conns_evicted;   /* idle connections closed to admit a new one at the limit */
} metrics_live;

/* The whole exposition, malloc'd and NUL-terminated; NULL when out of
 * memory. */
char *metrics_render(metrics *m, const metrics_live *live, size_t *len);

#endif

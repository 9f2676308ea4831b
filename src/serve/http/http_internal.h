/*
 * http_internal: what server.c, chat.c and memories.c share. Not a public
 * header.
 */
#ifndef IS_SERVE_HTTP_INTERNAL_H
#define IS_SERVE_HTTP_INTERNAL_H

#include "serve/http/guard.h"
#include "serve/http/metrics.h"
#include "serve/http/server.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>

struct http_server {
    http_config cfg; /* strings below are owned copies */
    char *host, *tenant0, *model_id;
    struct MHD_Daemon *d;
    int port;
    metrics *met;
    struct http_guard *guard; /* connections, timeouts, in-flight slots (guard.h) */
    atomic_int in_flight;
    atomic_bool stopping;
    atomic_ullong next_id;
    pthread_mutex_t log_mu;
    FILE *log;
    int64_t created; /* unix seconds, for /v1/models */
};

struct chat_job;

/* One HTTP request (MHD's per-request context). */
typedef struct http_req {
    http_server *srv;
    struct MHD_Connection *conn;
    uint64_t id;
    double t0; /* monotonic ms */
    char method[16];
    char path[256];
    char *body;
    size_t len, cap;
    bool responded; /* a response is queued */
    /* An error found before the body was read (key, limits): answered
     * once the body has been read and dropped, because a server that
     * answers and closes while the client still sends makes the client's
     * TCP stack see a reset instead of the answer. */
    int early_status;
    char early_code[32];
    char early_msg[160];
    size_t dropped;             /* body bytes read and dropped */
    bool counted;               /* holds an in-flight slot */
    bool started;               /* the access handler has seen the headers */
    bool linger;                /* answered before its body: linger once sent (guard.h) */
    struct http_guard_conn *gc; /* the connection's guard record (may be NULL) */
    parse_error url_err;        /* the raw URL's check (status 0: fine) */
    bool api;                   /* a route that needs a key */
    char tenant[AUTH_TENANT_MAX + 1];
    metrics_route route;
    int status;
    size_t bytes_out; /* body bytes of a buffered response */
    char err_code[64];
    /* chat, for the log */
    int mode; /* -1 if not a chat */
    int32_t n_facts;
    char user[80];
    bool has_usage;
    int32_t prompt_tokens, completion_tokens, injected_tokens;
    double ttft_ms;
    char finish[16];
    struct chat_job *job; /* a streaming chat: its job (one reference) */
} http_req;

double http_now_ms(void);

/* Responses. All take ownership of what they are given and return MHD's
 * result of queueing. */
enum MHD_Result http_send_json(http_req *r, int status, cJSON *body);
enum MHD_Result http_send_error(http_req *r, int status, const char *param, const char *code,
                                const char *fmt, ...) __attribute__((format(printf, 5, 6)));
enum MHD_Result http_send_parse_error(http_req *r, const parse_error *e);
/* Maps a status of the layers below (with is_error_last()'s message). */
enum MHD_Result http_send_status(http_req *r, is_status st, const char *what);

/* Gives back r's in-flight slot, if it holds one (then no more): when its
 * answer is queued, when its stream has ended, or at the latest when MHD
 * reports the request completed. Connection thread only. */
void http_req_release_slot(http_req *r);

/* True if the peer of the connection has closed it (or it broke). */
bool http_conn_gone(struct MHD_Connection *c);

/* The query string's arguments (URL-decoded; owned by MHD, valid during
 * the request), at most max. */
int32_t http_query_args(struct MHD_Connection *c, const char **keys, const char **values,
                        int32_t max);
/* The same with each key's and value's length (a decoded %00 is inside
 * them); klens, vlens may be NULL. */
int32_t http_query_args_n(struct MHD_Connection *c, const char **keys, size_t *klens,
                          const char **values, size_t *vlens, int32_t max);

/* ISO 8601 UTC ("2024-05-01T12:00:00.123Z") of unix ms, into out[32]. */
void http_iso_time(int64_t unix_ms, char out[32]);

/* Handlers (the request body is complete; the tenant is set). */
enum MHD_Result http_chat(http_req *r);
enum MHD_Result http_memories(http_req *r, const char *rest);

/* A fact's kv_ready (memories.c), for the memory routes and chat: whether
 * this node can inject its KV without encoding it, i.e. the row names a
 * record and the GPU or this node's record store holds it
 * (sched_fact_kv_here; without a scheduler, the record store alone). */
bool http_fact_kv_ready(http_server *srv, const mem_fact *f);

/* ---- scheduler jobs (chat.c), shared with infer=true extraction ---------------- */

typedef struct chat_job chat_job;

/* Submits r to the scheduler. stop_on_object: cancel as soon as the
 * reply's first JSON object closes (extraction). On failure no job is
 * made and the status is returned (is_error_last() says why). */
is_status chat_job_submit(http_server *srv, const sched_request *req, bool stop_on_object,
                          chat_job **out);
/* Blocks until the final event, cancelling the request if the client of
 * `conn` (may be NULL) hangs up or the server stops. */
void chat_job_wait(chat_job *j, struct MHD_Connection *conn);
/* After wait: the text (not NUL-terminated, owned by j), the outcome. */
const char *chat_job_text(chat_job *j, size_t *len);
bool chat_job_failed(chat_job *j, is_status *st, const char **msg);
/* Releases the scheduler handle (after the final event) and the job. */
void chat_job_free(chat_job *j);

/* The completion notification of a streaming request: cancels its job if
 * the response ended with an error, and reads its usage for the log. */
void chat_job_on_completed(http_req *r, bool error);

#endif

#include "serve/http/http_internal.h"
#include "serve/http/mem0.h"

#include "core/status.h"
#include "core/utf8.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <limits.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

http_limits http_default_limits(void) {
    return (http_limits){.max_body_bytes = 1u << 20,
                         .max_prompt_tokens = 4096,
                         .max_in_flight = 64,
                         .max_in_flight_tenant = -1,
                         .max_connections = 512,
                         .connection_timeout_s = 30,
                         .header_timeout_s = 10,
                         .body_timeout_s = 60,
                         .max_fact_bytes = 4096,
                         .extract_max_tokens = 512,
                         .parse = parse_default_limits()};
}

http_config http_default_config(void) {
    return (http_config){.host = "127.0.0.1",
                         .port = 8080,
                         .limits = http_default_limits(),
                         .no_auth_tenant = "default",
                         .model_id = "inferscale"};
}

double http_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void http_iso_time(int64_t ms, char out[32]) {
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(out, 32, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 32 - n, ".%03dZ", (int)(ms % 1000));
}

/* ---- responses ----------------------------------------------------------------------- */

void http_req_release_slot(http_req *r) {
    if (!r->counted) return;
    r->counted = false;
    http_guard_release(r->srv->guard, r->srv->cfg.no_auth ? "" : r->tenant);
    atomic_fetch_sub(&r->srv->in_flight, 1);
}

static enum MHD_Result queue_buffer(http_req *r, int status, char *buf, size_t len,
                                    const char *content_type) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (status == 405) {
        const char *allow = r->route == METRICS_ROUTE_CHAT ? "POST" : "GET";
        if (r->route == METRICS_ROUTE_MEMORIES) allow = "GET, POST, PUT, DELETE";
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    }
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    /* A request refused before its body was read ends its connection: a
     * client refused once gets no kept-alive connection to hold. */
    if (r->early_status) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    /* Overload and shutdown are passing states: say when to come back. */
    if (status == 429 || status == 503)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    enum MHD_Result ok = MHD_queue_response(r->conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    /* The answer is complete: its slot goes now, not at MHD's completion
     * notification, which can come after the client has read the answer
     * and sent its next request on another connection. */
    http_req_release_slot(r);
    r->responded = true;
    r->status = status;
    r->bytes_out = len;
    return ok;
}

enum MHD_Result http_send_json(http_req *r, int status, cJSON *body) {
    char *txt = body ? cJSON_PrintUnformatted(body) : NULL;
    cJSON_Delete(body);
    if (!txt) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
            "\"param\":null,\"code\":\"out_of_memory\"}}";
        txt = strdup(oom);
        status = 500;
        if (!txt) return MHD_NO;
    }
    size_t n = strlen(txt);
    /* A trailing newline: friendlier for curl in a terminal. */
    char *nl = realloc(txt, n + 2);
    if (nl) {
        txt = nl;
        txt[n++] = '\n';
        txt[n] = '\0';
    }
    return queue_buffer(r, status, txt, n, "application/json");
}

static const char *error_type(int status) {
    if (status == 429) return "rate_limit_error";
    if (status >= 500) return "server_error";
    return "invalid_request_error";
}

enum MHD_Result http_send_error(http_req *r, int status, const char *param, const char *code,
                                const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* Messages may quote bytes from below (file names, ...): keep the JSON valid. */
    char *clean = utf8_sanitized_copy(msg, strlen(msg));
    cJSON *root = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message", clean ? clean : "error");
    cJSON_AddStringToObject(e, "type", error_type(status));
    if (param && *param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code && *code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    free(clean);
    snprintf(r->err_code, sizeof r->err_code, "%s", code && *code ? code : "error");
    return http_send_json(r, status, root);
}

enum MHD_Result http_send_parse_error(http_req *r, const parse_error *e) {
    return http_send_error(r, e->status ? e->status : 400, e->param, e->code, "%s", e->message);
}

enum MHD_Result http_send_status(http_req *r, is_status st, const char *what) {
    const char *msg = is_error_last();
    switch (st) {
    case IS_ERR_INVALID_ARG:
        return http_send_error(r, 400, NULL, "invalid_value", "%s: %s", what, msg);
    case IS_ERR_NOT_FOUND: return http_send_error(r, 404, NULL, "not_found", "%s: %s", what, msg);
    case IS_ERR_CONTEXT_FULL:
        return http_send_error(r, 400, "messages", "context_length_exceeded", "%s: %s", what, msg);
    case IS_ERR_BUSY: return http_send_error(r, 503, NULL, "overloaded", "%s: %s", what, msg);
    case IS_ERR_CANCELLED:
        return http_send_error(r, 503, NULL,
                               atomic_load(&r->srv->stopping) ? "shutting_down" : "cancelled",
                               "%s: %s", what, msg);
    default: return http_send_error(r, 500, NULL, "internal_error", "%s: %s", what, msg);
    }
}

/* How long a stop waits for in-flight requests to be answered. */
#define STOP_DRAIN_MS 5000
/* ... and how long without one of them answered before it stops waiting. */
#define STOP_STALL_MS 1000

bool http_conn_gone(struct MHD_Connection *c) {
    if (!c) return false;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    /* POLLRDHUP: the client closed, or shut down its sending side. The two
     * look the same until the server writes, and a non-streamed answer
     * writes only at its end, so waiting for a failed write would keep an
     * abandoned request decoding to max_tokens. A client that half-closes
     * and still reads is rare (nc -N); it is told its request was
     * cancelled (503), never given a cut answer as a whole one. */
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

typedef struct args_acc {
    const char **keys, **values;
    size_t *klens, *vlens;
    int32_t n, max;
} args_acc;

static enum MHD_Result collect_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                   size_t key_size, const char *value, size_t value_size) {
    args_acc *a = cls;
    (void)kind;
    if (a->n < a->max) {
        a->keys[a->n] = key;
        a->values[a->n] = value;
        if (a->klens) a->klens[a->n] = key_size;
        if (a->vlens) a->vlens[a->n] = value ? value_size : 0;
    }
    a->n++;
    return MHD_YES;
}

int32_t http_query_args(struct MHD_Connection *c, const char **keys, const char **values,
                        int32_t max) {
    return http_query_args_n(c, keys, NULL, values, NULL, max);
}

int32_t http_query_args_n(struct MHD_Connection *c, const char **keys, size_t *klens,
                          const char **values, size_t *vlens, int32_t max) {
    args_acc a = {keys, values, klens, vlens, 0, max};
    MHD_get_connection_values_n(c, MHD_GET_ARGUMENT_KIND, collect_arg, &a);
    return a.n;
}

/* ---- routes -------------------------------------------------------------------------- */

/* 503 while stopping, and while the backend has failed and not recovered
 * (sched_get_health): a load balancer then sends no one here. */
static enum MHD_Result send_health(http_req *r) {
    http_server *s = r->srv;
    cJSON *o = cJSON_CreateObject();
    sched_health hh = {.healthy = true};
    if (s->cfg.sched) sched_get_health(s->cfg.sched, &hh);
    bool stopping = atomic_load(&s->stopping);
    cJSON_AddStringToObject(o, "status", stopping ? "stopping" : !hh.healthy ? "unhealthy" : "ok");
    if (!hh.healthy) cJSON_AddStringToObject(o, "error", hh.last_error);
    cJSON_AddStringToObject(o, "model", s->model_id);
    cJSON_AddBoolToObject(o, "chat", s->cfg.sched != NULL);
    cJSON_AddBoolToObject(o, "memory", s->cfg.mem != NULL);
    if (s->cfg.sched) {
        sched_stats ss;
        sched_get_stats(s->cfg.sched, &ss);
        cJSON *j = cJSON_AddObjectToObject(o, "scheduler");
        cJSON_AddNumberToObject(j, "queued", ss.queued);
        cJSON_AddNumberToObject(j, "running", ss.running);
        cJSON_AddNumberToObject(j, "encode_queued", ss.encode_queued);
        cJSON_AddNumberToObject(j, "encode_running", ss.encode_running);
        cJSON_AddNumberToObject(j, "kv_blocks_used", ss.kv_blocks_used);
        cJSON_AddNumberToObject(j, "kv_blocks_free", ss.kv_blocks_free);
        cJSON_AddNumberToObject(j, "kv_blocks_reserved", ss.kv_blocks_reserved);
        cJSON *b = cJSON_AddObjectToObject(o, "backend");
        cJSON_AddBoolToObject(b, "healthy", hh.healthy);
        cJSON_AddNumberToObject(b, "failures", (double)hh.backend_failures);
        cJSON_AddNumberToObject(b, "recoveries", (double)hh.recoveries);
        if (hh.last_error[0]) cJSON_AddStringToObject(b, "last_error", hh.last_error);
        else cJSON_AddNullToObject(b, "last_error");
    }
    if (s->cfg.mem && s->cfg.public_stats) /* a count over every tenant */
        cJSON_AddNumberToObject(o, "facts", (double)mem_store_count(memory_fact_store(s->cfg.mem)));
    cJSON_AddNumberToObject(o, "requests_in_flight", atomic_load(&s->in_flight));
    return http_send_json(r, stopping || !hh.healthy ? 503 : 200, o);
}

static enum MHD_Result send_metrics(http_req *r) {
    http_server *s = r->srv;
    sched_stats ss;
    record_store_stats rs;
    metrics_live live = {.in_flight = atomic_load(&s->in_flight), .n_facts = -1};
    http_guard_counts(s->guard, &live.conns_timed_out, &live.conns_evicted);
    if (s->cfg.sched) {
        sched_get_stats(s->cfg.sched, &ss);
        live.sched_stats = &ss;
    }
    if (s->cfg.mem) {
        rs = record_store_get_stats(memory_record_store(s->cfg.mem));
        live.store_stats = &rs;
        if (s->cfg.public_stats) live.n_facts = mem_store_count(memory_fact_store(s->cfg.mem));
    }
    size_t len = 0;
    char *txt = metrics_render(s->met, &live, &len);
    if (!txt) return http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
    return queue_buffer(r, 200, txt, len, "text/plain; version=0.0.4; charset=utf-8");
}

static cJSON *model_object(http_server *s) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->model_id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->created);
    cJSON_AddStringToObject(m, "owned_by", "inferscale");
    return m;
}

static enum MHD_Result send_models(http_req *r, const char *id) {
    http_server *s = r->srv;
    if (id && *id) {
        if (strcmp(id, s->model_id) != 0)
            return http_send_error(r, 404, "model", "model_not_found",
                                   "The model '%.200s' does not exist", id);
        return http_send_json(r, 200, model_object(s));
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    if (s->cfg.sched) cJSON_AddItemToArray(data, model_object(s));
    return http_send_json(r, 200, o);
}

/* Classifies the path at the first call; the rest of a memories path goes
 * to *rest, a model id to *rest for models. */
static metrics_route classify(const char *path, const char **rest) {
    *rest = NULL;
    if (strcmp(path, "/health") == 0 || strcmp(path, "/health/") == 0) return METRICS_ROUTE_HEALTH;
    if (strcmp(path, "/metrics") == 0 || strcmp(path, "/metrics/") == 0)
        return METRICS_ROUTE_METRICS;
    if (strcmp(path, "/v1/chat/completions") == 0 || strcmp(path, "/v1/chat/completions/") == 0)
        return METRICS_ROUTE_CHAT;
    if (strncmp(path, "/v1/models", 10) == 0 && (path[10] == '\0' || path[10] == '/')) {
        *rest = path[10] ? path + 11 : "";
        return METRICS_ROUTE_MODELS;
    }
    if (http_mem0_route(path)) return METRICS_ROUTE_MEMORIES; /* *rest NULL: mem0.c's */
    if (strncmp(path, "/v1/memories", 12) == 0 && (path[12] == '\0' || path[12] == '/')) {
        *rest = path + 12;
        if (strcmp(*rest, "/search") == 0 || strcmp(*rest, "/search/") == 0)
            return METRICS_ROUTE_SEARCH;
        return METRICS_ROUTE_MEMORIES;
    }
    return METRICS_ROUTE_OTHER;
}

static enum MHD_Result dispatch(http_req *r) {
    http_server *s = r->srv;
    const char *rest;
    metrics_route rt = classify(r->path, &rest);
    const char *m = r->method;
    bool get = strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0, post = strcmp(m, "POST") == 0;
    switch (rt) {
    case METRICS_ROUTE_HEALTH:
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        return send_health(r);
    case METRICS_ROUTE_METRICS:
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        return send_metrics(r);
    case METRICS_ROUTE_MODELS:
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        if (strchr(rest, '/') && rest[strlen(rest) - 1] != '/')
            return http_send_error(r, 404, NULL, "not_found", "no route %.200s", r->path);
        {
            char id[256];
            snprintf(id, sizeof id, "%s", rest);
            size_t l = strlen(id);
            if (l && id[l - 1] == '/') id[l - 1] = '\0';
            return send_models(r, id);
        }
    case METRICS_ROUTE_CHAT:
        if (!post) return http_send_error(r, 405, NULL, "method_not_allowed", "use POST");
        return http_chat(r);
    case METRICS_ROUTE_SEARCH:
        if (!post) return http_send_error(r, 405, NULL, "method_not_allowed", "use POST");
        return http_memories(r, rest);
    case METRICS_ROUTE_MEMORIES: return http_memories(r, rest);
    default:
        (void)s;
        return http_send_error(r, 404, NULL, "not_found", "no route %.200s %.200s", r->method,
                               r->path);
    }
}

/* ---- MHD callbacks --------------------------------------------------------------------- */

/* Bodies past the limit are still read (and dropped) up to this much, so
 * the client gets its 413 rather than a reset connection; beyond it the
 * connection is answered and closed at once. */
#define DROP_MAX ((size_t)64 << 20)

static void set_early(http_req *r, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void set_early(http_req *r, int status, const char *code, const char *fmt, ...) {
    if (r->early_status) return; /* the first reason wins */
    r->early_status = status;
    snprintf(r->early_code, sizeof r->early_code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->early_msg, sizeof r->early_msg, fmt, ap);
    va_end(ap);
}

static enum MHD_Result send_early(http_req *r) {
    return http_send_error(r, r->early_status, NULL, r->early_code, "%s", r->early_msg);
}

/* Header bytes (names and values) a request may carry; 431 above. The
 * daemon's memory limit (HTTP_MHD_MEMORY) is set well above it so that
 * such requests reach this check instead of MHD's own error page. */
#define HTTP_MAX_HEADER_BYTES ((size_t)32 << 10)
#define HTTP_MAX_QUERY_ARGS   64
#define HTTP_MHD_MEMORY       ((size_t)512 << 10)

static http_req *req_new(http_server *s, struct MHD_Connection *conn) {
    http_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->srv = s;
    r->conn = conn;
    r->id = atomic_fetch_add(&s->next_id, 1) + 1;
    r->t0 = http_now_ms();
    r->mode = -1;
    return r;
}

/* MHD's URI log callback: called with the raw request target before MHD
 * decodes it, so a %00 or a control character is seen here while the
 * decoded path MHD passes on would already be cut at the NUL. Its result
 * becomes the request's context. */
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn) {
    http_req *r = req_new(cls, conn);
    if (r && uri) parse_url_check(uri, strlen(uri), &r->url_err);
    return r;
}

static enum MHD_Result header_bytes(void *cls, enum MHD_ValueKind kind, const char *key,
                                    size_t key_size, const char *value, size_t value_size) {
    (void)kind;
    (void)key;
    (void)value;
    *(size_t *)cls += key_size + value_size + 4;
    return MHD_YES;
}

/* The checks made once the headers are in and before the body is read, in
 * this order: URL, header size, query size, key, body size, shutdown,
 * in-flight slot. Every refusal but 413 is answered at once (MHD then
 * closes a connection whose body was not read); a 413's body is read and
 * dropped first, since clients sending a large body see a reset instead
 * of an answer otherwise (it holds no slot meanwhile, and the body timeout
 * bounds it). Returns true when the request may go on. */
static bool admit(http_req *r, unsigned long long *announced) {
    http_server *s = r->srv;
    struct MHD_Connection *conn = r->conn;
    size_t max_body = s->cfg.limits.max_body_bytes;
    if (r->url_err.status) {
        set_early(r, r->url_err.status, r->url_err.code, "%s", r->url_err.message);
        return false;
    }
    size_t hb = 0;
    MHD_get_connection_values_n(conn, MHD_HEADER_KIND, header_bytes, &hb);
    if (hb > HTTP_MAX_HEADER_BYTES) {
        set_early(r, 431, "headers_too_large", "the request headers are larger than %zu bytes",
                  HTTP_MAX_HEADER_BYTES);
        return false;
    }
    if (MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, NULL, NULL) > HTTP_MAX_QUERY_ARGS) {
        set_early(r, 400, "invalid_value", "more than %d query parameters", HTTP_MAX_QUERY_ARGS);
        return false;
    }
    if (r->api) {
        if (s->cfg.no_auth) {
            snprintf(r->tenant, sizeof r->tenant, "%s", s->tenant0);
        } else {
            size_t hl = 0;
            const char *h = NULL;
            if (MHD_lookup_connection_value_n(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION,
                                              strlen(MHD_HTTP_HEADER_AUTHORIZATION), &h,
                                              &hl) != MHD_YES)
                h = NULL;
            const char *t = h && strlen(h) == hl ? auth_tenant(s->cfg.keys, h) : NULL;
            if (!t) {
                set_early(r, 401, "invalid_api_key", "%s",
                          h ? "Incorrect API key provided"
                            : "Missing API key: send 'Authorization: Bearer KEY'");
                return false;
            }
            snprintf(r->tenant, sizeof r->tenant, "%s", t);
        }
    }
    const char *cl =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        *announced = strtoull(cl, &end, 10);
        if (errno || end == cl) *announced = ULLONG_MAX;
        if (*announced > max_body) {
            set_early(r, 413, "request_too_large", "the request body is larger than %zu bytes",
                      max_body);
            return false;
        }
    }
    if (!r->api) return true;
    if (atomic_load(&s->stopping)) {
        set_early(r, 503, "shutting_down", "the server is shutting down");
        return false;
    }
    http_guard_slot gs = http_guard_acquire(s->guard, s->cfg.no_auth ? "" : r->tenant);
    if (gs != HTTP_GUARD_SLOT_OK) {
        if (gs == HTTP_GUARD_SLOT_TENANT)
            set_early(r, 429, "too_many_requests",
                      "more than %d requests of this key's tenant in flight; retry later",
                      s->cfg.limits.max_in_flight_tenant);
        else
            set_early(r, 429, "too_many_requests", "more than %d requests in flight; retry later",
                      s->cfg.limits.max_in_flight);
        return false;
    }
    r->counted = true;
    atomic_fetch_add(&s->in_flight, 1);
    return true;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url,
                                 const char *method, const char *version, const char *upload,
                                 size_t *upload_size, void **con_cls) {
    http_server *s = cls;
    http_req *r = *con_cls;
    size_t max_body = s->cfg.limits.max_body_bytes;
    (void)version;
    if (!r) {
        if (!(r = req_new(s, conn))) return MHD_NO;
        *con_cls = r;
    }
    if (!r->started) {
        r->started = true;
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        r->gc = ci ? ci->socket_context : NULL;
        http_guard_set_state(s->guard, r->gc, HTTP_GUARD_BODY);
        snprintf(r->method, sizeof r->method, "%s", method);
        snprintf(r->path, sizeof r->path, "%s", url);
        const char *rest;
        r->route = classify(url, &rest);
        r->api = r->route != METRICS_ROUTE_HEALTH && r->route != METRICS_ROUTE_METRICS &&
                 r->route != METRICS_ROUTE_OTHER;
        unsigned long long announced = 0;
        if (!admit(r, &announced)) {
            const char *ex =
                MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
            /* A 413 is answered at once too when the client waits for a
             * go-ahead before sending its body. */
            if (r->early_status != 413 || announced > DROP_MAX ||
                (ex && strcasecmp(ex, "100-continue") == 0)) {
                /* MHD drops the body of a POST or PUT answered before it;
                 * another method's body is still read (and dropped here). */
                bool dropped = strcmp(method, "POST") == 0 || strcmp(method, "PUT") == 0;
                http_guard_set_state(s->guard, r->gc, dropped ? HTTP_GUARD_BUSY : HTTP_GUARD_DRAIN);
                r->linger = dropped;
                return send_early(r);
            }
        }
        if (!r->counted) http_guard_set_state(s->guard, r->gc, HTTP_GUARD_DRAIN);
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->responded) return MHD_YES;
        if (r->early_status) {
            r->dropped += n;
            return r->dropped > DROP_MAX ? send_early(r) : MHD_YES;
        }
        if (r->len + n > max_body) {
            r->dropped = r->len + n;
            free(r->body);
            r->body = NULL;
            r->len = r->cap = 0;
            set_early(r, 413, "request_too_large", "the request body is larger than %zu bytes",
                      max_body);
            return MHD_YES;
        }
        if (r->len + n + 1 > r->cap) {
            size_t nc = r->cap ? r->cap : 4096;
            while (nc < r->len + n + 1) nc *= 2;
            char *nb = realloc(r->body, nc);
            if (!nb) {
                set_early(r, 500, "out_of_memory", "out of memory");
                r->dropped = r->len + n;
                return MHD_YES;
            }
            r->body = nb;
            r->cap = nc;
        }
        memcpy(r->body + r->len, upload, n);
        r->len += n;
        r->body[r->len] = '\0';
        return MHD_YES;
    }
    /* The body is in: from here on the server writes to the connection. */
    http_guard_set_state(s->guard, r->gc, HTTP_GUARD_BUSY);
    if (r->responded) return MHD_YES;
    if (r->early_status) return send_early(r);
    return dispatch(r);
}

static void log_request(http_server *s, http_req *r, enum MHD_RequestTerminationCode toe) {
    if (s->cfg.quiet) return;
    cJSON *o = cJSON_CreateObject();
    char ts[32];
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    http_iso_time((int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000, ts);
    cJSON_AddStringToObject(o, "ts", ts);
    cJSON_AddNumberToObject(o, "id", (double)r->id);
    cJSON_AddStringToObject(o, "method", r->method);
    char *p = utf8_sanitized_copy(r->path, strlen(r->path));
    cJSON_AddStringToObject(o, "path", p ? p : "");
    free(p);
    cJSON_AddNumberToObject(o, "status", r->status);
    if (r->tenant[0]) cJSON_AddStringToObject(o, "tenant", r->tenant);
    cJSON_AddNumberToObject(o, "ms", (double)(int64_t)((http_now_ms() - r->t0) * 1000) / 1000);
    cJSON_AddNumberToObject(o, "bytes_in", (double)(r->len + r->dropped));
    if (r->bytes_out) cJSON_AddNumberToObject(o, "bytes_out", (double)r->bytes_out);
    if (r->err_code[0]) cJSON_AddStringToObject(o, "error", r->err_code);
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK)
        cJSON_AddStringToObject(o, "terminated",
                                toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED   ? "timeout"
                                : toe == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN ? "shutdown"
                                : toe == MHD_REQUEST_TERMINATED_CLIENT_ABORT    ? "client_abort"
                                                                                : "error");
    if (r->mode >= 0) {
        static const char *const modes[] = {"kv", "prompt", "off"};
        cJSON_AddStringToObject(o, "mode", modes[r->mode]);
        cJSON_AddNumberToObject(o, "facts", r->n_facts);
        if (r->user[0]) {
            char *u = utf8_sanitized_copy(r->user, strlen(r->user));
            cJSON_AddStringToObject(o, "user", u ? u : "");
            free(u);
        }
        if (r->has_usage) {
            cJSON_AddNumberToObject(o, "prompt_tokens", r->prompt_tokens);
            cJSON_AddNumberToObject(o, "injected_tokens", r->injected_tokens);
            cJSON_AddNumberToObject(o, "completion_tokens", r->completion_tokens);
            cJSON_AddNumberToObject(o, "ttft_ms", (double)(int64_t)(r->ttft_ms * 1000) / 1000);
            cJSON_AddStringToObject(o, "finish", r->finish);
        }
    }
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!line) return;
    pthread_mutex_lock(&s->log_mu);
    fputs(line, s->log);
    fputc('\n', s->log);
    fflush(s->log);
    pthread_mutex_unlock(&s->log_mu);
    free(line);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    http_server *s = cls;
    http_req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    if (r->job) chat_job_on_completed(r, toe != MHD_REQUEST_TERMINATED_COMPLETED_OK);
    if (r->responded || r->status) {
        metrics_observe_http(s->met, r->route, r->status);
        log_request(s, r, toe);
    }
    http_req_release_slot(r); /* a stream cut short, or no answer queued */
    if (r->linger && toe == MHD_REQUEST_TERMINATED_COMPLETED_OK) http_guard_linger(s->guard, r->gc);
    if (r->gc) http_guard_set_state(s->guard, r->gc, HTTP_GUARD_HEAD);
    free(r->body);
    free(r);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    http_server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = ci ? http_guard_open(s->guard, ci->connect_fd) : NULL;
    } else {
        http_guard_close(s->guard, *socket_context);
        *socket_context = NULL;
    }
}

static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addr;
    (void)addrlen;
    return http_guard_accept(((http_server *)cls)->guard) ? MHD_YES : MHD_NO;
}

/* ---- start and stop ----------------------------------------------------------------------- */

static is_status bind_listen(const char *host, int port, int *fd_out, int *port_out, bool *v6) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, ps, &hints, &res);
    if (gai != 0)
        return is_error_set(IS_ERR_INVALID_ARG, "cannot resolve host '%s': %s", host,
                            gai_strerror(gai));
    int err = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (a->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof ss;
            getsockname(fd, (struct sockaddr *)&ss, &sl);
            *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                                 : ntohs(((struct sockaddr_in *)&ss)->sin_port);
            *v6 = a->ai_family == AF_INET6;
            *fd_out = fd;
            freeaddrinfo(res);
            return IS_OK;
        }
        err = errno;
        close(fd);
    }
    freeaddrinfo(res);
    return is_error_set(IS_ERR_IO, "cannot listen on %s:%d: %s", host, port, strerror(err));
}

is_status http_server_start(const http_config *c, http_server **out) {
    if (!c || !out) return is_error_set(IS_ERR_INVALID_ARG, "http_server_start: NULL argument");
    if (!c->no_auth && (!c->keys || auth_keys_count(c->keys) == 0))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "no API keys given (a keys file, or no_auth for local use)");
    if (c->port < 0 || c->port > 65535)
        return is_error_set(IS_ERR_INVALID_ARG, "port %d is out of range", c->port);
    const char *t0 = c->no_auth_tenant ? c->no_auth_tenant : "default";
    if (c->no_auth && !auth_tenant_valid(t0))
        return is_error_set(IS_ERR_INVALID_ARG, "tenant '%s' is not a valid name", t0);
    http_server *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    s->cfg = *c;
    s->host = strdup(c->host ? c->host : "127.0.0.1");
    s->tenant0 = strdup(t0);
    s->model_id = strdup(c->model_id ? c->model_id : "inferscale");
    s->log = c->log ? c->log : stderr;
    s->created = (int64_t)time(NULL);
    pthread_mutex_init(&s->log_mu, NULL);
    is_status st;
    if (!s->host || !s->tenant0 || !s->model_id) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (s->cfg.limits.max_in_flight <= 0) s->cfg.limits.max_in_flight = 64;
    if (s->cfg.limits.max_connections <= 0) s->cfg.limits.max_connections = 512;
    if (s->cfg.limits.max_body_bytes == 0) s->cfg.limits.max_body_bytes = 1u << 20;
    if (s->cfg.limits.max_in_flight_tenant < 0) /* the default: a quarter left for the others */
        s->cfg.limits.max_in_flight_tenant =
            s->cfg.limits.max_in_flight > 1 ? s->cfg.limits.max_in_flight * 3 / 4 : 1;
    if ((st = metrics_create(&s->met)) != IS_OK) goto fail;
    http_guard_params gp = {
        .max_connections = s->cfg.limits.max_connections,
        .header_timeout_s = s->cfg.limits.header_timeout_s,
        .body_timeout_s = s->cfg.limits.body_timeout_s,
        .idle_timeout_s = s->cfg.limits.connection_timeout_s,
        .max_in_flight = s->cfg.limits.max_in_flight,
        /* With no_auth every request is one tenant: the global limit is its limit. */
        .max_in_flight_tenant = c->no_auth ? 0 : s->cfg.limits.max_in_flight_tenant};
    if ((st = http_guard_create(&gp, &s->guard)) != IS_OK) goto fail;
    int fd = -1;
    bool v6 = false;
    if ((st = bind_listen(s->host, c->port, &fd, &s->port, &v6)) != IS_OK) goto fail;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (v6) flags |= MHD_USE_IPv6;
    /* The guard decides who gets in (evicting idle connections at the
     * limit); MHD's own limit sits above it, for evicted connections whose
     * threads are still closing. */
    s->d = MHD_start_daemon(
        flags, 0, on_accept, s, on_access, s, MHD_OPTION_LISTEN_SOCKET, fd,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
        s, MHD_OPTION_URI_LOG_CALLBACK, on_uri, s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        HTTP_MHD_MEMORY, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(s->cfg.limits.max_connections + HTTP_GUARD_EVICT_SLACK),
        MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)(s->cfg.limits.connection_timeout_s > 0 ? s->cfg.limits.connection_timeout_s : 0),
        MHD_OPTION_END);
    if (!s->d) {
        close(fd);
        st = is_error_set(IS_ERR_IO, "cannot start the HTTP daemon on %s:%d", s->host, s->port);
        goto fail;
    }
    *out = s;
    return IS_OK;
fail:
    http_guard_free(s->guard);
    metrics_free(s->met);
    free(s->host);
    free(s->tenant0);
    free(s->model_id);
    pthread_mutex_destroy(&s->log_mu);
    free(s);
    return st;
}

int http_server_port(const http_server *s) { return s ? s->port : 0; }

void http_server_stop(http_server *s) {
    if (!s) return;
    /* Waiting handlers see the flag within 100 ms, cancel their requests
     * and answer 503 shutting_down. MHD_stop_daemon shuts every socket
     * down at once, so give those answers a bounded moment to be written
     * first (a slot is given back when its answer is queued; the write
     * follows on the connection's thread). */
    atomic_store(&s->stopping, true);
    bool waited = false;
    /* A request that stops counting down for STOP_STALL_MS (a client that
     * stalls its body, a stream whose client does not read) is not waited
     * for: one such client must not hold every stop for the whole bound. */
    int32_t last = atomic_load(&s->in_flight), still = 0;
    for (int i = 0; i < STOP_DRAIN_MS / 10 && last > 0 && still < STOP_STALL_MS / 10; i++) {
        waited = true;
        usleep(10 * 1000);
        int32_t now = atomic_load(&s->in_flight);
        still = now < last ? 0 : still + 1;
        last = now;
    }
    if (waited) usleep(50 * 1000);
    MHD_stop_daemon(s->d);
    http_guard_free(s->guard);
    metrics_free(s->met);
    free(s->host);
    free(s->tenant0);
    free(s->model_id);
    pthread_mutex_destroy(&s->log_mu);
    free(s);
}

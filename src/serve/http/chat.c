/*
 * POST /v1/chat/completions: OpenAI's chat, with memory.
 *
 * The scheduler's event callback (engine thread) only appends text to the
 * job's buffer and records the outcome under the job's mutex; everything
 * else (JSON, SSE framing, UTF-8 boundaries) happens on the connection's
 * thread. A job outlives whichever of its two users ends first: the
 * connection thread's request and, for a stream, the MHD response whose
 * callback reads it (a reference count).
 *
 * Memory: `user` names the user (the tenant comes from the key); mode kv
 * (the default with a user) or prompt retrieves memory_search(k, filters)
 * on the last user message and hands the facts to the scheduler with
 * their KV record ids (NULL while a fact's KV is being encoded: the
 * scheduler then prefills its text). A user with no facts at all is
 * answered without memory (mode off) and the response says so:
 * "memory": {"user_known": false, "k": 0, ...}; a 404 would make every
 * first conversation of a new user fail, which is worse for clients.
 */
#include "serve/http/http_internal.h"

#include "core/status.h"
#include "core/utf8.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WAIT_SLICE_MS 100

/* Why a job was cancelled: only an extraction's closed object is a
 * complete answer; any other cancel ended it before its answer was. */
typedef enum job_cancel {
    JOB_CANCEL_NONE,
    JOB_CANCEL_OBJECT, /* the extraction's JSON object closed */
    JOB_CANCEL_GONE,   /* the client hung up, or its response failed */
    JOB_CANCEL_STOP,   /* the server stops */
} job_cancel;

struct chat_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    http_server *srv;
    sched_handle *h; /* NULL once released */
    bool cancelled;
    job_cancel cancel_why;
    /* Written by the engine thread. */
    char *text; /* whole reply so far (non-stream) or not yet sent (stream) */
    size_t len, cap;
    bool nomem;
    bool done;
    sched_event_kind end;
    is_finish_reason finish;
    sched_usage usage;
    is_status err;
    char err_msg[512];
    /* Extraction: stop once the first JSON object closes. */
    bool stop_on_object;
    int depth;
    bool in_str, esc, obj_closed;
    /* Streaming state (connection thread only). */
    struct MHD_Connection *conn;
    struct http_req *req; /* the request while it lives, for its slot (NULL after) */
    char *out;            /* SSE bytes not yet handed to MHD */
    size_t out_len, out_pos, out_cap;
    char hold[8]; /* an unfinished UTF-8 sequence */
    size_t hold_len;
    int stage; /* 0: nothing sent, 1: role sent, 2: all queued */
    char cid[48];
    int64_t created;
    cJSON *memory_info; /* owned */
    bool include_usage;
    int mode;
    bool observed;     /* metrics recorded */
    double prepare_ms; /* request received -> handed to the scheduler */
};

static void job_unref(chat_job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->text);
    free(j->out);
    cJSON_Delete(j->memory_info);
    free(j);
}

static void scan_object(chat_job *j, const char *t, size_t n) {
    for (size_t i = 0; i < n && !j->obj_closed; i++) {
        char c = t[i];
        if (j->in_str) {
            if (j->esc) j->esc = false;
            else if (c == '\\') j->esc = true;
            else if (c == '"') j->in_str = false;
        } else if (c == '"' && j->depth > 0) {
            j->in_str = true;
        } else if (c == '{') {
            j->depth++;
        } else if (c == '}' && j->depth > 0) {
            if (--j->depth == 0) j->obj_closed = true;
        }
    }
}

/* Engine thread: must be quick and never call into the scheduler. */
static void on_event(const sched_event *ev, void *ud) {
    chat_job *j = ud;
    pthread_mutex_lock(&j->mu);
    if (ev->kind == SCHED_EV_TEXT) {
        if (!j->nomem && ev->len) {
            if (j->len + ev->len + 1 > j->cap) {
                size_t nc = j->cap ? j->cap * 2 : 256;
                while (nc < j->len + ev->len + 1) nc *= 2;
                char *nt = realloc(j->text, nc);
                if (nt) {
                    j->text = nt;
                    j->cap = nc;
                } else {
                    j->nomem = true;
                }
            }
            if (!j->nomem) {
                memcpy(j->text + j->len, ev->text, ev->len);
                j->len += ev->len;
                j->text[j->len] = '\0';
                if (j->stop_on_object) scan_object(j, ev->text, ev->len);
            }
        }
    } else {
        j->done = true;
        j->end = ev->kind;
        j->finish = ev->finish;
        j->usage = ev->usage;
        j->err = ev->status;
        snprintf(j->err_msg, sizeof j->err_msg, "%s", ev->message ? ev->message : "");
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

is_status chat_job_submit(http_server *srv, const sched_request *req, bool stop_on_object,
                          chat_job **out) {
    chat_job *j = calloc(1, sizeof *j);
    if (!j) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 1;
    j->srv = srv;
    j->stop_on_object = stop_on_object;
    /* The reply begun for the model opens the object: count its braces, or
     * the first nested object's close would be taken for the end. */
    if (stop_on_object && req->reply_prefix)
        scan_object(j, req->reply_prefix, strlen(req->reply_prefix));
    j->mode = req->mode;
    sched_handle *h = NULL;
    /* The handle is stored under the lock: a cancel from another thread
     * must never see it half-set. Events may arrive before submit returns;
     * they only touch the buffers. */
    pthread_mutex_lock(&j->mu);
    is_status st = sched_submit(srv->cfg.sched, req, on_event, j, &h);
    j->h = h;
    pthread_mutex_unlock(&j->mu);
    if (st != IS_OK) {
        j->refs = 1;
        job_unref(j);
        return st;
    }
    *out = j;
    return IS_OK;
}

static void job_cancel_locked(chat_job *j, job_cancel why) {
    if (!j->cancelled && j->h && !j->done) {
        j->cancelled = true;
        j->cancel_why = why;
        sched_cancel(j->h);
    }
}

static void timed_wait(chat_job *j) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += WAIT_SLICE_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&j->cv, &j->mu, &ts);
}

/* Waits (lock held) until `ready` or the end; cancels on a hang-up, a
 * server stop or a closed extraction object. */
static void wait_locked(chat_job *j, struct MHD_Connection *conn, bool for_text) {
    while (!j->done && !(for_text && j->len > 0)) {
        if (j->stop_on_object && j->obj_closed) job_cancel_locked(j, JOB_CANCEL_OBJECT);
        timed_wait(j);
        if (j->done || j->cancelled) continue;
        bool stop = atomic_load(&j->srv->stopping);
        /* Polling the socket needs no lock; drop ours meanwhile so the
         * engine thread is never held up. */
        pthread_mutex_unlock(&j->mu);
        bool gone = !stop && http_conn_gone(conn);
        pthread_mutex_lock(&j->mu);
        if (stop || gone) job_cancel_locked(j, stop ? JOB_CANCEL_STOP : JOB_CANCEL_GONE);
    }
}

void chat_job_wait(chat_job *j, struct MHD_Connection *conn) {
    pthread_mutex_lock(&j->mu);
    wait_locked(j, conn, false);
    pthread_mutex_unlock(&j->mu);
}

const char *chat_job_text(chat_job *j, size_t *len) {
    *len = j->len;
    return j->text ? j->text : "";
}

bool chat_job_failed(chat_job *j, is_status *st, const char **msg) {
    if (j->nomem) {
        *st = IS_ERR_NOMEM;
        *msg = "out of memory";
        return true;
    }
    if (j->end == SCHED_EV_ERROR) {
        *st = j->err ? j->err : IS_ERR_INTERNAL;
        *msg = j->err_msg;
        return true;
    }
    /* A DONE of reason abort is what the scheduler sends a cancelled
     * request: its text stops wherever the cancel caught it. */
    if (j->done && j->finish == IS_FINISH_ABORT && j->cancel_why != JOB_CANCEL_OBJECT) {
        *st = IS_ERR_CANCELLED;
        *msg = j->cancel_why == JOB_CANCEL_STOP || atomic_load(&j->srv->stopping)
                   ? "the server is shutting down; the request was cancelled"
                   : "the request was cancelled before its answer was complete";
        return true;
    }
    return false;
}

static void job_release_handle(chat_job *j) {
    pthread_mutex_lock(&j->mu);
    sched_handle *h = j->h;
    j->h = NULL;
    pthread_mutex_unlock(&j->mu);
    if (h) sched_release(h);
}

void chat_job_free(chat_job *j) {
    if (!j) return;
    chat_job_wait(j, NULL);
    job_release_handle(j);
    job_unref(j);
}

/* ---- response pieces ------------------------------------------------------------------- */

static const char *finish_name(is_finish_reason f) {
    switch (f) {
    case IS_FINISH_LENGTH: return "length";
    case IS_FINISH_EOG:
    case IS_FINISH_STOP: return "stop";
    case IS_FINISH_ABORT: break; /* answered as an error (chat_job_failed) */
    }
    return "stop";
}

static cJSON *usage_json(const sched_usage *u, double prepare_ms) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompt_tokens", u->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", u->completion_tokens);
    cJSON_AddNumberToObject(o, "total_tokens", u->prompt_tokens + u->completion_tokens);
    /* OpenAI's cached_tokens: prompt tokens that were not computed for this
     * request (the shared serving prefix and the injected facts). */
    cJSON *d = cJSON_AddObjectToObject(o, "prompt_tokens_details");
    int32_t reused = u->prompt_tokens - u->prefilled_tokens;
    cJSON_AddNumberToObject(d, "cached_tokens", reused > 0 ? reused : 0);
    cJSON_AddNumberToObject(o, "prefix_cached_tokens", u->cached_tokens);
    cJSON_AddNumberToObject(o, "memory_tokens", u->memory_tokens);
    cJSON_AddNumberToObject(o, "injected_tokens", u->injected_tokens);
    cJSON_AddNumberToObject(o, "memory_prefilled_tokens", u->memory_tokens - u->injected_tokens);
    cJSON_AddNumberToObject(o, "prefilled_tokens", u->prefilled_tokens);
    /* Where a kv request's facts came from (scheduler.h sched_usage). */
    cJSON *f = cJSON_AddObjectToObject(o, "facts");
    cJSON_AddNumberToObject(f, "gpu", u->facts_gpu);
    cJSON_AddNumberToObject(f, "host", u->facts_host);
    cJSON_AddNumberToObject(f, "disk", u->facts_disk);
    cJSON_AddNumberToObject(f, "encoded", u->facts_encoded);
    cJSON_AddNumberToObject(f, "text", u->facts_text);
    /* Where a request's time went before its first token: this side of the
     * scheduler (parse, memory search, layout), then the scheduler's. */
    cJSON_AddNumberToObject(o, "prepare_ms", prepare_ms);
    cJSON_AddNumberToObject(o, "queue_ms", u->queue_ms);
    cJSON_AddNumberToObject(o, "admit_ms", u->admit_ms);
    cJSON_AddNumberToObject(o, "ttft_ms", u->ttft_ms);
    cJSON_AddNumberToObject(o, "total_ms", u->total_ms);
    return o;
}

static void observe(chat_job *j) {
    if (j->observed) return;
    j->observed = true;
    metrics_chat mc = {.mode = j->mode,
                       .ok = j->done && j->end == SCHED_EV_DONE && j->finish != IS_FINISH_ABORT,
                       .ttft_s = j->usage.completion_tokens > 0 ? j->usage.ttft_ms / 1e3 : -1.0,
                       .total_s = j->usage.total_ms / 1e3,
                       .prompt_tokens = j->usage.prompt_tokens,
                       .completion_tokens = j->usage.completion_tokens,
                       .injected_tokens = j->usage.injected_tokens,
                       .memory_prefilled_tokens =
                           j->usage.memory_tokens - j->usage.injected_tokens};
    metrics_observe_chat(j->srv->met, &mc);
}

static cJSON *chunk_base(chat_job *j) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->cid);
    cJSON_AddStringToObject(o, "object", "chat.completion.chunk");
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    cJSON_AddStringToObject(o, "model", j->srv->model_id);
    return o;
}

static bool out_append(chat_job *j, const char *s, size_t n) {
    if (j->out_len + n > j->out_cap) {
        size_t nc = j->out_cap ? j->out_cap * 2 : 1024;
        while (nc < j->out_len + n) nc *= 2;
        char *no = realloc(j->out, nc);
        if (!no) return false;
        j->out = no;
        j->out_cap = nc;
    }
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
    return true;
}

/* "data: <json>\n\n"; takes the object. */
static bool sse_event(chat_job *j, cJSON *o) {
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!txt) return false;
    bool ok =
        out_append(j, "data: ", 6) && out_append(j, txt, strlen(txt)) && out_append(j, "\n\n", 2);
    free(txt);
    return ok;
}

static bool sse_delta(chat_job *j, const char *role, const char *content, size_t n,
                      const char *finish) {
    cJSON *o = chunk_base(j), *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject(), *delta = cJSON_AddObjectToObject(c, "delta");
    cJSON_AddNumberToObject(c, "index", 0);
    if (role) cJSON_AddStringToObject(delta, "role", role);
    if (content) {
        char *s = utf8_sanitized_copy(content, n);
        if (!s) {
            cJSON_Delete(c);
            cJSON_Delete(o);
            return false;
        }
        cJSON_AddStringToObject(delta, "content", s);
        free(s);
    }
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(choices, c);
    return sse_event(j, o);
}

/* Turns what the engine sent into SSE events; called without the lock with
 * the text taken out of the job. */
static bool stream_text(chat_job *j, const char *t, size_t n) {
    if (!n) return true;
    char *buf = malloc(j->hold_len + n);
    if (!buf) return false;
    memcpy(buf, j->hold, j->hold_len);
    memcpy(buf + j->hold_len, t, n);
    size_t total = j->hold_len + n;
    size_t k = utf8_complete_prefix(buf, total);
    j->hold_len = total - k; /* at most 3 */
    memcpy(j->hold, buf + k, j->hold_len);
    bool ok = k ? sse_delta(j, NULL, buf, k, NULL) : true;
    free(buf);
    return ok;
}

static bool stream_end(chat_job *j) {
    if (j->hold_len && !sse_delta(j, NULL, j->hold, j->hold_len, NULL)) return false;
    j->hold_len = 0;
    is_status st;
    const char *msg;
    if (chat_job_failed(j, &st, &msg)) {
        cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "message", msg && *msg ? msg : is_status_to_string(st));
        cJSON_AddStringToObject(e, "type", "server_error");
        cJSON_AddNullToObject(e, "param");
        cJSON_AddStringToObject(e, "code",
                                st != IS_ERR_CANCELLED           ? "internal_error"
                                : atomic_load(&j->srv->stopping) ? "shutting_down"
                                                                 : "cancelled");
        if (!sse_event(j, o)) return false;
    } else {
        if (!sse_delta(j, NULL, NULL, 0, finish_name(j->finish))) return false;
        if (j->include_usage) {
            cJSON *o = chunk_base(j);
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(&j->usage, j->prepare_ms));
            if (j->memory_info)
                cJSON_AddItemToObject(o, "memory", cJSON_Duplicate(j->memory_info, true));
            if (!sse_event(j, o)) return false;
        }
    }
    return out_append(j, "data: [DONE]\n\n", 14);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    chat_job *j = cls;
    for (;;) {
        if (j->out_pos < j->out_len) {
            size_t n = j->out_len - j->out_pos;
            if (n > max) n = max;
            memcpy(buf, j->out + j->out_pos, n);
            j->out_pos += n;
            if (j->out_pos == j->out_len) j->out_pos = j->out_len = 0;
            return (ssize_t)n;
        }
        if (j->stage == 2) return MHD_CONTENT_READER_END_OF_STREAM;
        if (j->stage == 0) {
            if (!sse_delta(j, "assistant", "", 0, NULL)) return MHD_CONTENT_READER_END_WITH_ERROR;
            j->stage = 1;
            continue;
        }
        pthread_mutex_lock(&j->mu);
        wait_locked(j, j->conn, true);
        /* Cancelled: end with the error event once the cancel's DONE comes
         * (the scheduler's next step). A client still reading (a stop, a
         * half-close) learns why; for one that is gone the write fails. */
        if (j->cancelled && !j->done)
            while (!j->done) timed_wait(j);
        char *t = j->text;
        size_t n = j->len;
        bool done = j->done;
        j->text = NULL;
        j->len = j->cap = 0;
        pthread_mutex_unlock(&j->mu);
        bool ok = stream_text(j, t, n);
        free(t);
        if (ok && done) {
            ok = stream_end(j);
            observe(j);
            j->stage = 2;
            /* The whole answer is queued: the slot goes before the client
             * can read the end and send its next request. */
            if (j->req) http_req_release_slot(j->req);
        }
        if (!ok) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

/* The response is gone (stream finished, client gone, or never queued). */
static void stream_free(void *cls) {
    chat_job *j = cls;
    pthread_mutex_lock(&j->mu);
    job_cancel_locked(j, JOB_CANCEL_GONE); /* no-op when done */
    pthread_mutex_unlock(&j->mu);
    chat_job_wait(j, NULL);
    if (!j->observed) observe(j);
    job_release_handle(j);
    job_unref(j);
}

/* For the request's log line. */
static void note_usage(http_req *r, chat_job *j) {
    if (!j->done) return;
    r->has_usage = true;
    r->prompt_tokens = j->usage.prompt_tokens;
    r->completion_tokens = j->usage.completion_tokens;
    r->injected_tokens = j->usage.injected_tokens;
    r->ttft_ms = j->usage.ttft_ms;
    is_status st;
    const char *msg;
    snprintf(r->finish, sizeof r->finish, "%s",
             !chat_job_failed(j, &st, &msg) ? finish_name(j->finish)
             : st == IS_ERR_CANCELLED       ? "cancelled"
                                            : "error");
}

void chat_job_on_completed(http_req *r, bool error) {
    chat_job *j = r->job;
    r->job = NULL;
    j->req = NULL; /* r is freed next; stream_read runs on this thread, never after */
    pthread_mutex_lock(&j->mu);
    if (error) job_cancel_locked(j, JOB_CANCEL_GONE);
    note_usage(r, j);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* ---- the handler ----------------------------------------------------------------------- */

static ask_mode to_ask_mode(parse_mode m) {
    return m == PARSE_MODE_KV       ? ASK_MODE_KV
           : m == PARSE_MODE_PROMPT ? ASK_MODE_PROMPT
                                    : ASK_MODE_OFF;
}

/* Tokens of the client's messages (not the template's): what
 * max_prompt_tokens bounds. -1 when they cannot be counted. */
static int64_t count_tokens(const tokenizer *tok, const parse_chat *c) {
    int64_t total = 0;
    for (int32_t i = 0; i < c->n_messages; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(tok, c->messages[i].content, strlen(c->messages[i].content), false,
                             false, &ids, &n) != IS_OK)
            return -1;
        free(ids);
        total += (int64_t)n;
    }
    return total;
}

enum MHD_Result http_chat(http_req *r) {
    http_server *s = r->srv;
    const http_limits *lim = &s->cfg.limits;
    parse_chat c;
    parse_error pe;
    is_status st = parse_chat_request(r->body, r->len, &lim->parse, &c, &pe);
    if (st != IS_OK) {
        parse_chat_free(&c);
        return http_send_parse_error(r, &pe);
    }
    enum MHD_Result res;
    memory_hit *hits = NULL;
    int32_t n_hits = 0;
    sched_fact *facts = NULL;
    memory_fact_ref *rows = NULL;
    chat_message *msgs = NULL;
    cJSON *meminfo = NULL;
    chat_job *job = NULL;

    if (!s->cfg.sched) {
        res = http_send_error(r, 503, NULL, "no_model", "no model is loaded on this server");
        goto out;
    }
    if (c.model && strcmp(c.model, s->model_id) != 0 && strcmp(c.model, "default") != 0) {
        /* Clients send whatever their default is; answering with the one
         * model we serve is friendlier than a 404. The response names it. */
    }
    ask_mode mode =
        c.mode == PARSE_MODE_DEFAULT ? (c.user ? ASK_MODE_KV : ASK_MODE_OFF) : to_ask_mode(c.mode);
    if (c.user) snprintf(r->user, sizeof r->user, "%s", c.user);
    if (mode != ASK_MODE_OFF && !c.user) {
        res = http_send_error(r, 400, "user", "missing_field",
                              "memory mode '%s' needs 'user' (the user whose memory to use)",
                              ask_mode_name(mode));
        goto out;
    }
    if (lim->max_prompt_tokens > 0 && s->cfg.tok) {
        int64_t nt = count_tokens(s->cfg.tok, &c);
        if (nt < 0) {
            res = http_send_status(r, IS_ERR_INTERNAL, "tokenizing the messages");
            goto out;
        }
        if (nt > lim->max_prompt_tokens) {
            res = http_send_error(r, 400, "messages", "context_length_exceeded",
                                  "the messages hold %lld tokens; this server accepts at most %d",
                                  (long long)nt, lim->max_prompt_tokens);
            goto out;
        }
    }
    if (mode != ASK_MODE_OFF) {
        if (!s->cfg.mem) {
            res = http_send_error(r, 503, "memory", "no_memory", "this server has no memory store");
            goto out;
        }
        const char *query = parse_chat_query(&c);
        if (!query || !query[strspn(query, " \t\r\n")]) {
            res = http_send_error(r, 400, "messages", "invalid_value",
                                  "memory needs a non-empty user message to search with");
            goto out;
        }
        mem_filter f = {.tenant = r->tenant,
                        .user = c.user,
                        .agent_id = c.filters.agent_id,
                        .run_id = c.filters.run_id,
                        .meta_keys = (const char *const *)c.filters.meta_keys,
                        .meta_values = (const char *const *)c.filters.meta_values,
                        .n_meta = c.filters.n_meta};
        if (c.filters.user_id && strcmp(c.filters.user_id, c.user) != 0) {
            res = http_send_error(r, 400, "memory.filters", "invalid_value",
                                  "memory.filters.user_id differs from 'user'");
            goto out;
        }
        bool known = true;
        if (c.k > 0 && (st = memory_search(s->cfg.mem, &f, query, c.k, &hits, &n_hits)) != IS_OK) {
            res = http_send_status(r, st, "memory search");
            goto out;
        }
        if (n_hits == 0) {
            mem_filter any = {.tenant = r->tenant, .user = c.user};
            memory_hit *h1 = NULL;
            int32_t n1 = 0;
            if ((st = memory_search(s->cfg.mem, &any, query, 1, &h1, &n1)) != IS_OK) {
                res = http_send_status(r, st, "memory search");
                goto out;
            }
            memory_hits_free(h1, n1);
            known = n1 > 0;
        }
        meminfo = cJSON_CreateObject();
        cJSON_AddStringToObject(meminfo, "user", c.user);
        cJSON_AddBoolToObject(meminfo, "user_known", known);
        cJSON_AddNumberToObject(meminfo, "requested_k", c.k);
        if (!known) {
            mode = ASK_MODE_OFF;
            cJSON_AddStringToObject(
                meminfo, "note", "no memories are stored for this user: answered without memory");
        }
        cJSON_AddStringToObject(meminfo, "mode", ask_mode_name(mode));
        cJSON_AddNumberToObject(meminfo, "k", n_hits);
        cJSON *ids = cJSON_AddArrayToObject(meminfo, "facts");
        int32_t n_ready = 0;
        if (n_hits) {
            facts = calloc((size_t)n_hits, sizeof *facts);
            rows = calloc((size_t)n_hits, sizeof *rows);
            if (!facts || !rows) {
                res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
                goto out;
            }
        }
        for (int32_t i = 0; i < n_hits; i++) {
            facts[i].text = hits[i].fact.text;
            facts[i].kv_record = hits[i].fact.kv_record;
            /* Its row: KV missing on this node is encoded for the request. */
            snprintf(rows[i].id, sizeof rows[i].id, "%s", hits[i].fact.id);
            rows[i].tenant = hits[i].fact.tenant;
            rows[i].user = hits[i].fact.user;
            n_ready += http_fact_kv_ready(r->srv, &hits[i].fact);
            cJSON_AddItemToArray(ids, cJSON_CreateString(hits[i].fact.id));
        }
        cJSON_AddNumberToObject(meminfo, "kv_ready", n_ready);
    }
    r->mode = (int)mode;
    r->n_facts = n_hits;

    msgs = calloc((size_t)c.n_messages, sizeof *msgs);
    if (!msgs) {
        res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        goto out;
    }
    for (int32_t i = 0; i < c.n_messages; i++)
        msgs[i] = (chat_message){c.messages[i].role, c.messages[i].content};
    uint64_t seed = c.has_seed ? c.seed : 0;
    if (c.has_seed && seed == 0) seed = 1; /* 0 means "random" to the scheduler */
    sched_request req = {.messages = msgs,
                         .n_messages = c.n_messages,
                         .mode = mode,
                         .facts = facts,
                         .n_facts = mode == ASK_MODE_OFF ? 0 : n_hits,
                         .fact_rows = rows,
                         .max_tokens = c.max_tokens,
                         .temperature = c.temperature,
                         .top_p = c.top_p,
                         .top_k = c.top_k,
                         .seed = seed,
                         .stop = (const char *const *)c.stop,
                         .n_stop = c.n_stop};
    double t_submit = http_now_ms();
    st = chat_job_submit(s, &req, false, &job);
    if (st != IS_OK) {
        res = st == IS_ERR_BUSY
                  ? http_send_error(r, 503, NULL, "overloaded",
                                    "the server is busy (%s); retry later", is_error_last())
                  : http_send_status(r, st, "chat");
        goto out;
    }
    job->prepare_ms = t_submit - r->t0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    job->created = now.tv_sec;
    snprintf(job->cid, sizeof job->cid, "chatcmpl-%llx%06llx", (unsigned long long)now.tv_sec,
             (unsigned long long)(r->id & 0xffffff));

    if (c.stream) {
        job->conn = r->conn;
        job->req = r;
        job->include_usage = c.include_usage;
        job->memory_info = meminfo;
        meminfo = NULL;
        job->refs = 2; /* the response's and the request's */
        r->job = job;
        struct MHD_Response *resp = MHD_create_response_from_callback(
            MHD_SIZE_UNKNOWN, 4096, stream_read, job, stream_free);
        if (!resp) {
            r->job = NULL;
            job->refs = 1;
            chat_job_free(job);
            job = NULL;
            res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
            goto out;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        res = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp); /* if queueing failed, this frees the job's response side */
        r->responded = true;
        r->status = 200;
        job = NULL;
        goto out;
    }

    chat_job_wait(job, r->conn);
    note_usage(r, job);
    is_status jst;
    const char *jmsg;
    if (chat_job_failed(job, &jst, &jmsg)) {
        observe(job);
        int code = jst == IS_ERR_CONTEXT_FULL                      ? 400
                   : jst == IS_ERR_CANCELLED || jst == IS_ERR_BUSY ? 503
                                                                   : 500;
        res = http_send_error(r, code, NULL,
                              jst == IS_ERR_CONTEXT_FULL  ? "context_length_exceeded"
                              : code != 503               ? "internal_error"
                              : atomic_load(&s->stopping) ? "shutting_down"
                              : jst == IS_ERR_CANCELLED   ? "cancelled"
                                                          : "overloaded",
                              "%s", jmsg && *jmsg ? jmsg : is_status_to_string(jst));
        goto out;
    }
    observe(job);
    size_t tl;
    const char *text = chat_job_text(job, &tl);
    char *clean = utf8_sanitized_copy(text, tl);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", job->cid);
    cJSON_AddStringToObject(o, "object", "chat.completion");
    cJSON_AddNumberToObject(o, "created", (double)job->created);
    cJSON_AddStringToObject(o, "model", s->model_id);
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", 0);
    cJSON *msg = cJSON_AddObjectToObject(ch, "message");
    cJSON_AddStringToObject(msg, "role", "assistant");
    cJSON_AddStringToObject(msg, "content", clean ? clean : "");
    cJSON_AddNullToObject(ch, "logprobs");
    cJSON_AddStringToObject(ch, "finish_reason", finish_name(job->finish));
    cJSON_AddItemToArray(choices, ch);
    cJSON_AddItemToObject(o, "usage", usage_json(&job->usage, job->prepare_ms));
    if (meminfo) {
        cJSON_AddItemToObject(o, "memory", meminfo);
        meminfo = NULL;
    }
    free(clean);
    res = http_send_json(r, 200, o);
out:
    if (job) chat_job_free(job);
    cJSON_Delete(meminfo);
    free(msgs);
    free(facts);
    free(rows);
    memory_hits_free(hits, n_hits);
    parse_chat_free(&c);
    return res;
}

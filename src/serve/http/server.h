/*
 * server: the HTTP API (DESIGN.md, serving), on libmicrohttpd.
 *
 *   POST /v1/chat/completions        OpenAI chat (stream: server-sent events)
 *   GET  /v1/models, /v1/models/{id}
 *   POST /v1/memories/               add (messages or facts; infer)
 *   GET  /v1/memories/               list by filters (query string)
 *   DELETE /v1/memories/             delete by filters (user_id required)
 *   GET|PUT|DELETE /v1/memories/{id}/
 *   GET  /v1/memories/{id}/history/
 *   POST /v1/memories/search/
 *   Mem0's platform routes for the mem0ai clients (/v1/ping, /v2 and /v3
 *   memories, /v1/batch, /v1/entities, ...): see serve/http/mem0.h
 *   GET  /health, /metrics           (no key needed; /health is 503 while stopping
 *                                    and while the backend has failed, sched_get_health)
 * (Trailing slashes are optional.)
 *
 * Threads: one per connection (MHD_USE_THREAD_PER_CONNECTION), so a
 * non-streaming chat may block its own connection's thread until its DONE
 * event, and a streaming one blocks in the response callback until the
 * scheduler's event callback has text for it. The model is reached only
 * through the scheduler (serve/scheduler.h); memory through the memory
 * service (memory/memory.h), both thread-safe. While waiting, a handler
 * polls its socket: a client that closed (or shut down its sending side:
 * the two look alike until the server writes) has its request cancelled
 * (sched_cancel), so its KV blocks are freed at the scheduler's next step;
 * the request-completed notification cancels too when a response ends
 * with an error (a failed write). A request
 * cancelled before its answer is complete is answered 503 (cancelled, or
 * shutting_down), a stream with an error event, never a 200.
 *
 * Tenancy: every API route needs "Authorization: Bearer KEY" (or "Token
 * KEY", the form of Mem0's clients); the key's
 * tenant (serve/http/auth.h) scopes every memory read, write and search
 * of the request. With no_auth, every request is the tenant no_auth_tenant.
 *
 * Errors are OpenAI's shape, {"error": {"message", "type", "param",
 * "code"}}, with status 400 (malformed or invalid input, prompt past the
 * context), 401 (no or unknown key), 404 (unknown route, memory or model),
 * 405, 408 (headers or body not received in time), 413 (body over the
 * limit), 414 (URL too long), 429 (too many requests in flight, in all or
 * for the tenant), 431 (headers too large), 500, 503 (no model loaded,
 * scheduler queue full, shutting down); 429 and 503 carry Retry-After.
 * A request is checked (URL, header size, key, in-flight slot) before its
 * body is read; refused ones are answered at once and their connection
 * closed, holding no slot. Errors libmicrohttpd answers itself are listed
 * in README.md (serving).
 *
 * Logging: one JSON line per request (method, path, status, tenant, ms,
 * bytes, and for chat: mode, facts used, tokens, TTFT), written when the
 * request completes (after the last byte of a stream).
 */
#ifndef IS_SERVE_HTTP_SERVER_H
#define IS_SERVE_HTTP_SERVER_H

#include "inferscale.h"
#include "memory/memory.h"
#include "model/tokenizer.h"
#include "serve/http/auth.h"
#include "serve/http/parse.h"
#include "serve/scheduler.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct http_server http_server;

typedef struct http_limits {
    size_t max_body_bytes;        /* request body; 413 above (default 1 MiB) */
    int32_t max_prompt_tokens;    /* the client's messages, tokenised; 400 above
                                     (default 4096; 0: unchecked, the context still is) */
    int32_t max_in_flight;        /* API requests being served at once; 429 above (default 64) */
    int32_t max_in_flight_tenant; /* of them, one tenant's (default -1: 3/4 of max_in_flight;
                                     0: no per-tenant limit; not applied with no_auth, where
                                     there is one tenant) */
    int32_t max_connections;      /* open connections; past it a new one evicts the oldest
                                     waiting for headers (default 512) */
    int32_t connection_timeout_s; /* a kept-alive connection idle between requests, and no
                                     progress while sending a response (default 30) */
    int32_t header_timeout_s;     /* a new connection's request headers (default 10; 408) */
    int32_t body_timeout_s;       /* a request body, from its headers (default 60; 408) */
    int32_t max_fact_bytes;       /* one fact's text (default 4096) */
    int32_t extract_max_tokens;   /* reply budget of infer=true extraction (default 512) */
    parse_limits parse;           /* max_tokens, k, top_k, messages (parse.h) */
} http_limits;

typedef struct http_config {
    const char *host; /* address to bind (default "127.0.0.1"; "::1", "0.0.0.0", a name) */
    int port;         /* 0: a free port, see http_server_port (default 8080) */
    http_limits limits;
    const auth_keys *keys;      /* borrowed; required unless no_auth */
    bool no_auth;               /* every request is tenant no_auth_tenant */
    const char *no_auth_tenant; /* default "default" */
    const char *model_id;       /* name in /v1/models and in responses (default "inferscale") */
    sched *sched;               /* borrowed; NULL: chat and infer=true answer 503 */
    memory *mem;                /* borrowed; NULL: memory routes answer 503 */
    const tokenizer *tok;       /* borrowed; for max_prompt_tokens (NULL: unchecked) */
    FILE *log;                  /* request log (NULL: stderr) */
    bool quiet;                 /* no request log at all */
    int infer_fallback;         /* an infer=true add whose extraction yields no fact:
                                     HTTP_INFER_FALLBACK_STORE (default) stores the user's
                                     messages as they are, _REJECT answers 422 */
    bool public_stats;          /* /health and /metrics show counts over all tenants (facts)
                                     to callers without a key (default false) */
} http_config;

enum { HTTP_INFER_FALLBACK_STORE = 0, HTTP_INFER_FALLBACK_REJECT = 1 };

http_limits http_default_limits(void);
http_config http_default_config(void);

/* Binds and starts serving (threads of its own). Borrowed objects must
 * outlive the server. IS_ERR_INVALID_ARG (bad config: no keys without
 * no_auth, bad host), IS_ERR_IO (cannot bind: the message says why),
 * IS_ERR_NOMEM. */
is_status http_server_start(const http_config *c, http_server **out);

/* The port bound (the one picked when config.port was 0). */
int http_server_port(const http_server *s);

/* Stops accepting, cancels the requests still running (their clients get
 * a 503 shutting_down or an error event; waits up to 5 s for those to be
 * written, after that a closed connection), waits for every connection
 * thread and frees the server. The scheduler must still be running (the
 * cancelled requests' final events come from it): free it after this.
 * NULL is a no-op. */
void http_server_stop(http_server *s);

#endif

/*
 * guard: what keeps hostile or slow clients from holding the server's
 * resources. Not a public header (server.c uses it).
 *
 *   - Connections. Every open connection is registered (MHD's connection
 *     notification) with its state: waiting for a request's headers,
 *     receiving a body, or busy (a handler runs or a response is sent).
 *     A reaper thread closes a connection whose headers have not all
 *     arrived within header_timeout_s of its opening, whose body has not
 *     arrived within body_timeout_s of its headers, or that has waited
 *     idle_timeout_s for its next request; the first two get a 408 JSON
 *     error first. MHD's own inactivity timeout is reset by every byte, so
 *     a client that trickles one byte a second would otherwise be kept
 *     forever.
 *   - The connection limit. At max_connections, a new connection evicts
 *     the oldest one that is waiting for headers (idle or slow) or sending
 *     a body that holds no in-flight slot, so neither idle nor keyless
 *     connections can lock new clients out; only when every connection is
 *     busy or uploading with a slot is a new one refused.
 *   - In-flight slots. A request takes a slot only after its key has been
 *     checked, and gives it back as soon as its answer is queued (server.c);
 *     the slots are limited in all (max_in_flight) and per tenant
 *     (max_in_flight_tenant), so one tenant cannot starve the others.
 *
 * Thread-safe: one mutex; MHD's threads and the reaper call in at once.
 */
#ifndef IS_SERVE_HTTP_GUARD_H
#define IS_SERVE_HTTP_GUARD_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

/* Room above max_connections for evicted connections whose threads have
 * not yet closed them: the daemon's own connection limit is set this much
 * higher, and the guard refuses past it. */
#define HTTP_GUARD_EVICT_SLACK 64

typedef struct http_guard http_guard;
typedef struct http_guard_conn http_guard_conn;

typedef struct http_guard_params {
    int32_t max_connections;      /* open connections before eviction (> 0) */
    int32_t header_timeout_s;     /* a new connection's first request headers (0: none) */
    int32_t body_timeout_s;       /* a request body, from its headers (0: none) */
    int32_t idle_timeout_s;       /* a kept-alive connection between requests (0: none) */
    int32_t max_in_flight;        /* requests holding a slot, all tenants (> 0) */
    int32_t max_in_flight_tenant; /* per tenant (0: no per-tenant limit) */
} http_guard_params;

typedef enum http_guard_state {
    HTTP_GUARD_HEAD = 0,  /* waiting for a request's headers */
    HTTP_GUARD_BODY = 1,  /* headers in, receiving the body */
    HTTP_GUARD_BUSY = 2,  /* a handler runs or a response is being sent */
    HTTP_GUARD_DRAIN = 3, /* receiving a body that holds no slot: a refused request's (read
                             and dropped) or one of a route that takes no key; timed like
                             a body, and evictable like a connection waiting for headers */
} http_guard_state;

/* Starts the reaper thread. IS_ERR_NOMEM, IS_ERR_INVALID_ARG. */
is_status http_guard_create(const http_guard_params *p, http_guard **out);
/* Stops the reaper. Connections must all be closed (the daemon stopped). */
void http_guard_free(http_guard *g);

/* Accept policy: true to accept a new connection (evicting the oldest
 * connection waiting for headers if at the limit), false to refuse it. */
bool http_guard_accept(http_guard *g);

/* A connection opened on socket fd: its record (NULL when out of memory:
 * that connection is then simply not guarded). */
http_guard_conn *http_guard_open(http_guard *g, int fd);
/* For a connection answered before its request body was read (the daemon
 * drops the rest and closes it), once the answer is sent: ends the
 * sending side, then reads and drops what still comes for at most 250 ms
 * (256 KiB), since closing a socket with unread bytes sends a reset, which
 * can reach the client before the answer. Blocks: call it on the
 * connection's own thread (MHD's request-completed notification), never
 * on the daemon's. NULL is a no-op. */
void http_guard_linger(http_guard *g, http_guard_conn *c);
/* The connection is closing; its record is freed. NULL is a no-op. */
void http_guard_close(http_guard *g, http_guard_conn *c);
/* The connection's state changes (the clock of its timeout restarts).
 * NULL is a no-op. */
void http_guard_set_state(http_guard *g, http_guard_conn *c, http_guard_state st);

typedef enum http_guard_slot {
    HTTP_GUARD_SLOT_OK = 0,
    HTTP_GUARD_SLOT_FULL = 1,   /* max_in_flight reached */
    HTTP_GUARD_SLOT_TENANT = 2, /* this tenant's max_in_flight_tenant reached */
} http_guard_slot;

/* Takes an in-flight slot for tenant (a valid tenant name); on anything
 * but OK nothing is taken. */
http_guard_slot http_guard_acquire(http_guard *g, const char *tenant);
/* Gives back a slot taken by http_guard_acquire. */
void http_guard_release(http_guard *g, const char *tenant);
/* Slots held now, in all. */
int32_t http_guard_in_flight(http_guard *g);

/* Connections closed by the reaper (timeouts) and by eviction, since start. */
void http_guard_counts(http_guard *g, int64_t *timed_out, int64_t *evicted);

#endif

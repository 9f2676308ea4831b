#include "serve/http/guard.h"

#include "core/status.h"
#include "serve/http/auth.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* How often the reaper looks (timeouts are whole seconds). */
#define GUARD_TICK_MS 200
/* How long, and how much, a connection answered before its body was read
 * reads and drops before closing (http_guard_set_linger). */
#define GUARD_LINGER_MS    250
#define GUARD_LINGER_BYTES ((size_t)256 << 10)

struct http_guard_conn {
    int fd;
    http_guard_state state;
    bool first;   /* no request completed on it yet */
    bool closing; /* shut down by the reaper or by eviction */
    double since; /* monotonic ms of the last state change */
    http_guard_conn *prev, *next;
};

typedef struct tenant_slot {
    char name[AUTH_TENANT_MAX + 1];
    int32_t n;
} tenant_slot;

struct http_guard {
    http_guard_params p;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t reaper;
    bool stop;
    http_guard_conn head; /* list sentinel, oldest first */
    int32_t n_conns, n_closing;
    tenant_slot *tenants;
    int32_t n_tenants, cap_tenants;
    int32_t in_flight;
    int64_t timed_out, evicted;
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Closes c's socket for both directions (its MHD thread then sees the end
 * and closes the connection); with a 408, the client learns why. Called
 * with mu held, while c is registered, so its fd is still open. */
static void shut(http_guard *g, http_guard_conn *c, bool send_408) {
    if (send_408) {
        static const char body[] =
            "{\"error\":{\"message\":\"the request was not received in time\",\"type\":"
            "\"invalid_request_error\",\"param\":null,\"code\":\"request_timeout\"}}\n";
        char msg[512];
        int n = snprintf(msg, sizeof msg,
                         "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                         "Connection: close\r\nContent-Length: %zu\r\n\r\n%s",
                         sizeof body - 1, body);
        /* Best effort, never blocking: a client too slow to take 300 bytes
         * loses them. */
        (void)send(c->fd, msg, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    shutdown(c->fd, SHUT_RDWR);
    c->closing = true;
    g->n_closing++;
}

static void *reaper_main(void *arg) {
    http_guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += GUARD_TICK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        if (g->stop) break;
        double t = now_ms();
        for (http_guard_conn *c = g->head.next; c != &g->head; c = c->next) {
            if (c->closing || c->state == HTTP_GUARD_BUSY) continue;
            bool body = c->state == HTTP_GUARD_BODY || c->state == HTTP_GUARD_DRAIN;
            int32_t lim = body       ? g->p.body_timeout_s
                          : c->first ? g->p.header_timeout_s
                                     : g->p.idle_timeout_s;
            if (lim <= 0 || t - c->since < lim * 1e3) continue;
            /* A kept-alive connection that sent nothing more is closed
             * without a word: it has no request to answer. */
            shut(g, c, body || c->first);
            g->timed_out++;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

is_status http_guard_create(const http_guard_params *p, http_guard **out) {
    if (!p || !out || p->max_connections <= 0 || p->max_in_flight <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "http_guard_create: bad parameters");
    http_guard *g = calloc(1, sizeof *g);
    if (!g) return is_error_set(IS_ERR_NOMEM, "out of memory");
    g->p = *p;
    g->head.next = g->head.prev = &g->head;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (pthread_create(&g->reaper, NULL, reaper_main, g) != 0) {
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return is_error_set(IS_ERR_NOMEM, "cannot start the connection reaper thread");
    }
    *out = g;
    return IS_OK;
}

void http_guard_free(http_guard *g) {
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    g->stop = true;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->reaper, NULL);
    while (g->head.next != &g->head) { /* connections MHD never reported closed */
        http_guard_conn *c = g->head.next;
        c->prev->next = c->next;
        c->next->prev = c->prev;
        free(c);
    }
    free(g->tenants);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

bool http_guard_accept(http_guard *g) {
    pthread_mutex_lock(&g->mu);
    bool ok = true;
    if (g->n_conns - g->n_closing >= g->p.max_connections) {
        /* The oldest connection waiting for headers, or sending a body
         * that holds no slot, makes room: an idle, slow or refused client,
         * never one being served. */
        http_guard_conn *victim = NULL;
        for (http_guard_conn *c = g->head.next; c != &g->head; c = c->next)
            if (!c->closing && (c->state == HTTP_GUARD_HEAD || c->state == HTTP_GUARD_DRAIN) &&
                (!victim || c->since < victim->since))
                victim = c;
        if (victim) {
            shut(g, victim, false);
            g->evicted++;
        } else {
            ok = false;
        }
    }
    if (g->n_conns >= g->p.max_connections + HTTP_GUARD_EVICT_SLACK) ok = false;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

http_guard_conn *http_guard_open(http_guard *g, int fd) {
    http_guard_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->state = HTTP_GUARD_HEAD;
    c->first = true;
    c->since = now_ms();
    pthread_mutex_lock(&g->mu);
    c->prev = g->head.prev;
    c->next = &g->head;
    g->head.prev->next = c;
    g->head.prev = c;
    g->n_conns++;
    pthread_mutex_unlock(&g->mu);
    return c;
}

/* Reads and drops what the peer still sends, until it closes, a quarter
 * second passes or GUARD_LINGER_BYTES came: bounded, so a hostile client
 * cannot hold the connection with it. */
static void linger_drain(int fd) {
    shutdown(fd, SHUT_WR);
    char buf[4096];
    size_t total = 0;
    double end = now_ms() + GUARD_LINGER_MS;
    while (total < GUARD_LINGER_BYTES) {
        int left = (int)(end - now_ms());
        if (left <= 0) break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) break;
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0) break;
        total += (size_t)n;
    }
}

void http_guard_linger(http_guard *g, http_guard_conn *c) {
    if (!c) return;
    pthread_mutex_lock(&g->mu);
    bool shut_already = c->closing;
    int fd = c->fd;
    pthread_mutex_unlock(&g->mu);
    /* The socket stays open until the daemon closes it after this
     * connection's thread is done, so fd is still this connection's. */
    if (!shut_already) linger_drain(fd);
}

void http_guard_close(http_guard *g, http_guard_conn *c) {
    if (!c) return;
    pthread_mutex_lock(&g->mu);
    c->prev->next = c->next;
    c->next->prev = c->prev;
    g->n_conns--;
    if (c->closing) g->n_closing--;
    pthread_mutex_unlock(&g->mu);
    free(c);
}

void http_guard_set_state(http_guard *g, http_guard_conn *c, http_guard_state st) {
    if (!c) return;
    pthread_mutex_lock(&g->mu);
    if (st == HTTP_GUARD_HEAD && c->state != HTTP_GUARD_HEAD) c->first = false;
    c->state = st;
    c->since = now_ms();
    pthread_mutex_unlock(&g->mu);
}

static tenant_slot *find_tenant(http_guard *g, const char *t, bool add) {
    for (int32_t i = 0; i < g->n_tenants; i++)
        if (strcmp(g->tenants[i].name, t) == 0) return &g->tenants[i];
    if (!add) return NULL;
    if (g->n_tenants == g->cap_tenants) {
        int32_t nc = g->cap_tenants ? 2 * g->cap_tenants : 16;
        tenant_slot *nt = realloc(g->tenants, (size_t)nc * sizeof *nt);
        if (!nt) return NULL;
        g->tenants = nt;
        g->cap_tenants = nc;
    }
    tenant_slot *s = &g->tenants[g->n_tenants++];
    snprintf(s->name, sizeof s->name, "%s", t);
    s->n = 0;
    return s;
}

http_guard_slot http_guard_acquire(http_guard *g, const char *tenant) {
    pthread_mutex_lock(&g->mu);
    http_guard_slot r = HTTP_GUARD_SLOT_OK;
    tenant_slot *s = g->p.max_in_flight_tenant > 0 ? find_tenant(g, tenant, true) : NULL;
    if (g->in_flight >= g->p.max_in_flight) r = HTTP_GUARD_SLOT_FULL;
    else if (g->p.max_in_flight_tenant > 0 && (!s || s->n >= g->p.max_in_flight_tenant))
        r = HTTP_GUARD_SLOT_TENANT;
    if (r == HTTP_GUARD_SLOT_OK) {
        g->in_flight++;
        if (s) s->n++;
    }
    pthread_mutex_unlock(&g->mu);
    return r;
}

void http_guard_release(http_guard *g, const char *tenant) {
    pthread_mutex_lock(&g->mu);
    g->in_flight--;
    tenant_slot *s = g->p.max_in_flight_tenant > 0 ? find_tenant(g, tenant, false) : NULL;
    if (s) s->n--;
    pthread_mutex_unlock(&g->mu);
}

int32_t http_guard_in_flight(http_guard *g) {
    pthread_mutex_lock(&g->mu);
    int32_t n = g->in_flight;
    pthread_mutex_unlock(&g->mu);
    return n;
}

void http_guard_counts(http_guard *g, int64_t *timed_out, int64_t *evicted) {
    pthread_mutex_lock(&g->mu);
    if (timed_out) *timed_out = g->timed_out;
    if (evicted) *evicted = g->evicted;
    pthread_mutex_unlock(&g->mu);
}

/*
 * io_pool: a batch queue and its workers (see io_pool.h).
 *
 * A batch lives on its caller's stack. It stays in the queue while it has
 * items nobody took; workers join the batch at the head (any number of
 * them at once), take items by an atomic counter, and leave it; whoever
 * finds it without items left unlinks it. The caller returns only when
 * every item has run and no worker is inside (users), since its stack
 * frame is the batch.
 */
#include "serve/io_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

typedef struct io_batch io_batch;
struct io_batch {
    void (*fn)(void *arg, int32_t i);
    void *arg;
    int32_t n;
    atomic_int next;   /* the next item to take */
    int32_t done;      /* items run (p->mu) */
    int32_t users;     /* workers inside (p->mu) */
    bool queued;       /* linked in p's queue (p->mu) */
    pthread_cond_t cv; /* done == n && users == 0 */
    io_batch *link;
};

struct io_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a batch was queued, or stop */
    io_batch *head, *tail;
    bool stop;
    pthread_t *threads;
    int32_t n_threads;
};

static void unlink_batch(io_pool *p, io_batch *b) {
    if (!b->queued) return;
    io_batch **at = &p->head, *prev = NULL;
    while (*at && *at != b) {
        prev = *at;
        at = &(*at)->link;
    }
    if (*at) *at = b->link;
    if (p->tail == b) p->tail = prev;
    b->link = NULL;
    b->queued = false;
}

static int32_t drain(io_batch *b) {
    int32_t k = 0, i;
    while ((i = atomic_fetch_add(&b->next, 1)) < b->n) {
        b->fn(b->arg, i);
        k++;
    }
    return k;
}

static void *worker(void *arg) {
    io_pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->head) pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) break;
        io_batch *b = p->head;
        if (atomic_load(&b->next) >= b->n) {
            unlink_batch(p, b); /* taken: those inside finish it */
            continue;
        }
        b->users++;
        pthread_mutex_unlock(&p->mu);
        int32_t k = drain(b);
        pthread_mutex_lock(&p->mu);
        b->done += k;
        b->users--;
        unlink_batch(p, b);
        if (b->done == b->n && b->users == 0) pthread_cond_signal(&b->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

is_status io_pool_create(int32_t n_threads, io_pool **out) {
    if (n_threads < 1 || n_threads > 256 || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "io pool: 1 to 256 threads");
    io_pool *p = calloc(1, sizeof *p);
    if (!p || !(p->threads = calloc((size_t)n_threads, sizeof *p->threads))) {
        free(p);
        return is_error_set(IS_ERR_NOMEM, "io pool: out of memory");
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int32_t i = 0; i < n_threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
            io_pool_free(p);
            return is_error_set(IS_ERR_INTERNAL, "io pool: cannot start thread %d", (int)i);
        }
        p->n_threads++;
    }
    *out = p;
    return IS_OK;
}

void io_pool_free(io_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int32_t i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p);
}

void io_pool_run(io_pool *p, void (*fn)(void *arg, int32_t i), void *arg, int32_t n) {
    if (!p || n < 2) {
        for (int32_t i = 0; i < n; i++) fn(arg, i);
        return;
    }
    io_batch b = {.fn = fn, .arg = arg, .n = n, .queued = true};
    atomic_init(&b.next, 0);
    pthread_cond_init(&b.cv, NULL);
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->link = &b;
    else p->head = &b;
    p->tail = &b;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    int32_t k = drain(&b);
    pthread_mutex_lock(&p->mu);
    b.done += k;
    unlink_batch(p, &b);
    while (b.done < b.n || b.users > 0) pthread_cond_wait(&b.cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&b.cv);
}

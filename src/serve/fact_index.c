/*
 * fact_index: record id -> (content id, tokens, text hash, resident hint);
 * see fact_index.h. Open hashing with chains, doubled when the load passes
 * one entry a bucket.
 */
#include "serve/fact_index.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct node {
    struct node *next;
    uint64_t hash;
    fact_index_entry e;
    char id[]; /* NUL-terminated */
} node;

struct fact_index {
    pthread_mutex_t mu;
    node **buckets;
    size_t n_buckets; /* a power of two */
    int64_t n, max;
};

/* FNV-1a: ids are short and already unique. */
static uint64_t id_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

is_status fact_index_create(int64_t max_entries, fact_index **out) {
    if (!out || max_entries < 1)
        return is_error_set(IS_ERR_INVALID_ARG, "fact_index_create: bad arguments");
    fact_index *x = calloc(1, sizeof *x);
    if (!x) return is_error_set(IS_ERR_NOMEM, "out of memory");
    x->n_buckets = 1024;
    x->buckets = calloc(x->n_buckets, sizeof *x->buckets);
    if (!x->buckets) {
        free(x);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    x->max = max_entries;
    pthread_mutex_init(&x->mu, NULL);
    *out = x;
    return IS_OK;
}

static void clear_locked(fact_index *x) {
    for (size_t b = 0; b < x->n_buckets; b++) {
        for (node *n = x->buckets[b], *nx; n; n = nx) {
            nx = n->next;
            free(n);
        }
        x->buckets[b] = NULL;
    }
    x->n = 0;
}

void fact_index_free(fact_index *x) {
    if (!x) return;
    clear_locked(x);
    free(x->buckets);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

static node *find_locked(fact_index *x, const char *id, uint64_t h) {
    for (node *n = x->buckets[h & (x->n_buckets - 1)]; n; n = n->next)
        if (n->hash == h && strcmp(n->id, id) == 0) return n;
    return NULL;
}

static void grow_locked(fact_index *x) {
    size_t nb = x->n_buckets * 2;
    node **b = calloc(nb, sizeof *b);
    if (!b) return; /* longer chains, still correct */
    for (size_t i = 0; i < x->n_buckets; i++) {
        for (node *n = x->buckets[i], *nx; n; n = nx) {
            nx = n->next;
            n->next = b[n->hash & (nb - 1)];
            b[n->hash & (nb - 1)] = n;
        }
    }
    free(x->buckets);
    x->buckets = b;
    x->n_buckets = nb;
}

bool fact_index_get(fact_index *x, const char *record, fact_index_entry *out) {
    if (!x || !record) return false;
    uint64_t h = id_hash(record);
    pthread_mutex_lock(&x->mu);
    node *n = find_locked(x, record, h);
    if (n) *out = n->e;
    pthread_mutex_unlock(&x->mu);
    return n != NULL;
}

void fact_index_put(fact_index *x, const char *record, const fact_index_entry *e) {
    if (!x || !record || !e) return;
    uint64_t h = id_hash(record);
    size_t len = strlen(record);
    pthread_mutex_lock(&x->mu);
    node *n = find_locked(x, record, h);
    if (n) {
        n->e = *e;
    } else {
        if (x->n >= x->max) clear_locked(x);
        if ((size_t)x->n >= x->n_buckets) grow_locked(x);
        if ((n = malloc(sizeof *n + len + 1))) {
            n->hash = h;
            n->e = *e;
            memcpy(n->id, record, len + 1);
            size_t b = h & (x->n_buckets - 1);
            n->next = x->buckets[b];
            x->buckets[b] = n;
            x->n++;
        }
    }
    pthread_mutex_unlock(&x->mu);
}

void fact_index_set_resident(fact_index *x, const char *record, bool resident) {
    if (!x || !record) return;
    uint64_t h = id_hash(record);
    pthread_mutex_lock(&x->mu);
    node *n = find_locked(x, record, h);
    if (n) n->e.resident = resident;
    pthread_mutex_unlock(&x->mu);
}

int64_t fact_index_size(fact_index *x) {
    if (!x) return 0;
    pthread_mutex_lock(&x->mu);
    int64_t n = x->n;
    pthread_mutex_unlock(&x->mu);
    return n;
}

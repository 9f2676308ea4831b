/*
 * host_tier: pinned records between the GPU arena and the disk (see
 * host_tier.h).
 *
 * Blocks: class c holds 2^c bytes (c >= HT_MIN_CLASS). Free blocks of a
 * class are a stack threaded through their own first bytes (the memory is
 * ours and unused), so the allocator needs no memory of its own. New
 * blocks are carved from the current chunk; a chunk's tail too small for
 * the next block is carved into smaller free blocks, so nothing is lost.
 * When the bound is reached the least recently used unheld record whose
 * block is at least the size wanted is evicted (a scan: a miss reads
 * megabytes from disk anyway), and a larger block is split in halves down
 * to the size, the other halves freed.
 */
#include "kv/host_tier.h"

#include "core/status.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HT_MIN_CLASS   16 /* 64 KiB */
#define HT_MAX_CLASS   40 /* 1 TiB: more than any record */
#define HT_CHUNK_BYTES ((size_t)256 << 20)

typedef struct ht_entry ht_entry;
struct ht_entry {
    fact_kv kv; /* the view callers get; first, so a fact_kv* is an ht_entry* */
    char id[RECORD_STORE_ID_MAX + 1];
    void *block; /* 2^cls bytes; the record's file bytes at its start */
    int32_t cls;
    int32_t refs;    /* views not released (a loading entry: its loader's) */
    bool loading;    /* being read; waiters sleep on cv */
    uint64_t stamp;  /* last use, for eviction */
    ht_entry *hnext; /* hash chain */
};

struct host_tier {
    record_store *store;
    host_tier_alloc al;
    size_t max_bytes;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ht_entry **buckets;
    size_t n_buckets; /* power of two */
    int64_t n_entries;
    void *free_blocks[HT_MAX_CLASS + 1]; /* stacks */
    void **chunks;
    size_t n_chunks, chunks_cap;
    uint8_t *cur; /* the current chunk's unused part */
    size_t cur_left;
    uint64_t clock;
    bool reused; /* take_block handed out an evicted record's memory */
    host_tier_stats st;
};

static size_t hash_id(const char *id) {
    size_t h = 1469598103934665603ull;
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 1099511628211ull;
    return h;
}

static ht_entry **slot_of(host_tier *t, const char *id) {
    ht_entry **p = &t->buckets[hash_id(id) & (t->n_buckets - 1)];
    while (*p && strcmp((*p)->id, id) != 0) p = &(*p)->hnext;
    return p;
}

static void grow_table(host_tier *t) {
    if ((size_t)t->n_entries < t->n_buckets) return;
    size_t nb = t->n_buckets * 2;
    ht_entry **b = calloc(nb, sizeof *b);
    if (!b) return; /* longer chains, still correct */
    for (size_t i = 0; i < t->n_buckets; i++)
        for (ht_entry *e = t->buckets[i], *next; e; e = next) {
            next = e->hnext;
            size_t h = hash_id(e->id) & (nb - 1);
            e->hnext = b[h];
            b[h] = e;
        }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = nb;
}

static void push_free(host_tier *t, void *block, int32_t cls) {
    *(void **)block = t->free_blocks[cls];
    t->free_blocks[cls] = block;
}

static void *pop_free(host_tier *t, int32_t cls) {
    void *b = t->free_blocks[cls];
    if (b) t->free_blocks[cls] = *(void **)b;
    return b;
}

/* The rest of the current chunk as free blocks, largest first. */
static void retire_chunk(host_tier *t) {
    for (int32_t c = HT_MAX_CLASS; c >= HT_MIN_CLASS; c--)
        while (t->cur_left >= ((size_t)1 << c)) {
            push_free(t, t->cur, c);
            t->cur += (size_t)1 << c;
            t->cur_left -= (size_t)1 << c;
        }
    t->cur_left = 0;
}

/* Unlinks an unheld entry and frees its block into its class. */
static void evict(host_tier *t, ht_entry *e) {
    ht_entry **p = slot_of(t, e->id);
    *p = e->hnext;
    t->n_entries--;
    t->st.records--;
    t->st.bytes_records -= (int64_t)1 << e->cls;
    t->st.evictions++;
    push_free(t, e->block, e->cls);
    free(e);
}

/* A block of class cls, or NULL when the bound leaves no room. Under mu.
 * *split: the class of an evicted record's block whose first 2^cls bytes
 * are returned; its other halves are the caller's to free once it has
 * quiesced (a device copy may still read them), else 0. */
static void *take_block(host_tier *t, int32_t cls, int32_t *split) {
    *split = 0;
    const size_t size = (size_t)1 << cls;
    void *b = pop_free(t, cls);
    if (b) return b;
    if (t->cur_left >= size) {
        b = t->cur;
        t->cur += size;
        t->cur_left -= size;
        return b;
    }
    size_t chunk = size > HT_CHUNK_BYTES ? size : HT_CHUNK_BYTES;
    if ((size_t)t->st.bytes_chunks + chunk > t->max_bytes)
        chunk = t->max_bytes - (size_t)t->st.bytes_chunks;
    if (chunk >= size && (size_t)t->st.bytes_chunks < t->max_bytes) {
        if (t->n_chunks == t->chunks_cap) {
            size_t nc = t->chunks_cap ? 2 * t->chunks_cap : 16;
            void **g = realloc(t->chunks, nc * sizeof *g);
            if (!g) return NULL;
            t->chunks = g;
            t->chunks_cap = nc;
        }
        void *mem = NULL;
        if (t->al.alloc(t->al.ud, chunk, &mem) == IS_OK && mem) {
            retire_chunk(t);
            t->chunks[t->n_chunks++] = mem;
            t->st.bytes_chunks += (int64_t)chunk;
            t->cur = (uint8_t *)mem + size;
            t->cur_left = chunk - size;
            return mem;
        }
        is_error_clear(); /* no more pinned memory: evict instead */
    }
    /* Room from the least recently used unheld record of this size or more
     * (a smaller class may have been freed meanwhile: try it first). */
    for (;;) {
        if ((b = pop_free(t, cls))) return b;
        ht_entry *victim = NULL;
        for (size_t i = 0; i < t->n_buckets; i++)
            for (ht_entry *e = t->buckets[i]; e; e = e->hnext)
                if (e->refs == 0 && !e->loading && e->cls >= cls &&
                    (!victim || e->stamp < victim->stamp))
                    victim = e;
        if (!victim) break;
        int32_t vc = victim->cls;
        uint8_t *vb = victim->block;
        evict(t, victim);
        t->reused = true;
        if (vc == cls) continue; /* it is on the free stack now */
        (void)pop_free(t, vc);   /* take it back; its other halves go after the quiesce */
        *split = vc;
        return vb;
    }
    /* Split a larger free block, if any. */
    for (int32_t c = cls + 1; c <= HT_MAX_CLASS; c++)
        if ((b = pop_free(t, c))) {
            for (int32_t d = c - 1; d >= cls; d--) push_free(t, (uint8_t *)b + ((size_t)1 << d), d);
            return b;
        }
    return NULL;
}

is_status host_tier_create(record_store *store, size_t max_bytes, host_tier_alloc al,
                           host_tier **out) {
    if (!store || !al.alloc || !al.free || max_bytes < ((size_t)1 << 20) || !out)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "host tier: needs a store, an allocator and >= 1 MiB");
    host_tier *t = calloc(1, sizeof *t);
    if (!t) return is_error_set(IS_ERR_NOMEM, "host tier: out of memory");
    t->n_buckets = 1024;
    t->buckets = calloc(t->n_buckets, sizeof *t->buckets);
    if (!t->buckets) {
        free(t);
        return is_error_set(IS_ERR_NOMEM, "host tier: out of memory");
    }
    t->store = store;
    t->al = al;
    t->max_bytes = max_bytes;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    *out = t;
    return IS_OK;
}

void host_tier_free(host_tier *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n_buckets; i++)
        for (ht_entry *e = t->buckets[i], *next; e; e = next) {
            next = e->hnext;
            IS_ASSERT(e->refs == 0 && !e->loading);
            free(e);
        }
    for (size_t i = 0; i < t->n_chunks; i++) t->al.free(t->al.ud, t->chunks[i]);
    free(t->chunks);
    free(t->buckets);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

/* record_store_read_into's buffer: the loading entry's block, sized now
 * that the file's length is known. */
typedef struct ht_load {
    host_tier *t;
    ht_entry *e;
} ht_load;

static int32_t class_of(size_t len) {
    int32_t c = HT_MIN_CLASS;
    while (c < HT_MAX_CLASS && ((size_t)1 << c) < len) c++;
    return c;
}

static void *load_alloc(void *ud, size_t len) {
    ht_load *l = ud;
    const int32_t cls = class_of(len);
    if (((size_t)1 << cls) < len) return NULL;
    pthread_mutex_lock(&l->t->mu);
    l->t->reused = false;
    int32_t split = 0;
    void *b = take_block(l->t, cls, &split);
    bool reused = l->t->reused;
    if (b) {
        l->e->block = b;
        l->e->cls = cls;
    }
    pthread_mutex_unlock(&l->t->mu);
    /* An evicted record may still be read by a device copy of a request
     * that gave it up: wait for those before the file overwrites it. */
    if (b && reused && l->t->al.quiesce) l->t->al.quiesce(l->t->al.ud);
    if (split) { /* only now may another load take (and overwrite) the rest */
        pthread_mutex_lock(&l->t->mu);
        for (int32_t c = split - 1; c >= cls; c--)
            push_free(l->t, (uint8_t *)b + ((size_t)1 << c), c);
        pthread_mutex_unlock(&l->t->mu);
    }
    return b;
}

static void load_release(void *ud, void *p) {
    ht_load *l = ud;
    pthread_mutex_lock(&l->t->mu);
    push_free(l->t, p, l->e->cls);
    l->e->block = NULL;
    pthread_mutex_unlock(&l->t->mu);
}

is_status host_tier_get(host_tier *t, const char *id, const fact_kv_meta *expected,
                        const fact_kv **out, bool *from_disk) {
    if (!record_store_id_valid(id))
        return is_error_set(IS_ERR_INVALID_ARG, "host tier: invalid record id");
    pthread_mutex_lock(&t->mu);
    ht_entry **p;
    while ((p = slot_of(t, id)) && *p && (*p)->loading) pthread_cond_wait(&t->cv, &t->mu);
    ht_entry *e = *p;
    if (e) {
        is_status st = expected ? fact_meta_check(&e->kv.meta, expected) : IS_OK;
        if (st == IS_OK) {
            e->refs++;
            e->stamp = ++t->clock;
            t->st.hits++;
            *out = &e->kv;
            if (from_disk) *from_disk = false;
        }
        pthread_mutex_unlock(&t->mu);
        return st;
    }
    e = calloc(1, sizeof *e);
    if (!e) {
        pthread_mutex_unlock(&t->mu);
        return is_error_set(IS_ERR_NOMEM, "host tier: out of memory");
    }
    snprintf(e->id, sizeof e->id, "%s", id);
    e->loading = true;
    e->refs = 1;
    *p = e;
    t->n_entries++;
    pthread_mutex_unlock(&t->mu);

    ht_load l = {t, e};
    void *buf = NULL;
    size_t len = 0;
    fact_kv kv;
    is_status st = record_store_read_into(t->store, id, expected, load_alloc, load_release, &l, &kv,
                                          &buf, &len);

    pthread_mutex_lock(&t->mu);
    e->loading = false;
    if (st == IS_OK) {
        e->kv = kv;
        e->stamp = ++t->clock;
        t->st.disk_reads++;
        t->st.records++;
        t->st.bytes_records += (int64_t)1 << e->cls;
        *out = &e->kv;
        if (from_disk) *from_disk = true;
        grow_table(t);
    } else {
        if (st == IS_ERR_NOMEM) t->st.no_room++;
        ht_entry **q = slot_of(t, id);
        IS_ASSERT(*q == e);
        *q = e->hnext;
        t->n_entries--;
        free(e);
    }
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return st;
}

void host_tier_release(host_tier *t, const fact_kv *kv) {
    if (!kv) return;
    ht_entry *e = (ht_entry *)kv;
    pthread_mutex_lock(&t->mu);
    IS_ASSERT(e->refs > 0);
    e->refs--;
    pthread_mutex_unlock(&t->mu);
}

host_tier_stats host_tier_get_stats(host_tier *t) {
    pthread_mutex_lock(&t->mu);
    host_tier_stats s = t->st;
    pthread_mutex_unlock(&t->mu);
    return s;
}

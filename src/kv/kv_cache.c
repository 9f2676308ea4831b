#include "kv/kv_cache.h"

#include "core/status.h"

#include <stdlib.h>
#include <string.h>

typedef struct kv_seq {
    bool alive;
    int32_t length;   /* positions held */
    int32_t n_blocks; /* entries used in blocks */
    int32_t cap;      /* entries allocated in blocks */
    int32_t *blocks;  /* [cap] block ids */
} kv_seq;

struct kv_cache {
    kv_cache_params p;
    int32_t *refcount;   /* [n_blocks] sequences referencing each block */
    int32_t *free_stack; /* [n_blocks] ids of free blocks, top at n_free-1 */
    int32_t n_free;
    kv_seq *seqs; /* [max_seqs] */
};

is_status kv_cache_create(kv_cache_params p, kv_cache **out) {
    if (p.n_layers <= 0 || p.n_kv_heads <= 0 || p.head_dim <= 0 || p.block_size <= 0 ||
        p.n_blocks <= 0 || p.max_seqs <= 0)
        return is_error_set(IS_ERR_INVALID_ARG, "kv cache: all sizes must be positive");
    kv_cache *c = calloc(1, sizeof *c);
    if (!c) return is_error_set(IS_ERR_NOMEM, "kv cache: out of memory");
    c->p = p;
    c->refcount = calloc((size_t)p.n_blocks, sizeof *c->refcount);
    c->free_stack = malloc((size_t)p.n_blocks * sizeof *c->free_stack);
    c->seqs = calloc((size_t)p.max_seqs, sizeof *c->seqs);
    if (!c->refcount || !c->free_stack || !c->seqs) {
        kv_cache_free(c);
        return is_error_set(IS_ERR_NOMEM, "kv cache: out of memory");
    }
    /* Lowest ids on top, so fresh caches hand out blocks 0, 1, 2... */
    for (int32_t i = 0; i < p.n_blocks; i++) c->free_stack[i] = p.n_blocks - 1 - i;
    c->n_free = p.n_blocks;
    *out = c;
    return IS_OK;
}

void kv_cache_free(kv_cache *c) {
    if (!c) return;
    if (c->seqs)
        for (int32_t i = 0; i < c->p.max_seqs; i++) free(c->seqs[i].blocks);
    free(c->seqs);
    free(c->refcount);
    free(c->free_stack);
    free(c);
}

kv_cache_params kv_cache_get_params(const kv_cache *c) { return c->p; }
int32_t kv_cache_free_blocks(const kv_cache *c) { return c->n_free; }

static kv_seq *seq_get(const kv_cache *c, int32_t seq) {
    IS_ASSERT(seq >= 0 && seq < c->p.max_seqs && c->seqs[seq].alive);
    return &c->seqs[seq];
}

is_status kv_seq_create(kv_cache *c, int32_t *seq_out) {
    for (int32_t i = 0; i < c->p.max_seqs; i++) {
        if (!c->seqs[i].alive) {
            kv_seq *s = &c->seqs[i];
            s->alive = true;
            s->length = 0;
            s->n_blocks = 0;
            *seq_out = i;
            return IS_OK;
        }
    }
    return is_error_set(IS_ERR_CONTEXT_FULL, "kv cache: all %d sequence slots are in use",
                        c->p.max_seqs);
}

static void block_release(kv_cache *c, int32_t b) {
    IS_ASSERT(c->refcount[b] > 0);
    if (--c->refcount[b] == 0) c->free_stack[c->n_free++] = b;
}

void kv_seq_free(kv_cache *c, int32_t seq) {
    kv_seq *s = seq_get(c, seq);
    for (int32_t i = 0; i < s->n_blocks; i++) block_release(c, s->blocks[i]);
    s->n_blocks = 0;
    s->length = 0;
    s->alive = false;
}

int32_t kv_seq_length(const kv_cache *c, int32_t seq) { return seq_get(c, seq)->length; }

static is_status seq_reserve_entries(kv_seq *s, int32_t n) {
    if (n <= s->cap) return IS_OK;
    int32_t cap = s->cap ? s->cap : 16;
    while (cap < n) cap *= 2;
    int32_t *b = realloc(s->blocks, (size_t)cap * sizeof *b);
    if (!b) return is_error_set(IS_ERR_NOMEM, "kv cache: out of memory");
    s->blocks = b;
    s->cap = cap;
    return IS_OK;
}

is_status kv_seq_grow(kv_cache *c, int32_t seq, int32_t n) {
    kv_seq *s = seq_get(c, seq);
    if (n < 0) return is_error_set(IS_ERR_INVALID_ARG, "kv cache: negative growth");
    int32_t bs = c->p.block_size;
    int64_t need_len = (int64_t)s->length + n;
    int64_t need_blocks = (need_len + bs - 1) / bs;
    int64_t extra = need_blocks - s->n_blocks;
    if (extra > c->n_free)
        return is_error_set(IS_ERR_CONTEXT_FULL, "kv cache: need %lld more blocks, %d free",
                            (long long)extra, c->n_free);
    is_status st = seq_reserve_entries(s, (int32_t)need_blocks);
    if (st != IS_OK) return st;
    for (int64_t i = 0; i < extra; i++) {
        int32_t b = c->free_stack[--c->n_free];
        c->refcount[b] = 1;
        s->blocks[s->n_blocks++] = b;
    }
    s->length = (int32_t)need_len;
    return IS_OK;
}

void kv_seq_truncate(kv_cache *c, int32_t seq, int32_t new_len) {
    kv_seq *s = seq_get(c, seq);
    IS_ASSERT(new_len >= 0);
    if (new_len >= s->length) return;
    int32_t bs = c->p.block_size;
    int32_t keep = (new_len + bs - 1) / bs;
    while (s->n_blocks > keep) block_release(c, s->blocks[--s->n_blocks]);
    s->length = new_len;
}

is_status kv_seq_share_prefix(kv_cache *c, int32_t dst, int32_t src, int32_t n) {
    kv_seq *d = seq_get(c, dst);
    kv_seq *s = seq_get(c, src);
    int32_t bs = c->p.block_size;
    if (n < 0 || n > s->length || n % bs != 0)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "kv cache: shared prefix of %d positions must be a multiple of "
                            "the block size %d and at most the source length %d",
                            n, bs, s->length);
    if (d->length != 0)
        return is_error_set(IS_ERR_INVALID_ARG, "kv cache: prefix target must be empty");
    int32_t nb = n / bs;
    is_status st = seq_reserve_entries(d, nb);
    if (st != IS_OK) return st;
    for (int32_t i = 0; i < nb; i++) {
        d->blocks[i] = s->blocks[i];
        c->refcount[s->blocks[i]]++;
    }
    d->n_blocks = nb;
    d->length = n;
    return IS_OK;
}

int32_t kv_cache_slot(const kv_cache *c, int32_t seq, int32_t pos) {
    const kv_seq *s = seq_get(c, seq);
    IS_ASSERT(pos >= 0 && pos < s->length);
    int32_t bs = c->p.block_size;
    return s->blocks[pos / bs] * bs + pos % bs;
}

void kv_cache_slots(const kv_cache *c, int32_t seq, int32_t pos, int32_t n, int32_t *out) {
    const kv_seq *s = seq_get(c, seq);
    IS_ASSERT(pos >= 0 && n >= 0 && pos + n <= s->length);
    const int32_t bs = c->p.block_size;
    for (int32_t i = 0; i < n;) {
        const int32_t p = pos + i, off = p % bs, run = bs - off < n - i ? bs - off : n - i;
        const int32_t first = s->blocks[p / bs] * bs + off;
        for (int32_t j = 0; j < run; j++) out[i + j] = first + j;
        i += run;
    }
}

const int32_t *kv_seq_blocks(const kv_cache *c, int32_t seq, int32_t *n_blocks) {
    const kv_seq *s = seq_get(c, seq);
    *n_blocks = s->n_blocks;
    return s->blocks;
}

bool kv_cache_check(const kv_cache *c) {
    int32_t nb = c->p.n_blocks;
    int32_t *count = calloc((size_t)nb, sizeof *count);
    if (!count) return false;
    bool ok = true;
    for (int32_t i = 0; i < c->p.max_seqs; i++) {
        const kv_seq *s = &c->seqs[i];
        if (!s->alive) continue;
        int32_t bs = c->p.block_size;
        if (s->n_blocks != (s->length + bs - 1) / bs) ok = false;
        for (int32_t j = 0; j < s->n_blocks; j++) {
            if (s->blocks[j] < 0 || s->blocks[j] >= nb) ok = false;
            else count[s->blocks[j]]++;
        }
    }
    for (int32_t i = 0; i < c->n_free; i++) {
        int32_t b = c->free_stack[i];
        if (b < 0 || b >= nb || count[b] != 0 || c->refcount[b] != 0) ok = false;
        else count[b] = -1; /* a block on the free list twice shows up below */
    }
    int32_t used = 0;
    for (int32_t b = 0; b < nb; b++) {
        if (count[b] > 0) {
            used++;
            if (count[b] != c->refcount[b]) ok = false;
        } else if (count[b] == 0 && c->refcount[b] != 0) {
            ok = false;
        }
    }
    if (used + c->n_free != nb) ok = false;
    free(count);
    return ok;
}

/*
 * strmap: open-addressing string -> int64 map (see strmap.h).
 */
#include "memory/strmap.h"

#include "core/status.h"

#include <stdlib.h>
#include <string.h>

/* FNV-1a, 64-bit, folded to 32: keys are short ids and words. */
static uint32_t strmap_hash(const char *key, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)key[i];
        h *= 1099511628211ull;
    }
    return (uint32_t)(h ^ (h >> 32));
}

void strmap_free(strmap *m) {
    free(m->slots);
    m->slots = NULL;
    m->cap = m->n = 0;
}

/* Index of `key`'s slot, or of the empty slot where it would go. */
static uint32_t strmap_find(const strmap *m, const char *key, size_t len, uint32_t h) {
    uint32_t mask = m->cap - 1;
    uint32_t i = h & mask;
    for (;;) {
        const strmap_slot *s = &m->slots[i];
        if (!s->key) return i;
        if (s->hash == h && s->len == len && memcmp(s->key, key, len) == 0) return i;
        i = (i + 1) & mask;
    }
}

is_status strmap_reserve(strmap *m, uint32_t n_more) {
    uint64_t want = (uint64_t)m->n + n_more;
    if (want * 2 <= m->cap) return IS_OK;
    uint64_t cap = m->cap ? m->cap : 16;
    while (want * 2 > cap) cap *= 2;
    if (cap > (1ull << 31)) return is_error_set(IS_ERR_NOMEM, "strmap: too many keys");
    strmap_slot *slots = calloc((size_t)cap, sizeof *slots);
    if (!slots) return is_error_set(IS_ERR_NOMEM, "strmap: out of memory");
    strmap old = *m;
    m->slots = slots;
    m->cap = (uint32_t)cap;
    for (uint32_t i = 0; i < old.cap; i++) {
        if (!old.slots[i].key) continue;
        uint32_t j = strmap_find(m, old.slots[i].key, old.slots[i].len, old.slots[i].hash);
        m->slots[j] = old.slots[i];
    }
    free(old.slots);
    return IS_OK;
}

bool strmap_get(const strmap *m, const char *key, size_t len, int64_t *val) {
    if (m->n == 0) return false;
    uint32_t i = strmap_find(m, key, len, strmap_hash(key, len));
    if (!m->slots[i].key) return false;
    if (val) *val = m->slots[i].val;
    return true;
}

void strmap_put(strmap *m, const char *key, size_t len, int64_t val) {
    IS_ASSERT(m->cap > 0 && len <= UINT32_MAX);
    uint32_t h = strmap_hash(key, len);
    uint32_t i = strmap_find(m, key, len, h);
    strmap_slot *s = &m->slots[i];
    if (!s->key) {
        IS_ASSERT(((uint64_t)m->n + 1) * 2 <= m->cap);
        m->n++;
    }
    s->key = key;
    s->len = (uint32_t)len;
    s->hash = h;
    s->val = val;
}

bool strmap_del(strmap *m, const char *key, size_t len) {
    if (m->n == 0) return false;
    uint32_t mask = m->cap - 1;
    uint32_t i = strmap_find(m, key, len, strmap_hash(key, len));
    if (!m->slots[i].key) return false;
    /* Backward shift: pull later entries of the probe run into the hole
     * unless their home slot lies cyclically in (hole, j]. */
    uint32_t j = i;
    for (;;) {
        m->slots[i].key = NULL;
        for (;;) {
            j = (j + 1) & mask;
            if (!m->slots[j].key) {
                m->n--;
                return true;
            }
            uint32_t home = m->slots[j].hash & mask;
            bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) break;
        }
        m->slots[i] = m->slots[j];
        i = j;
    }
}

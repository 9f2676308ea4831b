/*
 * strmap: a small open-addressing hash map from byte strings to int64_t,
 * for the memory index (fact ids, (tenant, user) partitions, interned filter
 * values) and BM25 (its vocabulary).
 *
 * The map does not own its keys: it stores the caller's pointer and length,
 * and the caller keeps the bytes alive (and unchanged) while the key is in
 * the map. Linear probing at load <= 1/2, deletion by backward shift (no
 * tombstones, so lookups never degrade after churn).
 *
 * Growing is separated from inserting so that callers can reserve room
 * first and then modify several structures without a failure half-way:
 * strmap_put() never allocates once strmap_reserve() has succeeded for it.
 *
 * Lookups are read-only: any number of threads may call strmap_get() at once
 * while no thread modifies the map.
 */
#ifndef IS_MEMORY_STRMAP_H
#define IS_MEMORY_STRMAP_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct strmap_slot {
    const char *key; /* NULL: empty slot */
    uint32_t len;    /* key bytes */
    uint32_t hash;   /* low 32 bits of the key's hash */
    int64_t val;
} strmap_slot;

typedef struct strmap {
    strmap_slot *slots; /* [cap]; cap a power of two, or 0 */
    uint32_t cap;
    uint32_t n; /* keys present */
} strmap;

/* A zeroed strmap is an empty map. Frees the slots (not the keys). */
void strmap_free(strmap *m);

/* Makes room for `n_more` new keys beyond the present ones. IS_ERR_NOMEM
 * (the map is unchanged). */
is_status strmap_reserve(strmap *m, uint32_t n_more);

/* The value of `key` into *val (when val is non-NULL); false if absent. */
bool strmap_get(const strmap *m, const char *key, size_t len, int64_t *val);

/* Sets key -> val. An existing key takes the new pointer and value. The
 * caller has reserved room (IS_ASSERT otherwise). */
void strmap_put(strmap *m, const char *key, size_t len, int64_t val);

/* Removes `key`; false if it was absent. */
bool strmap_del(strmap *m, const char *key, size_t len);

#endif

/*
 * io_pool: a few threads that run the items of a caller's batch beside it.
 *
 * A request names its facts all at once, and each fact that misses the
 * faster tiers costs a file read, a checksum and the start of a copy to
 * the GPU: on the submitting thread alone, k of them run one after another
 * while the other cores idle. io_pool_run spreads them over the pool's
 * threads and the caller's own, and returns when every item has run. The
 * caller always works on its own batch too, so a batch finishes even when
 * every pool thread is busy with other callers' batches.
 *
 * Threads: io_pool_run may be called from any number of threads at once.
 */
#ifndef IS_SERVE_IO_POOL_H
#define IS_SERVE_IO_POOL_H

#include "core/status.h"

#include <stdint.h>

typedef struct io_pool io_pool;

/* n_threads in [1, 256]. IS_ERR_INVALID_ARG, IS_ERR_NOMEM, IS_ERR_INTERNAL
 * (a thread could not start). */
is_status io_pool_create(int32_t n_threads, io_pool **out);
/* Waits for the threads; no io_pool_run may be running. NULL is a no-op. */
void io_pool_free(io_pool *p);

/* Runs fn(arg, i) once for every i in [0, n), on the pool's threads and
 * the caller's, in any order and at once; returns when all have returned.
 * p NULL or n < 2: on the caller's thread, in order. */
void io_pool_run(io_pool *p, void (*fn)(void *arg, int32_t i), void *arg, int32_t n);

#endif

/*
 * threads: see threads.h for why every thread must agree with OpenBLAS on
 * the thread count.
 */
#include "core/threads.h"

#include <cblas.h>
#include <omp.h>
#include <stdatomic.h>

/* The count and a generation that changes with each threads_init, so that
 * a thread attached to an earlier count attaches again. */
static atomic_int g_count;
static atomic_int g_generation;
static _Thread_local int t_generation; /* generation this thread attached to; 0: none */

int32_t threads_init(int32_t n) {
    if (n <= 0) n = omp_get_max_threads();
    if (n < 1) n = 1;
    openblas_set_num_threads(n);
    atomic_store(&g_count, n);
    atomic_fetch_add(&g_generation, 1);
    threads_attach();
    return n;
}

void threads_attach(void) {
    const int gen = atomic_load(&g_generation);
    if (gen == 0 || t_generation == gen) return;
    const int n = atomic_load(&g_count);
    if (omp_get_max_threads() != n) omp_set_num_threads(n);
    t_generation = gen;
}

int32_t threads_count(void) { return atomic_load(&g_count); }

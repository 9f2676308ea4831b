/*
 * threads: the thread count of the shared numerical libraries (OpenBLAS's
 * OpenMP build and libgomp), set once for the process.
 *
 * Why this exists: OpenBLAS keeps one process-wide thread count, and its
 * OpenMP build compares it on every multi-threaded call with the calling
 * thread's OpenMP default (omp_get_max_threads(), a per-thread value that
 * omp_set_num_threads changes for the calling thread only). When they
 * differ, the call resets the global count and resizes the per-thread
 * buffers another thread's GEMM may be using at that moment. A thread
 * started by the scheduler or libmicrohttpd has the OpenMP default of
 * every core, so with a count below the core count (-t 1 on two cores) the
 * engine thread and an HTTP thread embedding a query kept resetting it
 * under each other's GEMMs: garbage logits and embeddings, at random.
 *
 * The rule: threads_init() sets the count once, at start-up, before any
 * thread calls into BLAS; every thread calls threads_attach() before it
 * calls into BLAS or opens an OpenMP region, which gives it the same
 * OpenMP default once (a thread-local check afterwards), so no call ever
 * finds a difference to "repair". libgomp itself keeps a thread pool per
 * calling thread, so the embedder on an HTTP thread and the engine thread
 * never share one.
 */
#ifndef IS_CORE_THREADS_H
#define IS_CORE_THREADS_H

#include <stdint.h>

/* Sets the process's BLAS and OpenMP thread count: n > 0, or 0 for the
 * calling thread's OpenMP default (OMP_NUM_THREADS, else every core), and
 * attaches the calling thread. Meant to be called once, at start-up,
 * while no other thread is in BLAS; a later call with another count (a
 * test that runs several settings one after another) is allowed only at
 * such a quiet moment too, and every thread re-attaches to it. Returns
 * the count in force. */
int32_t threads_init(int32_t n);

/* Gives the calling thread the process's OpenMP default (once per thread
 * and per threads_init). Cheap enough to call at the top of every entry
 * into BLAS. Before any threads_init it does nothing. */
void threads_attach(void);

/* The count in force (0 before threads_init). */
int32_t threads_count(void);

#endif

/*
 * bench_timeline: every kernel, copy and memset the process runs between
 * timeline_begin and timeline_end, with its GPU start and end, from CUPTI's
 * activity records (which, unlike the backend's op profiler, neither
 * serialise the kernels nor put events between them: programmatic
 * dependent launches keep overlapping as served). bench_gpu -L.
 */
#ifndef IS_BENCH_TIMELINE_H
#define IS_BENCH_TIMELINE_H

#include <stdbool.h>
#include <stdint.h>

/* A kernel, copy or memset the GPU ran. */
typedef struct timeline_record {
    uint64_t start, end; /* ns, the GPU's clock */
    const char *name;    /* the kernel's (mangled) name, CUPTI's string, or
                          * "memcpy HtoD" / "memcpy DtoH" / "memcpy" / "memset" */
} timeline_record;

/* Starts recording; false (with a message on stderr) where CUPTI refuses. */
bool timeline_begin(void);

/* Now on the records' clock (ns): a host step placed among the records. */
uint64_t timeline_now(void);

/* Stops recording and returns the records since timeline_begin, sorted by
 * start (*out: the caller frees it); -1 where CUPTI failed. */
int timeline_end(timeline_record **out);

#endif

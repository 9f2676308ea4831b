/*
 * bench_timeline: CUPTI's concurrent-kernel, memcpy and memset activity records (see
 * bench_timeline.h). CUPTI hands filled buffers to buffer_done from its own
 * thread or at a flush; the records go into one growing array.
 */
#include "bench_timeline.h"

#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_BYTES ((size_t)8 << 20)
#define BUF_ALIGN 8

static timeline_record *g_k;
static size_t g_n, g_cap;
static bool g_failed;

static bool ok(CUptiResult r, const char *what) {
    if (r == CUPTI_SUCCESS) return true;
    const char *s = NULL;
    cuptiGetResultString(r, &s);
    fprintf(stderr, "bench_timeline: %s: %s\n", what, s ? s : "?");
    return false;
}

static void CUPTIAPI buffer_want(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(BUF_ALIGN, BUF_BYTES);
    *size = *buffer ? BUF_BYTES : 0;
    *max_records = 0; /* as many as fit */
}

static void CUPTIAPI buffer_done(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                 size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        timeline_record e;
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            /* The fields read here lead every version of the record. */
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            e = (timeline_record){k->start, k->end, k->name};
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            e = (timeline_record){m->start, m->end,
                                  m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "memcpy HtoD"
                                  : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "memcpy DtoH"
                                                                                   : "memcpy"};
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
            e = (timeline_record){m->start, m->end, "memset"};
        } else {
            continue;
        }
        if (g_n == g_cap) {
            size_t cap = g_cap ? 2 * g_cap : 4096;
            timeline_record *p = realloc(g_k, cap * sizeof *p);
            if (!p) {
                g_failed = true;
                break;
            }
            g_k = p;
            g_cap = cap;
        }
        g_k[g_n++] = e;
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        g_failed = true;
    free(buffer);
}

bool timeline_begin(void) {
    static bool registered;
    if (!registered) {
        if (!ok(cuptiActivityRegisterCallbacks(buffer_want, buffer_done), "register")) return false;
        registered = true;
    }
    g_n = 0;
    g_failed = false;
    return ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable") &&
           ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy") &&
           ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
}

uint64_t timeline_now(void) {
    uint64_t t = 0;
    cuptiGetTimestamp(&t);
    return t;
}

static int by_start(const void *a, const void *b) {
    const timeline_record *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

int timeline_end(timeline_record **out) {
    *out = NULL;
    bool good = ok(cuptiActivityFlushAll(1), "flush");
    good = ok(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disable") && good;
    good = ok(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY), "disable memcpy") && good;
    good = ok(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET), "disable memset") && good;
    if (!good || g_failed) {
        if (g_failed) fprintf(stderr, "bench_timeline: records lost (memory or CUPTI's drops)\n");
        return -1;
    }
    timeline_record *k = malloc((g_n ? g_n : 1) * sizeof *k);
    if (!k) return -1;
    memcpy(k, g_k, g_n * sizeof *k);
    qsort(k, g_n, sizeof *k, by_start);
    *out = k;
    return (int)g_n;
}

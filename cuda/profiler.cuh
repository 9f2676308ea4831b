/*
 * profiler: the backend's op profiler (backend_cuda_profile_begin/end in
 * backend_cuda.h): between begin and end, every op is bracketed by a pair
 * of CUDA events on the backend's stream; end waits and sums the GPU time
 * per kind of op. Off, an op costs one branch.
 */
#ifndef IS_CUDA_PROFILER_CUH
#define IS_CUDA_PROFILER_CUH

#include "backend_cuda.h"
#include "common.cuh"

/* Ops recorded per window; more are counted in cuda_op_profile.dropped. */
#define CUDA_PROFILER_MAX_OPS 16384

typedef struct cuda_profiler cuda_profiler;

/* Starts a window on stream s of device `device` (*p created at the first
 * call; its events are made once): waits for the stream, then, with
 * hold_ms > 0, holds the GPU busy that long so the ops queued meanwhile run
 * back to back. */
is_status cuda_profiler_begin(cuda_profiler **p, int32_t device, cudaStream_t s, double hold_ms);
/* Ends the window: waits for the stream and fills *out (zeros first).
 * IS_ERR_INVALID_ARG when no window is open. */
is_status cuda_profiler_end(cuda_profiler *p, int32_t device, cudaStream_t s, cuda_op_profile *out);
/* NULL: nothing. */
void cuda_profiler_free(cuda_profiler *p);

/* An op's start and end while a window is open: start returns the op's
 * index, or -1 (no window, or past the window's capacity), which stop
 * takes back. */
int32_t cuda_profiler_op_start(cuda_profiler *p, cudaStream_t s, cuda_op_kind kind);
void cuda_profiler_op_stop(cuda_profiler *p, cudaStream_t s, int32_t i);

/* Brackets one op with events while a window is open; declared right after
 * the op's begin so it covers everything the op queues. */
struct cuda_op_span {
    cuda_profiler *p;
    cudaStream_t s;
    int32_t i;
    cuda_op_span(cuda_profiler *prof, cudaStream_t stream, cuda_op_kind kind)
        : p(prof), s(stream), i(prof ? cuda_profiler_op_start(prof, stream, kind) : -1) {}
    ~cuda_op_span() {
        if (i >= 0) cuda_profiler_op_stop(p, s, i);
    }
};

#endif

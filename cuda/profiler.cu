/*
 * profiler: the backend's op profiler (see profiler.cuh).
 */
#include "profiler.cuh"

#include <stdlib.h>
#include <string.h>
#include <time.h>

struct cuda_profiler {
    bool on;         /* a window is open */
    cudaEvent_t *ev; /* [2 * CUDA_PROFILER_MAX_OPS]: each op's start and end */
    int32_t n;       /* ops recorded */
    int32_t dropped; /* ops past CUDA_PROFILER_MAX_OPS */
    uint8_t kind[CUDA_PROFILER_MAX_OPS];
    double t0; /* host clock at begin, ms */
};

static double host_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Keeps the GPU busy for `cycles` clocks: the ops queued meanwhile then run
 * back to back, so their events time the GPU alone, not the host. */
static __global__ void hold_kernel(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}

extern "C" const char *cuda_op_kind_name(cuda_op_kind k) {
    static const char *const names[CUDA_OP_N] = {
        "upload", "download", "copy",      "get_rows", "rmsnorm", "matmul",
        "rope",   "kv_store", "attention", "swiglu",   "add",     "inject",
    };
    return k >= 0 && k < CUDA_OP_N ? names[k] : "?";
}

is_status cuda_profiler_begin(cuda_profiler **pp, int32_t device, cudaStream_t s, double hold_ms) {
    CUDA_CHECK(cudaSetDevice(device));
    if (!*pp) {
        cuda_profiler *p = (cuda_profiler *)calloc(1, sizeof *p);
        cudaEvent_t *ev = (cudaEvent_t *)calloc(2 * CUDA_PROFILER_MAX_OPS, sizeof *ev);
        if (!p || !ev) {
            free(p);
            free(ev);
            return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory (profiler)");
        }
        for (int32_t i = 0; i < 2 * CUDA_PROFILER_MAX_OPS; i++) {
            cudaError_t e = cudaEventCreate(&ev[i]);
            if (e != cudaSuccess) {
                for (int32_t j = 0; j < i; j++) cudaEventDestroy(ev[j]);
                free(ev);
                free(p);
                return cuda_status_from(e, "cudaEventCreate", __FILE__, __LINE__);
            }
        }
        p->ev = ev;
        *pp = p;
    }
    cuda_profiler *p = *pp;
    CUDA_CHECK(cudaStreamSynchronize(s));
    p->n = 0;
    p->dropped = 0;
    p->on = true;
    p->t0 = host_ms();
    if (hold_ms > 0) {
        int khz = 0;
        CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
        hold_kernel<<<1, 1, 0, s>>>((long long)(hold_ms * khz));
        CUDA_CHECK_LAUNCH();
    }
    return IS_OK;
}

is_status cuda_profiler_end(cuda_profiler *p, int32_t device, cudaStream_t s,
                            cuda_op_profile *out) {
    memset(out, 0, sizeof *out);
    if (!p || !p->on) return is_error_set(IS_ERR_INVALID_ARG, "cuda profiler: not started");
    p->on = false;
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaStreamSynchronize(s));
    out->wall_ms = host_ms() - p->t0;
    out->dropped = p->dropped;
    for (int32_t i = 0; i < p->n; i++) {
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]));
        out->count[p->kind[i]]++;
        out->gpu_ms[p->kind[i]] += ms;
        out->busy_ms += ms;
    }
    if (p->n > 0) {
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, p->ev[0], p->ev[2 * p->n - 1]));
        out->span_ms = ms;
    }
    return IS_OK;
}

void cuda_profiler_free(cuda_profiler *p) {
    if (!p) return;
    for (int32_t i = 0; i < 2 * CUDA_PROFILER_MAX_OPS; i++) cudaEventDestroy(p->ev[i]);
    free(p->ev);
    free(p);
}

int32_t cuda_profiler_op_start(cuda_profiler *p, cudaStream_t s, cuda_op_kind kind) {
    if (!p->on) return -1;
    if (p->n >= CUDA_PROFILER_MAX_OPS) {
        p->dropped++;
        return -1;
    }
    const int32_t i = p->n++;
    p->kind[i] = (uint8_t)kind;
    cudaEventRecord(p->ev[2 * i], s);
    return i;
}

void cuda_profiler_op_stop(cuda_profiler *p, cudaStream_t s, int32_t i) {
    cudaEventRecord(p->ev[2 * i + 1], s);
}

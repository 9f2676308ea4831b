/*
 * backend_cuda: the CUDA backend, behind the same interface as the CPU one
 * (backend/backend.h) and tested op by op against it
 * (tests/cuda/test_cuda_ops.c).
 *
 * Representation: matrices in bf16 [rows][cols] (any GGUF type the CPU side
 * reads is dequantised on the host and rounded to nearest even), vectors
 * (norm gains, biases) in f32; activations in f32 device memory, as the
 * interface passes f32 pointers; the KV cache in f32 or bf16 (option kv,
 * options.h; with bf16, injected facts live in a device arena, bf16 too). Matrix products convert the
 * input rows to bf16 and call cuBLAS (bf16 operands, f32 accumulation and
 * output); by default each input row goes in as two bf16 rows, hi + lo
 * (CUDA_MATMUL_BF16X2, options.h). The other ops are kernels of this
 * folder, one .cu/.cuh pair per family. Everything runs in order on one stream: ops return before the
 * GPU has finished, download and sync wait for it.
 *
 * RMSNorm and SwiGLU also write their output's bf16 rows, so the matrix
 * product that follows skips its conversion pass (option fused_convert;
 * results are identical either way).
 *
 * Host arrays that ops take (token ids, positions, slots, block tables,
 * segment ids) are copied into device scratch on each call; a call whose
 * array equals the previous one's (the same attention metadata for every
 * layer) skips the copy.
 *
 * Errors: ops return void in the interface, so the first failing CUDA or
 * cuBLAS call of an op (or an injected fault, backend_fault_arm) is latched
 * (and printed once to stderr); from then on ops do nothing, and the
 * status op (no wait) and backend_cuda_check (after a wait) return the
 * failure, until the recover op finds the device usable again (a sticky
 * CUDA error never is: only a new process recovers from it). Memory and
 * weight functions return their status directly.
 *
 * Built for sm_90 (H100/H200) only; backend_cuda_available says whether this
 * machine can run it.
 */
#ifndef IS_CUDA_BACKEND_CUDA_H
#define IS_CUDA_BACKEND_CUDA_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend/backend.h"
#include "options.h"

/* True when a CUDA driver is present and some device can run this build's
 * kernels. Never fails: false (and no message) without a GPU or driver. */
bool backend_cuda_available(void);

/* Creates a backend on `device`, configured by the defaults and then
 * $IS_CUDA_OPTIONS (options.h). IS_ERR_UNSUPPORTED without a usable device
 * (no driver, no such device, no kernel image for it), IS_ERR_INVALID_ARG
 * for a bad IS_CUDA_OPTIONS list (the message names the item), IS_ERR_NOMEM,
 * IS_ERR_INTERNAL for another CUDA or cuBLAS failure; *out is unchanged on
 * failure. Free with be->ops->free(be). */
is_status backend_cuda_create(int32_t device, backend **out);

/* The backend's configuration (options.h: the keys, their defaults, the
 * IS_CUDA_OPTIONS environment variable read at creation).
 * backend_cuda_configure applies a "key=value,..." list (IS_ERR_INVALID_ARG naming a bad item,
 * nothing changed); backend_cuda_options reads the whole configuration.
 * Each backend has its own: two backends of a process never share one.
 * A change of kv applies to engines created afterwards. */
is_status backend_cuda_configure(backend *be, const char *spec);
void backend_cuda_options(backend *be, cuda_options *out);

/* Capacity of the GPU fact-KV arena (arena.cuh), taken when the first
 * facts are injected (default 2 GiB, or half the free memory if less);
 * changing it drops the arena and what it holds. */
void backend_cuda_set_arena_bytes(backend *be, size_t bytes);

/* The most device memory the arena stages host-tier copies in at a time
 * (0: the default, the arena's bytes up to 1 GiB; a queue of copies larger
 * than it goes in parts). Tests set it to reach the parts; it drops the
 * arena as backend_cuda_set_arena_bytes does. */
void backend_cuda_set_staging_bytes(backend *be, size_t bytes);

/* The arena's element type: fp8 e4m3 with a scale per (token, layer, KV
 * head) (kv.cuh; half the bytes of bf16, so twice the facts resident), or
 * bf16 (the default). Injection dequantises in its one pass. Changing it
 * drops the arena and what it holds. */
void backend_cuda_set_arena_fp8(backend *be, bool fp8);

/* The device memory free now (cudaMemGetInfo), for sizing the arena from
 * what the weights and the KV pool leave; 0 on an error. */
size_t backend_cuda_free_bytes(backend *be);

typedef struct cuda_arena_stats {
    int64_t hits, misses, evictions; /* facts found resident, filled, dropped */
    int64_t bytes_uploaded;          /* host -> device for fills */
    int64_t records, pages_used, pages_total, page_bytes;
    int64_t prefetch_hits, prefetch_misses; /* host-tier prefetches: pinned resident, copied */
    int64_t staged_batches; /* host-tier copies staged: one an injection, more for a queue the
                               staging cannot hold at once */
} cuda_arena_stats;
/* Zeros when no arena exists yet. */
void backend_cuda_arena_stats(backend *be, cuda_arena_stats *out);

/* Op profiler, for finding where a forward pass spends its time: between
 * begin and end every op is bracketed by CUDA events (about a microsecond
 * each, so timings with it on are slightly pessimistic). end waits for the
 * stream and sums the GPU time per kind of op; busy_ms / span_ms says how
 * much of the GPU's span ran ops rather than waiting for the host (launch
 * overhead). At most 16384 ops per window (more are counted in dropped). */
typedef enum cuda_op_kind {
    CUDA_OP_UPLOAD,
    CUDA_OP_DOWNLOAD,
    CUDA_OP_COPY,
    CUDA_OP_GET_ROWS,
    CUDA_OP_RMSNORM,
    CUDA_OP_MATMUL,
    CUDA_OP_ROPE,
    CUDA_OP_KV_STORE,
    CUDA_OP_ATTENTION,
    CUDA_OP_SWIGLU,
    CUDA_OP_ADD,
    CUDA_OP_INJECT,
    CUDA_OP_N
} cuda_op_kind;

typedef struct cuda_op_profile {
    int64_t count[CUDA_OP_N];
    double gpu_ms[CUDA_OP_N];
    double busy_ms; /* sum over all ops */
    double span_ms; /* GPU time from the first op's start to the last op's end */
    double wall_ms; /* host clock from begin to end */
    int64_t dropped;
} cuda_op_profile;

const char *cuda_op_kind_name(cuda_op_kind k);
/* hold_ms > 0: the GPU first spins that long, so the ops queued meanwhile
 * run back to back and span_ms is the GPU's own time (a host that queues
 * slower than the GPU runs shows up as span_ms - busy_ms without it). */
is_status backend_cuda_profile_begin(backend *be, double hold_ms);
is_status backend_cuda_profile_end(backend *be, cuda_op_profile *out);

/* Waits for the backend's queued work and returns IS_OK, or the first
 * failure recorded by any op so far (its message set again for this
 * thread). `be` must be a CUDA backend. */
is_status backend_cuda_check(backend *be);

#ifdef __cplusplus
}
#endif

#endif

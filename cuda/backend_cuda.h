/*
 * backend_cuda: the CUDA backend, behind the same interface as the CPU one
 * (backend/backend.h) and tested op by op against it
 * (tests/cuda/test_cuda_ops.c).
 *
 * Representation: matrices in bf16 [rows][cols] (any GGUF type the CPU side
 * reads is dequantised on the host and rounded to nearest even), vectors
 * (norm gains, biases) in f32; activations in f32 device memory, as the
 * interface passes f32 pointers; the KV cache in f32 or bf16 (see
 * backend_cuda_set_kv_dtype; with bf16, injected facts live in a device
 * arena, bf16 too). Matrix products convert the
 * input rows to bf16 and call cuBLAS (bf16 operands, f32 accumulation and
 * output); by default each input row goes in as two bf16 rows, hi + lo
 * (CUDA_MATMUL_BF16X2, see below). The other ops are kernels of this
 * folder, one .cu/.cuh pair per family. Everything runs in order on one stream: ops return before the
 * GPU has finished, download and sync wait for it.
 *
 * RMSNorm and SwiGLU also write their output's bf16 rows, so the matrix
 * product that follows skips its conversion pass (IS_CUDA_NO_FUSED_CONVERT=1
 * in the environment when the backend is created turns this off, to measure
 * it; results are identical either way).
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

/* True when a CUDA driver is present and some device can run this build's
 * kernels. Never fails: false (and no message) without a GPU or driver. */
bool backend_cuda_available(void);

/* Creates a backend on `device`. IS_ERR_UNSUPPORTED without a usable device
 * (no driver, no such device, no kernel image for it), IS_ERR_NOMEM,
 * IS_ERR_INTERNAL for another CUDA or cuBLAS failure; *out is unchanged on
 * failure. Free with be->ops->free(be). */
is_status backend_cuda_create(int32_t device, backend **out);

/* How matrix products round their f32 input rows. Weights are bf16 either
 * way; a product accumulates in f32.
 *   CUDA_MATMUL_BF16X2 (default): each row x is split into hi = bf16(x) and
 *     lo = bf16(x - hi), and one GEMM over 2T columns gives W hi + W lo, so
 *     the input keeps about 16 bits: the weights' rounding is what is left.
 *     Same weight traffic (memory-bound decode costs the same), twice the
 *     arithmetic (compute-bound prefill takes up to twice as long).
 *   CUDA_MATMUL_BF16: x rounded to bf16, one GEMM over T columns.
 * On SmolLM2-135M a simulation of the two (docs/notes/cuda-diary.md) gives logits
 * within 4.8e-3 (BF16X2) and 9.8e-3 (BF16) of f32, relative L2, inside
 * the 1e-2 bar of the GPU tests. */
typedef enum cuda_matmul_precision {
    CUDA_MATMUL_BF16X2 = 0,
    CUDA_MATMUL_BF16 = 1,
} cuda_matmul_precision;

/* Sets the rounding of later matrix products. `be` must be a CUDA backend. */
void backend_cuda_set_matmul_precision(backend *be, cuda_matmul_precision p);

/* The KV cache's element type, for engines created afterwards (the engine
 * sizes its cache by it; an engine must not outlive a change):
 *   CUDA_KV_F32 (default): the CPU reference's type; attention in f32
 *     throughout (the per-(token, head) kernel); injected facts keep their
 *     f32 values (uploaded per call, as the engine's own staging does);
 *   CUDA_KV_BF16 (the serving configuration): half the bytes; plain causal
 *     batches run the tiled tensor-core attention (flash.cuh) where the
 *     shape allows it; facts are injected in one launch from the GPU fact-KV
 *     arena (bf16). Faster by 1.6-13x on the 8B shape (BENCHMARKS.md), less
 *     exact: on SmolLM2-135M the logits move from 4.8e-3 to 7.7e-3 of the
 *     CPU's (the GPU tests' bar is 1e-2), and injection lands at 6.7e-3 of the
 *     GPU's masked reference but 1.08e-2 of the CPU's (docs/notes/cuda-diary.md),
 *     which is why it is not the default. */
typedef enum cuda_kv_dtype {
    CUDA_KV_F32 = 0,
    CUDA_KV_BF16 = 1,
} cuda_kv_dtype;
void backend_cuda_set_kv_dtype(backend *be, cuda_kv_dtype t);

/* Tiled attention over a bf16 cache (default on); off: the per-(token,
 * head) kernel of attention.cuh on every batch. */
void backend_cuda_set_flash(backend *be, bool on);
/* Key splits of the tiled attention merged inside thread-block clusters
 * (default on, where the GPU fits them); off: always by a second kernel
 * over partial results in global memory (the first design). */
void backend_cuda_set_flash_clusters(backend *be, bool on);
/* The tiled attention's plans may walk the keys in tiles of 128 (two key
 * warps of 64, on wgmma) where the cost model finds it cheaper: a block
 * that walks several tiles pays each tile's fixed steps half as often
 * (default on; IS_CUDA_FLASH_WIDE=0 at creation off; off with clusters
 * off too); off: 64-key tiles only. */
void backend_cuda_set_flash_wide(backend *be, bool on);
/* The tiled attention's S = Q K^T and O += P V on wgmma (default on, where
 * the GPU runs sm_90a code: cuda/flash_wgmma.cu; IS_CUDA_FLASH_WGMMA=0
 * off); off: on mma.sync. */
void backend_cuda_set_flash_wgmma(backend *be, bool on);
/* Which products take the skinny kernel (cuda/skinny.cuh: weights streamed
 * into tensor-core fragments, column ranges summed inside a cluster) rather
 * than cuBLAS, among those whose weights have a multiple of 64 columns and
 * whose plan is one wave of blocks (so not the 8B head). Default
 * CUDA_SKINNY_DECODE: at most 8 GEMM columns (decode steps of up to 8
 * sequences, 4 with bf16x2 inputs; a one-sequence 8B decode step measured
 * 2.2% faster than on cuBLAS); CUDA_SKINNY_ALL: every
 * product of <= SKINNY_MAX_N columns (input rows, twice them with bf16x2
 * inputs; at 30 rows slower than cuBLAS); CUDA_SKINNY_OFF: none. The
 * environment picks at creation: IS_CUDA_SKINNY=0 (off), =1 (all). */
typedef enum cuda_skinny_mode {
    CUDA_SKINNY_OFF = 0,
    CUDA_SKINNY_DECODE = 1,
    CUDA_SKINNY_ALL = 2,
} cuda_skinny_mode;
void backend_cuda_set_skinny(backend *be, cuda_skinny_mode mode);
/* Forces the skinny kernel's column ranges (1-8; 0: its plan chooses), for
 * tests and benchmarks. IS_CUDA_SKINNY_SPLITS at creation. */
void backend_cuda_set_skinny_splits(backend *be, int32_t splits);
/* Products of up to 32 GEMM columns (input rows; twice them with bf16x2
 * inputs) that the skinny kernel does not take, on cuda/wgmma_gemm.cuh's
 * kernel (TMA + wgmma, weights streamed before its programmatic wait)
 * instead of cuBLAS, where it takes the shape (columns a multiple of 64; at
 * most 256 weight rows an SM, so not the 8B head) and the GPU is a Hopper.
 * Default on (a 30-token query's TTFT on the 8B shape 0.0-0.3 ms faster,
 * docs/notes/cuda-diary.md); IS_CUDA_WGMMA=0 at creation turns it off. */
void backend_cuda_set_wgmma(backend *be, bool on);
/* Launches the kernels that may (RMSNorm, RoPE + KV store, attention,
 * SwiGLU, the skinny products) as programmatic dependents of the kernel
 * before them, so each starts as the last one's blocks exit (default on;
 * IS_CUDA_PDL=0 at creation turns it off). Process-wide: it sets the launch
 * policy of every backend of the process. */
void backend_cuda_set_pdl(backend *be, bool on);
/* With PDL on, an attention op right after a RoPE + KV store op starts
 * before the store's kernel ends, and copies the key tiles written before
 * the forward ahead of its wait (default off: a trade within 2% on the 8B
 * shape; IS_CUDA_PDL_EARLY=1 at creation turns it on). Process-wide, as
 * backend_cuda_set_pdl. */
void backend_cuda_set_pdl_early(backend *be, bool on);
/* Products of stacked weights (q, k, v; gate, up) as one GEMM each
 * (matmul_n), default on; off: one product per weight, as before. The
 * environment picks at creation: IS_CUDA_STACKED=0 turns it off. */
void backend_cuda_set_stacked(backend *be, bool on);

/* The backend as first built (the baseline, kept for measuring):
 * f32 KV cache, per-(token, head) attention, no inject op (the engine
 * uploads facts layer by layer), matmul inputs converted on every call.
 * Off restores the defaults (f32 cache). Set before creating engines. */
void backend_cuda_set_legacy(backend *be, bool on);

/* CUDA graphs (default off: measured slower than no graphs on the 8B
 * shape; IS_CUDA_GRAPHS=1 in the environment when the backend is created,
 * or this setter: on). The engine brackets each decode step and short
 * prefill with graph_begin/graph_end (backend.h); the backend captures the
 * forward's kernels and copies on its stream and launches them as one
 * graph, reusing executable graphs of the same shape through
 * cudaGraphExecUpdate (a small cache, least recently used replaced). Host
 * arrays the ops take are copied into pinned memory while capturing, so
 * the graph reads them when it runs. Anything a capture cannot hold
 * (allocating or growing a buffer, waiting, inject, the setters) launches
 * what was recorded so far and runs the rest of the forward as usual (a
 * "break"). Results are the same kernels with the same arguments: bitwise
 * equal to graphs off. Off with the op profiler and in legacy mode. */
void backend_cuda_set_graphs(backend *be, bool on);

typedef struct cuda_graph_stats {
    int64_t recorded;       /* forwards captured (graph_begin returned true) */
    int64_t instantiations; /* executable graphs built (cudaGraphInstantiate) */
    int64_t updates;        /* cached executable graphs reused (cudaGraphExecUpdate) */
    int64_t breaks;         /* captures cut short (see above) */
    int64_t launches;       /* cudaGraphLaunch calls */
} cuda_graph_stats;
/* Counts since the backend was created. */
void backend_cuda_graph_stats(backend *be, cuda_graph_stats *out);

/* Capacity of the GPU fact-KV arena (arena.cuh), taken when the first
 * facts are injected (default 2 GiB, or half the free memory if less);
 * changing it drops the arena and what it holds. */
void backend_cuda_set_arena_bytes(backend *be, size_t bytes);

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
    CUDA_OP_UPLOAD, CUDA_OP_DOWNLOAD, CUDA_OP_COPY, CUDA_OP_GET_ROWS, CUDA_OP_RMSNORM,
    CUDA_OP_MATMUL, CUDA_OP_ROPE, CUDA_OP_KV_STORE, CUDA_OP_ATTENTION, CUDA_OP_SWIGLU,
    CUDA_OP_ADD, CUDA_OP_INJECT, CUDA_OP_N
} cuda_op_kind;

typedef struct cuda_op_profile {
    int64_t count[CUDA_OP_N];
    double gpu_ms[CUDA_OP_N];
    double busy_ms;  /* sum over all ops */
    double span_ms;  /* GPU time from the first op's start to the last op's end */
    double wall_ms;  /* host clock from begin to end */
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

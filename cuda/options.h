/*
 * options: the one configuration of the CUDA backend, parsed, validated and
 * printed here and nowhere else.
 *
 * A configuration is a list "key=value,key=value" (spaces around items are
 * ignored). It comes from a flag (`--cuda-opt` of serve and bench_load, `-O`
 * of bench_gpu; backend_configure) or, when the backend is created, from
 * the one environment variable IS_CUDA_OPTIONS, read by
 * cuda_options_from_env (the only getenv of the backend). Booleans take on|off (or 1|0). An
 * unknown key or value is an IS_ERR_INVALID_ARG that names it and lists what
 * is accepted, and leaves the options unchanged: a typo never silently
 * measures the default.
 *
 *   key            values          default  what
 *   precision      bf16x2 | bf16   bf16x2   matmul inputs split hi + lo, or rounded to bf16
 *   kv             f32 | bf16      f32      KV cache element type (engines created after)
 *   flash          on | off        on       tiled tensor-core attention over a bf16 cache
 *   clusters       on | off        on       its key splits merged inside clusters
 *   wide           on | off        on       its 128-key tiles where the plan finds them cheaper
 *   flash_wgmma    on | off        on       its products on wgmma (sm_90a), else mma.sync
 *   skinny         on | off        on       decode products (<= 8 GEMM columns) on skinny.cu
 *   skinny_splits  0 .. 8          0        force the skinny kernel's column ranges (0: plan)
 *   wgmma          on | off        on       products of 9-32 GEMM columns on wgmma_gemm.cu
 *   stacked        on | off        on       q, k, v and gate, up as one product each
 *   fused_convert  on | off        on       norms and SwiGLU write the next product's bf16 input
 *   pdl            on | off        on       small ops launched as programmatic dependents
 *
 * Plain C, no CUDA: the parser is tested everywhere (tests/cuda/test_cuda_options.c).
 */
#ifndef IS_CUDA_OPTIONS_H
#define IS_CUDA_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How matrix products round their f32 input rows. Weights are bf16 either
 * way; a product accumulates in f32.
 *   CUDA_MATMUL_BF16X2 (default): each row x is split into hi = bf16(x) and
 *     lo = bf16(x - hi), and one GEMM over 2T columns gives W hi + W lo, so
 *     the input keeps about 16 bits: the weights' rounding is what is left.
 *     Same weight traffic (memory-bound decode costs the same), twice the
 *     arithmetic (compute-bound prefill takes up to twice as long).
 *   CUDA_MATMUL_BF16: x rounded to bf16, one GEMM over T columns.
 * On SmolLM2-135M a simulation of the two (docs/notes/cuda-diary.md) gives
 * logits within 4.8e-3 (BF16X2) and 9.8e-3 (BF16) of f32, relative L2,
 * inside the 1e-2 bar of the GPU tests. */
typedef enum cuda_matmul_precision {
    CUDA_MATMUL_BF16X2 = 0,
    CUDA_MATMUL_BF16 = 1,
} cuda_matmul_precision;

/* The KV cache's element type, for engines created afterwards (the engine
 * sizes its cache by it; an engine must not outlive a change):
 *   CUDA_KV_F32 (default): the CPU reference's type; attention in f32
 *     throughout (the per-(token, head) kernel); injected facts keep their
 *     f32 values (uploaded per call, as the engine's own staging does);
 *   CUDA_KV_BF16 (the serving configuration, BACKEND_OPT_KV_COMPACT): half
 *     the bytes; plain causal batches run the tiled tensor-core attention
 *     (flash.cuh) where the shape allows it; facts are injected in one
 *     launch from the GPU fact-KV arena (bf16). Less exact: on SmolLM2-135M
 *     the logits move from 4.8e-3 to 7.7e-3 of the CPU's (the GPU tests' bar
 *     is 1e-2), which is why it is not the default. */
typedef enum cuda_kv_dtype {
    CUDA_KV_F32 = 0,
    CUDA_KV_BF16 = 1,
} cuda_kv_dtype;

typedef struct cuda_options {
    cuda_matmul_precision precision; /* precision */
    cuda_kv_dtype kv;                /* kv */
    bool flash;                      /* flash: tiled attention over a bf16 cache */
    bool flash_clusters;             /* clusters: its key splits merged in clusters, else by a
                                        second kernel over partial results */
    bool flash_wide;                 /* wide: its plans may take 128-key tiles */
    bool flash_wgmma;                /* flash_wgmma: its S and P V on wgmma where the GPU runs
                                        sm_90a code */
    bool skinny;                     /* skinny: products of <= 8 GEMM columns on skinny.cu where
                                        its plan is one wave of blocks */
    int32_t skinny_splits;           /* skinny_splits: 1-8 forces its column ranges; 0: plan */
    bool wgmma;                      /* wgmma: products of <= 32 GEMM columns the skinny kernel
                                        does not take on wgmma_gemm.cu where it takes the shape */
    bool stacked;                    /* stacked: stacked weights read by one product */
    bool fused_convert;              /* fused_convert: ops write the next product's bf16 input */
    bool pdl;                        /* pdl: programmatic dependent launch of the small ops */
} cuda_options;

/* The plainest configuration, as the backend was first built: an f32 KV
 * cache with the per-(token, head) attention, a product per weight, every
 * product on cuBLAS, matmul inputs converted by a pass of their own. The
 * "before" of the benchmarks (bench_gpu's configuration "legacy"). */
#define CUDA_OPTIONS_PLAINEST "kv=f32,flash=off,stacked=off,fused_convert=off,skinny=off,wgmma=off"

/* The defaults of the table above (each measured faster on the 8B shape,
 * BENCHMARKS.md, except kv, which the server sets to bf16). */
cuda_options cuda_options_default(void);

/* Applies spec ("key=value,..."; NULL or "" changes nothing) to *o. IS_OK,
 * or IS_ERR_INVALID_ARG with a message naming the item and what it accepts,
 * *o unchanged. */
is_status cuda_options_parse(cuda_options *o, const char *spec);

/* Applies $IS_CUDA_OPTIONS, where set, to *o (as cuda_options_parse; the
 * message says the list came from IS_CUDA_OPTIONS). */
is_status cuda_options_from_env(cuda_options *o);

/* Writes every key's value of o as one list that cuda_options_parse reads
 * back ("precision=bf16x2,kv=f32,..."), truncated to n bytes with its NUL;
 * returns the length the whole list needs, as snprintf. */
int cuda_options_format(const cuda_options *o, char *buf, size_t n);

/* The key table above, one line a key, for --help texts. */
const char *cuda_options_help(void);

#ifdef __cplusplus
}
#endif

#endif

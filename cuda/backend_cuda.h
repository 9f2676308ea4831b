/*
 * backend_cuda: the CUDA backend, behind the same interface as the CPU one
 * (backend/backend.h) and tested op by op against it
 * (tests/cuda/test_cuda_ops.c).
 *
 * Representation: matrices in bf16 [rows][cols] (any GGUF type the CPU side
 * reads is dequantised on the host and rounded to nearest even), vectors
 * (norm gains, biases) in f32; activations and the KV cache in f32 device
 * memory, as the interface passes f32 pointers. Matrix products convert the
 * input rows to bf16 and call cuBLAS (bf16 operands, f32 accumulation and
 * output); by default each input row goes in as two bf16 rows, hi + lo
 * (CUDA_MATMUL_BF16X2, see below). The other ops are kernels of this
 * folder, one .cu/.cuh pair per family. Everything runs in order on one stream: ops return before the
 * GPU has finished, download and sync wait for it.
 *
 * Host arrays that ops take (token ids, positions, slots, block tables,
 * segment ids) are copied into device scratch on each call; a call whose
 * array equals the previous one's (the same attention metadata for every
 * layer) skips the copy.
 *
 * Errors: ops return void in the interface, so the first failing CUDA or
 * cuBLAS call of an op is recorded (and printed once to stderr); from then
 * on ops do nothing and backend_cuda_check returns the failure. Memory and
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
 * On SmolLM2-135M a simulation of the two (cuda/NOTES.md) gives logits
 * within 4.8e-3 (BF16X2) and 9.8e-3 (BF16) of f32, relative L2; issue 6
 * asks for 1e-2. */
typedef enum cuda_matmul_precision {
    CUDA_MATMUL_BF16X2 = 0,
    CUDA_MATMUL_BF16 = 1,
} cuda_matmul_precision;

/* Sets the rounding of later matrix products. `be` must be a CUDA backend. */
void backend_cuda_set_matmul_precision(backend *be, cuda_matmul_precision p);

/* Waits for the backend's queued work and returns IS_OK, or the first
 * failure recorded by any op so far (its message set again for this
 * thread). `be` must be a CUDA backend. */
is_status backend_cuda_check(backend *be);

#ifdef __cplusplus
}
#endif

#endif

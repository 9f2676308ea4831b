/*
 * backend_cuda: the backend_ops table of the CUDA backend, its device
 * memory, weights and the per-call staging of host arrays (see
 * backend_cuda.h for the representation and the error model). The kernels
 * live in one .cu/.cuh pair per family; this file only launches them.
 */
extern "C" {
#include "backend/backend.h"
#include "core/status.h"
#include "gguf/tensor_type.h"
#include "gguf/quant.h"
}
#include "backend_cuda.h"
#include "weights_host.h"

#include "arena.cuh"
#include "argmax.cuh"
#include "attention.cuh"
#include "common.cuh"
#include "flash.cuh"
#include "elementwise.cuh"
#include "kv.cuh"
#include "norm.cuh"
#include "options.h"
#include "products.cuh"
#include "profiler.cuh"
#include "rope.cuh"
#include "skinny.cuh"
#include "wgmma_gemm.cuh"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The one allocation of stacked weights (weight_create_stacked), freed
 * with the last of them. */
typedef struct cuda_stack {
    void *data;
    int32_t refs;
} cuda_stack;

typedef struct cuda_weight {
    backend_weight base; /* shape; must stay first */
    bool bf16;           /* matrix in bf16, else f32 vector */
    void *data;          /* device [rows][cols] */
    cuda_stack *stack;   /* NULL: data is the weight's own allocation */
} cuda_weight;

/* A device buffer that receives a host array per call, and a host copy of
 * what it holds, so an identical array is not sent again. */
typedef struct dev_stage {
    void *dev;
    size_t cap;
    void *held; /* host copy of dev's first held_n bytes */
    size_t held_cap, held_n;
    bool valid;
} dev_stage;

#define ROPE_MAX_HALF          512
#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLAS's own default on Hopper */

/* A matmul input in bf16 ([2][T][cols] when split) and what it holds: the
 * conversion of src[0, n) (split or not); valid until an op writes memory
 * overlapping src (touch). */
typedef struct bf16_input {
    __nv_bfloat16 *buf;
    size_t cap; /* elements */
    const float *src;
    size_t n;
    bool split, valid;
} bf16_input;

/* An injection whose facts' copies are still on their way
 * (cuda_arena_stage): layer group g lands, and the injection's layers of it
 * run, just before the first attention over those layers' caches, so the
 * copy of the later groups runs while the earlier layers compute. Any op
 * other than the forward's lands and injects the rest first. */
typedef struct deferred_inject {
    bool active;
    int32_t next; /* the next group to land */
    float **kc;   /* host: the injection's key caches, to know an attention's layer */
    int32_t kc_cap;
    const void *dcaches; /* the injection's arguments (st_caches, st_inject) */
    const int32_t *dp;
    int32_t n, n_layers, n_kv_heads, head_dim, block_size, n_rot;
    bool neox;
} deferred_inject;

typedef struct cuda_ctx {
    backend *be; /* the backend this is the context of (its fault injection state) */
    int32_t device;
    cudaStream_t stream;
    cublasHandle_t cublas;
    is_status err; /* first failure of an op, latched until recover (backend.h) */
    char err_msg[512];

    cuda_options opt; /* the configuration (options.h); kv: for engines created after a change */
    int32_t n_sms;
    /* Matmul inputs in bf16. xbf: conversions, and the copies RMSNorm and
     * SwiGLU write beside their f32 output; gbf: the copy the fused gate/up
     * product + SwiGLU writes (it cannot write xbf, which it reads). Q, K
     * and V read the same normed rows, gate and up too: converted once
     * instead of 3 and 2 times. xin: the one the next product reads. */
    bf16_input xbf, gbf;
    const __nv_bfloat16 *xin;
    dev_stage st_tiles, st_inject, st_caches;
    int32_t *tiles;     /* host: flash query tiles being built, [n][FLASH_TILE_INTS] */
    size_t tiles_cap;   /* tiles */
    float *partial;     /* flash split partial results */
    size_t partial_cap; /* floats */
    cuda_arena *arena;
    size_t arena_bytes;   /* requested capacity (0 = default) */
    size_t staging_bytes; /* the arena's staging of host-tier copies (0 = default) */
    bool arena_fp8;       /* the arena's pages in fp8 e4m3 with scales (kv.cuh), else bf16 */
    /* The arena and its pointer: the host tier's threads prefetch into it
     * (fact_prefetch) while the engine thread injects from it. */
    pthread_mutex_t arena_mu;
    deferred_inject def; /* the engine thread's */
    float *inj_rows;     /* f32 cache injection: one layer's rows, [2][T][kv_dim] */
    size_t inj_rows_cap; /* floats */
    float *ypart;        /* split or stacked products before their sum or split: [2][T][rows] */
    size_t ypart_cap;    /* elements */
    dev_stage st_tokens, st_rope, st_slots, st_attn;
    int32_t *pack;   /* host: attention metadata being packed */
    size_t pack_cap; /* elements */
    /* host: an injection list reordered (order_facts): its facts, then its
     * slots and positions [2][T] */
    backend_fact *ord_facts;
    size_t ord_facts_cap; /* facts */
    int32_t *ord_tok;
    size_t ord_tok_cap; /* elements */

    /* cos/sin table, the CPU reference's: [rope_n_pos][n_rot/2][cos, sin]. */
    float *rope_host;
    float *rope_dev;
    int32_t rope_n_pos;
    int32_t rope_n_rot;
    float rope_base, rope_scale;
    bool rope_has_factors;
    float rope_factors[ROPE_MAX_HALF];

    cuda_profiler *prof; /* op profiler (profiler.cuh); NULL until first begun */
    int32_t *argmax_out; /* the argmax op's device results */
    size_t argmax_cap;
    void *cublas_ws; /* cuBLAS workspace of its own (recover writes it to test the device) */
} cuda_ctx;

static cuda_ctx *ctx_of(backend *be) { return (cuda_ctx *)be->ctx; }

static bool kv_bf16(const cuda_ctx *c) { return c->opt.kv == CUDA_KV_BF16; }
static bool split_inputs(const cuda_ctx *c) { return c->opt.precision == CUDA_MATMUL_BF16X2; }

/* An op is about to write [p, p + bytes): the cached matmul input
 * conversion is stale if it overlaps. */
static void touch(cuda_ctx *c, const void *p, size_t bytes) {
    for (bf16_input *in : {&c->xbf, &c->gbf}) {
        if (!in->valid) continue;
        const char *a = (const char *)p, *b = (const char *)in->src;
        if (a < b + in->n * sizeof(float) && b < a + bytes) in->valid = false;
    }
}

/* Memory may have been freed or reused: no bf16 input is known valid. */
static void inputs_stale(cuda_ctx *c) {
    c->xbf.valid = false;
    c->gbf.valid = false;
}

/* Records the first failure of an op; later ones are consequences. */
static void op_note(cuda_ctx *c, is_status st) {
    if (st == IS_OK || c->err != IS_OK) return;
    c->err = st;
    snprintf(c->err_msg, sizeof c->err_msg, "%s", is_error_last());
    fprintf(stderr, "cuda backend: %s (further ops are skipped)\n", c->err_msg);
}

static is_status deferred_run(cuda_ctx *c, int32_t last);

/* False once an op has failed (the stream's state is unknown from there),
 * or when this op is the injected fault (backend_fault_arm), which takes
 * the same path as a failing CUDA call. forward: one of the forward's ops
 * that neither read nor rewrite the injected facts' rows (everything but
 * attention reads or writes other rows or other memory), which may run
 * before a deferred injection's layers land; any other op lands them all. */
static bool op_begin_as(cuda_ctx *c, bool forward) {
    if (c->err != IS_OK) return false;
    if (backend_fault_tick(c->be)) {
        op_note(c, is_error_set(IS_ERR_INTERNAL, "cuda backend: injected fault at op %lld",
                                (long long)backend_op_count(c->be)));
        return false;
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) {
        op_note(c, cuda_status_from(e, "cudaSetDevice", __FILE__, __LINE__));
        return false;
    }
    if (!forward && c->def.active) {
        is_status st = deferred_run(c, CUDA_ARENA_GROUPS - 1);
        if (st != IS_OK) {
            op_note(c, st);
            return false;
        }
    }
    return true;
}

static bool op_begin(cuda_ctx *c) { return op_begin_as(c, false); }
static bool op_begin_forward(cuda_ctx *c) { return op_begin_as(c, true); }

/* Before an op over one layer's cache (it reads the injected rows, or a
 * recomputation rewrites some): that layer's deferred group lands, with
 * the groups before it, and their layers are injected. */
static bool land_for(cuda_ctx *c, const float *k_cache) {
    if (!c->def.active) return true;
    int32_t last = CUDA_ARENA_GROUPS - 1; /* not the injection's cache: everything lands */
    for (int32_t l = 0; l < c->def.n_layers; l++)
        if (c->def.kc[l] == k_cache) {
            last = cuda_arena_group_of(c->def.n_layers, l);
            break;
        }
    const is_status st = deferred_run(c, last);
    if (st != IS_OK) op_note(c, st);
    return st == IS_OK;
}

/* Brackets an op with the profiler's events (profiler.cuh). */
#define OP_SPAN(c, kind) cuda_op_span span((c)->prof, (c)->stream, (kind))

/* ---- staging of host arrays ---------------------------------------------- */

static is_status stage_upload(cuda_ctx *c, dev_stage *st, const void *src, size_t n,
                              const void **dev_out) {
    if (st->valid && st->held_n == n && memcmp(st->held, src, n) == 0) {
        *dev_out = st->dev;
        return IS_OK;
    }
    st->valid = false;
    if (n > st->cap) {
        size_t cap = n > 2 * st->cap ? n : 2 * st->cap;
        if (cap < 4096) cap = 4096;
        /* Queued kernels may still read the old buffer. */
        CUDA_CHECK(cudaStreamSynchronize(c->stream));
        CUDA_CHECK(cudaFree(st->dev));
        st->dev = NULL;
        st->cap = 0;
        CUDA_CHECK(cudaMalloc(&st->dev, cap));
        st->cap = cap;
    }
    if (n > st->held_cap) {
        void *p = realloc(st->held, st->cap);
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        st->held = p;
        st->held_cap = st->cap;
    }
    /* From pageable memory the copy is staged before the call returns, so
     * the caller may reuse src at once; it runs after the queued kernels. */
    CUDA_CHECK(cudaMemcpyAsync(st->dev, src, n, cudaMemcpyHostToDevice, c->stream));
    memcpy(st->held, src, n);
    st->held_n = n;
    st->valid = true;
    *dev_out = st->dev;
    return IS_OK;
}

static void stage_free(dev_stage *st) {
    cudaFree(st->dev);
    free(st->held);
    memset(st, 0, sizeof *st);
}

/* ---- memory ---------------------------------------------------------------- */

static is_status cu_alloc(backend *be, size_t bytes, void **out) {
    cuda_ctx *c = ctx_of(be);
    CUDA_CHECK(cudaSetDevice(c->device));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(e == cudaErrorMemoryAllocation ? IS_ERR_NOMEM : IS_ERR_INTERNAL,
                            "cuda backend: cannot allocate %zu bytes: %s", bytes,
                            cudaGetErrorString(e));
    }
    inputs_stale(c); /* the address may have held the converted rows' source */
    *out = p;
    return IS_OK;
}

static void cu_release(backend *be, void *ptr) {
    if (!ptr) return;
    cuda_ctx *c = ctx_of(be);
    /* A deferred injection still writes into its caches (ptr may be one):
     * it lands now, not into whatever cudaMalloc puts there next. */
    if (c->def.active && c->err == IS_OK && cudaSetDevice(c->device) == cudaSuccess)
        op_note(c, deferred_run(c, CUDA_ARENA_GROUPS - 1));
    inputs_stale(c);
    /* cudaFree waits for the device; queued kernels may still use ptr. */
    cudaError_t e = cudaFree(ptr);
    if (e != cudaSuccess) op_note(c, cuda_status_from(e, "cudaFree", __FILE__, __LINE__));
}

static void cu_upload(backend *be, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    if (!bytes || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_UPLOAD);
    touch(c, dst, bytes);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess)
        op_note(c, cuda_status_from(e, "cudaMemcpyAsync(upload)", __FILE__, __LINE__));
}

static void cu_download(backend *be, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    if (!bytes || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_DOWNLOAD);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) op_note(c, cuda_status_from(e, "download", __FILE__, __LINE__));
}

static void cu_copy(backend *be, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    if (!bytes || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_COPY);
    touch(c, dst, bytes);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream);
    if (e != cudaSuccess)
        op_note(c, cuda_status_from(e, "cudaMemcpyAsync(copy)", __FILE__, __LINE__));
}

static void cu_narrow(backend *be, void *dst, int32_t dtype, const float *x, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!n || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_COPY);
    touch(c, dst, n * (dtype == 0 ? 4 : 2));
    op_note(c, cuda_narrow(c->stream, dst, dtype, x, (int64_t)n));
}

static void cu_copy_2d(backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                       size_t width, size_t height) {
    cuda_ctx *c = ctx_of(be);
    if (!width || !height || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_COPY);
    touch(c, dst, dst_pitch * (height - 1) + width);
    cudaError_t e = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                      cudaMemcpyDeviceToDevice, c->stream);
    if (e != cudaSuccess) op_note(c, cuda_status_from(e, "cudaMemcpy2DAsync", __FILE__, __LINE__));
}

/* ---- weights --------------------------------------------------------------- */

static size_t weight_bytes(const cuda_weight *w) {
    return (size_t)(w->base.shape.rows * w->base.shape.cols) * (w->bf16 ? 2 : 4);
}

/* Converts t on the host and copies it to w->data, allocated here unless
 * the weight is part of a stack (already placed). */
static is_status weight_upload(cuda_ctx *c, cuda_weight *w, const gguf_tensor *t) {
    const size_t bytes = weight_bytes(w);
    void *host = malloc(bytes ? bytes : 1);
    if (!host) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory for '%s'", t->name);
    is_status st = w->bf16 ? cuda_host_weight_bf16(t, (uint16_t *)host)
                           : cuda_host_weight_f32(t, (float *)host);
    if (st == IS_OK) {
        cudaError_t e = w->stack ? cudaSuccess : cudaMalloc(&w->data, bytes ? bytes : 256);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(w->data, host, bytes, cudaMemcpyHostToDevice, c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) {
            cudaGetLastError();
            st = is_error_set(e == cudaErrorMemoryAllocation ? IS_ERR_NOMEM : IS_ERR_INTERNAL,
                              "cuda backend: cannot place tensor '%s' (%zu bytes): %s", t->name,
                              bytes, cudaGetErrorString(e));
        }
    }
    free(host);
    return st;
}

static is_status weight_check(const gguf_tensor *t) {
    if (t->n_dims > 2 || t->ne[2] != 1 || t->ne[3] != 1)
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda backend: tensor '%s' has %u dims", t->name,
                            t->n_dims);
    if (!quant_can_dequantize(t->type))
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda backend: tensor '%s' has unsupported type %u",
                            t->name, t->type);
    return IS_OK;
}

static is_status cu_weight_create(backend *be, const gguf_tensor *t, backend_weight **out) {
    cuda_ctx *c = ctx_of(be);
    is_status st0 = weight_check(t);
    if (st0 != IS_OK) return st0;
    CUDA_CHECK(cudaSetDevice(c->device));
    cuda_weight *w = (cuda_weight *)calloc(1, sizeof *w);
    if (!w) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    w->base.shape.cols = t->ne[0];
    w->base.shape.rows = t->ne[1];
    w->bf16 = t->ne[1] > 1; /* vectors (norm gains, biases) stay f32 */
    is_status st = weight_upload(c, w, t);
    if (st != IS_OK) {
        cudaFree(w->data);
        free(w);
        return st;
    }
    *out = &w->base;
    return IS_OK;
}

static void weight_release(cuda_weight *w) {
    if (!w->stack) {
        cudaFree(w->data);
    } else if (--w->stack->refs == 0) {
        cudaFree(w->stack->data);
        free(w->stack);
    }
    free(w);
}

static void cu_weight_free(backend *be, backend_weight *bw) {
    if (!bw) return;
    weight_release((cuda_weight *)bw);
}

/* One allocation, the matrices' rows one after the other: matmul_n reads
 * them with one GEMM, whose output it splits. */
static is_status cu_weight_create_stacked(backend *be, const gguf_tensor *const *ts, int32_t n,
                                          backend_weight **out) {
    cuda_ctx *c = ctx_of(be);
    if (n <= 0 || n > CUDA_SPLIT_MAX)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda backend: %d stacked weights (1..%d)", n,
                            CUDA_SPLIT_MAX);
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        is_status st = weight_check(ts[i]);
        if (st != IS_OK) return st;
        if (ts[i]->n_dims != 2 || ts[i]->ne[1] < 2 || ts[i]->ne[0] != ts[0]->ne[0])
            return is_error_set(
                IS_ERR_INVALID_ARG,
                "cuda backend: '%s' cannot be stacked with '%s' (widths %lld, %lld)", ts[i]->name,
                ts[0]->name, (long long)ts[i]->ne[0], (long long)ts[0]->ne[0]);
        total += (size_t)(ts[i]->ne[0] * ts[i]->ne[1]) * 2;
    }
    CUDA_CHECK(cudaSetDevice(c->device));
    cuda_stack *sk = (cuda_stack *)calloc(1, sizeof *sk);
    if (!sk) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    cudaError_t e = cudaMalloc(&sk->data, total);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(sk);
        return is_error_set(
            e == cudaErrorMemoryAllocation ? IS_ERR_NOMEM : IS_ERR_INTERNAL,
            "cuda backend: cannot place %d stacked tensors from '%s' (%zu bytes): %s", n,
            ts[0]->name, total, cudaGetErrorString(e));
    }
    is_status st = IS_OK;
    size_t off = 0;
    int32_t made = 0;
    cuda_weight *ws[CUDA_SPLIT_MAX];
    for (; made < n && st == IS_OK; made++) {
        cuda_weight *w = (cuda_weight *)calloc(1, sizeof *w);
        if (!w) {
            st = is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
            break;
        }
        w->base.shape.cols = ts[made]->ne[0];
        w->base.shape.rows = ts[made]->ne[1];
        w->bf16 = true;
        w->data = (char *)sk->data + off;
        w->stack = sk;
        sk->refs++;
        ws[made] = w;
        off += weight_bytes(w);
        st = weight_upload(c, w, ts[made]);
    }
    if (st != IS_OK) {
        for (int32_t i = 0; i < made; i++) weight_release(ws[i]); /* the last frees sk */
        if (made == 0) {
            cudaFree(sk->data);
            free(sk);
        }
        return st;
    }
    for (int32_t i = 0; i < n; i++) out[i] = &ws[i]->base;
    return IS_OK;
}

/* ---- ops --------------------------------------------------------------------- */

static is_status get_rows_impl(cuda_ctx *c, float *out, const cuda_weight *emb,
                               const int32_t *tokens, int32_t T) {
    if (T <= 0) return IS_OK;
    for (int32_t t = 0; t < T; t++) IS_ASSERT(tokens[t] >= 0 && tokens[t] < emb->base.shape.rows);
    const void *dtok;
    is_status st = stage_upload(c, &c->st_tokens, tokens, (size_t)T * sizeof(int32_t), &dtok);
    if (st != IS_OK) return st;
    return cuda_get_rows(c->stream, out, emb->data, emb->bf16, emb->base.shape.cols,
                         (const int32_t *)dtok, T);
}

static void cu_get_rows(backend *be, float *out, const backend_weight *emb, const int32_t *tokens,
                        int32_t T) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_GET_ROWS);
    touch(c, out, (size_t)T * ((const cuda_weight *)emb)->base.shape.cols * sizeof(float));
    op_note(c, get_rows_impl(c, out, (const cuda_weight *)emb, tokens, T));
}

static is_status scratch_reserve(cuda_ctx *c, void **buf, size_t *cap, size_t n, size_t size);

/* For an op about to write n floats: where to write their bf16 copy as well
 * (NULL: nowhere), in the layout the next matmul would convert them to.
 * produced() then records that xbf holds the copy of `out`. */
static __nv_bfloat16 *bf16_copy_of(cuda_ctx *c, size_t n, bool *split) {
    *split = split_inputs(c);
    if (!c->opt.fused_convert) return NULL;
    c->xbf.valid = false;
    if (scratch_reserve(c, (void **)&c->xbf.buf, &c->xbf.cap, *split ? 2 * n : n,
                        sizeof(__nv_bfloat16)) != IS_OK) {
        is_error_clear(); /* the matmul converts, and reports a failure of its own */
        return NULL;
    }
    return c->xbf.buf;
}

/* Records that in (xbf or gbf) holds the bf16 copy of out[0, n). */
static void produced_in(bf16_input *in, const float *out, size_t n, bool split, is_status st) {
    if (st != IS_OK) return;
    in->src = out;
    in->n = n;
    in->split = split;
    in->valid = true;
}

static void produced(cuda_ctx *c, const float *out, size_t n, bool split, is_status st) {
    produced_in(&c->xbf, out, n, split, st);
}

/* RMSNorm, after x += res when res is not NULL (add_rmsnorm). */
static void norm_op(backend *be, float *out, float *x, const float *res, const backend_weight *g,
                    int32_t T, int32_t n, float eps) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_RMSNORM);
    const cuda_weight *gw = (const cuda_weight *)g;
    IS_ASSERT(!gw->bf16 && gw->base.shape.cols == n);
    IS_ASSERT(!res || (x != out && x != res));
    const size_t total = (size_t)T * n;
    if (res) touch(c, x, total * sizeof(float));
    touch(c, out, total * sizeof(float));
    bool split;
    __nv_bfloat16 *obf = bf16_copy_of(c, total, &split);
    is_status st = cuda_add_rmsnorm(c->stream, out, x, res, (const float *)gw->data, T, n, eps, obf,
                                    split, c->opt.pdl);
    if (obf) produced(c, out, total, split, st);
    op_note(c, st);
}

static void cu_rmsnorm(backend *be, float *out, const float *x, const backend_weight *g, int32_t T,
                       int32_t n, float eps) {
    norm_op(be, out, (float *)x, NULL, g, T, n, eps); /* without res, x is only read */
}

static void cu_add_rmsnorm(backend *be, float *out, float *x, const float *res,
                           const backend_weight *g, int32_t T, int32_t n, float eps) {
    norm_op(be, out, x, res, g, T, n, eps);
}

/* Makes *buf hold at least n elements of `size` bytes. Queued work may
 * still read the old buffer, so growing waits for the stream. */
static is_status scratch_reserve(cuda_ctx *c, void **buf, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return IS_OK;
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaFree(*buf));
    *buf = NULL;
    *cap = 0;
    CUDA_CHECK(cudaMalloc(buf, n * size));
    *cap = n;
    return IS_OK;
}

/* Makes xin hold x[T][cols] in bf16 (hi then lo when split): xbf, unless it
 * already does. */
static is_status input_bf16(cuda_ctx *c, const float *x, int32_t T, int64_t cols, bool split) {
    const size_t x_n = (size_t)T * (size_t)cols;
    for (bf16_input *in : {&c->gbf, &c->xbf})
        if (in->valid && in->src == x && in->n == x_n && in->split == split) {
            c->xin = in->buf;
            return IS_OK;
        }
    c->xbf.valid = false;
    is_status st = scratch_reserve(c, (void **)&c->xbf.buf, &c->xbf.cap, split ? 2 * x_n : x_n,
                                   sizeof(__nv_bfloat16));
    if (st != IS_OK) return st;
    st = split ? cuda_f32_to_bf16_split(c->stream, c->xbf.buf, x, (int64_t)x_n)
               : cuda_f32_to_bf16(c->stream, c->xbf.buf, x, (int64_t)x_n);
    if (st != IS_OK) return st;
    produced_in(&c->xbf, x, x_n, split, IS_OK);
    c->xin = c->xbf.buf;
    return IS_OK;
}

/* out[n_cols][rows] = W xin^T, f32, on the kernel products.cuh chooses. */
static is_status gemm_bf16(cuda_ctx *c, float *out, const void *w, int64_t rows, int32_t n_cols,
                           int64_t cols) {
    return cuda_product_bf16(c->stream, c->cublas, &c->opt, out, w, c->xin, rows, n_cols, cols);
}

static is_status matmul_impl(cuda_ctx *c, float *y, const float *x, const cuda_weight *w,
                             const cuda_weight *bias, int32_t T) {
    if (T <= 0) return IS_OK;
    const int64_t rows = w->base.shape.rows, cols = w->base.shape.cols;
    const float one = 1.0f, zero = 0.0f;
    touch(c, y, (size_t)T * (size_t)rows * sizeof(float)); /* y never overlaps x */
    const float *bias_data = NULL;
    if (bias) {
        IS_ASSERT(!bias->bf16 && bias->base.shape.cols == rows);
        bias_data = (const float *)bias->data;
    }
    if (!w->bf16) {
        CUBLAS_CHECK(cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, T, (int)cols, &one,
                                 (const float *)w->data, (int)cols, x, (int)cols, &zero, y,
                                 (int)rows));
        return bias ? cuda_add_bias(c->stream, y, bias_data, T, rows) : IS_OK;
    }
    const bool split = split_inputs(c);
    const int32_t n_cols = split ? 2 * T : T; /* GEMM columns: input rows, hi then lo */
    is_status st = input_bf16(c, x, T, cols, split);
    if (st != IS_OK) return st;
    float *out = y;
    if (split) {
        st = scratch_reserve(c, (void **)&c->ypart, &c->ypart_cap, (size_t)n_cols * (size_t)rows,
                             sizeof(float));
        if (st != IS_OK) return st;
        out = c->ypart;
    }
    st = gemm_bf16(c, out, w->data, rows, n_cols, cols);
    if (st != IS_OK) return st;
    if (split) return cuda_sum_halves(c->stream, y, c->ypart, bias_data, T, rows);
    return bias ? cuda_add_bias(c->stream, y, bias_data, T, rows) : IS_OK;
}

static void cu_matmul(backend *be, float *y, const float *x, const backend_weight *w,
                      const backend_weight *bias, int32_t T) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_MATMUL);
    op_note(c, matmul_impl(c, y, x, (const cuda_weight *)w, (const cuda_weight *)bias, T));
}

/* Stacked weights (consecutive parts of one allocation, bf16) in one GEMM
 * into ypart, whose columns one kernel adds up (split halves), biases and
 * copies to the outputs. Anything else: a product each. Fewer, larger
 * products keep the memory busier at few rows: a small product's ramp and
 * tail leave it idle (a 30-token kv request on the 8B shape measured 6% faster). The
 * split moves 8 bytes a row and output column, which at many rows costs
 * more than that saves (a 1,280-token prompt 36.0 -> 38.4 ms; crossover
 * between 155 and 280 rows): past STACKED_MAX_T rows, a product each. */
#define STACKED_MAX_T 128

/* Whether ws[0..n) are consecutive parts of one stacked allocation that one
 * product at T rows should read (the conditions above); *rows: their sum. */
static bool stacked_one(const cuda_ctx *c, const cuda_weight *const *ws,
                        const cuda_weight *const *bs, int32_t n, int32_t T, int64_t *rows) {
    const int64_t cols = ws[0]->base.shape.cols;
    bool one = c->opt.stacked && T <= STACKED_MAX_T && n > 1 && n <= CUDA_SPLIT_MAX && ws[0]->stack;
    *rows = 0;
    for (int32_t i = 0; i < n && one; i++) {
        one = ws[i]->stack == ws[0]->stack && ws[i]->base.shape.cols == cols &&
              ws[i]->data == (const char *)ws[0]->data + (size_t)(*rows * cols) * 2 &&
              (!bs || !bs[i] || (!bs[i]->bf16 && bs[i]->base.shape.cols == ws[i]->base.shape.rows));
        *rows += ws[i]->base.shape.rows;
    }
    return one;
}

/* The stacked product into ypart ([2][T][rows] when split). */
static is_status stacked_product(cuda_ctx *c, const float *x, const cuda_weight *w0, int64_t rows,
                                 int32_t T) {
    const int64_t cols = w0->base.shape.cols;
    const bool split = split_inputs(c);
    const int32_t n_cols = split ? 2 * T : T;
    is_status st = input_bf16(c, x, T, cols, split);
    if (st == IS_OK)
        st = scratch_reserve(c, (void **)&c->ypart, &c->ypart_cap, (size_t)n_cols * (size_t)rows,
                             sizeof(float));
    if (st != IS_OK) return st;
    return gemm_bf16(c, c->ypart, w0->data, rows, n_cols, cols);
}

static is_status matmul_n_impl(cuda_ctx *c, float *const *ys, const float *x,
                               const cuda_weight *const *ws, const cuda_weight *const *bs,
                               int32_t n, int32_t T) {
    if (T <= 0) return IS_OK;
    int64_t rows;
    if (!stacked_one(c, ws, bs, n, T, &rows)) {
        for (int32_t i = 0; i < n; i++) {
            is_status st = matmul_impl(c, ys[i], x, ws[i], bs[i], T);
            if (st != IS_OK) return st;
        }
        return IS_OK;
    }
    cuda_split sp;
    sp.n = n;
    for (int32_t i = 0; i < n; i++) {
        touch(c, ys[i], (size_t)T * (size_t)ws[i]->base.shape.rows * sizeof(float));
        sp.out[i].y = ys[i];
        sp.out[i].bias = bs[i] ? (const float *)bs[i]->data : NULL;
        sp.out[i].rows = ws[i]->base.shape.rows;
    }
    is_status st = stacked_product(c, x, ws[0], rows, T);
    if (st != IS_OK) return st;
    return cuda_split_columns(c->stream, &sp, c->ypart, rows, T, split_inputs(c));
}

static void cu_matmul_n(backend *be, float *const *ys, const float *x,
                        const backend_weight *const *ws, const backend_weight *const *bs, int32_t n,
                        int32_t T) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_MATMUL);
    op_note(c, matmul_n_impl(c, ys, x, (const cuda_weight *const *)ws,
                             (const cuda_weight *const *)bs, n, T));
}

/* SwiGLU straight from the stacked product of gate and up (no split: one
 * launch and two passes over [T][2 ffn] floats fewer a layer), or in the
 * product's kernel (bf16 inputs of at most 32 rows on the wgmma kernel);
 * otherwise matmul_n and swiglu. The same bits every way. */
static is_status matmul_swiglu_impl(cuda_ctx *c, float *out, float *up_scratch, const float *x,
                                    const cuda_weight *wg, const cuda_weight *wu, int32_t T) {
    if (T <= 0) return IS_OK;
    const cuda_weight *ws[2] = {wg, wu};
    const int64_t ffn = wg->base.shape.rows;
    const size_t n = (size_t)T * (size_t)ffn;
    int64_t rows;
    const bool one = wu->base.shape.rows == ffn && stacked_one(c, ws, NULL, 2, T, &rows);
    is_status st;
    const int64_t cols = wg->base.shape.cols;
    /* bf16 inputs where the stacked product would be on the wgmma kernel
     * (not a decode step's, on the skinny one): the product and SwiGLU in
     * one kernel (cuda_wgmma_swiglu: the same bits as the two below). */
    if (one && c->opt.fused_convert && c->opt.precision == CUDA_MATMUL_BF16 &&
        cuda_product_on(&c->opt, T, rows, cols, NULL) == CUDA_PRODUCT_WGMMA &&
        cuda_wgmma_swiglu_supports(T, ffn, cols) && cuda_aligned16(wg->data)) {
        st = input_bf16(c, x, T, cols, false);
        if (st != IS_OK) return st;
        if (c->xin != c->gbf.buf) {
            c->gbf.valid = false;
            st = scratch_reserve(c, (void **)&c->gbf.buf, &c->gbf.cap, n, sizeof(__nv_bfloat16));
            if (st != IS_OK) return st;
            touch(c, out, n * sizeof(float));
            st = cuda_wgmma_swiglu(c->stream, out, c->gbf.buf, (const __nv_bfloat16 *)wg->data,
                                   c->xin, T, ffn, cols, c->opt.pdl);
            produced_in(&c->gbf, out, n, false, st);
            return st;
        }
    }
    if (one) {
        st = stacked_product(c, x, wg, rows, T);
    } else {
        float *ys[2] = {out, up_scratch};
        const cuda_weight *bs[2] = {NULL, NULL};
        st = matmul_n_impl(c, ys, x, ws, bs, 2, T);
    }
    if (st != IS_OK) return st;
    touch(c, out, n * sizeof(float));
    bool split;
    __nv_bfloat16 *obf = bf16_copy_of(c, n, &split);
    st = one ? cuda_swiglu_stacked(c->stream, out, c->ypart, ffn, T, split_inputs(c), obf, split,
                                   c->opt.pdl)
             : cuda_swiglu(c->stream, out, out, up_scratch, (int64_t)n, obf, split);
    if (obf) produced(c, out, n, split, st);
    return st;
}

static void cu_matmul_swiglu(backend *be, float *out, float *up_scratch, const float *x,
                             const backend_weight *w_gate, const backend_weight *w_up, int32_t T) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_MATMUL);
    op_note(c, matmul_swiglu_impl(c, out, up_scratch, x, (const cuda_weight *)w_gate,
                                  (const cuda_weight *)w_up, T));
}

/* Makes the cos/sin table cover positions [0, max_pos], built as the CPU
 * reference builds its own (cpu_backend.c, rope_table): f32 inverse
 * frequencies, angle and cos/sin in double, rounded to f32. */
static is_status rope_table(cuda_ctx *c, const rope_params *rp, int32_t max_pos) {
    const int32_t half = rp->n_rot / 2;
    IS_ASSERT(half > 0 && half <= ROPE_MAX_HALF);
    bool same = c->rope_host && c->rope_n_rot == rp->n_rot && c->rope_base == rp->freq_base &&
                c->rope_scale == rp->freq_scale &&
                c->rope_has_factors == (rp->freq_factors != NULL);
    if (same && rp->freq_factors)
        same = memcmp(c->rope_factors, rp->freq_factors, (size_t)half * sizeof(float)) == 0;
    if (same && max_pos < c->rope_n_pos) return IS_OK;
    const int32_t from = same ? c->rope_n_pos : 0;
    /* Doubling only extends a table of the same parameters: a table rebuilt
     * for other ones starts from what is asked (doubling there made every
     * change of parameters double the table, so a process that alternated
     * them, as the op tests do, spent minutes computing billions of rows). */
    const int32_t grown = same ? 2 * c->rope_n_pos : 0;
    int32_t n = max_pos + 1 > grown ? max_pos + 1 : grown;
    if (n < 4096) n = 4096;
    const size_t bytes = (size_t)n * half * 2 * sizeof(float);
    float *cs = (float *)realloc(c->rope_host, bytes);
    if (!cs) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory (rope table)");
    c->rope_host = cs;
    c->rope_n_pos = 0; /* invalid until rebuilt and uploaded */
    float inv[ROPE_MAX_HALF];
    for (int32_t i = 0; i < half; i++) {
        inv[i] = 1.0f / powf(rp->freq_base, (float)(2 * i) / (float)rp->n_rot);
        if (rp->freq_factors) inv[i] /= rp->freq_factors[i];
    }
    for (int32_t p = from; p < n; p++) {
        double pp = (double)p * (double)rp->freq_scale;
        for (int32_t i = 0; i < half; i++) {
            double theta = pp * (double)inv[i];
            cs[((size_t)p * half + i) * 2] = (float)cos(theta);
            cs[((size_t)p * half + i) * 2 + 1] = (float)sin(theta);
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* queued ropes may read the old table */
    CUDA_CHECK(cudaFree(c->rope_dev));
    c->rope_dev = NULL;
    CUDA_CHECK(cudaMalloc(&c->rope_dev, bytes));
    CUDA_CHECK(cudaMemcpyAsync(c->rope_dev, cs, bytes, cudaMemcpyHostToDevice, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->rope_n_pos = n;
    c->rope_n_rot = rp->n_rot;
    c->rope_base = rp->freq_base;
    c->rope_scale = rp->freq_scale;
    c->rope_has_factors = rp->freq_factors != NULL;
    if (rp->freq_factors) memcpy(c->rope_factors, rp->freq_factors, (size_t)half * sizeof(float));
    return IS_OK;
}

/* The table covering every |pos[t]|, and the positions on the device. */
static is_status rope_prepare(cuda_ctx *c, const rope_params *rp, int32_t head_dim,
                              const int32_t *pos, int32_t T, const void **dpos) {
    IS_ASSERT(rp->n_rot > 0 && rp->n_rot % 2 == 0 && rp->n_rot <= head_dim);
    int32_t max_pos = 0;
    for (int32_t t = 0; t < T; t++) {
        IS_ASSERT(pos[t] != INT32_MIN);
        int32_t ap = pos[t] < 0 ? -pos[t] : pos[t];
        if (ap > max_pos) max_pos = ap;
    }
    is_status st = rope_table(c, rp, max_pos);
    if (st != IS_OK) return st;
    return stage_upload(c, &c->st_rope, pos, (size_t)T * sizeof(int32_t), dpos);
}

static is_status rope_impl(cuda_ctx *c, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                           int32_t head_dim, const rope_params *rp) {
    if (T <= 0) return IS_OK;
    const void *dpos;
    is_status st = rope_prepare(c, rp, head_dim, pos, T, &dpos);
    if (st != IS_OK) return st;
    return cuda_rope(c->stream, x, (const int32_t *)dpos, T, n_heads, head_dim, rp->n_rot,
                     rp->layout == ROPE_LAYOUT_NEOX, c->rope_dev);
}

static void cu_rope(backend *be, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                    int32_t head_dim, const rope_params *rp) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_ROPE);
    touch(c, x, (size_t)T * n_heads * head_dim * sizeof(float));
    op_note(c, rope_impl(c, x, pos, T, n_heads, head_dim, rp));
}

static void cu_kv_store(backend *be, float *k_cache, float *v_cache, const float *k, const float *v,
                        const int32_t *slots, int32_t T, int32_t n_kv_heads, int32_t head_dim,
                        int32_t block_size) {
    cuda_ctx *c = ctx_of(be);
    if (T <= 0 || !op_begin_forward(c) || !land_for(c, k_cache)) return;
    OP_SPAN(c, CUDA_OP_KV_STORE);
    for (int32_t t = 0; t < T; t++) IS_ASSERT(slots[t] >= 0);
    const void *dslots;
    is_status st = stage_upload(c, &c->st_slots, slots, (size_t)T * sizeof(int32_t), &dslots);
    if (st == IS_OK)
        st = cuda_kv_store(c->stream, k_cache, v_cache, k, v, (const int32_t *)dslots, T,
                           n_kv_heads, head_dim, block_size, kv_bf16(c));
    op_note(c, st);
}

/* rope_prepare, and the slots (checked) on the device: what both
 * rope_store ops need before their launch. */
static is_status rope_store_prepare(cuda_ctx *c, const rope_params *rp, int32_t head_dim,
                                    const int32_t *pos, const int32_t *slots, int32_t T,
                                    const void **dpos, const void **dslots) {
    for (int32_t t = 0; t < T; t++) IS_ASSERT(slots[t] >= 0);
    is_status st = rope_prepare(c, rp, head_dim, pos, T, dpos);
    if (st != IS_OK) return st;
    return stage_upload(c, &c->st_slots, slots, (size_t)T * sizeof(int32_t), dslots);
}

static is_status rope_store_impl(cuda_ctx *c, float *q, const float *k, const float *v,
                                 float *k_cache, float *v_cache, const int32_t *pos,
                                 const int32_t *slots, int32_t T, int32_t n_heads,
                                 int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                                 const rope_params *rp) {
    const void *dpos, *dslots;
    is_status st = rope_store_prepare(c, rp, head_dim, pos, slots, T, &dpos, &dslots);
    if (st != IS_OK) return st;
    return cuda_rope_store(c->stream, q, k, v, k_cache, v_cache, (const int32_t *)dpos,
                           (const int32_t *)dslots, T, n_heads, n_kv_heads, head_dim, block_size,
                           rp->n_rot, rp->layout == ROPE_LAYOUT_NEOX, c->rope_dev, kv_bf16(c),
                           c->opt.pdl);
}

/* The q, k, v products and rope_store: from the stacked product's output
 * where the weights are stacked (no split: a launch a layer fewer and no
 * pass over q, k, v), else the two ops. The same bits either way. */
static is_status matmul_rope_store_impl(cuda_ctx *c, float *q, float *k, float *v, const float *x,
                                        const cuda_weight *const *ws, const cuda_weight *const *bs,
                                        float *k_cache, float *v_cache, const int32_t *pos,
                                        const int32_t *slots, int32_t T, int32_t n_heads,
                                        int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                                        const rope_params *rp) {
    if (T <= 0) return IS_OK;
    const int64_t q_dim = (int64_t)n_heads * head_dim, kv_dim = (int64_t)n_kv_heads * head_dim;
    int64_t rows;
    const bool one = ws[0]->base.shape.rows == q_dim && ws[1]->base.shape.rows == kv_dim &&
                     ws[2]->base.shape.rows == kv_dim && stacked_one(c, ws, bs, 3, T, &rows);
    if (!one) {
        float *ys[3] = {q, k, v}; /* matmul_n_impl marks them written */
        is_status st = matmul_n_impl(c, ys, x, ws, bs, 3, T);
        if (st != IS_OK) return st;
        return rope_store_impl(c, q, k, v, k_cache, v_cache, pos, slots, T, n_heads, n_kv_heads,
                               head_dim, block_size, rp);
    }
    is_status st = stacked_product(c, x, ws[0], rows, T);
    const void *dpos, *dslots;
    if (st == IS_OK) st = rope_store_prepare(c, rp, head_dim, pos, slots, T, &dpos, &dslots);
    if (st != IS_OK) return st;
    touch(c, q, (size_t)T * q_dim * sizeof(float));
    const float *b[3];
    for (int i = 0; i < 3; i++) b[i] = bs[i] ? (const float *)bs[i]->data : NULL;
    return cuda_rope_store_stacked(
        c->stream, q, c->ypart, T, split_inputs(c), b[0], b[1], b[2], k_cache, v_cache,
        (const int32_t *)dpos, (const int32_t *)dslots, n_heads, n_kv_heads, head_dim, block_size,
        rp->n_rot, rp->layout == ROPE_LAYOUT_NEOX, c->rope_dev, kv_bf16(c), c->opt.pdl);
}

static void cu_matmul_rope_store(backend *be, float *q, float *k, float *v, const float *x,
                                 const backend_weight *const *w, const backend_weight *const *b,
                                 float *k_cache, float *v_cache, const int32_t *pos,
                                 const int32_t *slots, int32_t T, int32_t n_heads,
                                 int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                                 const rope_params *rp) {
    cuda_ctx *c = ctx_of(be);
    if (T <= 0 || !op_begin_forward(c) || !land_for(c, k_cache)) return;
    OP_SPAN(c, CUDA_OP_MATMUL);
    const is_status st = matmul_rope_store_impl(
        c, q, k, v, x, (const cuda_weight *const *)w, (const cuda_weight *const *)b, k_cache,
        v_cache, pos, slots, T, n_heads, n_kv_heads, head_dim, block_size, rp);
    op_note(c, st);
}

static void cu_rope_store(backend *be, float *q, float *k, const float *v, float *k_cache,
                          float *v_cache, const int32_t *pos, const int32_t *slots, int32_t T,
                          int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                          const rope_params *rp) {
    cuda_ctx *c = ctx_of(be);
    if (T <= 0 || !op_begin_forward(c) || !land_for(c, k_cache)) return;
    OP_SPAN(c, CUDA_OP_ROPE);
    touch(c, q, (size_t)T * n_heads * head_dim * sizeof(float));
    const is_status st = rope_store_impl(c, q, k, v, k_cache, v_cache, pos, slots, T, n_heads,
                                         n_kv_heads, head_dim, block_size, rp);
    op_note(c, st);
}

/* Packs the host attn_batch into one int32 array ([pos T][seq T][bt_off S]
 * [seg_off S][block tables][segment ids][memory spans 2S, where the batch
 * has them]), uploads it and points `m` into the device copy. */
static is_status attn_meta(cuda_ctx *c, const attn_batch *b, int32_t block_size,
                           cuda_attn_meta *m) {
    const int32_t T = b->n_tokens, S = b->n_seqs;
    size_t n = 2 * (size_t)T + 2 * (size_t)S;
    for (int32_t s = 0; s < S; s++) {
        n += (size_t)(b->seq_len[s] + block_size - 1) / block_size;
        if (b->seq_segments && b->seq_segments[s]) n += (size_t)b->seq_len[s];
    }
    if (b->mem_span) n += 2 * (size_t)S;
    if (n > c->pack_cap) {
        size_t cap = n > 2 * c->pack_cap ? n : 2 * c->pack_cap;
        int32_t *p = (int32_t *)realloc(c->pack, cap * sizeof(int32_t));
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        c->pack = p;
        c->pack_cap = cap;
    }
    int32_t *pk = c->pack;
    memcpy(pk, b->pos, (size_t)T * sizeof(int32_t));
    memcpy(pk + T, b->seq_of_token, (size_t)T * sizeof(int32_t));
    size_t at = 2 * (size_t)T + 2 * (size_t)S;
    for (int32_t s = 0; s < S; s++) {
        int32_t nb = (b->seq_len[s] + block_size - 1) / block_size;
        pk[2 * T + s] = (int32_t)at;
        memcpy(pk + at, b->block_tables[s], (size_t)nb * sizeof(int32_t));
        at += (size_t)nb;
    }
    for (int32_t s = 0; s < S; s++) {
        const int32_t *seg = b->seq_segments ? b->seq_segments[s] : NULL;
        pk[2 * T + S + s] = seg ? (int32_t)at : -1;
        if (seg) {
            memcpy(pk + at, seg, (size_t)b->seq_len[s] * sizeof(int32_t));
            at += (size_t)b->seq_len[s];
        }
    }
    const size_t mem_at = at;
    if (b->mem_span) {
        memcpy(pk + at, b->mem_span, 2 * (size_t)S * sizeof(int32_t));
        at += 2 * (size_t)S;
    }
    IS_ASSERT(at == n && n < (size_t)INT32_MAX);
    const void *dev;
    is_status st = stage_upload(c, &c->st_attn, pk, n * sizeof(int32_t), &dev);
    if (st != IS_OK) return st;
    const int32_t *d = (const int32_t *)dev;
    m->pos = d;
    m->seq_of_token = d + T;
    m->bt_off = d + 2 * T;
    m->seg_off = d + 2 * T + S;
    m->flat = d;
    m->mem = b->mem_span ? d + mem_at : NULL;
    m->mem_mul = b->mem_span ? 1.0f / b->mem_temp : 1.0f;
    m->mem_add = b->mem_span ? logf(b->mem_mass) : 0.0f;
    return IS_OK;
}

/* Plain causal batches over a bf16 cache take the tiled kernel. */
static bool use_flash(const cuda_ctx *c, const attn_batch *b, int32_t n_heads, int32_t n_kv_heads,
                      int32_t head_dim, int32_t block_size) {
    if (!kv_bf16(c) || !c->opt.flash || b->q_prefix) return false;
    if (!cuda_flash_supports(head_dim, n_heads, n_kv_heads, block_size)) return false;
    if (b->seq_segments)
        for (int32_t s = 0; s < b->n_seqs; s++)
            if (b->seq_segments[s]) return false;
    return true;
}

/* Query tiles, block shape and key splits: cuda_flash_plan_batch's (the
 * choice bench_attn_gpu measures). */
static is_status flash_impl(cuda_ctx *c, float *out, const float *q, const float *k_cache,
                            const float *v_cache, const attn_batch *b, const cuda_attn_meta &m,
                            int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                            int32_t block_size) {
    const int32_t T = b->n_tokens;
    /* The tiles, then each tile's memory span where the batch has them. */
    if ((size_t)T > c->tiles_cap) {
        int32_t *p =
            (int32_t *)realloc(c->tiles, (size_t)T * (FLASH_TILE_INTS + 2) * sizeof(int32_t));
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        c->tiles = p;
        c->tiles_cap = (size_t)T;
    }
    /* c->pack holds attn_meta's host copy: bt_off at 2T (offsets into flat). */
    const cuda_flash_plan plan =
        cuda_flash_plan_batch(b->seq_of_token, b->pos, T, c->pack + 2 * (size_t)T, n_heads,
                              n_kv_heads, head_dim, c->n_sms,
                              !c->opt.flash_clusters ? CUDA_FLASH_CHOICE_NO_CLUSTER
                              : c->opt.flash_wide    ? CUDA_FLASH_CHOICE_AUTO
                                                     : CUDA_FLASH_CHOICE_NO_WIDE,
                              c->opt.flash_wgmma, c->tiles);
    size_t n_ints = (size_t)plan.n_tiles * FLASH_TILE_INTS;
    if (b->mem_span) {
        int32_t *span = c->tiles + n_ints;
        for (int32_t i = 0; i < plan.n_tiles; i++) {
            const int32_t s = b->seq_of_token[c->tiles[(size_t)i * FLASH_TILE_INTS]];
            span[2 * i] = b->mem_span[2 * s];
            span[2 * i + 1] = b->mem_span[2 * s + 1];
        }
        n_ints += 2 * (size_t)plan.n_tiles;
    }
    const void *dtiles;
    is_status st = stage_upload(c, &c->st_tiles, c->tiles, n_ints * sizeof(int32_t), &dtiles);
    if (st != IS_OK) return st;
    cuda_flash_mem mem = {NULL, 1.0f, 0.0f};
    if (b->mem_span) {
        mem.span = (const int32_t *)dtiles + (size_t)plan.n_tiles * FLASH_TILE_INTS;
        mem.mul_log2 = 1.0f / b->mem_temp;
        mem.add_log2 = log2f(b->mem_mass);
    }
    if (cuda_flash_partial_floats(plan, n_kv_heads, head_dim) > 0) {
        st = scratch_reserve(c, (void **)&c->partial, &c->partial_cap,
                             cuda_flash_partial_floats(plan, n_kv_heads, head_dim), sizeof(float));
        if (st != IS_OK) return st;
    }
    /* The output's bf16 copy too: the attention output product then skips
     * its conversion (a launch a layer fewer). */
    const size_t n = (size_t)T * n_heads * head_dim;
    cuda_bf16_out ob = {NULL, (int64_t)n, false};
    ob.p = bf16_copy_of(c, n, &ob.split);
    st = cuda_flash_attention_mem(c->stream, out, q, (const __nv_bfloat16 *)k_cache,
                                  (const __nv_bfloat16 *)v_cache, m.flat, (const int32_t *)dtiles,
                                  plan, c->partial, n_heads, n_kv_heads, head_dim, block_size, ob,
                                  c->opt.pdl, mem);
    if (ob.p) produced(c, out, n, ob.split, st);
    return st;
}

static void cu_attention(backend *be, float *out, const float *q, const float *k_cache,
                         const float *v_cache, const attn_batch *b, int32_t n_heads,
                         int32_t n_kv_heads, int32_t head_dim, int32_t block_size) {
    cuda_ctx *c = ctx_of(be);
    if (b->n_tokens <= 0 || !op_begin_forward(c) || !land_for(c, k_cache)) return;
    OP_SPAN(c, CUDA_OP_ATTENTION);
    /* The CPU reference's preconditions, checked on the host arrays. */
    for (int32_t t = 0; t < b->n_tokens; t++) {
        int32_t s = b->seq_of_token[t];
        IS_ASSERT(s >= 0 && s < b->n_seqs);
        IS_ASSERT(b->pos[t] >= 0 && b->pos[t] + 1 <= b->seq_len[s]);
    }
    touch(c, out, (size_t)b->n_tokens * n_heads * head_dim * sizeof(float));
    cuda_attn_meta m;
    is_status st = attn_meta(c, b, block_size, &m);
    if (st == IS_OK && use_flash(c, b, n_heads, n_kv_heads, head_dim, block_size))
        st = flash_impl(c, out, q, k_cache, v_cache, b, m, n_heads, n_kv_heads, head_dim,
                        block_size);
    else if (st == IS_OK)
        st = cuda_attention(c->stream, out, q, b->q_prefix, k_cache, v_cache, m, b->n_tokens,
                            n_heads, n_kv_heads, head_dim, block_size, kv_bf16(c));
    op_note(c, st);
    if (c->def.active && st == IS_OK) {
        /* The forward's first uploads are queued now: the batch's later
         * groups may follow them on the copy engine (cuda_arena_send; once
         * they are queued, a no-op). */
        pthread_mutex_lock(&c->arena_mu);
        if (c->def.active) op_note(c, cuda_arena_send(c->arena));
        pthread_mutex_unlock(&c->arena_mu);
    }
}

static void cu_swiglu(backend *be, float *out, const float *gate, const float *up, int64_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_SWIGLU);
    touch(c, out, (size_t)n * sizeof(float));
    bool split;
    __nv_bfloat16 *obf = bf16_copy_of(c, (size_t)n, &split);
    is_status st = cuda_swiglu(c->stream, out, gate, up, n, obf, split);
    if (obf) produced(c, out, (size_t)n, split, st);
    op_note(c, st);
}

static void cu_add(backend *be, float *x, const float *y, int64_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin_forward(c)) return;
    OP_SPAN(c, CUDA_OP_ADD);
    touch(c, x, (size_t)n * sizeof(float));
    op_note(c, cuda_add(c->stream, x, y, n));
}

/* The greedy choice on the device: only rows' indices come back. */
static void cu_argmax(backend *be, int32_t *out, const float *x, int32_t rows, int32_t n) {
    cuda_ctx *c = ctx_of(be);
    if (rows <= 0 || !op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_DOWNLOAD);
    is_status st =
        scratch_reserve(c, (void **)&c->argmax_out, &c->argmax_cap, (size_t)rows, sizeof(int32_t));
    if (st == IS_OK) st = cuda_argmax_rows(c->stream, c->argmax_out, x, rows, n);
    if (st == IS_OK) {
        cudaError_t e = cudaMemcpyAsync(out, c->argmax_out, (size_t)rows * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) st = cuda_status_from(e, "argmax", __FILE__, __LINE__);
    }
    op_note(c, st);
}

static void cu_sync(backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess)
        op_note(c, cuda_status_from(e, "cudaStreamSynchronize", __FILE__, __LINE__));
}

static size_t cu_kv_elem_size(backend *be) { return kv_bf16(ctx_of(be)) ? 2 : 4; }

#define ARENA_DEFAULT_BYTES ((size_t)2 << 30)

/* An f32 cache keeps the records' f32 values (the CPU reference's): each
 * layer's rows are uploaded and go through the rope and kv_store kernels,
 * as the engine's own staging does; the arena (bf16) is not used. */
static is_status inject_f32(cuda_ctx *c, float *const *k_cache, float *const *v_cache,
                            const backend_inject *in, int32_t total) {
    const int32_t kv_dim = in->n_kv_heads * in->head_dim;
    const size_t n = (size_t)total * kv_dim;
    is_status st =
        scratch_reserve(c, (void **)&c->inj_rows, &c->inj_rows_cap, 2 * n, sizeof(float));
    if (st != IS_OK) return st;
    int32_t *pos = (int32_t *)malloc((size_t)total * sizeof *pos);
    if (!pos) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    for (int32_t i = 0; i < total; i++) pos[i] = in->pos ? in->pos[i] : in->pos0 + i;
    float *k = c->inj_rows, *v = c->inj_rows + n;
    for (int32_t l = 0; l < in->n_layers && st == IS_OK; l++) {
        size_t at = 0;
        for (int32_t f = 0; f < in->n_facts && st == IS_OK; f++) {
            const backend_fact *bf = &in->facts[f];
            const size_t rows = (size_t)bf->n_tokens * kv_dim, src = (size_t)l * rows;
            cudaError_t e = cudaMemcpyAsync(k + at, bf->k + src, rows * sizeof(float),
                                            cudaMemcpyHostToDevice, c->stream);
            if (e == cudaSuccess)
                e = cudaMemcpyAsync(v + at, bf->v + src, rows * sizeof(float),
                                    cudaMemcpyHostToDevice, c->stream);
            if (e != cudaSuccess)
                st = cuda_status_from(e, "cudaMemcpyAsync(inject)", __FILE__, __LINE__);
            at += rows;
        }
        if (st == IS_OK) st = rope_impl(c, k, pos, total, in->n_kv_heads, in->head_dim, in->rope);
        if (st == IS_OK) {
            const void *dslots;
            st = stage_upload(c, &c->st_slots, in->slots, (size_t)total * sizeof(int32_t), &dslots);
            if (st == IS_OK)
                st = cuda_kv_store(c->stream, k_cache[l], v_cache[l], k, v, (const int32_t *)dslots,
                                   total, in->n_kv_heads, in->head_dim, in->block_size, false);
        }
    }
    free(pos);
    return st;
}

/* The arena for records of this shape and the configured page dtype,
 * created at the first use (the default size: ARENA_DEFAULT_BYTES or half
 * the free memory); one of another shape is replaced (the engine thread).
 * Under arena_mu. */
static is_status arena_ensure(cuda_ctx *c, int32_t n_layers, int32_t n_kv_heads, int32_t head_dim) {
    if (cuda_arena_matches(c->arena, n_layers, n_kv_heads, head_dim, c->arena_fp8)) return IS_OK;
    if (c->def.active) /* a prefetch of another shape while a batch lands */
        return is_error_set(IS_ERR_INVALID_ARG, "cuda arena: records of another shape");
    cuda_arena_free(c->arena);
    c->arena = NULL;
    size_t bytes = c->arena_bytes;
    if (bytes == 0) {
        size_t free_b = 0, total_b = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
        bytes = ARENA_DEFAULT_BYTES < free_b / 2 ? ARENA_DEFAULT_BYTES : free_b / 2;
    }
    return cuda_arena_create(bytes, c->staging_bytes, n_layers, n_kv_heads, head_dim, c->arena_fp8,
                             &c->arena);
}

/* Lands groups def.next .. last of the staged batch, each followed by the
 * deferred injection's layers of it. Under arena_mu. */
static is_status deferred_land_locked(cuda_ctx *c, int32_t last) {
    deferred_inject *d = &c->def;
    is_status st = IS_OK;
    while (d->active && d->next <= last && st == IS_OK) {
        const int32_t g = d->next;
        st = cuda_arena_land(c->arena, c->stream, g);
        if (st == IS_OK) {
            int32_t l0, l1;
            cuda_arena_group(c->arena, g, &l0, &l1);
            st = cuda_inject(c->stream, (void *const *)d->dcaches, cuda_arena_data(c->arena), false,
                             d->dp, d->dp + d->n, d->dp + 2 * d->n, d->n, d->n_layers, l0, l1,
                             d->n_kv_heads, d->head_dim, d->block_size, d->n_rot, d->neox,
                             c->rope_dev, true);
        }
        d->next = g + 1;
        if (d->next == CUDA_ARENA_GROUPS) d->active = false;
    }
    if (st != IS_OK) d->active = false;
    return st;
}

static is_status deferred_run(cuda_ctx *c, int32_t last) {
    pthread_mutex_lock(&c->arena_mu);
    const is_status st = deferred_land_locked(c, last);
    pthread_mutex_unlock(&c->arena_mu);
    return st;
}

/* Keeps what the injection's launches need (its device arrays stay: only
 * an injection rewrites them, and it lands this one first). */
static is_status defer_inject(cuda_ctx *c, float *const *k_cache, const void *dcaches,
                              const int32_t *dp, int32_t n, const backend_inject *in) {
    deferred_inject *d = &c->def;
    if (in->n_layers > d->kc_cap) {
        float **kc = (float **)realloc(d->kc, (size_t)in->n_layers * sizeof *kc);
        if (!kc) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        d->kc = kc;
        d->kc_cap = in->n_layers;
    }
    memcpy(d->kc, k_cache, (size_t)in->n_layers * sizeof *d->kc);
    d->active = true;
    d->next = 0;
    d->dcaches = dcaches;
    d->dp = dp;
    d->n = n;
    d->n_layers = in->n_layers;
    d->n_kv_heads = in->n_kv_heads;
    d->head_dim = in->head_dim;
    d->block_size = in->block_size;
    d->n_rot = in->rope->n_rot;
    d->neox = in->rope->layout == ROPE_LAYOUT_NEOX;
    return IS_OK;
}

/* Whether a fact named without values (the arena holds it: the caller
 * checked) comes after one that carries its values. */
static bool valueless_after_valued(const backend_inject *in) {
    bool valued = false;
    for (int32_t f = 0; f < in->n_facts; f++) {
        if (in->facts[f].k && in->facts[f].v) valued = true;
        else if (valued) return true;
    }
    return false;
}

/* *out: in with the facts named without values first, each fact's slots and
 * positions moving with it (the positions written out). Injection does not
 * depend on the order. A list larger than the arena goes in parts, and each
 * part's place claims every resident record of the rest of the list; only
 * the claims of facts that carry their values can be given up for room, so
 * with the others behind, a later part can find the arena full of claims
 * and no room for its first fact. In front, they all go in the first part
 * (they are resident together), and every later part carries its values. */
static is_status order_facts(cuda_ctx *c, const backend_inject *in, int64_t total,
                             backend_inject *out) {
    if ((size_t)in->n_facts > c->ord_facts_cap) {
        backend_fact *p =
            (backend_fact *)realloc(c->ord_facts, (size_t)in->n_facts * sizeof(backend_fact));
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        c->ord_facts = p;
        c->ord_facts_cap = (size_t)in->n_facts;
    }
    if (2 * (size_t)total > c->ord_tok_cap) {
        int32_t *p = (int32_t *)realloc(c->ord_tok, 2 * (size_t)total * sizeof(int32_t));
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        c->ord_tok = p;
        c->ord_tok_cap = 2 * (size_t)total;
    }
    int32_t *slots = c->ord_tok, *pos = c->ord_tok + total;
    int32_t n = 0;
    int64_t t = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t t0 = 0;
        for (int32_t f = 0; f < in->n_facts; f++) {
            const backend_fact *x = &in->facts[f];
            const bool valued = x->k && x->v;
            if (valued == (pass == 1)) {
                c->ord_facts[n++] = *x;
                memcpy(slots + t, in->slots + t0, (size_t)x->n_tokens * sizeof(int32_t));
                for (int32_t i = 0; i < x->n_tokens; i++)
                    pos[t + i] = in->pos ? in->pos[t0 + i] : in->pos0 + (int32_t)(t0 + i);
                t += x->n_tokens;
            }
            t0 += x->n_tokens;
        }
    }
    *out = *in;
    out->facts = c->ord_facts;
    out->slots = slots;
    out->pos = pos;
    return IS_OK;
}

static is_status inject_impl(cuda_ctx *c, float *const *k_cache, float *const *v_cache,
                             const backend_inject *in) {
    int64_t total = 0;
    for (int32_t f = 0; f < in->n_facts; f++) total += in->facts[f].n_tokens;
    if (total <= 0) return IS_OK;
    if (total > INT32_MAX / 4)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda inject: too many tokens");
    const rope_params *rp = in->rope;
    IS_ASSERT(rp->n_rot > 0 && rp->n_rot % 2 == 0 && rp->n_rot <= in->head_dim);
    if (!kv_bf16(c)) return inject_f32(c, k_cache, v_cache, in, (int32_t)total);
    is_status st = arena_ensure(c, in->n_layers, in->n_kv_heads, in->head_dim);
    if (st != IS_OK) return st;
    backend_inject ordered;
    if (valueless_after_valued(in)) {
        if ((st = order_facts(c, in, total, &ordered)) != IS_OK) return st;
        in = &ordered;
    }
    /* The prefetched records' copies start now (before the place, which
     * may read them); they land group by group, deferred below. */
    bool staged = false;
    if ((st = cuda_arena_stage(c->arena, c->stream, &staged)) != IS_OK) return st;
    /* Host pack: [pages T][slots T][positions T], then the caches'
     * addresses. Positions are per token, so the facts of every sequence
     * of an engine_inject_batch are one list and one launch. */
    size_t need = 3 * (size_t)total;
    if (need > c->pack_cap) {
        int32_t *p = (int32_t *)realloc(c->pack, need * sizeof(int32_t));
        if (!p) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
        c->pack = p;
        c->pack_cap = need;
    }
    int32_t max_pos = in->pos0 + (int32_t)total - 1;
    if (in->pos) {
        max_pos = 0;
        for (int64_t i = 0; i < total; i++)
            if (in->pos[i] > max_pos) max_pos = in->pos[i];
    }
    if ((st = rope_table(c, rp, max_pos)) != IS_OK) return st;
    void **caches = (void **)malloc(2 * (size_t)in->n_layers * sizeof(void *));
    if (!caches) return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    for (int32_t l = 0; l < in->n_layers; l++) {
        caches[l] = k_cache[l];
        caches[in->n_layers + l] = v_cache[l];
    }
    const void *dcaches;
    st =
        stage_upload(c, &c->st_caches, caches, 2 * (size_t)in->n_layers * sizeof(void *), &dcaches);
    free(caches);
    if (st != IS_OK) return st;
    /* One launch for the whole list whenever the arena holds it whole (the
     * serving case); a list larger than the arena goes in as many parts as
     * the arena takes, each placed, then injected. */
    int32_t f0 = 0;
    int64_t t0 = 0;
    while (f0 < in->n_facts && st == IS_OK) {
        int32_t placed = 0;
        st = cuda_arena_place(c->arena, c->stream, in->facts + f0, in->n_facts - f0, c->pack,
                              &placed);
        if (st != IS_OK) break;
        int64_t n = 0;
        for (int32_t f = f0; f < f0 + placed; f++) n += in->facts[f].n_tokens;
        memcpy(c->pack + n, in->slots + t0, (size_t)n * sizeof(int32_t));
        for (int64_t i = 0; i < n; i++)
            c->pack[2 * n + i] = in->pos ? in->pos[t0 + i] : in->pos0 + (int32_t)(t0 + i);
        const void *dpack;
        if ((st = stage_upload(c, &c->st_inject, c->pack, 3 * (size_t)n * sizeof(int32_t),
                               &dpack)) != IS_OK)
            break;
        const int32_t *dp = (const int32_t *)dpack;
        if (staged && f0 == 0 && placed == in->n_facts) {
            /* The whole list in one part: its layers go in as they land. */
            st = defer_inject(c, k_cache, dcaches, dp, (int32_t)n, in);
        } else {
            for (int32_t g = 0; staged && g < CUDA_ARENA_GROUPS && st == IS_OK; g++)
                st = cuda_arena_land(c->arena, c->stream, g);
            staged = false;
            if (st == IS_OK)
                st =
                    cuda_inject(c->stream, (void *const *)dcaches, cuda_arena_data(c->arena),
                                c->arena_fp8, dp, dp + n, dp + 2 * n, (int32_t)n, in->n_layers, 0,
                                in->n_layers, in->n_kv_heads, in->head_dim, in->block_size,
                                rp->n_rot, rp->layout == ROPE_LAYOUT_NEOX, c->rope_dev, kv_bf16(c));
        }
        f0 += placed;
        t0 += n;
    }
    if (st != IS_OK) c->def.active = false; /* latched: recover drops the arena */
    return st;
}

static void cu_inject(backend *be, float *const *k_cache, float *const *v_cache,
                      const backend_inject *in) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    OP_SPAN(c, CUDA_OP_INJECT);
    pthread_mutex_lock(&c->arena_mu);
    op_note(c, inject_impl(c, k_cache, v_cache, in));
    pthread_mutex_unlock(&c->arena_mu);
}

/* Resident only where the next inject reads the arena: a bf16 cache. */
static bool cu_fact_resident(backend *be, uint64_t id, int32_t n_tokens) {
    cuda_ctx *c = ctx_of(be);
    if (!kv_bf16(c)) return false;
    pthread_mutex_lock(&c->arena_mu);
    bool held = c->arena && cuda_arena_holds(c->arena, id, n_tokens);
    pthread_mutex_unlock(&c->arena_mu);
    return held;
}

/* ---- the host tier's ops (any thread) ------------------------------------ */

/* Pinned: the copy engine reads it while the host goes on (upload.cuh). */
static is_status cu_host_alloc(backend *be, size_t bytes, void **out) {
    cuda_ctx *c = ctx_of(be);
    void *p = NULL;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(IS_ERR_NOMEM, "cuda backend: cannot pin %zu bytes of host memory: %s",
                            bytes, cudaGetErrorString(e));
    }
    *out = p;
    return IS_OK;
}

static void cu_host_free(backend *be, void *ptr) {
    if (!ptr) return;
    cuda_ctx *c = ctx_of(be);
    cudaSetDevice(c->device);
    pthread_mutex_lock(&c->arena_mu);
    cuda_arena_wait_uploads(c->arena); /* a copy may still read it */
    pthread_mutex_unlock(&c->arena_mu);
    cudaFreeHost(ptr);
}

static bool host_readable(const void *p) {
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return at.type == cudaMemoryTypeHost;
}

/* Only with the serving cache (bf16, arena). */
static bool cu_fact_prefetch(backend *be, const backend_fact_host *f) {
    cuda_ctx *c = ctx_of(be);
    if (!kv_bf16(c) || !f->id) return false;
    if (f->k &&
        (!f->v || (f->dtype != 1 && f->dtype != 2) || !host_readable(f->k) || !host_readable(f->v)))
        return false;
    if (cudaSetDevice(c->device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    bool pinned = false;
    pthread_mutex_lock(&c->arena_mu);
    /* A server's first requests prefetch before anything was injected: the
     * arena is made here then, in the shape the fact names (the model's). */
    if (c->err == IS_OK && arena_ensure(c, f->n_layers, f->n_kv_heads, f->head_dim) == IS_OK &&
        cuda_arena_prefetch(c->arena, f, &pinned) != IS_OK)
        pinned = false; /* the caller injects the values itself */
    pthread_mutex_unlock(&c->arena_mu);
    if (!pinned) is_error_clear();
    return pinned;
}

static void cu_host_wait(backend *be) {
    cuda_ctx *c = ctx_of(be);
    cudaSetDevice(c->device);
    pthread_mutex_lock(&c->arena_mu);
    cuda_arena_wait_uploads(c->arena);
    pthread_mutex_unlock(&c->arena_mu);
}

static void cu_fact_unpin(backend *be, uint64_t id) {
    cuda_ctx *c = ctx_of(be);
    pthread_mutex_lock(&c->arena_mu);
    if (c->arena) cuda_arena_unpin(c->arena, id);
    pthread_mutex_unlock(&c->arena_mu);
}

static is_status cu_status(backend *be) {
    const cuda_ctx *c = ctx_of(be);
    if (c->err == IS_OK) return IS_OK;
    return is_error_set(c->err, "%s", c->err_msg);
}

/* A sticky CUDA error (a kernel's illegal address, a lost device) comes
 * back from every later call, so a wait on the stream and one small copy
 * tell whether the device works again. Then what a failed op may have left
 * half-done is dropped: the fact arena (a record placed whose values never
 * landed), the staged host arrays (a copy that never ran, while the host
 * copy says it did) and the converted matmul inputs. */
static is_status cu_recover(backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (c->err == IS_OK) return IS_OK;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) {
        cudaGetLastError(); /* a launch's error that is not sticky */
        e = cudaStreamSynchronize(c->stream);
    }
    if (e == cudaSuccess) e = cudaMemsetAsync(c->cublas_ws, 0, 256, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
        return is_error_set(IS_ERR_INTERNAL,
                            "cuda backend: the device does not recover (%s) from: %s; only a new "
                            "process can use it",
                            cudaGetErrorString(e), c->err_msg);
    pthread_mutex_lock(&c->arena_mu);
    if (c->arena) {
        cuda_arena_free(c->arena); /* taken again at the next injection */
        c->arena = NULL;
    }
    c->def.active = false;
    pthread_mutex_unlock(&c->arena_mu);
    for (dev_stage *st : {&c->st_tiles, &c->st_inject, &c->st_caches, &c->st_tokens, &c->st_rope,
                          &c->st_slots, &c->st_attn})
        st->valid = false;
    inputs_stale(c);
    c->err = IS_OK;
    c->err_msg[0] = '\0';
    return IS_OK;
}

static void ctx_destroy(cuda_ctx *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->stream) cudaStreamSynchronize(c->stream);
    stage_free(&c->st_tokens);
    stage_free(&c->st_rope);
    stage_free(&c->st_slots);
    stage_free(&c->st_attn);
    stage_free(&c->st_tiles);
    stage_free(&c->st_inject);
    stage_free(&c->st_caches);
    cudaFree(c->partial);
    cudaFree(c->argmax_out);
    cudaFree(c->inj_rows);
    free(c->tiles);
    cuda_arena_free(c->arena);
    free(c->def.kc);
    pthread_mutex_destroy(&c->arena_mu);
    cudaFree(c->xbf.buf);
    cudaFree(c->gbf.buf);
    cudaFree(c->ypart);
    cudaFree(c->rope_dev);
    free(c->rope_host);
    free(c->pack);
    free(c->ord_facts);
    free(c->ord_tok);
    cuda_profiler_free(c->prof);
    if (c->cublas) cublasDestroy(c->cublas);
    cudaFree(c->cublas_ws); /* after the handle that uses it */
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

static void cu_free(backend *be) {
    if (!be) return;
    ctx_destroy(ctx_of(be));
    free(be);
}

/* The backend interface's options, onto this backend's configuration. */
static is_status cu_set_option(backend *be, backend_option opt, uint64_t value) {
    switch (opt) {
    case BACKEND_OPT_KV_COMPACT:
        ctx_of(be)->opt.kv = value ? CUDA_KV_BF16 : CUDA_KV_F32;
        return IS_OK;
    case BACKEND_OPT_FACT_CACHE_BYTES:
        backend_cuda_set_arena_bytes(be, (size_t)value);
        return IS_OK;
    case BACKEND_OPT_FACT_CACHE_FP8: backend_cuda_set_arena_fp8(be, value != 0); return IS_OK;
    }
    return IS_ERR_UNSUPPORTED;
}

static is_status cu_configure(backend *be, const char *spec, char *desc, size_t n) {
    is_status st = backend_cuda_configure(be, spec);
    if (st == IS_OK && desc) cuda_options_format(&ctx_of(be)->opt, desc, n);
    return st;
}

static const backend_ops cuda_ops = {
    /* .name = */ "cuda",
    /* .free = */ cu_free,
    /* .alloc = */ cu_alloc,
    /* .release = */ cu_release,
    /* .upload = */ cu_upload,
    /* .download = */ cu_download,
    /* .copy = */ cu_copy,
    /* .narrow = */ cu_narrow,
    /* .weight_create = */ cu_weight_create,
    /* .weight_free = */ cu_weight_free,
    /* .get_rows = */ cu_get_rows,
    /* .rmsnorm = */ cu_rmsnorm,
    /* .matmul = */ cu_matmul,
    /* .rope = */ cu_rope,
    /* .kv_store = */ cu_kv_store,
    /* .attention = */ cu_attention,
    /* .swiglu = */ cu_swiglu,
    /* .add = */ cu_add,
    /* .sync = */ cu_sync,
    /* .kv_elem_size = */ cu_kv_elem_size,
    /* .inject = */ cu_inject,
    /* .copy_2d = */ cu_copy_2d,
    /* .fact_resident = */ cu_fact_resident,
    /* .add_rmsnorm = */ cu_add_rmsnorm,
    /* .weight_create_stacked = */ cu_weight_create_stacked,
    /* .matmul_n = */ cu_matmul_n,
    /* .rope_store = */ cu_rope_store,
    /* .matmul_swiglu = */ cu_matmul_swiglu,
    /* .matmul_rope_store = */ cu_matmul_rope_store,
    /* .argmax = */ cu_argmax,
    /* .status = */ cu_status,
    /* .recover = */ cu_recover,
    /* .set_option = */ cu_set_option,
    /* .configure = */ cu_configure,
    /* .free_bytes = */ backend_cuda_free_bytes,
    /* .host_alloc = */ cu_host_alloc,
    /* .host_free = */ cu_host_free,
    /* .fact_prefetch = */ cu_fact_prefetch,
    /* .fact_unpin = */ cu_fact_unpin,
    /* .host_wait = */ cu_host_wait,
};

/* ---- creation -------------------------------------------------------------- */

/* A kernel whose attributes say whether this build has code for a device. */
static __global__ void probe_kernel(void) {}

/* IS_OK if `device` exists and can run this build's kernels. */
static is_status device_usable(int32_t device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda backend: no usable CUDA driver or device (%s)",
                            cudaGetErrorString(e));
    }
    if (device < 0 || device >= n)
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda backend: no device %d (%d present)", device,
                            n);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    if (prop.major < 8) /* bf16 matrix products */
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda backend: device %d (%s) is sm_%d%d, need sm_80+", device,
                            prop.name, prop.major, prop.minor);
    CUDA_CHECK(cudaSetDevice(device));
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, probe_kernel);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "cuda backend: this build has no code for device %d (%s, sm_%d%d): %s",
                            device, prop.name, prop.major, prop.minor, cudaGetErrorString(e));
    }
    return IS_OK;
}

extern "C" bool backend_cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    for (int d = 0; d < n; d++)
        if (device_usable(d) == IS_OK) return true;
    is_error_clear();
    return false;
}

extern "C" is_status backend_cuda_create(int32_t device, backend **out) {
    is_status st = device_usable(device);
    if (st != IS_OK) return st;
    backend *be = (backend *)calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return is_error_set(IS_ERR_NOMEM, "cuda backend: out of memory");
    }
    c->be = be;
    c->device = device;
    pthread_mutex_init(&c->arena_mu, NULL);
    c->err = IS_OK;
    /* The defaults, then IS_CUDA_OPTIONS: a bad list fails the creation rather
     * than measuring something else than asked. */
    c->opt = cuda_options_default();
    if ((st = cuda_options_from_env(&c->opt)) != IS_OK) {
        free(be);
        free(c);
        return st;
    }
    c->n_sms = 132;
    {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
            sms > 0)
            c->n_sms = sms;
        cudaGetLastError();
    }
    cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        st = cuda_status_from(e, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
        c->stream = NULL;
    }
    if (st == IS_OK) {
        cublasStatus_t bs = cublasCreate(&c->cublas);
        if (bs != CUBLAS_STATUS_SUCCESS) {
            c->cublas = NULL;
            st = cublas_status_from(bs, "cublasCreate", __FILE__, __LINE__);
        } else if ((bs = cublasSetStream(c->cublas, c->stream)) != CUBLAS_STATUS_SUCCESS) {
            st = cublas_status_from(bs, "cublasSetStream", __FILE__, __LINE__);
        }
    }
    /* A workspace of its own (cuBLAS's default size), which recover writes
     * to test the device; after cublasSetStream, which resets it. */
    if (st == IS_OK) {
        e = cudaMalloc(&c->cublas_ws, CUBLAS_WORKSPACE_BYTES);
        if (e != cudaSuccess) {
            c->cublas_ws = NULL;
            st = cuda_status_from(e, "cudaMalloc(cuBLAS workspace)", __FILE__, __LINE__);
        } else {
            cublasStatus_t bs = cublasSetWorkspace(c->cublas, c->cublas_ws, CUBLAS_WORKSPACE_BYTES);
            if (bs != CUBLAS_STATUS_SUCCESS)
                st = cublas_status_from(bs, "cublasSetWorkspace", __FILE__, __LINE__);
        }
    }
    if (st == IS_OK) st = cuda_skinny_prepare();
    if (st == IS_OK) st = cuda_wgmma_prepare();
    if (st != IS_OK) {
        ctx_destroy(c);
        free(be);
        return st;
    }
    be->ops = &cuda_ops;
    be->ctx = c;
    *out = be;
    return IS_OK;
}

extern "C" is_status backend_cuda_configure(backend *be, const char *spec) {
    return cuda_options_parse(&ctx_of(be)->opt, spec);
}

extern "C" void backend_cuda_options(backend *be, cuda_options *out) { *out = ctx_of(be)->opt; }

extern "C" void backend_cuda_set_arena_bytes(backend *be, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    pthread_mutex_lock(&c->arena_mu);
    if (c->arena) {
        cudaSetDevice(c->device);
        if (c->def.active && deferred_land_locked(c, CUDA_ARENA_GROUPS - 1) != IS_OK)
            is_error_clear();             /* the arena goes anyway */
        cudaStreamSynchronize(c->stream); /* queued injections may read it */
        cuda_arena_free(c->arena);
        c->arena = NULL;
    }
    c->arena_bytes = bytes;
    pthread_mutex_unlock(&c->arena_mu);
}

extern "C" void backend_cuda_set_staging_bytes(backend *be, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    pthread_mutex_lock(&c->arena_mu); /* a prefetch may make the arena again at once */
    c->staging_bytes = bytes;
    pthread_mutex_unlock(&c->arena_mu);
    backend_cuda_set_arena_bytes(be, c->arena_bytes); /* drops the arena */
}

extern "C" void backend_cuda_set_arena_fp8(backend *be, bool fp8) {
    cuda_ctx *c = ctx_of(be);
    if (c->arena_fp8 == fp8) return;
    backend_cuda_set_arena_bytes(be, c->arena_bytes); /* drops the arena */
    c->arena_fp8 = fp8;
}

extern "C" size_t backend_cuda_free_bytes(backend *be) {
    cuda_ctx *c = ctx_of(be);
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(c->device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
        return 0;
    return free_b;
}

extern "C" void backend_cuda_arena_stats(backend *be, cuda_arena_stats *out) {
    cuda_ctx *c = ctx_of(be);
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&c->arena_mu);
    if (c->arena) cuda_arena_get_stats(c->arena, out);
    pthread_mutex_unlock(&c->arena_mu);
}

extern "C" is_status backend_cuda_check(backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (c->err == IS_OK) {
        cudaError_t e = cudaSetDevice(c->device);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess)
            op_note(c, cuda_status_from(e, "cudaStreamSynchronize", __FILE__, __LINE__));
    }
    if (c->err != IS_OK) return is_error_set(c->err, "%s", c->err_msg);
    return IS_OK;
}

/* ---- op profiler (profiler.cuh) --------------------------------------------- */

extern "C" is_status backend_cuda_profile_begin(backend *be, double hold_ms) {
    cuda_ctx *c = ctx_of(be);
    return cuda_profiler_begin(&c->prof, c->device, c->stream, hold_ms);
}

extern "C" is_status backend_cuda_profile_end(backend *be, cuda_op_profile *out) {
    cuda_ctx *c = ctx_of(be);
    return cuda_profiler_end(c->prof, c->device, c->stream, out);
}

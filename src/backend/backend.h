/*
 * backend: the interface every compute backend implements.
 *
 * The engine orchestrates a forward pass as a sequence of ops; a backend
 * owns the memory those ops read and write (host memory for the CPU, device
 * memory for CUDA) and the representation of weights. The CPU backend is the
 * reference: every other backend is tested against it op by op.
 *
 * Conventions shared by all ops:
 *   - activations are row-major f32 [T][n] in backend memory, one row per
 *     token of the batch;
 *   - weights are matrices W[rows][cols] (GGUF ne[1] x ne[0]) used as
 *     y = x W^T, or vectors (norm gains, biases);
 *   - the KV cache storage of layer l is K_l, V_l:
 *     [n_blocks][n_kv_heads][block_size][head_dim], addressed by slot
 *     (block * block_size + offset) as kv/kv_cache.h hands them out; its
 *     elements are f32 unless the backend says otherwise (kv_elem_size).
 */
#ifndef IS_BACKEND_BACKEND_H
#define IS_BACKEND_BACKEND_H

#include "inferscale.h"
#include "gguf/gguf.h"

typedef struct backend backend;
typedef struct backend_weight backend_weight;

typedef enum rope_layout {
    ROPE_LAYOUT_NORM = 0, /* rotate adjacent pairs (x[2i], x[2i+1]): llama */
    ROPE_LAYOUT_NEOX = 1, /* rotate halves (x[i], x[i + d/2]): qwen2, neox */
} rope_layout;

typedef struct rope_params {
    rope_layout layout;
    int32_t n_rot;             /* dims rotated per head (<= head_dim) */
    float freq_base;           /* theta base */
    float freq_scale;          /* linear position scale (1 = none) */
    const float *freq_factors; /* [n_rot/2] llama-3 style divisors, or NULL; host memory */
} rope_params;

/* Where each token of a batch attends: its sequence's block table, and the
 * slots it may see. A token in slot p of its sequence sees slots [0, p]
 * (causal), restricted by segments when the sequence has them:
 *   segment 0   shared (serving prefix, query): seen by every later token;
 *   segment s>0 fact s: seen by segment 0 and by fact s's own tokens;
 *   segment -s  fact s's encoding context: seen by fact s's tokens only.
 * This is the segment-masked reference for memory injection. Host memory. */
typedef struct attn_batch {
    int32_t n_tokens;
    const int32_t *pos;          /* [T] position of each token in its sequence */
    const int32_t *seq_of_token; /* [T] index into block_tables */
    int32_t n_seqs;
    const int32_t *const *block_tables; /* [n_seqs] -> block ids */
    const int32_t *seq_len; /* [n_seqs] positions readable (after this batch's writes) */
    const int32_t *const
        *seq_segments; /* [n_seqs] -> [seq_len] segment of each position, or NULL entries */
    /* For the reference only: queries rotated to the position they had at
     * encoding time, used when scoring segment-0 keys, so each fact sees the
     * serving prefix at the distance it saw it when encoded. [T][n_heads*head_dim]
     * in backend memory, or NULL. */
    const float *q_prefix;
    /* Optional (NULL = none): each sequence's memory segment, the slots
     * [mem_span[2s], mem_span[2s+1]) its injected facts occupy. A query
     * after the segment (pos >= its end) scores a memory key as
     * score / mem_temp + ln(mem_mass), score = q.k / sqrt(head_dim): the
     * memory's logits sharpened (mem_temp < 1) and its softmax mass
     * multiplied by mem_mass against the other keys' (APE's attention
     * temperature and scaling factor, here as one per-key affine map so
     * that a one-pass online softmax applies it). Other queries and keys
     * as without it. Host memory. */
    const int32_t *mem_span;
    float mem_temp, mem_mass;
} attn_batch;

/* One fact for the optional inject op: its stored pre-RoPE keys and values,
 * f32 [n_layers][n_tokens][n_kv_heads*head_dim] in host memory. A nonzero
 * id names the content (the same id always means the same values), so a
 * backend may keep the record resident and skip reading k and v (which are
 * then NULL when fact_resident said so). */
typedef struct backend_fact {
    uint64_t id;
    int32_t n_tokens;
    const float *k, *v;
} backend_fact;

/* A fact's record as the host tier holds it, for the optional
 * fact_prefetch op: pre-RoPE keys and values [n_layers][n_tokens][kv_dim]
 * in the record's own element type (dtype: 1 f16, 2 bf16, as kv_dtype
 * numbers them), in host memory from host_alloc (pinned: the device reads
 * it while the caller goes on). */
typedef struct backend_fact_host {
    uint64_t id;
    int32_t n_tokens;
    int32_t n_layers, n_kv_heads, head_dim; /* the model's: a backend may shape its cache by them */
    int32_t dtype;
    const void *k, *v;
} backend_fact_host;

/* What the inject op writes: the facts' tokens, in order, token i (of all
 * the facts' tokens) into slots[i] of every layer's cache at position
 * pos[i], or pos0 + i where pos is NULL (one sequence's contiguous memory
 * segment); keys rotated to their position by `rope`. Slots name blocks of
 * the whole pool, so with pos the facts of several sequences go in one
 * call (engine_inject_batch): a sequence's facts are a run of the list.
 * slots and pos in host memory. */
typedef struct backend_inject {
    int32_t n_layers, n_kv_heads, head_dim, block_size;
    const backend_fact *facts;
    int32_t n_facts;
    int32_t pos0;
    const int32_t *slots; /* [sum of n_tokens] */
    const int32_t *pos;   /* [sum of n_tokens], or NULL */
    const rope_params *rope;
} backend_inject;

/* Settings a backend may have (backend_set_option); a backend without one
 * says so, and callers that only prefer a setting go on without it. */
typedef enum backend_option {
    /* 1: the backend's compact KV cache, the serving configuration (on CUDA
     * bf16: half the bytes, tiled attention, injected facts resident in a
     * device arena); 0: the reference element type, f32. For engines
     * created afterwards (the engine sizes its cache by kv_elem_size). */
    BACKEND_OPT_KV_COMPACT = 0,
    /* Bytes of device memory the resident fact-KV cache may hold; a change
     * drops what it holds. */
    BACKEND_OPT_FACT_CACHE_BYTES = 1,
    /* 1: the resident fact-KV cache holds fp8 e4m3 with a scale per
     * (token, layer, KV head), half the bytes of the cache's own dtype;
     * 0: the cache's own dtype (the default). A change drops what it holds. */
    BACKEND_OPT_FACT_CACHE_FP8 = 2,
} backend_option;

typedef struct backend_ops {
    const char *name;
    void (*free)(backend *be);

    /* Memory. */
    is_status (*alloc)(backend *be, size_t bytes, void **out);
    void (*release)(backend *be, void *ptr);
    void (*upload)(backend *be, void *dst, const void *src, size_t bytes);
    void (*download)(backend *be, void *dst, const void *src, size_t bytes);
    /* Copy within backend memory. */
    void (*copy)(backend *be, void *dst, const void *src, size_t bytes);
    /* dst[n] = x[n] (f32) in dtype, both in backend memory: 0 f32 (a copy),
     * 1 f16, 2 bf16 (as kv_dtype numbers them), rounded bit for bit as
     * quant_f32_to_f16 and quant_f32_to_bf16 round. A fact's captured rows
     * are narrowed where they are computed: half the bytes come down, and
     * the host converts nothing. */
    void (*narrow)(backend *be, void *dst, int32_t dtype, const float *x, size_t n);

    /* Weights from a GGUF tensor of any readable type. */
    is_status (*weight_create)(backend *be, const gguf_tensor *t, backend_weight **out);
    void (*weight_free)(backend *be, backend_weight *w);

    /* out[T][cols] = rows tokens[t] of emb (tokens in host memory). */
    void (*get_rows)(backend *be, float *out, const backend_weight *emb, const int32_t *tokens,
                     int32_t T);
    /* out[T][n] = x / rms(x) * g. */
    void (*rmsnorm)(backend *be, float *out, const float *x, const backend_weight *g, int32_t T,
                    int32_t n, float eps);
    /* y[T][rows] = x[T][cols] W^T (+ bias). */
    void (*matmul)(backend *be, float *y, const float *x, const backend_weight *w,
                   const backend_weight *bias, int32_t T);
    /* In place on x[T][n_heads][head_dim]; pos in host memory. */
    void (*rope)(backend *be, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                 int32_t head_dim, const rope_params *rp);
    /* Writes k, v [T][n_kv_heads*head_dim] into the slots (host memory). */
    void (*kv_store)(backend *be, float *k_cache, float *v_cache, const float *k, const float *v,
                     const int32_t *slots, int32_t T, int32_t n_kv_heads, int32_t head_dim,
                     int32_t block_size);
    /* out[T][n_heads*head_dim] = softmax(q K^T / sqrt(d) + mask) V. */
    void (*attention)(backend *be, float *out, const float *q, const float *k_cache,
                      const float *v_cache, const attn_batch *b, int32_t n_heads,
                      int32_t n_kv_heads, int32_t head_dim, int32_t block_size);
    /* out[T][n] = silu(gate) * up. */
    void (*swiglu)(backend *be, float *out, const float *gate, const float *up, int64_t n);
    /* x[n] += y[n]. */
    void (*add)(backend *be, float *x, const float *y, int64_t n);
    /* Waits for queued work (no-op on the CPU). */
    void (*sync)(backend *be);

    /* Optional (NULL = 4: f32). Bytes per element of the KV cache storage
     * the engine allocates; the storage is opaque to the engine (only
     * kv_store, attention and inject interpret it; the engine copies rows
     * of it with copy). */
    size_t (*kv_elem_size)(backend *be);
    /* Optional (NULL = the engine uploads each layer's rows and applies
     * rope and kv_store): chunked RoPE + scatter of facts into the caches
     * of every layer (k_cache[l], v_cache[l]) in one call. */
    void (*inject)(backend *be, float *const *k_cache, float *const *v_cache,
                   const backend_inject *in);
    /* Optional (NULL = one copy per row): height rows of width bytes, row i
     * from src + i * src_pitch to dst + i * dst_pitch, in one call (a fork
     * copies one block of every layer's cache: 2 calls instead of 2 per layer). */
    void (*copy_2d)(backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                    size_t width, size_t height);
    /* Optional (NULL = never): whether the next inject call would find the
     * fact of this id and length resident and not read its k and v. When
     * true, the caller may pass k = v = NULL for it in that call, provided
     * no other inject runs in between (the backend keeps a call's resident
     * facts while it makes room for the call's others). */
    bool (*fact_resident)(backend *be, uint64_t id, int32_t n_tokens);
    /* Optional (NULL = add, then rmsnorm): x[T][n] += res, then out =
     * x / rms(x) * g, with the same results as the two ops; out may alias
     * res, not x. A residual add is always followed by the next norm, and
     * one launch instead of two is 64 fewer a forward of a 32-layer model. */
    void (*add_rmsnorm)(backend *be, float *out, float *x, const float *res,
                        const backend_weight *g, int32_t T, int32_t n, float eps);
    /* Optional (NULL = weight_create for each): n matrices of the same width
     * (ne[0]) placed as one, rows in order, so that matmul_n can read them
     * in one product. Each out[i] is a weight of its own to every op and to
     * weight_free (the storage goes with the last of them). */
    is_status (*weight_create_stacked)(backend *be, const gguf_tensor *const *ts, int32_t n,
                                       backend_weight **out);
    /* Optional (NULL = matmul for each): ys[i][T][rows_i] = x ws[i]^T
     * (+ bs[i] where not NULL), i < n: products that share their input (the
     * attention's q, k, v; the FFN's gate and up). A backend reads stacked
     * weights in one pass; it gives the same results as the n matmuls up
     * to the order of the sums inside a product. */
    void (*matmul_n)(backend *be, float *const *ys, const float *x, const backend_weight *const *ws,
                     const backend_weight *const *bs, int32_t n, int32_t T);
    /* Optional (NULL = rope on q, rope on k, kv_store): q[T][n_heads][head_dim]
     * rotated in place, and k rotated, with v, written into the slots of the
     * caches, by the same rotation as rope's. k is input only: afterwards it
     * holds either its rotated or its original rows. One launch instead of
     * three a layer. pos and slots in host memory. */
    void (*rope_store)(backend *be, float *q, float *k, const float *v, float *k_cache,
                       float *v_cache, const int32_t *pos, const int32_t *slots, int32_t T,
                       int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                       const rope_params *rp);
    /* Optional (NULL = matmul_n of w_gate and w_up into out and up_scratch,
     * then swiglu into out): out[T][rows] = silu(x w_gate^T) * (x w_up^T),
     * the FFN's first half, with the same results as those ops. A backend
     * that multiplies stacked weights in one product applies the SwiGLU to
     * that product's output where it lies, and may leave up_scratch
     * ([T][rows], no bias) unwritten. */
    void (*matmul_swiglu)(backend *be, float *out, float *up_scratch, const float *x,
                          const backend_weight *w_gate, const backend_weight *w_up, int32_t T);
    /* Optional (NULL = matmul_n of w[0..2], the q, k, v weights, with biases
     * b[i] where not NULL, then rope_store): the attention's input side in
     * one op, with the same results as those ops. q holds the rotated
     * queries after; k and v ([T][n_kv_heads][head_dim]) are scratch a
     * backend may leave unwritten: one that multiplies stacked weights
     * rotates and stores straight from the product's output. */
    void (*matmul_rope_store)(backend *be, float *q, float *k, float *v, const float *x,
                              const backend_weight *const *w, const backend_weight *const *b,
                              float *k_cache, float *v_cache, const int32_t *pos,
                              const int32_t *slots, int32_t T, int32_t n_heads, int32_t n_kv_heads,
                              int32_t head_dim, int32_t block_size, const rope_params *rp);
    /* Optional (NULL = download each row, then vmath_argmax): out[r] (host
     * memory) = vmath_argmax of row r of x[rows][n], its rule exactly (the
     * first of equal maxima, NaN skipped, 0 where nothing passes -inf).
     * Waits for it, like download. */
    void (*argmax)(backend *be, int32_t *out, const float *x, int32_t rows, int32_t n);

    /* Failures (see "Failures" below). Optional (NULL = the backend's ops
     * cannot fail). status: IS_OK, or the failure latched since the last
     * successful recover, its message set again for this thread. It does
     * not wait: a failure the device meets after the last download or sync
     * is latched by the next one. */
    is_status (*status)(backend *be);
    /* Optional, with status (NULL when status is): brings a failed
     * backend back to a usable state and clears the latch, or says why it
     * cannot (a device lost for good: only a new process recovers). State
     * a failed op may have left half-written (resident fact records) is
     * dropped; the engine's own state (weights, KV pool, sequences) stays.
     * Every pin fact_prefetch took before it is dropped with the records
     * (the CUDA arena is freed): no fact_unpin is owed for them, and one
     * sent would drop a pin taken since (the scheduler keeps an epoch). */
    is_status (*recover)(backend *be);
    /* Optional (NULL = no settings): sets `opt` to `value`. IS_OK, or
     * IS_ERR_UNSUPPORTED (nothing changed) for a setting this backend
     * lacks. */
    is_status (*set_option)(backend *be, backend_option opt, uint64_t value);
    /* Optional (NULL = no settings of its own): applies spec, a
     * "key=value,..." list of the backend's own settings (NULL or "":
     * none), all or nothing, and writes the whole configuration after it
     * (the same list form) to desc[n] where desc is not NULL. IS_OK, or
     * IS_ERR_INVALID_ARG naming the bad item, nothing changed. */
    is_status (*configure)(backend *be, const char *spec, char *desc, size_t n);
    /* Optional (NULL = 0): bytes of device memory free now, for sizing a
     * cache from what the weights and the KV pool leave; 0 on an error. */
    size_t (*free_bytes)(backend *be);

    /* The fact-KV host tier (any thread, unlike the ops above; none ticks
     * or latches). Optional (NULL = none, and the caller keeps its records
     * in ordinary memory): host memory the device can read while the
     * caller goes on (CUDA: pinned), and its release, which waits
     * for any copy still reading it. */
    is_status (*host_alloc)(backend *be, size_t bytes, void **out);
    void (*host_free)(backend *be, void *ptr);
    /* Optional (NULL = never): makes the fact of f->id resident for a later
     * inject, copying its values (when f->k is not NULL) from host_alloc
     * memory asynchronously, and pins it (never evicted) until fact_unpin;
     * the inject that uses it waits for the copy on the device, not the
     * host (CUDA: the copy starts at the next inject, and each layer's
     * rows land just before that layer first runs). f->k NULL: only pins a
     * fact already resident (not one whose copy has not started). Returns
     * false, nothing pinned, when it cannot (no room beside other pins, a
     * cache of another shape or type, a failed backend): the caller
     * injects the values itself. The memory must keep its contents until
     * the fact is injected or its pin dropped, and stay allocated until
     * host_wait or host_free (which waits). */
    bool (*fact_prefetch)(backend *be, const backend_fact_host *f);
    /* Drops one pin that fact_prefetch took (no-op if none). */
    void (*fact_unpin)(backend *be, uint64_t id);
    /* Waits until no copy that fact_prefetch started reads host memory. */
    void (*host_wait)(backend *be);
} backend_ops;

/* Fault injection state of one backend (backend_fault_arm); only
 * backend.c reads or writes it, through atomic builtins. */
typedef struct backend_fault_state {
    int64_t ops;     /* ops ticked since creation */
    int64_t fail_at; /* the tick that fails (0: none armed) */
    int32_t stuck;   /* recover refuses until the next arm */
} backend_fault_state;

struct backend {
    const backend_ops *ops;
    void *ctx;
    backend_fault_state fault; /* zero at creation */
};

/*
 * Failures. Ops return nothing, so a backend latches the first failure of
 * any op (a CUDA error, an injected fault): from then on its ops do
 * nothing, and status reports the failure until recover succeeds. A latch
 * is simpler than a status from every op, and it cannot be missed: a
 * caller that checks once after a sequence of ops (the engine does after
 * every forward, injection and fork) sees any failure inside it, and a
 * caller that forgets still finds the backend failed at its next check;
 * ops after a failure never compute on a state that is already wrong.
 */

/* IS_OK, or the backend's latched failure (message set). Cheap: no wait. */
is_status backend_status(backend *be);
/* Recovers a failed backend (IS_OK also when it had not failed). Refused
 * (IS_ERR_INTERNAL) while a stuck fault is armed (backend_fault_arm). */
is_status backend_recover(backend *be);

/* Fault injection, for tests of the failure paths on any backend: the
 * nth op called after this (n >= 1; counted as backend_op_count counts)
 * fails as a device failure would: latched, later ops skipped. stuck:
 * backend_recover keeps failing until the next arm, so a test can see the
 * failed state before it lets the backend recover. n = 0 disarms (and
 * clears stuck). Safe from any thread. */
void backend_fault_arm(backend *be, int64_t n, bool stuck);
/* Ops ticked since the backend was created: every call of an op that
 * computes, copies, synchronises or downloads (not alloc, release,
 * weight_create, weight_free, kv_elem_size, fact_resident, status,
 * recover). A test counts the ops of a clean run, then aims faults at
 * them. Safe from any thread. */
int64_t backend_op_count(const backend *be);
/* For backends, at the start of each ticking op: counts it and returns
 * true when it is the one armed to fail (the backend then latches an
 * IS_ERR_INTERNAL failure whose message says it was injected). */
bool backend_fault_tick(backend *be);

typedef struct backend_weight_info {
    int64_t rows, cols; /* vectors have rows == 1 */
} backend_weight_info;

/* Every backend's weight handle starts with this, so the engine can read
 * shapes without knowing the representation. */
struct backend_weight {
    backend_weight_info shape;
};

/* The CPU backend: f32 everywhere, OpenBLAS for matrix products, n_threads
 * for the other ops (0 = all cores). */
is_status backend_cpu_create(int32_t n_threads, backend **out);

/* A backend by name: "cpu" (NULL too) or "cuda" (device 0, in builds with
 * the CUDA backend; IS_ERR_UNSUPPORTED otherwise or for any other name).
 * n_threads applies to the CPU. */
is_status backend_create(const char *name, int32_t n_threads, backend **out);
/* Whether backend_create(name) can succeed in this build. */
bool backend_available(const char *name);

/* Sets a backend's option (backend_option). IS_OK; IS_ERR_UNSUPPORTED,
 * message set and the backend unchanged, where it has no such setting. */
is_status backend_set_option(backend *be, backend_option opt, uint64_t value);
/* Applies a backend's own settings, "key=value,..." (the CUDA backend's:
 * cuda/options.h), and writes its whole configuration to desc[n] where desc
 * is not NULL ("" for a backend without settings), for printing at
 * start-up. IS_OK; IS_ERR_INVALID_ARG naming a bad item, nothing changed;
 * IS_ERR_UNSUPPORTED for a non-empty spec on a backend without settings. */
is_status backend_configure(backend *be, const char *spec, char *desc, size_t n);
/* The settings backend_configure takes for the backend of this name, one
 * indented line a key, for --help texts; a line saying there are none for
 * a backend without settings or not in this build. Never NULL. */
const char *backend_options_help(const char *name);
/* Device memory free now, in bytes: 0 for a backend without device memory
 * of its own (the CPU) or on an error. */
size_t backend_free_bytes(backend *be);

#endif

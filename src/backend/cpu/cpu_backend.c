/*
 * cpu_backend: the reference backend. f32 weights and activations in host
 * memory, OpenBLAS for the matrix products (it runs its own threads), OpenMP
 * across the two cores for attention and the element-wise ops.
 *
 * Matrix products of a few tokens (decode, short prefills) read the weight's
 * GGUF blocks instead (cpu_qmatmul): they stream a sixth of the bytes of the
 * f32 copy, and at small T bytes are the cost. The f32 copy stays for
 * sgemm at large T, for get_rows, and for types the kernel does not read.
 *
 * Attention reads the KV cache through each sequence's block table: for a
 * sequence and a KV head it gathers the keys and values of the positions the
 * batch's queries can see into contiguous scratch, then (for prefill chunks)
 * computes scores with one GEMM, masks and normalises them, and multiplies by
 * V with a second GEMM. Single-token queries (decode) use direct loops,
 * where a GEMM call would cost more than it saves.
 *
 * Failures (backend.h): the CPU's ops fail only where memory runs out or a
 * fault is injected; the first failure is latched, and later ops return at
 * once until recover, exactly as on the GPU, so the engine's and the
 * server's failure paths are tested here.
 */
#include "backend/backend.h"
#include "backend/cpu/cpu_qmatmul.h"

#include "core/status.h"
#include "core/threads.h"
#include "core/vmath.h"
#include "gguf/tensor_type.h"
#include "gguf/quant.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_weight {
    backend_weight base; /* shape; must stay first */
    float *data;         /* [rows][cols] */
    /* The tensor's bytes in the GGUF mapping ([rows] rows of packed blocks
     * of raw_type), which lives as long as the model; NULL when
     * cpu_qmatmul cannot read this type, so matmul uses data only. */
    const void *raw;
    uint32_t raw_type;
} cpu_weight;

/* Largest batch that takes the quantised kernel; larger ones take sgemm on
 * the f32 copy. The kernel is bound by AVX2 FMAs from a few tokens on, and
 * OpenBLAS's sgemm (AVX-512 here) catches up as T grows. bench_engine
 * prefill tok/s, SmolLM2-135M Q4_1, 2 threads, idle box, two runs each:
 *   T           8        16       24       32       40       48       64
 *   qmatmul  368-401  396-434  411-421  406-436  410-422  416-435  402-407
 *   sgemm    131-131  251-256  283-298  391-393  400-410  539-553  622-633
 * The kernel up to 32, where it still wins; they tie at 40. */
#define CPU_QMATMUL_MAX_T 32

typedef struct cpu_ctx {
    int32_t n_threads;
    float *rope_cs;       /* [rope_n_pos][n_rot/2][cos, sin] */
    int32_t rope_n_pos;   /* positions in the table */
    rope_params rope_key; /* parameters the table was built for */
    is_status err;        /* first failure of an op since the last recover, latched */
    char err_msg[512];
} cpu_ctx;

/* Latches the first failure; later ones are its consequences. */
static void op_fail(backend *be, is_status st, const char *fmt, ...) {
    cpu_ctx *c = be->ctx;
    if (c->err != IS_OK) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err_msg, sizeof c->err_msg, fmt, ap);
    va_end(ap);
    c->err = st;
    fprintf(stderr, "cpu backend: %s (further ops are skipped until it recovers)\n", c->err_msg);
}

/* False once an op has failed, or when this op is the injected fault. */
static bool op_begin(backend *be) {
    cpu_ctx *c = be->ctx;
    if (c->err != IS_OK) return false;
    if (backend_fault_tick(be)) {
        op_fail(be, IS_ERR_INTERNAL, "injected fault at op %lld", (long long)backend_op_count(be));
        return false;
    }
    return true;
}

static is_status cpu_status(backend *be) {
    cpu_ctx *c = be->ctx;
    if (c->err == IS_OK) return IS_OK;
    return is_error_set(c->err, "cpu backend: %s", c->err_msg);
}

/* Nothing an op leaves behind outlives it here (the rope table is only
 * replaced once complete), so clearing the latch is the whole recovery. */
static is_status cpu_recover(backend *be) {
    cpu_ctx *c = be->ctx;
    c->err = IS_OK;
    c->err_msg[0] = '\0';
    return IS_OK;
}

static is_status cpu_alloc(backend *be, size_t bytes, void **out) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return is_error_set(IS_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes", bytes);
    *out = p;
    return IS_OK;
}

static void cpu_release(backend *be, void *ptr) { free(ptr); }

static void cpu_copy(backend *be, void *dst, const void *src, size_t bytes) {
    if (!op_begin(be)) return;
    memcpy(dst, src, bytes);
}

static void cpu_narrow(backend *be, void *dst, int32_t dtype, const float *x, size_t n) {
    if (!op_begin(be)) return;
    switch (dtype) {
    case 0: memcpy(dst, x, n * sizeof(float)); return;
    case 1: quant_f32_to_f16_row(x, dst, n); return;
    case 2: quant_f32_to_bf16_row(x, dst, n); return;
    }
    IS_ASSERT(!"cpu_narrow: invalid dtype");
}

static is_status cpu_weight_create(backend *be, const gguf_tensor *t, backend_weight **out) {
    if (t->n_dims > 2 || t->ne[2] != 1 || t->ne[3] != 1)
        return is_error_set(IS_ERR_UNSUPPORTED, "cpu backend: tensor '%s' has %u dims", t->name,
                            t->n_dims);
    if (!quant_can_dequantize(t->type))
        return is_error_set(IS_ERR_UNSUPPORTED, "cpu backend: tensor '%s' has unsupported type %u",
                            t->name, t->type);
    cpu_weight *w = calloc(1, sizeof *w);
    if (!w) return is_error_set(IS_ERR_NOMEM, "cpu backend: out of memory");
    w->base.shape.cols = t->ne[0];
    w->base.shape.rows = t->ne[1];
    if (cpu_qmatmul_supports(t->type, t->ne[0])) {
        w->raw = t->data;
        w->raw_type = t->type;
    }
    int64_t n = t->ne[0] * t->ne[1];
    is_status st = cpu_alloc(be, (size_t)n * sizeof(float), (void **)&w->data);
    if (st != IS_OK) {
        free(w);
        return st;
    }
    /* Rows are independent blocks of the file: dequantise them in parallel. */
    size_t row_bytes = tensor_type_row_bytes(t->type, t->ne[0]);
    int64_t rows = t->ne[1];
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = (const uint8_t *)t->data + (size_t)r * row_bytes;
        if (quant_dequantize(t->type, src, w->data + r * t->ne[0], t->ne[0]) != IS_OK) failed = 1;
    }
    if (failed) {
        free(w->data);
        free(w);
        return is_error_set(IS_ERR_FORMAT, "cpu backend: cannot dequantise tensor '%s'", t->name);
    }
    *out = &w->base;
    return IS_OK;
}

static void cpu_weight_free(backend *be, backend_weight *bw) {
    if (!bw) return;
    cpu_weight *w = (cpu_weight *)bw;
    free(w->data);
    free(w);
}

static const float *wdata(const backend_weight *bw) { return ((const cpu_weight *)bw)->data; }

static void cpu_get_rows(backend *be, float *out, const backend_weight *emb, const int32_t *tokens,
                         int32_t T) {
    if (!op_begin(be)) return;
    int64_t cols = emb->shape.cols;
    for (int32_t t = 0; t < T; t++) {
        IS_ASSERT(tokens[t] >= 0 && tokens[t] < emb->shape.rows);
        memcpy(out + (int64_t)t * cols, wdata(emb) + (int64_t)tokens[t] * cols,
               (size_t)cols * sizeof(float));
    }
}

static void cpu_rmsnorm(backend *be, float *out, const float *x, const backend_weight *g, int32_t T,
                        int32_t n, float eps) {
    if (!op_begin(be)) return;
    threads_attach();
    const float *gw = wdata(g);
#pragma omp parallel for schedule(static) if (T > 8)
    for (int32_t t = 0; t < T; t++) {
        const float *xr = x + (int64_t)t * n;
        float *o = out + (int64_t)t * n;
        float ss = 0.0f;
        for (int32_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (int32_t i = 0; i < n; i++) o[i] = xr[i] * scale * gw[i];
    }
}

static void cpu_matmul(backend *be, float *y, const float *x, const backend_weight *w,
                       const backend_weight *bias, int32_t T) {
    if (!op_begin(be)) return;
    threads_attach();
    int64_t rows = w->shape.rows, cols = w->shape.cols;
    const cpu_weight *cw = (const cpu_weight *)w;
    /* Few tokens: stream the quantised blocks. If its scratch cannot be
     * allocated, the f32 path below needs none. */
    bool done = cw->raw && T <= CPU_QMATMUL_MAX_T &&
                cpu_qmatmul(y, x, cw->raw, cw->raw_type, rows, cols, T) == IS_OK;
    if (!done && T == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (blasint)rows, (blasint)cols, 1.0f, wdata(w),
                    (blasint)cols, x, 1, 0.0f, y, 1);
    else if (!done)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, (blasint)rows, (blasint)cols, 1.0f,
                    x, (blasint)cols, wdata(w), (blasint)cols, 0.0f, y, (blasint)rows);
    if (bias) {
        const float *b = wdata(bias);
        for (int32_t t = 0; t < T; t++)
            for (int64_t i = 0; i < rows; i++) y[(int64_t)t * rows + i] += b[i];
    }
}

/* Inverse frequencies computed the way the reference implementations do
 * (f32 power, then f32 reciprocal), so angles at long range agree. */
static void rope_inv_freq(const rope_params *rp, float *inv) {
    for (int32_t i = 0; i < rp->n_rot / 2; i++) {
        inv[i] = 1.0f / powf(rp->freq_base, (float)(2 * i) / (float)rp->n_rot);
        if (rp->freq_factors) inv[i] /= rp->freq_factors[i];
    }
}

/* cos/sin of every (position, pair) seen so far, grown on demand: the
 * angles depend only on the position, so the 2 x layers rotations of a
 * batch (and every injection) share one table instead of calling sincos
 * per layer.
 *
 * The angle is formed in double: in f32, p * inv rounds to within
 * |theta| * 6e-8, about 2e-4 rad at position 3000, which is enough to make a
 * fact's keys depend on where it was encoded (the position-invariance test
 * sees 2e-5 relative in f32, 1e-7 here). */
static const float *rope_table(cpu_ctx *ctx, const rope_params *rp, int32_t max_pos) {
    int32_t half = rp->n_rot / 2;
    bool same = ctx->rope_cs && ctx->rope_key.layout == rp->layout &&
                ctx->rope_key.n_rot == rp->n_rot && ctx->rope_key.freq_base == rp->freq_base &&
                ctx->rope_key.freq_scale == rp->freq_scale &&
                ctx->rope_key.freq_factors == rp->freq_factors;
    if (same && max_pos < ctx->rope_n_pos) return ctx->rope_cs;
    int32_t from = same ? ctx->rope_n_pos : 0;
    int32_t n = max_pos + 1 > 2 * ctx->rope_n_pos ? max_pos + 1 : 2 * ctx->rope_n_pos;
    if (n < 4096) n = 4096;
    float *cs = realloc(ctx->rope_cs, (size_t)n * half * 2 * sizeof(float));
    if (!cs) return NULL; /* the old table stays the context's */
    float inv[512];
    IS_ASSERT(half <= 512);
    rope_inv_freq(rp, inv);
#pragma omp parallel for schedule(static)
    for (int32_t p = from; p < n; p++) {
        double pp = (double)p * (double)rp->freq_scale;
        for (int32_t i = 0; i < half; i++) {
            double theta = pp * (double)inv[i];
            cs[((size_t)p * half + i) * 2] = (float)cos(theta);
            cs[((size_t)p * half + i) * 2 + 1] = (float)sin(theta);
        }
    }
    ctx->rope_cs = cs;
    ctx->rope_n_pos = n;
    ctx->rope_key = *rp;
    return cs;
}

/* Rotates one head's vector by the angles cs (cos, sin pairs; sgn -1 for a
 * negative position), reading src and writing dst (which may be src). The
 * one rotation both rope and inject use, so the two paths agree bit for bit. */
static inline void rope_head(float *dst, const float *src, const float *cs, float sgn,
                             rope_layout layout, int32_t half, int32_t head_dim, int32_t n_rot) {
    if (layout == ROPE_LAYOUT_NORM) {
        for (int32_t i = 0; i < half; i++) {
            float a = src[2 * i], b = src[2 * i + 1], c = cs[2 * i], s = sgn * cs[2 * i + 1];
            dst[2 * i] = a * c - b * s;
            dst[2 * i + 1] = a * s + b * c;
        }
    } else {
        for (int32_t i = 0; i < half; i++) {
            float a = src[i], b = src[i + half], c = cs[2 * i], s = sgn * cs[2 * i + 1];
            dst[i] = a * c - b * s;
            dst[i + half] = a * s + b * c;
        }
    }
    if (dst != src && n_rot < head_dim)
        memcpy(dst + n_rot, src + n_rot, (size_t)(head_dim - n_rot) * sizeof(float));
}

static void cpu_rope(backend *be, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                     int32_t head_dim, const rope_params *rp) {
    if (!op_begin(be)) return;
    threads_attach();
    int32_t half = rp->n_rot / 2;
    /* Negative positions (the segment-masked reference places a fact's
     * context before the prefix) use cos(-a) = cos a, sin(-a) = -sin a. */
    int32_t max_pos = 0;
    for (int32_t t = 0; t < T; t++) {
        int32_t ap = pos[t] < 0 ? -pos[t] : pos[t];
        if (ap > max_pos) max_pos = ap;
    }
    const float *table = rope_table(be->ctx, rp, max_pos);
    if (!table) {
        op_fail(be, IS_ERR_NOMEM, "out of memory for the rope table");
        return;
    }
#pragma omp parallel for schedule(static) if (T > 4)
    for (int32_t t = 0; t < T; t++) {
        const float *cs = table + (size_t)(pos[t] < 0 ? -pos[t] : pos[t]) * half * 2;
        float sgn = pos[t] < 0 ? -1.0f : 1.0f;
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + ((int64_t)t * n_heads + h) * head_dim;
            rope_head(v, v, cs, sgn, rp->layout, half, head_dim, rp->n_rot);
        }
    }
}

/* Chunked RoPE + scatter in one pass: each stored pre-RoPE key row is
 * rotated straight from the record into its cache slot and each value row
 * copied, every (layer, token) independently, so both cores share the work
 * and nothing is staged (the engine's generic path copies each row into the
 * activation buffer first, then rotates, then scatters). The tokens of
 * several sequences' facts (in->pos) are one such list: threads split
 * (sequence, fact, layer) work alike. */
static void cpu_inject(backend *be, float *const *k_cache, float *const *v_cache,
                       const backend_inject *in) {
    if (!op_begin(be)) return;
    threads_attach();
    int64_t total = 0;
    for (int32_t f = 0; f < in->n_facts; f++) total += in->facts[f].n_tokens;
    if (total == 0) return;
    const rope_params *rp = in->rope;
    int32_t half = rp->n_rot / 2, kv_dim = in->n_kv_heads * in->head_dim;
    int32_t max_pos = in->pos0 + (int32_t)total - 1;
    if (in->pos) {
        max_pos = 0;
        for (int64_t i = 0; i < total; i++)
            if (in->pos[i] > max_pos) max_pos = in->pos[i];
    }
    const float *table = rope_table(be->ctx, rp, max_pos);
    /* Where each token comes from: its fact and its index in the fact. */
    int32_t *fact_of = table ? malloc((size_t)total * 2 * sizeof *fact_of) : NULL;
    if (!fact_of) {
        op_fail(be, IS_ERR_NOMEM, "out of memory injecting %lld tokens", (long long)total);
        return;
    }
    int32_t *tok_of = fact_of + total;
    for (int32_t f = 0, i = 0; f < in->n_facts; f++)
        for (int32_t j = 0; j < in->facts[f].n_tokens; j++, i++) {
            fact_of[i] = f;
            tok_of[i] = j;
        }
    int64_t work = (int64_t)in->n_layers * total;
#pragma omp parallel for schedule(static) if (work > 64)
    for (int64_t w = 0; w < work; w++) {
        int32_t l = (int32_t)(w / total), i = (int32_t)(w % total);
        const backend_fact *fa = &in->facts[fact_of[i]];
        size_t src = ((size_t)l * fa->n_tokens + tok_of[i]) * kv_dim;
        const float *cs = table + (size_t)(in->pos ? in->pos[i] : in->pos0 + i) * half * 2;
        int32_t block = in->slots[i] / in->block_size, off = in->slots[i] % in->block_size;
        for (int32_t h = 0; h < in->n_kv_heads; h++) {
            size_t dst =
                (((size_t)block * in->n_kv_heads + h) * in->block_size + off) * in->head_dim;
            const float *ks = fa->k + src + (size_t)h * in->head_dim;
            rope_head(k_cache[l] + dst, ks, cs, 1.0f, rp->layout, half, in->head_dim, rp->n_rot);
            memcpy(v_cache[l] + dst, fa->v + src + (size_t)h * in->head_dim,
                   (size_t)in->head_dim * sizeof(float));
        }
    }
    free(fact_of);
}

static void cpu_kv_store(backend *be, float *k_cache, float *v_cache, const float *k,
                         const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                         int32_t head_dim, int32_t block_size) {
    if (!op_begin(be)) return;
    threads_attach();
    for (int32_t t = 0; t < T; t++) {
        int32_t block = slots[t] / block_size, off = slots[t] % block_size;
        for (int32_t h = 0; h < n_kv_heads; h++) {
            size_t dst = (((size_t)block * n_kv_heads + h) * block_size + off) * head_dim;
            size_t src = ((size_t)t * n_kv_heads + h) * head_dim;
            memcpy(k_cache + dst, k + src, (size_t)head_dim * sizeof(float));
            memcpy(v_cache + dst, v + src, (size_t)head_dim * sizeof(float));
        }
    }
}

/* May the query in slot qp see the key in slot kp? (segments: backend.h) */
static inline bool attn_visible(int32_t qp, int32_t kp, const int32_t *seg) {
    if (kp > qp) return false;
    if (!seg) return true;
    int32_t qs = seg[qp], ks = seg[kp];
    if (ks == 0) return true;
    if (ks > 0) return qs == 0 || qs == ks || qs == -ks;
    return qs == ks || qs == -ks;
}

/* Copies positions [0, n) of one KV head of a sequence into dst[n][head_dim]. */
static void gather_head(float *dst, const float *cache, const int32_t *blocks, int32_t n, int32_t h,
                        int32_t n_kv_heads, int32_t head_dim, int32_t block_size) {
    for (int32_t p0 = 0; p0 < n; p0 += block_size) {
        int32_t cnt = n - p0 < block_size ? n - p0 : block_size;
        const float *src =
            cache + (((size_t)blocks[p0 / block_size] * n_kv_heads + h) * block_size) * head_dim;
        memcpy(dst + (size_t)p0 * head_dim, src, (size_t)cnt * head_dim * sizeof(float));
    }
}

/* How a query scores its sequence's memory keys (attn_batch.mem_span):
 * keys [begin, end) take score * mul + add, for queries at or after end. */
typedef struct mem_map {
    int32_t begin, end;
    float mul, add;
} mem_map;

static mem_map mem_map_of(const attn_batch *b, int32_t s) {
    mem_map mm = {0, 0, 1.0f, 0.0f};
    if (!b->mem_span || b->mem_span[2 * s] >= b->mem_span[2 * s + 1]) return mm;
    mm.begin = b->mem_span[2 * s];
    mm.end = b->mem_span[2 * s + 1];
    mm.mul = 1.0f / b->mem_temp;
    mm.add = logf(b->mem_mass);
    return mm;
}

/* Softmax of row[0..n) in place over the visible entries (others get 0). */
static void masked_softmax(float *row, int32_t n, int32_t qp, const int32_t *seg, float scale,
                           const mem_map *mm) {
    float mx = -INFINITY;
    const bool mapped = mm->begin < mm->end && qp >= mm->end;
    for (int32_t j = 0; j < n; j++) {
        if (attn_visible(qp, j, seg)) {
            row[j] *= scale;
            if (mapped && j >= mm->begin && j < mm->end) row[j] = row[j] * mm->mul + mm->add;
            if (row[j] > mx) mx = row[j];
        } else {
            row[j] = -INFINITY;
        }
    }
    float sum = vmath_exp_sub_sum(row, n, mx);
    float inv = 1.0f / sum;
    for (int32_t j = 0; j < n; j++) row[j] *= inv;
}

/* Tokens of one sequence that are consecutive in the batch form a run; a
 * run is processed as a unit (its keys are gathered once). */
static void cpu_attention(backend *be, float *out, const float *q, const float *k_cache,
                          const float *v_cache, const attn_batch *b, int32_t n_heads,
                          int32_t n_kv_heads, int32_t head_dim, int32_t block_size) {
    if (!op_begin(be)) return;
    threads_attach();
    int32_t n_rep = n_heads / n_kv_heads;
    float scale = 1.0f / sqrtf((float)head_dim);
    int32_t q_stride = n_heads * head_dim;

    for (int32_t t0 = 0; t0 < b->n_tokens;) {
        int32_t s = b->seq_of_token[t0];
        int32_t t1 = t0 + 1;
        while (t1 < b->n_tokens && b->seq_of_token[t1] == s) t1++;
        int32_t run = t1 - t0;
        int32_t n_keys = 0;
        for (int32_t t = t0; t < t1; t++)
            if (b->pos[t] + 1 > n_keys) n_keys = b->pos[t] + 1;
        IS_ASSERT(n_keys <= b->seq_len[s]);
        const int32_t *blocks = b->block_tables[s];
        const int32_t *seg = b->seq_segments ? b->seq_segments[s] : NULL;
        const mem_map mm = mem_map_of(b, s);

        if (run < 8 || b->q_prefix) {
            /* Decode-sized: direct loops over (token, head). */
#pragma omp parallel
            {
                float *scores = malloc((size_t)n_keys * sizeof(float));
#pragma omp for collapse(2) schedule(static)
                for (int32_t t = t0; t < t1; t++) {
                    for (int32_t h = 0; h < n_heads; h++) {
                        int32_t kh = h / n_rep;
                        const float *qv = q + (size_t)t * q_stride + (size_t)h * head_dim;
                        const float *qpre =
                            b->q_prefix ? b->q_prefix + (size_t)t * q_stride + (size_t)h * head_dim
                                        : qv;
                        int32_t qp = b->pos[t];
                        for (int32_t j = 0; j < n_keys; j++) {
                            const float *qj = (seg && seg[j] == 0) ? qpre : qv;
                            const float *kv =
                                k_cache +
                                (((size_t)blocks[j / block_size] * n_kv_heads + kh) * block_size +
                                 j % block_size) *
                                    head_dim;
                            float d = 0.0f;
                            for (int32_t i = 0; i < head_dim; i++) d += qj[i] * kv[i];
                            scores[j] = d;
                        }
                        masked_softmax(scores, n_keys, qp, seg, scale, &mm);
                        float *o = out + (size_t)t * q_stride + (size_t)h * head_dim;
                        memset(o, 0, (size_t)head_dim * sizeof(float));
                        for (int32_t j = 0; j < n_keys; j++) {
                            float pj = scores[j];
                            if (pj == 0.0f) continue;
                            const float *vv =
                                v_cache +
                                (((size_t)blocks[j / block_size] * n_kv_heads + kh) * block_size +
                                 j % block_size) *
                                    head_dim;
                            for (int32_t i = 0; i < head_dim; i++) o[i] += pj * vv[i];
                        }
                    }
                }
                free(scores);
            }
            t0 = t1;
            continue;
        }

        /* Prefill-sized: gather every KV head's keys and values once, then
         * two GEMMs per (KV head, query chunk). The pairs are spread over
         * the threads, each GEMM single-threaded inside them: a short query
         * (the ~30 tokens after injected memory) then keeps every core busy
         * with whole heads instead of splitting small GEMMs. Rows of S are
         * ordered (token, rep head). */
        const int32_t chunk = run <= 64 ? 16 : 128;
        const int32_t n_chunks = (run + chunk - 1) / chunk;
        size_t head_elems = (size_t)n_keys * head_dim;
        float *kall = malloc((size_t)n_kv_heads * head_elems * sizeof(float));
        float *vall = malloc((size_t)n_kv_heads * head_elems * sizeof(float));
        IS_ASSERT(kall && vall);
#pragma omp parallel for schedule(static) if (n_kv_heads > 1)
        for (int32_t kh = 0; kh < n_kv_heads; kh++) {
            gather_head(kall + kh * head_elems, k_cache, blocks, n_keys, kh, n_kv_heads, head_dim,
                        block_size);
            gather_head(vall + kh * head_elems, v_cache, blocks, n_keys, kh, n_kv_heads, head_dim,
                        block_size);
        }
#pragma omp parallel
        {
            float *qbuf = malloc((size_t)chunk * n_rep * head_dim * sizeof(float));
            float *obuf = malloc((size_t)chunk * n_rep * head_dim * sizeof(float));
            float *sbuf = malloc((size_t)chunk * n_rep * n_keys * sizeof(float));
            IS_ASSERT(qbuf && obuf && sbuf);
#pragma omp for schedule(dynamic)
            for (int32_t item = 0; item < n_kv_heads * n_chunks; item++) {
                int32_t kh = item / n_chunks;
                int32_t c0 = t0 + (item % n_chunks) * chunk;
                int32_t cn = t1 - c0 < chunk ? t1 - c0 : chunk;
                const float *kbuf = kall + kh * head_elems, *vbuf = vall + kh * head_elems;
                int32_t ck = 0; /* keys this chunk can see */
                for (int32_t t = c0; t < c0 + cn; t++)
                    if (b->pos[t] + 1 > ck) ck = b->pos[t] + 1;
                int32_t m = cn * n_rep;
                for (int32_t t = 0; t < cn; t++)
                    for (int32_t r = 0; r < n_rep; r++)
                        memcpy(qbuf + ((size_t)t * n_rep + r) * head_dim,
                               q + (size_t)(c0 + t) * q_stride +
                                   (size_t)(kh * n_rep + r) * head_dim,
                               (size_t)head_dim * sizeof(float));
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, ck, head_dim, 1.0f, qbuf,
                            head_dim, kbuf, head_dim, 0.0f, sbuf, ck);
                for (int32_t row = 0; row < m; row++)
                    masked_softmax(sbuf + (size_t)row * ck, ck, b->pos[c0 + row / n_rep], seg,
                                   scale, &mm);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, head_dim, ck, 1.0f, sbuf,
                            ck, vbuf, head_dim, 0.0f, obuf, head_dim);
                for (int32_t t = 0; t < cn; t++)
                    for (int32_t r = 0; r < n_rep; r++)
                        memcpy(out + (size_t)(c0 + t) * q_stride +
                                   (size_t)(kh * n_rep + r) * head_dim,
                               obuf + ((size_t)t * n_rep + r) * head_dim,
                               (size_t)head_dim * sizeof(float));
            }
            free(qbuf);
            free(obuf);
            free(sbuf);
        }
        free(kall);
        free(vall);
        t0 = t1;
    }
}

static void cpu_swiglu(backend *be, float *out, const float *gate, const float *up, int64_t n) {
    if (!op_begin(be)) return;
    threads_attach();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void cpu_add(backend *be, float *x, const float *y, int64_t n) {
    if (!op_begin(be)) return;
    threads_attach();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* Nothing to wait for; an op all the same, so faults can land on it. */
static void cpu_sync(backend *be) { (void)op_begin(be); }

static void cpu_free(backend *be) {
    if (!be) return;
    free(((cpu_ctx *)be->ctx)->rope_cs);
    free(be->ctx);
    free(be);
}

static void cpu_argmax(backend *be, int32_t *out, const float *x, int32_t rows, int32_t n) {
    if (!op_begin(be)) return;
    for (int32_t r = 0; r < rows; r++) out[r] = vmath_argmax(x + (size_t)r * n, n);
}

static const backend_ops cpu_ops = {
    .name = "cpu",
    .free = cpu_free,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .narrow = cpu_narrow,
    .weight_create = cpu_weight_create,
    .weight_free = cpu_weight_free,
    .get_rows = cpu_get_rows,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .sync = cpu_sync,
    .inject = cpu_inject,
    .argmax = cpu_argmax,
    .status = cpu_status,
    .recover = cpu_recover,
};

is_status backend_cpu_create(int32_t n_threads, backend **out) {
    backend *be = calloc(1, sizeof *be);
    cpu_ctx *ctx = calloc(1, sizeof *ctx);
    if (!be || !ctx) {
        free(be);
        free(ctx);
        return is_error_set(IS_ERR_NOMEM, "cpu backend: out of memory");
    }
    /* Process-wide, once: see core/threads.h for why every thread that
     * enters BLAS must agree with it. */
    ctx->n_threads = threads_init(n_threads);
    be->ops = &cpu_ops;
    be->ctx = ctx;
    *out = be;
    return IS_OK;
}

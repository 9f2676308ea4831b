/*
 * embed: the sentence embedder on the GPU (see retrieval_cuda.h), a mirror
 * of src/memory/embedder.c's forward pass. Sections: kernels, weights and
 * buffers, forward pass, public calls.
 *
 * A batch is packed as on the CPU: the T tokens of all texts form one
 * [T][H] matrix for the four projections of a layer (cuBLAS SGEMM, plain
 * f32: the default math mode never rounds inputs to TF32), attention runs
 * one block per (text, head) with that text's keys and values in shared
 * memory, and the LayerNorm, GELU and pooling kernels take one row or
 * element at a time, with the CPU's formulas in the CPU's order of
 * operations (two-pass LayerNorm, the same rational erf, f64 pooling and
 * norm). Biases of the projections are folded into what reads them next
 * (the query/key/value bias into attention's loads, the other biases into
 * GELU and the residual + LayerNorm). The host uploads token ids and text
 * offsets only (pinned staging, reused once the previous upload has
 * landed).
 */
#include "retrieval.cuh"
#include "retrieval_cuda.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A batch runs in chunks of at most this many tokens (a text is at most
 * max_tokens <= 512 of them): work buffers of CHUNK_TOKENS * (6H + I)
 * floats, 126 MB for MiniLM. */
#define CHUNK_TOKENS 8192
/* Texts are tokenised this many at a time (host buffer of TOKENIZE_TEXTS *
 * max_tokens ids). */
#define TOKENIZE_TEXTS 256
#define LN_THREADS     128
#define ATT_WARPS      4
#define POOL_THREADS   128

/* ---- kernels ----------------------------------------------------------- */

template <typename T> static __device__ __forceinline__ T warp_sum_t(T v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

/* Sum of v over the block (every thread gets it); red holds 33 values. */
template <typename T> static __device__ T block_sum(T v, T *red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum_t(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? red[lane] : (T)0;
        v = warp_sum_t(v);
        if (lane == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];
}

/* row = LayerNorm(row) * g + b in place, row already summed; the CPU's two
 * passes (mean, then the variance of the differences). Each thread reads
 * back only the elements it wrote. */
static __device__ void layernorm_row(float *row, const float *g, const float *b, int32_t n,
                                     float eps, float *red) {
    float s = 0.0f;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) s += row[i];
    const float mean = block_sum(s, red) / (float)n;
    float v = 0.0f;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = row[i] - mean;
        v += d * d;
    }
    const float var = block_sum(v, red) / (float)n;
    const float inv = 1.0f / sqrtf(var + eps);
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x)
        row[i] = (row[i] - mean) * inv * g[i] + b[i];
}

/* Block (text i, position p): x[off[i] + p] = LayerNorm(word + position +
 * type-0 embedding). Blocks past a text's length return at once. */
static __global__ void
embed_ln_kernel(float *__restrict__ x, const int32_t *__restrict__ ids,
                const int32_t *__restrict__ off, const float *__restrict__ tok_emb,
                const float *__restrict__ pos_emb, const float *__restrict__ type_emb,
                const float *__restrict__ g, const float *__restrict__ b, int32_t H, float eps) {
    __shared__ float red[33];
    const int32_t o = off[blockIdx.x], len = off[blockIdx.x + 1] - o, p = blockIdx.y;
    if (p >= len) return; /* the whole block */
    float *row = x + (int64_t)(o + p) * H;
    const float *w = tok_emb + (int64_t)ids[o + p] * H, *pe = pos_emb + (int64_t)p * H;
    for (int32_t i = threadIdx.x; i < H; i += blockDim.x) row[i] = w[i] + pe[i] + type_emb[i];
    layernorm_row(row, g, b, H, eps, red);
}

/* One block per row: x = LayerNorm(x + r + bias). */
static __global__ void add_ln_kernel(float *__restrict__ x, const float *__restrict__ r,
                                     const float *__restrict__ bias, const float *__restrict__ g,
                                     const float *__restrict__ b, int32_t H, float eps) {
    __shared__ float red[33];
    float *row = x + (int64_t)blockIdx.x * H;
    const float *rr = r + (int64_t)blockIdx.x * H;
    for (int32_t i = threadIdx.x; i < H; i += blockDim.x) row[i] = row[i] + rr[i] + bias[i];
    layernorm_row(row, g, b, H, eps, red);
}

/* GELU(x) = x/2 (1 + erf(x / sqrt 2)) with embedder.c's erf: the same
 * rational function, clamp and fused multiply-adds as its AVX2 lanes. */
static __device__ __forceinline__ float gelu_erf(float v) {
    const float y = fminf(fmaxf(v * 0.70710678118654752f, -4.0f), 4.0f);
    const float y2 = y * y;
    float p = fmaf(-2.72614225801306e-10f, y2, 2.77068142495902e-08f);
    p = fmaf(p, y2, -2.10102402082508e-06f);
    p = fmaf(p, y2, -5.69250639462346e-05f);
    p = fmaf(p, y2, -7.34990630326855e-04f);
    p = fmaf(p, y2, -2.95459980854025e-03f);
    p = fmaf(p, y2, -1.60960333262415e-02f);
    float q = fmaf(-1.45660718464996e-05f, y2, -2.13374055278905e-04f);
    q = fmaf(q, y2, -1.68282697438203e-03f);
    q = fmaf(q, y2, -7.37332916720468e-03f);
    q = fmaf(q, y2, -1.42647390514189e-02f);
    const float erf = y * p / q;
    return 0.5f * v * (1.0f + erf);
}

/* ff[t][j] = GELU(ff[t][j] + bias[j]) over n = T * I values. */
static __global__ void bias_gelu_kernel(float *__restrict__ ff, const float *__restrict__ bias,
                                        int64_t n, int32_t I) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        ff[i] = gelu_erf(ff[i] + bias[i % I]);
}

/* Dynamic shared memory of attention_kernel for texts of up to L tokens:
 * K [L][dh + 1] (padded: lanes read different keys' same column), V
 * [L][dh], and per warp a query row [dh] and a row of probabilities [L]. */
static size_t attention_smem(int32_t L, int32_t dh) {
    return ((size_t)L * (size_t)(2 * dh + 1) + (size_t)ATT_WARPS * (size_t)(dh + L)) *
           sizeof(float);
}

/* One block per (text, head): ctx rows of the text, head h's columns =
 * softmax(q k^T * scale) v, as embedder.c's attention_head. Warps take
 * query rows in turn; lanes split the keys for the scores and the head's
 * columns for the weighted sum. qkv holds the projections without bias. */
static __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_kernel(float *__restrict__ ctx, const float *__restrict__ qkv,
                     const float *__restrict__ bqkv, const int32_t *__restrict__ off,
                     int32_t n_heads, int32_t H, int32_t dh, float scale) {
    extern __shared__ float sm[];
    const int32_t text = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    const int32_t o = off[text], len = off[text + 1] - o;
    const int32_t ld = 3 * H, kd = dh + 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *ks = sm;                                        /* [len][dh + 1] */
    float *vs = ks + (size_t)len * kd;                     /* [len][dh] */
    float *qs = vs + (size_t)len * dh + (size_t)warp * dh; /* [dh] this warp's */
    float *ps = vs + (size_t)len * dh + (size_t)ATT_WARPS * dh + (size_t)warp * len; /* [len] */
    const float *base = qkv + (int64_t)o * ld + (int64_t)h * dh;
    const float *bq = bqkv + (int64_t)h * dh, *bk = bq + H, *bv = bq + 2 * H;
    for (int32_t e = threadIdx.x; e < len * dh; e += blockDim.x) {
        const int32_t j = e / dh, d = e - j * dh;
        const float *r = base + (int64_t)j * ld;
        ks[j * kd + d] = r[H + d] + bk[d];
        vs[j * dh + d] = r[2 * H + d] + bv[d];
    }
    __syncthreads();
    for (int32_t i = warp; i < len; i += ATT_WARPS) {
        const float *r = base + (int64_t)i * ld;
        for (int32_t d = lane; d < dh; d += 32) qs[d] = r[d] + bq[d];
        __syncwarp();
        float mx = -INFINITY;
        for (int32_t j = lane; j < len; j += 32) {
            const float *k = ks + j * kd;
            float s = 0.0f;
            for (int32_t d = 0; d < dh; d++) s = fmaf(qs[d], k[d], s);
            s *= scale;
            ps[j] = s;
            mx = fmaxf(mx, s);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int32_t j = lane; j < len; j += 32) {
            const float e = expf(ps[j] - mx);
            ps[j] = e;
            sum += e;
        }
        const float inv = 1.0f / warp_sum(sum);
        __syncwarp(); /* every lane's ps entries written before all lanes read them */
        float *out = ctx + (int64_t)(o + i) * H + (int64_t)h * dh;
        for (int32_t d = lane; d < dh; d += 32) {
            float acc = 0.0f;
            for (int32_t j = 0; j < len; j++) acc = fmaf(ps[j] * inv, vs[j * dh + d], acc);
            out[d] = acc;
        }
        __syncwarp(); /* qs and ps read by all lanes before the next row overwrites them */
    }
}

/* One block per text: out[i] = normalise(mean of its token rows, or its
 * [CLS] row), the mean and the norm in f64 as on the CPU
 * (x / max(||x||, 1e-12)). */
static __global__ void pool_kernel(float *__restrict__ out, const float *__restrict__ x,
                                   const int32_t *__restrict__ off, int32_t H, bool cls) {
    __shared__ double red[33];
    const int32_t o = off[blockIdx.x], len = off[blockIdx.x + 1] - o;
    float *dst = out + (int64_t)blockIdx.x * H;
    const float *x0 = x + (int64_t)o * H;
    double ss = 0.0;
    for (int32_t d = threadIdx.x; d < H; d += blockDim.x) {
        float v;
        if (cls) {
            v = x0[d];
        } else {
            double s = 0.0;
            for (int32_t p = 0; p < len; p++) s += x0[(int64_t)p * H + d];
            v = (float)(s / len);
        }
        dst[d] = v;
        ss += (double)v * v;
    }
    const double norm = sqrt(block_sum(ss, red));
    const float inv = (float)(1.0 / (norm > 1e-12 ? norm : 1e-12));
    for (int32_t d = threadIdx.x; d < H; d += blockDim.x) dst[d] *= inv;
}

/* ---- weights and buffers ---------------------------------------------- */

typedef struct gpu_layer {
    const float *wqkv, *bqkv, *wo, *bo, *ln1_g, *ln1_b, *w1, *b1, *w2, *b2, *ln2_g, *ln2_b;
} gpu_layer; /* device pointers into cuda_embedder.weights; shapes as encoder_layer_weights */

struct retrieval_encoder {
    int32_t device;
    int32_t H, n_layers, n_heads, dh, I, n_vocab, max_tokens;
    float ln_eps;
    bool pool_cls;
    encoder_tokenize_fn tokenize; /* the weights' tokenizer (borrowed) */
    const void *tokenizer;
    cublasHandle_t cublas;

    float *weights;        /* one device allocation holding every tensor below */
    const float *tok_emb;  /* (n_vocab, H) */
    const float *pos_emb;  /* (max_tokens, H): the rows a text can reach */
    const float *type_emb; /* (H) */
    const float *emb_ln_g, *emb_ln_b;
    gpu_layer *layers; /* host array (n_layers) */

    /* Work buffers (device), sized for ws_tokens tokens. */
    int32_t ws_tokens;
    float *x;   /* (T, H) hidden states */
    float *qkv; /* (T, 3H) projections, without bias */
    float *ctx; /* (T, H) attention output */
    float *tmp; /* (T, H) projection before residual + LayerNorm */
    float *ff;  /* (T, I) */
    float *out; /* (CHUNK_TOKENS, H) embeddings of a chunk, for the host variants */

    int32_t *meta_dev;  /* [2 * CHUNK_TOKENS + 1]: a chunk's ids, then its n + 1 text offsets */
    int32_t *staging;   /* pinned host copy of meta_dev's contents */
    cudaEvent_t staged; /* recorded after the upload from staging */
    bool staged_pending;
    /* Recorded after a call's last kernel: the next call's stream waits for
     * it, so work buffers are not shared by two threads' streams at once
     * when the embedder changes hands right after an asynchronous call. */
    cudaEvent_t done;
    bool done_pending;

    int32_t *tok; /* host (TOKENIZE_TEXTS, max_tokens) ids of the texts being embedded */
};

/* n floats rounded up to 64, so every tensor is 256-byte aligned. */
static size_t padded(size_t n) { return (n + 63) & ~(size_t)63; }

/* Copies n floats of host data to the device weights at offset *at, and
 * advances *at. */
static is_status put(cuda_embedder *g, size_t *at, const float *h, size_t n, const float **dst) {
    float *d = g->weights + *at;
    CUDA_CHECK(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    *dst = d;
    *at += padded(n);
    return IS_OK;
}

static is_status upload_weights(cuda_embedder *g, const encoder_weights *w) {
    const size_t H = (size_t)g->H, I = (size_t)g->I;
    size_t total =
        padded((size_t)g->n_vocab * H) + padded((size_t)g->max_tokens * H) + 3 * padded(H);
    /* wqkv, bqkv, wo, then six H-vectors (bo, ln1 g/b, b2, ln2 g/b), w1, b1, w2. */
    const size_t per_layer = padded(3 * H * H) + padded(3 * H) + padded(H * H) + 6 * padded(H) +
                             padded(I * H) + padded(I) + padded(H * I);
    total += (size_t)g->n_layers * per_layer;
    CUDA_CHECK(cudaMalloc((void **)&g->weights, total * sizeof(float)));
    g->layers = (gpu_layer *)calloc((size_t)g->n_layers, sizeof *g->layers);
    if (!g->layers) return is_error_set(IS_ERR_NOMEM, "cuda embedder: out of memory");
    size_t at = 0;
    is_status st;
    if ((st = put(g, &at, w->tok_emb, (size_t)g->n_vocab * H, &g->tok_emb)) ||
        (st = put(g, &at, w->pos_emb, (size_t)g->max_tokens * H, &g->pos_emb)) ||
        (st = put(g, &at, w->type_emb, H, &g->type_emb)) ||
        (st = put(g, &at, w->emb_ln_g, H, &g->emb_ln_g)) ||
        (st = put(g, &at, w->emb_ln_b, H, &g->emb_ln_b)))
        return st;
    for (int32_t l = 0; l < g->n_layers; l++) {
        const encoder_layer_weights lw = w->layers[l];
        gpu_layer *L = &g->layers[l];
        if ((st = put(g, &at, lw.wqkv, 3 * H * H, &L->wqkv)) ||
            (st = put(g, &at, lw.bqkv, 3 * H, &L->bqkv)) ||
            (st = put(g, &at, lw.wo, H * H, &L->wo)) || (st = put(g, &at, lw.bo, H, &L->bo)) ||
            (st = put(g, &at, lw.ln1_g, H, &L->ln1_g)) ||
            (st = put(g, &at, lw.ln1_b, H, &L->ln1_b)) ||
            (st = put(g, &at, lw.w1, I * H, &L->w1)) || (st = put(g, &at, lw.b1, I, &L->b1)) ||
            (st = put(g, &at, lw.w2, H * I, &L->w2)) || (st = put(g, &at, lw.b2, H, &L->b2)) ||
            (st = put(g, &at, lw.ln2_g, H, &L->ln2_g)) ||
            (st = put(g, &at, lw.ln2_b, H, &L->ln2_b)))
            return st;
    }
    IS_ASSERT(at == total);
    return IS_OK;
}

static void free_workspace(cuda_embedder *g) {
    cudaFree(g->x);
    cudaFree(g->qkv);
    cudaFree(g->ctx);
    cudaFree(g->tmp);
    cudaFree(g->ff);
    g->x = g->qkv = g->ctx = g->tmp = g->ff = NULL;
    g->ws_tokens = 0;
}

/* Makes the work buffers hold T tokens. Queued work may still use the old
 * ones, so growing waits for the stream first. */
static is_status ensure_workspace(cuda_embedder *g, int32_t T) {
    if (T <= g->ws_tokens) return IS_OK;
    int32_t want = g->ws_tokens * 2 > T ? g->ws_tokens * 2 : T;
    if (want > CHUNK_TOKENS) want = CHUNK_TOKENS;
    IS_ASSERT(want >= T);
    CUDA_CHECK(cudaStreamSynchronize(RETRIEVAL_STREAM));
    free_workspace(g);
    const size_t t = (size_t)want, H = (size_t)g->H, I = (size_t)g->I;
    cudaError_t e = cudaMalloc((void **)&g->x, t * H * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&g->qkv, t * 3 * H * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&g->ctx, t * H * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&g->tmp, t * H * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)&g->ff, t * I * sizeof(float));
    if (e != cudaSuccess) {
        free_workspace(g);
        return cuda_status_from(e, "cudaMalloc (embedder work buffers)", __FILE__, __LINE__);
    }
    g->ws_tokens = want;
    return IS_OK;
}

/* ---- forward pass ------------------------------------------------------ */

/* c[T][n_out] = a[T][k_in] w[n_out][k_in]^T (row-major; cuBLAS sees the
 * column-major transposes: c^T = w a^T). */
static is_status linear(cuda_embedder *g, float *c, const float *a, const float *w, int32_t T,
                        int32_t n_out, int32_t k_in) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasSgemm(g->cublas, CUBLAS_OP_T, CUBLAS_OP_N, n_out, T, k_in, &one, w, k_in, a,
                             k_in, &zero, c, n_out));
    return IS_OK;
}

/* Runs the encoder on n texts of T tokens in all (T <= CHUNK_TOKENS),
 * writing their embeddings to out_dev[n][H]. */
static is_status forward(cuda_embedder *g, const int32_t *const *ids, const int32_t *lens,
                         int32_t n, float *out_dev) {
    cudaStream_t s = RETRIEVAL_STREAM;
    const int32_t H = g->H, I = g->I;
    int32_t T = 0, L = 0;
    for (int32_t i = 0; i < n; i++) {
        T += lens[i];
        if (lens[i] > L) L = lens[i];
    }
    IS_ASSERT(T <= CHUNK_TOKENS);
    is_status st = ensure_workspace(g, T);
    if (st != IS_OK) return st;

    /* Stage ids and offsets once the previous chunk's upload has left the
     * pinned buffer. */
    if (g->staged_pending) CUDA_CHECK(cudaEventSynchronize(g->staged));
    int32_t *off = g->staging + T;
    off[0] = 0;
    for (int32_t i = 0; i < n; i++) {
        memcpy(g->staging + off[i], ids[i], (size_t)lens[i] * sizeof(int32_t));
        off[i + 1] = off[i] + lens[i];
    }
    CUDA_CHECK(cudaMemcpyAsync(g->meta_dev, g->staging, (size_t)(T + n + 1) * sizeof(int32_t),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(g->staged, s));
    g->staged_pending = true;
    const int32_t *ids_d = g->meta_dev, *off_d = g->meta_dev + T;

    embed_ln_kernel<<<dim3((unsigned)n, (unsigned)L), LN_THREADS, 0, s>>>(
        g->x, ids_d, off_d, g->tok_emb, g->pos_emb, g->type_emb, g->emb_ln_g, g->emb_ln_b, H,
        g->ln_eps);
    CUDA_CHECK_LAUNCH();
    const size_t att_smem = attention_smem(L, g->dh);
    const float scale = 1.0f / sqrtf((float)g->dh);
    const int64_t n_ff = (int64_t)T * I;
    for (int32_t l = 0; l < g->n_layers; l++) {
        const gpu_layer *W = &g->layers[l];
        if ((st = linear(g, g->qkv, g->x, W->wqkv, T, 3 * H, H)) != IS_OK) return st;
        attention_kernel<<<(unsigned)(n * g->n_heads), ATT_WARPS * 32, att_smem, s>>>(
            g->ctx, g->qkv, W->bqkv, off_d, g->n_heads, H, g->dh, scale);
        CUDA_CHECK_LAUNCH();
        if ((st = linear(g, g->tmp, g->ctx, W->wo, T, H, H)) != IS_OK) return st;
        add_ln_kernel<<<(unsigned)T, LN_THREADS, 0, s>>>(g->x, g->tmp, W->bo, W->ln1_g, W->ln1_b, H,
                                                         g->ln_eps);
        CUDA_CHECK_LAUNCH();
        if ((st = linear(g, g->ff, g->x, W->w1, T, I, H)) != IS_OK) return st;
        bias_gelu_kernel<<<cuda_blocks_for(n_ff, 256), 256, 0, s>>>(g->ff, W->b1, n_ff, I);
        CUDA_CHECK_LAUNCH();
        if ((st = linear(g, g->tmp, g->ff, W->w2, T, H, I)) != IS_OK) return st;
        add_ln_kernel<<<(unsigned)T, LN_THREADS, 0, s>>>(g->x, g->tmp, W->b2, W->ln2_g, W->ln2_b, H,
                                                         g->ln_eps);
        CUDA_CHECK_LAUNCH();
    }
    pool_kernel<<<(unsigned)n, POOL_THREADS, 0, s>>>(out_dev, g->x, off_d, H, g->pool_cls);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* Checks n texts of ids as embedder_embed_ids does. */
static is_status check_ids(const cuda_embedder *g, const int32_t *const *ids, const int32_t *lens,
                           int32_t n, const void *out, const char *who) {
    if (!g || n < 0 || (n > 0 && (!ids || !lens || !out)))
        return is_error_set(IS_ERR_INVALID_ARG, "%s: bad argument", who);
    for (int32_t i = 0; i < n; i++) {
        if (!ids[i] || lens[i] < 1 || lens[i] > g->max_tokens)
            return is_error_set(IS_ERR_INVALID_ARG, "%s: text %d has %d tokens (1..%d)", who, i,
                                lens[i], g->max_tokens);
        for (int32_t p = 0; p < lens[i]; p++)
            if (ids[i][p] < 0 || ids[i][p] >= g->n_vocab)
                return is_error_set(IS_ERR_INVALID_ARG, "%s: token id %d out of range", who,
                                    ids[i][p]);
    }
    return IS_OK;
}

/* Embeds checked texts in chunks of at most CHUNK_TOKENS tokens, into
 * device memory (out_host NULL: out_dev[n][H]) or host memory (out_host,
 * through the chunk buffer g->out). */
static is_status run_ids(cuda_embedder *g, const int32_t *const *ids, const int32_t *lens,
                         int32_t n, float *out_dev, float *out_host) {
    CUDA_CHECK(cudaSetDevice(g->device));
    if (out_host && !g->out)
        CUDA_CHECK(
            cudaMalloc((void **)&g->out, (size_t)CHUNK_TOKENS * (size_t)g->H * sizeof(float)));
    if (g->done_pending) CUDA_CHECK(cudaStreamWaitEvent(RETRIEVAL_STREAM, g->done, 0));
    int32_t i = 0;
    while (i < n) {
        int32_t j = i, T = 0;
        while (j < n && T + lens[j] <= CHUNK_TOKENS) T += lens[j++];
        float *dst = out_host ? g->out : out_dev + (int64_t)i * g->H;
        is_status st = forward(g, ids + i, lens + i, j - i, dst);
        if (st != IS_OK) return st;
        if (out_host) /* to pageable memory: returns once copied */
            CUDA_CHECK(cudaMemcpyAsync(out_host + (int64_t)i * g->H, g->out,
                                       (size_t)(j - i) * (size_t)g->H * sizeof(float),
                                       cudaMemcpyDeviceToHost, RETRIEVAL_STREAM));
        i = j;
    }
    CUDA_CHECK(cudaEventRecord(g->done, RETRIEVAL_STREAM));
    g->done_pending = true;
    if (out_host) CUDA_CHECK(cudaStreamSynchronize(RETRIEVAL_STREAM));
    return IS_OK;
}

/* Tokenises texts TOKENIZE_TEXTS at a time and embeds each group. */
static is_status run_texts(cuda_embedder *g, const char *const *texts, int32_t n, float *out_dev,
                           float *out_host, const char *who) {
    if (!g || n < 0 || (n > 0 && (!texts || !(out_dev || out_host))))
        return is_error_set(IS_ERR_INVALID_ARG, "%s: bad argument", who);
    for (int32_t i = 0; i < n; i++)
        if (!texts[i]) return is_error_set(IS_ERR_INVALID_ARG, "%s: text %d is NULL", who, i);
    const int32_t M = g->max_tokens;
    if (n > 0 && !g->tok) {
        g->tok = (int32_t *)malloc((size_t)TOKENIZE_TEXTS * (size_t)M * sizeof(int32_t));
        if (!g->tok) return is_error_set(IS_ERR_NOMEM, "%s: out of memory", who);
    }
    int32_t lens[TOKENIZE_TEXTS];
    const int32_t *ptrs[TOKENIZE_TEXTS];
    for (int32_t i0 = 0; i0 < n; i0 += TOKENIZE_TEXTS) {
        const int32_t m = n - i0 < TOKENIZE_TEXTS ? n - i0 : TOKENIZE_TEXTS;
        for (int32_t k = 0; k < m; k++) {
            const char *t = texts[i0 + k];
            int32_t *dst = g->tok + (size_t)k * M;
            is_status st = g->tokenize(g->tokenizer, t, strlen(t), M, dst, &lens[k]);
            if (st != IS_OK) return is_error_set(st, "%s: tokenising text %d failed", who, i0 + k);
            ptrs[k] = dst;
        }
        /* g->tok is free again once run_ids returns: forward copies the ids
         * into the pinned staging buffer before it queues anything. */
        is_status st = run_ids(g, ptrs, lens, m, out_dev ? out_dev + (int64_t)i0 * g->H : NULL,
                               out_host ? out_host + (int64_t)i0 * g->H : NULL);
        if (st != IS_OK) return st;
    }
    return IS_OK;
}

/* ---- public calls ------------------------------------------------------ */

extern "C" void cuda_embedder_free(cuda_embedder *g) {
    if (!g) return;
    cudaSetDevice(g->device);
    if (g->staged_pending) cudaEventSynchronize(g->staged);
    if (g->done_pending) cudaEventSynchronize(g->done);
    if (g->staged) cudaEventDestroy(g->staged);
    if (g->done) cudaEventDestroy(g->done);
    free_workspace(g);
    cudaFree(g->out);
    cudaFree(g->meta_dev);
    cudaFreeHost(g->staging);
    cudaFree(g->weights);
    if (g->cublas) cublasDestroy(g->cublas);
    free(g->layers);
    free(g->tok);
    free(g);
    cudaGetLastError(); /* nothing to report from a free */
}

static is_status create(cuda_embedder *g, const encoder_weights *wp) {
    const encoder_weights w = *wp;
    if (!w.layers || !w.tokenize || w.hidden < 1 || w.n_layers < 1 || w.n_heads < 1 ||
        w.head_dim * w.n_heads != w.hidden || w.max_tokens < 1 || w.max_tokens > w.max_pos)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda_embedder_create: inconsistent encoder weights");
    g->H = w.hidden;
    g->n_layers = w.n_layers;
    g->n_heads = w.n_heads;
    g->dh = w.head_dim;
    g->I = w.inter;
    g->n_vocab = w.n_vocab;
    g->max_tokens = w.max_tokens;
    g->ln_eps = w.ln_eps;
    g->pool_cls = w.pool_cls;
    g->tokenize = w.tokenize;
    g->tokenizer = w.tokenizer;
    const size_t smem = attention_smem(g->max_tokens, g->dh);
    int optin = 0;
    is_status st = retrieval_use_device(g->device, smem, (const void *)attention_kernel,
                                        "cuda embedder", &optin);
    if (st != IS_OK) return st;
    /* The attribute belongs to the kernel, shared by every embedder: the
     * device's limit suits them all. */
    CUDA_CHECK(
        cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    if ((st = upload_weights(g, &w)) != IS_OK) return st;
    CUBLAS_CHECK(cublasCreate(&g->cublas));
    /* Plain f32 products (no TF32), on the calling thread's stream. */
    CUBLAS_CHECK(cublasSetMathMode(g->cublas, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(cublasSetStream(g->cublas, RETRIEVAL_STREAM));
    const size_t meta = (size_t)(2 * CHUNK_TOKENS + 1) * sizeof(int32_t);
    CUDA_CHECK(cudaMalloc((void **)&g->meta_dev, meta));
    CUDA_CHECK(cudaMallocHost((void **)&g->staging, meta));
    CUDA_CHECK(cudaEventCreateWithFlags(&g->staged, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&g->done, cudaEventDisableTiming));
    return IS_OK;
}

extern "C" is_status cuda_embedder_create(const encoder_weights *w, int32_t device,
                                          cuda_embedder **out) {
    if (!w || !out) return is_error_set(IS_ERR_INVALID_ARG, "cuda_embedder_create: NULL argument");
    cuda_embedder *g = (cuda_embedder *)calloc(1, sizeof *g);
    if (!g) return is_error_set(IS_ERR_NOMEM, "cuda embedder: out of memory");
    g->device = device;
    is_status st = create(g, w);
    if (st != IS_OK) {
        cuda_embedder_free(g);
        return st;
    }
    *out = g;
    return IS_OK;
}

extern "C" int32_t cuda_embedder_dim(const cuda_embedder *g) { return g ? g->H : 0; }
extern "C" int32_t cuda_embedder_max_tokens(const cuda_embedder *g) {
    return g ? g->max_tokens : 0;
}

extern "C" is_status cuda_embedder_embed_ids_device(cuda_embedder *g, const int32_t *const *ids,
                                                    const int32_t *lens, int32_t n,
                                                    float *out_dev) {
    is_status st = check_ids(g, ids, lens, n, out_dev, "cuda_embedder_embed_ids_device");
    if (st != IS_OK || n == 0) return st;
    return run_ids(g, ids, lens, n, out_dev, NULL);
}

extern "C" is_status cuda_embedder_embed_ids(cuda_embedder *g, const int32_t *const *ids,
                                             const int32_t *lens, int32_t n, float *out) {
    is_status st = check_ids(g, ids, lens, n, out, "cuda_embedder_embed_ids");
    if (st != IS_OK || n == 0) return st;
    return run_ids(g, ids, lens, n, NULL, out);
}

extern "C" is_status cuda_embedder_embed_device(cuda_embedder *g, const char *const *texts,
                                                int32_t n, float *out_dev) {
    return run_texts(g, texts, n, out_dev, NULL, "cuda_embedder_embed_device");
}

extern "C" is_status cuda_embedder_embed(cuda_embedder *g, const char *const *texts, int32_t n,
                                         float *out) {
    return run_texts(g, texts, n, NULL, out, "cuda_embedder_embed");
}

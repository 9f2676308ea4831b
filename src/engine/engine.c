#include "engine/engine.h"

#include "core/status.h"
#include "core/vmath.h"
#include "engine/recompute.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct seq_state {
    int32_t *segments; /* [cap] segment of each position, NULL while unused */
    int32_t cap;
    int32_t mem_begin, mem_end; /* memory segment: slots [mem_begin, mem_end) */
} seq_state;

struct engine {
    model *m;
    backend *be;
    engine_params p;
    kv_cache *kv;
    float **k_cache, **v_cache; /* [n_layers] -> [n_blocks][n_kv_heads][block_size][head_dim] */
    void *k_all, *v_all;        /* the layers' caches, one after the other, layer_bytes apart */
    size_t layer_bytes;
    size_t kv_esize; /* bytes per cache element (backend's kv_elem_size) */
    seq_state *seqs; /* [max_seqs] */
    /* Sequences present in one forward chunk, [max_seqs] each. */
    int32_t *u_seq, *u_len;
    const int32_t **u_table, **u_seg;
    int32_t *u_mem; /* [max_seqs][2] memory spans of the chunk's sequences */

    /* Activation scratch for one chunk of up to max_batch tokens. */
    float *x;       /* [B][dim] residual stream */
    float *xb;      /* [B][dim] normed input / attention projection output */
    float *q;       /* [B][n_heads*head_dim] */
    float *k, *v;   /* [B][n_kv_heads*head_dim] */
    float *att;     /* [B][n_heads*head_dim] attention output */
    float *hg, *hu; /* [B][ffn_dim] gate, up */
    float *logits;  /* [B][n_vocab] */
    float *q2;      /* [B][n_heads*head_dim] queries rotated for the prefix (reference only) */
    int32_t *pos, *rpos, *rpos2, *slots,
        *seq_idx; /* [B] host: slot, RoPE position, shifted, slot id, run */
    /* A capture's rows in its dtype, in backend memory, until the forward
     * ends: [2][n_layers][n][kv_dim] (keys, then values). Kept between
     * forwards (grown, never shrunk): an encoding needs the same again. */
    void *cap_buf;
    size_t cap_bytes;
};

/* A forward over some of the layers (engine_recompute_blend): layers
 * [l0, l1) of a chunk, the residual stream taken from x_in (backend memory,
 * the batch's rows [n][dim]; NULL: the token embeddings, l0 = 0) and, when
 * l1 < n_layers, left in x_out (the same rows; or NULL) with layer l1's
 * pre-RoPE keys and values of it in k_next, v_next (host, [n][kv_dim]);
 * store false: nothing written into the cache (the attention reads it as it
 * is). No output head unless `head`. NULL range: every layer, stored, the head. */
typedef struct fwd_range {
    int32_t l0, l1;
    const float *x_in;
    float *x_out;
    float *k_next, *v_next;
    bool store;
    bool head; /* l1 = n_layers: the output head for the selected rows, as without a range */
} fwd_range;

engine_params engine_default_params(void) {
    engine_params p = {
        .n_ctx = 0,
        .max_seqs = 8,
        .n_blocks = 0,
        .block_size = 16,
        .max_batch = 512,
        .mem_temp = 1.0f,
        .mem_mass = 1.0f,
    };
    return p;
}

static bool mem_scale_valid(float temp, float mass) {
    return temp > 0.0f && temp < INFINITY && mass > 0.0f && mass < INFINITY;
}

is_status engine_set_memory_scale(engine *e, float temp, float mass) {
    if (!mem_scale_valid(temp, mass))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "engine: memory temperature and mass must be positive and finite");
    e->p.mem_temp = temp;
    e->p.mem_mass = mass;
    return IS_OK;
}

static is_status alloc_f32(engine *e, float **out, size_t n) {
    return e->be->ops->alloc(e->be, n * sizeof(float), (void **)out);
}

is_status engine_create(model *m, engine_params p, engine **out) {
    const model_config *c = &m->cfg;
    if (p.n_ctx <= 0) p.n_ctx = c->n_ctx_train;
    if (p.block_size <= 0 || p.max_seqs <= 0 || p.max_batch <= 0 || p.n_blocks < 0)
        return is_error_set(IS_ERR_INVALID_ARG, "engine: sizes must be positive");
    if (!mem_scale_valid(p.mem_temp, p.mem_mass))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "engine: memory temperature and mass must be positive and finite");
    if (p.n_blocks == 0) {
        int64_t per_seq = (p.n_ctx + p.block_size - 1) / p.block_size;
        int64_t nb = per_seq * p.max_seqs;
        p.n_blocks = (int32_t)(nb > (1 << 20) ? (1 << 20) : nb);
    }
    engine *e = calloc(1, sizeof *e);
    if (!e) return is_error_set(IS_ERR_NOMEM, "engine: out of memory");
    e->m = m;
    e->be = m->be;
    e->p = p;
    kv_cache_params kp = {
        .n_layers = c->n_layers,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->head_dim,
        .block_size = p.block_size,
        .n_blocks = p.n_blocks,
        .max_seqs = p.max_seqs,
    };
    is_status st = kv_cache_create(kp, &e->kv);
    if (st != IS_OK) goto fail;
    e->k_cache = calloc((size_t)c->n_layers, sizeof(float *));
    e->v_cache = calloc((size_t)c->n_layers, sizeof(float *));
    e->seqs = calloc((size_t)p.max_seqs, sizeof *e->seqs);
    e->pos = malloc((size_t)p.max_batch * sizeof(int32_t));
    e->rpos = malloc((size_t)p.max_batch * sizeof(int32_t));
    e->rpos2 = malloc((size_t)p.max_batch * sizeof(int32_t));
    e->slots = malloc((size_t)p.max_batch * sizeof(int32_t));
    e->seq_idx = malloc((size_t)p.max_batch * sizeof(int32_t));
    e->u_seq = malloc((size_t)p.max_seqs * sizeof(int32_t));
    e->u_len = malloc((size_t)p.max_seqs * sizeof(int32_t));
    e->u_table = malloc((size_t)p.max_seqs * sizeof(int32_t *));
    e->u_seg = malloc((size_t)p.max_seqs * sizeof(int32_t *));
    e->u_mem = malloc((size_t)p.max_seqs * 2 * sizeof(int32_t));
    if (!e->k_cache || !e->v_cache || !e->seqs || !e->pos || !e->rpos || !e->rpos2 || !e->slots ||
        !e->seq_idx || !e->u_seq || !e->u_len || !e->u_table || !e->u_seg || !e->u_mem) {
        st = is_error_set(IS_ERR_NOMEM, "engine: out of memory");
        goto fail;
    }
    e->kv_esize = e->be->ops->kv_elem_size ? e->be->ops->kv_elem_size(e->be) : sizeof(float);
    /* One allocation per cache, so a block of every layer is one strided copy. */
    size_t layer_bytes =
        (size_t)p.n_blocks * p.block_size * c->n_kv_heads * c->head_dim * e->kv_esize;
    e->layer_bytes = layer_bytes;
    if ((st = e->be->ops->alloc(e->be, layer_bytes * c->n_layers, &e->k_all)) != IS_OK ||
        (st = e->be->ops->alloc(e->be, layer_bytes * c->n_layers, &e->v_all)) != IS_OK)
        goto fail;
    for (int32_t l = 0; l < c->n_layers; l++) {
        e->k_cache[l] = (float *)((char *)e->k_all + (size_t)l * layer_bytes);
        e->v_cache[l] = (float *)((char *)e->v_all + (size_t)l * layer_bytes);
    }
    size_t B = (size_t)p.max_batch;
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    if ((st = alloc_f32(e, &e->x, B * c->dim)) || (st = alloc_f32(e, &e->xb, B * c->dim)) ||
        (st = alloc_f32(e, &e->q, B * q_dim)) || (st = alloc_f32(e, &e->k, B * kv_dim)) ||
        (st = alloc_f32(e, &e->v, B * kv_dim)) || (st = alloc_f32(e, &e->att, B * q_dim)) ||
        (st = alloc_f32(e, &e->hg, B * c->ffn_dim)) ||
        (st = alloc_f32(e, &e->hu, B * c->ffn_dim)) || (st = alloc_f32(e, &e->q2, B * q_dim)) ||
        (st = alloc_f32(e, &e->logits, B * c->n_vocab)))
        goto fail;
    *out = e;
    return IS_OK;
fail:
    engine_free(e);
    return st;
}

void engine_free(engine *e) {
    if (!e) return;
    backend *be = e->be;
    if (e->k_all) be->ops->release(be, e->k_all);
    if (e->v_all) be->ops->release(be, e->v_all);
    free(e->k_cache);
    free(e->v_cache);
    if (e->seqs)
        for (int32_t i = 0; i < e->p.max_seqs; i++) free(e->seqs[i].segments);
    free(e->seqs);
    float *bufs[] = {e->x, e->xb, e->q, e->k, e->v, e->att, e->hg, e->hu, e->q2, e->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    if (e->cap_buf) be->ops->release(be, e->cap_buf);
    free(e->pos);
    free(e->rpos);
    free(e->rpos2);
    free(e->slots);
    free(e->seq_idx);
    free(e->u_seq);
    free(e->u_len);
    free(e->u_table);
    free(e->u_seg);
    free(e->u_mem);
    kv_cache_free(e->kv);
    free(e);
}

const model *engine_model(const engine *e) { return e->m; }
kv_cache *engine_kv(engine *e) { return e->kv; }
int32_t engine_n_ctx(const engine *e) { return e->p.n_ctx; }

is_status engine_seq_open(engine *e, int32_t *seq) {
    is_status st = kv_seq_create(e->kv, seq);
    if (st == IS_OK) {
        free(e->seqs[*seq].segments);
        e->seqs[*seq].segments = NULL;
        e->seqs[*seq].cap = 0;
        e->seqs[*seq].mem_begin = e->seqs[*seq].mem_end = 0;
    }
    return st;
}

void engine_seq_close(engine *e, int32_t seq) { kv_seq_free(e->kv, seq); }

static is_status seq_set_segments(engine *e, int32_t seq, int32_t from, const int32_t *seg,
                                  int32_t n);

is_status engine_seq_fork(engine *e, int32_t dst, int32_t src, int32_t n) {
    const model_config *c = &e->m->cfg;
    int32_t bs = e->p.block_size;
    if (n < 0 || n > kv_seq_length(e->kv, src))
        return is_error_set(IS_ERR_INVALID_ARG, "fork: %d positions of a sequence of %d", n,
                            kv_seq_length(e->kv, src));
    int32_t shared = n / bs * bs, tail = n - shared;
    is_status st = backend_status(e->be);
    if (st != IS_OK) return st;
    st = kv_seq_share_prefix(e->kv, dst, src, shared);
    if (st != IS_OK) return st;
    if (tail > 0) {
        if ((st = kv_seq_grow(e->kv, dst, tail)) != IS_OK) {
            kv_seq_truncate(e->kv, dst, 0);
            return st;
        }
        int32_t sb = kv_cache_slot(e->kv, src, shared) / bs,
                db = kv_cache_slot(e->kv, dst, shared) / bs;
        /* The trailing block is copied whole, every head and row: one copy
         * per layer and cache instead of one per head (a GPU pays ~5 us per
         * copy call: 512 of them were 2.5 ms of an 8B fork). Rows past the
         * tail lie beyond dst's length: written before anything reads them.
         * Byte offsets: the cache's element type is the backend's. */
        const size_t blk = (size_t)c->n_kv_heads * bs * c->head_dim * e->kv_esize;
        const backend_ops *op = e->be->ops;
        char *kc = (char *)e->k_all, *vc = (char *)e->v_all;
        if (op->copy_2d) {
            op->copy_2d(e->be, kc + (size_t)db * blk, e->layer_bytes, kc + (size_t)sb * blk,
                        e->layer_bytes, blk, (size_t)c->n_layers);
            op->copy_2d(e->be, vc + (size_t)db * blk, e->layer_bytes, vc + (size_t)sb * blk,
                        e->layer_bytes, blk, (size_t)c->n_layers);
        } else {
            for (int32_t l = 0; l < c->n_layers; l++) {
                const size_t lo = (size_t)l * e->layer_bytes;
                op->copy(e->be, kc + lo + (size_t)db * blk, kc + lo + (size_t)sb * blk, blk);
                op->copy(e->be, vc + lo + (size_t)db * blk, vc + lo + (size_t)sb * blk, blk);
            }
        }
        if ((st = backend_status(e->be)) != IS_OK) {
            kv_seq_truncate(e->kv, dst, 0);
            return st;
        }
    }
    const seq_state *ss = &e->seqs[src];
    if (ss->segments && (st = seq_set_segments(e, dst, 0, ss->segments, n)) != IS_OK) {
        kv_seq_truncate(e->kv, dst, 0);
        return st;
    }
    seq_state *ds = &e->seqs[dst];
    ds->mem_begin = ss->mem_begin < n ? ss->mem_begin : n;
    ds->mem_end = ss->mem_end < n ? ss->mem_end : n;
    return IS_OK;
}

void engine_seq_memory(const engine *e, int32_t seq, int32_t *begin, int32_t *end) {
    *begin = e->seqs[seq].mem_begin;
    *end = e->seqs[seq].mem_end;
}

is_status engine_seq_set_memory(engine *e, int32_t seq, int32_t begin, int32_t end) {
    if (seq < 0 || seq >= e->p.max_seqs)
        return is_error_set(IS_ERR_INVALID_ARG, "engine: sequence id %d out of range", seq);
    if (begin < 0 || begin > end || end > e->p.n_ctx)
        return is_error_set(IS_ERR_INVALID_ARG, "engine: memory segment [%d, %d) outside [0, %d]",
                            begin, end, e->p.n_ctx);
    e->seqs[seq].mem_begin = begin;
    e->seqs[seq].mem_end = end;
    return IS_OK;
}

/* Records segment ids for positions [from, from+n) of a sequence. A
 * sequence that never had segments keeps NULL (plain causal attention);
 * once it has them, unspecified positions are segment 0. */
static is_status seq_set_segments(engine *e, int32_t seq, int32_t from, const int32_t *seg,
                                  int32_t n) {
    seq_state *s = &e->seqs[seq];
    if (!seg && !s->segments) return IS_OK;
    int32_t need = from + n;
    if (need > s->cap) {
        int32_t cap = s->cap ? s->cap : 256;
        while (cap < need) cap *= 2;
        int32_t *p = realloc(s->segments, (size_t)cap * sizeof *p);
        if (!p) return is_error_set(IS_ERR_NOMEM, "engine: out of memory");
        memset(p + s->cap, 0, (size_t)(cap - s->cap) * sizeof *p);
        s->segments = p;
        s->cap = cap;
    }
    for (int32_t i = 0; i < n; i++) s->segments[from + i] = seg ? seg[i] : 0;
    return IS_OK;
}

/* x += res, then out = rmsnorm(x) * g: the residual add and the norm that
 * always follows it, fused where the backend can. */
static void add_norm(backend *be, float *out, float *x, const float *res, const backend_weight *g,
                     int32_t T, int32_t n, float eps) {
    const backend_ops *op = be->ops;
    if (op->add_rmsnorm) {
        op->add_rmsnorm(be, out, x, res, g, T, n, eps);
        return;
    }
    op->add(be, x, res, (int64_t)T * n);
    op->rmsnorm(be, out, x, g, T, n, eps);
}

/* Products that share their input, in one call where the backend can
 * (stacked weights read in one pass). */
static void matmul_n(backend *be, float *const *ys, const float *x, const backend_weight *const *ws,
                     const backend_weight *const *bs, int32_t n, int32_t T) {
    const backend_ops *op = be->ops;
    if (op->matmul_n) {
        op->matmul_n(be, ys, x, ws, bs, n, T);
        return;
    }
    for (int32_t i = 0; i < n; i++) op->matmul(be, ys[i], x, ws[i], bs[i], T);
}

/* The FFN's first half, silu(x w_gate^T) * (x w_up^T) into out: in one
 * call where the backend can (up is scratch it may leave unwritten). */
static void gate_up_swiglu(backend *be, float *out, float *up, const float *x,
                           const backend_weight *w_gate, const backend_weight *w_up, int32_t T,
                           int32_t ffn_dim) {
    const backend_ops *op = be->ops;
    if (op->matmul_swiglu) {
        op->matmul_swiglu(be, out, up, x, w_gate, w_up, T);
        return;
    }
    matmul_n(be, (float *const[]){out, up}, x, (const backend_weight *const[]){w_gate, w_up},
             (const backend_weight *const[]){NULL, NULL}, 2, T);
    op->swiglu(be, out, out, up, (int64_t)T * ffn_dim);
}

/* Queries and keys rotated, keys and values stored: in one call where the
 * backend can. */
static void rope_store(backend *be, engine *e, int32_t l, int32_t n) {
    const model_config *c = &e->m->cfg;
    const backend_ops *op = be->ops;
    if (op->rope_store) {
        op->rope_store(be, e->q, e->k, e->v, e->k_cache[l], e->v_cache[l], e->rpos, e->slots, n,
                       c->n_heads, c->n_kv_heads, c->head_dim, e->p.block_size, &c->rope);
        return;
    }
    op->rope(be, e->q, e->rpos, n, c->n_heads, c->head_dim, &c->rope);
    op->rope(be, e->k, e->rpos, n, c->n_kv_heads, c->head_dim, &c->rope);
    op->kv_store(be, e->k_cache[l], e->v_cache[l], e->k, e->v, e->slots, n, c->n_kv_heads,
                 c->head_dim, e->p.block_size);
}

/* Where a chunk's selected rows go: their logits (host memory), or each
 * row's greedy choice (tokens), through `row` (a row of host scratch) where
 * the backend has no argmax op. */
typedef struct chunk_out {
    float *logits;
    int32_t *tokens;
    float *row;
} chunk_out;

/* out->tokens[r] = the argmax of the first n_rows rows of e->logits: on the
 * backend where it can, else of the rows downloaded one by one. */
static void greedy_rows(engine *e, const chunk_out *out, int32_t n_rows) {
    const backend_ops *op = e->be->ops;
    const int32_t V = e->m->cfg.n_vocab;
    if (op->argmax) {
        op->argmax(e->be, out->tokens, e->logits, n_rows, V);
        return;
    }
    for (int32_t r = 0; r < n_rows; r++) {
        op->download(e->be, out->row, e->logits + (size_t)r * V, (size_t)V * sizeof(float));
        out->tokens[r] = vmath_argmax(out->row, V);
    }
}

/* Bytes of one captured element: 0 f32, 1 f16, 2 bf16 (0 for others). */
static size_t capture_elem_size(int32_t dtype) {
    return dtype == 0 ? 4 : dtype == 1 || dtype == 2 ? 2 : 0;
}

/* Checks b's capture and makes room for it in e->cap_buf. */
static is_status capture_prepare(engine *e, const engine_batch *b) {
    const engine_kv_capture *cap = b->capture;
    const model_config *c = &e->m->cfg;
    if (!capture_elem_size(cap->dtype))
        return is_error_set(IS_ERR_INVALID_ARG, "engine: capture dtype %d (0 f32, 1 f16, 2 bf16)",
                            cap->dtype);
    if (cap->first < 0 || cap->n < 0 || cap->n > b->n_tokens - cap->first)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "engine: capture of tokens [%d, %d) outside a batch of %d", cap->first,
                            cap->first + cap->n, b->n_tokens);
    size_t need = 2 * (size_t)c->n_layers * (size_t)cap->n * (size_t)c->n_kv_heads *
                  (size_t)c->head_dim * capture_elem_size(cap->dtype);
    if (need == 0 || need <= e->cap_bytes) return IS_OK;
    if (e->cap_buf) e->be->ops->release(e->be, e->cap_buf);
    e->cap_buf = NULL;
    e->cap_bytes = 0;
    is_status st = e->be->ops->alloc(e->be, need, &e->cap_buf);
    if (st == IS_OK) e->cap_bytes = need;
    return st;
}

/* One forward over tokens [t0, t0+n) of the batch, whose KV slots are
 * already reserved. Writes logits of selected tokens, returns how many. */
static int32_t forward_chunk(engine *e, const engine_batch *b, int32_t t0, int32_t n,
                             const int32_t *base_len, const chunk_out *out,
                             const fwd_range *range) {
    const model *m = e->m;
    const model_config *c = &m->cfg;
    backend *be = e->be;
    const backend_ops *op = be->ops;
    int32_t q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim;

    /* Positions: tokens of a sequence follow each other in batch order. */
    int32_t *uniq = e->u_seq, n_uniq = 0; /* sequences present in this chunk */
    const int32_t **tables = e->u_table;
    int32_t *lens = e->u_len;
    const int32_t **segs = e->u_seg;
    bool any_seg = false, any_mem = false;
    int32_t *seen = calloc((size_t)e->p.max_seqs, sizeof *seen); /* appended before t0+i */
    for (int32_t t = 0; t < t0; t++)
        if (!b->rewrite || b->rewrite[t] < 0) seen[b->seq[t]]++;
    for (int32_t i = 0; i < n; i++) {
        int32_t s = b->seq[t0 + i];
        const bool rw = b->rewrite && b->rewrite[t0 + i] >= 0;
        e->pos[i] = rw ? b->rewrite[t0 + i] : base_len[s] + seen[s]++;
        e->rpos[i] = b->pos ? b->pos[t0 + i] : e->pos[i];
        e->rpos2[i] = e->rpos[i] - (b->prefix_shift ? b->prefix_shift[t0 + i] : 0);
        e->slots[i] = kv_cache_slot(e->kv, s, e->pos[i]);
        int32_t u = 0;
        while (u < n_uniq && uniq[u] != s) u++;
        if (u == n_uniq) {
            IS_ASSERT(n_uniq < e->p.max_seqs);
            uniq[n_uniq++] = s;
        }
        e->seq_idx[i] = u;
    }
    for (int32_t u = 0; u < n_uniq; u++) {
        int32_t nb;
        tables[u] = kv_seq_blocks(e->kv, uniq[u], &nb);
        lens[u] = base_len[uniq[u]] + seen[uniq[u]];
        segs[u] = e->seqs[uniq[u]].segments;
        if (segs[u]) any_seg = true;
        /* A memory segment that a truncation cut short ends at the length. */
        const seq_state *ss = &e->seqs[uniq[u]];
        int32_t mb = ss->mem_begin, me = ss->mem_end < lens[u] ? ss->mem_end : lens[u];
        e->u_mem[2 * u] = mb < me ? mb : 0;
        e->u_mem[2 * u + 1] = mb < me ? me : 0;
        if (mb < me) any_mem = true;
    }
    free(seen);
    bool shifted = false;
    for (int32_t i = 0; i < n; i++)
        if (e->rpos2[i] != e->rpos[i]) shifted = true;
    attn_batch ab = {
        .n_tokens = n,
        .pos = e->pos,
        .seq_of_token = e->seq_idx,
        .n_seqs = n_uniq,
        .block_tables = tables,
        .seq_len = lens,
        .seq_segments = any_seg ? segs : NULL,
        .q_prefix = shifted ? e->q2 : NULL,
        /* Plain attention (and its fast paths) unless the memory is mapped. */
        .mem_span = any_mem && (e->p.mem_temp != 1.0f || e->p.mem_mass != 1.0f) ? e->u_mem : NULL,
        .mem_temp = e->p.mem_temp,
        .mem_mass = e->p.mem_mass,
    };
    /* Captured rows of this chunk: batch tokens [cap0, cap1). */
    const engine_kv_capture *cap = b->capture;
    int32_t cap0 = 0, cap1 = 0;
    if (cap) {
        cap0 = cap->first > t0 ? cap->first : t0;
        cap1 = cap->first + cap->n < t0 + n ? cap->first + cap->n : t0 + n;
    }

    const int32_t l0 = range ? range->l0 : 0, l1 = range ? range->l1 : c->n_layers;
    const bool store = range ? range->store : true;
    if (range && range->x_in)
        op->copy(be, e->x, range->x_in + (size_t)t0 * c->dim, (size_t)n * c->dim * sizeof(float));
    else op->get_rows(be, e->x, m->token_embd, b->tokens + t0, n);
    for (int32_t l = l0; l < l1; l++) {
        const model_layer *L = &m->layers[l];
        /* Later layers' first norm comes with the previous layer's last add. */
        if (l == l0) op->rmsnorm(be, e->xb, e->x, L->attn_norm, n, c->dim, c->rms_eps);
        /* Captured rows read k and v, a shifted prefix q unrotated: then
         * the products and the rotation run as separate ops. */
        if (!store) {
            /* Queries only: the cache keeps what it holds. */
            matmul_n(be, (float *const[]){e->q, e->k, e->v}, e->xb,
                     (const backend_weight *const[]){L->wq, L->wk, L->wv},
                     (const backend_weight *const[]){L->bq, L->bk, L->bv}, 3, n);
            op->rope(be, e->q, e->rpos, n, c->n_heads, c->head_dim, &c->rope);
        } else if (op->matmul_rope_store && cap0 == cap1 && !shifted) {
            op->matmul_rope_store(be, e->q, e->k, e->v, e->xb,
                                  (const backend_weight *const[]){L->wq, L->wk, L->wv},
                                  (const backend_weight *const[]){L->bq, L->bk, L->bv},
                                  e->k_cache[l], e->v_cache[l], e->rpos, e->slots, n, c->n_heads,
                                  c->n_kv_heads, c->head_dim, e->p.block_size, &c->rope);
        } else {
            matmul_n(be, (float *const[]){e->q, e->k, e->v}, e->xb,
                     (const backend_weight *const[]){L->wq, L->wk, L->wv},
                     (const backend_weight *const[]){L->bq, L->bk, L->bv}, 3, n);
            /* The captured rows are consecutive on both sides: one op a
             * layer, narrowed where they were computed and left there, so
             * the forward never waits for the host (decode_impl brings the
             * whole capture down once, after the last chunk). */
            if (cap1 > cap0) {
                size_t esz = capture_elem_size(cap->dtype), rows = (size_t)cap->n * kv_dim;
                size_t dst = ((size_t)l * cap->n + (cap0 - cap->first)) * kv_dim * esz;
                size_t src = (size_t)(cap0 - t0) * kv_dim, cnt = (size_t)(cap1 - cap0) * kv_dim;
                uint8_t *ck = e->cap_buf, *cv = ck + (size_t)c->n_layers * rows * esz;
                op->narrow(be, ck + dst, cap->dtype, e->k + src, cnt);
                op->narrow(be, cv + dst, cap->dtype, e->v + src, cnt);
            }
            if (shifted) {
                op->copy(be, e->q2, e->q, (size_t)n * q_dim * sizeof(float));
                op->rope(be, e->q2, e->rpos2, n, c->n_heads, c->head_dim, &c->rope);
            }
            rope_store(be, e, l, n);
        }
        op->attention(be, e->att, e->q, e->k_cache[l], e->v_cache[l], &ab, c->n_heads,
                      c->n_kv_heads, c->head_dim, e->p.block_size);
        op->matmul(be, e->xb, e->att, L->wo, NULL, n);
        add_norm(be, e->xb, e->x, e->xb, L->ffn_norm, n, c->dim, c->rms_eps);
        gate_up_swiglu(be, e->hg, e->hu, e->xb, L->w_gate, L->w_up, n, c->ffn_dim);
        op->matmul(be, e->xb, e->hg, L->w_down, NULL, n);
        if (l + 1 < c->n_layers)
            add_norm(be, e->xb, e->x, e->xb, m->layers[l + 1].attn_norm, n, c->dim, c->rms_eps);
        else op->add(be, e->x, e->xb, (int64_t)n * c->dim); /* the head normalises selected rows */
    }
    if (range && !range->head) {
        /* No head. Stopped before layer l1: x is its residual input, xb its norm. */
        if (l1 < c->n_layers && range->x_out)
            op->copy(be, range->x_out + (size_t)t0 * c->dim, e->x,
                     (size_t)n * c->dim * sizeof(float));
        if (l1 < c->n_layers && range->k_next) {
            const model_layer *L = &m->layers[l1];
            matmul_n(be, (float *const[]){e->k, e->v}, e->xb,
                     (const backend_weight *const[]){L->wk, L->wv},
                     (const backend_weight *const[]){L->bk, L->bv}, 2, n);
            size_t off = (size_t)t0 * kv_dim, bytes = (size_t)n * kv_dim * sizeof(float);
            op->download(be, range->k_next + off, e->k, bytes);
            op->download(be, range->v_next + off, e->v, bytes);
        }
        op->sync(be);
        return 0;
    }

    /* Output head only for the selected rows: gather them to the front. */
    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t t = t0 + i;
        bool want = b->want_logits ? b->want_logits[t] : (t == b->n_tokens - 1);
        if (!want) continue;
        if (n_out != i)
            op->copy(be, e->x + (size_t)n_out * c->dim, e->x + (size_t)i * c->dim,
                     (size_t)c->dim * sizeof(float));
        n_out++;
    }
    if (n_out > 0) {
        op->rmsnorm(be, e->xb, e->x, m->output_norm, n_out, c->dim, c->rms_eps);
        op->matmul(be, e->logits, e->xb, m->output, NULL, n_out);
    }
    if (n_out > 0 && out->logits)
        op->download(be, out->logits, e->logits, (size_t)n_out * c->n_vocab * sizeof(float));
    else if (n_out > 0) greedy_rows(e, out, n_out);
    op->sync(be);
    return n_out;
}

/* The rewrite field of a batch (engine.h): each sequence's recomputed
 * tokens inside its memory segment and what it holds, at strictly
 * increasing positions, before any of its appended tokens. last[max_seqs]
 * is scratch. IS_ERR_INVALID_ARG naming the first that is not. */
static is_status check_rewrite(engine *e, const engine_batch *b, int32_t *last) {
    const int32_t max_seqs = e->p.max_seqs;
    for (int32_t s = 0; s < max_seqs; s++) last[s] = -1; /* -2: an appended token seen */
    for (int32_t t = 0; t < b->n_tokens; t++) {
        const int32_t s = b->seq[t], p = b->rewrite[t];
        if (p < 0) {
            last[s] = -2;
            continue;
        }
        const seq_state *ss = &e->seqs[s];
        const int32_t len = kv_seq_length(e->kv, s);
        if (last[s] == -2)
            return is_error_set(IS_ERR_INVALID_ARG,
                                "recompute: batch token %d recomputes position %d after tokens "
                                "appended to its sequence",
                                t, p);
        if (p < ss->mem_begin || p >= ss->mem_end || p >= len || p <= last[s])
            return is_error_set(IS_ERR_INVALID_ARG,
                                "recompute: position %d is not after %d inside the memory [%d, %d)",
                                p, last[s], ss->mem_begin, ss->mem_end < len ? ss->mem_end : len);
        last[s] = p;
    }
    return IS_OK;
}

static is_status blend_check(engine *e, int32_t seq, const engine_blend *bl, int32_t *total);
static is_status blend_forward(engine *e, const engine_batch *b, const int32_t *base_len,
                               int32_t total, chunk_out *co);

/* engine_decode (logits) or engine_decode_greedy (tokens): one of the two. */
static is_status decode_impl(engine *e, const engine_batch *b, float *logits, int32_t *tokens) {
    const model_config *c = &e->m->cfg;
    if (b->n_tokens <= 0) return is_error_set(IS_ERR_INVALID_ARG, "engine: empty batch");
    /* A failed backend runs nothing until it recovers: refuse before any
     * sequence grows. */
    is_status st = backend_status(e->be);
    if (st != IS_OK) return st;
    int32_t max_seqs = e->p.max_seqs;
    int32_t grown = 0; /* sequences [0, grown) may have grown: undone on failure (out) */
    int32_t *base_len = calloc((size_t)max_seqs, sizeof *base_len);
    int32_t *add = calloc((size_t)max_seqs, sizeof *add);
    chunk_out co = {logits, tokens, NULL};
    const bool host_argmax = tokens && !e->be->ops->argmax; /* greedy_rows downloads rows */
    if (host_argmax) co.row = malloc((size_t)c->n_vocab * sizeof *co.row);
    if (!base_len || !add || (host_argmax && !co.row)) {
        free(base_len);
        free(add);
        free(co.row);
        return is_error_set(IS_ERR_NOMEM, "engine: out of memory");
    }
    for (int32_t t = 0; t < b->n_tokens; t++) {
        int32_t s = b->seq[t];
        if (s < 0 || s >= max_seqs) {
            st = is_error_set(IS_ERR_INVALID_ARG, "engine: sequence id %d out of range", s);
            goto out;
        }
        if (b->tokens[t] < 0 || b->tokens[t] >= c->n_vocab) {
            st = is_error_set(IS_ERR_INVALID_ARG, "engine: token id %d out of range [0, %d)",
                              b->tokens[t], c->n_vocab);
            goto out;
        }
        if (!b->rewrite || b->rewrite[t] < 0) add[s]++;
    }
    if (b->rewrite && (st = check_rewrite(e, b, base_len)) != IS_OK) goto out;
    int32_t blend_total = 0;
    if (b->blend) {
        for (int32_t t = 1; t < b->n_tokens; t++)
            if (b->seq[t] != b->seq[0]) {
                st = is_error_set(IS_ERR_INVALID_ARG, "blend: a batch of one sequence only");
                goto out;
            }
        if (b->rewrite || b->capture || b->segment || b->pos || b->prefix_shift) {
            st = is_error_set(IS_ERR_INVALID_ARG, "blend: a batch of plain appended tokens only");
            goto out;
        }
        if ((st = blend_check(e, b->seq[0], b->blend, &blend_total)) != IS_OK) goto out;
    }
    for (int32_t t = 0; t < b->n_tokens; t++) base_len[b->seq[t]] = kv_seq_length(e->kv, b->seq[t]);
    /* Reserve all KV slots first so a failure leaves every sequence as it was. */
    for (int32_t s = 0; s < max_seqs; s++) {
        if (!add[s]) continue;
        if (base_len[s] + add[s] > e->p.n_ctx) {
            st = is_error_set(IS_ERR_CONTEXT_FULL,
                              "engine: sequence %d would hold %d tokens, past the context of %d", s,
                              base_len[s] + add[s], e->p.n_ctx);
            break;
        }
        if ((st = kv_seq_grow(e->kv, s, add[s])) != IS_OK) break;
        grown = s + 1;
    }
    if (st == IS_OK) {
        /* Segments are recorded per sequence, in batch order. */
        int32_t *seen = calloc((size_t)max_seqs, sizeof *seen);
        for (int32_t t = 0; t < b->n_tokens && st == IS_OK; t++) {
            int32_t s = b->seq[t];
            if (b->rewrite && b->rewrite[t] >= 0) continue; /* its slot keeps its segment */
            st = seq_set_segments(e, s, base_len[s] + seen[s]++, b->segment ? &b->segment[t] : NULL,
                                  1);
        }
        free(seen);
    }
    if (st != IS_OK) goto out;
    if (blend_total > 0) {
        /* On failure the memory's recomputed slots are undefined (engine.h). */
        st = blend_forward(e, b, base_len, blend_total, &co);
        goto out;
    }
    if (b->capture && (st = capture_prepare(e, b)) != IS_OK) goto out;
    for (int32_t t0 = 0; t0 < b->n_tokens; t0 += e->p.max_batch) {
        int32_t n = b->n_tokens - t0 < e->p.max_batch ? b->n_tokens - t0 : e->p.max_batch;
        int32_t n_out = forward_chunk(e, b, t0, n, base_len, &co, NULL);
        /* Every chunk ends in a download or sync, which latches what the
         * device met: one check covers each op of the chunk. */
        if ((st = backend_status(e->be)) != IS_OK) goto out;
        if (co.logits) co.logits += (size_t)n_out * c->n_vocab;
        if (co.tokens) co.tokens += n_out;
    }
    if (b->capture && b->capture->n > 0) {
        const engine_kv_capture *cap = b->capture;
        size_t half = (size_t)c->n_layers * (size_t)cap->n * (size_t)c->n_kv_heads *
                      (size_t)c->head_dim * capture_elem_size(cap->dtype);
        e->be->ops->download(e->be, cap->k, e->cap_buf, half);
        e->be->ops->download(e->be, cap->v, (const uint8_t *)e->cap_buf + half, half);
        st = backend_status(e->be);
    }
out:
    /* A failure after the slots were reserved puts every sequence back where
     * it was; their slots past that are written again before anything
     * reads them. */
    if (st != IS_OK)
        for (int32_t s = 0; s < grown; s++)
            if (add[s]) kv_seq_truncate(e->kv, s, base_len[s]);
    free(base_len);
    free(add);
    free(co.row);
    return st;
}

is_status engine_decode(engine *e, const engine_batch *b, float *logits) {
    return decode_impl(e, b, logits, NULL);
}

is_status engine_decode_greedy(engine *e, const engine_batch *b, int32_t *tokens) {
    return decode_impl(e, b, NULL, tokens);
}

/* Chunked RoPE + injection. A backend with an inject op does it in one
 * call for every layer and every sequence of a batch (the CUDA backend:
 * one launch from its fact-KV arena). Otherwise facts are staged through the activation scratch a chunk
 * of max_batch tokens at a time: for each layer the stored pre-RoPE keys
 * are uploaded, rotated to their serving positions by the backend's rope op
 * (the same op prefill uses, so the rotation is the one a prefill at that
 * position would apply) and scattered with kv_store. */
is_status engine_inject(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts) {
    return engine_inject_ids(e, seq, facts, NULL, n_facts);
}

bool engine_fact_resident(engine *e, uint64_t cache_id, int32_t n_tokens) {
    const backend_ops *op = e->be->ops;
    return cache_id && op->inject && op->fact_resident &&
           op->fact_resident(e->be, cache_id, n_tokens);
}

/* Checks one sequence's facts before anything changes: ids, lengths, and
 * values unless the backend holds the fact. *total: their tokens. */
static is_status inject_check(engine *e, int32_t seq, const engine_fact *facts,
                              const uint64_t *cache_ids, int32_t n_facts, int64_t *total) {
    *total = 0;
    if (seq < 0 || seq >= e->p.max_seqs)
        return is_error_set(IS_ERR_INVALID_ARG, "inject: sequence id %d out of range", seq);
    if (n_facts < 0 || (n_facts > 0 && !facts))
        return is_error_set(IS_ERR_INVALID_ARG, "inject: %d facts without a list", n_facts);
    for (int32_t f = 0; f < n_facts; f++) {
        if (facts[f].n_tokens <= 0)
            return is_error_set(IS_ERR_INVALID_ARG, "inject: fact %d has no tokens", f);
        if ((!facts[f].k || !facts[f].v) &&
            !engine_fact_resident(e, cache_ids ? cache_ids[f] : 0, facts[f].n_tokens))
            return is_error_set(IS_ERR_INVALID_ARG,
                                "inject: fact %d has no values and the backend does not hold it",
                                f);
        *total += facts[f].n_tokens;
    }
    return IS_OK;
}

/* What a sequence held before its facts were placed, to put it back. */
typedef struct inject_undo {
    int32_t base, total; /* length before; tokens placed (0: nothing to undo) */
    int32_t mem_begin, mem_end;
} inject_undo;

/* Grows the sequence by `total` memory tokens and its memory segment over
 * them: the bookkeeping of an injection, before any op. On failure the
 * sequence is unchanged and u->total is 0. */
static is_status inject_place(engine *e, int32_t seq, int64_t total, inject_undo *u) {
    seq_state *ss = &e->seqs[seq];
    const int32_t base = kv_seq_length(e->kv, seq);
    *u = (inject_undo){base, 0, ss->mem_begin, ss->mem_end};
    if (base + total > e->p.n_ctx)
        return is_error_set(IS_ERR_CONTEXT_FULL,
                            "inject: %lld memory tokens after %d would pass the context of %d",
                            (long long)total, base, e->p.n_ctx);
    is_status st = kv_seq_grow(e->kv, seq, (int32_t)total);
    if (st != IS_OK) return st;
    if ((st = seq_set_segments(e, seq, base, NULL, (int32_t)total)) != IS_OK) {
        kv_seq_truncate(e->kv, seq, base);
        return st;
    }
    if (ss->mem_begin >= ss->mem_end || ss->mem_begin > base) ss->mem_begin = base;
    ss->mem_end = base + (int32_t)total;
    u->total = (int32_t)total;
    return IS_OK;
}

static void inject_undo_apply(engine *e, int32_t seq, const inject_undo *u) {
    if (u->total == 0) return;
    kv_seq_truncate(e->kv, seq, u->base);
    e->seqs[seq].mem_begin = u->mem_begin;
    e->seqs[seq].mem_end = u->mem_end;
}

static is_status inject_staged(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts,
                               int64_t total, const inject_undo *u);

is_status engine_inject_ids(engine *e, int32_t seq, const engine_fact *facts,
                            const uint64_t *cache_ids, int32_t n_facts) {
    if (e->be->ops->inject) {
        /* One sequence of the batched path: the same backend call. */
        engine_inject_seq one = {seq, facts, cache_ids, n_facts};
        return engine_inject_batch(e, &one, 1, NULL);
    }
    int64_t total = 0;
    is_status st = inject_check(e, seq, facts, cache_ids, n_facts, &total);
    if (st != IS_OK || total == 0) return st;
    if ((st = backend_status(e->be)) != IS_OK) return st;
    inject_undo u;
    if ((st = inject_place(e, seq, total, &u)) != IS_OK) return st;
    return inject_staged(e, seq, facts, n_facts, total, &u);
}

/* Undoes every sequence of a batch that was placed, last first, gives each
 * the call's failure st, frees the undo list and returns st. */
static is_status inject_undo_all(engine *e, const engine_inject_seq *seqs, int32_t n,
                                 inject_undo *undo, is_status *results, is_status st) {
    for (int32_t i = n - 1; i >= 0; i--)
        if (undo[i].total) {
            inject_undo_apply(e, seqs[i].seq, &undo[i]);
            if (results) results[i] = st;
        }
    free(undo);
    return st;
}

is_status engine_inject_batch(engine *e, const engine_inject_seq *seqs, int32_t n,
                              is_status *results) {
    const model_config *c = &e->m->cfg;
    backend *be = e->be;
    const backend_ops *op = be->ops;
    if (n <= 0) return IS_OK;
    if (!seqs) return is_error_set(IS_ERR_INVALID_ARG, "inject: no sequences");
    is_status first = IS_OK;
    int32_t first_i = n;
    char first_msg[512] = "";
    /* Keeps the failure of the first sequence in the list and its message
     * (sequences are checked before any is placed, so a later one's
     * failure may come first, and each overwrites the thread's message). */
#define NOTE_FAIL(i, st_)                                                                          \
    do {                                                                                           \
        if (results) results[i] = (st_);                                                           \
        if ((i) < first_i) {                                                                       \
            first = (st_);                                                                         \
            first_i = (i);                                                                         \
            snprintf(first_msg, sizeof first_msg, "%s", is_error_last());                          \
        }                                                                                          \
    } while (0)
    if (!op->inject) {
        /* The generic path stages every layer through the scratch: one
         * sequence after another. */
        for (int32_t i = 0; i < n; i++) {
            is_status st = engine_inject_ids(e, seqs[i].seq, seqs[i].facts, seqs[i].cache_ids,
                                             seqs[i].n_facts);
            if (results) results[i] = st;
            if (st != IS_OK) NOTE_FAIL(i, st);
        }
        if (first != IS_OK) is_error_set(first, "%s", first_msg);
        return first;
    }
    inject_undo *undo = calloc((size_t)n, sizeof *undo);
    int64_t *totals = calloc((size_t)n, sizeof *totals);
    is_status st = undo && totals ? IS_OK : is_error_set(IS_ERR_NOMEM, "inject: out of memory");
    if (st != IS_OK) {
        for (int32_t i = 0; i < n; i++)
            if (results) results[i] = st;
        free(undo);
        free(totals);
        return st;
    }
    /* Each sequence on its own: checked, then (with the backend sound)
     * grown, or left as it was. A sequence named twice gets its second
     * list after its first. */
    int64_t checked_tokens = 0;
    for (int32_t i = 0; i < n; i++) {
        const engine_inject_seq *q = &seqs[i];
        st = inject_check(e, q->seq, q->facts, q->cache_ids, q->n_facts, &totals[i]);
        if (results) results[i] = st;
        if (st != IS_OK) {
            NOTE_FAIL(i, st);
            totals[i] = -1;
        } else {
            checked_tokens += totals[i];
        }
    }
    if (checked_tokens > 0 && (st = backend_status(be)) != IS_OK) {
        for (int32_t i = 0; i < n; i++)
            if (totals[i] >= 0 && results) results[i] = st;
        free(undo);
        free(totals);
        return st;
    }
    int64_t all_facts = 0, all_tokens = 0;
    for (int32_t i = 0; i < n; i++) {
        if (totals[i] <= 0) continue;
        st = inject_place(e, seqs[i].seq, totals[i], &undo[i]);
        if (results) results[i] = st;
        if (st != IS_OK) {
            NOTE_FAIL(i, st);
            continue;
        }
        all_facts += seqs[i].n_facts;
        all_tokens += totals[i];
    }
    free(totals);
    if (all_tokens > INT32_MAX / 4) {
        st = is_error_set(IS_ERR_INVALID_ARG, "inject: %lld memory tokens in one call",
                          (long long)all_tokens);
        return inject_undo_all(e, seqs, n, undo, results, st);
    }
    if (all_tokens == 0) {
        free(undo);
        if (first != IS_OK) is_error_set(first, "%s", first_msg);
        return first;
    }
    /* One backend call for every sequence placed: facts in order, each
     * token with the slot and the position it takes in its sequence. */
    backend_fact *bf = malloc((size_t)all_facts * sizeof *bf);
    int32_t *slots = malloc((size_t)all_tokens * 2 * sizeof *slots);
    if (!bf || !slots) {
        free(bf);
        free(slots);
        st = is_error_set(IS_ERR_NOMEM, "inject: out of memory");
        return inject_undo_all(e, seqs, n, undo, results, st);
    }
    int32_t *pos = slots + all_tokens;
    int64_t nf = 0, at = 0;
    for (int32_t i = 0; i < n; i++) {
        const engine_inject_seq *q = &seqs[i];
        if (!undo[i].total) continue;
        for (int32_t f = 0; f < q->n_facts; f++)
            bf[nf++] = (backend_fact){q->cache_ids ? q->cache_ids[f] : 0, q->facts[f].n_tokens,
                                      q->facts[f].k, q->facts[f].v};
        kv_cache_slots(e->kv, q->seq, undo[i].base, undo[i].total, slots + at);
        for (int32_t j = 0; j < undo[i].total; j++) pos[at + j] = undo[i].base + j;
        at += undo[i].total;
    }
    backend_inject in = {
        .n_layers = c->n_layers,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->head_dim,
        .block_size = e->p.block_size,
        .facts = bf,
        .n_facts = (int32_t)all_facts,
        .pos0 = 0,
        .slots = slots,
        .pos = pos,
        .rope = &c->rope,
    };
    op->inject(be, e->k_cache, e->v_cache, &in);
    free(bf);
    free(slots);
    /* Without a wait (the injection overlaps what follows): a failure
     * the device meets later is latched by the prefill's download. A
     * failure now undoes every sequence of the call, last first. */
    if ((st = backend_status(be)) != IS_OK) return inject_undo_all(e, seqs, n, undo, results, st);
    free(undo);
    if (first != IS_OK) is_error_set(first, "%s", first_msg);
    return first;
#undef NOTE_FAIL
}

size_t engine_kv_elem_size(const engine *e) { return e->kv_esize; }

is_status engine_seq_read_kv(engine *e, int32_t seq, int32_t pos, int32_t n, void *k, void *v) {
    const model_config *c = &e->m->cfg;
    if (seq < 0 || seq >= e->p.max_seqs || pos < 0 || n < 0 ||
        (int64_t)pos + n > kv_seq_length(e->kv, seq))
        return is_error_set(IS_ERR_INVALID_ARG, "read_kv: positions [%d, %lld) of sequence %d", pos,
                            (long long)pos + n, seq);
    if (n == 0) return IS_OK;
    int32_t *slots = malloc((size_t)n * sizeof *slots);
    if (!slots) return is_error_set(IS_ERR_NOMEM, "read_kv: out of memory");
    kv_cache_slots(e->kv, seq, pos, n, slots);
    const int32_t bs = e->p.block_size, hd = c->head_dim, kh = c->n_kv_heads;
    const size_t row = (size_t)hd * e->kv_esize;
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t i = 0; i < n; i++)
            for (int32_t h = 0; h < kh; h++) {
                const size_t src = ((size_t)(slots[i] / bs) * kh + h) * bs + slots[i] % bs;
                const size_t dst = (((size_t)l * n + i) * kh + h) * row;
                e->be->ops->download(e->be, (char *)k + dst,
                                     (const char *)e->k_cache[l] + src * row, row);
                e->be->ops->download(e->be, (char *)v + dst,
                                     (const char *)e->v_cache[l] + src * row, row);
            }
    free(slots);
    return backend_status(e->be);
}

/* The generic injection (a backend without an inject op), for facts
 * already placed by inject_place: staged a chunk at a time. */
static is_status inject_staged(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts,
                               int64_t total, const inject_undo *u) {
    const model_config *c = &e->m->cfg;
    backend *be = e->be;
    const backend_ops *op = be->ops;
    const int32_t base = u->base;
    is_status st;
    (void)n_facts;
    int32_t kv_dim = c->n_kv_heads * c->head_dim;
    size_t row = (size_t)kv_dim * sizeof(float);
    int32_t f = 0, j = 0; /* fact and token where the next chunk starts */
    for (int64_t t0 = 0; t0 < total; t0 += e->p.max_batch) {
        int32_t n = total - t0 < e->p.max_batch ? (int32_t)(total - t0) : e->p.max_batch;
        for (int32_t i = 0; i < n; i++) e->rpos[i] = base + (int32_t)t0 + i;
        kv_cache_slots(e->kv, seq, base + (int32_t)t0, n, e->slots);
        for (int32_t l = 0; l < c->n_layers; l++) {
            /* Stage this chunk's rows, one contiguous run per fact. */
            int32_t ff = f, jj = j;
            for (int32_t i = 0; i < n;) {
                int32_t run = facts[ff].n_tokens - jj;
                if (run > n - i) run = n - i;
                size_t src = ((size_t)l * facts[ff].n_tokens + jj) * kv_dim;
                op->upload(be, e->k + (size_t)i * kv_dim, facts[ff].k + src, run * row);
                op->upload(be, e->v + (size_t)i * kv_dim, facts[ff].v + src, run * row);
                i += run;
                jj += run;
                if (jj == facts[ff].n_tokens) {
                    ff++;
                    jj = 0;
                }
            }
            op->rope(be, e->k, e->rpos, n, c->n_kv_heads, c->head_dim, &c->rope);
            op->kv_store(be, e->k_cache[l], e->v_cache[l], e->k, e->v, e->slots, n, c->n_kv_heads,
                         c->head_dim, e->p.block_size);
        }
        /* Advance (f, j) past this chunk. */
        for (int32_t left = n; left > 0;) {
            int32_t run = facts[f].n_tokens - j;
            if (run > left) run = left;
            left -= run;
            j += run;
            if (j == facts[f].n_tokens) {
                f++;
                j = 0;
            }
        }
    }
    op->sync(be);
    if ((st = backend_status(be)) != IS_OK) inject_undo_apply(e, seq, u);
    return st;
}

is_status engine_recompute(engine *e, int32_t seq, const int32_t *pos, const int32_t *tokens,
                           int32_t n) {
    if (n <= 0) return IS_OK;
    if (seq < 0 || seq >= e->p.max_seqs)
        return is_error_set(IS_ERR_INVALID_ARG, "recompute: sequence id %d out of range", seq);
    int32_t *seqs = malloc((size_t)n * sizeof *seqs);
    bool *want = calloc((size_t)n, sizeof *want); /* no logits */
    if (!seqs || !want) {
        free(seqs);
        free(want);
        return is_error_set(IS_ERR_NOMEM, "recompute: out of memory");
    }
    for (int32_t i = 0; i < n; i++) seqs[i] = seq;
    /* A batch of recomputed tokens only: nothing appended. */
    engine_batch b = {
        .n_tokens = n, .tokens = tokens, .seq = seqs, .want_logits = want, .rewrite = pos};
    is_status st = decode_impl(e, &b, NULL, NULL);
    free(seqs);
    free(want);
    return st;
}

/* Rows [0, n) of the selected tokens' residual stream gathered from
 * src[total][dim] (backend memory): one copy per run of consecutive rows. */
static void gather_rows(engine *e, float *dst, const float *src, const bool *sel, int32_t total) {
    const int32_t dim = e->m->cfg.dim;
    const size_t row = (size_t)dim * sizeof(float);
    int32_t at = 0;
    for (int32_t i = 0; i < total;) {
        if (!sel[i]) {
            i++;
            continue;
        }
        int32_t j = i;
        while (j < total && sel[j]) j++;
        e->be->ops->copy(e->be, dst + (size_t)at * dim, src + (size_t)i * dim,
                         (size_t)(j - i) * row);
        at += j - i;
        i = j;
    }
}

/* What the blend's first pass leaves: the memory's tokens in order, the
 * chosen ones, and the chosen ones' layer-0 output. */
typedef struct blend_state {
    int32_t total, n_sel;
    int32_t *pos, *toks; /* [total]; after blend_prepare the chosen ones first, [n_sel] */
    float *hsel;         /* backend [n_sel][dim]: their residual stream entering layer 1 */
} blend_state;

static void blend_state_free(engine *e, blend_state *bs) {
    if (bs->hsel) e->be->ops->release(e->be, bs->hsel);
    free(bs->pos);
    free(bs->toks);
    memset(bs, 0, sizeof *bs);
}

/* Arguments of a blend of bl over `seq`: IS_ERR_INVALID_ARG naming the
 * first bad one, else *total = the facts' tokens. */
static is_status blend_check(engine *e, int32_t seq, const engine_blend *bl, int32_t *total) {
    const model_config *c = &e->m->cfg;
    if (seq < 0 || seq >= e->p.max_seqs)
        return is_error_set(IS_ERR_INVALID_ARG, "blend: sequence id %d out of range", seq);
    if (!(bl->ratio >= 0.0f && bl->ratio <= 1.0f))
        return is_error_set(IS_ERR_INVALID_ARG, "blend: ratio %g is not in [0, 1]",
                            (double)bl->ratio);
    if (c->n_layers < 2)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "blend: a model of %d layer has no second layer "
                            "to compare",
                            c->n_layers);
    const seq_state *ss = &e->seqs[seq];
    const int32_t len = kv_seq_length(e->kv, seq);
    *total = 0;
    for (int32_t f = 0; f < bl->n_facts; f++) {
        const engine_fact *fa = &bl->facts[f];
        if (fa->n_tokens <= 0 || !fa->k || !fa->v || !fa->tokens)
            return is_error_set(IS_ERR_INVALID_ARG, "blend: fact %d has no tokens or no values", f);
        *total += fa->n_tokens;
    }
    const int32_t mem_end = ss->mem_end < len ? ss->mem_end : len;
    if (ss->mem_begin + *total > mem_end)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "blend: %d fact tokens do not lie in the memory "
                            "[%d, %d)",
                            *total, ss->mem_begin, mem_end);
    return IS_OK;
}

/* The blend's first pass (engine.h, engine_recompute_blend): every memory
 * token through layer 0 (nothing stored), the deviation of layer 1's K/V
 * from the stored ones, the choice, and the chosen ones' layer-0 output
 * gathered into bs->hsel. `len`: the sequence's length before anything
 * this call appends. */
static is_status blend_prepare(engine *e, int32_t seq, int32_t len, const engine_blend *bl,
                               int32_t total, blend_state *bs) {
    const model_config *c = &e->m->cfg;
    const int32_t kv_dim = c->n_kv_heads * c->head_dim;
    const seq_state *ss = &e->seqs[seq];
    memset(bs, 0, sizeof *bs);
    bs->total = total;
    bs->pos = malloc((size_t)total * sizeof *bs->pos);
    bs->toks = malloc((size_t)total * sizeof *bs->toks);
    int32_t *seqs = malloc((size_t)total * sizeof *seqs);
    int32_t *base_len = calloc((size_t)e->p.max_seqs, sizeof *base_len);
    float *kn = malloc((size_t)total * kv_dim * sizeof *kn);
    float *vn = malloc((size_t)total * kv_dim * sizeof *vn);
    float *dev = bl->deviation ? bl->deviation : malloc((size_t)total * sizeof *dev);
    bool *sel = bl->selected ? bl->selected : malloc((size_t)total * sizeof *sel);
    float *hid = NULL; /* backend [total][dim] */
    is_status st = IS_OK;
    if (!bs->pos || !bs->toks || !seqs || !base_len || !kn || !vn || !dev || !sel)
        st = is_error_set(IS_ERR_NOMEM, "blend: out of memory");
    if (st == IS_OK) st = alloc_f32(e, &hid, (size_t)total * c->dim);
    int32_t at = 0;
    for (int32_t f = 0; st == IS_OK && f < bl->n_facts; f++)
        for (int32_t j = 0; j < bl->facts[f].n_tokens; j++, at++) {
            bs->pos[at] = ss->mem_begin + at;
            bs->toks[at] = bl->facts[f].tokens[j];
            seqs[at] = seq;
        }
    base_len[seq] = len; /* the keys readable: the whole sequence, causally cut */
    chunk_out co = {NULL, NULL, NULL};
    engine_batch b = {.n_tokens = total, .tokens = bs->toks, .seq = seqs, .rewrite = bs->pos};
    fwd_range first = {.l0 = 0, .l1 = 1, .x_out = hid, .k_next = kn, .v_next = vn, .store = false};
    for (int32_t t0 = 0; st == IS_OK && t0 < total; t0 += e->p.max_batch) {
        int32_t n = total - t0 < e->p.max_batch ? total - t0 : e->p.max_batch;
        forward_chunk(e, &b, t0, n, base_len, &co, &first);
        st = backend_status(e->be);
    }
    /* Deviation from the injected keys and values (before RoPE: the same
     * rotation of both leaves their distance). */
    at = 0;
    for (int32_t f = 0; st == IS_OK && f < bl->n_facts; f++) {
        const int32_t nt = bl->facts[f].n_tokens;
        for (int32_t j = 0; j < nt; j++, at++) {
            const float *ki = bl->facts[f].k + ((size_t)nt + j) * kv_dim; /* layer 1 */
            const float *vi = bl->facts[f].v + ((size_t)nt + j) * kv_dim;
            const float *kr = kn + (size_t)at * kv_dim, *vr = vn + (size_t)at * kv_dim;
            double d = 0;
            for (int32_t x = 0; x < kv_dim; x++) {
                double dk = (double)kr[x] - ki[x], dv = (double)vr[x] - vi[x];
                d += dk * dk + dv * dv;
            }
            dev[at] = (float)d;
        }
    }
    if (st == IS_OK) st = recompute_select_top(dev, total, bl->ratio, sel);
    for (int32_t i = 0; st == IS_OK && i < total; i++)
        if (sel[i]) {
            bs->pos[bs->n_sel] = bs->pos[i];
            bs->toks[bs->n_sel++] = bs->toks[i];
        }
    if (st == IS_OK && bs->n_sel > 0) st = alloc_f32(e, &bs->hsel, (size_t)bs->n_sel * c->dim);
    if (st == IS_OK && bs->n_sel > 0) gather_rows(e, bs->hsel, hid, sel, total);
    if (hid) e->be->ops->release(e->be, hid);
    free(seqs);
    free(base_len);
    free(kn);
    free(vn);
    if (dev != bl->deviation) free(dev);
    if (sel != bl->selected) free(sel);
    if (st != IS_OK) blend_state_free(e, bs);
    return st;
}

is_status engine_recompute_blend(engine *e, int32_t seq, const engine_fact *facts, int32_t n_facts,
                                 float ratio, bool *selected, float *deviation) {
    engine_blend bl = {.facts = facts,
                       .n_facts = n_facts,
                       .ratio = ratio,
                       .selected = selected,
                       .deviation = deviation};
    int32_t total;
    is_status st = blend_check(e, seq, &bl, &total);
    if (st != IS_OK || total == 0) return st;
    if ((st = backend_status(e->be)) != IS_OK) return st;
    const int32_t len = kv_seq_length(e->kv, seq);
    blend_state bs;
    if ((st = blend_prepare(e, seq, len, &bl, total, &bs)) != IS_OK) return st;
    /* The chosen tokens through the other layers from that output, their
     * keys and values written over their slots. */
    int32_t *seqs = malloc((size_t)(bs.n_sel ? bs.n_sel : 1) * sizeof *seqs);
    int32_t *base_len = calloc((size_t)e->p.max_seqs, sizeof *base_len);
    if (!seqs || !base_len) st = is_error_set(IS_ERR_NOMEM, "blend: out of memory");
    for (int32_t i = 0; st == IS_OK && i < bs.n_sel; i++) seqs[i] = seq;
    if (base_len) base_len[seq] = len;
    chunk_out co = {NULL, NULL, NULL};
    engine_batch b = {.n_tokens = bs.n_sel, .tokens = bs.toks, .seq = seqs, .rewrite = bs.pos};
    fwd_range rest = {.l0 = 1, .l1 = e->m->cfg.n_layers, .x_in = bs.hsel, .store = true};
    for (int32_t t0 = 0; st == IS_OK && t0 < bs.n_sel; t0 += e->p.max_batch) {
        int32_t n = bs.n_sel - t0 < e->p.max_batch ? bs.n_sel - t0 : e->p.max_batch;
        forward_chunk(e, &b, t0, n, base_len, &co, &rest);
        st = backend_status(e->be);
    }
    free(seqs);
    free(base_len);
    blend_state_free(e, &bs);
    return st;
}

/* engine_decode with b->blend: the blend's first pass; the batch's
 * (appended) tokens through layer 0; then the chosen memory tokens and the
 * batch's in one forward over layers 1.. with the head (the chosen ones
 * first: the batch reads their new K/V in the same layer). Slots reserved
 * by decode_impl; base_len the lengths before. */
static is_status blend_forward(engine *e, const engine_batch *b, const int32_t *base_len,
                               int32_t total, chunk_out *co) {
    const model_config *c = &e->m->cfg;
    const int32_t seq = b->seq[0], nq = b->n_tokens;
    blend_state bs;
    is_status st = blend_prepare(e, seq, base_len[seq], b->blend, total, &bs);
    if (st != IS_OK) return st;
    const int32_t n = bs.n_sel + nq;
    float *hcat = NULL; /* backend [n][dim]: the chosen rows, then the batch's */
    int32_t *toks = malloc((size_t)n * sizeof *toks), *rw = malloc((size_t)n * sizeof *rw);
    int32_t *seqs = malloc((size_t)n * sizeof *seqs);
    bool *want = malloc((size_t)n * sizeof *want);
    if (!toks || !rw || !seqs || !want) st = is_error_set(IS_ERR_NOMEM, "blend: out of memory");
    if (st == IS_OK) st = alloc_f32(e, &hcat, (size_t)n * c->dim);
    if (st == IS_OK) {
        /* The batch through layer 0, stored, its output after the chosen rows. */
        fwd_range first = {
            .l0 = 0, .l1 = 1, .x_out = hcat + (size_t)bs.n_sel * c->dim, .store = true};
        for (int32_t t0 = 0; st == IS_OK && t0 < nq; t0 += e->p.max_batch) {
            int32_t m = nq - t0 < e->p.max_batch ? nq - t0 : e->p.max_batch;
            forward_chunk(e, b, t0, m, base_len, co, &first);
            st = backend_status(e->be);
        }
    }
    if (st == IS_OK) {
        if (bs.n_sel)
            e->be->ops->copy(e->be, hcat, bs.hsel, (size_t)bs.n_sel * c->dim * sizeof(float));
        for (int32_t i = 0; i < n; i++) {
            const bool mem = i < bs.n_sel;
            toks[i] = mem ? bs.toks[i] : b->tokens[i - bs.n_sel];
            rw[i] = mem ? bs.pos[i] : -1;
            seqs[i] = seq;
            want[i] = !mem && (b->want_logits ? b->want_logits[i - bs.n_sel] : i == n - 1);
        }
        engine_batch fb = {
            .n_tokens = n, .tokens = toks, .seq = seqs, .want_logits = want, .rewrite = rw};
        fwd_range rest = {.l0 = 1, .l1 = c->n_layers, .x_in = hcat, .store = true, .head = true};
        for (int32_t t0 = 0; st == IS_OK && t0 < n; t0 += e->p.max_batch) {
            int32_t m = n - t0 < e->p.max_batch ? n - t0 : e->p.max_batch;
            int32_t n_out = forward_chunk(e, &fb, t0, m, base_len, co, &rest);
            st = backend_status(e->be);
            if (co->logits) co->logits += (size_t)n_out * c->n_vocab;
            if (co->tokens) co->tokens += n_out;
        }
    }
    if (hcat) e->be->ops->release(e->be, hcat);
    free(toks);
    free(rw);
    free(seqs);
    free(want);
    blend_state_free(e, &bs);
    return st;
}

is_status engine_status(engine *e) { return backend_status(e->be); }

is_status engine_recover(engine *e) { return backend_recover(e->be); }

bool engine_host_tier(engine *e) {
    const backend_ops *op = e->be->ops;
    return op->inject && op->host_alloc && op->host_free && op->fact_prefetch && op->fact_unpin &&
           op->host_wait;
}

is_status engine_host_alloc(engine *e, size_t bytes, void **out) {
    if (!e->be->ops->host_alloc)
        return is_error_set(IS_ERR_UNSUPPORTED, "backend has no host tier");
    return e->be->ops->host_alloc(e->be, bytes, out);
}

void engine_host_free(engine *e, void *ptr) {
    if (ptr && e->be->ops->host_free) e->be->ops->host_free(e->be, ptr);
}

void engine_host_wait(engine *e) {
    if (e->be->ops->host_wait) e->be->ops->host_wait(e->be);
}

bool engine_fact_prefetch(engine *e, uint64_t cache_id, int32_t n_tokens, int32_t dtype,
                          const void *k, const void *v) {
    if (!cache_id || n_tokens <= 0 || !engine_host_tier(e)) return false;
    const model_config *c = &e->m->cfg;
    backend_fact_host f = {.id = cache_id,
                           .n_tokens = n_tokens,
                           .n_layers = c->n_layers,
                           .n_kv_heads = c->n_kv_heads,
                           .head_dim = c->head_dim,
                           .dtype = dtype,
                           .k = k,
                           .v = v};
    return e->be->ops->fact_prefetch(e->be, &f);
}

void engine_fact_unpin(engine *e, uint64_t cache_id) {
    if (cache_id && e->be->ops->fact_unpin) e->be->ops->fact_unpin(e->be, cache_id);
}

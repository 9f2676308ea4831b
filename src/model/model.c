#include "model/model.h"

#include "core/status.h"
#include "gguf/tensor_type.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool arch_supported(const char *arch, rope_layout *layout) {
    static const struct {
        const char *name;
        rope_layout layout;
    } known[] = {
        {"llama", ROPE_LAYOUT_NORM},
        {"mistral", ROPE_LAYOUT_NORM},
        {"qwen2", ROPE_LAYOUT_NEOX},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if (strcmp(arch, known[i].name) == 0) {
            *layout = known[i].layout;
            return true;
        }
    }
    return false;
}

/* Reads "<arch>.<suffix>" as a positive int32. */
static is_status arch_u32(const gguf_ctx *g, const char *arch, const char *suffix, bool required,
                          int32_t *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    is_status st = gguf_get_u32(g, key, &v);
    if (st == IS_ERR_NOT_FOUND && !required) return IS_OK;
    if (st != IS_OK) return st;
    if (v == 0 || v > (1u << 30))
        return is_error_set(IS_ERR_FORMAT, "model: %s = %u is out of range", key, v);
    *out = (int32_t)v;
    return IS_OK;
}

static is_status arch_f32(const gguf_ctx *g, const char *arch, const char *suffix, float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    is_status st = gguf_get_f32(g, key, out);
    return st == IS_ERR_NOT_FOUND ? IS_OK : st; /* optional: keep the default */
}

is_status model_config_read(const gguf_ctx *g, model_config *out) {
    model_config c;
    memset(&c, 0, sizeof c);
    gguf_string s;
    is_status st = gguf_get_str(g, "general.architecture", &s);
    if (st != IS_OK) return st;
    if (s.len >= sizeof c.arch) s.len = sizeof c.arch - 1;
    memcpy(c.arch, s.data, s.len);
    c.arch[s.len] = '\0';
    if (!arch_supported(c.arch, &c.rope.layout))
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "model: architecture '%s' is not supported (llama, mistral, qwen2 are)",
                            c.arch);
    const char *a = c.arch;
    if ((st = arch_u32(g, a, "block_count", true, &c.n_layers)) != IS_OK ||
        (st = arch_u32(g, a, "embedding_length", true, &c.dim)) != IS_OK ||
        (st = arch_u32(g, a, "feed_forward_length", true, &c.ffn_dim)) != IS_OK ||
        (st = arch_u32(g, a, "attention.head_count", true, &c.n_heads)) != IS_OK)
        return st;
    c.n_kv_heads = c.n_heads;
    c.n_ctx_train = 4096;
    if ((st = arch_u32(g, a, "attention.head_count_kv", false, &c.n_kv_heads)) != IS_OK ||
        (st = arch_u32(g, a, "context_length", false, &c.n_ctx_train)) != IS_OK)
        return st;
    if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
        return is_error_set(IS_ERR_FORMAT,
                            "model: %d heads do not divide width %d into %d kv groups", c.n_heads,
                            c.dim, c.n_kv_heads);
    c.head_dim = c.dim / c.n_heads;
    if ((st = arch_u32(g, a, "attention.key_length", false, &c.head_dim)) != IS_OK) return st;
    c.rope.n_rot = c.head_dim;
    if ((st = arch_u32(g, a, "rope.dimension_count", false, &c.rope.n_rot)) != IS_OK) return st;
    if (c.rope.n_rot > c.head_dim || c.rope.n_rot % 2 != 0 || c.head_dim > 1024)
        return is_error_set(IS_ERR_FORMAT, "model: rope dimension %d does not fit head dim %d",
                            c.rope.n_rot, c.head_dim);
    c.rms_eps = 1e-5f;
    c.rope.freq_base = 10000.0f;
    c.rope.freq_scale = 1.0f;
    if ((st = arch_f32(g, a, "attention.layer_norm_rms_epsilon", &c.rms_eps)) != IS_OK ||
        (st = arch_f32(g, a, "rope.freq_base", &c.rope.freq_base)) != IS_OK)
        return st;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (gguf_get_str(g, key, &s) == IS_OK) {
        if (s.len == 6 && memcmp(s.data, "linear", 6) == 0) {
            float factor = 1.0f;
            if ((st = arch_f32(g, a, "rope.scaling.factor", &factor)) != IS_OK) return st;
            if (factor > 0.0f) c.rope.freq_scale = 1.0f / factor;
        } else if (!(s.len == 4 && memcmp(s.data, "none", 4) == 0) &&
                   !(s.len == 6 && memcmp(s.data, "llama3", 6) == 0)) {
            /* llama3 scaling arrives as the rope_freqs tensor, read by model_load. */
            return is_error_set(IS_ERR_UNSUPPORTED, "model: rope scaling '%.*s' is not supported",
                                (int)s.len, s.data);
        }
    }
    const gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return is_error_set(IS_ERR_FORMAT, "model: tensor 'token_embd.weight' is missing");
    if (emb->ne[0] != c.dim)
        return is_error_set(IS_ERR_FORMAT, "model: token_embd width %lld != embedding_length %d",
                            (long long)emb->ne[0], c.dim);
    c.n_vocab = (int32_t)emb->ne[1];
    c.has_qkv_bias = gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c.tied_output = gguf_find_tensor(g, "output.weight") == NULL;
    *out = c;
    return IS_OK;
}

/* Tensor `name` after checking its shape (cols x rows; rows = 1 for
 * vectors); *out = NULL for a missing optional one. */
static is_status find_weight(model *m, const char *name, int64_t cols, int64_t rows, bool optional,
                             const gguf_tensor **out) {
    const gguf_tensor *t = gguf_find_tensor(m->gguf, name);
    *out = t;
    if (!t) {
        if (optional) return IS_OK;
        return is_error_set(IS_ERR_FORMAT, "model: tensor '%s' is missing", name);
    }
    int64_t t_rows = t->ne[1] * t->ne[2] * t->ne[3];
    if (t->ne[0] != cols || t_rows != rows)
        return is_error_set(
            IS_ERR_FORMAT, "model: tensor '%s' is %lld x %lld, expected %lld x %lld", name,
            (long long)t->ne[0], (long long)t_rows, (long long)cols, (long long)rows);
    return IS_OK;
}

/* Creates weight `name` on the backend after checking its shape. */
static is_status load_weight(model *m, const char *name, int64_t cols, int64_t rows, bool optional,
                             backend_weight **out) {
    const gguf_tensor *t;
    *out = NULL;
    is_status st = find_weight(m, name, cols, rows, optional, &t);
    if (st != IS_OK || !t) return st;
    return m->be->ops->weight_create(m->be, t, out);
}

/* Matrices of layer l that share their input (same cols), created stacked
 * where the backend can, so one product reads them (backend matmul_n). */
static is_status load_stack(model *m, int32_t l, const char *const *suffix, const int64_t *rows,
                            int32_t n, int64_t cols, backend_weight **const *out) {
    const gguf_tensor *ts[4];
    backend_weight *ws[4];
    IS_ASSERT(n <= 4);
    for (int32_t i = 0; i < n; i++) {
        char name[96];
        snprintf(name, sizeof name, "blk.%d.%s", l, suffix[i]);
        is_status st = find_weight(m, name, cols, rows[i], false, &ts[i]);
        if (st != IS_OK) return st;
    }
    const backend_ops *op = m->be->ops;
    if (op->weight_create_stacked) {
        is_status st = op->weight_create_stacked(m->be, ts, n, ws);
        if (st != IS_OK) return st;
        for (int32_t i = 0; i < n; i++) *out[i] = ws[i];
        return IS_OK;
    }
    for (int32_t i = 0; i < n; i++) {
        is_status st = op->weight_create(m->be, ts[i], out[i]);
        if (st != IS_OK) return st;
    }
    return IS_OK;
}

/* 64-bit hash over metadata and tensor bytes (a multiply-xorshift over
 * 8-byte words): cheap enough to run at every load, strong enough to tell
 * two models apart. It names the model in fact-KV records. */
static uint64_t hash_bytes(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = data;
    const uint64_t k = 0x9E3779B97F4A7C15ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ (w * k)) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001B3ull;
    return h ^ (h >> 32);
}

static void model_fingerprint(model *m) {
    /* Everything before the tensor data (metadata and tensor infos), then
     * every tensor's bytes. */
    uint64_t h = 0x243F6A8885A308D3ull;
    h = hash_bytes(h, gguf_file_data(m->gguf), (size_t)gguf_data_offset(m->gguf));
    for (int64_t i = 0; i < gguf_n_tensors(m->gguf); i++) {
        const gguf_tensor *t = gguf_tensor_at(m->gguf, i);
        h = hash_bytes(h, t->data, t->nbytes);
    }
    snprintf(m->fingerprint, sizeof m->fingerprint, "%016llx", (unsigned long long)h);
}

static is_status load_weights(model *m) {
    const model_config *c = &m->cfg;
    int64_t q_dim = (int64_t)c->n_heads * c->head_dim,
            kv_dim = (int64_t)c->n_kv_heads * c->head_dim;
    is_status st;
    if ((st = load_weight(m, "token_embd.weight", c->dim, c->n_vocab, false, &m->token_embd)) ||
        (st = load_weight(m, "output_norm.weight", c->dim, 1, false, &m->output_norm)))
        return st;
    if (c->tied_output) {
        m->output = m->token_embd;
    } else if ((st = load_weight(m, "output.weight", c->dim, c->n_vocab, false, &m->output))) {
        return st;
    }
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return is_error_set(IS_ERR_NOMEM, "model: out of memory");
    for (int32_t l = 0; l < c->n_layers; l++) {
        model_layer *L = &m->layers[l];
        char n[96];
#define W(field, suffix, cols, rows, opt)                                                          \
    snprintf(n, sizeof n, "blk.%d." suffix, l);                                                    \
    if ((st = load_weight(m, n, cols, rows, opt, &L->field)) != IS_OK) return st;
        W(attn_norm, "attn_norm.weight", c->dim, 1, false)
        st = load_stack(m, l,
                        (const char *const[]){"attn_q.weight", "attn_k.weight", "attn_v.weight"},
                        (const int64_t[]){q_dim, kv_dim, kv_dim}, 3, c->dim,
                        (backend_weight * *const[]){&L->wq, &L->wk, &L->wv});
        if (st != IS_OK) return st;
        W(bq, "attn_q.bias", q_dim, 1, !c->has_qkv_bias)
        W(bk, "attn_k.bias", kv_dim, 1, !c->has_qkv_bias)
        W(bv, "attn_v.bias", kv_dim, 1, !c->has_qkv_bias)
        W(wo, "attn_output.weight", q_dim, c->dim, false)
        W(ffn_norm, "ffn_norm.weight", c->dim, 1, false)
        st = load_stack(m, l, (const char *const[]){"ffn_gate.weight", "ffn_up.weight"},
                        (const int64_t[]){c->ffn_dim, c->ffn_dim}, 2, c->dim,
                        (backend_weight * *const[]){&L->w_gate, &L->w_up});
        if (st != IS_OK) return st;
        W(w_down, "ffn_down.weight", c->ffn_dim, c->dim, false)
#undef W
    }
    /* Llama 3.1 frequency scaling: per-pair divisors stored as a tensor. */
    const gguf_tensor *rf = gguf_find_tensor(m->gguf, "rope_freqs.weight");
    if (rf) {
        if (rf->type != TENSOR_TYPE_F32 || rf->ne[0] != c->rope.n_rot / 2)
            return is_error_set(IS_ERR_FORMAT, "model: rope_freqs.weight must be f32 [%d]",
                                c->rope.n_rot / 2);
        m->rope_freq_factors = malloc((size_t)rf->ne[0] * sizeof(float));
        if (!m->rope_freq_factors) return is_error_set(IS_ERR_NOMEM, "model: out of memory");
        memcpy(m->rope_freq_factors, rf->data, (size_t)rf->ne[0] * sizeof(float));
        m->cfg.rope.freq_factors = m->rope_freq_factors;
    }
    return IS_OK;
}

is_status model_load(const char *path, backend *be, model **out) {
    model *m = calloc(1, sizeof *m);
    if (!m) return is_error_set(IS_ERR_NOMEM, "model: out of memory");
    m->be = be;
    is_status st = gguf_open(path, &m->gguf);
    if (st == IS_OK) st = model_config_read(m->gguf, &m->cfg);
    if (st == IS_OK) st = tokenizer_load(m->gguf, &m->tok);
    if (st == IS_OK && tokenizer_n_vocab(m->tok) != m->cfg.n_vocab)
        st = is_error_set(IS_ERR_FORMAT, "model: tokenizer has %d tokens, embedding %d rows",
                          tokenizer_n_vocab(m->tok), m->cfg.n_vocab);
    if (st == IS_OK) st = load_weights(m);
    if (st != IS_OK) {
        model_free(m);
        return st;
    }
    model_fingerprint(m);
    *out = m;
    return IS_OK;
}

void model_free(model *m) {
    if (!m) return;
    backend *be = m->be;
    if (m->layers) {
        for (int32_t l = 0; l < m->cfg.n_layers; l++) {
            model_layer *L = &m->layers[l];
            backend_weight *ws[] = {L->attn_norm, L->wq,     L->wk,   L->wv,
                                    L->bq,        L->bk,     L->bv,   L->wo,
                                    L->ffn_norm,  L->w_gate, L->w_up, L->w_down};
            for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) be->ops->weight_free(be, ws[i]);
        }
        free(m->layers);
    }
    if (m->output != m->token_embd) be->ops->weight_free(be, m->output);
    be->ops->weight_free(be, m->token_embd);
    be->ops->weight_free(be, m->output_norm);
    free(m->rope_freq_factors);
    tokenizer_free(m->tok);
    gguf_close(m->gguf);
    free(m);
}

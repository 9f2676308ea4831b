/*
 * embedder: a BERT sentence encoder (see embedder.h). Sections: files and
 * configuration, weights, kernels, forward pass, public calls.
 */
#include "memory/embedder.h"
#include "memory/embedder_weights.h"

#include "core/status.h"
#include "core/threads.h"
#include "core/vmath.h"
#include "gguf/quant.h"
#include "memory/safetensors.h"

#include <cblas.h>
#include <cJSON.h>
#include <errno.h>
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* A batch is cut into chunks of at most this many tokens, which bounds the
 * work buffers (the FFN one is CHUNK_TOKENS * intermediate floats: 24 MiB
 * for MiniLM) while keeping the sgemm shapes large. */
#define CHUNK_TOKENS 4096

typedef enum embedder_pooling {
    EMBEDDER_POOLING_MEAN = 0, /* average of all token states ([CLS], [SEP] included) */
    EMBEDDER_POOLING_CLS = 1,  /* the [CLS] token's state */
} embedder_pooling;

/* A layer's weights: the view memory/embedder_weights.h gives out. wqkv and
 * bqkv are owned (the three projections stacked at load); the rest point
 * into the mapped file or the widened copy. */
typedef encoder_layer_weights bert_layer;

struct embedder {
    wordpiece *wp;
    safetensors *st;
    /* Configuration and embedding weights: the view embedder_get_weights
     * hands out (its layers, pool_cls and tokenizer are filled there).
     * type_emb is (n_types, H); row 0 is used (single segment). */
    encoder_weights w;
    embedder_pooling pooling;
    bert_layer *layers; /* (n_layers) */
    float **owned;      /* tensors converted from F16/BF16, freed with e */
    int32_t n_owned, cap_owned;
    int32_t n_threads; /* 0: all cores */

    /* Work buffers, grown on demand; sized for ws_tokens tokens. */
    size_t ws_tokens;
    float *x;      /* (T, H) hidden states */
    float *qkv;    /* (T, 3H) */
    float *ctx;    /* (T, H) attention output before projection */
    float *tmp;    /* (T, H) */
    float *ff;     /* (T, I) */
    float *scores; /* (threads, max_tokens) one attention row per thread */
    int32_t scores_threads;
    int32_t *tok; /* (tok_texts, max_tokens) token ids of a chunk of texts */
    int32_t tok_texts;

    /* A device embedder (embedder_create_on) runs the forward pass through
     * its backend's retrieval calls: ops and enc are set, base is the CPU
     * embedder it was copied from (borrowed: its tokenizer and weights),
     * and of the fields above only hidden, max_tokens and n_vocab are. */
    const embedder *base;
    const retrieval_ops *ops;
    retrieval_encoder *enc;
    int32_t device;
};

/* ---- files and configuration ----------------------------------------- */

static is_status read_file(const char *path, char **data, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return is_error_set(IS_ERR_IO, "embedder: cannot open %s: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return is_error_set(IS_ERR_IO, "embedder: cannot seek %s", path);
    }
    long n = ftell(f);
    if (n < 0 || n > (64l << 20)) {
        fclose(f);
        return is_error_set(n < 0 ? IS_ERR_IO : IS_ERR_FORMAT, "embedder: %s: bad size", path);
    }
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    }
    size_t r = fread(buf, 1, (size_t)n, f);
    fclose(f);
    if (r != (size_t)n) {
        free(buf);
        return is_error_set(IS_ERR_IO, "embedder: short read on %s", path);
    }
    buf[n] = 0;
    *data = buf;
    *len = (size_t)n;
    return IS_OK;
}

static bool file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Parses JSON file dir/name into *out. A missing optional file gives IS_OK
 * and *out = NULL. */
static is_status read_json(const char *dir, const char *name, bool required, cJSON **out) {
    char path[4096];
    *out = NULL;
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        return is_error_set(IS_ERR_INVALID_ARG, "embedder: path too long");
    if (!required && !file_exists(path)) return IS_OK;
    char *data = NULL;
    size_t len = 0;
    is_status st = read_file(path, &data, &len);
    if (st != IS_OK) return st;
    cJSON *j = cJSON_ParseWithLength(data, len);
    free(data);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return is_error_set(IS_ERR_FORMAT, "embedder: %s is not a JSON object", path);
    }
    *out = j;
    return IS_OK;
}

/* Reads positive integer `key` of config object j into *v. */
static is_status json_int(const cJSON *j, const char *file, const char *key, int32_t lo, int32_t hi,
                          int32_t *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsNumber(it) || it->valuedouble < lo || it->valuedouble > hi ||
        floor(it->valuedouble) != it->valuedouble)
        return is_error_set(IS_ERR_FORMAT,
                            "embedder: %s: \"%s\" missing or not an integer in [%d, %d]", file, key,
                            lo, hi);
    *v = (int32_t)it->valuedouble;
    return IS_OK;
}

static bool json_bool(const cJSON *j, const char *key, bool dflt) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsBool(it) ? cJSON_IsTrue(it) : dflt;
}

static is_status read_config(embedder *e, const char *dir, wordpiece_params *wpp) {
    cJSON *cfg = NULL, *tok = NULL, *sbert = NULL, *pool = NULL;
    is_status st = read_json(dir, "config.json", true, &cfg);
    if (st == IS_OK) st = read_json(dir, "tokenizer_config.json", false, &tok);
    if (st == IS_OK) st = read_json(dir, "sentence_bert_config.json", false, &sbert);
    if (st == IS_OK) st = read_json(dir, "1_Pooling/config.json", false, &pool);
    if (st != IS_OK) goto done;

    if ((st = json_int(cfg, "config.json", "hidden_size", 1, 1 << 16, &e->w.hidden)) ||
        (st = json_int(cfg, "config.json", "num_hidden_layers", 1, 1024, &e->w.n_layers)) ||
        (st = json_int(cfg, "config.json", "num_attention_heads", 1, 1024, &e->w.n_heads)) ||
        (st = json_int(cfg, "config.json", "intermediate_size", 1, 1 << 20, &e->w.inter)) ||
        (st = json_int(cfg, "config.json", "vocab_size", 1, 1 << 24, &e->w.n_vocab)) ||
        (st = json_int(cfg, "config.json", "max_position_embeddings", 2, 1 << 20, &e->w.max_pos)))
        goto done;
    if (e->w.hidden % e->w.n_heads != 0) {
        st = is_error_set(IS_ERR_FORMAT,
                          "embedder: config.json: hidden_size %d not a multiple of %d heads",
                          e->w.hidden, e->w.n_heads);
        goto done;
    }
    e->w.head_dim = e->w.hidden / e->w.n_heads;
    const cJSON *eps = cJSON_GetObjectItemCaseSensitive(cfg, "layer_norm_eps");
    e->w.ln_eps = cJSON_IsNumber(eps) ? (float)eps->valuedouble : 1e-12f;
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(cfg, "hidden_act");
    if (!cJSON_IsString(act) || strcmp(act->valuestring, "gelu") != 0) {
        st = is_error_set(IS_ERR_UNSUPPORTED, "embedder: config.json: hidden_act must be \"gelu\"");
        goto done;
    }
    const cJSON *pet = cJSON_GetObjectItemCaseSensitive(cfg, "position_embedding_type");
    if (pet && (!cJSON_IsString(pet) || strcmp(pet->valuestring, "absolute") != 0)) {
        st = is_error_set(IS_ERR_UNSUPPORTED,
                          "embedder: config.json: only absolute position embeddings");
        goto done;
    }

    *wpp = wordpiece_default_params();
    if (tok) {
        wpp->lowercase = json_bool(tok, "do_lower_case", true);
        wpp->tokenize_chinese_chars = json_bool(tok, "tokenize_chinese_chars", true);
        const cJSON *sa = cJSON_GetObjectItemCaseSensitive(tok, "strip_accents");
        wpp->strip_accents = cJSON_IsBool(sa) ? cJSON_IsTrue(sa) : -1;
    }

    e->w.max_tokens = e->w.max_pos < 512 ? e->w.max_pos : 512;
    if (sbert && (st = json_int(sbert, "sentence_bert_config.json", "max_seq_length", 2,
                                e->w.max_pos, &e->w.max_tokens)))
        goto done;

    e->pooling = EMBEDDER_POOLING_MEAN;
    if (pool) {
        bool mean = json_bool(pool, "pooling_mode_mean_tokens", false);
        bool cls = json_bool(pool, "pooling_mode_cls_token", false);
        bool other = json_bool(pool, "pooling_mode_max_tokens", false) ||
                     json_bool(pool, "pooling_mode_mean_sqrt_len_tokens", false) ||
                     json_bool(pool, "pooling_mode_weightedmean_tokens", false) ||
                     json_bool(pool, "pooling_mode_lasttoken", false);
        if (mean + cls != 1 || other) {
            st = is_error_set(
                IS_ERR_UNSUPPORTED,
                "embedder: 1_Pooling/config.json: only one of mean or CLS pooling is supported");
            goto done;
        }
        e->pooling = cls ? EMBEDDER_POOLING_CLS : EMBEDDER_POOLING_MEAN;
    }
done:
    cJSON_Delete(cfg);
    cJSON_Delete(tok);
    cJSON_Delete(sbert);
    cJSON_Delete(pool);
    return st;
}

/* ---- weights ----------------------------------------------------------- */

/* The F32 data of tensor `name` (prefix + name) with the given shape (d1 = 0
 * for a vector). F16/BF16 are converted into a buffer owned by e. */
static is_status get_tensor(embedder *e, const char *prefix, const char *name, int64_t d0,
                            int64_t d1, const float **out) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    const safetensors_tensor *t = safetensors_find(e->st, full);
    if (!t) {
        /* Old BERT checkpoints name LayerNorm parameters gamma/beta. */
        char alt[256];
        const char *w = strstr(full, "LayerNorm.weight"), *b = strstr(full, "LayerNorm.bias");
        if (w || b) {
            size_t k = (size_t)((w ? w : b) - full);
            snprintf(alt, sizeof alt, "%.*sLayerNorm.%s", (int)k, full, w ? "gamma" : "beta");
            t = safetensors_find(e->st, alt);
        }
    }
    if (!t)
        return is_error_set(IS_ERR_FORMAT, "embedder: model.safetensors lacks tensor \"%s\"", full);
    bool ok = d1 ? (t->n_dims == 2 && t->shape[0] == d0 && t->shape[1] == d1)
                 : (t->n_dims == 1 && t->shape[0] == d0);
    if (!ok)
        return is_error_set(IS_ERR_FORMAT,
                            "embedder: tensor \"%s\" has shape [%lld%s%lld], expected [%lld%s%lld]",
                            full, (long long)t->shape[0], t->n_dims > 1 ? ", " : "",
                            t->n_dims > 1 ? (long long)t->shape[1] : 0ll, (long long)d0,
                            d1 ? ", " : "", (long long)d1);
    if (t->dtype == SAFETENSORS_DTYPE_F32 && ((uintptr_t)t->data & 3) == 0) {
        *out = t->data;
        return IS_OK;
    }
    if (t->dtype != SAFETENSORS_DTYPE_F32 && t->dtype != SAFETENSORS_DTYPE_F16 &&
        t->dtype != SAFETENSORS_DTYPE_BF16)
        return is_error_set(IS_ERR_UNSUPPORTED, "embedder: tensor \"%s\" is not F32, F16 or BF16",
                            full);
    if (e->n_owned == e->cap_owned) {
        int32_t cap = e->cap_owned ? 2 * e->cap_owned : 16;
        float **no = realloc(e->owned, (size_t)cap * sizeof *no);
        if (!no) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
        e->owned = no;
        e->cap_owned = cap;
    }
    float *f = malloc((size_t)t->n_elements * sizeof *f);
    if (!f) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    const uint8_t *p = t->data;
    for (int64_t i = 0; i < t->n_elements; i++) {
        if (t->dtype == SAFETENSORS_DTYPE_F32) {
            memcpy(&f[i], p + 4 * i, 4);
        } else {
            uint16_t h = (uint16_t)(p[2 * i] | (p[2 * i + 1] << 8));
            f[i] = t->dtype == SAFETENSORS_DTYPE_F16 ? quant_f16_to_f32(h) : quant_bf16_to_f32(h);
        }
    }
    e->owned[e->n_owned++] = f;
    *out = f;
    return IS_OK;
}

static is_status load_weights(embedder *e) {
    const int64_t H = e->w.hidden, FI = e->w.inter;
    const char *pre = safetensors_find(e->st, "embeddings.word_embeddings.weight")        ? ""
                      : safetensors_find(e->st, "bert.embeddings.word_embeddings.weight") ? "bert."
                                                                                          : "";
    const safetensors_tensor *tt = NULL;
    char name[256];
    snprintf(name, sizeof name, "%sembeddings.token_type_embeddings.weight", pre);
    tt = safetensors_find(e->st, name);
    int64_t n_types = tt && tt->n_dims == 2 ? tt->shape[0] : 1;
    is_status st;
    if ((st = get_tensor(e, pre, "embeddings.word_embeddings.weight", e->w.n_vocab, H,
                         &e->w.tok_emb)) ||
        (st = get_tensor(e, pre, "embeddings.position_embeddings.weight", e->w.max_pos, H,
                         &e->w.pos_emb)) ||
        (st = get_tensor(e, pre, "embeddings.token_type_embeddings.weight", n_types, H,
                         &e->w.type_emb)) ||
        (st = get_tensor(e, pre, "embeddings.LayerNorm.weight", H, 0, &e->w.emb_ln_g)) ||
        (st = get_tensor(e, pre, "embeddings.LayerNorm.bias", H, 0, &e->w.emb_ln_b)))
        return st;
    e->layers = calloc((size_t)e->w.n_layers, sizeof *e->layers);
    if (!e->layers) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    for (int32_t l = 0; l < e->w.n_layers; l++) {
        bert_layer *L = &e->layers[l];
        const float *q, *k, *v, *bq, *bk, *bv;
        char n[16][128];
        static const char *const suffix[] = {
            "attention.self.query.weight",
            "attention.self.query.bias",
            "attention.self.key.weight",
            "attention.self.key.bias",
            "attention.self.value.weight",
            "attention.self.value.bias",
            "attention.output.dense.weight",
            "attention.output.dense.bias",
            "attention.output.LayerNorm.weight",
            "attention.output.LayerNorm.bias",
            "intermediate.dense.weight",
            "intermediate.dense.bias",
            "output.dense.weight",
            "output.dense.bias",
            "output.LayerNorm.weight",
            "output.LayerNorm.bias",
        };
        for (int i = 0; i < 16; i++)
            snprintf(n[i], sizeof n[i], "encoder.layer.%d.%s", l, suffix[i]);
        if ((st = get_tensor(e, pre, n[0], H, H, &q)) ||
            (st = get_tensor(e, pre, n[1], H, 0, &bq)) ||
            (st = get_tensor(e, pre, n[2], H, H, &k)) ||
            (st = get_tensor(e, pre, n[3], H, 0, &bk)) ||
            (st = get_tensor(e, pre, n[4], H, H, &v)) ||
            (st = get_tensor(e, pre, n[5], H, 0, &bv)) ||
            (st = get_tensor(e, pre, n[6], H, H, &L->wo)) ||
            (st = get_tensor(e, pre, n[7], H, 0, &L->bo)) ||
            (st = get_tensor(e, pre, n[8], H, 0, &L->ln1_g)) ||
            (st = get_tensor(e, pre, n[9], H, 0, &L->ln1_b)) ||
            (st = get_tensor(e, pre, n[10], FI, H, &L->w1)) ||
            (st = get_tensor(e, pre, n[11], FI, 0, &L->b1)) ||
            (st = get_tensor(e, pre, n[12], H, FI, &L->w2)) ||
            (st = get_tensor(e, pre, n[13], H, 0, &L->b2)) ||
            (st = get_tensor(e, pre, n[14], H, 0, &L->ln2_g)) ||
            (st = get_tensor(e, pre, n[15], H, 0, &L->ln2_b)))
            return st;
        /* One [3H, H] projection instead of three: one sgemm per layer. */
        float *wqkv = malloc((size_t)(3 * H * H) * sizeof(float));
        float *bqkv = malloc((size_t)(3 * H) * sizeof(float));
        L->wqkv = wqkv;
        L->bqkv = bqkv;
        if (!wqkv || !bqkv) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
        memcpy(wqkv, q, (size_t)(H * H) * sizeof(float));
        memcpy(wqkv + H * H, k, (size_t)(H * H) * sizeof(float));
        memcpy(wqkv + 2 * H * H, v, (size_t)(H * H) * sizeof(float));
        memcpy(bqkv, bq, (size_t)H * sizeof(float));
        memcpy(bqkv + H, bk, (size_t)H * sizeof(float));
        memcpy(bqkv + 2 * H, bv, (size_t)H * sizeof(float));
    }
    return IS_OK;
}

void embedder_free(embedder *e) {
    if (!e) return;
    if (e->ops) {
        e->ops->encoder_free(e->enc);
        free(e);
        return;
    }
    if (e->layers) {
        for (int32_t l = 0; l < e->w.n_layers; l++) {
            free((float *)e->layers[l].wqkv); /* owned (see bert_layer) */
            free((float *)e->layers[l].bqkv);
        }
        free(e->layers);
    }
    for (int32_t i = 0; i < e->n_owned; i++) free(e->owned[i]);
    free(e->owned);
    safetensors_close(e->st);
    wordpiece_free(e->wp);
    free(e->x);
    free(e->qkv);
    free(e->ctx);
    free(e->tmp);
    free(e->ff);
    free(e->scores);
    free(e->tok);
    free(e);
}

is_status embedder_load(const char *dir, embedder **out) {
    if (!dir || !out) return is_error_set(IS_ERR_INVALID_ARG, "embedder_load: NULL argument");
    embedder *e = calloc(1, sizeof *e);
    if (!e) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    wordpiece_params wpp;
    char path[4096];
    is_status st = read_config(e, dir, &wpp);
    if (st == IS_OK) {
        snprintf(path, sizeof path, "%s/vocab.txt", dir);
        st = wordpiece_load(path, wpp, &e->wp);
    }
    if (st == IS_OK && wordpiece_n_vocab(e->wp) != e->w.n_vocab)
        st = is_error_set(IS_ERR_FORMAT, "embedder: vocab.txt has %d tokens, config.json says %d",
                          wordpiece_n_vocab(e->wp), e->w.n_vocab);
    if (st == IS_OK) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        st = safetensors_open(path, &e->st);
    }
    if (st == IS_OK) st = load_weights(e);
    if (st != IS_OK) {
        embedder_free(e);
        return st;
    }
    *out = e;
    return IS_OK;
}

int32_t embedder_dim(const embedder *e) { return e ? e->w.hidden : 0; }
int32_t embedder_max_tokens(const embedder *e) { return e ? e->w.max_tokens : 0; }
const wordpiece *embedder_tokenizer(const embedder *e) {
    return e ? (e->base ? e->base->wp : e->wp) : NULL;
}
void embedder_set_n_threads(embedder *e, int32_t n) {
    if (e) e->n_threads = n > 0 ? n : 0;
}

/* wordpiece_encode behind the encoder_weights tokenizer callback. */
static is_status tokenize_wordpiece(const void *tok, const char *text, size_t len, int32_t max_len,
                                    int32_t *ids, int32_t *n_out) {
    return wordpiece_encode(tok, text, len, max_len, ids, n_out);
}

void embedder_get_weights(const embedder *e, encoder_weights *out) {
    if (e->base) e = e->base;
    *out = e->w;
    out->pool_cls = e->pooling == EMBEDDER_POOLING_CLS;
    out->layers = e->layers;
    out->tokenize = tokenize_wordpiece;
    out->tokenizer = e->wp;
}

is_status embedder_create_on(const embedder *cpu, const char *backend, int32_t device,
                             embedder **out) {
    if (!cpu || !backend || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "embedder_create_on: NULL argument");
    if (cpu->base)
        return is_error_set(IS_ERR_INVALID_ARG, "embedder_create_on: needs a CPU embedder");
    const retrieval_ops *ops;
    is_status st = retrieval_backend_get(backend, &ops);
    if (st != IS_OK) return st;
    embedder *e = calloc(1, sizeof *e);
    if (!e) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    encoder_weights w;
    embedder_get_weights(cpu, &w);
    if ((st = ops->encoder_create(&w, device, &e->enc)) != IS_OK) {
        free(e);
        return st;
    }
    e->base = cpu;
    e->ops = ops;
    e->device = device;
    e->w.hidden = cpu->w.hidden;
    e->w.max_tokens = cpu->w.max_tokens;
    e->w.n_vocab = cpu->w.n_vocab;
    *out = e;
    return IS_OK;
}

const char *embedder_backend(const embedder *e) { return e && e->ops ? e->ops->name : "cpu"; }

is_status embedder_embed_device(embedder *e, const char *const *texts, int32_t n, float *out_dev) {
    if (!e) return is_error_set(IS_ERR_INVALID_ARG, "embedder_embed_device: NULL embedder");
    if (!e->ops)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "embedder_embed_device: a CPU embedder has no device memory");
    return e->ops->encoder_embed_device(e->enc, texts, n, out_dev);
}

/* ---- kernels ----------------------------------------------------------- */

static int32_t n_threads_eff(const embedder *e) {
    return e->n_threads > 0 ? e->n_threads : omp_get_num_procs();
}

/* Dot product with 8 independent partial sums (vectorises without
 * -ffast-math, and the summation order is fixed). */
static inline float dot(const float *a, const float *b, int32_t n) {
    float acc[8] = {0};
    int32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Sum of v[0..n) with 8 partial sums (vectorises without -ffast-math). */
static inline float sum8(const float *v, int32_t n) {
    float acc[8] = {0};
    int32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += v[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += v[i];
    return s;
}

/* x = LayerNorm(x + r + bias) over rows of width n (r, bias may be NULL),
 * in place. Two passes (mean, then variance of the differences), as exact
 * as the reference's f32 Welford for rows of a few hundred values. */
static void add_layernorm_rows(float *x, const float *r, const float *bias, const float *g,
                               const float *b, int64_t rows, int32_t n, float eps, int32_t nt) {
#pragma omp parallel for schedule(static) num_threads(nt) if (rows > 16)
    for (int64_t t = 0; t < rows; t++) {
        float *row = x + t * n;
        if (r) {
            const float *rr = r + t * n;
            for (int32_t i = 0; i < n; i++) row[i] += rr[i];
        }
        if (bias)
            for (int32_t i = 0; i < n; i++) row[i] += bias[i];
        const float mean = sum8(row, n) / (float)n;
        float acc[8] = {0};
        int32_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int k = 0; k < 8; k++) {
                float d = row[i + k] - mean;
                acc[k] += d * d;
            }
        float var =
            ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < n; i++) var += (row[i] - mean) * (row[i] - mean);
        var /= (float)n;
        const float inv = 1.0f / sqrtf(var + eps);
        for (i = 0; i < n; i++) row[i] = (row[i] - mean) * inv * g[i] + b[i];
    }
}

/* erf(x) for float as a rational function of x on [-4, 4] (outside, erf
 * is +-1 in float): the approximation XLA and Eigen use for f32, at most
 * 3.3e-7 from the exact erf (a few float ulps; measured over [-12, 12]).
 * Unlike libm's erff it has no branches, so GELU loops vectorise; erff
 * was a quarter of the encoder's time. */
static inline float erf_f32(float x) {
    x = x < -4.0f ? -4.0f : x > 4.0f ? 4.0f : x;
    const float x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 - 2.10102402082508e-06f;
    p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f;
    p = p * x2 - 2.95459980854025e-03f;
    p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f;
    q = q * x2 - 1.68282697438203e-03f;
    q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    return x * p / q;
}

/* x = GELU(x) = x/2 (1 + erf(x / sqrt 2)) over n values: the same
 * arithmetic as erf_f32 in AVX2 lanes (the branch of the clamp keeps GCC
 * from vectorising the scalar loop under strict IEEE semantics). */
static void gelu_row(float *x, int32_t n) {
    int32_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 lo = _mm256_set1_ps(-4.0f), hi = _mm256_set1_ps(4.0f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 rs2 = _mm256_set1_ps(0.70710678118654752f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, rs2), lo), hi);
        const __m256 y2 = _mm256_mul_ps(y, y);
        __m256 p = _mm256_set1_ps(-2.72614225801306e-10f);
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(2.77068142495902e-08f));
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-2.10102402082508e-06f));
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-5.69250639462346e-05f));
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-7.34990630326855e-04f));
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-2.95459980854025e-03f));
        p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1.60960333262415e-02f));
        __m256 q = _mm256_set1_ps(-1.45660718464996e-05f);
        q = _mm256_fmadd_ps(q, y2, _mm256_set1_ps(-2.13374055278905e-04f));
        q = _mm256_fmadd_ps(q, y2, _mm256_set1_ps(-1.68282697438203e-03f));
        q = _mm256_fmadd_ps(q, y2, _mm256_set1_ps(-7.37332916720468e-03f));
        q = _mm256_fmadd_ps(q, y2, _mm256_set1_ps(-1.42647390514189e-02f));
        const __m256 erf = _mm256_div_ps(_mm256_mul_ps(y, p), q);
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, erf)));
    }
#endif
    for (; i < n; i++) x[i] = 0.5f * x[i] * (1.0f + erf_f32(x[i] * 0.70710678118654752f));
}

/* Fills rows [0, T) of c (width n) with bias, so that a following sgemm
 * with beta = 1 adds the product: bias and product in one pass over c. */
static void fill_bias(float *c, const float *bias, int64_t T, int32_t n, int32_t nt) {
#pragma omp parallel for schedule(static) num_threads(nt) if (T > 16)
    for (int64_t t = 0; t < T; t++) memcpy(c + t * n, bias, (size_t)n * sizeof(float));
}

/* c[T, n] = a[T, k] * w[n, k]^T + beta * c (PyTorch's Linear, bias apart). */
static void linear(const float *a, const float *w, float *c, int64_t T, int32_t n, int32_t k,
                   float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)T, n, k, 1.0f, a, k, w, k, beta,
                c, n);
}

/* ---- forward pass ------------------------------------------------------ */

static is_status ensure_workspace(embedder *e, size_t T) {
    int32_t nt = n_threads_eff(e);
    if (T > e->ws_tokens) {
        const size_t H = (size_t)e->w.hidden, FI = (size_t)e->w.inter;
        float *b[5] = {
            realloc(e->x, T * H * sizeof(float)),
        };
        if (b[0]) e->x = b[0];
        b[1] = realloc(e->qkv, T * 3 * H * sizeof(float));
        if (b[1]) e->qkv = b[1];
        b[2] = realloc(e->ctx, T * H * sizeof(float));
        if (b[2]) e->ctx = b[2];
        b[3] = realloc(e->tmp, T * H * sizeof(float));
        if (b[3]) e->tmp = b[3];
        b[4] = realloc(e->ff, T * FI * sizeof(float));
        if (b[4]) e->ff = b[4];
        if (!b[0] || !b[1] || !b[2] || !b[3] || !b[4]) {
            e->ws_tokens = 0; /* sizes now unknown: regrow everything next time */
            return is_error_set(IS_ERR_NOMEM, "embedder: out of memory for %zu tokens", T);
        }
        e->ws_tokens = T;
    }
    if (nt > e->scores_threads) {
        float *s = realloc(e->scores, (size_t)nt * (size_t)e->w.max_tokens * sizeof(float));
        if (!s) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
        e->scores = s;
        e->scores_threads = nt;
    }
    return IS_OK;
}

/* Multi-head attention of one text (rows [off, off + len) of qkv) and head h,
 * into ctx. Each query row: scores against the text's keys, softmax,
 * weighted sum of values. */
static void attention_head(const embedder *e, int64_t off, int32_t len, int32_t h, float *s) {
    const int32_t H = e->w.hidden, dh = e->w.head_dim, ld = 3 * H;
    const float scale = 1.0f / sqrtf((float)dh);
    const float *q0 = e->qkv + off * ld + h * dh;
    const float *k0 = q0 + H;
    const float *v0 = q0 + 2 * H;
    for (int32_t i = 0; i < len; i++) {
        const float *q = q0 + (int64_t)i * ld;
        float mx = -INFINITY;
        for (int32_t j = 0; j < len; j++) {
            s[j] = dot(q, k0 + (int64_t)j * ld, dh) * scale;
            if (s[j] > mx) mx = s[j];
        }
        float inv = 1.0f / vmath_exp_sub_sum(s, len, mx);
        float *o = e->ctx + (off + i) * H + h * dh;
        for (int32_t d = 0; d < dh; d++) o[d] = 0.0f;
        for (int32_t j = 0; j < len; j++) {
            const float *v = v0 + (int64_t)j * ld;
            const float p = s[j] * inv;
            for (int32_t d = 0; d < dh; d++) o[d] += p * v[d];
        }
    }
}

/* Runs the encoder on n texts of token ids (ids[i][0..lens[i])), packed,
 * and writes the pooled, normalised embeddings to out[n][H]. */
static is_status forward(embedder *e, const int32_t *const *ids, const int32_t *lens, int32_t n,
                         float *out) {
    const int32_t H = e->w.hidden, FI = e->w.inter, nt = n_threads_eff(e);
    int64_t T = 0;
    for (int32_t i = 0; i < n; i++) T += lens[i];
    is_status st = ensure_workspace(e, (size_t)T);
    if (st != IS_OK) return st;
    int64_t *off = malloc(((size_t)n + 1) * sizeof *off);
    if (!off) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
    off[0] = 0;
    for (int32_t i = 0; i < n; i++) off[i + 1] = off[i] + lens[i];

        /* Embeddings: word + position + token type 0, then LayerNorm. */
#pragma omp parallel for schedule(static) num_threads(nt) if (n > 1)
    for (int32_t i = 0; i < n; i++) {
        for (int32_t p = 0; p < lens[i]; p++) {
            float *row = e->x + (off[i] + p) * H;
            const float *w = e->w.tok_emb + (int64_t)ids[i][p] * H;
            const float *pe = e->w.pos_emb + (int64_t)p * H;
            for (int32_t d = 0; d < H; d++) row[d] = w[d] + pe[d] + e->w.type_emb[d];
        }
    }
    add_layernorm_rows(e->x, NULL, NULL, e->w.emb_ln_g, e->w.emb_ln_b, T, H, e->w.ln_eps, nt);

    const int32_t n_tasks = n * e->w.n_heads;
    for (int32_t l = 0; l < e->w.n_layers; l++) {
        const bert_layer *L = &e->layers[l];
        fill_bias(e->qkv, L->bqkv, T, 3 * H, nt);
        linear(e->x, L->wqkv, e->qkv, T, 3 * H, H, 1.0f);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (T > 16)
        for (int32_t task = 0; task < n_tasks; task++) {
            int32_t i = task / e->w.n_heads, h = task % e->w.n_heads;
            attention_head(e, off[i], lens[i], h,
                           e->scores + (size_t)omp_get_thread_num() * e->w.max_tokens);
        }
        linear(e->ctx, L->wo, e->tmp, T, H, H, 0.0f);
        add_layernorm_rows(e->x, e->tmp, L->bo, L->ln1_g, L->ln1_b, T, H, e->w.ln_eps, nt);
        fill_bias(e->ff, L->b1, T, FI, nt);
        linear(e->x, L->w1, e->ff, T, FI, H, 1.0f);
#pragma omp parallel for schedule(static) num_threads(nt) if (T > 16)
        for (int64_t t = 0; t < T; t++) { gelu_row(e->ff + t * FI, FI); }
        linear(e->ff, L->w2, e->tmp, T, H, FI, 0.0f);
        add_layernorm_rows(e->x, e->tmp, L->b2, L->ln2_g, L->ln2_b, T, H, e->w.ln_eps, nt);
    }

    /* Pooling and L2 normalisation (sentence-transformers' Normalize:
     * x / max(||x||, 1e-12)). */
    for (int32_t i = 0; i < n; i++) {
        float *o = out + (int64_t)i * H;
        const float *x0 = e->x + off[i] * H;
        if (e->pooling == EMBEDDER_POOLING_CLS) {
            memcpy(o, x0, (size_t)H * sizeof(float));
        } else {
            for (int32_t d = 0; d < H; d++) {
                double s = 0;
                for (int32_t p = 0; p < lens[i]; p++) s += x0[(int64_t)p * H + d];
                o[d] = (float)(s / lens[i]);
            }
        }
        double ss = 0;
        for (int32_t d = 0; d < H; d++) ss += (double)o[d] * o[d];
        double norm = sqrt(ss);
        float inv = (float)(1.0 / (norm > 1e-12 ? norm : 1e-12));
        for (int32_t d = 0; d < H; d++) o[d] *= inv;
    }
    free(off);
    return IS_OK;
}

/* Cuts n texts into chunks of at most CHUNK_TOKENS tokens (a text longer
 * than that is a chunk of its own) and runs each. */
static is_status forward_chunked(embedder *e, const int32_t *const *ids, const int32_t *lens,
                                 int32_t n, float *out) {
    int32_t i = 0;
    while (i < n) {
        int32_t j = i;
        int64_t T = 0;
        while (j < n && (j == i || T + lens[j] <= CHUNK_TOKENS)) T += lens[j++];
        is_status st = forward(e, ids + i, lens + i, j - i, out + (int64_t)i * e->w.hidden);
        if (st != IS_OK) return st;
        i = j;
    }
    return IS_OK;
}

/* ---- public calls ------------------------------------------------------ */

is_status embedder_embed_ids(embedder *e, const int32_t *const *ids, const int32_t *lens, int32_t n,
                             float *out) {
    if (e && e->ops) return e->ops->encoder_embed_ids(e->enc, ids, lens, n, out);
    if (!e || n < 0 || (n > 0 && (!ids || !lens || !out)))
        return is_error_set(IS_ERR_INVALID_ARG, "embedder_embed_ids: bad argument");
    for (int32_t i = 0; i < n; i++) {
        if (!ids[i] || lens[i] < 1 || lens[i] > e->w.max_tokens)
            return is_error_set(IS_ERR_INVALID_ARG,
                                "embedder_embed_ids: text %d has %d tokens (1..%d)", i, lens[i],
                                e->w.max_tokens);
        for (int32_t p = 0; p < lens[i]; p++)
            if (ids[i][p] < 0 || ids[i][p] >= e->w.n_vocab)
                return is_error_set(IS_ERR_INVALID_ARG,
                                    "embedder_embed_ids: token id %d out of range", ids[i][p]);
    }
    threads_attach(); /* BLAS's count is the process's, set once (core/threads.h) */
    return forward_chunked(e, ids, lens, n, out);
}

/* Texts are tokenised this many at a time, then run in token chunks. */
#define TOKENIZE_TEXTS 256

is_status embedder_embed(embedder *e, const char *const *texts, int32_t n, float *out) {
    if (e && e->ops) return e->ops->encoder_embed(e->enc, texts, n, out);
    if (!e || n < 0 || (n > 0 && (!texts || !out)))
        return is_error_set(IS_ERR_INVALID_ARG, "embedder_embed: bad argument");
    for (int32_t i = 0; i < n; i++)
        if (!texts[i])
            return is_error_set(IS_ERR_INVALID_ARG, "embedder_embed: text %d is NULL", i);
    threads_attach(); /* BLAS's count is the process's, set once (core/threads.h) */
    const int32_t M = e->w.max_tokens, nt = n_threads_eff(e);
    int32_t lens[TOKENIZE_TEXTS];
    const int32_t *ptrs[TOKENIZE_TEXTS];
    is_status status[TOKENIZE_TEXTS];
    for (int32_t i0 = 0; i0 < n; i0 += TOKENIZE_TEXTS) {
        int32_t m = n - i0 < TOKENIZE_TEXTS ? n - i0 : TOKENIZE_TEXTS;
        if (m > e->tok_texts) {
            int32_t *t = realloc(e->tok, (size_t)m * (size_t)M * sizeof *t);
            if (!t) return is_error_set(IS_ERR_NOMEM, "embedder: out of memory");
            e->tok = t;
            e->tok_texts = m;
        }
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt) if (m > 1)
        for (int32_t k = 0; k < m; k++) {
            const char *s = texts[i0 + k];
            status[k] = wordpiece_encode(e->wp, s, strlen(s), M, e->tok + (size_t)k * M, &lens[k]);
            ptrs[k] = e->tok + (size_t)k * M;
        }
        for (int32_t k = 0; k < m; k++)
            if (status[k] != IS_OK)
                return is_error_set(status[k], "embedder: tokenising text %d failed", i0 + k);
        is_status st = forward_chunked(e, ptrs, lens, m, out + (int64_t)i0 * e->w.hidden);
        if (st != IS_OK) return st;
    }
    return IS_OK;
}

/*
 * model: a Llama-family model loaded from GGUF: its architecture
 * configuration, its tokenizer, and its weights placed on a backend.
 *
 * Supported architectures share one block (RMSNorm, RoPE, grouped-query
 * attention, SwiGLU): llama (Llama 2/3, Mistral, SmolLM2), mistral and qwen2
 * (which adds q/k/v biases and uses the NeoX RoPE layout).
 */
#ifndef IS_MODEL_MODEL_H
#define IS_MODEL_MODEL_H

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/tokenizer.h"

typedef struct model_config {
    char arch[32];       /* general.architecture */
    int32_t n_layers;    /* blocks */
    int32_t dim;         /* embedding width */
    int32_t ffn_dim;     /* SwiGLU hidden width */
    int32_t n_heads;     /* query heads */
    int32_t n_kv_heads;  /* key/value heads (GQA) */
    int32_t head_dim;    /* per head */
    int32_t n_vocab;     /* rows of the embedding */
    int32_t n_ctx_train; /* context length the model was trained for */
    float rms_eps;
    rope_params rope; /* freq_factors point into the model's memory */
    bool has_qkv_bias;
    bool tied_output; /* output head shares token_embd */
} model_config;

typedef struct model_layer {
    backend_weight *attn_norm;    /* [dim] */
    backend_weight *wq;           /* [n_heads*head_dim][dim] */
    backend_weight *wk;           /* [n_kv_heads*head_dim][dim] */
    backend_weight *wv;           /* [n_kv_heads*head_dim][dim] */
    backend_weight *bq, *bk, *bv; /* biases or NULL */
    backend_weight *wo;           /* [dim][n_heads*head_dim] */
    backend_weight *ffn_norm;     /* [dim] */
    backend_weight *w_gate;       /* [ffn_dim][dim] */
    backend_weight *w_up;         /* [ffn_dim][dim] */
    backend_weight *w_down;       /* [dim][ffn_dim] */
} model_layer;

typedef struct model {
    model_config cfg;
    gguf_ctx *gguf; /* kept open: tokenizer strings point into it */
    tokenizer *tok;
    backend *be;                 /* not owned */
    backend_weight *token_embd;  /* [n_vocab][dim] */
    backend_weight *output_norm; /* [dim] */
    backend_weight *output;      /* [n_vocab][dim]; == token_embd when tied */
    model_layer *layers;         /* [n_layers] */
    float *rope_freq_factors;    /* [n_rot/2] or NULL */
    char fingerprint[17];        /* hex of a hash over metadata and weights */
} model;

/* Reads the configuration only (no weights, no backend). IS_ERR_UNSUPPORTED
 * for an architecture outside the Llama family; IS_ERR_FORMAT for missing or
 * inconsistent hyper-parameters. */
is_status model_config_read(const gguf_ctx *g, model_config *out);

/* Opens `path`, reads config and tokenizer, and creates every weight on `be`.
 * On failure nothing is left allocated and *out is unchanged. */
is_status model_load(const char *path, backend *be, model **out);
void model_free(model *m);

#endif

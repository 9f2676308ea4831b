/*
 * retrieval: the interface a backend implements to run the memory layer's
 * retrieval on its device: a BERT sentence encoder (a copy of a loaded
 * embedder's weights) and an exact top-k over one user's fact embeddings.
 *
 * Why an interface here: the memory layer owns the embedder and the
 * search (memory/embedder.h, memory/dense_gpu.h), and a backend must not
 * know the memory layer. So the weights travel as the plain view below,
 * the tokenizer as a callback, and the memory layer reaches the device
 * code only through the table of calls a backend hands out by name
 * (retrieval_backend_get), as the inference backends are created by name
 * (backend.h). The CUDA backend implements it (cuda/embed.cu, cuda/topk.cu;
 * cuda/retrieval_cuda.h states the contract of each call in full). The CPU
 * has no table: the memory layer's own embedder and index are the CPU
 * implementation and the reference the device one is tested against.
 */
#ifndef IS_BACKEND_RETRIEVAL_H
#define IS_BACKEND_RETRIEVAL_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The largest k a device search takes. */
#define RETRIEVAL_TOPK_MAX 1024

/* One post-LN BERT layer. Row-major, PyTorch's Linear layout (out, in). */
typedef struct encoder_layer_weights {
    const float *wqkv;  /* (3H, H) query, key, value rows stacked */
    const float *bqkv;  /* (3H) */
    const float *wo;    /* (H, H) attention output projection */
    const float *bo;    /* (H) */
    const float *ln1_g; /* (H) LayerNorm after attention */
    const float *ln1_b; /* (H) */
    const float *w1;    /* (I, H) FFN up */
    const float *b1;    /* (I) */
    const float *w2;    /* (H, I) FFN down */
    const float *b2;    /* (H) */
    const float *ln2_g; /* (H) LayerNorm after the FFN */
    const float *ln2_b; /* (H) */
} encoder_layer_weights;

/* Tokenises text[0..len) into at most max_len ids ([CLS] and [SEP]
 * included, truncating as the CPU encoder does) into ids[], their count
 * into *n_out. `tokenizer` is encoder_weights.tokenizer. */
typedef is_status (*encoder_tokenize_fn)(const void *tokenizer, const char *text, size_t len,
                                         int32_t max_len, int32_t *ids, int32_t *n_out);

/* A BERT sentence encoder's configuration and f32 weights, host memory,
 * borrowed from the memory layer's embedder (valid while it lives, never
 * written). */
typedef struct encoder_weights {
    int32_t hidden; /* H */
    int32_t n_layers;
    int32_t n_heads;
    int32_t head_dim; /* H / n_heads */
    int32_t inter;    /* FFN width I */
    int32_t n_vocab;
    int32_t max_pos;                     /* rows of pos_emb */
    int32_t max_tokens;                  /* max_seq_length, <= max_pos */
    float ln_eps;                        /* every LayerNorm's epsilon (config layer_norm_eps) */
    bool pool_cls;                       /* the [CLS] token's state; else the mean of all tokens */
    const float *tok_emb;                /* (n_vocab, H) */
    const float *pos_emb;                /* (max_pos, H) */
    const float *type_emb;               /* (H): token type 0, the only one used */
    const float *emb_ln_g;               /* (H) */
    const float *emb_ln_b;               /* (H) */
    const encoder_layer_weights *layers; /* (n_layers) */
    encoder_tokenize_fn tokenize;        /* the encoder's own tokenizer */
    const void *tokenizer;               /* its state; must outlive the device copy */
} encoder_weights;

typedef struct retrieval_encoder retrieval_encoder; /* a device copy of an encoder */
typedef struct retrieval_matrix retrieval_matrix;   /* one user's fact embeddings on the device */

/* A backend's retrieval calls. Each object is used by one thread at a
 * time. Errors: IS_ERR_INVALID_ARG (bad arguments, nothing done),
 * IS_ERR_UNSUPPORTED (no usable device, or a model the kernels do not
 * handle), IS_ERR_NOMEM, IS_ERR_INTERNAL (another device failure); the
 * message is set. Pointers named _dev are device memory of the object's
 * device. */
typedef struct retrieval_ops {
    const char *name;

    /* Copies the encoder to `device`. *out unchanged on failure. */
    is_status (*encoder_create)(const encoder_weights *w, int32_t device, retrieval_encoder **out);
    void (*encoder_free)(retrieval_encoder *enc); /* NULL is a no-op */
    /* n texts of token ids (text i is ids[i][0..lens[i])) into out[n][H], host. */
    is_status (*encoder_embed_ids)(retrieval_encoder *enc, const int32_t *const *ids,
                                   const int32_t *lens, int32_t n, float *out);
    /* n NUL-terminated texts, tokenised on the host, into out[n][H], host. */
    is_status (*encoder_embed)(retrieval_encoder *enc, const char *const *texts, int32_t n,
                               float *out);
    /* The same into out_dev[n][H]; returns once queued, and a search the
     * same thread calls next sees the result. */
    is_status (*encoder_embed_device)(retrieval_encoder *enc, const char *const *texts, int32_t n,
                                      float *out_dev);

    /* An empty matrix of rows of `dim` floats. */
    is_status (*matrix_create)(int32_t device, int32_t dim, retrieval_matrix **out);
    void (*matrix_free)(retrieval_matrix *m); /* NULL is a no-op */
    int32_t (*matrix_count)(const retrieval_matrix *m);
    /* Writes data[i][0..dim) (host) into row rows[i]; rows at or past the
     * count append, without gaps. */
    is_status (*matrix_set_rows)(retrieval_matrix *m, const int32_t *rows, int32_t n,
                                 const float *data);
    /* Removes `row`, moving the last row into it (*moved_from: its old
     * index, or -1 when nothing moved). */
    is_status (*matrix_remove_row)(retrieval_matrix *m, int32_t row, int32_t *moved_from);
    /* The k (<= RETRIEVAL_TOPK_MAX) best rows for query_dev[dim] by dot
     * product, best first, equal scores by row ascending. */
    is_status (*matrix_search)(retrieval_matrix *m, const float *query_dev, int32_t k,
                               int32_t *idx_out, float *score_out, int32_t *n_out);
    /* The scores a search gives rows[0..n) (n <= RETRIEVAL_TOPK_MAX). */
    is_status (*matrix_score_rows)(retrieval_matrix *m, const float *query_dev, const int32_t *rows,
                                   int32_t n, float *score_out);

    /* A device vector of n floats (a query's embedding), and its release. */
    is_status (*vector_alloc)(int32_t device, int32_t n, float **out_dev);
    void (*vector_free)(int32_t device, float *dev);
} retrieval_ops;

/* The retrieval calls of backend `name` ("cuda"). IS_ERR_UNSUPPORTED for
 * "cpu" (the memory layer computes on the CPU itself), for a backend this
 * build lacks, or an unknown name; *out unchanged then. */
is_status retrieval_backend_get(const char *name, const retrieval_ops **out);

#ifdef __cplusplus
}
#endif

#endif

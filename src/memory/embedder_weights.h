/*
 * embedder_weights: read-only views of a loaded embedder's configuration and
 * f32 weights, for code that runs the same encoder elsewhere (the GPU copy,
 * cuda/embed.cu, uploads them). Internal to the library; a layer's view is
 * also the embedder's own representation of the layer (embedder.c).
 *
 * The pointers are the embedder's own arrays (memory-mapped F32 tensors or
 * its converted copies): valid while the embedder lives, never to be
 * written. Shapes are row-major, PyTorch's Linear layout (out, in).
 */
#ifndef IS_MEMORY_EMBEDDER_WEIGHTS_H
#define IS_MEMORY_EMBEDDER_WEIGHTS_H

#include "memory/embedder.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct embedder_layer_weights {
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
} embedder_layer_weights;

typedef struct embedder_weights {
    int32_t hidden;     /* H */
    int32_t n_layers;
    int32_t n_heads;
    int32_t head_dim;   /* H / n_heads */
    int32_t inter;      /* FFN width I */
    int32_t n_vocab;
    int32_t max_pos;    /* rows of pos_emb */
    int32_t max_tokens; /* max_seq_length, <= max_pos */
    float ln_eps;       /* every LayerNorm's epsilon (config layer_norm_eps) */
    bool pool_cls;      /* the [CLS] token's state; else the mean of all tokens */
    const float *tok_emb;  /* (n_vocab, H) */
    const float *pos_emb;  /* (max_pos, H) */
    const float *type_emb; /* (H): token type 0, the only one used */
    const float *emb_ln_g; /* (H) */
    const float *emb_ln_b; /* (H) */
} embedder_weights;

/* Fills *out with e's configuration and embedding weights. */
void embedder_get_weights(const embedder *e, embedder_weights *out);

/* Fills *out with layer `layer` (0 <= layer < n_layers) of e. */
void embedder_get_layer_weights(const embedder *e, int32_t layer, embedder_layer_weights *out);

#endif

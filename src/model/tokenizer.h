/*
 * tokenizer: text <-> token ids for Llama-family GGUF models.
 *
 * Two vocabularies exist among the models we serve, both described by the
 * tokenizer.ggml.* metadata of the GGUF file:
 *
 *   - byte-level BPE (tokenizer.ggml.model "gpt2": Llama 3, Qwen 2.5,
 *     SmolLM2): text is cut into words by a per-family pre-tokenizer regex
 *     (tokenizer.ggml.pre), each word's bytes are mapped to GPT-2's printable
 *     byte alphabet and merged pairwise by merge rank;
 *   - SentencePiece BPE (tokenizer.ggml.model "llama": Llama 2, Mistral
 *     v0.x): spaces become U+2581 "▁", a leading "▁" is added, UTF-8
 *     characters are merged by score, and characters outside the vocabulary
 *     fall back to <0xNN> byte tokens.
 *
 * The reference we match token for token is Hugging Face `tokenizers` with
 * the model's real tokenizer.json configuration (BPE) and `sentencepiece`
 * (SPM); tools/make_tokenizer_golden.py produces the golden ids.
 *
 * Input need not be valid UTF-8: every ill-formed sequence is replaced by
 * U+FFFD using the Unicode "maximal subpart" rule (what Python's
 * bytes.decode("utf-8", "replace") does), so the ids are the reference's ids
 * for that decoded string. Such input does not round-trip; valid UTF-8 does.
 *
 * Special tokens (token type CONTROL or UNKNOWN) written in the text are
 * recognised only when the caller asks (parse_special), so user text cannot
 * forge "<|im_end|>"; USER_DEFINED tokens are always recognised, as in
 * llama.cpp and HF. Matching is leftmost-longest, like HF's added vocabulary.
 *
 * A tokenizer is immutable after creation; any number of threads may encode
 * and decode with it at once.
 */
#ifndef IS_MODEL_TOKENIZER_H
#define IS_MODEL_TOKENIZER_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct gguf_ctx gguf_ctx;
typedef struct tokenizer tokenizer;

typedef enum tokenizer_type {
    TOKENIZER_TYPE_BPE = 0, /* "gpt2": byte-level BPE with merges */
    TOKENIZER_TYPE_SPM = 1, /* "llama": SentencePiece BPE with scores */
} tokenizer_type;

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
typedef enum tokenizer_token_type {
    TOKENIZER_TOKEN_UNDEFINED = 0,
    TOKENIZER_TOKEN_NORMAL = 1,
    TOKENIZER_TOKEN_UNKNOWN = 2,
    TOKENIZER_TOKEN_CONTROL = 3,
    TOKENIZER_TOKEN_USER_DEFINED = 4,
    TOKENIZER_TOKEN_UNUSED = 5,
    TOKENIZER_TOKEN_BYTE = 6,
} tokenizer_token_type;

/* `len` bytes at `data`, not necessarily NUL-terminated. */
typedef struct tokenizer_str {
    const char *data;
    size_t len;
} tokenizer_str;

/* Everything a tokenizer is built from; tokenizer_load fills one from GGUF
 * metadata, tests and tools may fill one directly. Only borrowed during
 * tokenizer_create (everything is copied). Start from tokenizer_spec_init. */
typedef struct tokenizer_spec {
    tokenizer_type type;
    /* BPE pre-tokenizer family, as in tokenizer.ggml.pre: "gpt2" (also NULL
     * or "default"), "llama-bpe" (Llama 3), "qwen2", "smollm" (and the
     * llama.cpp names that share these regexes). Ignored for SPM. */
    const char *pre;
    int32_t n_vocab;
    const tokenizer_str *tokens; /* [n_vocab] raw vocab strings */
    const int32_t *token_types;  /* [n_vocab] tokenizer_token_type, or NULL: all NORMAL */
    const float *scores;         /* [n_vocab] SPM merge scores, or NULL: all 0 */
    int64_t n_merges;            /* BPE */
    const tokenizer_str *merges; /* [n_merges] "left right", rank = index */
    int32_t bos_id, eos_id, eot_id, eom_id, unk_id, pad_id; /* -1: none */
    int8_t add_bos;          /* 1 / 0, or -1: per model type like llama.cpp */
    int8_t add_space_prefix; /* SPM: 1 / 0, or -1: default (1) */
} tokenizer_spec;

/* Sets every id to -1, add_bos/add_space_prefix to -1, the rest to zero. */
void tokenizer_spec_init(tokenizer_spec *spec);

/* Builds a tokenizer from `spec`. On success *out is new (free with
 * tokenizer_free). Errors: IS_ERR_INVALID_ARG (NULL, n_vocab < 1, ids out of
 * range, missing arrays), IS_ERR_UNSUPPORTED (unknown pre-tokenizer),
 * IS_ERR_NOMEM, IS_ERR_INTERNAL (PCRE2 refused a pattern). *out unchanged on
 * failure. */
is_status tokenizer_create(const tokenizer_spec *spec, tokenizer **out);

/* Builds the tokenizer described by the tokenizer.ggml.* keys of `g`.
 * Errors: IS_ERR_NOT_FOUND (no tokenizer.ggml.model / tokens / merges),
 * IS_ERR_FORMAT (keys of the wrong type, arrays of the wrong length, ids out
 * of range), IS_ERR_UNSUPPORTED (a model other than "gpt2"/"llama", an
 * unknown pre-tokenizer), IS_ERR_NOMEM. *out unchanged on failure. */
is_status tokenizer_load(const gguf_ctx *g, tokenizer **out);

/* NULL is a no-op. */
void tokenizer_free(tokenizer *t);

tokenizer_type tokenizer_get_type(const tokenizer *t);
int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t); /* -1 if none */
int32_t tokenizer_eos(const tokenizer *t); /* -1 if none */

/* True if generating `id` ends the turn: eos, eot, eom, and control tokens
 * named like an end of turn (<|im_end|>, <|eot_id|>, <|endoftext|>,
 * <|end_of_text|>, <|eom_id|>, <|end|>, <end_of_turn>, ...). False for ids
 * out of range. */
bool tokenizer_is_eog(const tokenizer *t, int32_t id);

/* tokenizer.ggml.add_bos_token, else the llama.cpp default: true for SPM and
 * Llama 3 ("llama-bpe"), false for other BPE families. */
bool tokenizer_add_bos(const tokenizer *t);

/* Encodes `len` bytes at `text` (any bytes; see the UTF-8 rule above).
 * add_bos: prepend BOS if tokenizer_add_bos() and the model has one.
 * parse_special: recognise control tokens written in the text.
 * On success *out is a malloc'd array of *n_out ids (caller frees; it may be
 * NULL when *n_out is 0). Errors: IS_ERR_INVALID_ARG (NULL pointers, text
 * NULL with len > 0, len > 1 GiB), IS_ERR_NOMEM, IS_ERR_INTERNAL (a PCRE2
 * match error). Outputs unchanged on failure. */
is_status tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                           bool parse_special, int32_t **out, size_t *n_out);

/* The bytes token `id` contributes to the output: byte-level BPE unmaps the
 * GPT-2 alphabet, SPM turns "▁" into ' ' and <0xNN> into that byte. Control
 * and unknown tokens give their text if render_special, else nothing.
 * Writes min(result, cap) bytes to buf (no NUL) and returns the full length,
 * so a caller can retry with a bigger buffer. Ids out of range give 0. */
size_t tokenizer_token_to_piece(const tokenizer *t, int32_t id, bool render_special, char *buf,
                                size_t cap);

/* Concatenates the pieces of `ids`; for SPM with a space prefix, drops the
 * leading space of the first text token if only special tokens precede it
 * (sentencepiece's DecodeIds). *out is malloc'd and NUL-terminated (the
 * bytes may contain NULs; *n_out is the length). Errors: IS_ERR_INVALID_ARG,
 * IS_ERR_NOMEM; outputs unchanged on failure. */
is_status tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool render_special,
                           char **out, size_t *n_out);

/* The raw vocab string of `id` (NUL-terminated; "" if out of range), for
 * debugging. */
const char *tokenizer_token_text(const tokenizer *t, int32_t id);

/* tokenizer_token_type of `id`; TOKENIZER_TOKEN_UNDEFINED if out of range. */
tokenizer_token_type tokenizer_token_get_type(const tokenizer *t, int32_t id);

/* Id of the vocab entry whose raw text is exactly `text` (NUL-terminated),
 * or -1. For chat-template control tokens like "<|im_start|>". */
int32_t tokenizer_find(const tokenizer *t, const char *text);

#endif

/*
 * inferscale.h: the public C API of InferScale.
 *
 * InferScale is an LLM inference engine for Llama-family GGUF models whose
 * distinguishing feature is memory injected at the attention layer (see
 * DESIGN.md). This header is the whole public surface: handles are opaque,
 * parameters are passed by value with *_default_params(), every fallible call
 * returns an is_status and leaves its outputs untouched on failure, and
 * is_error_last() gives a one-line reason for the latest failure on the
 * calling thread.
 */
#ifndef INFERSCALE_H
#define INFERSCALE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ------------------------------------------------------------ */

typedef enum is_status {
    IS_OK = 0,
    IS_ERR_INVALID_ARG = -1,  /* the caller passed something meaningless */
    IS_ERR_IO = -2,           /* open/read/write/mmap failed */
    IS_ERR_FORMAT = -3,       /* a file or record is corrupt or truncated */
    IS_ERR_UNSUPPORTED = -4,  /* valid, but not something we implement */
    IS_ERR_NOMEM = -5,        /* an allocation failed */
    IS_ERR_CONTEXT_FULL = -6, /* no room left in the context / KV cache */
    IS_ERR_NOT_FOUND = -7,    /* a key, tensor, id or file is missing */
    IS_ERR_MISMATCH = -8,     /* data made for another model or setting */
    IS_ERR_INTERNAL = -9,     /* a dependency failed in a way we did not expect */
    IS_ERR_BUSY = -10,        /* a queue or limit is full: try again later */
    IS_ERR_CANCELLED = -11,   /* stopped on request (client gone, shutdown) */
} is_status;

/* A constant English name for `st`. */
const char *is_status_to_string(is_status st);

/* The message recorded by the latest failing call on this thread. Never NULL. */
const char *is_error_last(void);

/* ---- models ------------------------------------------------------------ */

typedef struct is_model is_model;

typedef struct is_model_params {
    const char *backend; /* "cpu" (default) or "cuda" where built */
    int32_t n_threads;   /* CPU threads; 0 = all cores */
} is_model_params;

is_model_params is_model_default_params(void);

/* Loads a GGUF model. IS_ERR_IO (missing file), IS_ERR_FORMAT (corrupt or
 * truncated file), IS_ERR_UNSUPPORTED (architecture or tensor type, or a
 * backend this build or machine lacks). *out is unchanged on failure.
 * backend "cuda" exists in builds with the CUDA backend (CMake option
 * IS_CUDA, on where nvcc is found; IS_HAVE_CUDA is then defined) and runs on
 * GPU 0, which must be sm_90 (H100/H200) for the default build. */
is_status is_model_load(const char *path, is_model_params params, is_model **out);
void is_model_free(is_model *m);

const char *is_model_arch(const is_model *m);
/* 16 hex digits naming the model's metadata and weights. */
const char *is_model_fingerprint(const is_model *m);
int32_t is_model_n_vocab(const is_model *m);
int32_t is_model_n_ctx_train(const is_model *m);

/* ---- tokens ------------------------------------------------------------ */

/* Tokenises `len` bytes. Any bytes are accepted: each invalid UTF-8 sequence
 * is read as U+FFFD, as Python's decode(errors="replace") does.
 * add_bos: prepend BOS if the model wants one (not after is_chat_render,
 * whose text already holds it where the template wants it).
 * parse_special: text like "<|im_end|>" becomes its control token. The ids
 * are malloc'd into *out (free() them). */
is_status is_tokenize(const is_model *m, const char *text, size_t len, bool add_bos,
                      bool parse_special, int32_t **out, size_t *n_out);

/* Writes the bytes token `id` contributes to text (at most `cap`) and returns
 * their count, which may exceed cap. Control tokens give 0 bytes. */
size_t is_token_to_piece(const is_model *m, int32_t id, char *buf, size_t cap);

/* True for end-of-generation tokens (EOS, end-of-turn). */
bool is_token_is_eog(const is_model *m, int32_t id);

typedef struct is_chat_message {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
} is_chat_message;

/* Renders a conversation with the model's chat template (ChatML, Llama 3 or
 * Mistral, detected from the GGUF). add_assistant appends the header that
 * starts the assistant's reply. *out is malloc'd. */
is_status is_chat_render(const is_model *m, const is_chat_message *msgs, size_t n,
                         bool add_assistant, char **out);

/* ---- generation -------------------------------------------------------- */

/* A session holds one sequence's KV cache between calls; a new prompt that
 * starts with what the session already holds reuses that KV (so a chat turn
 * prefills only the new messages). */
typedef struct is_session is_session;

typedef struct is_session_params {
    int32_t n_ctx; /* context positions; 0 = the model's training context */
} is_session_params;

is_session_params is_session_default_params(void);
is_status is_session_create(is_model *m, is_session_params params, is_session **out);
void is_session_free(is_session *s);

typedef enum is_finish_reason {
    IS_FINISH_LENGTH = 0, /* max_tokens reached */
    IS_FINISH_EOG = 1,    /* the model ended its turn */
    IS_FINISH_STOP = 2,   /* a stop string appeared (it is not emitted) */
    IS_FINISH_ABORT = 3,  /* the callback asked to stop */
} is_finish_reason;

typedef struct is_gen_params {
    int32_t max_tokens;       /* tokens to generate at most */
    float temperature;        /* 0 = greedy */
    int32_t top_k;            /* 0 = off */
    float top_p;              /* 1 = off */
    uint64_t seed;            /* sampling seed */
    const char *const *stop;  /* stop strings, or NULL */
    size_t n_stop;
} is_gen_params;

is_gen_params is_gen_default_params(void);

typedef struct is_gen_stats {
    int32_t n_prompt;        /* prompt tokens given */
    int32_t n_prompt_reused; /* of those, found already in the session's KV */
    int32_t n_generated;
    double prefill_ms;       /* prompt processing, up to the first sampled token */
    double decode_ms;        /* the remaining tokens */
    is_finish_reason finish;
} is_gen_stats;

/* Receives text as it is produced (stop strings already held back). Return
 * false to stop generation. */
typedef bool (*is_text_cb)(const char *text, size_t len, void *user_data);

/* Prefills `prompt` (reusing the session's matching prefix) and generates.
 * IS_ERR_CONTEXT_FULL if the prompt does not fit the context (the session is
 * then empty). Generation that reaches the end of the context stops with
 * IS_FINISH_LENGTH. */
is_status is_session_generate(is_session *s, const int32_t *prompt, size_t n_prompt,
                              is_gen_params params, is_text_cb cb, void *user_data,
                              is_gen_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* INFERSCALE_H */

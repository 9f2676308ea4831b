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
    int32_t max_tokens;      /* tokens to generate at most */
    float temperature;       /* 0 = greedy */
    int32_t top_k;           /* 0 = off */
    float top_p;             /* 1 = off */
    uint64_t seed;           /* sampling seed */
    const char *const *stop; /* stop strings, or NULL */
    size_t n_stop;
} is_gen_params;

is_gen_params is_gen_default_params(void);

typedef struct is_gen_stats {
    int32_t n_prompt;        /* prompt tokens given */
    int32_t n_prompt_reused; /* of those, found already in the session's KV */
    int32_t n_generated;
    double prefill_ms; /* prompt processing, up to the first sampled token */
    double decode_ms;  /* the remaining tokens */
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

/* ---- memory ------------------------------------------------------------ */

/* A memory store: facts per user, each kept with its sentence embedding
 * (for retrieval) and, with a model, its KV encoded once (for injection at
 * the attention layer; DESIGN.md). One data directory is used by one
 * process at a time. Calls may come from several threads. */
typedef struct is_memory is_memory;

typedef struct is_memory_params {
    const char *tenant;       /* the namespace of every user below ("default") */
    const char *embedder_dir; /* sentence-embedding model (sentence-transformers folder);
                                 NULL: models/all-MiniLM-L6-v2; "none": BM25 retrieval only */
    const char *model_path;   /* GGUF model that encodes facts' KV and answers; NULL: facts
                                 are stored as text only and is_memory_ask is unavailable */
    const char *backend;      /* the model's backend: "cpu" (default) or "cuda" where built */
    int32_t n_threads;        /* CPU threads; 0 = all cores */
    int32_t window;           /* context turns encoded with each fact (default 0) */
} is_memory_params;

is_memory_params is_memory_default_params(void);

/* Opens (creating if needed) the store in data_dir. IS_ERR_NOT_FOUND (no
 * embedding model there), IS_ERR_IO, IS_ERR_FORMAT, IS_ERR_MISMATCH (the
 * store was made with another embedding model), IS_ERR_BUSY (another
 * process has it open), a model's errors as is_model_load's. *out is
 * unchanged on failure. */
is_status is_memory_open(const char *data_dir, is_memory_params params, is_memory **out);
/* Closes the store; everything added is on disk already. NULL is a no-op. */
void is_memory_close(is_memory *mem);

/* The size of a fact id, its NUL included. */
#define IS_MEMORY_ID_SIZE 72

/* Adds a fact of `user`: text (non-empty, valid UTF-8) and the conversation
 * turns before it (context[n_context], oldest first, or NULL), encoded
 * with it when the store has a model. The fact's id goes to id_out (may be
 * NULL). IS_ERR_INVALID_ARG for a bad argument (nothing stored). */
is_status is_memory_add(is_memory *mem, const char *user, const char *text,
                        const char *const *context, size_t n_context,
                        char id_out[IS_MEMORY_ID_SIZE]);

typedef struct is_memory_hit {
    char id[IS_MEMORY_ID_SIZE];
    char *text;  /* malloc'd; is_memory_hits_free frees it */
    float score; /* higher is better (fusion of dense and BM25, or BM25 alone) */
} is_memory_hit;

/* The k facts of `user` most relevant to `query`, best first, into a
 * malloc'd *hits[*n_hits] (n_hits <= k; free with is_memory_hits_free). A
 * user with no facts gives 0 hits. */
is_status is_memory_search(is_memory *mem, const char *user, const char *query, int32_t k,
                           is_memory_hit **hits, int32_t *n_hits);
void is_memory_hits_free(is_memory_hit *hits, int32_t n_hits);

typedef enum is_memory_mode {
    IS_MEMORY_KV = 0,     /* the facts' stored KV is injected (no prefill of their text) */
    IS_MEMORY_PROMPT = 1, /* the facts are pasted into the prompt as text */
    IS_MEMORY_OFF = 2,    /* no memory: the query alone */
} is_memory_mode;

/* Answers `query` for `user` with the user's k most relevant facts as
 * memory, in `mode`, streaming the reply to cb. IS_ERR_UNSUPPORTED when
 * the store was opened without a model; in kv mode IS_ERR_NOT_FOUND when a
 * retrieved fact has no KV yet; IS_ERR_UNSUPPORTED for stop strings (not
 * applied here). stats may be NULL; n_prompt counts the tokens prefilled
 * (the memory's, in kv mode, are not). Asks run one at a time. */
is_status is_memory_ask(is_memory *mem, const char *user, const char *query, int32_t k,
                        is_memory_mode mode, is_gen_params params, is_text_cb cb, void *user_data,
                        is_gen_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* INFERSCALE_H */

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
} is_status;

/* A constant English name for `st`. */
const char *is_status_to_string(is_status st);

/* The message recorded by the latest failing call on this thread. Never NULL. */
const char *is_error_last(void);

#ifdef __cplusplus
}
#endif

#endif /* INFERSCALE_H */

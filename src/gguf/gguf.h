/*
 * gguf: a read-only, zero-copy reader for GGUF model files.
 *
 * GGUF is the file format of llama.cpp/ggml: typed key/value metadata (the
 * architecture's hyper-parameters, the tokenizer's vocabulary) followed by
 * tensor descriptions and the tensor bytes themselves. We map the file
 * read-only and hand out pointers into the mapping, so opening a multi-GB
 * model costs only the parse of its header; the kernel pages weights in as
 * the forward pass touches them.
 *
 * Every length, count, offset and type in the file is checked against the
 * file size (with overflow-safe arithmetic) before it is used, so a corrupt,
 * truncated or hostile file yields IS_ERR_FORMAT with a message naming the
 * field and its byte offset, never a crash or a huge allocation.
 *
 * ---- Byte layout (all integers little-endian, no implicit padding) ---------
 *
 *   header
 *     u8[4]  magic          "GGUF"
 *     u32    version        3 (2 is accepted: same layout; 1 used u32 counts
 *                           and is rejected as IS_ERR_UNSUPPORTED; a
 *                           byte-swapped version means a big-endian file,
 *                           also IS_ERR_UNSUPPORTED)
 *     u64    tensor_count
 *     u64    kv_count
 *   kv_count times: metadata
 *     string key            gguf-string = u64 len, then len bytes (UTF-8, not
 *                           NUL-terminated); keys are unique, non-empty
 *     u32    value_type     gguf_value_type below
 *     value                 u8/i8/bool: 1 byte (bool is 0 or 1),
 *                           u16/i16: 2, u32/i32/f32: 4, u64/i64/f64: 8,
 *                           string: gguf-string,
 *                           array: u32 elem_type, u64 count, count elements
 *                           packed back to back (strings each with their own
 *                           u64 length). Arrays of arrays are legal GGUF but
 *                           no model uses them: rejected as IS_ERR_UNSUPPORTED.
 *   tensor_count times: tensor info
 *     string name           unique, non-empty
 *     u32    n_dims         0..4
 *     u64    ne[n_dims]     elements per dimension, ne[0] fastest-varying;
 *                           ne[0] is a multiple of the type's block size
 *     u32    type           ggml type id (gguf/tensor_type.h)
 *     u64    offset         from the start of the data section; a multiple
 *                           of the alignment
 *   padding                 zero bytes up to the next multiple of `alignment`
 *                           (key "general.alignment", u32, power of two;
 *                           default 32), measured from the start of the file
 *   data section            tensor bytes, each tensor at data_start + offset,
 *                           taking row_bytes(type, ne[0]) * ne[1]*ne[2]*ne[3]
 *
 * Limits we add (all far above real models): keys and tensor names at most
 * 65535 bytes and without NUL bytes (we hand them out as C strings).
 *
 * ---- Ownership and threads --------------------------------------------------
 *
 * Accessors take a context returned by a successful open (never NULL, except
 * where a function says so). A gguf_ctx is immutable after open: any number of threads may read it at
 * once. Every pointer it returns (names, strings, array data, tensor data)
 * lives until gguf_close(). gguf_open() owns its mapping; gguf_open_memory()
 * borrows the caller's buffer, which must outlive the context.
 */
#ifndef IS_GGUF_GGUF_H
#define IS_GGUF_GGUF_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS          4

typedef struct gguf_ctx gguf_ctx;

/* Metadata value types; the numbers are part of the file format. */
typedef enum gguf_value_type {
    GGUF_VALUE_UINT8 = 0,
    GGUF_VALUE_INT8 = 1,
    GGUF_VALUE_UINT16 = 2,
    GGUF_VALUE_INT16 = 3,
    GGUF_VALUE_UINT32 = 4,
    GGUF_VALUE_INT32 = 5,
    GGUF_VALUE_FLOAT32 = 6,
    GGUF_VALUE_BOOL = 7,
    GGUF_VALUE_STRING = 8,
    GGUF_VALUE_ARRAY = 9,
    GGUF_VALUE_UINT64 = 10,
    GGUF_VALUE_INT64 = 11,
    GGUF_VALUE_FLOAT64 = 12,
    GGUF_VALUE_COUNT_ = 13, /* not a type */
} gguf_value_type;

/* A string inside the file: `len` bytes at `data`, NOT NUL-terminated (print
 * with "%.*s", (int)s.len, s.data). Points into the mapping/buffer. */
typedef struct gguf_string {
    const char *data;
    uint64_t len;
} gguf_string;

typedef struct gguf_tensor {
    const char *name;          /* NUL-terminated copy owned by the ctx */
    uint32_t n_dims;           /* 0..4 as written in the file */
    int64_t ne[GGUF_MAX_DIMS]; /* (ne[0] fastest-varying, ..., ne[3]); unused dims = 1 */
    uint32_t type;             /* tensor_type id; tensor_type_get(type) != NULL */
    uint64_t offset;           /* from the start of the data section */
    const void *data;          /* file data + data section + offset */
    size_t nbytes;             /* bytes of the whole tensor */
    int64_t n_elements;        /* ne[0]*ne[1]*ne[2]*ne[3] */
} gguf_tensor;

/* ---- open / close ---------------------------------------------------------- */

/* Maps the file at `path` read-only and parses it. On success *out is a new
 * context (free with gguf_close) and IS_OK is returned.
 * Errors: IS_ERR_INVALID_ARG (NULL argument), IS_ERR_IO (cannot open, stat or
 * map; the message has the path and strerror), IS_ERR_FORMAT (corrupt or
 * truncated; the message names the field and byte offset),
 * IS_ERR_UNSUPPORTED (version other than 2/3, big-endian, nested arrays),
 * IS_ERR_NOMEM. *out is unchanged on failure. */
is_status gguf_open(const char *path, gguf_ctx **out);

/* As gguf_open, but parses `size` bytes at `data` owned by the caller, with no
 * copy: the buffer must stay valid and unchanged until gguf_close(). Tensor
 * data is only as aligned as `data` itself is. Never IS_ERR_IO. */
is_status gguf_open_memory(const void *data, size_t size, gguf_ctx **out);

/* Unmaps (for gguf_open) and frees everything. NULL is a no-op. */
void gguf_close(gguf_ctx *ctx);

/* ---- file ------------------------------------------------------------------- */

uint32_t gguf_version(const gguf_ctx *ctx);   /* 2 or 3 */
uint32_t gguf_alignment(const gguf_ctx *ctx); /* general.alignment or 32 */
size_t gguf_file_size(const gguf_ctx *ctx);
const void *gguf_file_data(const gguf_ctx *ctx); /* whole file, read-only */
/* Byte offset of the data section in the file (a multiple of the alignment). */
uint64_t gguf_data_offset(const gguf_ctx *ctx);

/* ---- metadata by index --------------------------------------------------------- */

int64_t gguf_n_keys(const gguf_ctx *ctx);
/* Index of `key`, or -1 if absent (O(1): hashed). */
int64_t gguf_find_key(const gguf_ctx *ctx, const char *key);
/* NUL-terminated key of pair `i` (0 <= i < gguf_n_keys); NULL if out of range. */
const char *gguf_key_name(const gguf_ctx *ctx, int64_t i);
/* Value type of pair `i`; GGUF_VALUE_COUNT_ if out of range. */
gguf_value_type gguf_key_type(const gguf_ctx *ctx, int64_t i);

/* ---- typed getters by key ---------------------------------------------------------
 * Each returns IS_OK and writes *out, or IS_ERR_NOT_FOUND (key absent; the
 * message names it), IS_ERR_FORMAT (value of another type, or an integer
 * that does not fit; the message names key and type), IS_ERR_INVALID_ARG
 * (NULL argument). *out is unchanged on failure.
 * Integer getters accept every integer type whose value fits losslessly
 * (writers differ in the width they use for the same key); bool is not an
 * integer here. */
is_status gguf_get_u32(const gguf_ctx *ctx, const char *key, uint32_t *out);
is_status gguf_get_i32(const gguf_ctx *ctx, const char *key, int32_t *out);
is_status gguf_get_u64(const gguf_ctx *ctx, const char *key, uint64_t *out);
is_status gguf_get_i64(const gguf_ctx *ctx, const char *key, int64_t *out);
/* Accept FLOAT32 or FLOAT64 (rounded to nearest for f32). */
is_status gguf_get_f32(const gguf_ctx *ctx, const char *key, float *out);
is_status gguf_get_f64(const gguf_ctx *ctx, const char *key, double *out);
is_status gguf_get_bool(const gguf_ctx *ctx, const char *key, bool *out);
is_status gguf_get_str(const gguf_ctx *ctx, const char *key, gguf_string *out);

/* ---- arrays ------------------------------------------------------------------------
 * gguf_get_arr: element type and count of array `key` (either out may be
 * NULL). Errors as for the typed getters (IS_ERR_FORMAT if not an array).
 *
 * gguf_get_arr_data: for arrays of numbers or bools, *data points at the
 * first element inside the file: `count` packed little-endian elements that
 * may be UNALIGNED, so read them with memcpy, not by casting the pointer.
 * (Bools are bytes, each 0 or 1: checked at open.) IS_ERR_FORMAT for arrays
 * of strings. For an empty array *data is a valid pointer to no elements.
 *
 * gguf_get_arr_str: element `i` of an array of strings, in O(1) (an index of
 * string offsets is built at open). IS_ERR_FORMAT if the array holds another
 * type, IS_ERR_INVALID_ARG if i >= count.
 * All three leave their outputs unchanged on failure. */
is_status gguf_get_arr(const gguf_ctx *ctx, const char *key, gguf_value_type *elem_type,
                       uint64_t *count);
is_status gguf_get_arr_data(const gguf_ctx *ctx, const char *key, const void **data);
is_status gguf_get_arr_str(const gguf_ctx *ctx, const char *key, uint64_t i, gguf_string *out);

/* ---- tensors ------------------------------------------------------------------------ */

int64_t gguf_n_tensors(const gguf_ctx *ctx);
/* Tensor `i` in file order (0 <= i < gguf_n_tensors), or NULL if out of range. */
const gguf_tensor *gguf_tensor_at(const gguf_ctx *ctx, int64_t i);
/* Tensor called `name`, or NULL if none (O(1): hashed). Does not set an error
 * message: callers that require the tensor report it with their context. */
const gguf_tensor *gguf_find_tensor(const gguf_ctx *ctx, const char *name);

/* A constant name for `t` ("u32", "string", ...); "unknown" past the enum. */
const char *gguf_value_type_name(gguf_value_type t);

#endif

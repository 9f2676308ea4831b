/*
 * fact_record: the fact-KV record, one fact's keys and values as a
 * self-checking, versioned byte string.
 *
 * Memory is injected at the attention layer (DESIGN.md): each fact is run
 * through the model once, offline, and for the fact's own tokens we keep,
 * in every layer, the keys BEFORE rotary embedding and the values. At serving
 * time those keys are rotated to wherever the fact lands (chunked RoPE) and
 * scattered into the paged cache. A record is only meaningful for the exact
 * model, dtype and RoPE setting that produced it, so its header names all of
 * them and fact_meta_check() refuses a record made for anything else; a
 * checksum over every byte catches corruption before a single value is used.
 *
 * fact_record_parse() is zero-copy and keeps no state (picohttpparser's
 * habit): it validates a buffer (a memory-mapped file, usually) and hands
 * out pointers into it. Every size is checked against the buffer length
 * with overflow-safe arithmetic, so a corrupt, truncated or hostile record
 * yields IS_ERR_FORMAT with a message naming the field, never a crash.
 *
 * ---- Byte layout, version 1 (integers and floats little-endian) ------------
 *
 *   offset size  field
 *   0      4     magic            "IFKV"
 *   4      4     u32 version      1
 *   8      4     u32 header_bytes 128 (where the token section starts)
 *   12     4     u32 dtype        kv_dtype: 0 f32, 1 f16, 2 bf16, 3 fp8 (e4m3
 *                                 with row scales, below)
 *   16     16    fingerprint      the model's 16 lowercase hex digits
 *                                 (model->fingerprint), no NUL
 *   32     4     i32 n_layers     1..4096
 *   36     4     i32 n_kv_heads   1..4096
 *   40     4     i32 head_dim     1..8192
 *   44     4     i32 n_tokens     1..1048576
 *   48     4     i32 rope_layout  0 norm, 1 neox (backend.h rope_layout)
 *   52     4     i32 rope_n_rot   even, 0..head_dim
 *   56     4     f32 rope_freq_base   finite, > 0
 *   60     4     f32 rope_freq_scale  finite, > 0
 *   64     8     u64 rope_factors_hash  fact_rope_factors_hash(), 0 if none
 *   72     4     i32 window       w, >= -1 (-1: encoded with no context)
 *   76     4     u32 reserved     0
 *   80     8     u64 text_hash    fact_text_hash() of the fact's text
 *   88     8     u64 total_bytes  the whole record's length (= the file size)
 *   96     24    reserved         0
 *   120    8     u64 checksum     XXH64 (seed 0) of bytes [0, 120) followed
 *                                 by bytes [128, total_bytes)
 *   128          tokens   i32[n_tokens]
 *                k        [n_layers][n_tokens][n_kv_heads * head_dim] dtype,
 *                         pre-RoPE
 *                v        same shape
 *
 * In fp8 (dtype 3) the k and v sections each hold the codes, u8 [n_layers]
 * [n_tokens][n_kv_heads * head_dim] (core/fp8.h), zero bytes up to a
 * multiple of 4, then the scales, f32 [n_layers][n_tokens][n_kv_heads]: a
 * value is its code's value times the scale of its (layer, token, head).
 * Each scale is a power of two in [2^-126, 2^127] (fp8.h says why).
 * dtype 3 came after the first records were written; it needs no new
 * version, since a reader without it refuses the record by its dtype, and
 * records of dtypes 0-2 are byte for byte as before.
 *
 * Each of the three sections starts at a multiple of 64 bytes from the
 * record's start; the gaps are zero bytes. total_bytes = 128 +
 * pad64(4 n_tokens) + 2 pad64(fact_kv_bytes()), and the buffer must be exactly that long (trailing bytes are
 * corruption too). Reserved fields and padding must be zero, and are covered
 * by the checksum, so a change to any byte of a record is rejected. A later
 * version may grow the header: header_bytes says where the payload starts.
 * Version 1 readers reject any other version.
 *
 * XXH64 is Yann Collet's xxHash64 (github.com/Cyan4973/xxHash); the same
 * function gives fact_text_hash() and fact_rope_factors_hash(), so a script
 * with Python's `xxhash` package can read and check records.
 *
 * Threads: everything here is a pure function of its arguments.
 */
#ifndef IS_KV_FACT_RECORD_H
#define IS_KV_FACT_RECORD_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct model;

typedef enum kv_dtype {
    KV_DTYPE_F32 = 0,
    KV_DTYPE_F16 = 1,  /* IEEE binary16 */
    KV_DTYPE_BF16 = 2, /* bfloat16 */
    KV_DTYPE_FP8 = 3,  /* fp8 e4m3 codes with an f32 scale per (layer, token, KV head) */
} kv_dtype;

#define KV_DTYPE_COUNT 4 /* dtypes 0 .. KV_DTYPE_COUNT - 1 */

#define FACT_RECORD_VERSION      1
#define FACT_RECORD_HEADER_BYTES 128
#define FACT_RECORD_ALIGN        64 /* sections start at multiples of this */
#define FACT_MAX_LAYERS          4096
#define FACT_MAX_KV_HEADS        4096
#define FACT_MAX_HEAD_DIM        8192
#define FACT_MAX_TOKENS          (1 << 20)

typedef struct fact_kv_meta {
    char model_fingerprint[17]; /* 16 lowercase hex digits + NUL (model->fingerprint) */
    kv_dtype dtype;             /* element type of k and v */
    int32_t n_layers;           /* model blocks */
    int32_t n_kv_heads;         /* key/value heads (GQA) */
    int32_t head_dim;           /* per head */
    int32_t n_tokens;           /* the fact's tokens, >= 1 */
    int32_t rope_layout;        /* 0 norm, 1 neox (backend.h rope_layout) */
    int32_t rope_n_rot;         /* dims rotated per head */
    float rope_freq_base;       /* theta base */
    float rope_freq_scale;      /* linear position scale */
    uint64_t rope_factors_hash; /* fact_rope_factors_hash() of llama-3 freq factors, 0 if none */
    int32_t window;     /* w: context turns used at encoding; -1 = no context at all (ablation) */
    uint64_t text_hash; /* fact_text_hash() of the fact's text */
} fact_kv_meta;

/* One fact's KV as the record store hands it out (or as the caller builds it
 * from fact_record_parse()). Immutable; the pointers live as long as the
 * buffer they point into (for a store record: until record_store_release()). */
typedef struct fact_kv {
    fact_kv_meta meta;
    const int32_t *tokens; /* [n_tokens] the fact's token ids */
    const void *k;         /* [n_layers][n_tokens][n_kv_heads*head_dim] in meta.dtype, pre-RoPE */
    const void *v;         /* [n_layers][n_tokens][n_kv_heads*head_dim] in meta.dtype */
    /* Names the contents: the record's stored checksum (fact_record_content_id),
     * or 0 when unknown. A backend may keep a record resident under it
     * (engine_inject_ids), so it must change whenever any byte does. */
    uint64_t content_id;
} fact_kv;

/* ---- dtypes and shapes ------------------------------------------------------ */

/* Bytes per element: 4, 2, 2, 1 (fp8: its scales come on top, see
 * fact_kv_bytes); 0 for a value outside kv_dtype. */
size_t kv_dtype_size(kv_dtype dtype);

/* "f32", "f16", "bf16", "fp8", or "invalid". */
const char *kv_dtype_name(kv_dtype dtype);

/* The dtype of a name kv_dtype_name() gives; false (out unchanged) for
 * anything else. For the --kv-dtype options. */
bool kv_dtype_parse(const char *name, kv_dtype *out);

/* Elements in one row of k or v: n_kv_heads * head_dim. */
size_t fact_kv_row_elems(const fact_kv_meta *meta);

/* Bytes of the whole k section (= of the v section) of a meta that passed
 * fact_meta_validate(): the elements, and for fp8 the padding and scales. */
size_t fact_kv_bytes(const fact_kv_meta *meta);

/* The row of (layer, token) inside `base` (a k or v section of `meta`'s
 * shape): fact_kv_row_elems() elements of meta->dtype (fp8: the codes).
 * Indices are asserted in range. */
const void *fact_kv_row(const fact_kv_meta *meta, const void *base, int32_t layer, int32_t token);

/* The scales of an fp8 section, f32 [n_layers][n_tokens][n_kv_heads]
 * (4-byte aligned when base is); NULL for the other dtypes. */
const float *fact_kv_scales(const fact_kv_meta *meta, const void *base);

/* A whole k or v section of `meta` (fact_kv_bytes() bytes at `section`) to
 * f32 [n_layers][n_tokens][n_kv_heads*head_dim] at dst, exact for every
 * dtype; and back (f16, bf16 round to nearest even; fp8 as core/fp8.h
 * quantises, a scale per row of head_dim). No alignment needed. */
void fact_kv_widen(const fact_kv_meta *meta, const void *section, float *dst);
void fact_kv_narrow(const fact_kv_meta *meta, const float *src, void *section);

/* Widens `n` elements of `dtype` at `src` to f32 (exact for every dtype).
 * src needs no alignment. Asserts dtype is valid and not fp8, whose values
 * need their scales (fact_kv_widen). */
void fact_kv_to_f32(kv_dtype dtype, const void *src, float *dst, size_t n);

/* Narrows `n` f32 values to `dtype` at `dst` (copy for f32; f16 and bf16
 * round to nearest, ties to even, through gguf/quant.h). dst needs no
 * alignment. Asserts dtype is valid and not fp8 (fact_kv_narrow). */
void fact_kv_from_f32(kv_dtype dtype, const float *src, void *dst, size_t n);

/* ---- hashes ------------------------------------------------------------------ */

/* XXH64, seed 0, of the fact's text bytes (text may be NULL when len is 0). */
uint64_t fact_text_hash(const char *text, size_t len);

/* XXH64, seed 0, of the `n` floats' bytes; 0 when factors is NULL or n is 0
 * (a model without llama-3 frequency factors). */
uint64_t fact_rope_factors_hash(const float *factors, int32_t n);

/* ---- metadata ---------------------------------------------------------------- */

/* The meta a record for `m` in `dtype` must carry: fingerprint, shapes and
 * RoPE parameters from the model; n_tokens, window and text_hash are zero
 * for the caller to fill in. This is the `expected` of fact_meta_check(). */
void fact_meta_for_model(const struct model *m, kv_dtype dtype, fact_kv_meta *out);

/* Checks every field against the limits of the byte layout above. IS_OK or
 * IS_ERR_INVALID_ARG with a message naming the field. */
is_status fact_meta_validate(const fact_kv_meta *meta);

/* Compares a record's meta with what the serving model expects: everything
 * except n_tokens, window and text_hash, which describe the fact. IS_OK, or
 * IS_ERR_MISMATCH with a message naming the first differing field (in the
 * order fingerprint, dtype, n_layers, n_kv_heads, head_dim, rope_layout,
 * rope_n_rot, rope_freq_base, rope_freq_scale, rope_factors_hash), e.g.
 * "fact record was made by model 0123456789abcdef, serving model is
 * abcdef0123456789". Floats compare exactly. */
is_status fact_meta_check(const fact_kv_meta *record, const fact_kv_meta *expected);

/* Whether fact_meta_check(r, e) would pass, setting no error message: a
 * record of r is one the model of e can use. False for NULL. */
bool fact_meta_same_model(const fact_kv_meta *r, const fact_kv_meta *e);

/* ---- encoding and parsing ------------------------------------------------------ */

/* The byte length of a record for `meta` into *len. IS_ERR_INVALID_ARG if
 * meta fails fact_meta_validate() (*len unchanged). */
is_status fact_record_size(const fact_kv_meta *meta, size_t *len);

/* Writes the record into buf[len], which must be exactly fact_record_size()
 * bytes (any alignment). tokens [n_tokens], k and v [n_layers][n_tokens]
 * [n_kv_heads*head_dim] in meta->dtype, any alignment. IS_ERR_INVALID_ARG
 * for a bad meta, a NULL pointer or a wrong len, IS_ERR_NOMEM (buf then
 * unchanged). */
is_status fact_record_encode_into(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                                  const void *v, void *buf, size_t len);

/* A record without assembling it: the header with the tokens (*head, a new
 * buffer the caller frees), then the caller's k and v and their zero
 * padding, in that order, are its bytes; pieces[i] points at each, their
 * lengths add up to *total. The checksum is taken from the pieces where they
 * lie, so a record can be written straight from the caller's sections
 * (writev) with no copy of the payload. k and v must stay unchanged while
 * the pieces are used. Failures as fact_record_encode_into's, IS_ERR_NOMEM;
 * nothing is written on failure. */
#define FACT_RECORD_PIECES 5
typedef struct fact_record_piece {
    const void *data;
    size_t len;
} fact_record_piece;
is_status fact_record_encode_pieces(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                                    const void *v, void **head,
                                    fact_record_piece pieces[FACT_RECORD_PIECES], size_t *total);

/* As fact_record_encode_into(), into a new 64-byte-aligned buffer: *buf
 * (free() it) and *len. IS_ERR_INVALID_ARG, IS_ERR_NOMEM; *buf and *len are
 * unchanged on failure. */
is_status fact_record_encode(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                             const void *v, void **buf, size_t *len);

/* Validates the record in buf[len] (magic, version, header size, every field
 * against its limits, total length with overflow checks, zero padding, and
 * the checksum) and gives its meta and pointers into buf for the tokens, k
 * and v. IS_OK; IS_ERR_FORMAT with a message naming the field for anything
 * wrong with the bytes (a newer version included); IS_ERR_INVALID_ARG if
 * buf is NULL while len > 0, or buf is not 4-byte aligned (the pointers
 * handed out would then be misaligned; malloc'd and mmap'd buffers are
 * fine). Outputs may be NULL when not wanted; on failure none is written.
 * Never reads outside buf[len]. */
is_status fact_record_parse(const void *buf, size_t len, fact_kv_meta *meta, const int32_t **tokens,
                            const void **k, const void **v);

/* The meta of the record whose first len (>= FACT_RECORD_HEADER_BYTES)
 * bytes are buf, from its header alone: every check fact_record_parse()
 * makes of the header, none of the rest (length, checksum, payload), so a
 * record that passes may still be refused as corrupt when read whole. For
 * asking what a file is (its model, dtype, text) without reading it.
 * IS_ERR_FORMAT, IS_ERR_INVALID_ARG (NULL); any alignment. */
is_status fact_record_parse_header(const void *buf, size_t len, fact_kv_meta *meta);

/* A record's checksum taken as its bytes arrive, so a reader hashes each
 * piece while it is still in the CPU's cache instead of reading the whole
 * record from memory a second time: fact_record_sum_init(), then
 * fact_record_sum_feed() with rec (the record's first byte) and each range
 * [from, to) of it in order, then fact_record_parse_summed(). The fields
 * are private (XXH64's streaming state). */
typedef struct fact_record_sum {
    struct fact_xxh64 {
        uint64_t v[4];      /* the four lane accumulators */
        uint64_t total_len; /* bytes hashed so far */
        uint8_t mem[32];    /* a partial stripe */
        uint32_t mem_size;  /* bytes of mem in use, < 32 */
    } h;
    size_t fed; /* bytes of the record fed so far */
} fact_record_sum;
void fact_record_sum_init(fact_record_sum *s);
/* Bytes [from, to) of the record at rec; from must be where the last feed
 * ended (0 at first). */
void fact_record_sum_feed(fact_record_sum *s, const void *rec, size_t from, size_t to);
/* fact_record_parse() with the checksum taken from s, which must have been
 * fed exactly buf[0, len) (IS_ERR_INVALID_ARG otherwise): every check is
 * the same, only the hashing pass is gone. */
is_status fact_record_parse_summed(const void *buf, size_t len, const fact_record_sum *s,
                                   fact_kv_meta *meta, const int32_t **tokens, const void **k,
                                   const void **v);

/* The checksum stored in a record that fact_record_parse() accepted: XXH64
 * over every other byte, so two records with the same id have the same
 * contents (up to a 2^-64 collision), and never 0 (0 maps to 1). */
uint64_t fact_record_content_id(const void *buf);

#endif

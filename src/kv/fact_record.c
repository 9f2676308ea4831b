/*
 * fact_record: encoding, validation and parsing of fact-KV records (byte
 * layout in fact_record.h), and the XXH64 hash they are checked with.
 */
#include "kv/fact_record.h"

#include "core/status.h"
#include "model/model.h"
#include "gguf/quant.h"
#include "core/fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fact records are little-endian and copied as-is: a big-endian host needs byte swaps here"
#endif

/* ---- XXH64 ---------------------------------------------------------------------
 * xxHash64 as specified in xxHash's doc/xxhash_spec.md, in streaming form so
 * the checksum can skip its own field. Checked against Python's `xxhash`
 * package by tests/kv/test_fact_record.c. */

#define XXH_P1 0x9E3779B185EBCA87ull
#define XXH_P2 0xC2B2AE3D27D4EB4Full
#define XXH_P3 0x165667B19E3779F9ull
#define XXH_P4 0x85EBCA77C2B2AE63ull
#define XXH_P5 0x27D4EB2F165667C5ull

typedef struct fact_xxh64 xxh64_state; /* declared in fact_record.h for fact_record_sum */

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t input) {
    acc += input * XXH_P2;
    acc = rotl64(acc, 31);
    return acc * XXH_P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t val) {
    acc ^= xxh_round(0, val);
    return acc * XXH_P1 + XXH_P4;
}

static void xxh64_init(xxh64_state *s, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->v[0] = seed + XXH_P1 + XXH_P2;
    s->v[1] = seed + XXH_P2;
    s->v[2] = seed;
    s->v[3] = seed - XXH_P1;
}

static void xxh64_stripe(xxh64_state *s, const uint8_t *p) {
    s->v[0] = xxh_round(s->v[0], read64(p));
    s->v[1] = xxh_round(s->v[1], read64(p + 8));
    s->v[2] = xxh_round(s->v[2], read64(p + 16));
    s->v[3] = xxh_round(s->v[3], read64(p + 24));
}

static void xxh64_update(xxh64_state *s, const void *data, size_t n) {
    const uint8_t *p = data;
    s->total_len += n;
    if (s->mem_size + n < 32) {
        if (n) memcpy(s->mem + s->mem_size, p, n);
        s->mem_size += (uint32_t)n;
        return;
    }
    if (s->mem_size) {
        size_t fill = 32 - s->mem_size;
        memcpy(s->mem + s->mem_size, p, fill);
        xxh64_stripe(s, s->mem);
        p += fill;
        n -= fill;
        s->mem_size = 0;
    }
    for (; n >= 32; p += 32, n -= 32) xxh64_stripe(s, p);
    if (n) memcpy(s->mem, p, n);
    s->mem_size = (uint32_t)n;
}

static uint64_t xxh64_digest(const xxh64_state *s) {
    uint64_t h;
    if (s->total_len >= 32) {
        h = rotl64(s->v[0], 1) + rotl64(s->v[1], 7) + rotl64(s->v[2], 12) + rotl64(s->v[3], 18);
        for (int i = 0; i < 4; i++) h = xxh_merge(h, s->v[i]);
    } else {
        h = s->v[2] + XXH_P5; /* v[2] holds the seed */
    }
    h += s->total_len;
    const uint8_t *p = s->mem;
    uint32_t n = s->mem_size;
    for (; n >= 8; p += 8, n -= 8) {
        h ^= xxh_round(0, read64(p));
        h = rotl64(h, 27) * XXH_P1 + XXH_P4;
    }
    if (n >= 4) {
        h ^= (uint64_t)read32(p) * XXH_P1;
        h = rotl64(h, 23) * XXH_P2 + XXH_P3;
        p += 4;
        n -= 4;
    }
    for (; n > 0; p++, n--) {
        h ^= *p * XXH_P5;
        h = rotl64(h, 11) * XXH_P1;
    }
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    h ^= h >> 32;
    return h;
}

static uint64_t xxh64(const void *data, size_t n) {
    xxh64_state s;
    xxh64_init(&s, 0);
    xxh64_update(&s, data, n);
    return xxh64_digest(&s);
}

uint64_t fact_text_hash(const char *text, size_t len) { return xxh64(len ? text : "", len); }

uint64_t fact_rope_factors_hash(const float *factors, int32_t n) {
    if (!factors || n <= 0) return 0;
    return xxh64(factors, (size_t)n * sizeof(float));
}

/* ---- dtypes and shapes ------------------------------------------------------------ */

size_t kv_dtype_size(kv_dtype dtype) {
    switch (dtype) {
    case KV_DTYPE_F32: return 4;
    case KV_DTYPE_F16: return 2;
    case KV_DTYPE_BF16: return 2;
    case KV_DTYPE_FP8: return 1;
    }
    return 0;
}

const char *kv_dtype_name(kv_dtype dtype) {
    switch (dtype) {
    case KV_DTYPE_F32: return "f32";
    case KV_DTYPE_F16: return "f16";
    case KV_DTYPE_BF16: return "bf16";
    case KV_DTYPE_FP8: return "fp8";
    }
    return "invalid";
}

bool kv_dtype_parse(const char *name, kv_dtype *out) {
    if (!name) return false;
    for (int d = 0; d < KV_DTYPE_COUNT; d++)
        if (strcmp(name, kv_dtype_name((kv_dtype)d)) == 0) {
            *out = (kv_dtype)d;
            return true;
        }
    return false;
}

size_t fact_kv_row_elems(const fact_kv_meta *meta) {
    return (size_t)meta->n_kv_heads * (size_t)meta->head_dim;
}

/* Fits in 64 bits for any meta within the limits: 2^12 * 2^20 * 2^12 * 2^13
 * * 4 = 2^59. */
size_t fact_kv_bytes(const fact_kv_meta *meta) {
    const size_t rows = (size_t)meta->n_layers * (size_t)meta->n_tokens;
    const size_t elems = rows * fact_kv_row_elems(meta) * kv_dtype_size(meta->dtype);
    if (meta->dtype != KV_DTYPE_FP8) return elems;
    return ((elems + 3) & ~(size_t)3) + rows * (size_t)meta->n_kv_heads * sizeof(float);
}

const float *fact_kv_scales(const fact_kv_meta *meta, const void *base) {
    if (meta->dtype != KV_DTYPE_FP8) return NULL;
    const size_t codes = (size_t)meta->n_layers * (size_t)meta->n_tokens * fact_kv_row_elems(meta);
    return (const float *)((const uint8_t *)base + ((codes + 3) & ~(size_t)3));
}

const void *fact_kv_row(const fact_kv_meta *meta, const void *base, int32_t layer, int32_t token) {
    IS_ASSERT(layer >= 0 && layer < meta->n_layers && token >= 0 && token < meta->n_tokens);
    size_t row = fact_kv_row_elems(meta) * kv_dtype_size(meta->dtype);
    return (const uint8_t *)base + ((size_t)layer * (size_t)meta->n_tokens + (size_t)token) * row;
}

void fact_kv_to_f32(kv_dtype dtype, const void *src, float *dst, size_t n) {
    const uint8_t *s = src;
    switch (dtype) {
    case KV_DTYPE_F32:
        if (n) memcpy(dst, src, n * sizeof(float));
        return;
    case KV_DTYPE_F16: {
        /* A served miss widens a whole record (millions of values for an
         * 8B model) before its upload: eight at a time where the CPU
         * converts binary16 itself (F16C, part of x86-64-v3), which gives
         * quant_f16_to_f32's bits for every input (test_fact_record walks
         * all 65,536). */
        size_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i,
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * i))));
#endif
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = quant_f16_to_f32(h);
        }
        return;
    }
    case KV_DTYPE_BF16:
        /* quant_bf16_to_f32 in line (the upper half of the float), so the
         * loop vectorises. */
        for (size_t i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, s + 2 * i, 2);
            uint32_t u = (uint32_t)b << 16;
            memcpy(dst + i, &u, 4);
        }
        return;
    case KV_DTYPE_FP8: break; /* needs its scales: fact_kv_widen */
    }
    IS_ASSERT(!"fact_kv_to_f32: invalid dtype");
}

void fact_kv_from_f32(kv_dtype dtype, const float *src, void *dst, size_t n) {
    uint8_t *d = dst;
    switch (dtype) {
    case KV_DTYPE_F32:
        if (n) memcpy(dst, src, n * sizeof(float));
        return;
    case KV_DTYPE_F16: quant_f32_to_f16_row(src, d, n); return;
    case KV_DTYPE_BF16: quant_f32_to_bf16_row(src, d, n); return;
    case KV_DTYPE_FP8: break; /* needs its scales: fact_kv_narrow */
    }
    IS_ASSERT(!"fact_kv_from_f32: invalid dtype");
}

void fact_kv_widen(const fact_kv_meta *meta, const void *section, float *dst) {
    const size_t rows = (size_t)meta->n_layers * (size_t)meta->n_tokens;
    const size_t n = rows * fact_kv_row_elems(meta);
    if (meta->dtype != KV_DTYPE_FP8) {
        fact_kv_to_f32(meta->dtype, section, dst, n);
        return;
    }
    /* The section (so its scales) may sit at any offset: the scales are
     * copied out a chunk of rows at a time. */
    const uint8_t *codes = section;
    const uint8_t *sc = (const uint8_t *)fact_kv_scales(meta, section);
    const size_t n_scales = rows * (size_t)meta->n_kv_heads, hd = (size_t)meta->head_dim;
    float chunk[256];
    for (size_t r = 0; r < n_scales; r += 256) {
        const size_t m = n_scales - r < 256 ? n_scales - r : 256;
        memcpy(chunk, sc + r * sizeof(float), m * sizeof(float));
        fp8_dequantize_rows(codes + r * hd, chunk, m, hd, dst + r * hd);
    }
}

void fact_kv_narrow(const fact_kv_meta *meta, const float *src, void *section) {
    const size_t rows = (size_t)meta->n_layers * (size_t)meta->n_tokens;
    const size_t n = rows * fact_kv_row_elems(meta);
    if (meta->dtype != KV_DTYPE_FP8) {
        fact_kv_from_f32(meta->dtype, src, section, n);
        return;
    }
    uint8_t *b = section;
    const size_t codes_end = (n + 3) & ~(size_t)3;
    memset(b + n, 0, codes_end - n);
    const size_t n_scales = rows * (size_t)meta->n_kv_heads, hd = (size_t)meta->head_dim;
    float chunk[256];
    for (size_t r = 0; r < n_scales; r += 256) {
        const size_t m = n_scales - r < 256 ? n_scales - r : 256;
        fp8_quantize_rows(src + r * hd, m, hd, b + r * hd, chunk);
        memcpy(b + codes_end + r * sizeof(float), chunk, m * sizeof(float));
    }
}

/* ---- metadata ------------------------------------------------------------------------ */

void fact_meta_for_model(const struct model *m, kv_dtype dtype, fact_kv_meta *out) {
    const model_config *c = &m->cfg;
    memset(out, 0, sizeof *out);
    memcpy(out->model_fingerprint, m->fingerprint, sizeof out->model_fingerprint);
    out->model_fingerprint[16] = '\0';
    out->dtype = dtype;
    out->n_layers = c->n_layers;
    out->n_kv_heads = c->n_kv_heads;
    out->head_dim = c->head_dim;
    out->rope_layout = (int32_t)c->rope.layout;
    out->rope_n_rot = c->rope.n_rot;
    out->rope_freq_base = c->rope.freq_base;
    out->rope_freq_scale = c->rope.freq_scale;
    out->rope_factors_hash = fact_rope_factors_hash(c->rope.freq_factors, c->rope.n_rot / 2);
}

static bool is_lower_hex(char ch) { return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'); }

/* The limits of the byte layout; returns NULL if `m` is within them, else
 * a description of the first field that is not. `fp` is the fingerprint's 16
 * characters (not necessarily NUL-terminated). */
static const char *meta_problem(const fact_kv_meta *m, const char *fp, char *why, size_t cap) {
    for (int i = 0; i < 16; i++)
        if (!is_lower_hex(fp[i])) {
            snprintf(why, cap, "model fingerprint character %d is not a lowercase hex digit", i);
            return why;
        }
#define RANGE(field, lo, hi)                                                                       \
    if (m->field < (lo) || m->field > (hi)) {                                                      \
        snprintf(why, cap, #field " is %lld, must be in [%lld, %lld]", (long long)m->field,        \
                 (long long)(lo), (long long)(hi));                                                \
        return why;                                                                                \
    }
    RANGE(dtype, 0, KV_DTYPE_COUNT - 1)
    RANGE(n_layers, 1, FACT_MAX_LAYERS)
    RANGE(n_kv_heads, 1, FACT_MAX_KV_HEADS)
    RANGE(head_dim, 1, FACT_MAX_HEAD_DIM)
    RANGE(n_tokens, 1, FACT_MAX_TOKENS)
    RANGE(rope_layout, 0, 1)
    RANGE(rope_n_rot, 0, m->head_dim)
    RANGE(window, -1, INT32_MAX)
#undef RANGE
    if (m->rope_n_rot % 2 != 0) {
        snprintf(why, cap, "rope_n_rot is %d, must be even", m->rope_n_rot);
        return why;
    }
    if (!isfinite(m->rope_freq_base) || !(m->rope_freq_base > 0)) {
        snprintf(why, cap, "rope_freq_base is %g, must be finite and > 0", m->rope_freq_base);
        return why;
    }
    if (!isfinite(m->rope_freq_scale) || !(m->rope_freq_scale > 0)) {
        snprintf(why, cap, "rope_freq_scale is %g, must be finite and > 0", m->rope_freq_scale);
        return why;
    }
    return NULL;
}

is_status fact_meta_validate(const fact_kv_meta *meta) {
    if (!meta) return is_error_set(IS_ERR_INVALID_ARG, "fact record: meta is NULL");
    char why[160];
    if (strnlen(meta->model_fingerprint, sizeof meta->model_fingerprint) != 16)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fact record: model fingerprint must be 16 hex digits");
    if (meta_problem(meta, meta->model_fingerprint, why, sizeof why))
        return is_error_set(IS_ERR_INVALID_ARG, "fact record: %s", why);
    return IS_OK;
}

/* The fields fact_meta_check compares, in its order. */
typedef enum meta_field {
    MF_SAME,
    MF_FINGERPRINT,
    MF_DTYPE,
    MF_N_LAYERS,
    MF_N_KV_HEADS,
    MF_HEAD_DIM,
    MF_ROPE_LAYOUT,
    MF_ROPE_N_ROT,
    MF_ROPE_BASE,
    MF_ROPE_SCALE,
    MF_ROPE_FACTORS,
} meta_field;

static meta_field model_difference(const fact_kv_meta *r, const fact_kv_meta *e) {
    if (strncmp(r->model_fingerprint, e->model_fingerprint, 16) != 0) return MF_FINGERPRINT;
    if (r->dtype != e->dtype) return MF_DTYPE;
    if (r->n_layers != e->n_layers) return MF_N_LAYERS;
    if (r->n_kv_heads != e->n_kv_heads) return MF_N_KV_HEADS;
    if (r->head_dim != e->head_dim) return MF_HEAD_DIM;
    if (r->rope_layout != e->rope_layout) return MF_ROPE_LAYOUT;
    if (r->rope_n_rot != e->rope_n_rot) return MF_ROPE_N_ROT;
    if (r->rope_freq_base != e->rope_freq_base) return MF_ROPE_BASE;
    if (r->rope_freq_scale != e->rope_freq_scale) return MF_ROPE_SCALE;
    if (r->rope_factors_hash != e->rope_factors_hash) return MF_ROPE_FACTORS;
    return MF_SAME;
}

bool fact_meta_same_model(const fact_kv_meta *r, const fact_kv_meta *e) {
    return r && e && model_difference(r, e) == MF_SAME;
}

is_status fact_meta_check(const fact_kv_meta *r, const fact_kv_meta *e) {
    if (!r || !e) return is_error_set(IS_ERR_INVALID_ARG, "fact record: meta is NULL");
    const char *what = NULL;
    long long rv = 0, ev = 0;
    switch (model_difference(r, e)) {
    case MF_SAME: return IS_OK;
    case MF_FINGERPRINT:
        return is_error_set(IS_ERR_MISMATCH,
                            "fact record was made by model %.16s, serving model is %.16s",
                            r->model_fingerprint, e->model_fingerprint);
    case MF_DTYPE:
        return is_error_set(IS_ERR_MISMATCH, "fact record dtype is %s, expected %s",
                            kv_dtype_name(r->dtype), kv_dtype_name(e->dtype));
    case MF_N_LAYERS: what = "n_layers", rv = r->n_layers, ev = e->n_layers; break;
    case MF_N_KV_HEADS: what = "n_kv_heads", rv = r->n_kv_heads, ev = e->n_kv_heads; break;
    case MF_HEAD_DIM: what = "head_dim", rv = r->head_dim, ev = e->head_dim; break;
    case MF_ROPE_LAYOUT: what = "RoPE layout", rv = r->rope_layout, ev = e->rope_layout; break;
    case MF_ROPE_N_ROT: what = "RoPE n_rot", rv = r->rope_n_rot, ev = e->rope_n_rot; break;
    case MF_ROPE_BASE:
        return is_error_set(IS_ERR_MISMATCH,
                            "fact record has RoPE freq_base %.9g, serving model has %.9g",
                            r->rope_freq_base, e->rope_freq_base);
    case MF_ROPE_SCALE:
        return is_error_set(IS_ERR_MISMATCH,
                            "fact record has RoPE freq_scale %.9g, serving model has %.9g",
                            r->rope_freq_scale, e->rope_freq_scale);
    case MF_ROPE_FACTORS:
        return is_error_set(
            IS_ERR_MISMATCH,
            "fact record has RoPE frequency factors %016llx, serving model has %016llx",
            (unsigned long long)r->rope_factors_hash, (unsigned long long)e->rope_factors_hash);
    }
    return is_error_set(IS_ERR_MISMATCH, "fact record has %s %lld, serving model has %lld", what,
                        rv, ev);
}

/* ---- layout ---------------------------------------------------------------------------- */

enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_HEADER_BYTES = 8,
    OFF_DTYPE = 12,
    OFF_FINGERPRINT = 16,
    OFF_N_LAYERS = 32,
    OFF_N_KV_HEADS = 36,
    OFF_HEAD_DIM = 40,
    OFF_N_TOKENS = 44,
    OFF_ROPE_LAYOUT = 48,
    OFF_ROPE_N_ROT = 52,
    OFF_ROPE_BASE = 56,
    OFF_ROPE_SCALE = 60,
    OFF_ROPE_FACTORS = 64,
    OFF_WINDOW = 72,
    OFF_RESERVED0 = 76,
    OFF_TEXT_HASH = 80,
    OFF_TOTAL_BYTES = 88,
    OFF_RESERVED1 = 96,
    OFF_CHECKSUM = 120,
};

static const uint8_t record_magic[4] = {'I', 'F', 'K', 'V'};

/* Where the sections lie inside a record. */
typedef struct record_layout {
    size_t tokens_off, tokens_bytes;
    size_t k_off, v_off, kv_bytes;
    size_t total;
} record_layout;

static size_t pad64(size_t n) {
    return (n + (FACT_RECORD_ALIGN - 1)) & ~(size_t)(FACT_RECORD_ALIGN - 1);
}

/* For a meta within the limits nothing here can overflow (see fact_kv_bytes). */
static record_layout layout_of(const fact_kv_meta *m) {
    record_layout l;
    l.tokens_off = FACT_RECORD_HEADER_BYTES;
    l.tokens_bytes = (size_t)m->n_tokens * sizeof(int32_t);
    l.kv_bytes = fact_kv_bytes(m);
    l.k_off = l.tokens_off + pad64(l.tokens_bytes);
    l.v_off = l.k_off + pad64(l.kv_bytes);
    l.total = l.v_off + pad64(l.kv_bytes);
    return l;
}

/* The checksum: XXH64 of the header before the checksum field, then the
 * whole payload (padding included). */
static uint64_t record_checksum(const uint8_t *rec, size_t total) {
    xxh64_state s;
    xxh64_init(&s, 0);
    xxh64_update(&s, rec, OFF_CHECKSUM);
    xxh64_update(&s, rec + FACT_RECORD_HEADER_BYTES, total - FACT_RECORD_HEADER_BYTES);
    return xxh64_digest(&s);
}

void fact_record_sum_init(fact_record_sum *s) {
    xxh64_init(&s->h, 0);
    s->fed = 0;
}

void fact_record_sum_feed(fact_record_sum *s, const void *rec, size_t from, size_t to) {
    IS_ASSERT(from == s->fed && to >= from);
    const uint8_t *b = rec;
    /* record_checksum()'s bytes: all but the checksum field itself. */
    if (from < OFF_CHECKSUM) {
        const size_t end = to < OFF_CHECKSUM ? to : OFF_CHECKSUM;
        xxh64_update(&s->h, b + from, end - from);
        from = end;
    }
    if (from < FACT_RECORD_HEADER_BYTES)
        from = to < FACT_RECORD_HEADER_BYTES ? to : FACT_RECORD_HEADER_BYTES;
    if (to > from) xxh64_update(&s->h, b + from, to - from);
    s->fed = to;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static void putf(uint8_t *p, float v) { memcpy(p, &v, 4); }
static int32_t get_i32(const uint8_t *p) { return (int32_t)read32(p); }
static float get_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* ---- encoding -------------------------------------------------------------------------- */

is_status fact_record_size(const fact_kv_meta *meta, size_t *len) {
    is_status st = fact_meta_validate(meta);
    if (st != IS_OK) return st;
    if (!len) return is_error_set(IS_ERR_INVALID_ARG, "fact record: len is NULL");
    *len = layout_of(meta).total;
    return IS_OK;
}

static const uint8_t zero_pad[FACT_RECORD_ALIGN];

is_status fact_record_encode_pieces(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                                    const void *v, void **head,
                                    fact_record_piece pieces[FACT_RECORD_PIECES], size_t *total) {
    is_status st = fact_meta_validate(meta);
    if (st != IS_OK) return st;
    if (!tokens || !k || !v || !head || !pieces || !total)
        return is_error_set(IS_ERR_INVALID_ARG, "fact record: NULL tokens, k, v or output");
    for (int32_t i = 0; i < meta->n_tokens; i++)
        if (tokens[i] < 0)
            return is_error_set(IS_ERR_INVALID_ARG, "fact record: token %d has negative id %d", i,
                                tokens[i]);
    record_layout l = layout_of(meta);
    uint8_t *b = calloc(1, l.k_off); /* header, tokens and their padding */
    if (!b) return is_error_set(IS_ERR_NOMEM, "fact record: out of memory");
    memcpy(b + OFF_MAGIC, record_magic, 4);
    put32(b + OFF_VERSION, FACT_RECORD_VERSION);
    put32(b + OFF_HEADER_BYTES, FACT_RECORD_HEADER_BYTES);
    put32(b + OFF_DTYPE, (uint32_t)meta->dtype);
    memcpy(b + OFF_FINGERPRINT, meta->model_fingerprint, 16);
    put32(b + OFF_N_LAYERS, (uint32_t)meta->n_layers);
    put32(b + OFF_N_KV_HEADS, (uint32_t)meta->n_kv_heads);
    put32(b + OFF_HEAD_DIM, (uint32_t)meta->head_dim);
    put32(b + OFF_N_TOKENS, (uint32_t)meta->n_tokens);
    put32(b + OFF_ROPE_LAYOUT, (uint32_t)meta->rope_layout);
    put32(b + OFF_ROPE_N_ROT, (uint32_t)meta->rope_n_rot);
    putf(b + OFF_ROPE_BASE, meta->rope_freq_base);
    putf(b + OFF_ROPE_SCALE, meta->rope_freq_scale);
    put64(b + OFF_ROPE_FACTORS, meta->rope_factors_hash);
    put32(b + OFF_WINDOW, (uint32_t)meta->window);
    put64(b + OFF_TEXT_HASH, meta->text_hash);
    put64(b + OFF_TOTAL_BYTES, (uint64_t)l.total);
    memcpy(b + l.tokens_off, tokens, l.tokens_bytes);

    /* Sections, each followed by zero padding up to the next one. */
    pieces[0] = (fact_record_piece){b, l.k_off};
    pieces[1] = (fact_record_piece){k, l.kv_bytes};
    pieces[2] = (fact_record_piece){zero_pad, l.v_off - l.k_off - l.kv_bytes};
    pieces[3] = (fact_record_piece){v, l.kv_bytes};
    pieces[4] = (fact_record_piece){zero_pad, l.total - l.v_off - l.kv_bytes};

    /* The checksum of record_checksum(), taken from the pieces where they lie. */
    xxh64_state h;
    xxh64_init(&h, 0);
    xxh64_update(&h, b, OFF_CHECKSUM);
    xxh64_update(&h, b + FACT_RECORD_HEADER_BYTES, l.k_off - FACT_RECORD_HEADER_BYTES);
    for (int i = 1; i < FACT_RECORD_PIECES; i++) xxh64_update(&h, pieces[i].data, pieces[i].len);
    put64(b + OFF_CHECKSUM, xxh64_digest(&h));
    *head = b;
    *total = l.total;
    return IS_OK;
}

is_status fact_record_encode_into(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                                  const void *v, void *buf, size_t len) {
    is_status st = fact_meta_validate(meta);
    if (st != IS_OK) return st;
    if (!buf) return is_error_set(IS_ERR_INVALID_ARG, "fact record: NULL buffer");
    record_layout l = layout_of(meta);
    if (len != l.total)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fact record: buffer is %zu bytes, record needs %zu", len, l.total);
    void *head;
    fact_record_piece pieces[FACT_RECORD_PIECES];
    size_t total;
    if ((st = fact_record_encode_pieces(meta, tokens, k, v, &head, pieces, &total)) != IS_OK)
        return st;
    uint8_t *b = buf;
    for (int i = 0; i < FACT_RECORD_PIECES; i++) {
        memcpy(b, pieces[i].data, pieces[i].len);
        b += pieces[i].len;
    }
    free(head);
    return IS_OK;
}

is_status fact_record_encode(const fact_kv_meta *meta, const int32_t *tokens, const void *k,
                             const void *v, void **buf, size_t *len) {
    if (!buf || !len) return is_error_set(IS_ERR_INVALID_ARG, "fact record: NULL output");
    size_t total;
    is_status st = fact_record_size(meta, &total);
    if (st != IS_OK) return st;
    /* total is a multiple of FACT_RECORD_ALIGN, as aligned_alloc wants. */
    void *b = aligned_alloc(FACT_RECORD_ALIGN, total);
    if (!b) return is_error_set(IS_ERR_NOMEM, "fact record: out of memory (%zu bytes)", total);
    st = fact_record_encode_into(meta, tokens, k, v, b, total);
    if (st != IS_OK) {
        free(b);
        return st;
    }
    *buf = b;
    *len = total;
    return IS_OK;
}

/* ---- parsing ----------------------------------------------------------------------------- */

static bool all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return false;
    return true;
}

/* The header's checks (every one that needs no byte past it) into *out. */
static is_status parse_header(const uint8_t *b, size_t len, fact_kv_meta *out) {
    if (len < FACT_RECORD_HEADER_BYTES)
        return is_error_set(IS_ERR_FORMAT,
                            "fact record: %zu bytes, shorter than the %d-byte header (truncated)",
                            len, FACT_RECORD_HEADER_BYTES);
    if (memcmp(b + OFF_MAGIC, record_magic, 4) != 0)
        return is_error_set(IS_ERR_FORMAT, "fact record: bad magic (not a fact-KV record)");
    uint32_t version = read32(b + OFF_VERSION);
    if (version != FACT_RECORD_VERSION)
        return is_error_set(IS_ERR_FORMAT,
                            "fact record: version %u, this build reads version %d only", version,
                            FACT_RECORD_VERSION);
    uint32_t header_bytes = read32(b + OFF_HEADER_BYTES);
    if (header_bytes != FACT_RECORD_HEADER_BYTES)
        return is_error_set(IS_ERR_FORMAT, "fact record: header_bytes is %u, version 1 has %d",
                            header_bytes, FACT_RECORD_HEADER_BYTES);

    fact_kv_meta m;
    memset(&m, 0, sizeof m);
    memcpy(m.model_fingerprint, b + OFF_FINGERPRINT, 16);
    m.model_fingerprint[16] = '\0';
    uint32_t dtype = read32(b + OFF_DTYPE);
    /* Out-of-range values are kept out of the enum until checked. */
    m.dtype = dtype < KV_DTYPE_COUNT ? (kv_dtype)dtype : (kv_dtype)KV_DTYPE_COUNT;
    m.n_layers = get_i32(b + OFF_N_LAYERS);
    m.n_kv_heads = get_i32(b + OFF_N_KV_HEADS);
    m.head_dim = get_i32(b + OFF_HEAD_DIM);
    m.n_tokens = get_i32(b + OFF_N_TOKENS);
    m.rope_layout = get_i32(b + OFF_ROPE_LAYOUT);
    m.rope_n_rot = get_i32(b + OFF_ROPE_N_ROT);
    m.rope_freq_base = get_f32(b + OFF_ROPE_BASE);
    m.rope_freq_scale = get_f32(b + OFF_ROPE_SCALE);
    m.rope_factors_hash = read64(b + OFF_ROPE_FACTORS);
    m.window = get_i32(b + OFF_WINDOW);
    m.text_hash = read64(b + OFF_TEXT_HASH);

    char why[160];
    if (dtype >= KV_DTYPE_COUNT)
        return is_error_set(IS_ERR_FORMAT, "fact record: dtype %u is none of f32, f16, bf16, fp8",
                            dtype);
    if (meta_problem(&m, (const char *)b + OFF_FINGERPRINT, why, sizeof why))
        return is_error_set(IS_ERR_FORMAT, "fact record: %s", why);
    if (!all_zero(b + OFF_RESERVED0, 4) ||
        !all_zero(b + OFF_RESERVED1, OFF_CHECKSUM - OFF_RESERVED1))
        return is_error_set(IS_ERR_FORMAT, "fact record: reserved header bytes are not zero");
    *out = m;
    return IS_OK;
}

/* fact_record_parse's work; sum is the checksum of buf[len] when the caller
 * took it as the bytes arrived, NULL to take it here. */
static is_status parse(const void *buf, size_t len, const fact_record_sum *sum_of,
                       fact_kv_meta *meta_out, const int32_t **tokens, const void **k,
                       const void **v) {
    if (!buf && len > 0) return is_error_set(IS_ERR_INVALID_ARG, "fact record: buffer is NULL");
    if ((uintptr_t)buf % 4 != 0)
        return is_error_set(IS_ERR_INVALID_ARG, "fact record: buffer is not 4-byte aligned");
    const uint8_t *b = buf;
    fact_kv_meta m;
    is_status st = parse_header(b, len, &m);
    if (st != IS_OK) return st;

    /* The fields are within the limits, so the layout's arithmetic cannot
     * overflow; the record must be exactly as long as they say. */
    record_layout l = layout_of(&m);
    uint64_t total_field = read64(b + OFF_TOTAL_BYTES);
    if (total_field != (uint64_t)l.total)
        return is_error_set(IS_ERR_FORMAT,
                            "fact record: total_bytes is %llu, the shapes make %zu bytes",
                            (unsigned long long)total_field, l.total);
    if (len != l.total)
        return is_error_set(IS_ERR_FORMAT, "fact record: %zu bytes, the header says %zu (%s)", len,
                            l.total, len < l.total ? "truncated" : "trailing bytes");
    uint64_t sum = read64(b + OFF_CHECKSUM),
             want = sum_of ? xxh64_digest(&sum_of->h) : record_checksum(b, l.total);
    if (sum != want)
        return is_error_set(IS_ERR_FORMAT,
                            "fact record: checksum mismatch (stored %016llx, computed %016llx): "
                            "the record is corrupt",
                            (unsigned long long)sum, (unsigned long long)want);
    /* Past the checksum only a faulty writer can get here, but the promise
     * holds for any bytes. */
    if (!all_zero(b + l.tokens_off + l.tokens_bytes, l.k_off - l.tokens_off - l.tokens_bytes) ||
        !all_zero(b + l.k_off + l.kv_bytes, l.v_off - l.k_off - l.kv_bytes) ||
        !all_zero(b + l.v_off + l.kv_bytes, l.total - l.v_off - l.kv_bytes))
        return is_error_set(IS_ERR_FORMAT, "fact record: section padding is not zero");
    if (m.dtype == KV_DTYPE_FP8) {
        /* Codes padded with zeros to the scales; each scale a power of two
         * in the normal range (as fp8_scale_for_amax makes them). */
        const size_t codes = (size_t)m.n_layers * m.n_tokens * fact_kv_row_elems(&m);
        const size_t pad = ((codes + 3) & ~(size_t)3) - codes;
        const size_t n_scales = (size_t)m.n_layers * m.n_tokens * m.n_kv_heads;
        for (int s = 0; s < 2; s++) {
            const size_t off = s ? l.v_off : l.k_off;
            if (!all_zero(b + off + codes, pad))
                return is_error_set(IS_ERR_FORMAT, "fact record: fp8 code padding is not zero");
            const uint8_t *sc = b + off + codes + pad;
            for (size_t i = 0; i < n_scales; i++) {
                const uint32_t u = read32(sc + 4 * i), e = u >> 23;
                if ((u & 0x807FFFFFu) != 0 || e == 0 || e == 255)
                    return is_error_set(IS_ERR_FORMAT,
                                        "fact record: fp8 %s scale %zu is %g, not a power of two "
                                        "in [2^-126, 2^127]",
                                        s ? "v" : "k", i, (double)get_f32(sc + 4 * i));
            }
        }
    }
    const int32_t *tok = (const int32_t *)(b + l.tokens_off);
    for (int32_t i = 0; i < m.n_tokens; i++)
        if (tok[i] < 0)
            return is_error_set(IS_ERR_FORMAT, "fact record: token %d has negative id %d", i,
                                tok[i]);

    if (meta_out) *meta_out = m;
    if (tokens) *tokens = tok;
    if (k) *k = b + l.k_off;
    if (v) *v = b + l.v_off;
    return IS_OK;
}

is_status fact_record_parse_header(const void *buf, size_t len, fact_kv_meta *meta) {
    if (!buf || !meta) return is_error_set(IS_ERR_INVALID_ARG, "fact record: NULL argument");
    return parse_header(buf, len, meta);
}

is_status fact_record_parse(const void *buf, size_t len, fact_kv_meta *meta, const int32_t **tokens,
                            const void **k, const void **v) {
    return parse(buf, len, NULL, meta, tokens, k, v);
}

is_status fact_record_parse_summed(const void *buf, size_t len, const fact_record_sum *s,
                                   fact_kv_meta *meta, const int32_t **tokens, const void **k,
                                   const void **v) {
    if (!s || s->fed != len)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fact record: the checksum was taken over %zu bytes, not the %zu given",
                            s ? s->fed : 0, len);
    return parse(buf, len, s, meta, tokens, k, v);
}

uint64_t fact_record_content_id(const void *buf) {
    uint64_t sum = read64((const uint8_t *)buf + OFF_CHECKSUM);
    return sum ? sum : 1;
}

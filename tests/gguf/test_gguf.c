/*
 * test_gguf: the GGUF reader against files written here, byte by byte.
 *
 * A tiny writer (gw_*) builds GGUF files in memory with every value type,
 * arrays (strings included) and tensors of several types, and records where
 * each field landed so the corruption tests can overwrite exactly that field.
 * Valid files are read back and every value compared with what was written;
 * corrupt files (every truncation, huge lengths and counts, bad types,
 * misaligned or out-of-file tensors, duplicates) must fail with the right
 * status and never crash (run under IS_SANITIZE=ON to check for leaks and
 * out-of-bounds reads: every buffer handed to the reader is malloc'd at its
 * exact size so ASan sees one byte too far).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"
#include "gguf/gguf.h"
#include "gguf/tensor_type.h"

/* ---- a minimal GGUF writer -------------------------------------------------- */

typedef struct buf {
    uint8_t *p;
    size_t len, cap;
} buf;

static void buf_put(buf *b, const void *d, size_t n) {
    if (b->cap - b->len < n) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, d, n);
    b->len += n;
}
static void put_u32(buf *b, uint32_t v) { buf_put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { buf_put(b, &v, 8); }
static void put_str(buf *b, const char *s) {
    put_u64(b, strlen(s));
    buf_put(b, s, strlen(s));
}

#define HEADER_BYTES 24

typedef struct gw {
    buf kv, ti, data;
    uint64_t n_kv, n_t;
    uint32_t version;
    uint32_t alignment;
} gw;

static void gw_init(gw *w) {
    memset(w, 0, sizeof *w);
    w->version = 3;
    w->alignment = 32;
}

static void gw_free(gw *w) {
    free(w->kv.p);
    free(w->ti.p);
    free(w->data.p);
}

/* File offset of the kv section position `rel`. */
static size_t kv_pos(size_t rel) { return HEADER_BYTES + rel; }
/* File offset of tensor-info position `rel` (valid once all kvs are written). */
static size_t ti_pos(const gw *w, size_t rel) { return HEADER_BYTES + w->kv.len + rel; }

/* Writes key and type; returns the file offset of the value. */
static size_t gw_key(gw *w, const char *key, uint32_t type) {
    assert_int_equal(w->n_t, 0); /* kvs first: ti_pos depends on it */
    put_str(&w->kv, key);
    put_u32(&w->kv, type);
    w->n_kv++;
    return kv_pos(w->kv.len);
}

static size_t gw_scalar(gw *w, const char *key, gguf_value_type t, const void *v, size_t n) {
    size_t pos = gw_key(w, key, t);
    buf_put(&w->kv, v, n);
    return pos;
}
#define GW_SCALAR(w, key, t, ctype, val)                                                           \
    do {                                                                                           \
        ctype v_ = (val);                                                                          \
        gw_scalar((w), (key), (t), &v_, sizeof v_);                                                \
    } while (0)

/* Returns the file offset of the string's length field. */
static size_t gw_str(gw *w, const char *key, const char *s) {
    size_t pos = gw_key(w, key, GGUF_VALUE_STRING);
    put_str(&w->kv, s);
    return pos;
}

/* Returns the file offset of the array's element type (count follows it). */
static size_t gw_arr(gw *w, const char *key, gguf_value_type et, uint64_t count, const void *elems,
                     size_t elem_size) {
    size_t pos = gw_key(w, key, GGUF_VALUE_ARRAY);
    put_u32(&w->kv, et);
    put_u64(&w->kv, count);
    buf_put(&w->kv, elems, count * elem_size);
    return pos;
}

static size_t gw_arr_str(gw *w, const char *key, const char *const *s, uint64_t count) {
    size_t pos = gw_key(w, key, GGUF_VALUE_ARRAY);
    put_u32(&w->kv, GGUF_VALUE_STRING);
    put_u64(&w->kv, count);
    for (uint64_t i = 0; i < count; i++) put_str(&w->kv, s[i]);
    return pos;
}

static void gw_alignment(gw *w, uint32_t a) {
    GW_SCALAR(w, "general.alignment", GGUF_VALUE_UINT32, uint32_t, a);
    w->alignment = a;
}

/* Appends a tensor whose `nbytes` data bytes are `bytes` (computed by the
 * caller from the block sizes, not by the library). Returns the file offset
 * of its info record (the name's length field). */
static size_t gw_tensor(gw *w, const char *name, uint32_t type, uint32_t n_dims, const int64_t *ne,
                        const void *bytes, size_t nbytes) {
    size_t rel = w->ti.len;
    while (w->data.len % w->alignment) buf_put(&w->data, "\0", 1);
    put_str(&w->ti, name);
    put_u32(&w->ti, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) put_u64(&w->ti, (uint64_t)ne[d]);
    put_u32(&w->ti, type);
    put_u64(&w->ti, w->data.len);
    buf_put(&w->data, bytes, nbytes);
    w->n_t++;
    return ti_pos(w, rel);
}

/* The file: header, kvs, tensor infos, padding, data (no padding after the
 * last tensor, so every strict prefix of a file with tensors is invalid). */
static uint8_t *gw_finish(const gw *w, size_t *size) {
    buf f = {0};
    buf_put(&f, "GGUF", 4);
    put_u32(&f, w->version);
    put_u64(&f, w->n_t);
    put_u64(&f, w->n_kv);
    buf_put(&f, w->kv.p, w->kv.len);
    buf_put(&f, w->ti.p, w->ti.len);
    if (w->n_t > 0) {
        while (f.len % w->alignment) buf_put(&f, "\0", 1);
        buf_put(&f, w->data.p, w->data.len);
    }
    /* Exact-size copy so ASan catches any read past the end. */
    uint8_t *out = malloc(f.len ? f.len : 1);
    assert_non_null(out);
    memcpy(out, f.p, f.len);
    free(f.p);
    *size = f.len;
    return out;
}

static void put_at_u64(uint8_t *f, size_t pos, uint64_t v) { memcpy(f + pos, &v, 8); }
static void put_at_u32(uint8_t *f, size_t pos, uint32_t v) { memcpy(f + pos, &v, 4); }

/* Opens a copy of `f` and expects `want`; on failure the out pointer must be
 * untouched and a "gguf: " message recorded. */
static void expect_open(const uint8_t *f, size_t size, is_status want, const char *msg_part) {
    uint8_t *copy = malloc(size ? size : 1);
    assert_non_null(copy);
    memcpy(copy, f, size);
    gguf_ctx *ctx = (gguf_ctx *)(uintptr_t)0x1;
    is_error_clear();
    is_status st = gguf_open_memory(copy, size, &ctx);
    if (st != want)
        fail_msg("expected %s, got %s (%s)", is_status_to_string(want), is_status_to_string(st),
                 is_error_last());
    if (st == IS_OK) {
        gguf_close(ctx);
    } else {
        assert_ptr_equal(ctx, (gguf_ctx *)(uintptr_t)0x1);
        assert_true(strncmp(is_error_last(), "gguf: ", 6) == 0);
        if (msg_part != NULL && strstr(is_error_last(), msg_part) == NULL)
            fail_msg("message '%s' lacks '%s'", is_error_last(), msg_part);
    }
    free(copy);
}

/* With IS_GGUF_SEED_DIR set, valid files written here are also saved there
 * (scripts/fuzz_gguf.sh uses them as the fuzzer's seed corpus). */
static void save_seed(const char *name, const uint8_t *f, size_t size) {
    const char *dir = getenv("IS_GGUF_SEED_DIR");
    if (dir == NULL || dir[0] == '\0') return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(f, 1, size, fp), size);
    assert_int_equal(fclose(fp), 0);
}

/* ---- the reference file: every value type and tensor kind ---------------------- */

static const char *const STRS[] = {"alpha", "", "\xce\xb2\xce\xb5\xcf\x84\xce\xb1",
                                   "a longer string with spaces"};
static const uint8_t ARR_U8[] = {0, 1, 254, 255};
static const int8_t ARR_I8[] = {-128, -1, 0, 127};
static const uint16_t ARR_U16[] = {0, 65535, 1234};
static const int16_t ARR_I16[] = {-32768, 32767, -5};
static const uint32_t ARR_U32[] = {0, 0xFFFFFFFFu, 49152};
static const int32_t ARR_I32[] = {INT32_MIN, INT32_MAX, -7, 0};
static const float ARR_F32[] = {1.5f, -0.0f, 1e-5f, 3.0e38f};
static const uint8_t ARR_BOOL[] = {1, 0, 0, 1, 1};
static const uint64_t ARR_U64[] = {0, UINT64_MAX, 1ull << 40};
static const int64_t ARR_I64[] = {INT64_MIN, INT64_MAX, -1};
static const double ARR_F64[] = {3.141592653589793, -2.5e-300, 1e300};

/* Tensor payloads: deterministic byte patterns of the exact size. */
static uint8_t *pattern(size_t n, uint8_t seed) {
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed + i * 7);
    return p;
}

typedef struct tensor_spec {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[4];
    size_t nbytes; /* by hand from the block sizes in the comment */
} tensor_spec;

static const tensor_spec TENSORS[] = {
    /* f32 [5]: 5 * 4 bytes */
    {"blk.0.attn_norm.weight", TENSOR_TYPE_F32, 1, {5, 1, 1, 1}, 20},
    /* f16 [3, 2]: 6 * 2 */
    {"blk.0.f16", TENSOR_TYPE_F16, 2, {3, 2, 1, 1}, 12},
    /* q4_1 [64, 3]: 2 blocks of 20 bytes per row, 3 rows */
    {"blk.0.attn_q.weight", TENSOR_TYPE_Q4_1, 2, {64, 3, 1, 1}, 120},
    /* q8_0 [32, 2, 2]: 1 block of 34 bytes per row, 4 rows */
    {"token_embd.weight", TENSOR_TYPE_Q8_0, 3, {32, 2, 2, 1}, 136},
    /* q4_K [256, 1, 1, 2]: 1 block of 144 bytes per row, 2 rows */
    {"blk.1.q4k", TENSOR_TYPE_Q4_K, 4, {256, 1, 1, 2}, 288},
    /* i32 [7]: 28 bytes */
    {"output.i32", TENSOR_TYPE_I32, 1, {7, 1, 1, 1}, 28},
};
#define N_TENSORS (sizeof TENSORS / sizeof TENSORS[0])

#define ARR(w, key, t, a) gw_arr((w), (key), (t), sizeof(a) / sizeof(a[0]), (a), sizeof(a[0]))

static void write_reference(gw *w, uint32_t alignment, bool tensors) {
    gw_init(w);
    if (alignment != 32) gw_alignment(w, alignment);
    GW_SCALAR(w, "t.u8", GGUF_VALUE_UINT8, uint8_t, 255);
    GW_SCALAR(w, "t.i8", GGUF_VALUE_INT8, int8_t, -128);
    GW_SCALAR(w, "t.u16", GGUF_VALUE_UINT16, uint16_t, 65535);
    GW_SCALAR(w, "t.i16", GGUF_VALUE_INT16, int16_t, -32768);
    GW_SCALAR(w, "t.u32", GGUF_VALUE_UINT32, uint32_t, 0xFFFFFFFFu);
    GW_SCALAR(w, "t.i32", GGUF_VALUE_INT32, int32_t, INT32_MIN);
    GW_SCALAR(w, "t.f32", GGUF_VALUE_FLOAT32, float, 3.25f);
    GW_SCALAR(w, "t.bool_true", GGUF_VALUE_BOOL, uint8_t, 1);
    GW_SCALAR(w, "t.bool_false", GGUF_VALUE_BOOL, uint8_t, 0);
    gw_str(w, "t.str", "hello, gguf");
    gw_str(w, "t.str_empty", "");
    GW_SCALAR(w, "t.u64", GGUF_VALUE_UINT64, uint64_t, UINT64_MAX);
    GW_SCALAR(w, "t.i64", GGUF_VALUE_INT64, int64_t, INT64_MIN);
    GW_SCALAR(w, "t.f64", GGUF_VALUE_FLOAT64, double, 2.718281828459045);
    ARR(w, "a.u8", GGUF_VALUE_UINT8, ARR_U8);
    ARR(w, "a.i8", GGUF_VALUE_INT8, ARR_I8);
    ARR(w, "a.u16", GGUF_VALUE_UINT16, ARR_U16);
    ARR(w, "a.i16", GGUF_VALUE_INT16, ARR_I16);
    ARR(w, "a.u32", GGUF_VALUE_UINT32, ARR_U32);
    ARR(w, "a.i32", GGUF_VALUE_INT32, ARR_I32);
    ARR(w, "a.f32", GGUF_VALUE_FLOAT32, ARR_F32);
    ARR(w, "a.bool", GGUF_VALUE_BOOL, ARR_BOOL);
    ARR(w, "a.u64", GGUF_VALUE_UINT64, ARR_U64);
    ARR(w, "a.i64", GGUF_VALUE_INT64, ARR_I64);
    ARR(w, "a.f64", GGUF_VALUE_FLOAT64, ARR_F64);
    gw_arr_str(w, "a.str", STRS, 4);
    gw_arr(w, "a.empty", GGUF_VALUE_UINT32, 0, NULL, 4);
    gw_arr_str(w, "a.str_empty", NULL, 0);
    if (!tensors) return;
    for (size_t i = 0; i < N_TENSORS; i++) {
        const tensor_spec *s = &TENSORS[i];
        uint8_t *p = pattern(s->nbytes, (uint8_t)i);
        gw_tensor(w, s->name, s->type, s->n_dims, s->ne, p, s->nbytes);
        free(p);
    }
}
#define N_REFERENCE_KEYS 28

static void check_arr(const gguf_ctx *ctx, const char *key, gguf_value_type et, const void *want,
                      uint64_t count, size_t esize) {
    gguf_value_type t = GGUF_VALUE_COUNT_;
    uint64_t n = 0;
    const void *data = NULL;
    assert_int_equal(gguf_get_arr(ctx, key, &t, &n), IS_OK);
    assert_int_equal(t, et);
    assert_int_equal(n, count);
    assert_int_equal(gguf_get_arr_data(ctx, key, &data), IS_OK);
    assert_memory_equal(data, want, count * esize);
}

static void check_reference(const gguf_ctx *ctx, uint32_t alignment, bool tensors) {
    assert_int_equal(gguf_version(ctx), 3);
    assert_int_equal(gguf_alignment(ctx), alignment);
    assert_int_equal(gguf_n_keys(ctx), N_REFERENCE_KEYS + (alignment != 32));

    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool b;
    gguf_string s;

    assert_int_equal(gguf_get_u32(ctx, "t.u8", &u32), IS_OK);
    assert_int_equal(u32, 255);
    assert_int_equal(gguf_get_i32(ctx, "t.i8", &i32), IS_OK);
    assert_int_equal(i32, -128);
    assert_int_equal(gguf_get_u32(ctx, "t.u16", &u32), IS_OK);
    assert_int_equal(u32, 65535);
    assert_int_equal(gguf_get_i64(ctx, "t.i16", &i64), IS_OK);
    assert_int_equal(i64, -32768);
    assert_int_equal(gguf_get_u32(ctx, "t.u32", &u32), IS_OK);
    assert_int_equal(u32, 0xFFFFFFFFu);
    assert_int_equal(gguf_get_i32(ctx, "t.i32", &i32), IS_OK);
    assert_int_equal(i32, INT32_MIN);
    assert_int_equal(gguf_get_f32(ctx, "t.f32", &f32), IS_OK);
    assert_true(f32 == 3.25f);
    assert_int_equal(gguf_get_bool(ctx, "t.bool_true", &b), IS_OK);
    assert_true(b);
    assert_int_equal(gguf_get_bool(ctx, "t.bool_false", &b), IS_OK);
    assert_false(b);
    assert_int_equal(gguf_get_str(ctx, "t.str", &s), IS_OK);
    assert_int_equal(s.len, 11);
    assert_memory_equal(s.data, "hello, gguf", 11);
    assert_int_equal(gguf_get_str(ctx, "t.str_empty", &s), IS_OK);
    assert_int_equal(s.len, 0);
    assert_int_equal(gguf_get_u64(ctx, "t.u64", &u64), IS_OK);
    assert_true(u64 == UINT64_MAX);
    assert_int_equal(gguf_get_i64(ctx, "t.i64", &i64), IS_OK);
    assert_true(i64 == INT64_MIN);
    assert_int_equal(gguf_get_f64(ctx, "t.f64", &f64), IS_OK);
    assert_true(f64 == 2.718281828459045);

    check_arr(ctx, "a.u8", GGUF_VALUE_UINT8, ARR_U8, 4, 1);
    check_arr(ctx, "a.i8", GGUF_VALUE_INT8, ARR_I8, 4, 1);
    check_arr(ctx, "a.u16", GGUF_VALUE_UINT16, ARR_U16, 3, 2);
    check_arr(ctx, "a.i16", GGUF_VALUE_INT16, ARR_I16, 3, 2);
    check_arr(ctx, "a.u32", GGUF_VALUE_UINT32, ARR_U32, 3, 4);
    check_arr(ctx, "a.i32", GGUF_VALUE_INT32, ARR_I32, 4, 4);
    check_arr(ctx, "a.f32", GGUF_VALUE_FLOAT32, ARR_F32, 4, 4);
    check_arr(ctx, "a.bool", GGUF_VALUE_BOOL, ARR_BOOL, 5, 1);
    check_arr(ctx, "a.u64", GGUF_VALUE_UINT64, ARR_U64, 3, 8);
    check_arr(ctx, "a.i64", GGUF_VALUE_INT64, ARR_I64, 3, 8);
    check_arr(ctx, "a.f64", GGUF_VALUE_FLOAT64, ARR_F64, 3, 8);
    check_arr(ctx, "a.empty", GGUF_VALUE_UINT32, NULL, 0, 4);

    gguf_value_type et;
    assert_int_equal(gguf_get_arr(ctx, "a.str", &et, &u64), IS_OK);
    assert_int_equal(et, GGUF_VALUE_STRING);
    assert_int_equal(u64, 4);
    for (uint64_t i = 0; i < 4; i++) {
        assert_int_equal(gguf_get_arr_str(ctx, "a.str", i, &s), IS_OK);
        assert_int_equal(s.len, strlen(STRS[i]));
        assert_memory_equal(s.data, STRS[i], s.len);
    }
    assert_int_equal(gguf_get_arr_str(ctx, "a.str", 4, &s), IS_ERR_INVALID_ARG);
    assert_int_equal(gguf_get_arr(ctx, "a.str_empty", &et, &u64), IS_OK);
    assert_int_equal(et, GGUF_VALUE_STRING);
    assert_int_equal(u64, 0);
    assert_int_equal(gguf_get_arr_str(ctx, "a.str_empty", 0, &s), IS_ERR_INVALID_ARG);
    const void *data;
    assert_int_equal(gguf_get_arr_data(ctx, "a.str", &data), IS_ERR_FORMAT);

    /* Index order is file order, and every key is found by name. */
    for (int64_t i = 0; i < gguf_n_keys(ctx); i++) {
        const char *k = gguf_key_name(ctx, i);
        assert_non_null(k);
        assert_int_equal(gguf_find_key(ctx, k), i);
    }
    assert_string_equal(gguf_key_name(ctx, alignment != 32 ? 1 : 0), "t.u8");
    assert_int_equal(gguf_key_type(ctx, gguf_find_key(ctx, "a.str")), GGUF_VALUE_ARRAY);
    assert_null(gguf_key_name(ctx, -1));
    assert_null(gguf_key_name(ctx, gguf_n_keys(ctx)));
    assert_int_equal(gguf_key_type(ctx, gguf_n_keys(ctx)), GGUF_VALUE_COUNT_);
    assert_int_equal(gguf_find_key(ctx, "t.u"), -1);
    assert_int_equal(gguf_find_key(ctx, "t.u88"), -1);

    if (!tensors) {
        assert_int_equal(gguf_n_tensors(ctx), 0);
        return;
    }
    assert_int_equal(gguf_n_tensors(ctx), N_TENSORS);
    assert_int_equal(gguf_data_offset(ctx) % alignment, 0);
    const uint8_t *base = gguf_file_data(ctx);
    uint64_t prev_end = 0;
    for (size_t i = 0; i < N_TENSORS; i++) {
        const tensor_spec *sp = &TENSORS[i];
        const gguf_tensor *t = gguf_tensor_at(ctx, (int64_t)i);
        assert_non_null(t);
        assert_ptr_equal(gguf_find_tensor(ctx, sp->name), t);
        assert_string_equal(t->name, sp->name);
        assert_int_equal(t->n_dims, sp->n_dims);
        for (int d = 0; d < 4; d++) assert_int_equal(t->ne[d], sp->ne[d]);
        assert_int_equal(t->type, sp->type);
        assert_int_equal(t->nbytes, sp->nbytes);
        assert_int_equal(t->n_elements, sp->ne[0] * sp->ne[1] * sp->ne[2] * sp->ne[3]);
        assert_int_equal(t->offset % alignment, 0);
        assert_true(t->offset >= prev_end);
        prev_end = t->offset + t->nbytes;
        const uint8_t *d = t->data;
        assert_ptr_equal(d, base + gguf_data_offset(ctx) + t->offset);
        assert_int_equal((size_t)(d - base) % alignment, 0);
        uint8_t *p = pattern(sp->nbytes, (uint8_t)i);
        assert_memory_equal(d, p, sp->nbytes);
        free(p);
    }
    assert_int_equal(gguf_data_offset(ctx) + prev_end, gguf_file_size(ctx));
    assert_null(gguf_tensor_at(ctx, -1));
    assert_null(gguf_tensor_at(ctx, (int64_t)N_TENSORS));
    assert_null(gguf_find_tensor(ctx, "token_embd"));
    assert_null(gguf_find_tensor(ctx, ""));
}

/* ---- valid files --------------------------------------------------------------- */

static void read_back(uint32_t alignment, bool tensors) {
    gw w;
    size_t size;
    write_reference(&w, alignment, tensors);
    uint8_t *f = gw_finish(&w, &size);
    gguf_ctx *ctx = NULL;
    is_status st = gguf_open_memory(f, size, &ctx);
    if (st != IS_OK) fail_msg("%s", is_error_last());
    char seed[64];
    snprintf(seed, sizeof seed, "test_ref_a%u_%s", alignment, tensors ? "tensors" : "kv_only");
    save_seed(seed, f, size);
    assert_ptr_equal(gguf_file_data(ctx), f);
    assert_int_equal(gguf_file_size(ctx), size);
    check_reference(ctx, alignment, tensors);
    gguf_close(ctx);
    free(f);
    gw_free(&w);
}

static void test_read_all_types(void **state) {
    (void)state;
    read_back(32, true);
    read_back(32, false);
}

static void test_custom_alignment(void **state) {
    (void)state;
    read_back(64, true);
    read_back(256, true);
    read_back(8, true);
    read_back(1, true);
}

static void test_open_file(void **state) {
    (void)state;
    gw w;
    size_t size;
    write_reference(&w, 32, true);
    uint8_t *f = gw_finish(&w, &size);
    char path[] = "/tmp/test_gguf_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, f, size), (ssize_t)size);
    close(fd);
    gguf_ctx *ctx = NULL;
    is_status st = gguf_open(path, &ctx);
    if (st != IS_OK) fail_msg("%s", is_error_last());
    assert_int_equal(gguf_file_size(ctx), size);
    check_reference(ctx, 32, true);
    gguf_close(ctx);

    /* A truncated file names the path. */
    assert_int_equal(truncate(path, (off_t)size - 1), 0);
    ctx = NULL;
    assert_int_equal(gguf_open(path, &ctx), IS_ERR_FORMAT);
    assert_null(ctx);
    assert_non_null(strstr(is_error_last(), path));
    assert_non_null(strstr(is_error_last(), "past end of file"));
    /* Empty file. */
    assert_int_equal(truncate(path, 0), 0);
    assert_int_equal(gguf_open(path, &ctx), IS_ERR_FORMAT);
    unlink(path);
    free(f);
    gw_free(&w);
}

static void test_open_io_errors(void **state) {
    (void)state;
    gguf_ctx *ctx = NULL;
    assert_int_equal(gguf_open("/nonexistent/dir/model.gguf", &ctx), IS_ERR_IO);
    assert_null(ctx);
    assert_non_null(strstr(is_error_last(), "/nonexistent/dir/model.gguf"));
    assert_non_null(strstr(is_error_last(), "No such file or directory"));
    assert_int_equal(gguf_open("/tmp", &ctx), IS_ERR_IO);
    assert_int_equal(gguf_open(NULL, &ctx), IS_ERR_INVALID_ARG);
    assert_int_equal(gguf_open_memory(NULL, 10, &ctx), IS_ERR_INVALID_ARG);
    assert_int_equal(gguf_open_memory("GGUF", 4, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(gguf_open_memory(NULL, 0, &ctx), IS_ERR_FORMAT);
    assert_null(ctx);
    gguf_close(NULL);
}

static void test_getter_conversions(void **state) {
    (void)state;
    gw w;
    size_t size;
    gw_init(&w);
    GW_SCALAR(&w, "u8", GGUF_VALUE_UINT8, uint8_t, 7);
    GW_SCALAR(&w, "i32_pos", GGUF_VALUE_INT32, int32_t, 42);
    GW_SCALAR(&w, "i64_neg", GGUF_VALUE_INT64, int64_t, -1);
    GW_SCALAR(&w, "u64_big", GGUF_VALUE_UINT64, uint64_t, 1ull << 32);
    GW_SCALAR(&w, "u64_huge", GGUF_VALUE_UINT64, uint64_t, 1ull << 63);
    GW_SCALAR(&w, "u32_big", GGUF_VALUE_UINT32, uint32_t, 0x80000000u);
    GW_SCALAR(&w, "i64_min32", GGUF_VALUE_INT64, int64_t, INT32_MIN);
    GW_SCALAR(&w, "f64", GGUF_VALUE_FLOAT64, double, 0.1);
    GW_SCALAR(&w, "b", GGUF_VALUE_BOOL, uint8_t, 1);
    gw_str(&w, "s", "x");
    ARR(&w, "arr", GGUF_VALUE_UINT32, ARR_U32);
    uint8_t *f = gw_finish(&w, &size);
    gguf_ctx *ctx = NULL;
    assert_int_equal(gguf_open_memory(f, size, &ctx), IS_OK);

    uint32_t u32 = 99;
    int32_t i32 = 99;
    uint64_t u64 = 99;
    int64_t i64 = 99;
    float f32 = 99;
    double f64 = 99;
    bool b = false;
    gguf_string s = {NULL, 99};

    assert_int_equal(gguf_get_u32(ctx, "u8", &u32), IS_OK);
    assert_int_equal(u32, 7);
    assert_int_equal(gguf_get_u64(ctx, "i32_pos", &u64), IS_OK);
    assert_int_equal(u64, 42);
    assert_int_equal(gguf_get_i32(ctx, "i64_neg", &i32), IS_OK);
    assert_int_equal(i32, -1);
    assert_int_equal(gguf_get_i32(ctx, "i64_min32", &i32), IS_OK);
    assert_int_equal(i32, INT32_MIN);
    assert_int_equal(gguf_get_i64(ctx, "u64_big", &i64), IS_OK);
    assert_int_equal(i64, 1ll << 32);
    assert_int_equal(gguf_get_f32(ctx, "f64", &f32), IS_OK);
    assert_true(f32 == 0.1f);
    assert_int_equal(gguf_get_f64(ctx, "f64", &f64), IS_OK);
    assert_true(f64 == 0.1);

    /* Lossy or wrong-typed reads fail and leave the output alone. */
    u32 = 99;
    i32 = 99;
    u64 = 99;
    i64 = 99;
    f32 = 99;
    assert_int_equal(gguf_get_u32(ctx, "i64_neg", &u32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u64(ctx, "i64_neg", &u64), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(ctx, "u64_big", &u32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_i32(ctx, "u32_big", &i32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_i64(ctx, "u64_huge", &i64), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(ctx, "b", &u32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(ctx, "f64", &u32), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "'f64'"));
    assert_int_equal(gguf_get_f32(ctx, "u8", &f32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_bool(ctx, "u8", &b), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_str(ctx, "u8", &s), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(ctx, "s", &u32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(ctx, "arr", &u32), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_arr(ctx, "s", NULL, NULL), IS_ERR_FORMAT);
    assert_int_equal(gguf_get_arr_str(ctx, "arr", 0, &s), IS_ERR_FORMAT);
    assert_int_equal(u32, 99);
    assert_int_equal(i32, 99);
    assert_int_equal(u64, 99);
    assert_int_equal(i64, 99);
    assert_true(f32 == 99);
    assert_false(b);
    assert_null(s.data);

    assert_int_equal(gguf_get_u32(ctx, "llama.block_count", &u32), IS_ERR_NOT_FOUND);
    assert_non_null(strstr(is_error_last(), "llama.block_count"));
    assert_int_equal(gguf_get_arr(ctx, "missing", NULL, NULL), IS_ERR_NOT_FOUND);
    assert_int_equal(u32, 99);
    assert_int_equal(gguf_get_u32(ctx, "u8", NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(gguf_n_tensors(ctx), 0);
    assert_int_equal(gguf_alignment(ctx), 32);
    gguf_close(ctx);
    free(f);
    gw_free(&w);
}

/* Edge shapes that are valid: a scalar (n_dims 0) and an empty tensor. */
static void test_edge_tensors(void **state) {
    (void)state;
    gw w;
    size_t size;
    gw_init(&w);
    float one = 1.0f, v[4] = {1, 2, 3, 4};
    gw_tensor(&w, "scalar", TENSOR_TYPE_F32, 0, NULL, &one, 4);
    gw_tensor(&w, "empty", TENSOR_TYPE_F32, 2, (int64_t[]){4, 0}, NULL, 0);
    gw_tensor(&w, "vec", TENSOR_TYPE_F32, 1, (int64_t[]){4}, v, 16);
    uint8_t *f = gw_finish(&w, &size);
    gguf_ctx *ctx = NULL;
    is_status st = gguf_open_memory(f, size, &ctx);
    if (st != IS_OK) fail_msg("%s", is_error_last());
    const gguf_tensor *t = gguf_find_tensor(ctx, "scalar");
    assert_non_null(t);
    assert_int_equal(t->n_dims, 0);
    for (int d = 0; d < 4; d++) assert_int_equal(t->ne[d], 1);
    assert_int_equal(t->n_elements, 1);
    assert_int_equal(t->nbytes, 4);
    assert_memory_equal(t->data, &one, 4);
    t = gguf_find_tensor(ctx, "empty");
    assert_non_null(t);
    assert_int_equal(t->ne[1], 0);
    assert_int_equal(t->n_elements, 0);
    assert_int_equal(t->nbytes, 0);
    t = gguf_find_tensor(ctx, "vec");
    assert_non_null(t);
    assert_memory_equal(t->data, v, 16);
    gguf_close(ctx);
    free(f);
    gw_free(&w);
}

/* ---- versions and magic ------------------------------------------------------------ */

static void test_versions(void **state) {
    (void)state;
    gw w;
    size_t size;
    write_reference(&w, 32, true);
    uint8_t *f = gw_finish(&w, &size);
    gguf_ctx *ctx = NULL;

    put_at_u32(f, 4, 2);
    assert_int_equal(gguf_open_memory(f, size, &ctx), IS_OK);
    assert_int_equal(gguf_version(ctx), 2);
    gguf_close(ctx);

    put_at_u32(f, 4, 1);
    expect_open(f, size, IS_ERR_UNSUPPORTED, "version 1");
    put_at_u32(f, 4, 4);
    expect_open(f, size, IS_ERR_UNSUPPORTED, "version 4");
    put_at_u32(f, 4, 0);
    expect_open(f, size, IS_ERR_UNSUPPORTED, "version 0");
    put_at_u32(f, 4, 0x03000000u); /* a big-endian v3 file */
    expect_open(f, size, IS_ERR_UNSUPPORTED, "big-endian");
    put_at_u32(f, 4, 3);

    memcpy(f, "GGML", 4);
    expect_open(f, size, IS_ERR_FORMAT, "magic");
    memcpy(f, "GGUF", 4);
    expect_open(f, size, IS_OK, NULL);
    free(f);
    gw_free(&w);
}

/* ---- truncation at every byte -------------------------------------------------------- */

static void truncate_everywhere(uint32_t alignment, bool tensors) {
    gw w;
    size_t size;
    write_reference(&w, alignment, tensors);
    uint8_t *f = gw_finish(&w, &size);
    for (size_t len = 0; len < size; len++) {
        uint8_t *copy = malloc(len ? len : 1);
        assert_non_null(copy);
        memcpy(copy, f, len);
        gguf_ctx *ctx = NULL;
        is_status st = gguf_open_memory(copy, len, &ctx);
        if (st != IS_ERR_FORMAT)
            fail_msg("prefix of %zu of %zu bytes: %s (%s)", len, size, is_status_to_string(st),
                     is_error_last());
        assert_null(ctx);
        free(copy);
    }
    expect_open(f, size, IS_OK, NULL);
    free(f);
    gw_free(&w);
}

static void test_truncate_every_offset(void **state) {
    (void)state;
    truncate_everywhere(32, true);
    truncate_everywhere(64, true);
    truncate_everywhere(32, false);
}

/* ---- corrupt fields ------------------------------------------------------------------ */

/* A small file with one of everything the corruption tests poke at; the
 * positions of the poked fields are returned in `at`. */
typedef struct positions {
    size_t str_value;  /* length field of string value "s" */
    size_t key0;       /* length field of the first key */
    size_t arr_num;    /* element type of array "n" (count at +4) */
    size_t arr_str;    /* element type of array "ss" (count at +4) */
    size_t bool_value; /* the byte of bool "b" */
    size_t t0, t1, t2; /* info records of tensors "t0" (q4_1 [32, 2]),
                          "t1" (f32 [8]) and "t2" (f32 [2, 2, 2]) */
} positions;

static uint8_t *corruptible(positions *at, size_t *size) {
    static const char *const ss[] = {"x", "yy"};
    static const uint16_t n[] = {1, 2, 3};
    gw w;
    gw_init(&w);
    at->key0 = kv_pos(w.kv.len);
    at->str_value = gw_str(&w, "s", "value");
    at->arr_num = gw_arr(&w, "n", GGUF_VALUE_UINT16, 3, n, 2);
    at->arr_str = gw_arr_str(&w, "ss", ss, 2);
    uint8_t one = 1;
    at->bool_value = gw_scalar(&w, "b", GGUF_VALUE_BOOL, &one, 1);
    uint8_t q[40] = {0}, x[32] = {0};
    at->t0 = gw_tensor(&w, "t0", TENSOR_TYPE_Q4_1, 2, (int64_t[]){32, 2}, q, 40);
    at->t1 = gw_tensor(&w, "t1", TENSOR_TYPE_F32, 1, (int64_t[]){8}, x, 32);
    at->t2 = gw_tensor(&w, "t2", TENSOR_TYPE_F32, 3, (int64_t[]){2, 2, 2}, x, 32);
    uint8_t *f = gw_finish(&w, size);
    gw_free(&w);
    save_seed("test_small", f, *size);
    return f;
}

/* Offsets inside a tensor info record named with 2 bytes. */
#define TI_NDIMS 10
#define TI_NE0   14
static size_t ti_type(uint8_t *f, size_t t) {
    uint32_t n_dims;
    memcpy(&n_dims, f + t + TI_NDIMS, 4);
    return t + TI_NE0 + 8 * n_dims;
}
static size_t ti_offset(uint8_t *f, size_t t) { return ti_type(f, t) + 4; }

typedef void (*corrupt_fn)(uint8_t *f, size_t size, const positions *at);

static void expect_corrupt(corrupt_fn fn, is_status want, const char *msg) {
    positions at;
    size_t size;
    uint8_t *f = corruptible(&at, &size);
    expect_open(f, size, IS_OK, NULL); /* intact it is valid */
    fn(f, size, &at);
    expect_open(f, size, want, msg);
    free(f);
}

#define CORRUPT(name, body)                                                                        \
    static void name(uint8_t *f, size_t size, const positions *at) {                               \
        (void)f;                                                                                   \
        (void)size;                                                                                \
        (void)at;                                                                                  \
        body;                                                                                      \
    }

CORRUPT(str_len_huge, put_at_u64(f, at->str_value, 1ull << 63))
CORRUPT(str_len_past, put_at_u64(f, at->str_value, size))
CORRUPT(key_len_huge, put_at_u64(f, at->key0, UINT64_MAX))
CORRUPT(key_empty, put_at_u64(f, at->key0, 0))
CORRUPT(key_nul, f[at->key0 + 8] = 0)
CORRUPT(arr_count_huge, put_at_u64(f, at->arr_num + 4, 1ull << 62))
CORRUPT(arr_count_wrap, put_at_u64(f, at->arr_num + 4, (UINT64_MAX / 2) + 2))
CORRUPT(arr_str_count_huge, put_at_u64(f, at->arr_str + 4, 1ull << 62))
CORRUPT(arr_str_len_huge, put_at_u64(f, at->arr_str + 12, 1ull << 63))
CORRUPT(arr_elem_unknown, put_at_u32(f, at->arr_num, 99))
CORRUPT(arr_nested, put_at_u32(f, at->arr_num, GGUF_VALUE_ARRAY))
CORRUPT(value_type_unknown, put_at_u32(f, at->str_value - 4, 99))
CORRUPT(bool_two, f[at->bool_value] = 2)
CORRUPT(kv_count_huge, put_at_u64(f, 16, 1ull << 62))
CORRUPT(kv_count_plus1, put_at_u64(f, 16, 5))
CORRUPT(tensor_count_huge, put_at_u64(f, 8, UINT64_MAX))
CORRUPT(n_dims_9, put_at_u32(f, at->t0 + TI_NDIMS, 9))
CORRUPT(ne_negative, put_at_u64(f, at->t0 + TI_NE0 + 8, 1ull << 63))
CORRUPT(ne_overflow, put_at_u64(f, at->t0 + TI_NE0 + 8, 1ull << 62);
        put_at_u64(f, at->t0 + TI_NE0, 1ull << 40))
CORRUPT(ne_zero_hides_overflow, put_at_u64(f, at->t2 + TI_NE0, 0);
        put_at_u64(f, at->t2 + TI_NE0 + 8, 1ull << 62);
        put_at_u64(f, at->t2 + TI_NE0 + 16, 1ull << 62))
CORRUPT(ne_too_big, put_at_u64(f, at->t0 + TI_NE0 + 8, 4))
CORRUPT(ne0_not_block, put_at_u64(f, at->t0 + TI_NE0, 16))
CORRUPT(type_99, put_at_u32(f, ti_type(f, at->t0), 99))
CORRUPT(type_gap, put_at_u32(f, ti_type(f, at->t0), 4)) /* Q4_2, removed */
CORRUPT(offset_past_eof, put_at_u64(f, ti_offset(f, at->t1), 1ull << 40))
CORRUPT(offset_wrap, put_at_u64(f, ti_offset(f, at->t1), UINT64_MAX - 31))
CORRUPT(offset_misaligned, put_at_u64(f, ti_offset(f, at->t1), 48))
CORRUPT(offset_overlap, put_at_u64(f, ti_offset(f, at->t1), 32))
CORRUPT(dup_tensor, memcpy(f + at->t1 + 8, "t0", 2))
CORRUPT(dup_key, memcpy(f + at->key0 + 8, "n", 1))

static void test_corrupt_fields(void **state) {
    (void)state;
    expect_corrupt(str_len_huge, IS_ERR_FORMAT, "string 's'");
    expect_corrupt(str_len_past, IS_ERR_FORMAT, "past end of file");
    expect_corrupt(key_len_huge, IS_ERR_FORMAT, "byte 24");
    expect_corrupt(key_empty, IS_ERR_FORMAT, "empty");
    expect_corrupt(key_nul, IS_ERR_FORMAT, "NUL");
    expect_corrupt(arr_count_huge, IS_ERR_FORMAT, "array 'n'");
    expect_corrupt(arr_count_wrap, IS_ERR_FORMAT, "array 'n'");
    expect_corrupt(arr_str_count_huge, IS_ERR_FORMAT, "array 'ss'");
    expect_corrupt(arr_str_len_huge, IS_ERR_FORMAT, "array 'ss' string 0");
    expect_corrupt(arr_elem_unknown, IS_ERR_FORMAT, "unknown element type 99");
    expect_corrupt(arr_nested, IS_ERR_UNSUPPORTED, "array of arrays");
    expect_corrupt(value_type_unknown, IS_ERR_FORMAT, "unknown value type 99");
    expect_corrupt(bool_two, IS_ERR_FORMAT, "bool 2");
    expect_corrupt(kv_count_huge, IS_ERR_FORMAT, "header claims");
    expect_corrupt(kv_count_plus1, IS_ERR_FORMAT, NULL);
    expect_corrupt(tensor_count_huge, IS_ERR_FORMAT, "header claims");
    expect_corrupt(n_dims_9, IS_ERR_FORMAT, "9 dimensions");
    expect_corrupt(ne_negative, IS_ERR_FORMAT, "negative");
    expect_corrupt(ne_overflow, IS_ERR_FORMAT, "tensor 't0'");
    expect_corrupt(ne_zero_hides_overflow, IS_ERR_FORMAT, "overflows");
    expect_corrupt(ne_too_big, IS_ERR_FORMAT, "overlaps");
    expect_corrupt(ne0_not_block, IS_ERR_FORMAT, "block size");
    expect_corrupt(type_99, IS_ERR_FORMAT, "unknown type 99");
    expect_corrupt(type_gap, IS_ERR_FORMAT, "unknown type 4");
    expect_corrupt(offset_past_eof, IS_ERR_FORMAT,
                   "tensor 't1' data [1099511627776+32] past end of file");
    expect_corrupt(offset_wrap, IS_ERR_FORMAT, "past end of file");
    expect_corrupt(offset_misaligned, IS_ERR_FORMAT, "alignment");
    expect_corrupt(offset_overlap, IS_ERR_FORMAT, "overlaps");
    expect_corrupt(dup_tensor, IS_ERR_FORMAT, "duplicate tensor 't0'");
    expect_corrupt(dup_key, IS_ERR_FORMAT, "duplicate key 'n'");
}

static void test_bad_alignment(void **state) {
    (void)state;
    const uint32_t bad[] = {0, 3, 48, 0xFFFFFFFFu};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gw w;
        size_t size;
        gw_init(&w);
        GW_SCALAR(&w, "general.alignment", GGUF_VALUE_UINT32, uint32_t, bad[i]);
        uint8_t *f = gw_finish(&w, &size);
        expect_open(f, size, IS_ERR_FORMAT, "power of two");
        free(f);
        gw_free(&w);
    }
    gw w;
    size_t size;
    gw_init(&w);
    GW_SCALAR(&w, "general.alignment", GGUF_VALUE_UINT64, uint64_t, 32);
    uint8_t *f = gw_finish(&w, &size);
    expect_open(f, size, IS_ERR_FORMAT, "expected u32");
    free(f);
    gw_free(&w);
}

/* Random byte damage: whatever happens, a status and no crash; a file that
 * still opens must be walkable end to end. */
static void walk(const gguf_ctx *ctx) {
    for (int64_t i = 0; i < gguf_n_keys(ctx); i++) {
        const char *k = gguf_key_name(ctx, i);
        assert_int_equal(gguf_find_key(ctx, k), i);
        gguf_string s;
        uint64_t n = 0;
        gguf_value_type et;
        const void *d;
        uint32_t u32;
        double f64;
        bool b;
        (void)gguf_get_u32(ctx, k, &u32);
        (void)gguf_get_f64(ctx, k, &f64);
        (void)gguf_get_bool(ctx, k, &b);
        if (gguf_get_str(ctx, k, &s) == IS_OK && s.len)
            (void)((volatile const char *)s.data)[s.len - 1];
        if (gguf_get_arr(ctx, k, &et, &n) != IS_OK) continue;
        if (et == GGUF_VALUE_STRING) {
            for (uint64_t j = 0; j < n; j++) {
                assert_int_equal(gguf_get_arr_str(ctx, k, j, &s), IS_OK);
                if (s.len) (void)((volatile const char *)s.data)[s.len - 1];
            }
        } else {
            assert_int_equal(gguf_get_arr_data(ctx, k, &d), IS_OK);
        }
    }
    for (int64_t i = 0; i < gguf_n_tensors(ctx); i++) {
        const gguf_tensor *t = gguf_tensor_at(ctx, i);
        assert_ptr_equal(gguf_find_tensor(ctx, t->name), t);
        if (t->nbytes) (void)((volatile const uint8_t *)t->data)[t->nbytes - 1];
    }
}

static void test_random_damage(void **state) {
    (void)state;
    gw w;
    size_t size;
    write_reference(&w, 32, true);
    uint8_t *f = gw_finish(&w, &size);
    uint8_t *copy = malloc(size);
    assert_non_null(copy);
    gguf_ctx *intact = NULL;
    assert_int_equal(gguf_open_memory(f, size, &intact), IS_OK);
    size_t header = (size_t)gguf_data_offset(intact);
    gguf_close(intact);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int opened = 0, failed = 0;
    for (int iter = 0; iter < 20000; iter++) {
        memcpy(copy, f, size);
        int flips = 1 + iter % 4;
        for (int k = 0; k < flips; k++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            /* Odd iterations damage only the header and tensor infos,
             * where the structure is. */
            size_t span = (iter & 1) ? header : size;
            size_t pos = (size_t)(rng % span);
            copy[pos] = (uint8_t)(rng >> 32);
        }
        gguf_ctx *ctx = NULL;
        is_status st = gguf_open_memory(copy, size, &ctx);
        if (st == IS_OK) {
            walk(ctx);
            gguf_close(ctx);
            opened++;
        } else {
            assert_true(st == IS_ERR_FORMAT || st == IS_ERR_UNSUPPORTED);
            assert_null(ctx);
            failed++;
        }
    }
    /* Both outcomes happen, or the test is not exercising anything. */
    assert_true(opened > 0 && failed > 0);
    free(copy);
    free(f);
    gw_free(&w);
}

/* ---- the default model --------------------------------------------------------------- */

static void test_default_model(void **state) {
    (void)state;
    struct stat sb;
    if (stat(IS_DEFAULT_MODEL, &sb) != 0) { TEST_SKIP(TEST_NEEDS_MODEL); }
    gguf_ctx *ctx = NULL;
    is_status st = gguf_open(IS_DEFAULT_MODEL, &ctx);
    if (st != IS_OK) fail_msg("%s", is_error_last());
    assert_int_equal(gguf_version(ctx), 3);
    assert_int_equal(gguf_n_tensors(ctx), 272);
    uint32_t u32;
    assert_int_equal(gguf_get_u32(ctx, "llama.block_count", &u32), IS_OK);
    assert_int_equal(u32, 30);
    gguf_string s;
    assert_int_equal(gguf_get_str(ctx, "general.architecture", &s), IS_OK);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.data, "llama", 5);
    assert_int_equal(gguf_get_str(ctx, "tokenizer.ggml.pre", &s), IS_OK);
    assert_int_equal(s.len, 6);
    assert_memory_equal(s.data, "smollm", 6);
    gguf_value_type et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(ctx, "tokenizer.ggml.tokens", &et, &n), IS_OK);
    assert_int_equal(et, GGUF_VALUE_STRING);
    assert_int_equal(n, 49152);
    const gguf_tensor *t = gguf_find_tensor(ctx, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TENSOR_TYPE_Q8_0);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 576);
    assert_int_equal(t->ne[1], 49152);
    assert_int_equal(t->nbytes, (size_t)576 / 32 * 34 * 49152);
    walk(ctx);
    gguf_close(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_all_types),     cmocka_unit_test(test_custom_alignment),
        cmocka_unit_test(test_open_file),          cmocka_unit_test(test_open_io_errors),
        cmocka_unit_test(test_getter_conversions), cmocka_unit_test(test_edge_tensors),
        cmocka_unit_test(test_versions),           cmocka_unit_test(test_truncate_every_offset),
        cmocka_unit_test(test_corrupt_fields),     cmocka_unit_test(test_bad_alignment),
        cmocka_unit_test(test_random_damage),      cmocka_unit_test(test_default_model),
    };
    return test_run_group(tests, NULL, NULL);
}

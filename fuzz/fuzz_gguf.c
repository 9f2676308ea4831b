/*
 * fuzz_gguf: libFuzzer target for the GGUF reader.
 *
 * Parses the input with gguf_open_memory() and, when it opens, walks every
 * key, every typed getter, every array element and every tensor, touching
 * the first and last byte of each span the reader hands out, so ASan sees any
 * span that reaches outside the input. Invariants the reader promises (index
 * lookups agree, spans lie inside the file) are checked with __builtin_trap()
 * so a violation is reported as a crash.
 */
#include "gguf/gguf.h"
#include "gguf/tensor_type.h"

#include <stdint.h>
#include <string.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

static volatile uint8_t sink;

/* Touches [p, p + n) at both ends and checks it lies inside the file. */
static void touch(const uint8_t *file, size_t size, const void *p, uint64_t n) {
    const uint8_t *b = p;
    CHECK(b >= file && (uint64_t)(b - file) <= size);
    CHECK(n <= size - (size_t)(b - file));
    if (n) sink ^= b[0] ^ b[n - 1];
}

static void walk_key(const gguf_ctx *ctx, const uint8_t *file, size_t size, int64_t i) {
    const char *k = gguf_key_name(ctx, i);
    CHECK(k != NULL && k[0] != '\0');
    CHECK(gguf_find_key(ctx, k) == i);
    gguf_value_type t = gguf_key_type(ctx, i);
    CHECK(t < GGUF_VALUE_COUNT_);

    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool b;
    gguf_string s;
    is_status st;
    st = gguf_get_u32(ctx, k, &u32);
    CHECK(st == IS_OK || st == IS_ERR_FORMAT);
    st = gguf_get_i32(ctx, k, &i32);
    CHECK(st == IS_OK || st == IS_ERR_FORMAT);
    st = gguf_get_u64(ctx, k, &u64);
    CHECK(st == IS_OK || st == IS_ERR_FORMAT);
    st = gguf_get_i64(ctx, k, &i64);
    CHECK(st == IS_OK || st == IS_ERR_FORMAT);
    st = gguf_get_f32(ctx, k, &f32);
    CHECK((st == IS_OK) == (t == GGUF_VALUE_FLOAT32 || t == GGUF_VALUE_FLOAT64));
    st = gguf_get_f64(ctx, k, &f64);
    CHECK((st == IS_OK) == (t == GGUF_VALUE_FLOAT32 || t == GGUF_VALUE_FLOAT64));
    st = gguf_get_bool(ctx, k, &b);
    CHECK((st == IS_OK) == (t == GGUF_VALUE_BOOL));
    st = gguf_get_str(ctx, k, &s);
    CHECK((st == IS_OK) == (t == GGUF_VALUE_STRING));
    if (st == IS_OK) touch(file, size, s.data, s.len);

    gguf_value_type et;
    uint64_t n;
    st = gguf_get_arr(ctx, k, &et, &n);
    CHECK((st == IS_OK) == (t == GGUF_VALUE_ARRAY));
    if (st != IS_OK) return;
    CHECK(et < GGUF_VALUE_COUNT_ && et != GGUF_VALUE_ARRAY);
    const void *d;
    st = gguf_get_arr_data(ctx, k, &d);
    if (et == GGUF_VALUE_STRING) {
        CHECK(st == IS_ERR_FORMAT);
        for (uint64_t j = 0; j < n; j++) {
            CHECK(gguf_get_arr_str(ctx, k, j, &s) == IS_OK);
            touch(file, size, s.data, s.len);
        }
        CHECK(gguf_get_arr_str(ctx, k, n, &s) == IS_ERR_INVALID_ARG);
    } else {
        static const uint8_t esize[GGUF_VALUE_COUNT_] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
        CHECK(st == IS_OK);
        CHECK(n <= size / esize[et]);
        touch(file, size, d, n * esize[et]);
        if (et == GGUF_VALUE_BOOL)
            for (uint64_t j = 0; j < n; j++) CHECK(((const uint8_t *)d)[j] <= 1);
        CHECK(gguf_get_arr_str(ctx, k, 0, &s) == IS_ERR_FORMAT);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_ctx *ctx = NULL;
    is_status st = gguf_open_memory(data, size, &ctx);
    if (st != IS_OK) {
        CHECK(ctx == NULL);
        CHECK(st == IS_ERR_FORMAT || st == IS_ERR_UNSUPPORTED);
        return 0;
    }
    CHECK(gguf_file_data(ctx) == data && gguf_file_size(ctx) == size);
    uint32_t a = gguf_alignment(ctx);
    CHECK(a != 0 && (a & (a - 1)) == 0);
    CHECK(gguf_version(ctx) == 2 || gguf_version(ctx) == 3);
    for (int64_t i = 0; i < gguf_n_keys(ctx); i++) walk_key(ctx, data, size, i);
    CHECK(gguf_key_name(ctx, gguf_n_keys(ctx)) == NULL);
    /* Empty names are rejected at open, so "" is never present. */
    uint32_t u32 = 7;
    CHECK(gguf_find_key(ctx, "") == -1 && gguf_find_tensor(ctx, "") == NULL);
    CHECK(gguf_get_u32(ctx, "", &u32) == IS_ERR_NOT_FOUND && u32 == 7);

    for (int64_t i = 0; i < gguf_n_tensors(ctx); i++) {
        const gguf_tensor *t = gguf_tensor_at(ctx, i);
        CHECK(t != NULL && gguf_find_tensor(ctx, t->name) == t);
        CHECK(t->n_dims <= GGUF_MAX_DIMS);
        CHECK(tensor_type_get(t->type) != NULL);
        CHECK(t->offset % a == 0);
        CHECK(t->nbytes ==
              tensor_type_row_bytes(t->type, t->ne[0]) * (size_t)(t->ne[1] * t->ne[2] * t->ne[3]));
        touch(data, size, t->data, t->nbytes);
    }
    CHECK(gguf_tensor_at(ctx, gguf_n_tensors(ctx)) == NULL);
    gguf_close(ctx);
    return 0;
}

/* Fact-KV records: XXH64, round trips per dtype, the documented byte layout,
 * refusals of records made for something else, and corruption: every byte
 * flipped, every truncation, hostile headers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "core/status.h"
#include "kv/fact_record.h"
#include "gguf/quant.h"
#include "core/fp8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------ */

static fact_kv_meta small_meta(kv_dtype dtype, int32_t n_layers, int32_t n_kv_heads,
                               int32_t head_dim, int32_t n_tokens) {
    fact_kv_meta m;
    memset(&m, 0, sizeof m);
    strcpy(m.model_fingerprint, "0123456789abcdef");
    m.dtype = dtype;
    m.n_layers = n_layers;
    m.n_kv_heads = n_kv_heads;
    m.head_dim = head_dim;
    m.n_tokens = n_tokens;
    m.rope_layout = 0;
    m.rope_n_rot = head_dim;
    m.rope_freq_base = 10000.0f;
    m.rope_freq_scale = 1.0f;
    m.rope_factors_hash = 0;
    m.window = 3;
    m.text_hash = fact_text_hash("Alice moved to Paris.", 21);
    return m;
}

static uint64_t rng_state = 0x1234567;
static float rnd(void) { /* uniform in [-4, 4), with plenty of low mantissa bits */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return ((float)(rng_state >> 40) / (float)(1u << 24) - 0.5f) * 8.0f;
}

/* k, v in f32 and narrowed to the meta's dtype; tokens 100 + i. */
typedef struct sample {
    fact_kv_meta m;
    size_t n;        /* elements of k (= of v) */
    float *kf, *vf;  /* [n] */
    void *k, *v;     /* [n] in m.dtype */
    int32_t *tokens; /* [n_tokens] */
} sample;

static sample sample_make(fact_kv_meta m) {
    sample s = {.m = m};
    s.n = (size_t)m.n_layers * m.n_tokens * m.n_kv_heads * m.head_dim;
    s.kf = malloc(s.n * sizeof(float));
    s.vf = malloc(s.n * sizeof(float));
    s.k = malloc(s.n * 4 + 64); /* fp8's scales fit in the slack of 4 bytes a value */
    s.v = malloc(s.n * 4 + 64);
    s.tokens = malloc((size_t)m.n_tokens * sizeof(int32_t));
    assert_non_null(s.kf);
    assert_non_null(s.tokens);
    for (size_t i = 0; i < s.n; i++) {
        s.kf[i] = rnd();
        s.vf[i] = rnd();
    }
    for (int32_t i = 0; i < m.n_tokens; i++) s.tokens[i] = 100 + 7 * i;
    fact_kv_narrow(&m, s.kf, s.k);
    fact_kv_narrow(&m, s.vf, s.v);
    return s;
}

static void sample_free(sample *s) {
    free(s->kf);
    free(s->vf);
    free(s->k);
    free(s->v);
    free(s->tokens);
}

static void assert_meta_equal(const fact_kv_meta *a, const fact_kv_meta *b) {
    assert_string_equal(a->model_fingerprint, b->model_fingerprint);
    assert_int_equal(a->dtype, b->dtype);
    assert_int_equal(a->n_layers, b->n_layers);
    assert_int_equal(a->n_kv_heads, b->n_kv_heads);
    assert_int_equal(a->head_dim, b->head_dim);
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_int_equal(a->rope_layout, b->rope_layout);
    assert_int_equal(a->rope_n_rot, b->rope_n_rot);
    assert_true(a->rope_freq_base == b->rope_freq_base);
    assert_true(a->rope_freq_scale == b->rope_freq_scale);
    assert_true(a->rope_factors_hash == b->rope_factors_hash);
    assert_int_equal(a->window, b->window);
    assert_true(a->text_hash == b->text_hash);
}

/* With IS_FACT_SEED_DIR set, valid records made here are also saved there
 * (scripts/fuzz_fact_record.sh uses them as the fuzzer's seed corpus). */
static void save_seed(const char *name, const void *rec, size_t size) {
    const char *dir = getenv("IS_FACT_SEED_DIR");
    if (dir == NULL || dir[0] == '\0') return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.fkv", dir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(rec, 1, size, fp), size);
    assert_int_equal(fclose(fp), 0);
}

/* ---- XXH64 ------------------------------------------------------------------- */

/* Expected values from the reference xxHash implementation through Python's
 * `xxhash` package 4.1.0: xxhash.xxh64_intdigest(data) (seed 0), printed by
 * tools/make_xxh64_golden.py. */
static void test_xxh64_reference_vectors(void **state) {
    assert_true(fact_text_hash(NULL, 0) == 0xef46db3751d8e999ull);
    assert_true(fact_text_hash("a", 1) == 0xd24ec4f1a98c6e5bull);
    assert_true(fact_text_hash("abc", 3) == 0x44bc2cf5ad770999ull);
    /* bytes(range(256)) * 3 + b'xyz': 771 bytes, every stripe and tail path. */
    char buf[771];
    for (int i = 0; i < 768; i++) buf[i] = (char)(i & 255);
    memcpy(buf + 768, "xyz", 3);
    assert_true(fact_text_hash(buf, sizeof buf) == 0xe921a1b45bd779f8ull);
    /* A different text, a different hash; factors: NULL gives 0. */
    assert_true(fact_text_hash("abd", 3) != fact_text_hash("abc", 3));
    assert_true(fact_rope_factors_hash(NULL, 64) == 0);
    float f[4] = {1, 2, 4, 8};
    assert_true(fact_rope_factors_hash(f, 4) == fact_text_hash((const char *)f, sizeof f));
}

static void reseal(uint8_t *b, size_t len);

/* ---- round trips -------------------------------------------------------------- */

/* Half an ulp relative, plus half the smallest subnormal for f16 values
 * that land below its normal range. */
static bool close_enough(float got, float want, double rel_tol, double abs_tol) {
    if (rel_tol == 0) return got == want;
    return fabs((double)got - (double)want) <= rel_tol * fabs((double)want) + abs_tol;
}

static void round_trip(kv_dtype dtype, double rel_tol, double abs_tol) {
    sample s = sample_make(small_meta(dtype, 3, 2, 8, 5));
    void *buf = NULL;
    size_t len = 0;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    size_t want_len;
    assert_int_equal(fact_record_size(&s.m, &want_len), IS_OK);
    assert_int_equal(len, want_len);

    fact_kv_meta m;
    const int32_t *tok;
    const void *k, *v;
    assert_int_equal(fact_record_parse(buf, len, &m, &tok, &k, &v), IS_OK);
    assert_meta_equal(&m, &s.m);
    assert_memory_equal(tok, s.tokens, (size_t)s.m.n_tokens * 4);
    /* The stored bytes are exactly the caller's. */
    assert_memory_equal(k, s.k, s.n * kv_dtype_size(dtype));
    assert_memory_equal(v, s.v, s.n * kv_dtype_size(dtype));
    save_seed(kv_dtype_name(dtype), buf, len);
    /* Sections are 64-byte aligned inside the 64-byte-aligned buffer. */
    assert_int_equal((uintptr_t)buf % 64, 0);
    assert_int_equal((uintptr_t)k % 64, 0);
    assert_int_equal((uintptr_t)v % 64, 0);

    /* Widened back, within the dtype's rounding (half an ulp, relative). */
    float *back = malloc(s.n * sizeof(float));
    fact_kv_to_f32(dtype, k, back, s.n);
    for (size_t i = 0; i < s.n; i++) assert_true(close_enough(back[i], s.kf[i], rel_tol, abs_tol));
    fact_kv_to_f32(dtype, v, back, s.n);
    for (size_t i = 0; i < s.n; i++) assert_true(close_enough(back[i], s.vf[i], rel_tol, abs_tol));
    /* ... and not trivially: the narrow dtypes do round these values. */
    if (rel_tol != 0) {
        size_t changed = 0;
        for (size_t i = 0; i < s.n; i++) changed += back[i] != s.vf[i];
        assert_true(changed > s.n / 2);
    }
    free(back);

    /* Rows: (layer 2, token 3) is element offset (2*5 + 3) * 16. */
    const uint8_t *row = fact_kv_row(&m, k, 2, 3);
    assert_ptr_equal(row, (const uint8_t *)k + (size_t)(2 * 5 + 3) * 16 * kv_dtype_size(dtype));
    assert_int_equal(fact_kv_row_elems(&m), 16);
    assert_int_equal(fact_kv_bytes(&m), s.n * kv_dtype_size(dtype));
    free(buf);
    sample_free(&s);
}

static void test_round_trip_f32(void **state) { round_trip(KV_DTYPE_F32, 0, 0); }

/* fp8: codes, padding to 4 bytes, then a power-of-two scale per (layer,
 * token, head); widened within 3 mantissa bits; a corrupt scale (resealed,
 * so only the scale check can see it) is refused, naming it. */
static void test_round_trip_fp8(void **state) {
    (void)state;
    /* 3 layers, 5 tokens, 1 head of 6: 90 codes, so 2 bytes of padding. */
    sample s = sample_make(small_meta(KV_DTYPE_FP8, 3, 1, 6, 5));
    fact_kv_meta m;
    assert_int_equal(fact_kv_bytes(&s.m), 92 + 15 * 4);
    void *buf = NULL;
    size_t len = 0;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    const void *k, *v;
    assert_int_equal(fact_record_parse(buf, len, &m, NULL, &k, &v), IS_OK);
    assert_int_equal(m.dtype, KV_DTYPE_FP8);
    assert_memory_equal(k, s.k, fact_kv_bytes(&m));
    save_seed("fp8", buf, len);
    const float *sc = fact_kv_scales(&m, k);
    assert_ptr_equal((const uint8_t *)sc, (const uint8_t *)k + 92);
    fact_kv_meta other = m;
    other.dtype = KV_DTYPE_BF16;
    assert_null(fact_kv_scales(&other, k));
    float *back = malloc(s.n * sizeof(float));
    fact_kv_widen(&m, v, back);
    size_t changed = 0;
    const float *vs = fact_kv_scales(&m, v);
    for (size_t i = 0; i < s.n; i++) {
        /* Half a unit of 3 mantissa bits, or half the smallest subnormal step. */
        double bound = fmax(fabs(s.vf[i]) * 0x1p-4, vs[i / 6] * 0x1p-10);
        assert_true(fabs((double)back[i] - s.vf[i]) <= bound);
        assert_true(back[i] == fp8_e4m3_to_f32(((const uint8_t *)v)[i]) * vs[i / 6]);
        changed += back[i] != s.vf[i];
    }
    assert_true(changed > s.n / 2);
    /* Narrowing the widened values again gives the same bytes. */
    uint8_t *again = malloc(fact_kv_bytes(&m));
    fact_kv_narrow(&m, back, again);
    assert_memory_equal(again, v, fact_kv_bytes(&m));
    free(again);
    free(back);
    /* A scale of 3 (not a power of two), the checksum made right again. */
    uint8_t *b = buf;
    const size_t at = (size_t)((const uint8_t *)sc - b) + 4 * 7;
    float three = 3.0f;
    memcpy(b + at, &three, 4);
    reseal(b, len);
    assert_int_equal(fact_record_parse(buf, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "k scale 7"));
    free(buf);
    sample_free(&s);
}
static void test_round_trip_f16(void **state) { round_trip(KV_DTYPE_F16, 0x1p-11, 0x1p-25); }
static void test_round_trip_bf16(void **state) { round_trip(KV_DTYPE_BF16, 0x1p-8, 0); }

/* Narrowing rounds to nearest, ties to even. */
static void test_narrowing_ties_to_even(void **state) {
    /* f16 has 10 fraction bits: 1 + 2^-11 is halfway between 1 and 1 + 2^-10. */
    float in[4] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, -(1.0f + 0x1p-11f), 1.0f + 0x1.8p-11f};
    float want16[4] = {1.0f, 1.0f + 0x1p-9f, -1.0f, 1.0f + 0x1p-10f};
    uint16_t h[4];
    float out[4];
    fact_kv_from_f32(KV_DTYPE_F16, in, h, 4);
    fact_kv_to_f32(KV_DTYPE_F16, h, out, 4);
    for (int i = 0; i < 4; i++) assert_true(out[i] == want16[i]);
    /* bf16 has 7: 1 + 2^-8 is halfway between 1 and 1 + 2^-7. */
    float inb[3] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1.8p-8f};
    float wantb[3] = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f};
    fact_kv_from_f32(KV_DTYPE_BF16, inb, h, 3);
    fact_kv_to_f32(KV_DTYPE_BF16, h, out, 3);
    for (int i = 0; i < 3; i++) assert_true(out[i] == wantb[i]);
    /* Unaligned source and destination. */
    uint8_t raw[1 + 4 * 4];
    fact_kv_from_f32(KV_DTYPE_F32, in, raw + 1, 4);
    fact_kv_to_f32(KV_DTYPE_F32, raw + 1, out, 4);
    assert_memory_equal(out, in, sizeof in);
}

/* Widening gives the scalar conversions' bits for every 16-bit pattern
 * (NaNs, infinities and subnormals included), whichever path the build
 * takes (F16C eight at a time, the rest one by one): all 65,536 values in
 * one call and again from an odd offset, so both paths see each of them. */
static void test_widening_every_value(void **state) {
    (void)state;
    const size_t n = 65536;
    uint16_t *h = malloc((n + 1) * sizeof *h);
    float *out = malloc((n + 1) * sizeof *out);
    assert_non_null(h);
    assert_non_null(out);
    for (size_t i = 0; i < n; i++) h[i + 1] = (uint16_t)i;
    for (int dt = 0; dt < 2; dt++) {
        kv_dtype t = dt ? KV_DTYPE_BF16 : KV_DTYPE_F16;
        for (size_t off = 0; off < 2; off++) {
            fact_kv_to_f32(t, h + 1 + off, out, n - off);
            for (size_t i = 0; i < n - off; i++) {
                uint16_t v = (uint16_t)(i + off);
                float want = dt ? quant_bf16_to_f32(v) : quant_f16_to_f32(v);
                if (memcmp(&out[i], &want, 4) != 0)
                    fail_msg("%s widening of 0x%04x differs from the scalar conversion",
                             dt ? "bf16" : "f16", v);
            }
        }
    }
    free(h);
    free(out);
}

/* ---- the documented byte layout ------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* A record assembled here from the layout in fact_record.h, not by the
 * encoder, must parse, and must equal the encoder's bytes. */
static void test_layout_matches_documentation(void **state) {
    sample s = sample_make(small_meta(KV_DTYPE_F16, 2, 1, 6, 3));
    s.m.rope_layout = 1;
    s.m.rope_n_rot = 4;
    s.m.rope_freq_base = 500000.0f;
    s.m.rope_freq_scale = 0.25f;
    s.m.rope_factors_hash = 0xfeedfacecafebeefull;
    s.m.window = -1;
    /* tokens 12 bytes -> 64; k, v 2*3*6*2 = 72 bytes -> 128 each. */
    const size_t total = 128 + 64 + 128 + 128;
    uint8_t *b = aligned_alloc(64, total);
    memset(b, 0, total);
    memcpy(b, "IFKV", 4);
    put32(b + 4, 1);
    put32(b + 8, 128);
    put32(b + 12, 1);
    memcpy(b + 16, "0123456789abcdef", 16);
    put32(b + 32, 2);
    put32(b + 36, 1);
    put32(b + 40, 6);
    put32(b + 44, 3);
    put32(b + 48, 1);
    put32(b + 52, 4);
    memcpy(b + 56, &s.m.rope_freq_base, 4);
    memcpy(b + 60, &s.m.rope_freq_scale, 4);
    put64(b + 64, 0xfeedfacecafebeefull);
    put32(b + 72, (uint32_t)-1);
    put64(b + 80, s.m.text_hash);
    put64(b + 88, total);
    memcpy(b + 128, s.tokens, 12);
    memcpy(b + 192, s.k, 72);
    memcpy(b + 320, s.v, 72);
    /* checksum: XXH64 of [0, 120) then [128, total), as one string. */
    uint8_t *cat = malloc(total - 8);
    memcpy(cat, b, 120);
    memcpy(cat + 120, b + 128, total - 128);
    put64(b + 120, fact_text_hash((const char *)cat, total - 8));
    free(cat);

    fact_kv_meta m;
    const void *k, *v;
    assert_int_equal(fact_record_parse(b, total, &m, NULL, &k, &v), IS_OK);
    assert_meta_equal(&m, &s.m);
    assert_ptr_equal(k, b + 192);
    assert_ptr_equal(v, b + 320);

    void *enc;
    size_t len;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &enc, &len), IS_OK);
    assert_int_equal(len, total);
    assert_memory_equal(enc, b, total);
    save_seed("layout_f16_neox", b, total);
    free(enc);

    /* The same bytes as pieces, the payload where the caller keeps it. */
    void *head;
    fact_record_piece pc[FACT_RECORD_PIECES];
    assert_int_equal(fact_record_encode_pieces(&s.m, s.tokens, s.k, s.v, &head, pc, &len), IS_OK);
    assert_int_equal(len, total);
    assert_ptr_equal(pc[1].data, s.k);
    assert_ptr_equal(pc[3].data, s.v);
    size_t at = 0;
    for (int i = 0; i < FACT_RECORD_PIECES; i++) {
        assert_true(at + pc[i].len <= total);
        assert_memory_equal(pc[i].data, b + at, pc[i].len);
        at += pc[i].len;
    }
    assert_int_equal(at, total);
    free(head);
    free(b);
    sample_free(&s);
}

/* ---- refusals ---------------------------------------------------------------------- */

static void test_meta_check_refuses_other_settings(void **state) {
    fact_kv_meta want = small_meta(KV_DTYPE_F32, 30, 3, 64, 1);
    fact_kv_meta r = want;
    /* What describes the fact itself is not compared. */
    r.n_tokens = 17;
    r.window = -1;
    r.text_hash = 42;
    assert_int_equal(fact_meta_check(&r, &want), IS_OK);

    r = want;
    strcpy(r.model_fingerprint, "fedcba9876543210");
    assert_int_equal(fact_meta_check(&r, &want), IS_ERR_MISMATCH);
    assert_non_null(strstr(is_error_last(), "fedcba9876543210"));
    assert_non_null(strstr(is_error_last(), "0123456789abcdef"));
    assert_non_null(strstr(is_error_last(), "model"));

    r = want;
    r.dtype = KV_DTYPE_BF16;
    assert_int_equal(fact_meta_check(&r, &want), IS_ERR_MISMATCH);
    assert_non_null(strstr(is_error_last(), "bf16"));
    assert_non_null(strstr(is_error_last(), "f32"));

    r = want;
    r.rope_freq_base = 500000.0f;
    assert_int_equal(fact_meta_check(&r, &want), IS_ERR_MISMATCH);
    assert_non_null(strstr(is_error_last(), "freq_base"));
    assert_non_null(strstr(is_error_last(), "500000"));

    /* Every other field the serving model fixes. */
    fact_kv_meta variants[7];
    for (int i = 0; i < 7; i++) variants[i] = want;
    variants[0].n_layers = 31;
    variants[1].n_kv_heads = 4;
    variants[2].head_dim = 128;
    variants[3].rope_layout = 1;
    variants[4].rope_n_rot = 32;
    variants[5].rope_freq_scale = 0.5f;
    variants[6].rope_factors_hash = 1;
    const char *field[7] = {"n_layers", "n_kv_heads", "head_dim",         "layout",
                            "n_rot",    "freq_scale", "frequency factors"};
    for (int i = 0; i < 7; i++) {
        assert_int_equal(fact_meta_check(&variants[i], &want), IS_ERR_MISMATCH);
        assert_non_null(strstr(is_error_last(), field[i]));
    }
    /* The first differing field is the one named. */
    r = want;
    r.dtype = KV_DTYPE_F16;
    r.rope_freq_base = 1.0f;
    assert_int_equal(fact_meta_check(&r, &want), IS_ERR_MISMATCH);
    assert_non_null(strstr(is_error_last(), "dtype"));

    /* fact_meta_same_model is the same test without a message. */
    is_error_set(IS_ERR_IO, "earlier message");
    for (int i = 0; i < 7; i++) assert_false(fact_meta_same_model(&variants[i], &want));
    assert_false(fact_meta_same_model(&r, &want));
    r = want;
    r.n_tokens = 17;
    r.window = -1;
    r.text_hash = 42;
    assert_true(fact_meta_same_model(&r, &want));
    strcpy(r.model_fingerprint, "fedcba9876543210");
    assert_false(fact_meta_same_model(&r, &want));
    assert_false(fact_meta_same_model(NULL, &want));
    assert_string_equal(is_error_last(), "earlier message");
}

/* The header alone: what fact_record_parse says of it, for any alignment,
 * and nothing of the bytes after it. */
static void test_header_parse(void **state) {
    (void)state;
    for (int dt = 0; dt < KV_DTYPE_COUNT; dt++) {
        sample s = sample_make(small_meta((kv_dtype)dt, 2, 1, 2, 3));
        void *buf;
        size_t len;
        assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
        fact_kv_meta whole, head;
        assert_int_equal(fact_record_parse(buf, len, &whole, NULL, NULL, NULL), IS_OK);
        uint8_t *odd = malloc(FACT_RECORD_HEADER_BYTES + 1);
        assert_non_null(odd);
        memcpy(odd + 1, buf, FACT_RECORD_HEADER_BYTES);
        assert_int_equal(fact_record_parse_header(odd + 1, FACT_RECORD_HEADER_BYTES, &head), IS_OK);
        assert_meta_equal(&head, &whole);
        /* A damaged payload is the full parse's to find. */
        uint8_t *b = buf;
        b[len - 1] ^= 0x80;
        assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
        assert_int_equal(fact_record_parse_header(b, len, &head), IS_OK);
        /* Short, or a header field out of its limits, is refused. */
        assert_int_equal(fact_record_parse_header(b, FACT_RECORD_HEADER_BYTES - 1, &head),
                         IS_ERR_FORMAT);
        const size_t bad_at[] = {0, 4, 8, 12, 16, 35, 47, 76, 96};
        for (size_t i = 0; i < sizeof bad_at / sizeof *bad_at; i++) {
            memcpy(odd + 1, buf, FACT_RECORD_HEADER_BYTES);
            odd[1 + bad_at[i]] ^= 0xff;
            fact_kv_meta m = {.n_layers = -77};
            if (fact_record_parse_header(odd + 1, FACT_RECORD_HEADER_BYTES, &m) != IS_ERR_FORMAT)
                fail_msg("dtype %d: header byte %zu flipped was accepted", dt, bad_at[i]);
            assert_int_equal(m.n_layers, -77);
        }
        assert_int_equal(fact_record_parse_header(NULL, 0, &head), IS_ERR_INVALID_ARG);
        free(odd);
        free(buf);
        sample_free(&s);
    }
}

static void test_encode_refuses_bad_meta(void **state) {
    sample s = sample_make(small_meta(KV_DTYPE_F32, 1, 1, 4, 2));
    void *buf = (void *)0x1;
    size_t len = 77;
    fact_kv_meta bad[12];
    for (int i = 0; i < 12; i++) bad[i] = s.m;
    bad[0].model_fingerprint[3] = 'G';
    bad[1].model_fingerprint[15] = '\0';
    bad[2].dtype = (kv_dtype)KV_DTYPE_COUNT;
    bad[3].n_layers = 0;
    bad[4].n_kv_heads = -1;
    bad[5].head_dim = FACT_MAX_HEAD_DIM + 1;
    bad[6].n_tokens = 0;
    bad[7].rope_layout = 2;
    bad[8].rope_n_rot = 3;
    bad[9].rope_freq_base = NAN;
    bad[10].rope_freq_scale = 0;
    bad[11].window = -2;
    for (int i = 0; i < 12; i++) {
        assert_int_equal(fact_record_encode(&bad[i], s.tokens, s.k, s.v, &buf, &len),
                         IS_ERR_INVALID_ARG);
        assert_ptr_equal(buf, (void *)0x1);
        assert_int_equal(len, 77);
    }
    assert_int_equal(fact_record_encode(&s.m, NULL, s.k, s.v, &buf, &len), IS_ERR_INVALID_ARG);
    s.tokens[1] = -5;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_ERR_INVALID_ARG);
    /* encode_into wants the exact size. */
    s.tokens[1] = 5;
    size_t need;
    assert_int_equal(fact_record_size(&s.m, &need), IS_OK);
    uint8_t *b = malloc(need + 1);
    assert_int_equal(fact_record_encode_into(&s.m, s.tokens, s.k, s.v, b, need + 1),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(fact_record_encode_into(&s.m, s.tokens, s.k, s.v, b, need), IS_OK);
    free(b);
    sample_free(&s);
}

/* ---- corruption ------------------------------------------------------------------------ */

static void test_every_byte_flip_is_rejected(void **state) {
    for (int dt = 0; dt < KV_DTYPE_COUNT; dt++) {
        sample s = sample_make(small_meta((kv_dtype)dt, 2, 1, 2, 3));
        void *buf;
        size_t len;
        assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
        uint8_t *b = buf;
        const uint8_t masks[3] = {0x01, 0x80, 0xff};
        for (size_t i = 0; i < len; i++)
            for (int j = 0; j < 3; j++) {
                b[i] ^= masks[j];
                fact_kv_meta m = {.n_layers = -77};
                const void *k = NULL;
                is_status st = fact_record_parse(b, len, &m, NULL, &k, NULL);
                if (st != IS_ERR_FORMAT)
                    fail_msg("dtype %d: flipping byte %zu with %02x gave %d", dt, i, masks[j], st);
                assert_int_equal(m.n_layers, -77); /* outputs untouched on failure */
                assert_null(k);
                b[i] ^= masks[j];
            }
        assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_OK);
        char name[32];
        snprintf(name, sizeof name, "tiny_%s", kv_dtype_name((kv_dtype)dt));
        save_seed(name, b, len);
        free(buf);
        sample_free(&s);
    }
}

/* Sums the record at b[len] fed in pieces of `piece` bytes. */
static fact_record_sum sum_in_pieces(const uint8_t *b, size_t len, size_t piece) {
    fact_record_sum s;
    fact_record_sum_init(&s);
    for (size_t at = 0; at < len; at += piece)
        fact_record_sum_feed(&s, b, at, at + piece < len ? at + piece : len);
    return s;
}

/* A checksum taken as the bytes arrive, in pieces that start and end inside
 * and around the checksum field, accepts what fact_record_parse accepts and
 * refuses every flipped byte; a sum over fewer bytes, or none, is refused. */
static void test_summed_parse(void **state) {
    sample s = sample_make(small_meta(KV_DTYPE_BF16, 2, 2, 4, 3));
    void *buf;
    size_t len;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    uint8_t *b = buf;
    const size_t pieces[] = {1, 7, 32, 100, 121, 125, 129, len};
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        fact_record_sum sum = sum_in_pieces(b, len, pieces[i]);
        fact_kv_meta m;
        const void *k = NULL;
        assert_int_equal(fact_record_parse_summed(b, len, &sum, &m, NULL, &k, NULL), IS_OK);
        assert_int_equal(m.n_tokens, s.m.n_tokens);
        const void *k_plain = NULL;
        assert_int_equal(fact_record_parse(b, len, NULL, NULL, &k_plain, NULL), IS_OK);
        assert_ptr_equal(k, k_plain);
    }
    for (size_t i = 0; i < len; i++) {
        b[i] ^= 0x10;
        fact_record_sum sum = sum_in_pieces(b, len, 13);
        if (fact_record_parse_summed(b, len, &sum, NULL, NULL, NULL, NULL) != IS_ERR_FORMAT)
            fail_msg("flipping byte %zu of %zu was accepted", i, len);
        b[i] ^= 0x10;
    }
    fact_record_sum part = sum_in_pieces(b, len - 4, 64);
    assert_int_equal(fact_record_parse_summed(b, len, &part, NULL, NULL, NULL, NULL),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(fact_record_parse_summed(b, len, NULL, NULL, NULL, NULL, NULL),
                     IS_ERR_INVALID_ARG);
    free(buf);
    sample_free(&s);
}

static void test_every_truncation_is_rejected(void **state) {
    sample s = sample_make(small_meta(KV_DTYPE_BF16, 2, 2, 4, 3));
    void *buf;
    size_t len;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    for (size_t n = 0; n < len; n++) {
        /* A copy of exactly n bytes, so ASan sees any read past the end. */
        void *t = malloc(n ? n : 1);
        memcpy(t, buf, n);
        is_status st = fact_record_parse(n ? t : NULL, n, NULL, NULL, NULL, NULL);
        if (st != IS_ERR_FORMAT) fail_msg("truncated to %zu of %zu bytes: status %d", n, len, st);
        free(t);
    }
    /* Trailing bytes are refused too. */
    uint8_t *longer = malloc(len + 4);
    memcpy(longer, buf, len);
    memset(longer + len, 0, 4);
    assert_int_equal(fact_record_parse(longer, len + 4, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "trailing"));
    free(longer);
    free(buf);
    sample_free(&s);
}

/* Recomputes the checksum of the record in b[len] after an edit. */
static void reseal(uint8_t *b, size_t len) {
    uint8_t *cat = malloc(len - 8);
    memcpy(cat, b, 120);
    memcpy(cat + 120, b + 128, len - 128);
    put64(b + 120, fact_text_hash((const char *)cat, len - 8));
    free(cat);
}

/* Headers that claim huge shapes (within the limits, so the arithmetic is
 * at its largest) in a short buffer: refused on size, without overflow. */
static void test_hostile_headers(void **state) {
    sample s = sample_make(small_meta(KV_DTYPE_F32, 1, 1, 2, 1));
    void *buf;
    size_t len;
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    uint8_t *b = buf;
    put32(b + 32, FACT_MAX_LAYERS);
    put32(b + 36, FACT_MAX_KV_HEADS);
    put32(b + 40, FACT_MAX_HEAD_DIM);
    put32(b + 44, FACT_MAX_TOKENS);
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    put32(b + 44, 0x7fffffff); /* beyond the limit */
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "n_tokens"));
    put32(b + 44, 0x80000000u); /* negative */
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    free(buf);

    /* Version, magic, header size: each refused with its name. */
    assert_int_equal(fact_record_encode(&s.m, s.tokens, s.k, s.v, &buf, &len), IS_OK);
    b = buf;
    put32(b + 4, 2);
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "version 2"));
    put32(b + 4, 1);
    b[0] = 'G';
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "magic"));
    b[0] = 'I';
    assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_OK);

    /* Non-zero reserved bytes or padding are refused even under a valid
     * checksum (a writer from the future or a buggy one). */
    size_t pos[3] = {77, 100, 128 + 4 + 3}; /* reserved0, reserved1, token padding */
    for (int i = 0; i < 3; i++) {
        b[pos[i]] = 1;
        reseal(b, len);
        assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_ERR_FORMAT);
        assert_non_null(strstr(is_error_last(), "not zero"));
        b[pos[i]] = 0;
        reseal(b, len);
        assert_int_equal(fact_record_parse(b, len, NULL, NULL, NULL, NULL), IS_OK);
    }

    /* Misaligned buffers are refused rather than handing out misaligned
     * pointers; NULL with a length is an argument error. */
    uint8_t *shifted = aligned_alloc(64, len + 64);
    memcpy(shifted + 2, buf, len);
    assert_int_equal(fact_record_parse(shifted + 2, len, NULL, NULL, NULL, NULL),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(fact_record_parse(NULL, 5, NULL, NULL, NULL, NULL), IS_ERR_INVALID_ARG);
    free(shifted);
    free(buf);
    sample_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xxh64_reference_vectors),
        cmocka_unit_test(test_round_trip_f32),
        cmocka_unit_test(test_round_trip_f16),
        cmocka_unit_test(test_round_trip_bf16),
        cmocka_unit_test(test_round_trip_fp8),
        cmocka_unit_test(test_narrowing_ties_to_even),
        cmocka_unit_test(test_widening_every_value),
        cmocka_unit_test(test_layout_matches_documentation),
        cmocka_unit_test(test_meta_check_refuses_other_settings),
        cmocka_unit_test(test_header_parse),
        cmocka_unit_test(test_encode_refuses_bad_meta),
        cmocka_unit_test(test_every_byte_flip_is_rejected),
        cmocka_unit_test(test_every_truncation_is_rejected),
        cmocka_unit_test(test_summed_parse),
        cmocka_unit_test(test_hostile_headers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

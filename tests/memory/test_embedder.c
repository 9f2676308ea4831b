/*
 * test_embedder: the memory layer's tokenizer, weight reader and sentence
 * encoder.
 *
 *   - wordpiece on a hand-made vocabulary: greedy longest match, "##"
 *     continuation, [UNK] for an unmatched word and for a word over 100
 *     characters, lowercasing and accent stripping, CJK split, special tokens
 *     in text, truncation; corrupt vocabularies give statuses;
 *   - safetensors: a file written here reads back; truncated, oversized,
 *     non-JSON and inconsistent headers give IS_ERR_FORMAT, never a crash;
 *   - embedder on a tiny random BERT written here: loads, embeds unit
 *     vectors, a text's embedding does not depend on its batch, and every
 *     broken folder (missing file, missing tensor, wrong shape, truncated
 *     weights, bad JSON, unsupported activation) gives the stated status;
 *   - golden (skipped when models/all-MiniLM-L6-v2 is absent; run
 *     scripts/fetch_embedder.sh): token ids identical to sentence-
 *     transformers' tokenizer on tests/golden/embed/tokens.json and on the
 *     50 sentences of embeddings.json, and embedding cosine >= 0.999 to the
 *     reference for every sentence, both from text and from the reference's
 *     ids. Golden files come from tools/make_embedder_golden.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory/embedder.h"
#include "test_util.h"
#include "memory/safetensors.h"
#include "memory/wordpiece.h"

#define MODEL_DIR IS_SOURCE_DIR "/models/all-MiniLM-L6-v2"

/* ---- helpers --------------------------------------------------------------- */

static cJSON *load_golden(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/embed/%s", IS_GOLDEN_DIR, name);
    char *text = test_read_file(path, NULL);
    if (!text) fail_msg("cannot read %s (run tools/make_embedder_golden.py)", path);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

static bool have_model(void) { return access(MODEL_DIR "/model.safetensors", R_OK) == 0; }

static void encode_str(const wordpiece *wp, const char *s, int32_t max_len, int32_t *ids,
                       int32_t *n) {
    assert_int_equal(wordpiece_encode(wp, s, strlen(s), max_len, ids, n), IS_OK);
}

static void assert_ids(const int32_t *got, int32_t n, const int32_t *want, int32_t m) {
    if (n != m || memcmp(got, want, (size_t)n * sizeof *got) != 0) {
        fprintf(stderr, "got  ");
        for (int32_t i = 0; i < n; i++) fprintf(stderr, " %d", got[i]);
        fprintf(stderr, "\nwant ");
        for (int32_t i = 0; i < m; i++) fprintf(stderr, " %d", want[i]);
        fprintf(stderr, "\n");
        fail();
    }
}

/* ---- wordpiece on a hand vocabulary ------------------------------------------- */

static const char hand_vocab[] = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"   /* 0-4 */
                                 "un\n##aff\n##able\nhello\n,\n!\n"       /* 5-10 */
                                 "want\n##want\n##ed\na\n##a\ncaf\n##e\n" /* 11-17 */
                                 "\xe6\x9d\xb1\nunaff\n";                 /* 18: 東, 19: unaff */

static wordpiece *hand_wp(void) {
    wordpiece *wp = NULL;
    assert_int_equal(
        wordpiece_load_buffer(hand_vocab, sizeof hand_vocab - 1, wordpiece_default_params(), &wp),
        IS_OK);
    return wp;
}

static void test_wordpiece_hand(void **state) {
    (void)state;
    wordpiece *wp = hand_wp();
    int32_t ids[256], n;
    assert_int_equal(wordpiece_n_vocab(wp), 20);
    assert_int_equal(wordpiece_cls_id(wp), 2);
    assert_int_equal(wordpiece_sep_id(wp), 3);
    assert_int_equal(wordpiece_unk_id(wp), 1);
    assert_int_equal(wordpiece_token_id(wp, "##aff", 5), 6);
    assert_int_equal(wordpiece_token_id(wp, "aff", 3), -1);
    assert_string_equal(wordpiece_token_text(wp, 7), "##able");
    assert_null(wordpiece_token_text(wp, 20));

    /* Longest match first: "unaff" (19) beats "un" (5) + "##aff". */
    encode_str(wp, "UnAffable", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 19, 7, 3}, 4);
    encode_str(wp, "Hello, unwanted!", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 8, 9, 5, 12, 13, 10, 3}, 8);
    /* A position no piece matches makes the whole word [UNK]. */
    encode_str(wp, "unx hello", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 1, 8, 3}, 4);
    /* Accents stripped after NFD; precomposed and combining forms agree. */
    encode_str(wp, "CAF\xc3\x89 cafe\xcc\x81", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 16, 17, 16, 17, 3}, 6);
    /* CJK ideographs are words of their own; 京 is not in the vocabulary. */
    encode_str(wp, "\xe6\x9d\xb1\xe4\xba\xac", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 18, 1, 3}, 4);
    /* Control and format characters vanish, whitespace splits. */
    encode_str(wp, "hel\x01lo\xe2\x80\x8b\t,\xc2\xa0!", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 8, 9, 10, 3}, 5);
    /* Special tokens written in the text are kept (case-sensitive). */
    encode_str(wp, "[SEP]hello[MASK][mask]", 256, ids, &n);
    /* "[mask]" is three words "[" "mask" "]", none in the vocabulary. */
    assert_ids(ids, n, (int32_t[]){2, 3, 8, 4, 1, 1, 1, 3}, 8);
    /* Empty and whitespace-only text: just [CLS] [SEP]. */
    encode_str(wp, "", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 3}, 2);
    assert_int_equal(wordpiece_encode(wp, NULL, 0, 2, ids, &n), IS_OK);
    assert_ids(ids, n, (int32_t[]){2, 3}, 2);
    /* Invalid UTF-8 is dropped. */
    encode_str(wp, "hel\xff\xc3lo", 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 8, 3}, 3);

    /* 100 characters are pieced, 101 are one [UNK]. */
    char word[102];
    memset(word, 'a', 101);
    word[100] = 0;
    encode_str(wp, word, 256, ids, &n);
    assert_int_equal(n, 102);
    assert_int_equal(ids[1], 14);
    assert_int_equal(ids[100], 15);
    word[100] = 'a';
    word[101] = 0;
    encode_str(wp, word, 256, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 1, 3}, 3);
    /* Truncation keeps [CLS] first pieces [SEP], even inside a word. */
    word[100] = 0;
    encode_str(wp, word, 6, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 14, 15, 15, 15, 3}, 6);
    encode_str(wp, "hello hello", 2, ids, &n);
    assert_ids(ids, n, (int32_t[]){2, 3}, 2);

    assert_int_equal(wordpiece_encode(wp, "x", 1, 1, ids, &n), IS_ERR_INVALID_ARG);
    assert_int_equal(n, 0);
    assert_int_equal(wordpiece_encode(wp, NULL, 1, 8, ids, &n), IS_ERR_INVALID_ARG);
    wordpiece_free(wp);
}

/* Any bytes: a status, never a crash, and the [CLS] ... [SEP] frame. */
static void test_wordpiece_random_bytes(void **state) {
    (void)state;
    wordpiece *wp = hand_wp();
    uint32_t x = 12345;
    char buf[64];
    int32_t ids[32], n;
    for (int r = 0; r < 20000; r++) {
        size_t len = (size_t)(r % 64);
        for (size_t i = 0; i < len; i++) {
            x = x * 1664525u + 1013904223u;
            /* Mostly ASCII letters and '[' (special-token starts), some high bytes. */
            uint32_t b = x >> 24;
            buf[i] = (char)(b < 96 ? 'a' + b % 3 : b < 112 ? '[' : b < 128 ? ' ' : b);
        }
        int32_t max_len = 2 + r % 30;
        assert_int_equal(wordpiece_encode(wp, buf, len, max_len, ids, &n), IS_OK);
        assert_true(n >= 2 && n <= max_len);
        assert_int_equal(ids[0], 2);
        assert_int_equal(ids[n - 1], 3);
        for (int32_t i = 0; i < n; i++) assert_true(ids[i] >= 0 && ids[i] < 20);
    }
    wordpiece_free(wp);
}

static void test_wordpiece_params(void **state) {
    (void)state;
    wordpiece_params p = wordpiece_default_params();
    p.lowercase = false;
    wordpiece *wp = NULL;
    assert_int_equal(wordpiece_load_buffer(hand_vocab, sizeof hand_vocab - 1, p, &wp), IS_OK);
    int32_t ids[16], n;
    encode_str(wp, "Hello hello caf\xc3\xa9", 16, ids,
               &n); /* cased: no lowercasing, no stripping */
    assert_ids(ids, n, (int32_t[]){2, 1, 8, 1, 3}, 5);
    wordpiece_free(wp);
}

static void test_wordpiece_bad_vocab(void **state) {
    (void)state;
    wordpiece *wp = (wordpiece *)0x1;
    const char dup[] = "[CLS]\n[SEP]\n[UNK]\na\na\n";
    assert_int_equal(wordpiece_load_buffer(dup, sizeof dup - 1, wordpiece_default_params(), &wp),
                     IS_ERR_FORMAT);
    const char nocls[] = "[SEP]\n[UNK]\na\n";
    assert_int_equal(
        wordpiece_load_buffer(nocls, sizeof nocls - 1, wordpiece_default_params(), &wp),
        IS_ERR_FORMAT);
    const char empty_line[] = "[CLS]\n\n[SEP]\n[UNK]\n";
    assert_int_equal(
        wordpiece_load_buffer(empty_line, sizeof empty_line - 1, wordpiece_default_params(), &wp),
        IS_ERR_FORMAT);
    const char bad_utf8[] = "[CLS]\n[SEP]\n[UNK]\n\xff\n";
    assert_int_equal(
        wordpiece_load_buffer(bad_utf8, sizeof bad_utf8 - 1, wordpiece_default_params(), &wp),
        IS_ERR_FORMAT);
    assert_int_equal(wordpiece_load_buffer("", 0, wordpiece_default_params(), &wp), IS_ERR_FORMAT);
    assert_int_equal(wordpiece_load("/nonexistent/vocab.txt", wordpiece_default_params(), &wp),
                     IS_ERR_IO);
    assert_ptr_equal(wp, (wordpiece *)0x1); /* unchanged on failure */
    /* CRLF line ends and a missing final newline are fine. */
    const char crlf[] = "[CLS]\r\n[SEP]\r\n[UNK]\r\nab";
    assert_int_equal(wordpiece_load_buffer(crlf, sizeof crlf - 1, wordpiece_default_params(), &wp),
                     IS_OK);
    assert_int_equal(wordpiece_token_id(wp, "ab", 2), 3);
    assert_int_equal(wordpiece_token_id(wp, "[SEP]", 5), 1);
    wordpiece_free(wp);
}

/* ---- safetensors ----------------------------------------------------------- */

/* Builds a safetensors file: tensors given as name, dims, data (F32). */
typedef struct st_tensor {
    const char *name;
    int32_t n_dims;
    int64_t shape[2];
    const float *data;
} st_tensor;

static size_t st_build(const st_tensor *t, int32_t n, uint8_t **out) {
    size_t hcap = 256 + (size_t)n * 256, hl = 0, dl = 0;
    char *h = malloc(hcap);
    assert_non_null(h);
    hl += (size_t)snprintf(h + hl, hcap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int32_t i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int32_t d = 0; d < t[i].n_dims; d++) ne *= t[i].shape[d];
        hl += (size_t)snprintf(h + hl, hcap - hl, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[",
                               t[i].name);
        for (int32_t d = 0; d < t[i].n_dims; d++)
            hl += (size_t)snprintf(h + hl, hcap - hl, "%s%lld", d ? "," : "",
                                   (long long)t[i].shape[d]);
        hl += (size_t)snprintf(h + hl, hcap - hl, "],\"data_offsets\":[%zu,%zu]}", dl,
                               dl + 4 * (size_t)ne);
        dl += 4 * (size_t)ne;
    }
    hl += (size_t)snprintf(h + hl, hcap - hl, "}");
    while (hl % 8) h[hl++] = ' ';
    uint8_t *f = malloc(8 + hl + dl);
    assert_non_null(f);
    for (int i = 0; i < 8; i++) f[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(f + 8, h, hl);
    size_t p = 8 + hl;
    for (int32_t i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int32_t d = 0; d < t[i].n_dims; d++) ne *= t[i].shape[d];
        memcpy(f + p, t[i].data, 4 * (size_t)ne);
        p += 4 * (size_t)ne;
    }
    free(h);
    *out = f;
    return p;
}

static char g_tmp[256];

static int tmp_setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/test_embedder.XXXXXX");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int tmp_teardown(void **state) {
    (void)state;
    return test_remove_tree(g_tmp);
}

static void write_raw(const char *name, const void *data, size_t n, char *path, size_t cap) {
    snprintf(path, cap, "%s/%s", g_tmp, name);
    assert_true(test_write_file(path, data, n));
}

static void test_safetensors(void **state) {
    (void)state;
    const float a[6] = {1, 2, 3, 4, 5, 6}, b[2] = {-1, 0.5f};
    st_tensor t[2] = {{"a.weight", 2, {2, 3}, a}, {"b", 1, {2, 0}, b}};
    uint8_t *f;
    size_t n = st_build(t, 2, &f);
    char path[512];
    write_raw("ok.safetensors", f, n, path, sizeof path);
    safetensors *st = NULL;
    assert_int_equal(safetensors_open(path, &st), IS_OK);
    assert_int_equal(safetensors_n_tensors(st), 2);
    const safetensors_tensor *ta = safetensors_find(st, "a.weight");
    assert_non_null(ta);
    assert_int_equal(ta->dtype, SAFETENSORS_DTYPE_F32);
    assert_int_equal(ta->n_dims, 2);
    assert_int_equal(ta->shape[1], 3);
    assert_int_equal(ta->n_elements, 6);
    assert_memory_equal(ta->data, a, sizeof a);
    assert_memory_equal(safetensors_find(st, "b")->data, b, sizeof b);
    assert_null(safetensors_find(st, "__metadata__"));
    assert_null(safetensors_find(st, "c"));
    assert_null(safetensors_tensor_at(st, 2));
    safetensors_close(st);

    /* Every truncation of the file is refused, none crashes. */
    for (size_t k = 0; k < n; k++) {
        write_raw("trunc.safetensors", f, k, path, sizeof path);
        safetensors *s2 = (safetensors *)0x1;
        assert_int_equal(safetensors_open(path, &s2), IS_ERR_FORMAT);
        assert_ptr_equal(s2, (safetensors *)0x1);
    }
    /* Header length pointing past the end. */
    uint8_t *g = malloc(n);
    memcpy(g, f, n);
    g[5] = 0x7f;
    write_raw("big.safetensors", g, n, path, sizeof path);
    assert_int_equal(safetensors_open(path, &st), IS_ERR_FORMAT);
    /* Header not JSON. */
    memcpy(g, f, n);
    g[8] = 'x';
    write_raw("nojson.safetensors", g, n, path, sizeof path);
    assert_int_equal(safetensors_open(path, &st), IS_ERR_FORMAT);
    /* Shape disagreeing with the byte range: change "3" of [2,3] to "4". */
    memcpy(g, f, n);
    char *s = memmem(g, n, "[2,3]", 5);
    assert_non_null(s);
    s[3] = '4';
    write_raw("shape.safetensors", g, n, path, sizeof path);
    assert_int_equal(safetensors_open(path, &st), IS_ERR_FORMAT);
    /* Unknown dtype. */
    memcpy(g, f, n);
    s = memmem(g, n, "\"F32\"", 5);
    memcpy(s, "\"X32\"", 5);
    write_raw("dtype.safetensors", g, n, path, sizeof path);
    assert_int_equal(safetensors_open(path, &st), IS_ERR_FORMAT);
    free(g);
    free(f);
    assert_int_equal(safetensors_open("/nonexistent.safetensors", &st), IS_ERR_IO);
    assert_int_equal(safetensors_open(g_tmp, &st), IS_ERR_IO); /* a folder */
}

/* ---- a tiny random BERT ------------------------------------------------------ */

enum { TH = 8, TI = 16, TL = 2, TV = 20, TP = 16 };

static float g_rand_state = 0.5f;
static float frand(void) { /* deterministic values in [-0.5, 0.5) */
    g_rand_state = g_rand_state * 997.0f + 0.1234f;
    g_rand_state -= floorf(g_rand_state);
    return g_rand_state - 0.5f;
}

static const char tiny_config[] =
    "{\"hidden_size\": 8, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
    "\"intermediate_size\": 16,"
    " \"vocab_size\": 20, \"max_position_embeddings\": 16, \"hidden_act\": \"gelu\","
    " \"layer_norm_eps\": 1e-12, \"type_vocab_size\": 2, \"position_embedding_type\": "
    "\"absolute\"}";

/* Writes the tiny model into dir g_tmp/name; `skip` omits one tensor by
 * name, `bad_shape` gives that tensor a wrong first dimension, `trunc`
 * cuts that many bytes off the weights. */
static void write_tiny_model(const char *name, const char *config, const char *skip,
                             const char *bad_shape, size_t trunc) {
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_true(test_write_file(path, config, strlen(config)));
    snprintf(path, sizeof path, "%s/vocab.txt", dir);
    assert_true(test_write_file(path, hand_vocab, sizeof hand_vocab - 1));
    static char names[64][96];
    static float data[64][TP * TI * 2];
    st_tensor t[64];
    int32_t n = 0;
#define ADD(nm, d0, d1)                                                                            \
    do {                                                                                           \
        snprintf(names[n], sizeof names[n], "%s", nm);                                             \
        int64_t ne = (int64_t)(d0) * ((d1) ? (d1) : 1);                                            \
        for (int64_t q = 0; q < ne; q++) data[n][q] = frand();                                     \
        if (strstr(nm, "LayerNorm.weight"))                                                        \
            for (int64_t q = 0; q < ne; q++) data[n][q] += 1.0f;                                   \
        if (!skip || strcmp(skip, nm) != 0) {                                                      \
            t[n] = (st_tensor){names[n], (d1) ? 2 : 1, {(d0), (d1)}, data[n]};                     \
            if (bad_shape && strcmp(bad_shape, nm) == 0) t[n].shape[0]--;                          \
            n++;                                                                                   \
        }                                                                                          \
    } while (0)
    ADD("embeddings.word_embeddings.weight", TV, TH);
    ADD("embeddings.position_embeddings.weight", TP, TH);
    ADD("embeddings.token_type_embeddings.weight", 2, TH);
    ADD("embeddings.LayerNorm.weight", TH, 0);
    ADD("embeddings.LayerNorm.bias", TH, 0);
    for (int l = 0; l < TL; l++) {
        char nm[96];
#define LADD(sfx, d0, d1)                                                                          \
    do {                                                                                           \
        snprintf(nm, sizeof nm, "encoder.layer.%d.%s", l, sfx);                                    \
        ADD(nm, d0, d1);                                                                           \
    } while (0)
        LADD("attention.self.query.weight", TH, TH);
        LADD("attention.self.query.bias", TH, 0);
        LADD("attention.self.key.weight", TH, TH);
        LADD("attention.self.key.bias", TH, 0);
        LADD("attention.self.value.weight", TH, TH);
        LADD("attention.self.value.bias", TH, 0);
        LADD("attention.output.dense.weight", TH, TH);
        LADD("attention.output.dense.bias", TH, 0);
        LADD("attention.output.LayerNorm.weight", TH, 0);
        LADD("attention.output.LayerNorm.bias", TH, 0);
        LADD("intermediate.dense.weight", TI, TH);
        LADD("intermediate.dense.bias", TI, 0);
        LADD("output.dense.weight", TH, TI);
        LADD("output.dense.bias", TH, 0);
        LADD("output.LayerNorm.weight", TH, 0);
        LADD("output.LayerNorm.bias", TH, 0);
    }
    uint8_t *f;
    size_t sz = st_build(t, n, &f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_true(test_write_file(path, f, sz - trunc));
    free(f);
}

static void tiny_dir(const char *name, char *dir, size_t cap) {
    snprintf(dir, cap, "%s/%s", g_tmp, name);
}

static void test_embedder_tiny(void **state) {
    (void)state;
    char dir[512];
    write_tiny_model("ok", tiny_config, NULL, NULL, 0);
    tiny_dir("ok", dir, sizeof dir);
    embedder *e = NULL;
    assert_int_equal(embedder_load(dir, &e), IS_OK);
    assert_int_equal(embedder_dim(e), TH);
    assert_int_equal(embedder_max_tokens(e), TP); /* no sentence_bert_config: min(512, positions) */
    const char *texts[] = {"hello, unaffable!", "", "caf\xc3\xa9 \xe6\x9d\xb1",
                           "a a a a a a a a a a a a a a a a a a", "hello"};
    const int32_t n = 5;
    float out[5 * TH], one[TH];
    assert_int_equal(embedder_embed(e, texts, n, out), IS_OK);
    for (int32_t i = 0; i < n; i++) {
        double ss = 0;
        for (int d = 0; d < TH; d++) {
            assert_true(isfinite(out[i * TH + d]));
            ss += (double)out[i * TH + d] * out[i * TH + d];
        }
        assert_true(fabs(ss - 1.0) < 1e-5);
        /* Alone or in a batch: same vector (packing, no cross-talk). */
        assert_int_equal(embedder_embed(e, &texts[i], 1, one), IS_OK);
        for (int d = 0; d < TH; d++) assert_true(fabsf(one[d] - out[i * TH + d]) < 1e-5f);
    }
    /* Different texts, different vectors. */
    assert_true(fabsf(out[0] - out[4 * TH]) + fabsf(out[1] - out[4 * TH + 1]) > 1e-4f);
    /* Bad arguments. */
    assert_int_equal(embedder_embed(e, NULL, 1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(embedder_embed(e, texts, -1, out), IS_ERR_INVALID_ARG);
    assert_int_equal(embedder_embed(e, NULL, 0, NULL), IS_OK);
    const int32_t bad_ids[3] = {2, 25, 3}, *bp = bad_ids, bl = 3;
    assert_int_equal(embedder_embed_ids(e, &bp, &bl, 1, out), IS_ERR_INVALID_ARG);
    const int32_t long_len = TP + 1;
    assert_int_equal(embedder_embed_ids(e, &bp, &long_len, 1, out), IS_ERR_INVALID_ARG);
    embedder_set_n_threads(e, 1);
    float out1[5 * TH];
    assert_int_equal(embedder_embed(e, texts, n, out1), IS_OK);
    for (int32_t i = 0; i < n * TH; i++) assert_true(fabsf(out1[i] - out[i]) < 1e-5f);
    embedder_set_n_threads(e, 0);
    /* The implementation behind the interface: this one is the CPU's, and
     * a device copy is made by backend name. */
    assert_string_equal(embedder_backend(e), "cpu");
    embedder *d = (embedder *)0x1;
    assert_int_equal(embedder_create_on(e, "cpu", 0, &d), IS_ERR_UNSUPPORTED);
    assert_int_equal(embedder_create_on(e, "tpu", 0, &d), IS_ERR_UNSUPPORTED);
    assert_int_equal(embedder_create_on(NULL, "cuda", 0, &d), IS_ERR_INVALID_ARG);
    assert_int_equal(embedder_create_on(e, NULL, 0, &d), IS_ERR_INVALID_ARG);
    assert_int_equal(embedder_create_on(e, "cuda", 999, &d),
                     IS_ERR_UNSUPPORTED); /* no such device */
    assert_ptr_equal(d, (embedder *)0x1);
    assert_int_equal(embedder_embed_device(e, texts, 1, out), IS_ERR_UNSUPPORTED);
    /* Where a GPU is present the device copy must give the CPU's vectors
     * (tests/cuda/test_cuda_retrieval.c checks it in depth); elsewhere it
     * is refused as unsupported, never half made. */
    is_status st = embedder_create_on(e, "cuda", 0, &d);
    if (st == IS_OK) {
        assert_string_equal(embedder_backend(d), "cuda");
        assert_int_equal(embedder_dim(d), TH);
        assert_int_equal(embedder_max_tokens(d), TP);
        assert_ptr_equal(embedder_tokenizer(d), embedder_tokenizer(e));
        assert_int_equal(embedder_create_on(d, "cuda", 0, &d), IS_ERR_INVALID_ARG);
        float dev_out[5 * TH];
        assert_int_equal(embedder_embed(d, texts, n, dev_out), IS_OK);
        for (int32_t i = 0; i < n * TH; i++) assert_true(fabsf(dev_out[i] - out[i]) < 1e-4f);
        embedder_free(d);
    } else {
        assert_int_equal(st, IS_ERR_UNSUPPORTED);
        assert_ptr_equal(d, (embedder *)0x1);
    }
    embedder_free(e);
    embedder_free(NULL);
}

static void expect_load(const char *name, is_status want) {
    char dir[512];
    tiny_dir(name, dir, sizeof dir);
    embedder *e = (embedder *)0x1;
    is_status st = embedder_load(dir, &e);
    if (st != want)
        fail_msg("%s: got %s (%s), want %s", name, is_status_to_string(st), is_error_last(),
                 is_status_to_string(want));
    assert_ptr_equal(e, (embedder *)0x1);
}

static void test_embedder_broken(void **state) {
    (void)state;
    char path[600];
    expect_load("does-not-exist", IS_ERR_IO);
    write_tiny_model("no-tensor", tiny_config, "encoder.layer.1.output.dense.weight", NULL, 0);
    expect_load("no-tensor", IS_ERR_FORMAT);
    write_tiny_model("bad-shape", tiny_config, NULL, "encoder.layer.0.intermediate.dense.weight",
                     0);
    expect_load("bad-shape", IS_ERR_FORMAT);
    write_tiny_model("truncated", tiny_config, NULL, NULL, 100);
    expect_load("truncated", IS_ERR_FORMAT);
    write_tiny_model("bad-json", "{\"hidden_size\": 8,", NULL, NULL, 0);
    expect_load("bad-json", IS_ERR_FORMAT);
    char cfg[sizeof tiny_config + 8];
    snprintf(cfg, sizeof cfg, "%s", tiny_config);
    memcpy(strstr(cfg, "\"gelu\""), "\"relu\"", 6);
    write_tiny_model("relu", cfg, NULL, NULL, 0);
    expect_load("relu", IS_ERR_UNSUPPORTED);
    snprintf(cfg, sizeof cfg, "%s", tiny_config);
    memcpy(strstr(cfg, "\"vocab_size\": 20"), "\"vocab_size\": 21", 16);
    write_tiny_model("vocab-size", cfg, NULL, NULL, 0);
    expect_load("vocab-size", IS_ERR_FORMAT);
    write_tiny_model("no-vocab", tiny_config, NULL, NULL, 0);
    snprintf(path, sizeof path, "%s/no-vocab/vocab.txt", g_tmp);
    unlink(path);
    expect_load("no-vocab", IS_ERR_IO);
    write_tiny_model("no-weights", tiny_config, NULL, NULL, 0);
    snprintf(path, sizeof path, "%s/no-weights/model.safetensors", g_tmp);
    unlink(path);
    expect_load("no-weights", IS_ERR_IO);
    write_tiny_model("pool-max", tiny_config, NULL, NULL, 0);
    snprintf(path, sizeof path, "%s/pool-max/1_Pooling", g_tmp);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/pool-max/1_Pooling/config.json", g_tmp);
    const char pool[] = "{\"pooling_mode_max_tokens\": true}";
    assert_true(test_write_file(path, pool, sizeof pool - 1));
    expect_load("pool-max", IS_ERR_UNSUPPORTED);
    write_tiny_model("seq-too-long", tiny_config, NULL, NULL, 0);
    snprintf(path, sizeof path, "%s/seq-too-long/sentence_bert_config.json", g_tmp);
    const char sb[] = "{\"max_seq_length\": 17}";
    assert_true(test_write_file(path, sb, sizeof sb - 1));
    expect_load("seq-too-long", IS_ERR_FORMAT);
}

/* ---- golden: the real model against sentence-transformers --------------------------- */

static embedder *g_e;

static embedder *real_model(void) {
    if (!g_e) assert_int_equal(embedder_load(MODEL_DIR, &g_e), IS_OK);
    return g_e;
}

static int32_t json_ids(const cJSON *arr, int32_t *ids, int32_t cap) {
    int32_t n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) {
        assert_true(n < cap);
        ids[n++] = v->valueint;
    }
    return n;
}

static void test_golden_tokens(void **state) {
    (void)state;
    if (!have_model()) TEST_SKIP(TEST_NEEDS_EMBEDDER);
    embedder *e = real_model();
    const wordpiece *wp = embedder_tokenizer(e);
    cJSON *g = load_golden("tokens.json");
    const int32_t M = embedder_max_tokens(e);
    assert_int_equal(M, cJSON_GetObjectItem(g, "max_seq_length")->valueint);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)M), *want = malloc(sizeof(int32_t) * (size_t)M);
    int32_t count = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(g, "items")) {
        const char *hex = cJSON_GetObjectItem(it, "hex")->valuestring;
        size_t nb = strlen(hex) / 2;
        char *bytes = malloc(nb + 1);
        for (size_t i = 0; i < nb; i++) {
            unsigned v;
            assert_int_equal(sscanf(hex + 2 * i, "%2x", &v), 1);
            bytes[i] = (char)v;
        }
        int32_t n, m = json_ids(cJSON_GetObjectItem(it, "ids"), want, M);
        assert_int_equal(wordpiece_encode(wp, bytes, nb, M, ids, &n), IS_OK);
        if (n != m || memcmp(ids, want, sizeof(int32_t) * (size_t)n) != 0) {
            fprintf(stderr, "tokens.json item %d (hex %.60s)\n", count, hex);
            assert_ids(ids, n, want, m);
        }
        free(bytes);
        count++;
    }
    assert_true(count >= 400);
    print_message("tokenizer: %d golden texts, ids identical\n", count);
    free(ids);
    free(want);
    cJSON_Delete(g);
}

static double cosine(const float *a, const float *b, int32_t n) {
    double ab = 0, aa = 0, bb = 0;
    for (int32_t i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return ab / sqrt(aa * bb);
}

static void test_golden_embeddings(void **state) {
    (void)state;
    if (!have_model()) TEST_SKIP(TEST_NEEDS_EMBEDDER);
    embedder *e = real_model();
    cJSON *g = load_golden("embeddings.json");
    const cJSON *items = cJSON_GetObjectItem(g, "items");
    const int32_t n = cJSON_GetArraySize(items), D = embedder_dim(e), M = embedder_max_tokens(e);
    assert_int_equal(D, cJSON_GetObjectItem(g, "dim")->valueint);
    assert_true(n >= 40);
    const char **texts = calloc((size_t)n, sizeof *texts);
    int32_t **ref_ids = calloc((size_t)n, sizeof *ref_ids);
    const int32_t **ref_ptrs = calloc((size_t)n, sizeof *ref_ptrs);
    int32_t *ref_lens = calloc((size_t)n, sizeof *ref_lens);
    float *ref = calloc((size_t)n * D, sizeof *ref), *got = calloc((size_t)n * D, sizeof *got);
    float *got_ids = calloc((size_t)n * D, sizeof *got_ids), *one = calloc((size_t)D, sizeof *one);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)M);
    int32_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, items) {
        texts[i] = cJSON_GetObjectItem(it, "text")->valuestring;
        ref_ids[i] = malloc(sizeof(int32_t) * (size_t)M);
        ref_lens[i] = json_ids(cJSON_GetObjectItem(it, "ids"), ref_ids[i], M);
        ref_ptrs[i] = ref_ids[i];
        int32_t d = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, cJSON_GetObjectItem(it, "embedding")) ref[(size_t)i * D + d++] =
            (float)v->valuedouble;
        assert_int_equal(d, D);
        int32_t k;
        assert_int_equal(
            wordpiece_encode(embedder_tokenizer(e), texts[i], strlen(texts[i]), M, ids, &k), IS_OK);
        if (k != ref_lens[i] || memcmp(ids, ref_ids[i], sizeof(int32_t) * (size_t)k) != 0) {
            fprintf(stderr, "sentence %d: token ids differ\n", i);
            assert_ids(ids, k, ref_ids[i], ref_lens[i]);
        }
        i++;
    }
    /* All sentences in one batch, from text and from the reference ids. */
    assert_int_equal(embedder_embed(e, texts, n, got), IS_OK);
    assert_int_equal(embedder_embed_ids(e, ref_ptrs, ref_lens, n, got_ids), IS_OK);
    double min_cos = 1.0, min_cos_ids = 1.0, min_self = 1.0;
    int32_t worst = 0;
    for (i = 0; i < n; i++) {
        double c = cosine(got + (size_t)i * D, ref + (size_t)i * D, D);
        double c2 = cosine(got_ids + (size_t)i * D, ref + (size_t)i * D, D);
        if (c < min_cos) {
            min_cos = c;
            worst = i;
        }
        if (c2 < min_cos_ids) min_cos_ids = c2;
        if (c < 0.999) fail_msg("sentence %d: cosine %.6f < 0.999", i, c);
        assert_int_equal(embedder_embed(e, &texts[i], 1, one), IS_OK);
        double cs = cosine(one, got + (size_t)i * D, D);
        if (cs < min_self) min_self = cs;
    }
    print_message(
        "embeddings: %d sentences, min cosine to reference %.9f (1 - cos = %.1e, sentence %d); "
        "from the reference's ids %.9f; alone vs in a batch %.9f\n",
        n, min_cos, 1.0 - min_cos, worst, min_cos_ids, min_self);
    assert_true(min_cos_ids >= 0.999);
    assert_true(min_self >= 0.99999);
    for (i = 0; i < n; i++) free(ref_ids[i]);
    free(ref_ids);
    free(ref_ptrs);
    free(ref_lens);
    free(texts);
    free(ref);
    free(got);
    free(got_ids);
    free(one);
    free(ids);
    cJSON_Delete(g);
}

static int teardown_model(void **state) {
    (void)state;
    embedder_free(g_e);
    g_e = NULL;
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wordpiece_hand),
        cmocka_unit_test(test_wordpiece_random_bytes),
        cmocka_unit_test(test_wordpiece_params),
        cmocka_unit_test(test_wordpiece_bad_vocab),
        cmocka_unit_test_setup_teardown(test_safetensors, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_embedder_tiny, tmp_setup, tmp_teardown),
        cmocka_unit_test_setup_teardown(test_embedder_broken, tmp_setup, tmp_teardown),
        cmocka_unit_test(test_golden_tokens),
        cmocka_unit_test(test_golden_embeddings),
    };
    return test_run_group(tests, NULL, teardown_model);
}

/* test_bert: a random BERT folder for embedder tests (see test_bert.h). */
#include "test_bert.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const test_bert_cfg test_bert_a = {"bert-a", 64, 2, 128, 2, 40, 24, 1e-12, 0, 1.0f};
const test_bert_cfg test_bert_b = {"bert-b", 48, 2, 96, 3, 20, 0, 1e-5, 1, 0.004f};

static const char vocab_text[] =
    "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"
    "the\ncat\ndog\nsat\non\nmat\na\nand\nran\nto\npark\nshe\nhe\nlikes\npizza\n"
    "caroline\nmelanie\nwent\nbeach\nwith\nher\nkids\nlast\nweek\npainting\n"
    "##s\n##ing\n##ed\nun\n##able\n,\n.\n!\n?\nin\n";

const char *const test_bert_words[] = {
    "the",   "cat",  "dog", "sat",  "on",    "mat",   "a",        "and",     "ran",
    "to",    "park", "she", "he",   "likes", "pizza", "caroline", "melanie", "went",
    "beach", "with", "her", "kids", "last",  "week",  "painting", "in",      NULL,
};

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-a, a). */
static float urand(uint64_t *s, float a) {
    return (float)(((double)(rng_next(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0) * a);
}

static int write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "test_bert: cannot create %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = fwrite(data, 1, n, f) == n ? 0 : -1;
    if (fclose(f) != 0) rc = -1;
    if (rc) fprintf(stderr, "test_bert: cannot write %s\n", path);
    return rc;
}

typedef struct st_tensor {
    char name[96];
    int32_t n_dims;
    int64_t shape[2];
    float *data; /* [shape[0] * shape[1]] */
} st_tensor;

static size_t st_numel(const st_tensor *t) {
    return (size_t)(t->shape[0] * (t->n_dims > 1 ? t->shape[1] : 1));
}

/* safetensors: 8-byte little-endian header length, the JSON header padded
 * with spaces to 8 bytes, then the F32 data. */
static int st_write(const char *path, const st_tensor *t, int32_t n) {
    size_t hcap = 256 + (size_t)n * 256, hl = 0, dl = 0;
    char *h = malloc(hcap);
    if (!h) return -1;
    hl += (size_t)snprintf(h + hl, hcap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int32_t i = 0; i < n; i++) {
        hl += (size_t)snprintf(h + hl, hcap - hl, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[",
                               t[i].name);
        for (int32_t d = 0; d < t[i].n_dims; d++)
            hl += (size_t)snprintf(h + hl, hcap - hl, "%s%lld", d ? "," : "",
                                   (long long)t[i].shape[d]);
        hl += (size_t)snprintf(h + hl, hcap - hl, "],\"data_offsets\":[%zu,%zu]}", dl,
                               dl + 4 * st_numel(&t[i]));
        dl += 4 * st_numel(&t[i]);
    }
    hl += (size_t)snprintf(h + hl, hcap - hl, "}");
    while (hl % 8) h[hl++] = ' ';
    FILE *f = fopen(path, "wb");
    int rc = f ? 0 : -1;
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    if (!rc && (fwrite(len, 1, 8, f) != 8 || fwrite(h, 1, hl, f) != hl)) rc = -1;
    for (int32_t i = 0; !rc && i < n; i++)
        if (fwrite(t[i].data, 4, st_numel(&t[i]), f) != st_numel(&t[i])) rc = -1;
    if (f && fclose(f) != 0) rc = -1;
    if (rc) fprintf(stderr, "test_bert: cannot write %s\n", path);
    free(h);
    return rc;
}

static int add_tensor(st_tensor *t, int32_t *n, uint64_t *rng, const char *name, int64_t d0,
                      int64_t d1, float scale, float offset) {
    st_tensor *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, "%s", name);
    x->n_dims = d1 ? 2 : 1;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->data = malloc(st_numel(x) * sizeof(float));
    if (!x->data) return -1;
    for (size_t i = 0; i < st_numel(x); i++) x->data[i] = offset + urand(rng, scale);
    return 0;
}

int test_bert_write(const char *parent, const test_bert_cfg *c, uint64_t *rng) {
    char dir[512], path[600], buf[1024];
    snprintf(dir, sizeof dir, "%s/%s", parent, c->name);
    if (mkdir(dir, 0755) != 0) {
        fprintf(stderr, "test_bert: cannot create %s: %s\n", dir, strerror(errno));
        return -1;
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    int len = snprintf(
        buf, sizeof buf,
        "{\"hidden_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d,"
        " \"intermediate_size\": %d, \"vocab_size\": %d, \"max_position_embeddings\": %d,"
        " \"hidden_act\": \"gelu\", \"layer_norm_eps\": %g, \"type_vocab_size\": 2,"
        " \"position_embedding_type\": \"absolute\"}",
        (int)c->H, (int)c->layers, (int)c->heads, (int)c->I, TEST_BERT_VOCAB, (int)c->P, c->eps);
    if (write_file(path, buf, (size_t)len)) return -1;
    snprintf(path, sizeof path, "%s/vocab.txt", dir);
    if (write_file(path, vocab_text, sizeof vocab_text - 1)) return -1;
    if (c->max_seq) {
        snprintf(path, sizeof path, "%s/sentence_bert_config.json", dir);
        len = snprintf(buf, sizeof buf, "{\"max_seq_length\": %d}", (int)c->max_seq);
        if (write_file(path, buf, (size_t)len)) return -1;
    }
    if (c->cls) {
        snprintf(path, sizeof path, "%s/1_Pooling", dir);
        if (mkdir(path, 0755) != 0) return -1;
        snprintf(path, sizeof path, "%s/1_Pooling/config.json", dir);
        len = snprintf(buf, sizeof buf,
                       "{\"word_embedding_dimension\": %d, \"pooling_mode_cls_token\": true,"
                       " \"pooling_mode_mean_tokens\": false}",
                       (int)c->H);
        if (write_file(path, buf, (size_t)len)) return -1;
    }
    const int64_t H = c->H, I = c->I;
    if (c->layers > 16) return -1;
    st_tensor t[8 + 16 * 16];
    int32_t n = 0;
    int rc = 0;
    rc |= add_tensor(t, &n, rng, "embeddings.word_embeddings.weight", TEST_BERT_VOCAB, H, c->emb,
                     0.0f);
    rc |= add_tensor(t, &n, rng, "embeddings.position_embeddings.weight", c->P, H, c->emb, 0.0f);
    rc |= add_tensor(t, &n, rng, "embeddings.token_type_embeddings.weight", 2, H, 0.5f * c->emb,
                     0.0f);
    rc |= add_tensor(t, &n, rng, "embeddings.LayerNorm.weight", H, 0, 0.2f, 1.0f);
    rc |= add_tensor(t, &n, rng, "embeddings.LayerNorm.bias", H, 0, 0.1f, 0.0f);
    for (int32_t l = 0; l < c->layers; l++) {
        static const struct {
            const char *sfx;
            int d0, d1; /* 0: H, 1: I, -1: none (d1 only) */
            float scale, offset;
        } lt[] = {
            {"attention.self.query.weight", 0, 0, 0.25f, 0.0f},
            {"attention.self.query.bias", 0, -1, 0.1f, 0.0f},
            {"attention.self.key.weight", 0, 0, 0.25f, 0.0f},
            {"attention.self.key.bias", 0, -1, 0.1f, 0.0f},
            {"attention.self.value.weight", 0, 0, 0.25f, 0.0f},
            {"attention.self.value.bias", 0, -1, 0.1f, 0.0f},
            {"attention.output.dense.weight", 0, 0, 0.2f, 0.0f},
            {"attention.output.dense.bias", 0, -1, 0.1f, 0.0f},
            {"attention.output.LayerNorm.weight", 0, -1, 0.2f, 1.0f},
            {"attention.output.LayerNorm.bias", 0, -1, 0.1f, 0.0f},
            {"intermediate.dense.weight", 1, 0, 0.25f, 0.0f},
            {"intermediate.dense.bias", 1, -1, 0.2f, 0.0f},
            {"output.dense.weight", 0, 1, 0.15f, 0.0f},
            {"output.dense.bias", 0, -1, 0.1f, 0.0f},
            {"output.LayerNorm.weight", 0, -1, 0.2f, 1.0f},
            {"output.LayerNorm.bias", 0, -1, 0.1f, 0.0f},
        };
        for (size_t j = 0; j < sizeof lt / sizeof *lt; j++) {
            char nm[96];
            snprintf(nm, sizeof nm, "encoder.layer.%d.%s", (int)l, lt[j].sfx);
            const int64_t d0 = lt[j].d0 ? I : H, d1 = lt[j].d1 < 0 ? 0 : lt[j].d1 ? I : H;
            rc |= add_tensor(t, &n, rng, nm, d0, d1, lt[j].scale, lt[j].offset);
        }
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!rc) rc = st_write(path, t, n);
    for (int32_t i = 0; i < n; i++) free(t[i].data);
    return rc;
}

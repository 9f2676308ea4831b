/*
 * Forward pass on the architecture variants the default model does not
 * exercise, against transformers: tiny random-weight models written by
 * tools/make_tiny_models.py to tests/golden/tiny/ (qwen2 with q/k/v biases and
 * NeoX RoPE, in f32 and Q8_0; llama with Llama-3.1 frequency scaling through
 * rope_freqs.weight; Mistral-style llama with head_dim != dim / n_heads; all
 * GQA with an untied output head). For every model and prompt: the logits at
 * every position within 1e-3 of the reference's logit range with the same
 * argmax, and the same 16 greedy tokens (prompt prefilled in chunks of 64,
 * then one token per step through the KV cache).
 *
 * The golden directory can be overridden with IS_TINY_GOLDEN_DIR (used to
 * check that a deliberately broken model set makes this test fail).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "test_util.h"
#include "engine/sampler.h"

#define N_GREEDY    16
#define MAX_MODELS  16
#define MAX_PROMPTS 8
#define TOLERANCE   1e-3 /* of the reference's logit range; never loosened */

typedef struct tiny_prompt {
    char name[32];
    int32_t *tokens;
    int32_t n_tokens;
    float *all; /* [n_tokens][n_vocab] reference logits */
    int32_t greedy[N_GREEDY];
} tiny_prompt;

typedef struct tiny_model {
    char name[64];
    char gguf[1024];
    char arch[32];
    int32_t n_vocab;
    int32_t head_dim; /* expected from the config */
    bool qkv_bias;
    bool rope_scaled; /* llama3 scaling: expects rope_freqs */
    tiny_prompt prompts[MAX_PROMPTS];
    int n_prompts;
} tiny_model;

static char g_dir[400];
static tiny_model g_models[MAX_MODELS];
static int g_n_models;

static float *read_f32(const char *name, size_t expect) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    size_t n = 0;
    float *d = test_read_file(path, &n);
    if (!d || n != expect * sizeof(float)) {
        fprintf(stderr, "golden file %s: expected %zu floats, got %zu bytes\n", path, expect, n);
        free(d);
        return NULL;
    }
    return d;
}

static const char *json_str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* Reads the manifest into g_models. 0 on success. */
static int manifest_load(void) {
    const char *env = getenv("IS_TINY_GOLDEN_DIR");
    snprintf(g_dir, sizeof g_dir, "%s", env && *env ? env : IS_GOLDEN_DIR "/tiny");
    char path[1024];
    snprintf(path, sizeof path, "%s/manifest.json", g_dir);
    size_t n;
    char *json = test_read_file(path, &n);
    if (!json) {
        fprintf(stderr, "cannot read %s (run tools/make_tiny_models.py)\n", path);
        return -1;
    }
    cJSON *root = cJSON_Parse(json);
    free(json);
    if (!root) return -1;
    const cJSON *ms = cJSON_GetObjectItem(root, "models"), *mj;
    int rc = 0;
    cJSON_ArrayForEach(mj, ms) {
        if (g_n_models == MAX_MODELS) break;
        tiny_model *m = &g_models[g_n_models++];
        const cJSON *cfg = cJSON_GetObjectItem(mj, "config");
        snprintf(m->name, sizeof m->name, "%s", json_str(mj, "name"));
        snprintf(m->gguf, sizeof m->gguf, "%s/%s", g_dir, json_str(mj, "gguf"));
        snprintf(m->arch, sizeof m->arch, "%s", json_str(mj, "arch"));
        m->n_vocab = cJSON_GetObjectItem(mj, "n_vocab")->valueint;
        const cJSON *hd = cJSON_GetObjectItem(cfg, "head_dim");
        m->head_dim = cJSON_IsNumber(hd) ? hd->valueint
                                         : cJSON_GetObjectItem(cfg, "dim")->valueint /
                                               cJSON_GetObjectItem(cfg, "n_heads")->valueint;
        m->qkv_bias = cJSON_IsTrue(cJSON_GetObjectItem(cfg, "qkv_bias"));
        m->rope_scaled = cJSON_IsObject(cJSON_GetObjectItem(cfg, "rope_scaling"));
        const cJSON *pj;
        cJSON_ArrayForEach(pj, cJSON_GetObjectItem(mj, "prompts")) {
            if (m->n_prompts == MAX_PROMPTS) break;
            tiny_prompt *p = &m->prompts[m->n_prompts++];
            snprintf(p->name, sizeof p->name, "%s", json_str(pj, "name"));
            const cJSON *toks = cJSON_GetObjectItem(pj, "tokens");
            p->n_tokens = cJSON_GetArraySize(toks);
            p->tokens = malloc((size_t)p->n_tokens * sizeof(int32_t));
            for (int32_t i = 0; i < p->n_tokens; i++)
                p->tokens[i] = cJSON_GetArrayItem(toks, i)->valueint;
            p->all = read_f32(json_str(pj, "all_logits"), (size_t)m->n_vocab * p->n_tokens);
            const cJSON *gr = cJSON_GetObjectItem(pj, "greedy");
            if (!p->all || cJSON_GetArraySize(gr) != N_GREEDY) rc = -1;
            for (int i = 0; i < N_GREEDY && i < cJSON_GetArraySize(gr); i++)
                p->greedy[i] = cJSON_GetArrayItem(gr, i)->valueint;
        }
    }
    cJSON_Delete(root);
    return g_n_models > 0 ? rc : -1;
}

static void manifest_free(void) {
    for (int i = 0; i < g_n_models; i++)
        for (int j = 0; j < g_models[i].n_prompts; j++) {
            free(g_models[i].prompts[j].tokens);
            free(g_models[i].prompts[j].all);
        }
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* max |a - ref| / (max(ref) - min(ref)) */
static engine *make_engine(model *m, int32_t max_batch) {
    engine_params ep = engine_default_params();
    ep.n_ctx = 1024;
    ep.max_seqs = 1;
    ep.max_batch = max_batch;
    engine *e = NULL;
    assert_int_equal(engine_create(m, ep, &e), IS_OK);
    return e;
}

/* Every position of the prompt in one batch against the reference. */
static void check_all_positions(model *m, const tiny_model *tm, const tiny_prompt *p) {
    int32_t V = tm->n_vocab, n = p->n_tokens;
    float *logits = malloc((size_t)V * n * sizeof(float));
    bool *want = malloc((size_t)n);
    int32_t *seq = calloc((size_t)n, sizeof *seq);
    for (int32_t t = 0; t < n; t++) want[t] = true;
    engine *e = make_engine(m, 512);
    int32_t s;
    assert_int_equal(engine_seq_open(e, &s), IS_OK);
    for (int32_t t = 0; t < n; t++) seq[t] = s;
    engine_batch b = {.n_tokens = n, .tokens = p->tokens, .seq = seq, .want_logits = want};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    double worst = 0;
    int32_t worst_t = 0, bad_argmax = -1;
    for (int32_t t = 0; t < n; t++) {
        const float *got = logits + (size_t)t * V, *ref = p->all + (size_t)t * V;
        double err = test_rel_range_err(got, ref, V);
        if (err > worst) {
            worst = err;
            worst_t = t;
        }
        if (bad_argmax < 0 && argmax(got, V) != argmax(ref, V)) bad_argmax = t;
    }
    printf("  %-12s %-7s %4d tokens: max |diff| / range = %.2e (position %d)\n", tm->name, p->name,
           n, worst, worst_t);
    if (worst > TOLERANCE)
        fail_msg("%s/%s: position %d differs by %.2e of the logit range", tm->name, p->name,
                 worst_t, worst);
    if (bad_argmax >= 0)
        fail_msg("%s/%s: argmax differs at position %d", tm->name, p->name, bad_argmax);
    engine_free(e);
    free(logits);
    free(want);
    free(seq);
}

/* Prefill in chunks of 64 (several forward chunks for the long prompts), then
 * 16 greedy steps one token at a time. */
static void check_greedy(model *m, const tiny_model *tm, const tiny_prompt *p) {
    int32_t V = tm->n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t *seq = calloc((size_t)p->n_tokens, sizeof *seq);
    engine *e = make_engine(m, 64);
    int32_t s;
    assert_int_equal(engine_seq_open(e, &s), IS_OK);
    for (int32_t t = 0; t < p->n_tokens; t++) seq[t] = s;
    engine_batch b = {.n_tokens = p->n_tokens, .tokens = p->tokens, .seq = seq};
    assert_int_equal(engine_decode(e, &b, logits), IS_OK);
    double err = test_rel_range_err(logits, p->all + (size_t)(p->n_tokens - 1) * V, V);
    if (err > TOLERANCE)
        fail_msg("%s/%s: chunked prefill's last logits differ by %.2e", tm->name, p->name, err);
    for (int k = 0; k < N_GREEDY; k++) {
        int32_t tok = sampler_argmax(logits, V);
        if (tok != p->greedy[k])
            fail_msg("%s/%s: greedy token %d is %d, reference %d", tm->name, p->name, k, tok,
                     p->greedy[k]);
        engine_batch one = {.n_tokens = 1, .tokens = &tok, .seq = &s};
        assert_int_equal(engine_decode(e, &one, logits), IS_OK);
    }
    engine_free(e);
    free(logits);
    free(seq);
}

static void test_model(void **state) {
    const tiny_model *tm = *state;
    backend *be = NULL;
    model *m = NULL;
    assert_int_equal(backend_cpu_create(0, &be), IS_OK);
    if (model_load(tm->gguf, be, &m) != IS_OK)
        fail_msg("model_load %s: %s", tm->gguf, is_error_last());
    /* The loader read the variant the file describes. */
    const model_config *c = &m->cfg;
    assert_string_equal(c->arch, tm->arch);
    assert_int_equal(c->n_vocab, tm->n_vocab);
    assert_int_equal(c->head_dim, tm->head_dim);
    assert_int_equal(c->has_qkv_bias, tm->qkv_bias);
    assert_false(c->tied_output);
    assert_true(c->n_kv_heads < c->n_heads);
    assert_int_equal(c->rope.layout,
                     strcmp(tm->arch, "qwen2") == 0 ? ROPE_LAYOUT_NEOX : ROPE_LAYOUT_NORM);
    assert_int_equal(c->rope.freq_factors != NULL, tm->rope_scaled);
    for (int i = 0; i < tm->n_prompts; i++) {
        check_all_positions(m, tm, &tm->prompts[i]);
        check_greedy(m, tm, &tm->prompts[i]);
    }
    model_free(m);
    be->ops->free(be);
}

int main(void) {
    if (manifest_load() != 0) {
        manifest_free();
        return 1;
    }
    struct CMUnitTest tests[MAX_MODELS];
    for (int i = 0; i < g_n_models; i++) {
        struct CMUnitTest t = {
            .name = g_models[i].name, .test_func = test_model, .initial_state = &g_models[i]};
        tests[i] = t;
    }
    int rc = _cmocka_run_group_tests("test_tiny_models", tests, (size_t)g_n_models, NULL, NULL);
    manifest_free();
    return rc;
}

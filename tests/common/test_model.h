/*
 * test_model: the engine tests' fixture on the default model: the model
 * and its serving prompt loaded once per program, engines of the sizes a
 * test picks, facts encoded right after the serving prefix (w = 0, their
 * pre-RoPE keys and values captured), and the sequences and token lists
 * the comparisons start from. The helpers run inside a cmocka case and
 * fail it when the engine refuses.
 */
#ifndef IS_TESTS_TEST_MODEL_H
#define IS_TESTS_TEST_MODEL_H

#include "engine/engine.h"
#include "serve/memory_prompt.h"

#include <stdint.h>

/* Makes the backend named backend_name (backend_create: "cpu" or "cuda")
 * into *be, and loads the default model (IS_DEFAULT_MODEL) on it and, when
 * mp is not NULL, its serving prompt (memory_prompt_create with the
 * default header). *m (and *mp) stay NULL when the model is not installed:
 * cases then skip (TEST_SKIP). 0, or -1 when any of it fails, with the
 * reason on stderr: a cmocka group setup's return. */
int test_model_open(const char *backend_name, backend **be, model **m, memory_prompt **mp);

/* Frees the prompt, the model and the backend (each may be NULL): 0, a
 * cmocka group teardown's return. */
int test_model_close(backend *be, model *m, memory_prompt *mp);

/* Loads the default model on the backend be, made by the caller (nothing
 * else: *m stays NULL without the model) and, when the model is there, makes
 * a scratch directory from the mkdtemp template dir (rewritten in place).
 * 0, or -1 when loading or making the directory fails. */
int test_model_open_scratch(backend *be, model **m, char *dir);

/* test_model_close, and removes the scratch directory (made when m is not
 * NULL) with everything in it. 0, or -1 if it could not be removed. */
int test_model_close_scratch(backend *be, model *m, const char *dir);

/* engine_default_params with these sizes (max_batch 0: the default's). */
engine_params test_engine_params(int32_t n_ctx, int32_t max_seqs, int32_t max_batch);

/* engine_create on m with ep; the case fails if it refuses. */
engine *test_engine_create(model *m, engine_params ep);

/* Facts of one LoCoMo conversation (Caroline and Melanie) that the engine
 * tests encode: as sentences, and led by their session's date. */
#define TEST_N_LOCOMO_FACTS 22
extern const char *const test_locomo_facts[TEST_N_LOCOMO_FACTS];
#define TEST_N_LOCOMO_DATED_FACTS 4
extern const char *const test_locomo_dated_facts[TEST_N_LOCOMO_DATED_FACTS];

/* A fact's tokens and its keys and values: f32, pre-RoPE,
 * [n_layers][n][n_kv_heads * head_dim]. */
typedef struct test_fact {
    int32_t *toks, n;
    float *k, *v;
} test_fact;

/* Tokenises text as a fact (memory_prompt_fact) and captures its keys and
 * values from a prefill of the serving prefix followed by the fact, on a
 * sequence of its own (closed after). */
void test_fact_encode(engine *e, const memory_prompt *mp, const char *text, test_fact *f);

/* Frees f[0..n) (not the array). */
void test_facts_free(test_fact *f, int n);

/* The engine_fact of each of f[0..n) into out[0..n) (borrowing f's arrays). */
void test_facts_to_engine(const test_fact *f, int n, engine_fact *out);

/* Runs toks[0..n) on a new sequence in one batch and closes it: the last
 * token's logits into logits; cap (may be NULL) captures keys and values. */
void test_prefill(engine *e, const int32_t *toks, int32_t n, engine_kv_capture *cap, float *logits);

/* Appends toks[0..n) to sequence seq in one batch: the last token's
 * logits into logits. */
void test_decode_seq(engine *e, int32_t seq, const int32_t *toks, int32_t n, float *logits);

/* Opens a sequence holding the serving prefix (the cached prefix requests
 * fork): its id; the last prefix token's logits into logits. */
int32_t test_prefix_open(engine *e, const memory_prompt *mp, float *logits);

/* What a request reading the cached prefix ps gets now: the last prefix
 * token decoded again on a fork of ps's other tokens (closed after), its
 * logits into logits. Equal to test_prefix_open's while nothing wrote into
 * the shared blocks. */
void test_prefix_logits(engine *e, const memory_prompt *mp, int32_t ps, float *logits);

/* Prompt mode's tokens: the serving prefix, each fact's tokens, then
 * suf[0..ns), into toks (room for cap, which must be enough): their count. */
int32_t test_prompt_tokens(const memory_prompt *mp, const test_fact *f, int n, const int32_t *suf,
                           int32_t ns, int32_t *toks, int32_t cap);

#endif

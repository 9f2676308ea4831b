/*
 * sampler: picking the next token from a row of logits.
 *
 * The pipeline is the usual one (the order Hugging Face transformers uses):
 *   1. temperature: p_i proportional to exp(logit_i / T); T = 0 means greedy
 *      (the first index of the largest logit, no randomness at all);
 *   2. top-k: keep the k largest logits (ties broken by lower token id);
 *   3. top-p (nucleus): over the surviving tokens, renormalised and sorted
 *      by probability, keep the shortest prefix whose mass reaches top_p
 *      (always at least one token);
 *   4. draw one token from what is left, in proportion to its probability,
 *      with the sampler's own xoshiro256** generator.
 * The same seed and the same logits give the same tokens on every machine
 * that rounds expf() the same way. NaN logits count as -inf, so a broken row
 * never crashes the sampler; if every logit is NaN or -inf, token 0 is
 * returned.
 *
 * Cost per call: O(n_vocab) for greedy, top-k (a k-element heap, then a sort
 * of k) and plain temperature sampling; with top-p and no top-k, the mass is
 * summed per narrow probability bucket and only the bucket where the nucleus
 * ends is sorted.
 */
#ifndef IS_ENGINE_SAMPLER_H
#define IS_ENGINE_SAMPLER_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct sampler_params {
    float temperature; /* >= 0; 0 = greedy */
    int32_t top_k;     /* >= 0; 0 = off (all tokens) */
    float top_p;       /* in (0, 1]; 1 = off */
    uint64_t seed;     /* PRNG seed; 0 = draw one from the clock (see sampler_seed) */
} sampler_params;

/* temperature 0.8, top_k 40, top_p 0.95, seed 0: a fresh random seed per
 * sampler. Set a non-zero seed for reproducible output. */
sampler_params sampler_default_params(void);

typedef struct sampler sampler;

/* Creates a sampler for rows of `n_vocab` logits and stores it in *out.
 * Returns IS_ERR_INVALID_ARG for out == NULL, n_vocab <= 0, a negative or
 * non-finite temperature, top_k < 0, or top_p outside (0, 1] (NaN included);
 * IS_ERR_NOMEM if its scratch buffers cannot be allocated. *out is untouched
 * on failure. */
is_status sampler_create(sampler_params p, int32_t n_vocab, sampler **out);

/* Frees a sampler; NULL is a no-op. */
void sampler_free(sampler *s);

/* The seed actually in use: p.seed, or the one drawn when p.seed was 0.
 * A sampler created with this seed replays the same choices. */
uint64_t sampler_seed(const sampler *s);

/* Samples a token id in [0, n_vocab) from logits[n_vocab] (not modified).
 * Greedy (temperature 0, or top_k 1) returns sampler_argmax() and does not
 * advance the generator. Returns -1 only if s or logits is NULL. */
int32_t sampler_sample(sampler *s, const float *logits);

/* Whether s always takes the argmax (temperature 0, or top_k 1), so that
 * its choice needs only that index (engine_decode_greedy). */
bool sampler_is_greedy(const sampler *s);

/* Index of the largest of logits[n], the lowest one on ties; NaNs are
 * skipped; 0 if every value is NaN or -inf; -1 if logits is NULL or n <= 0. */
int32_t sampler_argmax(const float *logits, int32_t n);

#endif

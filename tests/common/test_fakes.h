/*
 * test_fakes: stand-ins for the memory layer's models, for tests that
 * exercise storage, crashes and nodes without running a network: a hashed
 * bag-of-words sentence embedder (deterministic; texts sharing words score
 * alike) and a tiny KV record that still carries its fact's text hash and
 * window, so the service's checks (memory_check, reconciliation) apply;
 * and an empty PostgreSQL database for each case of a test on that store.
 */
#ifndef IS_TEST_FAKES_H
#define IS_TEST_FAKES_H

#include "kv/fact_record.h"
#include "kv/record_store.h"
#include "memory/memory.h"

#include <stdbool.h>
#include <stdint.h>

/* The dimension of test_fake_embed. */
#define TEST_FAKE_DIM 64

/* Hashed bag of lowercased alphanumeric words, L2-normalised, dim floats a
 * text into out[n * dim]. A text without words gets e0. */
void test_bow_embed(const char *const *texts, int32_t n, int32_t dim, float *out);

/* A memory_embed_fn: test_bow_embed with TEST_FAKE_DIM. */
is_status test_fake_embed(void *user_data, const char *const *texts, int32_t n, float *out);

/* The metadata of a fake record: the fake model's fingerprint, f32, one
 * layer and KV head of 4 dims, n_tokens tokens, the window, and the hash
 * of hash_text. */
void test_fake_meta(fact_kv_meta *m, int32_t n_tokens, int32_t window, const char *hash_text);

/* Writes the small valid record of a fake encoder for job (f32, one layer,
 * head and two tokens; tokens = {tokens0, job->window}; the text's hash).
 * record_store_put's status. */
is_status test_fake_record_put(record_store *rs, const memory_encode_job *job, int32_t tokens0);

/* Empties the PostgreSQL database at url (its public schema dropped and
 * made again). False if that fails or the build has no libpq. */
bool test_pg_reset(const char *url);

#endif

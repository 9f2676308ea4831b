/*
 * bm25: lexical retrieval over a user's facts, the other half of the memory
 * index's hybrid search (memory/index.h fuses it with the dense ranking).
 *
 * Dense embeddings miss exact names, numbers and rare words ("Oscar",
 * "Grand Canyon", "2022") that a query shares with a fact; BM25 on the same
 * facts catches them, and reciprocal-rank fusion keeps the best of both.
 *
 * Tokens: the text is normalised with utf8proc (NFKC compatibility mapping,
 * case folding, marks stripped, default-ignorable characters dropped, so
 * "Café", "CAFE" and "cafe" are one term), then split into maximal runs of
 * letters and digits (Unicode categories L* and N*); each CJK ideograph is
 * a token of its own, as BERT does, since Chinese has no spaces. Stripping
 * marks also drops Japanese voicing marks (が -> か), as BERT uncased does;
 * documents and queries go through the same steps, so terms still match. A small
 * English stopword list is dropped (Lucene's 33 words plus the contraction
 * remnants "s", "t", "d", "ll", "m", "re", "ve"). No stemming.
 *
 * Scoring (Okapi BM25 with Lucene's idf, exact document lengths):
 *
 *   score(D, Q) = sum over query tokens q of
 *                 idf(q) * tf(q,D) * (k1 + 1) / (tf(q,D) + k1 * (1 - b + b * |D| / avgdl))
 *   idf(q)      = ln(1 + (N - df(q) + 0.5) / (df(q) + 0.5))
 *
 * with k1 = 1.2, b = 0.75, N the number of documents in this index (one
 * user's facts), df the number holding the term, |D| a document's token
 * count after stopwords, avgdl their mean. A query is a bag: a term written
 * twice counts twice (as rank_bm25 and Lucene's boolean query do). Unlike
 * Lucene 8+, the (k1 + 1) factor is kept (it only scales scores) and
 * lengths are not quantised to one byte.
 *
 * Documents are rows 0..n-1, kept aligned with the caller's own row arrays:
 * bm25_add appends row n, bm25_remove moves the last row into the hole,
 * exactly as the caller's swap-remove does.
 *
 * Threads: the index has no lock of its own. Scoring is read-only, so any
 * number of threads may score at once while none modifies (memory/index.c
 * holds a rwlock around it). Tokenising touches nothing shared.
 */
#ifndef IS_MEMORY_BM25_H
#define IS_MEMORY_BM25_H

#include "inferscale.h"

#include <stdbool.h>
#include <stdint.h>

#define BM25_K1 1.2f
#define BM25_B  0.75f

/* ---- tokenizer ------------------------------------------------------------ */

typedef struct bm25_tokens {
    char *buf;    /* tokens, each NUL-terminated */
    int32_t *off; /* [n] start of token i in buf */
    int32_t *len; /* [n] its length in bytes */
    int32_t n;
} bm25_tokens;

/* Splits `text` (NUL-terminated UTF-8) into normalised terms, stopwords
 * dropped; a NULL text gives no tokens. IS_ERR_INVALID_ARG if the text is
 * not valid UTF-8, IS_ERR_NOMEM. *out is zeroed on failure. */
is_status bm25_tokenize(const char *text, bm25_tokens *out);
void bm25_tokens_free(bm25_tokens *t);

/* ---- index ---------------------------------------------------------------- */

typedef struct bm25_index bm25_index;

/* A document made ready for bm25_add: its distinct terms and counts. */
typedef struct bm25_doc {
    int32_t *pairs; /* [n_terms][2]: term id, term frequency */
    int32_t n_terms;
    int32_t len; /* tokens in the document */
} bm25_doc;

is_status bm25_create(bm25_index **out);
void bm25_free(bm25_index *ix);

int32_t bm25_n_docs(const bm25_index *ix);

/* Readies a document for bm25_add: interns its terms and reserves the room
 * that adding it takes (posting and row capacity), so that bm25_add cannot
 * fail as long as no other document is added in between. IS_ERR_NOMEM: the
 * documents are unchanged (some interned terms may stay unused). *doc is
 * zeroed on failure; free an unused one with bm25_doc_free. */
is_status bm25_prepare(bm25_index *ix, const bm25_tokens *t, bm25_doc *doc);
void bm25_doc_free(bm25_doc *doc);

/* Appends the prepared document as row n_docs, taking ownership of *doc
 * (which is zeroed). */
void bm25_add(bm25_index *ix, bm25_doc *doc);

/* Removes row `row`; the last row, if another, takes its number. */
void bm25_remove(bm25_index *ix, int32_t row);

/* Adds every row's score for the query to acc[row] (acc: [n_docs], zeroed
 * by the caller) and lists the rows that match at least one query term in
 * touched[0..*n_touched) (touched: [n_docs]); their scores are > 0, the
 * others' stay 0. Read-only on the index. IS_ERR_NOMEM (outputs then
 * undefined). */
is_status bm25_score(const bm25_index *ix, const bm25_tokens *query, float *acc, int32_t *touched,
                     int32_t *n_touched);

/* Checks that postings, document frequencies, per-row term lists and the
 * total length agree. For asserts and tests. */
bool bm25_check(const bm25_index *ix);

#endif

/*
 * bm25: tokenizer and per-user inverted index with Okapi BM25 scoring (see
 * bm25.h for the definitions).
 *
 * Layout: a vocabulary (term text -> term id), per term a posting list of
 * (row, tf) in no particular order, per row its distinct terms with their
 * frequencies (needed to take a row out of the postings again). Postings are
 * unsorted because rows move on swap-remove; removing or moving a row scans
 * the posting lists of its own terms, O(sum of their df), which is fine for
 * occasional writes and keeps the search loop a plain scatter-add.
 */
#include "memory/bm25.h"

#include "core/status.h"
#include "memory/strmap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ---- tokenizer ------------------------------------------------------------ */

/* Lucene's English stop set plus the pieces contractions split into. */
static const char *const bm25_stopwords[] = {
    "a",    "an",   "and",  "are",   "as",   "at",    "be",    "but",  "by",   "for",
    "if",   "in",   "into", "is",    "it",   "no",    "not",   "of",   "on",   "or",
    "such", "that", "the",  "their", "then", "there", "these", "they", "this", "to",
    "was",  "will", "with", "s",     "t",    "d",     "ll",    "m",    "re",   "ve",
};

static bool bm25_is_stopword(const char *s, int32_t len) {
    if (len > 5) return false;
    for (size_t i = 0; i < sizeof bm25_stopwords / sizeof *bm25_stopwords; i++) {
        const char *w = bm25_stopwords[i];
        if ((int32_t)strlen(w) == len && memcmp(w, s, (size_t)len) == 0) return true;
    }
    return false;
}

/* CJK ideographs, the blocks BERT's tokenizer splits one by one. */
static bool bm25_is_cjk(utf8proc_int32_t c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

static bool bm25_is_word_char(utf8proc_int32_t c) {
    switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO: return true;
    default: return false;
    }
}

void bm25_tokens_free(bm25_tokens *t) {
    free(t->buf);
    free(t->off);
    free(t->len);
    memset(t, 0, sizeof *t);
}

is_status bm25_tokenize(const char *text, bm25_tokens *out) {
    memset(out, 0, sizeof *out);
    if (!text || !*text) return IS_OK;
    utf8proc_uint8_t *norm = NULL;
    utf8proc_ssize_t nn =
        utf8proc_map((const utf8proc_uint8_t *)text, 0, &norm,
                     UTF8PROC_NULLTERM | UTF8PROC_STABLE | UTF8PROC_COMPAT | UTF8PROC_COMPOSE |
                         UTF8PROC_CASEFOLD | UTF8PROC_STRIPMARK | UTF8PROC_IGNORE);
    if (nn < 0) {
        if (nn == UTF8PROC_ERROR_NOMEM) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
        return is_error_set(IS_ERR_INVALID_ARG, "bm25: text: %s", utf8proc_errmsg(nn));
    }
    /* Every token takes its bytes plus a NUL, and tokens are separated by at
     * least one byte except CJK ideographs (3-4 bytes each): 2n+1 is room. */
    bm25_tokens t = {0};
    int32_t cap_tok = 16;
    t.buf = malloc((size_t)nn * 2 + 1);
    t.off = malloc(sizeof *t.off * (size_t)cap_tok);
    t.len = malloc(sizeof *t.len * (size_t)cap_tok);
    if (!t.buf || !t.off || !t.len) goto nomem;
    int32_t w = 0;      /* write position in buf */
    int32_t start = -1; /* start of the open token in buf, or -1 */
    utf8proc_ssize_t r = 0;
    for (;;) {
        utf8proc_int32_t c = -1;
        utf8proc_ssize_t step = 0;
        if (r < nn) {
            step = utf8proc_iterate(norm + r, nn - r, &c);
            IS_ASSERT(step > 0); /* utf8proc_map produced valid UTF-8 */
        }
        bool word = c >= 0 && bm25_is_word_char(c);
        bool cjk = word && bm25_is_cjk(c);
        if (start >= 0 && (!word || cjk)) { /* close the open token */
            int32_t len = w - start;
            if (bm25_is_stopword(t.buf + start, len)) {
                w = start;
            } else {
                if (t.n == cap_tok) {
                    cap_tok *= 2;
                    int32_t *o = realloc(t.off, sizeof *o * (size_t)cap_tok);
                    if (!o) goto nomem;
                    t.off = o;
                    int32_t *l = realloc(t.len, sizeof *l * (size_t)cap_tok);
                    if (!l) goto nomem;
                    t.len = l;
                }
                t.off[t.n] = start;
                t.len[t.n] = len;
                t.n++;
                t.buf[w++] = '\0';
            }
            start = -1;
        }
        if (c < 0) break;
        if (word) {
            if (start < 0) start = w;
            memcpy(t.buf + w, norm + r, (size_t)step);
            w += (int32_t)step;
            if (cjk) { /* a token of its own: close it at once */
                if (t.n == cap_tok) {
                    cap_tok *= 2;
                    int32_t *o = realloc(t.off, sizeof *o * (size_t)cap_tok);
                    if (!o) goto nomem;
                    t.off = o;
                    int32_t *l = realloc(t.len, sizeof *l * (size_t)cap_tok);
                    if (!l) goto nomem;
                    t.len = l;
                }
                t.off[t.n] = start;
                t.len[t.n] = w - start;
                t.n++;
                t.buf[w++] = '\0';
                start = -1;
            }
        }
        r += step;
    }
    IS_ASSERT(w <= nn * 2 + 1);
    free(norm);
    *out = t;
    return IS_OK;
nomem:
    free(norm);
    bm25_tokens_free(&t);
    return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
}

/* ---- index ---------------------------------------------------------------- */

typedef struct bm25_posting {
    int32_t row;
    int32_t tf;
} bm25_posting;

typedef struct bm25_term {
    char *text;     /* owned, NUL-terminated; the vocabulary's key */
    int32_t n_post; /* = document frequency */
    int32_t cap_post;
    bm25_posting *post; /* [cap_post] */
} bm25_term;

struct bm25_index {
    strmap vocab;     /* term text -> term id */
    bm25_term *terms; /* [cap_terms] */
    int32_t n_terms, cap_terms;
    bm25_doc *rows; /* [cap_rows] per row: its terms and length */
    int32_t n_rows, cap_rows;
    int64_t total_len; /* sum of rows' len */
};

is_status bm25_create(bm25_index **out) {
    bm25_index *ix = calloc(1, sizeof *ix);
    if (!ix) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
    *out = ix;
    return IS_OK;
}

void bm25_free(bm25_index *ix) {
    if (!ix) return;
    for (int32_t i = 0; i < ix->n_terms; i++) {
        free(ix->terms[i].text);
        free(ix->terms[i].post);
    }
    for (int32_t i = 0; i < ix->n_rows; i++) free(ix->rows[i].pairs);
    free(ix->terms);
    free(ix->rows);
    strmap_free(&ix->vocab);
    free(ix);
}

int32_t bm25_n_docs(const bm25_index *ix) { return ix->n_rows; }

void bm25_doc_free(bm25_doc *doc) {
    free(doc->pairs);
    memset(doc, 0, sizeof *doc);
}

static int bm25_cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sorted term ids -> (term, count) pairs in place of a fresh array. */
static int32_t *bm25_group(const int32_t *ids, int32_t n, int32_t *n_pairs) {
    int32_t *pairs = malloc(sizeof *pairs * 2 * (size_t)(n > 0 ? n : 1));
    if (!pairs) return NULL;
    int32_t m = 0;
    for (int32_t i = 0; i < n;) {
        int32_t j = i;
        while (j < n && ids[j] == ids[i]) j++;
        pairs[2 * m] = ids[i];
        pairs[2 * m + 1] = j - i;
        m++;
        i = j;
    }
    *n_pairs = m;
    return pairs;
}

is_status bm25_prepare(bm25_index *ix, const bm25_tokens *t, bm25_doc *doc) {
    memset(doc, 0, sizeof *doc);
    if (t->n > 0 && ix->n_terms > INT32_MAX - t->n)
        return is_error_set(IS_ERR_NOMEM, "bm25: vocabulary full");
    is_status st = strmap_reserve(&ix->vocab, (uint32_t)t->n);
    if (st) return st;
    if (ix->n_terms + t->n > ix->cap_terms) {
        int64_t cap = ix->cap_terms ? ix->cap_terms : 64;
        while (cap < (int64_t)ix->n_terms + t->n) cap *= 2;
        if (cap > INT32_MAX) cap = INT32_MAX;
        bm25_term *terms = realloc(ix->terms, sizeof *terms * (size_t)cap);
        if (!terms) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
        ix->terms = terms;
        ix->cap_terms = (int32_t)cap;
    }
    if (ix->n_rows == ix->cap_rows) {
        if (ix->cap_rows == INT32_MAX) return is_error_set(IS_ERR_NOMEM, "bm25: too many rows");
        int64_t cap = ix->cap_rows ? (int64_t)ix->cap_rows * 2 : 64;
        if (cap > INT32_MAX) cap = INT32_MAX;
        bm25_doc *rows = realloc(ix->rows, sizeof *rows * (size_t)cap);
        if (!rows) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
        ix->rows = rows;
        ix->cap_rows = (int32_t)cap;
    }
    int32_t *ids = malloc(sizeof *ids * (size_t)(t->n > 0 ? t->n : 1));
    if (!ids) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
    for (int32_t i = 0; i < t->n; i++) {
        const char *s = t->buf + t->off[i];
        int64_t id;
        if (!strmap_get(&ix->vocab, s, (size_t)t->len[i], &id)) {
            char *text = malloc((size_t)t->len[i] + 1);
            if (!text) {
                free(ids);
                return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
            }
            memcpy(text, s, (size_t)t->len[i] + 1);
            id = ix->n_terms++;
            ix->terms[id] = (bm25_term){.text = text};
            strmap_put(&ix->vocab, text, (size_t)t->len[i], id);
        }
        ids[i] = (int32_t)id;
    }
    qsort(ids, (size_t)t->n, sizeof *ids, bm25_cmp_i32);
    int32_t n_pairs = 0;
    int32_t *pairs = bm25_group(ids, t->n, &n_pairs);
    free(ids);
    if (!pairs) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
    for (int32_t i = 0; i < n_pairs; i++) {
        bm25_term *term = &ix->terms[pairs[2 * i]];
        if (term->n_post < term->cap_post) continue;
        int32_t cap = term->cap_post ? term->cap_post * 2 : 4;
        bm25_posting *post = realloc(term->post, sizeof *post * (size_t)cap);
        if (!post) {
            free(pairs);
            return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
        }
        term->post = post;
        term->cap_post = cap;
    }
    doc->pairs = pairs;
    doc->n_terms = n_pairs;
    doc->len = t->n;
    return IS_OK;
}

void bm25_add(bm25_index *ix, bm25_doc *doc) {
    IS_ASSERT(ix->n_rows < ix->cap_rows);
    int32_t row = ix->n_rows++;
    for (int32_t i = 0; i < doc->n_terms; i++) {
        bm25_term *term = &ix->terms[doc->pairs[2 * i]];
        IS_ASSERT(term->n_post < term->cap_post);
        term->post[term->n_post++] = (bm25_posting){row, doc->pairs[2 * i + 1]};
    }
    ix->total_len += doc->len;
    ix->rows[row] = *doc;
    memset(doc, 0, sizeof *doc);
}

/* Index of `row`'s posting in `term`. */
static int32_t bm25_find_posting(const bm25_term *term, int32_t row) {
    for (int32_t i = 0; i < term->n_post; i++)
        if (term->post[i].row == row) return i;
    IS_ASSERT(!"row missing from a posting list of its own term");
    return -1;
}

void bm25_remove(bm25_index *ix, int32_t row) {
    IS_ASSERT(row >= 0 && row < ix->n_rows);
    bm25_doc *doc = &ix->rows[row];
    for (int32_t i = 0; i < doc->n_terms; i++) {
        bm25_term *term = &ix->terms[doc->pairs[2 * i]];
        int32_t p = bm25_find_posting(term, row);
        term->post[p] = term->post[--term->n_post];
    }
    ix->total_len -= doc->len;
    free(doc->pairs);
    int32_t last = --ix->n_rows;
    if (row != last) {
        bm25_doc *moved = &ix->rows[last];
        for (int32_t i = 0; i < moved->n_terms; i++) {
            bm25_term *term = &ix->terms[moved->pairs[2 * i]];
            term->post[bm25_find_posting(term, last)].row = row;
        }
        ix->rows[row] = *moved;
    }
    memset(&ix->rows[last], 0, sizeof ix->rows[last]);
}

is_status bm25_score(const bm25_index *ix, const bm25_tokens *query, float *acc, int32_t *touched,
                     int32_t *n_touched) {
    *n_touched = 0;
    if (ix->n_rows == 0 || query->n == 0 || ix->total_len == 0) return IS_OK;
    int32_t *ids = malloc(sizeof *ids * (size_t)query->n);
    if (!ids) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");
    int32_t n_ids = 0;
    for (int32_t i = 0; i < query->n; i++) {
        int64_t id;
        if (strmap_get(&ix->vocab, query->buf + query->off[i], (size_t)query->len[i], &id))
            ids[n_ids++] = (int32_t)id;
    }
    qsort(ids, (size_t)n_ids, sizeof *ids, bm25_cmp_i32);
    int32_t n_pairs = 0;
    int32_t *pairs = bm25_group(ids, n_ids, &n_pairs);
    free(ids);
    if (!pairs) return is_error_set(IS_ERR_NOMEM, "bm25: out of memory");

    const double n_docs = ix->n_rows;
    const float inv_avgdl = (float)(n_docs / (double)ix->total_len);
    const float k1 = BM25_K1, b = BM25_B;
    int32_t nt = 0;
    for (int32_t i = 0; i < n_pairs; i++) {
        const bm25_term *term = &ix->terms[pairs[2 * i]];
        const double df = term->n_post;
        if (df == 0) continue;
        const float w = (float)(pairs[2 * i + 1] * log(1.0 + (n_docs - df + 0.5) / (df + 0.5)));
        for (int32_t p = 0; p < term->n_post; p++) {
            const int32_t row = term->post[p].row;
            const float tf = (float)term->post[p].tf;
            const float norm = k1 * (1.0f - b + b * (float)ix->rows[row].len * inv_avgdl);
            /* Every contribution is > 0, so acc == 0 means "not yet seen". */
            if (acc[row] == 0.0f) touched[nt++] = row;
            acc[row] += w * tf * (k1 + 1.0f) / (tf + norm);
        }
    }
    free(pairs);
    *n_touched = nt;
    return IS_OK;
}

bool bm25_check(const bm25_index *ix) {
    int64_t total = 0, n_pairs = 0, n_post = 0;
    for (int32_t r = 0; r < ix->n_rows; r++) {
        const bm25_doc *d = &ix->rows[r];
        int32_t len = 0;
        for (int32_t i = 0; i < d->n_terms; i++) {
            int32_t t = d->pairs[2 * i], tf = d->pairs[2 * i + 1];
            if (t < 0 || t >= ix->n_terms || tf <= 0) return false;
            if (i > 0 && d->pairs[2 * (i - 1)] >= t) return false; /* sorted, distinct */
            const bm25_term *term = &ix->terms[t];
            int32_t found = 0;
            for (int32_t p = 0; p < term->n_post; p++)
                if (term->post[p].row == r) found += term->post[p].tf == tf ? 1 : 100;
            if (found != 1) return false;
            len += tf;
        }
        if (len != d->len) return false;
        total += d->len;
        n_pairs += d->n_terms;
    }
    for (int32_t t = 0; t < ix->n_terms; t++) {
        const bm25_term *term = &ix->terms[t];
        for (int32_t p = 0; p < term->n_post; p++)
            if (term->post[p].row < 0 || term->post[p].row >= ix->n_rows) return false;
        n_post += term->n_post;
        int64_t id;
        if (!strmap_get(&ix->vocab, term->text, strlen(term->text), &id) || id != t) return false;
    }
    return total == ix->total_len && n_pairs == n_post && ix->vocab.n == (uint32_t)ix->n_terms;
}

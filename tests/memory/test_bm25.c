/*
 * test_bm25: the lexical half of the memory index.
 *
 *   - tokenizer: case folding, accents, NFKC, stopwords, contractions,
 *     CJK one ideograph a token, numbers, invalid UTF-8, empty input;
 *   - scores on a hand example (four short documents, numbers worked out
 *     by hand below), both from bm25_score and through mem_index_search;
 *   - removing and moving rows keeps postings consistent (bm25_check) and
 *     scores equal to an index built from the survivors alone.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/bm25.h"
#include "memory/index.h"

/* The tokens of `text` joined by '|'. */
static void tokens_joined(const char *text, char *out, size_t cap) {
    bm25_tokens t;
    assert_int_equal(bm25_tokenize(text, &t), IS_OK);
    out[0] = '\0';
    for (int32_t i = 0; i < t.n; i++) {
        assert_int_equal((int32_t)strlen(t.buf + t.off[i]), t.len[i]);
        if (i) strncat(out, "|", cap - strlen(out) - 1);
        strncat(out, t.buf + t.off[i], cap - strlen(out) - 1);
    }
    bm25_tokens_free(&t);
}

static void test_tokenize(void **state) {
    (void)state;
    char buf[512];
    tokens_joined("The cat sat on the mat.", buf, sizeof buf);
    assert_string_equal(buf, "cat|sat|mat");
    tokens_joined("Café CAFE cafe naïve Ångström", buf, sizeof buf);
    assert_string_equal(buf, "cafe|cafe|cafe|naive|angstrom");
    /* Possessive and contraction remnants are stopwords. */
    tokens_joined("Melanie's son isn't here, I'm sure we'll go", buf, sizeof buf);
    assert_string_equal(buf, "melanie|son|isn|here|i|sure|we|go");
    /* NFKC: ligature, fullwidth letters and digits; case folding of ß. */
    tokens_joined("\xef\xac\x81le \xef\xbc\xa1\xef\xbc\xa2\xef\xbc\xa3 \xef\xbc\x92\xef\xbc\x90 "
                  "STRASSE Stra\xc3\x9f"
                  "e",
                  buf, sizeof buf);
    assert_string_equal(buf, "file|abc|20|strasse|strasse");
    /* Numbers and mixed words stay whole; punctuation splits. */
    tokens_joined("LGBTQ+ pride-parade in 2022, at 7:55pm", buf, sizeof buf);
    assert_string_equal(buf, "lgbtq|pride|parade|2022|7|55pm");
    /* Each CJK ideograph is a token; kana runs stay words (and lose their
     * voicing marks with the other marks, as BERT uncased does: が -> か). */
    tokens_joined("我爱北京 ひらがな", buf, sizeof buf);
    assert_string_equal(buf, "我|爱|北|京|ひらかな");
    /* Greek and Cyrillic fold too. */
    tokens_joined("ΣΟΦΙΑ Москва", buf, sizeof buf);
    assert_string_equal(buf, "σοφια|москва");
    /* Default-ignorable characters (soft hyphen, zero-width space) vanish
     * inside a word. */
    tokens_joined("co\xc2\xad"
                  "operate zero\xe2\x80\x8bwidth",
                  buf, sizeof buf);
    assert_string_equal(buf, "cooperate|zerowidth");
    tokens_joined("", buf, sizeof buf);
    assert_string_equal(buf, "");
    tokens_joined("the and of , . !", buf, sizeof buf);
    assert_string_equal(buf, "");

    bm25_tokens t;
    assert_int_equal(bm25_tokenize(NULL, &t), IS_OK);
    assert_int_equal(t.n, 0);
    assert_int_equal(bm25_tokenize("bad \xff\xfe bytes", &t), IS_ERR_INVALID_ARG);
    assert_int_equal(t.n, 0);
    assert_int_equal(bm25_tokenize("truncated \xe2\x82", &t), IS_ERR_INVALID_ARG);
}

/*
 * The hand example. After tokenising (stopwords "the", "on", "and", "a"
 * dropped; no stemming):
 *
 *   D0 "The cat sat on the mat"   cat sat mat      |D| = 3
 *   D1 "The dog chased the cat"   dog chased cat   |D| = 3
 *   D2 "Dogs and cats"            dogs cats        |D| = 2
 *   D3 "A cat, a dog, a cat!"     cat dog cat      |D| = 3 (tf(cat) = 2)
 *
 *   N = 4, avgdl = 11 / 4 = 2.75
 *   df(cat) = 3: idf = ln(1 + (4 - 3 + 0.5) / (3 + 0.5)) = ln(1 + 1.5/3.5) = ln(1.4285714) = 0.3566749
 *   df(dog) = 2: idf = ln(1 + 2.5 / 2.5) = ln 2 = 0.6931472
 *   df(dogs) = 1: idf = ln(1 + 3.5 / 1.5) = ln(3.3333333) = 1.2039728
 *
 *   length norm K(|D|) = k1 (1 - b + b |D| / avgdl):
 *     K(3) = 1.2 (0.25 + 0.75 * 3 / 2.75) = 1.2 * 1.0681818 = 1.2818182
 *     K(2) = 1.2 (0.25 + 0.75 * 2 / 2.75) = 1.2 * 0.7954545 = 0.9545455
 *   tf part tf (k1 + 1) / (tf + K):
 *     tf 1, |D| 3: 2.2 / 2.2818182 = 0.9641434
 *     tf 2, |D| 3: 4.4 / 3.2818182 = 1.3407202
 *     tf 1, |D| 2: 2.2 / 1.9545455 = 1.1255814
 *
 * Query "cat dog":
 *   D0 = 0.3566749 * 0.9641434                       = 0.3438858
 *   D1 = 0.3566749 * 0.9641434 + 0.6931472 * 0.9641434 = 0.3438858 + 0.6682933 = 1.0121791
 *   D3 = 0.3566749 * 1.3407202 + 0.6682933            = 0.4782013 + 0.6682933 = 1.1464946
 *   D2 shares no term: not returned. Order D3, D1, D0.
 * Query "cat cat dog" (a bag: cat counts twice):
 *   D0 = 2 * 0.3438858 = 0.6877716, D1 = 0.6877716 + 0.6682933 = 1.3560649,
 *   D3 = 2 * 0.4782013 + 0.6682933 = 1.6246959
 * Query "Dogs!": D2 = 1.2039728 * 1.1255814 = 1.3551694.
 */
static const char *const hand_docs[4] = {"The cat sat on the mat", "The dog chased the cat",
                                         "Dogs and cats", "A cat, a dog, a cat!"};

static bm25_index *hand_index(void) {
    bm25_index *ix;
    assert_int_equal(bm25_create(&ix), IS_OK);
    for (int i = 0; i < 4; i++) {
        bm25_tokens t;
        bm25_doc d;
        assert_int_equal(bm25_tokenize(hand_docs[i], &t), IS_OK);
        assert_int_equal(bm25_prepare(ix, &t, &d), IS_OK);
        bm25_add(ix, &d);
        assert_null(d.pairs);
        bm25_tokens_free(&t);
    }
    assert_true(bm25_check(ix));
    return ix;
}

static void score_query(const bm25_index *ix, const char *q, float *acc, int32_t *n_touched) {
    bm25_tokens t;
    int32_t touched[8];
    assert_int_equal(bm25_tokenize(q, &t), IS_OK);
    memset(acc, 0, sizeof(float) * 4);
    assert_int_equal(bm25_score(ix, &t, acc, touched, n_touched), IS_OK);
    for (int32_t i = 0; i < *n_touched; i++) assert_true(acc[touched[i]] > 0.0f);
    bm25_tokens_free(&t);
}

static void test_hand_scores(void **state) {
    (void)state;
    bm25_index *ix = hand_index();
    assert_int_equal(bm25_n_docs(ix), 4);
    float acc[4];
    int32_t nt;
    score_query(ix, "cat dog", acc, &nt);
    assert_int_equal(nt, 3);
    assert_float_equal(acc[0], 0.3438858, 1e-5);
    assert_float_equal(acc[1], 1.0121791, 1e-5);
    assert_float_equal(acc[2], 0.0, 0.0);
    assert_float_equal(acc[3], 1.1464946, 1e-5);
    score_query(ix, "cat cat dog", acc, &nt);
    assert_float_equal(acc[0], 0.6877716, 1e-5);
    assert_float_equal(acc[1], 1.3560649, 1e-5);
    assert_float_equal(acc[3], 1.6246959, 1e-5);
    score_query(ix, "Dogs!", acc, &nt);
    assert_int_equal(nt, 1);
    assert_float_equal(acc[2], 1.3551694, 1e-5);
    score_query(ix, "the of and", acc, &nt); /* only stopwords */
    assert_int_equal(nt, 0);
    score_query(ix, "unicorn", acc, &nt); /* unknown term */
    assert_int_equal(nt, 0);
    bm25_free(ix);
}

/* The same example through the memory index, in BM25 mode. */
static void test_hand_through_index(void **state) {
    (void)state;
    mem_index *ix;
    assert_int_equal(mem_index_create(2, &ix), IS_OK);
    const float e[2] = {1.0f, 0.0f};
    const char *ids[4] = {"d0", "d1", "d2", "d3"};
    for (int i = 0; i < 4; i++) {
        mem_doc d = {
            .id = ids[i], .tenant = "t", .user = "u", .text = hand_docs[i], .embedding = e};
        assert_int_equal(mem_index_upsert(ix, &d), IS_OK);
    }
    mem_filter f = {.tenant = "t", .user = "u"};
    mem_hit hits[10];
    int32_t n = -1;
    assert_int_equal(mem_index_search(ix, &f, NULL, "CAT, dog?", 10, MEM_SEARCH_BM25, hits, &n),
                     IS_OK);
    assert_int_equal(n, 3);
    assert_string_equal(hits[0].id, "d3");
    assert_string_equal(hits[1].id, "d1");
    assert_string_equal(hits[2].id, "d0");
    assert_float_equal(hits[0].score, 1.1464946, 1e-5);
    assert_float_equal(hits[1].score, 1.0121791, 1e-5);
    assert_float_equal(hits[2].score, 0.3438858, 1e-5);
    for (int i = 0; i < 3; i++) {
        assert_float_equal(hits[i].bm25, hits[i].score, 0.0);
        assert_int_equal(hits[i].bm25_rank, i + 1);
        assert_int_equal(hits[i].dense_rank, -1);
    }
    /* k smaller than the matches keeps the best. */
    assert_int_equal(mem_index_search(ix, &f, NULL, "cat dog", 1, MEM_SEARCH_BM25, hits, &n),
                     IS_OK);
    assert_int_equal(n, 1);
    assert_string_equal(hits[0].id, "d3");
    mem_index_free(ix);
}

/* Removing rows (with the last row moving into the hole) gives the same
 * scores as an index built from the remaining documents. */
static void test_remove_consistency(void **state) {
    (void)state;
    static const char *words[] = {"apple",   "river",   "mountain", "guitar",
                                  "pottery", "camping", "adoption", "painting",
                                  "violin",  "beach",   "museum",   "Oscar"};
    enum { N = 60 };
    char docs[N][128];
    uint32_t rng = 12345;
    for (int i = 0; i < N; i++) {
        docs[i][0] = '\0';
        int nw = 1 + (int)((rng = rng * 1103515245u + 12345u) >> 16) % 7;
        for (int w = 0; w < nw; w++) {
            rng = rng * 1103515245u + 12345u;
            strcat(docs[i], words[(rng >> 16) % 12]);
            strcat(docs[i], " ");
        }
    }
    bm25_index *ix;
    assert_int_equal(bm25_create(&ix), IS_OK);
    int alive[N]; /* row -> doc */
    int n = 0;
    for (int i = 0; i < N; i++) {
        bm25_tokens t;
        bm25_doc d;
        assert_int_equal(bm25_tokenize(docs[i], &t), IS_OK);
        assert_int_equal(bm25_prepare(ix, &t, &d), IS_OK);
        bm25_add(ix, &d);
        bm25_tokens_free(&t);
        alive[n++] = i;
    }
    /* Remove every third row position, mirroring the swap. */
    for (int r = 0; r < n; r += 3) {
        bm25_remove(ix, r);
        alive[r] = alive[--n];
        assert_true(bm25_check(ix));
    }
    assert_int_equal(bm25_n_docs(ix), n);
    bm25_index *fresh;
    assert_int_equal(bm25_create(&fresh), IS_OK);
    for (int r = 0; r < n; r++) {
        bm25_tokens t;
        bm25_doc d;
        assert_int_equal(bm25_tokenize(docs[alive[r]], &t), IS_OK);
        assert_int_equal(bm25_prepare(fresh, &t, &d), IS_OK);
        bm25_add(fresh, &d);
        bm25_tokens_free(&t);
    }
    const char *queries[] = {"apple river", "oscar pottery pottery", "violin beach museum camping"};
    for (int q = 0; q < 3; q++) {
        bm25_tokens t;
        assert_int_equal(bm25_tokenize(queries[q], &t), IS_OK);
        float a[N] = {0}, b[N] = {0};
        int32_t ta[N], tb[N], na, nb;
        assert_int_equal(bm25_score(ix, &t, a, ta, &na), IS_OK);
        assert_int_equal(bm25_score(fresh, &t, b, tb, &nb), IS_OK);
        assert_int_equal(na, nb);
        assert_true(na > 0);
        for (int r = 0; r < n; r++) assert_float_equal(a[r], b[r], 1e-6);
        bm25_tokens_free(&t);
    }
    /* Remove everything. */
    while (n > 0) bm25_remove(ix, --n);
    assert_true(bm25_check(ix));
    assert_int_equal(bm25_n_docs(ix), 0);
    bm25_free(ix);
    bm25_free(fresh);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize),
        cmocka_unit_test(test_hand_scores),
        cmocka_unit_test(test_hand_through_index),
        cmocka_unit_test(test_remove_consistency),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_locomo_eval: LoCoMo's scoring in C against LoCoMo's own Python.
 *
 *   - golden (tests/golden/locomo_eval.json, made by
 *     tools/make_locomo_eval_golden.py running LoCoMo's evaluation.py):
 *     the Porter stems of ~2700 words (every rule, and every word of the
 *     LoCoMo questions and answers), normalize_answer, exact_match_score,
 *     f1_score and the multi-hop f1 on ~770 pairs, and per-question scores
 *     and evidence recall from eval_question_answering;
 *   - recall@k and the per-category aggregation on hand examples;
 *   - bad arguments.
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

#include "eval/locomo_eval.h"

static cJSON *g_golden;

static int setup(void **state) {
    FILE *f = fopen(IS_GOLDEN_DIR "/locomo_eval.json", "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    buf[n] = 0;
    g_golden = cJSON_Parse(buf);
    free(buf);
    return g_golden ? 0 : -1;
}

static int teardown(void **state) {
    cJSON_Delete(g_golden);
    return 0;
}

static const char *str_at(const cJSON *arr, int i) {
    const cJSON *it = cJSON_GetArrayItem(arr, i);
    assert_true(cJSON_IsString(it));
    return it->valuestring;
}

static void test_golden_stem(void **state) {
    const cJSON *list = cJSON_GetObjectItem(g_golden, "stem"), *e;
    assert_true(cJSON_GetArraySize(list) > 2000);
    int bad = 0;
    cJSON_ArrayForEach(e, list) {
        char *s;
        assert_int_equal(locomo_eval_stem(str_at(e, 0), &s), IS_OK);
        if (strcmp(s, str_at(e, 1)) != 0) {
            if (bad++ < 20)
                fprintf(stderr, "stem('%s') = '%s', want '%s'\n", str_at(e, 0), s, str_at(e, 1));
        }
        free(s);
    }
    assert_int_equal(bad, 0);
}

static void test_golden_normalize(void **state) {
    const cJSON *list = cJSON_GetObjectItem(g_golden, "normalize"), *e;
    assert_true(cJSON_GetArraySize(list) > 10);
    int bad = 0;
    cJSON_ArrayForEach(e, list) {
        char *s;
        assert_int_equal(locomo_eval_normalize(str_at(e, 0), &s), IS_OK);
        if (strcmp(s, str_at(e, 1)) != 0) {
            if (bad++ < 20)
                fprintf(stderr, "normalize('%s') = '%s', want '%s'\n", str_at(e, 0), s,
                        str_at(e, 1));
        }
        free(s);
    }
    assert_int_equal(bad, 0);
}

static void test_golden_pairs(void **state) {
    const cJSON *list = cJSON_GetObjectItem(g_golden, "pairs"), *e;
    assert_true(cJSON_GetArraySize(list) > 100);
    int bad = 0, n_em = 0, n_partial = 0;
    cJSON_ArrayForEach(e, list) {
        const char *p = str_at(e, 0), *g = str_at(e, 1);
        bool want_em = cJSON_IsTrue(cJSON_GetArrayItem(e, 2)), em;
        double want_f1 = cJSON_GetArrayItem(e, 3)->valuedouble;
        double want_multi = cJSON_GetArrayItem(e, 4)->valuedouble, f1, multi;
        assert_int_equal(locomo_eval_exact_match(p, g, &em), IS_OK);
        assert_int_equal(locomo_eval_f1(p, g, &f1), IS_OK);
        assert_int_equal(locomo_eval_f1_multi(p, g, &multi), IS_OK);
        n_em += want_em;
        n_partial += want_f1 > 0 && want_f1 < 1;
        if (em != want_em || fabs(f1 - want_f1) > 1e-12 || fabs(multi - want_multi) > 1e-12) {
            if (bad++ < 20)
                fprintf(stderr, "'%s' vs '%s': em %d f1 %.17g multi %.17g, want %d %.17g %.17g\n",
                        p, g, em, f1, multi, want_em, want_f1, want_multi);
        }
    }
    assert_int_equal(bad, 0);
    /* The golden set is not degenerate: it has matches, misses and partial overlaps. */
    assert_true(n_em > 10);
    assert_true(n_partial > 100);
}

static void test_golden_questions(void **state) {
    const cJSON *list = cJSON_GetObjectItem(g_golden, "questions"), *q;
    assert_true(cJSON_GetArraySize(list) >= 10);
    cJSON_ArrayForEach(q, list) {
        int32_t cat = cJSON_GetObjectItem(q, "category")->valueint;
        const char *ans = cJSON_GetObjectItem(q, "answer")->valuestring;
        const char *pred = cJSON_GetObjectItem(q, "prediction")->valuestring;
        const cJSON *ev = cJSON_GetObjectItem(q, "evidence"),
                    *ret = cJSON_GetObjectItem(q, "retrieved");
        const char *evs[16], *rets[16];
        int32_t ne = 0, nr = 0;
        for (int i = 0; i < cJSON_GetArraySize(ev) && ne < 16; i++) evs[ne++] = str_at(ev, i);
        for (int i = 0; i < cJSON_GetArraySize(ret) && nr < 16; i++) rets[nr++] = str_at(ret, i);
        double score;
        assert_int_equal(locomo_eval_score(pred, ans, cat, &score), IS_OK);
        double want = cJSON_GetObjectItem(q, "score")->valuedouble;
        if (fabs(score - want) > 1e-12)
            fprintf(stderr, "cat %d '%s' vs '%s': %.17g, want %.17g\n", cat, pred, ans, score,
                    want);
        assert_true(fabs(score - want) <= 1e-12);
        assert_true(fabs(locomo_eval_recall(evs, ne, rets, nr) -
                         cJSON_GetObjectItem(q, "recall")->valuedouble) <= 1e-12);
    }
}

/* Worked by hand: evidence D1:3, D2:5, D7:1; the retrieved facts cite D2:5
 * twice and D1:3 once (plus turns that are not evidence): 2 of 3 found. */
static void test_recall_hand(void **state) {
    const char *ev[] = {"D1:3", "D2:5", "D7:1"};
    const char *ret[] = {"D2:5", "D9:1", "D1:3", "D2:5", "D7:10"};
    assert_true(fabs(locomo_eval_recall(ev, 3, ret, 5) - 2.0 / 3.0) < 1e-15);
    assert_true(locomo_eval_recall(ev, 3, ret, 0) == 0.0);
    assert_true(locomo_eval_recall(ev, 3, ev, 3) == 1.0);
    /* "D7:1" is not "D7:10": ids compare whole. */
    const char *ret2[] = {"D7:10"};
    assert_true(locomo_eval_recall(ev + 2, 1, ret2, 1) == 0.0);
    /* LoCoMo counts a question without evidence as fully recalled. */
    assert_true(locomo_eval_recall(NULL, 0, ret, 5) == 1.0);
}

/* Hand examples of the scoring rules, independent of the golden file. */
static void test_rules_hand(void **state) {
    double f;
    bool em;
    /* Articles, case and punctuation vanish: "The Cat." == "cat". */
    assert_int_equal(locomo_eval_f1("The Cat.", "cat", &f), IS_OK);
    assert_true(f == 1.0);
    /* Stemming: "agencies" and "agency" share the stem "agenc". */
    assert_int_equal(locomo_eval_f1("agency", "agencies", &f), IS_OK);
    assert_true(f == 1.0);
    assert_int_equal(locomo_eval_exact_match("agency", "agencies", &em), IS_OK);
    assert_false(em); /* exact match does not stem */
    /* One word of two predicted, one of one gold: P = 1/2, R = 1, F1 = 2/3. */
    assert_int_equal(locomo_eval_f1("red car", "car", &f), IS_OK);
    assert_true(fabs(f - 2.0 / 3.0) < 1e-15);
    /* Multi-hop: gold parts "a1 b1", "c1"; prediction parts "b1", "c1 d1":
     * best per gold part 2/3 and 2/3, mean 2/3. */
    assert_int_equal(locomo_eval_score("b1, c1 d1", "a1 b1, c1", 1, &f), IS_OK);
    assert_true(fabs(f - 2.0 / 3.0) < 1e-15);
    /* Category 3 scores against the part before ';'. */
    assert_int_equal(locomo_eval_score("yes", "Yes; because she said so", 3, &f), IS_OK);
    assert_true(f == 1.0);
    assert_int_equal(locomo_eval_exact("yes", "Yes; because she said so", 3, &em), IS_OK);
    assert_true(em);
    /* Category 5: the refusal phrases, in any case. */
    assert_int_equal(locomo_eval_score("That is NOT mentioned.", "x", 5, &f), IS_OK);
    assert_true(f == 1.0);
    assert_int_equal(locomo_eval_score("x", "x", 5, &f), IS_OK);
    assert_true(f == 0.0);
    /* Word sets: order and repetition do not matter for exact match. */
    /* ("a" is an article and vanishes: {b, c} == {b, c}). */
    assert_int_equal(locomo_eval_exact_match("b a b c", "c, b", &em), IS_OK);
    assert_true(em);
    assert_int_equal(locomo_eval_exact_match("b x c", "c b", &em), IS_OK);
    assert_false(em);
}

static void test_aggregate(void **state) {
    locomo_eval_acc acc = {0};
    locomo_eval_result r1 = {
        .f1 = 1.0, .em = 1.0, .recall = 0.5, .ttft_ms = 10, .agree = 1, .f1_vs_prompt = 1};
    locomo_eval_result r2 = {.f1 = 0.5, .em = 0.0, .recall = 1.0, .ttft_ms = 30, .agree = -1};
    locomo_eval_result r3 = {
        .f1 = 0.0, .em = 0.0, .recall = 0.0, .ttft_ms = 20, .agree = 0, .f1_vs_prompt = 0.5};
    locomo_eval_acc_add(&acc, &r1);
    locomo_eval_acc_add(&acc, &r2);
    locomo_eval_acc_add(&acc, &r3);
    locomo_eval_result m = locomo_eval_acc_mean(&acc);
    assert_true(fabs(m.f1 - 0.5) < 1e-15);
    assert_true(fabs(m.em - 1.0 / 3.0) < 1e-15);
    assert_true(fabs(m.recall - 0.5) < 1e-15);
    assert_true(fabs(m.ttft_ms - 20.0) < 1e-12);
    /* Agreement over the two compared questions only. */
    assert_true(fabs(m.agree - 0.5) < 1e-15);
    assert_true(fabs(m.f1_vs_prompt - 0.75) < 1e-15);
    locomo_eval_acc empty = {0};
    m = locomo_eval_acc_mean(&empty);
    assert_true(m.f1 == 0.0 && m.agree < 0);
}

static void test_bad_args(void **state) {
    double f;
    bool b;
    char *s;
    assert_int_equal(locomo_eval_f1(NULL, "x", &f), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_f1_multi("x", NULL, &f), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_exact_match("x", "x", NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_score("x", "x", 0, &f), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_score("x", "x", 6, &f), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_exact("x", "x", 9, &b), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_normalize(NULL, &s), IS_ERR_INVALID_ARG);
    assert_int_equal(locomo_eval_stem(NULL, &s), IS_ERR_INVALID_ARG);
    /* Invalid UTF-8 is read, not rejected: each bad byte is U+FFFD. */
    assert_int_equal(locomo_eval_normalize("caf\xff THE \xc3", &s), IS_OK);
    assert_string_equal(s, "caf\xef\xbf\xbd \xef\xbf\xbd");
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_stem),  cmocka_unit_test(test_golden_normalize),
        cmocka_unit_test(test_golden_pairs), cmocka_unit_test(test_golden_questions),
        cmocka_unit_test(test_recall_hand),  cmocka_unit_test(test_rules_hand),
        cmocka_unit_test(test_aggregate),    cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

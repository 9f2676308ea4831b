/*
 * test_nll: the teacher-forced accuracy instrument of `eval locomo --nll`.
 *
 *   - teacher_score_tokens on the default model against transformers'
 *     per-token NLL (tests/golden/nll.json, made by tools/make_nll_golden.py
 *     from transformers' logits of the same GGUF);
 *   - teacher_score_request: kv mode with one fact encoded at w = 0 scores
 *     the gold answer as prompt mode does (the exactness the design claims
 *     for that case), and no memory scores it differently;
 *   - log-softmax, KL, argmax on hand-computed distributions;
 *   - the list-item rule on pieces and on the default model's vocabulary;
 *   - dated facts: LoCoMo session dates in the gold answers' form, and
 *     the one rendering both memory modes use;
 *   - the paired bootstrap: degenerate data, ratios, seeds, and the width
 *     of a mean's interval against the normal approximation.
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
#include <sys/stat.h>
#include <unistd.h>

#include "eval/nll_report.h"
#include "eval/nll_stats.h"
#include "eval/teacher.h"
#include "memory/locomo.h"
#include "serve/memory_prompt.h"
#include "test_sched.h"
#include "test_util.h"

#define LOCOMO_26 IS_SOURCE_DIR "/../shared/data/locomo/26.json"

static test_ask_stack g_st; /* backend, model, engine, record store, ask context */
static char g_dir[] = "/tmp/test_nll_XXXXXX";

static int setup(void **state) { return test_ask_stack_open(&g_st, 1024, g_dir); }

static int teardown(void **state) { return test_ask_stack_close(&g_st, g_dir); }

#define SKIP_WITHOUT_MODEL()                                                                       \
    do {                                                                                           \
        if (!g_st.model) TEST_SKIP(TEST_NEEDS_MODEL);                                              \
    } while (0)

static int32_t *json_ints(const cJSON *a, int32_t *n) {
    *n = cJSON_GetArraySize(a);
    int32_t *v = malloc((size_t)*n * sizeof *v);
    for (int32_t i = 0; i < *n; i++) v[i] = cJSON_GetArrayItem(a, i)->valueint;
    return v;
}

/* ---- against transformers --------------------------------------------- */

static void test_nll_golden(void **state) {
    SKIP_WITHOUT_MODEL();
    char *json = test_read_file(IS_GOLDEN_DIR "/nll.json", NULL);
    assert_non_null(json);
    cJSON *g = cJSON_Parse(json);
    free(json);
    assert_non_null(g);
    int32_t nc, na;
    int32_t *ctx = json_ints(cJSON_GetObjectItem(g, "context"), &nc);
    int32_t *ans = json_ints(cJSON_GetObjectItem(g, "answer"), &na);
    double want = cJSON_GetObjectItem(g, "nll_mean")->valuedouble;
    int32_t want_top1 = cJSON_GetObjectItem(g, "first_top1")->valueint;
    int32_t nv = g_st.model->cfg.n_vocab;
    float *first = malloc((size_t)nv * sizeof *first);
    int32_t seq;
    assert_int_equal(engine_seq_open(g_st.engine, &seq), IS_OK);
    double nll = -1;
    assert_int_equal(teacher_score_tokens(g_st.engine, seq, ctx, nc, ans, na, &nll, first), IS_OK);
    engine_seq_close(g_st.engine, seq);
    /* Per-token NLL moves by about the logit error (1e-3 of the range, a
     * few hundredths of a nat at most); the mean over 5 tokens must agree
     * far more closely than the gaps the instrument reports (tenths). */
    fprintf(stderr, "mean NLL %.6f, transformers %.6f\n", nll, want);
    assert_true(fabs(nll - want) < 5e-3);
    assert_int_equal(nll_argmax(first, nv), want_top1);
    /* A changed answer token changes the score: the test can fail. */
    ans[na - 1] = (ans[na - 1] + 1) % nv;
    assert_int_equal(engine_seq_open(g_st.engine, &seq), IS_OK);
    double other;
    assert_int_equal(teacher_score_tokens(g_st.engine, seq, ctx, nc, ans, na, &other, NULL), IS_OK);
    engine_seq_close(g_st.engine, seq);
    assert_true(fabs(other - want) > 0.1);
    free(first);
    free(ctx);
    free(ans);
    cJSON_Delete(g);
}

static void test_teacher_bad_args(void **state) {
    SKIP_WITHOUT_MODEL();
    int32_t t = 1;
    double nll;
    assert_int_equal(teacher_score_tokens(g_st.engine, 0, &t, 0, &t, 1, &nll, NULL),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(teacher_score_tokens(g_st.engine, 0, &t, 1, &t, 0, &nll, NULL),
                     IS_ERR_INVALID_ARG);
    int32_t *toks, n;
    assert_int_equal(teacher_answer_tokens(g_st.model, "", &toks, &n), IS_ERR_INVALID_ARG);
    assert_int_equal(teacher_answer_tokens(g_st.model, "7 May 2023", &toks, &n), IS_OK);
    assert_true(n >= 3);
    free(toks);
}

/* ---- kv against prompt: one fact, w = 0 -------------------------------- */

static void test_kv_equals_prompt_one_fact(void **state) {
    SKIP_WITHOUT_MODEL();
    const char *text = "Melanie plays the clarinet in a community band.";
    ask_fact f = {.id = "nll-f0", .text = text, .context = NULL, .n_context = 0};
    bool did;
    assert_int_equal(ask_encode_fact(g_st.ask, &f, 0, &did), IS_OK);
    int32_t *ans, na;
    assert_int_equal(teacher_answer_tokens(g_st.model, "The clarinet", &ans, &na), IS_OK);
    const char *ids[] = {"nll-f0"}, *texts[] = {text};
    const char *q = "What instrument does Melanie play? Answer in a few words.";
    int32_t nv = g_st.model->cfg.n_vocab;
    float *lp = malloc((size_t)3 * nv * sizeof *lp);
    double nll[3];
    ask_mode modes[3] = {ASK_MODE_PROMPT, ASK_MODE_KV, ASK_MODE_OFF};
    for (int i = 0; i < 3; i++) {
        ask_request r = {
            .mode = modes[i], .query = q, .fact_ids = ids, .fact_texts = texts, .n_facts = 1};
        assert_int_equal(teacher_score_request(g_st.engine, g_st.store, g_st.ask, &r, ans, na,
                                               &nll[i], lp + (size_t)i * nv),
                         IS_OK);
    }
    fprintf(stderr, "NLL prompt %.6f kv %.6f off %.6f\n", nll[0], nll[1], nll[2]);
    assert_true(test_rel_range_err(lp + nv, lp, nv) <= 1e-4);
    assert_true(fabs(nll[1] - nll[0]) < 1e-3);
    /* The fact helps: the gold answer is likelier with it than without. */
    assert_true(nll[2] - nll[0] > 0.1);
    for (int i = 0; i < 3; i++) nll_log_softmax(lp + (size_t)i * nv, nv, lp + (size_t)i * nv);
    assert_true(nll_kl(lp, lp + nv, nv) < 1e-4);
    assert_true(nll_kl(lp, lp + 2 * (size_t)nv, nv) > 1e-3);
    /* A record that is not there is an error, not a score. */
    const char *missing[] = {"nll-missing"};
    ask_request r = {
        .mode = ASK_MODE_KV, .query = q, .fact_ids = missing, .fact_texts = texts, .n_facts = 1};
    double x;
    assert_int_not_equal(
        teacher_score_request(g_st.engine, g_st.store, g_st.ask, &r, ans, na, &x, NULL), IS_OK);
    free(lp);
    free(ans);
}

/* ---- distributions ----------------------------------------------------- */

static void test_softmax_kl(void **state) {
    float x[4] = {1.0f, 2.0f, 3.0f, 4.0f}, lp[4];
    double lse = nll_log_softmax(x, 4, lp);
    double want = log(exp(1) + exp(2) + exp(3) + exp(4));
    assert_true(fabs(lse - want) < 1e-9);
    double s = 0;
    for (int i = 0; i < 4; i++) s += exp(lp[i]);
    assert_true(fabs(s - 1) < 1e-6);
    assert_int_equal(nll_argmax(lp, 4), 3);
    float ties[3] = {5, 5, 1};
    assert_int_equal(nll_argmax(ties, 3), 0);
    /* KL of two two-point distributions: p = (0.5, 0.5), q = (0.9, 0.1). */
    float p[2] = {(float)log(0.5), (float)log(0.5)}, q[2] = {(float)log(0.9), (float)log(0.1)};
    double kl = 0.5 * log(0.5 / 0.9) + 0.5 * log(0.5 / 0.1);
    assert_true(fabs(nll_kl(p, q, 2) - kl) < 1e-6);
    assert_true(fabs(nll_kl(p, p, 2)) < 1e-9);
    /* p with a zero entry adds nothing for it */
    float p0[2] = {0.0f, -INFINITY};
    assert_true(fabs(nll_kl(p0, q, 2) - (0 - log(0.9))) < 1e-6);
    bool mask[4] = {true, false, true, false};
    assert_true(fabs(nll_mass(lp, mask, 4) - (exp(1) + exp(3)) / exp(want)) < 1e-6);
}

/* ---- list items -------------------------------------------------------- */

static bool li(const char *s) { return nll_piece_is_list_item(s, strlen(s)); }

static void test_list_item_rule(void **state) {
    assert_true(li("-"));
    assert_true(li(" -"));
    assert_true(li("\n-"));
    assert_true(li("*"));
    assert_true(li(" *"));
    assert_true(li("+"));
    assert_true(li("\xE2\x80\xA2"));
    assert_true(li(" \xE2\x80\xA2"));
    assert_true(li("1."));
    assert_true(li("12)"));
    assert_true(li(" 3."));
    assert_false(li("1"));
    assert_false(li("2022"));
    assert_false(li(" Paris"));
    assert_false(li("The"));
    assert_false(li(""));
    assert_false(li("  \n"));
    assert_false(li("."));
    assert_false(li("\xE2\x80\x94")); /* em dash */
}

static void test_list_mask_vocab(void **state) {
    SKIP_WITHOUT_MODEL();
    const tokenizer *t = g_st.model->tok;
    int32_t nv = tokenizer_n_vocab(t);
    bool *mask = calloc((size_t)nv, sizeof *mask);
    int32_t n = nll_list_mask(t, mask);
    fprintf(stderr, "%d of %d tokens open a list item\n", n, nv);
    assert_true(n > 10 && n < nv / 20);
    int32_t dash = tokenizer_find(t, "-"), the = tokenizer_find(t, "The");
    assert_true(dash >= 0 && the >= 0);
    assert_true(mask[dash]);
    assert_false(mask[the]);
    /* "\n- " as the model would write it: its first token opens a list item. */
    int32_t *toks;
    size_t nt;
    assert_int_equal(tokenizer_encode(t, "- Caroline", 10, false, false, &toks, &nt), IS_OK);
    assert_true(nt >= 1 && mask[toks[0]]);
    free(toks);
    assert_int_equal(tokenizer_encode(t, "2022", 4, false, false, &toks, &nt), IS_OK);
    assert_false(mask[toks[0]]);
    free(toks);
    for (int32_t id = 0; id < nv; id++)
        if (tokenizer_token_get_type(t, id) == TOKENIZER_TOKEN_CONTROL) assert_false(mask[id]);
    free(mask);
}

/* ---- dated facts ------------------------------------------------------ */

static void test_dated_facts(void **state) {
    char buf[64];
    assert_string_equal(locomo_short_date("1:56 pm on 8 May, 2023", buf, sizeof buf), "8 May 2023");
    assert_string_equal(locomo_short_date("12:09 am on 13 September, 2023", buf, sizeof buf),
                        "13 September 2023");
    assert_string_equal(locomo_short_date("May, 2023", buf, sizeof buf), "May 2023");
    assert_string_equal(locomo_short_date("1:56 pm on 8 May, 2023", buf, 5), "8 Ma");
    char *t;
    assert_int_equal(
        memory_prompt_dated_text("8 May 2023", "Caroline went to a support group.", &t), IS_OK);
    assert_string_equal(t, "[8 May 2023] Caroline went to a support group.");
    free(t);
    assert_int_equal(memory_prompt_dated_text("", "x", &t), IS_OK);
    assert_string_equal(t, "x");
    free(t);
    assert_int_equal(memory_prompt_dated_text(NULL, "x", &t), IS_OK);
    assert_string_equal(t, "x");
    free(t);
    assert_int_equal(memory_prompt_dated_text("d", NULL, &t), IS_ERR_INVALID_ARG);
    locomo_conv *c = NULL;
    if (locomo_load(LOCOMO_26, &c) != IS_OK) TEST_SKIP(TEST_NEEDS_LOCOMO);
    /* every fact carries its own session's date */
    for (int32_t i = 0; i < c->n_facts; i++) {
        assert_non_null(c->facts[i].date);
        if (c->facts[i].session == 1) assert_string_equal(c->facts[i].date, "8 May 2023");
        if (c->facts[i].session == 2) assert_string_equal(c->facts[i].date, "25 May 2023");
    }
    locomo_free(c);
}

/* ---- bootstrap --------------------------------------------------------- */

static void test_bootstrap(void **state) {
    double p, lo, hi;
    double c[50];
    for (int i = 0; i < 50; i++) c[i] = 3.5;
    assert_true(nll_bootstrap(c, NULL, 50, 200, 1, 0.05, &p, &lo, &hi));
    assert_true(p == 3.5 && lo == 3.5 && hi == 3.5);
    /* a = 2 b question by question: every resample's ratio is 2. */
    double a[40], b[40];
    for (int i = 0; i < 40; i++) {
        b[i] = 1 + i % 7;
        a[i] = 2 * b[i];
    }
    assert_true(nll_bootstrap(a, b, 40, 500, 7, 0.05, &p, &lo, &hi));
    assert_true(fabs(p - 2) < 1e-12 && fabs(lo - 2) < 1e-12 && fabs(hi - 2) < 1e-12);
    /* A mean's interval: about mean +- 1.96 sd / sqrt(n). Values 0..19
     * repeated (sd^2 = (20^2 - 1) / 12). */
    enum { N = 400 };
    double x[N];
    for (int i = 0; i < N; i++) x[i] = i % 20;
    assert_true(nll_bootstrap(x, NULL, N, 4000, 1234, 0.05, &p, &lo, &hi));
    double half = 1.96 * sqrt(399.0 / 12.0) / sqrt((double)N);
    fprintf(stderr, "mean %.4f [%.4f, %.4f], normal half-width %.4f\n", p, lo, hi, half);
    assert_true(fabs(p - 9.5) < 1e-12);
    assert_true(lo < p && p < hi);
    assert_true(fabs((hi - lo) / 2 - half) < 0.1 * half);
    assert_true(fabs((p - lo) - (hi - p)) < 0.15 * half);
    /* The same seed gives the same interval; another seed a slightly different one. */
    double lo2, hi2;
    assert_true(nll_bootstrap(x, NULL, N, 4000, 1234, 0.05, &p, &lo2, &hi2));
    assert_true(lo2 == lo && hi2 == hi);
    assert_true(nll_bootstrap(x, NULL, N, 4000, 99, 0.05, &p, &lo2, &hi2));
    assert_true(lo2 != lo || hi2 != hi);
    /* A 50% interval is narrower than the 95% one. */
    assert_true(nll_bootstrap(x, NULL, N, 4000, 1234, 0.5, &p, &lo2, &hi2));
    assert_true(lo2 > lo && hi2 < hi);
    /* Nothing to resample, or a zero denominator everywhere. */
    assert_false(nll_bootstrap(x, NULL, 0, 100, 1, 0.05, &p, &lo, &hi));
    assert_true(isnan(p));
    double z[5] = {0};
    assert_false(nll_bootstrap(x, z, 5, 100, 1, 0.05, &p, &lo, &hi));
}

static void test_report(void **state) {
    const char *names[] = {"prompt", "off", "kv0"};
    nll_report *r;
    assert_int_equal(nll_report_create(names, 1, &r), IS_ERR_INVALID_ARG);
    assert_int_equal(nll_report_create(names, 3, &r), IS_OK);
    /* kv recovers exactly half of prompt's gain on every question. */
    for (int i = 0; i < 30; i++) {
        nll_row w = {.category = 1 + i % 4};
        w.nll[0] = 2.0 + 0.01 * i;
        w.nll[1] = 3.0 + 0.03 * i;
        w.nll[2] = (w.nll[0] + w.nll[1]) / 2;
        for (int s = 0; s < 3; s++) w.f1[s] = w.em[s] = -1;
        w.agree[0] = 1;
        assert_int_equal(nll_report_add(r, &w), IS_OK);
    }
    assert_int_equal(nll_report_n_rows(r), 30);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    nll_report_print(r, f, 200, 1);
    fclose(f);
    assert_non_null(strstr(buf, "| 1-4 all | kv0 | 30 |"));
    assert_non_null(strstr(buf, "| 50.0 [50.0, 50.0] |"));
    free(buf);
    nll_report_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_kl),       cmocka_unit_test(test_list_item_rule),
        cmocka_unit_test(test_bootstrap),        cmocka_unit_test(test_report),
        cmocka_unit_test(test_dated_facts),      cmocka_unit_test(test_nll_golden),
        cmocka_unit_test(test_teacher_bad_args), cmocka_unit_test(test_kv_equals_prompt_one_fact),
        cmocka_unit_test(test_list_mask_vocab),
    };
    return test_run_group(tests, setup, teardown);
}

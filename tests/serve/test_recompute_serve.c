/*
 * Recomputation on the answering paths, default model, CPU f32:
 *   - ask_run: a kv request with every memory token recomputed in the
 *     query's forward (recompute past the longest fact) or blended at
 *     ratio 1 answers as prompt mode does (test_recompute and test_blend
 *     show the logits equal to 1e-6); recompute = 2 prefills 2 tokens a
 *     fact more and its prompt positions are kv's;
 *   - the scheduler (sched_params.recompute): its answers equal ask_run's
 *     with the same recompute, with prompt chunks smaller than the
 *     recomputed tokens (so they span several steps, beside another
 *     request), and every token recomputed answers as prompt mode;
 *     usage counts the recomputed tokens as prefilled, not as prompt.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "serve/scheduler.h"
#include "test_model.h"
#include "test_sched.h"
#include "test_util.h"

static backend *g_be;
static model *g_model;
static char g_dir[] = "/tmp/test_recompute_serve_XXXXXX";

static int setup(void **state) {
    (void)state;
    if (backend_cpu_create(0, &g_be) != IS_OK) return -1;
    return test_model_open_scratch(g_be, &g_model, g_dir);
}

static int teardown(void **state) {
    (void)state;
    return test_model_close_scratch(g_be, g_model, g_dir);
}

static void test_recompute_answers(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    const int32_t max_tokens = 16;
    engine *e = test_engine_create(g_model, test_engine_params(1024, 6, 0));
    char dir[400];
    snprintf(dir, sizeof dir, "%s/mem", g_dir);
    memory_params mp = memory_default_params(); /* BM25 only: retrieval is not tested here */
    memory *mem = NULL;
    assert_int_equal(memory_open(dir, &mp, &mem, NULL), IS_OK);
    const char *texts[] = {"Melanie plays the clarinet and started as a child.",
                           "Caroline moved from Sweden four years ago.",
                           "Melanie is learning to bake sourdough bread."};
    const char *q = "What does Melanie play, and where is Caroline from?";
    char rids[3][RECORD_STORE_ID_MAX + 1];
    ask_ctx *ac;
    assert_int_equal(ask_ctx_create(e, memory_record_store(mem), KV_DTYPE_F32, &ac), IS_OK);
    test_add_with_records(mem, ac, texts, 3, NULL, rids);
    const char *rid_ptrs[] = {rids[0], rids[1], rids[2]};

    /* ask_run */
    test_text kv = {0}, prompt = {0}, all = {0}, blend = {0}, two = {0};
    ask_timing tkv, tp, tall, tb, t2;
    ask_request r = test_ask_greedy(ASK_MODE_KV, q, rid_ptrs, texts, 3, max_tokens);
    assert_int_equal(ask_run(ac, &r, test_text_collect, &kv, &tkv), IS_OK);
    r.recompute = 1000;
    assert_int_equal(ask_run(ac, &r, test_text_collect, &all, &tall), IS_OK);
    r.recompute = 0;
    r.blend = 1.0f;
    assert_int_equal(ask_run(ac, &r, test_text_collect, &blend, &tb), IS_OK);
    r.blend = 0.0f;
    r.recompute = 2;
    assert_int_equal(ask_run(ac, &r, test_text_collect, &two, &t2), IS_OK);
    r = test_ask_greedy(ASK_MODE_PROMPT, q, rid_ptrs, texts, 3, max_tokens);
    assert_int_equal(ask_run(ac, &r, test_text_collect, &prompt, &tp), IS_OK);
    printf("  ask kv: \"%s\"\n  ask prompt: \"%s\"\n  ask kv, all recomputed: \"%s\"\n"
           "  ask kv, blend 1: \"%s\"\n  ask kv, recompute 2: \"%s\"\n",
           kv.s, prompt.s, all.s, blend.s, two.s);
    assert_true(prompt.n > 0);
    assert_string_equal(all.s, prompt.s);
    assert_string_equal(blend.s, prompt.s);
    /* Every token recomputed goes through the query's forward, positions unchanged. */
    assert_int_equal(tall.n_prefilled, tkv.n_prefilled + tkv.n_memory_tokens);
    assert_int_equal(t2.n_prefilled, tkv.n_prefilled + 2 * 3);
    ask_ctx_free(ac);

    /* The scheduler, in prompt chunks of 8 tokens: the rewrites span steps. */
    const int32_t ms[] = {2, 1000};
    const test_text *want[] = {&two, &prompt};
    for (int k = 0; k < 2; k++) {
        sched_params sp = sched_default_params();
        sp.record_dtype = KV_DTYPE_F32;
        sp.prefill_chunk = 8;
        sp.recompute = ms[k];
        sched *s;
        assert_int_equal(sched_create(e, mem, &sp, &s), IS_OK);
        chat_message m1[] = {{"user", q}};
        sched_fact facts[3];
        for (int i = 0; i < 3; i++) facts[i] = (sched_fact){texts[i], rids[i]};
        sched_request rq = {.messages = m1,
                            .n_messages = 1,
                            .mode = ASK_MODE_KV,
                            .facts = facts,
                            .n_facts = 3,
                            .max_tokens = max_tokens,
                            .temperature = 0,
                            .top_p = 1.0f};
        test_coll a, b;
        test_coll_submit(s, &rq, &a);
        test_coll_submit(s, &rq, &b); /* beside another request in the same steps */
        test_coll_done(&a);
        test_coll_done(&b);
        printf("  scheduler, recompute %d: \"%s\" / \"%s\" (%d prompt, %d prefilled tokens)\n",
               (int)ms[k], a.text, b.text, (int)a.usage.prompt_tokens,
               (int)a.usage.prefilled_tokens);
        assert_string_equal(a.text, want[k]->s);
        assert_string_equal(b.text, want[k]->s);
        int32_t n_rw = k == 0 ? 2 * 3 : tkv.n_memory_tokens;
        assert_int_equal(a.usage.prefilled_tokens, (int32_t)tkv.n_prefilled + n_rw);
        assert_int_equal(a.usage.prompt_tokens,
                         a.usage.cached_tokens + tkv.n_memory_tokens + tkv.n_prefilled);
        sched_free(s);
    }
    sched_params bad = sched_default_params();
    bad.recompute = -1;
    sched *s = NULL;
    assert_int_equal(sched_create(e, mem, &bad, &s), IS_ERR_INVALID_ARG);
    engine_free(e);
    memory_close(mem);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_recompute_answers)};
    return test_run_group(tests, setup, teardown);
}

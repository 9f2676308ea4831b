/*
 * The public memory API (include/inferscale.h, is_memory_*), through that
 * header alone: a store opened, facts added for two users, searches that
 * find a user's own facts and never another's, reopening, refusals; and,
 * with the default model, answers with the facts injected as KV and pasted
 * as text (kv mode must prefill fewer tokens: the memory's are injected).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* After the headers it needs. */
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inferscale.h"
#include "test_util.h"

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/is_test_api_memory_%d", (int)getpid());
    test_remove_tree(g_dir);
    return mkdir(g_dir, 0755);
}

static int teardown(void **state) {
    (void)state;
    test_remove_tree(g_dir);
    return 0;
}

static void ok(is_status st) {
    if (st != IS_OK) fail_msg("%s: %s", is_status_to_string(st), is_error_last());
}

static is_memory_params bm25_params(void) {
    is_memory_params p = is_memory_default_params();
    p.embedder_dir = "none"; /* BM25: the same ranking wherever the test runs */
    return p;
}

static void test_add_search(void **state) {
    (void)state;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/bm25", g_dir);
    is_memory *mem = NULL;
    ok(is_memory_open(dir, bm25_params(), &mem));
    char id[IS_MEMORY_ID_SIZE];
    ok(is_memory_add(mem, "alice", "Alice adopted a grey cat named Pixel.", NULL, 0, id));
    assert_true(strlen(id) > 0);
    const char *ctx[] = {"We talked about hobbies.", "She said she paints."};
    ok(is_memory_add(mem, "alice", "Alice paints lakes at sunrise.", ctx, 2, NULL));
    ok(is_memory_add(mem, "alice", "Alice works as a nurse in Boston.", NULL, 0, NULL));
    ok(is_memory_add(mem, "bob", "Bob has a cat too, a black one.", NULL, 0, NULL));

    is_memory_hit *hits = NULL;
    int32_t n = 0;
    ok(is_memory_search(mem, "alice", "what is the name of her cat", 2, &hits, &n));
    assert_true(n >= 1 && n <= 2);
    assert_string_equal(hits[0].id, id);
    assert_string_equal(hits[0].text, "Alice adopted a grey cat named Pixel.");
    for (int32_t i = 0; i < n; i++) assert_null(strstr(hits[i].text, "Bob"));
    for (int32_t i = 1; i < n; i++) assert_true(hits[i - 1].score >= hits[i].score);
    is_memory_hits_free(hits, n);
    /* Another user sees only its own facts; an unknown user none. */
    ok(is_memory_search(mem, "bob", "cat", 5, &hits, &n));
    assert_int_equal(n, 1);
    assert_string_equal(hits[0].text, "Bob has a cat too, a black one.");
    is_memory_hits_free(hits, n);
    ok(is_memory_search(mem, "carol", "cat", 5, &hits, &n));
    assert_int_equal(n, 0);
    is_memory_hits_free(hits, n);

    /* Refusals, with nothing stored. */
    assert_int_equal(is_memory_add(mem, "alice", "", NULL, 0, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(is_memory_add(mem, "alice", "bad \xff utf-8", NULL, 0, NULL),
                     IS_ERR_INVALID_ARG);
    assert_int_equal(is_memory_add(mem, "", "text", NULL, 0, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(is_memory_add(mem, "alice", "text", NULL, 3, NULL), IS_ERR_INVALID_ARG);
    assert_int_equal(is_memory_search(mem, "alice", "cat", -1, &hits, &n), IS_ERR_INVALID_ARG);
    is_gen_params gp = is_gen_default_params();
    assert_int_equal(is_memory_ask(mem, "alice", "cat?", 3, IS_MEMORY_PROMPT, gp, NULL, NULL, NULL),
                     IS_ERR_UNSUPPORTED); /* no model */
    is_memory_close(mem);

    /* Reopened: everything is there. */
    ok(is_memory_open(dir, bm25_params(), &mem));
    ok(is_memory_search(mem, "alice", "Alice nurse Boston", 5, &hits, &n));
    assert_int_equal(n, 3);
    assert_string_equal(hits[0].text, "Alice works as a nurse in Boston.");
    is_memory_hits_free(hits, n);
    is_memory_close(mem);
    is_memory_close(NULL);

    is_memory *keep = (is_memory *)0x1;
    is_memory_params bad = bm25_params();
    bad.embedder_dir = "/nonexistent/embedder";
    assert_int_equal(is_memory_open(dir, bad, &keep), IS_ERR_NOT_FOUND);
    bad = bm25_params();
    bad.tenant = "";
    assert_int_equal(is_memory_open(dir, bad, &keep), IS_ERR_INVALID_ARG);
    bad = bm25_params();
    bad.model_path = "/nonexistent/model.gguf";
    assert_int_equal(is_memory_open(dir, bad, &keep), IS_ERR_IO);
    assert_ptr_equal(keep, (is_memory *)0x1);
}

typedef struct reply {
    char text[512];
    size_t len;
} reply;

static bool collect(const char *t, size_t l, void *ud) {
    reply *r = ud;
    size_t room = sizeof r->text - 1 - r->len;
    if (l > room) l = room;
    memcpy(r->text + r->len, t, l);
    r->len += l;
    r->text[r->len] = '\0';
    return true;
}

static void test_ask(void **state) {
    (void)state;
    if (!test_file_exists(IS_DEFAULT_MODEL)) TEST_SKIP(TEST_NEEDS_MODEL);
    char dir[300];
    snprintf(dir, sizeof dir, "%s/ask", g_dir);
    is_memory_params p = bm25_params();
    p.model_path = IS_DEFAULT_MODEL;
    p.n_threads = 2;
    is_memory *mem = NULL;
    ok(is_memory_open(dir, p, &mem));
    ok(is_memory_add(mem, "alice", "Alice adopted a grey cat named Pixel.", NULL, 0, NULL));
    ok(is_memory_add(mem, "alice", "Alice works as a nurse in Boston.", NULL, 0, NULL));
    is_gen_params gp = is_gen_default_params();
    gp.max_tokens = 8;
    gp.temperature = 0.0f;
    reply kv = {0}, pr = {0};
    is_gen_stats skv, spr;
    ok(is_memory_ask(mem, "alice", "What is the name of Alice's cat?", 2, IS_MEMORY_KV, gp, collect,
                     &kv, &skv));
    ok(is_memory_ask(mem, "alice", "What is the name of Alice's cat?", 2, IS_MEMORY_PROMPT, gp,
                     collect, &pr, &spr));
    assert_true(skv.n_generated > 0 && kv.len > 0);
    assert_true(spr.n_generated > 0 && pr.len > 0);
    /* The facts' tokens are injected in kv mode, prefilled in prompt mode. */
    assert_true(skv.n_prompt < spr.n_prompt);
    const char *stop[] = {"\n"};
    gp.stop = stop;
    gp.n_stop = 1;
    assert_int_equal(is_memory_ask(mem, "alice", "cat?", 2, IS_MEMORY_KV, gp, collect, &kv, NULL),
                     IS_ERR_UNSUPPORTED);
    is_memory_close(mem);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add_search),
        cmocka_unit_test(test_ask),
    };
    return test_run_group(tests, setup, teardown);
}

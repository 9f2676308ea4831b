/*
 * test_sched: the serving tests' scheduler and ask_run helpers
 * (test_sched.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_sched.h"

#include "test_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int test_ask_stack_open(test_ask_stack *s, int32_t n_ctx, char *dir) {
    memset(s, 0, sizeof *s);
    if (backend_cpu_create(0, &s->be) != IS_OK) return -1;
    if (test_model_open_scratch(s->be, &s->model, dir) != 0) return -1;
    if (!s->model) return 0;
    engine_params ep = engine_default_params();
    ep.max_seqs = 3;
    ep.n_ctx = n_ctx;
    if (engine_create(s->model, ep, &s->engine) != IS_OK ||
        record_store_open(dir, 64 << 20, &s->store) != IS_OK ||
        ask_ctx_create(s->engine, s->store, KV_DTYPE_F32, &s->ask) != IS_OK) {
        fprintf(stderr, "setup: %s\n", is_error_last());
        return -1;
    }
    return 0;
}

int test_ask_stack_close(test_ask_stack *s, const char *dir) {
    ask_ctx_free(s->ask);
    if (s->store) record_store_close(s->store);
    engine_free(s->engine);
    return test_model_close_scratch(s->be, s->model, dir);
}

bool test_text_collect(const char *text, size_t len, void *user_data) {
    test_text *b = user_data;
    if (b->n + len < sizeof b->s) {
        memcpy(b->s + b->n, text, len);
        b->n += len;
        b->s[b->n] = 0;
    }
    return true;
}

void test_coll_init(test_coll *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
}

void test_coll_on_event(const sched_event *ev, void *user_data) {
    test_coll *c = user_data;
    pthread_mutex_lock(&c->mu);
    if (c->released) c->n_after_release++;
    if (ev->kind == SCHED_EV_TEXT) {
        if (c->n + ev->len < sizeof c->text) {
            memcpy(c->text + c->n, ev->text, ev->len);
            c->n += ev->len;
            c->text[c->n] = 0;
        }
        c->n_text++;
    } else {
        c->n_terminal++;
        c->kind = ev->kind;
        c->finish = ev->finish;
        c->usage = ev->usage;
        c->status = ev->status;
        if (ev->message) snprintf(c->message, sizeof c->message, "%s", ev->message);
    }
    bool cancel = c->cancel_after && c->n_text == c->cancel_after && ev->kind == SCHED_EV_TEXT;
    sched_handle *h = c->h;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (cancel) sched_cancel(h);
}

void test_coll_submit(sched *s, const sched_request *r, test_coll *c) {
    test_coll_init(c);
    if (sched_submit(s, r, test_coll_on_event, c, &c->h) != IS_OK)
        fail_msg("sched_submit: %s", is_error_last());
}

int test_wait_limit_s(void) {
    const char *e = getenv("SCHED_TEST_TIMEOUT_S");
    return e && atoi(e) > 0 ? atoi(e) : 300;
}

/* Waits until the terminal event came, or at least n texts (n > 0). */
static void coll_wait_for(test_coll *c, int n, const char *what) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += test_wait_limit_s();
    pthread_mutex_lock(&c->mu);
    while (c->n_terminal == 0 && (n == 0 || c->n_text < n)) {
        if (pthread_cond_timedwait(&c->cv, &c->mu, &dl) != 0) {
            pthread_mutex_unlock(&c->mu);
            fail_msg("no %s within %d s", what, test_wait_limit_s());
        }
    }
    pthread_mutex_unlock(&c->mu);
}

void test_coll_wait(test_coll *c) { coll_wait_for(c, 0, "terminal event"); }

void test_coll_wait_text(test_coll *c, int n) { coll_wait_for(c, n, "text"); }

void test_coll_done(test_coll *c) {
    test_coll_wait(c);
    if (c->kind != SCHED_EV_DONE) fail_msg("request failed: %s", c->message);
    sched_release(c->h);
}

void test_coll_run(sched *s, const sched_request *r, test_coll *c) {
    test_coll_submit(s, r, c);
    test_coll_done(c);
}

sched_request test_sched_greedy(const chat_message *msgs, int32_t n, ask_mode mode,
                                int32_t max_tokens) {
    sched_request r = {.messages = msgs,
                       .n_messages = n,
                       .mode = mode,
                       .max_tokens = max_tokens,
                       .temperature = 0,
                       .top_p = 1.0f,
                       .top_k = 0};
    return r;
}

ask_request test_ask_greedy(ask_mode mode, const char *query, const char *const *ids,
                            const char *const *texts, int n, int32_t max_tokens) {
    ask_request r = {.mode = mode,
                     .query = query,
                     .fact_ids = ids,
                     .fact_texts = texts,
                     .n_facts = n,
                     .max_tokens = max_tokens,
                     .temperature = 0,
                     .top_k = 0,
                     .top_p = 1.0f};
    return r;
}

void test_add_with_records(memory *mem, ask_ctx *ac, const char *const *texts, int n,
                           char (*ids)[MEMORY_ID_SIZE], char (*rids)[RECORD_STORE_ID_MAX + 1]) {
    memory_set_encoder(mem, ask_memory_encoder, ac);
    for (int i = 0; i < n; i++) {
        memory_add_req r = {
            .tenant = "t", .user = "u", .text = texts[i], .window = MEMORY_WINDOW_DEFAULT};
        char id[MEMORY_ID_SIZE];
        if (memory_add(mem, &r, id) != IS_OK) fail_msg("memory_add: %s", is_error_last());
        if (ids) memcpy(ids[i], id, sizeof id);
        mem_fact f;
        assert_int_equal(memory_get(mem, "t", "u", id, &f), IS_OK);
        assert_non_null(f.kv_record);
        snprintf(rids[i], RECORD_STORE_ID_MAX + 1, "%s", f.kv_record);
        mem_fact_clear(&f);
    }
    memory_set_encoder(mem, NULL, NULL);
}

/*
 * test_sched: the serving tests' helpers around the scheduler and ask_run:
 * a collector of one request's events (its text, how many texts and
 * terminal events came, the terminal event's fields; optionally a cancel
 * from inside the callback), a text buffer for ask_run, greedy requests,
 * facts added with their KV records, and the ask tests' stack (model,
 * engine, record store, ask context). The helpers run inside a cmocka case
 * and fail it when a call is refused or a wait runs out.
 */
#ifndef IS_TESTS_TEST_SCHED_H
#define IS_TESTS_TEST_SCHED_H

#include "memory/memory.h"
#include "serve/ask.h"
#include "serve/scheduler.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The ask tests' stack on the default model: a CPU backend, the model, an
 * engine, a record store in a scratch directory and an ask context over
 * them (f32 records). */
typedef struct test_ask_stack {
    backend *be;
    model *model; /* NULL when the model is not installed: cases then skip */
    engine *engine;
    record_store *store;
    ask_ctx *ask;
} test_ask_stack;

/* Opens the stack with an engine of 3 sequences and n_ctx tokens and a
 * record store (64 MiB cache) in a scratch directory made from the
 * mkdtemp template dir (rewritten in place). Without the model only the
 * backend is made. 0, or -1 on a failure (the reason on stderr). */
int test_ask_stack_open(test_ask_stack *s, int32_t n_ctx, char *dir);

/* Frees the stack and removes its scratch directory: 0, or -1 if that
 * could not be removed. */
int test_ask_stack_close(test_ask_stack *s, const char *dir);

/* Text gathered from ask_run (test_text_collect) or a request's events. */
typedef struct test_text {
    char s[8192]; /* NUL-terminated */
    size_t n;
} test_text;

/* An ask_text_cb appending to the test_text user_data (a piece that does
 * not fit is dropped). Always goes on. */
bool test_text_collect(const char *text, size_t len, void *user_data);

/* One request's events, as test_coll_on_event records them. */
typedef struct test_coll {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char text[8192]; /* the text events, NUL-terminated (a piece that does not fit is dropped) */
    size_t n;        /* bytes of text */
    int n_text, n_terminal, n_after_release;
    bool released; /* set by the test before it releases early */
    sched_event_kind kind;
    is_finish_reason finish;
    sched_usage usage;
    is_status status;
    char message[256];
    sched_handle *h;
    int cancel_after; /* cancel from inside the callback after this many texts (0: never) */
} test_coll;

/* Empties c for a new request (its mutex and condition made anew). */
void test_coll_init(test_coll *c);

/* A sched_event_fn recording into the test_coll user_data. */
void test_coll_on_event(const sched_event *ev, void *user_data);

/* test_coll_init, then sched_submit with c as the user data; the case
 * fails if the scheduler refuses. */
void test_coll_submit(sched *s, const sched_request *r, test_coll *c);

/* Waits for the terminal event (the case fails after test_wait_limit_s). */
void test_coll_wait(test_coll *c);

/* Waits for at least n text events or the terminal one. */
void test_coll_wait_text(test_coll *c, int n);

/* Waits for the terminal event, which must be DONE (else the case fails
 * with the event's message), and releases the handle. */
void test_coll_done(test_coll *c);

/* test_coll_submit, then test_coll_done: one request alone. */
void test_coll_run(sched *s, const sched_request *r, test_coll *c);

/* Seconds a wait may take: SCHED_TEST_TIMEOUT_S (for runs under
 * valgrind), else 300. */
int test_wait_limit_s(void);

/* A greedy chat request (temperature 0, top_p 1, no top_k) of n messages. */
sched_request test_sched_greedy(const chat_message *msgs, int32_t n, ask_mode mode,
                                int32_t max_tokens);

/* A greedy ask_run request over n facts (their record ids and texts). */
ask_request test_ask_greedy(ask_mode mode, const char *query, const char *const *ids,
                            const char *const *texts, int n, int32_t max_tokens);

/* Adds texts[0..n) for tenant "t", user "u", each with its KV record made
 * by ask_memory_encoder on ac (the encoder is unset after): the facts' ids
 * into ids (may be NULL) and their records' ids into rids. */
void test_add_with_records(memory *mem, ask_ctx *ac, const char *const *texts, int n,
                           char (*ids)[MEMORY_ID_SIZE], char (*rids)[RECORD_STORE_ID_MAX + 1]);

#endif

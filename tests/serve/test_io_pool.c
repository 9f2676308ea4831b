/* io_pool: every item of a batch runs exactly once, on several threads,
 * with several callers at once (each returning only when its own batch
 * is done), and a NULL pool runs the items in order on the caller. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "serve/io_pool.h"

#define N_ITEMS   2000
#define N_CALLERS 4

typedef struct counts {
    atomic_int runs[N_ITEMS];
    atomic_int order; /* items run so far, for the NULL pool's order */
    int32_t first_seen[N_ITEMS];
    pthread_t tid[N_ITEMS];
} counts;

static void item(void *arg, int32_t i) {
    counts *c = arg;
    atomic_fetch_add(&c->runs[i], 1);
    c->first_seen[i] = atomic_fetch_add(&c->order, 1);
    c->tid[i] = pthread_self();
    if (i % 97 == 0) {
        struct timespec ts = {0, 200000}; /* a slow read now and then */
        nanosleep(&ts, NULL);
    }
}

static void check_once(counts *c, int32_t n) {
    for (int32_t i = 0; i < n; i++) assert_int_equal(atomic_load(&c->runs[i]), 1);
}

static void test_null_pool_in_order(void **state) {
    (void)state;
    static counts c;
    memset(&c, 0, sizeof c);
    io_pool_run(NULL, item, &c, 50);
    check_once(&c, 50);
    for (int32_t i = 0; i < 50; i++) assert_int_equal(c.first_seen[i], i);
}

static void test_one_batch_many_threads(void **state) {
    (void)state;
    io_pool *p = NULL;
    assert_int_equal(io_pool_create(4, &p), IS_OK);
    static counts c;
    memset(&c, 0, sizeof c);
    io_pool_run(p, item, &c, N_ITEMS);
    check_once(&c, N_ITEMS);
    int others = 0;
    for (int32_t i = 0; i < N_ITEMS; i++) others += !pthread_equal(c.tid[i], pthread_self());
    assert_true(others > 0);     /* the pool took part */
    io_pool_run(p, item, &c, 1); /* one item: on the caller */
    assert_int_equal(atomic_load(&c.runs[0]), 2);
    io_pool_free(p);
}

typedef struct caller {
    io_pool *p;
    counts c;
} caller;

static void *call(void *arg) {
    caller *k = arg;
    for (int r = 0; r < 5; r++) {
        memset(&k->c, 0, sizeof k->c);
        io_pool_run(k->p, item, &k->c, N_ITEMS / 4);
        for (int32_t i = 0; i < N_ITEMS / 4; i++)
            if (atomic_load(&k->c.runs[i]) != 1) return (void *)1;
    }
    return NULL;
}

static void test_callers_at_once(void **state) {
    (void)state;
    io_pool *p = NULL;
    assert_int_equal(io_pool_create(3, &p), IS_OK);
    static caller k[N_CALLERS];
    pthread_t th[N_CALLERS];
    for (int i = 0; i < N_CALLERS; i++) {
        k[i].p = p;
        assert_int_equal(pthread_create(&th[i], NULL, call, &k[i]), 0);
    }
    for (int i = 0; i < N_CALLERS; i++) {
        void *bad = NULL;
        pthread_join(th[i], &bad);
        assert_null(bad);
    }
    io_pool_free(p);
    assert_int_equal(io_pool_create(0, &p), IS_ERR_INVALID_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_null_pool_in_order),
        cmocka_unit_test(test_one_batch_many_threads),
        cmocka_unit_test(test_callers_at_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

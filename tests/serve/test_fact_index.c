/*
 * test_fact_index: the scheduler's map from record id to what injecting a
 * GPU-resident record needs (serve/fact_index.h): lookups, updates, the
 * resident hint, growth past the first table, the bound, and use from
 * several threads at once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "serve/fact_index.h"

static void test_put_get(void **state) {
    (void)state;
    fact_index *x;
    assert_int_equal(fact_index_create(1000, &x), IS_OK);
    fact_index_entry e;
    assert_false(fact_index_get(x, "f1-v1", &e));
    fact_index_entry a = {.content_id = 11, .text_hash = 22, .n_tokens = 7, .resident = false};
    fact_index_put(x, "f1-v1", &a);
    assert_true(fact_index_get(x, "f1-v1", &e));
    assert_int_equal(e.content_id, 11);
    assert_int_equal(e.text_hash, 22);
    assert_int_equal(e.n_tokens, 7);
    assert_false(e.resident);
    assert_false(fact_index_get(x, "f1-v2", &e)); /* another version is another record */
    fact_index_set_resident(x, "f1-v1", true);
    assert_true(fact_index_get(x, "f1-v1", &e));
    assert_true(e.resident);
    fact_index_set_resident(x, "nope", true); /* no entry: nothing added */
    assert_false(fact_index_get(x, "nope", &e));
    a.content_id = 99;
    fact_index_put(x, "f1-v1", &a); /* replaced, not added */
    assert_true(fact_index_get(x, "f1-v1", &e));
    assert_int_equal(e.content_id, 99);
    assert_int_equal(fact_index_size(x), 1);
    fact_index_free(x);
    fact_index_free(NULL);
    assert_int_equal(fact_index_create(0, &x), IS_ERR_INVALID_ARG);
}

static void test_growth_and_bound(void **state) {
    (void)state;
    fact_index *x;
    assert_int_equal(fact_index_create(5000, &x), IS_OK);
    char id[32];
    for (int i = 0; i < 5000; i++) { /* past the first table's 1024 buckets */
        snprintf(id, sizeof id, "r%d", i);
        fact_index_entry a = {.content_id = (uint64_t)i * 3 + 1, .n_tokens = i % 50 + 1};
        fact_index_put(x, id, &a);
    }
    assert_int_equal(fact_index_size(x), 5000);
    for (int i = 0; i < 5000; i++) {
        snprintf(id, sizeof id, "r%d", i);
        fact_index_entry e;
        assert_true(fact_index_get(x, id, &e));
        assert_int_equal(e.content_id, (uint64_t)i * 3 + 1);
        assert_int_equal(e.n_tokens, i % 50 + 1);
    }
    /* At the bound the table starts again: only the new entry is left. */
    fact_index_entry b = {.content_id = 7, .n_tokens = 1};
    fact_index_put(x, "one-more", &b);
    assert_int_equal(fact_index_size(x), 1);
    fact_index_entry e;
    assert_false(fact_index_get(x, "r0", &e));
    assert_true(fact_index_get(x, "one-more", &e));
    fact_index_free(x);
}

typedef struct worker {
    fact_index *x;
    int t;
    int bad;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    char id[32];
    for (int i = 0; i < 20000; i++) {
        snprintf(id, sizeof id, "t%d-%d", w->t, i % 3000);
        fact_index_entry a = {.content_id = (uint64_t)(w->t * 100000 + i % 3000), .n_tokens = 3};
        fact_index_put(w->x, id, &a);
        fact_index_entry e;
        if (!fact_index_get(w->x, id, &e) || e.content_id != a.content_id) w->bad++;
        fact_index_set_resident(w->x, id, i & 1);
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    fact_index *x;
    assert_int_equal(fact_index_create(1 << 20, &x), IS_OK);
    pthread_t th[4];
    worker w[4];
    for (int t = 0; t < 4; t++) {
        w[t] = (worker){.x = x, .t = t};
        assert_int_equal(pthread_create(&th[t], NULL, work, &w[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(w[t].bad, 0);
    }
    assert_int_equal(fact_index_size(x), 4 * 3000);
    fact_index_free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get),
        cmocka_unit_test(test_growth_and_bound),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

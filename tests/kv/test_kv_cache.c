/* Paged KV cache bookkeeping: growth, truncation, sharing, exhaustion. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kv/kv_cache.h"

static kv_cache *make(int32_t n_blocks, int32_t max_seqs) {
    kv_cache_params p = {.n_layers = 2,
                         .n_kv_heads = 2,
                         .head_dim = 8,
                         .block_size = 4,
                         .n_blocks = n_blocks,
                         .max_seqs = max_seqs};
    kv_cache *c = NULL;
    assert_int_equal(kv_cache_create(p, &c), IS_OK);
    return c;
}

static void test_grow_and_slots(void **state) {
    kv_cache *c = make(8, 2);
    int32_t s;
    assert_int_equal(kv_seq_create(c, &s), IS_OK);
    assert_int_equal(kv_seq_grow(c, s, 5), IS_OK); /* 2 blocks */
    assert_int_equal(kv_seq_length(c, s), 5);
    assert_int_equal(kv_cache_free_blocks(c), 6);
    /* Positions in the same block are consecutive slots. */
    assert_int_equal(kv_cache_slot(c, s, 1), kv_cache_slot(c, s, 0) + 1);
    assert_int_equal(kv_cache_slot(c, s, 4) % 4, 0);
    assert_int_equal(kv_seq_grow(c, s, 3), IS_OK); /* fills block 2 exactly */
    assert_int_equal(kv_cache_free_blocks(c), 6);
    assert_true(kv_cache_check(c));
    kv_cache_free(c);
}

/* kv_cache_slots equals kv_cache_slot position by position, for every run
 * (starting inside a block, crossing blocks, empty), on a sequence whose
 * blocks are not in order (another sequence took blocks between). */
static void test_slot_runs(void **state) {
    kv_cache *c = make(16, 2);
    int32_t a, b;
    assert_int_equal(kv_seq_create(c, &a), IS_OK);
    assert_int_equal(kv_seq_create(c, &b), IS_OK);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(kv_seq_grow(c, a, 3), IS_OK);
        assert_int_equal(kv_seq_grow(c, b, 2), IS_OK);
    }
    const int32_t len = kv_seq_length(c, a);
    int32_t got[32];
    for (int32_t pos = 0; pos <= len; pos++)
        for (int32_t n = 0; pos + n <= len; n++) {
            got[n] = -7; /* past the run: must stay */
            kv_cache_slots(c, a, pos, n, got);
            for (int32_t i = 0; i < n; i++) assert_int_equal(got[i], kv_cache_slot(c, a, pos + i));
            assert_int_equal(got[n], -7);
        }
    kv_cache_free(c);
}

static void test_exhaustion_leaves_seq_unchanged(void **state) {
    kv_cache *c = make(3, 2);
    int32_t a, b;
    assert_int_equal(kv_seq_create(c, &a), IS_OK);
    assert_int_equal(kv_seq_create(c, &b), IS_OK);
    assert_int_equal(kv_seq_grow(c, a, 8), IS_OK);
    assert_int_equal(kv_seq_grow(c, b, 5), IS_ERR_CONTEXT_FULL);
    assert_int_equal(kv_seq_length(c, b), 0);
    assert_int_equal(kv_cache_free_blocks(c), 1);
    kv_seq_free(c, a);
    assert_int_equal(kv_cache_free_blocks(c), 3);
    assert_int_equal(kv_seq_grow(c, b, 12), IS_OK);
    assert_true(kv_cache_check(c));
    /* No third sequence slot. */
    int32_t x;
    assert_int_equal(kv_seq_create(c, &x), IS_OK);
    int32_t y;
    assert_int_equal(kv_seq_create(c, &y), IS_ERR_CONTEXT_FULL);
    kv_cache_free(c);
}

static void test_truncate_releases(void **state) {
    kv_cache *c = make(8, 1);
    int32_t s;
    assert_int_equal(kv_seq_create(c, &s), IS_OK);
    assert_int_equal(kv_seq_grow(c, s, 13), IS_OK);
    assert_int_equal(kv_cache_free_blocks(c), 4);
    kv_seq_truncate(c, s, 5);
    assert_int_equal(kv_seq_length(c, s), 5);
    assert_int_equal(kv_cache_free_blocks(c), 6);
    kv_seq_truncate(c, s, 0);
    assert_int_equal(kv_cache_free_blocks(c), 8);
    assert_true(kv_cache_check(c));
    kv_cache_free(c);
}

static void test_share_prefix_refcounts(void **state) {
    kv_cache *c = make(8, 3);
    int32_t src, d1, d2;
    assert_int_equal(kv_seq_create(c, &src), IS_OK);
    assert_int_equal(kv_seq_create(c, &d1), IS_OK);
    assert_int_equal(kv_seq_create(c, &d2), IS_OK);
    assert_int_equal(kv_seq_grow(c, src, 8), IS_OK);
    assert_int_equal(kv_seq_share_prefix(c, d1, src, 6),
                     IS_ERR_INVALID_ARG); /* not block aligned */
    assert_int_equal(kv_seq_share_prefix(c, d1, src, 8), IS_OK);
    assert_int_equal(kv_seq_share_prefix(c, d2, src, 4), IS_OK);
    assert_int_equal(kv_cache_slot(c, d1, 5), kv_cache_slot(c, src, 5));
    assert_int_equal(kv_cache_free_blocks(c), 6);
    assert_int_equal(kv_seq_grow(c, d1, 1), IS_OK); /* private block after the shared ones */
    assert_int_not_equal(kv_cache_slot(c, d1, 8) / 4, kv_cache_slot(c, src, 7) / 4);
    assert_true(kv_cache_check(c));
    kv_seq_free(c, src);
    assert_int_equal(kv_cache_free_blocks(c), 5); /* shared blocks still held */
    kv_seq_free(c, d1);
    kv_seq_free(c, d2);
    assert_int_equal(kv_cache_free_blocks(c), 8);
    assert_true(kv_cache_check(c));
    kv_cache_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grow_and_slots),
        cmocka_unit_test(test_slot_runs),
        cmocka_unit_test(test_exhaustion_leaves_seq_unchanged),
        cmocka_unit_test(test_truncate_releases),
        cmocka_unit_test(test_share_prefix_refcounts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

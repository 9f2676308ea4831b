/*
 * test_flash_plan: how the tiled attention cuts a batch into query tiles
 * (cuda_flash_plan_batch: host code, so it runs without a device, in CI).
 * Each tile carries its first batch token, its tokens, where its
 * sequence's block table starts, its first position, and its sequence's
 * first position in the batch: keys before that one were written before
 * the forward, and the attention may copy them before it waits for the
 * kernel before it (cuda_pdl_early_on). A wrong value there is a race the
 * logits would show only sometimes, so it is checked here exactly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
extern "C" { /* this cmocka.h declares its functions for C only */
#include <cmocka.h>
}

#include <vector>

#include "flash.cuh"

struct tile {
    int32_t t0, n, bt_at, pos0, first;
};

static std::vector<tile> plan_tiles(const std::vector<int32_t> &seq, const std::vector<int32_t> &pos,
                                    const std::vector<int32_t> &bt_off, int32_t n_heads,
                                    int32_t n_kv_heads) {
    const int32_t T = (int32_t)seq.size();
    std::vector<int32_t> raw((size_t)T * FLASH_TILE_INTS, -1);
    const cuda_flash_plan p = cuda_flash_plan_batch(seq.data(), pos.data(), T, bt_off.data(), n_heads,
                                                    n_kv_heads, 128, 132, CUDA_FLASH_CHOICE_AUTO,
                                                    true, raw.data());
    std::vector<tile> out;
    for (int32_t i = 0; i < p.n_tiles; i++) {
        const int32_t *r = raw.data() + (size_t)i * FLASH_TILE_INTS;
        out.push_back({r[0], r[1], r[2], r[3], r[4]});
    }
    assert_true(p.splits >= 1);
    return out;
}

static void expect_tile(const tile &got, tile want) {
    assert_int_equal(got.t0, want.t0);
    assert_int_equal(got.n, want.n);
    assert_int_equal(got.bt_at, want.bt_at);
    assert_int_equal(got.pos0, want.pos0);
    assert_int_equal(got.first, want.first);
}

/* Three sequences interleaved in one batch, one of them twice: its second
 * run's tile must still say that its keys from position 10 on are this
 * forward's, not only those from 13. */
static void test_interleaved(void **state) {
    (void)state;
    const std::vector<tile> t = plan_tiles({0, 0, 0, 1, 1, 0, 2, 2, 2, 2},
                                           {10, 11, 12, 5, 6, 13, 0, 1, 2, 3}, {0, 100, 200}, 32, 8);
    assert_int_equal((int)t.size(), 4);
    expect_tile(t[0], {0, 3, 0, 10, 10});
    expect_tile(t[1], {3, 2, 100, 5, 5});
    expect_tile(t[2], {5, 1, 0, 13, 10});
    expect_tile(t[3], {6, 4, 200, 0, 0});
}

/* A run longer than a tile's rows (64 rows / a group of 4 = 16 tokens):
 * every tile of it has the run's first position; a sequence's positions
 * out of order in the batch give it their least. */
static void test_long_run_and_order(void **state) {
    (void)state;
    std::vector<int32_t> seq(40, 0), pos(40);
    for (int32_t i = 0; i < 40; i++) pos[(size_t)i] = 100 + i;
    std::vector<tile> t = plan_tiles(seq, pos, {7}, 32, 8);
    assert_int_equal((int)t.size(), 3);
    expect_tile(t[0], {0, 16, 7, 100, 100});
    expect_tile(t[1], {16, 16, 7, 116, 100});
    expect_tile(t[2], {32, 8, 7, 132, 100});
    t = plan_tiles({0, 0, 1, 0}, {20, 21, 3, 4}, {0, 50}, 8, 8); /* groups of 1: 64 tokens a tile */
    assert_int_equal((int)t.size(), 3);
    expect_tile(t[0], {0, 2, 0, 20, 4});
    expect_tile(t[1], {2, 1, 50, 3, 3});
    expect_tile(t[2], {3, 1, 0, 4, 4});
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_interleaved),
        cmocka_unit_test(test_long_run_and_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

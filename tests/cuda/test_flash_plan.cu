/*
 * test_flash_plan: how the tiled attention cuts a batch into query tiles
 * (cuda_flash_plan_batch: host code, so it runs without a device, in CI).
 * Each tile carries its first batch token, its tokens, where its
 * sequence's block table starts and its first position; a wrong value
 * there reads another sequence's keys, so it is checked here exactly.
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
    int32_t t0, n, bt_at, pos0;
};

static std::vector<tile> plan_tiles(const std::vector<int32_t> &seq,
                                    const std::vector<int32_t> &pos,
                                    const std::vector<int32_t> &bt_off, int32_t n_heads,
                                    int32_t n_kv_heads) {
    const int32_t T = (int32_t)seq.size();
    std::vector<int32_t> raw((size_t)T * FLASH_TILE_INTS, -1);
    const cuda_flash_plan p =
        cuda_flash_plan_batch(seq.data(), pos.data(), T, bt_off.data(), n_heads, n_kv_heads, 128,
                              132, CUDA_FLASH_CHOICE_AUTO, true, raw.data());
    std::vector<tile> out;
    for (int32_t i = 0; i < p.n_tiles; i++) {
        const int32_t *r = raw.data() + (size_t)i * FLASH_TILE_INTS;
        out.push_back({r[0], r[1], r[2], r[3]});
    }
    assert_true(p.splits >= 1);
    return out;
}

static void expect_tile(const tile &got, tile want) {
    assert_int_equal(got.t0, want.t0);
    assert_int_equal(got.n, want.n);
    assert_int_equal(got.bt_at, want.bt_at);
    assert_int_equal(got.pos0, want.pos0);
}

/* Three sequences interleaved in one batch, one of them twice: its second
 * run is a tile of its own, at its own position. */
static void test_interleaved(void **state) {
    (void)state;
    const std::vector<tile> t = plan_tiles(
        {0, 0, 0, 1, 1, 0, 2, 2, 2, 2}, {10, 11, 12, 5, 6, 13, 0, 1, 2, 3}, {0, 100, 200}, 32, 8);
    assert_int_equal((int)t.size(), 4);
    expect_tile(t[0], {0, 3, 0, 10});
    expect_tile(t[1], {3, 2, 100, 5});
    expect_tile(t[2], {5, 1, 0, 13});
    expect_tile(t[3], {6, 4, 200, 0});
}

/* A run longer than a tile's rows (64 rows / a group of 4 = 16 tokens) is
 * cut into tiles at consecutive positions; a sequence's positions out of
 * order in the batch give a tile each. */
static void test_long_run_and_order(void **state) {
    (void)state;
    std::vector<int32_t> seq(40, 0), pos(40);
    for (int32_t i = 0; i < 40; i++) pos[(size_t)i] = 100 + i;
    std::vector<tile> t = plan_tiles(seq, pos, {7}, 32, 8);
    assert_int_equal((int)t.size(), 3);
    expect_tile(t[0], {0, 16, 7, 100});
    expect_tile(t[1], {16, 16, 7, 116});
    expect_tile(t[2], {32, 8, 7, 132});
    t = plan_tiles({0, 0, 1, 0}, {20, 21, 3, 4}, {0, 50}, 8, 8); /* groups of 1: 64 tokens a tile */
    assert_int_equal((int)t.size(), 3);
    expect_tile(t[0], {0, 2, 0, 20});
    expect_tile(t[1], {2, 1, 50, 3});
    expect_tile(t[2], {3, 1, 0, 4});
}

/* The 8B query (30 tokens, 16 (tile, KV head) pairs) after k facts: the
 * cost model walks 1,340 keys (k = 50) in 128-key tiles, 6
 * splits of 2 such tiles against 4 of 64 keys, and 2,590 (k = 100) in 6
 * splits of 4 such tiles against 7, and keeps 64-key tiles where a block
 * walks one either way (k = 5: 215 keys); never without wide tiles allowed
 * (CUDA_FLASH_CHOICE_NO_WIDE, the plan before wide tiles). Wide tiles are the
 * wgmma engine's: without a GPU that runs it (CI) the plan must stay on
 * 64-key tiles; on one (ctest -L gpu) the choices above. */
static cuda_flash_plan plan_8b(int32_t keys, cuda_flash_choice choice) {
    std::vector<int32_t> seq(30, 0), pos(30), raw(30 * FLASH_TILE_INTS);
    for (int32_t t = 0; t < 30; t++) pos[(size_t)t] = keys - 30 + t;
    const int32_t bt_off[1] = {0};
    return cuda_flash_plan_batch(seq.data(), pos.data(), 30, bt_off, 32, 8, 128, 132, choice, true,
                                 raw.data());
}

static void test_wide_tiles(void **state) {
    (void)state;
    if (!cuda_flash_wgmma_supports(128)) {
        /* wide tiles are the wgmma engine's choice; mma.sync plans stay 64 */
        assert_int_equal(plan_8b(1340, CUDA_FLASH_CHOICE_AUTO).key_tile, FLASH_BN);
        return;
    }
    const cuda_flash_plan k50 = plan_8b(1340, CUDA_FLASH_CHOICE_AUTO);
    assert_int_equal(k50.key_tile, FLASH_BN_WIDE);
    assert_int_equal(k50.key_warps, 2);
    assert_int_equal(k50.splits, 6);
    assert_int_equal(plan_8b(215, CUDA_FLASH_CHOICE_AUTO).key_tile, FLASH_BN);
    const cuda_flash_plan k100 = plan_8b(2590, CUDA_FLASH_CHOICE_AUTO);
    assert_int_equal(k100.key_tile, FLASH_BN_WIDE);
    assert_int_equal(k100.splits, 6);
    assert_int_equal(plan_8b(1340, CUDA_FLASH_CHOICE_NO_WIDE).key_tile, FLASH_BN);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_interleaved),
        cmocka_unit_test(test_long_run_and_order),
        cmocka_unit_test(test_wide_tiles),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_flash_engines: the tiled attention's two engines (cuda/flash.cuh:
 * mma.sync, and wgmma on an sm_90a GPU) on the same batch with the same
 * plan. Both add each 16-wide step of S = Q K^T and of P V in the same
 * order into f32 accumulators of the same layout, and share everything
 * else (softmax, merges), so their outputs must be bitwise equal: they
 * measured 0 difference on the 8B shape's prefill and decode. A case that
 * differs is printed with its first differing element, so a broken
 * descriptor or layout shows where it breaks (head size, group, rows of
 * the tile, key tiles, splits, key warps, merge): this test found the D = 64
 * engine with one key part wrong past the first key tile, which the SASS
 * traced to ptxas giving P's fragments the registers of Q's;
 * Q now reaches wgmma from shared memory. (test_cuda_ops checks both
 * engines against the CPU at the bf16 bar.) Every plan runs on 64-key
 * tiles and, with two key warps, on 128-key ones (FLASH_BN_WIDE).
 *
 * Every slot of the cache outside the sequence holds NaN, and every output
 * must be finite as well as equal: keys past the sequence must not be read
 * into a tile (their V rows would give 0 x NaN = NaN even where P is 0),
 * as a copy that took whole pages would (TMA boxes of a page, tried and
 * dropped, read the last page's unwritten slots). Caches of pages of 4 to
 * 128 slots run besides the engine's 16.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
extern "C" { /* this cmocka.h declares its functions for C only */
#include <cmocka.h>
}

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "flash.cuh"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));            \
            fail();                                                                                \
        }                                                                                          \
    } while (0)

static int g_sms;

static uint64_t g_rng = 0x12345678;
static float urand(void) { /* uniform in [-1, 1) */
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}

struct shape {
    int32_t H, KH, D, T, pos0; /* one sequence: queries at pos0 .. pos0 + T - 1 */
    int32_t bs;                /* slots a cache page */
};

/* Runs every plan variant of one shape on both engines; returns how many
 * differed or gave an output that is not finite. */
static int check_shape(const shape &s) {
    const int32_t bs = s.bs, keys = s.pos0 + s.T, n_blocks = 2 * ((keys + bs - 1) / bs) + 3;
    const size_t cache_n = (size_t)n_blocks * s.KH * bs * s.D, q_n = (size_t)s.T * s.H * s.D;
    std::vector<__nv_bfloat16> kh(cache_n), vh(cache_n);
    for (size_t i = 0; i < cache_n; i++) { /* NaN unless the sequence's (below) */
        kh[i] = __float2bfloat16(NAN);
        vh[i] = __float2bfloat16(NAN);
    }
    std::vector<float> qh(q_n);
    for (size_t i = 0; i < q_n; i++) qh[i] = urand();
    /* The sequence's blocks: every other block of the pool, backwards, so
     * that no two consecutive pages are neighbours. */
    std::vector<int32_t> table((size_t)n_blocks);
    for (int32_t i = 0; i < (keys + bs - 1) / bs; i++) table[(size_t)i] = n_blocks - 1 - 2 * i;
    for (int32_t j = 0; j < keys; j++)
        for (int32_t h = 0; h < s.KH; h++)
            for (int32_t d = 0; d < s.D; d++) {
                const size_t at =
                    (((size_t)table[(size_t)(j / bs)] * s.KH + h) * bs + j % bs) * s.D + d;
                kh[at] = __float2bfloat16(urand());
                vh[at] = __float2bfloat16(urand());
            }
    std::vector<int32_t> sot((size_t)s.T, 0), pos((size_t)s.T),
        tiles((size_t)s.T * FLASH_TILE_INTS);
    for (int32_t t = 0; t < s.T; t++) pos[(size_t)t] = s.pos0 + t;
    const int32_t bt_off[1] = {0};

    __nv_bfloat16 *k, *v;
    float *q, *out[2], *partial;
    int32_t *d_table, *d_tiles;
    CK(cudaMalloc(&k, cache_n * sizeof(__nv_bfloat16)));
    CK(cudaMalloc(&v, cache_n * sizeof(__nv_bfloat16)));
    CK(cudaMalloc(&q, q_n * sizeof(float)));
    for (int e = 0; e < 2; e++) CK(cudaMalloc(&out[e], q_n * sizeof(float)));
    const size_t part_cap = (size_t)s.T * s.KH * 8 * FLASH_BM * (s.D + 2);
    CK(cudaMalloc(&partial, part_cap * sizeof(float)));
    CK(cudaMalloc(&d_table, table.size() * sizeof(int32_t)));
    CK(cudaMalloc(&d_tiles, tiles.size() * sizeof(int32_t)));
    CK(cudaMemcpy(k, kh.data(), cache_n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(v, vh.data(), cache_n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(q, qh.data(), q_n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_table, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

    int bad = 0;
    const int32_t splits_of[] = {1, 2, 3};
    for (const auto &shape : FLASH_TILE_SHAPES)
        for (int si = 0; si < 3; si++)
            for (int cl = 0; cl <= 1; cl++) {
                const int32_t bn = shape[0], kw = shape[1];
                cuda_flash_plan plan =
                    cuda_flash_plan_batch(sot.data(), pos.data(), s.T, bt_off, s.H, s.KH, s.D,
                                          g_sms, CUDA_FLASH_CHOICE_AUTO, true, tiles.data());
                const int32_t max_kt = (keys + bn - 1) / bn;
                plan.splits = splits_of[si];
                plan.key_warps = kw;
                plan.cluster = cl;
                plan.key_tile = bn;
                if (plan.splits > max_kt || (cl && plan.splits == 1)) continue;
                CK(cudaMemcpy(d_tiles, tiles.data(),
                              (size_t)plan.n_tiles * FLASH_TILE_INTS * sizeof(int32_t),
                              cudaMemcpyHostToDevice));
                std::vector<float> got[2];
                for (int e = 0; e < 2; e++) {
                    plan.wgmma = e;
                    CK(cudaMemset(out[e], 0xFF, q_n * sizeof(float))); /* NaN: unwritten shows */
                    assert_int_equal(cuda_flash_attention(0, out[e], q, k, v, d_table, d_tiles,
                                                          plan, partial, s.H, s.KH, s.D, bs,
                                                          cuda_bf16_out{}, true),
                                     0);
                    CK(cudaDeviceSynchronize());
                    got[e].resize(q_n);
                    CK(cudaMemcpy(got[e].data(), out[e], q_n * sizeof(float),
                                  cudaMemcpyDeviceToHost));
                }
                size_t first = q_n, n_diff = 0, n_bad = 0;
                double worst = 0.0;
                for (size_t i = 0; i < q_n; i++) {
                    if (!isfinite(got[0][i]) || !isfinite(got[1][i])) n_bad++;
                    if (memcmp(&got[0][i], &got[1][i], sizeof(float)) == 0) continue;
                    if (first == q_n) first = i;
                    n_diff++;
                    const double d = fabs((double)got[0][i] - got[1][i]);
                    if (!(d <= worst)) worst = d; /* NaN too */
                }
                char what[160];
                snprintf(what, sizeof what,
                         "D %d, heads %d/%d, T %d after %d, pages of %d: %d split%s%s, "
                         "%d key warp%s, %d-key tiles",
                         s.D, s.H, s.KH, s.T, s.pos0, bs, plan.splits, plan.splits > 1 ? "s" : "",
                         cl ? " (cluster)" : "", kw, kw > 1 ? "s" : "", bn);
                if (n_bad > 0) {
                    print_message("  %-72s %zu of %zu outputs not finite\n", what, n_bad, q_n);
                    bad++;
                } else if (n_diff == 0) {
                    print_message("  %-72s bitwise equal\n", what);
                } else {
                    const size_t tok = first / ((size_t)s.H * s.D);
                    const size_t head = first / s.D % s.H, col = first % s.D;
                    print_message("  %-72s %zu of %zu differ, worst %.3e; first: token %zu head "
                                  "%zu column %zu: %.6g vs %.6g\n",
                                  what, n_diff, q_n, worst, tok, head, col, got[0][first],
                                  got[1][first]);
                    bad++;
                }
            }
    cudaFree(k);
    cudaFree(v);
    cudaFree(q);
    cudaFree(out[0]);
    cudaFree(out[1]);
    cudaFree(partial);
    cudaFree(d_table);
    cudaFree(d_tiles);
    return bad;
}

static void test_engines_agree(void **state) {
    (void)state;
    const shape shapes[] = {
        {9, 3, 64, 20, 100, 16},    /* test_cuda_ops's "chunk after 100" (once 0.27 off) */
        {9, 3, 64, 21, 63, 16},     /* a full tile of SmolLM2's, two key tiles */
        {9, 3, 64, 50, 0, 16},      /* a prefill: single key tiles */
        {9, 3, 64, 4, 252, 16},     /* few rows, five key tiles */
        {9, 3, 64, 1, 300, 16},     /* a decode step */
        {8, 8, 64, 64, 130, 16},    /* no GQA: 64 tokens a tile */
        {32, 8, 128, 20, 100, 16},  /* the same chunk on the 8B heads */
        {32, 8, 128, 30, 1310, 16}, /* the 8B query after k = 50 facts */
        {32, 8, 128, 50, 0, 16},    /* a prefill: single key tiles */
        {32, 8, 128, 4, 252, 16},   /* few rows, five key tiles */
        {32, 8, 128, 1, 1999, 16},  /* a decode step */
        {8, 8, 128, 64, 130, 16},   /* no GQA: 64 tokens a tile */
        {28, 4, 128, 9, 200, 16},   /* a group of 7 */
        {32, 8, 128, 30, 301, 8},   /* pages of 8 */
        {32, 8, 128, 30, 301, 64},  /* a page a 64-key tile */
        {32, 8, 128, 7, 330, 128},  /* pages of 128: a wide tile a page */
        {9, 3, 64, 20, 100, 4},     /* pages of 4 */
    };
    int bad = 0;
    for (const shape &s : shapes) bad += check_shape(s);
    assert_int_equal(bad, 0);
}

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    if (!cuda_flash_wgmma_supports(128)) {
        printf("this GPU runs no sm_90a code (no wgmma engine): skipped\n");
        return 77;
    }
    cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_engines_agree)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

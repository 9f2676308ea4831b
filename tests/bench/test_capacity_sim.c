/*
 * The capacity model's simulator against cases with a closed form:
 *   - an LRU stack under uniform popularity: a tier holding C of U blocks
 *     serves C/U of the requests (every stack position is equally likely),
 *     on one node and spread over four by the user hash;
 *   - the engine queue with Poisson arrivals and a fixed engine time
 *     (M/D/1): the mean wait rho * S / (2 (1 - rho)) (Pollaczek-Khinchine),
 *     the utilisation rho, and Little's law: the number in the queue that
 *     arrivals see (Poisson arrivals see time averages) equals the arrival
 *     rate times the mean time in it;
 *   - a closed loop of clients without think time: throughput
 *     min(N / TTFT, 1 / S), and TTFT N / throughput when saturated;
 *   - the TTFT of a request from a tier: hot TTFT + block bytes / speed,
 *     and of an encoded one: hot TTFT + tokens * prefill time.
 * Fixed seeds; tolerances several standard errors wide.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>

#include "capacity_sim.h"

static cap_params base(void) {
    cap_params p = cap_default_params();
    p.hot_ms0 = 9;
    p.hot_us_per_token = 0;
    p.engine_ms = 4;
    p.prefill_us_per_token = 50;
    p.seed = 7;
    return p;
}

static cap_result run(const cap_params *p) {
    cap_result r;
    char err[256] = "";
    int rc = cap_simulate(p, &r, err, sizeof err);
    if (rc != 0) fprintf(stderr, "cap_simulate: %s\n", err);
    assert_int_equal(rc, 0);
    return r;
}

/* One block per user of one byte: tier sizes in bytes are sizes in blocks. */
static cap_params uniform_lru(int32_t nodes) {
    cap_params p = base();
    p.users = 20000;
    p.zipf = 0;
    p.facts_per_user = p.k = 1;
    p.tokens_per_fact = 1;
    p.kv_bytes_per_token = 1;
    p.nodes = nodes;
    p.gpu_bytes = 2000.0 / nodes;
    p.host_bytes = 4000.0 / nodes;
    p.disk_bytes = 6000.0 / nodes;
    p.host_gbps = p.disk_gbps = 1;
    p.session_len = 1;
    p.load_rps = 10; /* light: the queue plays no part here */
    p.requests = 400000;
    p.warmup = 100000;
    return p;
}

static void check_uniform(const cap_result *r) {
    printf("uniform LRU: gpu %.4f host %.4f disk %.4f encoded %.4f (expected 0.1 0.2 0.3 0.4)\n",
           r->tier_share[CAP_TIER_GPU], r->tier_share[CAP_TIER_HOST], r->tier_share[CAP_TIER_DISK],
           r->tier_share[CAP_TIER_NONE]);
    assert_true(fabs(r->tier_share[CAP_TIER_GPU] - 0.1) < 0.006);
    assert_true(fabs(r->tier_share[CAP_TIER_HOST] - 0.2) < 0.008);
    assert_true(fabs(r->tier_share[CAP_TIER_DISK] - 0.3) < 0.008);
    assert_true(fabs(r->tier_share[CAP_TIER_NONE] - 0.4) < 0.008);
}

static void test_lru_uniform_one_node(void **state) {
    (void)state;
    cap_params p = uniform_lru(1);
    cap_result r = run(&p);
    assert_int_equal(r.blocks_gpu, 2000);
    check_uniform(&r);
}

static void test_lru_uniform_four_nodes(void **state) {
    (void)state;
    cap_params p = uniform_lru(4);
    cap_result r = run(&p);
    assert_int_equal(r.blocks_gpu, 500);
    check_uniform(&r);
}

/* Poisson arrivals (sessions of one request), every block on the GPU. */
static void test_md1_and_little(void **state) {
    (void)state;
    cap_params p = base();
    p.users = 1000;
    p.nodes = 1;
    p.session_len = 1;
    p.engine_ms = 1;
    p.load_rps = 700; /* rho = 0.7 */
    p.gpu_bytes = 1e18;
    p.preload = CAP_TIER_GPU;
    p.requests = 1000000;
    p.warmup = 20000;
    cap_result r = run(&p);
    double rho = 0.7, wq = rho * p.engine_ms / (2 * (1 - rho));
    printf("M/D/1 rho 0.7: wait %.4f ms (closed form %.4f), utilisation %.4f, queue seen %.4f, "
           "lambda * W %.4f\n",
           r.wait_mean_ms, wq, r.util_max, r.queue_seen_mean, r.queue_little);
    assert_true(r.tier_share[CAP_TIER_GPU] == 1.0);
    assert_true(fabs(r.wait_mean_ms / wq - 1) < 0.04);
    assert_true(fabs(r.util_max - rho) < 0.01);
    assert_true(fabs(r.queue_seen_mean / r.queue_little - 1) < 0.03);
    double hot = p.hot_ms0 + cap_request_tokens(&p) * p.hot_us_per_token / 1e3;
    assert_true(fabs(r.ttft_mean_ms - (r.wait_mean_ms + hot)) < 0.01 * hot);
}

static void test_closed_loop(void **state) {
    (void)state;
    cap_params p = base();
    p.users = 1000;
    p.nodes = 1;
    p.gpu_bytes = 1e18;
    p.preload = CAP_TIER_GPU;
    p.think_s = 0;
    p.requests = 200000;
    p.warmup = 2000;
    p.closed_clients = 1;
    cap_result one = run(&p);
    p.closed_clients = 100;
    cap_result many = run(&p);
    printf("closed loop: 1 client %.2f req/s (closed form %.2f); 100 clients %.2f req/s (%.2f), "
           "TTFT %.1f ms (%.1f)\n",
           one.throughput_rps, 1000 / p.hot_ms0, many.throughput_rps, 1000 / p.engine_ms,
           many.ttft_mean_ms, 100 / (1000 / p.engine_ms) * 1000);
    assert_true(fabs(one.throughput_rps / (1000 / p.hot_ms0) - 1) < 0.01);
    assert_true(fabs(many.throughput_rps / (1000 / p.engine_ms) - 1) < 0.01);
    assert_true(fabs(many.ttft_mean_ms / (100 * p.engine_ms) - 1) < 0.01);
}

static void test_tier_and_encode_latency(void **state) {
    (void)state;
    cap_params p = base();
    p.users = 100;
    p.nodes = 1;
    p.closed_clients = 1;
    p.think_s = 0;
    p.requests = 1000;
    p.warmup = 0;
    p.gpu_bytes = 0;
    p.host_bytes = 1e18;
    p.host_gbps = 2;
    p.disk_bytes = 0;
    p.preload = CAP_TIER_HOST;
    cap_result r = run(&p);
    double want = p.hot_ms0 + cap_block_bytes(&p) / (p.host_gbps * 1e6);
    assert_true(r.tier_share[CAP_TIER_HOST] == 1.0);
    assert_true(fabs(r.ttft_p50_ms / want - 1) < 1e-4);
    p.host_bytes = 0;
    p.preload = CAP_TIER_NONE;
    r = run(&p);
    want = p.hot_ms0 + cap_request_tokens(&p) * p.prefill_us_per_token / 1e3;
    assert_true(r.tier_share[CAP_TIER_NONE] == 1.0);
    assert_true(fabs(r.ttft_p50_ms / want - 1) < 1e-4);
}

static void test_bad_parameters(void **state) {
    (void)state;
    cap_params p = base();
    p.engine_ms = 0;
    cap_result r;
    char err[256] = "";
    assert_int_equal(cap_simulate(&p, &r, err, sizeof err), -1);
    assert_true(err[0] != '\0');
    p = base();
    p.users = 0;
    assert_int_equal(cap_simulate(&p, &r, err, sizeof err), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lru_uniform_one_node),
        cmocka_unit_test(test_lru_uniform_four_nodes),
        cmocka_unit_test(test_md1_and_little),
        cmocka_unit_test(test_closed_loop),
        cmocka_unit_test(test_tier_and_encode_latency),
        cmocka_unit_test(test_bad_parameters),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * capacity_sim: a discrete-event model of a fleet of serving nodes with
 * per-user memory, for capacity planning (bench/capacity_model.c prints
 * its tables; tests/bench/test_capacity_sim.c checks it against closed
 * forms).
 *
 * What it models:
 *   - Users with Zipf(s) activity. Sessions start as a Poisson process
 *     (rate load / session_len over the fleet), each of a geometric number
 *     of requests (mean session_len), a think time (exponential, mean
 *     think_s) after each answer. Closed mode instead: closed_clients users
 *     that never stop, as a load test drives a server.
 *   - Routing by user: a user's requests all go to one node (a hash of the
 *     user, as a consistent-hash load balancer does).
 *   - Memory: each user's facts_per_user facts are split into blocks of k
 *     facts; a request retrieves one block, chosen uniformly (top-k of
 *     different queries picks different facts). A block's KV lives on its
 *     user's node in one tier: the GPU fact cache, the pinned host tier,
 *     local disk, or nowhere (then it is encoded on demand, on the GPU).
 *     The tiers form one LRU stack: a used block goes to the top of the GPU
 *     tier, the GPU's least recent block moves down to the host tier, the
 *     host's to disk, the disk's is dropped (it is only a cache: the facts'
 *     text stays in the shared store).
 *   - Time: a node's engine is one FIFO server of engine time (engine_ms a
 *     request, plus the prefill of an encoded block). A request's TTFT is
 *     max(queue wait, tier read) + hot TTFT(memory tokens) + encode time:
 *     a tier read starts when retrieval names the facts, so it overlaps
 *     the wait; an encode is prefill work on the engine.
 *
 * Not modelled: PCIe and disk contention between requests, decode steps,
 * partial blocks, writes to the tiers, node failures.
 */
#ifndef IS_BENCH_CAPACITY_SIM_H
#define IS_BENCH_CAPACITY_SIM_H

#include <stdint.h>

typedef enum cap_tier {
    CAP_TIER_GPU = 0,
    CAP_TIER_HOST = 1,
    CAP_TIER_DISK = 2,
    CAP_TIER_NONE = 3, /* not cached on the node: encoded on demand */
} cap_tier;

typedef struct cap_params {
    /* population and load */
    int64_t users;          /* > 0 */
    double zipf;            /* activity exponent (0: uniform) */
    double load_rps;        /* requests/s over the fleet (open mode) */
    double session_len;     /* mean requests per session (>= 1) */
    double think_s;         /* mean think time after an answer (0: none) */
    int32_t closed_clients; /* > 0: closed mode with that many users, load_rps unused */
    /* memory */
    int32_t facts_per_user; /* > 0 */
    int32_t k;              /* facts a request retrieves (> 0) */
    double tokens_per_fact; /* > 0 */
    double kv_bytes_per_token;
    /* fleet: each node */
    int32_t nodes;                            /* > 0 */
    double gpu_bytes, host_bytes, disk_bytes; /* tier sizes per node (bytes) */
    double host_gbps, disk_gbps;              /* read speed of a tier into the GPU (1e9 bytes/s) */
    /* engine, calibrated on measured figures (capacity_model.c) */
    double hot_ms0, hot_us_per_token; /* TTFT with the facts on the GPU, nothing queued */
    double engine_ms;                 /* engine time per request (1 / saturated requests/s) */
    double prefill_us_per_token;      /* encode on demand: time per token, latency and engine */
    cap_tier preload;                 /* every block starts in this tier (capacity permitting;
                                 CAP_TIER_NONE: all start uncached) */
    /* run */
    int64_t requests; /* measured requests */
    int64_t warmup;   /* requests simulated before measuring */
    uint64_t seed;
} cap_params;

typedef struct cap_result {
    int64_t measured;
    double tier_share[4]; /* share of measured requests served from each cap_tier */
    double ttft_mean_ms, ttft_p50_ms, ttft_p90_ms, ttft_p99_ms;
    double throughput_rps;      /* measured requests / measured time */
    double util_mean, util_max; /* engine busy share per node */
    /* Little's law on node 0's engine queue: the number of requests in it
     * seen by arriving requests, and the arrival rate times the mean time
     * a request spends in it (wait + engine time). */
    double queue_seen_mean, queue_little;
    double wait_mean_ms;                          /* node 0: mean wait for the engine */
    int32_t blocks_gpu, blocks_host, blocks_disk; /* tier sizes in blocks, per node */
} cap_result;

/* Defaults: the population, memory and fleet of the 1 M-user scenario of
 * BENCHMARKS.md; the engine fields are 0 and must be set (capacity_model.c
 * fits them to the measured figures). */
cap_params cap_default_params(void);

/* Runs the simulation. 0 on success; -1 on bad parameters or out of
 * memory, with a message in err (may be NULL); *r is then unchanged. */
int cap_simulate(const cap_params *p, cap_result *r, char *err, int err_len);

/* Memory tokens a request injects, and the bytes of one block of KV. */
double cap_request_tokens(const cap_params *p);
double cap_block_bytes(const cap_params *p);

#endif

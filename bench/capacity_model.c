/*
 * capacity_model: how many serving nodes a user population needs, and what
 * its users see, from the discrete-event model of bench/capacity_sim.h with
 * its engine calibrated on the measured single-node figures of
 * BENCHMARKS.md ("Served on the GPU, 8B shape").
 *
 *   capacity_model --calibrate       the fit: each measured figure, the
 *                                    model's value, what it calibrates
 *   capacity_model [options]         one row per node count: the share of
 *                                    requests served from each tier, TTFT
 *                                    percentiles, engine utilisation
 *   capacity_model --find-nodes      the fewest nodes meeting --max-util
 *                                    and --p99-ms at --load
 *
 * The measured figures below are copied from BENCHMARKS.md (served over
 * HTTP on one H200, Llama-3.1-8B shape, bf16 KV, one client unless said);
 * they are inputs, not results of this program.
 */
#include "capacity_sim.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KIB        1024.0
#define GIB        1073741824.0
#define TIB        1099511627776.0
#define KV_8B_BF16 (128 * KIB) /* bytes of KV per token, Llama-3.1-8B shape, bf16 */

/* ---- measured figures (BENCHMARKS.md, served on the GPU, 8B shape) ---------------------- */

/* TTFT vs k, served kv, hot (every fact in the GPU cache): memory tokens, p50 ms. The k = 100
 * row had 14 of 200 requests refused (context), so it is shown but not fitted. */
static const double HOT_TOK[] = {195, 748, 1974, 2579};
static const double HOT_MS[] = {6.97, 8.04, 9.44, 10.47};
/* The same requests in prompt mode (the facts prefilled as text), p50 ms. */
static const double PROMPT_MS[] = {17.81, 48.24, 116.61, 161.16};
#define N_FIT 3 /* rows fitted: k = 5, 20, 50 */
/* Throughput at k = 50 (1,974 memory tokens), hot: clients, requests/s, TTFT p50 ms. */
static const int KV_CLIENTS[] = {1, 10, 50, 100};
static const double KV_RPS[] = {104.6, 229.5, 261.2, 258.9};
static const double KV_P50[] = {9.4, 43, 183, 371};
#define PROMPT_RPS_100 8.60
/* Tiered with the vectorised widening (fact KV 7.5x a 0.2 GiB cache): memory tokens, p50. */
static const double TIER_TOK[] = {187, 738};
static const double TIER_MS[] = {22.1, 104.6};
/* Cold start (page cache dropped, nothing resident), k = 50: p50 of the first 30 requests. */
#define COLD_TOK 1974.0
#define COLD_MS  240.9

typedef struct fit {
    double hot_ms0, hot_us_per_token, prefill_us_per_token, engine_ms, host_gbps, disk_gbps;
} fit;

static void line_fit(const double *x, const double *y, int n, double *a, double *b) {
    double mx = 0, my = 0, sxx = 0, sxy = 0;
    for (int i = 0; i < n; i++) {
        mx += x[i] / n;
        my += y[i] / n;
    }
    for (int i = 0; i < n; i++) {
        sxx += (x[i] - mx) * (x[i] - mx);
        sxy += (x[i] - mx) * (y[i] - my);
    }
    *b = sxy / sxx;
    *a = my - *b * mx;
}

static fit calibrate(void) {
    fit f;
    double a, b;
    line_fit(HOT_TOK, HOT_MS, N_FIT, &a, &b);
    f.hot_ms0 = a;
    f.hot_us_per_token = b * 1e3;
    line_fit(HOT_TOK, PROMPT_MS, N_FIT, &a, &b);
    f.prefill_us_per_token = b * 1e3;
    f.engine_ms = 1e3 / KV_RPS[3];
    double bytes = 0, ms = 0;
    for (int i = 0; i < 2; i++) {
        bytes += TIER_TOK[i] * KV_8B_BF16;
        ms += TIER_MS[i] - (f.hot_ms0 + TIER_TOK[i] * f.hot_us_per_token / 1e3);
    }
    f.host_gbps = bytes / ms / 1e6;
    f.disk_gbps =
        COLD_TOK * KV_8B_BF16 / (COLD_MS - (f.hot_ms0 + COLD_TOK * f.hot_us_per_token / 1e3)) / 1e6;
    return f;
}

static void apply_fit(cap_params *p, const fit *f) {
    p->hot_ms0 = f->hot_ms0;
    p->hot_us_per_token = f->hot_us_per_token;
    p->prefill_us_per_token = f->prefill_us_per_token;
    p->engine_ms = f->engine_ms;
}

static cap_result sim_or_die(const cap_params *p) {
    cap_result r;
    char err[256];
    if (cap_simulate(p, &r, err, sizeof err) != 0) {
        fprintf(stderr, "capacity_model: %s\n", err);
        exit(1);
    }
    return r;
}

/* One node, `clients` closed-loop clients, each request `tokens` memory tokens served from
 * `tier` (CAP_TIER_NONE: encoded every time). */
static cap_result one_node(const fit *f, double tokens, int clients, cap_tier tier) {
    cap_params p = cap_default_params();
    apply_fit(&p, f);
    p.users = 1000;
    p.nodes = 1;
    p.facts_per_user = p.k = 10;
    p.tokens_per_fact = tokens / p.k;
    p.kv_bytes_per_token = KV_8B_BF16;
    p.closed_clients = clients;
    p.think_s = 0;
    p.gpu_bytes = tier == CAP_TIER_GPU ? 1e18 : 0;
    p.host_bytes = tier == CAP_TIER_HOST ? 1e18 : 0;
    p.disk_bytes = tier == CAP_TIER_DISK ? 1e18 : 0;
    p.host_gbps = f->host_gbps;
    p.disk_gbps = f->disk_gbps;
    p.preload = tier;
    p.requests = 20000;
    p.warmup = 1000;
    return sim_or_die(&p);
}

static void row(const char *what, double measured, double model, const char *role) {
    printf("| %s | %.2f | %.2f | %+.1f%% | %s |\n", what, measured, model,
           100 * (model / measured - 1), role);
}

static void print_calibration(void) {
    fit f = calibrate();
    printf("Fitted engine: hot TTFT %.3f ms + %.4f us/memory token; prefill (encode on demand) "
           "%.2f us/token; engine time %.3f ms/request; host tier %.2f GB/s; disk %.2f GB/s\n\n",
           f.hot_ms0, f.hot_us_per_token, f.prefill_us_per_token, f.engine_ms, f.host_gbps,
           f.disk_gbps);
    printf(
        "| figure (BENCHMARKS.md, served, 8B shape, H200) | measured | model | model vs measured "
        "| role |\n|---|---:|---:|---:|---|\n");
    char w[160];
    for (int i = 0; i < 4; i++) {
        snprintf(w, sizeof w, "kv TTFT p50 ms, hot, %.0f memory tokens", HOT_TOK[i]);
        row(w, HOT_MS[i], one_node(&f, HOT_TOK[i], 1, CAP_TIER_GPU).ttft_p50_ms,
            i < N_FIT ? "fits hot TTFT (least squares, k = 5, 20, 50)" : "check (row not clean)");
    }
    for (int i = 0; i < 4; i++) {
        snprintf(w, sizeof w, "prompt TTFT p50 ms, %.0f tokens -> model: encoded on demand",
                 HOT_TOK[i]);
        row(w, PROMPT_MS[i], one_node(&f, HOT_TOK[i], 1, CAP_TIER_NONE).ttft_p50_ms,
            i < N_FIT ? "fits prefill us/token (slope, k = 5, 20, 50)" : "check (row not clean)");
    }
    for (int i = 0; i < 4; i++) {
        cap_result r = one_node(&f, 1974, KV_CLIENTS[i], CAP_TIER_GPU);
        snprintf(w, sizeof w, "kv req/s, k = 50, %d clients", KV_CLIENTS[i]);
        row(w, KV_RPS[i], r.throughput_rps, i == 3 ? "fits engine time per request" : "check");
        snprintf(w, sizeof w, "kv TTFT p50 ms, k = 50, %d clients", KV_CLIENTS[i]);
        row(w, KV_P50[i], r.ttft_p50_ms, "check");
    }
    row("prompt req/s, k = 50, 100 clients -> model: encoded on demand", PROMPT_RPS_100,
        one_node(&f, 1974, 100, CAP_TIER_NONE).throughput_rps, "check");
    for (int i = 0; i < 2; i++) {
        snprintf(w, sizeof w, "kv TTFT p50 ms, tiered, %.0f memory tokens -> model: all from host",
                 TIER_TOK[i]);
        row(w, TIER_MS[i], one_node(&f, TIER_TOK[i], 1, CAP_TIER_HOST).ttft_p50_ms,
            "fits host tier GB/s (both rows)");
    }
    row("kv TTFT p50 ms, cold start, k = 50 -> model: all from disk", COLD_MS,
        one_node(&f, COLD_TOK, 1, CAP_TIER_DISK).ttft_p50_ms, "fits disk GB/s");
}

/* ---- the fleet ----------------------------------------------------------------------------- */

static void usage(FILE *o) {
    fprintf(
        o, "usage: capacity_model [options]\n"
           "Predicts per-tier hit rates, TTFT percentiles and engine utilisation of a fleet of\n"
           "serving nodes with per-user memory (bench/capacity_sim.h: the model), with the\n"
           "engine calibrated on the measured figures of BENCHMARKS.md.\n\n"
           "  --calibrate            print the fit: each measured figure against the model, exit\n"
           "  --nodes LIST           node counts, comma-separated (default 4,8,16,32)\n"
           "  --find-nodes           the fewest nodes meeting --max-util and --p99-ms at --load\n"
           "  --max-util U           engine utilisation bound of the busiest node (default 0.8)\n"
           "  --p99-ms MS            TTFT p99 bound (default 250)\n"
           "population and load:\n"
           "  --users N              users (default 1000000)\n"
           "  --zipf S               activity skew, Zipf exponent (default 1.0; 0 uniform)\n"
           "  --load RPS             requests/s over the fleet (default 700)\n"
           "  --session-len N        mean requests per session, geometric (default 10)\n"
           "  --think S              mean seconds between an answer and the next request (default "
           "20)\n"
           "memory:\n"
           "  --facts N              facts per user (default 200)\n"
           "  --tokens-per-fact T    (default 25)\n"
           "  --k K                  facts per request (default 50)\n"
           "  --kv-bytes-per-token B (default 131072: Llama-3.1-8B shape, bf16)\n"
           "each node:\n"
           "  --gpu-gib G            GPU fact cache (default 77.8, the served default on an H200)\n"
           "  --host-gib H           pinned host tier (default 256)\n"
           "  --disk-tib D           local disk tier (default 3.5)\n"
           "  --host-gbps X          host tier read speed, GB/s (default: calibrated)\n"
           "  --disk-gbps X          disk tier read speed, GB/s (default: calibrated)\n"
           "run:\n"
           "  --requests N           measured requests a run (default 4000000)\n"
           "  --warmup N             requests before measuring, so the tiers are full (default "
           "16000000)\n"
           "  --seed S               (default 1)\n"
           "  --csv FILE             also write the rows as CSV\n"
           "  -h, --help             this text\n");
}

static bool parse_double(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

typedef struct row_out {
    int32_t nodes;
    cap_result r;
} row_out;

static void print_header(void) {
    printf("| nodes | GPU hit | host | disk | encoded | TTFT p50 ms | p90 | p99 | engine util mean "
           "| max |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
}

/* A TTFT cell. Past a minute it is a queue that grows for as long as the run lasts (an
 * engine busier than its capacity), not a figure. */
static const char *ms_cell(double ms, char buf[32]) {
    if (ms > 60000) snprintf(buf, 32, "> 60 s");
    else snprintf(buf, 32, "%.1f", ms);
    return buf;
}

static void print_row(const row_out *o) {
    const cap_result *r = &o->r;
    char a[32], b[32], c[32];
    printf("| %d | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %s | %s | %s | %.2f | %.2f%s |\n", o->nodes,
           100 * r->tier_share[0], 100 * r->tier_share[1], 100 * r->tier_share[2],
           100 * r->tier_share[3], ms_cell(r->ttft_p50_ms, a), ms_cell(r->ttft_p90_ms, b),
           ms_cell(r->ttft_p99_ms, c), r->util_mean, r->util_max,
           r->util_max >= 1 ? " (overloaded)" : "");
    fflush(stdout);
}

static void csv_row(FILE *f, const row_out *o) {
    if (!f) return;
    const cap_result *r = &o->r;
    fprintf(f, "%d,%.5f,%.5f,%.5f,%.5f,%.3f,%.3f,%.3f,%.4f,%.4f\n", o->nodes, r->tier_share[0],
            r->tier_share[1], r->tier_share[2], r->tier_share[3], r->ttft_p50_ms, r->ttft_p90_ms,
            r->ttft_p99_ms, r->util_mean, r->util_max);
}

int main(int argc, char **argv) {
    fit f = calibrate();
    cap_params p = cap_default_params();
    apply_fit(&p, &f);
    p.host_gbps = f.host_gbps;
    p.disk_gbps = f.disk_gbps;
    const char *nodes_list = "4,8,16,32", *csv = NULL;
    bool find = false;
    double max_util = 0.8, p99_ms = 250;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--calibrate")) {
            print_calibration();
            return 0;
        }
        if (!strcmp(a, "--find-nodes")) {
            find = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "capacity_model: unknown option or missing value: %s (see --help)\n",
                    a);
            return 2;
        }
        const char *v = argv[++i];
        double d;
        bool ok = true;
        if (!strcmp(a, "--nodes")) nodes_list = v;
        else if (!strcmp(a, "--csv")) csv = v;
        else if (!(ok = parse_double(v, &d)))
            ;
        else if (!strcmp(a, "--max-util")) max_util = d;
        else if (!strcmp(a, "--p99-ms")) p99_ms = d;
        else if (!strcmp(a, "--users")) p.users = (int64_t)d;
        else if (!strcmp(a, "--zipf")) p.zipf = d;
        else if (!strcmp(a, "--load")) p.load_rps = d;
        else if (!strcmp(a, "--session-len")) p.session_len = d;
        else if (!strcmp(a, "--think")) p.think_s = d;
        else if (!strcmp(a, "--facts")) p.facts_per_user = (int32_t)d;
        else if (!strcmp(a, "--tokens-per-fact")) p.tokens_per_fact = d;
        else if (!strcmp(a, "--k")) p.k = (int32_t)d;
        else if (!strcmp(a, "--kv-bytes-per-token")) p.kv_bytes_per_token = d;
        else if (!strcmp(a, "--gpu-gib")) p.gpu_bytes = d * GIB;
        else if (!strcmp(a, "--host-gib")) p.host_bytes = d * GIB;
        else if (!strcmp(a, "--disk-tib")) p.disk_bytes = d * TIB;
        else if (!strcmp(a, "--host-gbps")) p.host_gbps = d;
        else if (!strcmp(a, "--disk-gbps")) p.disk_gbps = d;
        else if (!strcmp(a, "--requests")) p.requests = (int64_t)d;
        else if (!strcmp(a, "--warmup")) p.warmup = (int64_t)d;
        else if (!strcmp(a, "--seed")) p.seed = (uint64_t)d;
        else {
            fprintf(stderr, "capacity_model: unknown option %s (see --help)\n", a);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "capacity_model: %s: not a number: %s\n", a, v);
            return 2;
        }
    }
    FILE *cf = NULL;
    if (csv && !(cf = fopen(csv, "w"))) {
        fprintf(stderr, "capacity_model: cannot write %s\n", csv);
        return 1;
    }
    if (cf)
        fprintf(cf, "nodes,gpu_hit,host_hit,disk_hit,encoded,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,"
                    "util_mean,util_max\n");
    double bb = cap_block_bytes(&p);
    printf(
        "%lld users, Zipf %.2f, %.0f requests/s, sessions of %.1f requests %.0f s apart; %d facts "
        "of %.0f tokens a user, k = %d (%.0f MiB of KV a request, %.1f TiB in all); a node: GPU "
        "cache %.1f GiB, host %.0f GiB at %.2f GB/s, disk %.2f TiB at %.2f GB/s\n\n",
        (long long)p.users, p.zipf, p.load_rps, p.session_len, p.think_s, p.facts_per_user,
        p.tokens_per_fact, p.k, bb / (1024 * KIB),
        (double)p.users * p.facts_per_user * p.tokens_per_fact * p.kv_bytes_per_token / TIB,
        p.gpu_bytes / GIB, p.host_bytes / GIB, p.host_gbps, p.disk_bytes / TIB, p.disk_gbps);
    print_header();
    if (find) {
        /* Doubling, then bisection between the last failing and the first passing count. */
        int32_t lo = 0, hi = 1;
        for (;;) {
            p.nodes = hi;
            row_out o = {hi, sim_or_die(&p)};
            print_row(&o);
            csv_row(cf, &o);
            if (o.r.util_max <= max_util && o.r.ttft_p99_ms <= p99_ms) break;
            lo = hi;
            hi *= 2;
            if (hi > 4096) {
                fprintf(stderr, "capacity_model: no node count up to 4096 meets the bounds\n");
                return 1;
            }
        }
        while (hi - lo > 1) {
            int32_t mid = (lo + hi) / 2;
            p.nodes = mid;
            row_out o = {mid, sim_or_die(&p)};
            print_row(&o);
            csv_row(cf, &o);
            if (o.r.util_max <= max_util && o.r.ttft_p99_ms <= p99_ms) hi = mid;
            else lo = mid;
        }
        printf(
            "\nnodes needed at %.0f requests/s (busiest engine <= %.2f, TTFT p99 <= %.0f ms): %d\n",
            p.load_rps, max_util, p99_ms, hi);
    } else {
        const char *s = nodes_list;
        while (*s) {
            char *end;
            long n = strtol(s, &end, 10);
            if (end == s || n <= 0 || n > 100000 || (*end && *end != ',')) {
                fprintf(stderr, "capacity_model: bad --nodes list: %s\n", nodes_list);
                return 2;
            }
            p.nodes = (int32_t)n;
            row_out o = {(int32_t)n, sim_or_die(&p)};
            print_row(&o);
            csv_row(cf, &o);
            s = *end ? end + 1 : end;
        }
    }
    if (cf) fclose(cf);
    return 0;
}

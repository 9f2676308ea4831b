/*
 * bench_gpu: TTFT vs the number of memory facts k in the `prompt` and `kv`
 * modes, and throughput vs concurrent users, on any model (the speed work
 * uses a random-weight Llama-3.1-8B-shaped GGUF; latency does not depend on
 * weight values), for one or several configurations of the backend in the
 * same process, so "before" and "after" are measured side by side.
 *
 *   bench_gpu -m MODEL [-b cuda|cpu] [-k 5,10,20,50,100] [-u 1,10,50,100]
 *             [-U USERS_FOR_LEGACY] [-K 50] [-r REPS] [-c CONFIGS] [-t CONFIGS] [-A ARENA_GB]
 *             [-P 60] [-F 25] [-Q 30] [-o CSV] [-p] [-L] [-i] [-g GAP_MS] [-O OPTIONS]
 *             [-a 1,8,32,64]
 *
 * Layout (DESIGN.md): a serving prefix of P tokens (60), k facts of
 * F tokens (25), a query of Q tokens (30); token ids and the facts' KV are
 * random (the facts' KV stands for records encoded earlier).
 *   prompt: fork the cached prefix, prefill the k*F fact tokens + the query;
 *   kv:     fork the cached prefix, inject the k facts' stored KV (chunked
 *           RoPE + scatter), prefill the query;
 *   kv cold: the same with facts never seen (the GPU arena misses and fills
 *           from f32 values in ordinary host memory);
 *   kv tier (-H): facts never seen whose records (bf16) lie in pinned host
 *           memory, prefetched (engine_fact_prefetch: the copy to the GPU
 *           starts) before the fork and injected with no values, as the
 *           server's pinned host tier serves a miss; the column the served
 *           "tiered" rows are the served counterpart of.
 * TTFT runs from the fork to the first token chosen (greedy, on the
 * backend: engine_decode_greedy; with +hostargmax, as it was
 * first measured, from the logits brought to the host). Medians of REPS runs
 * after one warm-up; each kind of request (prompt, kv, kv cold) in a loop
 * of its own (-i: one of each a round, as first measured, when a kv
 * request followed the k-fact prompt prefill and the power cap that heavy
 * prefill left; -g: each request after GAP_MS of an idle GPU, as on a
 * server below saturation). The kv TTFT comes from runs as served; its
 * breakdown (fork, inject, prefill) from runs that wait for the injection
 * before the prefill, made alongside (the kv TTFT would otherwise
 * include that wait). Under each table, the kv TTFT's growth from the
 * smallest k to the largest, from the medians themselves (the table's two
 * decimals leave ~0.2 points of it uncertain).
 *
 * Throughput at k = K (50): U users, each with its own K facts (ids unique
 * per user; their contents drawn from a pool of host records), one batch:
 * every user's sequence is forked from the prefix, kv mode injects each
 * user's facts, then ONE engine_decode prefills every user's suffix (facts +
 * query in prompt mode, the query in kv mode) with continuous-batching
 * style mixed sequences; requests/s = U / wall time of the batch, median of
 * up to 3 runs (kv after an untimed run that fills the arena).
 *
 * Admission (-a U,...; run_admission): U kv requests admitted in one step
 * at k = K, fork + injection, one engine_inject_ids call a request against
 * one engine_inject_batch call for all (how the scheduler admits them).
 *
 * Configurations (-c for TTFT, -t for throughput; cuda only):
 *   legacy  the plainest configuration, as the backend was first built
 *           (CUDA_OPTIONS_PLAINEST: f32 KV, per-(token, head) attention,
 *           facts uploaded per layer, a product per weight on cuBLAS);
 *   bf16x2  the current backend in its serving configuration (bf16 KV cache,
 *           tiled attention, one-launch injection from the GPU arena),
 *           matmul inputs split hi + lo (the default precision);
 *   bf16    the same with matmul inputs in bf16 (the precision PyTorch's
 *           bf16 models run at).
 * A configuration may carry modifiers, each one option of cuda/options.h
 * off: "+noskinny" (skinny), "+unstacked" (stacked), "+nocluster"
 * (clusters), "+nopdl" (pdl), "+nowgmma" (wgmma), "+mmasync" (flash_wgmma),
 * "+narrow" (wide); "+hostargmax" (any backend) brings every request's
 * logits to the host and takes the argmax there instead of
 * engine_decode_greedy; "+r2", "+r3", ... name a repeat. Each configuration
 * starts from the options the backend was created with (IS_CUDA_OPTIONS) and -O's
 * list, e.g. -O pdl=off -c bf16,bf16+nowgmma.

 * -L (cuda, built with CUPTI): after each configuration's TTFT runs, the
 * kernels of one warm kv request per k as served, from CUPTI's records
 * (run_timeline): span, idle time, each kind of kernel's time, and the
 * difference between the largest and smallest k.

 * Logits of the first configuration's kv and prompt runs at the largest k
 * are kept, and every later configuration prints its relative error and
 * argmax agreement against them (same inputs, same weights).
 */
#include "backend/backend.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "kv/fact_record.h"
#include "model/model.h"
#ifdef IS_HAVE_CUDA
#include "backend_cuda.h"
#endif
#include "bench_util.h"
#ifdef IS_HAVE_CUPTI
#include "bench_timeline.h"
#endif

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t g_rng = 88172645463325252ull;
static uint64_t rng_next(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static int parse_list(const char *s, int *out, int max) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    int n = 0;
    for (char *t = strtok(buf, ","); t && n < max; t = strtok(NULL, ",")) out[n++] = atoi(t);
    return n;
}

static void die(const char *what) {
    fprintf(stderr, "bench_gpu: %s: %s\n", what, is_error_last());
    exit(1);
}

#define CHECK(call, what)                                                                          \
    do {                                                                                           \
        if ((call) != IS_OK) die(what);                                                            \
    } while (0)

typedef struct bench {
    backend *be;
    const char *be_name;
    model *m;
    engine *e;
    int32_t P, F, Q, V;
    int32_t *prefix; /* [P] */
    int32_t prefix_seq;
    int32_t n_pool;           /* distinct host records */
    float **pool_k, **pool_v; /* [n_pool] -> [n_layers][F][kv_dim] */
    int32_t *fact_tokens;     /* [F] (the same for every fact: only the KV matters) */
    float *logits;            /* [n_vocab] */
    int32_t *tok, *seq;       /* batch scratch */
    float mem_temp, mem_mass; /* -M: engine_params' memory scaling */
    int32_t recompute;        /* -R: first tokens of every fact recomputed in the query's forward */
    float blend;              /* -B: CacheBlend share of the memory recomputed after injection */
    int32_t *rw;              /* [cap] engine_batch.rewrite of the -R prefill */
    bool no_sync;             /* no sync between inject and prefill (profiling the GPU alone) */
    bool tier;                /* -H: the kv tier column */
    void **tier_rec;          /* -H: [n_pool] -> k then v, bf16, pinned (backend host_alloc) */
    uint64_t tier_base;       /* -H: the next never-seen fact id */
    int32_t cap;
    /* -L: where set, one_request notes the host's progress on this clock
     * (ns): its call, the fork, the injection's return, the forward's return
     * (the token, or the logits, on the host), the token chosen. */
    uint64_t (*clock_ns)(void);
    uint64_t mark[5];
    bool interleave;  /* -i: TTFT runs take one request of each kind a round */
    bool logits_out;  /* requests bring their logits to the host (see one_request) */
    bool host_argmax; /* +hostargmax: every request does */
    double gap_ms;    /* -g: the GPU left idle this long before each request */
} bench;

static void bench_mark(bench *b, int i) {
    if (b->clock_ns) b->mark[i] = b->clock_ns();
}

static void bench_backend_check(bench *b, const char *what) {
#ifdef IS_HAVE_CUDA
    if (strcmp(b->be_name, "cuda") == 0 && backend_cuda_check(b->be) != IS_OK) die(what);
#else
    (void)b;
    (void)what;
#endif
}

static void batch_reserve(bench *b, int32_t n) {
    if (n <= b->cap) return;
    b->tok = realloc(b->tok, (size_t)n * sizeof *b->tok);
    b->seq = realloc(b->seq, (size_t)n * sizeof *b->seq);
    b->rw = realloc(b->rw, (size_t)n * sizeof *b->rw);
    if (!b->tok || !b->seq || !b->rw) {
        fprintf(stderr, "bench_gpu: out of memory\n");
        exit(1);
    }
    b->cap = n;
}

static void random_tokens(bench *b, int32_t *t, int32_t n) {
    for (int32_t i = 0; i < n; i++) t[i] = (int32_t)(rng_next() % (uint64_t)(b->V - 1));
}

/* The requests' tokens, the same for every configuration: the facts of the
 * largest k (*k_max), then the query; a request of k facts starts (k_max -
 * k) facts in. The caller frees them. */
static int32_t *request_tokens(bench *b, const int *ks, int n_k, int32_t *k_max) {
    *k_max = 0;
    for (int i = 0; i < n_k; i++)
        if (ks[i] > *k_max) *k_max = ks[i];
    int32_t *t = malloc((size_t)(*k_max * b->F + b->Q) * sizeof *t);
    if (!t) {
        fprintf(stderr, "bench_gpu: out of memory\n");
        exit(1);
    }
    g_rng = 0x9E3779B97F4A7C15ull;
    random_tokens(b, t, *k_max * b->F + b->Q);
    return t;
}

/* Creates the engine and the cached serving prefix. */
static void bench_engine(bench *b, int32_t max_seqs, int32_t max_tokens_per_seq,
                         int32_t total_tokens) {
    engine_params ep = engine_default_params();
    ep.n_ctx = max_tokens_per_seq;
    ep.max_seqs = max_seqs;
    ep.block_size = 16;
    ep.max_batch = 4096;
    ep.n_blocks = total_tokens / ep.block_size + 2 * max_seqs + 16;
    ep.mem_temp = b->mem_temp;
    ep.mem_mass = b->mem_mass;
    CHECK(engine_create(b->m, ep, &b->e), "engine_create");
    CHECK(engine_seq_open(b->e, &b->prefix_seq), "seq_open");
    batch_reserve(b, b->P);
    for (int32_t i = 0; i < b->P; i++) b->seq[i] = b->prefix_seq;
    engine_batch eb = {.n_tokens = b->P, .tokens = b->prefix, .seq = b->seq};
    CHECK(engine_decode(b->e, &eb, b->logits), "prefix prefill");
}

static void fact_list(bench *b, int32_t k, uint64_t id_base, int32_t pool_off, engine_fact *f,
                      uint64_t *ids) {
    for (int32_t i = 0; i < k; i++) {
        int32_t p = (pool_off + i) % b->n_pool;
        f[i] = (engine_fact){b->F, b->fact_tokens, b->pool_k[p], b->pool_v[p]};
        ids[i] = id_base + (uint64_t)i;
    }
}

typedef struct ttft_parts {
    double total, fork, inject, prefill;
} ttft_parts;

/* One request; mode 0 prompt, 1 kv. The first token chosen greedily on
 * the backend (engine_decode_greedy), as a server serves a greedy request;
 * with b->logits_out (the logits comparisons, and +hostargmax) from its
 * logits in b->logits, brought to the host. */
static ttft_parts one_request(bench *b, int mode, int32_t k, uint64_t id_base, int32_t pool_off,
                              const int32_t *suffix) {
    ttft_parts t = {0};
    engine_fact *f = malloc((size_t)(k > 0 ? k : 1) * sizeof *f);
    uint64_t *ids = malloc((size_t)(k > 0 ? k : 1) * sizeof *ids);
    fact_list(b, k, id_base, pool_off, f, ids);
    /* -R: the first m tokens of every fact go first in the kv prefill. */
    const int32_t m =
        mode >= 1 && b->recompute > 0 ? (b->recompute < b->F ? b->recompute : b->F) : 0;
    const int32_t n = mode == 0 ? k * b->F + b->Q : k * m + b->Q;
    const int32_t *toks = mode == 0 ? suffix : suffix + k * b->F;
    /* -g: requests that find the GPU idle for a while, as on a server that
     * is not saturated (back to back, the board runs at its power cap). The
     * host spins, so that its own clock does not drop meanwhile. */
    if (b->gap_ms > 0) {
        b->be->ops->sync(b->be);
        for (const double until = bench_now_ms() + b->gap_ms; bench_now_ms() < until;) {}
    }
    double t0 = bench_now_ms();
    bench_mark(b, 0);
    if (mode == 2) { /* the host tier: copies started, as the server does at submit */
        const size_t half = (size_t)b->m->cfg.n_layers * b->F * b->m->cfg.n_kv_heads *
                            b->m->cfg.head_dim * sizeof(uint16_t);
        for (int32_t i = 0; i < k; i++) {
            const char *rec = b->tier_rec[(pool_off + i) % b->n_pool];
            if (!engine_fact_prefetch(b->e, ids[i], b->F, KV_DTYPE_BF16, rec, rec + half))
                die("host tier prefetch refused (-A: a larger arena)");
            f[i].k = f[i].v = NULL;
        }
    }
    int32_t s;
    CHECK(engine_seq_open(b->e, &s), "seq_open");
    CHECK(engine_seq_fork(b->e, s, b->prefix_seq, b->P), "fork");
    double t1 = bench_now_ms(), t2 = t1;
    bench_mark(b, 1);
    if (mode >= 1) {
        CHECK(engine_inject_ids(b->e, s, f, ids, k), "inject");
        if (mode == 2)
            for (int32_t i = 0; i < k; i++) engine_fact_unpin(b->e, ids[i]);
        if (b->blend > 0 && m > 0) /* -B with -R: the blend apart, before the prefill */
            CHECK(engine_recompute_blend(b->e, s, f, k, b->blend, NULL, NULL), "blend");
        if (!b->no_sync) b->be->ops->sync(b->be); /* for the breakdown only */
        t2 = bench_now_ms();
    }
    bench_mark(b, 2);
    batch_reserve(b, n);
    for (int32_t i = 0; i < n; i++) b->seq[i] = s;
    engine_batch eb = {.n_tokens = n, .tokens = toks, .seq = b->seq};
    if (m > 0) {
        int32_t mb, me, nr = 0;
        engine_seq_memory(b->e, s, &mb, &me);
        for (int32_t i = 0; i < k; i++)
            for (int32_t j = 0; j < m; j++) {
                b->rw[nr] = mb + i * b->F + j;
                b->tok[nr++] = b->fact_tokens[j];
            }
        for (int32_t i = 0; i < b->Q; i++) {
            b->rw[nr + i] = -1;
            b->tok[nr + i] = toks[i];
        }
        eb.tokens = b->tok;
        eb.rewrite = b->rw;
    }
    engine_blend bl = {f, k, b->blend, NULL, NULL};
    if (mode >= 1 && b->blend > 0 && m == 0) eb.blend = &bl; /* -B: fused into the prefill */
    int32_t first;
    if (b->logits_out) {
        CHECK(engine_decode(b->e, &eb, b->logits), "prefill");
        bench_mark(b, 3);
        first = sampler_argmax(b->logits, b->V);
    } else {
        CHECK(engine_decode_greedy(b->e, &eb, &first), "prefill");
        bench_mark(b, 3);
    }
    (void)first;
    double t3 = bench_now_ms();
    bench_mark(b, 4);
    engine_seq_close(b->e, s);
    bench_backend_check(b, "request");
    t.total = t3 - t0;
    t.fork = t1 - t0;
    t.inject = t2 - t1;
    t.prefill = t3 - t2;
    free(f);
    free(ids);
    return t;
}

typedef struct ref_logits {
    bool have;
    float *prompt, *kv;
} ref_logits;

static void compare_ref(const char *what, const float *a, const float *ref, int32_t V) {
    double num = 0, den = 0;
    for (int32_t i = 0; i < V; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    printf("  %s: rel err %.3e vs the first configuration, argmax %s\n", what, sqrt(num / den),
           sampler_argmax(a, V) == sampler_argmax(ref, V) ? "same" : "DIFFERENT");
}

/* Returns the number of rows written to csv. */
static void run_ttft(bench *b, const char *cfg, const int *ks, int n_k, int reps, bool cold,
                     FILE *csv, ref_logits *ref) {
    int32_t k_max;
    int32_t *suffix = request_tokens(b, ks, n_k, &k_max);
    printf("\n### TTFT, %s (%s), medians of %d runs, ms\n\n", cfg, b->be_name, reps);
    printf("| k | prompt tokens | prompt TTFT | kv TTFT | kv: fork | inject | prefill |%s prompt / "
           "kv |%s\n",
           cold ? " kv cold TTFT |" : "", b->tier ? " kv tier TTFT |" : "");
    printf("|---:|---:|---:|---:|---:|---:|---:|%s---:|%s\n", cold ? "---:|" : "",
           b->tier ? "---:|" : "");
    double *pr = malloc(sizeof(double) * reps), *kv = malloc(sizeof(double) * reps);
    double *fo = malloc(sizeof(double) * reps), *in = malloc(sizeof(double) * reps);
    double *pf = malloc(sizeof(double) * reps), *kc = malloc(sizeof(double) * reps);
    double *kt = malloc(sizeof(double) * reps);
    static uint64_t cold_base = 1ull << 40;
    int32_t k_lo = 0, k_hi = 0; /* the smallest and largest k, and their kv TTFT */
    double kv_lo = NAN, kv_hi = NAN;
    for (int ki = 0; ki < n_k; ki++) {
        const int32_t k = ks[ki];
        const int32_t *sfx = suffix + (k_max - k) * b->F;
        /* Each kind of request in a loop of its own (a warm-up first), so
         * that a kv request follows kv requests, not a 1,280-token prompt
         * prefill that leaves the board at its power cap; -i: one of each
         * kind a round. */
        const int passes = b->interleave ? 1 : 4;
        for (int pass = 0; pass < passes; pass++) {
            const bool do_p = b->interleave || pass == 0, do_kv = b->interleave || pass == 1;
            const bool do_cold = cold && (b->interleave || pass == 2);
            const bool do_tier = b->tier && (b->interleave || pass == 3);
            for (int r = -1; r < reps; r++) {
                if (do_p) {
                    ttft_parts p = one_request(b, 0, k, 0, 0, sfx);
                    if (r >= 0) pr[r] = p.total;
                }
                const bool held = b->no_sync;
                if (do_kv) {
                    ttft_parts q = one_request(b, 1, k, 1, 0, sfx);
                    b->no_sync = true; /* as served: no wait between inject and prefill */
                    ttft_parts served = one_request(b, 1, k, 1, 0, sfx);
                    b->no_sync = held;
                    if (r >= 0) {
                        kv[r] = served.total;
                        fo[r] = q.fork;
                        in[r] = q.inject;
                        pf[r] = q.prefill;
                    }
                }
                if (do_cold) {
                    b->no_sync = true;
                    ttft_parts c = one_request(b, 1, k, cold_base, 0, sfx);
                    b->no_sync = held;
                    cold_base += (uint64_t)k;
                    if (r >= 0) kc[r] = c.total;
                }
                if (do_tier) {
                    b->no_sync = true;
                    ttft_parts c = one_request(b, 2, k, b->tier_base, 0, sfx);
                    b->no_sync = held;
                    b->tier_base += (uint64_t)k;
                    if (r >= 0) kt[r] = c.total;
                }
            }
        }
        if (k == k_max && ref) { /* logits of the last kv run (cold runs inject the same values) */
            b->logits_out = true;
            one_request(b, 0, k, 0, 0, suffix);
            float *pl = malloc((size_t)b->V * sizeof(float));
            memcpy(pl, b->logits, (size_t)b->V * sizeof(float));
            one_request(b, 1, k, 1, 0, suffix);
            b->logits_out = b->host_argmax;
            if (!ref->have) {
                ref->prompt = pl;
                ref->kv = malloc((size_t)b->V * sizeof(float));
                memcpy(ref->kv, b->logits, (size_t)b->V * sizeof(float));
                ref->have = true;
            } else {
                char what[96];
                snprintf(what, sizeof what, "%s, k=%d, prompt-mode logits", cfg, k);
                compare_ref(what, pl, ref->prompt, b->V);
                snprintf(what, sizeof what, "%s, k=%d, kv-mode logits", cfg, k);
                compare_ref(what, b->logits, ref->kv, b->V);
                free(pl);
            }
        }
        double mp = bench_median(pr, reps), mk = bench_median(kv, reps),
               mf = bench_median(fo, reps), mi = bench_median(in, reps),
               mpf = bench_median(pf, reps), mc = cold ? bench_median(kc, reps) : NAN;
        printf("| %d | %d | %.2f | %.2f | %.3f | %.3f | %.2f |", k, k * b->F + b->Q, mp, mk, mf, mi,
               mpf);
        if (cold) printf(" %.2f |", mc);
        printf(" %.1fx |", mp / mk);
        if (b->tier) printf(" %.2f |", bench_median(kt, reps));
        printf("\n");
        fflush(stdout);
        if (csv)
            fprintf(csv, "ttft,%s,%d,%d,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n", cfg, k,
                    k * b->F + b->Q, mp, mk, mf, mi, mpf, mc,
                    b->tier ? bench_median(kt, reps) : NAN);
        if (ki == 0 || k < k_lo) {
            k_lo = k;
            kv_lo = mk;
        }
        if (ki == 0 || k > k_hi) {
            k_hi = k;
            kv_hi = mk;
        }
    }
    if (k_hi > k_lo)
        printf("\nkv TTFT growth from k = %d to %d: %+.2f%% (%.4f -> %.4f ms)\n", k_lo, k_hi,
               100.0 * (kv_hi / kv_lo - 1.0), kv_lo, kv_hi);
    free(pr);
    free(kv);
    free(fo);
    free(in);
    free(pf);
    free(kc);
    free(kt);
    free(suffix);
}

/* One batch of U users; returns wall ms. */
static double one_batch(bench *b, int mode, int32_t U, int32_t K, uint64_t id_base) {
    const int32_t per = mode == 0 ? K * b->F + b->Q : b->Q;
    const int32_t n = U * per;
    batch_reserve(b, n);
    int32_t *seqs = malloc((size_t)U * sizeof *seqs);
    engine_fact *f = malloc((size_t)K * sizeof *f);
    uint64_t *ids = malloc((size_t)K * sizeof *ids);
    int32_t *toks = malloc((size_t)n * sizeof *toks);
    random_tokens(b, toks, n);
    bool *want = calloc((size_t)n, 1);
    for (int32_t u = 0; u < U; u++) want[(size_t)u * per + per - 1] = true;
    float *logits = b->logits_out ? malloc((size_t)U * b->V * sizeof(float)) : NULL;
    int32_t *first = malloc((size_t)U * sizeof *first);
    if (!seqs || !f || !ids || !toks || !want || (b->logits_out && !logits) || !first) {
        fprintf(stderr, "bench_gpu: out of memory\n");
        exit(1);
    }
    double t0 = bench_now_ms();
    for (int32_t u = 0; u < U; u++) {
        CHECK(engine_seq_open(b->e, &seqs[u]), "seq_open");
        CHECK(engine_seq_fork(b->e, seqs[u], b->prefix_seq, b->P), "fork");
        if (mode == 1) {
            fact_list(b, K, id_base + (uint64_t)u * 4096, u * K, f, ids);
            CHECK(engine_inject_ids(b->e, seqs[u], f, ids, K), "inject");
        }
    }
    for (int32_t u = 0; u < U; u++)
        for (int32_t i = 0; i < per; i++) b->seq[(size_t)u * per + i] = seqs[u];
    engine_batch eb = {.n_tokens = n, .tokens = toks, .seq = b->seq, .want_logits = want};
    if (b->logits_out) {
        CHECK(engine_decode(b->e, &eb, logits), "batch prefill");
        for (int32_t u = 0; u < U; u++) (void)sampler_argmax(logits + (size_t)u * b->V, b->V);
    } else { /* every user's first token chosen on the backend (see one_request) */
        CHECK(engine_decode_greedy(b->e, &eb, first), "batch prefill");
    }
    double t1 = bench_now_ms();
    for (int32_t u = 0; u < U; u++) engine_seq_close(b->e, seqs[u]);
    bench_backend_check(b, "batch");
    free(seqs);
    free(f);
    free(ids);
    free(toks);
    free(want);
    free(logits);
    free(first);
    return t1 - t0;
}

static void run_throughput(bench *b, const char *cfg, const int *users, int n_u, int32_t K,
                           FILE *csv) {
    printf("\n### Throughput at k = %d, %s (%s): requests/s (median batch time, ms)\n\n", K, cfg,
           b->be_name);
    printf("| users | prompt req/s | prompt batch ms | kv req/s | kv batch ms | kv / prompt |\n");
    printf("|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < n_u; i++) {
        const int32_t U = users[i];
        double ms[2];
        for (int mode = 1; mode >= 0; mode--) {
            const uint64_t id_base = (uint64_t)1
                                     << 50; /* the same ids every run: the arena warms */
            if (mode == 1 || U <= 10) one_batch(b, mode, U, K, id_base); /* warm-up / fill */
            double t[3], spent = 0;
            int n = 0;
            while (n < 3 && (n == 0 || spent < 4000.0)) {
                t[n] = one_batch(b, mode, U, K, id_base);
                spent += t[n++];
            }
            ms[mode] = bench_median(t, n);
        }
        printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1fx |\n", U, 1e3 * U / ms[0], ms[0],
               1e3 * U / ms[1], ms[1], ms[0] / ms[1]);
        fflush(stdout);
        if (csv)
            fprintf(csv, "throughput,%s,%d,%d,%.4f,%.4f,%.4f,%.4f\n", cfg, K, U, ms[0], ms[1],
                    1e3 * U / ms[0], 1e3 * U / ms[1]);
    }
}

/* -a: one step's admission of U kv requests at k = K facts each, as the
 * scheduler admits them: every request's sequence forked from the prefix,
 * then the facts injected, either with one engine_inject_ids call a
 * request (how admission injected before) or with one engine_inject_batch
 * call for all (one launch on the GPU). Wall ms from the first fork until
 * the injections are done on the device (a sync); the sequences are closed
 * after. Ids are the same every run, so after the warm-up every fact is
 * resident in the GPU arena (the hot case). */
static double one_admission(bench *b, int32_t U, int32_t K, uint64_t id_base, bool batched) {
    int32_t *seqs = malloc((size_t)U * sizeof *seqs);
    engine_fact *f = malloc((size_t)U * K * sizeof *f);
    uint64_t *ids = malloc((size_t)U * K * sizeof *ids);
    engine_inject_seq *q = malloc((size_t)U * sizeof *q);
    if (!seqs || !f || !ids || !q) {
        fprintf(stderr, "bench_gpu: out of memory\n");
        exit(1);
    }
    for (int32_t u = 0; u < U; u++)
        fact_list(b, K, id_base + (uint64_t)u * 4096, u * K, f + (size_t)u * K,
                  ids + (size_t)u * K);
    b->be->ops->sync(b->be);
    double t0 = bench_now_ms();
    for (int32_t u = 0; u < U; u++) {
        CHECK(engine_seq_open(b->e, &seqs[u]), "seq_open");
        CHECK(engine_seq_fork(b->e, seqs[u], b->prefix_seq, b->P), "fork");
        if (!batched)
            CHECK(engine_inject_ids(b->e, seqs[u], f + (size_t)u * K, ids + (size_t)u * K, K),
                  "inject");
        q[u] = (engine_inject_seq){seqs[u], f + (size_t)u * K, ids + (size_t)u * K, K};
    }
    if (batched) CHECK(engine_inject_batch(b->e, q, U, NULL), "inject_batch");
    b->be->ops->sync(b->be);
    double t1 = bench_now_ms();
    for (int32_t u = 0; u < U; u++) engine_seq_close(b->e, seqs[u]);
    bench_backend_check(b, "admission");
    free(seqs);
    free(f);
    free(ids);
    free(q);
    return t1 - t0;
}

static void run_admission(bench *b, const char *cfg, const int *users, int n_u, int32_t K, int reps,
                          FILE *csv) {
    printf("\n### Admission of U requests at k = %d in one step, %s (%s): fork + inject, "
           "median ms of %d\n\n",
           K, cfg, b->be_name, reps);
    printf("| requests | a call each, ms | one call, ms | a call each, us/request | "
           "one call, us/request | each / one |\n");
    printf("|---:|---:|---:|---:|---:|---:|\n");
    const uint64_t id_base = (uint64_t)3 << 50;
    double *t = malloc((size_t)reps * sizeof *t);
    for (int i = 0; i < n_u; i++) {
        const int32_t U = users[i];
        double ms[2];
        for (int batched = 0; batched < 2; batched++) {
            one_admission(b, U, K, id_base, batched); /* warm-up: the arena holds the facts */
            for (int r = 0; r < reps; r++) t[r] = one_admission(b, U, K, id_base, batched);
            ms[batched] = bench_median(t, reps);
        }
        printf("| %d | %.3f | %.3f | %.1f | %.1f | %.2fx |\n", U, ms[0], ms[1], 1e3 * ms[0] / U,
               1e3 * ms[1] / U, ms[0] / ms[1]);
        fflush(stdout);
        if (csv) fprintf(csv, "admission,%s,%d,%d,%.4f,%.4f\n", cfg, K, U, ms[0], ms[1]);
    }
    free(t);
}

#ifdef IS_HAVE_CUDA
/* -p: one request per mode and k with the backend's op profiler on (after
 * the timed runs, so warm): where the GPU time goes, and how much of the
 * GPU's span is idle waiting for launches (span - busy). */
static void run_profile(bench *b, const char *cfg, const int *ks, int n_k) {
    int32_t k_max;
    int32_t *suffix = request_tokens(b, ks, n_k, &k_max);
    printf("\n### Op profile, %s: GPU ms per kind of op (one warm request each)\n\n", cfg);
    printf("| mode | k | wall | GPU span | GPU busy | ops |");
    for (int o = 0; o < CUDA_OP_N; o++) printf(" %s |", cuda_op_kind_name((cuda_op_kind)o));
    printf("\n|---|---:|---:|---:|---:|---:|");
    for (int o = 0; o < CUDA_OP_N; o++) printf("---:|");
    printf("\n");
    for (int ki = 0; ki < n_k; ki++) {
        for (int mode = 1; mode >= 0; mode--) {
            const int32_t k = ks[ki];
            one_request(b, mode, k, 1, 0, suffix + (k_max - k) * b->F); /* warm */
            /* live: as served; held: the GPU alone (see profile_begin). */
            for (int held = 0; held < 2; held++) {
                CHECK(backend_cuda_profile_begin(b->be, held ? 300.0 : 0.0), "profile");
                b->no_sync = held;
                one_request(b, mode, k, 1, 0, suffix + (k_max - k) * b->F);
                b->no_sync = false;
                cuda_op_profile pr;
                CHECK(backend_cuda_profile_end(b->be, &pr), "profile");
                int64_t n_ops = 0;
                for (int o = 0; o < CUDA_OP_N; o++) n_ops += pr.count[o];
                printf("| %s%s | %d | %.2f | %.2f | %.2f | %lld |", mode ? "kv" : "prompt",
                       held ? " (GPU alone)" : "", k, pr.wall_ms, pr.span_ms, pr.busy_ms,
                       (long long)n_ops);
                for (int o = 0; o < CUDA_OP_N; o++) printf(" %.3f |", pr.gpu_ms[o]);
                printf("\n");
            }
        }
    }
    fflush(stdout);
    free(suffix);
}

#ifdef IS_HAVE_CUPTI
/* -L: the kernels of one warm kv request per k as served (no wait between
 * the injection and the prefill), from CUPTI's records, which leave the
 * kernels' overlaps as they are (the op profile, -p, times each op between
 * events instead). Per k: the host's lead (its call to the first record,
 * a kernel, copy or memset) and tail (the last record's end to its
 * return), the request's GPU span from the first record's start to the
 * last one's end, the time no record runs, and each class of
 * kernel's summed duration (overlapping kernels both count), the idle
 * time that ends at a kernel of each kind (a kernel that cannot start at
 * once: a launch, a cluster waiting for free multiprocessors, a copy or a
 * host step before it); then the attention's own duration and what the
 * kernel after it takes from the attention's end to its own end, which
 * holds whatever the attention leaves to its successor; and the longest
 * idle stretches. The last row is the largest k minus the smallest. */
enum { TL_ATTN, TL_PRODUCT, TL_NORM, TL_INJECT, TL_COPY, TL_OTHER, TL_N };
static const char *const tl_names[TL_N] = {"attention", "products", "rmsnorm",
                                           "inject",    "copies",   "other"};

static int tl_class(const char *name) {
    if (!name) return TL_OTHER;
    if (!strncmp(name, "memcpy", 6) || !strcmp(name, "memset")) return TL_COPY;
    if (strstr(name, "flash")) return TL_ATTN;
    if (strstr(name, "gemm") || strstr(name, "skinny") || strstr(name, "nvjet") ||
        strstr(name, "xmma") || strstr(name, "cutlass"))
        return TL_PRODUCT;
    if (strstr(name, "rmsnorm")) return TL_NORM;
    if (strstr(name, "inject")) return TL_INJECT;
    return TL_OTHER;
}

#define TL_GAPS 6
typedef struct tl_row {
    double span, idle, sum[TL_N], attn_mean, after_attn_mean;
    double idle_before[TL_N]; /* idle time ending at a kernel of each kind */
    /* The host's share of the request: from its call to the first record's
     * start, and from the last record's end to its return. */
    double lead, tail;
    /* From the call (us): the fork's return, the injection's (no wait), the
     * forward's, the token chosen; the last record's end; the last DtoH
     * copy (the logits, or the token). */
    double at_fork, at_inject, at_logits, at_token, at_last_end, dtoh;
    int n, n_attn;
    /* The longest stretches with no kernel running: their length, and the
     * kernels before and after them (index in start order, short name). */
    double gap[TL_GAPS];
    int gap_at[TL_GAPS];
    char gap_before[TL_GAPS][40], gap_after[TL_GAPS][40];
} tl_row;

/* The identifier in a mangled name (_Z12flash_kernelI... -> flash_kernel),
 * else the name itself, cut to fit. */
static void tl_short(const char *name, char *out, size_t cap) {
    if (!name) name = "?";
    if (name[0] == '_' && name[1] == 'Z') {
        const char *p = name + 2;
        int len = 0;
        while (*p >= '0' && *p <= '9') len = len * 10 + (*p++ - '0');
        if (len > 0) {
            snprintf(out, cap, "%.*s", len < (int)cap - 1 ? len : (int)cap - 1, p);
            return;
        }
    }
    snprintf(out, cap, "%s", name);
}

/* mode 1: kv, resident facts; 2: the host tier (never-seen facts). */
static uint64_t tl_ids(bench *b, int mode, int32_t k) {
    if (mode != 2) return 1;
    const uint64_t id = b->tier_base;
    b->tier_base += (uint64_t)k;
    return id;
}

static bool tl_request(bench *b, int mode, int32_t k, const int32_t *suffix, tl_row *r) {
    one_request(b, mode, k, tl_ids(b, mode, k), 0, suffix); /* warm */
    if (!timeline_begin()) return false;
    b->no_sync = true;
    b->clock_ns = timeline_now;
    const uint64_t host0 = timeline_now();
    one_request(b, mode, k, tl_ids(b, mode, k), 0, suffix);
    const uint64_t host1 = timeline_now();
    b->clock_ns = NULL;
    b->no_sync = false;
    timeline_record *t = NULL;
    const int n = timeline_end(&t);
    if (n <= 0) {
        free(t);
        return false;
    }
    memset(r, 0, sizeof *r);
    r->n = n;
    uint64_t reach = t[0].start; /* the latest end so far: what lies before it is covered */
    double after = 0.0;
    for (int i = 0; i < n; i++) {
        const double d = (double)(t[i].end - t[i].start) * 1e-3;
        const int c = tl_class(t[i].name);
        r->sum[c] += d;
        if (t[i].start > reach) {
            const double g = (double)(t[i].start - reach) * 1e-3;
            r->idle += g;
            r->idle_before[c] += g;
            int j = TL_GAPS - 1; /* insert into the descending list */
            if (g > r->gap[j]) {
                while (j > 0 && g > r->gap[j - 1]) {
                    r->gap[j] = r->gap[j - 1];
                    r->gap_at[j] = r->gap_at[j - 1];
                    memcpy(r->gap_before[j], r->gap_before[j - 1], sizeof r->gap_before[j]);
                    memcpy(r->gap_after[j], r->gap_after[j - 1], sizeof r->gap_after[j]);
                    j--;
                }
                r->gap[j] = g;
                r->gap_at[j] = i;
                tl_short(i > 0 ? t[i - 1].name : NULL, r->gap_before[j], sizeof r->gap_before[j]);
                tl_short(t[i].name, r->gap_after[j], sizeof r->gap_after[j]);
            }
        }
        if (t[i].end > reach) reach = t[i].end;
        if (c == TL_ATTN) {
            r->n_attn++;
            r->attn_mean += d;
            if (i + 1 < n && t[i + 1].end > t[i].end)
                after += (double)(t[i + 1].end - t[i].end) * 1e-3;
        }
    }
    r->span = (double)(reach - t[0].start) * 1e-3;
    r->lead = ((double)t[0].start - (double)host0) * 1e-3;
    r->tail = ((double)host1 - (double)reach) * 1e-3;
    const double m0 = (double)b->mark[0];
    r->at_fork = ((double)b->mark[1] - m0) * 1e-3;
    r->at_inject = ((double)b->mark[2] - m0) * 1e-3;
    r->at_logits = ((double)b->mark[3] - m0) * 1e-3;
    r->at_token = ((double)b->mark[4] - m0) * 1e-3;
    r->at_last_end = ((double)reach - m0) * 1e-3;
    for (int i = n - 1; i >= 0; i--)
        if (t[i].name && !strcmp(t[i].name, "memcpy DtoH")) {
            r->dtoh = (double)(t[i].end - t[i].start) * 1e-3;
            break;
        }
    if (r->n_attn) {
        r->attn_mean /= r->n_attn;
        r->after_attn_mean = after / r->n_attn;
    }
    free(t);
    return true;
}

static void tl_print(const char *what, const tl_row *r) {
    printf("| %s | %d | %.1f | %.1f | %.1f | %.1f |", what, r->n, r->lead, r->span, r->idle,
           r->tail);
    for (int c = 0; c < TL_N; c++) printf(" %.1f |", r->sum[c]);
    for (int c = 0; c < TL_N; c++) printf(" %.1f |", r->idle_before[c]);
    printf(" %.2f | %.2f |\n", r->attn_mean, r->after_attn_mean);
}

static void run_timeline(bench *b, const char *cfg, const int *ks, int n_k) {
    int32_t k_max;
    int32_t *suffix = request_tokens(b, ks, n_k, &k_max);
    printf("\n### Kernel timeline, %s: one warm kv request as served (CUPTI), us\n\n", cfg);
    printf("| k | records | host lead | GPU span | idle | host tail |");
    for (int c = 0; c < TL_N; c++) printf(" %s |", tl_names[c]);
    for (int c = 0; c < TL_N; c++) printf(" idle before %s |", tl_names[c]);
    printf(" attention, mean | next kernel past the attention, mean |\n|---|");
    for (int c = 0; c < 2 * TL_N + 7; c++) printf("---:|");
    printf("\n");
    tl_row first = {0}, last = {0};
    int k_first = -1, k_last = -1;
    /* One request recorded and dropped first: the first recording after
     * CUPTI starts showed ~5 ms of idle time the others did not. */
    if (n_k > 0 && !tl_request(b, 1, ks[0], suffix + (k_max - ks[0]) * b->F, &first))
        fprintf(stderr, "bench_gpu: -L: the first recording failed\n");
    /* -H: each k's host-tier request after its resident one. */
    for (int ri = 0; ri < (b->tier ? 2 * n_k : n_k); ri++) {
        const int ki = b->tier ? ri / 2 : ri, mode = b->tier && ri % 2 ? 2 : 1;
        tl_row r;
        if (!tl_request(b, mode, ks[ki], suffix + (k_max - ks[ki]) * b->F, &r)) {
            printf("| %d | (no timeline) |\n", ks[ki]);
            continue;
        }
        char what[24];
        snprintf(what, sizeof what, "%d%s", ks[ki], mode == 2 ? " tier" : "");
        tl_print(what, &r);
        printf("|   host, us from the call: fork %.1f, injection returned %.1f, forward returned "
               "%.1f (the last record ended at %.1f; the last copy to the host took %.1f), token "
               "%.1f |\n",
               r.at_fork, r.at_inject, r.at_logits, r.at_last_end, r.dtoh, r.at_token);
        printf("|   longest idle stretches, us (after kernel i: before -> after):");
        for (int g = 0; g < TL_GAPS && r.gap[g] > 0; g++)
            printf(" %.1f (%d: %s -> %s);", r.gap[g], r.gap_at[g], r.gap_before[g], r.gap_after[g]);
        printf(" |\n");
        if (mode == 2) continue;
        if (k_first < 0 || ks[ki] < k_first) k_first = ks[ki], first = r;
        if (ks[ki] > k_last) k_last = ks[ki], last = r;
    }
    if (k_first >= 0 && k_last > k_first) {
        tl_row d = last;
        d.n -= first.n;
        d.span -= first.span;
        d.idle -= first.idle;
        d.lead -= first.lead;
        d.tail -= first.tail;
        for (int c = 0; c < TL_N; c++) {
            d.sum[c] -= first.sum[c];
            d.idle_before[c] -= first.idle_before[c];
        }
        d.attn_mean -= first.attn_mean;
        d.after_attn_mean -= first.after_attn_mean;
        char what[32];
        snprintf(what, sizeof what, "%d - %d", k_last, k_first);
        tl_print(what, &d);
    }
    fflush(stdout);
    free(suffix);
}
#endif

/* The backend's configuration for a -c/-t configuration: base (the
 * options the backend was created with, IS_CUDA_OPTIONS included, then -O's), the
 * configuration's precision and KV cache, then its modifiers (bench_gpu -h).
 * False, with a message, for an unknown configuration or modifier. */
static bool configure_cuda(backend *be, const cuda_options *base, const char *cfg) {
    static const struct {
        const char *modifier, *options;
    } MODS[] = {
        {"+noskinny", "skinny=off"}, {"+unstacked", "stacked=off"}, {"+nocluster", "clusters=off"},
        {"+nopdl", "pdl=off"},       {"+nowgmma", "wgmma=off"},     {"+mmasync", "flash_wgmma=off"},
        {"+narrow", "wide=off"},
    };
    char spec[512];
    cuda_options_format(base, spec, sizeof spec);
    if (backend_cuda_configure(be, spec) != IS_OK) return false;
    const char *what = strncmp(cfg, "legacy", 6) == 0   ? "precision=bf16x2," CUDA_OPTIONS_PLAINEST
                       : strncmp(cfg, "bf16x2", 6) == 0 ? "precision=bf16x2,kv=bf16"
                       : strncmp(cfg, "bf16", 4) == 0   ? "precision=bf16,kv=bf16"
                                                        : NULL;
    if (!what) {
        fprintf(stderr, "bench_gpu: unknown configuration '%s'\n", cfg);
        return false;
    }
    if (backend_cuda_configure(be, what) != IS_OK) return false;
    /* Modifiers: "+name" each; "+hostargmax" is the benchmark's own, and
     * "+r2", "+r3", ... name a repeat of the same configuration. */
    for (const char *m = strchr(cfg, '+'); m; m = strchr(m + 1, '+')) {
        const size_t len = strcspn(m + 1, "+") + 1;
        bool known = (len == 11 && !strncmp(m, "+hostargmax", 11)) ||
                     (len >= 3 && m[1] == 'r' && strspn(m + 2, "0123456789") == len - 2);
        for (size_t i = 0; i < sizeof MODS / sizeof MODS[0] && !known; i++)
            if (strlen(MODS[i].modifier) == len && !strncmp(m, MODS[i].modifier, len)) {
                if (backend_cuda_configure(be, MODS[i].options) != IS_OK) return false;
                known = true;
            }
        if (!known) {
            fprintf(stderr, "bench_gpu: unknown modifier '%.*s' in '%s'\n", (int)len, m, cfg);
            return false;
        }
    }
    return true;
}
#endif

static bool has(const char *list, const char *name) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ","))
        if (strcmp(t, name) == 0) return true;
    return false;
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *be_name = "cuda", *csv_path = NULL;
    const char *cfg_ttft = "legacy,bf16x2,bf16", *cfg_tp = "legacy,bf16";
    char ks_arg[128] = "5,10,20,50,100", us_arg[128] = "1,10,50,100", lus_arg[128] = "";
    char as_arg[128] = ""; /* -a: requests admitted in one step */
    int reps = 7, K = 50, threads = 0;
    bool profile = false, timeline = false, interleave = false;
    double gap_ms = 0.0;
    const char *cuda_opts = NULL; /* -O */
    double arena_gb = 24;
    bench b = {0};
    b.P = 60;
    b.F = 25;
    b.Q = 30;
    b.mem_temp = b.mem_mass = 1.0f;
    int c;
    while ((c = getopt(argc, argv, "m:b:k:u:U:K:r:c:t:A:P:F:Q:o:T:O:g:M:R:a:B:pLiHh")) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'b': be_name = optarg; break;
        case 'k': snprintf(ks_arg, sizeof ks_arg, "%s", optarg); break;
        case 'u': snprintf(us_arg, sizeof us_arg, "%s", optarg); break;
        case 'U': snprintf(lus_arg, sizeof lus_arg, "%s", optarg); break;
        case 'K': K = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'c': cfg_ttft = optarg; break;
        case 't': cfg_tp = optarg; break;
        case 'A': arena_gb = atof(optarg); break;
        case 'P': b.P = atoi(optarg); break;
        case 'F': b.F = atoi(optarg); break;
        case 'Q': b.Q = atoi(optarg); break;
        case 'o': csv_path = optarg; break;
        case 'T': threads = atoi(optarg); break;
        case 'p': profile = true; break;
        case 'L': timeline = true; break;
        case 'i': interleave = true; break;
        case 'H': b.tier = true; break;
        case 'g': gap_ms = atof(optarg); break;
        case 'R': b.recompute = atoi(optarg); break;
        case 'a': snprintf(as_arg, sizeof as_arg, "%s", optarg); break;
        case 'B':
            b.blend = (float)atof(optarg);
            if (!(b.blend > 0.0f && b.blend <= 1.0f)) {
                fprintf(stderr, "bench_gpu: -B takes a ratio in (0, 1], got '%s'\n", optarg);
                return 1;
            }
            break;
        case 'M':
            if (sscanf(optarg, "%f,%f", &b.mem_temp, &b.mem_mass) != 2 || !(b.mem_temp > 0.0f) ||
                !(b.mem_mass > 0.0f)) {
                fprintf(stderr, "bench_gpu: -M takes TEMP,MASS (both > 0), got '%s'\n", optarg);
                return 1;
            }
            break;
        case 'O': cuda_opts = optarg; break;
        default:
            fprintf(
                stderr,
                "usage: bench_gpu -m MODEL [-b cuda|cpu] [-k K,...] [-u U,...] [-K 50] [-r REPS]\n"
                "                 [-c TTFT_CONFIGS] [-t THROUGHPUT_CONFIGS] [-A ARENA_GB]\n"
                "                 [-P 60] [-F 25] [-Q 30] [-T THREADS] [-o CSV] [-p] [-L] [-i]\n"
                "                 [-g GAP_MS] [-O OPTIONS] [-M TEMP,MASS] [-R M] [-B R] [-a "
                "U,...] [-H]\n"
                "-H: a kv tier column: facts never seen, their bf16 records in pinned host\n"
                "    memory, prefetched before the fork and injected with no values (the\n"
                "    server's host tier; cuda); with -L, a timeline of such a request too\n"
                "-a U,...: for each throughput configuration (-t), the admission of U kv\n"
                "    requests at k = K in one step (fork + inject), one inject call a\n"
                "    request against one call for all (engine_inject_batch), facts\n"
                "    resident in the GPU arena; -c none -u none -t cpu runs only this on the CPU\n"
                "-M TEMP,MASS: kv requests score the injected facts' keys as\n"
                "    score / TEMP + ln(MASS) (engine_params.mem_temp, mem_mass;\n"
                "    default 1,1: plain attention)\n"
                "-R M: kv requests recompute the first M tokens of every fact in the\n"
                "    query's own forward (engine_batch.rewrite; its time counts in prefill)\n"
                "-B R: kv requests recompute the share R of the memory's tokens that\n"
                "    deviate most, in the query's forward (engine_batch.blend, CacheBlend;\n"
                "    its time counts in prefill)\n"
                "-i: TTFT runs take one prompt, kv and cold request a round (default:\n"
                "    each kind in a loop of its own, so kv requests follow kv requests)\n"
                "-g GAP_MS: the GPU left idle GAP_MS before each TTFT request (default 0:\n"
                "    back to back, where the board runs at its power cap)\n"
                "-p: after each configuration's TTFT runs, a per-op GPU time profile (cuda)\n"
                "-L: after each configuration's TTFT runs, the kernels of a kv request as\n"
                "    served, from CUPTI (cuda, where bench_gpu was built with CUPTI)\n"
                "-O OPTIONS: the CUDA backend's options (key=value,...) under every\n"
                "    configuration, on top of IS_CUDA_OPTIONS's:\n%s"
                "configs: legacy (the plainest options), bf16x2, bf16 (cuda), with\n"
                "         modifiers, each an option off: +noskinny, +unstacked,\n"
                "         +nocluster, +nopdl, +nowgmma, +mmasync (flash_wgmma),\n"
                "         +narrow (wide); +hostargmax: the logits brought to the host\n"
                "         for the first token's argmax; +r2, +r3: a repeat\n",
#ifdef IS_HAVE_CUDA
                cuda_options_help()
#else
                ""
#endif
            );
            return c == 'h' ? 0 : 1;
        }
    }
    if (!model_path) {
        fprintf(stderr, "bench_gpu: -m MODEL is required\n");
        return 1;
    }
    if (reps < 1) reps = 1;
    int ks[16], us[16], lus[16], as[16];
    int n_k = parse_list(ks_arg, ks, 16), n_u = parse_list(us_arg, us, 16);
    int n_a = as_arg[0] ? parse_list(as_arg, as, 16) : 0;
    if (strcmp(us_arg, "none") == 0) n_u = 0; /* -u none: no throughput table (-a alone) */
    int n_lu = lus_arg[0] ? parse_list(lus_arg, lus, 16) : 0; /* users for legacy (-U) */
    if (!lus_arg[0]) {
        memcpy(lus, us, sizeof us);
        n_lu = n_u;
    }
    int k_max = 0, u_max = 0;
    for (int i = 0; i < n_k; i++) k_max = ks[i] > k_max ? ks[i] : k_max;
    for (int i = 0; i < n_u; i++) u_max = us[i] > u_max ? us[i] : u_max;
    int a_max = 0;
    for (int i = 0; i < n_a; i++) a_max = as[i] > a_max ? as[i] : a_max;

    b.be_name = be_name;
    b.interleave = interleave;
    b.gap_ms = gap_ms;
    CHECK(backend_create(be_name, threads, &b.be), "backend");
    double t0 = bench_now_ms();
    CHECK(model_load(model_path, b.be, &b.m), "model_load");
    const model_config *mc = &b.m->cfg;
    b.V = mc->n_vocab;
    printf("model %s: %s, %d layers, dim %d, %d/%d heads of %d, vocab %d; loaded on %s in %.1f s\n",
           model_path, mc->arch, mc->n_layers, mc->dim, mc->n_heads, mc->n_kv_heads, mc->head_dim,
           mc->n_vocab, be_name, (bench_now_ms() - t0) / 1e3);
    printf("layout: prefix %d tokens, facts of %d tokens, query %d tokens\n", b.P, b.F, b.Q);

    b.logits = malloc((size_t)b.V * sizeof(float));
    b.prefix = malloc((size_t)b.P * sizeof(int32_t));
    b.fact_tokens = malloc((size_t)b.F * sizeof(int32_t));
    random_tokens(&b, b.prefix, b.P);
    random_tokens(&b, b.fact_tokens, b.F);
    /* Host records: enough for k_max distinct facts; throughput reuses them
     * under other ids (the arena sees distinct records either way). */
    const size_t rec_n = (size_t)mc->n_layers * b.F * mc->n_kv_heads * mc->head_dim;
    b.n_pool = k_max > 0 ? k_max : 1;
    if (b.n_pool < 64) b.n_pool = 64;
    b.pool_k = calloc((size_t)b.n_pool, sizeof(float *));
    b.pool_v = calloc((size_t)b.n_pool, sizeof(float *));
    for (int32_t p = 0; p < b.n_pool; p++) {
        b.pool_k[p] = malloc(rec_n * sizeof(float));
        b.pool_v[p] = malloc(rec_n * sizeof(float));
        if (!b.pool_k[p] || !b.pool_v[p]) {
            fprintf(stderr, "bench_gpu: out of memory for fact records\n");
            return 1;
        }
        /* Keys and values of the scale real ones have after the projections. */
        for (size_t i = 0; i < rec_n; i++) {
            b.pool_k[p][i] = ((float)(rng_next() >> 40) / (float)(1 << 24) - 0.5f) * 4.0f;
            b.pool_v[p][i] = ((float)(rng_next() >> 40) / (float)(1 << 24) - 0.5f) * 0.5f;
        }
    }
    if (b.tier) { /* -H: the pool's records again, as a host tier holds them */
        if (!b.be->ops->host_alloc) {
            fprintf(stderr, "bench_gpu: -H: the %s backend has no host tier\n", be_name);
            return 1;
        }
        b.tier_rec = calloc((size_t)b.n_pool, sizeof(void *));
        b.tier_base = 1ull << 50;
        for (int32_t p = 0; p < b.n_pool; p++) {
            CHECK(b.be->ops->host_alloc(b.be, 2 * rec_n * sizeof(uint16_t), &b.tier_rec[p]),
                  "host_alloc");
            fact_kv_from_f32(KV_DTYPE_BF16, b.pool_k[p], b.tier_rec[p], rec_n);
            fact_kv_from_f32(KV_DTYPE_BF16, b.pool_v[p], (uint16_t *)b.tier_rec[p] + rec_n, rec_n);
        }
    }
    FILE *csv = csv_path ? fopen(csv_path, "w") : NULL;
    if (csv)
        fprintf(csv, "# ttft,config,k,prompt_tokens,prompt_ms,kv_ms,kv_fork_ms,kv_inject_ms,"
                     "kv_prefill_ms,kv_cold_ms,kv_tier_ms\n"
                     "# throughput,config,k,users,prompt_batch_ms,kv_batch_ms,prompt_rps,kv_rps\n"
                     "# admission,config,k,requests,call_each_ms,one_call_ms\n");

    const bool cuda = strcmp(be_name, "cuda") == 0;
#ifdef IS_HAVE_CUDA
    cuda_options base; /* as created (IS_CUDA_OPTIONS), then -O's: each configuration's start */
    if (cuda) {
        if (backend_cuda_configure(b.be, cuda_opts) != IS_OK) {
            fprintf(stderr, "bench_gpu: -O: %s\n", is_error_last());
            return 1;
        }
        backend_cuda_options(b.be, &base);
    }
#else
    if (cuda_opts) fprintf(stderr, "bench_gpu: -O: built without the CUDA backend\n");
#endif
    /* Every configuration named by -c or -t, in that order ("none": an
     * empty list, which BENCH_ARGS cannot pass as ''). */
    char all_buf[512];
    const char *all[32];
    int n_all = 0;
    snprintf(all_buf, sizeof all_buf, "%s,%s", cfg_ttft, cfg_tp);
    for (char *t = strtok(all_buf, ","); t && n_all < 32; t = strtok(NULL, ",")) {
        bool dup = false;
        for (int i = 0; i < n_all; i++) dup = dup || strcmp(all[i], t) == 0;
        if (!dup && strcmp(t, "none") != 0) all[n_all++] = t;
    }
    ref_logits ref = {0};
    for (int ci = 0; ci < (cuda ? n_all : 1); ci++) {
        const char *cfg = cuda ? all[ci] : "cpu";
        /* On the CPU, "none" skips a kind (-c none: only throughput and -a). */
        bool do_ttft = cuda ? has(cfg_ttft, cfg) : strcmp(cfg_ttft, "none") != 0;
        bool do_tp = cuda ? has(cfg_tp, cfg) : strcmp(cfg_tp, "none") != 0;
        if (!do_ttft && !do_tp) continue;
        const bool legacy = strncmp(cfg, "legacy", 6) == 0;
#ifdef IS_HAVE_CUDA
        if (cuda) {
            is_error_clear();
            if (!configure_cuda(b.be, &base, cfg)) {
                if (is_error_last()[0])
                    fprintf(stderr, "bench_gpu: %s: %s\n", cfg, is_error_last());
                return 1;
            }
            backend_cuda_set_arena_bytes(b.be, (size_t)(arena_gb * (1 << 30)));
            char desc[512];
            cuda_options now;
            backend_cuda_options(b.be, &now);
            cuda_options_format(&now, desc, sizeof desc);
            printf("\n%s: cuda options %s\n", cfg, desc);
        }
#else
        (void)arena_gb;    /* the arena exists only in the CUDA backend */
#endif
        b.host_argmax = strstr(cfg, "+hostargmax") != NULL;
        b.logits_out = b.host_argmax;
        const int32_t per_seq = b.P + k_max * b.F + b.Q + 16;
        if (do_ttft) {
            bench_engine(&b, 4, per_seq, 4 * per_seq);
            run_ttft(&b, cfg, ks, n_k, reps, cuda && !legacy, csv, &ref);
#ifdef IS_HAVE_CUDA
            if (profile && cuda) run_profile(&b, cfg, ks, n_k);
#else
            (void)profile; /* the op profiler is the CUDA backend's */
#endif
#ifdef IS_HAVE_CUPTI
            if (timeline && cuda) run_timeline(&b, cfg, ks, n_k);
#else
            if (timeline) fprintf(stderr, "bench_gpu: -L: built without CUPTI\n");
#endif
            engine_free(b.e);
            b.e = NULL;
        }
        const int *cu = cuda && legacy ? lus : us;
        const int ncu = cuda && legacy ? n_lu : n_u;
        if (do_tp && ncu > 0) {
            const int32_t tp_seq = b.P + K * b.F + b.Q + 16;
            bench_engine(&b, u_max + 2, tp_seq, (u_max + 1) * tp_seq);
            run_throughput(&b, cfg, cu, ncu, K, csv);
            engine_free(b.e);
            b.e = NULL;
        }
        if (do_tp && n_a > 0) {
            const int32_t tp_seq = b.P + K * b.F + b.Q + 16;
            bench_engine(&b, a_max + 2, tp_seq, (a_max + 1) * tp_seq);
            run_admission(&b, cfg, as, n_a, K, reps, csv);
            engine_free(b.e);
            b.e = NULL;
        }
#ifdef IS_HAVE_CUDA
        if (cuda) {
            cuda_arena_stats st;
            backend_cuda_arena_stats(b.be, &st);
            if (st.pages_total)
                printf("\narena (%s): %lld hits, %lld misses, %lld evictions, %.2f GB uploaded, "
                       "%lld records in %lld of %lld pages (%lld bytes each)\n",
                       cfg, (long long)st.hits, (long long)st.misses, (long long)st.evictions,
                       st.bytes_uploaded / 1e9, (long long)st.records, (long long)st.pages_used,
                       (long long)st.pages_total, (long long)st.page_bytes);
        }
#endif
    }
    if (csv) fclose(csv);
    for (int32_t p = 0; p < b.n_pool; p++) {
        free(b.pool_k[p]);
        free(b.pool_v[p]);
        if (b.tier_rec) b.be->ops->host_free(b.be, b.tier_rec[p]);
    }
    free(b.tier_rec);
    free(b.pool_k);
    free(b.pool_v);
    free(b.prefix);
    free(b.fact_tokens);
    free(b.logits);
    free(b.tok);
    free(b.seq);
    free(b.rw);
    free(ref.prompt);
    free(ref.kv);
    model_free(b.m);
    b.be->ops->free(b.be);
    return 0;
}

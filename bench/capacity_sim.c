#include "capacity_sim.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NIL (-1)

/* ---- random numbers: xoshiro256**, seeded by splitmix64 ------------------------------ */

typedef struct rng {
    uint64_t s[4];
} rng;

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rng_seed(rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(rng *r) {
    uint64_t *s = r->s, out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

/* Uniform in (0, 1). */
static double rng_unit(rng *r) { return ((rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static double rng_exp(rng *r, double mean) { return mean > 0 ? -mean * log(rng_unit(r)) : 0; }

/* ---- the tiers: one LRU stack per node, cut into GPU, host and disk -------------------- */

typedef struct tiers {
    int32_t nodes;
    int32_t cap[3];               /* blocks per node in each tier */
    uint8_t *tier;                /* [blocks] cap_tier */
    int32_t *prev, *next;         /* [blocks] list links, toward the top / the bottom */
    int32_t *head, *tail, *count; /* [nodes * 3] */
} tiers;

static void list_remove(tiers *t, int32_t node, int32_t b) {
    int32_t l = node * 3 + t->tier[b];
    if (t->prev[b] != NIL) t->next[t->prev[b]] = t->next[b];
    else t->head[l] = t->next[b];
    if (t->next[b] != NIL) t->prev[t->next[b]] = t->prev[b];
    else t->tail[l] = t->prev[b];
    t->count[l]--;
    t->tier[b] = CAP_TIER_NONE;
}

static void list_push_top(tiers *t, int32_t node, int32_t b, int tier) {
    int32_t l = node * 3 + tier;
    t->prev[b] = NIL;
    t->next[b] = t->head[l];
    if (t->head[l] != NIL) t->prev[t->head[l]] = b;
    else t->tail[l] = b;
    t->head[l] = b;
    t->count[l]++;
    t->tier[b] = (uint8_t)tier;
}

/* The first tier at or below `from` with room in its size, or NONE. */
static int tier_below(const tiers *t, int from) {
    for (int i = from; i < 3; i++)
        if (t->cap[i] > 0) return i;
    return CAP_TIER_NONE;
}

/* Puts b at the top of the stack; every tier past its size hands its
 * least recent block down, the last one drops it. */
static void tiers_put_top(tiers *t, int32_t node, int32_t b) {
    int top = tier_below(t, 0);
    if (top == CAP_TIER_NONE) return;
    list_push_top(t, node, b, top);
    for (int i = top; i < 3; i++) {
        int32_t l = node * 3 + i;
        if (t->count[l] <= t->cap[i]) break;
        int32_t v = t->tail[l];
        list_remove(t, node, v);
        int down = tier_below(t, i + 1);
        if (down != CAP_TIER_NONE) list_push_top(t, node, v, down);
    }
}

/* Where b is now (its request is served from there), then moves it to the top. */
static cap_tier tiers_access(tiers *t, int32_t node, int32_t b) {
    cap_tier was = (cap_tier)t->tier[b];
    if (was != CAP_TIER_NONE) list_remove(t, node, b);
    tiers_put_top(t, node, b);
    return was;
}

static void tiers_free(tiers *t) {
    free(t->tier);
    free(t->prev);
    free(t->next);
    free(t->head);
    free(t->tail);
    free(t->count);
}

static int tiers_init(tiers *t, int32_t nodes, int64_t blocks, const int32_t cap[3]) {
    memset(t, 0, sizeof *t);
    t->nodes = nodes;
    memcpy(t->cap, cap, sizeof t->cap);
    t->tier = malloc((size_t)blocks);
    t->prev = malloc((size_t)blocks * sizeof *t->prev);
    t->next = malloc((size_t)blocks * sizeof *t->next);
    t->head = malloc((size_t)nodes * 3 * sizeof *t->head);
    t->tail = malloc((size_t)nodes * 3 * sizeof *t->tail);
    t->count = calloc((size_t)nodes * 3, sizeof *t->count);
    if (!t->tier || !t->prev || !t->next || !t->head || !t->tail || !t->count) {
        tiers_free(t);
        return -1;
    }
    memset(t->tier, CAP_TIER_NONE, (size_t)blocks);
    for (int32_t i = 0; i < nodes * 3; i++) t->head[i] = t->tail[i] = NIL;
    return 0;
}

/* ---- the event queue: a binary heap of (time, session) --------------------------------- */

typedef struct event {
    double t;
    int32_t s;
} event;

typedef struct heap {
    event *e;
    int64_t n, cap;
} heap;

static int heap_push(heap *h, double t, int32_t s) {
    if (h->n == h->cap) {
        int64_t nc = h->cap ? 2 * h->cap : 1024;
        event *ne = realloc(h->e, (size_t)nc * sizeof *ne);
        if (!ne) return -1;
        h->e = ne;
        h->cap = nc;
    }
    int64_t i = h->n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (h->e[p].t <= t) break;
        h->e[i] = h->e[p];
        i = p;
    }
    h->e[i] = (event){t, s};
    return 0;
}

static event heap_pop(heap *h) {
    event top = h->e[0], last = h->e[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->e[c + 1].t < h->e[c].t) c++;
        if (last.t <= h->e[c].t) break;
        h->e[i] = h->e[c];
        i = c;
    }
    if (h->n) h->e[i] = last;
    return top;
}

/* ---- the simulation ---------------------------------------------------------------------- */

cap_params cap_default_params(void) {
    return (cap_params){.users = 1000000,
                        .zipf = 1.0,
                        .load_rps = 700,
                        .session_len = 10,
                        .think_s = 20,
                        .facts_per_user = 200,
                        .k = 50,
                        .tokens_per_fact = 25,
                        .kv_bytes_per_token = 131072,
                        .nodes = 8,
                        .gpu_bytes = 77.8 * 1073741824.0,
                        .host_bytes = 256 * 1073741824.0,
                        .disk_bytes = 3.5 * 1099511627776.0,
                        .host_gbps = 1,
                        .disk_gbps = 1,
                        .preload = CAP_TIER_NONE,
                        .requests = 4000000,
                        .warmup = 16000000,
                        .seed = 1};
}

static int32_t blocks_per_user(const cap_params *p) {
    return p->facts_per_user > p->k ? p->facts_per_user / p->k : 1;
}

double cap_request_tokens(const cap_params *p) {
    return (p->facts_per_user < p->k ? p->facts_per_user : p->k) * p->tokens_per_fact;
}

double cap_block_bytes(const cap_params *p) {
    return cap_request_tokens(p) * p->kv_bytes_per_token;
}

static int32_t node_of(int64_t user, int32_t nodes) {
    uint64_t x = (uint64_t)user ^ 0x5bd1e995u;
    return (int32_t)(splitmix64(&x) % (uint64_t)nodes);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double pct(const float *v, int64_t n, double q) {
    if (n == 0) return 0;
    int64_t i = (int64_t)ceil(q * (double)n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return v[i];
}

typedef struct session {
    int64_t user;
    int64_t left; /* requests still to come (closed mode: never ends) */
} session;

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (err) snprintf(err, (size_t)err_len, __VA_ARGS__);                                      \
        goto out;                                                                                  \
    } while (0)

int cap_simulate(const cap_params *p, cap_result *res, char *err, int err_len) {
    int rc = -1;
    double *cdf = NULL, *busy = NULL, *work = NULL, *dep = NULL;
    float *ttft = NULL;
    session *ss = NULL;
    int32_t *free_s = NULL;
    heap h = {0};
    tiers t;
    bool tiers_ok = false;
    if (!p || !res) FAIL("NULL argument");
    if (p->users <= 0 || p->nodes <= 0 || p->facts_per_user <= 0 || p->k <= 0 ||
        p->tokens_per_fact <= 0 || p->kv_bytes_per_token <= 0 || p->requests <= 0 ||
        p->warmup < 0 || p->session_len < 1 || p->think_s < 0 || p->zipf < 0)
        FAIL("bad population, memory or run parameters");
    if (p->closed_clients <= 0 && !(p->load_rps > 0))
        FAIL("load_rps must be > 0 (or closed_clients set)");
    if (!(p->engine_ms > 0) || p->hot_ms0 < 0 || p->hot_us_per_token < 0 ||
        !(p->prefill_us_per_token > 0))
        FAIL("the engine parameters are not set (engine_ms, prefill_us_per_token > 0)");
    if ((p->host_bytes > 0 && !(p->host_gbps > 0)) || (p->disk_bytes > 0 && !(p->disk_gbps > 0)))
        FAIL("a tier with a size needs a speed");
    int32_t bpu = blocks_per_user(p);
    int64_t blocks = p->users * bpu;
    if (blocks > INT32_MAX - 1) FAIL("too many blocks (%lld)", (long long)blocks);
    double bb = cap_block_bytes(p), tok = cap_request_tokens(p);
    double capd[3] = {floor(p->gpu_bytes / bb), floor(p->host_bytes / bb),
                      floor(p->disk_bytes / bb)};
    int32_t cap[3];
    for (int i = 0; i < 3; i++)
        cap[i] = capd[i] > (double)blocks ? (int32_t)blocks : (int32_t)capd[i];
    if (tiers_init(&t, p->nodes, blocks, cap) != 0) FAIL("out of memory");
    tiers_ok = true;

    rng r;
    rng_seed(&r, p->seed);
    /* Zipf activity: user i (0-based) weighs (i + 1)^-s. */
    if (!(cdf = malloc((size_t)p->users * sizeof *cdf))) FAIL("out of memory");
    double acc = 0;
    for (int64_t i = 0; i < p->users; i++) cdf[i] = acc += pow((double)(i + 1), -p->zipf);

    if (p->preload != CAP_TIER_NONE) {
        int32_t saved[3];
        memcpy(saved, t.cap, sizeof saved);
        /* Only the preload tier takes blocks, then the sizes come back. */
        for (int i = 0; i < 3; i++)
            if (i != (int)p->preload) t.cap[i] = 0;
        for (int64_t b = 0; b < blocks; b++) {
            int32_t node = node_of(b / bpu, p->nodes);
            if (t.count[node * 3 + p->preload] < t.cap[p->preload])
                list_push_top(&t, node, (int32_t)b, p->preload);
        }
        memcpy(t.cap, saved, sizeof saved);
    }

    int64_t total = p->warmup + p->requests;
    busy = calloc((size_t)p->nodes, sizeof *busy);
    work = calloc((size_t)p->nodes, sizeof *work);
    ttft = malloc((size_t)p->requests * sizeof *ttft);
    if (!busy || !work || !ttft) FAIL("out of memory");
    int64_t n_s = 0, cap_s = 1024, n_free = 0;
    ss = malloc((size_t)cap_s * sizeof *ss);
    free_s = malloc((size_t)cap_s * sizeof *free_s);
    if (!ss || !free_s) FAIL("out of memory");
    bool closed = p->closed_clients > 0;
    if (closed) {
        for (int32_t c = 0; c < p->closed_clients; c++) {
            if (n_s == cap_s) {
                cap_s *= 2;
                session *ns = realloc(ss, (size_t)cap_s * sizeof *ns);
                int32_t *nf = realloc(free_s, (size_t)cap_s * sizeof *nf);
                if (ns) ss = ns;
                if (nf) free_s = nf;
                if (!ns || !nf) FAIL("out of memory");
            }
            ss[n_s] = (session){.user = c % p->users, .left = -1};
            if (heap_push(&h, 0, (int32_t)n_s++) != 0) FAIL("out of memory");
        }
    }
    double start_mean = closed ? 0 : p->session_len / p->load_rps; /* between session starts */
    double next_start = closed ? INFINITY : rng_exp(&r, start_mean);
    /* Node 0's departures, oldest first (FIFO: they only grow). */
    int64_t dep_head = 0, dep_n = 0, dep_cap = 1024;
    if (!(dep = malloc((size_t)dep_cap * sizeof *dep))) FAIL("out of memory");
    double seen_sum = 0, soj_sum = 0, wait0_sum = 0;
    int64_t n0 = 0, served[4] = {0};
    double t_warm = 0, t_now = 0, ttft_sum = 0;
    if (p->warmup == 0) t_warm = 0;
    for (int64_t done = 0; done < total; done++) {
        int32_t s;
        if (!closed && (h.n == 0 || next_start <= h.e[0].t)) {
            t_now = next_start;
            next_start += rng_exp(&r, start_mean);
            if (n_free) {
                s = free_s[--n_free];
            } else {
                if (n_s == cap_s) {
                    cap_s *= 2;
                    session *ns = realloc(ss, (size_t)cap_s * sizeof *ns);
                    int32_t *nf = realloc(free_s, (size_t)cap_s * sizeof *nf);
                    if (ns) ss = ns;
                    if (nf) free_s = nf;
                    if (!ns || !nf) FAIL("out of memory");
                }
                s = (int32_t)n_s++;
            }
            /* A user by activity: the first with cdf > u * total. */
            double u = rng_unit(&r) * acc;
            int64_t lo = 0, hi = p->users - 1;
            while (lo < hi) {
                int64_t mid = (lo + hi) / 2;
                if (cdf[mid] > u) hi = mid;
                else lo = mid + 1;
            }
            int64_t len = 1;
            if (p->session_len > 1) /* geometric, mean session_len */
                len = 1 + (int64_t)floor(log(rng_unit(&r)) / log(1 - 1 / p->session_len));
            ss[s] = (session){.user = lo, .left = len};
        } else {
            event e = heap_pop(&h);
            t_now = e.t;
            s = e.s;
        }
        bool measured = done >= p->warmup;
        if (done == p->warmup) {
            t_warm = t_now;
            memset(work, 0, (size_t)p->nodes * sizeof *work);
        }
        int64_t user = ss[s].user;
        int32_t node = node_of(user, p->nodes);
        int32_t b = (int32_t)(user * bpu + (bpu > 1 ? (int64_t)(rng_next(&r) % (uint64_t)bpu) : 0));
        cap_tier from = tiers_access(&t, node, b);
        double load_ms = from == CAP_TIER_HOST   ? bb / (p->host_gbps * 1e6)
                         : from == CAP_TIER_DISK ? bb / (p->disk_gbps * 1e6)
                                                 : 0;
        double enc_ms = from == CAP_TIER_NONE ? tok * p->prefill_us_per_token / 1e3 : 0;
        double start = busy[node] > t_now ? busy[node] : t_now;
        double wait_ms = (start - t_now) * 1e3;
        double svc_s = (p->engine_ms + enc_ms) / 1e3;
        busy[node] = start + svc_s;
        double ms = (wait_ms > load_ms ? wait_ms : load_ms) + p->hot_ms0 +
                    tok * p->hot_us_per_token / 1e3 + enc_ms;
        if (node == 0) {
            while (dep_n && dep[dep_head] <= t_now) {
                dep_head++;
                dep_n--;
            }
            if (measured) {
                seen_sum += (double)dep_n;
                soj_sum += busy[0] - t_now;
                wait0_sum += wait_ms;
                n0++;
            }
            if (dep_head + dep_n == dep_cap) {
                if (dep_head > dep_cap / 2) {
                    memmove(dep, dep + dep_head, (size_t)dep_n * sizeof *dep);
                    dep_head = 0;
                } else {
                    double *nd = realloc(dep, (size_t)dep_cap * 2 * sizeof *nd);
                    if (!nd) FAIL("out of memory");
                    dep = nd;
                    dep_cap *= 2;
                }
            }
            dep[dep_head + dep_n++] = busy[0];
        }
        if (measured) {
            ttft[done - p->warmup] = (float)ms;
            ttft_sum += ms;
            served[from]++;
            work[node] += svc_s;
        }
        if (ss[s].left < 0 || --ss[s].left > 0) {
            if (heap_push(&h, t_now + ms / 1e3 + rng_exp(&r, p->think_s), s) != 0)
                FAIL("out of memory");
        } else {
            free_s[n_free++] = s;
        }
    }
    double span = t_now - t_warm;
    cap_result o = {.measured = p->requests};
    for (int i = 0; i < 4; i++) o.tier_share[i] = (double)served[i] / (double)p->requests;
    o.ttft_mean_ms = ttft_sum / (double)p->requests;
    qsort(ttft, (size_t)p->requests, sizeof *ttft, cmp_float);
    o.ttft_p50_ms = pct(ttft, p->requests, 0.50);
    o.ttft_p90_ms = pct(ttft, p->requests, 0.90);
    o.ttft_p99_ms = pct(ttft, p->requests, 0.99);
    o.throughput_rps = span > 0 ? (double)p->requests / span : 0;
    for (int32_t n = 0; n < p->nodes; n++) {
        double u = span > 0 ? work[n] / span : 0;
        o.util_mean += u / p->nodes;
        if (u > o.util_max) o.util_max = u;
    }
    if (n0 && span > 0) {
        o.queue_seen_mean = seen_sum / (double)n0;
        o.queue_little = ((double)n0 / span) * (soj_sum / (double)n0);
        o.wait_mean_ms = wait0_sum / (double)n0;
    }
    o.blocks_gpu = cap[0];
    o.blocks_host = cap[1];
    o.blocks_disk = cap[2];
    *res = o;
    rc = 0;
out:
    if (tiers_ok) tiers_free(&t);
    free(cdf);
    free(busy);
    free(work);
    free(dep);
    free(ttft);
    free(ss);
    free(free_s);
    free(h.e);
    return rc;
}

/*
 * arena: LRU bookkeeping of the fact-KV arena (see arena.cuh).
 *
 * A request's facts are placed on the host before its injection kernel can
 * start, with the GPU idle meanwhile, so a hit costs one hash lookup and
 * the record's own memory: the order of use is each record's stamp (the
 * call that last used it), not a linked list whose splice touched three
 * nodes a fact; an eviction scans the records for the oldest stamp (a
 * miss that needs one uploads megabytes anyway).
 */
#include "arena.cuh"
#include "kv.cuh"
#include "upload.cuh"

#include <unordered_map>
#include <vector>

namespace {
struct record {
    uint64_t id; /* 0: free, or kept for the current call only */
    int32_t n_tokens;
    std::vector<int32_t> pages;
    uint64_t stamp; /* the call that last used it */
    int32_t pins;   /* prefetches not yet injected or given up: not evictable */
    /* A prefetch's record whose copy is not started yet: its host rows. */
    bool queued;
    const void *hk, *hv;
    int32_t dtype;
};

/* A record of the staged batch as its copies need it: taken when staged,
 * since the record may be evicted (and its slot reused) before its later
 * groups are copied, once its request has injected and unpinned it. */
struct staged_rec {
    const void *hk, *hv;
    int32_t n_tokens;
};

struct queued_ref {
    int32_t ri;
    uint64_t id; /* still the record's: it was not dropped meanwhile */
};
} // namespace

/* Staging of the host tier's copies: device memory taken as batches need
 * it, by default at most the arena's bytes and this much. Pins hold at most
 * half the arena, so a queue fits whole below that; a larger one is staged
 * and landed in parts, all but the last before the forward starts (a cap
 * that split a request's misses once cost the whole copy again). */
#define STAGING_MAX_BYTES ((size_t)1 << 30)
#define STAGING_MIN_BYTES ((size_t)64 << 20)

struct cuda_arena {
    int32_t n_layers, n_kv_heads, head_dim, kv_dim;
    bool fp8;          /* pages of fp8 codes and scales, else bf16 (kv.cuh) */
    size_t page_bytes; /* cuda_arena_page_bytes */
    int64_t n_pages;
    uint8_t *data;
    std::vector<int32_t> free_pages;
    std::unordered_map<uint64_t, int32_t> by_id; /* id -> index in recs */
    std::vector<record> recs;
    std::vector<int32_t> free_recs;
    std::vector<int32_t> claimed; /* this call's records found by the first pass, -1: none */
    uint64_t call;
    cuda_arena_stats stats;
    float *staging; /* one record in f32, device */
    size_t staging_cap;
    int32_t *dpages; /* one record's page ids, device */
    size_t dpages_cap;
    int64_t pinned_pages;
    /* Prefetches queue their records (pages taken, pinned); a stage copies
     * the queue on `up` into rec_staging, layer group by group (ev_group),
     * and the caller lands each group on its own stream (a scatter kernel),
     * the last one recording ev_free, after which the staging is reused. */
    std::vector<queued_ref> queue;
    cudaStream_t up;
    cudaEvent_t ev_group[CUDA_ARENA_GROUPS], ev_free;
    uint16_t *rec_staging;
    size_t rec_staging_cap;   /* elements */
    size_t staging_max;       /* bytes */
    cuda_upload_token *dtoks; /* the staged batch's tokens, device */
    size_t dtoks_cap;
    std::vector<cuda_upload_token> toks; /* host */
    int32_t landed;                      /* groups of the staged batch landed so far */
    int32_t sent;                        /* groups whose copies are queued on `up` */
    bool unsent; /* wait_uploads could not queue them: the host rows are gone, never copy */
    std::vector<staged_rec> batch; /* the staged batch, in staging order */
};

is_status cuda_arena_create(size_t max_bytes, size_t staging_bytes, int32_t n_layers,
                            int32_t n_kv_heads, int32_t head_dim, bool fp8, cuda_arena **out) {
    const size_t page_bytes = cuda_arena_page_bytes(n_layers, n_kv_heads, head_dim, fp8);
    const int64_t n_pages = (int64_t)(max_bytes / page_bytes);
    if (n_pages < 1 || n_pages > INT32_MAX)
        return is_error_set(IS_ERR_NOMEM, "cuda arena: %zu bytes hold %lld pages of %zu bytes",
                            max_bytes, (long long)n_pages, page_bytes);
    cuda_arena *a = new (std::nothrow) cuda_arena();
    if (!a) return is_error_set(IS_ERR_NOMEM, "cuda arena: out of memory");
    a->n_layers = n_layers;
    a->n_kv_heads = n_kv_heads;
    a->head_dim = head_dim;
    a->kv_dim = n_kv_heads * head_dim;
    a->fp8 = fp8;
    a->page_bytes = page_bytes;
    a->n_pages = n_pages;
    cudaError_t e = cudaMalloc(&a->data, (size_t)n_pages * page_bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        delete a;
        return is_error_set(IS_ERR_NOMEM, "cuda arena: cannot allocate %lld pages (%zu bytes): %s",
                            (long long)n_pages, (size_t)n_pages * page_bytes,
                            cudaGetErrorString(e));
    }
    bool made = cudaStreamCreateWithFlags(&a->up, cudaStreamNonBlocking) == cudaSuccess &&
                cudaEventCreateWithFlags(&a->ev_free, cudaEventDisableTiming) == cudaSuccess;
    for (int g = 0; g < CUDA_ARENA_GROUPS && made; g++)
        made = cudaEventCreateWithFlags(&a->ev_group[g], cudaEventDisableTiming) == cudaSuccess;
    if (!made) {
        cudaGetLastError();
        cuda_arena_free(a);
        return is_error_set(IS_ERR_INTERNAL, "cuda arena: cannot create its copy stream");
    }
    a->landed = CUDA_ARENA_GROUPS;
    a->staging_max = staging_bytes                   ? staging_bytes
                     : max_bytes < STAGING_MAX_BYTES ? max_bytes
                                                     : STAGING_MAX_BYTES;
    a->free_pages.reserve((size_t)n_pages);
    for (int64_t p = n_pages - 1; p >= 0; p--) a->free_pages.push_back((int32_t)p);
    a->stats.pages_total = n_pages;
    a->stats.page_bytes = (int64_t)page_bytes;
    *out = a;
    return IS_OK;
}

void cuda_arena_free(cuda_arena *a) {
    if (!a) return;
    if (a->up) {
        cudaStreamSynchronize(a->up);
        cudaStreamDestroy(a->up);
    }
    for (cudaEvent_t e : a->ev_group)
        if (e) cudaEventDestroy(e);
    if (a->ev_free) cudaEventDestroy(a->ev_free);
    cudaFree(a->data);
    cudaFree(a->rec_staging);
    cudaFree(a->dtoks);
    cudaFree(a->staging);
    cudaFree(a->dpages);
    delete a;
}

bool cuda_arena_matches(const cuda_arena *a, int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                        bool fp8) {
    return a && a->n_layers == n_layers && a->n_kv_heads == n_kv_heads && a->head_dim == head_dim &&
           a->fp8 == fp8;
}

const void *cuda_arena_data(const cuda_arena *a) { return a->data; }

void cuda_arena_get_stats(const cuda_arena *a, cuda_arena_stats *out) {
    *out = a->stats;
    out->pages_used = a->n_pages - (int64_t)a->free_pages.size();
    out->records = (int64_t)a->by_id.size();
}

/* Staging elements of a record (keys and values), its start kept 16-byte
 * aligned for the scatter's vector loads. */
static size_t staged_elems(const cuda_arena *a, int32_t n_tokens) {
    return ((size_t)2 * a->n_layers * n_tokens * a->kv_dim + 127) & ~(size_t)127;
}

static void drop_record(cuda_arena *a, int32_t ri) {
    record &r = a->recs[(size_t)ri];
    for (int32_t p : r.pages) a->free_pages.push_back(p);
    a->pinned_pages -= r.pins > 0 ? (int64_t)r.pages.size() : 0;
    r.pins = 0;
    r.queued = false;
    r.pages.clear();
    if (r.id) a->by_id.erase(r.id);
    r.id = 0;
    a->free_recs.push_back(ri);
}

/* Frees pages until `need` are free, least recently used first, sparing the
 * records of the current call. */
static bool make_room(cuda_arena *a, size_t need) {
    while (a->free_pages.size() < need) {
        int32_t victim = -1;
        uint64_t oldest = a->call; /* records of this call are not candidates */
        for (size_t i = 0; i < a->recs.size(); i++) {
            const record &r = a->recs[i];
            if (r.id && r.pins == 0 && r.stamp < oldest) {
                oldest = r.stamp;
                victim = (int32_t)i;
            }
        }
        if (victim < 0) return false; /* all the rest are in use */
        drop_record(a, victim);
        a->stats.evictions++;
    }
    return true;
}

static is_status grow(void **buf, size_t *cap, size_t bytes, cudaStream_t s) {
    if (bytes <= *cap) return IS_OK;
    CUDA_CHECK(cudaStreamSynchronize(s)); /* queued fills may still read it */
    CUDA_CHECK(cudaFree(*buf));
    *buf = NULL;
    *cap = 0;
    CUDA_CHECK(cudaMalloc(buf, bytes));
    *cap = bytes;
    return IS_OK;
}

/* Copies one record from the host into its pages. */
static is_status fill(cuda_arena *a, cudaStream_t s, const backend_fact *f,
                      const std::vector<int32_t> &pages) {
    const size_t n = (size_t)a->n_layers * f->n_tokens * a->kv_dim;
    is_status st = grow((void **)&a->staging, &a->staging_cap, 2 * n * sizeof(float), s);
    if (st == IS_OK)
        st = grow((void **)&a->dpages, &a->dpages_cap, pages.size() * sizeof(int32_t), s);
    if (st != IS_OK) return st;
    /* From pageable memory: each copy is staged before it returns, and
     * lands after the work queued before it (so after earlier fills). */
    CUDA_CHECK(cudaMemcpyAsync(a->staging, f->k, n * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a->staging + n, f->v, n * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a->dpages, pages.data(), pages.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, s));
    a->stats.bytes_uploaded += (int64_t)(2 * n * sizeof(float));
    return cuda_arena_fill(s, a->data, a->dpages, a->staging, a->staging + n, f->n_tokens,
                           a->n_layers, a->n_kv_heads, a->head_dim, a->fp8);
}

is_status cuda_arena_place(cuda_arena *a, cudaStream_t s, const backend_fact *facts,
                           int32_t n_facts, int32_t *pages, int32_t *n_placed) {
    *n_placed = 0;
    if (!a->queue.empty())
        return is_error_set(IS_ERR_INTERNAL,
                            "cuda arena: a place before its prefetches were staged");
    a->call++;
    /* Claim this call's resident records first, so room made for a miss
     * early in the list never evicts a hit later in it (whose values the
     * caller may have left out: cuda_arena_holds); the second pass takes
     * them from here rather than looking them up again. */
    a->claimed.assign((size_t)n_facts, -1);
    for (int32_t i = 0; i < n_facts; i++) {
        if (!facts[i].id) continue;
        auto it = a->by_id.find(facts[i].id);
        if (it == a->by_id.end()) continue;
        record &r = a->recs[(size_t)it->second];
        if (r.n_tokens != facts[i].n_tokens) continue;
        r.stamp = a->call;
        a->claimed[(size_t)i] = it->second;
    }
    std::vector<int32_t> transient; /* records of id 0, dropped after this call */
    is_status st = IS_OK;
    size_t at = 0;
    for (int32_t i = 0; i < n_facts && st == IS_OK; i++) {
        const backend_fact *f = &facts[i];
        int32_t ri = a->claimed[(size_t)i];
        /* A claim still holds unless an earlier fact of this call with the
         * same id and another length replaced its record. */
        if (ri >= 0 &&
            (a->recs[(size_t)ri].id != f->id || a->recs[(size_t)ri].n_tokens != f->n_tokens))
            ri = -1;
        if (ri < 0 && f->id) {
            auto it = a->by_id.find(f->id);
            if (it != a->by_id.end()) {
                ri = it->second;
                if (a->recs[(size_t)ri].n_tokens != f->n_tokens) { /* not the same content */
                    drop_record(a, ri);
                    ri = -1;
                }
            }
        }
        if (ri >= 0) {
            a->recs[(size_t)ri].stamp = a->call;
            a->stats.hits++;
        } else {
            bool room = make_room(a, (size_t)f->n_tokens);
            if (!room && i == 0) {
                /* Nothing placed yet, and hits further down the list hold
                 * the pages: those that came with their values can be
                 * filled again when their turn comes, so they give up
                 * their claim (without this a list longer than the arena
                 * whose tail is resident never makes progress). */
                for (int32_t j = 1; j < n_facts; j++) {
                    const int32_t rj = a->claimed[(size_t)j];
                    if (rj < 0 || !facts[j].k || !facts[j].v) continue;
                    a->recs[(size_t)rj].stamp = a->call - 1;
                    a->claimed[(size_t)j] = -1;
                }
                for (int32_t j = 1; j < n_facts; j++) /* the same record, named without values */
                    if (a->claimed[(size_t)j] >= 0)
                        a->recs[(size_t)a->claimed[(size_t)j]].stamp = a->call;
                room = make_room(a, (size_t)f->n_tokens);
            }
            if (!room) {
                /* The rest of the list waits for the next call, in which
                 * the records placed so far may be evicted: their
                 * injection is queued on s before any fill that reuses
                 * their pages. */
                if (i > 0) break;
                st = is_error_set(IS_ERR_NOMEM,
                                  "cuda arena: %d pages do not hold the facts of one request "
                                  "(a fact of %d tokens; %lld pages free, %lld pinned by "
                                  "prefetches; backend_cuda_set_arena_bytes)",
                                  (int)a->n_pages, (int)f->n_tokens,
                                  (long long)a->free_pages.size(), (long long)a->pinned_pages);
                break;
            }
            if (a->free_recs.empty()) {
                a->recs.emplace_back();
                a->free_recs.push_back((int32_t)a->recs.size() - 1);
            }
            ri = a->free_recs.back();
            a->free_recs.pop_back();
            record &r = a->recs[(size_t)ri];
            r.id = f->id;
            r.n_tokens = f->n_tokens;
            r.stamp = a->call;
            r.pages.assign(a->free_pages.end() - f->n_tokens, a->free_pages.end());
            a->free_pages.resize(a->free_pages.size() - (size_t)f->n_tokens);
            if (f->id) {
                a->by_id[f->id] = ri;
            } else {
                transient.push_back(ri);
            }
            a->stats.misses++;
            if (!f->k || !f->v)
                st = is_error_set(
                    IS_ERR_INVALID_ARG,
                    "cuda arena: fact %d (id %016llx) is not resident and has no values", (int)i,
                    (unsigned long long)f->id);
            else st = fill(a, s, f, r.pages);
            if (st != IS_OK) {
                /* Never leave a record that was not filled (a transient one
                 * is dropped here, not again after the loop). */
                if (!f->id) transient.pop_back();
                drop_record(a, ri);
                break;
            }
        }
        if (st == IS_OK) {
            const record &r = a->recs[(size_t)ri];
            for (int32_t p : r.pages) pages[at++] = p;
            *n_placed = i + 1;
        }
    }
    for (int32_t ri : transient) drop_record(a, ri);
    return st;
}

bool cuda_arena_holds(const cuda_arena *a, uint64_t id, int32_t n_tokens) {
    if (!id) return false;
    auto it = a->by_id.find(id);
    return it != a->by_id.end() && a->recs[(size_t)it->second].n_tokens == n_tokens;
}

is_status cuda_arena_prefetch(cuda_arena *a, const backend_fact_host *f, bool *pinned) {
    *pinned = false;
    if (!f->id || f->n_tokens <= 0 || f->n_layers != a->n_layers ||
        f->n_kv_heads != a->n_kv_heads || f->head_dim != a->head_dim)
        return IS_OK;
    auto it = a->by_id.find(f->id);
    if (it != a->by_id.end()) {
        record &r = a->recs[(size_t)it->second];
        if (r.n_tokens == f->n_tokens) {
            /* A queued record's copy reads host memory its first caller
             * holds: a caller holding none (pin only) or other memory (a
             * record of the same content under another id) must not
             * outlive it, as the copy would read what replaced it. */
            if (r.queued && (f->k != r.hk || f->v != r.hv)) return IS_OK;
            /* Pins hold at most half the pages, hits as misses: the rest
             * is what a place makes room in. */
            if (r.pins == 0 && a->pinned_pages + r.n_tokens > a->n_pages / 2) return IS_OK;
            if (r.pins++ == 0) a->pinned_pages += r.n_tokens;
            a->stats.prefetch_hits++;
            *pinned = true;
            return IS_OK;
        }
    }
    /* The scatter writes bf16 pages: an fp8 arena is filled by injections. */
    if (!f->k || !f->v || a->fp8) return IS_OK;
    if (a->pinned_pages + f->n_tokens > a->n_pages / 2) return IS_OK; /* the place's half */
    if (staged_elems(a, f->n_tokens) * 2 > a->staging_max) return IS_OK;
    if (it != a->by_id.end()) {
        if (a->recs[(size_t)it->second].pins > 0) return IS_OK; /* another length, in use */
        drop_record(a, it->second);
    }
    /* Records of the latest place stay too (make_room spares its stamp).
     * The pages freed here may still be read by injections queued on the
     * caller's stream: the scatter that rewrites them runs there after. */
    if (!make_room(a, (size_t)f->n_tokens)) return IS_OK;
    if (a->free_recs.empty()) {
        a->recs.emplace_back();
        a->free_recs.push_back((int32_t)a->recs.size() - 1);
    }
    const int32_t ri = a->free_recs.back();
    a->free_recs.pop_back();
    record &r = a->recs[(size_t)ri];
    r.id = f->id;
    r.n_tokens = f->n_tokens;
    r.stamp = a->call;
    r.pins = 1;
    r.queued = true;
    r.hk = f->k;
    r.hv = f->v;
    r.dtype = f->dtype;
    r.pages.assign(a->free_pages.end() - f->n_tokens, a->free_pages.end());
    a->free_pages.resize(a->free_pages.size() - (size_t)f->n_tokens);
    a->by_id[f->id] = ri;
    a->pinned_pages += f->n_tokens;
    a->queue.push_back({ri, f->id});
    a->stats.prefetch_misses++;
    a->stats.bytes_uploaded += (int64_t)2 * a->n_layers * f->n_tokens * a->kv_dim * 2;
    *pinned = true;
    return IS_OK;
}

void cuda_arena_unpin(cuda_arena *a, uint64_t id) {
    auto it = a->by_id.find(id);
    if (it == a->by_id.end()) return;
    record &r = a->recs[(size_t)it->second];
    if (r.pins > 0 && --r.pins == 0) {
        a->pinned_pages -= r.n_tokens;
        /* Given up before its copy started: its host rows are the caller's
         * again, so the copy never will. */
        if (r.queued) drop_record(a, it->second);
    }
}

static is_status send_groups(cuda_arena *a, int32_t last);

void cuda_arena_wait_uploads(cuda_arena *a) {
    if (!a || !a->up) return;
    /* A staged batch's later groups, not queued yet, would read the host
     * memory after this returns (the caller's cue to reuse it). */
    if (a->landed < CUDA_ARENA_GROUPS && send_groups(a, CUDA_ARENA_GROUPS - 1) != IS_OK) {
        is_error_clear();
        /* The caller reuses the rows once this returns: a later send
         * would copy whatever replaced them. Landing fails instead. */
        a->sent = CUDA_ARENA_GROUPS;
        a->unsent = true;
    }
    cudaStreamSynchronize(a->up);
}

void cuda_arena_group(const cuda_arena *a, int32_t g, int32_t *l0, int32_t *l1) {
    *l0 = (int32_t)((int64_t)a->n_layers * g / CUDA_ARENA_GROUPS);
    *l1 = (int32_t)((int64_t)a->n_layers * (g + 1) / CUDA_ARENA_GROUPS);
}

int32_t cuda_arena_group_of(int32_t n_layers, int32_t l) {
    /* The last g whose first layer, n_layers * g / GROUPS, is at most l. */
    int32_t g = CUDA_ARENA_GROUPS - 1;
    while (g > 0 && (int64_t)n_layers * g / CUDA_ARENA_GROUPS > l) g--;
    return g;
}

static is_status grow_staging(cuda_arena *a, size_t elems, size_t n_toks) {
    if (elems <= a->rec_staging_cap && n_toks <= a->dtoks_cap) return IS_OK;
    /* The copies and scatters of the batch before may still use them. */
    CUDA_CHECK(cudaStreamSynchronize(a->up));
    CUDA_CHECK(cudaEventSynchronize(a->ev_free));
    if (elems > a->rec_staging_cap) {
        size_t cap = STAGING_MIN_BYTES / 2;
        while (cap < elems) cap *= 2;
        if (cap > a->staging_max / 2) cap = a->staging_max / 2;
        if (cap < elems) cap = elems;
        CUDA_CHECK(cudaFree(a->rec_staging));
        a->rec_staging = NULL;
        a->rec_staging_cap = 0;
        CUDA_CHECK(cudaMalloc(&a->rec_staging, cap * 2));
        a->rec_staging_cap = cap;
    }
    if (n_toks > a->dtoks_cap) {
        size_t cap = n_toks < 4096 ? 4096 : 2 * n_toks;
        CUDA_CHECK(cudaFree(a->dtoks));
        a->dtoks = NULL;
        a->dtoks_cap = 0;
        CUDA_CHECK(cudaMalloc(&a->dtoks, cap * sizeof(cuda_upload_token)));
        a->dtoks_cap = cap;
    }
    return IS_OK;
}

/* Queues the copies of groups [sent, last] of the staged batch on `up`:
 * every record's layers of a group before any record's next group. */
static is_status send_groups(cuda_arena *a, int32_t last) {
    for (; a->sent <= last && a->sent < CUDA_ARENA_GROUPS; a->sent++) {
        int32_t l0, l1;
        cuda_arena_group(a, a->sent, &l0, &l1);
        size_t off = 0;
        for (const staged_rec &r : a->batch) {
            const size_t row = (size_t)r.n_tokens * a->kv_dim; /* a layer's elements */
            const size_t half = (size_t)a->n_layers * row;
            const size_t bytes = (size_t)(l1 - l0) * row * 2;
            if (bytes) {
                CUDA_CHECK(cudaMemcpyAsync(a->rec_staging + off + l0 * row,
                                           (const uint16_t *)r.hk + l0 * row, bytes,
                                           cudaMemcpyHostToDevice, a->up));
                CUDA_CHECK(cudaMemcpyAsync(a->rec_staging + off + half + l0 * row,
                                           (const uint16_t *)r.hv + l0 * row, bytes,
                                           cudaMemcpyHostToDevice, a->up));
            }
            off += staged_elems(a, r.n_tokens);
        }
        CUDA_CHECK(cudaEventRecord(a->ev_group[a->sent], a->up));
    }
    return IS_OK;
}

/* Lays out the batch's records one after another in the staging and
 * queues the copy of the first layer group. The later groups are queued
 * once the forward has queued its own small uploads (cuda_arena_send): the
 * copy engine takes host-to-device copies in the order they were queued,
 * whatever their stream, so a forward whose inputs were queued behind the
 * whole batch would wait for all of it before its first layer. */
static is_status copy_batch(cuda_arena *a, std::vector<int32_t> &batch) {
    a->toks.clear();
    a->batch.clear(); /* the batch before was all sent (it landed) */
    size_t at = 0;
    for (int32_t ri : batch) {
        const record &r = a->recs[(size_t)ri];
        for (int32_t j = 0; j < r.n_tokens; j++)
            a->toks.push_back({(int64_t)at, r.n_tokens, j, r.pages[(size_t)j], r.dtype == 1});
        a->batch.push_back({r.hk, r.hv, r.n_tokens});
        at += staged_elems(a, r.n_tokens);
    }
    is_status st = grow_staging(a, at, a->toks.size());
    if (st != IS_OK) return st;
    /* The batch before has landed (ev_free) before its staging is rewritten. */
    CUDA_CHECK(cudaStreamWaitEvent(a->up, a->ev_free, 0));
    CUDA_CHECK(cudaMemcpyAsync(a->dtoks, a->toks.data(), a->toks.size() * sizeof(cuda_upload_token),
                               cudaMemcpyHostToDevice, a->up));
    a->landed = 0;
    a->sent = 0;
    a->unsent = false;
    a->stats.staged_batches++;
    return send_groups(a, 0);
}

is_status cuda_arena_send(cuda_arena *a) {
    return a->landed < CUDA_ARENA_GROUPS ? send_groups(a, CUDA_ARENA_GROUPS - 1) : IS_OK;
}

is_status cuda_arena_stage(cuda_arena *a, cudaStream_t s, bool *staged) {
    *staged = false;
    if (a->landed < CUDA_ARENA_GROUPS)
        return is_error_set(IS_ERR_INTERNAL, "cuda arena: a stage before the last one landed");
    std::vector<int32_t> batch;
    size_t elems = 0;
    is_status st = IS_OK;
    for (size_t q = 0; q < a->queue.size() && st == IS_OK; q++) {
        const queued_ref &qr = a->queue[q];
        record &r = a->recs[(size_t)qr.ri];
        if (r.id != qr.id || !r.queued) continue; /* dropped meanwhile */
        const size_t e = staged_elems(a, r.n_tokens);
        if (!batch.empty() && (elems + e) * 2 > a->staging_max) {
            /* What the staging cannot hold at once lands now, in parts. */
            st = copy_batch(a, batch);
            for (int32_t g = 0; g < CUDA_ARENA_GROUPS && st == IS_OK; g++)
                st = cuda_arena_land(a, s, g);
            batch.clear();
            elems = 0;
        }
        r.queued = false;
        batch.push_back(qr.ri);
        elems += e;
    }
    a->queue.clear();
    if (st == IS_OK && !batch.empty()) {
        st = copy_batch(a, batch);
        *staged = st == IS_OK;
    }
    return st;
}

is_status cuda_arena_land(cuda_arena *a, cudaStream_t s, int32_t g) {
    if (a->landed != g || g >= CUDA_ARENA_GROUPS)
        return is_error_set(IS_ERR_INTERNAL, "cuda arena: group %d landed out of order", (int)g);
    if (a->unsent)
        return is_error_set(IS_ERR_INTERNAL, "cuda arena: a staged batch's copies were not queued");
    int32_t l0, l1;
    cuda_arena_group(a, g, &l0, &l1);
    is_status sent = send_groups(a, g);
    if (sent != IS_OK) return sent;
    CUDA_CHECK(cudaStreamWaitEvent(s, a->ev_group[g], 0));
    is_status st = cuda_upload_scatter(s, (__nv_bfloat16 *)a->data, a->rec_staging, a->dtoks,
                                       (int32_t)a->toks.size(), l0, l1, a->n_layers, a->kv_dim);
    if (st != IS_OK) return st;
    a->landed = g + 1;
    if (a->landed == CUDA_ARENA_GROUPS) CUDA_CHECK(cudaEventRecord(a->ev_free, s));
    return IS_OK;
}

/*
 * dense_gpu: per-user fact matrices on the GPU and the search that uses
 * them (see dense_gpu.h for the contract and docs/notes/cuda-diary.md,
 * "GPU retrieval", for what crosses PCIe).
 *
 * Layout. (tenant, user) -> a partition: a device matrix whose row r
 * holds the embedding of fact ids[r], and map: id -> r. A removal moves
 * the last row into the hole (the matrix does the same), so rows stay
 * dense. During a bulk load new rows are staged on the host after the
 * device's: rows [count, n) of ids[] are in staged[], uploaded by a flush
 * in one copy (they are consecutive rows).
 */
#include "memory/dense_gpu.h"

#include "backend/retrieval.h"
#include "core/status.h"
#include "memory/strmap.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The backend whose device holds the matrices: the one that implements
 * backend/retrieval.h. */
#define DG_BACKEND "cuda"

/* Staged rows (all users) that trigger a flush: 1.5 MB at dim 384. */
#define DG_STAGE_MAX 4096

typedef struct dg_part {
    char *key; /* tenant '\0' user, owned; the partition map's key */
    size_t key_len;
    retrieval_matrix *mat; /* rows [0, n - n_staged) */
    char **ids;            /* [cap] row -> fact id, owned; the id map's keys */
    int32_t n, cap;        /* rows named: on the device, then staged */
    strmap map;            /* fact id -> row */
    float *staged;         /* [cap_staged][dim]: rows n - n_staged .. n - 1 */
    int32_t n_staged, cap_staged;
    bool stale; /* rows may not match the facts: searched on the CPU */
} dg_part;

struct dense_gpu {
    const retrieval_ops *ops; /* the device's retrieval calls */
    embedder *emb;            /* the embedder's device copy */
    int32_t device, dim;
    float *q_dev;       /* device [dim]: the query of the search under way */
    pthread_mutex_t mu; /* everything below, and all device work */
    strmap parts;       /* partition key -> index in part[] */
    dg_part **part;     /* [cap_part] */
    int32_t n_part, cap_part;
    int64_t n_staged; /* all partitions */
    int64_t searches, declined;
    int32_t idx[RETRIEVAL_TOPK_MAX]; /* a search's rows and scores */
    float score[RETRIEVAL_TOPK_MAX];
};

/* ---- partitions ----------------------------------------------------------- */

static void part_free(const dense_gpu *g, dg_part *p) {
    if (!p) return;
    g->ops->matrix_free(p->mat);
    for (int32_t i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    strmap_free(&p->map);
    free(p->staged);
    free(p->key);
    free(p);
}

static int32_t part_count(const dg_part *p) { return p->n - p->n_staged; }

/* "tenant\0user" into buf[cap]; false when it does not fit. */
static bool part_key(const char *tenant, const char *user, char *buf, size_t cap, size_t *len) {
    size_t lt = strlen(tenant), lu = strlen(user);
    if (lt + lu + 2 > cap) return false;
    memcpy(buf, tenant, lt + 1);
    memcpy(buf + lt + 1, user, lu + 1);
    *len = lt + 1 + lu;
    return true;
}

/* The partition of (tenant, user): NULL when absent and !create, or when
 * creating it fails (status in *st). */
static dg_part *part_get(dense_gpu *g, const char *tenant, const char *user, bool create,
                         is_status *st) {
    *st = IS_OK;
    size_t lt = strlen(tenant), lu = strlen(user), len = lt + 1 + lu;
    char small[256], *key = len + 1 <= sizeof small ? small : malloc(len + 1);
    if (!key) {
        *st = is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
        return NULL;
    }
    part_key(tenant, user, key, len + 1, &len);
    int64_t v;
    dg_part *p = NULL;
    if (strmap_get(&g->parts, key, len, &v)) {
        p = g->part[v];
    } else if (create) {
        if ((*st = strmap_reserve(&g->parts, 1)) != IS_OK) goto out;
        if (g->n_part == g->cap_part) {
            int32_t cap = g->cap_part ? g->cap_part * 2 : 16;
            dg_part **a = realloc(g->part, sizeof *a * (size_t)cap);
            if (!a) {
                *st = is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
                goto out;
            }
            g->part = a;
            g->cap_part = cap;
        }
        p = calloc(1, sizeof *p);
        if (!p || !(p->key = malloc(len + 1))) {
            free(p);
            p = NULL;
            *st = is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
            goto out;
        }
        memcpy(p->key, key, len + 1);
        p->key_len = len;
        if ((*st = g->ops->matrix_create(g->device, g->dim, &p->mat)) != IS_OK) {
            part_free(g, p);
            p = NULL;
            goto out;
        }
        g->part[g->n_part] = p;
        strmap_put(&g->parts, p->key, len, g->n_part++);
    }
out:
    if (key != small) free(key);
    return p;
}

/* Uploads p's staged rows. On failure they are dropped and p is stale. */
static is_status part_flush(dense_gpu *g, dg_part *p) {
    if (p->n_staged == 0) return IS_OK;
    const int32_t first = part_count(p), n = p->n_staged;
    int32_t *rows = malloc(sizeof *rows * (size_t)n);
    is_status st = rows ? IS_OK : is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
    for (int32_t i = 0; st == IS_OK && i < n; i++) rows[i] = first + i;
    if (st == IS_OK) st = g->ops->matrix_set_rows(p->mat, rows, n, p->staged);
    free(rows);
    if (st != IS_OK) {
        for (int32_t r = first; r < p->n; r++) {
            strmap_del(&p->map, p->ids[r], strlen(p->ids[r]));
            free(p->ids[r]);
        }
        p->n = first;
        p->stale = true;
    }
    p->n_staged = 0;
    g->n_staged -= n;
    return st;
}

static is_status flush_all(dense_gpu *g) {
    is_status first = IS_OK;
    for (int32_t i = 0; i < g->n_part; i++) {
        is_status st = part_flush(g, g->part[i]);
        if (st != IS_OK && first == IS_OK) first = st;
    }
    return first;
}

/* Room for one more row in ids[] and staged[]. */
static is_status part_reserve(dense_gpu *g, dg_part *p) {
    if (p->n == INT32_MAX - 1) return is_error_set(IS_ERR_NOMEM, "dense_gpu: too many facts");
    if (p->n == p->cap) {
        int32_t cap = p->cap ? (p->cap > INT32_MAX / 2 ? INT32_MAX - 1 : p->cap * 2) : 16;
        char **a = realloc(p->ids, sizeof *a * (size_t)cap);
        if (!a) return is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
        p->ids = a;
        p->cap = cap;
    }
    if (p->n_staged == p->cap_staged) {
        int32_t cap = p->cap_staged ? p->cap_staged * 2 : 16;
        float *s = realloc(p->staged, sizeof *s * (size_t)cap * (size_t)g->dim);
        if (!s) return is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
        p->staged = s;
        p->cap_staged = cap;
    }
    return strmap_reserve(&p->map, 1);
}

/* dense_gpu_stage under the lock. */
static is_status stage_locked(dense_gpu *g, const char *tenant, const char *user, const char *id,
                              const float *e, dg_part **out) {
    if (!tenant || !user || !id || !*id || !e)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "dense_gpu: a fact needs tenant, user, id and embedding");
    for (int32_t j = 0; j < g->dim; j++)
        if (!isfinite(e[j]))
            return is_error_set(IS_ERR_INVALID_ARG, "dense_gpu: embedding[%d] is not finite",
                                (int)j);
    is_status st;
    dg_part *p = part_get(g, tenant, user, true, &st);
    if (!p) return st;
    *out = p;
    if (p->stale) return IS_OK; /* searched on the CPU from now on */
    const size_t dim = (size_t)g->dim;
    int64_t v;
    if (strmap_get(&p->map, id, strlen(id), &v)) {
        const int32_t r = (int32_t)v;
        if (r >= part_count(p)) { /* staged: replace there */
            memcpy(p->staged + (size_t)(r - part_count(p)) * dim, e, dim * sizeof(float));
            return IS_OK;
        }
        if ((st = g->ops->matrix_set_rows(p->mat, &r, 1, e)) != IS_OK) p->stale = true;
        return st;
    }
    if ((st = part_reserve(g, p)) != IS_OK) return st;
    char *copy = strdup(id);
    if (!copy) return is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
    memcpy(p->staged + (size_t)p->n_staged * dim, e, dim * sizeof(float));
    p->ids[p->n] = copy;
    strmap_put(&p->map, copy, strlen(copy), p->n);
    p->n++;
    p->n_staged++;
    g->n_staged++;
    return g->n_staged >= DG_STAGE_MAX ? flush_all(g) : IS_OK;
}

/* ---- create / free -------------------------------------------------------- */

is_status dense_gpu_create(const embedder *emb, int32_t device, dense_gpu **out) {
    if (!emb || !out) return is_error_set(IS_ERR_INVALID_ARG, "dense_gpu_create: NULL argument");
    dense_gpu *g = calloc(1, sizeof *g);
    if (!g) return is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
    pthread_mutex_init(&g->mu, NULL);
    g->device = device;
    is_status st = retrieval_backend_get(DG_BACKEND, &g->ops);
    if (st == IS_OK) st = embedder_create_on(emb, DG_BACKEND, device, &g->emb);
    if (st == IS_OK) {
        g->dim = embedder_dim(g->emb);
        /* A first matrix checks the top-k kernels can run on the device
         * too, so that a user's first fact cannot be the one to find out. */
        retrieval_matrix *probe = NULL;
        st = g->ops->matrix_create(device, g->dim, &probe);
        g->ops->matrix_free(probe);
    }
    if (st == IS_OK) st = g->ops->vector_alloc(device, g->dim, &g->q_dev);
    if (st != IS_OK) {
        dense_gpu_free(g);
        return st;
    }
    *out = g;
    return IS_OK;
}

void dense_gpu_free(dense_gpu *g) {
    if (!g) return;
    for (int32_t i = 0; i < g->n_part; i++) part_free(g, g->part[i]);
    free(g->part);
    strmap_free(&g->parts);
    if (g->ops) g->ops->vector_free(g->device, g->q_dev);
    embedder_free(g->emb);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

/* ---- writes --------------------------------------------------------------- */

is_status dense_gpu_stage(dense_gpu *g, const char *tenant, const char *user, const char *id,
                          const float *embedding) {
    pthread_mutex_lock(&g->mu);
    dg_part *p = NULL;
    is_status st = stage_locked(g, tenant, user, id, embedding, &p);
    pthread_mutex_unlock(&g->mu);
    return st;
}

is_status dense_gpu_flush(dense_gpu *g) {
    pthread_mutex_lock(&g->mu);
    is_status st = flush_all(g);
    pthread_mutex_unlock(&g->mu);
    return st;
}

is_status dense_gpu_put(dense_gpu *g, const char *tenant, const char *user, const char *id,
                        const float *embedding) {
    pthread_mutex_lock(&g->mu);
    dg_part *p = NULL;
    is_status st = stage_locked(g, tenant, user, id, embedding, &p);
    if (st == IS_OK) st = part_flush(g, p);
    pthread_mutex_unlock(&g->mu);
    return st;
}

is_status dense_gpu_remove(dense_gpu *g, const char *tenant, const char *user, const char *id) {
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "dense_gpu_remove: NULL argument");
    pthread_mutex_lock(&g->mu);
    is_status st;
    int64_t v;
    dg_part *p = part_get(g, tenant, user, false, &st);
    if (st != IS_OK || (p && p->stale)) goto out;
    if (!p || !strmap_get(&p->map, id, strlen(id), &v)) {
        st = is_error_set(IS_ERR_NOT_FOUND, "dense_gpu: no fact \"%.80s\"", id);
        goto out;
    }
    if ((st = part_flush(g, p)) != IS_OK) goto out; /* the row must be on the device */
    const int32_t r = (int32_t)v;
    int32_t moved = -1;
    if ((st = g->ops->matrix_remove_row(p->mat, r, &moved)) != IS_OK) {
        p->stale = true;
        goto out;
    }
    strmap_del(&p->map, p->ids[r], strlen(p->ids[r]));
    free(p->ids[r]);
    p->n--;
    if (moved >= 0) {
        IS_ASSERT(moved == p->n);
        p->ids[r] = p->ids[moved];
        strmap_put(&p->map, p->ids[r], strlen(p->ids[r]), r);
    }
out:
    pthread_mutex_unlock(&g->mu);
    return st;
}

/* ---- search --------------------------------------------------------------- */

typedef struct dg_cand {
    float score;
    int32_t row;
} dg_cand;

/* mem_index_search's order: score descending, then id bytewise. */
static int cmp_cand(const void *a, const void *b, void *ids_) {
    const dg_cand *x = a, *y = b;
    char *const *ids = ids_;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return strcmp(ids[x->row], ids[y->row]);
}

/* The `want` best rows of p for the query in g->q_dev, in the CPU index's
 * order, into c[0..want) (room for RETRIEVAL_TOPK_MAX). *decided = false when a
 * tie run at the cut runs past what the device can return. */
static is_status dense_list(dense_gpu *g, dg_part *p, int32_t want, dg_cand *c, bool *decided) {
    const int32_t count = part_count(p);
    IS_ASSERT(want > 0 && want < RETRIEVAL_TOPK_MAX && want <= count);
    int32_t fetch = want < count ? want + 1 : count;
    *decided = false;
    for (;;) {
        int32_t got = 0;
        is_status st = g->ops->matrix_search(p->mat, g->q_dev, fetch, g->idx, g->score, &got);
        if (st != IS_OK) return st;
        IS_ASSERT(got == fetch);
        for (int32_t i = 0; i < got; i++) c[i] = (dg_cand){g->score[i], g->idx[i]};
        qsort_r(c, (size_t)got, sizeof *c, cmp_cand, p->ids);
        /* Everything came back, or the cut falls between two scores: no
         * row left on the device scores above c[got - 1] (the device
         * orders the f64 scores; rounding them is monotone). */
        if (got == count || c[want - 1].score > c[got - 1].score) {
            *decided = true;
            return IS_OK;
        }
        if (fetch == RETRIEVAL_TOPK_MAX) return IS_OK;
        int64_t next = 2 * (int64_t)fetch > fetch + 64 ? 2 * (int64_t)fetch : fetch + 64;
        if (next > count) next = count;
        if (next > RETRIEVAL_TOPK_MAX) next = RETRIEVAL_TOPK_MAX;
        fetch = (int32_t)next;
    }
}

/* Fills the dense score of the hybrid hits the fusion left without one
 * (BM25 hits outside the dense list) from the device. */
static is_status fill_dense(dense_gpu *g, dg_part *p, mem_hit *hits, int32_t n) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!isnan(hits[i].dense)) continue;
        int64_t v;
        /* A fact the index has and the device not (a write under way)
         * cannot be scored: 0. */
        if (!p || !strmap_get(&p->map, hits[i].id, strlen(hits[i].id), &v) || v >= part_count(p)) {
            hits[i].dense = 0.0f;
            continue;
        }
        g->idx[m++] = (int32_t)v;
    }
    if (m == 0) return IS_OK;
    is_status st = g->ops->matrix_score_rows(p->mat, g->q_dev, g->idx, m, g->score);
    if (st != IS_OK) return st;
    m = 0;
    for (int32_t i = 0; i < n; i++)
        if (isnan(hits[i].dense)) hits[i].dense = g->score[m++];
    return IS_OK;
}

is_status dense_gpu_search(dense_gpu *g, mem_index *ix, const mem_filter *f, const char *query,
                           int32_t k, mem_search_mode mode, mem_hit *out, int32_t *n_out,
                           bool *handled) {
    if (!g || !ix || !handled)
        return is_error_set(IS_ERR_INVALID_ARG, "dense_gpu_search: NULL argument");
    *handled = false;
    if (!f || !f->tenant || !f->user || !query || k < 0)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "dense_gpu_search: needs tenant, user, a query and k >= 0");
    const int32_t depth = mode == MEM_SEARCH_HYBRID && k < MEM_HYBRID_DEPTH ? MEM_HYBRID_DEPTH : k;
    pthread_mutex_lock(&g->mu);
    if (mode == MEM_SEARCH_BM25 || f->agent_id || f->run_id || f->n_meta != 0 ||
        depth >= RETRIEVAL_TOPK_MAX) {
        g->declined++;
        pthread_mutex_unlock(&g->mu);
        return IS_OK;
    }
    is_status st;
    dg_part *p = part_get(g, f->tenant, f->user, false, &st);
    dg_cand *c = NULL;
    const char **ids = NULL;
    float *scores = NULL;
    int32_t n_list = 0;
    if (st != IS_OK) goto out;
    if (p && p->stale) {
        g->declined++;
        goto out;
    }
    if (p && (st = part_flush(g, p)) != IS_OK) goto out;
    const int32_t count = p ? part_count(p) : 0;
    const int32_t want = k == 0 ? 0 : depth < count ? depth : count;
    if (want > 0) {
        c = malloc(sizeof *c * RETRIEVAL_TOPK_MAX);
        ids = malloc(sizeof *ids * (size_t)want);
        scores = malloc(sizeof *scores * (size_t)want);
        if (!c || !ids || !scores) {
            st = is_error_set(IS_ERR_NOMEM, "dense_gpu: out of memory");
            goto out;
        }
        /* Only the query's token ids go up. */
        if ((st = embedder_embed_device(g->emb, &query, 1, g->q_dev)) != IS_OK) goto out;
        bool decided;
        if ((st = dense_list(g, p, want, c, &decided)) != IS_OK) goto out;
        if (!decided) {
            g->declined++;
            goto out;
        }
        for (int32_t i = 0; i < want; i++) {
            ids[i] = p->ids[c[i].row];
            scores[i] = c[i].score;
        }
        n_list = want;
    }
    /* BM25 and the fusion on the CPU, as mem_index_search runs them. */
    int32_t nh = 0;
    st = mem_index_search_dense_list(ix, f, ids, scores, n_list, query, k, mode, out, &nh);
    if (st == IS_OK && mode == MEM_SEARCH_HYBRID) st = fill_dense(g, p, out, nh);
    if (st == IS_OK) {
        *n_out = nh;
        *handled = true;
        g->searches++;
    }
out:
    pthread_mutex_unlock(&g->mu);
    free(c);
    free(ids);
    free(scores);
    return st;
}

/* ---- inspection ----------------------------------------------------------- */

void dense_gpu_get_stats(dense_gpu *g, dense_gpu_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&g->mu);
    for (int32_t i = 0; i < g->n_part; i++) {
        out->facts += g->part[i]->n;
        out->stale_users += g->part[i]->stale;
    }
    out->searches = g->searches;
    out->declined = g->declined;
    pthread_mutex_unlock(&g->mu);
}

bool dense_gpu_has(dense_gpu *g, const char *tenant, const char *user, const char *id) {
    pthread_mutex_lock(&g->mu);
    is_status st;
    int64_t v;
    dg_part *p = part_get(g, tenant, user, false, &st);
    bool has = p && !p->stale && strmap_get(&p->map, id, strlen(id), &v) && v < part_count(p);
    pthread_mutex_unlock(&g->mu);
    return has;
}

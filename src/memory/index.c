/*
 * index: per-user exact dense top-k, BM25 and RRF fusion over facts (see
 * index.h for the contract).
 *
 * Layout. The index maps (tenant, user) to a partition and every fact id to
 * (partition, row). A partition keeps its rows contiguous (a delete moves
 * the last row into the hole), in parallel arrays:
 *
 *   emb     [cap][stride_f] float32, the embeddings, zero-padded to a
 *           multiple of 8 floats (one AVX register)
 *   q8      [cap][stride_q] int8, the same rows quantised per row
 *           (v * q_scale[i] approximates emb[i]), padded to 32 bytes
 *   q_scale, q_err, norm  [cap]: the scale, an upper bound on the
 *           quantisation error ||emb[i] - q_scale[i] * q8[i]|| and one on
 *           ||emb[i]||
 *   rows    [cap]: id and filter fields; agent, run and metadata strings
 *           are interned per partition as small integers, so filtering a
 *           row compares integers
 *   bm25    the partition's inverted index (memory/bm25.h), rows aligned
 *
 * Exact dense top-k in two passes. For a query q (quantised the same way
 * to q^ = s_q * q8_q), the integer dot d_i = <q8_q, q8_i> gives
 * a_i = s_q * s_i * d_i = <q^, x^_i>, and
 *
 *   |<q, x_i> - a_i| <= ||q - q^|| ||x_i|| + ||q^|| ||x_i - x^_i|| (+ rounding)
 *
 * (write q.x - q^.x^ = (q - q^).x + q^.(x - x^), Cauchy-Schwarz), an error
 * bound B_i known per row. Pass 1 computes a_i for every row that passes
 * the filter (int8: a quarter of the float bytes, 32 products per
 * instruction) and keeps the depth-th largest lower bound a_i - B_i as L.
 * At least `depth` rows have a true score >= L, so every row of the true
 * top-depth has a true score >= L and thus an upper bound a_i + B_i >= L.
 * Pass 2 rescores just those rows with float32 dot products (the same
 * kernel for every row, so the scores are those a full scan would give)
 * and keeps the best in a heap. With random or real embeddings the band
 * around L holds a few dozen rows, so pass 2 costs nothing and the search
 * reads 1/4 of the bytes a float scan would: memory bandwidth is the limit
 * (100k x 384 floats are 154 MB; their int8 copy 38 MB).
 *
 * The rounding terms in B_i: the float32 rescoring dot has error at most
 * about (dim/32 + 6) ulp(1) * ||q|| ||x|| (FMA chains of dim/32 plus a
 * horizontal sum), the product s_q * s_i * d_i two roundings; we add
 * (dim + 16) * 1.2e-7 * ||q|| ||x|| + 1e-6 and scale the main term by
 * 1.001, which covers both with a wide margin.
 */
#include "memory/index.h"

#include "core/status.h"
#include "memory/bm25.h"
#include "memory/metadata.h"
#include "memory/strmap.h"

#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MEM_AVX2 1
#endif

/* ---- structures ----------------------------------------------------------- */

typedef struct mem_row {
    char *id;      /* owned; the id map's key */
    int32_t agent; /* symbol, or -1: none */
    int32_t run;   /* symbol, or -1: none */
    int32_t n_meta;
    int32_t *meta; /* [n_meta][2]: key symbol, value symbol; keys distinct */
} mem_row;

typedef struct mem_part {
    char *key; /* tenant '\0' user, owned; the partition map's key */
    size_t key_len;
    int32_t n, cap;
    float *emb;     /* [cap][stride_f] */
    int8_t *q8;     /* [cap][stride_q] */
    float *q_scale; /* [cap] */
    float *q_err;   /* [cap] */
    float *norm;    /* [cap] */
    mem_row *rows;  /* [cap] */
    strmap syms;    /* interned string -> symbol */
    char **sym;     /* [cap_sym] symbol -> string (owned) */
    int32_t n_sym, cap_sym;
    bm25_index *bm25;
} mem_part;

struct mem_index {
    int32_t dim;
    int32_t stride_f; /* dim rounded up to 8 */
    int32_t stride_q; /* dim rounded up to 32 */
    pthread_rwlock_t lock;
    strmap parts;    /* partition key -> index in part[] */
    mem_part **part; /* [cap_part] */
    int32_t n_part, cap_part;
    strmap ids; /* fact id -> (partition << 32) | row */
    int64_t n_docs;
};

static int64_t mem_pack(int32_t part, int32_t row) { return ((int64_t)part << 32) | (uint32_t)row; }
static int32_t mem_unpack_part(int64_t v) { return (int32_t)(v >> 32); }
static int32_t mem_unpack_row(int64_t v) { return (int32_t)(uint32_t)v; }

/* ---- kernels -------------------------------------------------------------- */

/* <a, b> over n floats, n a multiple of 8. */
static float mem_dot_f32(const float *a, const float *b, int32_t n) {
#ifdef MEM_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int32_t j = 0;
    for (; j + 32 <= n; j += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24), s3);
    }
    for (; j < n; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float s = 0.0f;
    for (int32_t j = 0; j < n; j++) s += a[j] * b[j];
    return s;
#endif
}

/* <x, q> over n int8 values (n a multiple of 32, values in [-127, 127]).
 * qabs = |q| is precomputed. */
static int32_t mem_dot_i8(const int8_t *x, const int8_t *q, const int8_t *qabs, int32_t n) {
#ifdef MEM_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
    int32_t j = 0;
    /* maddubs wants unsigned x signed: |q| times x with q's sign; pairs sum
     * to at most 2 * 127 * 127 < 32767, so nothing saturates. */
    for (; j + 64 <= n; j += 64) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + j));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + j + 32));
        __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + j));
        __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + j + 32));
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(qabs + j));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(qabs + j + 32));
        __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(x0, q0));
        __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(x1, q1));
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(p0, ones));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(p1, ones));
    }
    for (; j < n; j += 32) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + j));
        __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + j));
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(qabs + j));
        __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(x0, q0));
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(p0, ones));
    }
    __m256i s = _mm256_add_epi32(acc0, acc1);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(h);
#else
    (void)qabs;
    int32_t s = 0;
    for (int32_t j = 0; j < n; j++) s += (int32_t)x[j] * q[j];
    return s;
#endif
}

/* Rounds a non-negative double up to a float that is >= it. */
static float mem_round_up(double v) {
    float f = (float)v;
    return (double)f >= v ? f : nextafterf(f, INFINITY);
}

/* Quantises x[0..dim) to q[0..stride_q) (padding zeroed) with one scale;
 * gives upper bounds on ||x - scale * q|| and ||x||, and on ||scale * q||. */
static void mem_quantize(const float *x, int32_t dim, int32_t stride_q, int8_t *q, float *scale,
                         float *err, float *norm, float *qnorm) {
    float amax = 0.0f;
    for (int32_t j = 0; j < dim; j++) {
        const float v = fabsf(x[j]);
        if (v > amax) amax = v;
    }
    memset(q, 0, (size_t)stride_q);
    if (amax == 0.0f) {
        *scale = *err = *norm = 0.0f;
        if (qnorm) *qnorm = 0.0f;
        return;
    }
    const float s = amax / 127.0f;
    double e2 = 0.0, n2 = 0.0, qn2 = 0.0;
    for (int32_t j = 0; j < dim; j++) {
        float v = rintf(x[j] / s);
        v = fminf(fmaxf(v, -127.0f), 127.0f);
        q[j] = (int8_t)v;
        const double deq = (double)s * v; /* exact: float times small integer */
        e2 += ((double)x[j] - deq) * ((double)x[j] - deq);
        n2 += (double)x[j] * x[j];
        qn2 += deq * deq;
    }
    *scale = s;
    /* Double sums of dim terms are off by far less than the 1e-9 added. */
    *err = mem_round_up(sqrt(e2) * (1.0 + 1e-9) + 1e-12);
    *norm = mem_round_up(sqrt(n2) * (1.0 + 1e-9) + 1e-12);
    if (qnorm) *qnorm = mem_round_up(sqrt(qn2) * (1.0 + 1e-9) + 1e-12);
}

/* ---- top-k heap ----------------------------------------------------------- */

typedef struct mem_cand {
    float score;
    int32_t row;
} mem_cand;

/* a ranks before b: higher score, then smaller id. */
static bool mem_better(const mem_row *rows, mem_cand a, mem_cand b) {
    if (a.score != b.score) return a.score > b.score;
    return strcmp(rows[a.row].id, rows[b.row].id) < 0;
}

/* A heap of at most cap candidates whose root is the worst kept. */
typedef struct mem_heap {
    mem_cand *c;
    int32_t n, cap;
    const mem_row *rows;
} mem_heap;

static void mem_heap_sift_down(mem_heap *h, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < h->n && mem_better(h->rows, h->c[w], h->c[l])) w = l;
        if (r < h->n && mem_better(h->rows, h->c[w], h->c[r])) w = r;
        if (w == i) return;
        mem_cand t = h->c[i];
        h->c[i] = h->c[w];
        h->c[w] = t;
        i = w;
    }
}

static void mem_heap_push(mem_heap *h, mem_cand c) {
    if (h->n < h->cap) {
        int32_t i = h->n++;
        h->c[i] = c;
        while (i > 0) {
            int32_t p = (i - 1) / 2;
            if (!mem_better(h->rows, h->c[p], h->c[i])) break;
            mem_cand t = h->c[i];
            h->c[i] = h->c[p];
            h->c[p] = t;
            i = p;
        }
    } else if (h->cap > 0 && mem_better(h->rows, c, h->c[0])) {
        h->c[0] = c;
        mem_heap_sift_down(h, 0);
    }
}

static int mem_cmp_cand(const void *a, const void *b, void *rows) {
    const mem_cand *x = a, *y = b;
    if (mem_better(rows, *x, *y)) return -1;
    if (mem_better(rows, *y, *x)) return 1;
    return 0;
}

/* Sorts the heap's content best first, in place. */
static void mem_heap_sort(mem_heap *h) {
    qsort_r(h->c, (size_t)h->n, sizeof *h->c, mem_cmp_cand, (void *)h->rows);
}

/* Min-heap of floats keeping the cap largest values (root: the smallest). */
static void mem_fheap_push(float *h, int32_t *n, int32_t cap, float v) {
    if (*n < cap) {
        int32_t i = (*n)++;
        h[i] = v;
        while (i > 0) {
            int32_t p = (i - 1) / 2;
            if (h[p] <= h[i]) break;
            float t = h[i];
            h[i] = h[p];
            h[p] = t;
            i = p;
        }
    } else if (v > h[0]) {
        h[0] = v;
        int32_t i = 0;
        for (;;) {
            int32_t l = 2 * i + 1, r = l + 1, w = i;
            if (l < cap && h[l] < h[w]) w = l;
            if (r < cap && h[r] < h[w]) w = r;
            if (w == i) break;
            float t = h[i];
            h[i] = h[w];
            h[w] = t;
            i = w;
        }
    }
}

/* ---- partitions ----------------------------------------------------------- */

/* posix_memalign + copy: realloc would lose the 64-byte alignment. */
static void *mem_grow_aligned(void *old, size_t old_bytes, size_t new_bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, new_bytes ? new_bytes : 64) != 0) return NULL;
    if (old_bytes) memcpy(p, old, old_bytes);
    free(old);
    return p;
}

static void mem_part_free(mem_part *p) {
    if (!p) return;
    for (int32_t i = 0; i < p->n; i++) {
        free(p->rows[i].id);
        free(p->rows[i].meta);
    }
    for (int32_t i = 0; i < p->n_sym; i++) free(p->sym[i]);
    free(p->sym);
    strmap_free(&p->syms);
    bm25_free(p->bm25);
    free(p->emb);
    free(p->q8);
    free(p->q_scale);
    free(p->q_err);
    free(p->norm);
    free(p->rows);
    free(p->key);
    free(p);
}

/* Room for one more row. On failure the arrays that did grow stay valid
 * (bigger than cap), so the partition is unchanged. */
static is_status mem_part_reserve(const mem_index *ix, mem_part *p) {
    if (p->n < p->cap) return IS_OK;
    if (p->cap >= INT32_MAX / 2) return is_error_set(IS_ERR_NOMEM, "index: partition full");
    int32_t cap = p->cap ? p->cap * 2 : 16;
    size_t n = (size_t)p->n;
    void *e = mem_grow_aligned(p->emb, n * ix->stride_f * sizeof(float),
                               (size_t)cap * ix->stride_f * sizeof(float));
    if (!e) goto nomem;
    p->emb = e;
    void *q = mem_grow_aligned(p->q8, n * ix->stride_q, (size_t)cap * ix->stride_q);
    if (!q) goto nomem;
    p->q8 = q;
    float *f;
    if (!(f = realloc(p->q_scale, sizeof *f * cap))) goto nomem;
    p->q_scale = f;
    if (!(f = realloc(p->q_err, sizeof *f * cap))) goto nomem;
    p->q_err = f;
    if (!(f = realloc(p->norm, sizeof *f * cap))) goto nomem;
    p->norm = f;
    mem_row *r = realloc(p->rows, sizeof *r * cap);
    if (!r) goto nomem;
    p->rows = r;
    p->cap = cap;
    return IS_OK;
nomem:
    return is_error_set(IS_ERR_NOMEM, "index: out of memory");
}

/* The symbol of `s` in the partition, interning it if new. */
static is_status mem_part_intern(mem_part *p, const char *s, int32_t *sym) {
    size_t len = strlen(s);
    int64_t v;
    if (strmap_get(&p->syms, s, len, &v)) {
        *sym = (int32_t)v;
        return IS_OK;
    }
    if (p->n_sym == INT32_MAX) return is_error_set(IS_ERR_NOMEM, "index: too many symbols");
    is_status st = strmap_reserve(&p->syms, 1);
    if (st) return st;
    if (p->n_sym == p->cap_sym) {
        int32_t cap = p->cap_sym ? (p->cap_sym > INT32_MAX / 2 ? INT32_MAX : p->cap_sym * 2) : 16;
        char **a = realloc(p->sym, sizeof *a * cap);
        if (!a) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
        p->sym = a;
        p->cap_sym = cap;
    }
    char *copy = strdup(s);
    if (!copy) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
    p->sym[p->n_sym] = copy;
    strmap_put(&p->syms, copy, len, p->n_sym);
    *sym = p->n_sym++;
    return IS_OK;
}

/* The symbol of `s`, or -1 if the partition has never seen it. */
static int32_t mem_part_lookup(const mem_part *p, const char *s) {
    int64_t v;
    return strmap_get(&p->syms, s, strlen(s), &v) ? (int32_t)v : -1;
}

/* Takes row `row` out of partition `pi`: forgets its id, moves the last
 * row into its place (updating that row's id entry). Never fails. */
static void mem_part_remove_row(mem_index *ix, int32_t pi, int32_t row) {
    mem_part *p = ix->part[pi];
    mem_row *r = &p->rows[row];
    IS_ASSERT(strmap_del(&ix->ids, r->id, strlen(r->id)));
    free(r->id);
    free(r->meta);
    bm25_remove(p->bm25, row);
    int32_t last = --p->n;
    if (row != last) {
        memcpy(p->emb + (size_t)row * ix->stride_f, p->emb + (size_t)last * ix->stride_f,
               sizeof(float) * ix->stride_f);
        memcpy(p->q8 + (size_t)row * ix->stride_q, p->q8 + (size_t)last * ix->stride_q,
               (size_t)ix->stride_q);
        p->q_scale[row] = p->q_scale[last];
        p->q_err[row] = p->q_err[last];
        p->norm[row] = p->norm[last];
        p->rows[row] = p->rows[last];
        strmap_put(&ix->ids, p->rows[row].id, strlen(p->rows[row].id), mem_pack(pi, row));
    }
    memset(&p->rows[last], 0, sizeof p->rows[last]);
    ix->n_docs--;
}

/* "tenant\0user" into a fresh buffer. */
static char *mem_part_key(const char *tenant, const char *user, size_t *len) {
    size_t lt = strlen(tenant), lu = strlen(user);
    char *k = malloc(lt + lu + 2);
    if (!k) return NULL;
    memcpy(k, tenant, lt + 1);
    memcpy(k + lt + 1, user, lu + 1);
    *len = lt + 1 + lu;
    return k;
}

/* ---- create / free -------------------------------------------------------- */

is_status mem_index_create(int32_t dim, mem_index **out) {
    if (dim < 1 || dim > 65536) return is_error_set(IS_ERR_INVALID_ARG, "index: dim %d", (int)dim);
    mem_index *ix = calloc(1, sizeof *ix);
    if (!ix) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
    ix->dim = dim;
    ix->stride_f = (dim + 7) / 8 * 8;
    ix->stride_q = (dim + 31) / 32 * 32;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    /* glibc's default prefers readers: a steady flow of searches would then
     * block upserts forever. */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    int rc = pthread_rwlock_init(&ix->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    if (rc != 0) {
        free(ix);
        return is_error_set(IS_ERR_NOMEM, "index: rwlock init failed");
    }
    *out = ix;
    return IS_OK;
}

void mem_index_free(mem_index *ix) {
    if (!ix) return;
    for (int32_t i = 0; i < ix->n_part; i++) mem_part_free(ix->part[i]);
    free(ix->part);
    strmap_free(&ix->parts);
    strmap_free(&ix->ids);
    pthread_rwlock_destroy(&ix->lock);
    free(ix);
}

int32_t mem_index_dim(const mem_index *ix) { return ix->dim; }

int64_t mem_index_count(mem_index *ix) {
    pthread_rwlock_rdlock(&ix->lock);
    int64_t n = ix->n_docs;
    pthread_rwlock_unlock(&ix->lock);
    return n;
}

/* ---- upsert / remove ------------------------------------------------------ */

/* A document copied and checked outside the lock. */
typedef struct mem_prep {
    char *id;
    char *key; /* partition key */
    size_t key_len;
    char **meta; /* [n_meta][2] key, canonical value (owned) */
    int32_t n_meta;
    float *emb; /* [stride_f] */
    int8_t *q8; /* [stride_q] */
    float q_scale, q_err, norm;
    bm25_tokens tokens;
} mem_prep;

static void mem_prep_free(mem_prep *p) {
    free(p->id);
    free(p->key);
    for (int32_t i = 0; i < 2 * p->n_meta; i++) free(p->meta[i]);
    free(p->meta);
    free(p->emb);
    free(p->q8);
    bm25_tokens_free(&p->tokens);
}

/* Parses metadata into (key, value) string pairs, first of a key kept. */
static is_status mem_parse_meta(const char *json, mem_prep *p) {
    if (!json || !*json) return IS_OK;
    cJSON *root = cJSON_Parse(json);
    if (!root) return is_error_set(IS_ERR_INVALID_ARG, "index: metadata is not valid JSON");
    is_status st = IS_OK;
    if (!cJSON_IsObject(root)) {
        st = is_error_set(IS_ERR_INVALID_ARG, "index: metadata is not a JSON object");
        goto done;
    }
    int32_t n = cJSON_GetArraySize(root);
    p->meta = calloc((size_t)(n > 0 ? n : 1) * 2, sizeof *p->meta);
    if (!p->meta) {
        st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
        goto done;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (cJSON_IsObject(it) || cJSON_IsArray(it)) {
            st = is_error_set(IS_ERR_INVALID_ARG, "index: metadata key \"%s\" is not a scalar",
                              it->string);
            goto done;
        }
        bool dup = false;
        for (int32_t i = 0; i < p->n_meta && !dup; i++)
            dup = strcmp(p->meta[2 * i], it->string) == 0;
        if (dup) continue;
        char *k = strdup(it->string), *v = metadata_scalar_string(it);
        if (!k || !v) {
            free(k);
            free(v);
            st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
            goto done;
        }
        p->meta[2 * p->n_meta] = k;
        p->meta[2 * p->n_meta + 1] = v;
        p->n_meta++;
    }
done:
    cJSON_Delete(root);
    return st;
}

static is_status mem_prepare(const mem_index *ix, const mem_doc *d, mem_prep *p) {
    memset(p, 0, sizeof *p);
    if (!d || !d->id || !d->tenant || !d->user || !d->embedding)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "index: document lacks id, tenant, user or embedding");
    size_t id_len = strlen(d->id);
    if (id_len == 0 || id_len > MEM_ID_MAX)
        return is_error_set(IS_ERR_INVALID_ARG, "index: id length %zu (1..%d)", id_len, MEM_ID_MAX);
    if (!*d->tenant || !*d->user)
        return is_error_set(IS_ERR_INVALID_ARG, "index: empty tenant or user");
    for (int32_t j = 0; j < ix->dim; j++)
        if (!isfinite(d->embedding[j]))
            return is_error_set(IS_ERR_INVALID_ARG, "index: embedding[%d] is not finite", (int)j);
    is_status st = IS_ERR_NOMEM;
    if (!(p->id = strdup(d->id))) goto nomem;
    if (!(p->key = mem_part_key(d->tenant, d->user, &p->key_len))) goto nomem;
    p->emb = calloc((size_t)ix->stride_f, sizeof *p->emb);
    p->q8 = malloc((size_t)ix->stride_q);
    if (!p->emb || !p->q8) goto nomem;
    memcpy(p->emb, d->embedding, sizeof(float) * ix->dim);
    mem_quantize(p->emb, ix->dim, ix->stride_q, p->q8, &p->q_scale, &p->q_err, &p->norm, NULL);
    if ((st = mem_parse_meta(d->metadata_json, p))) goto fail;
    if ((st = bm25_tokenize(d->text, &p->tokens))) goto fail;
    return IS_OK;
nomem:
    st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
fail:
    mem_prep_free(p);
    memset(p, 0, sizeof *p);
    return st;
}

/* The partition for a key, created empty if new. */
static is_status mem_get_part(mem_index *ix, const char *key, size_t key_len, int32_t *pi) {
    int64_t v;
    if (strmap_get(&ix->parts, key, key_len, &v)) {
        *pi = (int32_t)v;
        return IS_OK;
    }
    is_status st = strmap_reserve(&ix->parts, 1);
    if (st) return st;
    if (ix->n_part == ix->cap_part) {
        if (ix->cap_part >= INT32_MAX / 2)
            return is_error_set(IS_ERR_NOMEM, "index: too many users");
        int32_t cap = ix->cap_part ? ix->cap_part * 2 : 16;
        mem_part **a = realloc(ix->part, sizeof *a * cap);
        if (!a) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
        ix->part = a;
        ix->cap_part = cap;
    }
    mem_part *p = calloc(1, sizeof *p);
    if (!p) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
    p->key = malloc(key_len + 1);
    if (!p->key || (st = bm25_create(&p->bm25)) != IS_OK) {
        free(p->key);
        free(p);
        return is_error_set(IS_ERR_NOMEM, "index: out of memory");
    }
    memcpy(p->key, key, key_len + 1);
    p->key_len = key_len;
    ix->part[ix->n_part] = p;
    strmap_put(&ix->parts, p->key, key_len, ix->n_part);
    *pi = ix->n_part++;
    return IS_OK;
}

is_status mem_index_upsert(mem_index *ix, const mem_doc *doc) {
    if (!ix) return is_error_set(IS_ERR_INVALID_ARG, "index: NULL index");
    mem_prep prep;
    is_status st = mem_prepare(ix, doc, &prep);
    if (st) return st;

    pthread_rwlock_wrlock(&ix->lock);
    /* Everything that can fail comes first; what it leaves behind (an empty
     * partition, unused symbols or terms, spare capacity) does not change
     * what any search returns. */
    int32_t pi = -1;
    mem_row row = {.agent = -1, .run = -1};
    bm25_doc bdoc = {0};
    if ((st = mem_get_part(ix, prep.key, prep.key_len, &pi))) goto fail;
    mem_part *p = ix->part[pi];
    if (doc->agent_id && (st = mem_part_intern(p, doc->agent_id, &row.agent))) goto fail;
    if (doc->run_id && (st = mem_part_intern(p, doc->run_id, &row.run))) goto fail;
    if (prep.n_meta > 0) {
        row.meta = malloc(sizeof *row.meta * 2 * prep.n_meta);
        if (!row.meta) {
            st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
            goto fail;
        }
        for (int32_t i = 0; i < prep.n_meta; i++) {
            if ((st = mem_part_intern(p, prep.meta[2 * i], &row.meta[2 * i]))) goto fail;
            if ((st = mem_part_intern(p, prep.meta[2 * i + 1], &row.meta[2 * i + 1]))) goto fail;
        }
        row.n_meta = prep.n_meta;
    }
    if ((st = mem_part_reserve(ix, p))) goto fail;
    if ((st = strmap_reserve(&ix->ids, 1))) goto fail;
    if ((st = bm25_prepare(p->bm25, &prep.tokens, &bdoc))) goto fail;

    /* Commit: nothing below fails. */
    int64_t old;
    if (strmap_get(&ix->ids, prep.id, strlen(prep.id), &old))
        mem_part_remove_row(ix, mem_unpack_part(old), mem_unpack_row(old));
    int32_t r = p->n++;
    memcpy(p->emb + (size_t)r * ix->stride_f, prep.emb, sizeof(float) * ix->stride_f);
    memcpy(p->q8 + (size_t)r * ix->stride_q, prep.q8, (size_t)ix->stride_q);
    p->q_scale[r] = prep.q_scale;
    p->q_err[r] = prep.q_err;
    p->norm[r] = prep.norm;
    row.id = prep.id;
    prep.id = NULL;
    p->rows[r] = row;
    bm25_add(p->bm25, &bdoc);
    strmap_put(&ix->ids, row.id, strlen(row.id), mem_pack(pi, r));
    ix->n_docs++;
    pthread_rwlock_unlock(&ix->lock);
    mem_prep_free(&prep);
    return IS_OK;
fail:
    pthread_rwlock_unlock(&ix->lock);
    free(row.meta);
    bm25_doc_free(&bdoc);
    mem_prep_free(&prep);
    return st;
}

is_status mem_index_remove(mem_index *ix, const char *id) {
    if (!ix || !id) return is_error_set(IS_ERR_INVALID_ARG, "index: NULL index or id");
    pthread_rwlock_wrlock(&ix->lock);
    int64_t v;
    is_status st = IS_OK;
    if (strmap_get(&ix->ids, id, strlen(id), &v))
        mem_part_remove_row(ix, mem_unpack_part(v), mem_unpack_row(v));
    else st = is_error_set(IS_ERR_NOT_FOUND, "index: no fact \"%.80s\"", id);
    pthread_rwlock_unlock(&ix->lock);
    return st;
}

/* ---- search --------------------------------------------------------------- */

/* A filter resolved to a partition's symbols. */
typedef struct mem_qfilter {
    bool any;      /* at least one condition beyond tenant and user */
    bool none;     /* some value is unknown to the partition: nothing matches */
    int32_t agent; /* -1: any */
    int32_t run;   /* -1: any */
    int32_t n_meta;
    int32_t *meta; /* [n_meta][2] */
} mem_qfilter;

static bool mem_row_match(const mem_row *r, const mem_qfilter *f) {
    if (f->agent >= 0 && r->agent != f->agent) return false;
    if (f->run >= 0 && r->run != f->run) return false;
    for (int32_t i = 0; i < f->n_meta; i++) {
        bool ok = false;
        for (int32_t j = 0; j < r->n_meta; j++) {
            if (r->meta[2 * j] == f->meta[2 * i]) {
                ok = r->meta[2 * j + 1] == f->meta[2 * i + 1];
                break;
            }
        }
        if (!ok) return false;
    }
    return true;
}

static is_status mem_resolve_filter(const mem_part *p, const mem_filter *f, mem_qfilter *q) {
    memset(q, 0, sizeof *q);
    q->agent = q->run = -1;
    if (f->agent_id) {
        q->any = true;
        if ((q->agent = mem_part_lookup(p, f->agent_id)) < 0) q->none = true;
    }
    if (f->run_id) {
        q->any = true;
        if ((q->run = mem_part_lookup(p, f->run_id)) < 0) q->none = true;
    }
    if (f->n_meta > 0) {
        q->any = true;
        q->meta = malloc(sizeof *q->meta * 2 * f->n_meta);
        if (!q->meta) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
        q->n_meta = f->n_meta;
        for (int32_t i = 0; i < f->n_meta; i++) {
            q->meta[2 * i] = mem_part_lookup(p, f->meta_keys[i]);
            q->meta[2 * i + 1] = mem_part_lookup(p, f->meta_values[i]);
            if (q->meta[2 * i] < 0 || q->meta[2 * i + 1] < 0) q->none = true;
        }
    }
    return IS_OK;
}

/* A query made ready for the dense kernels. */
typedef struct mem_query {
    float *f;                      /* [stride_f] the query, zero-padded */
    int8_t *q8;                    /* [stride_q] quantised */
    int8_t *q8abs;                 /* [stride_q] |q8| */
    float scale, err, norm, qnorm; /* as mem_quantize gives them */
} mem_query;

static void mem_query_free(mem_query *q) {
    free(q->f);
    free(q->q8);
    free(q->q8abs);
}

/* Per-thread work buffers of a search, kept between searches so that a
 * search over 100k facts does not map and fault in a megabyte each time.
 * Freed when the thread exits. acc is all zeros between searches. */
typedef struct mem_scratch {
    float *acc;       /* [cap_rows] BM25 scores */
    int32_t *touched; /* [cap_rows] rows with a BM25 score */
    float *ub;        /* [cap_rows] dense upper bounds */
    int32_t cap_rows;
} mem_scratch;

static pthread_key_t mem_scratch_key;
static pthread_once_t mem_scratch_once = PTHREAD_ONCE_INIT;
static bool mem_scratch_key_ok;

static void mem_scratch_destroy(void *p) {
    mem_scratch *sc = p;
    free(sc->acc);
    free(sc->touched);
    free(sc->ub);
    free(sc);
}

static void mem_scratch_init_key(void) {
    mem_scratch_key_ok = pthread_key_create(&mem_scratch_key, mem_scratch_destroy) == 0;
}

/* This thread's scratch with room for n_rows rows, or NULL (no memory). */
static mem_scratch *mem_scratch_get(int32_t n_rows) {
    pthread_once(&mem_scratch_once, mem_scratch_init_key);
    if (!mem_scratch_key_ok) return NULL;
    mem_scratch *sc = pthread_getspecific(mem_scratch_key);
    if (!sc) {
        if (!(sc = calloc(1, sizeof *sc))) return NULL;
        if (pthread_setspecific(mem_scratch_key, sc) != 0) {
            free(sc);
            return NULL;
        }
    }
    if (sc->cap_rows < n_rows) {
        float *acc = calloc((size_t)n_rows, sizeof *acc);
        int32_t *touched = malloc(sizeof *touched * (size_t)n_rows);
        float *ub = malloc(sizeof *ub * (size_t)n_rows);
        if (!acc || !touched || !ub) {
            free(acc);
            free(touched);
            free(ub);
            return NULL;
        }
        free(sc->acc);
        free(sc->touched);
        free(sc->ub);
        sc->acc = acc;
        sc->touched = touched;
        sc->ub = ub;
        sc->cap_rows = n_rows;
    }
    return sc;
}

/* The `depth` best filtered rows by float32 dot product, best first, into
 * h (h->cap = depth, h->c allocated by the caller). Pass 1 (int8) bounds
 * every row and finds L, the depth-th largest lower bound; pass 2 rescores
 * the rows whose upper bound reaches L. */
static is_status mem_dense_topk(const mem_index *ix, const mem_part *p, const mem_qfilter *f,
                                const mem_query *q, mem_scratch *sc, mem_heap *h) {
    const int32_t n = p->n, depth = h->cap;
    if (depth == 0 || n == 0) return IS_OK;
    float *lbh = malloc(sizeof *lbh * depth);
    if (!lbh) return is_error_set(IS_ERR_NOMEM, "index: out of memory");
    float *ub = sc->ub;
    const float rnd = ((float)ix->dim + 16.0f) * 1.2e-7f * q->norm;
    int32_t n_lb = 0;
    float L = -INFINITY; /* the heap's root once full: only rises */
    for (int32_t i = 0; i < n; i++) {
        if (f->any && !mem_row_match(&p->rows[i], f)) {
            ub[i] = -INFINITY; /* filtered out (a real bound is finite) */
            continue;
        }
        const int32_t d =
            mem_dot_i8(p->q8 + (size_t)i * ix->stride_q, q->q8, q->q8abs, ix->stride_q);
        const float a = q->scale * p->q_scale[i] * (float)d;
        const float b =
            1.001f * (q->err * p->norm[i] + q->qnorm * p->q_err[i]) + rnd * p->norm[i] + 1e-6f;
        ub[i] = a + b;
        if (n_lb < depth || a - b > L) {
            mem_fheap_push(lbh, &n_lb, depth, a - b);
            if (n_lb == depth) L = lbh[0];
        }
    }
    for (int32_t i = 0; i < n; i++) {
        if (ub[i] < L || ub[i] == -INFINITY) continue;
        const float s = mem_dot_f32(p->emb + (size_t)i * ix->stride_f, q->f, ix->stride_f);
        mem_heap_push(h, (mem_cand){s, i});
    }
    free(lbh);
    mem_heap_sort(h);
    return IS_OK;
}

/* The `depth` best filtered rows by BM25, best first, into h; sc->acc gets
 * every row's BM25 score, sc->touched the rows with one (*n_touched). */
static is_status mem_bm25_topk(const mem_part *p, const mem_qfilter *f, const bm25_tokens *t,
                               mem_scratch *sc, int32_t *n_touched, mem_heap *h) {
    *n_touched = 0;
    if (h->cap == 0 || p->n == 0 || t->n == 0) return IS_OK;
    is_status st = bm25_score(p->bm25, t, sc->acc, sc->touched, n_touched);
    if (st) return st;
    for (int32_t i = 0; i < *n_touched; i++) {
        const int32_t r = sc->touched[i];
        if (f->any && !mem_row_match(&p->rows[r], f)) continue;
        mem_heap_push(h, (mem_cand){sc->acc[r], r});
    }
    mem_heap_sort(h);
    return IS_OK;
}

/* One document of the fused list. */
typedef struct mem_fused {
    int32_t row;
    int32_t dense_rank, bm25_rank; /* 1-based, -1: absent */
    float rrf;
} mem_fused;

static int mem_cmp_fused_row(const void *a, const void *b) {
    const mem_fused *x = a, *y = b;
    return (x->row > y->row) - (x->row < y->row);
}

static int mem_cmp_fused(const void *a, const void *b, void *rows_) {
    const mem_fused *x = a, *y = b;
    const mem_row *rows = rows_;
    if (x->rrf != y->rrf) return x->rrf > y->rrf ? -1 : 1;
    return strcmp(rows[x->row].id, rows[y->row].id);
}

static void mem_hit_set(mem_hit *h, const char *id, float score, float dense, float bm25,
                        int32_t dense_rank, int32_t bm25_rank) {
    memset(h->id, 0, sizeof h->id);
    strcpy(h->id, id); /* ids are at most MEM_ID_MAX bytes */
    h->score = score;
    h->dense = dense;
    h->bm25 = bm25;
    h->dense_rank = dense_rank;
    h->bm25_rank = bm25_rank;
}

/* A dense list computed outside the index (mem_index_search_dense_list). */
typedef struct mem_ext_dense {
    const char *const *ids; /* [n] best first */
    const float *scores;    /* [n] */
    int32_t n;
} mem_ext_dense;

/* The external list's documents of partition pi, in its order, into h (at
 * most h->cap); ids of other partitions or of none (removed since the list
 * was made) are skipped. */
static void mem_ext_dense_rows(const mem_index *ix, int32_t pi, const mem_ext_dense *ext,
                               mem_heap *h) {
    for (int32_t i = 0; i < ext->n && h->n < h->cap; i++) {
        int64_t v;
        if (!strmap_get(&ix->ids, ext->ids[i], strlen(ext->ids[i]), &v) || mem_unpack_part(v) != pi)
            continue;
        h->c[h->n++] = (mem_cand){ext->scores[i], mem_unpack_row(v)};
    }
}

/* The search proper, under the read lock; hits into `hits` ([k]), which is
 * written only once nothing can fail any more. With ext, the dense list is
 * ext's (q is unused) and a hybrid hit outside it gets dense = NAN. */
static is_status mem_search_locked(const mem_index *ix, int32_t pi, const mem_filter *f,
                                   const mem_query *q, const mem_ext_dense *ext,
                                   const bm25_tokens *t, int32_t k, mem_search_mode mode,
                                   mem_hit *hits, int32_t *n_hits) {
    const mem_part *p = ix->part[pi];
    mem_qfilter qf;
    is_status st = mem_resolve_filter(p, f, &qf);
    if (st) return st;
    mem_heap dh = {.rows = p->rows}, bh = {.rows = p->rows};
    mem_fused *fu = NULL;
    mem_scratch *sc = NULL;
    float *acc = NULL; /* sc->acc once BM25 has run */
    int32_t n_touched = 0;
    *n_hits = 0;
    if (qf.none || p->n == 0) goto done;
    if (!(sc = mem_scratch_get(p->n))) goto nomem;

    int32_t depth = mode == MEM_SEARCH_HYBRID && k < MEM_HYBRID_DEPTH ? MEM_HYBRID_DEPTH : k;
    if (depth > p->n) depth = p->n;
    if (mode != MEM_SEARCH_BM25) {
        dh.cap = depth;
        if (!(dh.c = malloc(sizeof *dh.c * depth))) goto nomem;
        if (ext) mem_ext_dense_rows(ix, pi, ext, &dh);
        else if ((st = mem_dense_topk(ix, p, &qf, q, sc, &dh))) goto done;
    }
    if (mode != MEM_SEARCH_DENSE && t->n > 0) {
        bh.cap = depth;
        if (!(bh.c = malloc(sizeof *bh.c * depth))) goto nomem;
        acc = sc->acc;
        if ((st = mem_bm25_topk(p, &qf, t, sc, &n_touched, &bh))) goto done;
    }

    if (mode == MEM_SEARCH_DENSE) {
        for (int32_t i = 0; i < dh.n && i < k; i++)
            mem_hit_set(&hits[i], p->rows[dh.c[i].row].id, dh.c[i].score, dh.c[i].score, 0.0f,
                        i + 1, -1);
        *n_hits = dh.n < k ? dh.n : k;
    } else if (mode == MEM_SEARCH_BM25) {
        for (int32_t i = 0; i < bh.n && i < k; i++)
            mem_hit_set(&hits[i], p->rows[bh.c[i].row].id, bh.c[i].score, 0.0f, bh.c[i].score, -1,
                        i + 1);
        *n_hits = bh.n < k ? bh.n : k;
    } else {
        int32_t nf = 0;
        if (!(fu = malloc(sizeof *fu * (size_t)(dh.n + bh.n + 1)))) goto nomem;
        for (int32_t i = 0; i < dh.n; i++) fu[nf++] = (mem_fused){dh.c[i].row, i + 1, -1, 0};
        for (int32_t i = 0; i < bh.n; i++) fu[nf++] = (mem_fused){bh.c[i].row, -1, i + 1, 0};
        qsort(fu, (size_t)nf, sizeof *fu, mem_cmp_fused_row);
        int32_t m = 0;
        for (int32_t i = 0; i < nf; i++) {
            if (m > 0 && fu[m - 1].row == fu[i].row) {
                if (fu[i].dense_rank > 0) fu[m - 1].dense_rank = fu[i].dense_rank;
                if (fu[i].bm25_rank > 0) fu[m - 1].bm25_rank = fu[i].bm25_rank;
            } else {
                fu[m++] = fu[i];
            }
        }
        for (int32_t i = 0; i < m; i++) {
            double s = 0.0;
            if (fu[i].dense_rank > 0) s += 1.0 / (MEM_RRF_K + fu[i].dense_rank);
            if (fu[i].bm25_rank > 0) s += 1.0 / (MEM_RRF_K + fu[i].bm25_rank);
            fu[i].rrf = (float)s;
        }
        qsort_r(fu, (size_t)m, sizeof *fu, mem_cmp_fused, (void *)p->rows);
        int32_t n = m < k ? m : k;
        for (int32_t i = 0; i < n; i++) {
            const int32_t r = fu[i].row;
            const float dense =
                fu[i].dense_rank > 0 ? dh.c[fu[i].dense_rank - 1].score
                : ext                ? NAN
                      : mem_dot_f32(p->emb + (size_t)r * ix->stride_f, q->f, ix->stride_f);
            mem_hit_set(&hits[i], p->rows[r].id, fu[i].rrf, dense, acc ? acc[r] : 0.0f,
                        fu[i].dense_rank, fu[i].bm25_rank);
        }
        *n_hits = n;
    }
    goto done;
nomem:
    st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
done:
    free(qf.meta);
    free(dh.c);
    free(bh.c);
    free(fu);
    if (acc) /* leave the scratch zeroed for the next search */
        for (int32_t i = 0; i < n_touched; i++) acc[sc->touched[i]] = 0.0f;
    return st;
}

/* mem_index_search, with the dense list either computed here from
 * query_embedding or given (ext). */
static is_status mem_search(mem_index *ix, const mem_filter *f, const float *query_embedding,
                            const mem_ext_dense *ext, const char *query_text, int32_t k,
                            mem_search_mode mode, mem_hit *out, int32_t *n_out) {
    if (!ix || !n_out) return is_error_set(IS_ERR_INVALID_ARG, "index: NULL index or n_out");
    if (!f || !f->tenant || !f->user)
        return is_error_set(IS_ERR_INVALID_ARG, "index: a search needs a tenant and a user");
    if (f->n_meta < 0 || (f->n_meta > 0 && (!f->meta_keys || !f->meta_values)))
        return is_error_set(IS_ERR_INVALID_ARG, "index: bad metadata filter");
    for (int32_t i = 0; i < f->n_meta; i++)
        if (!f->meta_keys[i] || !f->meta_values[i])
            return is_error_set(IS_ERR_INVALID_ARG, "index: NULL metadata key or value");
    if (k < 0 || (k > 0 && !out)) return is_error_set(IS_ERR_INVALID_ARG, "index: k = %d", (int)k);
    if (mode != MEM_SEARCH_DENSE && mode != MEM_SEARCH_BM25 && mode != MEM_SEARCH_HYBRID)
        return is_error_set(IS_ERR_INVALID_ARG, "index: search mode %d", (int)mode);
    if (mode != MEM_SEARCH_BM25 && !query_embedding && !ext)
        return is_error_set(IS_ERR_INVALID_ARG, "index: dense search without a query embedding");
    if (mode == MEM_SEARCH_BM25 && !query_text)
        return is_error_set(IS_ERR_INVALID_ARG, "index: BM25 search without query text");
    if (mode != MEM_SEARCH_BM25 && !ext)
        for (int32_t j = 0; j < ix->dim; j++)
            if (!isfinite(query_embedding[j]))
                return is_error_set(IS_ERR_INVALID_ARG, "index: query[%d] is not finite", (int)j);
    if (k == 0) {
        *n_out = 0;
        return IS_OK;
    }

    /* Query preparation touches nothing shared: done before the lock. */
    is_status st = IS_OK;
    mem_query q = {0};
    bm25_tokens t = {0};
    char *key = NULL;
    size_t key_len = 0;
    if (mode != MEM_SEARCH_DENSE && query_text && (st = bm25_tokenize(query_text, &t))) goto out;
    if (mode != MEM_SEARCH_BM25 && !ext) {
        q.f = calloc((size_t)ix->stride_f, sizeof *q.f);
        q.q8 = malloc((size_t)ix->stride_q);
        q.q8abs = malloc((size_t)ix->stride_q);
        if (!q.f || !q.q8 || !q.q8abs) goto nomem;
        memcpy(q.f, query_embedding, sizeof(float) * ix->dim);
        mem_quantize(q.f, ix->dim, ix->stride_q, q.q8, &q.scale, &q.err, &q.norm, &q.qnorm);
        for (int32_t j = 0; j < ix->stride_q; j++) q.q8abs[j] = (int8_t)abs(q.q8[j]);
    }
    if (!(key = mem_part_key(f->tenant, f->user, &key_len))) goto nomem;

    int32_t n_hits = 0;
    pthread_rwlock_rdlock(&ix->lock);
    int64_t pv;
    if (strmap_get(&ix->parts, key, key_len, &pv))
        st = mem_search_locked(ix, (int32_t)pv, f, &q, ext, &t, k, mode, out, &n_hits);
    pthread_rwlock_unlock(&ix->lock);
    if (st == IS_OK) *n_out = n_hits;
    goto out;
nomem:
    st = is_error_set(IS_ERR_NOMEM, "index: out of memory");
out:
    mem_query_free(&q);
    bm25_tokens_free(&t);
    free(key);
    return st;
}

is_status mem_index_search(mem_index *ix, const mem_filter *f, const float *query_embedding,
                           const char *query_text, int32_t k, mem_search_mode mode, mem_hit *out,
                           int32_t *n_out) {
    return mem_search(ix, f, query_embedding, NULL, query_text, k, mode, out, n_out);
}

is_status mem_index_search_dense_list(mem_index *ix, const mem_filter *f,
                                      const char *const *dense_ids, const float *dense_scores,
                                      int32_t n_dense, const char *query_text, int32_t k,
                                      mem_search_mode mode, mem_hit *out, int32_t *n_out) {
    if (mode == MEM_SEARCH_BM25 || n_dense < 0 || (n_dense > 0 && (!dense_ids || !dense_scores)))
        return is_error_set(IS_ERR_INVALID_ARG, "index: bad external dense list (n %d, mode %d)",
                            (int)n_dense, (int)mode);
    if (f && (f->agent_id || f->run_id || f->n_meta != 0))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "index: an external dense list serves unfiltered searches only");
    for (int32_t i = 0; i < n_dense; i++)
        if (!dense_ids[i] || !isfinite(dense_scores[i]))
            return is_error_set(IS_ERR_INVALID_ARG,
                                "index: dense list entry %d is NULL or not finite", (int)i);
    const mem_ext_dense ext = {dense_ids, dense_scores, n_dense};
    return mem_search(ix, f, NULL, &ext, query_text, k, mode, out, n_out);
}

/* ---- invariants ----------------------------------------------------------- */

bool mem_index_check(mem_index *ix) {
    pthread_rwlock_rdlock(&ix->lock);
    bool ok = true;
    int64_t total = 0;
    int8_t *q8 = malloc((size_t)ix->stride_q);
    if (!q8) ok = false;
    for (int32_t pi = 0; ok && pi < ix->n_part; pi++) {
        const mem_part *p = ix->part[pi];
        int64_t v;
        if (!strmap_get(&ix->parts, p->key, p->key_len, &v) || v != pi) ok = false;
        if (bm25_n_docs(p->bm25) != p->n || !bm25_check(p->bm25)) ok = false;
        if (p->syms.n != (uint32_t)p->n_sym) ok = false;
        for (int32_t r = 0; ok && r < p->n; r++) {
            const mem_row *row = &p->rows[r];
            if (!strmap_get(&ix->ids, row->id, strlen(row->id), &v) || mem_unpack_part(v) != pi ||
                mem_unpack_row(v) != r)
                ok = false;
            if (row->agent >= p->n_sym || row->run >= p->n_sym) ok = false;
            for (int32_t j = 0; j < 2 * row->n_meta; j++)
                if (row->meta[j] < 0 || row->meta[j] >= p->n_sym) ok = false;
            float s, e, nr;
            const float *x = p->emb + (size_t)r * ix->stride_f;
            for (int32_t j = ix->dim; j < ix->stride_f; j++)
                if (x[j] != 0.0f) ok = false;
            mem_quantize(x, ix->dim, ix->stride_q, q8, &s, &e, &nr, NULL);
            if (memcmp(q8, p->q8 + (size_t)r * ix->stride_q, (size_t)ix->stride_q) != 0 ||
                s != p->q_scale[r] || e != p->q_err[r] || nr != p->norm[r])
                ok = false;
        }
        total += p->n;
    }
    if (ok && (total != ix->n_docs || ix->ids.n != (uint64_t)total)) ok = false;
    free(q8);
    pthread_rwlock_unlock(&ix->lock);
    return ok;
}

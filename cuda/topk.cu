/*
 * topk: one user's fact embeddings in device memory and an exact top-k
 * over them (see retrieval_cuda.h).
 *
 * Search, all on the device:
 *   1. score_kernel: one warp per row, the dot product with the query
 *      accumulated in f64 in a fixed order (lane l takes elements l, l + 32,
 *      ... or float4 groups, then a butterfly sum), written as a 64-bit key
 *      that orders like the f64 score. Products of floats are exact in f64
 *      and the sum of a few hundred is within 1e-16 relative, so the order
 *      is the one a double-precision brute force gives; equal rows give
 *      equal keys (then the row index decides).
 *   2. topk_block_kernel, in rounds: each block sorts a chunk of CH
 *      (key, row) pairs in shared memory (bitonic, best first: key
 *      descending, row ascending) and keeps its first k. A pair in the
 *      overall top k is beaten by fewer than k pairs of its chunk, so it
 *      survives every round: the result is exact for any n. Rounds shrink
 *      the candidates by CH / k (>= 8) until one block holds them all; the
 *      last round writes rows and float scores.
 *   3. one copy of the k (row, score) pairs to the host.
 * The matrix is read once (4 * dim bytes a row) and 8 bytes a row are
 * written and read back; at 1e6 rows of 384 floats the scan dominates.
 * score_rows scores a list of rows with the same per-row sum (row_dot),
 * so its values are those a search reports.
 *
 * set_rows and remove_row copy rows in place (one copy per run of
 * consecutive rows). Every call returns with its device work finished,
 * search included, so a matrix can change hands between threads.
 */
#include "retrieval.cuh"
#include "retrieval_cuda.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SCORE_THREADS 256
#define TOPK_THREADS  1024
/* Largest chunk a block sorts; (key, row) pairs take 12 bytes each. */
#define TOPK_CHUNK_MAX  8192
#define TOPK_PAIR_BYTES (sizeof(uint64_t) + sizeof(int32_t))
#define TOPK_SMEM_MAX   ((size_t)TOPK_CHUNK_MAX * TOPK_PAIR_BYTES)

/* ---- kernels ----------------------------------------------------------- */

/* A 64-bit key that orders like the score (larger key, larger score); -0
 * and +0 get the same key. No finite score maps to 0, the key of padding. */
static __device__ __forceinline__ uint64_t key_of(double s) {
    if (s == 0.0) s = 0.0;
    const uint64_t b = (uint64_t)__double_as_longlong(s);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

static __device__ __forceinline__ double score_of(uint64_t k) {
    const uint64_t b = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
    return __longlong_as_double((long long)b);
}

/* row . q in f64, by the whole warp (every lane gets the sum); vec4 when
 * dim % 4 == 0 and q is 16-byte aligned (rows then are too). The one
 * summation order of every score, so a row scored by score_rows_kernel
 * gets the value a search gives it. */
static __device__ __forceinline__ double row_dot(const float *__restrict__ row,
                                                 const float *__restrict__ q, int32_t dim,
                                                 bool vec4, int lane) {
    double acc = 0.0;
    if (vec4) {
        const float4 *r4 = (const float4 *)row, *q4 = (const float4 *)q;
        for (int32_t i = lane; i < dim / 4; i += 32) {
            const float4 a = r4[i], b = __ldg(q4 + i);
            acc = fma((double)a.x, (double)b.x, acc);
            acc = fma((double)a.y, (double)b.y, acc);
            acc = fma((double)a.z, (double)b.z, acc);
            acc = fma((double)a.w, (double)b.w, acc);
        }
    } else {
        for (int32_t i = lane; i < dim; i += 32)
            acc = fma((double)row[i], (double)__ldg(q + i), acc);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, off);
    return acc;
}

/* keys[r] = key_of(M[r] . q) for r < n, one warp a row. */
static __global__ void __launch_bounds__(SCORE_THREADS)
    score_kernel(uint64_t *__restrict__ keys, const float *__restrict__ M,
                 const float *__restrict__ q, int32_t n, int32_t dim, bool vec4) {
    const int lane = threadIdx.x & 31;
    const int64_t n_warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = (((int64_t)blockIdx.x * blockDim.x) + threadIdx.x) >> 5; r < n; r += n_warps) {
        const double acc = row_dot(M + r * dim, q, dim, vec4, lane);
        if (lane == 0) keys[r] = key_of(acc);
    }
}

/* out[i] = (float)(M[rows[i]] . q) for i < n, one warp a listed row. */
static __global__ void __launch_bounds__(SCORE_THREADS)
    score_rows_kernel(float *__restrict__ out, const int32_t *__restrict__ rows,
                      const float *__restrict__ M, const float *__restrict__ q, int32_t n,
                      int32_t dim, bool vec4) {
    const int lane = threadIdx.x & 31;
    const int64_t n_warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t i = (((int64_t)blockIdx.x * blockDim.x) + threadIdx.x) >> 5; i < n; i += n_warps) {
        const double acc = row_dot(M + (int64_t)rows[i] * dim, q, dim, vec4, lane);
        if (lane == 0) out[i] = (float)acc;
    }
}

/* Pair a before pair b: higher key, then lower row. */
static __device__ __forceinline__ bool better(uint64_t ka, int32_t ia, uint64_t kb, int32_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}

/* Block b sorts pairs [b * chunk, min(m, (b + 1) * chunk)) of (in_keys,
 * in_idx; NULL: the row is the position), padded to `chunk` (a power of
 * two) with (0, INT32_MAX), which loses to every real pair, and writes its
 * first `keep` pairs: to out_keys/out_idx[b * keep ...), or, in the last
 * round (one block), rows to out_idx and float scores to out_score. */
static __global__ void __launch_bounds__(TOPK_THREADS)
    topk_block_kernel(const uint64_t *__restrict__ in_keys, const int32_t *__restrict__ in_idx,
                      int64_t m, int32_t chunk, int32_t keep, uint64_t *__restrict__ out_keys,
                      int32_t *__restrict__ out_idx, float *__restrict__ out_score) {
    extern __shared__ uint64_t sk[];       /* [chunk] keys */
    int32_t *si = (int32_t *)(sk + chunk); /* [chunk] rows */
    const int64_t base = (int64_t)blockIdx.x * chunk;
    for (int32_t i = threadIdx.x; i < chunk; i += blockDim.x) {
        const int64_t gi = base + i;
        if (gi < m) {
            sk[i] = in_keys[gi];
            si[i] = in_idx ? in_idx[gi] : (int32_t)gi;
        } else {
            sk[i] = 0;
            si[i] = INT32_MAX;
        }
    }
    __syncthreads();
    for (int32_t size = 2; size <= chunk; size <<= 1) {
        for (int32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (int32_t t = threadIdx.x; t < chunk / 2; t += blockDim.x) {
                const int32_t lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const bool best_first = (lo & size) == 0; /* the final merge: all of it */
                const uint64_t kl = sk[lo], kh = sk[hi];
                const int32_t il = si[lo], ih = si[hi];
                if (better(kh, ih, kl, il) == best_first) {
                    sk[lo] = kh;
                    sk[hi] = kl;
                    si[lo] = ih;
                    si[hi] = il;
                }
            }
            __syncthreads();
        }
    }
    for (int32_t i = threadIdx.x; i < keep; i += blockDim.x) {
        if (out_score) {
            out_idx[i] = si[i];
            out_score[i] = (float)score_of(sk[i]);
        } else {
            const int64_t o = (int64_t)blockIdx.x * keep + i;
            out_keys[o] = sk[i];
            out_idx[o] = si[i];
        }
    }
}

/* ---- the matrix -------------------------------------------------------- */

struct retrieval_matrix {
    int32_t device;
    int32_t dim;
    int32_t count;  /* rows in use */
    int32_t cap;    /* rows allocated */
    float *rows;    /* device (cap, dim) */
    uint64_t *keys; /* device (key_cap) scores of a search */
    int32_t key_cap;
    uint64_t *cand_keys[2]; /* device (cand_cap) candidates between rounds, ping-pong */
    int32_t *cand_idx[2];
    int64_t cand_cap;
    void *result;      /* device: k rows (int32), then k scores (float); room for CUDA_TOPK_MAX */
    void *result_host; /* host copy of the same */
};

static void free_candidates(cuda_fact_matrix *m) {
    for (int i = 0; i < 2; i++) {
        cudaFree(m->cand_keys[i]);
        cudaFree(m->cand_idx[i]);
        m->cand_keys[i] = NULL;
        m->cand_idx[i] = NULL;
    }
    m->cand_cap = 0;
}

extern "C" void cuda_fact_matrix_free(cuda_fact_matrix *m) {
    if (!m) return;
    cudaSetDevice(m->device);
    cudaFree(m->rows);
    cudaFree(m->keys);
    free_candidates(m);
    cudaFree(m->result);
    free(m->result_host);
    free(m);
    cudaGetLastError(); /* nothing to report from a free */
}

static is_status create(cuda_fact_matrix *m) {
    int optin = 0;
    is_status st = retrieval_use_device(m->device, TOPK_SMEM_MAX, (const void *)topk_block_kernel,
                                        "cuda fact matrix", &optin);
    if (st != IS_OK) return st;
    CUDA_CHECK(cudaFuncSetAttribute(topk_block_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)TOPK_SMEM_MAX));
    const size_t res = (size_t)CUDA_TOPK_MAX * (sizeof(int32_t) + sizeof(float));
    CUDA_CHECK(cudaMalloc(&m->result, res));
    m->result_host = malloc(res);
    if (!m->result_host) return is_error_set(IS_ERR_NOMEM, "cuda fact matrix: out of memory");
    return IS_OK;
}

extern "C" is_status cuda_fact_matrix_create(int32_t device, int32_t dim, cuda_fact_matrix **out) {
    if (!out || dim < 1 || dim > 65536)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda_fact_matrix_create: bad argument (dim %d)",
                            dim);
    cuda_fact_matrix *m = (cuda_fact_matrix *)calloc(1, sizeof *m);
    if (!m) return is_error_set(IS_ERR_NOMEM, "cuda fact matrix: out of memory");
    m->device = device;
    m->dim = dim;
    is_status st = create(m);
    if (st != IS_OK) {
        cuda_fact_matrix_free(m);
        return st;
    }
    *out = m;
    return IS_OK;
}

extern "C" int32_t cuda_fact_matrix_count(const cuda_fact_matrix *m) { return m ? m->count : 0; }
extern "C" int32_t cuda_fact_matrix_dim(const cuda_fact_matrix *m) { return m ? m->dim : 0; }

/* Makes room for `rows` rows, keeping rows [0, count). Unchanged on
 * failure. */
static is_status reserve(cuda_fact_matrix *m, int32_t rows) {
    if (rows <= m->cap) return IS_OK;
    int64_t cap = m->cap ? 2 * (int64_t)m->cap : 64;
    if (cap < rows) cap = rows;
    if (cap > INT32_MAX - 1) cap = INT32_MAX - 1;
    float *nr = NULL;
    CUDA_CHECK(cudaMalloc((void **)&nr, (size_t)cap * (size_t)m->dim * sizeof(float)));
    if (m->count > 0) {
        cudaError_t e =
            cudaMemcpyAsync(nr, m->rows, (size_t)m->count * (size_t)m->dim * sizeof(float),
                            cudaMemcpyDeviceToDevice, RETRIEVAL_STREAM);
        if (e == cudaSuccess) e = cudaStreamSynchronize(RETRIEVAL_STREAM);
        if (e != cudaSuccess) {
            cudaFree(nr);
            return cuda_status_from(e, "growing the fact matrix", __FILE__, __LINE__);
        }
    }
    cudaFree(m->rows);
    m->rows = nr;
    m->cap = (int32_t)cap;
    return IS_OK;
}

/* Checks rows[0..n) against the rules of set_rows and gives the new count. */
static is_status check_rows(const cuda_fact_matrix *m, const int32_t *rows, int32_t n,
                            int32_t *new_count, const char *who) {
    int64_t top = m->count;
    for (int32_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= INT32_MAX - 1)
            return is_error_set(IS_ERR_INVALID_ARG, "%s: row %d out of range", who, rows[i]);
        if ((int64_t)rows[i] + 1 > top) top = (int64_t)rows[i] + 1;
    }
    /* Every new row must be named, so there are at most n of them (this
     * also bounds the bitmap below). */
    if (top - m->count > n)
        return is_error_set(IS_ERR_INVALID_ARG, "%s: rows past the count leave a gap", who);
    uint8_t *seen = (uint8_t *)calloc((size_t)(top + 7) / 8, 1);
    if (!seen) return is_error_set(IS_ERR_NOMEM, "%s: out of memory", who);
    is_status st = IS_OK;
    for (int32_t i = 0; i < n && st == IS_OK; i++) {
        const int32_t r = rows[i];
        if (seen[r >> 3] & (1u << (r & 7)))
            st = is_error_set(IS_ERR_INVALID_ARG, "%s: row %d given twice", who, r);
        seen[r >> 3] |= (uint8_t)(1u << (r & 7));
    }
    for (int64_t r = m->count; r < top && st == IS_OK; r++)
        if (!(seen[r >> 3] & (1u << (r & 7))))
            st = is_error_set(IS_ERR_INVALID_ARG,
                              "%s: row %lld is neither present nor given (a gap)", who,
                              (long long)r);
    free(seen);
    *new_count = (int32_t)top;
    return st;
}

static is_status set_rows(cuda_fact_matrix *m, const int32_t *rows, int32_t n, const float *data,
                          bool on_device, const char *who) {
    if (!m || n < 0 || (n > 0 && (!rows || !data)))
        return is_error_set(IS_ERR_INVALID_ARG, "%s: bad argument", who);
    if (n == 0) return IS_OK;
    int32_t new_count = 0;
    is_status st = check_rows(m, rows, n, &new_count, who);
    if (st != IS_OK) return st;
    const size_t dim = (size_t)m->dim;
    if (!on_device)
        for (size_t i = 0; i < (size_t)n * dim; i++)
            if (!isfinite(data[i]))
                return is_error_set(IS_ERR_INVALID_ARG, "%s: value %zu of row %d is not finite",
                                    who, i % dim, rows[i / dim]);
    CUDA_CHECK(cudaSetDevice(m->device));
    if ((st = reserve(m, new_count)) != IS_OK) return st;
    const cudaMemcpyKind kind = on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    for (int32_t i = 0; i < n;) {
        int32_t j = i + 1;
        while (j < n && rows[j] == rows[j - 1] + 1) j++;
        CUDA_CHECK(cudaMemcpyAsync(m->rows + (size_t)rows[i] * dim, data + (size_t)i * dim,
                                   (size_t)(j - i) * dim * sizeof(float), kind, RETRIEVAL_STREAM));
        i = j;
    }
    CUDA_CHECK(cudaStreamSynchronize(RETRIEVAL_STREAM));
    m->count = new_count;
    return IS_OK;
}

extern "C" is_status cuda_fact_matrix_set_rows(cuda_fact_matrix *m, const int32_t *rows, int32_t n,
                                               const float *data) {
    return set_rows(m, rows, n, data, false, "cuda_fact_matrix_set_rows");
}

extern "C" is_status cuda_fact_matrix_set_rows_device(cuda_fact_matrix *m, const int32_t *rows,
                                                      int32_t n, const float *data_dev) {
    return set_rows(m, rows, n, data_dev, true, "cuda_fact_matrix_set_rows_device");
}

extern "C" is_status cuda_fact_matrix_remove_row(cuda_fact_matrix *m, int32_t row,
                                                 int32_t *moved_from) {
    if (!m || !moved_from || row < 0 || row >= m->count)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda_fact_matrix_remove_row: row %d not in [0, %d)", row,
                            m ? m->count : 0);
    const int32_t last = m->count - 1;
    if (row != last) {
        CUDA_CHECK(cudaSetDevice(m->device));
        const size_t dim = (size_t)m->dim;
        CUDA_CHECK(cudaMemcpyAsync(m->rows + (size_t)row * dim, m->rows + (size_t)last * dim,
                                   dim * sizeof(float), cudaMemcpyDeviceToDevice,
                                   RETRIEVAL_STREAM));
        CUDA_CHECK(cudaStreamSynchronize(RETRIEVAL_STREAM));
    }
    *moved_from = row != last ? last : -1;
    m->count = last;
    return IS_OK;
}

/* ---- search ------------------------------------------------------------ */

static int32_t pow2_at_least(int64_t n) {
    int32_t p = 1;
    while (p < n) p <<= 1;
    return p;
}

/* Replaces a device buffer by one of n elements of `size` bytes (contents
 * lost). Queued work may read the old one: cudaFree waits for the device. */
static is_status regrow(void **buf, size_t n, size_t size) {
    CUDA_CHECK(cudaFree(*buf));
    *buf = NULL;
    CUDA_CHECK(cudaMalloc(buf, n * size));
    return IS_OK;
}

extern "C" is_status cuda_fact_matrix_search(cuda_fact_matrix *m, const float *query_dev, int32_t k,
                                             int32_t *idx_out, float *score_out, int32_t *n_out) {
    if (!m || !n_out || k < 0 || k > CUDA_TOPK_MAX ||
        (k > 0 && (!query_dev || !idx_out || !score_out)))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda_fact_matrix_search: bad argument (k %d, at most %d)", k,
                            CUDA_TOPK_MAX);
    const int32_t n = m->count;
    if (k == 0 || n == 0) {
        *n_out = 0;
        return IS_OK;
    }
    const int32_t kk = k < n ? k : n;
    /* Chunks of at least 8 k pairs: each round cuts the candidates 8x or more. */
    int32_t chunk = 8 * pow2_at_least(kk);
    if (chunk < 4096) chunk = 4096;
    IS_ASSERT(chunk <= TOPK_CHUNK_MAX);
    CUDA_CHECK(cudaSetDevice(m->device));
    is_status st;
    if (m->key_cap < m->cap) {
        m->key_cap = 0;
        if ((st = regrow((void **)&m->keys, (size_t)m->cap, sizeof(uint64_t))) != IS_OK) return st;
        m->key_cap = m->cap;
    }
    const int64_t n_cand = n > chunk ? ((int64_t)n + chunk - 1) / chunk * kk : 0;
    if (n_cand > m->cand_cap) {
        free_candidates(m);
        for (int i = 0; i < 2; i++) {
            if ((st = regrow((void **)&m->cand_keys[i], (size_t)n_cand, sizeof(uint64_t))) !=
                    IS_OK ||
                (st = regrow((void **)&m->cand_idx[i], (size_t)n_cand, sizeof(int32_t))) != IS_OK) {
                free_candidates(m);
                return st;
            }
        }
        m->cand_cap = n_cand;
    }

    cudaStream_t s = RETRIEVAL_STREAM;
    const bool vec4 = m->dim % 4 == 0 && ((uintptr_t)query_dev & 15) == 0;
    score_kernel<<<cuda_blocks_for((int64_t)n * 32, SCORE_THREADS), SCORE_THREADS, 0, s>>>(
        m->keys, m->rows, query_dev, n, m->dim, vec4);
    CUDA_CHECK_LAUNCH();
    const uint64_t *keys = m->keys;
    const int32_t *idx = NULL;
    int64_t cur = n;
    int pp = 0;
    while (cur > chunk) {
        const int64_t blocks = (cur + chunk - 1) / chunk;
        IS_ASSERT(blocks * kk <= m->cand_cap);
        topk_block_kernel<<<(unsigned)blocks, TOPK_THREADS, (size_t)chunk * TOPK_PAIR_BYTES, s>>>(
            keys, idx, cur, chunk, kk, m->cand_keys[pp], m->cand_idx[pp], NULL);
        CUDA_CHECK_LAUNCH();
        keys = m->cand_keys[pp];
        idx = m->cand_idx[pp];
        cur = blocks * kk;
        pp ^= 1;
    }
    const int32_t last = pow2_at_least(cur);
    const int threads = last / 2 < 32 ? 32 : last / 2 > TOPK_THREADS ? TOPK_THREADS : last / 2;
    /* Rows then scores, packed: one copy of 8 kk bytes. */
    int32_t *res_idx = (int32_t *)m->result;
    float *res_score = (float *)(res_idx + kk);
    topk_block_kernel<<<1, threads, (size_t)last * TOPK_PAIR_BYTES, s>>>(keys, idx, cur, last, kk,
                                                                         NULL, res_idx, res_score);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(
        cudaMemcpyAsync(m->result_host, m->result, (size_t)kk * 8, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    memcpy(idx_out, m->result_host, (size_t)kk * sizeof(int32_t));
    memcpy(score_out, (const int32_t *)m->result_host + kk, (size_t)kk * sizeof(float));
    *n_out = kk;
    return IS_OK;
}

extern "C" is_status cuda_fact_matrix_score_rows(cuda_fact_matrix *m, const float *query_dev,
                                                 const int32_t *rows, int32_t n, float *score_out) {
    if (!m || n < 0 || n > CUDA_TOPK_MAX || (n > 0 && (!query_dev || !rows || !score_out)))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda_fact_matrix_score_rows: bad argument (n %d, at most %d)", n,
                            CUDA_TOPK_MAX);
    for (int32_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= m->count)
            return is_error_set(IS_ERR_INVALID_ARG,
                                "cuda_fact_matrix_score_rows: row %d not in [0, %d)", rows[i],
                                m->count);
    if (n == 0) return IS_OK;
    CUDA_CHECK(cudaSetDevice(m->device));
    /* The result buffers serve: rows go up into the first n ints, scores
     * come back from the floats after them (room for CUDA_TOPK_MAX of each). */
    cudaStream_t s = RETRIEVAL_STREAM;
    int32_t *d_rows = (int32_t *)m->result;
    float *d_score = (float *)(d_rows + n);
    memcpy(m->result_host, rows, (size_t)n * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(d_rows, m->result_host, (size_t)n * sizeof(int32_t),
                               cudaMemcpyHostToDevice, s));
    const bool vec4 = m->dim % 4 == 0 && ((uintptr_t)query_dev & 15) == 0;
    score_rows_kernel<<<cuda_blocks_for((int64_t)n * 32, SCORE_THREADS), SCORE_THREADS, 0, s>>>(
        d_score, d_rows, m->rows, query_dev, n, m->dim, vec4);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(
        cudaMemcpyAsync(score_out, d_score, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return IS_OK;
}

/* ---- the retrieval interface (backend/retrieval.h) -------------------- */

static is_status vector_alloc(int32_t device, int32_t n, float **out_dev) {
    if (n < 1 || !out_dev)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda retrieval: bad vector size %d", n);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        cudaGetLastError();
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda retrieval: no device %d", device);
    }
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMalloc((void **)out_dev, (size_t)n * sizeof(float)));
    return IS_OK;
}

static void vector_free(int32_t device, float *dev) {
    if (!dev) return;
    cudaSetDevice(device);
    cudaFree(dev);
    cudaGetLastError(); /* nothing to report from a free */
}

extern "C" const retrieval_ops *retrieval_cuda_ops(void) {
    static const retrieval_ops ops = {
        "cuda",
        cuda_embedder_create,
        cuda_embedder_free,
        cuda_embedder_embed_ids,
        cuda_embedder_embed,
        cuda_embedder_embed_device,
        cuda_fact_matrix_create,
        cuda_fact_matrix_free,
        cuda_fact_matrix_count,
        cuda_fact_matrix_set_rows,
        cuda_fact_matrix_remove_row,
        cuda_fact_matrix_search,
        cuda_fact_matrix_score_rows,
        vector_alloc,
        vector_free,
    };
    return &ops;
}

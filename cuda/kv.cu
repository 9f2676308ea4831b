/*
 * kv: scatter of K and V rows into the paged cache, injection of facts from
 * the arena, and the arena's fill (see kv.cuh).
 */
#include "kv.cuh"

#include <cuda_fp8.h>

extern "C" {
#include "core/fp8.h"
}

/* An e4m3 code's value, through CUDA's own type (exact). */
static __device__ __forceinline__ float fp8_value(uint8_t code) {
    __nv_fp8_e4m3 q;
    q.__x = code;
    return (float)q;
}

/* One block per (token, KV head); threads copy the head's elements. */
template <typename CT>
static __global__ void kv_store_kernel(CT *k_cache, CT *v_cache, const float *k, const float *v,
                                       const int32_t *slots, int32_t n_kv_heads, int32_t head_dim,
                                       int32_t block_size) {
    int32_t t = blockIdx.x, h = blockIdx.y;
    int32_t slot = slots[t];
    int64_t block = slot / block_size, off = slot % block_size;
    int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim;
    int64_t src = ((int64_t)t * n_kv_heads + h) * head_dim;
    for (int32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        kv_put(k_cache + dst + i, k[src + i]);
        kv_put(v_cache + dst + i, v[src + i]);
    }
}

is_status cuda_kv_store(cudaStream_t s, void *k_cache, void *v_cache, const float *k,
                        const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                        int32_t head_dim, int32_t block_size, bool bf16) {
    if (T <= 0 || n_kv_heads <= 0) return IS_OK;
    dim3 grid((unsigned)T, (unsigned)n_kv_heads);
    int threads = head_dim >= 128 ? 128 : (head_dim + 31) / 32 * 32;
    if (bf16)
        kv_store_kernel<<<grid, threads, 0, s>>>((__nv_bfloat16 *)k_cache, (__nv_bfloat16 *)v_cache,
                                                 k, v, slots, n_kv_heads, head_dim, block_size);
    else
        kv_store_kernel<<<grid, threads, 0, s>>>((float *)k_cache, (float *)v_cache, k, v, slots,
                                                 n_kv_heads, head_dim, block_size);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* Element d of head x rotated with its pair partner by the table row tab
 * ([half][cos, sin]; neg: a negative position, sin negated): the value
 * rope_kernel leaves there. Elements past the rotated ones pass through. */
template <typename Load>
static __device__ __forceinline__ float rope_element(Load x, int32_t d, int32_t half, bool neox,
                                                     const float *tab, bool neg) {
    if (d >= 2 * half) return x(d);
    const int32_t pi = neox ? (d < half ? d : d - half) : d / 2;
    const int32_t i0 = neox ? pi : 2 * pi, i1 = neox ? pi + half : 2 * pi + 1;
    const float c = tab[2 * pi], sn = neg ? -tab[2 * pi + 1] : tab[2 * pi + 1];
    const float a = x(i0), b = x(i1);
    return d == i0 ? rope_first(a, b, c, sn) : rope_second(a, b, c, sn);
}

/* Where rope_store reads q, k and v: token t's row at t * q_stride (q) or
 * t * kv_stride (k, v) floats from each pointer, each value the sum of the
 * row's element, its lo half at lo_off floats further (0: none) and its
 * bias (NULL: none), in that order: the sums cuda_split_columns makes, so
 * that rotating straight from a stacked product gives the bits of split,
 * then rope_store. The unfused op reads q, k, v themselves (no lo, no bias). */
typedef struct rs_src {
    const float *q, *k, *v;
    int64_t q_stride, kv_stride, lo_off;
    const float *bq, *bk, *bv;
} rs_src;

static __device__ __forceinline__ float rs_load(const float *row, int64_t lo_off, const float *bias,
                                                int32_t col) {
    float x = row[col];
    if (lo_off) x += row[lo_off + col];
    if (bias) x += bias[col];
    return x;
}

/* Blocks (token, slice): the first q_blocks slices of a token rotate its
 * queries' pairs (as rope_kernel: a thread per pair) into q, the others
 * rotate each key element with its pair partner (as inject_kernel) and
 * store it with its value, a thread per element. A token's work spread over
 * several blocks (12 for the 8B shape) instead of one: a 30-token query is
 * otherwise 30 blocks, too few to keep the memory busy. */
template <typename CT>
static __global__ void
rope_store_kernel(float *q, rs_src src, CT *k_cache, CT *v_cache, const int32_t *pos,
                  const int32_t *slots, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                  int32_t block_size, int32_t half, bool neox, const float *cs, int32_t q_blocks) {
    pdl_wait(); /* launched as a dependent: nothing before this */
    const int32_t t = blockIdx.x, p = pos[t];
    const float *tab = cs + (int64_t)(p < 0 ? -p : p) * half * 2;
    if ((int32_t)blockIdx.y < q_blocks) {
        const int32_t k2 = blockIdx.y * blockDim.x + threadIdx.x;
        if (k2 >= n_heads * half) return;
        const int32_t i = k2 % half, hd0 = (k2 / half) * head_dim;
        const float *row = src.q + (int64_t)t * src.q_stride;
        float *x = q + (int64_t)t * n_heads * head_dim + hd0;
        const float c = tab[2 * i], sn = p < 0 ? -tab[2 * i + 1] : tab[2 * i + 1];
        const int32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        const float a = rs_load(row, src.lo_off, src.bq, hd0 + i0);
        const float b = rs_load(row, src.lo_off, src.bq, hd0 + i1);
        x[i0] = rope_first(a, b, c, sn);
        x[i1] = rope_second(a, b, c, sn);
        if (src.q != q && 2 * half < head_dim) /* a partial rotation: the rest passes through */
            for (int32_t d = 2 * half + i; d < head_dim; d += half)
                x[d] = rs_load(row, src.lo_off, src.bq, hd0 + d);
        return;
    }
    const int32_t kv_dim = n_kv_heads * head_dim;
    const int32_t e = (blockIdx.y - q_blocks) * blockDim.x + threadIdx.x;
    if (e >= kv_dim) return;
    const int32_t slot = slots[t];
    const int64_t block = slot / block_size, off = slot % block_size;
    const float *kt = src.k + (int64_t)t * src.kv_stride, *vt = src.v + (int64_t)t * src.kv_stride;
    const int32_t h = e / head_dim, d = e % head_dim;
    const int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim + d;
    const int32_t h0 = h * head_dim;
    kv_put(k_cache + dst,
           rope_element([=](int32_t i) { return rs_load(kt, src.lo_off, src.bk, h0 + i); }, d, half,
                        neox, tab, p < 0));
    kv_put(v_cache + dst, rs_load(vt, src.lo_off, src.bv, e));
}

#define ROPE_STORE_THREADS 256

static is_status rope_store_launch(cudaStream_t s, float *q, const rs_src &src, void *k_cache,
                                   void *v_cache, const int32_t *pos, const int32_t *slots,
                                   int32_t T, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                   int32_t block_size, int32_t n_rot, bool neox, const float *cs,
                                   bool bf16, bool pdl) {
    if (T <= 0) return IS_OK;
    const int32_t half = n_rot / 2;
    const int32_t q_blocks = (n_heads * half + ROPE_STORE_THREADS - 1) / ROPE_STORE_THREADS;
    const int32_t kv_blocks = (n_kv_heads * head_dim + ROPE_STORE_THREADS - 1) / ROPE_STORE_THREADS;
    if (q_blocks + kv_blocks > 65535)
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda rope_store: %d heads of %d too wide", n_heads,
                            head_dim);
    const dim3 grid((unsigned)T, (unsigned)(q_blocks + kv_blocks));
    if (bf16)
        CUDA_CHECK(cuda_launch_dependent(
            rope_store_kernel<__nv_bfloat16>, grid, dim3(ROPE_STORE_THREADS), 0, s, pdl, q, src,
            (__nv_bfloat16 *)k_cache, (__nv_bfloat16 *)v_cache, pos, slots, n_heads, n_kv_heads,
            head_dim, block_size, half, neox, cs, q_blocks));
    else
        CUDA_CHECK(cuda_launch_dependent(rope_store_kernel<float>, grid, dim3(ROPE_STORE_THREADS),
                                         0, s, pdl, q, src, (float *)k_cache, (float *)v_cache, pos,
                                         slots, n_heads, n_kv_heads, head_dim, block_size, half,
                                         neox, cs, q_blocks));
    return IS_OK;
}

is_status cuda_rope_store(cudaStream_t s, float *q, const float *k, const float *v, void *k_cache,
                          void *v_cache, const int32_t *pos, const int32_t *slots, int32_t T,
                          int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                          int32_t n_rot, bool neox, const float *cs, bool bf16, bool pdl) {
    const int32_t kv_dim = n_kv_heads * head_dim;
    const rs_src src = {q, k, v, (int64_t)n_heads * head_dim, kv_dim, 0, NULL, NULL, NULL};
    return rope_store_launch(s, q, src, k_cache, v_cache, pos, slots, T, n_heads, n_kv_heads,
                             head_dim, block_size, n_rot, neox, cs, bf16, pdl);
}

is_status cuda_rope_store_stacked(cudaStream_t s, float *q, const float *part, int32_t T,
                                  bool halves, const float *bq, const float *bk, const float *bv,
                                  void *k_cache, void *v_cache, const int32_t *pos,
                                  const int32_t *slots, int32_t n_heads, int32_t n_kv_heads,
                                  int32_t head_dim, int32_t block_size, int32_t n_rot, bool neox,
                                  const float *cs, bool bf16, bool pdl) {
    const int64_t q_dim = (int64_t)n_heads * head_dim, kv_dim = (int64_t)n_kv_heads * head_dim;
    const int64_t rows = q_dim + 2 * kv_dim;
    const rs_src src = {part, part + q_dim, part + q_dim + kv_dim,
                        rows, rows,         halves ? (int64_t)T * rows : 0,
                        bq,   bk,           bv};
    return rope_store_launch(s, q, src, k_cache, v_cache, pos, slots, T, n_heads, n_kv_heads,
                             head_dim, block_size, n_rot, neox, cs, bf16, pdl);
}

/* One block per (token, layer); thread e takes element e of the token's
 * kv_dim keys (rotated with its pair partner, as rope_kernel rotates: the
 * same table, the same expressions) and values. */
template <typename CT>
static __global__ void inject_kernel(void *const *caches, const __nv_bfloat16 *arena,
                                     const int32_t *pages, const int32_t *slots, const int32_t *pos,
                                     int32_t n_layers, int32_t l0, int32_t n_kv_heads,
                                     int32_t head_dim, int32_t block_size, int32_t n_rot, bool neox,
                                     const float *cs) {
    const int32_t i = blockIdx.x, l = l0 + (int32_t)blockIdx.y;
    const int32_t kv_dim = n_kv_heads * head_dim, half = n_rot / 2, p = pos[i];
    const __nv_bfloat16 *kr =
        arena + (int64_t)pages[i] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim;
    const __nv_bfloat16 *vr = kr + (int64_t)n_layers * kv_dim;
    CT *kc = (CT *)caches[l], *vc = (CT *)caches[n_layers + l];
    const int32_t slot = slots[i];
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        const int32_t h = e / head_dim, d = e % head_dim;
        const int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim + d;
        const __nv_bfloat16 *kh = kr + (int64_t)h * head_dim;
        kv_put(kc + dst, rope_element([=](int32_t i) { return kv_load(kh + i); }, d, half, neox,
                                      cs + (int64_t)p * half * 2, false));
        kv_put(vc + dst, __bfloat162float(vr[e]));
    }
}

/* The bf16 cache with every dimension rotated (the serving case): a thread
 * takes 8 elements of a head with 16-byte loads and stores (the old kernel
 * above moved 2 bytes a load and was ~3x off the copy bandwidth at k = 50),
 * or for the neox layout 8 elements and their 8 partners half a head away,
 * in each of INJECT_HEADS heads. The rotation is rope_kernel's expression,
 * as above. Consecutive threads take consecutive units of a head's row, so
 * they read and write 256-byte runs. */
static __device__ __forceinline__ void bf16x8_to_f32(const uint4 &u, float *f) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 v = __bfloat1622float2(h[j]);
        f[2 * j] = v.x;
        f[2 * j + 1] = v.y;
    }
}

static __device__ __forceinline__ uint4 f32_to_bf16x8(const float *f) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return u;
}

/* KV heads a thread takes: the same 16-byte piece (unit) of one token's
 * keys and values in each, so their loads are in flight together and the
 * unit's rotation table entries (32 bytes, f32, the same for every head and
 * layer of the token) are read once for them, not once a head (those reads
 * had been as many bytes from L2 as the keys' and values' from DRAM). */
#define INJECT_HEADS 4

static __global__ void __launch_bounds__(256)
    inject_bf16_kernel(void *const *caches, const __nv_bfloat16 *arena, const int32_t *pages,
                       const int32_t *slots, const int32_t *pos, int32_t n_tokens, int32_t n_layers,
                       int32_t l0, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                       bool neox, const float *cs) {
    /* Block (x: 256 of the layer's (token, head group, unit) triples, y:
     * layer); 32-bit index arithmetic (the host checks that it fits: the
     * 64-bit divisions of a grid-stride loop over every layer were most of
     * the kernel's instructions). */
    const int32_t kv_dim = n_kv_heads * head_dim, half = head_dim / 2;
    const int32_t per_head = neox ? head_dim / 16 : head_dim / 8;
    const int32_t groups = (n_kv_heads + INJECT_HEADS - 1) / INJECT_HEADS;
    const int32_t l = l0 + (int32_t)blockIdx.y, per_token = groups * per_head;
    const int32_t idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_tokens * per_token) return;
    const int32_t i = idx / per_token, rem = idx - i * per_token;
    const int32_t h0 = rem / per_head * INJECT_HEADS, d = (rem % per_head) * 8;
    __nv_bfloat16 *kc = (__nv_bfloat16 *)caches[l], *vc = (__nv_bfloat16 *)caches[n_layers + l];
    const int64_t rec = 2 * (int64_t)n_layers * kv_dim; /* an arena page's elements */
    const __nv_bfloat16 *kr = arena + pages[i] * rec + (int64_t)l * kv_dim;
    const __nv_bfloat16 *vr = kr + (int64_t)n_layers * kv_dim;
    const int32_t slot = slots[i];
    const int64_t row0 =
        ((int64_t)(slot / block_size) * n_kv_heads) * block_size + slot % block_size;
    uint4 k0[INJECT_HEADS], k1[INJECT_HEADS], v0[INJECT_HEADS], v1[INJECT_HEADS];
#pragma unroll
    for (int j = 0; j < INJECT_HEADS; j++) {
        const int32_t h = h0 + j;
        if (h >= n_kv_heads) break;
        k0[j] = *reinterpret_cast<const uint4 *>(kr + h * head_dim + d);
        v0[j] = *reinterpret_cast<const uint4 *>(vr + h * head_dim + d);
        if (neox) {
            k1[j] = *reinterpret_cast<const uint4 *>(kr + h * head_dim + d + half);
            v1[j] = *reinterpret_cast<const uint4 *>(vr + h * head_dim + d + half);
        }
    }
    /* Pairs (d + 2e, d + 2e + 1), e < 4: table entries d / 2 + e; neox:
     * pairs (d + e, d + e + half), e < 8: entries d + e. */
    const float *ce = cs + (int64_t)pos[i] * half * 2;
    float c[16];
#pragma unroll
    for (int e = 0; e < 4; e++)
        if (neox || e < 2)
            *reinterpret_cast<float4 *>(c + 4 * e) =
                *reinterpret_cast<const float4 *>(ce + (neox ? 2 * d : d) + 4 * e);
#pragma unroll
    for (int j = 0; j < INJECT_HEADS; j++) {
        const int32_t h = h0 + j;
        if (h >= n_kv_heads) break;
        /* The row of KV head h at this slot: h block_size rows after head 0's. */
        const int64_t dst = (row0 + (int64_t)h * block_size) * head_dim;
        float a[8], b[8];
        bf16x8_to_f32(k0[j], a);
        if (!neox) {
            float o[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float x0 = a[2 * e], x1 = a[2 * e + 1], co = c[2 * e], sn = c[2 * e + 1];
                o[2 * e] = rope_first(x0, x1, co, sn);
                o[2 * e + 1] = rope_second(x0, x1, co, sn);
            }
            *reinterpret_cast<uint4 *>(kc + dst + d) = f32_to_bf16x8(o);
            *reinterpret_cast<uint4 *>(vc + dst + d) = v0[j];
        } else {
            bf16x8_to_f32(k1[j], b);
            float o0[8], o1[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float co = c[2 * e], sn = c[2 * e + 1];
                o0[e] = rope_first(a[e], b[e], co, sn);
                o1[e] = rope_second(a[e], b[e], co, sn);
            }
            *reinterpret_cast<uint4 *>(kc + dst + d) = f32_to_bf16x8(o0);
            *reinterpret_cast<uint4 *>(kc + dst + d + half) = f32_to_bf16x8(o1);
            *reinterpret_cast<uint4 *>(vc + dst + d) = v0[j];
            *reinterpret_cast<uint4 *>(vc + dst + d + half) = v1[j];
        }
    }
}

/* inject_kernel from an fp8 arena: each key element is its code's value
 * times its head's scale (exact in f32), then rotated as there. */
template <typename CT>
static __global__ void
inject_fp8_kernel(void *const *caches, const uint8_t *arena, const int32_t *pages,
                  const int32_t *slots, const int32_t *pos, int32_t n_layers, int32_t l0,
                  int32_t n_kv_heads, int32_t head_dim, int32_t block_size, int32_t n_rot,
                  bool neox, const float *cs, int64_t page_bytes, int64_t codes_bytes) {
    const int32_t i = blockIdx.x, l = l0 + (int32_t)blockIdx.y;
    const int32_t kv_dim = n_kv_heads * head_dim, half = n_rot / 2, p = pos[i];
    const uint8_t *page = arena + (int64_t)pages[i] * page_bytes;
    const uint8_t *kr = page + (int64_t)l * kv_dim, *vr = page + (int64_t)(n_layers + l) * kv_dim;
    const float *ks = reinterpret_cast<const float *>(page + codes_bytes) + (int64_t)l * n_kv_heads;
    const float *vs = ks + (int64_t)n_layers * n_kv_heads;
    CT *kc = (CT *)caches[l], *vc = (CT *)caches[n_layers + l];
    const int32_t slot = slots[i];
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        const int32_t h = e / head_dim, d = e % head_dim;
        const int64_t dst = ((block * n_kv_heads + h) * block_size + off) * head_dim + d;
        const uint8_t *kh = kr + (int64_t)h * head_dim;
        const float sk = ks[h];
        kv_put(kc + dst, rope_element([=](int32_t j) { return __fmul_rn(fp8_value(kh[j]), sk); }, d,
                                      half, neox, cs + (int64_t)p * half * 2, false));
        kv_put(vc + dst, __fmul_rn(fp8_value(vr[e]), vs[h]));
    }
}

is_status cuda_inject(cudaStream_t s, void *const *caches, const void *arena_v, bool arena_fp8,
                      const int32_t *pages, const int32_t *slots, const int32_t *pos,
                      int32_t n_tokens, int32_t n_layers, int32_t l0, int32_t l1,
                      int32_t n_kv_heads, int32_t head_dim, int32_t block_size, int32_t n_rot,
                      bool neox, const float *cs, bool bf16) {
    if (n_tokens <= 0 || l1 <= l0) return IS_OK;
    if (l0 < 0 || l1 > n_layers || l1 - l0 > 65535)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda inject: bad layers [%d, %d) of %d", (int)l0,
                            (int)l1, (int)n_layers);
    const unsigned nl = (unsigned)(l1 - l0);
    if (arena_fp8) {
        const int64_t page_bytes =
            (int64_t)cuda_arena_page_bytes(n_layers, n_kv_heads, head_dim, true);
        const int64_t codes_bytes =
            ((int64_t)2 * n_layers * n_kv_heads * head_dim + 15) & ~(int64_t)15;
        const dim3 grid((unsigned)n_tokens, nl);
        const int32_t kv_dim = n_kv_heads * head_dim;
        const int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
        const uint8_t *a = (const uint8_t *)arena_v;
        if (bf16)
            inject_fp8_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(
                caches, a, pages, slots, pos, n_layers, l0, n_kv_heads, head_dim, block_size, n_rot,
                neox, cs, page_bytes, codes_bytes);
        else
            inject_fp8_kernel<float><<<grid, threads, 0, s>>>(
                caches, a, pages, slots, pos, n_layers, l0, n_kv_heads, head_dim, block_size, n_rot,
                neox, cs, page_bytes, codes_bytes);
        CUDA_CHECK_LAUNCH();
        return IS_OK;
    }
    const __nv_bfloat16 *arena = (const __nv_bfloat16 *)arena_v;
    const int64_t per_layer = (int64_t)n_tokens * n_kv_heads * head_dim / (neox ? 16 : 8);
    if (bf16 && n_rot == head_dim && head_dim % 16 == 0 && per_layer <= INT32_MAX / 2) {
        const int64_t groups = (n_kv_heads + INJECT_HEADS - 1) / INJECT_HEADS;
        const int64_t threads = (int64_t)n_tokens * groups * (neox ? head_dim / 16 : head_dim / 8);
        const dim3 grid((unsigned)((threads + 255) / 256), nl);
        inject_bf16_kernel<<<grid, 256, 0, s>>>(caches, arena, pages, slots, pos, n_tokens,
                                                n_layers, l0, n_kv_heads, head_dim, block_size,
                                                neox, cs);
        CUDA_CHECK_LAUNCH();
        return IS_OK;
    }
    dim3 grid((unsigned)n_tokens, nl);
    const int32_t kv_dim = n_kv_heads * head_dim;
    int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
    if (bf16)
        inject_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(caches, arena, pages, slots, pos,
                                                              n_layers, l0, n_kv_heads, head_dim,
                                                              block_size, n_rot, neox, cs);
    else
        inject_kernel<float><<<grid, threads, 0, s>>>(caches, arena, pages, slots, pos, n_layers,
                                                      l0, n_kv_heads, head_dim, block_size, n_rot,
                                                      neox, cs);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* One block per (token, layer). */
static __global__ void arena_fill_kernel(__nv_bfloat16 *arena, const int32_t *pages, const float *k,
                                         const float *v, int32_t n_tokens, int32_t n_layers,
                                         int32_t kv_dim) {
    const int32_t j = blockIdx.x, l = blockIdx.y;
    __nv_bfloat16 *kd = arena + (int64_t)pages[j] * 2 * n_layers * kv_dim + (int64_t)l * kv_dim;
    __nv_bfloat16 *vd = kd + (int64_t)n_layers * kv_dim;
    const int64_t src = ((int64_t)l * n_tokens + j) * kv_dim;
    for (int32_t e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        kd[e] = __float2bfloat16_rn(k[src + e]);
        vd[e] = __float2bfloat16_rn(v[src + e]);
    }
}

/* One block per (token, layer), a warp per (K or V, head) row: the row's
 * largest magnitude, its scale by fp8.h's rule (the same expression), and
 * the codes by CUDA's e4m3 conversion (round to nearest even, saturating:
 * fp8.c's rules, checked bit for bit by test_fp8_cuda). */
static __global__ void arena_fill_fp8_kernel(uint8_t *arena, const int32_t *pages, const float *k,
                                             const float *v, int32_t n_tokens, int32_t n_layers,
                                             int32_t n_kv_heads, int32_t head_dim,
                                             int64_t page_bytes, int64_t codes_bytes) {
    const int32_t j = blockIdx.x, l = blockIdx.y;
    const int32_t kv_dim = n_kv_heads * head_dim;
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    uint8_t *page = arena + (int64_t)pages[j] * page_bytes;
    float *scales = reinterpret_cast<float *>(page + codes_bytes);
    const int64_t src = ((int64_t)l * n_tokens + j) * kv_dim;
    for (int32_t r = warp; r < 2 * n_kv_heads; r += n_warps) {
        const int32_t which = r / n_kv_heads, h = r % n_kv_heads; /* which: 0 keys, 1 values */
        const float *x = (which ? v : k) + src + (int64_t)h * head_dim;
        float amax = 0;
        for (int32_t i = lane; i < head_dim; i += 32) amax = fmaxf(amax, fabsf(x[i]));
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float sc = fp8_scale_for_amax(amax), inv = fp8_scale_inverse(sc);
        uint8_t *codes = page + ((int64_t)which * n_layers + l) * kv_dim + (int64_t)h * head_dim;
        for (int32_t i = lane; i < head_dim; i += 32) codes[i] = __nv_fp8_e4m3(x[i] * inv).__x;
        if (lane == 0) scales[((int64_t)which * n_layers + l) * n_kv_heads + h] = sc;
    }
}

is_status cuda_arena_fill(cudaStream_t s, void *arena, const int32_t *pages, const float *k,
                          const float *v, int32_t n_tokens, int32_t n_layers, int32_t n_kv_heads,
                          int32_t head_dim, bool fp8) {
    if (n_tokens <= 0 || n_layers <= 0) return IS_OK;
    const int32_t kv_dim = n_kv_heads * head_dim;
    dim3 grid((unsigned)n_tokens, (unsigned)n_layers);
    if (fp8) {
        const int64_t page_bytes =
            (int64_t)cuda_arena_page_bytes(n_layers, n_kv_heads, head_dim, true);
        const int64_t codes_bytes = ((int64_t)2 * n_layers * kv_dim + 15) & ~(int64_t)15;
        arena_fill_fp8_kernel<<<grid, 256, 0, s>>>((uint8_t *)arena, pages, k, v, n_tokens,
                                                   n_layers, n_kv_heads, head_dim, page_bytes,
                                                   codes_bytes);
        CUDA_CHECK_LAUNCH();
        return IS_OK;
    }
    int threads = kv_dim >= 256 ? 256 : (kv_dim + 31) / 32 * 32;
    arena_fill_kernel<<<grid, threads, 0, s>>>((__nv_bfloat16 *)arena, pages, k, v, n_tokens,
                                               n_layers, kv_dim);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

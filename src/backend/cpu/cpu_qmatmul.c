/*
 * cpu_qmatmul: products with weights still in their GGUF blocks (see
 * cpu_qmatmul.h).
 *
 * Shape of the kernel: threads take contiguous ranges of weight rows. For
 * one row, the tokens are cut into tiles of at most 8; for a tile, each
 * 32-value (sub-)block of the row is expanded into four 8-float registers
 * and multiplied into one accumulator per token (two or four for tiles of
 * 1..4 tokens, so the FMA chains overlap). A tile of 8 keeps 8 accumulators
 * and 4 weight registers live, which is what 16 ymm registers allow; the
 * second tile of a 16-token batch re-reads the row from L1, not memory.
 * Activations are first copied into a per-tile layout, 32 columns of each
 * token in turn, so a tile reads one sequential stream.
 *
 * At one token the kernel is bound by the shuffle port (widening bytes to
 * lanes, broadcasting scales) and by memory; from about four tokens on, by
 * the FMAs themselves (AVX2, 8 lanes), which is where sgemm on the f32 copy
 * eventually overtakes it (cpu_backend.c picks the crossover).
 *
 * Exactness: every expansion forms its value with the same operations as
 * gguf/quant.c. The product scale * quant is exact in f32 for all types
 * here (see quant.h), so an FMA that adds the offset rounds exactly as
 * quant.c's multiply-then-add; f16 values convert exactly (the table below
 * is quant_f16_to_f32's, and F16C's vcvtph2ps, which quant.c also uses for
 * F16 rows, is exact). tests/backend/test_cpu_qmatmul.c checks every
 * expanded weight bit for bit.
 */
#include "backend/cpu/cpu_qmatmul.h"

#include "core/status.h"
#include "gguf/tensor_type.h"
#include "gguf/quant.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define AI       static inline __attribute__((always_inline))
#define MAX_TILE 8
/* How far ahead of the block being expanded to prefetch. At one token the
 * kernel expands a block in 2-3 ns, faster than a miss returns, and with
 * the hardware prefetcher alone decode ran at half the speed (SmolLM2
 * Q4_1, 2 threads: 58 tok/s with none, 115 at 1 KiB, 136 at 3-8 KiB). */
#define PREFETCH_BYTES 4096

/* f16 -> f32 for every half, filled once by quant_f16_to_f32 (so exact and
 * the same as the dequantised copy). A scale then reaches a register as a
 * broadcast load from this table: converting it with F16C and broadcasting
 * costs three shuffle-port uops, and with two scales per Q4_1 block those
 * were half the shuffle work that bounded the one-token kernel. */
static float f16_table[1 << 16];
static pthread_once_t f16_table_once = PTHREAD_ONCE_INIT;

static void f16_table_fill(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) f16_table[h] = quant_f16_to_f32((uint16_t)h);
}

AI const float *f16_ref(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return &f16_table[h];
}

AI __m256 f16_bcast(const uint8_t *p) { return _mm256_broadcast_ss(f16_ref(p)); }

/* 8 signed bytes at p, extended to 32-bit lanes (the load folds into the
 * extension). */
AI __m256i i8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Bytes 0..7 and 8..15 of v, zero- or sign-extended and converted to float. */
AI __m256 u8_lo_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
AI __m256 u8_hi_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
AI __m256 i8_lo_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
AI __m256 i8_hi_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* ---- block expansion --------------------------------------------------------
 * DEQ(b, s, w) puts values 32*s .. 32*s+31 of the block at b in w[0..3].
 * Each value is formed with quant.c's operations; products of a scale and a
 * quant are exact, so an FMA that adds an offset rounds as quant.c does. */

/* Nibbles of 16 bytes: low ones (values 0..15) to lo, high ones (16..31) to hi. */
AI void nibbles(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0f);
    *lo = _mm_and_si128(v, m4);
    *hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
}

/* Q4_0: f16 d | u8 qs[16]; y[j] = (lo(qs[j]) - 8) * d, y[j+16] = (hi - 8) * d. */
AI void deq_q4_0(const uint8_t *b, int s, __m256 w[4]) {
    const __m256 d = f16_bcast(b);
    __m128i lo, hi;
    nibbles(b + 2, &lo, &hi);
    lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
    hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    w[0] = _mm256_mul_ps(i8_lo_ps(lo), d);
    w[1] = _mm256_mul_ps(i8_hi_ps(lo), d);
    w[2] = _mm256_mul_ps(i8_lo_ps(hi), d);
    w[3] = _mm256_mul_ps(i8_hi_ps(hi), d);
}

/* Q4_1: f16 d | f16 m | u8 qs[16]; y = q * d + m (q * d is exact). */
AI void deq_q4_1(const uint8_t *b, int s, __m256 w[4]) {
    const __m256 d = f16_bcast(b), m = f16_bcast(b + 2);
    __m128i lo, hi;
    nibbles(b + 4, &lo, &hi);
    w[0] = _mm256_fmadd_ps(u8_lo_ps(lo), d, m);
    w[1] = _mm256_fmadd_ps(u8_hi_ps(lo), d, m);
    w[2] = _mm256_fmadd_ps(u8_lo_ps(hi), d, m);
    w[3] = _mm256_fmadd_ps(u8_hi_ps(hi), d, m);
}

/* Q8_0: f16 d | i8 qs[32]; y = qs * d. */
AI void deq_q8_0(const uint8_t *b, int s, __m256 w[4]) {
    const __m256 d = f16_bcast(b);
    for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(i8x8(b + 2 + 8 * k)), d);
}

/* Q4_K: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]; sub-block s uses
 * the low (s even) or high (s odd) nibbles of qs[32*(s/2) ..], and
 * y = (d * sc) * q - dmin * m with 6-bit sc, m unpacked as ggml's
 * get_scale_min_k4 does. */
AI void deq_q4_k(const uint8_t *b, int s, __m256 w[4]) {
    const uint8_t *sc6 = b + 4;
    uint8_t sc, mn;
    if (s < 4) {
        sc = sc6[s] & 63;
        mn = sc6[s + 4] & 63;
    } else {
        sc = (uint8_t)((sc6[s + 4] & 0x0f) | ((sc6[s - 4] >> 6) << 4));
        mn = (uint8_t)((sc6[s + 4] >> 4) | ((sc6[s] >> 6) << 4));
    }
    const __m256 d1 = _mm256_set1_ps(*f16_ref(b) * (float)sc);
    const __m256 m1 = _mm256_set1_ps(*f16_ref(b + 2) * (float)mn);
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s / 2)));
    if (s & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_fmsub_ps(d1, u8_lo_ps(q0), m1);
    w[1] = _mm256_fmsub_ps(d1, u8_hi_ps(q0), m1);
    w[2] = _mm256_fmsub_ps(d1, u8_lo_ps(q1), m1);
    w[3] = _mm256_fmsub_ps(d1, u8_hi_ps(q1), m1);
}

/* Q6_K: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d. Sub-block s is
 * half h = s/4, k = s%4: values l + 32k (l < 32) of the half take the low
 * (k < 2) or high nibble of ql[l + 32*(k&1)] and bits 2k..2k+1 of qh[l],
 * minus 32, times d * scales[l/16 + 2k] (that product first, as quant.c). */
AI void deq_q6_k(const uint8_t *b, int s, __m256 w[4]) {
    const int h = s / 4, k = s % 4;
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const int8_t *scales = (const int8_t *)(b + 192 + 8 * h);
    const float d = *f16_ref(b + 208);
    const __m256 da = _mm256_set1_ps(d * (float)scales[2 * k]);
    const __m256 db = _mm256_set1_ps(d * (float)scales[2 * k + 1]);
    __m256i lo = _mm256_loadu_si256((const __m256i *)(ql + 32 * (k & 1)));
    if (k >= 2) lo = _mm256_srli_epi16(lo, 4);
    lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0f));
    __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
    hb = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), _mm256_set1_epi8(3));
    __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(da, i8_lo_ps(q0));
    w[1] = _mm256_mul_ps(da, i8_hi_ps(q0));
    w[2] = _mm256_mul_ps(db, i8_lo_ps(q1));
    w[3] = _mm256_mul_ps(db, i8_hi_ps(q1));
}

/* F16, taken 32 values (64 bytes) at a time. */
AI void deq_f16(const uint8_t *b, int s, __m256 w[4]) {
    for (int k = 0; k < 4; k++)
        w[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * k)));
}

/* ---- one weight row against a tile of tokens ----------------------------- */

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* dst[t * ldy] = sum_c x_t[c] * W_row[c] for t < TT, where the row at wr
 * has nb blocks of BB bytes, each SUBS sub-blocks of 32 values, and xp
 * holds the tile's activations packed as [nb * SUBS][TT][32] (every load
 * of a sub-block is then at a fixed offset from one pointer). */
typedef void (*tile_fn)(const uint8_t *wr, int64_t nb, const float *xp, float *dst, int64_t ldy);

#define DEFINE_TILE(DEQ, BB, SUBS, TT)                                                             \
    static void tile_##DEQ##_##TT(const uint8_t *wr, int64_t nb, const float *xp, float *dst,      \
                                  int64_t ldy) {                                                   \
        enum { NA = TT == 1 ? 4 : TT <= 4 ? 2 : 1 }; /* accumulators per token */                  \
        __m256 acc[TT][NA];                                                                        \
        for (int t = 0; t < TT; t++)                                                               \
            for (int a = 0; a < NA; a++) acc[t][a] = _mm256_setzero_ps();                          \
        for (int64_t ib = 0; ib < nb; ib++) {                                                      \
            for (int s = 0; s < SUBS; s++) {                                                       \
                _mm_prefetch((const char *)wr + ib * (BB) + s * ((BB) / (SUBS)) + PREFETCH_BYTES,  \
                             _MM_HINT_T0);                                                         \
                __m256 w[4];                                                                       \
                DEQ(wr + ib * (BB), s, w);                                                         \
                for (int t = 0; t < TT; t++)                                                       \
                    for (int k = 0; k < 4; k++)                                                    \
                        acc[t][k % NA] = _mm256_fmadd_ps(                                          \
                            w[k], _mm256_loadu_ps(xp + t * 32 + 8 * k), acc[t][k % NA]);           \
                xp += TT * 32;                                                                     \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < TT; t++) {                                                             \
            __m256 v = acc[t][0];                                                                  \
            for (int a = 1; a < NA; a++) v = _mm256_add_ps(v, acc[t][a]);                          \
            dst[t * ldy] = hsum(v);                                                                \
        }                                                                                          \
    }

#define DEFINE_TILES(DEQ, BB, SUBS)                                                                \
    DEFINE_TILE(DEQ, BB, SUBS, 1)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 2)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 3)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 4)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 5)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 6)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 7)                                                                  \
    DEFINE_TILE(DEQ, BB, SUBS, 8)                                                                  \
    static const tile_fn tiles_##DEQ[MAX_TILE] = {tile_##DEQ##_1, tile_##DEQ##_2, tile_##DEQ##_3,  \
                                                  tile_##DEQ##_4, tile_##DEQ##_5, tile_##DEQ##_6,  \
                                                  tile_##DEQ##_7, tile_##DEQ##_8};

DEFINE_TILES(deq_q4_0, 18, 1)
DEFINE_TILES(deq_q4_1, 20, 1)
DEFINE_TILES(deq_q8_0, 34, 1)
DEFINE_TILES(deq_q4_k, 144, 8)
DEFINE_TILES(deq_q6_k, 210, 8)
DEFINE_TILES(deq_f16, 64, 1)

/* ---- dispatch -------------------------------------------------------------- */

typedef struct qmm_type {
    uint32_t type;
    const tile_fn *tiles;
    uint32_t block_elems; /* values per block the tile functions step over */
    uint32_t block_bytes;
} qmm_type;

static const qmm_type qmm_types[] = {
    {TENSOR_TYPE_Q4_0, tiles_deq_q4_0, 32, 18},   {TENSOR_TYPE_Q4_1, tiles_deq_q4_1, 32, 20},
    {TENSOR_TYPE_Q8_0, tiles_deq_q8_0, 32, 34},   {TENSOR_TYPE_Q4_K, tiles_deq_q4_k, 256, 144},
    {TENSOR_TYPE_Q6_K, tiles_deq_q6_k, 256, 210}, {TENSOR_TYPE_F16, tiles_deq_f16, 32, 64},
};

static const qmm_type *qmm_type_find(uint32_t type) {
    for (size_t i = 0; i < sizeof qmm_types / sizeof qmm_types[0]; i++)
        if (qmm_types[i].type == type) return &qmm_types[i];
    return NULL;
}

bool cpu_qmatmul_supports(uint32_t type, int64_t cols) {
    const qmm_type *q = qmm_type_find(type);
    return q != NULL && cols > 0 && cols % q->block_elems == 0;
}

is_status cpu_qmatmul(float *y, const float *x, const void *w, uint32_t type, int64_t rows,
                      int64_t cols, int32_t T) {
    const qmm_type *q = qmm_type_find(type);
    IS_ASSERT(q != NULL && cols > 0 && cols % q->block_elems == 0 && T >= 1 && rows >= 1);
    const int64_t nb = cols / q->block_elems;
    const size_t row_bytes = (size_t)nb * q->block_bytes;
    IS_ASSERT(row_bytes == tensor_type_row_bytes(type, cols)); /* tables agree */
    pthread_once(&f16_table_once, f16_table_fill);

    /* Tiles of balanced sizes: 12 tokens run as 6 + 6, not 8 + 4. */
    const int32_t n_tiles = (T + MAX_TILE - 1) / MAX_TILE;
    const int32_t base = T / n_tiles, extra = T % n_tiles;

    /* Each tile's rows of x interleaved by 32 columns ([cols/32][tt][32]);
     * one token is already in that layout. */
    float *pack = NULL;
    const float *xp = x;
    if (T > 1) {
        if (posix_memalign((void **)&pack, 64, (size_t)T * cols * sizeof(float)) != 0)
            return is_error_set(IS_ERR_NOMEM, "qmatmul: cannot allocate %lld floats",
                                (long long)T * cols);
        const int64_t n32 = cols / 32;
        for (int32_t i = 0, t0 = 0; i < n_tiles; i++) {
            const int32_t tt = base + (i < extra);
            float *dst = pack + (int64_t)t0 * cols;
            for (int64_t c = 0; c < n32; c++)
                for (int32_t t = 0; t < tt; t++)
                    memcpy(dst + (c * tt + t) * 32, x + (int64_t)(t0 + t) * cols + c * 32,
                           32 * sizeof(float));
            t0 += tt;
        }
        xp = pack;
    }

    const uint8_t *wb = w;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = wb + (size_t)r * row_bytes;
        int32_t t0 = 0;
        for (int32_t i = 0; i < n_tiles; i++) {
            const int32_t tt = base + (i < extra);
            q->tiles[tt - 1](wr, nb, xp + (int64_t)t0 * cols, y + (int64_t)t0 * rows + r, rows);
            t0 += tt;
        }
    }
    free(pack);
    return IS_OK;
}

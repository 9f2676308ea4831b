/*
 * flash: tiled paged attention on the tensor cores (see flash.cuh).
 *
 * Shared memory of a block (D = head_dim): Q [BM][D+8] bf16, K and V
 * [BN][D+8] bf16, S [BM][BN+4] f32 whose rows a warp overwrites with its P
 * rows in bf16 (row r of P lies inside S rows <= r, already read), the
 * output accumulator O [BM][D+4] f32, and per-row softmax state. Padding
 * keeps WMMA's 32-byte alignment and spreads rows over the banks. D = 128:
 * 102 KiB, two blocks per multiprocessor.
 */
#include "flash.cuh"

#include <math.h>
#include <mma.h>

using namespace nvcuda;

#define FLASH_THREADS 128

bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads) {
    if (head_dim != 64 && head_dim != 128) return false;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return false;
    return n_heads / n_kv_heads <= FLASH_BM;
}

template <int D> struct flash_layout {
    static constexpr int LDQ = D + 8;        /* bf16 */
    static constexpr int LDS = FLASH_BN + 4; /* f32 */
    static constexpr int LDP = FLASH_BN + 8; /* bf16, aliasing S */
    static constexpr int LDO = D + 4;        /* f32 */
    static constexpr size_t Q_BYTES = (size_t)FLASH_BM * LDQ * 2;
    static constexpr size_t KV_BYTES = (size_t)FLASH_BN * LDQ * 2;
    static constexpr size_t S_BYTES = (size_t)FLASH_BM * LDS * 4;
    static constexpr size_t O_BYTES = (size_t)FLASH_BM * LDO * 4;
    static constexpr size_t ROW_BYTES = (size_t)FLASH_BM * 4 * 4;
    static constexpr size_t BYTES = Q_BYTES + 2 * KV_BYTES + S_BYTES + O_BYTES + ROW_BYTES;
};

template <int D>
static __global__ void __launch_bounds__(FLASH_THREADS)
    flash_kernel(float *out, const float *q, const __nv_bfloat16 *k_cache,
                 const __nv_bfloat16 *v_cache, const int32_t *flat, const int32_t *bt_off,
                 const int32_t *tiles, int32_t n_heads, int32_t n_kv_heads, int32_t block_size,
                 float scale_log2, int32_t n_splits, float *partial) {
    using L = flash_layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *sQ = (__nv_bfloat16 *)smem;
    __nv_bfloat16 *sK = (__nv_bfloat16 *)(smem + L::Q_BYTES);
    __nv_bfloat16 *sV = (__nv_bfloat16 *)(smem + L::Q_BYTES + L::KV_BYTES);
    float *sS = (float *)(smem + L::Q_BYTES + 2 * L::KV_BYTES);
    float *sO = (float *)(smem + L::Q_BYTES + 2 * L::KV_BYTES + L::S_BYTES);
    float *sM = (float *)(smem + L::Q_BYTES + 2 * L::KV_BYTES + L::S_BYTES + L::O_BYTES);
    float *sL = sM + FLASH_BM, *sA = sL + FLASH_BM;
    int32_t *sPos = (int32_t *)(sA + FLASH_BM);

    const int32_t tile = blockIdx.x, kh = blockIdx.y, split = blockIdx.z;
    const int32_t t0 = tiles[4 * tile], n = tiles[4 * tile + 1], seq = tiles[4 * tile + 2],
                  pos0 = tiles[4 * tile + 3];
    const int32_t G = n_heads / n_kv_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int32_t *bt = flat + bt_off[seq];
    const int64_t q_stride = (int64_t)n_heads * D;

    for (int r = tid; r < FLASH_BM; r += FLASH_THREADS) {
        const int32_t ti = r / G;
        sPos[r] = ti < n ? pos0 + ti : -1;
        sM[r] = -INFINITY;
        sL[r] = 0.0f;
    }
    /* Q rows: (token t0 + r / G, head kh * G + r % G), rounded to bf16. */
    for (int c = tid; c < FLASH_BM * D / 4; c += FLASH_THREADS) {
        const int r = c / (D / 4), d = (c % (D / 4)) * 4;
        const int32_t ti = r / G;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (ti < n)
            v = *reinterpret_cast<const float4 *>(q + (int64_t)(t0 + ti) * q_stride +
                                                  (int64_t)(kh * G + r % G) * D + d);
        __nv_bfloat162 *dst = reinterpret_cast<__nv_bfloat162 *>(sQ + r * L::LDQ + d);
        dst[0] = __floats2bfloat162_rn(v.x, v.y);
        dst[1] = __floats2bfloat162_rn(v.z, v.w);
    }
    for (int i = tid; i < FLASH_BM * D; i += FLASH_THREADS) sO[(i / D) * L::LDO + i % D] = 0.0f;

    const int32_t n_keys = pos0 + n; /* the last token sees keys [0, pos0 + n - 1] */
    const int32_t n_kt = (n_keys + FLASH_BN - 1) / FLASH_BN;
    const int32_t per = (n_kt + n_splits - 1) / n_splits;
    const int32_t kt0 = split * per, kt1 = min(n_kt, kt0 + per);
    __syncthreads();

    float *wS = sS + warp * 16 * L::LDS;                 /* this warp's 16 score rows */
    __nv_bfloat16 *wP = reinterpret_cast<__nv_bfloat16 *>(wS); /* its P rows, in place */
    for (int32_t kt = kt0; kt < kt1; kt++) {
        /* K and V tile, 16 bytes a load; keys past the last are zeros. */
        for (int c = tid; c < FLASH_BN * (D / 8); c += FLASH_THREADS) {
            const int r = c / (D / 8), d = (c % (D / 8)) * 8;
            const int32_t j = kt * FLASH_BN + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (j < n_keys) {
                const int64_t off =
                    (((int64_t)bt[j / block_size] * n_kv_heads + kh) * block_size + j % block_size) *
                        D + d;
                kv = *reinterpret_cast<const uint4 *>(k_cache + off);
                vv = *reinterpret_cast<const uint4 *>(v_cache + off);
            }
            *reinterpret_cast<uint4 *>(sK + r * L::LDQ + d) = kv;
            *reinterpret_cast<uint4 *>(sV + r * L::LDQ + d) = vv;
        }
        __syncthreads();

        /* S = Q K^T for this warp's 16 rows. */
        {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FLASH_BN / 16];
#pragma unroll
            for (int nb = 0; nb < FLASH_BN / 16; nb++) wmma::fill_fragment(acc[nb], 0.0f);
#pragma unroll
            for (int kk = 0; kk < D; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::load_matrix_sync(a, sQ + warp * 16 * L::LDQ + kk, L::LDQ);
#pragma unroll
                for (int nb = 0; nb < FLASH_BN / 16; nb++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
                    wmma::load_matrix_sync(b, sK + nb * 16 * L::LDQ + kk, L::LDQ);
                    wmma::mma_sync(acc[nb], a, b, acc[nb]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < FLASH_BN / 16; nb++)
                wmma::store_matrix_sync(wS + nb * 16, acc[nb], L::LDS, wmma::mem_row_major);
        }
        __syncwarp();

        /* Online softmax, one row at a time across the warp (two keys a lane). */
        for (int rr = 0; rr < 16; rr++) {
            const int r = warp * 16 + rr;
            const int32_t rp = sPos[r];
            const int32_t j0 = kt * FLASH_BN + lane, j1 = j0 + 32;
            const float x0 = rp >= 0 && j0 <= rp ? wS[rr * L::LDS + lane] * scale_log2 : -INFINITY;
            const float x1 =
                rp >= 0 && j1 <= rp ? wS[rr * L::LDS + lane + 32] * scale_log2 : -INFINITY;
            const float mx = warp_max(fmaxf(x0, x1)); /* also: every lane has read its scores */
            const float m_old = sM[r], m_new = fmaxf(m_old, mx);
            float p0 = 0.0f, p1 = 0.0f, alpha = 1.0f;
            if (m_new != -INFINITY) {
                p0 = exp2f(x0 - m_new);
                p1 = exp2f(x1 - m_new);
                alpha = exp2f(m_old - m_new);
            }
            const float sum = warp_sum(p0 + p1);
            /* P row rr overlaps S rows <= rr, which every lane has read by
             * now (the shuffles above need each lane's scores); the barrier
             * makes that ordering explicit (racecheck does not count
             * shuffles as one: run 4 reported 55 warnings, 0 errors). */
            __syncwarp();
            wP[rr * L::LDP + lane] = __float2bfloat16_rn(p0);
            wP[rr * L::LDP + lane + 32] = __float2bfloat16_rn(p1);
            if (lane == 0) {
                sM[r] = m_new;
                sL[r] = sL[r] * alpha + sum;
                sA[r] = alpha;
            }
        }
        __syncwarp();
        for (int i = lane; i < 16 * D; i += 32) {
            const int r = warp * 16 + i / D;
            sO[r * L::LDO + i % D] *= sA[r];
        }
        __syncwarp();

        /* O += P V for this warp's rows. */
#pragma unroll
        for (int db = 0; db < D / 16; db++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
            float *op = sO + warp * 16 * L::LDO + db * 16;
            wmma::load_matrix_sync(o, op, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < FLASH_BN; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
                wmma::load_matrix_sync(a, wP + kk, L::LDP);
                wmma::load_matrix_sync(b, sV + kk * L::LDQ + db * 16, L::LDQ);
                wmma::mma_sync(o, a, b, o);
            }
            wmma::store_matrix_sync(op, o, L::LDO, wmma::mem_row_major);
        }
        __syncthreads(); /* K, V and S are overwritten by the next tile */
    }
    __syncthreads();

    if (n_splits == 1) {
        for (int i = tid; i < FLASH_BM * D; i += FLASH_THREADS) {
            const int r = i / D, d = i % D;
            if (sPos[r] < 0) continue;
            const int32_t ti = r / G;
            out[(int64_t)(t0 + ti) * q_stride + (int64_t)(kh * G + r % G) * D + d] =
                sO[r * L::LDO + d] / sL[r];
        }
        return;
    }
    float *part = partial + (((int64_t)tile * n_kv_heads + kh) * n_splits + split) * FLASH_BM * (D + 2);
    for (int i = tid; i < FLASH_BM * D; i += FLASH_THREADS) {
        const int r = i / D, d = i % D;
        part[r * (D + 2) + d] = sO[r * L::LDO + d];
    }
    for (int r = tid; r < FLASH_BM; r += FLASH_THREADS) {
        part[r * (D + 2) + D] = sM[r];
        part[r * (D + 2) + D + 1] = sL[r];
    }
}

/* One block per (tile, KV head): merges the splits' partial softmaxes. */
template <int D>
static __global__ void flash_merge_kernel(float *out, const float *partial, const int32_t *tiles,
                                          int32_t n_heads, int32_t n_kv_heads, int32_t n_splits) {
    const int32_t tile = blockIdx.x, kh = blockIdx.y;
    const int32_t t0 = tiles[4 * tile], n = tiles[4 * tile + 1];
    const int32_t G = n_heads / n_kv_heads;
    const float *base = partial + ((int64_t)tile * n_kv_heads + kh) * n_splits * FLASH_BM * (D + 2);
    const int64_t split_stride = (int64_t)FLASH_BM * (D + 2);
    for (int i = threadIdx.x; i < FLASH_BM * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        if (r / G >= n) continue;
        float mx = -INFINITY;
        for (int z = 0; z < n_splits; z++) mx = fmaxf(mx, base[z * split_stride + r * (D + 2) + D]);
        float num = 0.0f, den = 0.0f;
        for (int z = 0; z < n_splits; z++) {
            const float *p = base + z * split_stride + r * (D + 2);
            if (p[D] == -INFINITY) continue;
            const float w = exp2f(p[D] - mx);
            num += p[d] * w;
            den += p[D + 1] * w;
        }
        out[(int64_t)(t0 + r / G) * n_heads * D + (int64_t)(kh * G + r % G) * D + d] = num / den;
    }
}

template <int D>
static is_status flash_launch(cudaStream_t s, float *out, const float *q,
                              const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                              const int32_t *flat, const int32_t *bt_off, const int32_t *tiles,
                              int32_t n_tiles, int32_t n_splits, float *partial, int32_t n_heads,
                              int32_t n_kv_heads, int32_t block_size) {
    static bool attr_set = false; /* per process; the attribute is per function */
    const size_t smem = flash_layout<D>::BYTES;
    if (!attr_set) {
        CUDA_CHECK(cudaFuncSetAttribute(flash_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        attr_set = true;
    }
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    dim3 grid((unsigned)n_tiles, (unsigned)n_kv_heads, (unsigned)n_splits);
    flash_kernel<D><<<grid, FLASH_THREADS, smem, s>>>(out, q, k_cache, v_cache, flat, bt_off, tiles,
                                                      n_heads, n_kv_heads, block_size, scale_log2,
                                                      n_splits, partial);
    CUDA_CHECK_LAUNCH();
    if (n_splits > 1) {
        flash_merge_kernel<D><<<dim3((unsigned)n_tiles, (unsigned)n_kv_heads), 256, 0, s>>>(
            out, partial, tiles, n_heads, n_kv_heads, n_splits);
        CUDA_CHECK_LAUNCH();
    }
    return IS_OK;
}

is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *bt_off, const int32_t *tiles,
                               int32_t n_tiles, int32_t n_splits, float *partial, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t block_size) {
    if (n_tiles <= 0) return IS_OK;
    if (!cuda_flash_supports(head_dim, n_heads, n_kv_heads))
        return is_error_set(IS_ERR_UNSUPPORTED, "cuda flash attention: head_dim %d, %d/%d heads",
                            head_dim, n_heads, n_kv_heads);
    if (n_splits < 1 || (n_splits > 1 && !partial))
        return is_error_set(IS_ERR_INVALID_ARG, "cuda flash attention: %d splits", n_splits);
    if (head_dim == 64)
        return flash_launch<64>(s, out, q, k_cache, v_cache, flat, bt_off, tiles, n_tiles, n_splits,
                                partial, n_heads, n_kv_heads, block_size);
    return flash_launch<128>(s, out, q, k_cache, v_cache, flat, bt_off, tiles, n_tiles, n_splits,
                             partial, n_heads, n_kv_heads, block_size);
}

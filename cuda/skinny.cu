/*
 * skinny: weight-streaming products for few input rows (see skinny.cuh).
 *
 * Fragments are those of mma.sync m16n8k16 with W as the A operand (16
 * weight rows) and x^T as the B operand (8 input rows as columns). With
 * g = lane / 4 and c = lane % 4, a lane loads, for weight rows g and g + 8
 * of each of its 16-row tiles, the 8 columns [64 i + 8 c, +8) and
 * [64 i + 32 + 8 c, +8) of each 64-column step i. Each 16-byte load holds
 * the lane's A elements of two mma k-steps, in the order the fragment wants
 * them once the mma's logical k is read as a permutation of the physical
 * columns; the B fragments read the same columns of x from shared memory.
 * Four lanes read 64 contiguous bytes of a row: whole 32-byte sectors.
 */
#include "skinny.cuh"

#define SK_WARPS 4
#define SK_THREADS (32 * SK_WARPS)
/* bf16 of padding per shared row of x: a row pitch of 64 modulo 128 bytes
 * puts the 8 lanes of a 16-byte load phase (2 rows x 4 lanes) in distinct
 * banks. */
#define SK_PAD 32
#define SK_SMEM_CAP (200 * 1024)
#define SK_RING_BYTES (64 * 1024) /* the weight ring of a block's 4 warps */

/* x's columns of the block (nt 8-row tiles) and the weight ring (the same
 * size for both cuts). */
static size_t skinny_smem(int32_t nt, int32_t kc) {
    return (size_t)nt * 8 * (kc + SK_PAD) * 2 + SK_RING_BYTES;
}

bool cuda_skinny_supports(int32_t T, int64_t rows, int64_t cols, bool split) {
    if (T <= 0 || rows <= 0 || cols <= 0 || cols % 64 != 0 || cols > INT32_MAX) return false;
    return split ? T <= SKINNY_MAX_T / 2 : T <= SKINNY_MAX_T;
}

/* 8-column tiles of x the kernel holds: a power of two; split inputs pair a
 * tile of hi rows with the tile of the same tokens' lo rows. */
static int32_t skinny_nt(int32_t T, bool split) {
    int32_t n = (T + 7) / 8, p = 1;
    while (p < n) p *= 2;
    return split ? 2 * p : p;
}

skinny_plan cuda_skinny_plan(int32_t T, int64_t rows, int64_t cols, bool split, int32_t n_sms,
                             int32_t mt, int32_t kc) {
    skinny_plan p;
    const int32_t nt = skinny_nt(T, split);
    /* Two 16-row tiles a warp where that still leaves a row tile for every
     * other multiprocessor, else one (more tiles, fewer splits). */
    p.mt = mt == 1 || mt == 2 ? mt : (rows + 127) / 128 >= n_sms / 2 ? 2 : 1;
    p.row_tiles = (int32_t)((rows + 64 * p.mt - 1) / (64 * p.mt));
    const int32_t kc_lim =
        (int32_t)(((SK_SMEM_CAP - SK_RING_BYTES) / (nt * 8 * 2) - SK_PAD) / 64 * 64);
    if (kc > 0) {
        kc = kc / 64 * 64;
        p.kc = kc < 64 ? 64 : kc > kc_lim ? kc_lim : kc;
    } else {
        /* About two blocks a multiprocessor (each ring keeps 48 KiB of
         * weights in flight; run 18's sweep at T = 1 was best around 256
         * blocks), with the partial sums, written and read back, at most a
         * quarter of the weights' bytes. */
        int64_t splits = (2 * (int64_t)n_sms + p.row_tiles - 1) / p.row_tiles;
        const int64_t most = cols / (16 * (int64_t)T);
        if (splits > most) splits = most;
        if (splits < 1) splits = 1;
        p.kc = (int32_t)((cols + splits * 64 - 1) / (splits * 64) * 64);
        if (p.kc > kc_lim) p.kc = kc_lim;
    }
    if (p.kc > cols) p.kc = (int32_t)cols;
    p.n_splits = (int32_t)((cols + p.kc - 1) / p.kc);
    return p;
}

size_t cuda_skinny_partial_floats(const skinny_plan *p, int32_t T, int64_t rows) {
    return p->n_splits > 1 ? (size_t)p->n_splits * T * rows : 0;
}


static __device__ __forceinline__ void mma_bf16(float *d, uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* 16 bytes global -> shared, not through registers nor L1. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(a), "l"(src));
}

static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> static __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int MT, int S, int NT, bool SPLIT>
static __global__ void __launch_bounds__(SK_THREADS)
    skinny_kernel(float *y, const __nv_bfloat16 *w, const __nv_bfloat16 *x, const float *bias,
                  int32_t T, int32_t rows, int32_t cols, int32_t kc, float *partial) {
    constexpr int J = 4 * MT; /* 16-byte chunks a lane takes from each 64-column step */
    extern __shared__ __align__(16) unsigned char smem[];
    const int ld = kc + SK_PAD;
    const int split = blockIdx.y, n_splits = gridDim.y;
    const int k0 = split * kc, klen = min(kc, cols - k0), nkb = klen / 64;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int row_block = blockIdx.x * (SK_WARPS * 16 * MT);
    const int row0 = row_block + warp * 16 * MT;
    __nv_bfloat16 *const sx = reinterpret_cast<__nv_bfloat16 *>(smem);
    /* The weight ring: S steps of this warp's rows, each lane's chunks
     * side by side ([stage][chunk][lane]): a lane reads back only what it
     * copied itself, so no barrier orders the ring, and reads are
     * conflict-free. */
    uint4 *const ring = reinterpret_cast<uint4 *>(smem + (size_t)NT * 8 * ld * 2) +
                        (size_t)warp * S * J * 32 + lane;

    /* Rows past the end read the last row and are not written. Chunk j:
     * tile m = j / 4, row g + 8 (j / 2 % 2), columns 8c (+32 when j odd). */
    const __nv_bfloat16 *wp[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            wp[m][h] = w + (int64_t)min(row0 + 16 * m + 8 * h + g, rows - 1) * cols + k0 + 8 * c;
    auto issue = [&](int i) {
        uint4 *dst = ring + (size_t)(i % S) * J * 32;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int half = 0; half < 2; half++)
                    cp_async16(dst + (4 * m + 2 * h + half) * 32, wp[m][h] + 64 * i + 32 * half);
    };
    /* The first S - 1 steps go out before x's trip to shared memory. */
#pragma unroll
    for (int i = 0; i < S - 1; i++) {
        if (i < nkb) issue(i);
        cp_commit();
    }

    const int chunks = klen / 8;
    for (int i = threadIdx.x; i < NT * 8 * chunks; i += SK_THREADS) {
        const int r = i / chunks, ch = i % chunks;
        const int tok = SPLIT ? (r / 16) * 8 + r % 8 : r;
        const bool lo = SPLIT && ((r / 8) & 1);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (tok < T)
            v = __ldg(reinterpret_cast<const uint4 *>(x + (int64_t)(lo ? T + tok : tok) * cols +
                                                      k0) + ch);
        *reinterpret_cast<uint4 *>(sx + r * ld + ch * 8) = v;
    }
    __syncthreads();

    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][n][e] = 0.0f;

    const __nv_bfloat16 *sxl = sx + g * ld + 8 * c;
    for (int i = 0; i < nkb; i++) {
        cp_wait<S - 2>(); /* step i has landed (groups complete in order) */
        uint4 a[J];
        const uint4 *src = ring + (size_t)(i % S) * J * 32;
#pragma unroll
        for (int j = 0; j < J; j++) a[j] = src[j * 32];
        /* Its slot is free again only now that it is in registers; step
         * i + S - 1 reuses the slot of step i - 1, read last iteration. */
        if (i + S - 1 < nkb) issue(i + S - 1);
        cp_commit();
#pragma unroll
        for (int half = 0; half < 2; half++) {
            uint4 b[NT];
#pragma unroll
            for (int n = 0; n < NT; n++)
                b[n] = *reinterpret_cast<const uint4 *>(sxl + n * 8 * ld + 64 * i + 32 * half);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                const uint4 r0 = a[4 * m + half], r1 = a[4 * m + 2 + half];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    mma_bf16(acc[m][n], r0.x, r1.x, r0.y, r1.y, b[n].x, b[n].y);
                    mma_bf16(acc[m][n], r0.z, r1.z, r0.w, r1.w, b[n].z, b[n].w);
                }
            }
        }
    }
    cp_wait<0>();

    /* Accumulator element e of tile (m, n): weight row 16 m + g + 8 (e / 2),
     * x column 8 n + 2 c + e % 2; split: tiles 2p (hi) and 2p + 1 (lo) hold
     * the same tokens. */
    float *dst = n_splits > 1 ? partial + (int64_t)split * T * rows : y;
    constexpr int NTOK = SPLIT ? NT / 2 : NT;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NTOK; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = row0 + 16 * m + g + 8 * (e / 2), t = 8 * n + 2 * c + e % 2;
                if (r >= rows || t >= T) continue;
                float v = SPLIT ? acc[m][2 * n][e] + acc[m][2 * n + 1][e] : acc[m][n][e];
                if (n_splits == 1 && bias) v += bias[r];
                dst[(int64_t)t * rows + r] = v;
            }
}

/* y = the splits' partial sums added in split order (+ bias), every output
 * on its own thread: one block per row tile adding them all left a tail of
 * ~30 us at T = 30 with 32 splits (run 17). */
static __global__ void skinny_reduce(float *y, const float *partial, const float *bias,
                                     int32_t n_splits, int64_t n, int32_t rows) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = 0.0f;
        for (int32_t s = 0; s < n_splits; s++) v += partial[(int64_t)s * n + i];
        if (bias) v += bias[i % rows];
        y[i] = v;
    }
}

template <int MT, int S, int NT, bool SPLIT>
static is_status launch(cudaStream_t s, const skinny_plan *p, float *y, const __nv_bfloat16 *w,
                        const __nv_bfloat16 *x, const float *bias, int32_t T, int64_t rows,
                        int64_t cols, float *partial) {
    const size_t smem = skinny_smem(NT, p->kc);
    dim3 grid((unsigned)p->row_tiles, (unsigned)p->n_splits);
    skinny_kernel<MT, S, NT, SPLIT><<<grid, SK_THREADS, smem, s>>>(
        y, w, x, bias, T, (int32_t)rows, (int32_t)cols, p->kc, partial);
    CUDA_CHECK_LAUNCH();
    if (p->n_splits > 1) {
        const int64_t n = (int64_t)T * rows;
        skinny_reduce<<<cuda_blocks_for(n, 256), 256, 0, s>>>(y, partial, bias, p->n_splits, n,
                                                              (int32_t)rows);
        CUDA_CHECK_LAUNCH();
    }
    return IS_OK;
}

/* Two 16-row tiles a warp and four steps in flight, or one tile and eight:
 * the same 64 KiB ring either way. */
template <int NT, bool SPLIT>
static is_status launch_nt(cudaStream_t s, const skinny_plan *p, float *y,
                           const __nv_bfloat16 *w, const __nv_bfloat16 *x, const float *bias,
                           int32_t T, int64_t rows, int64_t cols, float *partial) {
    if (p->mt == 1) return launch<1, 8, NT, SPLIT>(s, p, y, w, x, bias, T, rows, cols, partial);
    return launch<2, 4, NT, SPLIT>(s, p, y, w, x, bias, T, rows, cols, partial);
}

template <int NT, bool SPLIT> static is_status allow_smem_nt(void) {
    CUDA_CHECK(cudaFuncSetAttribute(skinny_kernel<1, 8, NT, SPLIT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, SK_SMEM_CAP));
    CUDA_CHECK(cudaFuncSetAttribute(skinny_kernel<2, 4, NT, SPLIT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, SK_SMEM_CAP));
    return IS_OK;
}

is_status cuda_skinny_prepare(void) {
    is_status st = allow_smem_nt<1, false>();
    if (st == IS_OK) st = allow_smem_nt<2, false>();
    if (st == IS_OK) st = allow_smem_nt<4, false>();
    if (st == IS_OK) st = allow_smem_nt<8, false>();
    if (st == IS_OK) st = allow_smem_nt<2, true>();
    if (st == IS_OK) st = allow_smem_nt<4, true>();
    if (st == IS_OK) st = allow_smem_nt<8, true>();
    return st;
}

is_status cuda_skinny_matmul(cudaStream_t s, const skinny_plan *p, float *y,
                             const __nv_bfloat16 *w, const __nv_bfloat16 *x, const float *bias,
                             int32_t T, int64_t rows, int64_t cols, bool split, float *partial) {
    if (!cuda_skinny_supports(T, rows, cols, split) || rows > INT32_MAX)
        return is_error_set(IS_ERR_INVALID_ARG, "cuda skinny: product %d x %lld x %lld not taken",
                            T, (long long)rows, (long long)cols);
    switch (skinny_nt(T, split)) {
    case 1: return launch_nt<1, false>(s, p, y, w, x, bias, T, rows, cols, partial);
    case 2:
        return split ? launch_nt<2, true>(s, p, y, w, x, bias, T, rows, cols, partial)
                     : launch_nt<2, false>(s, p, y, w, x, bias, T, rows, cols, partial);
    case 4:
        return split ? launch_nt<4, true>(s, p, y, w, x, bias, T, rows, cols, partial)
                     : launch_nt<4, false>(s, p, y, w, x, bias, T, rows, cols, partial);
    default:
        return split ? launch_nt<8, true>(s, p, y, w, x, bias, T, rows, cols, partial)
                     : launch_nt<8, false>(s, p, y, w, x, bias, T, rows, cols, partial);
    }
}

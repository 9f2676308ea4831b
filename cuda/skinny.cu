/*
 * skinny: weight-streaming products for few input rows (see skinny.cuh).
 *
 * Fragments are those of mma.sync m16n8k16 with W as the A operand (16
 * weight rows) and x^T as the B operand (8 input rows as columns). With
 * g = lane / 4 and c = lane % 4, a lane loads, for weight rows g and g + 8
 * of its warp's 16, the 8 columns [64 i + 8 c, +8) and [64 i + 32 + 8 c, +8)
 * of each 64-column step i. Each 16-byte load holds the lane's A elements
 * of two mma k-steps, in the order the fragment wants them once the mma's
 * logical k is read as a permutation of the physical columns; the B
 * fragments read the same columns of x. Four lanes read 64 contiguous bytes
 * of a row, two loads a whole 128-byte line.
 */
#include "skinny.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#define SK_WARPS   (SKINNY_BLOCK_ROWS / 16)
#define SK_THREADS (32 * SK_WARPS)
/* x comes into shared memory a chunk of SK_CHUNK columns at a time (two
 * buffers: the next chunk's copies fly while this one is read), and each
 * warp keeps SK_CHUNK / 64 steps of its weight rows in registers, so a
 * chunk's steps index them with constants: 4 steps of 2 KiB a warp in
 * flight (16-byte loads that skip L1, 256-byte L2 prefetch). */
#define SK_CHUNK  256
#define SK_STAGES (SK_CHUNK / 64)
/* bf16 a row of x takes in shared memory: a pitch of 64 modulo 128 bytes
 * puts the 8 lanes of a 16-byte load phase (2 rows x 4 lanes) in distinct
 * banks. */
#define SK_XLD (SK_CHUNK + 32)
/* Floats a token's row of the block's sums takes: 128 + 4 puts the 32
 * lanes' stores (8 rows x 4 token pairs) in distinct banks. */
#define SK_RED_LD (SKINNY_BLOCK_ROWS + 4)
/* Columns a range has at least (one chunk). */
#define SK_MIN_RANGE SK_CHUNK

bool cuda_skinny_supports(int32_t n, int64_t rows, int64_t cols) {
    return n >= 1 && n <= SKINNY_MAX_N && rows >= 1 && rows <= INT32_MAX && cols >= 64 &&
           cols % 64 == 0 && cols <= INT32_MAX;
}

/* 8-row tiles of x the kernel holds (a power of two), and its index among
 * the instantiations. */
static int nt_index(int32_t n) { return n <= 8 ? 0 : n <= 16 ? 1 : n <= 32 ? 2 : 3; }

/* Dynamic shared memory of the kernel for NT tiles of x: two chunks. */
static size_t x_smem(int nt) { return (size_t)2 * nt * 8 * SK_XLD * 2; }

static __device__ __forceinline__ void mma_bf16(float *d, uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* 16 bytes of weights, read once: not kept in L1; the next 128 bytes of the
 * row are asked of memory with them. volatile keeps the first loads ahead
 * of pdl_wait(). */
static __device__ __forceinline__ uint4 ld_weights(const __nv_bfloat16 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* 16 bytes global -> shared, not through registers nor L1. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
}
static __device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
static __device__ __forceinline__ void cp_wait_all_but_one() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

/* Step i of a warp's rows: row g's two chunks, then row g + 8's. */
static __device__ __forceinline__ void load_step(uint4 *a, const __nv_bfloat16 *w_lo,
                                                 const __nv_bfloat16 *w_hi, int i) {
    a[0] = ld_weights(w_lo + 64 * i);
    a[1] = ld_weights(w_lo + 64 * i + 32);
    a[2] = ld_weights(w_hi + 64 * i);
    a[3] = ld_weights(w_hi + 64 * i + 32);
}

template <int NT>
static __global__ void __launch_bounds__(SK_THREADS, NT <= 4 ? 2 : 1)
    skinny_kernel(float *y, const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *x, int32_t n,
                  int32_t rows, int32_t cols, int32_t kc) {
    /* This block's sums, [token][row]: read by the cluster's blocks. */
    __shared__ __align__(16) float red[NT * 8][SK_RED_LD];
    extern __shared__ __align__(16) __nv_bfloat16 xs[]; /* [2][NT * 8][SK_XLD] */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int split = blockIdx.y, n_splits = gridDim.y;
    const int k0 = split * kc, klen = min(kc, cols - k0), steps = klen / 64;
    const int row_block = blockIdx.x * SKINNY_BLOCK_ROWS;
    /* Rows past the end read the last row and are not written. */
    const int r_lo = row_block + warp * 16 + g;
    const __nv_bfloat16 *w_lo = w + (int64_t)min(r_lo, rows - 1) * cols + k0 + 8 * c;
    const __nv_bfloat16 *w_hi = w + (int64_t)min(r_lo + 8, rows - 1) * cols + k0 + 8 * c;

    /* The weights do not depend on the kernel before: the first chunk's
     * steps go out before waiting for it. */
    uint4 a[SK_STAGES][4];
#pragma unroll
    for (int d = 0; d < SK_STAGES; d++)
        if (d < steps) load_step(a[d], w_lo, w_hi, d);
    pdl_wait();

    /* Chunk j of x (rows past n repeat the last; their sums are never
     * written) into buffer j % 2, as one cp.async group. */
    const int n_chunks = (klen + SK_CHUNK - 1) / SK_CHUNK;
    auto load_x = [&](int j) {
        __nv_bfloat16 *dst = xs + (size_t)(j & 1) * NT * 8 * SK_XLD;
        const int c0 = j * SK_CHUNK, len = min(SK_CHUNK, klen - c0);
        for (int i = threadIdx.x; i < NT * 8 * (SK_CHUNK / 8); i += SK_THREADS) {
            const int r = i / (SK_CHUNK / 8), ch = i % (SK_CHUNK / 8);
            if (8 * ch < len)
                cp_async16(dst + r * SK_XLD + 8 * ch,
                           x + (int64_t)min(r, n - 1) * cols + k0 + c0 + 8 * ch);
        }
        cp_commit();
    };
    load_x(0);

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[t][e] = 0.0f;

    for (int j = 0; j < n_chunks; j++) {
        if (j + 1 < n_chunks) load_x(j + 1);
        else cp_commit();      /* an empty group: the wait below counts the same */
        cp_wait_all_but_one(); /* this thread's copies of chunk j have landed */
        __syncthreads();       /* and everyone's */
        const __nv_bfloat16 *xb = xs + (size_t)(j & 1) * NT * 8 * SK_XLD + g * SK_XLD + 8 * c;
#pragma unroll
        for (int d = 0; d < SK_STAGES; d++) {
            const int i = j * SK_STAGES + d;
            if (i >= steps) break;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                uint4 b[NT];
#pragma unroll
                for (int t = 0; t < NT; t++)
                    b[t] =
                        *reinterpret_cast<const uint4 *>(xb + t * 8 * SK_XLD + 64 * d + 32 * half);
                const uint4 r0 = a[d][half], r1 = a[d][2 + half];
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    mma_bf16(acc[t], r0.x, r1.x, r0.y, r1.y, b[t].x, b[t].y);
                    mma_bf16(acc[t], r0.z, r1.z, r0.w, r1.w, b[t].z, b[t].w);
                }
            }
            /* The stage is free once multiplied: the next chunk's step. */
            if (i + SK_STAGES < steps) load_step(a[d], w_lo, w_hi, i + SK_STAGES);
        }
        __syncthreads(); /* buffer j % 2 is read; chunk j + 2 may overwrite it */
    }

    /* Accumulator element e of tile t: weight row g + 8 (e / 2) of the
     * warp's 16, x row 8 t + 2 c + e % 2. */
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            red[8 * t + 2 * c + e % 2][warp * 16 + g + 8 * (e / 2)] = acc[t][e];

    /* The ranges' sums: block `split` of the cluster adds its share of the
     * rows over all ranges, in range order, and writes them. */
    const int share = (SKINNY_BLOCK_ROWS + n_splits - 1) / n_splits;
    const int rb0 = split * share, nr = min(SKINNY_BLOCK_ROWS, rb0 + share) - rb0;
    if (n_splits == 1) {
        __syncthreads();
        for (int i = threadIdx.x; i < n * SKINNY_BLOCK_ROWS; i += SK_THREADS) {
            const int t = i / SKINNY_BLOCK_ROWS, r = i % SKINNY_BLOCK_ROWS;
            if (row_block + r < rows) y[(int64_t)t * rows + row_block + r] = red[t][r];
        }
        return;
    }
    cg::cluster_group cl = cg::this_cluster();
    cl.sync(); /* every range's sums are in place */
    if (nr > 0)
        for (int i = threadIdx.x; i < n * nr; i += SK_THREADS) {
            const int t = i / nr, r = rb0 + i % nr;
            float v = 0.0f;
            for (int s = 0; s < n_splits; s++) v += *cl.map_shared_rank(&red[t][r], s);
            if (row_block + r < rows) y[(int64_t)t * rows + row_block + r] = v;
        }
    cl.sync(); /* no block leaves while another reads its sums */
}

/* What fits on the current device at once, asked once for each NT (1, 2,
 * 4, 8): [1] blocks, [s] clusters of s blocks for s = 2..8 (0: such a
 * launch would not fit). */
static int32_t g_fit[4][SKINNY_MAX_SPLITS + 1];
static bool g_asked;

template <int NT> static cudaError_t ask_fit(int32_t *out) {
    /* Past 48 KiB of dynamic shared memory (NT = 8) a kernel must say so. */
    cudaError_t e = cudaFuncSetAttribute(
        skinny_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)x_smem(NT));
    int dev = 0, n_sms = 0, per_sm = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess)
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, skinny_kernel<NT>, SK_THREADS,
                                                          x_smem(NT));
    if (e != cudaSuccess) return e;
    out[1] = per_sm * n_sms;
    for (int s = 2; s <= SKINNY_MAX_SPLITS; s++) {
        cuda_launch_cfg l;
        cuda_launch_cfg_init(&l, dim3(1, (unsigned)s), dim3(SK_THREADS), x_smem(NT), 0,
                             dim3(1, (unsigned)s, 1), false);
        int nc = 0;
        if (cudaOccupancyMaxActiveClusters(&nc, skinny_kernel<NT>, &l.cfg) != cudaSuccess) nc = 0;
        cudaGetLastError(); /* a refusal is an answer, not an error for the next check */
        out[s] = nc;
    }
    return cudaSuccess;
}

is_status cuda_skinny_prepare(void) {
    if (g_asked) return IS_OK;
    CUDA_CHECK(ask_fit<1>(g_fit[0]));
    CUDA_CHECK(ask_fit<2>(g_fit[1]));
    CUDA_CHECK(ask_fit<4>(g_fit[2]));
    CUDA_CHECK(ask_fit<8>(g_fit[3]));
    g_asked = true;
    return IS_OK;
}

skinny_plan cuda_skinny_plan(int32_t n, int64_t rows, int64_t cols, int32_t splits) {
    skinny_plan p;
    p.row_blocks = (int32_t)((rows + SKINNY_BLOCK_ROWS - 1) / SKINNY_BLOCK_ROWS);
    const int64_t steps = cols / 64;
    int64_t s = 1;
    if (splits > 0) {
        s = splits < SKINNY_MAX_SPLITS ? splits : SKINNY_MAX_SPLITS;
    } else if (g_asked) {
        /* The most ranges that keep every block resident at once: a small
         * product then has a block on (nearly) every multiprocessor, a
         * large one (rows alone fill the GPU) one range and no cluster. */
        const int32_t *fit = g_fit[nt_index(n)];
        for (int64_t c = SKINNY_MAX_SPLITS; c >= 2; c--)
            if (cols / c >= SK_MIN_RANGE && p.row_blocks <= fit[c]) {
                s = c;
                break;
            }
    }
    if (s > steps) s = steps;
    p.kc = (int32_t)((steps + s - 1) / s * 64);
    p.splits = (int32_t)((cols + p.kc - 1) / p.kc);
    return p;
}

bool cuda_skinny_one_wave(const skinny_plan *p, int32_t n) {
    if (!g_asked || p->splits < 1 || p->splits > SKINNY_MAX_SPLITS) return false;
    const int32_t fit = g_fit[nt_index(n)][p->splits];
    return fit > 0 && p->row_blocks <= fit;
}

template <int NT>
static is_status launch(cudaStream_t s, const skinny_plan *p, float *y, const __nv_bfloat16 *w,
                        const __nv_bfloat16 *x, int32_t n, int64_t rows, int64_t cols, bool pdl) {
    CUDA_CHECK(cuda_launch_ex(skinny_kernel<NT>, dim3((unsigned)p->row_blocks, (unsigned)p->splits),
                              dim3(SK_THREADS), x_smem(NT), s, dim3(1, (unsigned)p->splits, 1), pdl,
                              y, w, x, n, (int32_t)rows, (int32_t)cols, p->kc));
    return IS_OK;
}

is_status cuda_skinny_gemm(cudaStream_t s, const skinny_plan *p, float *y, const __nv_bfloat16 *w,
                           const __nv_bfloat16 *x, int32_t n, int64_t rows, int64_t cols,
                           bool pdl) {
    if (!cuda_skinny_supports(n, rows, cols) || p->splits < 1 || p->splits > SKINNY_MAX_SPLITS ||
        p->kc % 64 != 0 || (int64_t)p->kc * (p->splits - 1) >= cols ||
        (int64_t)p->kc * p->splits < cols || (int64_t)p->row_blocks * SKINNY_BLOCK_ROWS < rows)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "cuda skinny: product %d x %lld x %lld not taken (plan %d x %d, %d)", n,
                            (long long)rows, (long long)cols, p->row_blocks, p->splits, p->kc);
    switch (nt_index(n)) {
    case 0: return launch<1>(s, p, y, w, x, n, rows, cols, pdl);
    case 1: return launch<2>(s, p, y, w, x, n, rows, cols, pdl);
    case 2: return launch<4>(s, p, y, w, x, n, rows, cols, pdl);
    default: return launch<8>(s, p, y, w, x, n, rows, cols, pdl);
    }
}

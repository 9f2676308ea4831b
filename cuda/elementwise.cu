/*
 * elementwise: one-pass kernels (see elementwise.cuh).
 */
#include "elementwise.cuh"

/* Element i of n: silu(g) * u, and its bf16 copy. Both SwiGLU kernels
 * call it, so they give the same bits. */
static __device__ __forceinline__ void swiglu_put(float *out, int64_t i, int64_t n, float g,
                                                  float u, __nv_bfloat16 *obf, bool split) {
    /* expf, not __expf: the CPU reference uses expf too. */
    const float y = g / (1.0f + expf(-g)) * u;
    out[i] = y;
    if (obf) bf16_copy_put(obf, n, i, y, split);
}

static __global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t n,
                                     __nv_bfloat16 *obf, bool split) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        swiglu_put(out, i, n, gate[i], up[i], obf, split);
}

/* Block (x, t): a stretch of row t. Gate and up are the two halves of the
 * stacked product's row, summed with its lo half first where there is one,
 * as cuda_split_columns sums them. */
static __global__ void swiglu_stacked_kernel(float *out, const float *part, int32_t rows, int32_t T,
                                             bool halves, __nv_bfloat16 *obf, bool split) {
    pdl_wait(); /* launched as a dependent: nothing before this */
    const int32_t t = blockIdx.y;
    const int64_t n = (int64_t)T * rows, part_n = 2 * n; /* one half of the product */
    const float *p = part + (int64_t)t * 2 * rows;
    for (int32_t r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
        float g = p[r], u = p[rows + r];
        if (halves) {
            g += p[part_n + r];
            u += p[part_n + rows + r];
        }
        swiglu_put(out, (int64_t)t * rows + r, n, g, u, obf, split);
    }
}

static __global__ void add_kernel(float *x, const float *y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static __global__ void add_bias_kernel(float *y, const float *bias, int64_t rows, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[i % rows];
}

static __global__ void f32_to_bf16_kernel(__nv_bfloat16 *dst, const float *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* quant_f32_to_f16 and quant_f32_to_bf16 (src/gguf/quant.c) in integer
 * arithmetic, so a record narrowed here is the host's bit for bit (NaN
 * payloads and subnormals included, which the intrinsics treat otherwise). */
static __device__ __forceinline__ uint16_t narrow_f16(uint32_t x) {
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (x >= 0x38800000u) {
        x += 0xfffu + ((x >> 13) & 1u);
        return (uint16_t)(sign | ((x - 0x38000000u) >> 13));
    }
    if (x <= 0x33000000u) return sign;
    const uint32_t shift = 126 - (x >> 23), mant = (x & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static __device__ __forceinline__ uint16_t narrow_bf16(uint32_t x) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static __global__ void narrow_kernel(uint16_t *dst, const uint32_t *src, int64_t n, bool bf16) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = bf16 ? narrow_bf16(src[i]) : narrow_f16(src[i]);
}

static __global__ void f32_to_bf16_split_kernel(__nv_bfloat16 *dst, const float *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        bf16_copy_put(dst, n, i, src[i], true);
    }
}

static __global__ void sum_halves_kernel(float *y, const float *part, const float *bias,
                                         int64_t rows, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = part[i] + part[n + i];
        if (bias) v += bias[i % rows];
        y[i] = v;
    }
}

template <typename T> static __device__ __forceinline__ float widen(T v);
template <> __device__ __forceinline__ float widen<float>(float v) { return v; }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

/* One block per token. */
template <typename T>
static __global__ void get_rows_kernel(float *out, const T *emb, int64_t cols,
                                       const int32_t *tokens) {
    const T *src = emb + (int64_t)tokens[blockIdx.x] * cols;
    float *dst = out + (int64_t)blockIdx.x * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = widen(src[i]);
}

is_status cuda_swiglu(cudaStream_t s, float *out, const float *gate, const float *up, int64_t n,
                      __nv_bfloat16 *obf, bool split) {
    if (n <= 0) return IS_OK;
    swiglu_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(out, gate, up, n, obf, split);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_swiglu_stacked(cudaStream_t s, float *out, const float *part, int64_t rows,
                              int32_t T, bool halves, __nv_bfloat16 *obf, bool split, bool pdl) {
    if (T <= 0 || rows <= 0) return IS_OK;
    IS_ASSERT(T <= 65535 && rows <= INT32_MAX / 2);
    int64_t bx = (rows + 255) / 256;
    if (bx > 64) bx = 64;
    CUDA_CHECK(cuda_launch_dependent(swiglu_stacked_kernel, dim3((unsigned)bx, (unsigned)T),
                                     dim3(256), 0, s, pdl, out, part, (int32_t)rows, T, halves, obf,
                                     split));
    return IS_OK;
}

is_status cuda_add(cudaStream_t s, float *x, const float *y, int64_t n) {
    if (n <= 0) return IS_OK;
    add_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(x, y, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_add_bias(cudaStream_t s, float *y, const float *bias, int32_t T, int64_t rows) {
    int64_t n = (int64_t)T * rows;
    if (n <= 0) return IS_OK;
    add_bias_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(y, bias, rows, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_f32_to_bf16(cudaStream_t s, __nv_bfloat16 *dst, const float *src, int64_t n) {
    if (n <= 0) return IS_OK;
    f32_to_bf16_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(dst, src, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_narrow(cudaStream_t s, void *dst, int32_t dtype, const float *src, int64_t n) {
    if (n <= 0) return IS_OK;
    if (dtype == 0) {
        CUDA_CHECK(
            cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, s));
        return IS_OK;
    }
    if (dtype != 1 && dtype != 2)
        return is_error_set(IS_ERR_INVALID_ARG, "narrow: dtype %d", dtype);
    narrow_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>((uint16_t *)dst, (const uint32_t *)src, n,
                                                          dtype == 2);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_f32_to_bf16_split(cudaStream_t s, __nv_bfloat16 *dst, const float *src, int64_t n) {
    if (n <= 0) return IS_OK;
    f32_to_bf16_split_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(dst, src, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_sum_halves(cudaStream_t s, float *y, const float *part, const float *bias, int32_t T,
                          int64_t rows) {
    int64_t n = (int64_t)T * rows;
    if (n <= 0) return IS_OK;
    sum_halves_kernel<<<cuda_blocks_for(n, 256), 256, 0, s>>>(y, part, bias, rows, n);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

/* Block (x, t, j): a stretch of output j's columns of row t. The outputs'
 * fields are picked with constant indices, so the parameter block is read
 * in place (a dynamic index would copy it to local memory in every thread). */
template <bool VEC>
static __global__ void split_columns_kernel(cuda_split sp, const float *part, int64_t rows_tot,
                                            int64_t n, bool halves) {
    const int32_t j = blockIdx.z;
    const int64_t t = blockIdx.y;
    float *y = j == 0 ? sp.out[0].y : j == 1 ? sp.out[1].y : j == 2 ? sp.out[2].y : sp.out[3].y;
    const float *bias = j == 0   ? sp.out[0].bias
                        : j == 1 ? sp.out[1].bias
                        : j == 2 ? sp.out[2].bias
                                 : sp.out[3].bias;
    const int64_t rows = j == 0   ? sp.out[0].rows
                         : j == 1 ? sp.out[1].rows
                         : j == 2 ? sp.out[2].rows
                                  : sp.out[3].rows;
    const int64_t off = j == 0   ? sp.out[0].off
                        : j == 1 ? sp.out[1].off
                        : j == 2 ? sp.out[2].off
                                 : sp.out[3].off;
    const float *src = part + t * rows_tot + off;
    float *dst = y + t * rows;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    if (VEC) {
        const float4 *s4 = reinterpret_cast<const float4 *>(src);
        const float4 *l4 = reinterpret_cast<const float4 *>(src + n);
        const float4 *b4 = reinterpret_cast<const float4 *>(bias);
        float4 *d4 = reinterpret_cast<float4 *>(dst);
        for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows / 4; r += step) {
            float4 v = s4[r];
            if (halves) {
                const float4 lo = l4[r];
                v = make_float4(v.x + lo.x, v.y + lo.y, v.z + lo.z, v.w + lo.w);
            }
            if (bias) {
                const float4 bb = b4[r];
                v = make_float4(v.x + bb.x, v.y + bb.y, v.z + bb.z, v.w + bb.w);
            }
            d4[r] = v;
        }
    } else {
        for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += step) {
            float v = src[r];
            if (halves) v += src[n + r];
            if (bias) v += bias[r];
            dst[r] = v;
        }
    }
}

is_status cuda_split_columns(cudaStream_t s, cuda_split *sp, const float *part, int64_t rows,
                             int32_t T, bool halves) {
    const int64_t n = (int64_t)T * rows;
    if (n <= 0 || sp->n <= 0) return IS_OK;
    IS_ASSERT(sp->n <= CUDA_SPLIT_MAX && T <= 65535);
    int64_t max_rows = 0;
    bool vec = rows % 4 == 0 && cuda_aligned16(part);
    int64_t off = 0;
    for (int32_t j = 0; j < sp->n; j++) {
        cuda_split_out *o = &sp->out[j];
        o->off = off;
        off += o->rows;
        if (o->rows > max_rows) max_rows = o->rows;
        vec = vec && o->rows % 4 == 0 && cuda_aligned16(o->y) &&
              (!o->bias || cuda_aligned16(o->bias));
    }
    const int64_t per_row = vec ? max_rows / 4 : max_rows;
    int64_t bx = (per_row + 255) / 256;
    if (bx > 64) bx = 64;
    const dim3 grid((unsigned)bx, (unsigned)T, (unsigned)sp->n);
    if (vec) split_columns_kernel<true><<<grid, 256, 0, s>>>(*sp, part, rows, n, halves);
    else split_columns_kernel<false><<<grid, 256, 0, s>>>(*sp, part, rows, n, halves);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

is_status cuda_get_rows(cudaStream_t s, float *out, const void *emb, bool emb_bf16, int64_t cols,
                        const int32_t *tokens, int32_t T) {
    if (T <= 0) return IS_OK;
    int threads = cols >= 256 ? 256 : 64;
    if (emb_bf16)
        get_rows_kernel<<<T, threads, 0, s>>>(out, (const __nv_bfloat16 *)emb, cols, tokens);
    else get_rows_kernel<<<T, threads, 0, s>>>(out, (const float *)emb, cols, tokens);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

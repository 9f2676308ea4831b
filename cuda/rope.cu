/*
 * rope: one thread per rotated pair (see rope.cuh).
 */
#include "rope.cuh"

static __global__ void rope_kernel(float *x, const int32_t *pos, int64_t n_pairs, int32_t n_heads,
                                   int32_t head_dim, int32_t half, bool neox, const float *cs) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n_pairs;
         k += (int64_t)gridDim.x * blockDim.x) {
        int32_t i = (int32_t)(k % half);
        int64_t th = k / half; /* token * n_heads + head */
        int32_t p = pos[th / n_heads];
        const float *e = cs + ((int64_t)(p < 0 ? -p : p) * half + i) * 2;
        float c = e[0], sn = p < 0 ? -e[1] : e[1];
        float *v = x + th * head_dim;
        int32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float a = v[i0], b = v[i1];
        v[i0] = rope_first(a, b, c, sn);
        v[i1] = rope_second(a, b, c, sn);
    }
}

is_status cuda_rope(cudaStream_t s, float *x, const int32_t *pos, int32_t T, int32_t n_heads,
                    int32_t head_dim, int32_t n_rot, bool neox, const float *cs) {
    int32_t half = n_rot / 2;
    int64_t n_pairs = (int64_t)T * n_heads * half;
    if (n_pairs <= 0) return IS_OK;
    rope_kernel<<<cuda_blocks_for(n_pairs, 256), 256, 0, s>>>(x, pos, n_pairs, n_heads, head_dim,
                                                              half, neox, cs);
    CUDA_CHECK_LAUNCH();
    return IS_OK;
}

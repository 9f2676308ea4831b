/*
 * kv: writes into the paged KV cache ([n_blocks][n_kv_heads][block_size]
 * [head_dim] per layer, addressed by slot = block * block_size + offset):
 * a batch's keys and values (kv_store), and the facts of a memory segment
 * (inject, from the fact-KV arena), in f32 (the CPU reference's type) or
 * bf16 (the serving cache, half the bytes).
 *
 * The fact-KV arena (arena.cuh) keeps records in pages of one token each:
 * page p holds that token's pre-RoPE keys for every layer, then its values,
 * bf16 [2][n_layers][kv_dim] (kv_dim = n_kv_heads * head_dim); or in fp8:
 * the codes, e4m3 [2][n_layers][kv_dim] (core/fp8.h), then from the next
 * multiple of 16 bytes the scales, f32 [2][n_layers][n_kv_heads] (a value is
 * its code's value times its head's scale), the page padded to 16 bytes.
 * The fill quantises as fp8_quantize_rows does (the same scale rule, and
 * CUDA's e4m3 conversion, which tests/cuda/test_fp8_cuda.cu checks against
 * fp8.c bit for bit), so a page holds the codes and scales a record of
 * dtype fp8 holds, and values already on the fp8 grid (from such a record)
 * come back unchanged.
 */
#ifndef IS_CUDA_KV_CUH
#define IS_CUDA_KV_CUH

#include "common.cuh"

/* Bytes of one arena page (see above). */
static inline size_t cuda_arena_page_bytes(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                                           bool fp8) {
    const size_t kv = (size_t)2 * n_layers * n_kv_heads * head_dim;
    if (!fp8) return kv * 2;
    const size_t codes = (kv + 15) & ~(size_t)15;
    return (codes + (size_t)2 * n_layers * n_kv_heads * sizeof(float) + 15) & ~(size_t)15;
}

static __device__ __forceinline__ float kv_load(const float *p) { return *p; }
static __device__ __forceinline__ float kv_load(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
static __device__ __forceinline__ void kv_put(float *p, float v) { *p = v; }
static __device__ __forceinline__ void kv_put(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16_rn(v);
}

/* k, v: [T][n_kv_heads*head_dim] f32; slots: [T] device; caches bf16 when
 * bf16, else f32. */
is_status cuda_kv_store(cudaStream_t s, void *k_cache, void *v_cache, const float *k,
                        const float *v, const int32_t *slots, int32_t T, int32_t n_kv_heads,
                        int32_t head_dim, int32_t block_size, bool bf16);

/* cuda_rope on q (n_heads) and on k (n_kv_heads), then cuda_kv_store of
 * the rotated keys and v, in one launch: the same rotation expressions and
 * table, so the same bits. k is only read (left unrotated). pos, slots:
 * [T] device. pdl: launched as a programmatic dependent (common.cuh). */
is_status cuda_rope_store(cudaStream_t s, float *q, const float *k, const float *v, void *k_cache,
                          void *v_cache, const int32_t *pos, const int32_t *slots, int32_t T,
                          int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t block_size,
                          int32_t n_rot, bool neox, const float *cs, bool bf16, bool pdl);

/* The same from the stacked product of q, k, v's weights: part [T][q_dim +
 * 2 kv_dim] (halves: its lo half follows, [2][T][...]), each value summed
 * with its lo half and bias (bq, bk, bv; NULL: none) as cuda_split_columns
 * sums them, so the bits of split, then cuda_rope_store; the rotated
 * queries go to q [T][q_dim]. */
is_status cuda_rope_store_stacked(cudaStream_t s, float *q, const float *part, int32_t T,
                                  bool halves, const float *bq, const float *bk, const float *bv,
                                  void *k_cache, void *v_cache, const int32_t *pos,
                                  const int32_t *slots, int32_t n_heads, int32_t n_kv_heads,
                                  int32_t head_dim, int32_t block_size, int32_t n_rot, bool neox,
                                  const float *cs, bool bf16, bool pdl);

/* Chunked RoPE + scatter, layers [l0, l1) and every token in one launch: token i
 * (page pages[i], slot slots[i], position pos[i]; device arrays) has its
 * arena keys rotated (cos/sin table cs as cuda_rope's) and written with its
 * values into layer l's caches, caches[l] (keys) and caches[n_layers + l]
 * (values) (device array of device pointers). Slots name blocks of the
 * whole pool and positions are per token, so the memory segments of
 * several sequences go in one launch. An fp8 arena's values are
 * dequantised in the same pass. */
is_status cuda_inject(cudaStream_t s, void *const *caches, const void *arena, bool arena_fp8,
                      const int32_t *pages, const int32_t *slots, const int32_t *pos,
                      int32_t n_tokens, int32_t n_layers, int32_t l0, int32_t l1,
                      int32_t n_kv_heads, int32_t head_dim, int32_t block_size, int32_t n_rot,
                      bool neox, const float *cs, bool bf16);

/* Fills arena pages (bf16, or fp8 when fp8) from a staged record: k, v f32
 * [n_layers][n_tokens][kv_dim] (device), token j into page pages[j] (device). */
is_status cuda_arena_fill(cudaStream_t s, void *arena, const int32_t *pages, const float *k,
                          const float *v, int32_t n_tokens, int32_t n_layers, int32_t n_kv_heads,
                          int32_t head_dim, bool fp8);

#endif

/*
 * upload: host-tier records into the fact arena's pages, in two steps:
 * the copy engine moves each record as it is (cudaMemcpyAsync from pinned
 * memory into a device staging buffer, no SMs taken from the forward), then
 * a kernel scatters the staged rows into the pages, a range of layers at a
 * time, on the stream whose next layers read them.
 *
 * Why not one kernel that reads the pinned rows itself (zero-copy): it moves
 * each byte once and needs no staging, and alone it is as fast as the copy
 * engine, but its blocks wait on PCIe while holding SMs, so beside a forward
 * it runs only when the forward's kernels leave room: the copy and the
 * forward then take the sum of their times instead of the larger
 * (bench_upload_gpu). Staged copies of a layer range land while earlier
 * layers compute.
 */
#ifndef IS_CUDA_UPLOAD_CUH
#define IS_CUDA_UPLOAD_CUH

#include "common.cuh"

/* One token of a staged record: the record's keys at staging element k
 * ([n_layers][n_tokens][kv_dim], its values right after), the token's
 * index j in it and the arena page it goes to. */
typedef struct cuda_upload_token {
    int64_t k;
    int32_t n_tokens;
    int32_t j;
    int32_t page;
    int32_t f16; /* the record's dtype: f16 (converted to bf16), else bf16 */
} cuda_upload_token;

/* Layers [l0, l1) of n staged tokens (toks: device) into their arena pages
 * ([2][n_layers][kv_dim] bf16 a page). staging: 2-byte elements, each
 * record's k 16-byte aligned. */
is_status cuda_upload_scatter(cudaStream_t s, __nv_bfloat16 *arena, const uint16_t *staging,
                              const cuda_upload_token *toks, int32_t n, int32_t l0, int32_t l1,
                              int32_t n_layers, int32_t kv_dim);

#endif

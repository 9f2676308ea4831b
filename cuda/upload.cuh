/*
 * upload: fact records from host memory into the fact arena's pages, read
 * by the kernel itself over PCIe (zero-copy from pinned, mapped memory).
 *
 * Why a kernel and not cudaMemcpyAsync: a record is [n_layers][n_tokens]
 * [kv_dim] rows and the arena wants each token's rows of every layer in
 * that token's page (arena.cuh), wherever the page lies, so a copy would
 * need a staging buffer on the device and a second pass; a kernel that
 * loads the host rows and stores them into the pages moves each byte once,
 * and converts f16 records to the arena's bf16 on the way (bf16 records are
 * copied bit for bit). The caller launches it on a stream of its own, so
 * the copy runs beside the engine's forward.
 */
#ifndef IS_CUDA_UPLOAD_CUH
#define IS_CUDA_UPLOAD_CUH

#include "common.cuh"

/* Pages of one launch, passed by value (no device array to fill first). */
#define CUDA_UPLOAD_MAX_TOKENS 256

typedef struct cuda_upload_pages {
    int32_t page[CUDA_UPLOAD_MAX_TOKENS];
} cuda_upload_pages;

/* Tokens [tok0, tok0 + n) of a record with n_tokens in all: k, v
 * [n_layers][n_tokens][kv_dim] (host memory the device can read; dtype
 * 1 f16, 2 bf16), token tok0 + j into arena page pages.page[j]
 * ([2][n_layers][kv_dim] bf16 a page). n <= CUDA_UPLOAD_MAX_TOKENS. */
is_status cuda_upload_record(cudaStream_t s, __nv_bfloat16 *arena, const cuda_upload_pages *pages,
                             const void *k, const void *v, int32_t dtype, int32_t tok0, int32_t n,
                             int32_t n_tokens, int32_t n_layers, int32_t kv_dim);

#endif

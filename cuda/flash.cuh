/*
 * flash: FlashAttention-style paged attention over a bf16 KV cache, for
 * plain causal batches (no segment masks, no q_prefix: those take the exact
 * kernel of attention.cuh).
 *
 * A block owns a query tile: up to FLASH_BM rows, each a (token, query head)
 * pair of one KV head's group, FLASH_BM / group consecutive tokens of one
 * sequence; so the heads of a GQA group share every K/V tile they read.
 * It walks the sequence's keys in tiles of FLASH_BN (or FLASH_BN_WIDE, the
 * plan's choice where a block walks several) through the block table
 * (cp.async 16-byte copies into shared memory, the next tile in flight while
 * one is used), computes S = Q K^T and O += P V on the tensor cores
 * (bf16 operands, f32 accumulation in registers; mma.sync m16n8k16, or
 * wgmma on an sm_90a GPU: plan.wgmma, bitwise the same result) with an online softmax in f32 between them. Q is rounded to bf16, P too
 * before the P V product (as FlashAttention does); softmax statistics stay
 * f32.
 *
 * Few tiles (a short query over a long memory, decode steps) would leave
 * most multiprocessors idle, so the keys are then split over n_splits
 * blocks per tile (flash-decoding). Up to FLASH_CLUSTER_MAX splits are one
 * thread-block cluster: each leaves its unnormalised rows in shared memory
 * and merges a share of the rows from all of them through distributed
 * shared memory, with no second launch; more splits write their partial
 * results to global memory and a second kernel merges them.
 *
 * A key tile costs a warp a chain of dependent steps (S, softmax, P V:
 * ~3 us for 64 keys), which more copies in flight do not shorten (a third
 * K/V stage gained nothing; a phase trace: ~2 us computing a tile, ~0
 * waiting for it); so for short queries two warps take each tile's halves for the
 * same rows (key_warps 2, 8 warps a block) and merge in shared memory at
 * the end (a 30-token query after 1,340 keys: 25.7 -> 24.1 us a layer).
 *
 * cuda_flash_plan_batch cuts the batch into tiles and chooses the splits,
 * key warps and merge by a cost model fitted to measured sweeps (a 30-token
 * query after 1,340 keys: 6 splits in a cluster, two key warps). (Blocks
 * of 128 rows, so that each K/V tile is read once for a 30-token query's
 * 120 rows, measured slower at 215 keys and no faster at 1,340-2,590;
 * docs/notes/cuda-diary.md has the measurements.)
 */
#ifndef IS_CUDA_FLASH_CUH
#define IS_CUDA_FLASH_CUH

#include "common.cuh"

#define FLASH_BM 64 /* query rows per block: 4 warps x 16 */
#define FLASH_BN 64 /* keys per tile */
/* Keys per tile of the wide tiles: two key parts of 64 (plan.key_tile).
 * A block that walks several tiles pays the per-tile steps (the barrier,
 * the row statistics' shuffles, O's rescale, the waits) half as often. */
#define FLASH_BN_WIDE 128
/* The (keys a tile, key warps) shapes a plan may take: wide tiles take two
 * key warps (a key part of 64 keys each). */
static const int32_t FLASH_TILE_SHAPES[3][2] = {{FLASH_BN, 1}, {FLASH_BN, 2}, {FLASH_BN_WIDE, 2}};
#define FLASH_MAX_SPLITS  64
#define FLASH_CLUSTER_MAX 8 /* splits merged in a cluster: the portable cluster size */
/* A query tile, as cuda_flash_plan_batch writes it: first batch token,
 * tokens, where its sequence's block table starts in `flat`, and position
 * of its first token. */
#define FLASH_TILE_INTS 4

/* Whether the kernel takes this shape: head_dim 64 or 128, whole groups,
 * cache blocks of a power of two tokens (the engine's default is 16). */
bool cuda_flash_supports(int32_t head_dim, int32_t n_heads, int32_t n_kv_heads, int32_t block_size);

/* How a batch is cut for cuda_flash_attention. */
typedef struct cuda_flash_plan {
    int32_t n_tiles;   /* query tiles of up to FLASH_BM rows */
    int32_t key_warps; /* warps on each key tile for the same rows: 1 or 2 */
    int32_t splits;    /* blocks each tile's keys are split over, 1..FLASH_MAX_SPLITS */
    int32_t cluster;   /* 1: the splits (<= FLASH_CLUSTER_MAX) merge as one cluster */
    int32_t wgmma;     /* 1: S and P V on wgmma (cuda_flash_wgmma_supports), else mma.sync */
    int32_t key_tile;  /* keys a tile: FLASH_BN, or FLASH_BN_WIDE (two key warps only) */
} cuda_flash_plan;

/* Whether this GPU runs the wgmma engine (sm_90a: Hopper) for this head
 * size (64 or 128). */
bool cuda_flash_wgmma_supports(int32_t head_dim);

/* Which plan cuda_flash_plan_batch makes; all but the first for A/B
 * measurements (bench_attn_gpu). */
typedef enum cuda_flash_choice {
    CUDA_FLASH_CHOICE_AUTO = 0,   /* serving's: splits by the cost model, none empty */
    CUDA_FLASH_CHOICE_LEGACY,     /* the first plan: splits filling two blocks a
                                   multiprocessor (the last ones possibly empty) */
    CUDA_FLASH_CHOICE_NO_CLUSTER, /* AUTO's model without cluster merges */
    CUDA_FLASH_CHOICE_NO_WIDE,    /* AUTO's model without wide key tiles */
} cuda_flash_choice;

/* How many clusters of `size` (2..FLASH_CLUSTER_MAX) blocks of the kernel
 * for this head size, key warps, engine and keys a tile the current GPU
 * holds at once (0: none); asked of the runtime once each. */
int32_t cuda_flash_max_clusters(int32_t head_dim, int32_t key_warps, int32_t size, bool wgmma,
                                int32_t key_tile);

/* Cuts a batch (host arrays: seq_of_token[T], pos[T], and where each
 * sequence's block table starts in cuda_flash_attention's `flat`,
 * bt_off[sequence]) into query tiles,
 * written to tiles (host int32 [T][FLASH_TILE_INTS], the layout
 * cuda_flash_attention reads), and chooses the key splits, key warps and merge for a GPU of
 * n_sms multiprocessors (the current device's cluster occupancy, for a
 * cluster merge), on the wgmma engine where wgmma and the GPU takes it
 * (not for CUDA_FLASH_CHOICE_LEGACY). Deterministic: the same batch gives
 * the same plan. */
cuda_flash_plan cuda_flash_plan_batch(const int32_t *seq_of_token, const int32_t *pos, int32_t T,
                                      const int32_t *bt_off, int32_t n_heads, int32_t n_kv_heads,
                                      int32_t head_dim, int32_t n_sms, cuda_flash_choice choice,
                                      bool wgmma, int32_t *tiles);

/* Phase timestamps for bench_attn_gpu -T: from the next launch on, thread
 * 0 of each block writes FLASH_TRACE_SLOTS values (SM clock cycles, or
 * ns of the global timer for *_NS) at trace + block * FLASH_TRACE_SLOTS,
 * block = (split * n_kv_heads + kv head) * n_tiles + tile; NULL stops.
 * Serving never sets it (one global load a block when unset). */
enum {
    FLASH_TRACE_ENTRY_NS,     /* global timer at entry */
    FLASH_TRACE_ENTRY,        /* clock at entry */
    FLASH_TRACE_PROLOGUE,     /* first copies issued, Q read */
    FLASH_TRACE_WAIT,         /* sum over tiles: waiting for a tile and the barrier */
    FLASH_TRACE_COMPUTE,      /* sum over tiles: the rest of an iteration */
    FLASH_TRACE_TILES,        /* key tiles walked */
    FLASH_TRACE_LOOP,         /* after the loop (l reduced) */
    FLASH_TRACE_KS_MERGE,     /* after the key warps' merge */
    FLASH_TRACE_CLUSTER_SYNC, /* cluster merge: all rows written */
    FLASH_TRACE_MERGED,       /* cluster merge: the other blocks' rows read and summed */
    FLASH_TRACE_END,          /* cluster merge: output written, after the last barrier */
    FLASH_TRACE_EXIT_NS,      /* global timer before the output is written */
    FLASH_TRACE_SLOTS
};
is_status cuda_flash_set_trace(unsigned long long *trace);

/* Floats of the partial results in global memory (splits merged by the
 * second kernel; none otherwise). */
static inline size_t cuda_flash_partial_floats(cuda_flash_plan plan, int32_t n_kv_heads,
                                               int32_t head_dim) {
    if (plan.splits <= 1 || plan.cluster) return 0;
    return (size_t)plan.n_tiles * n_kv_heads * plan.splits * FLASH_BM * (head_dim + 2);
}

/* Where an op also writes its f32 output's bf16 copy (bf16_copy_put's
 * layout; p NULL: nowhere): n is the output's element count. */
typedef struct cuda_bf16_out {
    __nv_bfloat16 *p;
    int64_t n;
    bool split;
} cuda_bf16_out;

/* out[T][n_heads*head_dim] for the tokens the tiles cover (and its bf16
 * copy where ob.p is set, for the product that reads it). tiles: device
 * int32 [plan.n_tiles][FLASH_TILE_INTS] (cuda_flash_plan_batch's), the
 * tokens of a tile consecutive in the batch and in position, at most
 * FLASH_BM / group of them. partial: cuda_flash_partial_floats of scratch
 * (NULL when that is 0). pdl: launched as a programmatic dependent of the
 * stream's previous kernel (common.cuh).
 * IS_ERR_UNSUPPORTED for a shape cuda_flash_supports refuses,
 * IS_ERR_INVALID_ARG for a plan it cannot run; nothing is launched then. */
is_status cuda_flash_attention(cudaStream_t s, float *out, const float *q,
                               const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                               const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                               float *partial, int32_t n_heads, int32_t n_kv_heads,
                               int32_t head_dim, int32_t block_size, cuda_bf16_out ob, bool pdl);

/* Memory scaling for the tiled kernel (attn_batch.mem_span): span, device
 * int32 [plan.n_tiles][2], the memory keys [begin, end) of each tile's
 * sequence (begin = end: none), or NULL; rows after a tile's memory score
 * its keys x * mul_log2 + add_log2, x the log2-domain score (so mul_log2 =
 * 1 / temperature, add_log2 = log2(mass)). Tiles that hold no memory key
 * take the unmasked fast path as before. */
typedef struct cuda_flash_mem {
    const int32_t *span;
    float mul_log2, add_log2;
} cuda_flash_mem;

/* cuda_flash_attention with memory scaling (mem.span NULL: the same). */
is_status cuda_flash_attention_mem(cudaStream_t s, float *out, const float *q,
                                   const __nv_bfloat16 *k_cache, const __nv_bfloat16 *v_cache,
                                   const int32_t *flat, const int32_t *tiles, cuda_flash_plan plan,
                                   float *partial, int32_t n_heads, int32_t n_kv_heads,
                                   int32_t head_dim, int32_t block_size, cuda_bf16_out ob, bool pdl,
                                   cuda_flash_mem mem);

#endif

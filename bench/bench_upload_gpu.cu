/*
 * bench_upload_gpu: what a host-tier miss costs on the GPU, by way of copy.
 *
 * A request's misses are records in pinned host memory ([n_layers][n_tokens]
 * [kv_dim] keys, then values, bf16) that must land in the fact arena's pages
 * before the layers that read them. Two ways to move them:
 *   zero-copy  a kernel reads the host rows over PCIe itself and writes
 *              them into the pages, one launch a record (the arena's way
 *              before; kept here to compare);
 *   DMA        the arena's way (upload.cuh): cudaMemcpyAsync into a device
 *              staging buffer (the copy engine, no SMs) in layer groups of
 *              G (every record's layers [g, g + G) before any record's next
 *              group), the order a layer-by-layer injection needs (the
 *              scatter into the pages, a device-to-device pass, is not
 *              timed);
 * each alone, and each beside a stand-in for the forward pass (a kernel
 * that streams the weights' bytes from HBM, as a short prefill does), which
 * says how much the copy slows the forward and how much of the copy the
 * forward hides, with the host time the calls take.
 *
 *   bench_upload_gpu [-n records] [-t tokens] [-L layers] [-d kv_dim]
 *                    [-w weight_gb] [-G group] [-r runs] [-a bytes]
 */
#include "bench_cuda.cuh"

#include <cuda_bf16.h>
#include <stdint.h>

#include <chrono>
#include <getopt.h>
#include <string.h>

namespace {

/* The zero-copy way: a block per (token, layer), 16 bytes a thread. */
__global__ void zero_copy_kernel(uint4 *arena, const int32_t *pages, const uint4 *k, const uint4 *v,
                                 int32_t n_tokens, int32_t n_layers, int32_t vec) {
    const int32_t j = blockIdx.x, l = blockIdx.y;
    const int64_t src = ((int64_t)l * n_tokens + j) * vec;
    uint4 *kd = arena + (int64_t)pages[j] * 2 * n_layers * vec + (int64_t)l * vec;
    uint4 *vd = kd + (int64_t)n_layers * vec;
    for (int32_t e = threadIdx.x; e < vec; e += blockDim.x) {
        kd[e] = k[src + e];
        vd[e] = v[src + e];
    }
}

/* The forward's stand-in: reads n uint4 once, all SMs, a sum kept live. */
__global__ void stream_kernel(const uint4 *w, size_t n, unsigned *sink) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint4 x = w[i];
        acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

struct shape {
    int n_rec, n_tok, n_layers, kv_dim, group;
    size_t rec_elems() const { return (size_t)n_layers * n_tok * kv_dim; } /* k or v */
    size_t rec_bytes() const { return 2 * rec_elems() * 2; }
};

struct setup {
    shape sh;
    std::vector<void *> host; /* per record: k then v, pinned and mapped */
    __nv_bfloat16 *arena;
    uint8_t *staging; /* every record, device */
    int32_t *dpages;  /* [n_rec][n_tok], device */
    cudaStream_t s_up, s_fw;
};

void upload_zero_copy(setup &S) {
    const shape &sh = S.sh;
    const int32_t vec = sh.kv_dim / 8;
    for (int r = 0; r < sh.n_rec; r++) {
        const uint4 *k = (const uint4 *)S.host[(size_t)r];
        zero_copy_kernel<<<dim3(sh.n_tok, sh.n_layers), vec >= 128 ? 128 : vec, 0, S.s_up>>>(
            (uint4 *)S.arena, S.dpages + (size_t)r * sh.n_tok, k, k + sh.rec_elems() / 8, sh.n_tok,
            sh.n_layers, vec);
    }
}

/* Layer-group order, the copies only. */
void copy_dma_groups(setup &S) {
    const shape &sh = S.sh;
    const size_t row = (size_t)sh.n_tok * sh.kv_dim * 2; /* one layer's rows of k */
    for (int g = 0; g < sh.n_layers; g += sh.group) {
        const int n = sh.n_layers - g < sh.group ? sh.n_layers - g : sh.group;
        for (int r = 0; r < sh.n_rec; r++) {
            const uint8_t *h = (const uint8_t *)S.host[(size_t)r];
            uint8_t *d = S.staging + (size_t)r * sh.rec_bytes();
            const size_t half = sh.rec_elems() * 2;
            CK(cudaMemcpyAsync(d + g * row, h + g * row, n * row, cudaMemcpyHostToDevice, S.s_up));
            CK(cudaMemcpyAsync(d + half + g * row, h + half + g * row, n * row,
                               cudaMemcpyHostToDevice, S.s_up));
        }
    }
}

struct timing {
    double up_ms, fw_ms, wall_ms, host_ms;
};

/* fn on s_up, beside the stand-in on s_fw when fw; ms of each stream and of
 * both, from one start. */
template <typename F>
timing run_once(setup &S, F fn, bool up, bool fw, const uint4 *w, size_t nw, unsigned *sink,
                int sms) {
    cudaEvent_t e0, eu, ef;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&eu));
    CK(cudaEventCreate(&ef));
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e0, S.s_up));
    CK(cudaStreamWaitEvent(S.s_fw, e0, 0));
    timing t = {0, 0, 0, 0};
    if (fw) stream_kernel<<<sms * 4, 512, 0, S.s_fw>>>(w, nw, sink);
    auto h0 = std::chrono::steady_clock::now();
    if (up) fn(S);
    t.host_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
    CK(cudaEventRecord(eu, S.s_up));
    CK(cudaEventRecord(ef, S.s_fw));
    CK(cudaDeviceSynchronize());
    float a = 0, b = 0;
    CK(cudaEventElapsedTime(&a, e0, eu));
    CK(cudaEventElapsedTime(&b, e0, ef));
    t.up_ms = up ? a : 0;
    t.fw_ms = fw ? b : 0;
    t.wall_ms = a > b ? a : b;
    cudaEventDestroy(e0);
    cudaEventDestroy(eu);
    cudaEventDestroy(ef);
    return t;
}

} // namespace

int main(int argc, char **argv) {
    shape sh = {30, 40, 32, 1024, 8};
    double weight_gb = 16.0;
    int runs = 11, opt, misalign = 0;
    while ((opt = getopt(argc, argv, "n:t:L:d:w:G:r:a:h")) != -1) {
        switch (opt) {
        case 'n': sh.n_rec = atoi(optarg); break;
        case 't': sh.n_tok = atoi(optarg); break;
        case 'L': sh.n_layers = atoi(optarg); break;
        case 'd': sh.kv_dim = atoi(optarg); break;
        case 'w': weight_gb = atof(optarg); break;
        case 'G': sh.group = atoi(optarg); break;
        case 'r': runs = atoi(optarg); break;
        case 'a': misalign = atoi(optarg); break;
        default:
            fprintf(stderr,
                    "usage: %s [-n records 30] [-t tokens 40] [-L layers 32] [-d kv_dim 1024]\n"
                    "          [-w GB the forward stand-in streams, 16] [-G layer group 8]\n"
                    "          [-r runs 11] [-a BYTES]\n"
                    "-a BYTES: each record's keys start BYTES past a 256-byte boundary (a\n"
                    "    record file's keys start 128 + 4 x tokens bytes into it); the zero-copy\n"
                    "    rows, which load 16 bytes at a time, need a multiple of 16\n",
                    argv[0]);
            return opt == 'h' ? 0 : 2;
        }
    }
    if (sh.n_rec < 1 || sh.n_tok < 1 || sh.n_layers < 1 || sh.kv_dim < 8 || sh.kv_dim % 8 ||
        sh.group < 1 || runs < 1 || weight_gb <= 0 || misalign < 0 || misalign >= 256 ||
        misalign % 2) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    cudaDeviceProp prop;
    if (!bench_device(&prop)) return 0;
    setup S;
    S.sh = sh;
    std::vector<void *> blocks;
    for (int r = 0; r < sh.n_rec; r++) {
        void *p;
        CK(cudaHostAlloc(&p, sh.rec_bytes() + 256, cudaHostAllocPortable | cudaHostAllocMapped));
        blocks.push_back(p);
        memset((char *)p + misalign, r + 1, sh.rec_bytes());
        S.host.push_back((char *)p + misalign);
    }
    const size_t page_bytes = (size_t)2 * sh.n_layers * sh.kv_dim * 2;
    CK(cudaMalloc(&S.arena, (size_t)sh.n_rec * sh.n_tok * page_bytes));
    CK(cudaMalloc(&S.staging, (size_t)sh.n_rec * sh.rec_bytes()));
    std::vector<int32_t> pages;
    for (int r = 0; r < sh.n_rec; r++)
        for (int j = 0; j < sh.n_tok; j++) /* pages in another order, as the arena's are */
            pages.push_back((sh.n_rec - 1 - r) * sh.n_tok + j);
    CK(cudaMalloc(&S.dpages, pages.size() * sizeof(int32_t)));
    CK(cudaMemcpy(S.dpages, pages.data(), pages.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&S.s_up, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&S.s_fw, cudaStreamNonBlocking));
    const size_t nw = (size_t)(weight_gb * 1e9) / sizeof(uint4);
    uint4 *w;
    unsigned *sink;
    CK(cudaMalloc(&w, nw * sizeof(uint4)));
    CK(cudaMemset(w, 1, nw * sizeof(uint4)));
    CK(cudaMalloc(&sink, sizeof *sink));

    const double mb = (double)sh.n_rec * sh.rec_bytes() / 1e6;
    printf("device: %s, %d SMs; %d records x %d tokens, %d layers, kv_dim %d (bf16): %.1f MB; "
           "forward stand-in streams %.1f GB; medians of %d\n",
           prop.name, prop.multiProcessorCount, sh.n_rec, sh.n_tok, sh.n_layers, sh.kv_dim, mb,
           weight_gb, runs);
    struct row {
        const char *name;
        void (*fn)(setup &);
        bool up, fw;
    } rows[] = {
        {"forward stand-in alone", upload_zero_copy, false, true},
        {"zero-copy kernel", upload_zero_copy, true, false},
        {"DMA in layer groups (copies)", copy_dma_groups, true, false},
        {"zero-copy beside the forward", upload_zero_copy, true, true},
        {"DMA in layer groups beside the forward (copies)", copy_dma_groups, true, true},
    };
    printf("host records %d bytes past a 256-byte boundary\n", misalign);
    printf("| way | copy ms | GB/s | forward ms | both ms | host ms "
           "|\n|---|---:|---:|---:|---:|---:|\n");
    for (const row &rw : rows) {
        if (rw.up && rw.fn == upload_zero_copy && misalign % 16) continue;
        std::vector<double> up, fw, wall, host;
        run_once(S, rw.fn, rw.up, rw.fw, w, nw, sink, prop.multiProcessorCount); /* warm */
        for (int i = 0; i < runs; i++) {
            timing t = run_once(S, rw.fn, rw.up, rw.fw, w, nw, sink, prop.multiProcessorCount);
            up.push_back(t.up_ms);
            fw.push_back(t.fw_ms);
            wall.push_back(t.wall_ms);
            host.push_back(t.host_ms);
        }
        const double u = median(up);
        printf("| %s | %.3f | %.1f | %.3f | %.3f | %.3f |\n", rw.name, u, u > 0 ? mb / u : 0.0,
               median(fw), median(wall), median(host));
    }
    for (void *p : blocks) cudaFreeHost(p);
    cudaFree(S.arena);
    cudaFree(S.staging);
    cudaFree(S.dpages);
    cudaFree(w);
    cudaFree(sink);
    return 0;
}

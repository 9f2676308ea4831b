/*
 * bench_ingest: how fast facts' KV is encoded in-process, one fact a
 * forward against many (serve/ask.h ask_encode_facts: each fact its own
 * sequence forked from the serving prefix, the records of a forward written
 * with one group commit), and where the time goes.
 *
 *   bench_ingest [-m MODEL] [--backend cpu|cuda] [--locomo FILE] [-n FACTS]
 *                [-b 1,8,32,64] [-s STEP_TOKENS] [-r REPS] [-w WINDOW] [--dtype f16|bf16|f32]
 *   (bench_ingest --help lists every option)
 *
 * For each batch size B, the first n LoCoMo observations of the file (as
 * their text, with the W turns before their evidence turn as context) are
 * encoded B at a time into an empty record store (a new directory each
 * repetition, so nothing is skipped as already stored). Per batch size, the
 * median over the repetitions of: facts/s, the wall time of n facts, and
 * its split into the forwards (with the captured rows' download), the
 * narrowing of the rows into records, and the records' writes and group
 * commits (ask_ctx_encode_stats), and the process's CPU time a fact (what
 * the work costs, whatever the neighbours on a shared machine take). The served path adds the fact store's
 * commits and the HTTP handling: bench_load --ingest-clients measures that.
 */
#include "backend/backend.h"
#include "core/status.h"
#include "core/threads.h"
#include "memory/locomo.h"
#include "serve/ask.h"
#ifdef IS_HAVE_CUDA
#include "backend_cuda.h"
#endif
#include "bench_util.h"

#include <errno.h>
#include <ftw.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef IS_SOURCE_DIR
#define IS_SOURCE_DIR "."
#endif

#define MAX_BATCHES 16

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    return remove(p);
}

/* CPU time of the process (every thread): on a shared machine the wall
 * time says how busy the neighbours were, this says what the work cost. */
static double cpu_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_ingest [options]\n\n"
            "Encodes LoCoMo observations' KV in-process, B facts a forward, for each batch size,\n"
            "and prints facts/s with the time split into forward, narrowing and record writes.\n\n"
            "  -m, --model PATH     GGUF model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
            "      --backend B      cpu | cuda (default cpu)\n"
            "      --locomo FILE    a LoCoMo conversation (default ../shared/data/locomo/26.json)\n"
            "  -n, --facts N        facts encoded per batch size and repetition (default 64)\n"
            "  -b, --batch LIST     facts a forward (default 1,8,32,64); with -s, facts handed to\n"
            "                       the encoder at a time, as the server's scheduler does\n"
            "  -s, --step-tokens N  a forward holds at most N tokens (the server's step: 2048 on\n"
            "                       the GPU), so a batch is several forwards, each one's records\n"
            "                       written beside the next one's forward (default: no limit)\n"
            "  -r, --reps R         repetitions; the table gives medians (default 3)\n"
            "  -w, --window W       context turns encoded with each fact (default 0; -1: none)\n"
            "      --dtype D        record dtype: f16 (the server's default), bf16, f32\n"
            "  -t, --threads N      CPU threads (default: all cores)\n"
            "      --kv-mem MIB     KV cache pool (default 2048)\n"
            "      --dir DIR        where the record stores go (default: a temporary directory)\n"
            "  -p, --profile        after the table, one encoding of the last batch size with the\n"
            "                       CUDA backend's op profiler on: GPU ms per kind of op\n"
            "  -h, --help           this help\n");
}

static bool parse_list(const char *s, int32_t *out, int *n) {
    *n = 0;
    char *dup = strdup(s), *save = NULL;
    for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end;
        long v = strtol(t, &end, 10);
        if (*end || v < 1 || v > 4096 || *n == MAX_BATCHES) {
            fprintf(stderr, "error: bad batch size '%s' (1-4096, at most %d of them)\n", t,
                    MAX_BATCHES);
            free(dup);
            return false;
        }
        out[(*n)++] = (int32_t)v;
    }
    free(dup);
    return *n > 0;
}

static bool parse_int(const char *s, const char *what, long lo, long hi, int32_t *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) {
        fprintf(stderr, "error: %s must be an integer in [%ld, %ld], not '%s'\n", what, lo, hi, s);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

/* Encodes facts[0..n) B at a time into a fresh record store under dir
 * (removed after), as the server's encoder does; false with the error
 * printed if any fact was not encoded. */
static bool encode_all(engine *e, const char *dir, kv_dtype dtype, const ask_fact *facts,
                       const int32_t *win, int32_t n, int32_t B, int32_t step_tokens,
                       ask_encode_stats *out) {
    record_store *rs = NULL;
    ask_ctx *a = NULL;
    if (record_store_open(dir, 64 << 20, &rs) != IS_OK ||
        ask_ctx_create(e, rs, dtype, &a) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        record_store_close(rs);
        return false;
    }
    is_status *st = calloc((size_t)B, sizeof *st);
    bool *did = calloc((size_t)B, sizeof *did);
    bool ok = st && did;
    for (int32_t i = 0; i < n && ok; i += B) {
        int32_t nb = n - i < B ? n - i : B;
        /* One forward for the B facts unless step_tokens limits a forward. */
        ok = ask_encode_facts(a, facts + i, win + i, nb, step_tokens, st, did) == IS_OK;
    }
    *out = ask_ctx_encode_stats(a);
    free(st);
    free(did);
    ask_ctx_free(a);
    record_store_close(rs);
    if (!ok || out->n_facts != n) {
        fprintf(stderr, "error: batch %d encoded %lld of %d facts: %s\n", (int)B,
                (long long)out->n_facts, (int)n, is_error_last());
        return false;
    }
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return true;
}

#ifdef IS_HAVE_CUDA
/* -p: the last batch size's encoding once more (warm) with the op profiler
 * on, live (as it runs) and held (the GPU alone: its ops queued behind a
 * spin, so span - busy is no longer the host's pace): where a forward's
 * GPU time goes, beside bench_gpu -p's prompt forward of as many tokens. */
static bool profile_encoding(engine *e, backend *be, const char *root, kv_dtype dtype,
                             const ask_fact *facts, const int32_t *win, int32_t n, int32_t B,
                             int32_t step_tokens) {
    printf("\n### Op profile: GPU ms per kind of op, one encoding of %d facts, %d a call\n\n",
           (int)n, (int)B);
    printf("| run | wall | GPU span | GPU busy | ops | forwards | tokens |");
    for (int o = 0; o < CUDA_OP_N; o++) printf(" %s |", cuda_op_kind_name((cuda_op_kind)o));
    printf("\n|---|---:|---:|---:|---:|---:|---:|");
    for (int o = 0; o < CUDA_OP_N; o++) printf("---:|");
    printf("\n");
    for (int held = 0; held < 2; held++) {
        char d[512];
        snprintf(d, sizeof d, "%s/profile-%d", root, held);
        ask_encode_stats es;
        cuda_op_profile pr;
        if (backend_cuda_profile_begin(be, held ? 300.0 : 0.0) != IS_OK ||
            !encode_all(e, d, dtype, facts, win, n, B, step_tokens, &es) ||
            backend_cuda_profile_end(be, &pr) != IS_OK) {
            fprintf(stderr, "error: profile: %s\n", is_error_last());
            return false;
        }
        int64_t n_ops = 0;
        for (int o = 0; o < CUDA_OP_N; o++) n_ops += pr.count[o];
        printf("| %s | %.2f | %.2f | %.2f | %lld | %lld | %lld |", held ? "GPU alone" : "live",
               pr.wall_ms, pr.span_ms, pr.busy_ms, (long long)n_ops, (long long)es.n_forwards,
               (long long)es.n_tokens);
        for (int o = 0; o < CUDA_OP_N; o++) printf(" %.3f |", pr.gpu_ms[o]);
        printf("\n");
        if (pr.dropped) printf("(%lld ops past the profiler's limit)\n", (long long)pr.dropped);
    }
    fflush(stdout);
    return true;
}
#endif

int main(int argc, char **argv) {
    const char *model_path = IS_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *locomo = IS_SOURCE_DIR "/../shared/data/locomo/26.json";
    const char *be_name = "cpu", *dir_opt = NULL;
    int32_t n_facts = 64, reps = 3, window = 0, threads = 0, kv_mib = 2048, step_tokens = 1 << 20;
    int32_t batches[MAX_BATCHES] = {1, 8, 32, 64};
    int n_batches = 4;
    kv_dtype dtype = KV_DTYPE_F16;
    bool profile = false;
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"backend", required_argument, 0, 'B'},
        {"locomo", required_argument, 0, 'l'},
        {"facts", required_argument, 0, 'n'},
        {"batch", required_argument, 0, 'b'},
        {"reps", required_argument, 0, 'r'},
        {"step-tokens", required_argument, 0, 's'},
        {"window", required_argument, 0, 'w'},
        {"dtype", required_argument, 0, 'd'},
        {"threads", required_argument, 0, 't'},
        {"kv-mem", required_argument, 0, 'V'},
        {"dir", required_argument, 0, 'D'},
        {"profile", no_argument, 0, 'p'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "m:n:b:r:s:w:t:ph", longopts, NULL)) != -1) {
        bool ok = true;
        switch (ch) {
        case 'm': model_path = optarg; break;
        case 'B': be_name = optarg; break;
        case 'l': locomo = optarg; break;
        case 'n': ok = parse_int(optarg, "--facts", 1, 100000, &n_facts); break;
        case 'b': ok = parse_list(optarg, batches, &n_batches); break;
        case 'r': ok = parse_int(optarg, "--reps", 1, 100, &reps); break;
        case 's': ok = parse_int(optarg, "--step-tokens", 1, 1 << 20, &step_tokens); break;
        case 'w': ok = parse_int(optarg, "--window", -1, 64, &window); break;
        case 't': ok = parse_int(optarg, "--threads", 1, 1024, &threads); break;
        case 'V': ok = parse_int(optarg, "--kv-mem", 16, 1 << 20, &kv_mib); break;
        case 'D': dir_opt = optarg; break;
        case 'p': profile = true; break;
        case 'd':
            if (strcmp(optarg, "f16") == 0) dtype = KV_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0) dtype = KV_DTYPE_BF16;
            else if (strcmp(optarg, "f32") == 0) dtype = KV_DTYPE_F32;
            else {
                fprintf(stderr, "error: --dtype f16, bf16 or f32, not '%s'\n", optarg);
                ok = false;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 1;
        }
        if (!ok) return 1;
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 1;
    }
    int32_t max_b = 1;
    for (int i = 0; i < n_batches; i++)
        if (batches[i] > max_b) max_b = batches[i];

    locomo_conv *conv = NULL;
    if (locomo_load(locomo, &conv) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    if (conv->n_facts < n_facts) n_facts = conv->n_facts;
    /* Fact i: its text, and the turns before its evidence turn as context. */
    ask_fact *facts = calloc((size_t)n_facts, sizeof *facts);
    int32_t *win = calloc((size_t)n_facts, sizeof *win);
    const char **turns = calloc((size_t)(conv->n_turns ? conv->n_turns : 1), sizeof *turns);
    char(*ids)[32] = calloc((size_t)n_facts, sizeof *ids);
    for (int32_t t = 0; t < conv->n_turns; t++) turns[t] = conv->turns[t].text;
    for (int32_t i = 0; i < n_facts; i++) {
        const locomo_fact *lf = &conv->facts[i];
        snprintf(ids[i], sizeof ids[i], "f%05d", (int)i);
        int32_t before = lf->turn > 0 ? lf->turn : 0;
        facts[i] = (ask_fact){ids[i], lf->text, turns, before};
        win[i] = window;
    }

    char tmpdir[] = "/tmp/bench_ingest_XXXXXX";
    const char *root = dir_opt;
    if (!root && !(root = mkdtemp(tmpdir))) {
        fprintf(stderr, "error: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    threads_init(threads);
    backend *be = NULL;
    model *m = NULL;
    engine *e = NULL;
    int rc = 1;
    if (backend_create(be_name, threads, &be) != IS_OK) goto fail;
    backend_set_option(be, BACKEND_OPT_KV_COMPACT, 1); /* the server's cache (bf16 on the GPU) */
    if (model_load(model_path, be, &m) != IS_OK) goto fail;
    {
        const model_config *c = &m->cfg;
        engine_params ep = engine_default_params();
        ep.n_ctx = 4096;
        ep.max_seqs = max_b + 2; /* every fact of a batch, the serving prefix, one spare */
        size_t elem = be->ops->kv_elem_size ? be->ops->kv_elem_size(be) : 4;
        size_t per_block =
            2 * (size_t)c->n_layers * c->n_kv_heads * c->head_dim * elem * ep.block_size;
        ep.n_blocks = (int32_t)(((size_t)kv_mib << 20) / per_block);
        if (strcmp(be->ops->name, "cpu") != 0 && ep.max_batch < 2048) ep.max_batch = 2048;
        if (engine_create(m, ep, &e) != IS_OK) goto fail;
    }
    printf("bench_ingest: model %s, backend %s, %d LoCoMo facts of %s, window %d, %s records, "
           "median of %d",
           model_path, be_name, (int)n_facts, conv->name, (int)window, kv_dtype_name(dtype),
           (int)reps);
    if (step_tokens < (1 << 20)) printf(", forwards of at most %d tokens", (int)step_tokens);
    printf("\n");
    printf("%6s %10s %9s %11s %11s %11s %11s %9s %12s\n", "batch", "facts/s", "wall_ms",
           "forward_ms", "narrow_ms", "write_ms", "tok/forward", "speedup", "cpu_ms/fact");
    double base = 0;
    for (int bi = 0; bi < n_batches; bi++) {
        int32_t B = batches[bi];
        double wall[100], fwd[100], cvt[100], wr[100], cpu[100], tpf = 0;
        for (int r = 0; r < reps; r++) {
            char d[512];
            snprintf(d, sizeof d, "%s/b%d-r%d", root, (int)B, r);
            ask_encode_stats es;
            double t0 = bench_now_ms(), c0 = cpu_ms();
            if (!encode_all(e, d, dtype, facts, win, n_facts, B, step_tokens, &es)) goto fail;
            wall[r] = bench_now_ms() - t0;
            cpu[r] = (cpu_ms() - c0) / n_facts;
            fwd[r] = es.forward_ms, cvt[r] = es.convert_ms, wr[r] = es.write_ms;
            tpf = es.n_forwards ? (double)es.n_tokens / es.n_forwards : 0;
        }
        double w = bench_median(wall, reps), rate = n_facts / (w / 1e3);
        if (bi == 0) base = rate;
        printf("%6d %10.1f %9.1f %11.1f %11.1f %11.1f %11.1f %8.2fx %12.1f\n", (int)B, rate, w,
               bench_median(fwd, reps), bench_median(cvt, reps), bench_median(wr, reps), tpf,
               rate / base, bench_median(cpu, reps));
        fflush(stdout);
    }
    if (profile) {
#ifdef IS_HAVE_CUDA
        int32_t B = batches[n_batches - 1];
        if (strcmp(be->ops->name, "cuda") != 0)
            printf("\n(-p: the op profiler is the CUDA backend's)\n");
        else if (!profile_encoding(e, be, root, dtype, facts, win, n_facts < B ? n_facts : B, B,
                                   step_tokens))
            goto fail;
#else
        printf("\n(-p: this build has no CUDA backend)\n");
#endif
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "error: %s\n", is_error_last());
out:
    engine_free(e);
    model_free(m);
    if (be) be->ops->free(be);
    if (!dir_opt) nftw(root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    locomo_free(conv);
    free(facts), free(win), free(turns), free(ids);
    return rc;
}

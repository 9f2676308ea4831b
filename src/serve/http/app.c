#include "serve/http/app.h"

#include "core/status.h"
#include "serve/stack.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

struct http_app {
    stack *st; /* the embedder and the memory service (serve/stack.h) */
    backend *be;
    model *m;
    engine *e;
    memory *mem; /* st's */
    sched *s;
    auth_keys *keys;
    http_server *srv;
    char model_id[256];
};

http_app_params http_app_default_params(void) {
    http_app_params p;
    memset(&p, 0, sizeof p);
    p.backend = "cpu";
    p.kv_bytes = (size_t)1 << 30;
    p.sched = sched_default_params();
    p.http = http_default_config();
    return p;
}

/* The disk cap of the node's KV records: record_cache_bytes, or by
 * default half the file system that holds them (records are a cache of
 * the rows, so the disk is shared with what else the machine keeps). */
static is_status set_record_cap(http_app *a, const http_app_params *p, FILE *notes) {
    if (p->record_cache_bytes < 0) return IS_OK;
    uint64_t cap = (uint64_t)p->record_cache_bytes;
    if (cap == 0) {
        struct statvfs fs;
        if (statvfs(p->data_dir, &fs) != 0)
            return is_error_set(IS_ERR_IO, "cannot read the size of the file system of %s",
                                p->data_dir);
        cap = (uint64_t)fs.f_blocks * fs.f_frsize / 2;
    }
    record_store *rs = memory_record_store(a->mem);
    is_status st = record_store_set_disk_cap(rs, cap);
    if (st != IS_OK) return st;
    record_store_stats rst = record_store_get_stats(rs);
    fprintf(notes, "KV records: %.2f GiB in %llu files on disk, kept within %.2f GiB%s%s\n",
            (double)rst.disk_bytes / (1 << 30), (unsigned long long)rst.n_disk,
            (double)cap / (1 << 30),
            p->record_cache_bytes ? "" : " (half the file system; --record-cache-gb)",
            rst.disk_evictions ? ": least recently used evicted" : "");
    return IS_OK;
}

/* The file name without directories and ".gguf". */
static void model_name(const char *path, char *out, size_t cap) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t l = strlen(b);
    if (l > 5 && strcmp(b + l - 5, ".gguf") == 0) l -= 5;
    snprintf(out, cap, "%.*s", (int)l, b);
}

void http_app_stop(http_app *a) {
    if (!a) return;
    http_server_stop(a->srv); /* first: its cancelled requests end through the scheduler */
    sched_free(a->s);
    stack_close(a->st); /* the memory, then the embedder */
    engine_free(a->e);
    model_free(a->m);
    if (a->be) a->be->ops->free(a->be);
    auth_keys_free(a->keys);
    free(a);
}

is_status http_app_start(const http_app_params *p, http_app **out) {
    if (!p || !out || !p->data_dir || !*p->data_dir)
        return is_error_set(IS_ERR_INVALID_ARG, "http_app_start: a data directory is required");
    FILE *notes = p->notes ? p->notes : stderr;
    http_app *a = calloc(1, sizeof *a);
    if (!a) return is_error_set(IS_ERR_NOMEM, "out of memory");
    is_status st;
    http_config hc = p->http;

    if (!hc.no_auth) {
        if (!p->keys_path) {
            st = is_error_set(IS_ERR_INVALID_ARG,
                              "an API keys file is required (or no-auth for local use)");
            goto fail;
        }
        if ((st = auth_keys_load(p->keys_path, &a->keys)) != IS_OK) goto fail;
    }

    /* The embedder (the default one if installed) and the memory service,
     * as every command sets them up; the model comes below, sized for serving. */
    stack_params sp = stack_default_params();
    sp.data_dir = p->data_dir;
    sp.embedder_dir = p->embedder_dir;
    sp.embedder_optional = true;
    sp.n_threads = p->threads;
    sp.window = p->kv_window;
    sp.gpu_retrieval = p->gpu_retrieval;
    sp.store_url = p->store_url;
    if ((st = stack_open(&sp, &a->st)) != IS_OK) goto fail;
    a->mem = a->st->mem;
    const memory_open_report rep = a->st->report;
    if (!a->st->emb && !p->embedder_dir)
        fprintf(notes,
                "warning: embedding model %s not found (scripts/fetch_embedder.sh "
                "fetches it): memory search is BM25 only\n",
                STACK_DEFAULT_EMBEDDER);
    if (rep.n_orphans)
        fprintf(notes, "memory: set aside %lld KV records no fact points to in %s/kv/orphans/\n",
                (long long)rep.n_orphans, p->data_dir);
    if (rep.repairs[0])
        fprintf(notes, "memory: warning: %s (inferscale fsck lists them)\n", rep.repairs);
    if ((st = set_record_cap(a, p, notes)) != IS_OK) goto fail;

    if (p->model_path) {
        if ((st = backend_create(p->backend ? p->backend : "cpu", p->threads, &a->be)) != IS_OK)
            goto fail;
        if ((st = backend_configure(a->be, p->backend_options, NULL, 0)) != IS_OK) goto fail;
        /* Serving runs the compact cache where the backend has one (CUDA's
         * bf16: injected facts stay resident in the GPU arena, keyed by
         * record content ids, and attention is tiled); the CPU has none,
         * and an f32 cache (asked for, or the only one) has no fact cache. */
        bool fact_cache =
            backend_set_option(a->be, BACKEND_OPT_KV_COMPACT, !p->kv_cache_f32) == IS_OK &&
            !p->kv_cache_f32;
        char desc[512];
        if (backend_configure(a->be, NULL, desc, sizeof desc) == IS_OK && desc[0])
            fprintf(notes, "backend %s: %s\n", a->be->ops->name, desc);
        if ((st = stack_model_load(p->model_path, a->be, &a->m)) != IS_OK) goto fail;
        const model_config *c = &a->m->cfg;
        engine_params ep = engine_default_params();
        ep.n_ctx = p->n_ctx > 0 ? p->n_ctx : c->n_ctx_train;
        int32_t running = p->sched.max_running > 0 ? p->sched.max_running : 32;
        /* The serving prefix holds one; encodings on demand take more. */
        ep.max_seqs = running + 1 + HTTP_APP_ENCODE_SEQS;
        size_t elem = a->be->ops->kv_elem_size ? a->be->ops->kv_elem_size(a->be) : 4;
        size_t per_block = 2 * (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim *
                           elem * (size_t)ep.block_size;
        size_t nb = (p->kv_bytes ? p->kv_bytes : ((size_t)1 << 30)) / per_block;
        if (nb < 2) nb = 2;
        if (nb > (1u << 20)) nb = 1u << 20;
        ep.n_blocks = (int32_t)nb;
        bool gpu = strcmp(a->be->ops->name, "cpu") != 0;
        if (gpu && ep.max_batch < SCHED_GPU_STEP_TOKENS) ep.max_batch = SCHED_GPU_STEP_TOKENS;
        if ((st = engine_create(a->m, ep, &a->e)) != IS_OK) goto fail;
        if (fact_cache) {
            size_t fc = p->fact_cache_bytes;
            if (fc == 0) {
                size_t left = backend_free_bytes(a->be);
                fc = left > 2 * HTTP_APP_FACT_CACHE_MARGIN ? left - HTTP_APP_FACT_CACHE_MARGIN
                                                           : left / 2;
            }
            if (backend_set_option(a->be, BACKEND_OPT_FACT_CACHE_BYTES, fc) == IS_OK)
                fprintf(notes, "fact cache: %.2f GiB of GPU memory%s\n", (double)fc / (1 << 30),
                        p->fact_cache_bytes
                            ? ""
                            : " (what the weights and the KV pool leave, less a margin)");
            /* fp8 records: the fact cache keeps their codes and scales too. */
            if (p->sched.record_dtype == KV_DTYPE_FP8 &&
                backend_set_option(a->be, BACKEND_OPT_FACT_CACHE_FP8, 1) == IS_OK)
                fprintf(notes, "fact cache: fp8 e4m3 with per-head scales, as the records\n");
        }
        sched_params sp = p->sched;
        sp.max_running = running;
        /* The host tier fills the fact cache: without one every fact is
         * injected from values widened on the host, and a tier would pin
         * records nothing copies. */
        if (!fact_cache) sp.host_tier_bytes = 0;
        if ((st = sched_create(a->e, a->mem, &sp, &a->s)) != IS_OK) goto fail;
        /* Facts without KV here (a previous run's, another node's, records
         * evicted or lost) are encoded by the first request that needs
         * them, not now: a shared store holds every user's facts. */
        if (rep.n_missing_kv > 0)
            fprintf(notes,
                    "memory: %lld facts have no KV record on this node: each is encoded "
                    "at the first request that needs it\n",
                    (long long)rep.n_missing_kv);
        if (p->model_name) snprintf(a->model_id, sizeof a->model_id, "%s", p->model_name);
        else model_name(p->model_path, a->model_id, sizeof a->model_id);
        hc.tok = a->m->tok;
        fprintf(notes, "model: %s (%s backend), context %d, KV pool %d blocks of %d tokens\n",
                a->model_id, a->be->ops->name, ep.n_ctx, ep.n_blocks, ep.block_size);
    } else {
        snprintf(a->model_id, sizeof a->model_id, "%s", p->model_name ? p->model_name : "none");
        hc.tok = NULL;
    }
    hc.keys = a->keys;
    hc.sched = a->s;
    hc.mem = a->mem;
    hc.model_id = a->model_id;
    if ((st = http_server_start(&hc, &a->srv)) != IS_OK) goto fail;
    fprintf(notes, "memory: %lld facts in %s (search: %s)\n", (long long)rep.n_facts,
            p->store_url ? "the PostgreSQL store" : p->data_dir,
            !a->st->emb        ? "BM25 only"
            : p->gpu_retrieval ? "dense on the GPU + BM25"
                               : "dense + BM25");
    *out = a;
    return IS_OK;
fail : {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", is_error_last());
    http_app_stop(a);
    return is_error_set(st, "%s", msg);
}
}

int http_app_port(const http_app *a) { return a ? http_server_port(a->srv) : 0; }
http_server *http_app_server(http_app *a) { return a->srv; }
sched *http_app_sched(http_app *a) { return a->s; }
memory *http_app_memory(http_app *a) { return a->mem; }
backend *http_app_backend(http_app *a) { return a->be; }

/*
 * app: the whole serving stack in one call, as `inferscale serve` runs it
 * and as tests and benchmarks start it: backend -> model -> engine ->
 * memory service (with the sentence embedder, no KV encoder) -> scheduler
 * (which encodes the KV of facts added through this node in the
 * background, and of any other fact at the first request that needs it on
 * this node; a start encodes nothing in bulk) -> HTTP server. The node's
 * KV records are a cache, bounded on disk (record_cache_bytes).
 *
 * Starting a server in a test (port 0 picks a free port):
 *
 *   http_app_params p = http_app_default_params();
 *   p.model_path = IS_DEFAULT_MODEL;
 *   p.data_dir = tmpdir;
 *   p.http.port = 0;
 *   p.http.no_auth = true;             // or p.keys_path = "keys.txt"
 *   http_app *app;
 *   if (http_app_start(&p, &app) != IS_OK) ...is_error_last()...
 *   int port = http_app_port(app);     // http://127.0.0.1:<port>/v1/...
 *   ...
 *   http_app_stop(app);                // server, scheduler, memory, model
 *
 * Without a model (model_path NULL) only the memory routes, /health and
 * /metrics work; chat answers 503. That is how the memory API can be
 * tested where the default model is missing.
 */
#ifndef IS_SERVE_HTTP_APP_H
#define IS_SERVE_HTTP_APP_H

#include "serve/http/server.h"
#include "serve/stack.h"

#include <stdio.h>

typedef struct http_app http_app;

#define HTTP_APP_DEFAULT_EMBEDDER STACK_DEFAULT_EMBEDDER
/* Device memory left beside the default fact cache for what grows later:
 * activations of a full step, cuBLAS workspaces, graphs, the retrieval
 * index on the GPU. */
#define HTTP_APP_FACT_CACHE_MARGIN ((size_t)6 << 30)
/* Sequences beside the running requests' for KV encoded on demand: the
 * facts of a request's first use on this node, one sequence each, go
 * through one forward (as many as a step's tokens take). */
#define HTTP_APP_ENCODE_SEQS 64

typedef struct http_app_params {
    const char *model_path;      /* GGUF; NULL: no model (memory routes only) */
    const char *model_name;      /* id in /v1/models (NULL: the file name without .gguf) */
    const char *backend;         /* "cpu" (default) or "cuda" */
    const char *backend_options; /* the backend's own settings, "key=value,..." (cuda:
                                    cuda/options.h; NULL: its defaults); printed at start */
    const char *data_dir;        /* required: the memory's data directory */
    const char *store_url;       /* the fact store (memory_params.store_url): NULL for SQLite */
    const char *embedder_dir;    /* NULL: HTTP_APP_DEFAULT_EMBEDDER if present, else BM25 only
                                 (with a warning); "none": BM25 only */
    const char *keys_path;       /* API keys file (auth.h); required unless http.no_auth */
    int32_t threads;             /* CPU threads (0: all cores) */
    int32_t n_ctx;               /* context per sequence (0: the model's) */
    size_t kv_bytes;             /* KV cache pool (default 1 GiB) */
    bool kv_cache_f32;           /* cuda: an f32 KV cache (exact, no GPU fact arena) instead of
                                 the default bf16 one (tiled attention, fact arena) */
    size_t fact_cache_bytes;     /* cuda, bf16 cache: the GPU fact-KV arena (0: the device memory
                                 free after the weights and the KV pool, less
                                 HTTP_APP_FACT_CACHE_MARGIN) */
    int32_t kv_window;           /* context turns encoded with each new fact (default 0) */
    /* Bytes of KV record files kept in <data_dir>/kv/, least recently used
     * deleted past it (record_store_set_disk_cap; they are encoded again
     * when needed): 0, the default, takes half the size of the file system
     * holding data_dir; < 0: no cap. */
    int64_t record_cache_bytes;
    bool gpu_retrieval; /* memory search's query embedding and dense top-k on CUDA device
                                 0 (memory_params.gpu_retrieval; needs the embedder) */
    sched_params sched; /* sched_default_params() */
    http_config http;   /* host, port, limits, no_auth, log...; keys, sched, mem, tok
                                 and model_id are set here */
    FILE *notes;        /* start-up lines and warnings (NULL: stderr) */
} http_app_params;

http_app_params http_app_default_params(void);

/* Loads and starts everything; on failure everything started is stopped
 * again and is_error_last() says what failed. */
is_status http_app_start(const http_app_params *p, http_app **out);

int http_app_port(const http_app *a);
http_server *http_app_server(http_app *a);
sched *http_app_sched(http_app *a); /* NULL without a model */
memory *http_app_memory(http_app *a);
backend *http_app_backend(http_app *a); /* NULL without a model; for fault-injection tests */

/* Stops the server (cancelling what runs), then the scheduler, the
 * memory (closed cleanly: nothing stored is lost) and the model. NULL is
 * a no-op. */
void http_app_stop(http_app *a);

#endif

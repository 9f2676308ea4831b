/*
 * inferscale serve: the HTTP API (OpenAI-compatible chat with memory,
 * Mem0-style memory routes) over one model and one data directory.
 *
 *   inferscale serve -m MODEL --data DIR [--host H] [--port P] (--keys FILE | --no-auth)
 *
 * Ctrl-C or SIGTERM stop it cleanly: the server stops accepting and
 * cancels what runs, then the scheduler, the memory (closed, nothing
 * stored lost) and the model are freed.
 */
#include "cli.h"

#include "core/status.h"

#ifdef IS_HAVE_HTTP
#include "serve/http/app.h"
#endif

#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void serve_usage(FILE *f) {
    fprintf(
        f,
        "usage: inferscale serve --data DIR [options]\n\n"
        "Serves the model over HTTP: POST /v1/chat/completions (OpenAI; \"user\" names the user\n"
        "whose memory is used, \"memory\": {\"k\", \"mode\": kv|prompt|off, \"filters\"}), GET "
        "/v1/models,\n"
        "Mem0's memory API as the mem0ai clients call it (/v1/ping, /v1-v3 memories: add, list,\n"
        "get, update, delete, history, search with filters; /v1/batch, /v1/entities), GET /health\n"
        "and GET /metrics (Prometheus).\n\n"
        "  -m, --model PATH        GGUF model (default: $INFERSCALE_MODEL or %s)\n"
        "      --data DIR          memory data directory (created if missing; see 'ingest')\n"
        "      --store URL         the fact store: a postgres://USER@HOST/DB URL several nodes "
        "share\n"
        "                          (this node keeps its KV records and index in --data as caches;\n"
        "                          docs/scale-out.md); default: DIR/memory.db (SQLite)\n"
        "      --host H            address to listen on (default 127.0.0.1)\n"
        "      --port P            port (default 8080; 0: any free port)\n"
        "      --keys FILE         API keys: one 'KEY TENANT' per line, '#' comments; clients "
        "send\n"
        "                          'Authorization: Bearer KEY' (or mem0ai's 'Token KEY') and see\n"
        "                          only their tenant's memories\n"
        "      --no-auth           no keys: every request is tenant --tenant (local use only)\n"
        "      --tenant T          the tenant of --no-auth requests (default 'default')\n"
        "      --model-name NAME   the model's id in the API (default: the file name)\n"
        "      --embedder DIR      sentence-embedding model (default models/all-MiniLM-L6-v2 if\n"
        "                          present; 'none': BM25 search only)\n"
        "      --backend B         cpu | cuda (default cpu)\n"
        "      --cuda-opt LIST     cuda: the backend's options, key=value,...\n"
        "                          ($IS_CUDA_OPTIONS: the same list, applied first; the KV\n"
        "                          cache's type is --kv-cache-f32's):\n%s"
        "      --retrieval R       cpu | cuda (default cpu): cuda embeds the query and searches "
        "each\n"
        "                          user's facts on GPU 0 (needs the embedder and a CUDA build; "
        "searches\n"
        "                          with agent/run/metadata filters stay on the CPU)\n"
        "  -t, --threads N         CPU threads (default: all cores)\n"
        "  -c, --ctx N             context per request (default: the model's)\n"
        "      --kv-mem MIB        KV cache pool in MiB (default 1024)\n"
        "      --kv-cache-f32      cuda: keep the KV cache in f32 (exact against the CPU, no GPU\n"
        "                          fact arena) instead of bf16 (the default: faster, resident "
        "facts)\n"
        "      --kv-dtype T        f16 | bf16 | f32 | fp8: dtype of the facts' KV records written "
        "and\n"
        "                          read (default f16; records of another dtype are used as text:\n"
        "                          ingest, whose default is f16 too, with the same --kv-dtype)\n"
        "                          fp8: e4m3 with a scale per layer, token and KV head, half of\n"
        "                          bf16's bytes; on cuda the fact cache keeps fp8 too\n"
        "      --fact-cache-gb GB  cuda: GPU memory for the facts' KV kept resident (default: "
        "what\n"
        "                          the weights and the KV pool leave, less 6 GiB)\n"
        "      --host-cache-gb GB  cuda: pinned host memory for facts' KV records between the GPU\n"
        "                          cache and the disk, read from disk and copied to the GPU as a\n"
        "                          request is submitted (default 8, or a quarter of the machine's\n"
        "                          or container's memory if less, taken as records come; f16 and\n"
        "                          bf16 records; 0: off, the records are read and widened per\n"
        "                          request)\n"
        "      --record-cache-gb GB  disk kept for the facts' KV records in DIR/kv/: past it the "
        "least\n"
        "                          recently used are deleted, and encoded again by the next "
        "request\n"
        "                          that needs them (default: half the file system holding DIR;\n"
        "                          0: no limit). The records are a cache: facts live in the store\n"
        "      --step-tokens N     most tokens in one engine step (default 2048 on cuda, 256 on "
        "cpu)\n"
        "      --prefill-chunk N   most prompt tokens of one request a step (default 2048 on "
        "cuda,\n"
        "                          128 on cpu)\n"
        "  -w, --window W          context turns encoded with each new fact (default 0)\n"
        "      --recompute M       kv requests: the first M tokens of every injected fact "
        "computed\n"
        "                          again, with the facts before them visible, in the request's\n"
        "                          first prefill forward (default 0: none)\n"
        "      --infer-fallback F  store | reject: an infer=true add from which the model "
        "extracts\n"
        "                          no fact stores the user's messages as they are (store, the\n"
        "                          default) or fails with 422 and stores nothing (reject)\n"
        "      --max-running N     requests in the running batch (default 32)\n"
        "      --max-queued N      requests waiting before 503 (default 256)\n"
        "limits (over a limit: a 4xx with an OpenAI-style error):\n"
        "      --max-body BYTES    request body (default 1048576; 413 above)\n"
        "      --max-prompt N      tokens of a request's messages (default 4096)\n"
        "      --max-tokens N      largest max_tokens (default 4096; default when absent: 256)\n"
        "      --max-k N           largest memory.k / top_k (default 100, at most 1024)\n"
        "      --max-in-flight N   API requests served at once (default 64; 429 above)\n"
        "hostile clients (a request's key and slot are checked before its body is read):\n"
        "      --max-in-flight-tenant N  of them, one tenant's (default: 3/4 of --max-in-flight;\n"
        "                          0: no per-tenant limit; not applied with --no-auth)\n"
        "      --max-connections N open connections (default 512); past it a new connection\n"
        "                          closes the oldest one waiting for a request (idle or slow)\n"
        "      --header-timeout S  a new connection's request headers must arrive within S s\n"
        "                          (default 10; 408 and close after)\n"
        "      --body-timeout S    a request body must arrive within S s of its headers\n"
        "                          (default 60; 408 and close after)\n"
        "      --idle-timeout S    a kept-alive connection is closed after S s without a request,\n"
        "                          and a response after S s without progress (default 30)\n"
        "      --public-stats      /health and /metrics show the fact count over all tenants to\n"
        "                          callers without a key (default: not shown)\n"
        "      --log FILE          request log, one JSON line per request (default: stderr)\n"
        "      --quiet             no request log\n"
        "  -h, --help              this help\n\n"
        "Example:\n"
        "  inferscale serve --data mem/ --no-auth &\n"
        "  curl -s localhost:8080/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\n"
        "       \"content\":\"What do I like?\"}],\"user\":\"alice\",\"max_tokens\":64}'\n",
        CLI_DEFAULT_MODEL, backend_options_help("cuda"));
}

#ifdef IS_HAVE_HTTP
static bool parse_size(const char *s, const char *what, unsigned long long lo,
                       unsigned long long hi, unsigned long long *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi || s[0] == '-') {
        fprintf(stderr, "error: %s must be an integer in [%llu, %llu], got '%s'\n", what, lo, hi,
                s);
        return false;
    }
    *out = v;
    return true;
}

/* Long-only options (codes past any character). */
enum {
    OPT_MAX_IN_FLIGHT_TENANT = 0x1270,
    OPT_MAX_CONNECTIONS,
    OPT_HEADER_TIMEOUT,
    OPT_BODY_TIMEOUT,
    OPT_IDLE_TIMEOUT,
    OPT_PUBLIC_STATS,
    OPT_HOST_CACHE_GB,
    OPT_CUDA_OPT,
    OPT_STORE,
    OPT_RECORD_CACHE_GB,
    OPT_RECOMPUTE,
};

int cmd_serve(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"data", required_argument, 0, 'D'},
        {"host", required_argument, 0, 'H'},
        {"port", required_argument, 0, 'P'},
        {"keys", required_argument, 0, 'K'},
        {"no-auth", no_argument, 0, 'N'},
        {"tenant", required_argument, 0, 'T'},
        {"model-name", required_argument, 0, 'M'},
        {"embedder", required_argument, 0, 'E'},
        {"backend", required_argument, 0, 'B'},
        {"threads", required_argument, 0, 't'},
        {"ctx", required_argument, 0, 'c'},
        {"kv-mem", required_argument, 0, 'V'},
        {"window", required_argument, 0, 'w'},
        {"max-running", required_argument, 0, 'R'},
        {"max-queued", required_argument, 0, 'Q'},
        {"max-body", required_argument, 0, 'b'},
        {"max-prompt", required_argument, 0, 'p'},
        {"max-tokens", required_argument, 0, 'n'},
        {"max-k", required_argument, 0, 'k'},
        {"max-in-flight", required_argument, 0, 'f'},
        {"log", required_argument, 0, 'L'},
        {"quiet", no_argument, 0, 'q'},
        {"kv-dtype", required_argument, 0, 'd'},
        {"kv-cache-f32", no_argument, 0, 'F'},
        {"retrieval", required_argument, 0, 'G'},
        {"infer-fallback", required_argument, 0, 'I'},
        {"fact-cache-gb", required_argument, 0, 'C'},
        {"step-tokens", required_argument, 0, 'S'},
        {"prefill-chunk", required_argument, 0, 'U'},
        {"cuda-opt", required_argument, 0, OPT_CUDA_OPT},
        {"max-in-flight-tenant", required_argument, 0, OPT_MAX_IN_FLIGHT_TENANT},
        {"max-connections", required_argument, 0, OPT_MAX_CONNECTIONS},
        {"header-timeout", required_argument, 0, OPT_HEADER_TIMEOUT},
        {"body-timeout", required_argument, 0, OPT_BODY_TIMEOUT},
        {"idle-timeout", required_argument, 0, OPT_IDLE_TIMEOUT},
        {"public-stats", no_argument, 0, OPT_PUBLIC_STATS},
        {"host-cache-gb", required_argument, 0, OPT_HOST_CACHE_GB},
        {"store", required_argument, 0, OPT_STORE},
        {"record-cache-gb", required_argument, 0, OPT_RECORD_CACHE_GB},
        {"recompute", required_argument, 0, OPT_RECOMPUTE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    http_app_params p = http_app_default_params();
    p.model_path = cli_default_model();
    const char *log_path = NULL;
    int32_t iv;
    unsigned long long uv;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:c:w:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': p.model_path = optarg; break;
        case 'D': p.data_dir = optarg; break;
        case OPT_STORE:
            if (!mem_store_is_url(optarg)) {
                fprintf(stderr,
                        "error: --store takes a postgres:// or postgresql:// URL, got '%s' "
                        "(the SQLite store is DIR/memory.db, the default)\n",
                        optarg);
                return 1;
            }
            p.store_url = optarg;
            break;
        case 'H': p.http.host = optarg; break;
        case 'P':
            if (!cli_parse_int(optarg, "--port", 0, 65535, &iv)) return 1;
            p.http.port = iv;
            break;
        case 'K': p.keys_path = optarg; break;
        case 'N': p.http.no_auth = true; break;
        case 'T': p.http.no_auth_tenant = optarg; break;
        case 'M': p.model_name = optarg; break;
        case 'E': p.embedder_dir = optarg; break;
        case 'B': p.backend = optarg; break;
        case OPT_CUDA_OPT: p.backend_options = optarg; break;
        case 'F': p.kv_cache_f32 = true; break;
        case 'G':
            if (!cli_parse_retrieval(optarg, &p.gpu_retrieval)) return 1;
            break;
        case 't':
            if (!cli_parse_int(optarg, "--threads", 1, 1024, &p.threads)) return 1;
            break;
        case 'c':
            if (!cli_parse_int(optarg, "--ctx", 16, 1 << 20, &p.n_ctx)) return 1;
            break;
        case 'V':
            if (!parse_size(optarg, "--kv-mem", 1, 1 << 20, &uv)) return 1;
            p.kv_bytes = (size_t)uv << 20;
            break;
        case 'w':
            if (!cli_parse_int(optarg, "--window", 0, MEMORY_MAX_CONTEXT, &p.kv_window)) return 1;
            break;
        case 'C': {
            char *end;
            double gb = strtod(optarg, &end);
            if (end == optarg || *end || !(gb > 0 && gb <= 1e4)) {
                fprintf(stderr,
                        "error: --fact-cache-gb must be a number of GiB in (0, 10000], got '%s'\n",
                        optarg);
                return 1;
            }
            p.fact_cache_bytes = (size_t)(gb * (double)(1 << 30));
            break;
        }
        case OPT_HOST_CACHE_GB: {
            char *end;
            double gb = strtod(optarg, &end);
            if (end == optarg || *end || !(gb >= 0 && gb <= 1e4)) {
                fprintf(stderr,
                        "error: --host-cache-gb must be a number of GiB in [0, 10000], got '%s'\n",
                        optarg);
                return 1;
            }
            p.sched.host_tier_bytes = (int64_t)(gb * (double)(1 << 30));
            break;
        }
        case OPT_RECORD_CACHE_GB: {
            char *end;
            double gb = strtod(optarg, &end);
            if (end == optarg || *end || !(gb >= 0 && gb <= 1e6)) {
                fprintf(stderr,
                        "error: --record-cache-gb must be a number of GiB in [0, 1000000], "
                        "got '%s'\n",
                        optarg);
                return 1;
            }
            int64_t bytes = (int64_t)(gb * (double)(1 << 30));
            /* 0 means no limit; a positive value too small for one record still bounds. */
            p.record_cache_bytes = gb == 0 ? -1 : bytes > 0 ? bytes : 1;
            break;
        }
        case 'S':
            if (!cli_parse_int(optarg, "--step-tokens", 1, 1 << 16, &p.sched.step_tokens)) return 1;
            break;
        case 'U':
            if (!cli_parse_int(optarg, "--prefill-chunk", 1, 1 << 16, &p.sched.prefill_chunk))
                return 1;
            break;
        case OPT_RECOMPUTE:
            if (!cli_parse_int(optarg, "--recompute", 0, 100000, &p.sched.recompute)) return 1;
            break;
        case 'R':
            if (!cli_parse_int(optarg, "--max-running", 1, 4096, &p.sched.max_running)) return 1;
            break;
        case 'Q':
            if (!cli_parse_int(optarg, "--max-queued", 1, 1 << 20, &p.sched.max_queued)) return 1;
            break;
        case 'b':
            if (!parse_size(optarg, "--max-body", 64, 1ULL << 30, &uv)) return 1;
            p.http.limits.max_body_bytes = (size_t)uv;
            break;
        case 'p':
            if (!cli_parse_int(optarg, "--max-prompt", 0, 1 << 24,
                               &p.http.limits.max_prompt_tokens))
                return 1;
            break;
        case 'n':
            if (!cli_parse_int(optarg, "--max-tokens", 1, 1 << 24, &p.http.limits.parse.max_tokens))
                return 1;
            if (p.http.limits.parse.default_max_tokens > p.http.limits.parse.max_tokens)
                p.http.limits.parse.default_max_tokens = p.http.limits.parse.max_tokens;
            break;
        case 'k':
            if (!cli_parse_int(optarg, "--max-k", 1, SCHED_MAX_FACTS, &p.http.limits.parse.max_k))
                return 1;
            if (p.http.limits.parse.default_k > p.http.limits.parse.max_k)
                p.http.limits.parse.default_k = p.http.limits.parse.max_k;
            if (p.http.limits.parse.default_top_k > p.http.limits.parse.max_k)
                p.http.limits.parse.default_top_k = p.http.limits.parse.max_k;
            break;
        case 'f':
            if (!cli_parse_int(optarg, "--max-in-flight", 1, 1 << 20, &p.http.limits.max_in_flight))
                return 1;
            break;
        case 'd':
            if (!cli_parse_kv_dtype(optarg, &p.sched.record_dtype)) return 1;
            break;
        case 'I':
            if (strcmp(optarg, "store") == 0) p.http.infer_fallback = HTTP_INFER_FALLBACK_STORE;
            else if (strcmp(optarg, "reject") == 0)
                p.http.infer_fallback = HTTP_INFER_FALLBACK_REJECT;
            else {
                fprintf(stderr, "error: --infer-fallback must be store or reject, got '%s'\n",
                        optarg);
                return 1;
            }
            break;
        case OPT_MAX_IN_FLIGHT_TENANT:
            if (!cli_parse_int(optarg, "--max-in-flight-tenant", 0, 1 << 20,
                               &p.http.limits.max_in_flight_tenant))
                return 1;
            break;
        case OPT_MAX_CONNECTIONS:
            if (!cli_parse_int(optarg, "--max-connections", 1, 1 << 16,
                               &p.http.limits.max_connections))
                return 1;
            break;
        case OPT_HEADER_TIMEOUT:
            if (!cli_parse_int(optarg, "--header-timeout", 1, 3600,
                               &p.http.limits.header_timeout_s))
                return 1;
            break;
        case OPT_BODY_TIMEOUT:
            if (!cli_parse_int(optarg, "--body-timeout", 1, 3600, &p.http.limits.body_timeout_s))
                return 1;
            break;
        case OPT_IDLE_TIMEOUT:
            if (!cli_parse_int(optarg, "--idle-timeout", 1, 3600,
                               &p.http.limits.connection_timeout_s))
                return 1;
            break;
        case OPT_PUBLIC_STATS: p.http.public_stats = true; break;
        case 'L': log_path = optarg; break;
        case 'q': p.http.quiet = true; break;
        case 'h': serve_usage(stdout); return 0;
        default: serve_usage(stderr); return 1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see 'inferscale serve --help')\n",
                argv[optind]);
        return 1;
    }
    if (!p.data_dir) {
        fprintf(stderr, "error: serve needs --data DIR (the memory's data directory)\n");
        return 1;
    }
    if (p.http.no_auth && p.keys_path) {
        fprintf(stderr, "error: --keys and --no-auth exclude each other\n");
        return 1;
    }
    if (!p.http.no_auth && !p.keys_path) {
        fprintf(stderr, "error: serve needs --keys FILE (API keys), or --no-auth for local use\n");
        return 1;
    }
    if (p.http.no_auth_tenant && !auth_tenant_valid(p.http.no_auth_tenant)) {
        fprintf(stderr, "error: --tenant must be 1 to %d characters of [A-Za-z0-9_.-]\n",
                AUTH_TENANT_MAX);
        return 1;
    }
    if (!backend_available(p.backend)) {
        fprintf(stderr, "error: backend '%s' is not available in this build (cpu%s)\n", p.backend,
                backend_available("cuda") ? ", cuda" : "");
        return 1;
    }
    FILE *log = NULL;
    if (log_path) {
        if (!(log = fopen(log_path, "a"))) {
            fprintf(stderr, "error: cannot open log file '%s': %s\n", log_path, strerror(errno));
            return 1;
        }
        p.http.log = log;
    }
    /* Every thread started from here on inherits the mask, so the signals
     * reach only the sigwait below. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    if (p.http.no_auth)
        fprintf(stderr,
                "warning: --no-auth: no API key is checked and every request is tenant "
                "'%s'; use it only on a machine you trust\n",
                p.http.no_auth_tenant ? p.http.no_auth_tenant : "default");
    http_app *app = NULL;
    if (http_app_start(&p, &app) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        if (log) fclose(log);
        return 1;
    }
    const char *h = p.http.host ? p.http.host : "127.0.0.1";
    fprintf(stderr, "serving on http://%s%s%s:%d (Ctrl-C to stop)\n", strchr(h, ':') ? "[" : "", h,
            strchr(h, ':') ? "]" : "", http_app_port(app));
    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "\n%s: stopping (requests still running are cancelled)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT");
    http_app_stop(app);
    fprintf(stderr, "stopped cleanly\n");
    if (log) fclose(log);
    return 0;
}
#else
int cmd_serve(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            serve_usage(stdout);
            return 0;
        }
    fprintf(stderr,
            "error: this build has no HTTP server (libmicrohttpd was not found at configure "
            "time: install libmicrohttpd-dev and configure again)\n");
    return 1;
}
#endif

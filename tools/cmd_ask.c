/*
 * inferscale ask: answer one question with a set of facts as memory.
 *
 *   inferscale ask -m MODEL --facts FILE --query TEXT [--k N] [--mode kv|prompt|off]
 *                  [--window W] [--data DIR] [--retrieval cpu|cuda]
 *
 * FILE holds one JSON object per line: {"text": "...", "id": "...",
 * "context": ["earlier turn", ...]} (id and context optional). Facts missing
 * from the record store under DIR/kv are encoded first (with their last W
 * context turns); then the k facts most relevant to the query are retrieved
 * (dense + BM25 with the embedding model when it is installed, BM25 alone
 * otherwise; with --retrieval cuda the query is embedded and the dense
 * top-k taken on the GPU, memory/dense_gpu.h), and the answer is generated
 * in the chosen mode. The time to
 * first token is printed split into retrieval, record fetch, injection and
 * prefill.
 */
#include "cli.h"

#include "core/status.h"
#include "kv/fact_record.h"
#include "memory/dense_gpu.h"
#include "memory/embedder.h"
#include "memory/index.h"
#include "memory/locomo.h"
#include "serve/ask.h"
#include "serve/stack.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct fact_line {
    char id[72];
    char *text;
    char **context;
    int32_t n_context;
} fact_line;

static void facts_free(fact_line *f, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        free(f[i].text);
        for (int32_t j = 0; j < f[i].n_context; j++) free(f[i].context[j]);
        free(f[i].context);
    }
    free(f);
}

/* Reads the JSON-lines facts file. Errors name the line. */
static int facts_load(const char *path, fact_line **out, int32_t *n_out) {
    FILE *fp = fopen(path, "r");
    if (!fp) {
        fprintf(stderr, "error: cannot open facts file '%s': %s\n", path, strerror(errno));
        return 1;
    }
    fact_line *facts = NULL;
    int32_t n = 0, cap = 0, lineno = 0;
    char *line = NULL;
    size_t lcap = 0;
    int rc = 0;
    while (getline(&line, &lcap, fp) >= 0) {
        lineno++;
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == '\n' || *p == '\0' || *p == '#') continue;
        cJSON *j = cJSON_Parse(p);
        const cJSON *text = cJSON_GetObjectItem(j, "text");
        if (!cJSON_IsObject(j) || !cJSON_IsString(text) || !text->valuestring[0]) {
            fprintf(stderr, "error: %s:%d: expected a JSON object with a non-empty \"text\"\n",
                    path, lineno);
            cJSON_Delete(j);
            rc = 1;
            break;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            facts = realloc(facts, (size_t)cap * sizeof *facts);
        }
        fact_line *f = &facts[n];
        memset(f, 0, sizeof *f);
        f->text = strdup(text->valuestring);
        const cJSON *id = cJSON_GetObjectItem(j, "id");
        if (cJSON_IsString(id)) {
            if (!record_store_id_valid(id->valuestring)) {
                fprintf(stderr, "error: %s:%d: id must be 1-64 characters of [A-Za-z0-9_-]\n", path,
                        lineno);
                free(f->text);
                cJSON_Delete(j);
                rc = 1;
                break;
            }
            snprintf(f->id, sizeof f->id, "%s", id->valuestring);
        } else {
            /* Content-addressed: the same text keeps the same record. */
            snprintf(f->id, sizeof f->id, "f%016llx",
                     (unsigned long long)fact_text_hash(f->text, strlen(f->text)));
        }
        const cJSON *ctx = cJSON_GetObjectItem(j, "context"), *turn;
        if (cJSON_IsArray(ctx)) {
            f->context = calloc((size_t)cJSON_GetArraySize(ctx) + 1, sizeof(char *));
            cJSON_ArrayForEach(turn, ctx) {
                if (cJSON_IsString(turn)) f->context[f->n_context++] = strdup(turn->valuestring);
            }
        }
        n++;
        cJSON_Delete(j);
    }
    free(line);
    fclose(fp);
    if (rc == 0 && n == 0) {
        fprintf(stderr, "error: facts file '%s' holds no facts\n", path);
        rc = 1;
    }
    if (rc) {
        facts_free(facts, n);
        return rc;
    }
    *out = facts;
    *n_out = n;
    return 0;
}

/* Facts from a LoCoMo conversation: its observations, each with the turns
 * before its evidence turn as context. */
static int facts_from_locomo(const char *path, fact_line **out, int32_t *n_out) {
    locomo_conv *c;
    if (locomo_load(path, &c) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    fact_line *facts = calloc((size_t)c->n_facts, sizeof *facts);
    const char *turns[64];
    for (int32_t i = 0; i < c->n_facts; i++) {
        snprintf(facts[i].id, sizeof facts[i].id, "%s-%d", c->name, i);
        facts[i].text = strdup(c->facts[i].text);
        int32_t nt = locomo_fact_context(c, &c->facts[i], 64, turns);
        facts[i].context = calloc((size_t)nt + 1, sizeof(char *));
        for (int32_t j = 0; j < nt; j++) facts[i].context[j] = strdup(turns[j]);
        facts[i].n_context = nt;
    }
    *out = facts;
    *n_out = c->n_facts;
    locomo_free(c);
    return 0;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static bool print_piece(const char *t, size_t l, void *ud) {
    fwrite(t, 1, l, stdout);
    fflush(stdout);
    return true;
}

static void ask_usage(FILE *f) {
    fprintf(
        f,
        "usage: inferscale ask --facts FILE --query TEXT [options]\n\n"
        "Answers a question with facts as memory: injected as KV (kv), pasted as text\n"
        "(prompt), or not at all (off). Facts not yet in the record store are encoded first.\n\n"
        "  -m, --model PATH     GGUF model (default: $INFERSCALE_MODEL or %s)\n"
        "      --facts FILE     JSON lines: {\"text\": ..., \"id\": ..., \"context\": [turns]}\n"
        "      --locomo FILE    or: the observations of a LoCoMo conversation as facts\n"
        "  -q, --query TEXT     the question\n"
        "  -k, --k N            facts to retrieve (default 5)\n"
        "      --mode MODE      kv | prompt | off (default kv)\n"
        "  -w, --window W       context turns encoded with each fact (default 0; -1: no\n"
        "                       context at all, not even the serving prefix)\n"
        "      --recompute M    kv: the first M tokens of every fact computed again, with the\n"
        "                       facts before them visible, in the query's own forward\n"
        "                       (default 0: none)\n"
        "      --blend R        kv: CacheBlend, the share R (0..1) of the memory's tokens\n"
        "                       whose second-layer K/V deviate most recomputed (default 0)\n"
        "      --data DIR       where records are stored (default ./inferscale-data)\n"
        "      --kv-dtype T     record precision: f32 | f16 | bf16 | fp8 (default f32)\n"
        "      --embedder DIR   sentence-embedding model (default %s if present;\n"
        "                       'none' for BM25 retrieval only)\n"
        "      --retrieval R    cpu | cuda (default cpu): cuda embeds the query and takes the\n"
        "                       dense top-k on GPU 0 (needs the embedder and a CUDA build)\n"
        "  -n, --max-tokens N   tokens to generate (default 128)\n"
        "      --temp T         temperature, 0 = greedy (default 0)\n"
        "      --seed S         sampling seed (default 0)\n"
        "  -t, --threads N      CPU threads (default: all cores)\n"
        "  -h, --help           this help\n",
        CLI_DEFAULT_MODEL, STACK_DEFAULT_EMBEDDER);
}

int cmd_ask(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"facts", required_argument, 0, 'F'},
        {"query", required_argument, 0, 'q'},
        {"k", required_argument, 0, 'k'},
        {"mode", required_argument, 0, 'M'},
        {"window", required_argument, 0, 'w'},
        {"data", required_argument, 0, 'D'},
        {"kv-dtype", required_argument, 0, 'd'},
        {"embedder", required_argument, 0, 'E'},
        {"max-tokens", required_argument, 0, 'n'},
        {"locomo", required_argument, 0, 'L'},
        {"retrieval", required_argument, 0, 'G'},
        {"temp", required_argument, 0, 'T'},
        {"seed", required_argument, 0, 'S'},
        {"threads", required_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},
        {"recompute", required_argument, 0, 'R'},
        {"blend", required_argument, 0, 'B'},
        {0, 0, 0, 0},
    };
    const char *model_path = cli_default_model(), *facts_path = NULL, *query = NULL, *locomo = NULL;
    const char *data = "inferscale-data", *emb_dir = NULL;
    int32_t k = 5, window = 0, max_tokens = 128, threads = 0, recompute = 0;
    float temp = 0.0f, blend = 0.0f;
    uint64_t seed = 0;
    ask_mode mode = ASK_MODE_KV;
    bool gpu_retrieval = false;
    kv_dtype dtype = KV_DTYPE_F32;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:q:k:w:n:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'F': facts_path = optarg; break;
        case 'L': locomo = optarg; break;
        case 'q': query = optarg; break;
        case 'k':
            if (!cli_parse_int(optarg, "--k", 0, 100000, &k)) return 1;
            break;
        case 'w':
            if (!cli_parse_int(optarg, "--window", -1, 1000, &window)) return 1;
            break;
        case 'n':
            if (!cli_parse_int(optarg, "--max-tokens", 0, 1 << 20, &max_tokens)) return 1;
            break;
        case 't':
            if (!cli_parse_int(optarg, "--threads", 1, 1024, &threads)) return 1;
            break;
        case 'T':
            if (!cli_parse_float(optarg, "--temp", 0.0f, 100.0f, &temp)) return 1;
            break;
        case 'S': {
            int32_t s32;
            if (!cli_parse_int(optarg, "--seed", 0, INT32_MAX, &s32)) return 1;
            seed = (uint64_t)s32;
            break;
        }
        case 'M':
            if (!ask_mode_parse(optarg, &mode)) {
                fprintf(stderr, "error: --mode must be kv, prompt or off, got '%s'\n", optarg);
                return 1;
            }
            break;
        case 'd':
            if (!cli_parse_kv_dtype(optarg, &dtype)) return 1;
            break;
        case 'D': data = optarg; break;
        case 'E': emb_dir = optarg; break;
        case 'G':
            if (!cli_parse_retrieval(optarg, &gpu_retrieval)) return 1;
            break;
        case 'R':
            if (!cli_parse_int(optarg, "--recompute", 0, 100000, &recompute)) return 1;
            break;
        case 'B':
            if (!cli_parse_float(optarg, "--blend", 0.0f, 1.0f, &blend)) return 1;
            break;
        case 'h': ask_usage(stdout); return 0;
        default: ask_usage(stderr); return 1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see 'inferscale ask --help')\n",
                argv[optind]);
        return 1;
    }
    if ((!facts_path == !locomo) || !query) {
        fprintf(stderr, "error: ask needs --query TEXT and one of --facts FILE or --locomo FILE "
                        "(see 'inferscale ask --help')\n");
        return 1;
    }
    if (!*query) {
        fprintf(stderr, "error: --query must not be empty\n");
        return 1;
    }
    fact_line *facts = NULL;
    int32_t n_facts = 0;
    if (facts_path ? facts_load(facts_path, &facts, &n_facts)
                   : facts_from_locomo(locomo, &facts, &n_facts))
        return 1;

    int rc = 1;
    stack *sk = NULL;
    ask_ctx *ac = NULL;
    embedder *emb = NULL;
    mem_index *ix = NULL;
    dense_gpu *gpu = NULL;
    float *vecs = NULL;
    mem_hit *hits = NULL;
    const char **ids = NULL, **texts = NULL;
    char kvdir[4096], ename[256];
    is_status st;

    /* The model's half of the stack over DIR/kv; the facts are indexed here. */
    snprintf(kvdir, sizeof kvdir, "%s/kv", data);
    stack_records_params sp = {.model_path = model_path,
                               .backend = "cpu",
                               .n_threads = threads,
                               .records_dir = kvdir,
                               .cache_bytes = (size_t)256 << 20,
                               .dtype = dtype};
    if ((st = stack_open_records(&sp, &sk)) != IS_OK) goto fail;
    ac = sk->ask;

    /* Encode what the store lacks. */
    int32_t encoded = 0;
    double te0 = now_ms();
    for (int32_t i = 0; i < n_facts; i++) {
        ask_fact af = {facts[i].id, facts[i].text, (const char *const *)facts[i].context,
                       facts[i].n_context};
        bool did;
        if ((st = ask_encode_fact(ac, &af, window, &did)) != IS_OK) goto fail;
        encoded += did;
        cli_progress("encoding facts", i + 1, n_facts, te0);
    }
    if (encoded)
        fprintf(stderr, "encoded %d facts (w=%d) in %.1f s; %d already stored\n", encoded, window,
                (now_ms() - te0) / 1e3, n_facts - encoded);

    /* Index the facts; embeddings only when the embedding model is installed. */
    if ((st = stack_embedder_open(emb_dir, true, threads, &emb, ename, sizeof ename)) != IS_OK)
        goto fail;
    if (gpu_retrieval && !emb) {
        fprintf(stderr, "error: --retrieval cuda needs the embedding model (--embedder DIR)\n");
        goto out;
    }
    int32_t dim = emb ? embedder_dim(emb) : 1;
    if ((st = mem_index_create(dim, &ix)) != IS_OK) goto fail;
    vecs = calloc((size_t)(n_facts + 1) * dim, sizeof(float));
    if (emb) {
        const char **all = malloc((size_t)n_facts * sizeof *all);
        for (int32_t i = 0; i < n_facts; i++) all[i] = facts[i].text;
        /* In batches, to show progress: a conversation's facts take a while on a few cores. */
        double tb0 = now_ms();
        st = IS_OK;
        for (int32_t i = 0; i < n_facts && st == IS_OK; i += 64) {
            int32_t nb = n_facts - i < 64 ? n_facts - i : 64;
            st = embedder_embed(emb, all + i, nb, vecs + (size_t)i * dim);
            cli_progress("embedding facts", i + nb, n_facts, tb0);
        }
        free(all);
        if (st != IS_OK) goto fail;
    } else {
        for (int32_t i = 0; i < n_facts; i++) vecs[i] = 1.0f; /* BM25 ranks; dense unused */
    }
    for (int32_t i = 0; i < n_facts; i++) {
        mem_doc d = {.id = facts[i].id,
                     .tenant = "local",
                     .user = "local",
                     .text = facts[i].text,
                     .embedding = vecs + (size_t)i * dim};
        if ((st = mem_index_upsert(ix, &d)) != IS_OK) goto fail;
    }
    if (gpu_retrieval) {
        if ((st = dense_gpu_create(emb, 0, &gpu)) != IS_OK) goto fail;
        for (int32_t i = 0; i < n_facts; i++)
            if ((st = dense_gpu_stage(gpu, "local", "local", facts[i].id,
                                      vecs + (size_t)i * dim)) != IS_OK)
                goto fail;
        if ((st = dense_gpu_flush(gpu)) != IS_OK) goto fail;
    }

    /* Retrieval: the first part of time-to-first-token. */
    int32_t kk = k < n_facts ? k : n_facts;
    hits = calloc((size_t)(kk ? kk : 1), sizeof *hits);
    int32_t n_hits = 0;
    mem_filter flt = {.tenant = "local", .user = "local"};
    bool on_gpu = false;
    /* The first GPU search loads each kernel's module (lazy loading) and
     * warms cuBLAS up, a cost a server pays once: searched once untimed. */
    if (gpu && mode != ASK_MODE_OFF && kk > 0 &&
        (st = dense_gpu_search(gpu, ix, &flt, query, kk, MEM_SEARCH_HYBRID, hits, &n_hits,
                               &on_gpu)) != IS_OK)
        goto fail;
    double t0 = now_ms();
    if (gpu && mode != ASK_MODE_OFF && kk > 0 &&
        (st = dense_gpu_search(gpu, ix, &flt, query, kk, MEM_SEARCH_HYBRID, hits, &n_hits,
                               &on_gpu)) != IS_OK)
        goto fail;
    if (!on_gpu && mode != ASK_MODE_OFF && kk > 0) {
        float *qv = vecs + (size_t)n_facts * dim;
        if (emb && (st = embedder_embed(emb, &query, 1, qv)) != IS_OK) goto fail;
        st = mem_index_search(ix, &flt, emb ? qv : NULL, query, kk,
                              emb ? MEM_SEARCH_HYBRID : MEM_SEARCH_BM25, hits, &n_hits);
        if (st != IS_OK) goto fail;
    }
    double retrieval_ms = now_ms() - t0;
    ids = malloc((size_t)(n_hits + 1) * sizeof *ids);
    texts = malloc((size_t)(n_hits + 1) * sizeof *texts);
    for (int32_t i = 0; i < n_hits; i++) {
        ids[i] = hits[i].id;
        for (int32_t j = 0; j < n_facts; j++)
            if (strcmp(facts[j].id, hits[i].id) == 0) texts[i] = facts[j].text;
    }
    ask_request req = {.mode = mode,
                       .query = query,
                       .fact_ids = ids,
                       .fact_texts = texts,
                       .n_facts = n_hits,
                       .max_tokens = max_tokens,
                       .temperature = temp,
                       .top_k = 40,
                       .top_p = 0.95f,
                       .seed = seed,
                       .recompute = recompute,
                       .blend = blend};
    ask_timing tm;
    if ((st = ask_run(ac, &req, print_piece, NULL, &tm)) != IS_OK) goto fail;
    printf("\n");
    fprintf(stderr,
            "\nmode %s, %d facts (%d memory tokens), %s retrieval\n"
            "TTFT %.1f ms = retrieval %.1f + fetch %.1f + injection %.1f + prefill %.1f "
            "(%d tokens) + sampling\n"
            "decode: %d tokens in %.1f ms\n",
            ask_mode_name(mode), n_hits, tm.n_memory_tokens,
            !emb     ? "bm25"
            : on_gpu ? "hybrid (dense on the GPU, after one warm-up search)"
                     : "hybrid",
            retrieval_ms + tm.ttft_ms, retrieval_ms, tm.fetch_ms, tm.inject_ms, tm.prefill_ms,
            tm.n_prefilled, tm.n_generated, tm.decode_ms);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "error: %s\n", is_error_last());
out:
    free(ids);
    free(texts);
    free(hits);
    free(vecs);
    dense_gpu_free(gpu);
    mem_index_free(ix);
    embedder_free(emb);
    stack_close(sk);
    facts_free(facts, n_facts);
    return rc;
}

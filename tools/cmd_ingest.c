/*
 * inferscale ingest: facts into a data directory's memory (memory/memory.h).
 *
 *   inferscale ingest locomo FILE... --data DIR [--tenant T] [--window W] [--model M | --no-kv]
 *   inferscale ingest facts FILE.jsonl --user U --data DIR [--tenant T] [--agent A] [--run R] ...
 *
 * locomo: each session's observations become the speaker's facts (user: the
 * speaker lowercased, or "<conversation>-<speaker>" with --user-by
 * conversation, the default for several files), each tied to its evidence turn (source
 * "locomo:<conversation>:<dia_id>") and encoded with the W turns before it.
 * facts: one JSON object per line, {"text": ..., "context": [turns],
 * "metadata": {...}, "source": ..., "agent_id": ..., "run_id": ...} (text
 * required); the source defaults to "<file name>:<line>".
 *
 * Each fact is embedded and committed on its own, so an interrupted run
 * keeps what it did, and a re-run skips facts already present (same user,
 * source and text) and continues; then the KV of the facts stored is
 * encoded (unless --no-kv), 64 facts a forward with one group commit of
 * their records (serve/encoder.h). Facts stored earlier without KV (or
 * whose record was lost) are encoded first when a model is given. Progress with rate and ETA (a bar on
 * a terminal, a line every few seconds otherwise); a summary at the end.
 */
#include "cli.h"

#include "core/status.h"
#include "serve/encoder.h"
#include "serve/stack.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Facts encoded in one forward (each its own sequence). */
#define INGEST_ENCODE_BATCH 64

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void ingest_usage(FILE *f) {
    fprintf(
        f,
        "usage: inferscale ingest locomo FILE... --data DIR [options]\n"
        "       inferscale ingest facts FILE.jsonl --user U --data DIR [options]\n\n"
        "Adds facts to the memory in DIR (created if missing): text, embedding, index entry\n"
        "and KV record, each fact atomically. Re-running skips facts already present.\n\n"
        "      --data DIR       data directory (memory.db and kv/)\n"
        "      --tenant T       tenant (default 'default', the tenant of 'serve --no-auth')\n"
        "  -w, --window W       context turns encoded with each fact (default 0; -1: none,\n"
        "                       not even the serving prefix)\n"
        "  -m, --model PATH     GGUF model that encodes the KV (default: $INFERSCALE_MODEL or\n"
        "                       %s)\n"
        "      --no-kv          store facts without KV records (encode them later)\n"
        "      --kv-dtype T     f16 | bf16 | f32 | fp8 (default f16, what `serve` reads by "
        "default)\n"
        "      --embedder DIR   sentence-embedding model (default %s; 'none': BM25 only)\n"
        "  -t, --threads N      CPU threads (default: all cores)\n"
        "locomo:\n"
        "      --user-by M      speaker (user '<speaker>', e.g. 'caroline') | conversation (user\n"
        "                       '<conv>-<speaker>'); default: speaker for one file, conversation\n"
        "                       for several (speakers of different conversations stay apart)\n"
        "facts:\n"
        "      --user U         the user the facts belong to (required)\n"
        "      --agent A        agent_id of every fact\n"
        "      --run R          run_id of every fact\n"
        "  -h, --help           this help\n",
        CLI_DEFAULT_MODEL, STACK_DEFAULT_EMBEDDER);
}

typedef struct progress_ctx {
    const char *what;
    double t0;
} progress_ctx;

static void on_progress(int64_t done, int64_t total, void *ud) {
    progress_ctx *p = ud;
    cli_progress(p->what, done, total, p->t0);
}

/* ---- facts files ---------------------------------------------------------------- */

typedef struct ingest_opts {
    const char *tenant, *user, *agent, *run;
    int32_t window;
} ingest_opts;

/* Imports one JSON-lines file; counts into *st. Returns 0, or 1 when the
 * file cannot be read (bad lines are counted as failed and reported). */
static int ingest_jsonl(memory *mem, const char *path, const ingest_opts *o,
                        memory_import_stats *st) {
    FILE *fp = fopen(path, "r");
    if (!fp) {
        fprintf(stderr, "error: cannot open '%s': %s\n", path, strerror(errno));
        return 1;
    }
    /* Count lines first, for the progress bar. */
    int64_t total = 0;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, fp) >= 0) total++;
    rewind(fp);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    progress_ctx pc = {base, now_ms()};
    int64_t lineno = 0;
    while (getline(&line, &cap, fp) >= 0) {
        lineno++;
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == '\n' || *p == '\r' || *p == '\0' || *p == '#') {
            cli_progress(pc.what, lineno, total, pc.t0);
            continue;
        }
        cJSON *j = cJSON_Parse(p);
        const char *text = cJSON_GetStringValue(cJSON_GetObjectItem(j, "text"));
        if (!cJSON_IsObject(j) || !text) {
            if (!st->first_error[0])
                snprintf(st->first_error, sizeof st->first_error,
                         "%s:%lld: expected a JSON object with a string \"text\"", path,
                         (long long)lineno);
            st->failed++;
            cJSON_Delete(j);
            cli_progress(pc.what, lineno, total, pc.t0);
            continue;
        }
        char src_buf[512];
        const char *source = cJSON_GetStringValue(cJSON_GetObjectItem(j, "source"));
        if (!source) {
            snprintf(src_buf, sizeof src_buf, "%s:%lld", base, (long long)lineno);
            source = src_buf;
        }
        const char *agent = cJSON_GetStringValue(cJSON_GetObjectItem(j, "agent_id"));
        const char *run = cJSON_GetStringValue(cJSON_GetObjectItem(j, "run_id"));
        char *meta = NULL;
        const cJSON *mj = cJSON_GetObjectItem(j, "metadata");
        if (mj) meta = cJSON_PrintUnformatted(mj);
        const cJSON *ctx = cJSON_GetObjectItem(j, "context"), *turn;
        int32_t n_ctx = 0;
        const char **turns = calloc((size_t)cJSON_GetArraySize(ctx) + 1, sizeof *turns);
        cJSON_ArrayForEach(turn, ctx) {
            if (cJSON_IsString(turn)) turns[n_ctx++] = turn->valuestring;
        }
        is_status s = memory_find_source(mem, o->tenant, o->user, source, text, NULL);
        if (s == IS_OK) {
            st->skipped++;
        } else {
            memory_add_req r = {.tenant = o->tenant,
                                .user = o->user,
                                .agent_id = agent ? agent : o->agent,
                                .run_id = run ? run : o->run,
                                .text = text,
                                .metadata_json = meta,
                                .source = source,
                                .context = turns,
                                .n_context = n_ctx,
                                .window = o->window};
            s = memory_add(mem, &r, NULL);
            if (s == IS_OK) {
                st->added++;
            } else {
                if (!st->first_error[0])
                    snprintf(st->first_error, sizeof st->first_error, "%.250s:%lld: %.200s", path,
                             (long long)lineno, is_error_last());
                st->failed++;
            }
        }
        free(turns);
        free(meta);
        cJSON_Delete(j);
        cli_progress(pc.what, lineno, total, pc.t0);
    }
    free(line);
    fclose(fp);
    return 0;
}

/* ---- main --------------------------------------------------------------------------- */

int cmd_ingest(int argc, char **argv) {
    static const struct option longopts[] = {
        {"data", required_argument, 0, 'D'},     {"tenant", required_argument, 0, 'T'},
        {"window", required_argument, 0, 'w'},   {"model", required_argument, 0, 'm'},
        {"no-kv", no_argument, 0, 'N'},          {"kv-dtype", required_argument, 0, 'd'},
        {"embedder", required_argument, 0, 'E'}, {"threads", required_argument, 0, 't'},
        {"user-by", required_argument, 0, 'B'},  {"user", required_argument, 0, 'U'},
        {"agent", required_argument, 0, 'A'},    {"run", required_argument, 0, 'R'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0},
    };
    const char *data = NULL, *model_path = cli_default_model(), *emb_dir = NULL;
    ingest_opts o = {.tenant = "default"};
    bool no_kv = false, by_speaker = false, by_set = false;
    int32_t threads = 0;
    kv_dtype dtype = KV_DTYPE_F16;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "w:m:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'D': data = optarg; break;
        case 'T': o.tenant = optarg; break;
        case 'w':
            if (!cli_parse_int(optarg, "--window", -1, MEMORY_MAX_CONTEXT, &o.window)) return 1;
            break;
        case 'm': model_path = optarg; break;
        case 'N': no_kv = true; break;
        case 'E': emb_dir = optarg; break;
        case 't':
            if (!cli_parse_int(optarg, "--threads", 1, 1024, &threads)) return 1;
            break;
        case 'U': o.user = optarg; break;
        case 'A': o.agent = optarg; break;
        case 'R': o.run = optarg; break;
        case 'B':
            by_set = true;
            if (strcmp(optarg, "speaker") == 0) by_speaker = true;
            else if (strcmp(optarg, "conversation") == 0) by_speaker = false;
            else {
                fprintf(stderr, "error: --user-by must be conversation or speaker, got '%s'\n",
                        optarg);
                return 1;
            }
            break;
        case 'd':
            if (!cli_parse_kv_dtype(optarg, &dtype)) return 1;
            break;
        case 'h': ingest_usage(stdout); return 0;
        default: ingest_usage(stderr); return 1;
        }
    }
    const char *kind = optind < argc ? argv[optind++] : NULL;
    bool locomo = kind && strcmp(kind, "locomo") == 0, facts = kind && strcmp(kind, "facts") == 0;
    if (!locomo && !facts) {
        fprintf(stderr,
                "error: ingest needs 'locomo' or 'facts' (see 'inferscale ingest --help')\n");
        return 1;
    }
    if (optind >= argc || !data) {
        fprintf(stderr, "error: ingest %s needs at least one FILE and --data DIR\n", kind);
        return 1;
    }
    if (facts && (!o.user || !*o.user)) {
        fprintf(stderr, "error: ingest facts needs --user U\n");
        return 1;
    }
    if (!*o.tenant) {
        fprintf(stderr, "error: --tenant must not be empty\n");
        return 1;
    }

    int rc = 1;
    stack *sk = NULL;
    memory *mem = NULL;
    is_status st;
    double t0 = now_ms();

    stack_params sp = stack_default_params();
    sp.data_dir = data;
    sp.embedder_dir = emb_dir;
    sp.model_path = no_kv ? NULL : model_path;
    sp.n_threads = threads;
    sp.dtype = dtype;
    sp.window = o.window;
    sp.encode_batch = INGEST_ENCODE_BATCH; /* adds store; the KV is encoded after, in batches */
    if ((st = stack_open(&sp, &sk)) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    mem = sk->mem;
    const memory_open_report rep = sk->report;
    if (rep.n_orphans)
        fprintf(stderr, "set aside %lld KV records no fact points to in %s/kv/orphans/\n",
                (long long)rep.n_orphans, data);
    if (rep.repairs[0]) fprintf(stderr, "warning: %s (inferscale fsck lists them)\n", rep.repairs);
    if (no_kv && rep.n_missing_kv > 0) {
        fprintf(stderr,
                "note: %lld facts have no KV record yet (run ingest with a model to encode "
                "them)\n",
                (long long)rep.n_missing_kv);
    }

    if (locomo && !by_set) by_speaker = argc - optind == 1;
    if (locomo)
        fprintf(stderr, "users: %s, tenant '%s'\n",
                by_speaker ? "one per speaker ('caroline')"
                           : "one per conversation and speaker ('26-caroline')",
                o.tenant);
    memory_import_stats total = {0};
    for (int i = optind; i < argc; i++) {
        memory_import_stats fs = {0};
        if (locomo) {
            locomo_conv *conv = NULL;
            if (locomo_load(argv[i], &conv) != IS_OK) {
                fprintf(stderr, "error: %s\n", is_error_last());
                goto out;
            }
            char what[300];
            snprintf(what, sizeof what, "locomo %s", conv->name);
            progress_ctx pc = {what, now_ms()};
            memory_locomo_opts lo = {.tenant = o.tenant,
                                     .user_by_speaker = by_speaker,
                                     .window = o.window,
                                     .progress = on_progress,
                                     .progress_user_data = &pc};
            st = memory_import_locomo(mem, conv, &lo, &fs);
            locomo_free(conv);
            if (st != IS_OK) goto fail;
        } else if (ingest_jsonl(mem, argv[i], &o, &fs) != 0) {
            goto out;
        }
        fprintf(stderr, "%s: %lld added, %lld skipped, %lld failed\n", argv[i], (long long)fs.added,
                (long long)fs.skipped, (long long)fs.failed);
        if (fs.failed) fprintf(stderr, "  first failure: %s\n", fs.first_error);
        total.added += fs.added;
        total.skipped += fs.skipped;
        total.failed += fs.failed;
    }
    if (sk->ask) {
        /* The facts were stored with their embeddings; their KV now, many
         * facts a forward (serve/encoder.h): the ones just added, those an
         * earlier run left without KV, and those whose records were made
         * for another model or dtype. A fact whose encoding fails stays
         * without KV, encoded by the next run. */
        progress_ctx pc = {"encoding KV", now_ms()};
        int64_t n_enc = 0;
        encoder_params enp = {sk->ask, 0};
        st = encoder_encode_missing(mem, &enp, INGEST_ENCODE_BATCH, on_progress, &pc, &n_enc);
        if (n_enc > 0 || st != IS_OK)
            fprintf(stderr, "encoded the %s KV of %lld facts\n", kv_dtype_name(dtype),
                    (long long)n_enc);
        if (st != IS_OK) goto fail;
    }
    double secs = (now_ms() - t0) / 1e3;
    printf("ingest: %lld added, %lld skipped (already present), %lld failed in %.1f s "
           "(%.1f facts/s); %lld facts in %s; KV %s\n",
           (long long)total.added, (long long)total.skipped, (long long)total.failed, secs,
           secs > 0 ? total.added / secs : 0.0, (long long)mem_store_count(memory_fact_store(mem)),
           data, no_kv ? "not encoded (--no-kv)" : kv_dtype_name(dtype));
    rc = total.failed ? 2 : 0;
    goto out;
fail:
    fprintf(stderr, "error: %s\n", is_error_last());
out:
    stack_close(sk);
    return rc;
}

/*
 * inferscale: the command-line program, a thin main over the public API.
 *
 *   inferscale generate -m MODEL -p TEXT [-n N] [--chat] [sampling options]
 *   inferscale chat     -m MODEL [sampling options]
 *
 * Errors print one line on stderr and exit non-zero.
 */
#include "inferscale.h"
#include "cli.h"
#include "gguf/verify.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct options {
    const char *model;
    const char *prompt;
    const char *system;
    int32_t n_predict;
    int32_t n_threads;
    int32_t n_ctx;
    bool chat;
    bool quiet_stats;
    is_gen_params gen;
    const char *stops[16];
} options;

static void usage(FILE *f, const char *cmd) {
    if (!cmd) {
        fprintf(
            f,
            "usage: inferscale <command> [options]\n\n"
            "commands:\n"
            "  generate   complete a prompt, printing tokens as they come\n"
            "  chat       interactive chat using the model's chat template\n"
            "  ask        answer a question with facts as memory (kv, prompt or off)\n"
            "  ingest     add facts to a memory (LoCoMo conversations, JSON lines)\n"
            "  eval       score memory modes on a benchmark (eval locomo)\n"
            "  serve      HTTP API: OpenAI-compatible chat with memory, Mem0-style memories\n"
            "  fsck       check a memory data directory; --repair repairs it, deleting nothing\n\n"
            "Every command takes --verify: model files (GGUF, the embedder's safetensors) are\n"
            "checked at load against their SHA-256 sidecar FILE.sha256 (sha256sum's format;\n"
            "make one with 'sha256sum FILE > FILE.sha256'); a missing or different one is an "
            "error.\n\n"
            "Run 'inferscale <command> --help' for a command's options.\n");
        return;
    }
    fprintf(f,
            "usage: inferscale %s [options]%s\n\n"
            "  -m, --model PATH     GGUF model (default: $INFERSCALE_MODEL or %s)\n"
            "%s"
            "  -n, --max-tokens N   tokens to generate at most (default 256)\n"
            "      --temp T         sampling temperature, 0 = greedy (default 0.8)\n"
            "      --top-k K        keep the K most likely tokens, 0 = off (default 40)\n"
            "      --top-p P        nucleus sampling mass, 1 = off (default 0.95)\n"
            "      --seed S         sampling seed (default: from the clock)\n"
            "      --stop TEXT      stop when TEXT appears (repeatable, up to 16)\n"
            "  -c, --ctx N          context length (default: the model's)\n"
            "  -t, --threads N      CPU threads (default: all cores)\n"
            "      --system TEXT    system message for chat templates\n"
            "  -h, --help           this help\n",
            cmd, strcmp(cmd, "generate") == 0 ? " -p TEXT" : "", CLI_DEFAULT_MODEL,
            strcmp(cmd, "generate") == 0
                ? "  -p, --prompt TEXT    the prompt\n"
                  "      --chat           wrap the prompt as a user turn in the chat template\n"
                  "      --no-stats       do not print speed figures at the end\n"
                : "");
}

/* Returns 0 on success, 1 on a usage error, 2 when --help was printed. */
static int parse_options(int argc, char **argv, const char *cmd, options *o) {
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt", required_argument, 0, 'p'},
        {"max-tokens", required_argument, 0, 'n'},
        {"temp", required_argument, 0, 'T'},
        {"top-k", required_argument, 0, 'K'},
        {"top-p", required_argument, 0, 'P'},
        {"seed", required_argument, 0, 'S'},
        {"stop", required_argument, 0, 'X'},
        {"ctx", required_argument, 0, 'c'},
        {"threads", required_argument, 0, 't'},
        {"chat", no_argument, 0, 'C'},
        {"system", required_argument, 0, 'Y'},
        {"no-stats", no_argument, 0, 'N'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    memset(o, 0, sizeof *o);
    o->model = cli_default_model();
    o->gen = is_gen_default_params();
    o->gen.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    o->gen.stop = o->stops;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:n:c:t:h", longopts, NULL)) != -1) {
        int32_t iv;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'n':
            if (!cli_parse_int(optarg, "--max-tokens", 0, 1 << 24, &o->gen.max_tokens)) return 1;
            break;
        case 'T':
            if (!cli_parse_float(optarg, "--temp", 0.0f, 100.0f, &o->gen.temperature)) return 1;
            break;
        case 'K':
            if (!cli_parse_int(optarg, "--top-k", 0, 1 << 24, &o->gen.top_k)) return 1;
            break;
        case 'P':
            if (!cli_parse_float(optarg, "--top-p", 1e-6f, 1.0f, &o->gen.top_p)) return 1;
            break;
        case 'S': {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(optarg, &end, 10);
            if (errno || *end || end == optarg) {
                fprintf(stderr, "error: --seed must be a non-negative integer, got '%s'\n", optarg);
                return 1;
            }
            o->gen.seed = v;
            break;
        }
        case 'X':
            if (o->gen.n_stop >= 16) {
                fprintf(stderr, "error: at most 16 --stop strings\n");
                return 1;
            }
            if (!*optarg) {
                fprintf(stderr, "error: --stop needs a non-empty string\n");
                return 1;
            }
            o->stops[o->gen.n_stop++] = optarg;
            break;
        case 'c':
            if (!cli_parse_int(optarg, "--ctx", 1, 1 << 24, &iv)) return 1;
            o->n_ctx = iv;
            break;
        case 't':
            if (!cli_parse_int(optarg, "--threads", 1, 1024, &iv)) return 1;
            o->n_threads = iv;
            break;
        case 'C': o->chat = true; break;
        case 'Y': o->system = optarg; break;
        case 'N': o->quiet_stats = true; break;
        case 'h': usage(stdout, cmd); return 2;
        default: usage(stderr, cmd); return 1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see 'inferscale %s --help')\n",
                argv[optind], cmd);
        return 1;
    }
    return 0;
}

static bool print_text(const char *text, size_t len, void *ud) {
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return true;
}

static is_model *load_model(const options *o) {
    is_model_params mp = is_model_default_params();
    mp.n_threads = o->n_threads;
    is_model *m = NULL;
    is_status st = is_model_load(o->model, mp, &m);
    if (st != IS_OK) {
        fprintf(stderr, "error: cannot load model '%s': %s\n", o->model, is_error_last());
        return NULL;
    }
    return m;
}

static int cmd_generate(int argc, char **argv) {
    options o;
    int r = parse_options(argc, argv, "generate", &o);
    if (r) return r == 2 ? 0 : 1;
    if (!o.prompt) {
        fprintf(stderr, "error: generate needs a prompt (-p TEXT)\n");
        return 1;
    }
    is_model *m = load_model(&o);
    if (!m) return 1;
    int rc = 1;
    char *text = NULL;
    int32_t *toks = NULL;
    size_t n = 0;
    is_session *s = NULL;
    is_status st;
    if (o.chat) {
        is_chat_message msgs[2];
        size_t nm = 0;
        if (o.system) msgs[nm++] = (is_chat_message){"system", o.system};
        msgs[nm++] = (is_chat_message){"user", o.prompt};
        if ((st = is_chat_render(m, msgs, nm, true, &text)) != IS_OK) goto done;
    }
    const char *prompt = o.chat ? text : o.prompt;
    if ((st = is_tokenize(m, prompt, strlen(prompt), !o.chat, o.chat, &toks, &n)) != IS_OK)
        goto done;
    is_session_params sp = is_session_default_params();
    sp.n_ctx = o.n_ctx;
    if ((st = is_session_create(m, sp, &s)) != IS_OK) goto done;
    int32_t n_ctx = o.n_ctx > 0 ? o.n_ctx : is_model_n_ctx_train(m);
    if ((int64_t)n > n_ctx) {
        fprintf(stderr, "error: prompt of %zu tokens is longer than the context of %d\n", n, n_ctx);
        goto done_quiet;
    }
    if (!o.chat) print_text(o.prompt, strlen(o.prompt), NULL);
    is_gen_stats stats;
    if ((st = is_session_generate(s, toks, n, o.gen, print_text, NULL, &stats)) != IS_OK) goto done;
    printf("\n");
    if (!o.quiet_stats)
        fprintf(stderr,
                "\nprefill: %d tokens in %.1f ms (%.1f tok/s); decode: %d tokens in %.1f ms "
                "(%.1f tok/s)\n",
                stats.n_prompt, stats.prefill_ms, stats.n_prompt * 1e3 / stats.prefill_ms,
                stats.n_generated, stats.decode_ms,
                stats.decode_ms > 0 ? stats.n_generated * 1e3 / stats.decode_ms : 0.0);
    rc = 0;
done:
    if (rc) fprintf(stderr, "error: %s\n", is_error_last());
done_quiet:
    is_session_free(s);
    free(toks);
    free(text);
    is_model_free(m);
    return rc;
}

/* Reads one line from stdin (without the newline); NULL at end of input. */
static char *read_line(void) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
        free(line);
        return NULL;
    }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    return line;
}

typedef struct reply_buf {
    char *buf;
    size_t len;
} reply_buf;

/* Prints and keeps the assistant's reply. */
static bool collect(const char *t, size_t l, void *ud) {
    reply_buf *r = ud;
    char *nb = realloc(r->buf, r->len + l + 1);
    if (!nb) return false;
    memcpy(nb + r->len, t, l);
    r->len += l;
    nb[r->len] = '\0';
    r->buf = nb;
    fwrite(t, 1, l, stdout);
    fflush(stdout);
    return true;
}

static int cmd_chat(int argc, char **argv) {
    options o;
    int r = parse_options(argc, argv, "chat", &o);
    if (r) return r == 2 ? 0 : 1;
    is_model *m = load_model(&o);
    if (!m) return 1;
    is_session *s = NULL;
    is_session_params sp = is_session_default_params();
    sp.n_ctx = o.n_ctx;
    if (is_session_create(m, sp, &s) != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        is_model_free(m);
        return 1;
    }
    size_t cap = 64, n = 0;
    is_chat_message *msgs = malloc(cap * sizeof *msgs);
    char **owned = malloc(cap * sizeof *owned); /* strings to free */
    if (o.system) {
        msgs[n] = (is_chat_message){"system", o.system};
        owned[n++] = NULL;
    }
    bool tty = isatty(0);
    fprintf(stderr, "chatting with %s (%s). Empty line or Ctrl-D to quit, /reset to forget.\n",
            o.model, is_model_arch(m));
    int rc = 0;
    for (;;) {
        if (tty) fprintf(stderr, "\n> ");
        char *line = read_line();
        if (!line || !*line) {
            free(line);
            break;
        }
        if (strcmp(line, "/reset") == 0) {
            for (size_t i = 0; i < n; i++) free(owned[i]);
            n = 0;
            if (o.system) {
                msgs[n] = (is_chat_message){"system", o.system};
                owned[n++] = NULL;
            }
            free(line);
            continue;
        }
        if (n + 2 > cap) {
            cap *= 2;
            msgs = realloc(msgs, cap * sizeof *msgs);
            owned = realloc(owned, cap * sizeof *owned);
        }
        msgs[n] = (is_chat_message){"user", line};
        owned[n++] = line;
        char *text = NULL;
        int32_t *toks = NULL;
        size_t nt = 0;
        is_status st = is_chat_render(m, msgs, n, true, &text);
        if (st == IS_OK) st = is_tokenize(m, text, strlen(text), false, true, &toks, &nt);
        free(text);
        /* Collect the reply to keep it in the conversation. */
        reply_buf rep = {0};
        is_gen_stats stats;
        if (st == IS_OK) st = is_session_generate(s, toks, nt, o.gen, collect, &rep, &stats);
        free(toks);
        if (st != IS_OK) {
            fprintf(stderr, "\nerror: %s\n", is_error_last());
            free(rep.buf);
            free(owned[--n]); /* drop the user turn that failed */
            if (st == IS_ERR_CONTEXT_FULL) {
                fprintf(stderr, "the conversation no longer fits the context; use /reset\n");
                continue;
            }
            rc = 1;
            break;
        }
        printf("\n");
        msgs[n] = (is_chat_message){"assistant", rep.buf ? rep.buf : ""};
        owned[n++] = rep.buf;
        if (!o.quiet_stats)
            fprintf(stderr, "[%d prompt tokens (%d reused), %.1f ms; %d tokens, %.1f tok/s]\n",
                    stats.n_prompt, stats.n_prompt_reused, stats.prefill_ms, stats.n_generated,
                    stats.decode_ms > 0 ? stats.n_generated * 1e3 / stats.decode_ms : 0.0);
    }
    for (size_t i = 0; i < n; i++) free(owned[i]);
    free(owned);
    free(msgs);
    is_session_free(s);
    is_model_free(m);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout, NULL);
        return argc < 2 ? 1 : 0;
    }
    /* --verify applies to every command: it is taken out wherever it stands
     * and switched on before any model file is opened. */
    int kept = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--verify") == 0) verify_set_enabled(true);
        else argv[kept++] = argv[i];
    }
    argc = kept;
    argv[argc] = NULL;
    if (argc < 2) {
        usage(stderr, NULL);
        return 1;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "generate") == 0) return cmd_generate(argc - 1, argv + 1);
    if (strcmp(cmd, "chat") == 0) return cmd_chat(argc - 1, argv + 1);
    if (strcmp(cmd, "ask") == 0) return cmd_ask(argc - 1, argv + 1);
    if (strcmp(cmd, "ingest") == 0) return cmd_ingest(argc - 1, argv + 1);
    if (strcmp(cmd, "eval") == 0) return cmd_eval(argc - 1, argv + 1);
    if (strcmp(cmd, "serve") == 0) return cmd_serve(argc - 1, argv + 1);
    if (strcmp(cmd, "fsck") == 0) return cmd_fsck(argc - 1, argv + 1);
    fprintf(stderr, "error: unknown command '%s' (see 'inferscale --help')\n", cmd);
    return 1;
}

/*
 * inferscale fsck: checks a memory data directory and, with --repair,
 * repairs it without destroying anything (memory/fsck.h says what can be
 * rebuilt). A thin main over memory_fsck.
 */
#include "cli.h"

#include "core/status.h"
#include "gguf/gguf.h"
#include "memory/embedder.h"
#include "memory/fsck.h"
#include "model/tokenizer.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define DEFAULT_EMBEDDER "models/all-MiniLM-L6-v2"

static void fsck_usage(FILE *f) {
    fprintf(f,
            "usage: inferscale fsck --data DIR [--repair] [options]\n\n"
            "Checks the memory in DIR: memory.db (SQLite's quick_check, tables, rows that cannot\n"
            "be served), the KV records in kv/ against the rows, and what earlier repairs set\n"
            "aside. Without --repair nothing is written. Exit status: 0 healthy (or repaired),\n"
            "1 error, 2 problems found (run again with --repair).\n\n"
            "--repair never deletes: missing tables are recreated; bad rows move to the table\n"
            "facts_quarantine; KV records no fact points to move to kv/orphans/. A store that is\n"
            "missing, empty or without facts beside KV records is rebuilt from the records: each\n"
            "fact's exact text (its tokens decoded by the model, checked against the record's\n"
            "text hash), id, version and window come back; owner (--tenant/--user), metadata,\n"
            "agent/run ids, context and history do not. The damaged file is kept beside it.\n\n"
            "      --data DIR       data directory (memory.db and kv/)\n"
            "      --repair         repair what can be repaired\n"
            "  -m, --model PATH     GGUF model whose tokenizer decodes records (default:\n"
            "                       $INFERSCALE_MODEL or %s)\n"
            "      --embedder DIR   sentence-embedding model, as serve uses it (default %s;\n"
            "                       'none': BM25 only)\n"
            "      --tenant T       tenant of facts rebuilt from records (default 'default')\n"
            "      --user U         user of facts rebuilt from records (default 'recovered')\n"
            "  -h, --help           this help\n",
            CLI_DEFAULT_MODEL, DEFAULT_EMBEDDER);
}

/* A record's fact tokens are those of "- <text>\n" (serve/memory_prompt.c's
 * fact layout): decode and strip the layout. */
static is_status text_of(void *ud, const int32_t *tokens, int32_t n, char **text) {
    char *s = NULL;
    size_t len = 0;
    is_status st = tokenizer_decode(ud, tokens, (size_t)n, false, &s, &len);
    if (st != IS_OK) return st;
    if (len != strlen(s) || len < 3 || strncmp(s, "- ", 2) != 0 || s[len - 1] != '\n') {
        free(s);
        return is_error_set(IS_ERR_FORMAT, "not a fact's layout");
    }
    s[len - 1] = '\0';
    memmove(s, s + 2, len - 2);
    *text = s;
    return IS_OK;
}

int cmd_fsck(int argc, char **argv) {
    static const struct option longopts[] = {
        {"data", required_argument, NULL, 'd'},   {"repair", no_argument, NULL, 'r'},
        {"model", required_argument, NULL, 'm'},  {"embedder", required_argument, NULL, 'e'},
        {"tenant", required_argument, NULL, 'T'}, {"user", required_argument, NULL, 'u'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0},
    };
    const char *data = NULL, *model_path = cli_default_model(), *edir = DEFAULT_EMBEDDER;
    memory_fsck_params p = {.tenant = "default", .user = "recovered"};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'd': data = optarg; break;
        case 'r': p.repair = true; break;
        case 'm': model_path = optarg; break;
        case 'e': edir = optarg; break;
        case 'T': p.tenant = optarg; break;
        case 'u': p.user = optarg; break;
        case 'h': fsck_usage(stdout); return 0;
        default: fsck_usage(stderr); return 1;
        }
    }
    if (!data || optind != argc) {
        fprintf(stderr, "error: %s\n", data ? "unexpected argument" : "--data DIR is required");
        fsck_usage(stderr);
        return 1;
    }
    gguf_ctx *g = NULL;
    tokenizer *tok = NULL;
    embedder *emb = NULL;
    char ename[256] = "none";
    struct stat sb;
    is_status st = IS_OK;
    if (p.repair) {
        /* Only a repair needs them; a missing model only rules out a rebuild. */
        if (stat(model_path, &sb) == 0 && (st = gguf_open(model_path, &g)) == IS_OK &&
            (st = tokenizer_load(g, &tok)) == IS_OK) {
            p.text_of = text_of;
            p.text_user_data = tok;
        }
        if (st == IS_OK && strcmp(edir, "none") != 0) {
            if ((st = embedder_load(edir, &emb)) == IS_OK) {
                size_t l = strlen(edir);
                while (l > 1 && edir[l - 1] == '/') l--;
                size_t b = l;
                while (b > 0 && edir[b - 1] != '/') b--;
                snprintf(ename, sizeof ename, "%.*s", (int)(l - b), edir + b);
            }
        }
        p.embedder = emb;
        p.embed_name = ename;
    }
    memory_fsck_report r;
    if (st == IS_OK) st = memory_fsck(data, &p, &r, stdout);
    embedder_free(emb);
    tokenizer_free(tok);
    gguf_close(g);
    if (st != IS_OK) {
        fprintf(stderr, "error: %s\n", is_error_last());
        return 1;
    }
    if (!r.problems) printf("fsck: no problems found\n");
    return r.problems && !p.repair ? 2 : 0;
}

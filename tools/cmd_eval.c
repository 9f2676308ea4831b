/*
 * inferscale eval locomo: answer LoCoMo's questions with retrieved memory
 * in several modes and score the answers as LoCoMo does.
 *
 *   inferscale eval locomo [--data-dir DIR] [--conv 26,30,...] [--k 20]
 *                          [--modes prompt,kv0,kv20] [--skip N] [--limit N] [--out FILE.csv]
 *
 * For each conversation: its observations become the facts of one user
 * (both speakers' facts, since questions do not say whose memory to
 * search), embedded and indexed; each question retrieves k facts (hybrid
 * dense + BM25), whose evidence turns give recall@k; the retrieved facts'
 * KV records are encoded for each kv window that is asked for (kvW: W
 * context turns; records persist in --store, so a rerun encodes nothing);
 * then every mode answers greedily from the same k facts. Answers are
 * scored with src/eval/locomo_eval.h (LoCoMo's F1 / exact match), and kv
 * and off answers are compared with the prompt-mode answer.
 *
 * Writes one CSV row per (question, mode) and prints a markdown table by
 * category (also written next to the CSV as FILE.md).
 */
#include "cli.h"

#include "core/status.h"
#include "eval/locomo_eval.h"
#include "eval/nll_report.h"
#include "eval/nll_stats.h"
#include "eval/teacher.h"
#include "kv/fact_record.h"
#include "memory/embedder.h"
#include "memory/index.h"
#include "memory/locomo.h"
#include "serve/ask.h"
#include "serve/stack.h"

#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EVAL_DEFAULT_DATA     "../shared/data/locomo"
#define EVAL_DEFAULT_EMBEDDER STACK_DEFAULT_EMBEDDER
#define EVAL_DEFAULT_STORE    "inferscale-data/locomo-eval"
#define EVAL_INSTRUCTION      " Answer in a few words."
#define EVAL_MAX_MODES        14
#define EVAL_MAX_CONVS        64

typedef struct eval_mode {
    ask_mode mode;
    int32_t window; /* kv modes: encoding context turns */
    char name[24];
    float temp, mass;  /* kv modes: engine_set_memory_scale (1, 1: plain attention) */
    int32_t recompute; /* kv modes: first tokens of each fact recomputed */
    float blend;       /* kv modes: CacheBlend share of the memory recomputed (0: none) */
} eval_mode;

typedef struct eval_opts {
    const char *data_dir, *model, *embedder, *store, *out, *instruction, *backend;
    const char *save_retrieval, *load_retrieval;
    char *convs[EVAL_MAX_CONVS];
    int32_t n_convs;
    eval_mode modes[EVAL_MAX_MODES];
    int32_t n_modes;
    int32_t k, skip, limit, max_tokens, threads;
    bool retrieve_only;
    bool nll, no_generate; /* teacher-forced instrument; skip generated answers */
    bool no_dates;         /* facts shown without their session date */
    int32_t n_boot;
    kv_dtype dtype;
} eval_opts;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void eval_usage(FILE *f) {
    fprintf(
        f,
        "usage: inferscale eval locomo [options]\n\n"
        "Answers LoCoMo's questions with k retrieved facts in each mode and reports LoCoMo's\n"
        "F1 and exact match, recall@k of the evidence turns, kv-vs-prompt agreement and TTFT\n"
        "by category (1-4; 5, adversarial, separately).\n\n"
        "      --data-dir DIR   LoCoMo conversations, one JSON file each (default %s)\n"
        "      --conv LIST      conversations by name, e.g. 26,30 (default: all in DIR)\n"
        "  -k, --k N            facts retrieved per question (default 20)\n"
        "      --modes LIST     of prompt, off, kvW (W context turns encoded with each fact,\n"
        "                       -1: no context at all) (default prompt,kv0,kv20); a kv mode\n"
        "                       may add tT and/or sS (e.g. kv0t0.8s2): the query's logits\n"
        "                       over the injected facts divided by T, their softmax mass\n"
        "                       multiplied by S (memory scaling; records shared with kvW);\n"
        "                       and rM: the first M tokens of every fact recomputed after\n"
        "                       injection with the facts before them visible, e.g. kv0r4,\n"
        "                       kv0t0.85r2; or bR: CacheBlend, the share R (0 < R <= 1) of\n"
        "                       the memory's tokens whose second-layer K/V deviate most\n"
        "                       recomputed, e.g. kv0b0.15\n"
        "      --limit N        only the first N questions of each conversation (default all)\n"
        "      --skip N         leave out the first N questions of each conversation (to\n"
        "                       finish a stopped run; rows keep their question numbers)\n"
        "      --out FILE       CSV, one row per (question, mode); the table goes to FILE.md\n"
        "                       (default locomo-eval.csv)\n"
        "  -m, --model PATH     GGUF model (default: $INFERSCALE_MODEL or %s)\n"
        "      --embedder DIR   sentence-embedding model (default %s)\n"
        "      --store DIR      where fact KV records are kept between runs (default %s)\n"
        "      --kv-dtype T     record precision: f32 | f16 | bf16 | fp8 (default f32)\n"
        "  -n, --max-tokens N   answer length limit in tokens (default 32)\n"
        "      --instruction T  appended to each question (default \"%s\")\n"
        "  -t, --threads N      CPU threads (default: all cores)\n"
        "      --backend B      cpu | cuda (default cpu)\n"
        "      --save-retrieval FILE  write each question's retrieved facts (for "
        "--load-retrieval)\n"
        "      --retrieve-only  only retrieve (and --save-retrieval): recall@k by category, no\n"
        "                       model run\n"
        "      --load-retrieval FILE  take the retrieved facts from FILE instead of embedding\n"
        "                       and searching (no embedding model needed): the same retrieval\n"
        "                       can then be answered on another machine or backend\n"
        "      --nll            also score the gold answer teacher-forced in prompt, off and\n"
        "                       every kv mode: mean token NLL, recovered share, KL and top-1\n"
        "                       agreement with prompt mode and P(list item) of the first answer\n"
        "                       token, by category with bootstrap intervals; per question in\n"
        "                       FILE.nll.csv (categories 1-4)\n"
        "      --no-generate    with --nll: no generated answers (no F1/EM), likelihoods only\n"
        "      --no-dates       show and encode facts without their session's date (default:\n"
        "                       \"[8 May 2023] fact\" in every mode; retrieval uses the bare "
        "text)\n"
        "      --bootstrap N    resamples for the --nll intervals (default 2000, fixed seed)\n"
        "  -h, --help           this help\n",
        EVAL_DEFAULT_DATA, CLI_DEFAULT_MODEL, EVAL_DEFAULT_EMBEDDER, EVAL_DEFAULT_STORE,
        EVAL_INSTRUCTION + 1);
}

static bool parse_modes(const char *s, eval_opts *o) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    o->n_modes = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->n_modes == EVAL_MAX_MODES) {
            fprintf(stderr, "error: at most %d modes\n", EVAL_MAX_MODES);
            return false;
        }
        eval_mode *m = &o->modes[o->n_modes];
        if (strcmp(t, "prompt") == 0) {
            *m = (eval_mode){ASK_MODE_PROMPT, 0, "prompt", 1.0f, 1.0f, 0, 0.0f};
        } else if (strcmp(t, "off") == 0) {
            *m = (eval_mode){ASK_MODE_OFF, 0, "off", 1.0f, 1.0f, 0, 0.0f};
        } else if (strncmp(t, "kv", 2) == 0 && t[2]) {
            /* kvW[tT][sS][rM][bR]: the window, then the optional memory
             * scaling and recomputation, each a letter and its number. */
            char num[5][32] = {"", "1", "1", "0", "0"}; /* W, T, S, M, R */
            const char *p = t + 2;
            int slot = 0;
            bool bad = strlen(t) >= sizeof m->name;
            while (!bad) {
                size_t n = strcspn(p, "tsrb");
                if (n == 0 || n >= sizeof num[0]) bad = true;
                else snprintf(num[slot], sizeof num[slot], "%.*s", (int)n, p);
                p += n;
                if (!*p) break;
                int next = *p == 't' ? 1 : *p == 's' ? 2 : *p == 'r' ? 3 : 4;
                if (next <= slot) bad = true; /* in this order, each once */
                slot = next;
                p++;
            }
            int32_t w, rm;
            float temp, mass, blend;
            if (bad) {
                fprintf(stderr,
                        "error: --modes: '%s' is not kvW[tT][sS][rM][bR] (e.g. kv0t0.8s2)\n", t);
                return false;
            }
            if (!cli_parse_int(num[0], "the window of a kv mode", -1, 1000, &w) ||
                !cli_parse_float(num[1], "a kv mode's memory temperature (t)", 0.01f, 100.0f,
                                 &temp) ||
                !cli_parse_float(num[2], "a kv mode's memory mass (s)", 0.001f, 1000.0f, &mass) ||
                !cli_parse_int(num[3], "a kv mode's recomputed tokens (r)", 0, 1000, &rm) ||
                !cli_parse_float(num[4], "a kv mode's blend ratio (b)", 0.0f, 1.0f, &blend))
                return false;
            if (slot == 4 && !(blend > 0.0f)) {
                fprintf(stderr, "error: --modes: '%s': a blend ratio must be above 0\n", t);
                return false;
            }
            *m = (eval_mode){ASK_MODE_KV, w, "", temp, mass, rm, blend};
            snprintf(m->name, sizeof m->name, "%s", t);
        } else {
            fprintf(stderr, "error: --modes: '%s' is not prompt, off or kvW (e.g. kv0, kv20)\n", t);
            return false;
        }
        for (int32_t i = 0; i < o->n_modes; i++) {
            if (strcmp(o->modes[i].name, m->name) == 0) {
                fprintf(stderr, "error: --modes: '%s' given twice\n", t);
                return false;
            }
        }
        o->n_modes++;
    }
    if (o->n_modes == 0) {
        fprintf(stderr, "error: --modes is empty\n");
        return false;
    }
    return true;
}

static bool parse_convs(const char *s, eval_opts *o) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->n_convs == EVAL_MAX_CONVS) {
            fprintf(stderr, "error: at most %d conversations\n", EVAL_MAX_CONVS);
            return false;
        }
        o->convs[o->n_convs++] = strdup(t);
    }
    return o->n_convs > 0;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every *.json of the data directory, by name. */
static bool list_convs(eval_opts *o) {
    DIR *d = opendir(o->data_dir);
    if (!d) {
        fprintf(stderr, "error: cannot open data directory '%s': %s\n", o->data_dir,
                strerror(errno));
        return false;
    }
    struct dirent *de;
    while ((de = readdir(d)) && o->n_convs < EVAL_MAX_CONVS) {
        size_t l = strlen(de->d_name);
        if (l > 5 && strcmp(de->d_name + l - 5, ".json") == 0)
            o->convs[o->n_convs++] = strndup(de->d_name, l - 5);
    }
    closedir(d);
    qsort(o->convs, (size_t)o->n_convs, sizeof *o->convs, cmp_cstr);
    if (o->n_convs == 0) fprintf(stderr, "error: no .json files in '%s'\n", o->data_dir);
    return o->n_convs > 0;
}

/* ---- answers ----------------------------------------------------------- */

typedef struct answer_buf {
    char s[2048];
    size_t n;
} answer_buf;

/* Keeps the answer's first line: a short answer is done at its first line
 * break (once some text has come), which saves decoding the rambling that
 * small models add. The same rule applies to every mode. */
static bool collect_answer(const char *t, size_t l, void *ud) {
    answer_buf *b = ud;
    for (size_t i = 0; i < l; i++) {
        bool blank = true;
        for (size_t j = 0; j < b->n && blank; j++) blank = b->s[j] == ' ' || b->s[j] == '\n';
        if (t[i] == '\n' && !blank) return false;
        if (b->n + 1 < sizeof b->s) b->s[b->n++] = t[i];
    }
    b->s[b->n] = 0;
    return true;
}

static void trim(char *s) {
    size_t n = strlen(s), i = 0;
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\n' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = 0;
    while (s[i] == ' ' || s[i] == '\n' || s[i] == '\t') i++;
    memmove(s, s + i, n - i + 1);
}

/* RFC 4180 field. */
static void csv_field(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

/* Per mode and category (index 0 unused, 1-5). */
typedef struct eval_tables {
    locomo_eval_acc acc[EVAL_MAX_MODES][6];
} eval_tables;

typedef struct q_result {
    char answer[2048];
    ask_timing tm;
} q_result;

/* ---- retrieval cache ---------------------------------------------------- */

/* Retrieval depends only on the texts, the embedder and k, so it can be done
 * once (here, with the embedding model) and the answering done elsewhere
 * (a GPU machine that has no embedding model). One line per question:
 *   conv <TAB> question <TAB> k <TAB> retrieval_ms <TAB> fact,fact,...
 * with the facts' indices in the conversation, best first. */
typedef struct retrieval_entry {
    char conv[64];
    int32_t q, k, n;
    double ms;
    int32_t *facts;
} retrieval_entry;

typedef struct retrieval_cache {
    retrieval_entry *e;
    int32_t n;
} retrieval_cache;

static void retrieval_cache_free(retrieval_cache *c) {
    for (int32_t i = 0; i < c->n; i++) free(c->e[i].facts);
    free(c->e);
    c->e = NULL;
    c->n = 0;
}

static bool retrieval_cache_load(const char *path, retrieval_cache *c) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "error: cannot read '%s': %s\n", path, strerror(errno));
        return false;
    }
    char *line = NULL;
    size_t cap = 0;
    int64_t lineno = 0;
    bool ok = true;
    while (ok && getline(&line, &cap, f) > 0) {
        lineno++;
        retrieval_entry r = {0};
        int used = 0;
        if (sscanf(line, "%63[^\t]\t%d\t%d\t%lf\t%n", r.conv, &r.q, &r.k, &r.ms, &used) != 4 ||
            r.q < 0 || r.k < 0 || r.k > 1000) {
            fprintf(stderr, "error: %s:%lld: not a retrieval line\n", path, (long long)lineno);
            ok = false;
            break;
        }
        r.facts = malloc((size_t)(r.k ? r.k : 1) * sizeof *r.facts);
        retrieval_entry *grown = realloc(c->e, (size_t)(c->n + 1) * sizeof *grown);
        if (!r.facts || !grown) {
            free(r.facts);
            if (grown) c->e = grown;
            fprintf(stderr, "error: out of memory\n");
            ok = false;
            break;
        }
        c->e = grown;
        for (char *p = line + used, *end; *p && *p != '\n'; p = end + (*end == ',')) {
            long v = strtol(p, &end, 10);
            if (end == p || v < 0 || r.n == r.k) {
                fprintf(stderr, "error: %s:%lld: bad fact list\n", path, (long long)lineno);
                ok = false;
                break;
            }
            r.facts[r.n++] = (int32_t)v;
        }
        c->e[c->n++] = r;
    }
    free(line);
    fclose(f);
    if (!ok) retrieval_cache_free(c);
    return ok;
}

static const retrieval_entry *retrieval_cache_find(const retrieval_cache *c, const char *conv,
                                                   int32_t q) {
    for (int32_t i = 0; i < c->n; i++)
        if (c->e[i].q == q && strcmp(c->e[i].conv, conv) == 0) return &c->e[i];
    return NULL;
}

/* ---- one conversation -------------------------------------------------- */

typedef struct eval_env {
    const eval_opts *o;
    ask_ctx *ask;
    embedder *emb;
    FILE *csv;
    FILE *save_retrieval;
    const retrieval_cache *load_retrieval;
    eval_tables *tab;
    int prompt_mode; /* index of prompt mode in o->modes, -1 if absent */
    /* --nll: slot 0 prompt, 1 off, 2.. the kv modes (nll_report.h) */
    engine *e;
    record_store *store;
    nll_report *rep;
    FILE *nll_csv;
    int32_t n_slots;
    int32_t
        slot_mode[NLL_REPORT_MAX_SLOTS]; /* kv slots: index in o->modes; -1 for prompt and off */
    const char *slot_name[NLL_REPORT_MAX_SLOTS];
    bool *list_mask; /* [n_vocab] */
    float *lp;       /* [n_slots][n_vocab] first answer token's log-probabilities */
} eval_env;

static void fact_id(char *buf, size_t cap, const char *conv, int32_t i) {
    snprintf(buf, cap, "%s-%d", conv, i);
}

/* Dated and undated records of a fact differ in their text: distinct ids. */
static void record_id(char *buf, size_t cap, const char *conv, int32_t i, int32_t w, bool dated) {
    snprintf(buf, cap, "%s-%d-w%d%s", conv, i, w, dated ? "-d" : "");
}

/* Whether the teacher-forced instrument scores a question: categories 1-4
 * with a gold answer (category 5 has no answer to force). */
static bool nll_scores(const locomo_question *lq) {
    return lq->category >= 1 && lq->category <= 4 && lq->answer[0];
}

/* The teacher-forced instrument for one question (categories 1-4 with a
 * gold answer): one pass per slot on the same retrieved facts, then a
 * report row and one CSV row per slot. gen_f1/gen_em: the generated answers'
 * scores by mode index (< 0: not generated). */
static is_status nll_question(eval_env *env, const locomo_conv *c, char *const *shown, int32_t q,
                              const char *query, const int32_t *hits, int32_t n_hits,
                              const double *gen_f1, const double *gen_em) {
    const eval_opts *o = env->o;
    const locomo_question *lq = &c->questions[q];
    if (!nll_scores(lq)) return IS_OK;
    const model *m = engine_model(env->e);
    const int32_t nv = m->cfg.n_vocab;
    int32_t *ans = NULL, n_ans = 0;
    is_status st = teacher_answer_tokens(m, lq->answer, &ans, &n_ans);
    if (st != IS_OK) return st;
    const char **ids = malloc((size_t)(n_hits ? n_hits : 1) * sizeof *ids);
    const char **texts = malloc((size_t)(n_hits ? n_hits : 1) * sizeof *texts);
    char(*rids)[72] = malloc((size_t)(n_hits ? n_hits : 1) * sizeof *rids);
    if (!ids || !texts || !rids) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    nll_row row = {.category = lq->category};
    for (int32_t s = 0; s < env->n_slots && st == IS_OK; s++) {
        int32_t gm = env->slot_mode[s];
        ask_mode mode = s == 0 ? ASK_MODE_PROMPT : s == 1 ? ASK_MODE_OFF : ASK_MODE_KV;
        for (int32_t h = 0; h < n_hits; h++) {
            record_id(rids[h], sizeof rids[h], c->name, hits[h], gm >= 0 ? o->modes[gm].window : 0,
                      !o->no_dates);
            ids[h] = rids[h];
            texts[h] = shown[hits[h]];
        }
        ask_request req = {.mode = mode,
                           .query = query,
                           .fact_ids = ids,
                           .fact_texts = texts,
                           .n_facts = n_hits,
                           .recompute = gm >= 0 ? o->modes[gm].recompute : 0,
                           .blend = gm >= 0 ? o->modes[gm].blend : 0.0f};
        float *lp = env->lp + (size_t)s * nv;
        st = engine_set_memory_scale(env->e, gm >= 0 ? o->modes[gm].temp : 1.0f,
                                     gm >= 0 ? o->modes[gm].mass : 1.0f);
        if (st != IS_OK) break;
        st = teacher_score_request(env->e, env->store, env->ask, &req, ans, n_ans, &row.nll[s], lp);
        if (st != IS_OK) break;
        nll_log_softmax(lp, nv, lp);
        row.plist[s] = nll_mass(lp, env->list_mask, nv);
        row.kl[s] = s == 0 ? 0 : nll_kl(env->lp, lp, nv);
        row.agree[s] = nll_argmax(lp, nv) == nll_argmax(env->lp, nv);
        /* the generated answer of the same mode, where one was generated */
        row.f1[s] = row.em[s] = -1;
        for (int32_t g = 0; g < o->n_modes; g++) {
            bool same = (s == 0 && o->modes[g].mode == ASK_MODE_PROMPT) ||
                        (s == 1 && o->modes[g].mode == ASK_MODE_OFF) || (s >= 2 && g == gm);
            if (same) {
                row.f1[s] = gen_f1[g];
                row.em[s] = gen_em[g];
            }
        }
    }
    if (st == IS_OK) st = nll_report_add(env->rep, &row);
    if (st == IS_OK && env->nll_csv) {
        for (int32_t s = 0; s < env->n_slots; s++) {
            char piece[64];
            int32_t top = nll_argmax(env->lp + (size_t)s * nv, nv);
            size_t pl = tokenizer_token_to_piece(m->tok, top, true, piece, sizeof piece - 1);
            piece[pl < sizeof piece - 1 ? pl : sizeof piece - 1] = 0;
            fprintf(env->nll_csv, "%s,%d,%d,%s,%d,%.6f,%.6f,%.6f,%d,", c->name, q, lq->category,
                    env->slot_name[s], n_ans, row.nll[s], row.plist[s], row.kl[s],
                    (int)row.agree[s]);
            csv_field(env->nll_csv, piece);
            if (row.f1[s] >= 0) fprintf(env->nll_csv, ",%.6f,%d\n", row.f1[s], (int)row.em[s]);
            else fprintf(env->nll_csv, ",,\n");
        }
        fflush(env->nll_csv);
    }
    free(ans);
    free(ids);
    free(texts);
    free(rids);
    return st;
}

static is_status eval_conv(eval_env *env, const char *name, double *t_encode, double *t_answer) {
    const eval_opts *o = env->o;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.json", o->data_dir, name);
    locomo_conv *c = NULL;
    is_status st = locomo_load(path, &c);
    if (st != IS_OK) return st;

    int32_t nf = c->n_facts, dim = env->emb ? embedder_dim(env->emb) : 1;
    int32_t nq = c->n_questions;
    if (o->limit > 0 && nq > o->limit) nq = o->limit;
    int32_t q0 = o->skip < nq ? o->skip : nq;
    int32_t k = o->k < nf ? o->k : nf;
    mem_index *ix = NULL;
    float *vecs = malloc((size_t)(nf + 1) * dim * sizeof(float));
    const char **texts = malloc((size_t)(nf ? nf : 1) * sizeof *texts);
    int32_t *hit_fact = malloc((size_t)(nq ? nq : 1) * (k ? k : 1) * sizeof *hit_fact);
    int32_t *n_hits = calloc((size_t)(nq ? nq : 1), sizeof *n_hits);
    double *recall = calloc((size_t)(nq ? nq : 1), sizeof *recall),
           *retr_ms = calloc((size_t)(nq ? nq : 1), sizeof(double));
    bool *needed = calloc((size_t)(nf ? nf : 1), sizeof *needed);
    mem_hit *hits = calloc((size_t)(k ? k : 1), sizeof *hits);
    const char **ev_ids =
        malloc((size_t)(k ? k : 1) * sizeof *ev_ids); /* evidence turns of the hits */
    q_result *res = calloc((size_t)o->n_modes, sizeof *res);
    char **shown =
        calloc((size_t)(nf ? nf : 1), sizeof *shown); /* fact texts as the model sees them */
    if (!shown) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < nf && st == IS_OK; i++)
        st = memory_prompt_dated_text(o->no_dates ? NULL : c->facts[i].date, c->facts[i].text,
                                      &shown[i]);
    if (st != IS_OK) goto done;
    if (!vecs || !texts || !hit_fact || !n_hits || !recall || !retr_ms || !needed || !hits ||
        !ev_ids || !res) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }

    /* Index: one user per conversation, both speakers' facts. */
    for (int32_t i = 0; i < nf; i++) texts[i] = c->facts[i].text;
    if (!env->load_retrieval) {
        if (nf > 0 && (st = embedder_embed(env->emb, texts, nf, vecs)) != IS_OK) goto done;
        if ((st = mem_index_create(dim, &ix)) != IS_OK) goto done;
        for (int32_t i = 0; i < nf; i++) {
            char id[MEM_ID_MAX + 1];
            fact_id(id, sizeof id, c->name, i);
            mem_doc d = {.id = id,
                         .tenant = "locomo",
                         .user = c->name,
                         .text = texts[i],
                         .embedding = vecs + (size_t)i * dim};
            if ((st = mem_index_upsert(ix, &d)) != IS_OK) goto done;
        }
    }

    /* Retrieval for every question first: it tells which records to encode. */
    mem_filter flt = {.tenant = "locomo", .user = c->name};
    for (int32_t q = q0; q < nq; q++) {
        const locomo_question *lq = &c->questions[q];
        int32_t nh = 0;
        if (env->load_retrieval) {
            const retrieval_entry *r = retrieval_cache_find(env->load_retrieval, c->name, q);
            if (!r || r->k != o->k) {
                st = is_error_set(
                    IS_ERR_NOT_FOUND,
                    "--load-retrieval: no entry for conversation %s question %d with k = %d",
                    c->name, q, o->k);
                goto done;
            }
            for (int32_t h = 0; h < r->n && h < k; h++) {
                if (r->facts[h] >= nf) {
                    st = is_error_set(IS_ERR_FORMAT,
                                      "--load-retrieval: conversation %s has no fact %d", c->name,
                                      r->facts[h]);
                    goto done;
                }
                hit_fact[(size_t)q * k + nh++] = r->facts[h];
            }
            retr_ms[q] = r->ms;
        } else {
            double t0 = now_ms();
            float *qv = vecs + (size_t)nf * dim;
            const char *qt = lq->question;
            if (k > 0) {
                if ((st = embedder_embed(env->emb, &qt, 1, qv)) != IS_OK) goto done;
                if ((st = mem_index_search(ix, &flt, qv, qt, k, MEM_SEARCH_HYBRID, hits, &nh)) !=
                    IS_OK)
                    goto done;
            }
            retr_ms[q] = now_ms() - t0;
            for (int32_t h = 0; h < nh; h++) {
                const char *dash = strrchr(hits[h].id, '-');
                int32_t fi = dash ? atoi(dash + 1) : -1;
                IS_ASSERT(fi >= 0 && fi < nf);
                hit_fact[(size_t)q * k + h] = fi;
            }
        }
        int32_t n_ev = 0;
        for (int32_t h = 0; h < nh; h++) {
            int32_t fi = hit_fact[(size_t)q * k + h];
            needed[fi] = true;
            ev_ids[n_ev++] = c->facts[fi].dia_id;
        }
        n_hits[q] = nh;
        recall[q] =
            locomo_eval_recall((const char *const *)lq->evidence, lq->n_evidence, ev_ids, n_ev);
        if (env->save_retrieval) {
            fprintf(env->save_retrieval, "%s\t%d\t%d\t%.3f\t", c->name, q, o->k, retr_ms[q]);
            for (int32_t h = 0; h < nh; h++)
                fprintf(env->save_retrieval, h ? ",%d" : "%d", hit_fact[(size_t)q * k + h]);
            fputc('\n', env->save_retrieval);
        }
    }

    if (o->retrieve_only) {
        for (int32_t q = q0; q < nq; q++) {
            int cat = c->questions[q].category;
            locomo_eval_result r = {.recall = recall[q], .agree = -1};
            if (cat >= 1 && cat <= 5) locomo_eval_acc_add(&env->tab->acc[0][cat], &r);
        }
        goto done;
    }

    /* Encode the retrieved facts' records for each kv window. */
    int32_t n_needed = 0;
    for (int32_t i = 0; i < nf; i++) n_needed += needed[i];
    double te = now_ms();
    for (int32_t m = 0; m < o->n_modes; m++) {
        if (o->modes[m].mode != ASK_MODE_KV) continue;
        int32_t w = o->modes[m].window, done_n = 0, encoded = 0;
        char what[64];
        snprintf(what, sizeof what, "conv %s: encoding w=%d", c->name, w);
        double t0 = now_ms();
        const char *ctx[1024];
        for (int32_t i = 0; i < nf; i++) {
            if (!needed[i]) continue;
            char rid[72];
            record_id(rid, sizeof rid, c->name, i, w, !o->no_dates);
            int32_t n_ctx =
                locomo_fact_context(c, &c->facts[i], w > 1024 ? 1024 : (w < 0 ? 0 : w), ctx);
            ask_fact af = {rid, shown[i], ctx, n_ctx};
            bool did;
            if ((st = ask_encode_fact(env->ask, &af, w, &did)) != IS_OK) goto done;
            encoded += did;
            cli_progress(what, ++done_n, n_needed, t0);
        }
        fprintf(stderr,
                "conv %s: w=%d: %d of %d retrieved facts encoded (%.1f s), %d already stored\n",
                c->name, w, encoded, n_needed, (now_ms() - t0) / 1e3, n_needed - encoded);
    }
    *t_encode += now_ms() - te;

    /* Answer every question in every mode from the same facts. */
    double ta = now_ms();
    char what[64];
    snprintf(what, sizeof what, "conv %s: answering", c->name);
    const char **ids = malloc((size_t)(k ? k : 1) * sizeof *ids),
               **ftexts = malloc((size_t)(k ? k : 1) * sizeof *ftexts);
    char(*rids)[72] = malloc((size_t)(k ? k : 1) * sizeof *rids);
    if (!ids || !ftexts || !rids) {
        free(ids);
        free(ftexts);
        free(rids);
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }
    /* Without generation the answering bar never moves: count the scored
     * questions instead, the only long work left. */
    char what_nll[64];
    snprintf(what_nll, sizeof what_nll, "conv %s: scoring questions", c->name);
    int32_t n_scored = 0, n_to_score = 0;
    for (int32_t q = q0; q < nq && o->nll && o->no_generate; q++)
        n_to_score += nll_scores(&c->questions[q]);
    for (int32_t q = q0; q < nq && st == IS_OK; q++) {
        const locomo_question *lq = &c->questions[q];
        size_t ql = strlen(lq->question) + strlen(o->instruction) + 1;
        char *query = malloc(ql);
        if (!query) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            break;
        }
        snprintf(query, ql, "%s%s", lq->question, o->instruction);
        for (int32_t m = 0; m < o->n_modes && st == IS_OK && !o->no_generate; m++) {
            const eval_mode *em = &o->modes[m];
            for (int32_t h = 0; h < n_hits[q]; h++) {
                int32_t fi = hit_fact[(size_t)q * k + h];
                record_id(rids[h], sizeof rids[h], c->name, fi, em->window, !o->no_dates);
                ids[h] = rids[h];
                ftexts[h] = shown[fi];
            }
            answer_buf ab = {.n = 0};
            ab.s[0] = 0;
            ask_request req = {.mode = em->mode,
                               .query = query,
                               .fact_ids = ids,
                               .fact_texts = ftexts,
                               .n_facts = n_hits[q],
                               .max_tokens = o->max_tokens,
                               .temperature = 0.0f,
                               .top_k = 0,
                               .top_p = 1.0f,
                               .seed = 0,
                               .recompute = em->recompute,
                               .blend = em->blend};
            st = engine_set_memory_scale(env->e, em->temp, em->mass);
            if (st == IS_OK) st = ask_run(env->ask, &req, collect_answer, &ab, &res[m].tm);
            snprintf(res[m].answer, sizeof res[m].answer, "%s", ab.s);
            trim(res[m].answer);
            cli_progress(what, (int64_t)(q - q0) * o->n_modes + m + 1,
                         (int64_t)(nq - q0) * o->n_modes, ta);
        }
        if (st != IS_OK) {
            free(query);
            break;
        }
        double gen_f1[EVAL_MAX_MODES], gen_em[EVAL_MAX_MODES];
        for (int32_t m = 0; m < EVAL_MAX_MODES; m++) gen_f1[m] = gen_em[m] = -1;
        /* Score, compare with prompt mode, write rows. */
        char *norm_prompt = NULL;
        if (!o->no_generate && env->prompt_mode >= 0 &&
            (st = locomo_eval_normalize(res[env->prompt_mode].answer, &norm_prompt)) != IS_OK)
            break;
        for (int32_t m = 0; m < o->n_modes && st == IS_OK && !o->no_generate; m++) {
            locomo_eval_result r = {.recall = recall[q], .ttft_ms = res[m].tm.ttft_ms, .agree = -1};
            bool em;
            if ((st = locomo_eval_score(res[m].answer, lq->answer, lq->category, &r.f1)) != IS_OK)
                break;
            if ((st = locomo_eval_exact(res[m].answer, lq->answer, lq->category, &em)) != IS_OK)
                break;
            r.em = em;
            gen_f1[m] = r.f1;
            gen_em[m] = r.em;
            if (norm_prompt && m != env->prompt_mode) {
                char *nm;
                if ((st = locomo_eval_normalize(res[m].answer, &nm)) != IS_OK) break;
                r.agree = strcmp(nm, norm_prompt) == 0;
                free(nm);
                if ((st = locomo_eval_f1(res[m].answer, res[env->prompt_mode].answer,
                                         &r.f1_vs_prompt)) != IS_OK)
                    break;
            }
            if (lq->category >= 1 && lq->category <= 5)
                locomo_eval_acc_add(&env->tab->acc[m][lq->category], &r);
            if (env->csv) {
                fprintf(env->csv, "%s,%d,%d,%s,%.6f,%d,%.6f,", c->name, q, lq->category,
                        o->modes[m].name, r.f1, (int)r.em, r.recall);
                if (r.agree >= 0) fprintf(env->csv, "%d,%.6f,", (int)r.agree, r.f1_vs_prompt);
                else fprintf(env->csv, ",,");
                fprintf(env->csv, "%.2f,%.2f,%.2f,%d,%d,", res[m].tm.ttft_ms, retr_ms[q],
                        res[m].tm.prefill_ms, res[m].tm.n_memory_tokens, res[m].tm.n_generated);
                csv_field(env->csv, res[m].answer);
                fputc(',', env->csv);
                csv_field(env->csv, lq->answer);
                fputc(',', env->csv);
                csv_field(env->csv, lq->question);
                fputc('\n', env->csv);
            }
        }
        free(norm_prompt);
        if (env->csv) fflush(env->csv);
        if (st == IS_OK && o->nll)
            st = nll_question(env, c, shown, q, query, hit_fact + (size_t)q * k, n_hits[q], gen_f1,
                              gen_em);
        if (st == IS_OK && n_to_score > 0 && nll_scores(lq))
            cli_progress(what_nll, ++n_scored, n_to_score, ta);
        free(query);
    }
    free(ids);
    free(ftexts);
    free(rids);
    *t_answer += now_ms() - ta;

done:
    mem_index_free(ix);
    free(vecs);
    free(texts);
    free(hit_fact);
    free(n_hits);
    free(recall);
    free(retr_ms);
    free(needed);
    free(hits);
    free(ev_ids);
    free(res);
    for (int32_t i = 0; shown && i < nf; i++) free(shown[i]);
    free(shown);
    locomo_free(c);
    return st;
}

/* ---- the table --------------------------------------------------------- */

static void fmt_val(char *buf, size_t cap, double v) {
    if (v < 0) snprintf(buf, cap, "-");
    else snprintf(buf, cap, "%.3f", v);
}

static void print_table(FILE *f, const eval_opts *o, const eval_tables *t, int prompt_mode) {
    static const char *const cat_names[] = {
        "", "1 multi-hop", "2 temporal", "3 open-domain", "4 single-hop", "5 adversarial"};
    fprintf(f,
            "| mode | category | n | F1 | EM | recall@%d | agree w/ prompt | F1 vs prompt | TTFT "
            "ms* |\n",
            o->k);
    fprintf(f, "|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int32_t m = 0; m < o->n_modes; m++) {
        locomo_eval_acc all = {0};
        for (int cat = 1; cat <= 6; cat++) {
            const locomo_eval_acc *a;
            const char *label;
            if (cat <= 4) {
                a = &t->acc[m][cat];
                label = cat_names[cat];
                all.n += a->n;
                all.f1 += a->f1;
                all.em += a->em;
                all.recall += a->recall;
                all.ttft_ms += a->ttft_ms;
                all.n_agree += a->n_agree;
                all.agree += a->agree;
                all.f1_vs_prompt += a->f1_vs_prompt;
            } else if (cat == 5) {
                a = &all;
                label = "**1-4 all**";
            } else {
                a = &t->acc[m][5];
                label = cat_names[5];
            }
            if (a->n == 0) continue;
            locomo_eval_result r = locomo_eval_acc_mean(a);
            char agree[16], f1p[16];
            fmt_val(agree, sizeof agree, r.agree);
            fmt_val(f1p, sizeof f1p, r.f1_vs_prompt);
            fprintf(f, "| %s | %s | %lld | %.3f | %.3f | %.3f | %s | %s | %.0f |\n",
                    o->modes[m].name, label, (long long)a->n, r.f1, r.em, r.recall, agree, f1p,
                    r.ttft_ms);
        }
    }
    fprintf(f, "\n*TTFT: from the request (facts chosen) to the first answer token: record fetch, "
               "injection and prefill; retrieval, the same for every mode, is not included (CSV: "
               "retrieval_ms).\n");
    (void)prompt_mode;
}

/* ---- main -------------------------------------------------------------- */

int cmd_eval(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        eval_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 1 : 0;
    }
    if (strcmp(argv[1], "locomo") != 0) {
        fprintf(stderr,
                "error: unknown benchmark '%s' (only 'locomo'; see 'inferscale eval --help')\n",
                argv[1]);
        return 1;
    }
    argc--;
    argv++;
    static const struct option longopts[] = {
        {"data-dir", required_argument, 0, 'D'},
        {"conv", required_argument, 0, 'C'},
        {"k", required_argument, 0, 'k'},
        {"modes", required_argument, 0, 'M'},
        {"limit", required_argument, 0, 'l'},
        {"skip", required_argument, 0, 'J'},
        {"out", required_argument, 0, 'o'},
        {"model", required_argument, 0, 'm'},
        {"embedder", required_argument, 0, 'E'},
        {"store", required_argument, 0, 'S'},
        {"kv-dtype", required_argument, 0, 'd'},
        {"max-tokens", required_argument, 0, 'n'},
        {"instruction", required_argument, 0, 'I'},
        {"threads", required_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},
        {"backend", required_argument, 0, 'B'},
        {"save-retrieval", required_argument, 0, 'R'},
        {"load-retrieval", required_argument, 0, 'L'},
        {"retrieve-only", no_argument, 0, 'r'},
        {"nll", no_argument, 0, 'N'},
        {"no-generate", no_argument, 0, 'G'},
        {"bootstrap", required_argument, 0, 'b'},
        {"no-dates", no_argument, 0, 'A'},
        {0, 0, 0, 0},
    };
    eval_opts o = {.data_dir = EVAL_DEFAULT_DATA,
                   .model = cli_default_model(),
                   .embedder = EVAL_DEFAULT_EMBEDDER,
                   .store = EVAL_DEFAULT_STORE,
                   .out = "locomo-eval.csv",
                   .instruction = EVAL_INSTRUCTION,
                   .k = 20,
                   .limit = 0,
                   .skip = 0,
                   .max_tokens = 32,
                   .threads = 0,
                   .dtype = KV_DTYPE_F32,
                   .backend = "cpu",
                   .n_boot = 2000};
    parse_modes("prompt,kv0,kv20", &o);
    const char *conv_arg = NULL;
    int c, rc = 1;
    optind = 1;
    while ((c = getopt_long(argc, argv, "k:m:n:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'D': o.data_dir = optarg; break;
        case 'C': conv_arg = optarg; break;
        case 'k':
            if (!cli_parse_int(optarg, "--k", 0, 1000, &o.k)) return 1;
            break;
        case 'M':
            if (!parse_modes(optarg, &o)) return 1;
            break;
        case 'l':
            if (!cli_parse_int(optarg, "--limit", 0, INT32_MAX, &o.limit)) return 1;
            break;
        case 'J':
            if (!cli_parse_int(optarg, "--skip", 0, INT32_MAX, &o.skip)) return 1;
            break;
        case 'o': o.out = optarg; break;
        case 'm': o.model = optarg; break;
        case 'E': o.embedder = optarg; break;
        case 'B': o.backend = optarg; break;
        case 'R': o.save_retrieval = optarg; break;
        case 'L': o.load_retrieval = optarg; break;
        case 'r': o.retrieve_only = true; break;
        case 'N': o.nll = true; break;
        case 'A': o.no_dates = true; break;
        case 'G': o.no_generate = true; break;
        case 'b':
            if (!cli_parse_int(optarg, "--bootstrap", 10, 1000000, &o.n_boot)) return 1;
            break;
        case 'S': o.store = optarg; break;
        case 'I': o.instruction = optarg; break;
        case 'n':
            if (!cli_parse_int(optarg, "--max-tokens", 1, 4096, &o.max_tokens)) return 1;
            break;
        case 't':
            if (!cli_parse_int(optarg, "--threads", 1, 1024, &o.threads)) return 1;
            break;
        case 'd':
            if (!cli_parse_kv_dtype(optarg, &o.dtype)) return 1;
            break;
        case 'h': eval_usage(stdout); return 0;
        default: eval_usage(stderr); return 1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s' (see 'inferscale eval --help')\n",
                argv[optind]);
        return 1;
    }
    if (o.no_generate && !o.nll) {
        fprintf(stderr, "error: --no-generate needs --nll (nothing would be measured)\n");
        return 1;
    }
    if (conv_arg ? !parse_convs(conv_arg, &o) : !list_convs(&o)) {
        if (conv_arg) fprintf(stderr, "error: --conv is empty\n");
        return 1;
    }

    stack *sk = NULL;
    model *m = NULL;
    engine *e = NULL;
    record_store *store = NULL;
    ask_ctx *ac = NULL;
    embedder *emb = NULL;
    FILE *csv = NULL, *md = NULL, *save_r = NULL, *nll_csv = NULL;
    nll_report *rep = NULL;
    bool *list_mask = NULL;
    float *lp = NULL;
    retrieval_cache rcache = {0};
    eval_tables *tab = calloc(1, sizeof *tab);
    is_status st;
    double t_start = now_ms(), t_encode = 0, t_answer = 0;
    char mdpath[4096];

    if (!tab) {
        fprintf(stderr, "error: out of memory\n");
        goto out;
    }
    if (o.load_retrieval && !retrieval_cache_load(o.load_retrieval, &rcache)) goto out;
    if (o.save_retrieval && !(save_r = fopen(o.save_retrieval, "w"))) {
        fprintf(stderr, "error: cannot write '%s': %s\n", o.save_retrieval, strerror(errno));
        goto out;
    }
    if (o.retrieve_only) {
        if (o.load_retrieval) {
            fprintf(stderr, "error: --retrieve-only and --load-retrieval exclude each other\n");
            goto out;
        }
        o.modes[0] = (eval_mode){ASK_MODE_OFF, 0, "retrieval", 1.0f, 1.0f, 0, 0.0f};
        o.n_modes = 1;
    }
    if (!o.retrieve_only) {
        /* The model's half of the stack; the facts are indexed per conversation here. */
        stack_records_params sp = {.model_path = o.model,
                                   .backend = o.backend,
                                   .n_threads = o.threads,
                                   .n_ctx_max = 4096,
                                   .records_dir = o.store,
                                   .cache_bytes = (size_t)512 << 20,
                                   .dtype = o.dtype};
        if ((st = stack_open_records(&sp, &sk)) != IS_OK) goto fail;
        m = sk->model;
        e = sk->eng;
        store = sk->rs;
        ac = sk->ask;
    }
    if (!o.load_retrieval) {
        char ename[256];
        if ((st = stack_embedder_open(o.embedder, false, o.threads, &emb, ename, sizeof ename)) !=
            IS_OK)
            goto fail;
        if (!emb) {
            fprintf(stderr, "error: eval retrieves with the embedding model (--embedder DIR), or "
                            "takes its retrieval from --load-retrieval FILE\n");
            goto out;
        }
    }
    csv = fopen(o.out, "w");
    if (!csv) {
        fprintf(stderr, "error: cannot write '%s': %s\n", o.out, strerror(errno));
        goto out;
    }
    fprintf(
        csv,
        "conv,question,category,mode,f1,em,recall,agree_prompt,f1_vs_prompt,ttft_ms,retrieval_ms,"
        "prefill_ms,memory_tokens,generated_tokens,answer,gold,question_text\n");
    eval_env env = {.o = &o,
                    .ask = ac,
                    .emb = emb,
                    .csv = csv,
                    .tab = tab,
                    .prompt_mode = -1,
                    .save_retrieval = save_r,
                    .load_retrieval = o.load_retrieval ? &rcache : NULL};
    for (int32_t i = 0; i < o.n_modes; i++)
        if (o.modes[i].mode == ASK_MODE_PROMPT) env.prompt_mode = i;
    env.e = e; /* the memory scaling of each kv mode is set on it */
    if (o.nll && !o.retrieve_only) {
        env.store = store;
        env.slot_name[0] = "prompt";
        env.slot_name[1] = "off";
        env.slot_mode[0] = env.slot_mode[1] = -1;
        env.n_slots = 2;
        for (int32_t i = 0; i < o.n_modes; i++) {
            if (o.modes[i].mode != ASK_MODE_KV) continue;
            env.slot_mode[env.n_slots] = i;
            env.slot_name[env.n_slots++] = o.modes[i].name;
        }
        int32_t nv = m->cfg.n_vocab;
        list_mask = malloc((size_t)nv * sizeof *list_mask);
        lp = malloc((size_t)env.n_slots * nv * sizeof *lp);
        if (!list_mask || !lp) {
            fprintf(stderr, "error: out of memory\n");
            goto out;
        }
        int32_t n_list = nll_list_mask(m->tok, list_mask);
        fprintf(stderr, "--nll: %d of %d vocabulary entries open a list item\n", n_list, nv);
        if ((st = nll_report_create(env.slot_name, env.n_slots, &rep)) != IS_OK) goto fail;
        char nllpath[4096];
        snprintf(nllpath, sizeof nllpath, "%s.nll.csv", o.out);
        if (!(nll_csv = fopen(nllpath, "w"))) {
            fprintf(stderr, "error: cannot write '%s': %s\n", nllpath, strerror(errno));
            goto out;
        }
        fprintf(
            nll_csv,
            "conv,question,category,mode,answer_tokens,nll,p_list,kl_vs_prompt,top1_agree_prompt,"
            "top1_piece,f1,em\n");
        env.rep = rep;
        env.nll_csv = nll_csv;
        env.list_mask = list_mask;
        env.lp = lp;
    }
    for (int32_t i = 0; i < o.n_convs; i++) {
        if ((st = eval_conv(&env, o.convs[i], &t_encode, &t_answer)) != IS_OK) goto fail;
    }

    double total_s = (now_ms() - t_start) / 1e3;
    char scope[64];
    if (o.skip && o.limit) snprintf(scope, sizeof scope, "questions %d-%d", o.skip + 1, o.limit);
    else if (o.skip) snprintf(scope, sizeof scope, "the questions after the first %d", o.skip);
    else if (o.limit) snprintf(scope, sizeof scope, "the first %d questions", o.limit);
    else snprintf(scope, sizeof scope, "all questions");
    printf("LoCoMo: %d conversation(s), %s of each, k = %d, model %s, backend %s\n\n", o.n_convs,
           scope, o.k, o.model, o.backend);
    if (!o.no_generate) print_table(stdout, &o, tab, env.prompt_mode);
    if (rep) {
        printf("\nTeacher-forced instrument, %d questions of categories 1-4:\n\n",
               nll_report_n_rows(rep));
        nll_report_print(rep, stdout, o.n_boot, 1234);
    }
    printf("\ntime: %.1f s total (encoding %.1f s, answering %.1f s)\n", total_s, t_encode / 1e3,
           t_answer / 1e3);
    snprintf(mdpath, sizeof mdpath, "%s.md", o.out);
    md = fopen(mdpath, "w");
    if (md) {
        fprintf(md, "LoCoMo: %d conversation(s), %s of each, k = %d, model %s, backend %s\n\n",
                o.n_convs, scope, o.k, o.model, o.backend);
        if (!o.no_generate) print_table(md, &o, tab, env.prompt_mode);
        if (rep) {
            fprintf(md, "\nTeacher-forced instrument, %d questions of categories 1-4:\n\n",
                    nll_report_n_rows(rep));
            nll_report_print(rep, md, o.n_boot, 1234);
        }
        fprintf(md, "\ntime: %.1f s total (encoding %.1f s, answering %.1f s)\n", total_s,
                t_encode / 1e3, t_answer / 1e3);
    }
    fprintf(stderr, "wrote %s and %s\n", o.out, mdpath);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "error: %s\n", is_error_last());
out:
    if (csv) fclose(csv);
    if (md) fclose(md);
    if (save_r) fclose(save_r);
    if (nll_csv) fclose(nll_csv);
    nll_report_free(rep);
    free(list_mask);
    free(lp);
    retrieval_cache_free(&rcache);
    embedder_free(emb);
    stack_close(sk);
    free(tab);
    for (int32_t i = 0; i < o.n_convs; i++) free(o.convs[i]);
    return rc;
}

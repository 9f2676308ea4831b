/*
 * test_crash: crash atomicity of the memory service (memory/memory.h).
 *
 * The invariant: a crash at any moment leaves each fact fully present (its
 * row with the embedding of its text, its KV record made for that text, its
 * index entry after reopen, its history ending in that text) or fully
 * absent, and an interrupted update shows the old version or the new one.
 *
 * A forked child opens the data directory and performs a random sequence of
 * adds, batch adds (three facts whose rows commit together, which must all
 * be there or none), updates, deletes and delete_alls on three users (two
 * tenants), and
 * tells the parent over a pipe when each operation begins ("B ...") and
 * ends ("E ..."). It dies in one of two ways:
 *
 *   step:  at the N-th fault-injection point, counting every point of a
 *          write: the service's own steps (memory_step), the record store's
 *          system calls (record_store_step) and the fact store's point just
 *          before COMMIT; there the child _exit()s, as abruptly as a crash;
 *   timer: SIGKILL after a random number of microseconds, which lands
 *          anywhere, inside SQLite's commit and the kernel calls included.
 *
 * The parent then reopens the directory (reconciliation runs), and checks
 * memory_check (rows, records and index agree; no orphan record; every KV
 * record carries its row's text hash) and that the facts are exactly the
 * model the parent built from the "E" lines, give or take the one operation
 * in flight, which must be wholly applied or wholly not; every fact's stored
 * embedding equals the embedding of its text, and its history ends with it.
 * The data directory carries over from one child to the next, so crashes
 * pile on top of recovered crashes.
 *
 * The first part uses fakes for speed (a hashed bag-of-words embedder, an
 * encoder writing small valid records). It also checks that every kind of
 * fault point was crashed at at least once. A second, smaller part runs
 * the real models (MiniLM embeddings, SmolLM2 KV encoding through
 * ask_encode_fact) when they are installed: each record must then load for
 * the serving model and carry its row's text, and each embedding match the
 * embedder (checked after the last fork: the parent never starts OpenMP
 * threads before forking). A third part kills a LoCoMo import at random
 * times and checks that re-running it completes the conversation exactly
 * (no fact twice, none missing).
 *
 * With IS_PG_URL set (ctest's test_crash_pg, beside a throwaway server from
 * scripts/pg_temp.sh) the first part runs on a PostgreSQL fact store: the
 * child then dies with a transaction open on the server, which must roll
 * it back. The other parts are the same code on either store and skip.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "test_fakes.h"
#include "test_util.h"
#include "kv/fact_record.h"
#include "memory/memory.h"
#include "serve/ask.h"

#define LOCOMO_26    IS_SOURCE_DIR "/../shared/data/locomo/26.json"
#define EMBEDDER_DIR IS_SOURCE_DIR "/models/all-MiniLM-L6-v2"

static char g_dir[256];
static const char *g_pg; /* IS_PG_URL: the fact store is this PostgreSQL database */

static int setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "%s/is_test_crash_XXXXXX",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    if (!mkdtemp(g_dir)) return -1;
    if (g_pg) return test_pg_reset(g_pg) ? 0 : -1; /* every case starts from an empty database */
    return 0;
}

static int teardown(void **state) { return test_remove_tree(g_dir); }

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---- fakes (tests/common/test_fakes.h) ------------------------------------------------ */

#define FAKE_DIM 32

static is_status fake_embed(void *ud, const char *const *texts, int32_t n, float *out) {
    test_bow_embed(texts, n, FAKE_DIM, out);
    return IS_OK;
}

static is_status fake_encode(void *ud, record_store *rs, const memory_encode_job *job) {
    return test_fake_record_put(rs, job, job->n_context);
}

/* Never called: the parent opens the store with the real model's name and
 * dimension but must not run the model (it forks later). */
static is_status no_embed(void *ud, const char *const *texts, int32_t n, float *out) {
    return is_error_set(IS_ERR_INTERNAL, "the parent does not embed");
}

/* ---- the workload --------------------------------------------------------------- */

#define N_PARTS 3
/* Facts of a batch add (the report line "E M" names three ids). */
#define CRASH_BATCH 3
static const char *PART_TENANT[N_PARTS] = {"t", "t", "t2"};
static const char *PART_USER[N_PARTS] = {"u0", "u1", "u0"};

static void text_of(int32_t textno, char *out, size_t cap) {
    static const char *words[] = {"apples", "boston", "cello",   "dogs", "everest", "falafel",
                                  "guitar", "hiking", "iceland", "jazz", "kayak",   "lisbon"};
    snprintf(out, cap, "fact %d: likes %s and %s, version %d", (int)textno, words[textno % 12],
             words[(textno / 12) % 12], (int)(textno % 7));
}

static const char *agent_of(int32_t textno) { return textno % 2 ? "a1" : "a0"; }

typedef struct crash_cfg {
    bool real;         /* real models (else fakes) */
    int32_t n_ops;     /* operations per child */
    int64_t kill_step; /* step mode: die at this fault point (1-based); 0: never */
    uint64_t seed;
    int32_t textno_base; /* texts of this child: base, base+1, ... */
} crash_cfg;

typedef struct child_state {
    int fd;        /* pipe to the parent */
    int64_t steps; /* fault points passed */
    int64_t kill_step;
} child_state;

static child_state g_child;

static void say(const char *fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    /* One write per line (< PIPE_BUF): a line arrives whole or not at all. */
    if (n > 0 && write(g_child.fd, buf, (size_t)n) != n) _exit(5);
}

/* kind: 0..3 memory steps, 10..15 record store steps, 20 commit. */
static void fault_point(int kind) {
    g_child.steps++;
    if (g_child.kill_step && g_child.steps == g_child.kill_step) {
        say("K %d\n", kind);
        _exit(42);
    }
}

static void on_memory_step(memory_step s, void *ud) { fault_point((int)s); }
static bool on_record_step(record_store_step s, void *ud) {
    fault_point(10 + (int)s);
    return true;
}
static bool on_commit(void *ud) {
    fault_point(20);
    return true;
}

#define CHILD_FAIL(...)                                                                            \
    do {                                                                                           \
        say("F " __VA_ARGS__);                                                                     \
        say(": %s\n", is_error_last());                                                            \
        _exit(3);                                                                                  \
    } while (0)

typedef struct known {
    char id[MEMORY_ID_SIZE];
    int part;
} known;

/* The child: open, run n_ops random operations, report each. Never returns. */
static void child_main(const crash_cfg *cfg, int fd) {
    g_child = (child_state){.fd = fd, .kill_step = cfg->kill_step};
    memory_params p = memory_default_params();
    embedder *emb = NULL;
    backend *be = NULL;
    model *mdl = NULL;
    engine *e = NULL;
    ask_ctx *ac = NULL;
    if (cfg->real) {
        if (embedder_load(EMBEDDER_DIR, &emb) != IS_OK) CHILD_FAIL("embedder_load");
        p.embedder = emb;
        p.embed_name = "all-MiniLM-L6-v2";
    } else {
        p.embed = fake_embed;
        p.embed_dim = FAKE_DIM;
        p.embed_name = "fake";
    }
    p.kv_window = 2;
    p.store_url = g_pg;
    memory *m = NULL;
    if (memory_open(g_dir, &p, &m, NULL) != IS_OK) CHILD_FAIL("memory_open");
    if (cfg->real) {
        if (backend_cpu_create(0, &be) != IS_OK || model_load(IS_DEFAULT_MODEL, be, &mdl) != IS_OK)
            CHILD_FAIL("model");
        engine_params ep = engine_default_params();
        ep.max_seqs = 3;
        ep.n_ctx = 512;
        if (engine_create(mdl, ep, &e) != IS_OK ||
            ask_ctx_create(e, memory_record_store(m), KV_DTYPE_F32, &ac) != IS_OK)
            CHILD_FAIL("engine");
        memory_set_encoder(m, ask_memory_encoder, ac);
    } else {
        memory_set_encoder(m, fake_encode, NULL);
    }
    memory_set_fault_hook(m, on_memory_step, NULL);
    record_store_set_fault_hook(memory_record_store(m), on_record_step, NULL);
    mem_store_set_fault_hook(memory_fact_store(m), on_commit, NULL);

    /* What exists now. */
    known *ks = NULL;
    int32_t nk = 0;
    for (int part = 0; part < N_PARTS; part++) {
        mem_filter f = {.tenant = PART_TENANT[part], .user = PART_USER[part]};
        mem_fact *all;
        int32_t na;
        if (memory_get_all(m, &f, &all, &na) != IS_OK) CHILD_FAIL("get_all");
        ks = realloc(ks, (size_t)(nk + na + cfg->n_ops + 1) * sizeof *ks);
        for (int32_t i = 0; i < na; i++) {
            snprintf(ks[nk].id, MEMORY_ID_SIZE, "%s", all[i].id);
            ks[nk++].part = part;
        }
        mem_facts_free(all, na);
    }
    uint64_t rs = cfg->seed;
    int32_t textno = cfg->textno_base;
    const char *ctx[3] = {"A: earlier turn one", "B: earlier turn two", "A: earlier turn three"};
    for (int32_t op = 0; op < cfg->n_ops; op++) {
        int r = (int)(rng_next(&rs) % 100);
        char text[128];
        if (r < 40 || nk == 0) {
            int part = (int)(rng_next(&rs) % N_PARTS);
            text_of(textno, text, sizeof text);
            say("B A %d %d\n", part, (int)textno);
            char id[MEMORY_ID_SIZE];
            memory_add_req req = {.tenant = PART_TENANT[part],
                                  .user = PART_USER[part],
                                  .agent_id = agent_of(textno),
                                  .text = text,
                                  .context = ctx,
                                  .n_context = 3,
                                  .window = MEMORY_WINDOW_DEFAULT};
            if (memory_add(m, &req, id) != IS_OK) CHILD_FAIL("add");
            say("E A %d %d %s\n", part, (int)textno, id);
            ks = realloc(ks, (size_t)(nk + cfg->n_ops + 1) * sizeof *ks);
            snprintf(ks[nk].id, MEMORY_ID_SIZE, "%s", id);
            ks[nk++].part = part;
            textno++;
        } else if (r < 50) {
            /* A batch: its rows commit together (memory_add_batch's group commit). */
            int part = (int)(rng_next(&rs) % N_PARTS);
            char texts[CRASH_BATCH][128], ids[CRASH_BATCH][MEMORY_ID_SIZE];
            memory_add_req reqs[CRASH_BATCH];
            for (int j = 0; j < CRASH_BATCH; j++) {
                text_of(textno + j, texts[j], sizeof texts[j]);
                reqs[j] = (memory_add_req){.tenant = PART_TENANT[part],
                                           .user = PART_USER[part],
                                           .agent_id = agent_of(textno + j),
                                           .text = texts[j],
                                           .context = ctx,
                                           .n_context = 3,
                                           .window = MEMORY_WINDOW_DEFAULT};
            }
            say("B M %d %d\n", part, (int)textno);
            if (memory_add_batch(m, reqs, CRASH_BATCH, ids, NULL) != IS_OK) CHILD_FAIL("add_batch");
            say("E M %d %d %s %s %s\n", part, (int)textno, ids[0], ids[1], ids[2]);
            ks = realloc(ks, (size_t)(nk + CRASH_BATCH + cfg->n_ops + 1) * sizeof *ks);
            for (int j = 0; j < CRASH_BATCH; j++) {
                memcpy(ks[nk].id, ids[j], MEMORY_ID_SIZE);
                ks[nk++].part = part;
            }
            textno += CRASH_BATCH;
        } else if (r < 75) {
            known *k = &ks[rng_next(&rs) % (uint64_t)nk];
            /* Keep the agent of the fact's first text: parity of textno. */
            text_of(textno, text, sizeof text);
            say("B U %s %d\n", k->id, (int)textno);
            if (memory_update(m, PART_TENANT[k->part], PART_USER[k->part], k->id, text, NULL) !=
                IS_OK)
                CHILD_FAIL("update");
            say("E U %s %d\n", k->id, (int)textno);
            textno++;
        } else if (r < 95) {
            int32_t i = (int32_t)(rng_next(&rs) % (uint64_t)nk);
            say("B D %s\n", ks[i].id);
            if (memory_delete(m, PART_TENANT[ks[i].part], PART_USER[ks[i].part], ks[i].id) != IS_OK)
                CHILD_FAIL("delete");
            say("E D %s\n", ks[i].id);
            ks[i] = ks[--nk];
        } else {
            int part = (int)(rng_next(&rs) % N_PARTS);
            say("B X %d\n", part);
            mem_filter f = {.tenant = PART_TENANT[part], .user = PART_USER[part], .agent_id = "a1"};
            int32_t nd;
            if (memory_delete_all(m, &f, &nd) != IS_OK) CHILD_FAIL("delete_all");
            say("E X %d %d\n", part, (int)nd);
            /* Forget what it deleted: re-read the partition. */
            int32_t w = 0;
            for (int32_t i = 0; i < nk; i++)
                if (ks[i].part != part) ks[w++] = ks[i];
            nk = w;
            mem_fact *all;
            int32_t na;
            mem_filter fp = {.tenant = PART_TENANT[part], .user = PART_USER[part]};
            if (memory_get_all(m, &fp, &all, &na) != IS_OK) CHILD_FAIL("get_all");
            ks = realloc(ks, (size_t)(nk + na + cfg->n_ops + 1) * sizeof *ks);
            for (int32_t i = 0; i < na; i++) {
                snprintf(ks[nk].id, MEMORY_ID_SIZE, "%s", all[i].id);
                ks[nk++].part = part;
            }
            mem_facts_free(all, na);
        }
    }
    say("S %lld\n", (long long)g_child.steps);
    _exit(0);
}

/* ---- the parent's model ------------------------------------------------------------ */

typedef struct mfact {
    char id[MEMORY_ID_SIZE];
    int part;
    int32_t textno;       /* current text */
    int32_t agent_textno; /* the text it was added with (decides its agent) */
} mfact;

typedef struct model_state {
    mfact *f;
    int32_t n, cap;
} model_state;

static mfact *model_find(model_state *ms, const char *id) {
    for (int32_t i = 0; i < ms->n; i++)
        if (strcmp(ms->f[i].id, id) == 0) return &ms->f[i];
    return NULL;
}

static void model_add(model_state *ms, const char *id, int part, int32_t textno) {
    if (ms->n == ms->cap) {
        ms->cap = ms->cap ? ms->cap * 2 : 64;
        ms->f = realloc(ms->f, (size_t)ms->cap * sizeof *ms->f);
    }
    mfact *f = &ms->f[ms->n++];
    snprintf(f->id, sizeof f->id, "%s", id);
    f->part = part;
    f->textno = textno;
    f->agent_textno = textno;
}

static void model_remove(model_state *ms, const char *id) {
    mfact *f = model_find(ms, id);
    assert_non_null(f);
    *f = ms->f[--ms->n];
}

static void model_delete_all(model_state *ms, int part) {
    int32_t w = 0;
    for (int32_t i = 0; i < ms->n; i++)
        if (!(ms->f[i].part == part && strcmp(agent_of(ms->f[i].agent_textno), "a1") == 0))
            ms->f[w++] = ms->f[i];
    ms->n = w;
}

/* The operation the child began but did not finish, if any. */
typedef struct pending {
    char kind; /* 0 none, 'A', 'U', 'D', 'X' */
    int part;
    int32_t textno;
    char id[MEMORY_ID_SIZE];
} pending;

typedef struct child_result {
    int64_t steps;   /* "S": fault points of a full run */
    int killed_kind; /* "K": the fault point it died at, -1 if none */
    bool failed;
    char fail_msg[256];
} child_result;

/* Applies the child's report to the model; returns what was in flight. */
static pending apply_report(model_state *ms, char *buf, child_result *res) {
    pending pd = {0};
    res->killed_kind = -1;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char id[MEMORY_ID_SIZE];
        int part, textno, nd;
        long long steps;
        char bid[CRASH_BATCH][MEMORY_ID_SIZE];
        if (sscanf(line, "B M %d %d", &part, &textno) == 2) {
            pd = (pending){'M', part, textno, ""};
        } else if (sscanf(line, "E M %d %d %71s %71s %71s", &part, &textno, bid[0], bid[1],
                          bid[2]) == 2 + CRASH_BATCH) {
            for (int j = 0; j < CRASH_BATCH; j++) model_add(ms, bid[j], part, textno + j);
            pd.kind = 0;
        } else if (sscanf(line, "B A %d %d", &part, &textno) == 2) {
            pd = (pending){'A', part, textno, ""};
        } else if (sscanf(line, "E A %d %d %71s", &part, &textno, id) == 3) {
            model_add(ms, id, part, textno);
            pd.kind = 0;
        } else if (sscanf(line, "B U %71s %d", id, &textno) == 2) {
            pd = (pending){'U', 0, textno, ""};
            snprintf(pd.id, sizeof pd.id, "%s", id);
        } else if (sscanf(line, "E U %71s %d", id, &textno) == 2) {
            mfact *f = model_find(ms, id);
            assert_non_null(f);
            f->textno = textno;
            pd.kind = 0;
        } else if (sscanf(line, "B D %71s", id) == 1) {
            pd = (pending){'D', 0, 0, ""};
            snprintf(pd.id, sizeof pd.id, "%s", id);
        } else if (sscanf(line, "E D %71s", id) == 1) {
            model_remove(ms, id);
            pd.kind = 0;
        } else if (sscanf(line, "B X %d", &part) == 1) {
            pd = (pending){'X', part, 0, ""};
        } else if (sscanf(line, "E X %d %d", &part, &nd) == 2) {
            model_delete_all(ms, part);
            pd.kind = 0;
        } else if (sscanf(line, "S %lld", &steps) == 1) {
            res->steps = steps;
        } else if (sscanf(line, "K %d", &res->killed_kind) == 1) {
        } else if (line[0] == 'F') {
            res->failed = true;
            snprintf(res->fail_msg, sizeof res->fail_msg, "%s", line);
        }
    }
    return pd;
}

/* Runs one child to its end or its death; the report into res, the
 * in-flight operation returned. timer_us > 0: SIGKILL after that long. */
static pending run_child(const crash_cfg *cfg, int64_t timer_us, model_state *ms,
                         child_result *res) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        child_main(cfg, fds[1]);
    }
    close(fds[1]);
    if (timer_us > 0) {
        usleep((useconds_t)timer_us);
        kill(pid, SIGKILL);
    }
    /* Read to EOF (the child's end closes when it dies). */
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = read(fds[0], buf + len, cap - len - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    buf[len] = 0;
    close(fds[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    memset(res, 0, sizeof *res);
    pending pd = apply_report(ms, buf, res);
    free(buf);
    if (res->failed) fail_msg("child failed: %s", res->fail_msg);
    /* A clean end, a step crash, or our SIGKILL: nothing else. */
    bool ok = (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 42)) ||
              (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && timer_us > 0);
    if (!ok) fail_msg("child ended with status 0x%x", status);
    return pd;
}

/* ---- the check ---------------------------------------------------------------------- */

typedef struct verify_cfg {
    bool real;
} verify_cfg;

/* Reopens the directory and checks the invariant against the model, taking
 * the in-flight operation as applied or not, whichever the store shows (and
 * then updating the model to match). Returns 1 if the in-flight operation
 * turned out applied, 0 if not, -1 if there was none. */
static int verify(const verify_cfg *vc, model_state *ms, const pending *pd) {
    memory_params p = memory_default_params();
    if (vc->real) {
        p.embed = no_embed;
        p.embed_dim = 384;
        p.embed_name = "all-MiniLM-L6-v2";
    } else {
        p.embed = fake_embed;
        p.embed_dim = FAKE_DIM;
        p.embed_name = "fake";
    }
    p.store_url = g_pg;
    memory *m = NULL;
    memory_open_report rep;
    if (memory_open(g_dir, &p, &m, &rep) != IS_OK) fail_msg("reopen: %s", is_error_last());
    /* Every committed row had its record before it committed. */
    assert_int_equal(rep.n_missing_kv, 0);
    if (memory_check(m, true) != IS_OK) fail_msg("memory_check: %s", is_error_last());
    int applied = pd->kind ? 0 : -1;
    int32_t n_actual = 0, n_batch = 0; /* facts of the batch in flight found */
    for (int part = 0; part < N_PARTS; part++) {
        mem_filter f = {.tenant = PART_TENANT[part], .user = PART_USER[part]};
        mem_fact *all;
        int32_t na;
        assert_int_equal(mem_store_list(memory_fact_store(m), &f, true, &all, &na), IS_OK);
        n_actual += na;
        for (int32_t i = 0; i < na; i++) {
            mem_fact *a = &all[i];
            mfact *mf = model_find(ms, a->id);
            char want[128];
            if (!mf) {
                /* Only the add (or batch add) in flight may have produced an unknown fact. */
                int32_t tn = -1;
                for (int j = 0; j < (pd->kind == 'M' ? CRASH_BATCH : 1); j++) {
                    text_of(pd->textno + j, want, sizeof want);
                    if (strcmp(a->text, want) == 0) tn = pd->textno + j;
                }
                if ((pd->kind != 'A' && pd->kind != 'M') || pd->part != part || tn < 0)
                    fail_msg("unexpected fact %s '%s' in part %d", a->id, a->text, part);
                n_batch += pd->kind == 'M';
                model_add(ms, a->id, part, tn);
                mf = model_find(ms, a->id);
                applied = 1;
            }
            assert_int_equal(mf->part, part);
            text_of(mf->textno, want, sizeof want);
            if (strcmp(a->text, want) != 0) {
                char newer[128];
                text_of(pd->textno, newer, sizeof newer);
                if (pd->kind != 'U' || strcmp(pd->id, a->id) != 0 || strcmp(a->text, newer) != 0)
                    fail_msg("fact %s has text '%s', expected '%s'", a->id, a->text, want);
                mf->textno = pd->textno;
                applied = 1;
            }
            assert_string_equal(a->agent_id, agent_of(mf->agent_textno));
            /* The embedding is the one of this text (fakes: exactly). */
            if (!vc->real) {
                float e[FAKE_DIM];
                const char *t = a->text;
                fake_embed(NULL, &t, 1, e);
                assert_int_equal(a->dim, FAKE_DIM);
                assert_memory_equal(a->embedding, e, sizeof e);
            }
            /* Its history ends with this text. */
            mem_history *h;
            int32_t nh;
            assert_int_equal(memory_history(m, f.tenant, f.user, a->id, &h, &nh), IS_OK);
            assert_true(h[nh - 1].event != MEM_EVENT_DELETE);
            assert_string_equal(h[nh - 1].new_text, a->text);
            mem_history_free(h, nh);
            /* And search under its user finds it (the rebuilt index). */
            memory_hit *hits;
            int32_t nhit;
            if (!vc->real) {
                assert_int_equal(memory_search(m, &f, a->text, 200, &hits, &nhit), IS_OK);
                bool found = false;
                for (int32_t j = 0; j < nhit; j++) found |= strcmp(hits[j].fact.id, a->id) == 0;
                assert_true(found);
                memory_hits_free(hits, nhit);
            }
        }
        mem_facts_free(all, na);
    }
    /* Facts the model has but the store lacks: only the delete(s) in flight. */
    if (n_actual != ms->n) {
        for (int32_t i = 0; i < ms->n;) {
            mfact *mf = &ms->f[i];
            mem_fact g;
            is_status st = memory_get(m, PART_TENANT[mf->part], PART_USER[mf->part], mf->id, &g);
            if (st == IS_OK) {
                mem_fact_clear(&g);
                i++;
                continue;
            }
            bool ok = (pd->kind == 'D' && strcmp(pd->id, mf->id) == 0) ||
                      (pd->kind == 'X' && pd->part == mf->part &&
                       strcmp(agent_of(mf->agent_textno), "a1") == 0);
            if (!ok) fail_msg("fact %s (text %d) vanished", mf->id, (int)mf->textno);
            applied = 1;
            *mf = ms->f[--ms->n];
        }
    }
    assert_int_equal(n_actual, ms->n);
    /* A batch add is one group commit: all of its facts or none. */
    if (pd->kind == 'M' && n_batch != 0 && n_batch != CRASH_BATCH)
        fail_msg("a batch add left %d of its %d facts", (int)n_batch, CRASH_BATCH);
    /* delete_all is all or nothing: none of its facts may remain if one went. */
    if (pd->kind == 'X' && applied == 1)
        for (int32_t i = 0; i < ms->n; i++)
            assert_false(ms->f[i].part == pd->part &&
                         strcmp(agent_of(ms->f[i].agent_textno), "a1") == 0);
    memory_close(m);
    /* No temporary record file survives the reopen. */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls '%s/kv' | grep -q '\\.tmp\\.'", g_dir);
    assert_int_not_equal(system(cmd), 0);
    return applied;
}

/* ---- tests ------------------------------------------------------------------------- */

static void test_crash_fakes(void **state) {
    model_state ms = {0};
    verify_cfg vc = {.real = false};
    uint64_t rs = 0x5eed;
    double t0 = now_ms();
    /* A full run first: how many fault points and how long a child takes. */
    crash_cfg cfg = {.real = false, .n_ops = 12, .seed = rng_next(&rs), .textno_base = 0};
    child_result res;
    double tc = now_ms();
    pending pd = run_child(&cfg, 0, &ms, &res);
    double child_us = (now_ms() - tc) * 1e3;
    assert_int_equal(pd.kind, 0);
    assert_true(res.steps > 40);
    verify(&vc, &ms, &pd);
    int64_t steps = res.steps;

    int kinds_hit[32] = {0};
    int n_applied = 0, n_not = 0, n_step = 0, n_timer = 0, n_batch = 0;
    int iters = 0;
    for (int it = 1; it <= 160 && now_ms() - t0 < 40e3; it++, iters++) {
        cfg.seed = rng_next(&rs);
        cfg.textno_base = it * 100;
        int64_t timer_us = 0;
        if (it % 2) {
            /* Step mode: every point of the first run's range, spread over the iterations. */
            cfg.kill_step = 1 + (int64_t)(rng_next(&rs) % (uint64_t)steps);
            n_step++;
        } else {
            cfg.kill_step = 0;
            timer_us = 1 + (int64_t)(rng_next(&rs) % (uint64_t)(child_us > 1 ? child_us : 1));
            n_timer++;
        }
        pd = run_child(&cfg, timer_us, &ms, &res);
        if (res.killed_kind >= 0) kinds_hit[res.killed_kind]++;
        n_batch += pd.kind == 'M';
        int a = verify(&vc, &ms, &pd);
        n_applied += a == 1;
        n_not += a == 0;
    }
    /* Some children died inside a batch add. */
    assert_true(n_batch > 0);
    /* Every kind of fault point was crashed at. */
    const int kinds[] = {MEMORY_STEP_EMBEDDED,
                         MEMORY_STEP_KV_WRITTEN,
                         MEMORY_STEP_COMMITTED,
                         MEMORY_STEP_KV_DELETED,
                         10 + RECORD_STORE_STEP_CREATE,
                         10 + RECORD_STORE_STEP_WRITE,
                         10 + RECORD_STORE_STEP_WRITE_REST,
                         10 + RECORD_STORE_STEP_FSYNC,
                         10 + RECORD_STORE_STEP_RENAME,
                         10 + RECORD_STORE_STEP_DIR_FSYNC,
                         20};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        if (!kinds_hit[kinds[i]]) fail_msg("no crash at fault point kind %d", kinds[i]);
    }
    /* Both outcomes of an interrupted operation occurred. */
    assert_true(n_applied > 0 && n_not > 0);
    printf("  %d children (%d step kills, %d timer kills) over %lld fault points; in-flight op "
           "applied %d times, not applied %d times (a batch add %d times); %d facts at the end; "
           "%.1f s\n",
           iters, n_step, n_timer, (long long)steps, n_applied, n_not, n_batch, (int)ms.n,
           (now_ms() - t0) / 1e3);
    assert_true(iters >= 50);
    printf("fault-matrix: crash-points|kill -9 of a writer (add, batch add, update, delete) at "
           "each of its "
           "fault points and at random times, fake models%s|%d|every fact whole or absent after "
           "reopen; the in-flight operation applied %d times, not applied %d times\n",
           g_pg ? ", PostgreSQL store" : "", iters, n_applied, n_not);
    free(ms.f);
}

static void test_crash_real_models(void **state) {
    if (g_pg) TEST_SKIP("the PostgreSQL run crashes the fakes part only");
    struct stat sb;
    if (stat(EMBEDDER_DIR "/model.safetensors", &sb) != 0) TEST_SKIP(TEST_NEEDS_EMBEDDER);
    if (stat(IS_DEFAULT_MODEL, &sb) != 0) TEST_SKIP(TEST_NEEDS_MODEL);
    model_state ms = {0};
    verify_cfg vc = {.real = true};
    uint64_t rs = 0xbeef;
    crash_cfg cfg = {.real = true, .n_ops = 4, .seed = rng_next(&rs), .textno_base = 0};
    child_result res;
    double tc = now_ms();
    pending pd = run_child(&cfg, 0, &ms, &res);
    double child_us = (now_ms() - tc) * 1e3;
    printf("  real models: a full child run takes %.1f s\n", child_us / 1e6);
    verify(&vc, &ms, &pd);
    int64_t steps = res.steps;
    /* Crashes in the first operation of a run (an add when the store is
     * empty, else any): halfway through writing the record, just after the
     * record is written, just after the commit; then two random kills. */
    int64_t kill_steps[3] = {4, 8, 10};
    for (int it = 0; it < 5; it++) {
        cfg.seed = rng_next(&rs);
        cfg.textno_base = (it + 1) * 100;
        cfg.kill_step = it < 3 ? (kill_steps[it] <= steps ? kill_steps[it] : steps) : 0;
        int64_t timer_us = it < 3 ? 0 : (int64_t)(child_us * (0.3 + 0.3 * (it - 3)));
        pd = run_child(&cfg, timer_us, &ms, &res);
        verify(&vc, &ms, &pd);
    }
    /* Now, after the last fork: the records load for the serving model and
     * the embeddings are the embedder's. */
    embedder *e = NULL;
    assert_int_equal(embedder_load(EMBEDDER_DIR, &e), IS_OK);
    backend *be = NULL;
    model *mdl = NULL;
    assert_int_equal(backend_cpu_create(0, &be), IS_OK);
    assert_int_equal(model_load(IS_DEFAULT_MODEL, be, &mdl), IS_OK);
    fact_kv_meta want;
    fact_meta_for_model(mdl, KV_DTYPE_F32, &want);
    memory_params p = memory_default_params();
    p.embedder = e;
    p.embed_name = "all-MiniLM-L6-v2";
    memory *m = NULL;
    assert_int_equal(memory_open(g_dir, &p, &m, NULL), IS_OK);
    int32_t n_checked = 0;
    for (int part = 0; part < N_PARTS; part++) {
        mem_filter f = {.tenant = PART_TENANT[part], .user = PART_USER[part]};
        mem_fact *all;
        int32_t na;
        assert_int_equal(mem_store_list(memory_fact_store(m), &f, true, &all, &na), IS_OK);
        for (int32_t i = 0; i < na; i++) {
            const fact_kv *kv;
            if (record_store_get(memory_record_store(m), all[i].kv_record, &want, &kv) != IS_OK)
                fail_msg("record of %s: %s", all[i].id, is_error_last());
            assert_true(kv->meta.text_hash == fact_text_hash(all[i].text, strlen(all[i].text)));
            assert_int_equal(kv->meta.window, 2);
            record_store_release(memory_record_store(m), kv);
            float v[384];
            const char *t = all[i].text;
            assert_int_equal(embedder_embed(e, &t, 1, v), IS_OK);
            double dot = 0;
            for (int j = 0; j < 384; j++) dot += (double)v[j] * all[i].embedding[j];
            assert_true(dot > 0.9999);
            n_checked++;
        }
        mem_facts_free(all, na);
    }
    assert_int_equal(n_checked, ms.n);
    printf("  real models: %d facts after 6 children (%lld fault points per full run)\n",
           (int)n_checked, (long long)steps);
    printf("fault-matrix: crash-points|kill -9 of a writer with the real model and embedder|6|"
           "every fact whole or absent; stored embeddings those of their texts\n");
    memory_close(m);
    model_free(mdl);
    be->ops->free(be);
    embedder_free(e);
    free(ms.f);
}

/* A LoCoMo import killed at random moments, then completed by a re-run. */
static void test_crash_import(void **state) {
    if (g_pg) TEST_SKIP("the PostgreSQL run crashes the fakes part only");
    locomo_conv *c = NULL;
    if (locomo_load(LOCOMO_26, &c) != IS_OK) TEST_SKIP(TEST_NEEDS_LOCOMO);
    memory_params p = memory_default_params();
    p.embed = fake_embed;
    p.embed_dim = FAKE_DIM;
    p.embed_name = "fake";
    memory_locomo_opts o = {.tenant = "demo", .window = 4, .batch = 8};
    /* How long a full import takes, in a child (timed, not killed). */
    double t_full = 0;
    uint64_t rs = 0x1337;
    for (int it = 0; it < 4; it++) {
        fflush(NULL);
        double t0 = now_ms();
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            memory *m = NULL;
            if (memory_open(g_dir, &p, &m, NULL) != IS_OK) _exit(3);
            memory_set_encoder(m, fake_encode, NULL);
            memory_import_stats st = {0};
            _exit(memory_import_locomo(m, c, &o, &st) == IS_OK && st.failed == 0 ? 0 : 3);
        }
        if (it > 0) {
            usleep((useconds_t)(1 + rng_next(&rs) % (uint64_t)(t_full * 1e3 * 0.8)));
            kill(pid, SIGKILL);
        }
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (it == 0) {
            assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
            t_full = now_ms() - t0;
            /* Start over for the killed runs. */
            char cmd[400];
            snprintf(cmd, sizeof cmd, "rm -rf '%s'/*", g_dir);
            assert_int_equal(system(cmd), 0);
            continue;
        }
        assert_false(WIFEXITED(status) && WEXITSTATUS(status) == 3);
        /* Reopen: whatever the kill left is consistent, and a re-run completes it. */
        memory *m = NULL;
        memory_open_report rep;
        assert_int_equal(memory_open(g_dir, &p, &m, &rep), IS_OK);
        assert_int_equal(rep.n_missing_kv, 0);
        if (memory_check(m, true) != IS_OK) fail_msg("memory_check: %s", is_error_last());
        int64_t present = mem_store_count(memory_fact_store(m));
        assert_true(present >= 0 && present <= c->n_facts);
        memory_set_encoder(m, fake_encode, NULL);
        memory_import_stats st = {0};
        assert_int_equal(memory_import_locomo(m, c, &o, &st), IS_OK);
        assert_int_equal(st.failed, 0);
        assert_int_equal(st.skipped, present);
        assert_int_equal(st.added, c->n_facts - present);
        assert_int_equal(mem_store_count(memory_fact_store(m)), c->n_facts);
        if (memory_check(m, true) != IS_OK) fail_msg("memory_check: %s", is_error_last());
        printf("  import killed after %lld of %d facts; re-run added %lld\n", (long long)present,
               (int)c->n_facts, (long long)st.added);
        memory_close(m);
        /* Start over for the next kill. */
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'/*", g_dir);
        assert_int_equal(system(cmd), 0);
    }
    locomo_free(c);
    printf("fault-matrix: crash-points|kill -9 of a LoCoMo import at a random time|4|"
           "every fact whole or absent; a re-run adds exactly the rest\n");
}

int main(void) {
    g_pg = getenv("IS_PG_URL");
    if (g_pg && !*g_pg) g_pg = NULL;
#ifndef IS_HAVE_LIBPQ
    if (g_pg) {
        fprintf(stderr, "skip: IS_PG_URL is set but this build has no libpq (libpq-dev)\n");
        return TEST_SKIP_CODE;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_crash_fakes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_crash_import, setup, teardown),
        cmocka_unit_test_setup_teardown(test_crash_real_models, setup, teardown),
    };
    return test_run_group(tests, NULL, NULL);
}

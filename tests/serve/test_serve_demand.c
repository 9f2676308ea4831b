/*
 * KV on demand, through `serve` (http_app) over loopback on the default
 * model (CPU): a node's fact KV is a cache of the stored rows.
 *
 * Node A (its own SQLite store) adds two users' facts through the API and
 * encodes their KV at add time. Node B shares A's rows (store_url: A's
 * memory.db, as nodes share PostgreSQL) and has none of the records:
 *   - starting B encodes nothing, and the memory routes report none of
 *     the facts kv_ready on B (their rows name records B does not hold)
 *     while A reports them all;
 *   - B's first chat of a user encodes the user's facts (usage.facts.encoded)
 *     and injects them: the answer is the greedy text of ask (ask_run) on
 *     records ask_encode_facts made of the same facts in the same batch,
 *     and B's records are bitwise those records; the second chat reads them
 *     from disk (usage.facts.disk) and answers the same; /metrics counts
 *     them under tier "encoded"; the user's facts are kv_ready on B from
 *     that first chat on, the other user's not yet;
 *   - B restarted without its record directory (a lost disk loses only
 *     cache) encodes them again and answers the same;
 *   - (CPU) a damaged record file is set aside at its first read and its
 *     fact encoded again by that chat, which answers the same;
 *   - records of another dtype count as missing: the next chat encodes
 *     over them (not kv_ready before it) and answers the same;
 *   - B with a record cap of two records: the other user's chat evicts
 *     the first user's records (the least recently used), whose
 *     next chat encodes them again, answering the same; meanwhile they
 *     are not kv_ready (on the GPU they are: it still holds their KV).
 *
 * Built twice: for the CPU backend (CI) and, as test_serve_demand_cuda
 * (label gpu, exit 77 without a device), for the CUDA backend as `serve
 * --backend cuda` runs it (bf16 cache, GPU fact arena; ask's reference on
 * the same cache): there a fact read again is resident on the GPU (gpu, not
 * disk), and one whose record file was evicted but which the GPU still
 * holds is injected from there, not encoded.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"
#include "kv/record_store.h"
#include "serve/ask.h"
#include "serve/http/app.h"
#include "serve/scheduler.h"
#include "test_http_client.h"
#include "test_util.h"
#ifdef DEMAND_CUDA
#include "backend_cuda.h"
#define DEMAND_BACKEND "cuda"
#define ON_GPU         1
#else
#define DEMAND_BACKEND "cpu"
#define ON_GPU         0
#endif

#define MAX_TOKENS 8
#define N_FACTS    3
#define N_CTX      1024

static char g_dir[] = "/tmp/test_serve_demand_XXXXXX";
static bool g_model;

static const char *const g_facts[2][N_FACTS] = {
    {"Alice plays the cello in a string quartet.", "Alice moved to Porto from Toronto in 2019.",
     "Alice has a grey cat named Miso."},
    {"Bob works as a nurse at the harbour clinic.", "Bob is training for the Lisbon marathon.",
     "Bob's sister Carla paints seascapes."},
};
static const char *const g_users[2] = {"alice", "bob"};
static const char *const g_queries[2] = {"Where did Alice move from, and what does Alice play?",
                                         "What is Bob training for?"};

static int setup(void **state) {
    (void)state;
    struct stat sb;
    g_model = stat(IS_DEFAULT_MODEL, &sb) == 0;
    if (g_model && !mkdtemp(g_dir)) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    return g_model ? test_remove_tree(g_dir) : 0;
}

/* ---- the server --------------------------------------------------------------------- */

static http_app *start(const char *data, const char *store_url, int64_t record_cap) {
    http_app_params p = http_app_default_params();
    p.model_path = IS_DEFAULT_MODEL;
    p.backend = DEMAND_BACKEND;
    p.data_dir = data;
    p.store_url = store_url;
    p.embedder_dir = "none"; /* BM25: every fact names its user, as every query does */
    p.n_ctx = N_CTX;
    p.kv_bytes = (size_t)64 << 20;
    p.record_cache_bytes = record_cap;
    p.http.port = 0;
    p.http.no_auth = true;
    p.http.quiet = true;
    FILE *notes = fopen("/dev/null", "w");
    p.notes = notes;
    http_app *a = NULL;
    is_status st = http_app_start(&p, &a);
    if (notes) fclose(notes);
    if (st != IS_OK) fail_msg("http_app_start: %s", is_error_last());
    return a;
}

/* Record files in dir. */
static int count_records(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        n += l > 4 && strcmp(de->d_name + l - 4, ".fkv") == 0;
    }
    closedir(d);
    return n;
}

typedef struct answer {
    char text[1024];
    int gpu, host, disk, encoded, text_facts;
    int kv_ready; /* memory.kv_ready: the facts with KV on the node as the chat came */
    char ids[N_FACTS][MEMORY_ID_SIZE];
    int n_ids;
} answer;

static int usage_int(const cJSON *facts, const char *name) {
    const cJSON *v = cJSON_GetObjectItem(facts, name);
    assert_non_null(v);
    return (int)cJSON_GetNumberValue(v);
}

static answer chat(http_app *a, int user) {
    char body[1024];
    snprintf(body, sizeof body,
             "{\"user\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"memory\":{\"k\":%d},"
             "\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}]}",
             g_users[user], MAX_TOKENS, N_FACTS, g_queries[user]);
    test_resp r = test_http_request(http_app_port(a), "POST", "/v1/chat/completions", NULL, body,
                                    strlen(body), false, 300);
    if (r.status != 200) fail_msg("chat: %ld %s", r.status, r.body ? r.body : "");
    answer ans;
    memset(&ans, 0, sizeof ans);
    const cJSON *msg = cJSON_GetObjectItem(
        cJSON_GetArrayItem(cJSON_GetObjectItem(r.json, "choices"), 0), "message");
    snprintf(ans.text, sizeof ans.text, "%s",
             cJSON_GetStringValue(cJSON_GetObjectItem(msg, "content")));
    const cJSON *f = cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "usage"), "facts");
    ans.gpu = usage_int(f, "gpu");
    ans.host = usage_int(f, "host");
    ans.disk = usage_int(f, "disk");
    ans.encoded = usage_int(f, "encoded");
    ans.text_facts = usage_int(f, "text");
    ans.kv_ready = usage_int(cJSON_GetObjectItem(r.json, "memory"), "kv_ready");
    const cJSON *ids = cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "memory"), "facts");
    ans.n_ids = cJSON_GetArraySize(ids);
    assert_int_equal(ans.n_ids, N_FACTS);
    for (int i = 0; i < ans.n_ids; i++)
        snprintf(ans.ids[i], sizeof ans.ids[i], "%s",
                 cJSON_GetStringValue(cJSON_GetArrayItem(ids, i)));
    printf("  %s: \"%s\" (facts: gpu %d, host %d, disk %d, encoded %d, text %d)\n", g_users[user],
           ans.text, ans.gpu, ans.host, ans.disk, ans.encoded, ans.text_facts);
    test_resp_free(&r);
    return ans;
}

/* Every fact injected, `encoded` of them encoded for the request (the
 * ones the chat found not kv_ready) and the rest read again: from disk on
 * the CPU (no GPU cache or host tier), from the GPU's fact cache on the GPU. */
static void expect_facts(const answer *a, int encoded) {
    assert_int_equal(a->text_facts, 0);
    assert_int_equal(a->encoded, encoded);
    assert_int_equal(a->kv_ready, N_FACTS - encoded);
    assert_int_equal(a->host, 0);
    assert_int_equal(ON_GPU ? a->gpu : a->disk, N_FACTS - encoded);
}

/* The value of a metric line "name{labels} value" in /metrics. */
static double metric(http_app *a, const char *line_start) {
    test_resp r = test_http_request(http_app_port(a), "GET", "/metrics", NULL, NULL, 0, false, 30);
    assert_int_equal(r.status, 200);
    char want[256];
    snprintf(want, sizeof want, "\n%s", line_start); /* a sample's line, not its # HELP */
    const char *at = r.body ? strstr(r.body, want) : NULL;
    if (!at) fail_msg("/metrics lacks %s", line_start);
    double v = strtod(at + strlen(want), NULL);
    test_resp_free(&r);
    return v;
}

/* How many of a user's N_FACTS facts report kv_ready, through the list
 * route of memories.c and Mem0's filtered list of mem0.c (which agree). */
static int kv_ready(http_app *a, int user) {
    int n[2] = {0, 0};
    for (int route = 0; route < 2; route++) {
        char path[128], body[128];
        snprintf(path, sizeof path, "/v1/memories/?user_id=%s", g_users[user]);
        snprintf(body, sizeof body, "{\"filters\":{\"user_id\":\"%s\"}}", g_users[user]);
        test_resp r =
            route == 0 ? test_http_request(http_app_port(a), "GET", path, NULL, NULL, 0, false, 30)
                       : test_http_request(http_app_port(a), "POST", "/v2/memories/", NULL, body,
                                           strlen(body), false, 30);
        if (r.status != 200) fail_msg("list: %ld %s", r.status, r.body ? r.body : "");
        const cJSON *res = cJSON_GetObjectItem(r.json, "results"), *it;
        assert_int_equal(cJSON_GetArraySize(res), N_FACTS);
        cJSON_ArrayForEach(it, res) {
            const cJSON *v = cJSON_GetObjectItem(it, "kv_ready");
            assert_true(cJSON_IsBool(v));
            n[route] += cJSON_IsTrue(v);
        }
        test_resp_free(&r);
    }
    assert_int_equal(n[0], n[1]);
    return n[0];
}

/* ---- the reference: ask on the same facts ------------------------------------------ */

static bool collect(const char *piece, size_t len, void *ud) {
    char *out = ud;
    size_t at = strlen(out);
    if (at + len >= 1024) len = 1023 - at;
    memcpy(out + at, piece, len);
    out[at + len] = '\0';
    return true;
}

/* ask_encode_facts over the facts in the chat's order (one batch, as the
 * server's encoding on demand, so the same forward), then ask_run. */
static void ask_reference(memory *mem, int user, const answer *order, const char *rec_dir,
                          char *text_out, const char *server_kv_dir) {
    backend *be = NULL;
    model *m = NULL;
    engine *e = NULL;
    record_store *rs = NULL;
    ask_ctx *ac = NULL;
    assert_int_equal(backend_create(DEMAND_BACKEND, 0, &be), IS_OK);
#ifdef DEMAND_CUDA
    if (backend_cuda_configure(be, "kv=bf16") != IS_OK) fail_msg("kv=bf16: %s", is_error_last());
#endif
    assert_int_equal(model_load(IS_DEFAULT_MODEL, be, &m), IS_OK);
    engine_params ep = engine_default_params();
    ep.n_ctx = N_CTX;
    ep.max_seqs = N_FACTS + 2;
    assert_int_equal(engine_create(m, ep, &e), IS_OK);
    assert_int_equal(record_store_open(rec_dir, 1 << 20, &rs), IS_OK);
    assert_int_equal(ask_ctx_create(e, rs, KV_DTYPE_F16, &ac), IS_OK);
    mem_fact rows[N_FACTS];
    ask_fact f[N_FACTS];
    int32_t w[N_FACTS];
    const char *ids[N_FACTS], *texts[N_FACTS];
    char rids[N_FACTS][16];
    for (int i = 0; i < N_FACTS; i++) {
        assert_int_equal(memory_get(mem, "default", g_users[user], order->ids[i], &rows[i]), IS_OK);
        snprintf(rids[i], sizeof rids[i], "ref%d", i);
        f[i] = (ask_fact){rids[i], rows[i].text, (const char *const *)rows[i].context,
                          rows[i].n_context};
        w[i] = rows[i].kv_window;
        ids[i] = rids[i];
        texts[i] = rows[i].text;
    }
    is_status sts[N_FACTS];
    bool did[N_FACTS];
    /* The server's encoding forward takes a step's tokens at most. */
    assert_int_equal(ask_encode_facts(ac, f, w, N_FACTS,
                                      ON_GPU ? SCHED_GPU_STEP_TOKENS : SCHED_CPU_STEP_TOKENS, sts,
                                      did),
                     IS_OK);
    for (int i = 0; i < N_FACTS; i++) assert_true(did[i]);
    /* The server's records of the same facts are these records, bit for bit. */
    if (server_kv_dir) {
        record_store *srs = NULL;
        assert_int_equal(record_store_open(server_kv_dir, 0, &srs), IS_OK);
        for (int i = 0; i < N_FACTS; i++) {
            const fact_kv *mine = NULL, *theirs = NULL;
            assert_non_null(rows[i].kv_record);
            assert_int_equal(record_store_get(rs, rids[i], NULL, &mine), IS_OK);
            assert_int_equal(record_store_get(srs, rows[i].kv_record, NULL, &theirs), IS_OK);
            assert_int_equal(mine->meta.n_tokens, theirs->meta.n_tokens);
            size_t bytes = fact_kv_bytes(&mine->meta);
            assert_int_equal(bytes, fact_kv_bytes(&theirs->meta));
            assert_memory_equal(mine->k, theirs->k, bytes);
            assert_memory_equal(mine->v, theirs->v, bytes);
            record_store_release(rs, mine);
            record_store_release(srs, theirs);
        }
        record_store_close(srs);
    }
    ask_request ar = {.mode = ASK_MODE_KV,
                      .query = g_queries[user],
                      .fact_ids = ids,
                      .fact_texts = texts,
                      .n_facts = N_FACTS,
                      .max_tokens = MAX_TOKENS,
                      .temperature = 0,
                      .top_k = 0,
                      .top_p = 1.0f};
    text_out[0] = '\0';
    ask_timing t;
    assert_int_equal(ask_run(ac, &ar, collect, text_out, &t), IS_OK);
    printf("  ask (%s): \"%s\"\n", g_users[user], text_out);
    for (int i = 0; i < N_FACTS; i++) mem_fact_clear(&rows[i]);
    ask_ctx_free(ac);
    record_store_close(rs);
    engine_free(e);
    model_free(m);
    be->ops->free(be);
}

/* ---- the test --------------------------------------------------------------------------- */

static void test_kv_on_demand(void **state) {
    (void)state;
    if (!g_model) TEST_SKIP(TEST_NEEDS_MODEL);
    char a_dir[400], b_dir[400], b_kv[420], a_db[420], ref_dir[400];
    snprintf(a_dir, sizeof a_dir, "%s/a", g_dir);
    snprintf(b_dir, sizeof b_dir, "%s/b", g_dir);
    snprintf(b_kv, sizeof b_kv, "%s/kv", b_dir);
    snprintf(a_db, sizeof a_db, "%s/memory.db", a_dir);
    snprintf(ref_dir, sizeof ref_dir, "%s/ref", g_dir);

    /* Node A: the facts added through it are encoded there, at add time. */
    http_app *a = start(a_dir, NULL, -1);
    for (int u = 0; u < 2; u++) {
        char body[1024];
        snprintf(body, sizeof body, "{\"user_id\":\"%s\",\"facts\":[\"%s\",\"%s\",\"%s\"]}",
                 g_users[u], g_facts[u][0], g_facts[u][1], g_facts[u][2]);
        test_resp r = test_http_request(http_app_port(a), "POST", "/v1/memories/", NULL, body,
                                        strlen(body), false, 60);
        if (r.status != 200) fail_msg("add: %ld %s", r.status, r.body ? r.body : "");
        test_resp_free(&r);
    }
    sched_stats ss;
    for (int i = 0; i < 1200; i++) { /* 2 minutes at most */
        sched_get_stats(http_app_sched(a), &ss);
        if (ss.facts_encoded >= 2 * N_FACTS && ss.encode_queued == 0) break;
        usleep(100 * 1000);
    }
    assert_int_equal(ss.facts_encoded, 2 * N_FACTS);
    assert_int_equal(kv_ready(a, 0), N_FACTS);
    assert_int_equal(kv_ready(a, 1), N_FACTS);
    http_app_stop(a);

    /* Node B on A's rows: its start encodes nothing. */
    http_app *b = start(b_dir, a_db, -1);
    usleep(300 * 1000);
    sched_get_stats(http_app_sched(b), &ss);
    assert_int_equal(ss.facts_encoded + ss.encode_queued, 0);
    assert_int_equal(count_records(b_kv), 0);
    /* The rows name records (A's), which B does not hold. */
    assert_int_equal(kv_ready(b, 0), 0);
    assert_int_equal(kv_ready(b, 1), 0);

    answer first = chat(b, 0);
    expect_facts(&first, N_FACTS);
    assert_int_equal(count_records(b_kv), N_FACTS);
    assert_int_equal(kv_ready(b, 0), N_FACTS);
    assert_int_equal(kv_ready(b, 1), 0);
    answer second = chat(b, 0);
    expect_facts(&second, 0);
    assert_string_equal(second.text, first.text);
    assert_true(metric(b, "inferscale_facts_served_total{tier=\"encoded\"} ") == N_FACTS);
    assert_true(metric(b, ON_GPU ? "inferscale_facts_served_total{tier=\"gpu\"} "
                                 : "inferscale_facts_served_total{tier=\"disk\"} ") == N_FACTS);
    answer bob = chat(b, 1);
    expect_facts(&bob, N_FACTS);
    assert_int_equal(kv_ready(b, 1), N_FACTS);
    size_t rec_bytes = 0;
    {
        DIR *d = opendir(b_kv);
        struct dirent *de;
        while (d && (de = readdir(d)) != NULL) {
            struct stat sb;
            char path[700];
            snprintf(path, sizeof path, "%s/%s", b_kv, de->d_name);
            if (strstr(de->d_name, ".fkv") && stat(path, &sb) == 0 &&
                (size_t)sb.st_size > rec_bytes)
                rec_bytes = (size_t)sb.st_size;
        }
        if (d) closedir(d);
    }
    assert_true(rec_bytes > 0);
    http_app_stop(b);
    /* ask on A's rows, B's records compared once B let them go. */
    memory_params mp = memory_default_params();
    memory *mem = NULL;
    assert_int_equal(memory_open(a_dir, &mp, &mem, NULL), IS_OK);
    char ref[1024];
    ask_reference(mem, 0, &first, ref_dir, ref, b_kv);
    memory_close(mem);
    assert_string_equal(first.text, ref);

    /* A lost record directory loses only cache. */
    assert_int_equal(test_remove_tree(b_kv), 0);
    b = start(b_dir, a_db, -1);
    assert_int_equal(count_records(b_kv), 0);
    assert_int_equal(kv_ready(b, 0), 0);
    answer again = chat(b, 0);
    expect_facts(&again, N_FACTS);
    assert_int_equal(kv_ready(b, 0), N_FACTS);
    assert_string_equal(again.text, first.text);
    answer bob_again = chat(b, 1);
    expect_facts(&bob_again, N_FACTS);
    assert_string_equal(bob_again.text, bob.text);
    http_app_stop(b);

    /* A damaged record is set aside at its first read (kept in corrupt/)
     * and its fact encoded again by the same chat, not prefilled as text
     * from then on. (On the GPU the fact may still be resident there.) */
    if (!ON_GPU) {
        char path[800], aside[800];
        snprintf(path, sizeof path, "%s/%s-v1.fkv", b_kv, again.ids[0]);
        snprintf(aside, sizeof aside, "%s/" RECORD_STORE_CORRUPT_DIR "/%s-v1.fkv", b_kv,
                 again.ids[0]);
        size_t n = 0;
        uint8_t *bytes = test_read_file(path, &n);
        assert_non_null(bytes);
        bytes[n / 2] ^= 0x40;
        assert_true(test_write_file(path, bytes, n));
        free(bytes);
        b = start(b_dir, a_db, -1);
        answer healed = chat(b, 0);
        assert_int_equal(healed.text_facts, 0);
        assert_int_equal(healed.encoded, 1);
        assert_int_equal(healed.disk, N_FACTS - 1);
        assert_string_equal(healed.text, first.text);
        assert_int_equal(access(aside, F_OK), 0);
        assert_true(metric(b, "inferscale_fact_kv_corrupt_total ") == 1);
        answer after = chat(b, 0); /* the new record, from disk */
        expect_facts(&after, 0);
        assert_string_equal(after.text, first.text);
        http_app_stop(b);
    }

    /* Records of another dtype (a server started before with another
     * --kv-dtype) count as missing: the chat encodes over them, where it
     * used to prefill the facts as text at every request. A fresh server
     * holds nothing on the GPU, so this runs on both backends. */
    {
        record_store *rs = NULL;
        assert_int_equal(record_store_open(b_kv, 0, &rs), IS_OK);
        for (int i = 0; i < N_FACTS; i++) {
            char rid[MEMORY_ID_SIZE + 8];
            snprintf(rid, sizeof rid, "%s-v1", again.ids[i]);
            const fact_kv *kv = NULL;
            assert_int_equal(record_store_get(rs, rid, NULL, &kv), IS_OK);
            fact_kv_meta other = kv->meta;
            other.dtype = other.dtype == KV_DTYPE_F32 ? KV_DTYPE_BF16 : KV_DTYPE_F32;
            size_t n = (size_t)other.n_layers * other.n_tokens * fact_kv_row_elems(&other);
            float *wide = malloc(n * sizeof *wide);
            void *k = malloc(fact_kv_bytes(&other)), *v = malloc(fact_kv_bytes(&other));
            assert_true(wide && k && v);
            fact_kv_widen(&kv->meta, kv->k, wide);
            fact_kv_narrow(&other, wide, k);
            fact_kv_widen(&kv->meta, kv->v, wide);
            fact_kv_narrow(&other, wide, v);
            assert_int_equal(record_store_put(rs, rid, &other, kv->tokens, k, v), IS_OK);
            record_store_release(rs, kv);
            free(wide), free(k), free(v);
        }
        record_store_close(rs);
        b = start(b_dir, a_db, -1);
        assert_int_equal(kv_ready(b, 0), 0);
        answer redone = chat(b, 0);
        expect_facts(&redone, N_FACTS);
        assert_string_equal(redone.text, first.text);
        answer after = chat(b, 0); /* the server's dtype, from disk or the GPU */
        expect_facts(&after, 0);
        assert_string_equal(after.text, first.text);
        http_app_stop(b);
    }

    /* Room for two records: each user's chat evicts the other's (the
     * least recently used; its own batch is spared), which are encoded
     * again by their next chat. */
    b = start(b_dir, a_db, (int64_t)(rec_bytes * 2));
    assert_true(count_records(b_kv) <= 3);
    for (int round = 0; round < 2; round++) {
        answer al = chat(b, 0);
        assert_int_equal(al.text_facts, 0);
        assert_int_equal(al.gpu + al.disk + al.encoded, N_FACTS);
        assert_string_equal(al.text, first.text);
        answer bo = chat(b, 1);
        assert_int_equal(bo.text_facts, 0);
        assert_int_equal(bo.gpu + bo.disk + bo.encoded, N_FACTS);
        if (!ON_GPU) assert_int_equal(bo.encoded, N_FACTS); /* alice's chat evicted them */
        assert_string_equal(bo.text, bob.text);
        assert_true(count_records(b_kv) <= N_FACTS);
        /* Bob's records took the room of alice's, whose KV only the GPU still holds. */
        assert_int_equal(kv_ready(b, 1), N_FACTS);
        assert_int_equal(kv_ready(b, 0), ON_GPU ? N_FACTS : 0);
    }
    answer al = chat(b, 0);
    if (!ON_GPU) expect_facts(&al, N_FACTS);
    assert_string_equal(al.text, first.text);
    /* At the start, then (CPU) at every chat: the GPU still holds the KV of
     * records evicted from disk, so it encodes nothing again. */
    assert_true(metric(b, "inferscale_fact_kv_disk_evictions_total ") >=
                (ON_GPU ? 3 : 3 * N_FACTS));
    http_app_stop(b);
}

int main(void) {
#ifdef DEMAND_CUDA
    /* Without a device (CI) the program reports itself skipped. */
    if (!backend_cuda_available()) {
        printf("no usable CUDA device: skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_on_demand),
    };
    return test_run_group(tests, setup, teardown);
}

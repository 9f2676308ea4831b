/* Record store: put/get/delete/overwrite, the cache under pressure with
 * records held, reopening, refusals, corrupted and half-written files, and
 * crashes or failures injected at every step of a put. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "core/status.h"
#include "kv/record_store.h"
#include "test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------------ */

enum { NL = 2, NH = 2, HD = 8, NT = 4, NELEM = NL * NT * NH * HD };

/* A record whose every value derives from `version`, so content identifies it. */
typedef struct rec {
    fact_kv_meta m;
    int32_t tokens[NT];
    float k[NELEM], v[NELEM];
} rec;

static void rec_make(rec *r, int version) {
    memset(r, 0, sizeof *r);
    strcpy(r->m.model_fingerprint, "00112233aabbccdd");
    r->m.dtype = KV_DTYPE_F32;
    r->m.n_layers = NL;
    r->m.n_kv_heads = NH;
    r->m.head_dim = HD;
    r->m.n_tokens = NT;
    r->m.rope_n_rot = HD;
    r->m.rope_freq_base = 10000.0f;
    r->m.rope_freq_scale = 1.0f;
    r->m.window = 0;
    r->m.text_hash = (uint64_t)version * 977;
    for (int i = 0; i < NT; i++) r->tokens[i] = version * 10 + i;
    for (int i = 0; i < NELEM; i++) {
        r->k[i] = (float)version + (float)i / 1024.0f;
        r->v[i] = -(float)version - (float)i / 512.0f;
    }
}

static size_t rec_bytes(void) {
    rec r;
    rec_make(&r, 0);
    size_t n;
    assert_int_equal(fact_record_size(&r.m, &n), IS_OK);
    return n;
}

static void put_version(record_store *s, const char *id, int version) {
    rec r;
    rec_make(&r, version);
    assert_int_equal(record_store_put(s, id, &r.m, r.tokens, r.k, r.v), IS_OK);
}

/* Asserts kv is exactly record `version`. */
static void assert_is_version(const fact_kv *kv, int version) {
    rec r;
    rec_make(&r, version);
    assert_int_equal(kv->meta.n_tokens, NT);
    assert_true(kv->meta.text_hash == r.m.text_hash);
    assert_memory_equal(kv->tokens, r.tokens, sizeof r.tokens);
    assert_memory_equal(kv->k, r.k, sizeof r.k);
    assert_memory_equal(kv->v, r.v, sizeof r.v);
}

static void assert_get_version(record_store *s, const char *id, int version) {
    const fact_kv *kv = NULL;
    is_status st = record_store_get(s, id, NULL, &kv);
    if (st != IS_OK) fail_msg("get %s: %s", id, is_error_last());
    assert_is_version(kv, version);
    record_store_release(s, kv);
}

static char *make_tmp_dir(void) {
    char *d = strdup("/tmp/is_record_store_XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    char path[512];
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* Files in dir whose name contains `part`. */
static int count_files(const char *dir, const char *part) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (strstr(de->d_name, part)) n++;
    closedir(d);
    return n;
}

/* ---- basic operations ------------------------------------------------------------- */

static void test_put_get_delete(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    const fact_kv *kv = (const fact_kv *)0x1;
    assert_int_equal(record_store_get(s, "alice-1", NULL, &kv), IS_ERR_NOT_FOUND);
    assert_ptr_equal(kv, (const fact_kv *)0x1);
    assert_false(record_store_contains(s, "alice-1"));

    put_version(s, "alice-1", 1);
    put_version(s, "bob_2", 2);
    assert_true(record_store_contains(s, "alice-1"));
    assert_get_version(s, "alice-1", 1);
    assert_get_version(s, "bob_2", 2);

    assert_int_equal(record_store_delete(s, "alice-1"), IS_OK);
    assert_false(record_store_contains(s, "alice-1"));
    assert_int_equal(record_store_get(s, "alice-1", NULL, &kv), IS_ERR_NOT_FOUND);
    assert_int_equal(record_store_delete(s, "alice-1"), IS_ERR_NOT_FOUND);
    assert_get_version(s, "bob_2", 2); /* the neighbour is untouched */

    char path[512];
    snprintf(path, sizeof path, "%s/bob_2.fkv", dir);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal((size_t)sb.st_size, rec_bytes());
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

static void test_invalid_ids(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    rec r;
    rec_make(&r, 1);
    const char *bad[] = {"", "a/b", "..", "a.b", "x y", "caf\xc3\xa9", "../etc/passwd", "a.fkv"};
    const fact_kv *kv;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_false(record_store_id_valid(bad[i]));
        assert_int_equal(record_store_put(s, bad[i], &r.m, r.tokens, r.k, r.v), IS_ERR_INVALID_ARG);
        assert_int_equal(record_store_get(s, bad[i], NULL, &kv), IS_ERR_INVALID_ARG);
        assert_int_equal(record_store_delete(s, bad[i]), IS_ERR_INVALID_ARG);
        assert_false(record_store_contains(s, bad[i]));
    }
    assert_int_equal(record_store_put(s, NULL, &r.m, r.tokens, r.k, r.v), IS_ERR_INVALID_ARG);
    char id[66];
    memset(id, 'a', 65);
    id[65] = '\0';
    assert_int_equal(record_store_put(s, id, &r.m, r.tokens, r.k, r.v), IS_ERR_INVALID_ARG);
    id[64] = '\0'; /* 64 characters is the longest valid id */
    assert_int_equal(record_store_put(s, id, &r.m, r.tokens, r.k, r.v), IS_OK);
    assert_get_version(s, id, 1);
    /* A bad meta is refused before anything touches the disk. */
    r.m.n_layers = 0;
    assert_int_equal(record_store_put(s, "ok", &r.m, r.tokens, r.k, r.v), IS_ERR_INVALID_ARG);
    assert_false(record_store_contains(s, "ok"));
    assert_int_equal(count_files(dir, ".tmp."), 0);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

static void test_overwrite_keeps_held_copy(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "f", 1);
    const fact_kv *old;
    assert_int_equal(record_store_get(s, "f", NULL, &old), IS_OK);
    put_version(s, "f", 2);
    assert_get_version(s, "f", 2);
    assert_is_version(old, 1); /* still valid and unchanged */
    assert_int_equal(record_store_delete(s, "f"), IS_OK);
    assert_is_version(old, 1);
    assert_int_equal(record_store_get_stats(s).n_held, 1);
    record_store_release(s, old);
    assert_int_equal(record_store_get_stats(s).n_held, 0);
    assert_int_equal(record_store_get_stats(s).n_cached, 0);
    assert_int_equal(record_store_get_stats(s).bytes_cached, 0);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* content_id names the bytes: equal for equal records under any id, new
 * when a record is overwritten with other values, kept across a reopen. */
static void test_content_id(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "a", 1);
    put_version(s, "b", 1);
    const fact_kv *a1, *b1, *a2, *b3;
    assert_int_equal(record_store_get(s, "a", NULL, &a1), IS_OK);
    assert_int_equal(record_store_get(s, "b", NULL, &b1), IS_OK);
    assert_true(a1->content_id != 0);
    assert_true(a1->content_id == b1->content_id);
    put_version(s, "a", 2);
    assert_int_equal(record_store_get(s, "a", NULL, &a2), IS_OK);
    assert_true(a2->content_id != 0 && a2->content_id != a1->content_id);
    uint64_t b_id = b1->content_id;
    record_store_release(s, a1);
    record_store_release(s, b1);
    record_store_release(s, a2);
    record_store_close(s);
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    assert_int_equal(record_store_get(s, "b", NULL, &b3), IS_OK);
    assert_true(b3->content_id == b_id);
    record_store_release(s, b3);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

static void test_reopen_sees_data(void **state) {
    char *dir = make_tmp_dir();
    char sub[512];
    snprintf(sub, sizeof sub, "%s/nested/store", dir); /* created with parents */
    record_store *s;
    assert_int_equal(record_store_open(sub, 1 << 20, &s), IS_OK);
    put_version(s, "a", 1);
    put_version(s, "b", 2);
    put_version(s, "a", 3);
    /* A second open of an open store is refused. */
    record_store *s2 = (record_store *)0x1;
    assert_int_equal(record_store_open(sub, 1 << 20, &s2), IS_ERR_IO);
    assert_ptr_equal(s2, (record_store *)0x1);
    record_store_close(s);

    assert_int_equal(record_store_open(sub, 1 << 20, &s), IS_OK);
    assert_get_version(s, "a", 3);
    assert_get_version(s, "b", 2);
    assert_get_version(s, "a", 3);
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.misses, 2); /* first reads came from disk */
    assert_int_equal(st.hits, 1);
    assert_int_equal(st.n_cached, 2);
    assert_int_equal(st.bytes_cached, 2 * rec_bytes());
    record_store_close(s);
    snprintf(sub, sizeof sub, "%s/nested/store", dir);
    remove_tree(sub);
    snprintf(sub, sizeof sub, "%s/nested", dir);
    rmdir(sub);
    remove_tree(dir);
    free(dir);
}

/* ---- the cache --------------------------------------------------------------------------- */

static void test_eviction_with_records_held(void **state) {
    char *dir = make_tmp_dir();
    size_t rb = rec_bytes();
    record_store *s;
    /* Room for two and a half records. */
    assert_int_equal(record_store_open(dir, rb * 5 / 2, &s), IS_OK);
    char id[16];
    for (int i = 0; i < 6; i++) {
        snprintf(id, sizeof id, "r%d", i);
        put_version(s, id, i);
    }
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.n_cached, 2);
    assert_int_equal(st.bytes_cached, 2 * rb);
    assert_int_equal(st.evictions, 4);

    /* Hold all six: four come from disk, two from the cache; the cache
     * keeps evicting while every record stays readable. */
    const fact_kv *held[6];
    for (int i = 0; i < 6; i++) {
        snprintf(id, sizeof id, "r%d", i);
        assert_int_equal(record_store_get(s, id, NULL, &held[i]), IS_OK);
        assert_true(record_store_get_stats(s).bytes_cached <= rb * 5 / 2);
    }
    st = record_store_get_stats(s);
    assert_int_equal(st.n_held, 6);
    assert_int_equal(st.hits, 0); /* r4, r5 were evicted by the reads of r0.. r3 */
    assert_int_equal(st.misses, 6);
    for (int i = 0; i < 6; i++) assert_is_version(held[i], i);
    /* Least recently used goes first: r4, r5 are the cached pair now; a get
     * of r4 then r0 evicts r5. */
    const fact_kv *again;
    assert_int_equal(record_store_get(s, "r4", NULL, &again), IS_OK);
    record_store_release(s, again);
    assert_int_equal(record_store_get_stats(s).hits, 1);
    assert_int_equal(record_store_get(s, "r0", NULL, &again), IS_OK);
    record_store_release(s, again);
    assert_int_equal(record_store_get(s, "r4", NULL, &again), IS_OK);
    record_store_release(s, again);
    assert_int_equal(record_store_get_stats(s).hits, 2);
    for (int i = 0; i < 6; i++) {
        assert_is_version(held[i], i);
        record_store_release(s, held[i]);
    }
    assert_int_equal(record_store_get_stats(s).n_held, 0);
    record_store_close(s);

    /* No cache at all: everything is read from disk every time. */
    assert_int_equal(record_store_open(dir, 0, &s), IS_OK);
    assert_get_version(s, "r1", 1);
    assert_get_version(s, "r1", 1);
    st = record_store_get_stats(s);
    assert_int_equal(st.hits, 0);
    assert_int_equal(st.misses, 2);
    assert_int_equal(st.n_cached, 0);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* ---- refusals ----------------------------------------------------------------------------- */

static void test_get_refuses_other_model(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "f", 1);
    rec r;
    rec_make(&r, 1);
    fact_kv_meta other = r.m;
    strcpy(other.model_fingerprint, "ffffffffffffffff");
    const fact_kv *kv = (const fact_kv *)0x1;
    for (int pass = 0; pass < 2; pass++) { /* from the cache, then from disk */
        assert_int_equal(record_store_get(s, "f", &other, &kv), IS_ERR_MISMATCH);
        assert_non_null(strstr(is_error_last(), "ffffffffffffffff"));
        assert_non_null(strstr(is_error_last(), "00112233aabbccdd"));
        assert_ptr_equal(kv, (const fact_kv *)0x1);
        fact_kv_meta dt = r.m;
        dt.dtype = KV_DTYPE_F16;
        assert_int_equal(record_store_get(s, "f", &dt, &kv), IS_ERR_MISMATCH);
        fact_kv_meta base = r.m;
        base.rope_freq_base = 500000.0f;
        assert_int_equal(record_store_get(s, "f", &base, &kv), IS_ERR_MISMATCH);
        assert_int_equal(record_store_get_stats(s).n_held, 0);
        record_store_close(s);
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    }
    /* The record itself is fine for the model it was made for. */
    fact_kv_meta same = r.m;
    same.n_tokens = 99; /* not compared */
    assert_int_equal(record_store_get(s, "f", &same, &kv), IS_OK);
    assert_is_version(kv, 1);
    record_store_release(s, kv);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* Once the store is told its serving model, a record of another counts
 * as missing (so what encodes missing facts encodes over it), from the
 * cache or from the file's header; a file whose header does not parse
 * still counts (its read sets it aside, then it is missing). */
static void test_contains_counts_serving_model(void **state) {
    (void)state;
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "f", 1);
    put_version(s, "g", 2);
    rec r;
    rec_make(&r, 1);
    fact_kv_meta f16 = r.m, other = r.m;
    f16.dtype = KV_DTYPE_F16;
    strcpy(other.model_fingerprint, "ffffffffffffffff");
    for (int pass = 0; pass < 2; pass++) { /* cached, then from disk */
        record_store_set_model(s, NULL);
        assert_true(record_store_contains(s, "f"));
        record_store_set_model(s, &r.m);
        assert_true(record_store_contains(s, "f"));
        assert_true(record_store_contains(s, "g"));
        assert_false(record_store_contains(s, "h"));
        record_store_set_model(s, &f16);
        assert_false(record_store_contains(s, "f"));
        record_store_set_model(s, &other);
        assert_false(record_store_contains(s, "g"));
        if (pass == 0) {
            assert_get_version(s, "f", 1); /* cached */
            record_store_close(s);
            assert_int_equal(record_store_open(dir, 0, &s), IS_OK);
        }
    }
    /* A header that does not parse. */
    char path[600];
    snprintf(path, sizeof path, "%s/f.fkv", dir);
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    assert_int_equal(fputc('X', fp), 'X'); /* the magic */
    fclose(fp);
    assert_true(record_store_contains(s, "f"));
    const fact_kv *kv = NULL;
    assert_int_equal(record_store_get(s, "f", NULL, &kv), IS_ERR_FORMAT);
    assert_false(record_store_contains(s, "f"));
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

static void test_corrupt_file_refused_neighbours_load(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "a", 1);
    put_version(s, "b", 2);
    put_version(s, "c", 3);
    record_store_close(s);

    char path[512];
    snprintf(path, sizeof path, "%s/b.fkv", dir);
    size_t n;
    uint8_t *bytes = test_read_file(path, &n);
    assert_non_null(bytes);
    bytes[n / 2] ^= 0x10;
    assert_true(test_write_file(path, bytes, n));

    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    const fact_kv *kv = (const fact_kv *)0x1;
    assert_true(record_store_contains(s, "b"));
    assert_int_equal(record_store_get(s, "b", NULL, &kv), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "b.fkv"));
    assert_non_null(strstr(is_error_last(), "checksum"));
    assert_ptr_equal(kv, (const fact_kv *)0x1);
    /* Set aside: the store reads as without it (so its fact is encoded
     * again), never cached. */
    assert_false(record_store_contains(s, "b"));
    assert_int_equal(record_store_get(s, "b", NULL, &kv), IS_ERR_NOT_FOUND);
    assert_ptr_equal(kv, (const fact_kv *)0x1);
    assert_get_version(s, "a", 1);
    assert_get_version(s, "c", 3);
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.n_cached, 2);
    assert_int_equal(st.n_held, 0);
    assert_int_equal(st.n_corrupt, 1);
    /* The damaged file is kept as it was, for inspection, in corrupt/; a
     * new put of the id is a record like any other. */
    char aside[600];
    snprintf(aside, sizeof aside, "%s/" RECORD_STORE_CORRUPT_DIR "/b.fkv", dir);
    size_t n2;
    uint8_t *after = test_read_file(aside, &n2);
    assert_non_null(after);
    assert_int_equal(n2, n);
    assert_memory_equal(after, bytes, n);
    free(after);
    put_version(s, "b", 4);
    assert_get_version(s, "b", 4);
    record_store_close(s);
    free(bytes);
    remove_tree(dir);
    free(dir);
}

/* ---- crashes --------------------------------------------------------------------------------- */

static void test_leftover_tmp_and_half_written_file(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "whole", 1);
    record_store_close(s);

    char path[512];
    snprintf(path, sizeof path, "%s/whole.fkv", dir);
    size_t n;
    uint8_t *bytes = test_read_file(path, &n);
    assert_non_null(bytes);
    /* A writer that died mid-write left a temporary file ... */
    snprintf(path, sizeof path, "%s/whole.fkv.tmp.4242.7", dir);
    assert_true(test_write_file(path, bytes, n / 3));
    snprintf(path, sizeof path, "%s/other.fkv.tmp.4242.8", dir);
    assert_true(test_write_file(path, bytes, n));
    /* ... and a file system without rename atomicity (or a hand copy) left
     * a final file cut short, and an empty one. */
    snprintf(path, sizeof path, "%s/half.fkv", dir);
    assert_true(test_write_file(path, bytes, n / 2));
    snprintf(path, sizeof path, "%s/empty.fkv", dir);
    assert_true(test_write_file(path, bytes, 0));
    assert_int_equal(count_files(dir, ".tmp."), 2);

    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    assert_int_equal(count_files(dir, ".tmp."), 0);
    assert_false(record_store_contains(s, "other")); /* a temporary file is no record */
    const fact_kv *kv;
    assert_int_equal(record_store_get(s, "other", NULL, &kv), IS_ERR_NOT_FOUND);
    assert_int_equal(record_store_get(s, "half", NULL, &kv), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "half.fkv"));
    assert_non_null(strstr(is_error_last(), "truncated"));
    assert_int_equal(record_store_get(s, "empty", NULL, &kv), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "empty.fkv"));
    assert_get_version(s, "whole", 1);
    record_store_close(s);
    free(bytes);
    remove_tree(dir);
    free(dir);
}

typedef struct fault_plan {
    record_store_step at;
    bool crash; /* _exit() there, else make the step fail */
} fault_plan;

static bool fault_hook(record_store_step step, void *user) {
    fault_plan *p = user;
    if (step != p->at) return true;
    if (p->crash) _exit(0);
    return false;
}

/* A child process dies at each step of a put, over an existing record and
 * over a missing one; the next open finds the old record or the new one,
 * whole, and no temporary file. */
static void test_crash_at_every_step(void **state) {
    for (int at = 0; at < RECORD_STORE_STEP_COUNT_; at++) {
        char *dir = make_tmp_dir();
        record_store *s;
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        put_version(s, "x", 1);
        record_store_close(s);

        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            record_store *c;
            if (record_store_open(dir, 1 << 20, &c) != IS_OK) _exit(2);
            fault_plan plan = {(record_store_step)at, true};
            record_store_set_fault_hook(c, fault_hook, &plan);
            rec r;
            rec_make(&r, 2);
            record_store_put(c, "x", &r.m, r.tokens, r.k, r.v);
            rec_make(&r, 3);
            record_store_put(c, "y", &r.m, r.tokens, r.k, r.v);
            _exit(3); /* the hook should have ended us */
        }
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        /* Before the rename the old record stands; after it, the new. */
        bool renamed = at > RECORD_STORE_STEP_RENAME;
        assert_int_equal(count_files(dir, ".tmp."),
                         at == RECORD_STORE_STEP_CREATE || renamed ? 0 : 1);

        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        assert_int_equal(count_files(dir, ".tmp."), 0);
        assert_get_version(s, "x", renamed ? 2 : 1);
        const fact_kv *kv;
        assert_int_equal(record_store_get(s, "y", NULL, &kv), IS_ERR_NOT_FOUND);
        record_store_close(s);
        remove_tree(dir);
        free(dir);
    }
}

/* Each step failing (as a full disk or an I/O error would): the put says
 * IS_ERR_IO and leaves the old record, the cache and no temporary file. */
static void test_failure_at_every_step(void **state) {
    for (int at = 0; at < RECORD_STORE_STEP_COUNT_; at++) {
        char *dir = make_tmp_dir();
        record_store *s;
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        put_version(s, "x", 1);
        const fact_kv *held;
        assert_int_equal(record_store_get(s, "x", NULL, &held), IS_OK);
        fault_plan plan = {(record_store_step)at, false};
        record_store_set_fault_hook(s, fault_hook, &plan);
        rec r;
        rec_make(&r, 2);
        assert_int_equal(record_store_put(s, "x", &r.m, r.tokens, r.k, r.v), IS_ERR_IO);
        assert_non_null(strstr(is_error_last(), "record store"));
        rec_make(&r, 3);
        assert_int_equal(record_store_put(s, "fresh", &r.m, r.tokens, r.k, r.v), IS_ERR_IO);
        record_store_set_fault_hook(s, NULL, NULL);
        assert_int_equal(count_files(dir, ".tmp."), 0);
        bool renamed = at == RECORD_STORE_STEP_DIR_FSYNC;
        /* The cache agrees with the disk, before and after a reopen. */
        for (int pass = 0; pass < 2; pass++) {
            assert_get_version(s, "x", renamed ? 2 : 1);
            if (renamed) {
                assert_get_version(s, "fresh", 3);
            } else {
                const fact_kv *kv;
                assert_int_equal(record_store_get(s, "fresh", NULL, &kv), IS_ERR_NOT_FOUND);
            }
            if (pass == 0) {
                assert_is_version(held, 1);
                record_store_release(s, held);
                record_store_close(s);
                assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
            }
        }
        record_store_close(s);
        remove_tree(dir);
        free(dir);
    }
}

/* ---- threads --------------------------------------------------------------------------------- */

typedef struct worker {
    record_store *s;
    int seed;
    int bad; /* records that were not one of the versions put */
} worker;

/* ---- group commit -------------------------------------------------------------------- */

enum { NB = 5 };

/* Fails (or crashes at) the nth time a step comes (1-based). */
typedef struct nth_plan {
    record_store_step at;
    int nth, seen;
    bool crash;
} nth_plan;

static bool nth_hook(record_store_step step, void *user) {
    nth_plan *p = user;
    if (step != p->at || ++p->seen != p->nth) return true;
    if (p->crash) _exit(0);
    return false;
}

/* Puts b0..b4 as versions 10..14 in one batch (b2 exists as version 1). */
static is_status put_five(record_store *s, is_status *st) {
    static rec r[NB];
    const char *ids[NB] = {"b0", "b1", "b2", "b3", "b4"};
    const fact_kv_meta *metas[NB];
    const int32_t *toks[NB];
    const void *k[NB], *v[NB];
    for (int i = 0; i < NB; i++) {
        rec_make(&r[i], 10 + i);
        metas[i] = &r[i].m, toks[i] = r[i].tokens, k[i] = r[i].k, v[i] = r[i].v;
    }
    return record_store_put_batch(s, NB, ids, metas, toks, k, v, st);
}

/* Record i of the batch: new (version 10 + i), old (b2's version 1) or absent. */
static void assert_batch_state(record_store *s, int n_new) {
    const char *ids[NB] = {"b0", "b1", "b2", "b3", "b4"};
    for (int i = 0; i < NB; i++) {
        if (i < n_new) {
            assert_get_version(s, ids[i], 10 + i);
        } else if (i == 2) {
            assert_get_version(s, ids[i], 1);
        } else {
            const fact_kv *kv;
            assert_int_equal(record_store_get(s, ids[i], NULL, &kv), IS_ERR_NOT_FOUND);
        }
    }
}

static void test_put_batch(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    put_version(s, "b2", 1);
    is_status st[NB];
    assert_int_equal(put_five(s, st), IS_OK);
    for (int i = 0; i < NB; i++) assert_int_equal(st[i], IS_OK);
    assert_batch_state(s, NB);
    assert_int_equal(count_files(dir, ".tmp."), 0);
    record_store_close(s);
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    assert_batch_state(s, NB);
    /* A bad id fails the batch before anything is written. */
    rec r;
    rec_make(&r, 20);
    const char *ids[2] = {"b0", "no/slash"};
    const fact_kv_meta *metas[2] = {&r.m, &r.m};
    const int32_t *toks[2] = {r.tokens, r.tokens};
    const void *k[2] = {r.k, r.k}, *v[2] = {r.v, r.v};
    assert_int_equal(record_store_put_batch(s, 2, ids, metas, toks, k, v, st), IS_ERR_INVALID_ARG);
    assert_int_equal(st[0], IS_ERR_INVALID_ARG);
    assert_get_version(s, "b0", 10);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* The third occurrence of each step fails: before the renames nothing
 * changes; at the third rename the two before it stand; a failed
 * directory fsync leaves every record renamed but reports it. The cache
 * agrees with the disk, and no temporary file is left. */
static void test_put_batch_failure_at_every_step(void **state) {
    for (int at = 0; at < RECORD_STORE_STEP_COUNT_; at++) {
        char *dir = make_tmp_dir();
        record_store *s;
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        put_version(s, "b2", 1);
        nth_plan plan = {(record_store_step)at, at == RECORD_STORE_STEP_DIR_FSYNC ? 1 : 3, 0,
                         false};
        record_store_set_fault_hook(s, nth_hook, &plan);
        is_status st[NB];
        assert_int_equal(put_five(s, st), IS_ERR_IO);
        record_store_set_fault_hook(s, NULL, NULL);
        int n_new = at == RECORD_STORE_STEP_RENAME ? 2 : at == RECORD_STORE_STEP_DIR_FSYNC ? NB : 0;
        for (int i = 0; i < NB; i++)
            assert_int_equal(st[i],
                             i < n_new && at == RECORD_STORE_STEP_RENAME ? IS_OK : IS_ERR_IO);
        assert_int_equal(count_files(dir, ".tmp."), 0);
        for (int pass = 0; pass < 2; pass++) {
            assert_batch_state(s, n_new);
            record_store_close(s);
            assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        }
        record_store_close(s);
        remove_tree(dir);
        free(dir);
    }
}

/* A child dies at the third occurrence of each step of a batch: the next
 * open finds each record old or new, whole (the renames done before the
 * crash, no others), and no temporary file. */
static void test_put_batch_crash_at_every_step(void **state) {
    for (int at = 0; at < RECORD_STORE_STEP_COUNT_; at++) {
        char *dir = make_tmp_dir();
        record_store *s;
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        put_version(s, "b2", 1);
        record_store_close(s);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            record_store *c;
            if (record_store_open(dir, 1 << 20, &c) != IS_OK) _exit(2);
            nth_plan plan = {(record_store_step)at, at == RECORD_STORE_STEP_DIR_FSYNC ? 1 : 3, 0,
                             true};
            record_store_set_fault_hook(c, nth_hook, &plan);
            is_status st[NB];
            put_five(c, st);
            _exit(3);
        }
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
        assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
        assert_int_equal(count_files(dir, ".tmp."), 0);
        assert_batch_state(s, at == RECORD_STORE_STEP_RENAME      ? 2
                              : at == RECORD_STORE_STEP_DIR_FSYNC ? NB
                                                                  : 0);
        record_store_close(s);
        remove_tree(dir);
        free(dir);
    }
}

/* ---- the disk cap ------------------------------------------------------------------ */

static bool file_exists(const char *dir, const char *id) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.fkv", dir, id);
    return access(path, F_OK) == 0;
}

/* Sets a record file's modification time to `sec` (file times may be
 * coarser than the test's puts). */
static void set_mtime(const char *dir, const char *id, time_t sec) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.fkv", dir, id);
    struct timespec t[2] = {{sec, 0}, {sec, 0}};
    assert_int_equal(utimensat(AT_FDCWD, path, t, 0), 0);
}

/* The least recently used record files go past the cap; held, pinned and
 * just-written records stay; a reopened store lists the directory again,
 * the least recently modified first; a batch larger than the cap keeps all
 * of itself until the next put. */
static void test_disk_cap(void **state) {
    char *dir = make_tmp_dir();
    uint64_t rb = rec_bytes();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    /* No cap: nothing tracked, nothing evicted. */
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        put_version(s, id, i);
    }
    assert_int_equal(record_store_get_stats(s).n_disk, 0);
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        set_mtime(dir, id, 1000000 + i);
    }
    /* Room for three: the directory's four are listed, the oldest (r0) goes. */
    assert_int_equal(record_store_set_disk_cap(s, 3 * rb + rb / 2), IS_OK);
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.n_disk, 3);
    assert_int_equal(st.disk_bytes, 3 * rb);
    assert_int_equal(st.disk_evictions, 1);
    assert_false(file_exists(dir, "r0"));
    assert_false(record_store_contains(s, "r0")); /* out of the memory cache too */
    /* A get makes r1 the most recent: the next put evicts r2. */
    assert_get_version(s, "r1", 1);
    put_version(s, "r4", 4);
    assert_true(file_exists(dir, "r1"));
    assert_false(file_exists(dir, "r2"));
    assert_true(file_exists(dir, "r3") && file_exists(dir, "r4"));
    /* A held record (r3, the least recent now) and a pinned one (r1) are
     * spared: r4 goes, though more recent. */
    const fact_kv *held;
    assert_int_equal(record_store_get(s, "r3", NULL, &held), IS_OK);
    put_version(s, "r1", 11); /* r1 most recent */
    assert_get_version(s, "r4", 4);
    record_store_pin(s, "r1");
    record_store_pin(s, "r9"); /* not there yet: pinned when it comes */
    put_version(s, "r5", 5);   /* over the cap: r3 is held, r4 the next */
    assert_true(file_exists(dir, "r3"));
    assert_false(file_exists(dir, "r4"));
    put_version(s, "r9", 9); /* r3 held, r1 and r9 pinned: r5 goes */
    assert_false(file_exists(dir, "r5"));
    assert_true(file_exists(dir, "r1") && file_exists(dir, "r9") && file_exists(dir, "r3"));
    assert_is_version(held, 3); /* still readable */
    record_store_release(s, held);
    put_version(s, "r6", 6); /* r3 free now, and the least recent */
    assert_false(file_exists(dir, "r3"));
    record_store_unpin(s, "r1");
    record_store_unpin(s, "r9");
    record_store_unpin(s, "nothing"); /* never pinned: no-op */
    put_version(s, "r7", 7);          /* r1 the least recent, unpinned now */
    assert_false(file_exists(dir, "r1"));
    st = record_store_get_stats(s);
    assert_int_equal(st.n_disk, 3);
    assert_true(st.disk_bytes <= 3 * rb + rb / 2);
    assert_int_equal(count_files(dir, ".fkv"), 3);
    /* A delete and a set-aside leave the count. */
    assert_int_equal(record_store_delete(s, "r7"), IS_OK);
    assert_int_equal(record_store_get_stats(s).n_disk, 2);
    /* A batch larger than the cap keeps all of itself. */
    is_status bst[NB];
    assert_int_equal(put_five(s, bst), IS_OK);
    const char *bids[NB] = {"b0", "b1", "b2", "b3", "b4"};
    for (int i = 0; i < NB; i++) assert_true(file_exists(dir, bids[i]));
    assert_false(file_exists(dir, "r9") || file_exists(dir, "r6"));
    put_version(s, "r8", 8);
    assert_int_equal(record_store_get_stats(s).n_disk, 3);
    assert_true(file_exists(dir, "r8") && file_exists(dir, "b4") && file_exists(dir, "b3"));
    record_store_close(s);
    set_mtime(dir, "b3", 1000000);
    set_mtime(dir, "b4", 1000001);
    set_mtime(dir, "r8", 1000002);

    /* Reopened: the directory is listed again, the oldest file first out. */
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    assert_int_equal(record_store_set_disk_cap(s, 2 * rb + rb / 2), IS_OK);
    st = record_store_get_stats(s);
    assert_int_equal(st.n_disk, 2);
    assert_int_equal(count_files(dir, ".fkv"), 2);
    assert_true(file_exists(dir, "r8") && file_exists(dir, "b4"));
    /* The cap off: nothing tracked, nothing evicted. */
    assert_int_equal(record_store_set_disk_cap(s, 0), IS_OK);
    put_version(s, "z0", 20);
    put_version(s, "z1", 21);
    assert_int_equal(count_files(dir, ".fkv"), 4);
    assert_int_equal(record_store_get_stats(s).n_disk, 0);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* read_into's buffer comes from its caller: this one deletes the record
 * first, as a delete of the fact on another thread would meanwhile. */
typedef struct delete_during {
    record_store *s;
    const char *id;
} delete_during;

static void *alloc_deleting(void *ud, size_t len) {
    delete_during *d = ud;
    assert_int_equal(record_store_delete(d->s, d->id), IS_OK);
    return malloc(len);
}

static void release_free(void *ud, void *p) { free(p); }

/* A pinned record deleted while read_into reads it: the reader gets what
 * the file held, and the disk cap's bookkeeping counts no file that is
 * not there (a phantom would take room from real records until evicted). */
static void test_read_into_deleted_meanwhile(void **state) {
    char *dir = make_tmp_dir();
    uint64_t rb = rec_bytes();
    record_store *s;
    assert_int_equal(record_store_open(dir, 1 << 20, &s), IS_OK);
    assert_int_equal(record_store_set_disk_cap(s, 10 * rb), IS_OK);
    record_store_pin(s, "a");
    put_version(s, "a", 1);
    assert_int_equal(record_store_get_stats(s).n_disk, 1);
    delete_during d = {s, "a"};
    fact_kv kv;
    void *buf = NULL;
    size_t len = 0;
    assert_int_equal(
        record_store_read_into(s, "a", NULL, alloc_deleting, release_free, &d, &kv, &buf, &len),
        IS_OK);
    assert_is_version(&kv, 1);
    free(buf);
    assert_false(file_exists(dir, "a"));
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.n_disk, 0);
    assert_int_equal(st.disk_bytes, 0);
    record_store_unpin(s, "a");
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

/* Readers and writers on a few ids at once: every get gives a whole record
 * of some version; the cache stays within bounds (checked by ASan/TSan runs
 * and by the stats afterwards). */
static void *worker_run(void *arg) {
    worker *w = arg;
    uint32_t x = (uint32_t)w->seed * 2654435761u + 1;
    char id[8];
    for (int i = 0; i < 400; i++) {
        x = x * 1664525u + 1013904223u;
        snprintf(id, sizeof id, "t%u", (x >> 8) % 4);
        int op = (int)((x >> 16) % 8);
        if (op == 0) {
            rec r;
            rec_make(&r, (int)((x >> 20) % 5));
            if (record_store_put(w->s, id, &r.m, r.tokens, r.k, r.v) != IS_OK) w->bad++;
        } else if (op == 1) {
            is_status st = record_store_delete(w->s, id);
            if (st != IS_OK && st != IS_ERR_NOT_FOUND) w->bad++;
        } else {
            const fact_kv *kv;
            is_status st = record_store_get(w->s, id, NULL, &kv);
            if (st == IS_OK) {
                int version = kv->tokens[0] / 10;
                rec r;
                rec_make(&r, version);
                if (memcmp(kv->k, r.k, sizeof r.k) || memcmp(kv->v, r.v, sizeof r.v)) w->bad++;
                record_store_release(w->s, kv);
            } else if (st != IS_ERR_NOT_FOUND) {
                w->bad++;
            }
        }
    }
    return NULL;
}

static void test_threads(void **state) {
    char *dir = make_tmp_dir();
    record_store *s;
    assert_int_equal(record_store_open(dir, rec_bytes() * 3, &s), IS_OK);
    enum { NW = 4 };
    pthread_t th[NW];
    worker w[NW];
    for (int i = 0; i < NW; i++) {
        w[i] = (worker){.s = s, .seed = i + 1};
        assert_int_equal(pthread_create(&th[i], NULL, worker_run, &w[i]), 0);
    }
    for (int i = 0; i < NW; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(w[i].bad, 0);
    }
    record_store_stats st = record_store_get_stats(s);
    assert_int_equal(st.n_held, 0);
    assert_true(st.bytes_cached <= rec_bytes() * 3);
    assert_true(st.hits + st.misses > 0);
    record_store_close(s);
    remove_tree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get_delete),
        cmocka_unit_test(test_invalid_ids),
        cmocka_unit_test(test_overwrite_keeps_held_copy),
        cmocka_unit_test(test_content_id),
        cmocka_unit_test(test_reopen_sees_data),
        cmocka_unit_test(test_eviction_with_records_held),
        cmocka_unit_test(test_get_refuses_other_model),
        cmocka_unit_test(test_contains_counts_serving_model),
        cmocka_unit_test(test_corrupt_file_refused_neighbours_load),
        cmocka_unit_test(test_leftover_tmp_and_half_written_file),
        cmocka_unit_test(test_crash_at_every_step),
        cmocka_unit_test(test_failure_at_every_step),
        cmocka_unit_test(test_put_batch),
        cmocka_unit_test(test_put_batch_failure_at_every_step),
        cmocka_unit_test(test_put_batch_crash_at_every_step),
        cmocka_unit_test(test_read_into_deleted_meanwhile),
        cmocka_unit_test(test_disk_cap),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

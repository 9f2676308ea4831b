/* Host tier: records read from their files into the tier's own memory
 * (record_store_read_into), hits served without the disk, refusals passed
 * through, eviction under the bound with held records kept, larger blocks
 * split for smaller records, and concurrent gets of one record reading it
 * once. The tier's memory comes from malloc here (the server's is pinned). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "core/status.h"
#include "kv/host_tier.h"
#include "kv/record_store.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NL = 2, NH = 2, HD = 8, ROW = NH * HD };

typedef struct rec {
    fact_kv_meta m;
    int32_t n;
    int32_t *tokens;
    uint16_t *k, *v; /* bf16 bit patterns */
} rec;

static void rec_make(rec *r, int version, int32_t n_tokens) {
    memset(r, 0, sizeof *r);
    strcpy(r->m.model_fingerprint, "00112233aabbccdd");
    r->m.dtype = KV_DTYPE_BF16;
    r->m.n_layers = NL;
    r->m.n_kv_heads = NH;
    r->m.head_dim = HD;
    r->m.n_tokens = n_tokens;
    r->m.rope_n_rot = HD;
    r->m.rope_freq_base = 10000.0f;
    r->m.rope_freq_scale = 1.0f;
    r->m.text_hash = (uint64_t)version * 977 + 1;
    r->n = n_tokens;
    size_t ne = (size_t)NL * n_tokens * ROW;
    r->tokens = malloc((size_t)n_tokens * sizeof *r->tokens);
    r->k = malloc(ne * 2);
    r->v = malloc(ne * 2);
    assert_non_null(r->tokens);
    assert_non_null(r->k);
    assert_non_null(r->v);
    for (int32_t i = 0; i < n_tokens; i++) r->tokens[i] = version * 10 + i;
    for (size_t i = 0; i < ne; i++) {
        r->k[i] = (uint16_t)(version * 31 + i);
        r->v[i] = (uint16_t)(version * 17 + 3 * i);
    }
}

static void rec_free(rec *r) {
    free(r->tokens);
    free(r->k);
    free(r->v);
}

static void put(record_store *s, const char *id, int version, int32_t n_tokens) {
    rec r;
    rec_make(&r, version, n_tokens);
    assert_int_equal(record_store_put(s, id, &r.m, r.tokens, r.k, r.v), IS_OK);
    rec_free(&r);
}

static void assert_is(const fact_kv *kv, int version, int32_t n_tokens) {
    rec r;
    rec_make(&r, version, n_tokens);
    assert_int_equal(kv->meta.n_tokens, n_tokens);
    assert_int_equal(kv->meta.dtype, KV_DTYPE_BF16);
    assert_true(kv->meta.text_hash == r.m.text_hash);
    assert_true(kv->content_id != 0);
    assert_memory_equal(kv->tokens, r.tokens, (size_t)n_tokens * 4);
    assert_memory_equal(kv->k, r.k, (size_t)NL * n_tokens * ROW * 2);
    assert_memory_equal(kv->v, r.v, (size_t)NL * n_tokens * ROW * 2);
    rec_free(&r);
}

typedef struct mem_counter {
    int64_t allocs, frees, quiesces;
} mem_counter;

static is_status t_alloc(void *ud, size_t bytes, void **out) {
    ((mem_counter *)ud)->allocs++;
    *out = malloc(bytes);
    return *out ? IS_OK : is_error_set(IS_ERR_NOMEM, "test: malloc");
}
static void t_free(void *ud, void *p) {
    ((mem_counter *)ud)->frees++;
    free(p);
}
static void t_quiesce(void *ud) { ((mem_counter *)ud)->quiesces++; }

typedef struct fixture {
    char dir[64];
    record_store *rs;
    host_tier *t;
    mem_counter mc;
} fixture;

static void open_fixture(fixture *f, size_t tier_bytes) {
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/test_host_tier.XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    assert_int_equal(record_store_open(f->dir, 0, &f->rs), IS_OK);
    host_tier_alloc al = {.alloc = t_alloc, .free = t_free, .quiesce = t_quiesce, .ud = &f->mc};
    assert_int_equal(host_tier_create(f->rs, tier_bytes, al, &f->t), IS_OK);
}

static void close_fixture(fixture *f) {
    host_tier_free(f->t);
    assert_int_equal(f->mc.allocs, f->mc.frees);
    record_store_close(f->rs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    assert_int_equal(system(cmd), 0);
}

static fact_kv_meta expected(void) {
    rec r;
    rec_make(&r, 0, 1);
    fact_kv_meta m = r.m;
    rec_free(&r);
    return m;
}

static void test_disk_then_hit(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, (size_t)4 << 20);
    put(f.rs, "a", 1, 7);
    put(f.rs, "b", 2, 300);
    fact_kv_meta want = expected();
    const fact_kv *kv = NULL, *kv2 = NULL;
    bool disk = false;
    assert_int_equal(host_tier_get(f.t, "a", &want, &kv, &disk), IS_OK);
    assert_true(disk);
    assert_is(kv, 1, 7);
    assert_int_equal(host_tier_get(f.t, "a", &want, &kv2, &disk), IS_OK);
    assert_false(disk);
    assert_ptr_equal(kv, kv2); /* one copy, shared */
    host_tier_release(f.t, kv);
    host_tier_release(f.t, kv2);
    assert_int_equal(host_tier_get(f.t, "b", NULL, &kv, &disk), IS_OK);
    assert_true(disk);
    assert_is(kv, 2, 300);
    host_tier_release(f.t, kv);
    host_tier_stats st = host_tier_get_stats(f.t);
    assert_int_equal(st.hits, 1);
    assert_int_equal(st.disk_reads, 2);
    assert_int_equal(st.records, 2);
    assert_int_equal(f.mc.allocs, 1); /* one chunk (the bound) holds both */
    close_fixture(&f);
}

static void test_refusals(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, (size_t)1 << 20);
    put(f.rs, "good", 1, 5);
    put(f.rs, "bad", 2, 5);
    fact_kv_meta want = expected();
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(f.t, "none", &want, &kv, NULL), IS_ERR_NOT_FOUND);
    assert_int_equal(host_tier_get(f.t, "../x", &want, &kv, NULL), IS_ERR_INVALID_ARG);
    fact_kv_meta other = want;
    strcpy(other.model_fingerprint, "ffffffffffffffff");
    assert_int_equal(host_tier_get(f.t, "good", &other, &kv, NULL), IS_ERR_MISMATCH);
    /* A flipped byte in the values: the checksum refuses it. */
    char path[128];
    snprintf(path, sizeof path, "%s/bad.fkv", f.dir);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    off_t end = lseek(fd, 0, SEEK_END);
    uint8_t b = 0;
    assert_int_equal(pread(fd, &b, 1, end - 9), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, end - 9), 1);
    close(fd);
    assert_int_equal(host_tier_get(f.t, "bad", &want, &kv, NULL), IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "bad.fkv"));
    assert_null(kv);
    /* Refusals leave nothing behind: the good one still loads. */
    assert_int_equal(host_tier_get(f.t, "good", &want, &kv, NULL), IS_OK);
    assert_is(kv, 1, 5);
    host_tier_release(f.t, kv);
    assert_int_equal(host_tier_get_stats(f.t).records, 1);
    close_fixture(&f);
}

static void test_eviction_keeps_held(void **state) {
    (void)state;
    fixture f;
    /* 1 MiB: sixteen 64 KiB blocks; a 5-token record takes one. */
    open_fixture(&f, (size_t)1 << 20);
    char id[16];
    for (int i = 0; i < 40; i++) {
        snprintf(id, sizeof id, "r%d", i);
        put(f.rs, id, i, 5);
    }
    const fact_kv *held[4];
    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof id, "r%d", i);
        assert_int_equal(host_tier_get(f.t, id, NULL, &held[i], NULL), IS_OK);
    }
    for (int round = 0; round < 2; round++)
        for (int i = 4; i < 40; i++) {
            const fact_kv *kv = NULL;
            snprintf(id, sizeof id, "r%d", i);
            assert_int_equal(host_tier_get(f.t, id, NULL, &kv, NULL), IS_OK);
            assert_is(kv, i, 5);
            host_tier_release(f.t, kv);
        }
    host_tier_stats st = host_tier_get_stats(f.t);
    assert_true(st.evictions >= 40 - 16);
    assert_true(st.records <= 16);
    assert_true(st.bytes_chunks <= (int64_t)1 << 20);
    assert_true(f.mc.quiesces > 0); /* evicted memory is reused only after copies stop */
    for (int i = 0; i < 4; i++) assert_is(held[i], i, 5); /* never evicted while held */
    /* Every block held: the next one has no room. */
    const fact_kv *all[16];
    int n_all = 0;
    for (int i = 4; i < 40 && n_all < 12; i++) {
        snprintf(id, sizeof id, "r%d", i);
        assert_int_equal(host_tier_get(f.t, id, NULL, &all[n_all++], NULL), IS_OK);
    }
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(f.t, "r4", NULL, &kv, NULL), IS_OK); /* held already: a hit */
    host_tier_release(f.t, kv);
    put(f.rs, "extra", 99, 5);
    assert_int_equal(host_tier_get(f.t, "extra", NULL, &kv, NULL), IS_ERR_NOMEM);
    assert_int_equal(host_tier_get_stats(f.t).no_room, 1);
    for (int i = 0; i < n_all; i++) host_tier_release(f.t, all[i]);
    for (int i = 0; i < 4; i++) host_tier_release(f.t, held[i]);
    assert_int_equal(host_tier_get(f.t, "extra", NULL, &kv, NULL), IS_OK);
    assert_is(kv, 99, 5);
    host_tier_release(f.t, kv);
    close_fixture(&f);
}

static void test_large_block_split(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, (size_t)1 << 20);
    /* 1,000 tokens: about 132 KB, a 256 KiB block; the small ones below
     * take the rest of the bound, then split the big ones' blocks. */
    put(f.rs, "big1", 1, 1000);
    put(f.rs, "big2", 2, 1000);
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(f.t, "big1", NULL, &kv, NULL), IS_OK);
    host_tier_release(f.t, kv);
    assert_int_equal(host_tier_get(f.t, "big2", NULL, &kv, NULL), IS_OK);
    host_tier_release(f.t, kv);
    /* Small records now come from the big ones' blocks, split. */
    char id[16];
    for (int i = 0; i < 12; i++) {
        snprintf(id, sizeof id, "s%d", i);
        put(f.rs, id, 10 + i, 5);
        assert_int_equal(host_tier_get(f.t, id, NULL, &kv, NULL), IS_OK);
        assert_is(kv, 10 + i, 5);
        host_tier_release(f.t, kv);
    }
    assert_true(host_tier_get_stats(f.t).evictions >= 1);
    assert_int_equal(f.mc.allocs, 1);
    close_fixture(&f);
}

typedef struct getter {
    host_tier *t;
    bool disk;
    is_status st;
} getter;

static void *get_one(void *arg) {
    getter *g = arg;
    const fact_kv *kv = NULL;
    g->st = host_tier_get(g->t, "shared", NULL, &kv, &g->disk);
    if (g->st == IS_OK) {
        assert_is(kv, 7, 200);
        host_tier_release(g->t, kv);
    }
    return NULL;
}

static void test_threads_read_once(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, (size_t)4 << 20);
    put(f.rs, "shared", 7, 200);
    pthread_t th[8];
    getter g[8];
    for (int i = 0; i < 8; i++) {
        g[i] = (getter){.t = f.t};
        assert_int_equal(pthread_create(&th[i], NULL, get_one, &g[i]), 0);
    }
    int disk = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(g[i].st, IS_OK);
        disk += g[i].disk;
    }
    assert_int_equal(disk, 1);
    host_tier_stats st = host_tier_get_stats(f.t);
    assert_int_equal(st.disk_reads, 1);
    assert_int_equal(st.hits, 7);
    close_fixture(&f);
}

/* Another load that runs while an eviction's quiesce waits (as one on
 * another thread may) must not be handed any of the evicted record's
 * memory: a device copy may still read all of it, not only the part the
 * evicting load takes. */
typedef struct window {
    mem_counter mc; /* first: t_alloc and t_free count in it */
    host_tier *t;
    const uint8_t *lo, *hi; /* the evicted record's block */
    int entered;
    const uint8_t *got; /* the block the load in the window was given */
} window;

static void window_quiesce(void *ud) {
    window *w = ud;
    w->mc.quiesces++;
    if (w->entered++) return; /* the load below evicts too: no deeper */
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(w->t, "in_window", NULL, &kv, NULL), IS_OK);
    assert_is(kv, 50, 5);
    w->got = (const uint8_t *)kv->tokens - FACT_RECORD_HEADER_BYTES;
    host_tier_release(w->t, kv);
}

static void test_evicted_block_kept_until_quiesced(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, (size_t)1 << 20);
    window w = {0};
    host_tier_free(f.t);
    host_tier_alloc al = {.alloc = t_alloc, .free = t_free, .quiesce = window_quiesce, .ud = &w};
    assert_int_equal(host_tier_create(f.rs, (size_t)1 << 20, al, &f.t), IS_OK);
    w.t = f.t;
    /* Two 512 KiB records fill the bound; big1 is the least recently used. */
    put(f.rs, "big1", 1, 2000); /* 264 KB */
    put(f.rs, "big2", 2, 2000);
    put(f.rs, "small", 3, 5);
    put(f.rs, "in_window", 50, 5);
    const fact_kv *kv = NULL;
    assert_int_equal(host_tier_get(f.t, "big1", NULL, &kv, NULL), IS_OK);
    w.lo = (const uint8_t *)kv->tokens - FACT_RECORD_HEADER_BYTES;
    w.hi = w.lo + ((size_t)512 << 10);
    host_tier_release(f.t, kv);
    assert_int_equal(host_tier_get(f.t, "big2", NULL, &kv, NULL), IS_OK);
    host_tier_release(f.t, kv);
    /* "small" evicts big1 and takes the head of its block; in its quiesce,
     * "in_window" must find room elsewhere (it evicts big2). */
    assert_int_equal(host_tier_get(f.t, "small", NULL, &kv, NULL), IS_OK);
    assert_is(kv, 3, 5);
    assert_true(w.entered >= 1);
    assert_non_null(w.got);
    if (w.got >= w.lo && w.got < w.hi)
        fail_msg("a load during the quiesce was given the evicted record's memory (+%td)",
                 w.got - w.lo);
    host_tier_release(f.t, kv);
    /* After the quiesce the rest of big1's block is free again. */
    for (int i = 0; i < 6; i++) {
        char id[16];
        snprintf(id, sizeof id, "after%d", i);
        put(f.rs, id, 60 + i, 5);
        assert_int_equal(host_tier_get(f.t, id, NULL, &kv, NULL), IS_OK);
        assert_is(kv, 60 + i, 5);
        host_tier_release(f.t, kv);
    }
    assert_int_equal(w.mc.allocs, 1);
    host_tier_free(f.t);
    assert_int_equal(w.mc.frees, 1);
    f.t = NULL;
    close_fixture(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_disk_then_hit),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_eviction_keeps_held),
        cmocka_unit_test(test_large_block_split),
        cmocka_unit_test(test_threads_read_once),
        cmocka_unit_test(test_evicted_block_kept_until_quiesced),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

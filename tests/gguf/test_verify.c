/*
 * --verify (gguf/verify.h): model files checked at load against their
 * SHA-256 sidecar. The sidecars are made by coreutils' sha256sum (the
 * reference implementation), never by our own hash.
 *
 * For a GGUF (tests/golden/tiny's llama31_f32.gguf, copied) and a
 * safetensors file (written here): with a good sidecar both open; one
 * flipped byte inside tensor data opens silently without --verify (what
 * the check exists for) and is refused with it; a missing or malformed
 * sidecar is refused with a message naming it. Each case prints
 * `fault-matrix: damaged-files|<case>|<tries>|<outcome>`.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/status.h"
#include "gguf/gguf.h"
#include "gguf/verify.h"
#include "memory/safetensors.h"
#include "test_util.h"

static char g_dir[] = "/tmp/is_test_verify_XXXXXX";

typedef is_status (*open_fn)(const char *path);

static is_status open_gguf(const char *path) {
    gguf_ctx *g = NULL;
    is_status st = gguf_open(path, &g);
    gguf_close(g);
    return st;
}

static is_status open_st(const char *path) {
    safetensors *s = NULL;
    is_status st = safetensors_open(path, &s);
    safetensors_close(s);
    return st;
}

static void sha256sum(const char *path) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cd '%s' && sha256sum '%s' > '%s.sha256'", g_dir,
             strrchr(path, '/') + 1, strrchr(path, '/') + 1);
    assert_int_equal(system(cmd), 0);
}

/* The whole sequence for one file of `n` bytes whose byte `flip` lies
 * inside tensor data. */
static void check_file(const char *kind, const char *path, const uint8_t *data, size_t n,
                       size_t flip, open_fn open) {
    char side[640], c[160];
    snprintf(side, sizeof side, "%s.sha256", path);
    assert_true(test_write_file(path, data, n));

    verify_set_enabled(true);
    unlink(side);
    is_status st = open(path);
    assert_int_equal(st, IS_ERR_IO);
    assert_non_null(strstr(is_error_last(), ".sha256"));
    snprintf(c, sizeof c, "%s --verify without a checksum file", kind);
    printf("fault-matrix: damaged-files|%s|1|refused, naming the missing sidecar\n", c);

    sha256sum(path);
    assert_int_equal(open(path), IS_OK);

    uint8_t *bad = malloc(n);
    memcpy(bad, data, n);
    bad[flip] ^= 0x10;
    assert_true(test_write_file(path, bad, n));
    free(bad);
    verify_set_enabled(false);
    bool silent = open(path) == IS_OK;
    verify_set_enabled(true);
    st = open(path);
    assert_int_equal(st, IS_ERR_FORMAT);
    assert_non_null(strstr(is_error_last(), "damaged"));
    snprintf(c, sizeof c, "%s with one bit flipped in tensor data", kind);
    printf("fault-matrix: damaged-files|%s|1|refused with --verify (%s without)\n", c,
           silent ? "loads silently" : "refused");

    assert_true(test_write_file(side, "not a checksum\n", 15));
    assert_true(test_write_file(path, data, n));
    assert_int_equal(open(path), IS_ERR_FORMAT);
    snprintf(c, sizeof c, "%s --verify with a malformed checksum file", kind);
    printf("fault-matrix: damaged-files|%s|1|refused\n", c);
    verify_set_enabled(false);
    fflush(stdout);
}

static void test_gguf(void **state) {
    size_t n = 0;
    uint8_t *data = test_read_file(IS_GOLDEN_DIR "/tiny/llama31_f32.gguf", &n);
    assert_non_null(data);
    /* The last byte of the file is tensor data (the data section ends it). */
    char path[600];
    snprintf(path, sizeof path, "%s/model.gguf", g_dir);
    check_file("GGUF", path, data, n, n - 1, open_gguf);
    free(data);
}

static void test_safetensors(void **state) {
    /* One F32 tensor of 16 values. */
    const char hdr[] = "{\"w\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]}}";
    size_t hl = sizeof hdr - 1, pad = (8 - hl % 8) % 8, n = 8 + hl + pad + 64;
    uint8_t *f = calloc(1, n);
    for (int i = 0; i < 8; i++) f[i] = (uint8_t)((uint64_t)(hl + pad) >> (8 * i));
    memcpy(f + 8, hdr, hl);
    memset(f + 8 + hl, ' ', pad);
    for (int i = 0; i < 16; i++) {
        float v = 0.25f * (float)i;
        memcpy(f + 8 + hl + pad + 4 * i, &v, 4);
    }
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    check_file("safetensors", path, f, n, n - 5, open_st);
    free(f);
}

static int setup(void **state) { return mkdtemp(g_dir) ? 0 : -1; }
static int teardown(void **state) { return test_remove_tree(g_dir); }

int main(void) {
    uint8_t probe[1] = {0};
    char hex[65];
    if (verify_sha256_hex(probe, 1, hex) == IS_ERR_UNSUPPORTED) {
        fprintf(stderr, "test_verify: built without nettle: skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gguf),
        cmocka_unit_test(test_safetensors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/*
 * verify: SHA-256 sidecars of model files (see verify.h), with nettle's
 * SHA-256.
 */
#include "gguf/verify.h"

#include "core/status.h"

#include <ctype.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#ifdef IS_HAVE_NETTLE
#include <nettle/sha2.h>
#endif

static atomic_bool g_enabled;

void verify_set_enabled(bool on) { atomic_store(&g_enabled, on); }
bool verify_enabled(void) { return atomic_load(&g_enabled); }

is_status verify_sha256_hex(const void *data, size_t len, char out[65]) {
#ifdef IS_HAVE_NETTLE
    struct sha256_ctx c;
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_init(&c);
    /* nettle takes size_t lengths; feed in 1 GiB pieces all the same. */
    const uint8_t *p = data;
    while (len > 0) {
        size_t n = len > ((size_t)1 << 30) ? ((size_t)1 << 30) : len;
        sha256_update(&c, n, p);
        p += n;
        len -= n;
    }
    sha256_digest(&c, sizeof d, d);
    for (int i = 0; i < SHA256_DIGEST_SIZE; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
    return IS_OK;
#else
    (void)data;
    (void)len;
    out[0] = '\0';
    return is_error_set(IS_ERR_UNSUPPORTED, "--verify: this build has no SHA-256 (nettle-dev was "
                                            "not installed when it was built)");
#endif
}

is_status verify_sha256(const char *path, const void *data, size_t len) {
    char side[4096];
    if ((size_t)snprintf(side, sizeof side, "%s.sha256", path) >= sizeof side)
        return is_error_set(IS_ERR_INVALID_ARG, "--verify: path too long: %s", path);
    FILE *f = fopen(side, "r");
    if (!f)
        return is_error_set(IS_ERR_IO,
                            "--verify: no checksum file %s (%s); make one with: "
                            "sha256sum %s > %s",
                            side, strerror(errno), path, side);
    char line[256] = "";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    char want[65];
    int n = 0;
    while (got && n < 64 && isxdigit((unsigned char)line[n])) {
        want[n] = (char)tolower((unsigned char)line[n]);
        n++;
    }
    want[n] = '\0';
    if (n != 64 || isxdigit((unsigned char)line[64]))
        return is_error_set(IS_ERR_FORMAT,
                            "--verify: %s does not start with a SHA-256 (64 hex digits)", side);
    char have[65];
    is_status st = verify_sha256_hex(data, len, have);
    if (st != IS_OK) return st;
    if (strcmp(have, want) != 0)
        return is_error_set(IS_ERR_FORMAT, "--verify: %s is damaged: its SHA-256 is %s, %s says %s",
                            path, have, side, want);
    return IS_OK;
}

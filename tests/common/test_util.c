#define _XOPEN_SOURCE 700
#include "test_util.h"

#include <arpa/inet.h>
#include <ftw.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0)
        buf = malloc((size_t)size + 1);
    if (buf && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (!buf) return NULL;
    buf[size] = '\0';
    if (n) *n = (size_t)size;
    return buf;
}

bool test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

double test_rel_range_err(const float *a, const float *ref, int32_t n) {
    float lo = ref[0], hi = ref[0];
    double err = 0;
    for (int32_t i = 0; i < n; i++) {
        if (ref[i] < lo) lo = ref[i];
        if (ref[i] > hi) hi = ref[i];
        double d = fabs((double)a[i] - ref[i]);
        if (d > err) err = d;
    }
    return err / (hi - lo);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)ftw;
    return (flag == FTW_DP ? rmdir(path) : unlink(path)) == 0 ? 0 : -1;
}

int test_remove_tree(const char *path) {
    return nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0 ? 0 : -1;
}

bool test_file_exists(const char *path) { return access(path, F_OK) == 0; }

/* Distinct reasons, kept for the summary; a program has a handful. */
static size_t g_skipped;
static const char *g_reasons[8];
static size_t g_n_reasons;

void test_note_skip(const char *reason) {
    g_skipped++;
    fprintf(stderr, "skipped: %s\n", reason);
    for (size_t i = 0; i < g_n_reasons; i++)
        if (strcmp(g_reasons[i], reason) == 0) return;
    if (g_n_reasons < sizeof g_reasons / sizeof g_reasons[0]) g_reasons[g_n_reasons++] = reason;
}

int test_group_result(int failures, size_t n) {
    if (g_skipped == 0) return failures;
    fprintf(stderr, "%zu of %zu cases skipped:", g_skipped, n);
    for (size_t i = 0; i < g_n_reasons; i++) fprintf(stderr, "%s %s", i ? ";" : "", g_reasons[i]);
    fprintf(stderr, "\n");
    if (failures == 0 && g_skipped >= n) {
        fprintf(stderr, "every case skipped: reporting the program as skipped (exit %d)\n",
                TEST_SKIP_CODE);
        return TEST_SKIP_CODE;
    }
    return failures;
}

int test_connect_loopback(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

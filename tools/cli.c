#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *cli_default_model(void) {
    const char *env = getenv("INFERSCALE_MODEL");
    return env && *env ? env : CLI_DEFAULT_MODEL;
}

bool cli_parse_int(const char *s, const char *what, int64_t lo, int64_t hi, int32_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "error: %s must be an integer in [%lld, %lld], got '%s'\n", what,
                (long long)lo, (long long)hi, s);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

bool cli_parse_float(const char *s, const char *what, float lo, float hi, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s || !(v >= lo && v <= hi)) {
        fprintf(stderr, "error: %s must be a number in [%g, %g], got '%s'\n", what, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

bool cli_parse_kv_dtype(const char *s, kv_dtype *out) {
    if (kv_dtype_parse(s, out)) return true;
    fprintf(stderr, "error: --kv-dtype must be f32, f16, bf16 or fp8, got '%s'\n", s);
    return false;
}

bool cli_parse_retrieval(const char *s, bool *gpu) {
    if (strcmp(s, "cpu") == 0 || strcmp(s, "cuda") == 0) {
        *gpu = strcmp(s, "cuda") == 0;
        return true;
    }
    fprintf(stderr, "error: --retrieval must be cpu or cuda, got '%s'\n", s);
    return false;
}

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void cli_progress(const char *what, int64_t done, int64_t total, double t0_ms) {
    static double last;
    static int tty = -1;
    if (tty < 0) tty = isatty(2);
    if (total <= 0) return;
    double now = mono_ms();
    /* A terminal gets a bar redrawn in place; a log or a pipe a line every
     * few seconds, so a long run is never silent there either. */
    if (done < total && now - last < (tty ? 100 : 5000)) return;
    if (done == 0 && !tty) return;
    last = now;
    double secs = (now - t0_ms) / 1e3;
    double rate = secs > 0 ? done / secs : 0;
    double eta = rate > 0 ? (total - done) / rate : 0;
    if (!tty) {
        fprintf(stderr, "%s: %lld/%lld  %.1f/s  ETA %.0fs\n", what, (long long)done,
                (long long)total, rate, eta);
        fflush(stderr);
        return;
    }
    int width = 30, fill = (int)(width * done / total);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r%s [%s] %lld/%lld  %.1f/s  ETA %.0fs ", what, bar, (long long)done,
            (long long)total, rate, eta);
    if (done >= total) fprintf(stderr, "\n");
    fflush(stderr);
}

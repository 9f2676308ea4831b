/*
 * options: the CUDA backend's configuration list, parsed and printed by one
 * table (see options.h), so a key cannot be parsed one way and printed
 * another.
 */
#include "options.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum opt_kind { OPT_BOOL, OPT_INT, OPT_ENUM } opt_kind;

typedef struct opt_def {
    const char *key;
    opt_kind kind;
    size_t off;               /* offset of the field in cuda_options */
    int32_t lo, hi;           /* OPT_INT: accepted range */
    const char *const *names; /* OPT_ENUM: value names, by the enum's value, NULL-ended */
    const char *help;
} opt_def;

static const char *const precision_names[] = {"bf16x2", "bf16", NULL};
static const char *const kv_names[] = {"f32", "bf16", NULL};

#define OFF(f) offsetof(cuda_options, f)

static const opt_def defs[] = {
    {"precision", OPT_ENUM, OFF(precision), 0, 0, precision_names,
     "matmul inputs split hi + lo (bf16x2), or rounded to bf16"},
    {"kv", OPT_ENUM, OFF(kv), 0, 0, kv_names,
     "KV cache element type, for engines created after (serve sets bf16)"},
    {"flash", OPT_BOOL, OFF(flash), 0, 0, NULL, "tiled tensor-core attention over a bf16 cache"},
    {"clusters", OPT_BOOL, OFF(flash_clusters), 0, 0, NULL,
     "its key splits merged inside clusters (off: by a second kernel)"},
    {"wide", OPT_BOOL, OFF(flash_wide), 0, 0, NULL,
     "its 128-key tiles where the plan finds them cheaper"},
    {"flash_wgmma", OPT_BOOL, OFF(flash_wgmma), 0, 0, NULL,
     "its products on wgmma (sm_90a; off: mma.sync)"},
    {"skinny", OPT_BOOL, OFF(skinny), 0, 0, NULL,
     "decode products (<= 8 GEMM columns) on the weight-streaming kernel"},
    {"skinny_splits", OPT_INT, OFF(skinny_splits), 0, 8, NULL,
     "force the skinny kernel's column ranges (0: its plan)"},
    {"wgmma", OPT_BOOL, OFF(wgmma), 0, 0, NULL,
     "products of 9-32 GEMM columns on the wgmma kernel"},
    {"stacked", OPT_BOOL, OFF(stacked), 0, 0, NULL, "q, k, v and gate, up as one product each"},
    {"fused_convert", OPT_BOOL, OFF(fused_convert), 0, 0, NULL,
     "norms and SwiGLU write the next product's bf16 input"},
    {"pdl", OPT_BOOL, OFF(pdl), 0, 0, NULL, "small ops launched as programmatic dependents"},
};
#define N_DEFS (sizeof defs / sizeof defs[0])

cuda_options cuda_options_default(void) {
    const cuda_options o = {
        .precision = CUDA_MATMUL_BF16X2,
        .kv = CUDA_KV_F32,
        .flash = true,
        .flash_clusters = true,
        .flash_wide = true,
        .flash_wgmma = true,
        .skinny = true,
        .skinny_splits = 0,
        .wgmma = true,
        .stacked = true,
        .fused_convert = true,
        .pdl = true,
    };
    return o;
}

/* Every key, for the messages that list them. */
static void list_keys(char *buf, size_t n) {
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_DEFS && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%s", i ? ", " : "", defs[i].key);
}

static void list_names(const char *const *names, char *buf, size_t n) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; names[i] && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%s", i ? " | " : "", names[i]);
}

/* One "key=value" item of len bytes at s, onto o. */
static is_status apply_item(cuda_options *o, const char *s, size_t len, const char *from) {
    const char *eq = memchr(s, '=', len);
    if (!eq)
        return is_error_set(IS_ERR_INVALID_ARG, "%s: '%.*s' is not key=value", from, (int)len, s);
    const size_t klen = (size_t)(eq - s);
    const char *v = eq + 1;
    const size_t vlen = len - klen - 1;
    const opt_def *d = NULL;
    for (size_t i = 0; i < N_DEFS && !d; i++)
        if (strlen(defs[i].key) == klen && memcmp(defs[i].key, s, klen) == 0) d = &defs[i];
    if (!d) {
        char keys[256];
        list_keys(keys, sizeof keys);
        return is_error_set(IS_ERR_INVALID_ARG, "%s: unknown key '%.*s' (keys: %s)", from,
                            (int)klen, s, keys);
    }
    char val[64];
    if (vlen == 0 || vlen >= sizeof val)
        return is_error_set(IS_ERR_INVALID_ARG, "%s: '%s' needs a value", from, d->key);
    memcpy(val, v, vlen);
    val[vlen] = '\0';
    char *field = (char *)o + d->off;
    switch (d->kind) {
    case OPT_BOOL:
        if (!strcmp(val, "on") || !strcmp(val, "1")) {
            *(bool *)field = true;
        } else if (!strcmp(val, "off") || !strcmp(val, "0")) {
            *(bool *)field = false;
        } else {
            return is_error_set(IS_ERR_INVALID_ARG, "%s: '%s' takes on or off, not '%s'", from,
                                d->key, val);
        }
        return IS_OK;
    case OPT_INT: {
        char *end = NULL;
        long x = strtol(val, &end, 10);
        if (*end != '\0' || x < d->lo || x > d->hi)
            return is_error_set(IS_ERR_INVALID_ARG, "%s: '%s' takes an integer in %d..%d, not '%s'",
                                from, d->key, d->lo, d->hi, val);
        *(int32_t *)field = (int32_t)x;
        return IS_OK;
    }
    case OPT_ENUM:
        for (int i = 0; d->names[i]; i++)
            if (!strcmp(val, d->names[i])) {
                *(int *)field = i; /* the enums are int-sized, valued by their names' order */
                return IS_OK;
            }
        {
            char names[128];
            list_names(d->names, names, sizeof names);
            return is_error_set(IS_ERR_INVALID_ARG, "%s: '%s' takes %s, not '%s'", from, d->key,
                                names, val);
        }
    }
    return IS_ERR_INTERNAL;
}

static is_status parse_from(cuda_options *o, const char *spec, const char *from) {
    if (!spec) return IS_OK;
    cuda_options t = *o; /* applied to a copy: all or nothing */
    const char *p = spec;
    while (*p) {
        while (*p == ',' || isspace((unsigned char)*p)) p++;
        if (!*p) break;
        const char *end = p;
        while (*end && *end != ',') end++;
        size_t len = (size_t)(end - p);
        while (len > 0 && isspace((unsigned char)p[len - 1])) len--;
        is_status st = apply_item(&t, p, len, from);
        if (st != IS_OK) return st;
        p = end;
    }
    *o = t;
    return IS_OK;
}

is_status cuda_options_parse(cuda_options *o, const char *spec) {
    return parse_from(o, spec, "cuda options");
}

is_status cuda_options_from_env(cuda_options *o) {
    return parse_from(o, getenv("IS_CUDA_OPTIONS"), "cuda options (IS_CUDA_OPTIONS)");
}

int cuda_options_format(const cuda_options *o, char *buf, size_t n) {
    size_t at = 0;
    if (n > 0) buf[0] = '\0';
    for (size_t i = 0; i < N_DEFS; i++) {
        const opt_def *d = &defs[i];
        const char *field = (const char *)o + d->off;
        char val[32];
        switch (d->kind) {
        case OPT_BOOL: snprintf(val, sizeof val, "%s", *(const bool *)field ? "on" : "off"); break;
        case OPT_INT: snprintf(val, sizeof val, "%d", (int)*(const int32_t *)field); break;
        case OPT_ENUM: snprintf(val, sizeof val, "%s", d->names[*(const int *)field]); break;
        }
        at += (size_t)snprintf(at < n ? buf + at : NULL, at < n ? n - at : 0, "%s%s=%s",
                               i ? "," : "", d->key, val);
    }
    return (int)at;
}

const char *cuda_options_help(void) {
    static char text[2048];
    if (text[0]) return text;
    const cuda_options def = cuda_options_default();
    char dbuf[512];
    cuda_options_format(&def, dbuf, sizeof dbuf);
    size_t at = 0;
    for (size_t i = 0; i < N_DEFS && at < sizeof text; i++) {
        const opt_def *d = &defs[i];
        char vals[64];
        if (d->kind == OPT_BOOL) snprintf(vals, sizeof vals, "on | off");
        else if (d->kind == OPT_INT) snprintf(vals, sizeof vals, "%d..%d", d->lo, d->hi);
        else list_names(d->names, vals, sizeof vals);
        at += (size_t)snprintf(text + at, sizeof text - at, "  %-14s %-16s %s\n", d->key, vals,
                               d->help);
    }
    if (at < sizeof text) snprintf(text + at, sizeof text - at, "  defaults: %s\n", dbuf);
    return text;
}

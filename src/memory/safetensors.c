/*
 * safetensors: see safetensors.h for the byte layout. The header is parsed
 * with cJSON (already a dependency) from a NUL-terminated copy, since the
 * mapping is not NUL-terminated.
 */
#include "memory/safetensors.h"

#include "core/status.h"
#include "gguf/verify.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Headers beyond this are not weight files we expect (and could make us
 * allocate without bound). 100 MB is what the Rust reference accepts. */
#define SAFETENSORS_MAX_HEADER (100u << 20)

struct safetensors {
    void *map; /* the whole file, read-only */
    size_t map_len;
    int32_t n;
    safetensors_tensor *t; /* (n) */
    char *names;           /* all names, NUL-terminated */
};

void safetensors_close(safetensors *st) {
    if (!st) return;
    if (st->map && st->map != MAP_FAILED) munmap(st->map, st->map_len);
    free(st->t);
    free(st->names);
    free(st);
}

int32_t safetensors_n_tensors(const safetensors *st) { return st ? st->n : 0; }

const safetensors_tensor *safetensors_tensor_at(const safetensors *st, int32_t i) {
    if (!st || i < 0 || i >= st->n) return NULL;
    return &st->t[i];
}

const safetensors_tensor *safetensors_find(const safetensors *st, const char *name) {
    if (!st || !name) return NULL;
    for (int32_t i = 0; i < st->n; i++)
        if (strcmp(st->t[i].name, name) == 0) return &st->t[i];
    return NULL;
}

static int dtype_parse(const char *s, safetensors_dtype *dt, uint64_t *size) {
    static const struct {
        const char *name;
        safetensors_dtype dt;
        uint64_t size;
    } k[] = {
        {"F32", SAFETENSORS_DTYPE_F32, 4},    {"F16", SAFETENSORS_DTYPE_F16, 2},
        {"BF16", SAFETENSORS_DTYPE_BF16, 2},  {"I64", SAFETENSORS_DTYPE_I64, 8},
        {"I32", SAFETENSORS_DTYPE_I32, 4},    {"F64", SAFETENSORS_DTYPE_OTHER, 8},
        {"U64", SAFETENSORS_DTYPE_OTHER, 8},  {"I16", SAFETENSORS_DTYPE_OTHER, 2},
        {"U16", SAFETENSORS_DTYPE_OTHER, 2},  {"U32", SAFETENSORS_DTYPE_OTHER, 4},
        {"I8", SAFETENSORS_DTYPE_OTHER, 1},   {"U8", SAFETENSORS_DTYPE_OTHER, 1},
        {"BOOL", SAFETENSORS_DTYPE_OTHER, 1},
    };
    for (size_t i = 0; i < sizeof k / sizeof *k; i++) {
        if (strcmp(s, k[i].name) == 0) {
            *dt = k[i].dt;
            *size = k[i].size;
            return 1;
        }
    }
    return 0;
}

/* A JSON number that is a non-negative integer below 2^53 (exact in a double). */
static int json_u64(const cJSON *j, uint64_t *v) {
    if (!cJSON_IsNumber(j)) return 0;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || floor(d) != d) return 0;
    *v = (uint64_t)d;
    return 1;
}

is_status safetensors_open(const char *path, safetensors **out) {
    if (!path || !out) return is_error_set(IS_ERR_INVALID_ARG, "safetensors: NULL argument");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return is_error_set(IS_ERR_IO, "safetensors: cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return is_error_set(IS_ERR_IO, "safetensors: cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return is_error_set(IS_ERR_IO, "safetensors: %s is not a regular file", path);
    }
    size_t flen = (size_t)sb.st_size;
    if (flen < 8) {
        close(fd);
        return is_error_set(IS_ERR_FORMAT, "safetensors: %s: %zu bytes, too short for a header",
                            path, flen);
    }
    safetensors *st = calloc(1, sizeof *st);
    if (!st) {
        close(fd);
        return is_error_set(IS_ERR_NOMEM, "safetensors: out of memory");
    }
    st->map = mmap(NULL, flen, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (st->map == MAP_FAILED) {
        st->map = NULL;
        safetensors_close(st);
        return is_error_set(IS_ERR_IO, "safetensors: cannot map %s: %s", path, strerror(map_errno));
    }
    st->map_len = flen;
    if (verify_enabled()) {
        is_status vs = verify_sha256(path, st->map, flen);
        if (vs != IS_OK) {
            safetensors_close(st);
            return vs;
        }
    }
    const uint8_t *base = st->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i];
    if (hlen == 0 || hlen > SAFETENSORS_MAX_HEADER || hlen > flen - 8) {
        safetensors_close(st);
        return is_error_set(IS_ERR_FORMAT,
                            "safetensors: %s: header length %llu invalid for a %zu-byte file", path,
                            (unsigned long long)hlen, flen);
    }
    char *hdr = malloc(hlen + 1);
    if (!hdr) {
        safetensors_close(st);
        return is_error_set(IS_ERR_NOMEM, "safetensors: out of memory");
    }
    memcpy(hdr, base + 8, hlen);
    hdr[hlen] = 0;
    if (strlen(hdr) != hlen) {
        free(hdr);
        safetensors_close(st);
        return is_error_set(IS_ERR_FORMAT, "safetensors: %s: NUL byte in header", path);
    }
    cJSON *root = cJSON_ParseWithLength(hdr, hlen);
    free(hdr);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        safetensors_close(st);
        return is_error_set(IS_ERR_FORMAT, "safetensors: %s: header is not a JSON object", path);
    }
    const uint64_t data_start = 8 + hlen;
    const uint64_t data_len = flen - data_start;
    int32_t n = 0;
    size_t names_len = 0;
    for (cJSON *it = root->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) continue;
        n++;
        names_len += strlen(it->string) + 1;
    }
    st->t = calloc(n ? (size_t)n : 1, sizeof *st->t);
    st->names = malloc(names_len + 1);
    if (!st->t || !st->names) {
        cJSON_Delete(root);
        safetensors_close(st);
        return is_error_set(IS_ERR_NOMEM, "safetensors: out of memory");
    }
    is_status status = IS_OK;
    size_t np = 0;
    for (cJSON *it = root->child; it && status == IS_OK; it = it->next) {
        const char *name = it->string;
        if (strcmp(name, "__metadata__") == 0) continue;
        safetensors_tensor *t = &st->t[st->n];
        const cJSON *jd = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        uint64_t esize = 0, begin = 0, end = 0;
        if (!cJSON_IsObject(it) || !cJSON_IsString(jd) || !cJSON_IsArray(js) ||
            !cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2) {
            status = is_error_set(
                IS_ERR_FORMAT, "safetensors: %s: tensor \"%s\" lacks dtype, shape or data_offsets",
                path, name);
            break;
        }
        if (!dtype_parse(jd->valuestring, &t->dtype, &esize)) {
            status = is_error_set(IS_ERR_FORMAT,
                                  "safetensors: %s: tensor \"%s\" has unknown dtype \"%s\"", path,
                                  name, jd->valuestring);
            break;
        }
        int nd = cJSON_GetArraySize(js);
        if (nd > SAFETENSORS_MAX_DIMS) {
            status = is_error_set(IS_ERR_FORMAT, "safetensors: %s: tensor \"%s\" has %d dimensions",
                                  path, name, nd);
            break;
        }
        t->n_dims = nd;
        uint64_t ne = 1;
        int d = 0;
        for (const cJSON *jv = js->child; jv; jv = jv->next, d++) {
            uint64_t v;
            /* Each dimension and the running product stay below 2^48, so
             * product * esize cannot overflow. */
            if (!json_u64(jv, &v) || v > (1ull << 48) || (v && ne > (1ull << 48) / v)) {
                status = is_error_set(IS_ERR_FORMAT,
                                      "safetensors: %s: tensor \"%s\" has a bad shape", path, name);
                break;
            }
            t->shape[d] = (int64_t)v;
            ne *= v;
        }
        if (status != IS_OK) break;
        if (!json_u64(jo->child, &begin) || !json_u64(jo->child->next, &end) || begin > end ||
            end > data_len) {
            status = is_error_set(IS_ERR_FORMAT,
                                  "safetensors: %s: tensor \"%s\" has data offsets outside the "
                                  "%llu-byte data section",
                                  path, name, (unsigned long long)data_len);
            break;
        }
        if (end - begin != ne * esize) {
            status = is_error_set(
                IS_ERR_FORMAT,
                "safetensors: %s: tensor \"%s\" holds %llu bytes, its shape needs %llu", path, name,
                (unsigned long long)(end - begin), (unsigned long long)(ne * esize));
            break;
        }
        t->n_elements = (int64_t)ne;
        t->n_bytes = end - begin;
        t->data = base + data_start + begin;
        size_t l = strlen(name);
        memcpy(st->names + np, name, l + 1);
        t->name = st->names + np;
        np += l + 1;
        st->n++;
    }
    cJSON_Delete(root);
    if (status != IS_OK) {
        safetensors_close(st);
        return status;
    }
    *out = st;
    return IS_OK;
}

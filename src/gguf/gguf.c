/*
 * gguf: the GGUF reader (format described in gguf.h).
 *
 * One pass over the header with a bounds-checked cursor: every read says how
 * many bytes it needs and fails with the byte offset if the file has fewer.
 * Counts from the file are checked against the bytes left before anything
 * is allocated for them, and the per-entry arrays grow as entries are
 * actually parsed, so the memory we allocate is bounded by a small multiple
 * of the bytes really present whatever the header claims. Sizes are computed in
 * uint64_t with __builtin_*_overflow.
 *
 * Keys and tensor names are copied NUL-terminated into one arena and indexed
 * by an open-addressing hash table (FNV-1a, linear probing) for O(1) lookup.
 * Everything else (string values, array elements, tensor bytes) is handed out
 * as pointers into the file.
 *
 * Caveat of any mmap reader: if another process truncates the file while it
 * is mapped, touching the lost pages raises SIGBUS. We do not guard that.
 */
#include "gguf/gguf.h"

#include "core/status.h"
#include "gguf/verify.h"
#include "gguf/tensor_type.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

#define GGUF_MAX_NAME 65535u
/* Smallest encodings, used to bound counts by the bytes left: a kv pair is a
 * non-empty key (8 + 1), a type (4) and a 1-byte value; a tensor info is a
 * non-empty name (8 + 1), n_dims (4), type (4), offset (8) with n_dims 0. */
#define GGUF_MIN_KV_BYTES     14u
#define GGUF_MIN_TENSOR_BYTES 25u

/* ---- context --------------------------------------------------------------- */

typedef struct gguf_kv {
    size_t key_off; /* key in ctx->names (NUL-terminated) */
    size_t key_pos; /* file offset of the key, for messages */
    gguf_value_type type;
    union {
        uint64_t u; /* UINT8/16/32/64, BOOL */
        int64_t i;  /* INT8/16/32/64 */
        double f;   /* FLOAT32 (exactly widened), FLOAT64 */
    } num;
    gguf_string str;          /* STRING */
    gguf_value_type arr_type; /* ARRAY: element type (never ARRAY) */
    uint64_t arr_count;       /* ARRAY: number of elements */
    uint64_t arr_pos;         /* ARRAY: file offset of the first element */
    uint64_t *arr_str_pos;    /* ARRAY of STRING: (arr_count) file offset of
                              each element's u64 length; NULL otherwise */
} gguf_kv;

typedef struct tensor_name {
    size_t off; /* name in ctx->names (NUL-terminated) */
    size_t pos; /* file offset of the name, for messages */
} tensor_name;

/* Open-addressing table of indices into kv[] or tensors[]: slot holds
 * index + 1, 0 is empty. Capacity is a power of two >= 2 * entries. */
typedef struct name_table {
    uint32_t *slots;
    uint64_t mask;
} name_table;

struct gguf_ctx {
    const uint8_t *data; /* whole file */
    size_t size;         /* bytes at data */
    bool mapped;         /* data is our mmap (gguf_open), else borrowed */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset; /* start of the data section */

    /* The arrays grow as entries are parsed (not sized from the counts the
     * file claims), so a lying header costs no more memory than its bytes. */
    int64_t n_kv; /* entries parsed so far; the file's count at the end */
    int64_t kv_cap;
    gguf_kv *kv; /* (kv_cap), zeroed past n_kv */
    int64_t n_tensors;
    int64_t tensor_cap;
    gguf_tensor *tensors; /* (tensor_cap) */
    int64_t tname_cap;
    tensor_name *tnames; /* (tname_cap) where each tensor's name is */

    char *names; /* arena of NUL-terminated keys and tensor names */
    size_t names_len;
    size_t names_cap;

    name_table kv_index;
    name_table tensor_index;
};

/* ---- value types -------------------------------------------------------------- */

static const struct {
    const char *name;
    uint32_t size; /* bytes of one scalar value; 0 for STRING and ARRAY */
} value_types[GGUF_VALUE_COUNT_] = {
    [GGUF_VALUE_UINT8] = {"u8", 1},      [GGUF_VALUE_INT8] = {"i8", 1},
    [GGUF_VALUE_UINT16] = {"u16", 2},    [GGUF_VALUE_INT16] = {"i16", 2},
    [GGUF_VALUE_UINT32] = {"u32", 4},    [GGUF_VALUE_INT32] = {"i32", 4},
    [GGUF_VALUE_FLOAT32] = {"f32", 4},   [GGUF_VALUE_BOOL] = {"bool", 1},
    [GGUF_VALUE_STRING] = {"string", 0}, [GGUF_VALUE_ARRAY] = {"array", 0},
    [GGUF_VALUE_UINT64] = {"u64", 8},    [GGUF_VALUE_INT64] = {"i64", 8},
    [GGUF_VALUE_FLOAT64] = {"f64", 8},
};

const char *gguf_value_type_name(gguf_value_type t) {
    if ((unsigned)t >= GGUF_VALUE_COUNT_) return "unknown";
    return value_types[t].name;
}

/* ---- bounds-checked cursor -------------------------------------------------------- */

typedef struct reader {
    const uint8_t *p;
    size_t size;
    size_t pos;
} reader;

static size_t rd_left(const reader *r) { return r->size - r->pos; }

static bool rd_bytes(reader *r, uint64_t n, const uint8_t **out) {
    if (n > rd_left(r)) return false;
    *out = r->p + r->pos;
    r->pos += (size_t)n;
    return true;
}

static bool rd_u32(reader *r, uint32_t *v) {
    const uint8_t *b;
    if (!rd_bytes(r, 4, &b)) return false;
    memcpy(v, b, 4);
    return true;
}

static bool rd_u64(reader *r, uint64_t *v) {
    const uint8_t *b;
    if (!rd_bytes(r, 8, &b)) return false;
    memcpy(v, b, 8);
    return true;
}

/* "gguf: truncated at byte P (file is N bytes) reading <what>" */
static is_status truncated(const reader *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static is_status truncated(const reader *r, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return is_error_set(IS_ERR_FORMAT,
                        "gguf: truncated at byte %zu (file is %zu bytes) "
                        "reading %s",
                        r->pos, r->size, what);
}

/* Reads a gguf-string. On failure r->pos is at the length field (for the
 * message) and the return names why. */
typedef enum str_result { STR_OK, STR_NO_LEN, STR_PAST_END } str_result;

static str_result rd_string(reader *r, gguf_string *s, uint64_t *len_out) {
    size_t start = r->pos;
    uint64_t len;
    const uint8_t *b;
    if (!rd_u64(r, &len)) return STR_NO_LEN;
    *len_out = len;
    if (!rd_bytes(r, len, &b)) {
        r->pos = start;
        return STR_PAST_END;
    }
    s->data = (const char *)b;
    s->len = len;
    return STR_OK;
}

static is_status string_error(const reader *r, str_result res, uint64_t len, const char *what,
                              int64_t index) {
    if (res == STR_NO_LEN) return truncated(r, "the length of %s #%lld", what, (long long)index);
    return is_error_set(IS_ERR_FORMAT,
                        "gguf: %s #%lld: string length %llu at byte %zu runs "
                        "past end of file (%zu bytes)",
                        what, (long long)index, (unsigned long long)len, r->pos, r->size);
}

/* ---- names: arena and hash table ------------------------------------------------ */

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Grows *p (an array of `elem`-byte items with *cap of them) to hold at
 * least `need`, zeroing the new items. */
static is_status reserve(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return IS_OK;
    int64_t nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    char *q = realloc(*p, (size_t)nc * elem);
    if (q == NULL) return is_error_set(IS_ERR_NOMEM, "gguf: out of memory for the header");
    memset(q + (size_t)*cap * elem, 0, (size_t)(nc - *cap) * elem);
    *p = q;
    *cap = nc;
    return IS_OK;
}

static bool table_init(name_table *t, int64_t n) {
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap *= 2;
    t->slots = calloc(cap, sizeof *t->slots);
    t->mask = cap - 1;
    return t->slots != NULL;
}

/* Slot for `name`: either the slot holding it or the empty slot where it
 * would go. `name_off[i]` gives the arena offset of entry i's name, with
 * `stride` bytes between consecutive offsets (kv[] or tnames[]). */
static uint32_t *table_slot(const name_table *t, const char *names, const void *offs, size_t stride,
                            const char *name) {
    uint64_t i = name_hash(name) & t->mask;
    for (;;) {
        uint32_t *slot = &t->slots[i];
        if (*slot == 0) return slot;
        size_t off;
        memcpy(&off, (const char *)offs + (size_t)(*slot - 1) * stride, sizeof off);
        if (strcmp(names + off, name) == 0) return slot;
        i = (i + 1) & t->mask;
    }
}

static uint32_t *kv_slot(const gguf_ctx *ctx, const char *key) {
    return table_slot(&ctx->kv_index, ctx->names, &ctx->kv[0].key_off, sizeof(gguf_kv), key);
}

static uint32_t *tensor_slot(const gguf_ctx *ctx, const char *name) {
    return table_slot(&ctx->tensor_index, ctx->names, &ctx->tnames[0].off, sizeof(tensor_name),
                      name);
}

/* Builds both name indexes once every entry is parsed (so their size follows
 * what the file really holds) and rejects duplicates. */
static is_status index_keys(gguf_ctx *ctx) {
    if (!table_init(&ctx->kv_index, ctx->n_kv))
        return is_error_set(IS_ERR_NOMEM, "gguf: out of memory for the index");
    for (int64_t i = 0; i < ctx->n_kv; i++) {
        const char *key = ctx->names + ctx->kv[i].key_off;
        uint32_t *slot = kv_slot(ctx, key);
        if (*slot != 0)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: duplicate key '%s' at byte %zu (first "
                                "at byte %zu)",
                                key, ctx->kv[i].key_pos, ctx->kv[*slot - 1].key_pos);
        *slot = (uint32_t)i + 1;
    }
    return IS_OK;
}

static is_status index_tensors(gguf_ctx *ctx) {
    if (!table_init(&ctx->tensor_index, ctx->n_tensors))
        return is_error_set(IS_ERR_NOMEM, "gguf: out of memory for the index");
    for (int64_t i = 0; i < ctx->n_tensors; i++) {
        const char *name = ctx->names + ctx->tnames[i].off;
        uint32_t *slot = tensor_slot(ctx, name);
        if (*slot != 0)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: duplicate tensor '%s' at byte %zu "
                                "(first at byte %zu)",
                                name, ctx->tnames[i].pos, ctx->tnames[*slot - 1].pos);
        *slot = (uint32_t)i + 1;
    }
    return IS_OK;
}

/* Validates a key or tensor name read at byte `pos` and copies it into the
 * arena; *off receives its arena offset. */
static is_status name_copy(gguf_ctx *ctx, gguf_string s, size_t pos, const char *what,
                           int64_t index, size_t *off) {
    if (s.len == 0)
        return is_error_set(IS_ERR_FORMAT, "gguf: %s #%lld at byte %zu is empty", what,
                            (long long)index, pos);
    if (s.len > GGUF_MAX_NAME)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: %s #%lld at byte %zu is %llu bytes long "
                            "(max %u)",
                            what, (long long)index, pos, (unsigned long long)s.len, GGUF_MAX_NAME);
    if (memchr(s.data, '\0', (size_t)s.len) != NULL)
        return is_error_set(IS_ERR_FORMAT, "gguf: %s #%lld at byte %zu contains a NUL byte", what,
                            (long long)index, pos);
    size_t need = (size_t)s.len + 1;
    if (ctx->names_cap - ctx->names_len < need) {
        size_t cap = ctx->names_cap ? ctx->names_cap : 1024;
        while (cap - ctx->names_len < need) cap *= 2;
        char *p = realloc(ctx->names, cap);
        if (p == NULL) return is_error_set(IS_ERR_NOMEM, "gguf: out of memory for names");
        ctx->names = p;
        ctx->names_cap = cap;
    }
    *off = ctx->names_len;
    memcpy(ctx->names + ctx->names_len, s.data, (size_t)s.len);
    ctx->names[ctx->names_len + (size_t)s.len] = '\0';
    ctx->names_len += need;
    return IS_OK;
}

/* ---- metadata -------------------------------------------------------------------- */

static void decode_scalar(gguf_kv *kv, gguf_value_type t, const uint8_t *b) {
    switch (t) {
    case GGUF_VALUE_UINT8:
    case GGUF_VALUE_BOOL: kv->num.u = b[0]; break;
    case GGUF_VALUE_INT8: kv->num.i = (int8_t)b[0]; break;
    case GGUF_VALUE_UINT16: {
        uint16_t v;
        memcpy(&v, b, 2);
        kv->num.u = v;
        break;
    }
    case GGUF_VALUE_INT16: {
        int16_t v;
        memcpy(&v, b, 2);
        kv->num.i = v;
        break;
    }
    case GGUF_VALUE_UINT32: {
        uint32_t v;
        memcpy(&v, b, 4);
        kv->num.u = v;
        break;
    }
    case GGUF_VALUE_INT32: {
        int32_t v;
        memcpy(&v, b, 4);
        kv->num.i = v;
        break;
    }
    case GGUF_VALUE_UINT64: memcpy(&kv->num.u, b, 8); break;
    case GGUF_VALUE_INT64: memcpy(&kv->num.i, b, 8); break;
    case GGUF_VALUE_FLOAT32: {
        float v;
        memcpy(&v, b, 4);
        kv->num.f = v;
        break;
    }
    case GGUF_VALUE_FLOAT64: memcpy(&kv->num.f, b, 8); break;
    default: IS_ASSERT(!"not a scalar type");
    }
}

static is_status parse_array(reader *r, gguf_kv *kv, const char *key) {
    uint32_t et;
    uint64_t count;
    size_t type_pos = r->pos;
    if (!rd_u32(r, &et)) return truncated(r, "the element type of array '%s'", key);
    if (et == GGUF_VALUE_ARRAY)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "gguf: key '%s' at byte %zu is an array of arrays "
                            "(not supported)",
                            key, type_pos);
    if (et >= GGUF_VALUE_COUNT_)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: array '%s' at byte %zu has unknown element "
                            "type %u",
                            key, type_pos, et);
    size_t count_pos = r->pos;
    if (!rd_u64(r, &count)) return truncated(r, "the length of array '%s'", key);
    kv->arr_type = (gguf_value_type)et;
    kv->arr_count = count;
    kv->arr_pos = r->pos;

    if (et == GGUF_VALUE_STRING) {
        /* Each element takes at least its 8-byte length. */
        if (count > rd_left(r) / 8)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: array '%s' at byte %zu claims %llu "
                                "strings, more than the %zu bytes left can hold",
                                key, count_pos, (unsigned long long)count, rd_left(r));
        if (count > 0) {
            kv->arr_str_pos = malloc((size_t)count * sizeof *kv->arr_str_pos);
            if (kv->arr_str_pos == NULL)
                return is_error_set(IS_ERR_NOMEM, "gguf: out of memory indexing array '%s'", key);
        }
        for (uint64_t i = 0; i < count; i++) {
            gguf_string s;
            uint64_t len = 0;
            kv->arr_str_pos[i] = r->pos;
            str_result res = rd_string(r, &s, &len);
            if (res == STR_NO_LEN)
                return truncated(r, "the length of string %llu of array '%s'",
                                 (unsigned long long)i, key);
            if (res == STR_PAST_END)
                return is_error_set(IS_ERR_FORMAT,
                                    "gguf: array '%s' string %llu: length %llu "
                                    "at byte %zu runs past end of file (%zu "
                                    "bytes)",
                                    key, (unsigned long long)i, (unsigned long long)len, r->pos,
                                    r->size);
        }
        return IS_OK;
    }

    uint32_t esize = value_types[et].size;
    if (count > rd_left(r) / esize)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: array '%s' at byte %zu claims %llu elements "
                            "of %u bytes, more than the %zu bytes left",
                            key, count_pos, (unsigned long long)count, esize, rd_left(r));
    const uint8_t *b;
    bool ok = rd_bytes(r, count * esize, &b);
    IS_ASSERT(ok);
    if (et == GGUF_VALUE_BOOL) {
        for (uint64_t i = 0; i < count; i++)
            if (b[i] > 1)
                return is_error_set(IS_ERR_FORMAT,
                                    "gguf: array '%s' element %llu at byte %llu "
                                    "is bool %u (must be 0 or 1)",
                                    key, (unsigned long long)i,
                                    (unsigned long long)(kv->arr_pos + i), b[i]);
    }
    return IS_OK;
}

static is_status parse_kv(gguf_ctx *ctx, reader *r, int64_t index) {
    gguf_kv *kv = &ctx->kv[index];
    gguf_string s;
    uint64_t len = 0;
    size_t key_pos = r->pos;
    str_result res = rd_string(r, &s, &len);
    if (res != STR_OK) return string_error(r, res, len, "key", index);
    is_status st = name_copy(ctx, s, key_pos, "key", index, &kv->key_off);
    if (st != IS_OK) return st;
    kv->key_pos = key_pos;
    const char *key = ctx->names + kv->key_off;

    uint32_t type;
    size_t type_pos = r->pos;
    if (!rd_u32(r, &type)) return truncated(r, "the type of key '%s'", key);
    if (type >= GGUF_VALUE_COUNT_)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: key '%s' at byte %zu has unknown value type "
                            "%u",
                            key, type_pos, type);
    kv->type = (gguf_value_type)type;

    if (type == GGUF_VALUE_STRING) {
        res = rd_string(r, &kv->str, &len);
        if (res == STR_NO_LEN) return truncated(r, "the length of string '%s'", key);
        if (res == STR_PAST_END)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: string '%s': length %llu at byte %zu "
                                "runs past end of file (%zu bytes)",
                                key, (unsigned long long)len, r->pos, r->size);
        return IS_OK;
    }
    if (type == GGUF_VALUE_ARRAY) return parse_array(r, kv, key);

    const uint8_t *b;
    if (!rd_bytes(r, value_types[type].size, &b))
        return truncated(r, "the %s value of key '%s'", value_types[type].name, key);
    if (type == GGUF_VALUE_BOOL && b[0] > 1)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: key '%s' at byte %zu is bool %u (must be 0 "
                            "or 1)",
                            key, r->pos - 1, b[0]);
    decode_scalar(kv, kv->type, b);
    return IS_OK;
}

static is_status read_alignment(gguf_ctx *ctx) {
    ctx->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(ctx, "general.alignment");
    if (i < 0) return IS_OK;
    const gguf_kv *kv = &ctx->kv[i];
    if (kv->type != GGUF_VALUE_UINT32)
        return is_error_set(IS_ERR_FORMAT, "gguf: general.alignment is %s, expected u32",
                            gguf_value_type_name(kv->type));
    uint64_t a = kv->num.u;
    if (a == 0 || (a & (a - 1)) != 0)
        return is_error_set(IS_ERR_FORMAT, "gguf: general.alignment %llu is not a power of two",
                            (unsigned long long)a);
    ctx->alignment = (uint32_t)a;
    return IS_OK;
}

/* ---- tensors ------------------------------------------------------------------------- */

static is_status parse_tensor(gguf_ctx *ctx, reader *r, int64_t index) {
    gguf_tensor *t = &ctx->tensors[index];
    gguf_string s;
    uint64_t len = 0;
    size_t name_pos = r->pos;
    str_result res = rd_string(r, &s, &len);
    if (res != STR_OK) return string_error(r, res, len, "tensor name", index);
    tensor_name *tn = &ctx->tnames[index];
    is_status st = name_copy(ctx, s, name_pos, "tensor name", index, &tn->off);
    if (st != IS_OK) return st;
    tn->pos = name_pos;
    const char *name = ctx->names + tn->off;

    size_t dims_pos = r->pos;
    if (!rd_u32(r, &t->n_dims)) return truncated(r, "n_dims of tensor '%s'", name);
    if (t->n_dims > GGUF_MAX_DIMS)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: tensor '%s' at byte %zu has %u dimensions "
                            "(max %d)",
                            name, dims_pos, t->n_dims, GGUF_MAX_DIMS);
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        uint64_t ne;
        if (!rd_u64(r, &ne)) return truncated(r, "ne[%u] of tensor '%s'", d, name);
        if (ne > (uint64_t)INT64_MAX)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: tensor '%s' ne[%u] = %llu at byte %zu "
                                "is negative as int64",
                                name, d, (unsigned long long)ne, r->pos - 8);
        t->ne[d] = (int64_t)ne;
    }
    size_t type_pos = r->pos;
    if (!rd_u32(r, &t->type)) return truncated(r, "the type of tensor '%s'", name);
    const tensor_type_info *info = tensor_type_get(t->type);
    if (info == NULL)
        return is_error_set(IS_ERR_FORMAT, "gguf: tensor '%s' at byte %zu has unknown type %u",
                            name, type_pos, t->type);
    size_t offset_pos = r->pos;
    if (!rd_u64(r, &t->offset)) return truncated(r, "the offset of tensor '%s'", name);

    if (t->ne[0] % info->block_elems != 0)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: tensor '%s' has rows of %lld values, not a "
                            "multiple of the %s block size %u",
                            name, (long long)t->ne[0], info->name, info->block_elems);
    /* Order-independent overflow check: a zero dimension must not hide the
     * absurd product of the others. */
    int64_t n = 1, bound = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        int64_t ne = t->ne[d];
        if (__builtin_mul_overflow(bound, ne > 0 ? ne : 1, &bound))
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: tensor '%s' shape [%lld, %lld, %lld, "
                                "%lld] overflows int64",
                                name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                                (long long)t->ne[3]);
        n *= ne;
    }
    t->n_elements = n;
    uint64_t nbytes = (uint64_t)t->ne[0] / info->block_elems;
    bool overflow = __builtin_mul_overflow(nbytes, (uint64_t)info->block_bytes, &nbytes);
    for (int d = 1; d < GGUF_MAX_DIMS; d++)
        overflow |= __builtin_mul_overflow(nbytes, (uint64_t)t->ne[d], &nbytes);
    if (overflow || nbytes > ctx->size)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: tensor '%s' of shape [%lld, %lld, %lld, "
                            "%lld] %s is larger than the file (%zu bytes)",
                            name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                            (long long)t->ne[3], info->name, ctx->size);
    t->nbytes = (size_t)nbytes;

    if (t->offset % ctx->alignment != 0)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: tensor '%s' offset %llu at byte %zu is not "
                            "a multiple of the alignment %u",
                            name, (unsigned long long)t->offset, offset_pos, ctx->alignment);
    return IS_OK;
}

/* Every tensor inside the file, none overlapping another. */
static is_status check_tensor_data(gguf_ctx *ctx) {
    if (ctx->n_tensors == 0) return IS_OK;
    if (ctx->data_offset > ctx->size)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: data section at byte %llu starts past end "
                            "of file (%zu bytes)",
                            (unsigned long long)ctx->data_offset, ctx->size);
    uint64_t data_len = ctx->size - ctx->data_offset;
    for (int64_t i = 0; i < ctx->n_tensors; i++) {
        gguf_tensor *t = &ctx->tensors[i];
        if (t->offset > data_len || t->nbytes > data_len - t->offset)
            return is_error_set(IS_ERR_FORMAT,
                                "gguf: tensor '%s' data [%llu+%zu] past end "
                                "of file (%zu bytes; data section at byte "
                                "%llu)",
                                t->name, (unsigned long long)t->offset, t->nbytes, ctx->size,
                                (unsigned long long)ctx->data_offset);
        t->data = ctx->data + ctx->data_offset + t->offset;
    }

    uint32_t *order = malloc((size_t)ctx->n_tensors * sizeof *order);
    if (order == NULL) return is_error_set(IS_ERR_NOMEM, "gguf: out of memory");
    for (int64_t i = 0; i < ctx->n_tensors; i++) order[i] = (uint32_t)i;
    /* Bottom-up merge sort of `order` by offset (stable, no globals). */
    uint32_t *tmp = malloc((size_t)ctx->n_tensors * sizeof *tmp);
    if (tmp == NULL) {
        free(order);
        return is_error_set(IS_ERR_NOMEM, "gguf: out of memory");
    }
    size_t n = (size_t)ctx->n_tensors;
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n;
            size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi)
                tmp[k++] = ctx->tensors[order[b]].offset < ctx->tensors[order[a]].offset
                               ? order[b++]
                               : order[a++];
            while (a < mid) tmp[k++] = order[a++];
            while (b < hi) tmp[k++] = order[b++];
        }
        uint32_t *sw = order;
        order = tmp;
        tmp = sw;
    }
    free(tmp);

    is_status st = IS_OK;
    const gguf_tensor *prev = NULL;
    for (size_t i = 0; i < n; i++) {
        const gguf_tensor *t = &ctx->tensors[order[i]];
        if (t->nbytes == 0) continue;
        if (prev != NULL && t->offset < prev->offset + prev->nbytes) {
            st = is_error_set(IS_ERR_FORMAT,
                              "gguf: tensor '%s' data [%llu+%zu] overlaps "
                              "tensor '%s' data [%llu+%zu]",
                              t->name, (unsigned long long)t->offset, t->nbytes, prev->name,
                              (unsigned long long)prev->offset, prev->nbytes);
            break;
        }
        prev = t;
    }
    free(order);
    return st;
}

/* ---- open ----------------------------------------------------------------------------- */

static is_status parse(gguf_ctx *ctx) {
    reader rd = {ctx->data, ctx->size, 0};
    reader *r = &rd;

    if (ctx->size < 4)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: file is %zu bytes, too small for the GGUF "
                            "magic",
                            ctx->size);
    if (memcmp(ctx->data, "GGUF", 4) != 0)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: bad magic %02x %02x %02x %02x at byte 0 "
                            "(expected \"GGUF\")",
                            ctx->data[0], ctx->data[1], ctx->data[2], ctx->data[3]);
    r->pos = 4;
    if (!rd_u32(r, &ctx->version)) return truncated(r, "the version");
    uint32_t v = ctx->version;
    if (v != 2 && v != 3) {
        if (__builtin_bswap32(v) == 2 || __builtin_bswap32(v) == 3)
            return is_error_set(IS_ERR_UNSUPPORTED,
                                "gguf: big-endian GGUF (version %u byte-"
                                "swapped) is not supported",
                                __builtin_bswap32(v));
        return is_error_set(IS_ERR_UNSUPPORTED, "gguf: version %u is not supported (only 2 and 3)",
                            v);
    }

    uint64_t n_tensors, n_kv;
    if (!rd_u64(r, &n_tensors)) return truncated(r, "the tensor count");
    if (!rd_u64(r, &n_kv)) return truncated(r, "the key/value count");
    size_t left = rd_left(r);
    if (n_kv > left / GGUF_MIN_KV_BYTES || n_tensors > left / GGUF_MIN_TENSOR_BYTES ||
        n_kv * GGUF_MIN_KV_BYTES > left - n_tensors * GGUF_MIN_TENSOR_BYTES)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: header claims %llu key/value pairs and %llu "
                            "tensors, more than the %zu bytes after byte %zu "
                            "can hold",
                            (unsigned long long)n_kv, (unsigned long long)n_tensors, left, r->pos);
    if (n_kv >= UINT32_MAX / 2 || n_tensors >= UINT32_MAX / 2)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "gguf: %llu key/value pairs and %llu tensors are "
                            "more than we index",
                            (unsigned long long)n_kv, (unsigned long long)n_tensors);

    /* Every array has at least one item, so index [0] is always valid. */
    is_status st;
    if ((st = reserve((void **)&ctx->kv, &ctx->kv_cap, 1, sizeof *ctx->kv)) ||
        (st = reserve((void **)&ctx->tensors, &ctx->tensor_cap, 1, sizeof *ctx->tensors)) ||
        (st = reserve((void **)&ctx->tnames, &ctx->tname_cap, 1, sizeof *ctx->tnames)))
        return st;
    for (int64_t i = 0; i < (int64_t)n_kv; i++) {
        st = reserve((void **)&ctx->kv, &ctx->kv_cap, i + 1, sizeof *ctx->kv);
        if (st != IS_OK) return st;
        ctx->n_kv = i + 1; /* counted before parsing: close frees its index */
        if ((st = parse_kv(ctx, r, i)) != IS_OK) return st;
    }
    if ((st = index_keys(ctx)) != IS_OK) return st;
    if ((st = read_alignment(ctx)) != IS_OK) return st;
    for (int64_t i = 0; i < (int64_t)n_tensors; i++) {
        if ((st = reserve((void **)&ctx->tensors, &ctx->tensor_cap, i + 1, sizeof *ctx->tensors)) ||
            (st = reserve((void **)&ctx->tnames, &ctx->tname_cap, i + 1, sizeof *ctx->tnames)))
            return st;
        ctx->n_tensors = i + 1;
        if ((st = parse_tensor(ctx, r, i)) != IS_OK) return st;
    }
    if ((st = index_tensors(ctx)) != IS_OK) return st;

    /* The arena no longer moves: hand out pointers into it. */
    for (int64_t i = 0; i < ctx->n_tensors; i++)
        ctx->tensors[i].name = ctx->names + ctx->tnames[i].off;

    uint64_t pad = (ctx->alignment - r->pos % ctx->alignment) % ctx->alignment;
    ctx->data_offset = (uint64_t)r->pos + pad;
    return check_tensor_data(ctx);
}

static is_status open_buffer(const void *data, size_t size, bool mapped, gguf_ctx **out) {
    gguf_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) return is_error_set(IS_ERR_NOMEM, "gguf: out of memory");
    ctx->data = data;
    ctx->size = size;
    ctx->alignment = GGUF_DEFAULT_ALIGNMENT;
    is_status st = parse(ctx);
    if (st != IS_OK) {
        gguf_close(ctx); /* mapped is still false: the caller unmaps */
        return st;
    }
    ctx->mapped = mapped;
    *out = ctx;
    return IS_OK;
}

is_status gguf_open_memory(const void *data, size_t size, gguf_ctx **out) {
    if (out == NULL || (data == NULL && size > 0))
        return is_error_set(IS_ERR_INVALID_ARG, "gguf_open_memory: NULL argument");
    return open_buffer(data, size, false, out);
}

is_status gguf_open(const char *path, gguf_ctx **out) {
    if (path == NULL || out == NULL)
        return is_error_set(IS_ERR_INVALID_ARG, "gguf_open: NULL argument");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return is_error_set(IS_ERR_IO, "gguf: cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return is_error_set(IS_ERR_IO, "gguf: cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return is_error_set(IS_ERR_IO, "gguf: '%s' is not a regular file", path);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return is_error_set(IS_ERR_UNSUPPORTED, "gguf: '%s' is too large to map", path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = NULL;
    if (size > 0) { /* mmap of 0 bytes fails; parse reports the empty file */
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return is_error_set(IS_ERR_IO, "gguf: cannot map '%s': %s", path, strerror(e));
        }
    }
    close(fd); /* the mapping keeps the file */
    if (verify_enabled()) {
        is_status vs = verify_sha256(path, map, size);
        if (vs != IS_OK) {
            if (map) munmap(map, size);
            return vs;
        }
    }

    is_status st = open_buffer(map, size, true, out);
    if (st != IS_OK) {
        if (map != NULL) munmap(map, size);
        /* Name the file in the parser's message: "gguf: PATH: reason". */
        char msg[512];
        const char *last = is_error_last();
        if (strncmp(last, "gguf: ", 6) == 0) last += 6;
        snprintf(msg, sizeof msg, "%s", last);
        is_error_set(st, "gguf: %s: %s", path, msg);
    }
    return st;
}

void gguf_close(gguf_ctx *ctx) {
    if (ctx == NULL) return;
    if (ctx->kv != NULL)
        for (int64_t i = 0; i < ctx->n_kv; i++) free(ctx->kv[i].arr_str_pos);
    free(ctx->kv);
    free(ctx->tensors);
    free(ctx->tnames);
    free(ctx->names);
    free(ctx->kv_index.slots);
    free(ctx->tensor_index.slots);
    if (ctx->mapped) munmap((void *)ctx->data, ctx->size);
    free(ctx);
}

/* ---- accessors ------------------------------------------------------------------------ */

uint32_t gguf_version(const gguf_ctx *ctx) { return ctx->version; }
uint32_t gguf_alignment(const gguf_ctx *ctx) { return ctx->alignment; }
size_t gguf_file_size(const gguf_ctx *ctx) { return ctx->size; }
const void *gguf_file_data(const gguf_ctx *ctx) { return ctx->data; }
uint64_t gguf_data_offset(const gguf_ctx *ctx) { return ctx->data_offset; }

int64_t gguf_n_keys(const gguf_ctx *ctx) { return ctx->n_kv; }

int64_t gguf_find_key(const gguf_ctx *ctx, const char *key) {
    if (ctx == NULL || key == NULL || ctx->kv_index.slots == NULL) return -1;
    uint32_t slot = *kv_slot(ctx, key);
    return slot == 0 ? -1 : (int64_t)slot - 1;
}

const char *gguf_key_name(const gguf_ctx *ctx, int64_t i) {
    if (i < 0 || i >= ctx->n_kv) return NULL;
    return ctx->names + ctx->kv[i].key_off;
}

gguf_value_type gguf_key_type(const gguf_ctx *ctx, int64_t i) {
    if (i < 0 || i >= ctx->n_kv) return GGUF_VALUE_COUNT_;
    return ctx->kv[i].type;
}

static is_status find_kv(const gguf_ctx *ctx, const char *key, const gguf_kv **kv) {
    if (ctx == NULL || key == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL argument");
    int64_t i = gguf_find_key(ctx, key);
    if (i < 0) return is_error_set(IS_ERR_NOT_FOUND, "gguf: key '%s' not found", key);
    *kv = &ctx->kv[i];
    return IS_OK;
}

static is_status wrong_type(const char *key, const gguf_kv *kv, const char *want) {
    return is_error_set(IS_ERR_FORMAT, "gguf: key '%s' is %s, expected %s", key,
                        gguf_value_type_name(kv->type), want);
}

static bool is_signed_int(gguf_value_type t) {
    return t == GGUF_VALUE_INT8 || t == GGUF_VALUE_INT16 || t == GGUF_VALUE_INT32 ||
           t == GGUF_VALUE_INT64;
}

static bool is_unsigned_int(gguf_value_type t) {
    return t == GGUF_VALUE_UINT8 || t == GGUF_VALUE_UINT16 || t == GGUF_VALUE_UINT32 ||
           t == GGUF_VALUE_UINT64;
}

/* An integer value of any width, checked to lie in [lo, hi]. On success
 * exactly one of: *neg set true and *sval the (negative) value, or *neg false
 * and *uval the non-negative value. */
static is_status get_int(const gguf_ctx *ctx, const char *key, const char *want, int64_t lo,
                         uint64_t hi, bool *neg, int64_t *sval, uint64_t *uval) {
    const gguf_kv *kv;
    is_status st = find_kv(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (is_signed_int(kv->type) && kv->num.i < 0) {
        if (kv->num.i < lo)
            return is_error_set(IS_ERR_FORMAT, "gguf: key '%s' = %lld does not fit %s", key,
                                (long long)kv->num.i, want);
        *neg = true;
        *sval = kv->num.i;
        return IS_OK;
    }
    uint64_t u;
    if (is_signed_int(kv->type)) u = (uint64_t)kv->num.i;
    else if (is_unsigned_int(kv->type)) u = kv->num.u;
    else return wrong_type(key, kv, want);
    if (u > hi)
        return is_error_set(IS_ERR_FORMAT, "gguf: key '%s' = %llu does not fit %s", key,
                            (unsigned long long)u, want);
    *neg = false;
    *uval = u;
    return IS_OK;
}

is_status gguf_get_u32(const gguf_ctx *ctx, const char *key, uint32_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = get_int(ctx, key, "u32", 0, UINT32_MAX, &neg, &s, &u);
    if (st == IS_OK) *out = (uint32_t)u;
    return st;
}

is_status gguf_get_i32(const gguf_ctx *ctx, const char *key, int32_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = get_int(ctx, key, "i32", INT32_MIN, INT32_MAX, &neg, &s, &u);
    if (st == IS_OK) *out = neg ? (int32_t)s : (int32_t)u;
    return st;
}

is_status gguf_get_u64(const gguf_ctx *ctx, const char *key, uint64_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = get_int(ctx, key, "u64", 0, UINT64_MAX, &neg, &s, &u);
    if (st == IS_OK) *out = u;
    return st;
}

is_status gguf_get_i64(const gguf_ctx *ctx, const char *key, int64_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = get_int(ctx, key, "i64", INT64_MIN, INT64_MAX, &neg, &s, &u);
    if (st == IS_OK) *out = neg ? s : (int64_t)u;
    return st;
}

is_status gguf_get_f32(const gguf_ctx *ctx, const char *key, float *out) {
    const gguf_kv *kv;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_kv(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->type != GGUF_VALUE_FLOAT32 && kv->type != GGUF_VALUE_FLOAT64)
        return wrong_type(key, kv, "f32 or f64");
    *out = (float)kv->num.f;
    return IS_OK;
}

is_status gguf_get_f64(const gguf_ctx *ctx, const char *key, double *out) {
    const gguf_kv *kv;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_kv(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->type != GGUF_VALUE_FLOAT32 && kv->type != GGUF_VALUE_FLOAT64)
        return wrong_type(key, kv, "f32 or f64");
    *out = kv->num.f;
    return IS_OK;
}

is_status gguf_get_bool(const gguf_ctx *ctx, const char *key, bool *out) {
    const gguf_kv *kv;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_kv(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->type != GGUF_VALUE_BOOL) return wrong_type(key, kv, "bool");
    *out = kv->num.u != 0;
    return IS_OK;
}

is_status gguf_get_str(const gguf_ctx *ctx, const char *key, gguf_string *out) {
    const gguf_kv *kv;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_kv(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->type != GGUF_VALUE_STRING) return wrong_type(key, kv, "string");
    *out = kv->str;
    return IS_OK;
}

static is_status find_arr(const gguf_ctx *ctx, const char *key, const gguf_kv **kv) {
    is_status st = find_kv(ctx, key, kv);
    if (st != IS_OK) return st;
    if ((*kv)->type != GGUF_VALUE_ARRAY) return wrong_type(key, *kv, "array");
    return IS_OK;
}

is_status gguf_get_arr(const gguf_ctx *ctx, const char *key, gguf_value_type *elem_type,
                       uint64_t *count) {
    const gguf_kv *kv;
    is_status st = find_arr(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (elem_type != NULL) *elem_type = kv->arr_type;
    if (count != NULL) *count = kv->arr_count;
    return IS_OK;
}

is_status gguf_get_arr_data(const gguf_ctx *ctx, const char *key, const void **data) {
    const gguf_kv *kv;
    if (data == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_arr(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->arr_type == GGUF_VALUE_STRING)
        return is_error_set(IS_ERR_FORMAT,
                            "gguf: array '%s' holds strings: use "
                            "gguf_get_arr_str",
                            key);
    *data = ctx->data + kv->arr_pos;
    return IS_OK;
}

is_status gguf_get_arr_str(const gguf_ctx *ctx, const char *key, uint64_t i, gguf_string *out) {
    const gguf_kv *kv;
    if (out == NULL) return is_error_set(IS_ERR_INVALID_ARG, "gguf: NULL out");
    is_status st = find_arr(ctx, key, &kv);
    if (st != IS_OK) return st;
    if (kv->arr_type != GGUF_VALUE_STRING)
        return is_error_set(IS_ERR_FORMAT, "gguf: array '%s' holds %s, expected strings", key,
                            gguf_value_type_name(kv->arr_type));
    if (i >= kv->arr_count)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "gguf: index %llu out of range for array '%s' of "
                            "%llu strings",
                            (unsigned long long)i, key, (unsigned long long)kv->arr_count);
    uint64_t pos = kv->arr_str_pos[i], len;
    memcpy(&len, ctx->data + pos, 8);
    out->data = (const char *)ctx->data + pos + 8;
    out->len = len;
    return IS_OK;
}

int64_t gguf_n_tensors(const gguf_ctx *ctx) { return ctx->n_tensors; }

const gguf_tensor *gguf_tensor_at(const gguf_ctx *ctx, int64_t i) {
    if (i < 0 || i >= ctx->n_tensors) return NULL;
    return &ctx->tensors[i];
}

const gguf_tensor *gguf_find_tensor(const gguf_ctx *ctx, const char *name) {
    if (ctx == NULL || name == NULL || ctx->tensor_index.slots == NULL) return NULL;
    uint32_t slot = *tensor_slot(ctx, name);
    return slot == 0 ? NULL : &ctx->tensors[slot - 1];
}

/*
 * filter: Mem0's filter language (see filter.h). The JSON is parsed once
 * into a small tree; dates are turned into unix milliseconds there, so a
 * match only compares. A fact's metadata is parsed once per match.
 */
#include "memory/filter.h"

#include "core/status.h"
#include "memory/metadata.h"

#include <cJSON.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_DEPTH 32

typedef enum node_kind { NODE_AND, NODE_OR, NODE_NOT, NODE_COND } node_kind;
typedef enum field_kind {
    FIELD_USER,
    FIELD_AGENT,
    FIELD_RUN,
    FIELD_CREATED,
    FIELD_UPDATED,
    FIELD_META
} field_kind;
typedef enum op_kind {
    OP_EQ,
    OP_NE,
    OP_IN,
    OP_NIN,
    OP_GT,
    OP_GTE,
    OP_LT,
    OP_LTE,
    OP_CONTAINS,
    OP_ICONTAINS,
    OP_ANY
} op_kind;

static const char *const OP_NAMES[] = {"eq",  "ne", "in",  "nin",      "gt",
                                       "gte", "lt", "lte", "contains", "icontains"};
#define N_OPS ((int)(sizeof OP_NAMES / sizeof OP_NAMES[0]))

/* Mem0 fields this store has no column or meaning for. */
static const char *const UNSUPPORTED[] = {"app_id",          "categories", "keywords",
                                          "expiration_date", "memory_ids", "immutable",
                                          "timestamp",       "org_id",     "project_id"};

struct mem_filter_expr {
    node_kind kind;
    mem_filter_expr **kids; /* [n_kids] for AND, OR, NOT */
    int n_kids;
    field_kind field; /* NODE_COND */
    char *key;        /* metadata key (FIELD_META) */
    op_kind op;
    cJSON *value; /* owned; times already in unix ms (numbers) */
};

void mem_filter_expr_free(mem_filter_expr *e) {
    if (!e) return;
    for (int i = 0; i < e->n_kids; i++) mem_filter_expr_free(e->kids[i]);
    free(e->kids);
    free(e->key);
    cJSON_Delete(e->value);
    free(e);
}

/* ---- time ---------------------------------------------------------------------------- */

static int64_t days_from_civil(int64_t y, int m, int d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static bool digits(const char *s, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (!isdigit((unsigned char)s[i])) return false;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return true;
}

bool mem_filter_parse_time(const char *s, int64_t *unix_ms) {
    int y, mo, d, h = 0, mi = 0, sec = 0, ms = 0, off = 0;
    if (!s || strlen(s) < 10 || !digits(s, 4, &y) || s[4] != '-' || !digits(s + 5, 2, &mo) ||
        s[7] != '-' || !digits(s + 8, 2, &d))
        return false;
    if (mo < 1 || mo > 12 || d < 1 || d > 31) return false;
    const char *p = s + 10;
    if (*p == 'T' || *p == 't' || *p == ' ') {
        p++;
        if (!digits(p, 2, &h) || p[2] != ':' || !digits(p + 3, 2, &mi)) return false;
        p += 5;
        if (*p == ':') {
            if (!digits(p + 1, 2, &sec)) return false;
            p += 3;
            if (*p == '.') {
                p++;
                int nd = 0;
                while (isdigit((unsigned char)*p)) {
                    if (nd < 3) ms = ms * 10 + (*p - '0');
                    nd++;
                    p++;
                }
                if (nd == 0) return false;
                for (; nd < 3; nd++) ms *= 10;
            }
        }
        if (h > 23 || mi > 59 || sec > 60) return false;
        if (*p == 'Z' || *p == 'z') p++;
        else if (*p == '+' || *p == '-') {
            int oh, om;
            int sign = *p == '-' ? -1 : 1;
            if (!digits(p + 1, 2, &oh)) return false;
            p += 3;
            if (*p == ':') p++;
            if (!digits(p, 2, &om)) return false;
            p += 2;
            off = sign * (oh * 60 + om);
        }
    }
    if (*p) return false;
    int64_t t = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec - (int64_t)off * 60;
    *unix_ms = t * 1000 + ms;
    return true;
}

/* ---- parse ------------------------------------------------------------------------------- */

static is_status fail(const char *fmt, const char *a) {
    return is_error_set(IS_ERR_INVALID_ARG, fmt, a);
}

static mem_filter_expr *node_new(node_kind k) {
    mem_filter_expr *e = calloc(1, sizeof *e);
    if (e) e->kind = k;
    return e;
}

static bool add_kid(mem_filter_expr *e, mem_filter_expr *kid) {
    mem_filter_expr **nk = realloc(e->kids, (size_t)(e->n_kids + 1) * sizeof *nk);
    if (!nk) return false;
    e->kids = nk;
    e->kids[e->n_kids++] = kid;
    return true;
}

static int op_of(const char *name) {
    for (int i = 0; i < N_OPS; i++)
        if (strcmp(name, OP_NAMES[i]) == 0) return i;
    return -1;
}

static bool is_scalar(const cJSON *v) {
    return cJSON_IsString(v) || cJSON_IsNumber(v) || cJSON_IsBool(v) || cJSON_IsNull(v);
}

/* A filter value for a time field: unix ms from an ISO string or unix seconds. */
static is_status time_value(const cJSON *v, const char *field, cJSON **out) {
    int64_t ms;
    /* Unix seconds, within a few hundred thousand years: the ms fit in 64 bits. */
    if (cJSON_IsNumber(v) && v->valuedouble > -1e13 && v->valuedouble < 1e13)
        ms = (int64_t)(v->valuedouble * 1000.0);
    else if (cJSON_IsString(v) && mem_filter_parse_time(v->valuestring, &ms)) {
    } else
        return is_error_set(IS_ERR_INVALID_ARG,
                            "filters: %s needs ISO 8601 dates (2024-07-01 or 2024-07-01T10:00:00Z) "
                            "or unix seconds",
                            field);
    *out = cJSON_CreateNumber((double)ms);
    return *out ? IS_OK : IS_ERR_NOMEM;
}

static is_status cond_new(field_kind fk, const char *key, op_kind op, const cJSON *v,
                          const char *name, mem_filter_expr **out) {
    *out = NULL;
    bool is_time = fk == FIELD_CREATED || fk == FIELD_UPDATED;
    bool is_id = fk == FIELD_USER || fk == FIELD_AGENT || fk == FIELD_RUN;
    cJSON *val = NULL;
    is_status st = IS_OK;
    if (op == OP_IN || op == OP_NIN) {
        if (!cJSON_IsArray(v))
            return is_error_set(IS_ERR_INVALID_ARG, "filters: %s: \"%s\" needs a list", name,
                                OP_NAMES[op]);
        val = cJSON_CreateArray();
        if (!val) return IS_ERR_NOMEM;
        const cJSON *it;
        cJSON_ArrayForEach(it, v) {
            cJSON *c = NULL;
            if (!is_scalar(it)) {
                cJSON_Delete(val);
                return is_error_set(IS_ERR_INVALID_ARG,
                                    "filters: %s: \"%s\" takes a list of scalars", name,
                                    OP_NAMES[op]);
            }
            if (is_time) {
                if ((st = time_value(it, name, &c)) != IS_OK) {
                    cJSON_Delete(val);
                    return st;
                }
            } else if (!(c = cJSON_Duplicate(it, false))) {
                cJSON_Delete(val);
                return IS_ERR_NOMEM;
            }
            cJSON_AddItemToArray(val, c);
        }
    } else {
        if (!is_scalar(v))
            return is_error_set(IS_ERR_INVALID_ARG, "filters: %s: \"%s\" takes a scalar", name,
                                op == OP_EQ ? "eq" : OP_NAMES[op]);
        if ((op == OP_CONTAINS || op == OP_ICONTAINS) && (is_time || (is_id && !cJSON_IsString(v))))
            return is_error_set(IS_ERR_INVALID_ARG, "filters: %s: \"%s\" needs a string", name,
                                OP_NAMES[op]);
        if (op == OP_EQ && cJSON_IsString(v) && strcmp(v->valuestring, "*") == 0) op = OP_ANY;
        else if (is_time) {
            if ((st = time_value(v, name, &val)) != IS_OK) return st;
        }
        if (!val && !(val = cJSON_Duplicate(v, false))) return IS_ERR_NOMEM;
    }
    mem_filter_expr *e = node_new(NODE_COND);
    if (!e || (key && !(e->key = strdup(key)))) {
        free(e);
        cJSON_Delete(val);
        return IS_ERR_NOMEM;
    }
    e->field = fk;
    e->op = op;
    e->value = val;
    *out = e;
    return IS_OK;
}

/* The conditions of one field: a scalar (equality) or an object of
 * operators, ANDed into parent. */
static is_status field_conds(field_kind fk, const char *key, const cJSON *v, const char *name,
                             mem_filter_expr *parent) {
    mem_filter_expr *c = NULL;
    is_status st;
    if (cJSON_IsObject(v)) {
        if (!v->child)
            return fail("filters: %s: an empty object (give a value or operators such as "
                        "{\"in\": [...]})",
                        name);
        const cJSON *o;
        cJSON_ArrayForEach(o, v) {
            int op = op_of(o->string);
            if (op < 0)
                return is_error_set(IS_ERR_INVALID_ARG,
                                    "filters: %s: unknown operator \"%.60s\" (eq, ne, in, nin, "
                                    "gt, gte, lt, lte, contains, icontains)",
                                    name, o->string);
            if ((st = cond_new(fk, key, (op_kind)op, o, name, &c)) != IS_OK) return st;
            if (!add_kid(parent, c)) {
                mem_filter_expr_free(c);
                return IS_ERR_NOMEM;
            }
        }
        return IS_OK;
    }
    if (cJSON_IsArray(v))
        return fail("filters: %s: a list is not a value (use {\"in\": [...]})", name);
    if ((st = cond_new(fk, key, OP_EQ, v, name, &c)) != IS_OK) return st;
    if (!add_kid(parent, c)) {
        mem_filter_expr_free(c);
        return IS_ERR_NOMEM;
    }
    return IS_OK;
}

static is_status parse_object(const cJSON *o, int depth, mem_filter_expr **out);

static is_status parse_list(node_kind k, const cJSON *v, int depth, mem_filter_expr **out) {
    const char *name = k == NODE_AND ? "AND" : k == NODE_OR ? "OR" : "NOT";
    if (cJSON_IsObject(v)) { /* {"NOT": {...}}: one filter */
        mem_filter_expr *n = node_new(k), *kid = NULL;
        if (!n) return IS_ERR_NOMEM;
        is_status st = parse_object(v, depth + 1, &kid);
        if (st == IS_OK && !add_kid(n, kid)) {
            mem_filter_expr_free(kid);
            st = IS_ERR_NOMEM;
        }
        if (st != IS_OK) mem_filter_expr_free(n);
        else *out = n;
        return st;
    }
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0)
        return fail("filters: %s needs a non-empty list of filter objects", name);
    mem_filter_expr *n = node_new(k);
    if (!n) return IS_ERR_NOMEM;
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        mem_filter_expr *kid = NULL;
        is_status st = cJSON_IsObject(it) ? parse_object(it, depth + 1, &kid)
                                          : fail("filters: the items of %s must be objects", name);
        if (st == IS_OK && !add_kid(n, kid)) {
            mem_filter_expr_free(kid);
            st = IS_ERR_NOMEM;
        }
        if (st != IS_OK) {
            mem_filter_expr_free(n);
            return st;
        }
    }
    *out = n;
    return IS_OK;
}

static is_status parse_object(const cJSON *o, int depth, mem_filter_expr **out) {
    *out = NULL;
    if (depth > MAX_DEPTH) return fail("filters: nested deeper than %s levels", "32");
    mem_filter_expr *and = node_new(NODE_AND);
    if (!and) return IS_ERR_NOMEM;
    is_status st = IS_OK;
    const cJSON *it;
    cJSON_ArrayForEach(it, o) {
        const char *k = it->string;
        mem_filter_expr *kid = NULL;
        if (strcmp(k, "AND") == 0 || strcmp(k, "OR") == 0 || strcmp(k, "NOT") == 0) {
            node_kind nk = k[0] == 'A' ? NODE_AND : k[0] == 'O' ? NODE_OR : NODE_NOT;
            st = parse_list(nk, it, depth, &kid);
            if (st == IS_OK && !add_kid(and, kid)) {
                mem_filter_expr_free(kid);
                st = IS_ERR_NOMEM;
            }
        } else if (strcmp(k, "user_id") == 0) st = field_conds(FIELD_USER, NULL, it, k, and);
        else if (strcmp(k, "agent_id") == 0) st = field_conds(FIELD_AGENT, NULL, it, k, and);
        else if (strcmp(k, "run_id") == 0) st = field_conds(FIELD_RUN, NULL, it, k, and);
        else if (strcmp(k, "created_at") == 0) st = field_conds(FIELD_CREATED, NULL, it, k, and);
        else if (strcmp(k, "updated_at") == 0) st = field_conds(FIELD_UPDATED, NULL, it, k, and);
        else if (strcmp(k, "metadata") == 0) {
            if (!cJSON_IsObject(it)) st = fail("filters: %s must be an object", k);
            const cJSON *m;
            if (st == IS_OK) cJSON_ArrayForEach(m, it) {
                    char name[128];
                    snprintf(name, sizeof name, "metadata.%.100s", m->string);
                    if ((st = field_conds(FIELD_META, m->string, m, name, and)) != IS_OK) break;
                }
        } else {
            for (size_t i = 0; i < sizeof UNSUPPORTED / sizeof UNSUPPORTED[0]; i++)
                if (strcmp(k, UNSUPPORTED[i]) == 0) {
                    st = is_error_set(
                        IS_ERR_INVALID_ARG,
                        "filters: \"%s\" is not supported by this server (its memories "
                        "have no %s; see the Mem0 feature table in the README)",
                        k, k);
                    break;
                }
            if (st == IS_OK) {
                if (cJSON_IsObject(it) && it->child && op_of(it->child->string) < 0)
                    st = is_error_set(IS_ERR_INVALID_ARG,
                                      "filters: \"%.60s\" is read as a metadata key, and its value "
                                      "must be a scalar or an object of operators",
                                      k);
                else st = field_conds(FIELD_META, k, it, k, and);
            }
        }
        if (st != IS_OK) break;
    }
    if (st != IS_OK) {
        mem_filter_expr_free(and);
        return st;
    }
    *out = and;
    return IS_OK;
}

is_status mem_filter_parse(const char *json, size_t len, mem_filter_expr **out) {
    *out = NULL;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return is_error_set(IS_ERR_INVALID_ARG, "filters: not valid JSON");
    is_status st = cJSON_IsObject(root) ? parse_object(root, 0, out)
                                        : fail("filters: %s must be a JSON object", "the filter");
    cJSON_Delete(root);
    return st;
}

/* ---- match -------------------------------------------------------------------------------- */

typedef struct match_ctx {
    const mem_fact *f;
    cJSON *meta; /* the fact's metadata, parsed at the first metadata condition */
    bool meta_done;
} match_ctx;

/* Equality as the rest of the store compares metadata: canonical strings. */
static bool scalar_eq(const cJSON *a, const cJSON *b) {
    if (cJSON_IsNumber(a) && cJSON_IsNumber(b)) return a->valuedouble == b->valuedouble;
    char *x = metadata_scalar_string(a), *y = metadata_scalar_string(b);
    bool eq = x && y && strcmp(x, y) == 0;
    free(x);
    free(y);
    return eq;
}

/* -2: not comparable; else <0, 0, >0. */
static int scalar_cmp(const cJSON *a, const cJSON *b) {
    if (cJSON_IsNumber(a) && cJSON_IsNumber(b))
        return a->valuedouble < b->valuedouble ? -1 : a->valuedouble > b->valuedouble ? 1 : 0;
    if (cJSON_IsString(a) && cJSON_IsString(b)) {
        int c = strcmp(a->valuestring, b->valuestring);
        return c < 0 ? -1 : c > 0 ? 1 : 0;
    }
    return -2;
}

static bool icontains(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    for (const char *p = hay; *p; p++)
        if (strncasecmp(p, needle, n) == 0) return true;
    return n == 0;
}

static bool cond_match(const mem_filter_expr *e, match_ctx *c) {
    cJSON tmp;
    memset(&tmp, 0, sizeof tmp);
    const cJSON *a = NULL; /* the fact's value; NULL when absent */
    const char *s = NULL;
    switch (e->field) {
    case FIELD_USER: s = c->f->user; break;
    case FIELD_AGENT: s = c->f->agent_id; break;
    case FIELD_RUN: s = c->f->run_id; break;
    case FIELD_CREATED:
    case FIELD_UPDATED:
        tmp.type = cJSON_Number;
        tmp.valuedouble = (double)(e->field == FIELD_CREATED ? c->f->created_at : c->f->updated_at);
        a = &tmp;
        break;
    case FIELD_META:
        if (!c->meta_done) {
            c->meta = c->f->metadata ? cJSON_Parse(c->f->metadata) : NULL;
            c->meta_done = true;
        }
        a = c->meta ? cJSON_GetObjectItemCaseSensitive(c->meta, e->key) : NULL;
        break;
    }
    if (s) {
        tmp.type = cJSON_String;
        tmp.valuestring = (char *)s;
        a = &tmp;
    }
    const cJSON *b = e->value;
    switch (e->op) {
    case OP_ANY: return a && !cJSON_IsNull(a);
    case OP_EQ: return a && scalar_eq(a, b);
    case OP_NE: return !a || !scalar_eq(a, b);
    case OP_IN:
    case OP_NIN: {
        bool in = false;
        const cJSON *it;
        if (a) cJSON_ArrayForEach(it, b) if (scalar_eq(a, it)) in = true;
        return e->op == OP_IN ? in : !in;
    }
    case OP_GT:
    case OP_GTE:
    case OP_LT:
    case OP_LTE: {
        if (!a) return false;
        int r = scalar_cmp(a, b);
        if (r == -2) return false;
        return e->op == OP_GT ? r > 0 : e->op == OP_GTE ? r >= 0 : e->op == OP_LT ? r < 0 : r <= 0;
    }
    case OP_CONTAINS:
    case OP_ICONTAINS:
        if (!a) return false;
        if (cJSON_IsArray(a)) {
            const cJSON *it;
            cJSON_ArrayForEach(it, a) if (scalar_eq(it, b)) return true;
            return false;
        }
        if (!cJSON_IsString(a) || !cJSON_IsString(b)) return false;
        return e->op == OP_CONTAINS ? strstr(a->valuestring, b->valuestring) != NULL
                                    : icontains(a->valuestring, b->valuestring);
    }
    return false;
}

static bool node_match(const mem_filter_expr *e, match_ctx *c) {
    switch (e->kind) {
    case NODE_AND:
        for (int i = 0; i < e->n_kids; i++)
            if (!node_match(e->kids[i], c)) return false;
        return true;
    case NODE_OR:
        for (int i = 0; i < e->n_kids; i++)
            if (node_match(e->kids[i], c)) return true;
        return false;
    case NODE_NOT:
        for (int i = 0; i < e->n_kids; i++)
            if (node_match(e->kids[i], c)) return false;
        return true;
    case NODE_COND: return cond_match(e, c);
    }
    return false;
}

bool mem_filter_match(const mem_filter_expr *e, const mem_fact *f) {
    match_ctx c = {.f = f};
    bool m = node_match(e, &c);
    cJSON_Delete(c.meta);
    return m;
}

const char *mem_filter_user(const mem_filter_expr *e) {
    if (e->kind == NODE_COND)
        return e->field == FIELD_USER && e->op == OP_EQ && cJSON_IsString(e->value)
                   ? e->value->valuestring
                   : NULL;
    if (e->kind != NODE_AND) return NULL;
    for (int i = 0; i < e->n_kids; i++) {
        const char *u = mem_filter_user(e->kids[i]);
        if (u) return u;
    }
    return NULL;
}

bool mem_filter_has_scope(const mem_filter_expr *e) {
    if (e->kind == NODE_COND)
        return e->field == FIELD_USER || e->field == FIELD_AGENT || e->field == FIELD_RUN;
    for (int i = 0; i < e->n_kids; i++)
        if (mem_filter_has_scope(e->kids[i])) return true;
    return false;
}

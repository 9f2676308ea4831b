/*
 * mem0: Mem0 platform routes for the official mem0ai clients (see mem0.h).
 *
 * Request fields the clients always send and that change nothing here are
 * accepted: output_format, async_mode (adds are stored before the reply
 * either way, which is what a synchronous add promises and more than an
 * asynchronous one does), version, org_id and project_id (the tenant comes
 * from the key; a project_id naming another tenant is refused). Fields of
 * Mem0 features this server does not have (custom_categories, graph,
 * expiration dates, app_id, ...) are refused by name with 400
 * "unsupported_feature" when set, so a client never believes they took
 * effect. Any other unknown field is 400 "unknown_field".
 */
#include "serve/http/mem0.h"

#include "core/status.h"
#include "core/utf8.h"
#include "memory/filter.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#define MAX_QUERY_ARGS    64
#define MAX_BATCH         1000
#define DEFAULT_PAGE_SIZE 100
#define MAX_PAGE_SIZE     1000
#define ORG_ID            "inferscale"

/* ---- helpers ------------------------------------------------------------------------ */

static bool is_no_user(const char *u) { return u && strcmp(u, HTTP_MEM0_NO_USER) == 0; }

static enum MHD_Result unsupported(http_req *r, const char *param, const char *what) {
    return http_send_error(r, 400, param, "unsupported_feature",
                           "%s is not supported by this server (InferScale); see the Mem0 feature "
                           "table in the README",
                           what);
}

/* Fields every route accepts and ignores; project_id must be the tenant. */
static bool common_field(http_req *r, const char *k, const cJSON *v, enum MHD_Result *res,
                         bool *handled) {
    *handled = true;
    if (strcmp(k, "org_id") == 0 || strcmp(k, "version") == 0 || strcmp(k, "output_format") == 0 ||
        strcmp(k, "async_mode") == 0)
        return true;
    if (strcmp(k, "project_id") == 0) {
        if (cJSON_IsString(v) && strcmp(v->valuestring, r->tenant) != 0) {
            *res = http_send_error(r, 400, "project_id", "invalid_value",
                                   "project_id %.100s is not the project of this API key (%s)",
                                   v->valuestring, r->tenant);
            return false;
        }
        return true;
    }
    *handled = false;
    return true;
}

/* Mem0 options without an equivalent here: refused when set (not null,
 * not false, not empty). */
static const char *const UNSUPPORTED_FIELDS[] = {"app_id",
                                                 "custom_categories",
                                                 "custom_instructions",
                                                 "agent_custom_instructions",
                                                 "includes",
                                                 "excludes",
                                                 "timestamp",
                                                 "expiration_date",
                                                 "structured_data_schema",
                                                 "enable_graph",
                                                 "immutable",
                                                 "categories",
                                                 "rerank",
                                                 "keyword_search",
                                                 "fields",
                                                 "reference_date",
                                                 "start_date",
                                                 "end_date",
                                                 "latest_only",
                                                 "show_expired",
                                                 "delete_linked",
                                                 "filter_memories",
                                                 "only_metadata_based_search",
                                                 "memory_depth",
                                                 "usecase_setting"};

static bool unsupported_field(const char *k, const cJSON *v) {
    for (size_t i = 0; i < sizeof UNSUPPORTED_FIELDS / sizeof UNSUPPORTED_FIELDS[0]; i++)
        if (strcmp(k, UNSUPPORTED_FIELDS[i]) == 0)
            return !(cJSON_IsNull(v) || cJSON_IsFalse(v) ||
                     (cJSON_IsString(v) && !*v->valuestring) ||
                     ((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child) ||
                     (strcmp(k, "delete_linked") == 0 && cJSON_IsString(v) &&
                      strcmp(v->valuestring, "false") == 0));
    return false;
}

static bool known_unsupported(const char *k) {
    for (size_t i = 0; i < sizeof UNSUPPORTED_FIELDS / sizeof UNSUPPORTED_FIELDS[0]; i++)
        if (strcmp(k, UNSUPPORTED_FIELDS[i]) == 0) return true;
    return false;
}

/* The body under the checks of every other route (parse_object): a NUL,
 * a "\u0000" escape or trailing data is a 400, never a string cut short or
 * a request half read. An empty body reads as {}. */
static cJSON *parse_body(http_req *r, enum MHD_Result *res) {
    if (!r->body || r->len == 0) return cJSON_CreateObject();
    parse_error pe;
    cJSON *o = parse_object(r->body, r->len, NULL, &pe);
    if (!o) *res = http_send_parse_error(r, &pe);
    return o;
}

/* An id given by the caller (body, query string, path) through the one
 * check of parse_id_check; sends the 400 itself. */
static bool id_ok(http_req *r, const char *name, const char *v, enum MHD_Result *res) {
    parse_error pe;
    if (parse_id_check(name, v, strlen(v), &pe) == IS_OK) return true;
    *res = http_send_parse_error(r, &pe);
    return false;
}

/* Python's repr of a dict (what httpx sends for a dict query parameter, as
 * mem0ai's delete_all(filters=...) does) turned into JSON; JSON is left as
 * it is. NULL when out of memory. */
static char *pyrepr_to_json(const char *s) {
    size_t n = strlen(s);
    char *o = malloc(n * 2 + 1), *w = o;
    if (!o) return NULL;
    for (const char *p = s; *p;) {
        if (*p == '\'' || *p == '"') {
            char q = *p++;
            *w++ = '"';
            while (*p && *p != q) {
                if (*p == '\\' && p[1]) {
                    if (p[1] == '\'') {
                        *w++ = '\'';
                        p += 2;
                        continue;
                    }
                    *w++ = *p++;
                    *w++ = *p++;
                    continue;
                }
                if (*p == '"') *w++ = '\\';
                *w++ = *p++;
            }
            if (*p) p++;
            *w++ = '"';
        } else if (strncmp(p, "True", 4) == 0 && !isalnum((unsigned char)p[4])) {
            memcpy(w, "true", 4), w += 4, p += 4;
        } else if (strncmp(p, "False", 5) == 0 && !isalnum((unsigned char)p[5])) {
            memcpy(w, "false", 5), w += 5, p += 5;
        } else if (strncmp(p, "None", 4) == 0 && !isalnum((unsigned char)p[4])) {
            memcpy(w, "null", 4), w += 4, p += 4;
        } else {
            *w++ = *p++;
        }
    }
    *w = '\0';
    return o;
}

static bool is_id_key(const char *k) {
    return strcmp(k, "user_id") == 0 || strcmp(k, "agent_id") == 0 || strcmp(k, "run_id") == 0;
}

static bool filter_id_ok(http_req *r, const char *k, const cJSON *v, enum MHD_Result *res) {
    return !cJSON_IsString(v) || strcmp(v->valuestring, "*") == 0 ||
           id_ok(r, k, v->valuestring, res);
}

/* The id values inside a filters object (an equality, an operator's value
 * or list) through the id check, "*" excepted: here, and only here, it
 * means any value. Sends the 400 itself. Depth past the filter parser's
 * own limit is left to it. */
static bool filter_ids_ok(http_req *r, const cJSON *o, int depth, enum MHD_Result *res) {
    if (!cJSON_IsObject(o) || depth > 64) return true;
    const cJSON *it;
    cJSON_ArrayForEach(it, o) {
        const char *k = it->string;
        if (strcmp(k, "AND") == 0 || strcmp(k, "OR") == 0 || strcmp(k, "NOT") == 0) {
            if (cJSON_IsObject(it) && !filter_ids_ok(r, it, depth + 1, res)) return false;
            const cJSON *sub;
            if (cJSON_IsArray(it)) cJSON_ArrayForEach(sub, it) {
                    if (!filter_ids_ok(r, sub, depth + 1, res)) return false;
                }
            continue;
        }
        if (!is_id_key(k)) continue;
        if (!cJSON_IsObject(it)) {
            if (!filter_id_ok(r, k, it, res)) return false;
            continue;
        }
        const cJSON *op, *v; /* {"in": [...]}, {"ne": "x"}, ... */
        cJSON_ArrayForEach(op, it) {
            if (!filter_id_ok(r, k, op, res)) return false;
            if (cJSON_IsArray(op)) cJSON_ArrayForEach(v, op) {
                    if (!filter_id_ok(r, k, v, res)) return false;
                }
        }
    }
    return true;
}

/* What a top-level id of "*" means to build_filter. No stored id is "*"
 * (the id check refuses it), so the wildcard cannot be taken for a name. */
typedef enum star_id {
    STAR_REFUSED, /* a 400 pointing to filters */
    STAR_ANY,     /* every value: Mem0's delete_all(user_id="*") */
    STAR_NAME,    /* the name itself: a path names one entity, never all */
} star_id;

/* Builds the filter {"AND": [filters?, {"user_id": u}?, ...]} from a
 * filters object and top-level ids, parses it. The filter language reads an
 * equality with "*" as any value, so a "*" that names itself (STAR_NAME)
 * goes in as {"in": ["*"]}. Sends the error itself. */
static mem_filter_expr *build_filter(http_req *r, const cJSON *filters, const char *user,
                                     const char *agent, const char *run, const cJSON *metadata,
                                     bool require_scope, star_id star, enum MHD_Result *res) {
    cJSON *and = cJSON_CreateArray();
    if (filters && !cJSON_IsNull(filters)) {
        if (!cJSON_IsObject(filters)) {
            cJSON_Delete(and);
            *res = http_send_error(r, 400, "filters", "invalid_type", "filters must be an object");
            return NULL;
        }
        if (!filter_ids_ok(r, filters, 0, res)) {
            cJSON_Delete(and);
            return NULL;
        }
        if (filters->child) cJSON_AddItemToArray(and, cJSON_Duplicate(filters, true));
    }
    const char *names[3] = {"user_id", "agent_id", "run_id"};
    const char *vals[3] = {user, agent, run};
    for (int i = 0; i < 3; i++) {
        const bool is_star = vals[i] && strcmp(vals[i], "*") == 0;
        if (vals[i] && !(is_star && star != STAR_REFUSED) && !id_ok(r, names[i], vals[i], res)) {
            cJSON_Delete(and);
            return NULL;
        }
    }
    for (int i = 0; i < 3; i++)
        if (vals[i]) {
            cJSON *o = cJSON_CreateObject();
            if (star == STAR_NAME && strcmp(vals[i], "*") == 0) {
                cJSON *in = cJSON_AddObjectToObject(o, names[i]);
                cJSON_AddItemToObject(in, "in", cJSON_CreateStringArray(&vals[i], 1));
            } else {
                cJSON_AddStringToObject(o, names[i], vals[i]);
            }
            cJSON_AddItemToArray(and, o);
        }
    if (metadata && !cJSON_IsNull(metadata)) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "metadata", cJSON_Duplicate(metadata, true));
        cJSON_AddItemToArray(and, o);
    }
    cJSON *root = cJSON_CreateObject();
    if (cJSON_GetArraySize(and) > 0) cJSON_AddItemToObject(root, "AND", and);
    else cJSON_Delete(and);
    char *txt = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    mem_filter_expr *e = NULL;
    is_status st = txt ? mem_filter_parse(txt, strlen(txt), &e) : IS_ERR_NOMEM;
    free(txt);
    if (st != IS_OK) {
        const char *msg = is_error_last();
        char param[32] = "filters";
        for (size_t i = 0; i < sizeof UNSUPPORTED_FIELDS / sizeof UNSUPPORTED_FIELDS[0]; i++) {
            char q[48];
            snprintf(q, sizeof q, "\"%s\" is not supported", UNSUPPORTED_FIELDS[i]);
            if (strstr(msg, q)) snprintf(param, sizeof param, "%s", UNSUPPORTED_FIELDS[i]);
        }
        if (strstr(msg, "\"org_id\" is not") || strstr(msg, "\"project_id\" is not"))
            snprintf(param, sizeof param, "filters");
        *res = st == IS_ERR_NOMEM
                   ? http_send_error(r, 500, NULL, "out_of_memory", "out of memory")
                   : http_send_error(r, 400, param,
                                     strstr(msg, "not supported") ? "unsupported_feature"
                                                                  : "invalid_value",
                                     "%s", msg);
        return NULL;
    }
    if (require_scope && !mem_filter_has_scope(e)) {
        mem_filter_expr_free(e);
        *res =
            http_send_error(r, 400, "user_id", "missing_field",
                            "name the memories: user_id, agent_id or run_id (at the top level or "
                            "in filters; {\"user_id\": \"*\"} for every user)");
        return NULL;
    }
    return e;
}

/* The tenant's facts matching e, oldest first within each user. */
typedef struct fact_set {
    mem_fact *f;
    int32_t n, cap;
} fact_set;

static void fact_set_free(fact_set *s) {
    mem_facts_free(s->f, s->n);
    memset(s, 0, sizeof *s);
}

static bool fact_match(const mem_filter_expr *e, const mem_fact *f) {
    mem_fact view = *f;
    if (is_no_user(view.user)) view.user = NULL;
    return mem_filter_match(e, &view);
}

/* The users to scan for e: the pinned one or every user of the tenant. */
static is_status users_for(http_req *r, const mem_filter_expr *e, char ***users, int32_t *n) {
    const char *u = e ? mem_filter_user(e) : NULL;
    if (u) {
        *users = malloc(sizeof **users);
        if (!*users || !((*users)[0] = strdup(u))) {
            free(*users);
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
        *n = 1;
        return IS_OK;
    }
    return mem_store_users(memory_fact_store(r->srv->cfg.mem), r->tenant, users, n);
}

static void users_free(char **u, int32_t n) {
    for (int32_t i = 0; i < n; i++) free(u[i]);
    free(u);
}

static is_status collect(http_req *r, const mem_filter_expr *e, fact_set *out) {
    memset(out, 0, sizeof *out);
    char **users = NULL;
    int32_t nu = 0;
    is_status st = users_for(r, e, &users, &nu);
    if (st != IS_OK) return st;
    for (int32_t i = 0; i < nu && st == IS_OK; i++) {
        mem_filter f = {.tenant = r->tenant, .user = users[i]};
        mem_fact *facts = NULL;
        int32_t n = 0;
        if ((st = memory_get_all(r->srv->cfg.mem, &f, &facts, &n)) != IS_OK) break;
        for (int32_t j = 0; j < n; j++) {
            if (!fact_match(e, &facts[j])) {
                mem_fact_clear(&facts[j]);
                continue;
            }
            if (out->n == out->cap) {
                int32_t nc = out->cap ? out->cap * 2 : 64;
                mem_fact *nf = realloc(out->f, (size_t)nc * sizeof *nf);
                if (!nf) {
                    for (int32_t k = j; k < n; k++) mem_fact_clear(&facts[k]);
                    st = is_error_set(IS_ERR_NOMEM, "out of memory");
                    break;
                }
                out->f = nf;
                out->cap = nc;
            }
            out->f[out->n++] = facts[j]; /* moved */
        }
        free(facts);
    }
    users_free(users, nu);
    if (st != IS_OK) fact_set_free(out);
    return st;
}

/* ---- ping ------------------------------------------------------------------------------ */

static enum MHD_Result ping(http_req *r) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", "ok");
    cJSON_AddStringToObject(o, "message", "pong");
    cJSON_AddStringToObject(o, "org_id", ORG_ID);
    cJSON_AddStringToObject(o, "project_id", r->tenant);
    cJSON_AddNullToObject(o, "user_email");
    return http_send_json(r, 200, o);
}

/* ---- add -------------------------------------------------------------------------------- */

enum MHD_Result http_mem0_add(http_req *r) {
    enum MHD_Result res = MHD_YES;
    cJSON *b = parse_body(r, &res);
    if (!b) return res;
    cJSON *out = cJSON_CreateObject();
    const char *ids[3] = {"user_id", "agent_id", "run_id"};
    const char *idv[3] = {NULL, NULL, NULL};
    cJSON *it;
    cJSON_ArrayForEach(it, b) {
        const char *k = it->string;
        bool handled;
        if (!common_field(r, k, it, &res, &handled)) goto done;
        if (handled) continue;
        if (unsupported_field(k, it)) {
            res = unsupported(r, k, k);
            goto done;
        }
        if (known_unsupported(k)) continue; /* unset */
        if (strcmp(k, "filters") == 0) {
            if (cJSON_IsNull(it)) continue;
            if (!cJSON_IsObject(it)) {
                res =
                    http_send_error(r, 400, "filters", "invalid_type", "filters must be an object");
                goto done;
            }
            /* 2.x's add names its scope in filters: equalities on the ids only. */
            cJSON *f;
            cJSON_ArrayForEach(f, it) {
                int i = 0;
                while (i < 3 && strcmp(f->string, ids[i]) != 0) i++;
                if (i == 3) {
                    if (strcmp(f->string, "app_id") == 0 && !cJSON_IsNull(f)) {
                        res = unsupported(r, "app_id", "app_id");
                        goto done;
                    }
                    res = http_send_error(r, 400, "filters", "invalid_value",
                                          "an add's filters name its scope (user_id, agent_id, "
                                          "run_id); \"%.60s\" is not one",
                                          f->string);
                    goto done;
                }
                if (cJSON_IsNull(f)) continue;
                if (!cJSON_IsString(f)) {
                    res = http_send_error(r, 400, f->string, "invalid_type",
                                          "filters.%s must be a string", f->string);
                    goto done;
                }
                if (!id_ok(r, f->string, f->valuestring, &res)) goto done;
                if (idv[i] && strcmp(idv[i], f->valuestring) != 0) {
                    res = http_send_error(r, 400, f->string, "invalid_value",
                                          "%s is given twice with different values", f->string);
                    goto done;
                }
                idv[i] = f->valuestring;
            }
            continue;
        }
        int i = 0;
        while (i < 3 && strcmp(k, ids[i]) != 0) i++;
        if (i < 3) {
            if (cJSON_IsNull(it)) continue;
            if (!cJSON_IsString(it)) {
                res = http_send_error(r, 400, k, "invalid_type", "%s must be a string", k);
                goto done;
            }
            if (!id_ok(r, k, it->valuestring, &res)) goto done;
            if (idv[i] && strcmp(idv[i], it->valuestring) != 0) {
                res = http_send_error(r, 400, k, "invalid_value",
                                      "%s is given twice with different values", k);
                goto done;
            }
            idv[i] = it->valuestring;
            continue;
        }
        /* messages, facts, metadata, infer and anything unknown: the add
         * parser checks them (and refuses unknown fields by name). */
        cJSON_AddItemToObject(out, k, cJSON_Duplicate(it, true));
    }
    if (idv[0] && (!*idv[0] || is_no_user(idv[0]))) {
        res =
            http_send_error(r, 400, "user_id", "invalid_value", "user_id must be a non-empty name");
        goto done;
    }
    if (!idv[0] && !idv[1] && !idv[2]) {
        res = http_send_error(r, 400, "user_id", "missing_field",
                              "name the memories' owner: user_id, agent_id or run_id");
        goto done;
    }
    /* Without a user the parser still wants a valid id; the owner argument
     * below puts the memories under HTTP_MEM0_NO_USER. */
    cJSON_AddStringToObject(out, "user_id", idv[0] ? idv[0] : "mem0-no-user");
    if (idv[1]) cJSON_AddStringToObject(out, "agent_id", idv[1]);
    if (idv[2]) cJSON_AddStringToObject(out, "run_id", idv[2]);
    char *txt = cJSON_PrintUnformatted(out);
    if (!txt) {
        res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        goto done;
    }
    res = http_memories_add_body(r, txt, strlen(txt), idv[0] ? NULL : HTTP_MEM0_NO_USER);
    free(txt);
done:
    cJSON_Delete(out);
    cJSON_Delete(b);
    return res;
}

/* ---- list and search -------------------------------------------------------------------- */

/* Reads the ids, filters, metadata and the route's own fields (others:
 * unknown). Returns the filter or NULL after sending an error. */
typedef struct scope_args {
    const cJSON *filters, *metadata;
    const char *user, *agent, *run;
} scope_args;

static bool scope_field(http_req *r, const char *k, const cJSON *v, scope_args *a,
                        enum MHD_Result *res, bool *handled) {
    *handled = true;
    if (!common_field(r, k, v, res, handled)) return false;
    if (*handled) return true;
    *handled = true;
    if (unsupported_field(k, v)) {
        *res = unsupported(r, k, k);
        return false;
    }
    if (known_unsupported(k)) return true;
    if (strcmp(k, "filters") == 0) {
        a->filters = v;
        return true;
    }
    if (strcmp(k, "metadata") == 0) {
        a->metadata = v;
        return true;
    }
    const char **dst = strcmp(k, "user_id") == 0    ? &a->user
                       : strcmp(k, "agent_id") == 0 ? &a->agent
                       : strcmp(k, "run_id") == 0   ? &a->run
                                                    : NULL;
    if (!dst) {
        *handled = false;
        return true;
    }
    if (cJSON_IsNull(v)) return true;
    if (!cJSON_IsString(v)) {
        *res = http_send_error(r, 400, k, "invalid_type", "%s must be a string", k);
        return false;
    }
    /* The id itself is checked where it becomes a filter (build_filter),
     * which also says what a "*" means there. A repeated key
     * (?user_id=alice&user_id=bob, or twice in a body) must
     * not silently become its last value: the delete would hit bob. */
    if (*dst && strcmp(*dst, v->valuestring) != 0) {
        *res = http_send_error(r, 400, k, "invalid_value",
                               "'%s' is given twice with different values", k);
        return false;
    }
    *dst = v->valuestring;
    return true;
}

static bool int_field(http_req *r, const char *k, const cJSON *v, int32_t lo, int32_t hi,
                      int32_t *out, enum MHD_Result *res) {
    double d = 0;
    if (cJSON_IsNumber(v)) d = v->valuedouble;
    else if (cJSON_IsString(v)) {
        char *end;
        d = strtod(v->valuestring, &end);
        if (end == v->valuestring || *end) d = -1e300;
    } else d = -1e300;
    if (d != (double)(int64_t)d || d < lo || d > hi) {
        *res = http_send_error(r, 400, k, "invalid_value", "%s must be an integer in [%d, %d]", k,
                               lo, hi);
        return false;
    }
    *out = (int32_t)d;
    return true;
}

static void page_url(http_req *r, int32_t page, int32_t size, cJSON *o, const char *name) {
    const char *host = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Host");
    char url[512], path[256];
    snprintf(path, sizeof path, "%s", r->path);
    snprintf(url, sizeof url, "http://%s%s?page=%d&page_size=%d", host ? host : "localhost", path,
             page, size);
    cJSON_AddStringToObject(o, name, url);
}

static enum MHD_Result list_v2(http_req *r) {
    enum MHD_Result res = MHD_YES;
    cJSON *b = parse_body(r, &res);
    if (!b) return res;
    scope_args a = {0};
    int32_t page = 1, size = DEFAULT_PAGE_SIZE;
    bool paged = false;
    mem_filter_expr *e = NULL;
    fact_set fs = {0};
    cJSON *it;
    cJSON_ArrayForEach(it, b) {
        bool handled;
        if (!scope_field(r, it->string, it, &a, &res, &handled)) goto done;
        if (handled) continue;
        if (strcmp(it->string, "page") == 0) {
            if (!int_field(r, "page", it, 1, INT32_MAX, &page, &res)) goto done;
            paged = true;
        } else if (strcmp(it->string, "page_size") == 0) {
            if (!int_field(r, "page_size", it, 1, MAX_PAGE_SIZE, &size, &res)) goto done;
            paged = true;
        } else if (strcmp(it->string, "top_k") == 0 || strcmp(it->string, "limit") == 0) {
            if (!int_field(r, it->string, it, 1, MAX_PAGE_SIZE, &size, &res)) goto done;
        } else {
            res = http_send_error(r, 400, it->string, "unknown_field", "unknown field \"%.60s\"",
                                  it->string);
            goto done;
        }
    }
    const char *keys[MAX_QUERY_ARGS], *vals[MAX_QUERY_ARGS];
    int32_t nq = http_query_args(r->conn, keys, vals, MAX_QUERY_ARGS);
    for (int32_t i = 0; i < nq && i < MAX_QUERY_ARGS; i++) {
        cJSON tmp = {.type = cJSON_String, .valuestring = (char *)vals[i]};
        if (strcmp(keys[i], "page") == 0) {
            if (!int_field(r, "page", &tmp, 1, INT32_MAX, &page, &res)) goto done;
            paged = true;
        } else if (strcmp(keys[i], "page_size") == 0) {
            if (!int_field(r, "page_size", &tmp, 1, MAX_PAGE_SIZE, &size, &res)) goto done;
            paged = true;
        } else if (strcmp(keys[i], "org_id") != 0 && strcmp(keys[i], "project_id") != 0) {
            res = http_send_error(r, 400, keys[i], "unknown_field",
                                  "unknown query parameter \"%.60s\"", keys[i]);
            goto done;
        }
    }
    if (!(e = build_filter(r, a.filters, a.user, a.agent, a.run, a.metadata, true, STAR_REFUSED,
                           &res)))
        goto done;
    is_status st = collect(r, e, &fs);
    if (st != IS_OK) {
        res = http_send_status(r, st, "listing memories");
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", fs.n);
    int64_t first = paged ? (int64_t)(page - 1) * size : 0;
    int64_t last = paged ? first + size : fs.n;
    if (paged && last < fs.n) page_url(r, page + 1, size, o, "next");
    else cJSON_AddNullToObject(o, "next");
    if (paged && page > 1) page_url(r, page - 1, size, o, "previous");
    else cJSON_AddNullToObject(o, "previous");
    cJSON *results = cJSON_AddArrayToObject(o, "results");
    for (int64_t i = first; i < last && i < fs.n; i++)
        cJSON_AddItemToArray(results, http_fact_json(r->srv, &fs.f[i]));
    res = http_send_json(r, 200, o);
done:
    fact_set_free(&fs);
    mem_filter_expr_free(e);
    cJSON_Delete(b);
    return res;
}

typedef struct scored {
    mem_fact *f; /* borrowed from the hits */
    float rank, dense;
    float key; /* what the results are ordered by */
} scored;

static int by_key(const void *x, const void *y) {
    const scored *a = x, *b = y;
    return a->key < b->key ? 1 : a->key > b->key ? -1 : strcmp(a->f->id, b->f->id);
}

static int by_id(const void *x, const void *y) {
    return strcmp(((const mem_fact *)x)->id, ((const mem_fact *)y)->id);
}

static enum MHD_Result search_v2(http_req *r) {
    enum MHD_Result res = MHD_YES;
    cJSON *b = parse_body(r, &res);
    if (!b) return res;
    scope_args a = {0};
    const char *query = NULL;
    int32_t top_k =
        r->srv->cfg.limits.parse.default_top_k > 0 ? r->srv->cfg.limits.parse.default_top_k : 10;
    int32_t max_k = r->srv->cfg.limits.parse.max_k > 0 ? r->srv->cfg.limits.parse.max_k : 100;
    double threshold = -2.0;
    mem_filter_expr *e = NULL;
    fact_set fs = {0};
    memory_hit **hits = NULL;
    int32_t *nh = NULL, n_users = 0;
    scored *sc = NULL;
    cJSON *it;
    cJSON_ArrayForEach(it, b) {
        bool handled;
        const char *k = it->string;
        if (!scope_field(r, k, it, &a, &res, &handled)) goto done;
        if (handled) continue;
        if (strcmp(k, "query") == 0) {
            if (!cJSON_IsString(it) || !it->valuestring[strspn(it->valuestring, " \t\r\n")]) {
                res = http_send_error(r, 400, "query", "invalid_value",
                                      "query must be a non-empty string");
                goto done;
            }
            query = it->valuestring;
        } else if (strcmp(k, "top_k") == 0 || strcmp(k, "limit") == 0) {
            if (!cJSON_IsNull(it) && !int_field(r, k, it, 1, max_k, &top_k, &res)) goto done;
        } else if (strcmp(k, "threshold") == 0) {
            if (cJSON_IsNull(it)) continue;
            if (!cJSON_IsNumber(it) || it->valuedouble < -1.0 || it->valuedouble > 1.0) {
                res =
                    http_send_error(r, 400, "threshold", "invalid_value",
                                    "threshold must be a number in [-1, 1] (a cosine similarity)");
                goto done;
            }
            threshold = it->valuedouble;
        } else {
            res = http_send_error(r, 400, k, "unknown_field", "unknown field \"%.60s\"", k);
            goto done;
        }
    }
    if (!query) {
        res = http_send_error(r, 400, "query", "missing_field", "query is required");
        goto done;
    }
    if (threshold > -2.0 && memory_dim(r->srv->cfg.mem) <= 1) {
        res = unsupported(r, "threshold",
                          "threshold (a similarity floor) without an embedding model (this server "
                          "ranks by BM25 alone)");
        goto done;
    }
    if (!(e = build_filter(r, a.filters, a.user, a.agent, a.run, a.metadata, true, STAR_REFUSED,
                           &res)))
        goto done;
    is_status st = collect(r, e, &fs);
    if (st != IS_OK) {
        res = http_send_status(r, st, "searching memories");
        goto done;
    }
    /* Rank each user's matching facts with the user's own index (the
     * index is per user), keeping only the facts the filter matched. */
    qsort(fs.f, (size_t)fs.n, sizeof *fs.f, by_id);
    char **users = NULL;
    int32_t nu = 0;
    if ((st = users_for(r, e, &users, &nu)) != IS_OK) {
        res = http_send_status(r, st, "searching memories");
        goto done;
    }
    hits = calloc((size_t)(nu ? nu : 1), sizeof *hits);
    nh = calloc((size_t)(nu ? nu : 1), sizeof *nh);
    sc = calloc((size_t)(fs.n ? fs.n : 1), sizeof *sc);
    int32_t ns = 0;
    bool dense = memory_dim(r->srv->cfg.mem) > 1;
    if (!hits || !nh || !sc) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    n_users = nu;
    for (int32_t u = 0; u < nu && st == IS_OK; u++) {
        int32_t mine = 0;
        for (int32_t i = 0; i < fs.n; i++) mine += strcmp(fs.f[i].user, users[u]) == 0;
        if (!mine) continue;
        mem_filter f = {.tenant = r->tenant, .user = users[u]};
        mem_fact *all = NULL;
        int32_t n_all = 0;
        if ((st = memory_get_all(r->srv->cfg.mem, &f, &all, &n_all)) != IS_OK) break;
        mem_facts_free(all, n_all);
        if ((st = memory_search(r->srv->cfg.mem, &f, query, n_all, &hits[u], &nh[u])) != IS_OK)
            break;
        for (int32_t i = 0; i < nh[u]; i++) {
            if (!bsearch(&hits[u][i].fact, fs.f, (size_t)fs.n, sizeof *fs.f, by_id)) continue;
            if (threshold > -2.0 && hits[u][i].dense < threshold) continue;
            /* Each user's ranking is fused on its own (RRF ranks), so hits
             * of several users are merged by the cosine similarity, which
             * means the same for all; by the fused score without one. */
            if (ns < fs.n)
                sc[ns++] = (scored){&hits[u][i].fact, hits[u][i].score, hits[u][i].dense,
                                    dense ? (nu > 1 ? hits[u][i].dense : hits[u][i].score)
                                          : hits[u][i].score};
        }
    }
    users_free(users, nu);
    if (st != IS_OK) {
        res = http_send_status(r, st, "searching memories");
        goto done;
    }
    qsort(sc, (size_t)ns, sizeof *sc, by_key);
    cJSON *o = cJSON_CreateObject(), *results = cJSON_AddArrayToObject(o, "results");
    for (int32_t i = 0; i < ns && i < top_k; i++) {
        cJSON *j = http_fact_json(r->srv, sc[i].f);
        cJSON_AddNumberToObject(j, "score", dense ? sc[i].dense : sc[i].rank);
        cJSON_AddNumberToObject(j, "rank_score", sc[i].rank);
        cJSON_AddItemToArray(results, j);
    }
    res = http_send_json(r, 200, o);
done:
    for (int32_t u = 0; hits && u < n_users; u++) memory_hits_free(hits[u], nh[u]);
    free(hits);
    free(nh);
    free(sc);
    fact_set_free(&fs);
    mem_filter_expr_free(e);
    cJSON_Delete(b);
    return res;
}

/* ---- delete all --------------------------------------------------------------------------- */

static is_status delete_matching(http_req *r, const mem_filter_expr *e, int32_t *n_deleted) {
    fact_set fs;
    *n_deleted = 0;
    is_status st = collect(r, e, &fs);
    for (int32_t i = 0; i < fs.n && st == IS_OK; i++) {
        is_status d = memory_delete(r->srv->cfg.mem, r->tenant, fs.f[i].user, fs.f[i].id);
        if (d == IS_OK) (*n_deleted)++;
        else if (d != IS_ERR_NOT_FOUND) st = d; /* a concurrent delete is not a failure */
    }
    fact_set_free(&fs);
    return st;
}

enum MHD_Result http_mem0_delete_all(http_req *r) {
    enum MHD_Result res = MHD_YES;
    const char *keys[MAX_QUERY_ARGS], *vals[MAX_QUERY_ARGS];
    int32_t nq = http_query_args(r->conn, keys, vals, MAX_QUERY_ARGS);
    if (nq > MAX_QUERY_ARGS)
        return http_send_error(r, 400, NULL, "invalid_value", "too many query parameters");
    scope_args a = {0};
    cJSON *filters = NULL, *metadata = NULL;
    mem_filter_expr *e = NULL;
    for (int32_t i = 0; i < nq; i++) {
        const char *k = keys[i], *v = vals[i] ? vals[i] : "";
        if (!utf8_valid(v, strlen(v))) {
            res = http_send_error(r, 400, k, "invalid_utf8", "%s is not valid UTF-8", k);
            goto done;
        }
        if (strcmp(k, "filters") == 0 || strcmp(k, "metadata") == 0) {
            cJSON **slot = k[0] == 'f' ? &filters : &metadata;
            if (*slot) {
                res = http_send_error(r, 400, k, "invalid_value", "'%s' is given twice", k);
                goto done;
            }
            char *j = pyrepr_to_json(v);
            if (!j) {
                res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
                goto done;
            }
            /* The body's rules: a "\u0000" would cut a filter value short
             * and widen the delete. */
            parse_error pe;
            *slot = parse_object(j, strlen(j), k[0] == 'f' ? "'filters'" : "'metadata'", &pe);
            free(j);
            if (!*slot) {
                snprintf(pe.param, sizeof pe.param, "%s", k);
                snprintf(pe.code, sizeof pe.code, "invalid_value");
                res = http_send_parse_error(r, &pe);
                goto done;
            }
            continue;
        }
        cJSON tmp = {.type = cJSON_String, .valuestring = (char *)v};
        bool handled;
        if (!scope_field(r, k, &tmp, &a, &res, &handled)) goto done;
        if (!handled) {
            res =
                http_send_error(r, 400, k, "unknown_field", "unknown query parameter \"%.60s\"", k);
            goto done;
        }
    }
    /* STAR_ANY: Mem0 documents delete_all(user_id="*") as every user. */
    if (!(e = build_filter(r, filters, a.user, a.agent, a.run, metadata, true, STAR_ANY, &res)))
        goto done;
    int32_t n = 0;
    is_status st = delete_matching(r, e, &n);
    if (st != IS_OK) {
        res = http_send_status(r, st, "deleting memories");
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "message", "Memories deleted successfully!");
    cJSON_AddNumberToObject(o, "deleted", n);
    res = http_send_json(r, 200, o);
done:
    mem_filter_expr_free(e);
    cJSON_Delete(filters);
    cJSON_Delete(metadata);
    return res;
}

/* ---- batch ----------------------------------------------------------------------------------- */

static enum MHD_Result batch(http_req *r, bool del) {
    enum MHD_Result res = MHD_YES;
    cJSON *b = parse_body(r, &res);
    if (!b) return res;
    char **owners = NULL;
    int32_t n = 0;
    const cJSON *mems = cJSON_GetObjectItemCaseSensitive(b, "memories");
    cJSON *it;
    cJSON_ArrayForEach(it, b) {
        if (strcmp(it->string, "memories") != 0) {
            bool handled;
            if (!common_field(r, it->string, it, &res, &handled)) goto done;
            if (!handled) {
                res = http_send_error(r, 400, it->string, "unknown_field",
                                      "unknown field \"%.60s\"", it->string);
                goto done;
            }
        }
    }
    if (!cJSON_IsArray(mems) || cJSON_GetArraySize(mems) == 0 ||
        cJSON_GetArraySize(mems) > MAX_BATCH) {
        res = http_send_error(r, 400, "memories", "invalid_value",
                              "memories must be a list of 1 to %d objects with a memory_id",
                              MAX_BATCH);
        goto done;
    }
    n = cJSON_GetArraySize(mems);
    owners = calloc((size_t)n, sizeof *owners);
    if (!owners) {
        res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        goto done;
    }
    size_t max_bytes =
        (size_t)(r->srv->cfg.limits.max_fact_bytes > 0 ? r->srv->cfg.limits.max_fact_bytes : 4096);
    /* Check every item (and that each memory exists) before changing any. */
    int32_t i = 0;
    cJSON_ArrayForEach(it, mems) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "memory_id");
        if (!cJSON_IsObject(it) || !cJSON_IsString(id) ||
            !parse_memory_id_valid(id->valuestring, strlen(id->valuestring))) {
            res = http_send_error(r, 400, "memories", "invalid_value",
                                  "memories[%d] needs a valid memory_id", i);
            goto done;
        }
        const cJSON *f;
        cJSON_ArrayForEach(f, it) {
            const char *k = f->string;
            bool ok =
                strcmp(k, "memory_id") == 0 ||
                (!del && ((strcmp(k, "text") == 0 && cJSON_IsString(f) && *f->valuestring &&
                           strlen(f->valuestring) <= max_bytes &&
                           utf8_valid(f->valuestring, strlen(f->valuestring))) ||
                          (strcmp(k, "metadata") == 0 && (cJSON_IsObject(f) || cJSON_IsNull(f)))));
            if (!ok) {
                res = http_send_error(
                    r, 400, "memories", "invalid_value",
                    "memories[%d].%.40s is not valid here (%s)", i, k,
                    del ? "a batch delete takes memory_id only"
                        : "memory_id, text (a non-empty string) and metadata (an object)");
                goto done;
            }
        }
        if (!del && !cJSON_GetObjectItemCaseSensitive(it, "text") &&
            !cJSON_GetObjectItemCaseSensitive(it, "metadata")) {
            res = http_send_error(r, 400, "memories", "invalid_value",
                                  "memories[%d] changes nothing (give text or metadata)", i);
            goto done;
        }
        is_status st = mem_store_owner(memory_fact_store(r->srv->cfg.mem), r->tenant,
                                       id->valuestring, &owners[i]);
        mem_fact probe;
        if (st == IS_OK) {
            st = memory_get(r->srv->cfg.mem, r->tenant, owners[i], id->valuestring, &probe);
            if (st == IS_OK) mem_fact_clear(&probe);
        }
        if (st == IS_ERR_NOT_FOUND) {
            res = http_send_error(r, 404, "memory_id", "memory_not_found",
                                  "memories[%d]: memory %s not found", i, id->valuestring);
            goto done;
        }
        if (st != IS_OK) {
            res = http_send_status(r, st, "batch");
            goto done;
        }
        i++;
    }
    cJSON *o = cJSON_CreateObject(), *results = cJSON_AddArrayToObject(o, "results");
    int32_t done_n = 0;
    i = 0;
    cJSON_ArrayForEach(it, mems) {
        const char *id = cJSON_GetObjectItemCaseSensitive(it, "memory_id")->valuestring;
        is_status st;
        if (del) st = memory_delete(r->srv->cfg.mem, r->tenant, owners[i], id);
        else {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(it, "text");
            const cJSON *m = cJSON_GetObjectItemCaseSensitive(it, "metadata");
            char *mj = m ? (cJSON_IsNull(m) ? strdup("{}") : cJSON_PrintUnformatted(m)) : NULL;
            st = memory_update(r->srv->cfg.mem, r->tenant, owners[i], id, t ? t->valuestring : NULL,
                               mj);
            free(mj);
            if (st == IS_OK && t && r->srv->cfg.sched)
                sched_encode(r->srv->cfg.sched, r->tenant, owners[i], id);
        }
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "memory_id", id);
        cJSON_AddStringToObject(j, "status", st == IS_OK ? "ok" : is_status_to_string(st));
        if (st != IS_OK) cJSON_AddStringToObject(j, "error", is_error_last());
        cJSON_AddItemToArray(results, j);
        done_n += st == IS_OK;
        i++;
    }
    char msg[96];
    snprintf(msg, sizeof msg, "Successfully %s %d memories", del ? "deleted" : "updated", done_n);
    cJSON_AddStringToObject(o, "message", msg);
    res = http_send_json(r, done_n == n ? 200 : 207, o);
done:
    for (int32_t k = 0; owners && k < n; k++) free(owners[k]);
    free(owners);
    cJSON_Delete(b);
    return res;
}

/* ---- entities ------------------------------------------------------------------------------ */

typedef struct entity {
    char type[8];
    char *name;
    int32_t n;
    int64_t created, updated;
} entity;

static entity *entity_find(entity **es, int32_t *n, int32_t *cap, const char *type,
                           const char *name) {
    for (int32_t i = 0; i < *n; i++)
        if (strcmp((*es)[i].type, type) == 0 && strcmp((*es)[i].name, name) == 0) return &(*es)[i];
    if (*n == *cap) {
        int32_t nc = *cap ? *cap * 2 : 16;
        entity *ne = realloc(*es, (size_t)nc * sizeof *ne);
        if (!ne) return NULL;
        *es = ne;
        *cap = nc;
    }
    entity *e = &(*es)[*n];
    memset(e, 0, sizeof *e);
    snprintf(e->type, sizeof e->type, "%s", type);
    if (!(e->name = strdup(name))) return NULL;
    e->created = INT64_MAX;
    (*n)++;
    return e;
}

static enum MHD_Result entities_list(http_req *r) {
    const char *keys[MAX_QUERY_ARGS], *vals[MAX_QUERY_ARGS];
    int32_t nq = http_query_args(r->conn, keys, vals, MAX_QUERY_ARGS);
    for (int32_t i = 0; i < nq && i < MAX_QUERY_ARGS; i++)
        if (strcmp(keys[i], "org_id") != 0 && strcmp(keys[i], "project_id") != 0)
            return http_send_error(r, 400, keys[i], "unknown_field",
                                   "unknown query parameter \"%.60s\"", keys[i]);
    fact_set fs = {0};
    mem_filter_expr *all = NULL;
    is_status st = mem_filter_parse("{}", 2, &all);
    if (st == IS_OK) st = collect(r, all, &fs);
    mem_filter_expr_free(all);
    if (st != IS_OK) return http_send_status(r, st, "listing entities");
    entity *es = NULL;
    int32_t n = 0, cap = 0;
    for (int32_t i = 0; i < fs.n && st == IS_OK; i++) {
        const char *types[3] = {"user", "agent", "run"};
        const char *names[3] = {is_no_user(fs.f[i].user) ? NULL : fs.f[i].user, fs.f[i].agent_id,
                                fs.f[i].run_id};
        for (int t = 0; t < 3; t++) {
            if (!names[t]) continue;
            entity *e = entity_find(&es, &n, &cap, types[t], names[t]);
            if (!e) {
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            e->n++;
            if (fs.f[i].created_at < e->created) e->created = fs.f[i].created_at;
            if (fs.f[i].updated_at > e->updated) e->updated = fs.f[i].updated_at;
        }
    }
    fact_set_free(&fs);
    cJSON *o = NULL;
    if (st == IS_OK) {
        o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "count", n);
        cJSON_AddNullToObject(o, "next");
        cJSON_AddNullToObject(o, "previous");
        cJSON *results = cJSON_AddArrayToObject(o, "results");
        for (int32_t i = 0; i < n; i++) {
            cJSON *j = cJSON_CreateObject();
            char ts[32];
            cJSON_AddStringToObject(j, "id", es[i].name);
            cJSON_AddStringToObject(j, "name", es[i].name);
            cJSON_AddStringToObject(j, "type", es[i].type);
            cJSON_AddNumberToObject(j, "total_memories", es[i].n);
            http_iso_time(es[i].created, ts);
            cJSON_AddStringToObject(j, "created_at", ts);
            http_iso_time(es[i].updated, ts);
            cJSON_AddStringToObject(j, "updated_at", ts);
            cJSON_AddStringToObject(j, "owner", r->tenant);
            cJSON_AddNullToObject(j, "metadata");
            cJSON_AddItemToArray(results, j);
        }
    }
    for (int32_t i = 0; i < n; i++) free(es[i].name);
    free(es);
    if (st != IS_OK) return http_send_status(r, st, "listing entities");
    return http_send_json(r, 200, o);
}

static enum MHD_Result entity_delete(http_req *r, const char *type, const char *name) {
    const char *field = strcmp(type, "user") == 0    ? "user_id"
                        : strcmp(type, "agent") == 0 ? "agent_id"
                        : strcmp(type, "run") == 0   ? "run_id"
                                                     : NULL;
    if (strcmp(type, "app") == 0) return unsupported(r, "type", "an app entity (app_id)");
    if (!field)
        return http_send_error(r, 400, "type", "invalid_value",
                               "entity type \"%.40s\" is not one of user, agent, run", type);
    enum MHD_Result res = MHD_YES;
    mem_filter_expr *e =
        build_filter(r, NULL, field[0] == 'u' ? name : NULL, field[0] == 'a' ? name : NULL,
                     field[0] == 'r' ? name : NULL, NULL, true, STAR_NAME, &res);
    if (!e) return res;
    int32_t n = 0;
    is_status st = delete_matching(r, e, &n);
    mem_filter_expr_free(e);
    if (st != IS_OK) return http_send_status(r, st, "deleting the entity");
    if (n == 0)
        return http_send_error(r, 404, "name", "entity_not_found", "no %s %.100s has memories",
                               type, name);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "message", "Entity deleted successfully!");
    cJSON_AddNumberToObject(o, "deleted", n);
    return http_send_json(r, 200, o);
}

/* ---- routing -------------------------------------------------------------------------------- */

/* Routes of the clients that this server does not implement, with the
 * feature each belongs to. */
static const struct {
    const char *prefix, *feature;
} UNSUPPORTED_ROUTES[] = {
    {"/v1/exports", "memory exports (create_memory_export, get_memory_export)"},
    {"/v1/summary", "memory summaries (get_summary)"},
    {"/v1/feedback", "feedback on memories (feedback)"},
    {"/v2/profiles", "user profiles (profile settings and jobs)"},
    {"/api/v1/orgs",
     "organisation and project management (project.*, get_project, update_project)"},
    {"/api/v1/webhooks", "webhooks"},
    {"/v1/memory_export", "memory exports"},
};

static bool path_is(const char *path, const char *route) {
    size_t n = strlen(route);
    return strncmp(path, route, n) == 0 &&
           (path[n] == '\0' || (path[n] == '/' && path[n + 1] == '\0'));
}

static const char *unsupported_route(const char *path) {
    for (size_t i = 0; i < sizeof UNSUPPORTED_ROUTES / sizeof UNSUPPORTED_ROUTES[0]; i++) {
        size_t n = strlen(UNSUPPORTED_ROUTES[i].prefix);
        if (strncmp(path, UNSUPPORTED_ROUTES[i].prefix, n) == 0 &&
            (path[n] == '\0' || path[n] == '/'))
            return UNSUPPORTED_ROUTES[i].feature;
    }
    if (strncmp(path, "/v2/entities/", 13) == 0 && strstr(path, "/profile"))
        return "user profiles (get_profile)";
    return NULL;
}

bool http_mem0_route(const char *path) {
    return path_is(path, "/v1/ping") || path_is(path, "/v2/memories") ||
           path_is(path, "/v3/memories") || path_is(path, "/v2/memories/search") ||
           path_is(path, "/v3/memories/search") || path_is(path, "/v3/memories/add") ||
           path_is(path, "/v1/batch") || path_is(path, "/v1/entities") ||
           strncmp(path, "/v2/entities/", 13) == 0 || unsupported_route(path) != NULL;
}

enum MHD_Result http_mem0(http_req *r) {
    const char *p = r->path, *m = r->method;
    bool get = strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0, post = strcmp(m, "POST") == 0;
    bool put = strcmp(m, "PUT") == 0, del = strcmp(m, "DELETE") == 0;
    const char *feature = unsupported_route(p);
    if (feature) return unsupported(r, NULL, feature);
    if (path_is(p, "/v1/ping")) {
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        return ping(r);
    }
    if (!r->srv->cfg.mem)
        return http_send_error(r, 503, NULL, "no_memory", "this server has no memory store");
    if (path_is(p, "/v2/memories/search") || path_is(p, "/v3/memories/search")) {
        if (!post) return http_send_error(r, 405, NULL, "method_not_allowed", "use POST");
        return search_v2(r);
    }
    if (path_is(p, "/v3/memories/add")) {
        if (!post) return http_send_error(r, 405, NULL, "method_not_allowed", "use POST");
        return http_mem0_add(r);
    }
    if (path_is(p, "/v2/memories") || path_is(p, "/v3/memories")) {
        if (!post) return http_send_error(r, 405, NULL, "method_not_allowed", "use POST");
        return list_v2(r);
    }
    if (path_is(p, "/v1/batch")) {
        if (!put && !del)
            return http_send_error(r, 405, NULL, "method_not_allowed", "use PUT or DELETE");
        return batch(r, del);
    }
    if (path_is(p, "/v1/entities")) {
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        return entities_list(r);
    }
    /* /v2/entities/{type}/{name}/ */
    char type[16], name[PARSE_MAX_ID + 1];
    const char *s = p + 13, *slash = strchr(s, '/');
    if (!slash || (size_t)(slash - s) >= sizeof type)
        return http_send_error(r, 400, "type", "invalid_value",
                               "use /v2/entities/{user|agent|run}/{name}/");
    memcpy(type, s, (size_t)(slash - s));
    type[slash - s] = '\0';
    s = slash + 1;
    size_t l = strlen(s);
    if (l && s[l - 1] == '/') l--;
    if (l == 0 || l > PARSE_MAX_ID || memchr(s, '/', l))
        return http_send_error(r, 400, "name", "invalid_value",
                               "use /v2/entities/{user|agent|run}/{name}/");
    memcpy(name, s, l);
    name[l] = '\0';
    if (!del) return http_send_error(r, 405, NULL, "method_not_allowed", "use DELETE");
    return entity_delete(r, type, name);
}

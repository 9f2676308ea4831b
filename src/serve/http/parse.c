#include "serve/http/parse.h"

#include "memory/metadata.h"

#include "core/status.h"
#include "core/utf8.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

parse_limits parse_default_limits(void) {
    return (parse_limits){.max_tokens = 4096,
                          .default_max_tokens = 256,
                          .max_k = 100,
                          .default_k = 10,
                          .default_top_k = 10,
                          .max_messages = 1024,
                          .max_facts = 1000};
}

is_status parse_fail(parse_error *err, int status, const char *param, const char *code,
                     const char *fmt, ...) {
    if (err) {
        err->status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        snprintf(err->param, sizeof err->param, "%s", param ? param : "");
        snprintf(err->code, sizeof err->code, "%s", code ? code : "");
    }
    return IS_ERR_INVALID_ARG;
}

static is_status nomem(parse_error *err) {
    if (err) parse_fail(err, 500, NULL, "out_of_memory", "out of memory");
    return IS_ERR_NOMEM;
}

/* ---- JSON helpers ------------------------------------------------------------------ */

/* True if the body holds an escaped NUL ("\u0000"): an escape is a
 * backslash preceded by an even number of backslashes. */
static bool has_escaped_nul(const char *s, size_t len) {
    for (size_t i = 0; i + 6 <= len; i++) {
        if (s[i] != '\\') continue;
        if (s[i + 1] == '\\') {
            i++; /* an escaped backslash: skip both */
            continue;
        }
        if (s[i + 1] == 'u' && s[i + 2] == '0' && s[i + 3] == '0' && s[i + 4] == '0' &&
            s[i + 5] == '0')
            return true;
    }
    return false;
}

cJSON *parse_object(const char *body, size_t len, const char *what, parse_error *err) {
    if (!what) what = "the request body";
    if (!body || len == 0) {
        parse_fail(err, 400, NULL, "invalid_json", "%s is empty: expected a JSON object", what);
        return NULL;
    }
    if (memchr(body, '\0', len)) {
        parse_fail(err, 400, NULL, "invalid_json", "%s contains a NUL byte", what);
        return NULL;
    }
    if (!utf8_valid(body, len)) {
        parse_fail(err, 400, NULL, "invalid_utf8", "%s is not valid UTF-8", what);
        return NULL;
    }
    if (has_escaped_nul(body, len)) {
        parse_fail(err, 400, NULL, "invalid_json", "%s: \\u0000 is not allowed in strings", what);
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!root) {
        size_t off = end && end >= body ? (size_t)(end - body) : 0;
        if (off > len) off = len;
        parse_fail(err, 400, NULL, "invalid_json", "%s is not valid JSON (error near byte %zu)",
                   what, off);
        return NULL;
    }
    for (const char *p = end; p && p < body + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            parse_fail(err, 400, NULL, "invalid_json",
                       "%s: unexpected data after the JSON value (byte %zu)", what,
                       (size_t)(p - body));
            return NULL;
        }
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        parse_fail(err, 400, NULL, "invalid_json", "%s must be a JSON object", what);
        return NULL;
    }
    return root;
}

static const cJSON *field(const cJSON *obj, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    return cJSON_IsNull(v) ? NULL : v;
}

/* An optional string field into *out (strdup'd). max_len 0: no limit;
 * non_empty: "" is refused. */
static is_status get_string(const cJSON *obj, const char *name, bool required, bool non_empty,
                            size_t max_len, char **out, parse_error *err) {
    const cJSON *v = field(obj, name);
    if (!v) {
        if (required) return parse_fail(err, 400, name, "missing_field", "'%s' is required", name);
        return IS_OK;
    }
    if (!cJSON_IsString(v))
        return parse_fail(err, 400, name, "invalid_type", "'%s' must be a string", name);
    size_t l = strlen(v->valuestring);
    if (non_empty && l == 0)
        return parse_fail(err, 400, name, "invalid_value", "'%s' must not be empty", name);
    if (max_len && l > max_len)
        return parse_fail(err, 400, name, "invalid_value", "'%s' is longer than %zu bytes", name,
                          max_len);
    free(*out);
    *out = strdup(v->valuestring);
    return *out ? IS_OK : nomem(err);
}

static is_status get_bool(const cJSON *obj, const char *name, bool *out, parse_error *err) {
    const cJSON *v = field(obj, name);
    if (!v) return IS_OK;
    if (!cJSON_IsBool(v))
        return parse_fail(err, 400, name, "invalid_type", "'%s' must be true or false", name);
    *out = cJSON_IsTrue(v);
    return IS_OK;
}

/* An integer in [lo, hi]; `shown` names it in messages. */
static is_status get_int(const cJSON *obj, const char *name, const char *shown, int64_t lo,
                         int64_t hi, bool *present, int64_t *out, parse_error *err) {
    const cJSON *v = field(obj, name);
    if (present) *present = v != NULL;
    if (!v) return IS_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble))
        return parse_fail(err, 400, shown, "invalid_type", "'%s' must be an integer", shown);
    double d = v->valuedouble;
    if (d < (double)lo || d > (double)hi)
        return parse_fail(err, 400, shown, "invalid_value",
                          "'%s' must be between %lld and %lld, got %.0f", shown, (long long)lo,
                          (long long)hi, d);
    *out = (int64_t)d;
    return IS_OK;
}

static is_status get_number(const cJSON *obj, const char *name, double lo, double hi, bool lo_open,
                            float *out, parse_error *err) {
    const cJSON *v = field(obj, name);
    if (!v) return IS_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return parse_fail(err, 400, name, "invalid_type", "'%s' must be a number", name);
    double d = v->valuedouble;
    if ((lo_open ? d <= lo : d < lo) || d > hi)
        return parse_fail(err, 400, name, "invalid_value", "'%s' must be in %s%g, %g], got %g",
                          name, lo_open ? "(" : "[", lo, hi, d);
    *out = (float)d;
    return IS_OK;
}

void parse_filters_free(parse_filters *f) {
    if (!f) return;
    free(f->user_id);
    free(f->agent_id);
    free(f->run_id);
    for (int32_t i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    memset(f, 0, sizeof *f);
}

static is_status add_meta(parse_filters *f, const char *key, const cJSON *v, const char *where,
                          parse_error *err) {
    if (cJSON_IsObject(v) || cJSON_IsArray(v))
        return parse_fail(err, 400, where, "invalid_type",
                          "filter '%s' must be a string, number, boolean or null", key);
    if (f->n_meta >= PARSE_MAX_META)
        return parse_fail(err, 400, where, "invalid_value", "at most %d metadata filters",
                          PARSE_MAX_META);
    for (int32_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0)
            return parse_fail(err, 400, where, "invalid_value", "metadata filter '%s' given twice",
                              key);
    char *k = strdup(key), *val = metadata_scalar_string(v);
    if (!k || !val) {
        free(k);
        free(val);
        return nomem(err);
    }
    f->meta_keys[f->n_meta] = k;
    f->meta_values[f->n_meta++] = val;
    return IS_OK;
}

/* An id-like field into *slot; a second value for the same slot must be
 * equal to the first. */
static is_status set_id(char **slot, const cJSON *v, const char *name, parse_error *err) {
    if (!v || cJSON_IsNull(v)) return IS_OK;
    if (!cJSON_IsString(v))
        return parse_fail(err, 400, name, "invalid_type", "'%s' must be a string", name);
    is_status st = parse_id_check(name, v->valuestring, strlen(v->valuestring), err);
    if (st != IS_OK) return st;
    if (*slot) {
        if (strcmp(*slot, v->valuestring) != 0)
            return parse_fail(err, 400, name, "invalid_value",
                              "'%s' is given twice with different values", name);
        return IS_OK;
    }
    *slot = strdup(v->valuestring);
    return *slot ? IS_OK : nomem(err);
}

/* A Mem0 filters object (see the top of parse.h). */
static is_status parse_filters_obj(const cJSON *obj, const char *where, parse_filters *f,
                                   parse_error *err) {
    if (!obj || cJSON_IsNull(obj)) return IS_OK;
    if (!cJSON_IsObject(obj))
        return parse_fail(err, 400, where, "invalid_type", "'%s' must be an object", where);
    const cJSON *it;
    is_status st;
    cJSON_ArrayForEach(it, obj) {
        const char *k = it->string;
        bool id =
            strcmp(k, "user_id") == 0 || strcmp(k, "agent_id") == 0 || strcmp(k, "run_id") == 0;
        /* These filters hold one value per id (the search of one user's
         * index), so "*" could only be read as a literal name. */
        if (id && cJSON_IsString(it) && strcmp(it->valuestring, "*") == 0)
            return parse_fail(err, 400, k, "invalid_value",
                              "%s.%s must not be \"*\" here: these filters name one %s; "
                              "POST /v2/memories/search/ takes {\"%s\": \"*\"}",
                              where, k, k, k);
        if (strcmp(k, "user_id") == 0) st = set_id(&f->user_id, it, "user_id", err);
        else if (strcmp(k, "agent_id") == 0) st = set_id(&f->agent_id, it, "agent_id", err);
        else if (strcmp(k, "run_id") == 0) st = set_id(&f->run_id, it, "run_id", err);
        else if (strcmp(k, "metadata") == 0) {
            if (cJSON_IsNull(it)) continue;
            if (!cJSON_IsObject(it))
                return parse_fail(err, 400, where, "invalid_type",
                                  "'metadata' filter must be an object");
            const cJSON *m;
            st = IS_OK;
            cJSON_ArrayForEach(m, it) {
                if ((st = add_meta(f, m->string, m, where, err)) != IS_OK) break;
            }
        } else {
            st = add_meta(f, k, it, where, err);
        }
        if (st != IS_OK) return st;
    }
    return IS_OK;
}

/* Messages: [{role, content}], content a string or an array of text parts. */
static is_status parse_messages(const cJSON *arr, int32_t max, bool chat, parse_message **out,
                                int32_t *n_out, parse_error *err) {
    if (!cJSON_IsArray(arr))
        return parse_fail(err, 400, "messages", "invalid_type", "'messages' must be an array");
    int n = cJSON_GetArraySize(arr);
    if (n == 0)
        return parse_fail(err, 400, "messages", "invalid_value", "'messages' must not be empty");
    if (n > max)
        return parse_fail(err, 400, "messages", "invalid_value", "at most %d messages", max);
    parse_message *msgs = calloc((size_t)n, sizeof *msgs);
    if (!msgs) return nomem(err);
    *out = msgs;
    *n_out = 0;
    const cJSON *m;
    int i = 0;
    char where[64];
    cJSON_ArrayForEach(m, arr) {
        snprintf(where, sizeof where, "messages[%d]", i);
        if (!cJSON_IsObject(m))
            return parse_fail(err, 400, where, "invalid_type", "%s must be an object", where);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role))
            return parse_fail(err, 400, where, "invalid_type", "%s.role must be a string", where);
        const char *r = role->valuestring;
        if (strcmp(r, "developer") == 0) r = "system";
        if (strcmp(r, "system") != 0 && strcmp(r, "user") != 0 && strcmp(r, "assistant") != 0)
            return parse_fail(err, 400, where, "invalid_value",
                              "%s.role must be system, user or assistant, got '%.40s'", where,
                              role->valuestring);
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        char *text = NULL;
        if (cJSON_IsString(c)) {
            text = strdup(c->valuestring);
        } else if (chat && cJSON_IsArray(c)) {
            /* OpenAI's content parts: only text ones. */
            size_t total = 0;
            const cJSON *part;
            cJSON_ArrayForEach(part, c) {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
                const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsObject(part) || !cJSON_IsString(type) ||
                    strcmp(type->valuestring, "text") != 0 || !cJSON_IsString(t))
                    return parse_fail(err, 400, where, "invalid_value",
                                      "%s.content: only parts of type \"text\" are supported",
                                      where);
                total += strlen(t->valuestring);
            }
            text = malloc(total + 1);
            if (text) {
                size_t o = 0;
                cJSON_ArrayForEach(part, c) {
                    const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
                    size_t l = strlen(t);
                    memcpy(text + o, t, l);
                    o += l;
                }
                text[o] = '\0';
            }
        } else {
            return parse_fail(err, 400, where, "invalid_type", "%s.content must be a string%s",
                              where, chat ? " or an array of text parts" : "");
        }
        msgs[i].role = strdup(r);
        msgs[i].content = text;
        *n_out = ++i;
        if (!text || !msgs[i - 1].role) return nomem(err);
    }
    return IS_OK;
}

static void messages_free(parse_message *m, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        free(m[i].role);
        free(m[i].content);
    }
    free(m);
}

/* ---- chat ------------------------------------------------------------------------- */

void parse_chat_free(parse_chat *c) {
    if (!c) return;
    free(c->model);
    messages_free(c->messages, c->n_messages);
    for (int32_t i = 0; i < c->n_stop; i++) free(c->stop[i]);
    free(c->user);
    parse_filters_free(&c->filters);
    memset(c, 0, sizeof *c);
}

const char *parse_chat_query(const parse_chat *c) {
    for (int32_t i = c->n_messages - 1; i >= 0; i--)
        if (strcmp(c->messages[i].role, "user") == 0) return c->messages[i].content;
    return NULL;
}

static is_status parse_memory_opts(const cJSON *mem, const parse_limits *lim, parse_chat *c,
                                   parse_error *err) {
    if (!mem) return IS_OK;
    if (!cJSON_IsObject(mem))
        return parse_fail(err, 400, "memory", "invalid_type", "'memory' must be an object");
    c->has_memory = true;
    const cJSON *it;
    cJSON_ArrayForEach(it, mem) {
        if (strcmp(it->string, "k") != 0 && strcmp(it->string, "mode") != 0 &&
            strcmp(it->string, "filters") != 0)
            return parse_fail(err, 400, "memory", "unknown_field",
                              "unknown field 'memory.%.40s' (k, mode, filters)", it->string);
    }
    int64_t k = c->k;
    is_status st = get_int(mem, "k", "memory.k", 0, lim->max_k, NULL, &k, err);
    if (st != IS_OK) return st;
    c->k = (int32_t)k;
    const cJSON *mode = field(mem, "mode");
    if (mode) {
        if (!cJSON_IsString(mode))
            return parse_fail(err, 400, "memory.mode", "invalid_type",
                              "'memory.mode' must be a string");
        if (strcmp(mode->valuestring, "kv") == 0) c->mode = PARSE_MODE_KV;
        else if (strcmp(mode->valuestring, "prompt") == 0) c->mode = PARSE_MODE_PROMPT;
        else if (strcmp(mode->valuestring, "off") == 0) c->mode = PARSE_MODE_OFF;
        else
            return parse_fail(err, 400, "memory.mode", "invalid_value",
                              "'memory.mode' must be kv, prompt or off, got '%.40s'",
                              mode->valuestring);
    }
    return parse_filters_obj(field(mem, "filters"), "memory.filters", &c->filters, err);
}

is_status parse_chat_request(const char *body, size_t len, const parse_limits *lim_in,
                             parse_chat *c, parse_error *err) {
    parse_limits lim = lim_in ? *lim_in : parse_default_limits();
    memset(c, 0, sizeof *c);
    c->max_tokens = lim.default_max_tokens;
    c->temperature = 1.0f;
    c->top_p = 1.0f;
    c->include_usage = true;
    c->k = lim.default_k;
    c->mode = PARSE_MODE_DEFAULT;
    cJSON *root = parse_object(body, len, NULL, err);
    if (!root) return IS_ERR_INVALID_ARG;
    is_status st;
    int64_t v;
    bool present;
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!msgs) {
        st = parse_fail(err, 400, "messages", "missing_field", "'messages' is required");
        goto done;
    }
    if ((st = parse_messages(msgs, lim.max_messages, true, &c->messages, &c->n_messages, err)) !=
        IS_OK)
        goto done;
    if ((st = get_string(root, "model", false, false, 256, &c->model, err)) != IS_OK) goto done;
    if ((st = get_int(root, "max_completion_tokens", "max_completion_tokens", 1, lim.max_tokens,
                      &present, &v, err)) != IS_OK)
        goto done;
    if (present) c->max_tokens = (int32_t)v;
    if ((st = get_int(root, "max_tokens", "max_tokens", 1, lim.max_tokens, &present, &v, err)) !=
        IS_OK)
        goto done;
    if (present) c->max_tokens = (int32_t)v;
    if ((st = get_number(root, "temperature", 0.0, 2.0, false, &c->temperature, err)) != IS_OK)
        goto done;
    if ((st = get_number(root, "top_p", 0.0, 1.0, true, &c->top_p, err)) != IS_OK) goto done;
    if ((st = get_int(root, "top_k", "top_k", 0, 1 << 20, &present, &v, err)) != IS_OK) goto done;
    if (present) c->top_k = (int32_t)v;
    /* OpenAI seeds are any 64-bit integer; doubles hold them exactly to 2^53. */
    if ((st = get_int(root, "seed", "seed", -(1LL << 53), 1LL << 53, &c->has_seed, &v, err)) !=
        IS_OK)
        goto done;
    if (c->has_seed) c->seed = (uint64_t)v;
    if ((st = get_int(root, "n", "n", 1, 1, NULL, &v, err)) != IS_OK) goto done;
    if ((st = get_bool(root, "stream", &c->stream, err)) != IS_OK) goto done;
    const cJSON *so = field(root, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so)) {
            st = parse_fail(err, 400, "stream_options", "invalid_type",
                            "'stream_options' must be an object");
            goto done;
        }
        if ((st = get_bool(so, "include_usage", &c->include_usage, err)) != IS_OK) goto done;
    }
    const cJSON *stop = field(root, "stop");
    if (cJSON_IsString(stop)) {
        if (stop->valuestring[0]) {
            if (!(c->stop[0] = strdup(stop->valuestring))) {
                st = nomem(err);
                goto done;
            }
            c->n_stop = 1;
        }
    } else if (cJSON_IsArray(stop)) {
        const cJSON *s;
        cJSON_ArrayForEach(s, stop) {
            if (!cJSON_IsString(s)) {
                st = parse_fail(err, 400, "stop", "invalid_type",
                                "'stop' must be a string or an array of strings");
                goto done;
            }
            if (!s->valuestring[0]) continue;
            if (c->n_stop >= PARSE_MAX_STOP) {
                st = parse_fail(err, 400, "stop", "invalid_value", "at most %d stop strings",
                                PARSE_MAX_STOP);
                goto done;
            }
            if (!(c->stop[c->n_stop] = strdup(s->valuestring))) {
                st = nomem(err);
                goto done;
            }
            c->n_stop++;
        }
    } else if (stop) {
        st = parse_fail(err, 400, "stop", "invalid_type",
                        "'stop' must be a string or an array of strings");
        goto done;
    }
    if ((st = get_string(root, "user", false, true, PARSE_MAX_ID, &c->user, err)) != IS_OK)
        goto done;
    if (c->user && (st = parse_id_check("user", c->user, strlen(c->user), err)) != IS_OK) goto done;
    if ((st = parse_memory_opts(field(root, "memory"), &lim, c, err)) != IS_OK) goto done;
    const cJSON *tools = field(root, "tools");
    if (tools && !(cJSON_IsArray(tools) && cJSON_GetArraySize(tools) == 0)) {
        st = parse_fail(err, 400, "tools", "unsupported", "tools are not supported");
        goto done;
    }
    st = IS_OK;
done:
    cJSON_Delete(root);
    return st;
}

/* ---- memories --------------------------------------------------------------------- */

/* Refuses fields not in allowed[] (NULL-terminated). */
static is_status only_fields(const cJSON *obj, const char *const *allowed, parse_error *err) {
    const cJSON *it;
    cJSON_ArrayForEach(it, obj) {
        bool ok = false;
        for (const char *const *a = allowed; *a; a++)
            if (strcmp(it->string, *a) == 0) ok = true;
        if (!ok)
            return parse_fail(err, 400, it->string, "unknown_field", "unknown field '%.60s'",
                              it->string);
    }
    return IS_OK;
}

static is_status metadata_field(const cJSON *root, char **out, parse_error *err) {
    const cJSON *md = field(root, "metadata");
    if (!md) return IS_OK;
    if (!cJSON_IsObject(md))
        return parse_fail(err, 400, "metadata", "invalid_type", "'metadata' must be an object");
    const cJSON *it;
    cJSON_ArrayForEach(it, md) {
        if (cJSON_IsObject(it) || cJSON_IsArray(it))
            return parse_fail(err, 400, "metadata", "invalid_value",
                              "metadata '%.60s': values must be strings, numbers, booleans or null",
                              it->string);
    }
    *out = cJSON_PrintUnformatted(md);
    return *out ? IS_OK : nomem(err);
}

void parse_mem_add_free(parse_mem_add *a) {
    if (!a) return;
    messages_free(a->messages, a->n_messages);
    for (int32_t i = 0; i < a->n_facts; i++) free(a->facts[i]);
    free(a->facts);
    free(a->user_id);
    free(a->agent_id);
    free(a->run_id);
    free(a->metadata_json);
    memset(a, 0, sizeof *a);
}

is_status parse_memory_add(const char *body, size_t len, const parse_limits *lim_in,
                           parse_mem_add *a, parse_error *err) {
    parse_limits lim = lim_in ? *lim_in : parse_default_limits();
    memset(a, 0, sizeof *a);
    a->infer = true;
    cJSON *root = parse_object(body, len, NULL, err);
    if (!root) return IS_ERR_INVALID_ARG;
    static const char *const allowed[] = {"messages", "facts",    "user_id", "agent_id",
                                          "run_id",   "metadata", "infer",   NULL};
    is_status st = only_fields(root, allowed, err);
    if (st != IS_OK) goto done;
    if ((st = set_id(&a->user_id, field(root, "user_id"), "user_id", err)) != IS_OK) goto done;
    if (!a->user_id) {
        st = parse_fail(err, 400, "user_id", "missing_field", "'user_id' is required");
        goto done;
    }
    if ((st = set_id(&a->agent_id, field(root, "agent_id"), "agent_id", err)) != IS_OK) goto done;
    if ((st = set_id(&a->run_id, field(root, "run_id"), "run_id", err)) != IS_OK) goto done;
    if ((st = metadata_field(root, &a->metadata_json, err)) != IS_OK) goto done;
    if ((st = get_bool(root, "infer", &a->infer, err)) != IS_OK) goto done;
    const cJSON *msgs = field(root, "messages"), *facts = field(root, "facts");
    if (!msgs && !facts) {
        st = parse_fail(err, 400, "messages", "missing_field", "'messages' or 'facts' is required");
        goto done;
    }
    if (msgs && (st = parse_messages(msgs, lim.max_messages, false, &a->messages, &a->n_messages,
                                     err)) != IS_OK)
        goto done;
    if (facts) {
        if (!cJSON_IsArray(facts)) {
            st = parse_fail(err, 400, "facts", "invalid_type",
                            "'facts' must be an array of strings");
            goto done;
        }
        int n = cJSON_GetArraySize(facts);
        if (n == 0 || n > lim.max_facts) {
            st = parse_fail(err, 400, "facts", "invalid_value", "'facts' must hold 1 to %d strings",
                            lim.max_facts);
            goto done;
        }
        if (!(a->facts = calloc((size_t)n, sizeof *a->facts))) {
            st = nomem(err);
            goto done;
        }
        const cJSON *f;
        cJSON_ArrayForEach(f, facts) {
            if (!cJSON_IsString(f) || !f->valuestring[strspn(f->valuestring, " \t\r\n")]) {
                st = parse_fail(err, 400, "facts", "invalid_value",
                                "facts[%d] must be a non-empty string", a->n_facts);
                goto done;
            }
            if (!(a->facts[a->n_facts] = strdup(f->valuestring))) {
                st = nomem(err);
                goto done;
            }
            a->n_facts++;
        }
    }
    st = IS_OK;
done:
    cJSON_Delete(root);
    return st;
}

void parse_mem_search_free(parse_mem_search *s) {
    if (!s) return;
    free(s->query);
    parse_filters_free(&s->filters);
    memset(s, 0, sizeof *s);
}

is_status parse_memory_search(const char *body, size_t len, const parse_limits *lim_in,
                              parse_mem_search *s, parse_error *err) {
    parse_limits lim = lim_in ? *lim_in : parse_default_limits();
    memset(s, 0, sizeof *s);
    s->top_k = lim.default_top_k;
    cJSON *root = parse_object(body, len, NULL, err);
    if (!root) return IS_ERR_INVALID_ARG;
    static const char *const allowed[] = {"query",    "top_k",  "limit",   "user_id",
                                          "agent_id", "run_id", "filters", NULL};
    is_status st = only_fields(root, allowed, err);
    if (st != IS_OK) goto done;
    if ((st = get_string(root, "query", true, true, 0, &s->query, err)) != IS_OK) goto done;
    if (!s->query[strspn(s->query, " \t\r\n")]) {
        st = parse_fail(err, 400, "query", "invalid_value", "'query' must not be blank");
        goto done;
    }
    int64_t v;
    bool present;
    if ((st = get_int(root, "limit", "limit", 1, lim.max_k, &present, &v, err)) != IS_OK) goto done;
    if (present) s->top_k = (int32_t)v;
    if ((st = get_int(root, "top_k", "top_k", 1, lim.max_k, &present, &v, err)) != IS_OK) goto done;
    if (present) s->top_k = (int32_t)v;
    if ((st = set_id(&s->filters.user_id, field(root, "user_id"), "user_id", err)) != IS_OK)
        goto done;
    if ((st = set_id(&s->filters.agent_id, field(root, "agent_id"), "agent_id", err)) != IS_OK)
        goto done;
    if ((st = set_id(&s->filters.run_id, field(root, "run_id"), "run_id", err)) != IS_OK) goto done;
    if ((st = parse_filters_obj(field(root, "filters"), "filters", &s->filters, err)) != IS_OK)
        goto done;
    if (!s->filters.user_id) {
        st = parse_fail(err, 400, "user_id", "missing_field",
                        "'user_id' is required (at the top level or in 'filters')");
        goto done;
    }
    st = IS_OK;
done:
    cJSON_Delete(root);
    return st;
}

void parse_mem_update_free(parse_mem_update *u) {
    if (!u) return;
    free(u->text);
    free(u->metadata_json);
    free(u->user_id);
    memset(u, 0, sizeof *u);
}

is_status parse_memory_update(const char *body, size_t len, parse_mem_update *u, parse_error *err) {
    memset(u, 0, sizeof *u);
    cJSON *root = parse_object(body, len, NULL, err);
    if (!root) return IS_ERR_INVALID_ARG;
    static const char *const allowed[] = {"text", "data", "memory", "metadata", "user_id", NULL};
    is_status st = only_fields(root, allowed, err);
    if (st != IS_OK) goto done;
    int n_text = 0;
    static const char *const names[] = {"text", "data", "memory"};
    for (int i = 0; i < 3; i++) {
        if (!field(root, names[i])) continue;
        if (++n_text > 1) {
            st = parse_fail(err, 400, names[i], "invalid_value",
                            "give the new text once ('text', 'data' or 'memory')");
            goto done;
        }
        if ((st = get_string(root, names[i], true, true, 0, &u->text, err)) != IS_OK) goto done;
        if (!u->text[strspn(u->text, " \t\r\n")]) {
            st =
                parse_fail(err, 400, names[i], "invalid_value", "'%s' must not be blank", names[i]);
            goto done;
        }
    }
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (cJSON_IsNull(md)) {
        if (!(u->metadata_json = strdup("{}"))) {
            st = nomem(err);
            goto done;
        }
    } else if ((st = metadata_field(root, &u->metadata_json, err)) != IS_OK) {
        goto done;
    }
    if ((st = set_id(&u->user_id, field(root, "user_id"), "user_id", err)) != IS_OK) goto done;
    if (!u->text && !u->metadata_json) {
        st = parse_fail(err, 400, "text", "missing_field", "'text' or 'metadata' is required");
        goto done;
    }
    st = IS_OK;
done:
    cJSON_Delete(root);
    return st;
}

is_status parse_memory_query(const char *const *keys, const char *const *values, int32_t n,
                             bool require_user, parse_filters *f, parse_error *err) {
    return parse_memory_query_n(keys, NULL, values, NULL, n, require_user, f, err);
}

is_status parse_memory_query_n(const char *const *keys, const size_t *klens,
                               const char *const *values, const size_t *vlens, int32_t n,
                               bool require_user, parse_filters *f, parse_error *err) {
    memset(f, 0, sizeof *f);
    is_status st = IS_OK;
    for (int32_t i = 0; i < n && st == IS_OK; i++) {
        const char *k = keys[i], *v = values[i] ? values[i] : "";
        size_t kl = klens ? klens[i] : strlen(k), vl0 = values[i] && vlens ? vlens[i] : strlen(v);
        /* A decoded %00 would make every C string below shorter than what
         * the client sent: "victim%00attacker" must not name "victim". */
        if (memchr(k, '\0', kl) || memchr(v, '\0', vl0)) {
            st = parse_fail(err, 400, NULL, "invalid_value",
                            "a query parameter holds a NUL byte (%%00)");
            break;
        }
        if (!utf8_valid(k, kl) || !utf8_valid(v, vl0)) {
            st = parse_fail(err, 400, NULL, "invalid_utf8", "the query string is not valid UTF-8");
            break;
        }
        char **slot = strcmp(k, "user_id") == 0    ? &f->user_id
                      : strcmp(k, "agent_id") == 0 ? &f->agent_id
                      : strcmp(k, "run_id") == 0   ? &f->run_id
                                                   : NULL;
        if (slot) {
            if ((st = parse_id_check(k, v, vl0, err)) != IS_OK) break;
            cJSON *s = cJSON_CreateString(v);
            if (!s) {
                st = nomem(err);
                break;
            }
            st = set_id(slot, s, k, err);
            cJSON_Delete(s);
        } else if (strcmp(k, "metadata") == 0) {
            /* Held to the rules of a body: an escaped NUL would cut a key or
             * value short and widen a delete filter. */
            cJSON *m = parse_object(v, vl0, "'metadata'", err);
            if (!m) {
                if (err) { /* a query value: the parameter is invalid, not the body */
                    snprintf(err->param, sizeof err->param, "metadata");
                    snprintf(err->code, sizeof err->code, "invalid_value");
                }
                st = IS_ERR_INVALID_ARG;
                break;
            }
            const cJSON *it;
            cJSON_ArrayForEach(it, m) {
                if ((st = add_meta(f, it->string, it, "metadata", err)) != IS_OK) break;
            }
            cJSON_Delete(m);
        } else {
            st = parse_fail(err, 400, k, "unknown_field",
                            "unknown query parameter '%.60s' (user_id, agent_id, run_id, metadata)",
                            k);
        }
    }
    if (st == IS_OK && require_user && !f->user_id)
        st = parse_fail(err, 400, "user_id", "missing_field", "'user_id' is required");
    if (st != IS_OK) parse_filters_free(f);
    return st;
}

bool parse_memory_id_valid(const char *id, size_t len) {
    if (len == 0 || len > 71) return false;
    for (size_t i = 0; i < len; i++) {
        char c = id[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_'))
            return false;
    }
    return true;
}

is_status parse_id_check(const char *name, const char *s, size_t len, parse_error *err) {
    if (len == 0 || len > PARSE_MAX_ID)
        return parse_fail(err, 400, name, "invalid_value", "'%s' must be 1 to %d bytes", name,
                          PARSE_MAX_ID);
    if (!utf8_valid(s, len))
        return parse_fail(err, 400, name, "invalid_utf8", "'%s' is not valid UTF-8", name);
    /* The filter language reads "*" as "any value": a user named "*" would
     * be one user when listed and every user of the tenant when deleted. */
    if (len == 1 && s[0] == '*')
        return parse_fail(err, 400, name, "invalid_value",
                          "'%s' must not be \"*\": ids are names, never wildcards; to match "
                          "every one, give filters {\"%s\": \"*\"} (POST /v2/memories/, "
                          "/v2/memories/search/, DELETE /v1/memories/?filters=)",
                          name, strcmp(name, "user") == 0 ? "user_id" : name);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        /* C1 controls (U+0080..U+009F) are 0xC2 0x80..0x9F in UTF-8. */
        bool c1 = c == 0xC2 && i + 1 < len && (unsigned char)s[i + 1] >= 0x80 &&
                  (unsigned char)s[i + 1] <= 0x9F;
        if (c < 0x20 || c == 0x7F || c1)
            return parse_fail(err, 400, name, "invalid_value",
                              "'%s' must not hold NUL or control characters", name);
    }
    return IS_OK;
}

static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

is_status parse_url_check(const char *raw, size_t len, parse_error *err) {
    if (len > PARSE_MAX_URL)
        return parse_fail(err, 414, NULL, "uri_too_long", "the URL is longer than %d bytes",
                          PARSE_MAX_URL);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)raw[i];
        /* Decode as MHD does: "%XX" with two hex digits is the byte, any
         * other '%' stays itself. */
        if (c == '%' && i + 2 < len && hex_val(raw[i + 1]) >= 0 && hex_val(raw[i + 2]) >= 0) {
            c = (unsigned char)(hex_val(raw[i + 1]) * 16 + hex_val(raw[i + 2]));
            i += 2;
        }
        if (c < 0x20 || c == 0x7F)
            return parse_fail(err, 400, NULL, "invalid_url",
                              "the URL holds a NUL or control character (%%%02X)", c);
    }
    return IS_OK;
}

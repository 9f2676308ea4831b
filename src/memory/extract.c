/*
 * extract: the extraction prompt, the generation call, and the lenient-but-
 * validating parser of the model's JSON reply (see the header).
 */
#include "memory/extract.h"

#include "core/status.h"
#include "core/utf8.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char k_system_prompt[] =
    "You keep the long-term memory of a personal assistant. From the conversation you are "
    "given, write down the facts about the user that are worth remembering in later "
    "conversations: personal details, preferences and dislikes, plans and goals, people and "
    "pets in their life, work, places, health, hobbies and important events. Write each fact "
    "as one short sentence of its own. Use only what the user says or confirms; skip greetings, "
    "small talk and general knowledge.\n"
    "Reply with a JSON object and nothing else, in this form:\n"
    "{\"facts\": [\"first fact\", \"second fact\"]}\n"
    "If there is nothing worth remembering, reply {\"facts\": []}.\n\n"
    "Example 1\n"
    "Input:\n"
    "user: Hi! How's it going?\n"
    "Output: {\"facts\": []}\n\n"
    "Example 2\n"
    "Input:\n"
    "user: I'm Priya. I work as a nurse in Leeds and I'm training for a half marathon in May.\n"
    "assistant: That's great, good luck with the training!\n"
    "Output: {\"facts\": [\"Name is Priya\", \"Works as a nurse in Leeds\", \"Is training for a "
    "half marathon in May\"]}\n\n"
    "Example 3\n"
    "Input:\n"
    "user: Can you suggest a dinner? I'm vegetarian and I really don't like mushrooms.\n"
    "Output: {\"facts\": [\"Is vegetarian\", \"Does not like mushrooms\"]}";

/* The start of the assistant's reply, written for it. */
static const char k_reply_start[] = "{\"facts\": [";

const char *extract_reply_start(void) { return k_reply_start; }

const char *extract_system_prompt(void) { return k_system_prompt; }

void extract_facts_free(char **facts, int32_t n_facts) {
    if (!facts) return;
    for (int32_t i = 0; i < n_facts; i++) free(facts[i]);
    free(facts);
}

/* ---- finding the object ------------------------------------------------ */

/* Finds the first balanced {...} in a byte stream fed in pieces. Quotes
 * only count inside the object: prose before it may hold stray ones. */
typedef struct obj_scan {
    int32_t depth;
    bool in_str, esc;
    int64_t start; /* offset of the first '{', or -1 */
    int64_t end;   /* offset just past its matching '}', or -1 */
    size_t pos;    /* bytes scanned so far */
} obj_scan;

static void scan_init(obj_scan *sc) {
    memset(sc, 0, sizeof *sc);
    sc->start = sc->end = -1;
}

/* Scans buf[sc->pos .. len). Stops once the object is complete. */
static void scan_feed(obj_scan *sc, const char *buf, size_t len) {
    for (; sc->pos < len && sc->end < 0; sc->pos++) {
        char ch = buf[sc->pos];
        if (sc->start < 0) {
            if (ch == '{') {
                sc->start = (int64_t)sc->pos;
                sc->depth = 1;
            }
            continue;
        }
        if (sc->in_str) {
            if (sc->esc) sc->esc = false;
            else if (ch == '\\') sc->esc = true;
            else if (ch == '"') sc->in_str = false;
            continue;
        }
        if (ch == '"') sc->in_str = true;
        else if (ch == '{') sc->depth++;
        else if (ch == '}' && --sc->depth == 0) sc->end = (int64_t)sc->pos + 1;
    }
}

/* The start of the reply, printable, for messages. */
static void snippet(const char *reply, size_t len, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < len && o + 4 < cap; i++) {
        unsigned char c = (unsigned char)reply[i];
        out[o++] = c < 0x20 || c == 0x7f ? ' ' : (char)c;
    }
    if (len > 0 && o + 4 >= cap) {
        /* Do not end inside a UTF-8 sequence. */
        o = utf8_complete_prefix(out, o);
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = 0;
}

/* The "facts" array of the reply: at the top of the object, or inside an
 * object nested in it (small models wrap it: {"result": {"facts": [...]}}),
 * depth first. NULL if none. */
static const cJSON *find_facts(const cJSON *o, int depth) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "facts"), *it;
    if (cJSON_IsArray(a)) return a;
    if (depth >= 4) return NULL;
    cJSON_ArrayForEach(it, o) {
        if (!cJSON_IsObject(it)) continue;
        if ((a = find_facts(it, depth + 1))) return a;
    }
    return NULL;
}

/* The text of a fact the model wrote as an object: its first text-like
 * field ({"fact": ...}, {"text": ...}, ...), else its scalar fields as
 * "key: value; ..." so that what the model said is kept. malloc'd; NULL
 * when the object has nothing to say (or out of memory). */
static char *object_fact_text(const cJSON *o) {
    static const char *const keys[] = {"fact",        "text",      "memory", "content",
                                       "description", "statement", "value"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[i]);
        if (cJSON_IsString(v) && v->valuestring[0]) return strdup(v->valuestring);
    }
    size_t cap = 1, o_len = 0;
    char *out = NULL;
    const cJSON *it;
    cJSON_ArrayForEach(it, o) {
        char num[64];
        const char *val = NULL;
        if (cJSON_IsString(it)) val = it->valuestring;
        else if (cJSON_IsNumber(it)) {
            snprintf(num, sizeof num, "%.17g", it->valuedouble);
            val = num;
        } else if (cJSON_IsBool(it)) val = cJSON_IsTrue(it) ? "true" : "false";
        if (!val || !*val) continue;
        size_t need = o_len + strlen(it->string) + strlen(val) + 5;
        if (need > cap) {
            cap = need * 2;
            char *nb = realloc(out, cap);
            if (!nb) {
                free(out);
                return NULL;
            }
            out = nb;
        }
        o_len += (size_t)sprintf(out + o_len, "%s%s: %s", o_len ? "; " : "", it->string, val);
    }
    return out;
}

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

is_status extract_parse(const char *reply, size_t len, char ***facts, int32_t *n_facts) {
    if ((!reply && len) || !facts || !n_facts)
        return is_error_set(IS_ERR_INVALID_ARG, "extract_parse: NULL argument");
    char snip[96];
    snippet(reply ? reply : "", len, snip, sizeof snip);
    obj_scan sc;
    scan_init(&sc);
    if (len) scan_feed(&sc, reply, len);
    if (sc.start < 0)
        return is_error_set(IS_ERR_FORMAT, "extract: the reply holds no JSON object: \"%s\"", snip);
    if (sc.end < 0)
        return is_error_set(IS_ERR_FORMAT,
                            "extract: the reply's JSON object is not closed (cut short?): \"%s\"",
                            snip);
    cJSON *root = cJSON_ParseWithLength(reply + sc.start, (size_t)(sc.end - sc.start));
    if (!root)
        return is_error_set(IS_ERR_FORMAT, "extract: the reply's object is not valid JSON: \"%s\"",
                            snip);
    is_status st = IS_OK;
    const cJSON *arr = cJSON_IsObject(root) ? find_facts(root, 0) : NULL, *it;
    char **out = NULL;
    int32_t n = 0;
    if (!cJSON_IsObject(root) || !cJSON_IsArray(arr)) {
        st = is_error_set(IS_ERR_FORMAT, "extract: the reply has no \"facts\" array: \"%s\"", snip);
        goto done;
    }
    int32_t count = cJSON_GetArraySize(arr);
    if (count > EXTRACT_MAX_FACTS) {
        st = is_error_set(IS_ERR_FORMAT, "extract: the reply lists %d facts, more than %d", count,
                          EXTRACT_MAX_FACTS);
        goto done;
    }
    out = calloc((size_t)(count ? count : 1), sizeof *out);
    if (!out) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }
    int32_t idx = 0;
    cJSON_ArrayForEach(it, arr) {
        char *obj_text = NULL;
        if (cJSON_IsObject(it) && !(obj_text = object_fact_text(it))) {
            st = is_error_set(IS_ERR_FORMAT,
                              "extract: fact %d of the reply is an object with no text: \"%s\"",
                              idx, snip);
            goto done;
        }
        if (!obj_text && !cJSON_IsString(it)) {
            st = is_error_set(IS_ERR_FORMAT,
                              "extract: fact %d of the reply is not a string: \"%s\"", idx, snip);
            goto done;
        }
        const char *s = obj_text ? obj_text : it->valuestring;
        size_t l = strlen(s);
        while (l > 0 && is_ws(*s)) s++, l--;
        while (l > 0 && is_ws(s[l - 1])) l--;
        if (l == 0) {
            free(obj_text);
            st = is_error_set(IS_ERR_FORMAT, "extract: fact %d of the reply is empty", idx);
            goto done;
        }
        if (l > EXTRACT_MAX_FACT_BYTES) {
            free(obj_text);
            st = is_error_set(IS_ERR_FORMAT,
                              "extract: fact %d of the reply has %zu bytes, more than %d", idx, l,
                              EXTRACT_MAX_FACT_BYTES);
            goto done;
        }
        if (!utf8_valid(s, l)) {
            free(obj_text);
            st = is_error_set(IS_ERR_FORMAT, "extract: fact %d of the reply is not valid UTF-8",
                              idx);
            goto done;
        }
        bool dup = false;
        for (int32_t j = 0; j < n && !dup; j++)
            dup = strlen(out[j]) == l && memcmp(out[j], s, l) == 0;
        idx++;
        if (dup) {
            free(obj_text);
            continue;
        }
        out[n] = strndup(s, l);
        free(obj_text);
        if (!out[n]) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            goto done;
        }
        n++;
    }
done:
    cJSON_Delete(root);
    if (st != IS_OK) {
        extract_facts_free(out, n);
        return st;
    }
    *facts = out;
    *n_facts = n;
    return IS_OK;
}

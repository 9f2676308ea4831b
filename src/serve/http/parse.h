/*
 * parse: the HTTP API's request bodies and query strings, checked and
 * turned into plain C structs before anything else sees them.
 *
 * Every public entry point takes raw bytes (any bytes: this is where
 * untrusted input enters) and either fills its output struct or fills a
 * parse_error with the HTTP status and an OpenAI-style message, param and
 * code. Nothing here touches the model, the scheduler or the memory
 * service, and the module depends on cJSON and core/status only, so a fuzz
 * target can drive it on its own (link parse.c and core/status.c).
 *
 * Rules shared by all bodies:
 *   - the body must be valid UTF-8 (RFC 3629: no overlong forms, no
 *     surrogates, nothing above U+10FFFF) and hold one JSON object and
 *     nothing after it but whitespace; "\u0000" escapes are refused (C
 *     strings would silently cut there);
 *   - a field of the wrong type is a 400 naming the field (param); null
 *     counts as absent for optional fields; unknown fields are ignored in
 *     chat bodies (OpenAI clients send many) and refused in memory bodies
 *     and query strings (a typo in a filter of a delete must not widen it);
 *   - numbers that must be integers must be integers (2.5 tokens is an
 *     error, 2.0 is 2), within the limits given.
 *
 * Filters (search, list, delete, chat's memory.filters) follow Mem0: the
 * fields user_id, agent_id and run_id, "metadata": a flat object of
 * scalars, and any other scalar field is a metadata equality too. Metadata
 * values are compared in the canonical form of memory/index.h (strings as
 * themselves, numbers in shortest round-trip form, true/false/null).
 */
#ifndef IS_SERVE_HTTP_PARSE_H
#define IS_SERVE_HTTP_PARSE_H

#include "inferscale.h"

#include <cjson/cJSON.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PARSE_MAX_STOP 16  /* stop strings per request */
#define PARSE_MAX_META 32  /* metadata equality filters */
#define PARSE_MAX_ID   256 /* bytes of a user_id, agent_id or run_id */

typedef struct parse_error {
    int status; /* HTTP status: 400 (or 413) */
    char message[512];
    char param[64]; /* the offending field, "" if none */
    char code[64];  /* machine-readable code, "" if none */
} parse_error;

/* Sets err (all fields) and returns IS_ERR_INVALID_ARG. param/code may be
 * NULL. */
is_status parse_fail(parse_error *err, int status, const char *param, const char *code,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

typedef struct parse_limits {
    int32_t max_tokens;         /* largest max_tokens accepted (default 4096) */
    int32_t default_max_tokens; /* max_tokens when the request has none (default 256) */
    int32_t max_k;              /* largest memory.k and top_k (default 100) */
    int32_t default_k;          /* memory.k when absent (default 10) */
    int32_t default_top_k;      /* search top_k when absent (default 10) */
    int32_t max_messages;       /* messages per request (default 1024) */
    int32_t max_facts;          /* facts per add (default 1000) */
} parse_limits;

parse_limits parse_default_limits(void);

/* One JSON object under the rules above: valid UTF-8, no NUL byte, no
 * "\u0000" escape, nothing after the object but whitespace. Every route
 * that reads a JSON body or a JSON query value goes through it, so no
 * route is handed a string that C cuts short. `what` names the input in
 * messages (NULL: "the request body"). The object (free with
 * cJSON_Delete), or NULL with *err set (400). */
cJSON *parse_object(const char *body, size_t len, const char *what, parse_error *err);

/* ---- filters --------------------------------------------------------------------- */

typedef struct parse_filters {
    char *user_id; /* NULL if absent */
    char *agent_id;
    char *run_id;
    char *meta_keys[PARSE_MAX_META];
    char *meta_values[PARSE_MAX_META]; /* canonical form */
    int32_t n_meta;
} parse_filters;

void parse_filters_free(parse_filters *f);

/* ---- chat completions ------------------------------------------------------------- */

typedef struct parse_message {
    char *role;    /* "system", "user", "assistant" ("developer" is read as "system") */
    char *content; /* text parts joined */
} parse_message;

typedef enum parse_mode {
    PARSE_MODE_DEFAULT = -1, /* kv when a user is named, off otherwise */
    PARSE_MODE_KV = 0,
    PARSE_MODE_PROMPT = 1,
    PARSE_MODE_OFF = 2,
} parse_mode;

typedef struct parse_chat {
    char *model; /* NULL if absent */
    parse_message *messages;
    int32_t n_messages;
    int32_t max_tokens; /* max_tokens or max_completion_tokens, else the default */
    float temperature;  /* default 1.0 (OpenAI's) */
    float top_p;        /* default 1.0 */
    int32_t top_k;      /* extension; default 0 (off) */
    uint64_t seed;      /* 0 if absent */
    bool has_seed;
    char *stop[PARSE_MAX_STOP];
    int32_t n_stop;
    bool stream;
    bool include_usage;    /* stream_options.include_usage (default true) */
    char *user;            /* NULL if absent */
    bool has_memory;       /* a "memory" object was given */
    int32_t k;             /* memory.k (default limits->default_k) */
    parse_mode mode;       /* memory.mode */
    parse_filters filters; /* memory.filters */
} parse_chat;

/* Parses a POST /v1/chat/completions body. lim may be NULL (defaults).
 * IS_OK, or IS_ERR_INVALID_ARG with *err set; IS_ERR_NOMEM. *out must be
 * freed with parse_chat_free in every case. */
is_status parse_chat_request(const char *body, size_t len, const parse_limits *lim, parse_chat *out,
                             parse_error *err);
void parse_chat_free(parse_chat *c);

/* The text retrieval uses: the content of the last user message, NULL if
 * there is none. */
const char *parse_chat_query(const parse_chat *c);

/* ---- memories --------------------------------------------------------------------- */

/* POST /v1/memories/: Mem0's add. Either messages (stored one fact per
 * user/assistant message with infer false; extracted by the LLM with infer
 * true, the default) or facts (an extension: strings stored as given), or
 * both. user_id required. */
typedef struct parse_mem_add {
    parse_message *messages;
    int32_t n_messages;
    char **facts;
    int32_t n_facts;
    char *user_id;
    char *agent_id;
    char *run_id;
    char *metadata_json; /* a flat object, unformatted; NULL if absent */
    bool infer;
} parse_mem_add;

is_status parse_memory_add(const char *body, size_t len, const parse_limits *lim,
                           parse_mem_add *out, parse_error *err);
void parse_mem_add_free(parse_mem_add *a);

/* POST /v1/memories/search/: query (required), top_k (or limit), user_id,
 * agent_id, run_id at the top level or inside "filters" (not both with
 * different values). A user_id is required (here or in filters). */
typedef struct parse_mem_search {
    char *query;
    int32_t top_k;
    parse_filters filters;
} parse_mem_search;

is_status parse_memory_search(const char *body, size_t len, const parse_limits *lim,
                              parse_mem_search *out, parse_error *err);
void parse_mem_search_free(parse_mem_search *s);

/* PUT /v1/memories/{id}/: the new text ("text", or Mem0's "data" or
 * "memory") and/or "metadata" (an object; null or {} clears it). At least
 * one of the two. An optional user_id must name the fact's owner. */
typedef struct parse_mem_update {
    char *text;          /* NULL: keep */
    char *metadata_json; /* NULL: keep; "{}": clear */
    char *user_id;       /* NULL if absent */
} parse_mem_update;

is_status parse_memory_update(const char *body, size_t len, parse_mem_update *out,
                              parse_error *err);
void parse_mem_update_free(parse_mem_update *u);

/* Query-string filters of GET and DELETE /v1/memories/ (keys already
 * URL-decoded): user_id (required when require_user), agent_id, run_id,
 * metadata (a JSON object). Any other key is refused. */
is_status parse_memory_query(const char *const *keys, const char *const *values, int32_t n,
                             bool require_user, parse_filters *out, parse_error *err);

/* The same, with each key's and value's length (as MHD_get_connection_values_n
 * gives them): a key or value holding a NUL byte (a decoded %00) is refused
 * rather than read as the shorter C string. klens/vlens may be NULL
 * (strlen). */
is_status parse_memory_query_n(const char *const *keys, const size_t *klens,
                               const char *const *values, const size_t *vlens, int32_t n,
                               bool require_user, parse_filters *out, parse_error *err);

/* ---- ids and URLs ------------------------------------------------------------------- */

/* The one check of every caller-chosen id (user_id, agent_id, run_id, chat's
 * "user"), wherever it comes from (JSON body, query string, path): 1 to
 * PARSE_MAX_ID bytes of valid UTF-8, no NUL, no control character (C0,
 * DEL, C1), and not "*", which Mem0's filters read as "any value": only
 * an explicit filters object may say "every user". `name` is the field's
 * name for the message. IS_OK, or IS_ERR_INVALID_ARG with *err set (400,
 * code invalid_value or invalid_utf8). */
is_status parse_id_check(const char *name, const char *s, size_t len, parse_error *err);

#define PARSE_MAX_URL 8192 /* bytes of a request target (path and query), raw */

/* Checks a raw request target (as received, before percent-decoding):
 * at most PARSE_MAX_URL bytes (414 above, code uri_too_long), and neither
 * it nor its percent-decoded form holds a NUL or a control character (400,
 * code invalid_url), so no decoded path segment or query value can be cut
 * short by a %00 or smuggle a line break. IS_OK or IS_ERR_INVALID_ARG. */
is_status parse_url_check(const char *raw, size_t len, parse_error *err);

/* A fact id taken from a URL path: 1..71 characters of [A-Za-z0-9_-]. */
bool parse_memory_id_valid(const char *id, size_t len);

#endif

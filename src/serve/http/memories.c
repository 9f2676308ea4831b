/*
 * /v1/memories: Mem0's memory API (REST shapes of Mem0's server: results
 * under "results", memories as {id, memory, hash, metadata, created_at,
 * updated_at, user_id, ...}), scoped to the caller's tenant.
 *
 * Fact ids are global (uuid4), but a fact is only visible to its tenant:
 * a route naming a fact by id alone finds its user with mem_store_owner
 * within the caller's tenant, so another tenant's id is a 404 exactly like
 * an id that never existed.
 *
 * Adding returns as soon as the facts are stored (row, embedding, index
 * entry); each one's KV is then encoded on the engine thread
 * (sched_encode), and until its record exists a chat that retrieves it
 * prefills its text instead (the scheduler's fallback).
 */
#include "serve/http/mem0.h"

#include "core/status.h"
#include "core/utf8.h"
#include "memory/extract.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_QUERY_ARGS 64
#define CONTEXT_TURNS  16 /* turns before a fact kept as its encoding context */

bool http_fact_kv_ready(http_server *srv, const mem_fact *f) {
    if (!f->kv_record) return false;
    if (srv->cfg.sched) return sched_fact_kv_here(srv->cfg.sched, f->kv_record);
    return srv->cfg.mem && record_store_contains(memory_record_store(srv->cfg.mem), f->kv_record);
}

cJSON *http_fact_json(http_server *srv, const mem_fact *f) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", f->id);
    cJSON_AddStringToObject(o, "memory", f->text ? f->text : "");
    cJSON_AddStringToObject(o, "hash", f->hash);
    cJSON *md = f->metadata ? cJSON_Parse(f->metadata) : NULL;
    if (md) cJSON_AddItemToObject(o, "metadata", md);
    else cJSON_AddNullToObject(o, "metadata");
    char ts[32];
    http_iso_time(f->created_at, ts);
    cJSON_AddStringToObject(o, "created_at", ts);
    http_iso_time(f->updated_at, ts);
    cJSON_AddStringToObject(o, "updated_at", ts);
    if (f->user && strcmp(f->user, HTTP_MEM0_NO_USER) != 0)
        cJSON_AddStringToObject(o, "user_id", f->user);
    else cJSON_AddNullToObject(o, "user_id");
    if (f->agent_id) cJSON_AddStringToObject(o, "agent_id", f->agent_id);
    if (f->run_id) cJSON_AddStringToObject(o, "run_id", f->run_id);
    cJSON_AddBoolToObject(o, "kv_ready", http_fact_kv_ready(srv, f));
    cJSON_AddNumberToObject(o, "version", f->version);
    return o;
}

static mem_filter to_filter(const char *tenant, const parse_filters *p) {
    return (mem_filter){.tenant = tenant,
                        .user = p->user_id,
                        .agent_id = p->agent_id,
                        .run_id = p->run_id,
                        .meta_keys = (const char *const *)p->meta_keys,
                        .meta_values = (const char *const *)p->meta_values,
                        .n_meta = p->n_meta};
}

/* Queues the fact's KV encoding; a failure only delays it to the next start. */
static void encode_later(http_req *r, const char *user, const char *id) {
    sched *s = r->srv->cfg.sched;
    if (!s) return;
    if (sched_encode(s, r->tenant, user, id) != IS_OK) {
        pthread_mutex_lock(&r->srv->log_mu);
        fprintf(r->srv->log,
                "{\"warning\":\"KV encoding of fact %s not queued (encoded at the next start)\"}\n",
                id);
        fflush(r->srv->log);
        pthread_mutex_unlock(&r->srv->log_mu);
    }
}

/* The user of fact `id` in the caller's tenant; want (may be NULL) must
 * match. Sends the 404 itself and returns false when there is none. */
static bool find_owner(http_req *r, const char *id, const char *want, char **user,
                       enum MHD_Result *res) {
    parse_error pe;
    if (want && parse_id_check("user_id", want, strlen(want), &pe) != IS_OK) {
        *res = http_send_parse_error(r, &pe);
        return false;
    }
    is_status st = mem_store_owner(memory_fact_store(r->srv->cfg.mem), r->tenant, id, user);
    if (st == IS_OK && want && strcmp(want, *user) != 0) {
        free(*user);
        *user = NULL;
        st = IS_ERR_NOT_FOUND;
    }
    if (st == IS_ERR_NOT_FOUND) {
        *res = http_send_error(r, 404, "memory_id", "memory_not_found", "memory %s not found", id);
        return false;
    }
    if (st != IS_OK) {
        *res = http_send_status(r, st, "memory lookup");
        return false;
    }
    return true;
}

/* ---- add --------------------------------------------------------------------------- */

typedef struct pending_fact {
    char *text;     /* owned */
    char **context; /* owned strings */
    int32_t n_context;
} pending_fact;

static void pending_free(pending_fact *p, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        free(p[i].text);
        for (int32_t j = 0; j < p[i].n_context; j++) free(p[i].context[j]);
        free(p[i].context);
    }
    free(p);
}

static char *turn_text(const parse_message *m) {
    size_t n = strlen(m->role) + strlen(m->content) + 3;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s: %s", m->role, m->content);
    return s;
}

/* The turns of msgs[0..upto) that are not system messages, the last
 * CONTEXT_TURNS of them. */
static bool context_of(const parse_message *msgs, int32_t upto, pending_fact *p) {
    int32_t first = upto, kept = 0;
    while (first > 0 && kept < CONTEXT_TURNS) {
        first--;
        if (strcmp(msgs[first].role, "system") != 0) kept++;
    }
    p->context = calloc((size_t)(kept ? kept : 1), sizeof *p->context);
    if (!p->context) return false;
    for (int32_t i = first; i < upto; i++) {
        if (strcmp(msgs[i].role, "system") == 0) continue;
        if (!(p->context[p->n_context] = turn_text(&msgs[i]))) return false;
        p->n_context++;
    }
    return true;
}

/* Runs Mem0-style extraction through the scheduler (a mode-off chat with
 * extract.h's prompt, greedy) and parses the reply with extract.h's
 * validating parser. Facts into *out; a reply that does not parse is a
 * warning (added to `warnings`), not an error. Returns false after
 * sending an error response. */
static bool extract(http_req *r, const parse_mem_add *a, pending_fact **out, int32_t *n_out,
                    cJSON *warnings, enum MHD_Result *res) {
    http_server *s = r->srv;
    size_t cap = 16;
    for (int32_t i = 0; i < a->n_messages; i++)
        cap += strlen(a->messages[i].role) + strlen(a->messages[i].content) + 4;
    char *input = malloc(cap);
    if (!input) {
        *res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        return false;
    }
    size_t o = (size_t)snprintf(input, cap, "Input:\n");
    int32_t n_turns = 0;
    for (int32_t i = 0; i < a->n_messages; i++) {
        if (strcmp(a->messages[i].role, "system") == 0) continue;
        o += (size_t)snprintf(input + o, cap - o, "%s: %s\n", a->messages[i].role,
                              a->messages[i].content);
        n_turns++;
    }
    if (n_turns == 0) {
        free(input);
        cJSON_AddItemToArray(warnings,
                             cJSON_CreateString("no user or assistant messages to extract from"));
        return true;
    }
    chat_message msgs[2] = {{"system", extract_system_prompt()}, {"user", input}};
    sched_request req = {
        .messages = msgs,
        .n_messages = 2,
        .mode = ASK_MODE_OFF,
        .max_tokens = s->cfg.limits.extract_max_tokens > 0 ? s->cfg.limits.extract_max_tokens : 512,
        .temperature = 0.0f,
        .top_p = 1.0f,
        .top_k = 0,
        .seed = 1,
        .reply_prefix = extract_reply_start()};
    chat_job *job = NULL;
    is_status st = chat_job_submit(s, &req, true, &job);
    free(input);
    if (st != IS_OK) {
        *res = st == IS_ERR_BUSY
                   ? http_send_error(r, 503, NULL, "overloaded",
                                     "the server is busy (%s); retry later", is_error_last())
                   : http_send_status(r, st, "fact extraction");
        return false;
    }
    chat_job_wait(job, r->conn);
    is_status jst;
    const char *jmsg;
    size_t len;
    const char *reply = chat_job_text(job, &len);
    if (chat_job_failed(job, &jst, &jmsg)) {
        /* Cut short by a hang-up or a stop: what the model wrote is not
         * its answer, so neither its facts nor the fallback (the raw
         * messages) are stored. */
        if (jst == IS_ERR_CANCELLED) {
            *res = http_send_status(r, is_error_set(jst, "%s", jmsg), "fact extraction");
            chat_job_free(job);
            return false;
        }
        *res = http_send_error(
            r, jst == IS_ERR_CONTEXT_FULL ? 400 : 503,
            jst == IS_ERR_CONTEXT_FULL ? "messages" : NULL,
            jst == IS_ERR_CONTEXT_FULL ? "context_length_exceeded" : "extraction_failed",
            "fact extraction: %s", jmsg && *jmsg ? jmsg : is_status_to_string(jst));
        chat_job_free(job);
        return false;
    }
    /* The reply was begun with extract_reply_start(): parse it whole. */
    const char *start = extract_reply_start();
    size_t sl = strlen(start);
    char *whole = malloc(sl + len + 1);
    if (!whole) {
        chat_job_free(job);
        *res = http_send_status(r, is_error_set(IS_ERR_NOMEM, "out of memory"), "fact extraction");
        return false;
    }
    memcpy(whole, start, sl);
    memcpy(whole + sl, reply, len);
    whole[sl + len] = '\0';
    char **facts = NULL;
    int32_t nf = 0;
    st = extract_parse(whole, sl + len, &facts, &nf);
    free(whole);
    if (st == IS_ERR_FORMAT) {
        char w[700];
        snprintf(w, sizeof w,
                 "the model's extraction reply was not usable, nothing was extracted: %s",
                 is_error_last());
        char *clean = utf8_sanitized_copy(w, strlen(w));
        cJSON_AddItemToArray(warnings,
                             cJSON_CreateString(clean ? clean : "extraction reply unusable"));
        free(clean);
        chat_job_free(job);
        return true;
    }
    chat_job_free(job);
    if (st != IS_OK) {
        *res = http_send_status(r, st, "fact extraction");
        return false;
    }
    pending_fact *p = calloc((size_t)(nf ? nf : 1), sizeof *p);
    bool ok = p != NULL;
    for (int32_t i = 0; ok && i < nf; i++) {
        p[i].text = facts[i];
        facts[i] = NULL;
        ok = context_of(a->messages, a->n_messages, &p[i]);
    }
    extract_facts_free(facts, nf);
    if (!ok) {
        pending_free(p, nf);
        *res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        return false;
    }
    *out = p;
    *n_out = nf;
    return true;
}

/* The user's own messages as facts: what an add keeps when extraction
 * found nothing and the server stores rather than loses them. */
static bool user_messages(const parse_mem_add *a, pending_fact **out, int32_t *n_out) {
    pending_fact *p = calloc(a->n_messages > 0 ? (size_t)(uint32_t)a->n_messages : 1, sizeof *p);
    int32_t n = 0;
    if (!p) return false;
    for (int32_t i = 0; i < a->n_messages; i++) {
        const char *t = a->messages[i].content;
        if (strcmp(a->messages[i].role, "user") != 0 || !t[strspn(t, " \t\r\n")]) continue;
        if (!(p[n].text = strdup(t))) break;
        n++;
        if (!context_of(a->messages, i, &p[n - 1])) break;
    }
    bool ok = true;
    for (int32_t i = 0; i < n; i++) ok = ok && p[i].text && p[i].context;
    if (!ok) {
        pending_free(p, n);
        return false;
    }
    *out = p;
    *n_out = n;
    return true;
}

enum MHD_Result http_memories_add_body(http_req *r, const char *body, size_t len,
                                       const char *owner) {
    http_server *s = r->srv;
    parse_mem_add a;
    parse_error pe;
    if (parse_memory_add(body, len, &s->cfg.limits.parse, &a, &pe) != IS_OK) {
        parse_mem_add_free(&a);
        return http_send_parse_error(r, &pe);
    }
    if (owner) {
        char *u = strdup(owner);
        if (!u) {
            parse_mem_add_free(&a);
            return http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
        }
        free(a.user_id);
        a.user_id = u;
    }
    enum MHD_Result res = MHD_YES;
    cJSON *warnings = cJSON_CreateArray();
    pending_fact *p = NULL;
    int32_t n = 0;
    memory_add_req *reqs = NULL;
    char(*ids)[MEMORY_ID_SIZE] = NULL;
    is_status *sts = NULL;
    const char *source = "api";
    size_t max_bytes =
        (size_t)(s->cfg.limits.max_fact_bytes > 0 ? s->cfg.limits.max_fact_bytes : 4096);

    /* Check sizes before anything is stored or run. */
    for (int32_t i = 0; i < a.n_facts; i++)
        if (strlen(a.facts[i]) > max_bytes) {
            res = http_send_error(r, 400, "facts", "fact_too_long",
                                  "facts[%d] is longer than %zu bytes", i, max_bytes);
            goto out;
        }
    if (a.n_messages && !a.infer)
        for (int32_t i = 0; i < a.n_messages; i++)
            if (strlen(a.messages[i].content) > max_bytes) {
                res = http_send_error(r, 400, "messages", "fact_too_long",
                                      "messages[%d].content is longer than %zu bytes (stored as "
                                      "one memory with infer=false)",
                                      i, max_bytes);
                goto out;
            }

    if (a.n_messages && a.infer) {
        if (!s->cfg.sched) {
            res = http_send_error(r, 503, "infer", "no_model",
                                  "infer=true needs the model, which this server has not loaded "
                                  "(send infer=false to store the messages as they are)");
            goto out;
        }
        if (!extract(r, &a, &p, &n, warnings, &res)) goto out;
        source = "api:infer";
        if (n == 0 && !a.n_facts) {
            /* Nothing usable came out of the model: keeping the user's words
             * is better than a 200 that stored nothing. */
            if (s->cfg.infer_fallback == HTTP_INFER_FALLBACK_REJECT) {
                cJSON *w = cJSON_GetArrayItem(warnings, 0);
                res = http_send_error(
                    r, 422, "infer", "extraction_failed",
                    "the model extracted no facts from the messages, so nothing was "
                    "stored (%s); send infer=false to store the messages as they are",
                    cJSON_IsString(w) ? w->valuestring : "an empty list");
                goto out;
            }
            for (int32_t i = 0; i < a.n_messages; i++)
                if (strcmp(a.messages[i].role, "user") == 0 &&
                    strlen(a.messages[i].content) > max_bytes) {
                    res =
                        http_send_error(r, 422, "messages", "extraction_failed",
                                        "the model extracted no facts, and messages[%d].content is "
                                        "longer than %zu bytes, too long to store as one memory; "
                                        "nothing was stored",
                                        i, max_bytes);
                    goto out;
                }
            pending_free(p, n);
            p = NULL;
            n = 0;
            if (!user_messages(&a, &p, &n)) goto oom;
            source = "api:infer-fallback";
            if (n == 0) {
                res = http_send_error(r, 422, "messages", "extraction_failed",
                                      "the model extracted no facts and the messages hold no user "
                                      "message to store; nothing was stored");
                goto out;
            }
            cJSON_AddItemToArray(
                warnings,
                cJSON_CreateString(
                    "the model extracted no facts, so the user's messages were stored as they are "
                    "(serve --infer-fallback store; 'reject' fails such adds with 422 instead)"));
        }
    } else if (a.n_messages) {
        p = calloc((size_t)(uint32_t)a.n_messages, sizeof *p);
        if (!p) goto oom;
        for (int32_t i = 0; i < a.n_messages; i++) {
            const char *t = a.messages[i].content;
            if (strcmp(a.messages[i].role, "system") == 0 || !t[strspn(t, " \t\r\n")]) continue;
            if (!(p[n].text = strdup(t))) goto oom;
            n++;
            if (!context_of(a.messages, i, &p[n - 1])) goto oom;
        }
        source = "api:messages";
    }
    if (a.n_facts) {
        pending_fact *np =
            realloc(p, ((size_t)(uint32_t)n + (size_t)(uint32_t)a.n_facts) * sizeof *np);
        if (!np) goto oom;
        p = np;
        for (int32_t i = 0; i < a.n_facts; i++) {
            memset(&p[n], 0, sizeof p[n]);
            if (!(p[n].text = strdup(a.facts[i]))) goto oom;
            n++;
        }
        if (!a.n_messages) source = "api:facts";
    }

    cJSON *root = cJSON_CreateObject(), *results = cJSON_AddArrayToObject(root, "results");
    if (n > 0) {
        reqs = calloc((size_t)n, sizeof *reqs);
        ids = calloc((size_t)n, sizeof *ids);
        sts = calloc((size_t)n, sizeof *sts);
        if (!reqs || !ids || !sts) {
            cJSON_Delete(root);
            goto oom;
        }
        for (int32_t i = 0; i < n; i++)
            reqs[i] = (memory_add_req){.tenant = r->tenant,
                                       .user = a.user_id,
                                       .agent_id = a.agent_id,
                                       .run_id = a.run_id,
                                       .text = p[i].text,
                                       .metadata_json = a.metadata_json,
                                       .source = source,
                                       .context = (const char *const *)p[i].context,
                                       .n_context = p[i].n_context,
                                       .window = MEMORY_WINDOW_DEFAULT};
        is_status st = memory_add_batch(s->cfg.mem, reqs, n, ids, sts);
        char first_err[512] = "";
        if (st != IS_OK) snprintf(first_err, sizeof first_err, "%s", is_error_last());
        int32_t added = 0;
        for (int32_t i = 0; i < n; i++) {
            if (sts[i] != IS_OK) continue;
            added++;
            cJSON *it = cJSON_CreateObject();
            cJSON_AddStringToObject(it, "id", ids[i]);
            cJSON_AddStringToObject(it, "memory", p[i].text);
            cJSON_AddStringToObject(it, "event", "ADD");
            cJSON_AddItemToArray(results, it);
            encode_later(r, a.user_id, ids[i]);
        }
        if (added == 0) {
            cJSON_Delete(root);
            is_error_set(st, "%s", first_err);
            res = http_send_status(r, st, "adding memories");
            goto out;
        }
        if (added < n) {
            char w[700];
            snprintf(w, sizeof w, "%d of %d memories were not stored: %s", n - added, n, first_err);
            cJSON_AddItemToArray(warnings, cJSON_CreateString(w));
        }
    }
    if (cJSON_GetArraySize(warnings) > 0) {
        cJSON_AddItemToObject(root, "warnings", warnings);
        warnings = NULL;
    }
    res = http_send_json(r, 200, root);
    goto out;
oom:
    res = http_send_error(r, 500, NULL, "out_of_memory", "out of memory");
out:
    cJSON_Delete(warnings);
    pending_free(p, n);
    free(reqs);
    free(ids);
    free(sts);
    parse_mem_add_free(&a);
    return res;
}

/* ---- list, search, delete all ------------------------------------------------------------ */

static bool query_filters(http_req *r, parse_filters *f, enum MHD_Result *res) {
    const char *keys[MAX_QUERY_ARGS], *vals[MAX_QUERY_ARGS];
    size_t klens[MAX_QUERY_ARGS], vlens[MAX_QUERY_ARGS];
    int32_t n = http_query_args_n(r->conn, keys, klens, vals, vlens, MAX_QUERY_ARGS);
    if (n > MAX_QUERY_ARGS) {
        *res = http_send_error(r, 400, NULL, "invalid_value", "too many query parameters");
        return false;
    }
    parse_error pe;
    if (parse_memory_query_n(keys, klens, vals, vlens, n, true, f, &pe) != IS_OK) {
        *res = http_send_parse_error(r, &pe);
        return false;
    }
    return true;
}

static enum MHD_Result list_memories(http_req *r) {
    parse_filters pf;
    enum MHD_Result res;
    if (!query_filters(r, &pf, &res)) return res;
    mem_filter f = to_filter(r->tenant, &pf);
    mem_fact *facts = NULL;
    int32_t n = 0;
    is_status st = memory_get_all(r->srv->cfg.mem, &f, &facts, &n);
    if (st != IS_OK) {
        parse_filters_free(&pf);
        return http_send_status(r, st, "listing memories");
    }
    cJSON *root = cJSON_CreateObject(), *results = cJSON_AddArrayToObject(root, "results");
    for (int32_t i = 0; i < n; i++)
        cJSON_AddItemToArray(results, http_fact_json(r->srv, &facts[i]));
    mem_facts_free(facts, n);
    parse_filters_free(&pf);
    return http_send_json(r, 200, root);
}

static enum MHD_Result search_memories(http_req *r) {
    parse_mem_search q;
    parse_error pe;
    if (parse_memory_search(r->body, r->len, &r->srv->cfg.limits.parse, &q, &pe) != IS_OK) {
        parse_mem_search_free(&q);
        return http_send_parse_error(r, &pe);
    }
    mem_filter f = to_filter(r->tenant, &q.filters);
    memory_hit *hits = NULL;
    int32_t n = 0;
    is_status st = memory_search(r->srv->cfg.mem, &f, q.query, q.top_k, &hits, &n);
    parse_mem_search_free(&q);
    if (st != IS_OK) return http_send_status(r, st, "searching memories");
    cJSON *root = cJSON_CreateObject(), *results = cJSON_AddArrayToObject(root, "results");
    for (int32_t i = 0; i < n; i++) {
        cJSON *o = http_fact_json(r->srv, &hits[i].fact);
        cJSON_AddNumberToObject(o, "score", hits[i].score);
        cJSON_AddItemToArray(results, o);
    }
    memory_hits_free(hits, n);
    return http_send_json(r, 200, root);
}

/* ---- one memory ---------------------------------------------------------------------------- */

/* The query's user_id (NULL if none) into *want; a second one with another
 * value is a 400, as on the routes that list, rather than the first one
 * silently. Sends the error itself. */
static bool query_user(http_req *r, const char **want, enum MHD_Result *res) {
    const char *keys[MAX_QUERY_ARGS], *vals[MAX_QUERY_ARGS];
    int32_t nq = http_query_args(r->conn, keys, vals, MAX_QUERY_ARGS);
    if (nq > MAX_QUERY_ARGS) {
        *res = http_send_error(r, 400, NULL, "invalid_value", "too many query parameters");
        return false;
    }
    *want = NULL;
    for (int32_t i = 0; i < nq; i++) {
        if (strcmp(keys[i], "user_id") != 0) continue;
        const char *v = vals[i] ? vals[i] : "";
        if (*want && strcmp(*want, v) != 0) {
            *res = http_send_error(r, 400, "user_id", "invalid_value",
                                   "'user_id' is given twice with different values");
            return false;
        }
        *want = v;
    }
    return true;
}

static enum MHD_Result get_one(http_req *r, const char *id) {
    enum MHD_Result res;
    const char *want;
    if (!query_user(r, &want, &res)) return res;
    char *user = NULL;
    if (!find_owner(r, id, want, &user, &res)) return res;
    mem_fact f;
    is_status st = memory_get(r->srv->cfg.mem, r->tenant, user, id, &f);
    free(user);
    if (st == IS_ERR_NOT_FOUND)
        return http_send_error(r, 404, "memory_id", "memory_not_found", "memory %s not found", id);
    if (st != IS_OK) return http_send_status(r, st, "reading the memory");
    cJSON *o = http_fact_json(r->srv, &f);
    mem_fact_clear(&f);
    return http_send_json(r, 200, o);
}

static enum MHD_Result update_one(http_req *r, const char *id) {
    parse_mem_update u;
    parse_error pe;
    if (parse_memory_update(r->body, r->len, &u, &pe) != IS_OK) {
        parse_mem_update_free(&u);
        return http_send_parse_error(r, &pe);
    }
    enum MHD_Result res;
    char *user = NULL;
    size_t max_bytes =
        (size_t)(r->srv->cfg.limits.max_fact_bytes > 0 ? r->srv->cfg.limits.max_fact_bytes : 4096);
    if (u.text && strlen(u.text) > max_bytes) {
        res = http_send_error(r, 400, "text", "fact_too_long", "the text is longer than %zu bytes",
                              max_bytes);
        goto out;
    }
    if (!find_owner(r, id, u.user_id, &user, &res)) goto out;
    is_status st = memory_update(r->srv->cfg.mem, r->tenant, user, id, u.text, u.metadata_json);
    if (st == IS_ERR_NOT_FOUND) {
        res = http_send_error(r, 404, "memory_id", "memory_not_found", "memory %s not found", id);
        goto out;
    }
    if (st != IS_OK) {
        res = http_send_status(r, st, "updating the memory");
        goto out;
    }
    mem_fact f;
    st = memory_get(r->srv->cfg.mem, r->tenant, user, id, &f);
    if (st != IS_OK) {
        res = http_send_status(r, st, "reading the memory");
        goto out;
    }
    if (u.text && !f.kv_record) encode_later(r, user, id);
    cJSON *o = http_fact_json(r->srv, &f);
    cJSON_AddStringToObject(o, "message", "Memory updated successfully!");
    mem_fact_clear(&f);
    res = http_send_json(r, 200, o);
out:
    free(user);
    parse_mem_update_free(&u);
    return res;
}

static enum MHD_Result delete_one(http_req *r, const char *id) {
    enum MHD_Result res;
    /* mem0ai 2.x's delete(id, delete_linked=True): no linked memories here. */
    const char *linked =
        MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, "delete_linked");
    if (linked && strcasecmp(linked, "false") != 0)
        return http_send_error(
            r, 400, "delete_linked", "unsupported_feature",
            "delete_linked is not supported by this server (InferScale): memories "
            "have no linked versions here; see the Mem0 feature table in the README");
    const char *want;
    if (!query_user(r, &want, &res)) return res;
    char *user = NULL;
    if (!find_owner(r, id, want, &user, &res)) return res;
    is_status st = memory_delete(r->srv->cfg.mem, r->tenant, user, id);
    free(user);
    if (st == IS_ERR_NOT_FOUND)
        return http_send_error(r, 404, "memory_id", "memory_not_found", "memory %s not found", id);
    if (st != IS_OK) return http_send_status(r, st, "deleting the memory");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "message", "Memory deleted successfully!");
    return http_send_json(r, 200, o);
}

static enum MHD_Result history_one(http_req *r, const char *id) {
    enum MHD_Result res;
    const char *want;
    if (!query_user(r, &want, &res)) return res;
    char *user = NULL;
    if (!find_owner(r, id, want, &user, &res)) return res;
    mem_history *h = NULL;
    int32_t n = 0;
    is_status st = memory_history(r->srv->cfg.mem, r->tenant, user, id, &h, &n);
    if (st == IS_ERR_NOT_FOUND) {
        free(user);
        return http_send_error(r, 404, "memory_id", "memory_not_found", "memory %s not found", id);
    }
    if (st != IS_OK) {
        free(user);
        return http_send_status(r, st, "reading the history");
    }
    cJSON *arr = cJSON_CreateArray();
    for (int32_t i = 0; i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        char hid[32], ts[32];
        snprintf(hid, sizeof hid, "%lld", (long long)h[i].id);
        http_iso_time(h[i].at, ts);
        cJSON_AddStringToObject(o, "id", hid);
        cJSON_AddStringToObject(o, "memory_id", h[i].fact_id);
        if (h[i].old_text) cJSON_AddStringToObject(o, "old_memory", h[i].old_text);
        else cJSON_AddNullToObject(o, "old_memory");
        if (h[i].new_text) cJSON_AddStringToObject(o, "new_memory", h[i].new_text);
        else cJSON_AddNullToObject(o, "new_memory");
        cJSON_AddStringToObject(o, "event", mem_event_name(h[i].event));
        cJSON_AddStringToObject(o, "created_at", ts);
        cJSON_AddStringToObject(o, "user_id", user);
        cJSON_AddBoolToObject(o, "is_deleted", h[i].event == MEM_EVENT_DELETE);
        cJSON_AddItemToArray(arr, o);
    }
    mem_history_free(h, n);
    free(user);
    return http_send_json(r, 200, arr);
}

/* ---- routing -------------------------------------------------------------------------------- */

enum MHD_Result http_memories(http_req *r, const char *rest) {
    if (!rest) return http_mem0(r); /* a Mem0 platform route (mem0.h) */
    if (!r->srv->cfg.mem)
        return http_send_error(r, 503, NULL, "no_memory", "this server has no memory store");
    const char *m = r->method;
    bool get = strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0;
    bool post = strcmp(m, "POST") == 0, put = strcmp(m, "PUT") == 0, del = strcmp(m, "DELETE") == 0;
    /* rest: "", "/", "/search[/]", "/{id}[/]", "/{id}/history[/]" */
    while (*rest == '/') rest++;
    char seg[2][96] = {"", ""};
    int nseg = 0;
    const char *p = rest;
    while (*p) {
        const char *e = strchr(p, '/');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == 0) return http_send_error(r, 404, NULL, "not_found", "no route %.200s", r->path);
        if (nseg == 2 || l >= sizeof seg[0])
            return http_send_error(r, 404, NULL, "not_found", "no route %.200s", r->path);
        memcpy(seg[nseg], p, l);
        seg[nseg][l] = '\0';
        nseg++;
        p += l;
        if (*p == '/') p++;
    }
    if (nseg == 0) {
        if (post) return http_mem0_add(r);
        if (get) return list_memories(r);
        if (del) return http_mem0_delete_all(r);
        return http_send_error(r, 405, NULL, "method_not_allowed", "use GET, POST or DELETE");
    }
    if (nseg == 1 && strcmp(seg[0], "search") == 0 && post) return search_memories(r);
    if (!parse_memory_id_valid(seg[0], strlen(seg[0])))
        return http_send_error(r, 404, "memory_id", "memory_not_found", "memory %.100s not found",
                               seg[0]);
    if (nseg == 2) {
        if (strcmp(seg[1], "history") != 0)
            return http_send_error(r, 404, NULL, "not_found", "no route %.200s", r->path);
        if (!get) return http_send_error(r, 405, NULL, "method_not_allowed", "use GET");
        return history_one(r, seg[0]);
    }
    if (get) return get_one(r, seg[0]);
    if (put) return update_one(r, seg[0]);
    if (del) return delete_one(r, seg[0]);
    return http_send_error(r, 405, NULL, "method_not_allowed", "use GET, PUT or DELETE");
}

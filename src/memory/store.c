/*
 * store: the public functions of memory/store.h. They check what both
 * implementations would check alike and dispatch through the store's ops
 * (memory/store_impl.h); the helpers both implementations share live here.
 */
#include "memory/store.h"

#include "core/status.h"
#include "kv/fact_record.h"
#include "memory/metadata.h"
#include "memory/store_impl.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- shared helpers ------------------------------------------------------------ */

const char *mem_event_name(mem_event e) {
    switch (e) {
    case MEM_EVENT_ADD: return "ADD";
    case MEM_EVENT_UPDATE: return "UPDATE";
    case MEM_EVENT_DELETE: return "DELETE";
    }
    return "?";
}

void mem_fact_clear(mem_fact *f) {
    if (!f) return;
    free(f->tenant);
    free(f->user);
    free(f->agent_id);
    free(f->run_id);
    free(f->text);
    free(f->metadata);
    free(f->source);
    free(f->embedding);
    for (int32_t i = 0; i < f->n_context; i++) free(f->context[i]);
    free(f->context);
    free(f->kv_record);
    memset(f, 0, sizeof *f);
}

void mem_facts_free(mem_fact *f, int32_t n) {
    if (!f) return;
    for (int32_t i = 0; i < n; i++) mem_fact_clear(&f[i]);
    free(f);
}

void mem_history_free(mem_history *h, int32_t n) {
    if (!h) return;
    for (int32_t i = 0; i < n; i++) {
        free(h[i].old_text);
        free(h[i].new_text);
    }
    free(h);
}

void mem_text_hash_hex(const char *text, char out[17]) {
    snprintf(out, 17, "%016llx", (unsigned long long)fact_text_hash(text, text ? strlen(text) : 0));
}

is_status mem_metadata_canonical(const char *json, char **out) {
    if (!json || !*json) {
        *out = NULL;
        return IS_OK;
    }
    cJSON *root = cJSON_Parse(json);
    if (!root) return is_error_set(IS_ERR_INVALID_ARG, "metadata is not valid JSON");
    is_status st = IS_OK;
    if (!cJSON_IsObject(root)) {
        st = is_error_set(IS_ERR_INVALID_ARG, "metadata is not a JSON object");
        goto done;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (cJSON_IsObject(it) || cJSON_IsArray(it)) {
            st = is_error_set(IS_ERR_INVALID_ARG,
                              "metadata key \"%s\": values must be strings, numbers, booleans "
                              "or null",
                              it->string);
            goto done;
        }
    }
    char *txt = cJSON_PrintUnformatted(root);
    if (!txt) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto done;
    }
    *out = txt;
done:
    cJSON_Delete(root);
    return st;
}

bool store_meta_matches(const char *metadata, const mem_filter *f) {
    if (f->n_meta <= 0) return true;
    if (!metadata) return false;
    cJSON *root = cJSON_Parse(metadata);
    if (!root) return false;
    bool ok = true;
    for (int32_t i = 0; i < f->n_meta && ok; i++) {
        const cJSON *it, *hit = NULL;
        cJSON_ArrayForEach(it, root) {
            if (strcmp(it->string, f->meta_keys[i]) == 0) {
                hit = it;
                break;
            }
        }
        char *v = hit ? metadata_scalar_string(hit) : NULL;
        ok = v && strcmp(v, f->meta_values[i]) == 0;
        free(v);
    }
    cJSON_Delete(root);
    return ok;
}

char *store_context_to_json(char *const *ctx, int32_t n) {
    cJSON *arr = cJSON_CreateArray();
    if (!arr) return NULL;
    for (int32_t i = 0; i < n; i++) {
        cJSON *s = cJSON_CreateString(ctx[i] ? ctx[i] : "");
        if (!s) {
            cJSON_Delete(arr);
            return NULL;
        }
        cJSON_AddItemToArray(arr, s);
    }
    char *txt = cJSON_PrintUnformatted(arr);
    cJSON_Delete(arr);
    return txt;
}

is_status store_context_from_json(const char *txt, mem_fact *f) {
    if (!txt || !*txt) return IS_OK;
    cJSON *arr = cJSON_Parse(txt);
    if (!cJSON_IsArray(arr)) {
        cJSON_Delete(arr);
        return is_error_set(IS_ERR_FORMAT, "fact %s: context column is not a JSON array", f->id);
    }
    int32_t n = cJSON_GetArraySize(arr);
    f->context = calloc((size_t)(n ? n : 1), sizeof *f->context);
    if (!f->context) {
        cJSON_Delete(arr);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        const char *v = cJSON_GetStringValue(it);
        if (!(f->context[f->n_context] = strdup(v ? v : ""))) {
            cJSON_Delete(arr);
            return is_error_set(IS_ERR_NOMEM, "out of memory");
        }
        f->n_context++;
    }
    cJSON_Delete(arr);
    return IS_OK;
}

int64_t store_now_unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

is_status store_check_fact(const mem_fact *f) {
    if (!f || !f->id[0] || !f->tenant || !*f->tenant || !f->user || !*f->user || !f->text ||
        strlen(f->hash) != 16 || !f->embedding || f->dim <= 0 || f->version < 1)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fact store: a fact needs id, tenant, user, text, hash, embedding "
                            "and a version >= 1");
    return IS_OK;
}

is_status store_check_filter(const mem_filter *f) {
    if (!f || !f->tenant || !f->user || f->n_meta < 0 ||
        (f->n_meta > 0 && (!f->meta_keys || !f->meta_values)))
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: a filter needs tenant and user");
    for (int32_t i = 0; i < f->n_meta; i++)
        if (!f->meta_keys[i] || !f->meta_values[i])
            return is_error_set(IS_ERR_INVALID_ARG,
                                "fact store: NULL metadata filter key or value");
    return IS_OK;
}

void store_note_repair(mem_store *s, const char *fmt, const char *arg) {
    size_t l = strlen(s->repairs);
    if (l + 3 >= sizeof s->repairs) return;
    if (l) l += (size_t)snprintf(s->repairs + l, sizeof s->repairs - l, "; ");
    snprintf(s->repairs + l, sizeof s->repairs - l, fmt, arg);
}

const char *store_row_problem(const char *id, const char *text, const char *hash, int32_t version,
                              const void *emb, int64_t bytes, int32_t dim, const char *ctx) {
    if (!id || !*id || strlen(id) > MEM_ID_MAX) return "bad id";
    if (version < 1) return "bad version";
    char h[17];
    mem_text_hash_hex(text ? text : "", h);
    if (!hash || strcmp(hash, h) != 0) return "the text does not match its hash";
    if (!emb || bytes <= 0 || bytes % (int64_t)sizeof(float) != 0 ||
        (dim > 0 && bytes != (int64_t)dim * (int64_t)sizeof(float)))
        return "embedding of the wrong size";
    for (int64_t i = 0; i < bytes / (int64_t)sizeof(float); i++) {
        float v;
        memcpy(&v, (const char *)emb + (size_t)i * sizeof v, sizeof v);
        if (!isfinite(v)) return "embedding not finite";
    }
    if (ctx) {
        cJSON *j = cJSON_Parse(ctx);
        bool ok = cJSON_IsArray(j);
        cJSON_Delete(j);
        if (!ok) return "context is not a JSON array";
    }
    return NULL;
}

/* ---- open and dispatch ------------------------------------------------------------ */

bool mem_store_is_url(const char *path) {
    return path &&
           (strncmp(path, "postgres://", 11) == 0 || strncmp(path, "postgresql://", 13) == 0);
}

is_status mem_store_open(const char *path, mem_store **out) {
    if (!path || !*path || !out) return is_error_set(IS_ERR_INVALID_ARG, "fact store: no path");
    return mem_store_is_url(path) ? store_pg_open(path, false, out)
                                  : store_sqlite_open(path, false, out);
}

is_status mem_store_open_readonly(const char *path, mem_store **out) {
    if (!path || !*path || !out) return is_error_set(IS_ERR_INVALID_ARG, "fact store: no path");
    return mem_store_is_url(path) ? store_pg_open(path, true, out)
                                  : store_sqlite_open(path, true, out);
}

void mem_store_close(mem_store *s) {
    if (s) s->ops->close(s);
}

const char *mem_store_kind(const mem_store *s) { return s->ops->name; }

void mem_store_set_fault_hook(mem_store *s, mem_store_fault_fn fn, void *user_data) {
    s->fault = fn;
    s->fault_user = user_data;
}

const char *mem_store_repairs(const mem_store *s) { return s->repairs; }

is_status mem_store_watch(mem_store *s, mem_store_change_fn fn, void *user_data) {
    if (!s || !fn) return is_error_set(IS_ERR_INVALID_ARG, "mem_store_watch: NULL argument");
    if (!s->ops->watch)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "fact store: a %s store has no other writers to "
                            "watch",
                            s->ops->name);
    return s->ops->watch(s, fn, user_data);
}

/* Every other call runs its op under the connection's lock (one caller at
 * a time on the connection), taken here rather than in each op. */
#define LOCKED(s, type, call)                                                                      \
    do {                                                                                           \
        (s)->ops->lock(s);                                                                         \
        type r_ = (call);                                                                          \
        (s)->ops->unlock(s);                                                                       \
        return r_;                                                                                 \
    } while (0)

is_status mem_store_meta_get(mem_store *s, const char *key, char **value) {
    LOCKED(s, is_status, s->ops->meta_get(s, key, value));
}

is_status mem_store_meta_set(mem_store *s, const char *key, const char *value) {
    LOCKED(s, is_status, s->ops->meta_set(s, key, value));
}

/* ---- writes: one transaction each, or one for a batch --------------------------- */

/* A transaction body: item i of a batch (a single write is a batch of one).
 * A failure it returns rolls the transaction back; an outcome that leaves
 * the transaction good (a conditional update that matched no row) goes to
 * *item instead. */
typedef is_status (*write_fn)(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item);

/* Runs body for items [i0, i1) in one transaction: lock, begin, the
 * bodies, the fault hook, commit; rolled back at the first failure.
 * item[i - i0] gets each item's own outcome (IS_OK unless its body said). */
static is_status write_tx(mem_store *s, write_fn body, void *ud, int32_t i0, int32_t i1,
                          is_status *item) {
    int64_t now = store_now_unix_ms();
    for (int32_t i = i0; i < i1; i++) item[i - i0] = IS_OK;
    s->ops->lock(s);
    is_status st = s->ops->begin(s);
    if (st == IS_OK) {
        for (int32_t i = i0; i < i1 && st == IS_OK; i++) st = body(s, ud, i, now, &item[i - i0]);
        if (st == IS_OK && s->fault && !s->fault(s->fault_user))
            st = is_error_set(IS_ERR_IO, "fact store %s: injected fault before commit", s->where);
        if (st == IS_OK) st = s->ops->commit(s);
        if (st != IS_OK) s->ops->rollback(s);
    }
    s->ops->unlock(s);
    return st;
}

/* One write in its own transaction: its failure or its own outcome. */
static is_status write_one(mem_store *s, write_fn body, void *ud) {
    is_status item, st = write_tx(s, body, ud, 0, 1, &item);
    return st != IS_OK ? st : item;
}

/* n writes in one transaction (one durable commit for all). If it fails,
 * each item is written again in a transaction of its own, so one bad item
 * costs only itself. status[i]: each item's own outcome. Returns IS_OK or
 * the first item's failure. */
static is_status write_batch(mem_store *s, write_fn body, void *ud, int32_t n, is_status *status) {
    is_status st = write_tx(s, body, ud, 0, n, status);
    if (st != IS_OK) {
        for (int32_t i = 0; i < n; i++) {
            is_status one = n == 1 ? st : write_tx(s, body, ud, i, i + 1, &status[i]);
            if (one != IS_OK) status[i] = one;
        }
    }
    for (int32_t i = 0; i < n; i++)
        if (status[i] != IS_OK) return status[i];
    return IS_OK;
}

static is_status insert_body(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item) {
    return s->ops->insert(s, ((const mem_fact *const *)ud)[i], now);
}

is_status mem_store_insert(mem_store *s, const mem_fact *f) {
    is_status st = store_check_fact(f);
    return st != IS_OK ? st : write_one(s, insert_body, (void *)&f);
}

is_status mem_store_insert_many(mem_store *s, const mem_fact *f, int32_t n, is_status *status) {
    if (n < 0 || (n > 0 && (!f || !status)))
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: insert_many needs facts and status");
    if (n == 0) return IS_OK;
    const mem_fact **ok = malloc((size_t)n * sizeof *ok);
    int32_t *at = malloc((size_t)n * sizeof *at);
    is_status *sub = malloc((size_t)n * sizeof *sub);
    is_status first = IS_OK;
    if (!ok || !at || !sub) {
        first = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; i < n; i++) status[i] = first;
        goto out;
    }
    /* Facts that fail the checks stay out of the transaction. */
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        status[i] = store_check_fact(&f[i]);
        if (status[i] == IS_OK) {
            at[m] = i;
            ok[m++] = &f[i];
        } else if (first == IS_OK) {
            first = status[i];
        }
    }
    if (m > 0) {
        is_status st = write_batch(s, insert_body, (void *)ok, m, sub);
        for (int32_t j = 0; j < m; j++) status[at[j]] = sub[j];
        if (first == IS_OK) first = st;
    }
out:
    free(ok);
    free(at);
    free(sub);
    return first;
}

is_status mem_store_get(mem_store *s, const char *tenant, const char *user, const char *id,
                        bool with_embedding, mem_fact *out) {
    memset(out, 0, sizeof *out);
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: get needs tenant, user and id");
    LOCKED(s, is_status, s->ops->get(s, tenant, user, id, with_embedding, out));
}

is_status mem_store_get_many(mem_store *s, const char *tenant, const char *user,
                             const char *const *ids, int32_t n, mem_fact *out, bool *found) {
    if (n < 0 || (n > 0 && (!ids || !out || !found)))
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: get_many needs ids, out and found");
    for (int32_t i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        found[i] = false;
        if (!ids[i]) return is_error_set(IS_ERR_INVALID_ARG, "fact store: get_many: NULL id");
    }
    if (!tenant || !user)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: get_many needs tenant and user");
    if (n == 0) return IS_OK;
    is_status st = IS_OK;
    s->ops->lock(s);
    if (s->ops->get_many) {
        st = s->ops->get_many(s, tenant, user, ids, n, out, found);
    } else {
        for (int32_t i = 0; i < n && st == IS_OK; i++) {
            st = s->ops->get(s, tenant, user, ids[i], false, &out[i]);
            found[i] = st == IS_OK;
            if (st == IS_ERR_NOT_FOUND) st = IS_OK;
        }
    }
    s->ops->unlock(s);
    if (st != IS_OK)
        for (int32_t i = 0; i < n; i++) {
            mem_fact_clear(&out[i]);
            found[i] = false;
        }
    return st;
}

is_status mem_store_list(mem_store *s, const mem_filter *f, bool with_embedding, mem_fact **out,
                         int32_t *n) {
    is_status st = store_check_filter(f);
    if (st != IS_OK) return st;
    LOCKED(s, is_status, s->ops->list(s, f, with_embedding, out, n));
}

typedef struct update_args {
    const mem_fact *f;
    int32_t expected_version;
} update_args;

static is_status update_body(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item) {
    const update_args *a = ud;
    return s->ops->update(s, a->f, a->expected_version, now);
}

is_status mem_store_update(mem_store *s, const mem_fact *f, int32_t expected_version) {
    is_status st = store_check_fact(f);
    update_args a = {f, expected_version};
    return st != IS_OK ? st : write_one(s, update_body, &a);
}

/* A fact deleted or updated meanwhile matches no row: its own outcome,
 * not the batch's. */
static is_status set_kv_body(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item) {
    const mem_store_kv_set *k = &((const mem_store_kv_set *)ud)[i];
    is_status st = s->ops->set_kv(s, k->id, k->version, k->kv_record);
    if (st != IS_ERR_NOT_FOUND) return st;
    *item = st;
    return IS_OK;
}

is_status mem_store_set_kv(mem_store *s, const char *id, int32_t version, const char *kv_record) {
    if (!id) return is_error_set(IS_ERR_INVALID_ARG, "fact store: set_kv needs an id");
    mem_store_kv_set k = {id, version, kv_record};
    return write_one(s, set_kv_body, &k);
}

is_status mem_store_set_kv_many(mem_store *s, const mem_store_kv_set *sets, int32_t n,
                                is_status *status) {
    if (n < 0 || (n > 0 && (!sets || !status)))
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: set_kv_many needs sets and status");
    for (int32_t i = 0; i < n; i++)
        if (!sets[i].id) return is_error_set(IS_ERR_INVALID_ARG, "fact store: set_kv needs an id");
    return n == 0 ? IS_OK : write_batch(s, set_kv_body, (void *)sets, n, status);
}

typedef struct delete_args {
    const char *tenant, *user, *id;
    mem_fact row;
} delete_args;

static is_status delete_body(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item) {
    delete_args *a = ud;
    return s->ops->del(s, a->tenant, a->user, a->id, &a->row, now);
}

is_status mem_store_delete(mem_store *s, const char *tenant, const char *user, const char *id,
                           mem_fact *old) {
    if (old) memset(old, 0, sizeof *old);
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: delete needs tenant, user and id");
    delete_args a = {.tenant = tenant, .user = user, .id = id};
    is_status st = write_one(s, delete_body, &a);
    if (st == IS_OK && old) *old = a.row;
    else mem_fact_clear(&a.row);
    return st;
}

typedef struct delete_all_args {
    const mem_filter *f;
    mem_fact *rows;
    int32_t n;
} delete_all_args;

static is_status delete_all_body(mem_store *s, void *ud, int32_t i, int64_t now, is_status *item) {
    delete_all_args *a = ud;
    return s->ops->delete_all(s, a->f, &a->rows, &a->n, now);
}

is_status mem_store_delete_all(mem_store *s, const mem_filter *f, mem_fact **deleted, int32_t *n) {
    is_status st = store_check_filter(f);
    if (st != IS_OK) return st;
    delete_all_args a = {f, NULL, 0};
    if ((st = write_one(s, delete_all_body, &a)) != IS_OK) {
        mem_facts_free(a.rows, a.n);
        return st;
    }
    *deleted = a.rows;
    *n = a.n;
    return IS_OK;
}

is_status mem_store_history(mem_store *s, const char *tenant, const char *user, const char *id,
                            mem_history **out, int32_t *n) {
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "fact store: history needs tenant, user and id");
    LOCKED(s, is_status, s->ops->history(s, tenant, user, id, out, n));
}

is_status mem_store_find_source(mem_store *s, const char *tenant, const char *user,
                                const char *source, const char *hash, char id_out[MEM_ID_MAX + 1]) {
    LOCKED(s, is_status, s->ops->find_source(s, tenant, user, source, hash, id_out));
}

int64_t mem_store_count(mem_store *s) { LOCKED(s, int64_t, s->ops->count(s)); }

is_status mem_store_owner(mem_store *s, const char *tenant, const char *id, char **user) {
    if (!s || !tenant || !id || !user)
        return is_error_set(IS_ERR_INVALID_ARG, "mem_store_owner: NULL argument");
    LOCKED(s, is_status, s->ops->owner(s, tenant, id, user));
}

is_status mem_store_users(mem_store *s, const char *tenant, char ***out, int32_t *n) {
    if (!s || !tenant || !out || !n)
        return is_error_set(IS_ERR_INVALID_ARG, "mem_store_users: NULL argument");
    LOCKED(s, is_status, s->ops->users(s, tenant, out, n));
}

is_status mem_store_foreach(mem_store *s, bool with_embedding, mem_store_fact_fn fn,
                            void *user_data) {
    LOCKED(s, is_status, s->ops->foreach (s, with_embedding, fn, user_data));
}

is_status mem_store_quarantine_bad_rows(mem_store *s, int32_t dim, int64_t *n_out) {
    LOCKED(s, is_status, s->ops->quarantine(s, dim, true, n_out));
}

is_status mem_store_count_bad_rows(mem_store *s, int32_t dim, int64_t *n_out) {
    LOCKED(s, is_status, s->ops->quarantine(s, dim, false, n_out));
}

void mem_store_missing_tables(mem_store *s, char *out, size_t cap) {
    s->ops->lock(s);
    s->ops->missing_tables(s, out, cap);
    s->ops->unlock(s);
}

is_status mem_store_integrity(mem_store *s, char *out, size_t cap) {
    LOCKED(s, is_status, s->ops->integrity(s, out, cap));
}

is_status mem_store_foreach_record(mem_store *s, mem_store_record_fn fn, void *user_data) {
    LOCKED(s, is_status, s->ops->foreach_record(s, fn, user_data));
}

int64_t mem_store_count_history(mem_store *s) { LOCKED(s, int64_t, s->ops->count_history(s)); }

int64_t mem_store_count_quarantined(mem_store *s) {
    LOCKED(s, int64_t, s->ops->count_quarantined(s));
}

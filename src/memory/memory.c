#include "memory/memory.h"

#include "core/status.h"
#include "core/utf8.h"
#include "kv/fact_record.h"
#include "memory/strmap.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

#define RECORD_EXT ".fkv"

struct memory {
    char *dir;
    char *kv_dir;
    mem_store *store;
    record_store *rs;
    mem_index *ix;
    dense_gpu *gpu; /* GPU retrieval, or NULL: the index's dense half on the device */
    /* embedding: emb, else embed(); dense is false for the BM25-only mode */
    embedder *emb;
    memory_embed_fn embed;
    void *embed_ud;
    int32_t dim;
    bool dense;
    int32_t kv_window;
    memory_encode_fn encode; /* NULL: facts are stored without KV */
    void *encode_ud;
    memory_fault_fn fault;
    void *fault_ud;
    memory_change_fn change; /* another node changed a fact (store watch) */
    void *change_ud;
    pthread_mutex_t write_mu; /* one write at a time, encode to index */
    /* (write_mu) The record ids memory_encode_batch calls are writing,
     * from their rows' read to their commit: two of them may encode one
     * fact at once (the scheduler's encoder thread and a request's KV on
     * demand on its engine thread), under one record id. */
    struct encode_batch_reg *encoding;
    pthread_mutex_t emb_mu; /* the embedder keeps work buffers */
    bool wrote_before;      /* the store holds a trace of a write (see memory_open) */
};

memory_params memory_default_params(void) {
    memory_params p;
    memset(&p, 0, sizeof p);
    p.kv_cache_bytes = (size_t)64 << 20;
    return p;
}

record_store *memory_record_store(memory *m) { return m->rs; }
mem_store *memory_fact_store(memory *m) { return m->store; }
int32_t memory_dim(const memory *m) { return m->dim; }

void memory_set_encoder(memory *m, memory_encode_fn fn, void *user_data) {
    pthread_mutex_lock(&m->write_mu);
    m->encode = fn;
    m->encode_ud = user_data;
    pthread_mutex_unlock(&m->write_mu);
}

void memory_set_fault_hook(memory *m, memory_fault_fn fn, void *user_data) {
    pthread_mutex_lock(&m->write_mu);
    m->fault = fn;
    m->fault_ud = user_data;
    pthread_mutex_unlock(&m->write_mu);
}

static void step(memory *m, memory_step s) {
    if (m->fault) m->fault(s, m->fault_ud);
}

/* ---- helpers -------------------------------------------------------------------- */

/* A random (version 4) UUID, lowercase. */
static is_status uuid4(char out[MEMORY_ID_SIZE]) {
    uint8_t b[16];
    size_t got = 0;
    while (got < sizeof b) {
        ssize_t r = getrandom(b + got, sizeof b - got, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return is_error_set(IS_ERR_IO, "getrandom: %s", strerror(errno));
        }
        got += (size_t)r;
    }
    b[6] = (uint8_t)((b[6] & 0x0f) | 0x40);
    b[8] = (uint8_t)((b[8] & 0x3f) | 0x80);
    snprintf(out, MEMORY_ID_SIZE,
             "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
    return IS_OK;
}

/* Record id of a fact's KV at a version: "<id>-v<version>". */
static void record_id(const char *fact_id, int32_t version, char out[RECORD_STORE_ID_MAX + 1]) {
    /* Fact ids are made by uuid4() (36 characters): with "-v" and 10 digits
     * they stay within the record store's 64. */
    IS_ASSERT(strlen(fact_id) <= 52);
    snprintf(out, RECORD_STORE_ID_MAX + 1, "%.52s-v%d", fact_id, (int)version);
}

static is_status embed_texts(memory *m, const char *const *texts, int32_t n, float *out) {
    if (n == 0) return IS_OK;
    if (!m->dense) {
        for (int32_t i = 0; i < n; i++) out[i] = 1.0f; /* dim 1: BM25 decides */
        return IS_OK;
    }
    pthread_mutex_lock(&m->emb_mu);
    is_status st =
        m->emb ? embedder_embed(m->emb, texts, n, out) : m->embed(m->embed_ud, texts, n, out);
    pthread_mutex_unlock(&m->emb_mu);
    return st;
}

static is_status index_put(memory *m, const mem_fact *f) {
    mem_doc d = {.id = f->id,
                 .tenant = f->tenant,
                 .user = f->user,
                 .agent_id = f->agent_id,
                 .run_id = f->run_id,
                 .text = f->text,
                 .embedding = f->embedding,
                 .metadata_json = f->metadata};
    return mem_index_upsert(m->ix, &d);
}

/* Deletes a record that may or may not exist. */
static void record_drop(memory *m, const char *rid) {
    if (rid && *rid) record_store_delete(m->rs, rid);
}

/* ---- open: rebuild and reconcile --------------------------------------------------- */

/* The record files of the kv directory: id -> index into ids (the map
 * keeps pointers to ids' strings), and whether a row claims each. */
typedef struct record_files {
    strmap map;
    char **ids;
    bool *claimed;
    int64_t n, cap;
} record_files;

static void record_files_free(record_files *r) {
    strmap_free(&r->map);
    for (int64_t i = 0; i < r->n; i++) free(r->ids[i]);
    free(r->ids);
    free(r->claimed);
    memset(r, 0, sizeof *r);
}

/* Marks the record `id` claimed; false if there is no such file. */
static bool record_files_claim(record_files *r, const char *id) {
    int64_t i;
    if (!id || !strmap_get(&r->map, id, strlen(id), &i)) return false;
    r->claimed[i] = true;
    return true;
}

static is_status record_files_scan(const char *kv_dir, record_files *r) {
    memset(r, 0, sizeof *r);
    DIR *d = opendir(kv_dir);
    if (!d) return is_error_set(IS_ERR_IO, "memory: cannot list %s: %s", kv_dir, strerror(errno));
    struct dirent *de;
    is_status st = IS_OK;
    while ((de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name), ext = strlen(RECORD_EXT);
        if (len <= ext || strcmp(de->d_name + len - ext, RECORD_EXT) != 0) continue;
        if (r->n == r->cap) {
            int64_t nc = r->cap ? r->cap * 2 : 256;
            char **ni = realloc(r->ids, (size_t)nc * sizeof *ni);
            if (!ni) {
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            r->ids = ni;
            r->cap = nc;
        }
        char *id = strndup(de->d_name, len - ext);
        if (!id) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            break;
        }
        r->ids[r->n++] = id;
    }
    closedir(d);
    if (st == IS_OK && !(r->claimed = calloc((size_t)(r->n ? r->n : 1), sizeof *r->claimed)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK && (st = strmap_reserve(&r->map, (uint32_t)r->n)) == IS_OK)
        for (int64_t i = 0; i < r->n; i++) strmap_put(&r->map, r->ids[i], strlen(r->ids[i]), i);
    if (st != IS_OK) record_files_free(r);
    return st;
}

typedef struct open_scan {
    memory *m;
    record_files *files;
    int64_t n_facts, n_missing;
} open_scan;

static is_status open_row(const mem_fact *f, void *ud) {
    open_scan *o = ud;
    if (f->dim != o->m->dim)
        return is_error_set(IS_ERR_FORMAT,
                            "memory: fact %s has an embedding of %d floats, the "
                            "store's are %d",
                            f->id, (int)f->dim, (int)o->m->dim);
    is_status st = index_put(o->m, f);
    if (st == IS_OK && o->m->gpu)
        st = dense_gpu_stage(o->m->gpu, f->tenant, f->user, f->id, f->embedding);
    if (st != IS_OK) return st;
    o->n_facts++;
    if (!record_files_claim(o->files, f->kv_record)) o->n_missing++;
    return IS_OK;
}

/* ---- several nodes: changes heard from the store -------------------------------------- */

void memory_set_change_fn(memory *m, memory_change_fn fn, void *user_data) {
    pthread_mutex_lock(&m->write_mu);
    m->change = fn;
    m->change_ud = user_data;
    pthread_mutex_unlock(&m->write_mu);
}

static is_status resync_row(const mem_fact *f, void *ud) {
    memory *m = ud;
    if (f->dim == m->dim && index_put(m, f) == IS_OK && m->gpu)
        dense_gpu_put(m->gpu, f->tenant, f->user, f->id, f->embedding);
    return IS_OK;
}

/* The store's watch: another node committed a change to fact c->id. The
 * row is the truth, so it is read again and the index follows it; the KV
 * record the row named before is this node's cache of a version that is
 * gone. */
static void on_store_change(const mem_change *c, void *ud) {
    memory *m = ud;
    pthread_mutex_lock(&m->write_mu);
    if (c->op == MEM_CHANGE_RESYNC) {
        /* Changes were missed: every row again (a fact deleted meanwhile
         * may keep its index entry; searches re-read rows, so it is never
         * returned). */
        mem_store_foreach(m->store, true, resync_row, m);
        pthread_mutex_unlock(&m->write_mu);
        return;
    }
    mem_fact f;
    is_status st = mem_store_get(m->store, c->tenant, c->user, c->id, true, &f);
    if (c->old_record && (st != IS_OK || !f.kv_record || strcmp(f.kv_record, c->old_record) != 0))
        record_drop(m, c->old_record);
    if (st == IS_OK && f.dim == m->dim) {
        index_put(m, &f);
        if (m->gpu) dense_gpu_put(m->gpu, f.tenant, f.user, f.id, f.embedding);
        /* Under the lock, so that memory_set_change_fn(NULL) leaves no call running. */
        if (m->change) m->change(c->tenant, c->user, c->id, m->change_ud);
    } else if (st == IS_ERR_NOT_FOUND) {
        mem_index_remove(m->ix, c->id);
        if (m->gpu) dense_gpu_remove(m->gpu, c->tenant, c->user, c->id);
    }
    mem_fact_clear(&f);
    pthread_mutex_unlock(&m->write_mu);
}

/* Checks the store's embedding model against ours (or records ours in an
 * empty store). */
static is_status check_embed_meta(memory *m, const char *name) {
    char dim_s[32];
    snprintf(dim_s, sizeof dim_s, "%d", (int)m->dim);
    char *old_name = NULL, *old_dim = NULL;
    is_status st = mem_store_meta_get(m->store, "embed_name", &old_name);
    if (st == IS_OK) st = mem_store_meta_get(m->store, "embed_dim", &old_dim);
    if (st == IS_OK && (strcmp(old_name, name) != 0 || strcmp(old_dim, dim_s) != 0) &&
        mem_store_count(m->store) > 0) {
        st = is_error_set(IS_ERR_MISMATCH,
                          "memory: the facts in %s were embedded by '%s' (dim %s), not '%s' (dim "
                          "%s); open it with the same embedding model",
                          m->dir, old_name, old_dim, name, dim_s);
    } else if (st == IS_OK || st == IS_ERR_NOT_FOUND) {
        st = mem_store_meta_set(m->store, "embed_name", name);
        if (st == IS_OK) st = mem_store_meta_set(m->store, "embed_dim", dim_s);
    }
    free(old_name);
    free(old_dim);
    return st;
}

is_status memory_open(const char *data_dir, const memory_params *p, memory **out,
                      memory_open_report *report) {
    if (!data_dir || !*data_dir || !p || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_open: NULL argument");
    if (!p->embedder && p->embed && (p->embed_dim <= 0 || p->embed_dim > 65536))
        return is_error_set(IS_ERR_INVALID_ARG, "memory_open: embed_dim %d", (int)p->embed_dim);
    if (p->gpu_retrieval && !p->embedder)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "memory_open: GPU retrieval needs a loaded embedder "
                            "(memory_params.embedder): it copies its weights");
    memory *m = calloc(1, sizeof *m);
    if (!m) return is_error_set(IS_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&m->write_mu, NULL);
    pthread_mutex_init(&m->emb_mu, NULL);
    m->emb = p->embedder;
    m->embed = p->embed;
    m->embed_ud = p->embed_user_data;
    m->dense = m->emb || m->embed;
    m->dim = m->emb ? embedder_dim(m->emb) : m->embed ? p->embed_dim : 1;
    m->kv_window = p->kv_window;
    char name_buf[64];
    const char *name = p->embed_name;
    if (!name) {
        snprintf(name_buf, sizeof name_buf, m->dense ? "embedder:%d" : "none", (int)m->dim);
        name = name_buf;
    }
    record_files files = {0};
    is_status st = IS_ERR_NOMEM;
    size_t dl = strlen(data_dir);
    char *db_path = malloc(dl + 16);
    m->dir = strdup(data_dir);
    m->kv_dir = malloc(dl + 8);
    if (!db_path || !m->dir || !m->kv_dir) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    snprintf(db_path, dl + 16, "%s/memory.db", data_dir);
    if (p->store_url && !(free(db_path), db_path = strdup(p->store_url))) {
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
        goto fail;
    }
    snprintf(m->kv_dir, dl + 8, "%s/kv", data_dir);
    /* First, so that a missing GPU fails before anything is opened. */
    if (p->gpu_retrieval && (st = dense_gpu_create(p->embedder, p->gpu_device, &m->gpu)) != IS_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", is_error_last());
        st = is_error_set(st, "memory_open: GPU retrieval was asked for on device %d: %s",
                          (int)p->gpu_device, msg);
        goto fail;
    }
    /* The record store first: its lock makes the directory ours alone, which
     * is what makes deleting orphan records below safe. */
    if ((st = record_store_open(m->kv_dir, p->kv_cache_bytes, &m->rs)) != IS_OK) goto fail;
    if ((st = record_files_scan(m->kv_dir, &files)) != IS_OK) goto fail;
    /* A store that is gone or empty beside KV records is damage, not a new
     * directory: creating an empty store here would make every record an
     * orphan. Refuse, naming the file; `inferscale fsck` says what can be
     * rebuilt. */
    struct stat db_st, wal_st;
    char wal_path[PATH_MAX];
    snprintf(wal_path, sizeof wal_path, "%s-wal", db_path);
    bool db_gone = !p->store_url &&
                   (stat(db_path, &db_st) != 0 ||
                    (db_st.st_size == 0 && (stat(wal_path, &wal_st) != 0 || wal_st.st_size == 0)));
    if (db_gone && files.n > 0) {
        st = is_error_set(IS_ERR_IO,
                          "memory: the fact store %s is %s but %s holds %lld KV "
                          "records: refusing to start with an empty store (restore "
                          "the file, or run `inferscale fsck --data %s`)",
                          db_path, stat(db_path, &db_st) != 0 ? "missing" : "empty", m->kv_dir,
                          (long long)files.n, data_dir);
        goto fail;
    }
    if ((st = mem_store_open(db_path, &m->store)) != IS_OK) goto fail;
    if ((st = check_embed_meta(m, name)) != IS_OK) goto fail;
    int64_t n_quarantined = 0;
    if ((st = mem_store_quarantine_bad_rows(m->store, m->dim, &n_quarantined)) != IS_OK) goto fail;
    /* A store that never recorded anything cannot own records. A batch
     * writes its records before its rows, so the store notes that writes
     * began (meta "writes_begun") before the first records: a crash during
     * the very first batch leaves that note beside its records. */
    char *begun = NULL;
    m->wrote_before = mem_store_count(m->store) > 0 || mem_store_count_history(m->store) > 0 ||
                      (mem_store_meta_get(m->store, "writes_begun", &begun) == IS_OK && begun);
    free(begun);
    is_error_clear();
    if (files.n > 1 && !m->wrote_before) {
        st = is_error_set(IS_ERR_IO,
                          "memory: the fact store %s has no facts and no history but "
                          "%s holds %lld KV records: refusing to start (restore the "
                          "file, or run `inferscale fsck --data %s`)",
                          db_path, m->kv_dir, (long long)files.n, data_dir);
        goto fail;
    }
    if ((st = mem_index_create(m->dim, &m->ix)) != IS_OK) goto fail;
    open_scan o = {.m = m, .files = &files};
    /* Other nodes' changes are heard from before the scan on; the writer
     * lock holds them until the scan is done, and applying one the scan
     * already saw changes nothing (each re-reads its row). */
    pthread_mutex_lock(&m->write_mu);
    is_status ws = mem_store_watch(m->store, on_store_change, m);
    if (ws != IS_OK && ws != IS_ERR_UNSUPPORTED) {
        pthread_mutex_unlock(&m->write_mu);
        st = ws;
        goto fail;
    }
    st = mem_store_foreach(m->store, true, open_row, &o);
    pthread_mutex_unlock(&m->write_mu);
    if (st != IS_OK) goto fail;
    if (m->gpu && (st = dense_gpu_flush(m->gpu)) != IS_OK) goto fail;
    int64_t n_orphans = 0;
    for (int64_t i = 0; i < files.n; i++) {
        if (files.claimed[i]) continue;
        /* Set aside, not deleted: a record no row points to is what a crash
         * leaves, but also what a damaged store makes of every record. */
        is_status ds = record_store_set_aside(m->rs, files.ids[i]);
        if (ds != IS_OK && ds != IS_ERR_NOT_FOUND) {
            st = ds;
            goto fail;
        }
        n_orphans++;
    }
    record_files_free(&files);
    free(db_path);
    if (report) {
        *report = (memory_open_report){o.n_facts, n_orphans, o.n_missing, n_quarantined, ""};
        snprintf(report->repairs, sizeof report->repairs, "%s", mem_store_repairs(m->store));
    }
    *out = m;
    return IS_OK;
fail:
    record_files_free(&files);
    free(db_path);
    memory_close(m);
    return st;
}

void memory_close(memory *m) {
    if (!m) return;
    mem_store_close(m->store); /* first: it ends the watch, which uses the rest */
    dense_gpu_free(m->gpu);
    mem_index_free(m->ix);
    if (m->rs) record_store_close(m->rs);
    pthread_mutex_destroy(&m->write_mu);
    pthread_mutex_destroy(&m->emb_mu);
    free(m->dir);
    free(m->kv_dir);
    free(m);
}

/* ---- add ------------------------------------------------------------------------ */

/* A request checked and made ready to write (metadata canonical). */
typedef struct add_prep {
    const memory_add_req *r;
    char *metadata;
    int32_t window;
    const char *const *context; /* the turns kept: the last `window` of r's */
    int32_t n_context;
} add_prep;

static is_status add_check(memory *m, const memory_add_req *r, add_prep *p) {
    memset(p, 0, sizeof *p);
    if (!r || !r->tenant || !*r->tenant || !r->user || !*r->user)
        return is_error_set(IS_ERR_INVALID_ARG, "memory: a fact needs a tenant and a user_id");
    if (!r->text || !*r->text)
        return is_error_set(IS_ERR_INVALID_ARG, "memory: a fact needs a non-empty text");
    if (!utf8_valid(r->text, strlen(r->text)))
        return is_error_set(IS_ERR_INVALID_ARG, "memory: text is not valid UTF-8");
    if (r->n_context < 0 || (r->n_context > 0 && !r->context))
        return is_error_set(IS_ERR_INVALID_ARG, "memory: bad context");
    for (int32_t i = 0; i < r->n_context; i++)
        if (!r->context[i] || !utf8_valid(r->context[i], strlen(r->context[i])))
            return is_error_set(IS_ERR_INVALID_ARG, "memory: context turn %d is NULL or not UTF-8",
                                (int)i);
    p->r = r;
    p->window = r->window == MEMORY_WINDOW_DEFAULT ? m->kv_window : r->window;
    if (p->window < -1 || p->window > MEMORY_MAX_CONTEXT)
        return is_error_set(IS_ERR_INVALID_ARG, "memory: window %d (-1..%d)", (int)p->window,
                            MEMORY_MAX_CONTEXT);
    int32_t keep = p->window < 0 ? 0 : (p->window < r->n_context ? p->window : r->n_context);
    p->context = r->context ? r->context + (r->n_context - keep) : NULL;
    p->n_context = keep;
    return mem_metadata_canonical(r->metadata_json, &p->metadata);
}

/* Writes checked facts p[0..n) with their embeddings emb[0..n): each one
 * encoded (its record durable first), then every row in one transaction
 * (a group commit: one durable commit for the batch, and a crash leaves
 * the whole batch or none of it, never part of a fact), then indexed.
 * Takes the writer lock. status[i] and id_out[i] (may be NULL) per fact. */
static void add_write_many(memory *m, const add_prep *const *p, const float *const *emb, int32_t n,
                           char *const *id_out, is_status *status) {
    mem_fact *f = calloc((size_t)n, sizeof *f);
    char(*rid)[RECORD_STORE_ID_MAX + 1] = calloc((size_t)n, sizeof *rid);
    is_status *sst = calloc((size_t)n, sizeof *sst);
    int32_t *at = calloc((size_t)n, sizeof *at); /* the request of each row */
    if (!f || !rid || !sst || !at) {
        is_status st = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; i < n; i++) status[i] = st;
        goto out;
    }
    pthread_mutex_lock(&m->write_mu);
    if (!m->wrote_before && m->encode) {
        is_status st = mem_store_meta_set(m->store, "writes_begun", "1");
        if (st != IS_OK) {
            pthread_mutex_unlock(&m->write_mu);
            for (int32_t i = 0; i < n; i++) status[i] = st;
            goto out;
        }
        m->wrote_before = true;
    }
    int32_t nf = 0;
    for (int32_t i = 0; i < n; i++) {
        const memory_add_req *r = p[i]->r;
        mem_fact *x = &f[nf];
        is_status st = uuid4(x->id);
        if (st != IS_OK) {
            status[i] = st;
            continue;
        }
        /* Borrowed pointers: the rows are never cleared. */
        x->tenant = (char *)r->tenant;
        x->user = (char *)r->user;
        x->agent_id = (char *)r->agent_id;
        x->run_id = (char *)r->run_id;
        x->text = (char *)r->text;
        x->metadata = p[i]->metadata;
        x->source = (char *)r->source;
        mem_text_hash_hex(r->text, x->hash);
        x->embedding = (float *)emb[i];
        x->dim = m->dim;
        x->context = (char **)p[i]->context;
        x->n_context = p[i]->n_context;
        x->kv_window = p[i]->window;
        x->version = 1;
        step(m, MEMORY_STEP_EMBEDDED);
        if (m->encode) {
            record_id(x->id, x->version, rid[nf]);
            memory_encode_job job = {rid[nf], r->text, p[i]->context, p[i]->n_context,
                                     p[i]->window};
            if ((st = m->encode(m->encode_ud, m->rs, &job)) != IS_OK) {
                record_drop(m, rid[nf]); /* a put can fail after its rename */
                status[i] = st;
                continue;
            }
            x->kv_record = rid[nf];
            step(m, MEMORY_STEP_KV_WRITTEN);
        }
        at[nf++] = i;
    }
    if (nf > 0) mem_store_insert_many(m->store, f, nf, sst);
    for (int32_t j = 0; j < nf; j++) {
        int32_t i = at[j];
        is_status st = sst[j];
        if (st != IS_OK) {
            record_drop(m, rid[j]);
        } else {
            step(m, MEMORY_STEP_COMMITTED);
            if ((st = index_put(m, &f[j])) != IS_OK) {
                /* Only out of memory gets here (the fact was checked): undo. */
                mem_store_delete(m->store, f[j].tenant, f[j].user, f[j].id, NULL);
                record_drop(m, rid[j]);
            } else if (m->gpu && (st = dense_gpu_put(m->gpu, f[j].tenant, f[j].user, f[j].id,
                                                     emb[i])) != IS_OK) {
                /* Device memory or a device failure: undo as above. */
                mem_index_remove(m->ix, f[j].id);
                mem_store_delete(m->store, f[j].tenant, f[j].user, f[j].id, NULL);
                record_drop(m, rid[j]);
            } else if (id_out && id_out[i]) {
                snprintf(id_out[i], MEMORY_ID_SIZE, "%s", f[j].id);
            }
        }
        status[i] = st;
    }
    pthread_mutex_unlock(&m->write_mu);
out:
    free(f);
    free(rid);
    free(sst);
    free(at);
}

is_status memory_add(memory *m, const memory_add_req *r, char id_out[MEMORY_ID_SIZE]) {
    return memory_add_batch(m, r, 1, (char(*)[MEMORY_ID_SIZE])id_out, NULL);
}

is_status memory_add_batch(memory *m, const memory_add_req *r, int32_t n,
                           char (*ids)[MEMORY_ID_SIZE], is_status *status) {
    if (n < 0 || (n > 0 && !r)) return is_error_set(IS_ERR_INVALID_ARG, "memory_add_batch: bad n");
    if (n == 0) return IS_OK;
    add_prep *p = calloc((size_t)n, sizeof *p);
    const char **texts = calloc((size_t)n, sizeof *texts);
    int32_t *slot = calloc((size_t)n, sizeof *slot); /* row of each valid fact in emb */
    float *emb = NULL;
    is_status first = IS_OK;
    if (!p || !texts || !slot) {
        first = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; status && i < n; i++) status[i] = first;
        goto out;
    }
    int32_t nv = 0;
    for (int32_t i = 0; i < n; i++) {
        is_status st = add_check(m, &r[i], &p[i]);
        if (status) status[i] = st;
        if (st != IS_OK) {
            if (first == IS_OK) first = st;
            slot[i] = -1;
            continue;
        }
        slot[i] = nv;
        texts[nv++] = r[i].text;
    }
    emb = malloc((size_t)(nv ? nv : 1) * (size_t)m->dim * sizeof(float));
    is_status est =
        emb ? embed_texts(m, texts, nv, emb) : is_error_set(IS_ERR_NOMEM, "out of memory");
    /* The valid facts, written together: one group commit of their rows. */
    const add_prep **vp = calloc((size_t)(nv ? nv : 1), sizeof *vp);
    const float **ve = calloc((size_t)(nv ? nv : 1), sizeof *ve);
    char **vid = calloc((size_t)(nv ? nv : 1), sizeof *vid);
    is_status *vst = calloc((size_t)(nv ? nv : 1), sizeof *vst);
    if (est == IS_OK && (!vp || !ve || !vid || !vst))
        est = is_error_set(IS_ERR_NOMEM, "out of memory");
    if (est == IS_OK) {
        for (int32_t i = 0; i < n; i++) {
            if (slot[i] < 0) continue;
            vp[slot[i]] = &p[i];
            ve[slot[i]] = emb + (size_t)slot[i] * m->dim;
            vid[slot[i]] = ids ? ids[i] : NULL;
        }
        if (nv > 0) add_write_many(m, vp, ve, nv, vid, vst);
    }
    for (int32_t i = 0; i < n; i++) {
        if (slot[i] < 0) continue;
        is_status st = est != IS_OK ? est : vst[slot[i]];
        if (status) status[i] = st;
        if (st != IS_OK && first == IS_OK) first = st;
    }
    free(vp);
    free(ve);
    free(vid);
    free(vst);
out:
    for (int32_t i = 0; p && i < n; i++) free(p[i].metadata);
    free(p);
    free(texts);
    free(slot);
    free(emb);
    return first;
}

/* ---- update / delete ---------------------------------------------------------------- */

is_status memory_update(memory *m, const char *tenant, const char *user, const char *id,
                        const char *text, const char *metadata_json) {
    if (!tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_update: needs tenant, user and id");
    if (text && (!*text || !utf8_valid(text, strlen(text))))
        return is_error_set(IS_ERR_INVALID_ARG, "memory_update: text is empty or not valid UTF-8");
    char *meta = NULL;
    bool meta_given = metadata_json != NULL;
    is_status st = mem_metadata_canonical(metadata_json, &meta);
    if (st != IS_OK) return st;
    if (meta && strcmp(meta, "{}") == 0) {
        free(meta);
        meta = NULL;
    }
    float *emb = NULL;
    mem_fact old = {0};
    char rid[RECORD_STORE_ID_MAX + 1] = "";
    pthread_mutex_lock(&m->write_mu);
    if ((st = mem_store_get(m->store, tenant, user, id, true, &old)) != IS_OK) goto out;
    bool text_changed = text && strcmp(text, old.text) != 0;
    mem_fact nf = old; /* shallow: old keeps ownership */
    nf.version = old.version + 1;
    if (meta_given) nf.metadata = meta;
    if (text_changed) {
        if (!(emb = malloc((size_t)m->dim * sizeof(float)))) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            goto out;
        }
        if ((st = embed_texts(m, &text, 1, emb)) != IS_OK) goto out;
        nf.text = (char *)text;
        nf.embedding = emb;
        mem_text_hash_hex(text, nf.hash);
        /* The old record describes the old text: a new one, or none. */
        nf.kv_record = NULL;
    }
    step(m, MEMORY_STEP_EMBEDDED);
    if (text_changed && m->encode) {
        record_id(id, nf.version, rid);
        memory_encode_job job = {rid, text, (const char *const *)old.context, old.n_context,
                                 old.kv_window};
        if ((st = m->encode(m->encode_ud, m->rs, &job)) != IS_OK) {
            record_drop(m, rid);
            goto out;
        }
        nf.kv_record = rid;
        step(m, MEMORY_STEP_KV_WRITTEN);
    }
    if ((st = mem_store_update(m->store, &nf, old.version)) != IS_OK) {
        record_drop(m, rid);
        goto out;
    }
    step(m, MEMORY_STEP_COMMITTED);
    if (text_changed && old.kv_record) {
        record_drop(m, old.kv_record);
        step(m, MEMORY_STEP_KV_DELETED);
    }
    /* Cannot fail for a fact that was indexed before but for memory. */
    st = index_put(m, &nf);
    if (st == IS_OK && text_changed && m->gpu) st = dense_gpu_put(m->gpu, tenant, user, id, emb);
out:
    pthread_mutex_unlock(&m->write_mu);
    mem_fact_clear(&old);
    free(emb);
    free(meta);
    return st;
}

is_status memory_delete(memory *m, const char *tenant, const char *user, const char *id) {
    mem_fact old;
    pthread_mutex_lock(&m->write_mu);
    is_status st = mem_store_delete(m->store, tenant, user, id, &old);
    if (st == IS_OK) {
        step(m, MEMORY_STEP_COMMITTED);
        if (old.kv_record) {
            record_drop(m, old.kv_record);
            step(m, MEMORY_STEP_KV_DELETED);
        }
        mem_index_remove(m->ix, old.id);
        is_status gs = m->gpu ? dense_gpu_remove(m->gpu, old.tenant, old.user, old.id) : IS_OK;
        if (gs != IS_OK && gs != IS_ERR_NOT_FOUND) st = gs;
        mem_fact_clear(&old);
    }
    pthread_mutex_unlock(&m->write_mu);
    return st;
}

is_status memory_delete_all(memory *m, const mem_filter *f, int32_t *n_deleted) {
    mem_fact *rows = NULL;
    int32_t n = 0;
    pthread_mutex_lock(&m->write_mu);
    is_status st = mem_store_delete_all(m->store, f, &rows, &n);
    if (st == IS_OK) {
        step(m, MEMORY_STEP_COMMITTED);
        for (int32_t i = 0; i < n; i++) record_drop(m, rows[i].kv_record);
        if (n) step(m, MEMORY_STEP_KV_DELETED);
        for (int32_t i = 0; i < n; i++) {
            mem_index_remove(m->ix, rows[i].id);
            is_status gs =
                m->gpu ? dense_gpu_remove(m->gpu, rows[i].tenant, rows[i].user, rows[i].id) : IS_OK;
            if (gs != IS_OK && gs != IS_ERR_NOT_FOUND && st == IS_OK) st = gs;
        }
        if (n_deleted) *n_deleted = n;
    }
    pthread_mutex_unlock(&m->write_mu);
    mem_facts_free(rows, n);
    return st;
}

/* ---- missing KV --------------------------------------------------------------------- */

typedef struct missing_scan {
    memory *m;
    memory_fact_ref *keys;
    int64_t n, cap;
} missing_scan;

static is_status missing_row(const mem_fact *f, void *ud) {
    missing_scan *s = ud;
    if (f->kv_record && record_store_contains(s->m->rs, f->kv_record)) return IS_OK;
    if (s->n == s->cap) {
        int64_t nc = s->cap ? s->cap * 2 : 64;
        memory_fact_ref *nk = realloc(s->keys, (size_t)nc * sizeof *nk);
        if (!nk) return is_error_set(IS_ERR_NOMEM, "out of memory");
        s->keys = nk;
        s->cap = nc;
    }
    memory_fact_ref *k = &s->keys[s->n];
    snprintf(k->id, sizeof k->id, "%s", f->id);
    k->tenant = strdup(f->tenant);
    k->user = strdup(f->user);
    if (!k->tenant || !k->user) {
        free(k->tenant);
        free(k->user);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    s->n++;
    return IS_OK;
}

void memory_fact_refs_free(memory_fact_ref *r, int64_t n) {
    for (int64_t i = 0; r && i < n; i++) {
        free(r[i].tenant);
        free(r[i].user);
    }
    free(r);
}

is_status memory_list_missing(memory *m, memory_fact_ref **out, int64_t *n) {
    if (!m || !out || !n)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_list_missing: NULL argument");
    missing_scan s = {.m = m};
    is_status st = mem_store_foreach(m->store, false, missing_row, &s);
    if (st != IS_OK) {
        memory_fact_refs_free(s.keys, s.n);
        return st;
    }
    *out = s.keys;
    *n = s.n;
    return IS_OK;
}

/* Encodes the KV record of row f, which has none, and makes the row point
 * to it. Called with the writer lock held, so the row cannot change
 * between the read and the commit; the commit is still conditional on
 * f's version (mem_store_set_kv), the same rule as everywhere else. */
static is_status encode_row(memory *m, const mem_fact *f, memory_encode_fn fn, void *ud) {
    char rid[RECORD_STORE_ID_MAX + 1];
    /* A row naming a record that is gone gets it back under that name;
     * otherwise a new record, then the row points to it. */
    if (f->kv_record) snprintf(rid, sizeof rid, "%s", f->kv_record);
    else record_id(f->id, f->version, rid);
    memory_encode_job job = {rid, f->text, (const char *const *)f->context, f->n_context,
                             f->kv_window};
    is_status st = fn(ud, m->rs, &job);
    if (st == IS_OK) step(m, MEMORY_STEP_KV_WRITTEN);
    if (st == IS_OK && !f->kv_record) st = mem_store_set_kv(m->store, f->id, f->version, rid);
    if (st != IS_OK) record_drop(m, f->kv_record ? NULL : rid);
    return st;
}

is_status memory_encode_missing(memory *m, memory_progress_fn progress, void *ud,
                                int64_t *n_encoded) {
    pthread_mutex_lock(&m->write_mu);
    int64_t done = 0;
    missing_scan s = {.m = m};
    is_status st = m->encode ? IS_OK
                             : is_error_set(IS_ERR_INVALID_ARG,
                                            "memory: no KV encoder set (a model is needed)");
    if (st == IS_OK) st = mem_store_foreach(m->store, false, missing_row, &s);
    for (int64_t i = 0; st == IS_OK && i < s.n; i++) {
        mem_fact f;
        if ((st = mem_store_get(m->store, s.keys[i].tenant, s.keys[i].user, s.keys[i].id, false,
                                &f)) != IS_OK)
            break;
        st = encode_row(m, &f, m->encode, m->encode_ud);
        mem_fact_clear(&f);
        if (st != IS_OK) break;
        done++;
        if (progress) progress(done, s.n, ud);
    }
    memory_fact_refs_free(s.keys, s.n);
    pthread_mutex_unlock(&m->write_mu);
    if (n_encoded) *n_encoded = done;
    return st;
}

is_status memory_encode_one(memory *m, const char *tenant, const char *user, const char *id,
                            memory_encode_fn fn, void *ud, bool *encoded) {
    if (encoded) *encoded = false;
    if (!m || !tenant || !user || !id)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_encode_one: needs tenant, user and id");
    pthread_mutex_lock(&m->write_mu);
    if (!fn) {
        fn = m->encode;
        ud = m->encode_ud;
    }
    mem_fact f = {0};
    is_status st = fn ? IS_OK
                      : is_error_set(IS_ERR_INVALID_ARG,
                                     "memory: no KV encoder given or set (a model is needed)");
    /* Read under the lock: an update or delete queued before us is seen,
     * one after us waits for our commit. */
    if (st == IS_OK) st = mem_store_get(m->store, tenant, user, id, false, &f);
    if (st == IS_OK && !(f.kv_record && record_store_contains(m->rs, f.kv_record))) {
        st = encode_row(m, &f, fn, ud);
        if (st == IS_OK && encoded) *encoded = true;
    }
    mem_fact_clear(&f);
    pthread_mutex_unlock(&m->write_mu);
    return st;
}

static bool same_str(const char *a, const char *b) {
    return a == b || (a && b && strcmp(a, b) == 0);
}

/* Whether two refs name one fact. */
static bool same_ref(const memory_fact_ref *a, const memory_fact_ref *b) {
    return strcmp(a->id, b->id) == 0 && same_str(a->tenant, b->tenant) &&
           same_str(a->user, b->user);
}

/* The row of f, changed since it was read (its version moved on), gets the
 * record rid encoded from f's text if it still has that text (and so the
 * same context and window: updates change only text and metadata) and no
 * record: a metadata update during the forward leaves the record good, and
 * nothing queues the fact again. The writer lock is held. */
static is_status set_kv_same_text(memory *m, const mem_fact *f, const char *rid) {
    mem_fact now;
    is_status st = mem_store_get(m->store, f->tenant, f->user, f->id, false, &now);
    if (st != IS_OK) return st;
    if (now.kv_record || strcmp(now.text, f->text) != 0)
        st = is_error_set(IS_ERR_NOT_FOUND, "memory: fact %s changed while encoded", f->id);
    else st = mem_store_set_kv(m->store, now.id, now.version, rid);
    mem_fact_clear(&now);
    return st;
}

/* A memory_encode_batch call's record ids, while it runs (m->encoding). */
typedef struct encode_batch_reg {
    char (*rid)[RECORD_STORE_ID_MAX + 1];
    int32_t n;
    struct encode_batch_reg *next;
} encode_batch_reg;

/* Drops the record rid that the batch self wrote, or began to, for the
 * fact f and could not name in its row (write_mu held): unless another
 * batch is writing that id too (it names or drops it at its own commit)
 * or, with unless_named, the row names it now (another batch's, which got
 * there first). */
static void record_drop_unclaimed(memory *m, const encode_batch_reg *self, const mem_fact *f,
                                  const char *rid, bool unless_named) {
    for (const encode_batch_reg *r = m->encoding; r; r = r->next)
        for (int32_t j = 0; r != self && j < r->n; j++)
            if (strcmp(r->rid[j], rid) == 0) return;
    mem_fact now;
    if (unless_named && mem_store_get(m->store, f->tenant, f->user, f->id, false, &now) == IS_OK) {
        bool named = now.kv_record && strcmp(now.kv_record, rid) == 0;
        mem_fact_clear(&now);
        if (named) return;
    }
    record_drop(m, rid);
}

is_status memory_encode_batch(memory *m, const memory_fact_ref *refs, int32_t n,
                              memory_encode_batch_fn fn, void *ud, is_status *status,
                              bool *encoded) {
    if (!m || n < 0 || (n > 0 && (!refs || !fn || !status || !encoded)))
        return is_error_set(IS_ERR_INVALID_ARG, "memory_encode_batch: NULL argument");
    if (n == 0) return IS_OK;
    mem_fact *f = calloc((size_t)n, sizeof *f);
    memory_encode_job *jobs = calloc((size_t)n, sizeof *jobs);
    int32_t *row = calloc((size_t)n, sizeof *row); /* the fact of each job */
    char(*rid)[RECORD_STORE_ID_MAX + 1] = calloc((size_t)n, sizeof *rid);
    is_status *jst = calloc((size_t)n, sizeof *jst), *set_st = calloc((size_t)n, sizeof *set_st);
    mem_store_kv_set *sets = calloc((size_t)n, sizeof *sets);
    int32_t *same_as = calloc((size_t)n, sizeof *same_as); /* an earlier ref of the fact, or -1 */
    if (!f || !jobs || !row || !rid || !jst || !set_st || !sets || !same_as) {
        free(f), free(jobs), free(row), free(rid), free(jst), free(set_st), free(sets);
        free(same_as);
        is_status st = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; i < n; i++) status[i] = st, encoded[i] = false;
        return st;
    }
    /* Read the rows; facts deleted meanwhile or encoded already drop out. */
    int32_t nj = 0;
    pthread_mutex_lock(&m->write_mu);
    for (int32_t i = 0; i < n; i++) {
        encoded[i] = false;
        /* A fact queued twice (an add's job and an update's) is one job:
         * two would write one record id twice, and the cleanup of a copy
         * that failed would delete the record the other's row then names. */
        same_as[i] = -1;
        for (int32_t p = 0; p < i && same_as[i] < 0; p++)
            if (same_ref(&refs[p], &refs[i])) same_as[i] = p;
        if (same_as[i] >= 0) continue;
        status[i] = mem_store_get(m->store, refs[i].tenant, refs[i].user, refs[i].id, false, &f[i]);
        if (status[i] != IS_OK) continue;
        if (f[i].kv_record && record_store_contains(m->rs, f[i].kv_record)) continue;
        /* A row naming a record that is gone gets it back under that name. */
        if (f[i].kv_record) snprintf(rid[nj], sizeof rid[nj], "%s", f[i].kv_record);
        else record_id(f[i].id, f[i].version, rid[nj]);
        jobs[nj] = (memory_encode_job){rid[nj], f[i].text, (const char *const *)f[i].context,
                                       f[i].n_context, f[i].kv_window};
        row[nj++] = i;
    }
    encode_batch_reg reg = {rid, nj, m->encoding};
    m->encoding = &reg;
    pthread_mutex_unlock(&m->write_mu);

    /* Pinned until the rows name them: under a disk cap, the group commit
     * of a later forward of this batch (or any put) would otherwise evict a
     * record written by an earlier one before its row points to it. */
    for (int32_t j = 0; j < nj; j++) record_store_pin(m->rs, rid[j]);
    /* The forward runs without the lock: writes of other facts go on. */
    if (nj > 0) fn(ud, m->rs, jobs, nj, jst);

    pthread_mutex_lock(&m->write_mu);
    /* The rows that get their new record, in one transaction (a group
     * commit), each conditional on the version read: a delete or a text
     * update since then wins, and the record it never named goes (a row
     * whose version moved on with its text unchanged is set again). */
    int32_t ns = 0;
    for (int32_t j = 0; j < nj; j++) {
        int32_t i = row[j];
        if (jst[j] == IS_OK && !f[i].kv_record)
            sets[ns++] = (mem_store_kv_set){f[i].id, f[i].version, rid[j]};
    }
    if (ns > 0) mem_store_set_kv_many(m->store, sets, ns, set_st);
    ns = 0;
    for (int32_t j = 0; j < nj; j++) {
        int32_t i = row[j];
        is_status st = jst[j];
        if (st != IS_OK) {
            /* A put can fail after its rename. */
            if (!f[i].kv_record) record_drop_unclaimed(m, &reg, &f[i], rid[j], true);
            status[i] = st;
            continue;
        }
        step(m, MEMORY_STEP_KV_WRITTEN);
        if (!f[i].kv_record) {
            st = set_st[ns++];
            if (st == IS_ERR_NOT_FOUND) st = set_kv_same_text(m, &f[i], rid[j]);
            if (st != IS_OK) record_drop_unclaimed(m, &reg, &f[i], rid[j], true);
        } else {
            /* Named by the row still, for the text it was encoded from (a
             * metadata update meanwhile changes neither). */
            mem_fact now;
            st = mem_store_get(m->store, f[i].tenant, f[i].user, f[i].id, false, &now);
            bool same = st == IS_OK && now.kv_record && strcmp(now.kv_record, rid[j]) == 0 &&
                        strcmp(now.text, f[i].text) == 0;
            if (st == IS_OK) mem_fact_clear(&now);
            if (!same) {
                record_drop_unclaimed(m, &reg, &f[i], rid[j], false);
                st = is_error_set(IS_ERR_NOT_FOUND, "memory: fact %s changed while encoded",
                                  f[i].id);
            }
        }
        status[i] = st;
        encoded[i] = st == IS_OK;
    }
    for (encode_batch_reg **r = &m->encoding; *r; r = &(*r)->next)
        if (*r == &reg) {
            *r = reg.next;
            break;
        }
    pthread_mutex_unlock(&m->write_mu);
    for (int32_t j = 0; j < nj; j++) record_store_unpin(m->rs, rid[j]);
    /* A copy gets its fact's outcome; the fact was encoded once. */
    for (int32_t i = 0; i < n; i++)
        if (same_as[i] >= 0) status[i] = status[same_as[i]], encoded[i] = false;
    is_status first = IS_OK;
    for (int32_t i = 0; i < n; i++) {
        if (first == IS_OK && status[i] != IS_OK && status[i] != IS_ERR_NOT_FOUND)
            first = status[i];
        if (f[i].tenant) mem_fact_clear(&f[i]);
    }
    free(f), free(jobs), free(row), free(rid), free(jst), free(set_st), free(sets);
    free(same_as);
    return first;
}

/* ---- reads ----------------------------------------------------------------------- */

is_status memory_get(memory *m, const char *tenant, const char *user, const char *id,
                     mem_fact *out) {
    return mem_store_get(m->store, tenant, user, id, false, out);
}

is_status memory_get_all(memory *m, const mem_filter *f, mem_fact **out, int32_t *n) {
    return mem_store_list(m->store, f, false, out, n);
}

is_status memory_history(memory *m, const char *tenant, const char *user, const char *id,
                         mem_history **out, int32_t *n) {
    return mem_store_history(m->store, tenant, user, id, out, n);
}

is_status memory_find_source(memory *m, const char *tenant, const char *user, const char *source,
                             const char *text, char id_out[MEMORY_ID_SIZE]) {
    if (!tenant || !user || !source || !text)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_find_source: NULL argument");
    char hash[17], id[MEM_ID_MAX + 1];
    mem_text_hash_hex(text, hash);
    is_status st = mem_store_find_source(m->store, tenant, user, source, hash, id);
    if (st == IS_OK && id_out) snprintf(id_out, MEMORY_ID_SIZE, "%s", id);
    return st;
}

void memory_hits_free(memory_hit *h, int32_t n) {
    if (!h) return;
    for (int32_t i = 0; i < n; i++) mem_fact_clear(&h[i].fact);
    free(h);
}

is_status memory_search(memory *m, const mem_filter *f, const char *query, int32_t k,
                        memory_hit **out, int32_t *n_out) {
    return memory_search_mode(m, f, query, k, MEM_SEARCH_HYBRID, out, n_out);
}

bool memory_gpu_stats(memory *m, dense_gpu_stats *out) {
    if (!m->gpu) {
        memset(out, 0, sizeof *out);
        return false;
    }
    dense_gpu_get_stats(m->gpu, out);
    return true;
}

is_status memory_search_mode(memory *m, const mem_filter *f, const char *query, int32_t k,
                             mem_search_mode mode, memory_hit **out, int32_t *n_out) {
    if (!f || !f->tenant || !f->user || !query || !*query || k < 0 || !out || !n_out)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "memory_search: needs tenant, user, a non-empty query and k >= 0");
    if (mode != MEM_SEARCH_DENSE && mode != MEM_SEARCH_BM25 && mode != MEM_SEARCH_HYBRID)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_search: mode %d", (int)mode);
    if (mode == MEM_SEARCH_DENSE && !m->dense)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_search: dense search needs an embedder");
    if (!m->dense) mode = MEM_SEARCH_BM25;
    float *qv = malloc((size_t)m->dim * sizeof(float));
    mem_hit *hits = malloc((size_t)(k ? k : 1) * sizeof *hits);
    memory_hit *res = calloc((size_t)(k ? k : 1), sizeof *res);
    int32_t nh = 0, n = 0;
    bool on_gpu = false;
    is_status st = qv && hits && res ? IS_OK : is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st == IS_OK && k > 0 && m->gpu)
        st = dense_gpu_search(m->gpu, m->ix, f, query, k, mode, hits, &nh, &on_gpu);
    if (st == IS_OK && !on_gpu && mode != MEM_SEARCH_BM25) st = embed_texts(m, &query, 1, qv);
    if (st == IS_OK && !on_gpu && k > 0)
        st = mem_index_search(m->ix, f, mode != MEM_SEARCH_BM25 ? qv : NULL, query, k, mode, hits,
                              &nh);
    /* The rows are the truth (another node may have changed them): all the
     * hits' rows in one read. */
    const char **hid = st == IS_OK && nh > 0 ? malloc((size_t)nh * sizeof *hid) : NULL;
    bool *found = hid ? malloc((size_t)nh * sizeof *found) : NULL;
    mem_fact *rows = found ? calloc((size_t)nh, sizeof *rows) : NULL;
    if (st == IS_OK && nh > 0 && !rows) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == IS_OK && i < nh; i++) hid[i] = hits[i].id;
    if (st == IS_OK && nh > 0)
        st = mem_store_get_many(m->store, f->tenant, f->user, hid, nh, rows, found);
    for (int32_t i = 0; st == IS_OK && i < nh; i++) {
        if (!found[i]) continue; /* deleted since the search */
        res[n].fact = rows[i];
        res[n].score = hits[i].score;
        res[n].dense = hits[i].dense;
        res[n].bm25 = hits[i].bm25;
        n++;
    }
    free(hid);
    free(found);
    free(rows);
    free(qv);
    free(hits);
    if (st != IS_OK) {
        memory_hits_free(res, n);
        return st;
    }
    *out = res;
    *n_out = n;
    return IS_OK;
}

/* ---- invariant checker ------------------------------------------------------------- */

typedef struct check_scan {
    memory *m;
    bool require_kv;
    mem_fact *rows; /* copies, without embeddings */
    int64_t n, cap;
    record_files *files;
} check_scan;

static is_status check_row(const mem_fact *f, void *ud) {
    check_scan *c = ud;
    memory *m = c->m;
    char hash[17];
    mem_text_hash_hex(f->text, hash);
    if (f->dim != m->dim || !f->embedding)
        return is_error_set(IS_ERR_INTERNAL, "check: fact %s has an embedding of %d floats", f->id,
                            (int)f->dim);
    if (strcmp(hash, f->hash) != 0)
        return is_error_set(IS_ERR_INTERNAL, "check: fact %s: hash %s is not its text's %s", f->id,
                            f->hash, hash);
    bool has_kv = f->kv_record && record_store_contains(m->rs, f->kv_record);
    if (!has_kv && c->require_kv)
        return is_error_set(IS_ERR_INTERNAL, "check: fact %s has no KV record (%s)", f->id,
                            f->kv_record ? f->kv_record : "none named");
    if (has_kv) {
        const fact_kv *kv = NULL;
        is_status st = record_store_get(m->rs, f->kv_record, NULL, &kv);
        if (st != IS_OK)
            return is_error_set(IS_ERR_INTERNAL, "check: fact %s: KV record %s: %s", f->id,
                                f->kv_record, is_error_last());
        bool same = kv->meta.text_hash == fact_text_hash(f->text, strlen(f->text));
        record_store_release(m->rs, kv);
        if (!same)
            return is_error_set(IS_ERR_INTERNAL,
                                "check: fact %s: record %s was made for another "
                                "text",
                                f->id, f->kv_record);
    }
    /* Named, so not an orphan, even if made for another model (encoded
     * again when needed). */
    if (f->kv_record) record_files_claim(c->files, f->kv_record);
    if (c->n == c->cap) {
        int64_t nc = c->cap ? c->cap * 2 : 64;
        mem_fact *nr = realloc(c->rows, (size_t)nc * sizeof *nr);
        if (!nr) return is_error_set(IS_ERR_NOMEM, "out of memory");
        c->rows = nr;
        c->cap = nc;
    }
    mem_fact *r = &c->rows[c->n++];
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", f->id);
    r->tenant = strdup(f->tenant);
    r->user = strdup(f->user);
    r->embedding = malloc((size_t)m->dim * sizeof(float));
    if (!r->tenant || !r->user || !r->embedding) return is_error_set(IS_ERR_NOMEM, "out of memory");
    memcpy(r->embedding, f->embedding, (size_t)m->dim * sizeof(float));
    r->dim = m->dim;
    return IS_OK;
}

static int cmp_rows(const void *a, const void *b) {
    const mem_fact *x = a, *y = b;
    int c = strcmp(x->tenant, y->tenant);
    if (!c) c = strcmp(x->user, y->user);
    if (!c) c = strcmp(x->id, y->id);
    return c;
}

static int cmp_hits(const void *a, const void *b) {
    return strcmp(((const mem_hit *)a)->id, ((const mem_hit *)b)->id);
}

is_status memory_check(memory *m, bool require_kv) {
    pthread_mutex_lock(&m->write_mu);
    record_files files = {0};
    check_scan c = {.m = m, .require_kv = require_kv, .files = &files};
    mem_hit *hits = NULL;
    is_status st = record_files_scan(m->kv_dir, &files);
    if (st == IS_OK) st = mem_store_foreach(m->store, true, check_row, &c);
    if (st == IS_OK && !mem_index_check(m->ix))
        st = is_error_set(IS_ERR_INTERNAL, "check: the index fails its own invariant check");
    if (st == IS_OK && mem_index_count(m->ix) != c.n)
        st = is_error_set(IS_ERR_INTERNAL, "check: %lld facts in the index, %lld rows",
                          (long long)mem_index_count(m->ix), (long long)c.n);
    for (int64_t i = 0; st == IS_OK && i < files.n; i++) {
        if (!files.claimed[i])
            st = is_error_set(IS_ERR_INTERNAL, "check: record %s has no fact", files.ids[i]);
    }
    /* Each user's partition holds exactly that user's rows: a dense search
     * one deeper than the row count must return exactly them. */
    if (st == IS_OK && c.n > 0) qsort(c.rows, (size_t)c.n, sizeof *c.rows, cmp_rows);
    if (st == IS_OK && !(hits = malloc((size_t)(c.n + 1) * sizeof *hits)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; st == IS_OK && i < c.n;) {
        int64_t j = i;
        while (j < c.n && strcmp(c.rows[j].tenant, c.rows[i].tenant) == 0 &&
               strcmp(c.rows[j].user, c.rows[i].user) == 0)
            j++;
        mem_filter f = {.tenant = c.rows[i].tenant, .user = c.rows[i].user};
        int32_t nh = 0;
        st = mem_index_search(m->ix, &f, c.rows[i].embedding, NULL, (int32_t)(j - i + 1),
                              MEM_SEARCH_DENSE, hits, &nh);
        if (st == IS_OK && nh != j - i)
            st = is_error_set(IS_ERR_INTERNAL, "check: user (%s, %s): %d indexed, %lld rows",
                              f.tenant, f.user, (int)nh, (long long)(j - i));
        if (st == IS_OK) qsort(hits, (size_t)nh, sizeof *hits, cmp_hits);
        for (int64_t r = i; st == IS_OK && r < j; r++)
            if (strcmp(hits[r - i].id, c.rows[r].id) != 0)
                st = is_error_set(IS_ERR_INTERNAL, "check: fact %s is not indexed under its user",
                                  c.rows[r].id);
        i = j;
    }
    if (st == IS_OK && m->gpu) {
        dense_gpu_stats gs;
        dense_gpu_get_stats(m->gpu, &gs);
        if (gs.stale_users > 0)
            st = is_error_set(IS_ERR_INTERNAL, "check: %d users' GPU copies are stale",
                              (int)gs.stale_users);
        else if (gs.facts != c.n)
            st = is_error_set(IS_ERR_INTERNAL, "check: %lld facts on the GPU, %lld rows",
                              (long long)gs.facts, (long long)c.n);
        for (int64_t r = 0; st == IS_OK && r < c.n; r++)
            if (!dense_gpu_has(m->gpu, c.rows[r].tenant, c.rows[r].user, c.rows[r].id))
                st = is_error_set(IS_ERR_INTERNAL,
                                  "check: fact %s is not on the GPU under its user", c.rows[r].id);
    }
    free(hits);
    mem_facts_free(c.rows, (int32_t)c.n);
    record_files_free(&files);
    pthread_mutex_unlock(&m->write_mu);
    return st;
}

/* ---- LoCoMo import ----------------------------------------------------------------- */

void memory_locomo_user(const locomo_conv *c, const char *speaker, bool by_speaker, char *out,
                        size_t cap) {
    if (by_speaker) snprintf(out, cap, "%s", speaker);
    else snprintf(out, cap, "%s-%s", c->name, speaker);
    for (char *p = out; *p; p++)
        if (*p >= 'A' && *p <= 'Z') *p = (char)(*p - 'A' + 'a');
}

/* The strings one pending LoCoMo fact needs until its batch is written. */
typedef struct locomo_pending {
    char user[256];
    char source[256];
    char *metadata;
    const char *turns[MEMORY_MAX_CONTEXT];
} locomo_pending;

static void note_failure(memory_import_stats *stats, const locomo_pending *pe) {
    if (stats->first_error[0]) return;
    snprintf(stats->first_error, sizeof stats->first_error, "%.200s (user %.100s): %.200s",
             pe->source, pe->user, is_error_last());
}

static void import_flush(memory *m, memory_add_req *reqs, locomo_pending *pend, int32_t n,
                         memory_import_stats *stats, int64_t *done, int64_t total,
                         const memory_locomo_opts *o) {
    is_status *status = malloc((size_t)(n ? n : 1) * sizeof *status);
    if (!status) {
        stats->failed += n;
        snprintf(stats->first_error, sizeof stats->first_error, "out of memory");
    } else {
        /* One batch embedding, then one group commit of the valid facts' rows. */
        add_prep *p = calloc((size_t)(n ? n : 1), sizeof *p);
        const char **texts = calloc((size_t)(n ? n : 1), sizeof *texts);
        float *emb = malloc((size_t)(n ? n : 1) * (size_t)m->dim * sizeof(float));
        const add_prep **vp = calloc((size_t)(n ? n : 1), sizeof *vp);
        const float **ve = calloc((size_t)(n ? n : 1), sizeof *ve);
        int32_t *at = calloc((size_t)(n ? n : 1), sizeof *at);
        is_status *vst = calloc((size_t)(n ? n : 1), sizeof *vst);
        is_status est = p && texts && emb && vp && ve && at && vst
                            ? IS_OK
                            : is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; est == IS_OK && i < n; i++) {
            status[i] = add_check(m, &reqs[i], &p[i]);
            texts[i] = reqs[i].text;
            if (status[i] != IS_OK) note_failure(stats, &pend[i]);
        }
        if (est == IS_OK) est = embed_texts(m, texts, n, emb);
        int32_t nv = 0;
        for (int32_t i = 0; est == IS_OK && i < n; i++) {
            if (status[i] != IS_OK) continue;
            vp[nv] = &p[i];
            ve[nv] = emb + (size_t)i * m->dim;
            at[nv++] = i;
        }
        if (est == IS_OK && nv > 0) add_write_many(m, vp, ve, nv, NULL, vst);
        for (int32_t j = 0; est == IS_OK && j < nv; j++) status[at[j]] = vst[j];
        for (int32_t i = 0; i < n; i++) {
            if (est != IS_OK) status[i] = est;
            if (status[i] == IS_OK) {
                stats->added++;
            } else {
                note_failure(stats, &pend[i]); /* a check failure was noted already */
                stats->failed++;
            }
            ++*done;
            if (o->progress) o->progress(*done, total, o->progress_user_data);
        }
        for (int32_t i = 0; p && i < n; i++) free(p[i].metadata);
        free(p);
        free(texts);
        free(emb);
        free(vp);
        free(ve);
        free(at);
        free(vst);
    }
    free(status);
    for (int32_t i = 0; i < n; i++) {
        free(pend[i].metadata);
        pend[i].metadata = NULL;
    }
}

is_status memory_import_locomo(memory *m, const locomo_conv *c, const memory_locomo_opts *o,
                               memory_import_stats *stats) {
    if (!m || !c || !o || !o->tenant || !*o->tenant || !stats)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_import_locomo: NULL argument or no tenant");
    int32_t batch = o->batch > 0 ? o->batch : 32;
    int32_t window = o->window == MEMORY_WINDOW_DEFAULT ? m->kv_window : o->window;
    if (window > MEMORY_MAX_CONTEXT) window = MEMORY_MAX_CONTEXT;
    memory_add_req *reqs = calloc((size_t)batch, sizeof *reqs);
    locomo_pending *pend = calloc((size_t)batch, sizeof *pend);
    if (!reqs || !pend) {
        free(reqs);
        free(pend);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    is_status st = IS_OK;
    int32_t n = 0;
    int64_t done = 0;
    for (int32_t i = 0; i < c->n_facts; i++) {
        const locomo_fact *f = &c->facts[i];
        locomo_pending *pe = &pend[n];
        memory_locomo_user(c, f->speaker, o->user_by_speaker, pe->user, sizeof pe->user);
        snprintf(pe->source, sizeof pe->source, "locomo:%s:%s", c->name, f->dia_id);
        is_status fs = memory_find_source(m, o->tenant, pe->user, pe->source, f->text, NULL);
        if (fs == IS_OK) {
            stats->skipped++;
            done++;
            if (o->progress) o->progress(done, c->n_facts, o->progress_user_data);
            continue;
        }
        if (fs != IS_ERR_NOT_FOUND) {
            st = fs;
            break;
        }
        cJSON *meta = cJSON_CreateObject();
        if (meta) {
            cJSON_AddStringToObject(meta, "conversation", c->name);
            cJSON_AddNumberToObject(meta, "session", f->session);
            cJSON_AddStringToObject(meta, "dia_id", f->dia_id);
            cJSON_AddStringToObject(meta, "speaker", f->speaker);
            pe->metadata = cJSON_PrintUnformatted(meta);
            cJSON_Delete(meta);
        }
        if (!pe->metadata) {
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
            break;
        }
        int32_t nt = window > 0 ? locomo_fact_context(c, f, window, pe->turns) : 0;
        reqs[n] = (memory_add_req){.tenant = o->tenant,
                                   .user = pe->user,
                                   .text = f->text,
                                   .metadata_json = pe->metadata,
                                   .source = pe->source,
                                   .context = pe->turns,
                                   .n_context = nt,
                                   .window = window};
        if (++n == batch) {
            import_flush(m, reqs, pend, n, stats, &done, c->n_facts, o);
            n = 0;
        }
    }
    if (st == IS_OK && n > 0) import_flush(m, reqs, pend, n, stats, &done, c->n_facts, o);
    for (int32_t i = 0; i < batch; i++) free(pend[i].metadata);
    free(reqs);
    free(pend);
    return st;
}

/*
 * fsck: see fsck.h for what is checked, what is repaired and what a
 * rebuild from KV records can and cannot bring back.
 */
#include "memory/fsck.h"

#include "core/status.h"
#include "kv/fact_record.h"
#include "kv/record_store.h"
#include "memory/memory.h"
#include "memory/store.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define REC_EXT ".fkv" /* record_store's file extension */

/* ---- the record files ------------------------------------------------------------ */

typedef struct id_list {
    char **ids;
    bool *claimed;
    int64_t n, cap;
} id_list;

static void id_list_free(id_list *l) {
    for (int64_t i = 0; i < l->n; i++) free(l->ids[i]);
    free(l->ids);
    free(l->claimed);
    memset(l, 0, sizeof *l);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The ids of the record files of dir, sorted (a missing dir: none). */
static is_status list_records(const char *dir, id_list *l) {
    memset(l, 0, sizeof *l);
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT
                   ? IS_OK
                   : is_error_set(IS_ERR_IO, "fsck: cannot list %s: %s", dir, strerror(errno));
    struct dirent *de;
    is_status st = IS_OK;
    const size_t ext = strlen(REC_EXT);
    while (st == IS_OK && (de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        if (len <= ext || strcmp(de->d_name + len - ext, REC_EXT) != 0) continue;
        if (l->n == l->cap) {
            int64_t nc = l->cap ? l->cap * 2 : 64;
            char **ni = realloc(l->ids, (size_t)nc * sizeof *ni);
            if (!ni) {
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            l->ids = ni;
            l->cap = nc;
        }
        if (!(l->ids[l->n] = strndup(de->d_name, len - ext)))
            st = is_error_set(IS_ERR_NOMEM, "out of memory");
        else l->n++;
    }
    closedir(d);
    if (st == IS_OK && !(l->claimed = calloc((size_t)(l->n ? l->n : 1), sizeof *l->claimed)))
        st = is_error_set(IS_ERR_NOMEM, "out of memory");
    if (st != IS_OK) id_list_free(l);
    else if (l->n) qsort(l->ids, (size_t)l->n, sizeof *l->ids, cmp_str);
    return st;
}

typedef struct claim_ctx {
    id_list *files;
    int64_t n_missing;
} claim_ctx;

static is_status claim(const char *rid, void *ud) {
    claim_ctx *c = ud;
    char **hit = c->files->n
                     ? bsearch(&rid, c->files->ids, (size_t)c->files->n, sizeof(char *), cmp_str)
                     : NULL;
    if (hit) c->files->claimed[hit - c->files->ids] = true;
    else c->n_missing++;
    return IS_OK;
}

/* ---- rebuilding from records ---------------------------------------------------- */

static is_status read_whole(const char *path, void **buf, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return is_error_set(IS_ERR_IO, "fsck: cannot open %s: %s", path, strerror(errno));
    is_status st = IS_OK;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    void *b = n > 0 ? malloc((size_t)n) : NULL;
    if (n <= 0 || fseek(f, 0, SEEK_SET) != 0 || !b || fread(b, 1, (size_t)n, f) != (size_t)n) {
        st = is_error_set(IS_ERR_IO, "fsck: cannot read %s", path);
        free(b);
    } else {
        *buf = b;
        *len = (size_t)n;
    }
    fclose(f);
    return st;
}

/* Splits a record id "<fact id>-v<version>" into its parts; false if it is
 * not of that form. */
static bool split_record_id(const char *rid, char *fact_id, size_t cap, int32_t *version) {
    const char *v = strrchr(rid, '-');
    if (!v || v == rid || v[1] != 'v' || !v[2]) return false;
    char *end;
    long n = strtol(v + 2, &end, 10);
    if (*end || n < 1 || n > INT32_MAX || (size_t)(v - rid) >= cap ||
        (size_t)(v - rid) > MEM_ID_MAX)
        return false;
    memcpy(fact_id, rid, (size_t)(v - rid));
    fact_id[v - rid] = '\0';
    *version = (int32_t)n;
    return true;
}

/* One record into a row of s; false (with *why) if its text cannot be
 * recovered exactly. */
static is_status rebuild_one(mem_store *s, const char *kv_dir, const char *rid,
                             const memory_fsck_params *p, int32_t dim, bool *ok, const char **why) {
    *ok = false;
    char fid[MEM_ID_MAX + 1];
    int32_t version;
    if (!split_record_id(rid, fid, sizeof fid, &version)) {
        *why = "the record's name is not <fact id>-v<version>";
        return IS_OK;
    }
    char path[PATH_MAX + 96];
    snprintf(path, sizeof path, "%s/%s" REC_EXT, kv_dir, rid);
    void *buf = NULL;
    size_t len = 0;
    if (read_whole(path, &buf, &len) != IS_OK) {
        *why = "unreadable";
        return IS_OK;
    }
    fact_kv_meta meta;
    const int32_t *tokens = NULL;
    char *text = NULL;
    is_status st = IS_OK;
    if (fact_record_parse(buf, len, &meta, &tokens, NULL, NULL) != IS_OK) {
        *why = "corrupt record";
    } else if (p->text_of(p->text_user_data, tokens, meta.n_tokens, &text) != IS_OK || !text) {
        *why = "its tokens do not decode";
    } else if (fact_text_hash(text, strlen(text)) != meta.text_hash) {
        *why = "the decoded text does not match the record's text hash";
    } else {
        mem_fact f;
        memset(&f, 0, sizeof f);
        snprintf(f.id, sizeof f.id, "%s", fid);
        f.tenant = (char *)(p->tenant ? p->tenant : "default");
        f.user = (char *)(p->user ? p->user : "recovered");
        f.text = text;
        f.source = (char *)"fsck:rebuilt";
        mem_text_hash_hex(text, f.hash);
        f.kv_window = meta.window;
        f.kv_record = (char *)rid;
        f.version = version;
        f.dim = dim;
        float one = 1.0f;
        float *emb = p->embedder ? malloc((size_t)dim * sizeof(float)) : &one;
        if (!emb) st = is_error_set(IS_ERR_NOMEM, "out of memory");
        if (st == IS_OK && p->embedder) {
            const char *t = text;
            st = embedder_embed(p->embedder, &t, 1, emb);
        }
        f.embedding = emb;
        if (st == IS_OK) st = mem_store_insert(s, &f);
        if (st == IS_OK) *ok = true;
        if (p->embedder) free(emb);
    }
    free(text);
    free(buf);
    return st;
}

/* A store that cannot serve its records (missing, empty, no facts and no
 * history): the damaged file is renamed away, a new store is filled from
 * the records. */
static is_status rebuild(const char *data_dir, const char *db_path, const id_list *files,
                         const memory_fsck_params *p, memory_fsck_report *r, FILE *out) {
    if (!p->text_of)
        return is_error_set(IS_ERR_INVALID_ARG,
                            "fsck: rebuilding the store from KV records needs the "
                            "model that encoded them (--model): the records keep "
                            "token ids, not text");
    struct stat sb;
    const char *suffix[] = {"", "-wal", "-shm"};
    long long now = (long long)time(NULL);
    for (int i = 0; i < 3; i++) {
        char from[PATH_MAX], to[PATH_MAX + 64];
        snprintf(from, sizeof from, "%s%s", db_path, suffix[i]);
        snprintf(to, sizeof to, "%s.damaged-%lld%s", db_path, now, suffix[i]);
        if (stat(from, &sb) != 0) continue;
        if (rename(from, to) != 0)
            return is_error_set(IS_ERR_IO, "fsck: cannot rename %s: %s", from, strerror(errno));
        if (out) fprintf(out, "fsck: kept the damaged %s as %s\n", from, to);
    }
    mem_store *s = NULL;
    is_status st = mem_store_open(db_path, &s);
    const int32_t dim = p->embedder ? embedder_dim(p->embedder) : 1;
    char dim_s[32];
    snprintf(dim_s, sizeof dim_s, "%d", (int)dim);
    if (st == IS_OK)
        st = mem_store_meta_set(s, "embed_name", p->embed_name ? p->embed_name : "none");
    if (st == IS_OK) st = mem_store_meta_set(s, "embed_dim", dim_s);
    char kv_dir[PATH_MAX];
    snprintf(kv_dir, sizeof kv_dir, "%s/kv", data_dir);
    for (int64_t i = 0; st == IS_OK && i < files->n; i++) {
        bool ok;
        const char *why = NULL;
        st = rebuild_one(s, kv_dir, files->ids[i], p, dim, &ok, &why);
        if (st != IS_OK) break;
        if (ok) {
            r->n_rebuilt++;
        } else {
            r->n_not_rebuilt++;
            if (out) fprintf(out, "fsck: record %s not rebuilt: %s\n", files->ids[i], why);
        }
    }
    mem_store_close(s);
    return st;
}

/* ---- the check ---------------------------------------------------------------------- */

static int64_t count_files(const char *dir) {
    id_list l;
    if (list_records(dir, &l) != IS_OK) return -1;
    int64_t n = l.n;
    id_list_free(&l);
    return n;
}

is_status memory_fsck(const char *data_dir, const memory_fsck_params *p, memory_fsck_report *r,
                      FILE *out) {
    if (!data_dir || !p || !r)
        return is_error_set(IS_ERR_INVALID_ARG, "memory_fsck: NULL argument");
    memset(r, 0, sizeof *r);
    char db_path[PATH_MAX], wal[PATH_MAX + 8], kv_dir[PATH_MAX], aside[PATH_MAX + 16];
    snprintf(db_path, sizeof db_path, "%s/memory.db", data_dir);
    snprintf(wal, sizeof wal, "%s-wal", db_path);
    snprintf(kv_dir, sizeof kv_dir, "%s/kv", data_dir);
    snprintf(aside, sizeof aside, "%s/" RECORD_STORE_ASIDE_DIR, kv_dir);
    struct stat sb, wb;
    if (stat(data_dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return is_error_set(IS_ERR_IO, "fsck: %s is not a directory", data_dir);
    /* The record store's lock: a running server keeps fsck out. */
    record_store *rs = NULL;
    is_status st = record_store_open(kv_dir, 0, &rs);
    if (st != IS_OK) return st;

    id_list files;
    if ((st = list_records(kv_dir, &files)) != IS_OK) {
        record_store_close(rs);
        return st;
    }
    r->n_records = files.n;
    r->n_set_aside = count_files(aside);
    r->db_missing = stat(db_path, &sb) != 0;
    r->db_empty = !r->db_missing && sb.st_size == 0 && (stat(wal, &wb) != 0 || wb.st_size == 0);
    snprintf(r->integrity, sizeof r->integrity, "%s", r->db_missing || r->db_empty ? "-" : "?");
    int32_t dim = 0;
    if (!r->db_missing && !r->db_empty) {
        mem_store *s = NULL;
        if ((st = mem_store_open_readonly(db_path, &s)) == IS_OK) {
            st = mem_store_integrity(s, r->integrity, sizeof r->integrity);
            mem_store_missing_tables(s, r->missing_tables, sizeof r->missing_tables);
            char *d = NULL;
            if (mem_store_meta_get(s, "embed_dim", &d) == IS_OK) dim = atoi(d);
            free(d);
            if (!strstr(r->missing_tables, "facts")) {
                claim_ctx c = {&files, 0};
                r->n_facts = mem_store_count(s);
                if (st == IS_OK) st = mem_store_count_bad_rows(s, dim, &r->n_bad_rows);
                if (st == IS_OK) st = mem_store_foreach_record(s, claim, &c);
                r->n_missing_kv = c.n_missing;
            }
            if (!strstr(r->missing_tables, "history")) r->n_history = mem_store_count_history(s);
            r->n_quarantined = mem_store_count_quarantined(s);
            mem_store_close(s);
        }
        if (st != IS_OK) {
            /* Unreadable as a database: reported, and rebuilt like a missing one. */
            snprintf(r->integrity, sizeof r->integrity, "unreadable: %.100s", is_error_last());
            st = IS_OK;
        }
    }
    for (int64_t i = 0; i < files.n; i++) r->n_unclaimed += !files.claimed[i];
    const bool unreadable = strncmp(r->integrity, "unreadable", 10) == 0;
    const bool store_lost = r->db_missing || r->db_empty || unreadable ||
                            strstr(r->missing_tables, "facts") ||
                            (r->n_facts == 0 && r->n_history <= 0 && files.n > 1);
    const bool rebuild_needed = store_lost && files.n > 0;
    r->problems =
        rebuild_needed || (!store_lost && (r->missing_tables[0] || r->n_bad_rows > 0 ||
                                           r->n_unclaimed > 0 || strcmp(r->integrity, "ok") != 0));
    if (out) {
        fprintf(out, "fsck: %s: %s\n", db_path,
                r->db_missing ? "MISSING"
                : r->db_empty ? "EMPTY"
                              : r->integrity);
        if (r->missing_tables[0]) fprintf(out, "fsck: missing tables: %s\n", r->missing_tables);
        fprintf(out,
                "fsck: %lld facts, %lld bad rows, %lld already quarantined, %lld history rows\n",
                (long long)r->n_facts, (long long)r->n_bad_rows, (long long)r->n_quarantined,
                (long long)r->n_history);
        fprintf(out,
                "fsck: %lld KV records in %s: %lld that no fact points to; %lld facts without "
                "their record; %lld set aside in %s\n",
                (long long)r->n_records, kv_dir, (long long)r->n_unclaimed,
                (long long)r->n_missing_kv, (long long)(r->n_set_aside > 0 ? r->n_set_aside : 0),
                aside);
        if (rebuild_needed)
            fprintf(out,
                    "fsck: the store is lost beside %lld KV records: --repair rebuilds the facts "
                    "from them (text exactly, as checked against each record's hash; not the "
                    "owner, metadata or history)\n",
                    (long long)files.n);
    }
    record_store_close(rs);
    if (p->repair && r->problems) {
        if (rebuild_needed) st = rebuild(data_dir, db_path, &files, p, r, out);
        if (st == IS_OK) {
            /* memory_open's recovery: tables, quarantine, records set aside. */
            memory_params mp = memory_default_params();
            mp.embedder = p->embedder;
            mp.embed_name = p->embed_name;
            memory *m = NULL;
            memory_open_report rep;
            st = memory_open(data_dir, &mp, &m, &rep);
            if (st == IS_OK) {
                if (out) {
                    if (rebuild_needed)
                        fprintf(out,
                                "fsck: rebuilt %lld facts from KV records (owner %s/%s); %lld "
                                "records could not be\n",
                                (long long)r->n_rebuilt, p->tenant ? p->tenant : "default",
                                p->user ? p->user : "recovered", (long long)r->n_not_rebuilt);
                    if (rep.repairs[0]) fprintf(out, "fsck: repaired: %s\n", rep.repairs);
                    if (rep.n_orphans)
                        fprintf(out, "fsck: set aside %lld records no fact points to in %s\n",
                                (long long)rep.n_orphans, aside);
                    fprintf(out, "fsck: the store now serves %lld facts\n", (long long)rep.n_facts);
                }
                memory_close(m);
            }
        }
    }
    id_list_free(&files);
    return st;
}

/*
 * record_store: fact-KV records on disk with an LRU cache in front (see
 * record_store.h for the directory layout, crash safety and threading).
 *
 * Bookkeeping: every record in memory is an rs_entry, reachable from the
 * cache (a hash table by id plus an LRU list) while `cached`, and alive
 * while it is cached or held (refs > 0). Whoever drops the last of the two
 * frees it. All of that is guarded by the store's mutex; file I/O is done
 * outside it, except the rename/unlink that changes what an id names, which
 * happens under the mutex together with the cache update, so the cache and
 * the directory change in the same order.
 */
#include "kv/record_store.h"

#include "core/status.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define RS_EXT      ".fkv"
#define RS_TMP_MARK ".fkv.tmp."
/* "<id>.fkv.tmp.<pid>.<counter>" fits easily. */
#define RS_NAME_CAP (RECORD_STORE_ID_MAX + 64)

typedef struct rs_entry rs_entry;
struct rs_entry {
    fact_kv kv;          /* what callers get; first, so a fact_kv* is an rs_entry* */
    record_store *store; /* owner, checked on release */
    char id[RECORD_STORE_ID_MAX + 1];
    void *base;            /* the record's bytes: a mapping or an aligned malloc */
    size_t len;            /* bytes at base */
    bool mapped;           /* munmap (true) or free (false) */
    int32_t refs;          /* holders that have not released it */
    bool cached;           /* linked into the table and the LRU list */
    rs_entry *prev, *next; /* LRU list, most recent at head */
    rs_entry *hnext;       /* hash chain */
};

/* A record file, or a pinned id, known to the disk cap's bookkeeping. */
typedef struct rs_disk rs_disk;
struct rs_disk {
    char id[RECORD_STORE_ID_MAX + 1];
    uint64_t bytes;       /* the file's size (0 while not on disk) */
    bool on_disk;         /* in the LRU list and counted in disk_bytes */
    int32_t pins;         /* record_store_pin calls not yet undone */
    uint64_t batch;       /* the put that last wrote it (its records are not evicted by it) */
    rs_disk *prev, *next; /* disk LRU list, most recent at head (on_disk only) */
    rs_disk *hnext;       /* hash chain */
};

struct record_store {
    pthread_mutex_t mu;
    char *dir;          /* as given, for messages */
    int dir_fd;         /* the directory; every file op is relative to it */
    int lock_fd;        /* <dir>/.lock, flock()ed */
    size_t cache_cap;   /* bytes */
    rs_entry **buckets; /* [n_buckets] hash chains of cached entries */
    size_t n_buckets;   /* power of two */
    rs_entry *lru_head, *lru_tail;
    record_store_stats stats;
    uint64_t generation;  /* bumped whenever an id's file changes */
    uint64_t tmp_counter; /* makes temporary names unique within the process */
    record_store_fault_fn fault;
    void *fault_user;
    /* The disk cap (record_store_set_disk_cap): tracked only when disk_cap > 0. */
    uint64_t disk_cap;
    rs_disk **d_buckets; /* [d_n_buckets] hash chains of every rs_disk */
    size_t d_n_buckets, d_n;
    rs_disk *d_head, *d_tail;
    uint64_t batch_counter;
    /* What record_store_contains counts (record_store_set_model). */
    bool has_model;
    fact_kv_meta model;
};

/* ---- ids and names ---------------------------------------------------------------- */

bool record_store_id_valid(const char *id) {
    if (!id) return false;
    size_t n = 0;
    for (; id[n]; n++) {
        char c = id[n];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '_' || c == '-';
        if (!ok || n >= RECORD_STORE_ID_MAX) return false;
    }
    return n > 0;
}

static is_status check_id(const char *id) {
    if (record_store_id_valid(id)) return IS_OK;
    return is_error_set(IS_ERR_INVALID_ARG,
                        "record store: invalid fact id '%.80s' (1-64 characters of "
                        "[A-Za-z0-9_-])",
                        id ? id : "(null)");
}

static void final_name(char *buf, const char *id) { snprintf(buf, RS_NAME_CAP, "%s" RS_EXT, id); }

/* FNV-1a: ids are short. */
static size_t id_hash(const char *id) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 0x100000001b3ull;
    return (size_t)h;
}

/* ---- entries and the cache (caller holds s->mu) ----------------------------------- */

static void entry_destroy(rs_entry *e) {
    if (e->mapped) munmap(e->base, e->len);
    else free(e->base);
    free(e);
}

static rs_entry *cache_find(record_store *s, const char *id) {
    for (rs_entry *e = s->buckets[id_hash(id) & (s->n_buckets - 1)]; e; e = e->hnext)
        if (strcmp(e->id, id) == 0) return e;
    return NULL;
}

static void lru_unlink(record_store *s, rs_entry *e) {
    if (e->prev) e->prev->next = e->next;
    else s->lru_head = e->next;
    if (e->next) e->next->prev = e->prev;
    else s->lru_tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_front(record_store *s, rs_entry *e) {
    e->prev = NULL;
    e->next = s->lru_head;
    if (s->lru_head) s->lru_head->prev = e;
    else s->lru_tail = e;
    s->lru_head = e;
}

/* Takes e out of the cache; frees it unless someone holds it. */
static void cache_drop(record_store *s, rs_entry *e) {
    IS_ASSERT(e->cached);
    rs_entry **pp = &s->buckets[id_hash(e->id) & (s->n_buckets - 1)];
    while (*pp != e) pp = &(*pp)->hnext;
    *pp = e->hnext;
    e->hnext = NULL;
    lru_unlink(s, e);
    e->cached = false;
    s->stats.bytes_cached -= e->len;
    s->stats.n_cached--;
    if (e->refs == 0) entry_destroy(e);
}

/* Doubles the table when it gets crowded; on allocation failure the chains
 * just grow longer. */
static void cache_maybe_grow(record_store *s) {
    if (s->stats.n_cached < s->n_buckets) return;
    size_t n = s->n_buckets * 2;
    rs_entry **b = calloc(n, sizeof *b);
    if (!b) return;
    for (size_t i = 0; i < s->n_buckets; i++)
        for (rs_entry *e = s->buckets[i], *next; e; e = next) {
            next = e->hnext;
            size_t j = id_hash(e->id) & (n - 1);
            e->hnext = b[j];
            b[j] = e;
        }
    free(s->buckets);
    s->buckets = b;
    s->n_buckets = n;
}

/* Puts e (not cached, id not in the cache) into the cache if it fits, then
 * evicts least recently used records until the cache is within bounds. */
static void cache_insert(record_store *s, rs_entry *e) {
    if (e->len > s->cache_cap) return;
    cache_maybe_grow(s);
    size_t j = id_hash(e->id) & (s->n_buckets - 1);
    e->hnext = s->buckets[j];
    s->buckets[j] = e;
    lru_push_front(s, e);
    e->cached = true;
    s->stats.bytes_cached += e->len;
    s->stats.n_cached++;
    while (s->stats.bytes_cached > s->cache_cap) {
        IS_ASSERT(s->lru_tail && s->lru_tail != e);
        cache_drop(s, s->lru_tail);
        s->stats.evictions++;
    }
}

/* Makes an entry for the record in base[len] (parsed again here, so a
 * record in memory is always one that passed every check). On failure
 * base is left to the caller. */
static is_status entry_create(record_store *s, const char *id, void *base, size_t len, bool mapped,
                              rs_entry **out) {
    rs_entry *e = calloc(1, sizeof *e);
    if (!e) return is_error_set(IS_ERR_NOMEM, "record store: out of memory");
    is_status st = fact_record_parse(base, len, &e->kv.meta, &e->kv.tokens, &e->kv.k, &e->kv.v);
    if (st != IS_OK) {
        free(e);
        return st;
    }
    e->kv.content_id = fact_record_content_id(base);
    snprintf(e->id, sizeof e->id, "%s", id);
    e->base = base;
    e->len = len;
    e->mapped = mapped;
    e->store = s;
    *out = e;
    return IS_OK;
}

/* ---- the disk cap's bookkeeping (caller holds s->mu) ------------------------------ */

static rs_disk *disk_find(record_store *s, const char *id) {
    if (!s->d_buckets) return NULL;
    for (rs_disk *d = s->d_buckets[id_hash(id) & (s->d_n_buckets - 1)]; d; d = d->hnext)
        if (strcmp(d->id, id) == 0) return d;
    return NULL;
}

static void disk_unlink_lru(record_store *s, rs_disk *d) {
    if (d->prev) d->prev->next = d->next;
    else s->d_head = d->next;
    if (d->next) d->next->prev = d->prev;
    else s->d_tail = d->prev;
    d->prev = d->next = NULL;
}

static void disk_push_front(record_store *s, rs_disk *d) {
    d->prev = NULL;
    d->next = s->d_head;
    if (s->d_head) s->d_head->prev = d;
    else s->d_tail = d;
    s->d_head = d;
}

/* The entry of `id`, made (not on disk, unpinned) when missing; NULL when
 * out of memory (the record then goes untracked: never evicted). */
static rs_disk *disk_get(record_store *s, const char *id) {
    rs_disk *d = disk_find(s, id);
    if (d) return d;
    if (s->d_n >= s->d_n_buckets) {
        size_t n = s->d_n_buckets * 2;
        rs_disk **b = calloc(n, sizeof *b);
        if (b) {
            for (size_t i = 0; i < s->d_n_buckets; i++)
                for (rs_disk *e = s->d_buckets[i], *next; e; e = next) {
                    next = e->hnext;
                    size_t j = id_hash(e->id) & (n - 1);
                    e->hnext = b[j];
                    b[j] = e;
                }
            free(s->d_buckets);
            s->d_buckets = b;
            s->d_n_buckets = n;
        }
    }
    if (!(d = calloc(1, sizeof *d))) return NULL;
    snprintf(d->id, sizeof d->id, "%s", id);
    size_t j = id_hash(id) & (s->d_n_buckets - 1);
    d->hnext = s->d_buckets[j];
    s->d_buckets[j] = d;
    s->d_n++;
    return d;
}

static void disk_remove(record_store *s, rs_disk *d) {
    rs_disk **pp = &s->d_buckets[id_hash(d->id) & (s->d_n_buckets - 1)];
    while (*pp != d) pp = &(*pp)->hnext;
    *pp = d->hnext;
    s->d_n--;
    free(d);
}

/* The file of `id` is gone (deleted, set aside, evicted): out of the LRU
 * and the counts; its entry stays while pinned. */
static void disk_gone(record_store *s, const char *id) {
    rs_disk *d = s->disk_cap ? disk_find(s, id) : NULL;
    if (!d) return;
    if (d->on_disk) {
        disk_unlink_lru(s, d);
        d->on_disk = false;
        s->stats.disk_bytes -= d->bytes;
        s->stats.n_disk--;
        d->bytes = 0;
    }
    if (d->pins == 0) disk_remove(s, d);
}

/* The file of `id` (`bytes` long) was just used or written: most recent. */
static rs_disk *disk_touch(record_store *s, const char *id, uint64_t bytes) {
    if (!s->disk_cap) return NULL;
    rs_disk *d = disk_get(s, id);
    if (!d) return NULL;
    if (d->on_disk) {
        s->stats.disk_bytes -= d->bytes;
        disk_unlink_lru(s, d);
    } else {
        d->on_disk = true;
        s->stats.n_disk++;
    }
    d->bytes = bytes;
    s->stats.disk_bytes += bytes;
    disk_push_front(s, d);
    return d;
}

/* Deletes least recently used record files until the directory is within
 * the cap, sparing those pinned, held or written by put `batch`. */
static void disk_evict(record_store *s, uint64_t batch) {
    rs_disk *d = s->d_tail;
    while (s->disk_cap && s->stats.disk_bytes > s->disk_cap && d) {
        rs_disk *prev = d->prev;
        rs_entry *e = cache_find(s, d->id);
        bool spare = d->pins > 0 || (batch && d->batch == batch) || (e && e->refs > 0);
        if (!spare) {
            char name[RS_NAME_CAP];
            final_name(name, d->id);
            if (unlinkat(s->dir_fd, name, 0) == 0 || errno == ENOENT) {
                s->generation++;
                if (e) cache_drop(s, e);
                s->stats.disk_evictions++;
                disk_gone(s, d->id);
            }
        }
        d = prev;
    }
}

static void disk_clear(record_store *s) {
    for (size_t i = 0; s->d_buckets && i < s->d_n_buckets; i++)
        for (rs_disk *d = s->d_buckets[i], *next; d; d = next) {
            next = d->hnext;
            free(d);
        }
    free(s->d_buckets);
    s->d_buckets = NULL;
    s->d_n_buckets = s->d_n = 0;
    s->d_head = s->d_tail = NULL;
    s->stats.disk_bytes = s->stats.n_disk = 0;
}

typedef struct disk_file {
    char id[RECORD_STORE_ID_MAX + 1];
    uint64_t bytes;
    struct timespec mtime;
} disk_file;

static int cmp_mtime_desc(const void *a, const void *b) {
    const struct timespec *x = &((const disk_file *)a)->mtime, *y = &((const disk_file *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? 1 : -1;
    if (x->tv_nsec != y->tv_nsec) return x->tv_nsec < y->tv_nsec ? 1 : -1;
    return 0;
}

is_status record_store_set_disk_cap(record_store *s, uint64_t bytes) {
    pthread_mutex_lock(&s->mu);
    is_status st = IS_OK;
    if (bytes == 0) {
        disk_clear(s);
        s->disk_cap = 0;
    } else if (s->disk_cap) {
        s->disk_cap = bytes;
    } else {
        /* The records already there, the least recently modified last. */
        disk_file *files = NULL;
        size_t n = 0, cap = 0;
        int fd = dup(s->dir_fd);
        DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
        if (!dir) {
            if (fd >= 0) close(fd);
            st = is_error_set(IS_ERR_IO, "record store: cannot list %s: %s", s->dir,
                              strerror(errno));
        }
        if (dir) rewinddir(dir);
        struct dirent *de;
        while (st == IS_OK && (de = readdir(dir)) != NULL) {
            size_t l = strlen(de->d_name);
            if (l <= strlen(RS_EXT) || strcmp(de->d_name + l - strlen(RS_EXT), RS_EXT) != 0)
                continue;
            char id[RECORD_STORE_ID_MAX + 1];
            size_t il = l - strlen(RS_EXT);
            if (il > RECORD_STORE_ID_MAX) continue;
            memcpy(id, de->d_name, il);
            id[il] = '\0';
            struct stat sb;
            if (!record_store_id_valid(id) || fstatat(s->dir_fd, de->d_name, &sb, 0) != 0 ||
                !S_ISREG(sb.st_mode))
                continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 256;
                disk_file *g = realloc(files, nc * sizeof *g);
                if (!g) {
                    st = is_error_set(IS_ERR_NOMEM, "record store: out of memory");
                    break;
                }
                files = g;
                cap = nc;
            }
            snprintf(files[n].id, sizeof files[n].id, "%s", id);
            files[n].bytes = (uint64_t)sb.st_size;
            files[n].mtime = sb.st_mtim;
            n++;
        }
        if (dir) closedir(dir);
        if (st == IS_OK && !s->d_buckets) {
            s->d_n_buckets = 256;
            if (!(s->d_buckets = calloc(s->d_n_buckets, sizeof *s->d_buckets)))
                st = is_error_set(IS_ERR_NOMEM, "record store: out of memory");
        }
        if (st == IS_OK) {
            s->disk_cap = bytes;
            /* Newest first, each pushed behind the ones before: the oldest
             * ends at the tail. */
            qsort(files, n, sizeof *files, cmp_mtime_desc);
            for (size_t i = 0; i < n; i++) {
                rs_disk *d = disk_get(s, files[i].id);
                if (!d || d->on_disk) continue;
                d->on_disk = true;
                d->bytes = files[i].bytes;
                s->stats.n_disk++;
                s->stats.disk_bytes += d->bytes;
                d->prev = s->d_tail;
                d->next = NULL;
                if (s->d_tail) s->d_tail->next = d;
                else s->d_head = d;
                s->d_tail = d;
            }
        } else {
            disk_clear(s);
        }
        free(files);
    }
    if (st == IS_OK) disk_evict(s, 0);
    pthread_mutex_unlock(&s->mu);
    return st;
}

void record_store_pin(record_store *s, const char *id) {
    if (!record_store_id_valid(id)) return;
    pthread_mutex_lock(&s->mu);
    rs_disk *d = s->disk_cap ? disk_get(s, id) : NULL;
    if (d) d->pins++;
    pthread_mutex_unlock(&s->mu);
}

void record_store_unpin(record_store *s, const char *id) {
    if (!record_store_id_valid(id)) return;
    pthread_mutex_lock(&s->mu);
    rs_disk *d = s->disk_cap ? disk_find(s, id) : NULL;
    if (d && d->pins > 0 && --d->pins == 0 && !d->on_disk) disk_remove(s, d);
    pthread_mutex_unlock(&s->mu);
}

/* ---- open / close ----------------------------------------------------------------- */

/* mkdir -p */
static is_status make_dirs(const char *dir) {
    size_t n = strlen(dir);
    char *p = malloc(n + 1);
    if (!p) return is_error_set(IS_ERR_NOMEM, "record store: out of memory");
    memcpy(p, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        char saved = p[i];
        p[i] = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int err = errno;
            is_status st = is_error_set(IS_ERR_IO, "record store: cannot create directory %s: %s",
                                        p, strerror(err));
            free(p);
            return st;
        }
        p[i] = saved;
    }
    free(p);
    return IS_OK;
}

/* Removes the temporary files a crashed or failed writer left behind. We
 * hold the directory's lock, so no writer of ours is running. */
static is_status remove_stale_tmp(record_store *s) {
    int fd = dup(s->dir_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        int err = errno;
        if (fd >= 0) close(fd);
        return is_error_set(IS_ERR_IO, "record store: cannot list %s: %s", s->dir, strerror(err));
    }
    rewinddir(d);
    bool removed = false;
    is_status st = IS_OK;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!strstr(de->d_name, RS_TMP_MARK)) continue;
        if (unlinkat(s->dir_fd, de->d_name, 0) != 0 && errno != ENOENT) {
            st = is_error_set(IS_ERR_IO, "record store: cannot remove stale %s/%s: %s", s->dir,
                              de->d_name, strerror(errno));
            break;
        }
        removed = true;
    }
    closedir(d);
    if (st == IS_OK && removed) fsync(s->dir_fd);
    return st;
}

is_status record_store_open(const char *dir, size_t cache_bytes, record_store **out) {
    if (!dir || !dir[0] || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "record store: empty directory name");
    is_status st = make_dirs(dir);
    if (st != IS_OK) return st;
    record_store *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "record store: out of memory");
    s->dir_fd = s->lock_fd = -1;
    s->cache_cap = cache_bytes;
    s->n_buckets = 64;
    s->dir = strdup(dir);
    s->buckets = calloc(s->n_buckets, sizeof *s->buckets);
    if (!s->dir || !s->buckets) {
        st = is_error_set(IS_ERR_NOMEM, "record store: out of memory");
        goto fail;
    }
    s->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (s->dir_fd < 0) {
        st = is_error_set(IS_ERR_IO, "record store: cannot open directory %s: %s", dir,
                          strerror(errno));
        goto fail;
    }
    s->lock_fd = openat(s->dir_fd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (s->lock_fd < 0) {
        st = is_error_set(IS_ERR_IO, "record store: cannot create %s/.lock: %s", dir,
                          strerror(errno));
        goto fail;
    }
    if (flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        st = is_error_set(IS_ERR_IO, "record store: %s is %s", dir,
                          errno == EWOULDBLOCK ? "already open (its .lock is held)"
                                               : strerror(errno));
        goto fail;
    }
    if ((st = remove_stale_tmp(s)) != IS_OK) goto fail;
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        st = is_error_set(IS_ERR_INTERNAL, "record store: pthread_mutex_init failed");
        goto fail;
    }
    *out = s;
    return IS_OK;
fail:
    if (s->lock_fd >= 0) close(s->lock_fd);
    if (s->dir_fd >= 0) close(s->dir_fd);
    free(s->buckets);
    free(s->dir);
    free(s);
    return st;
}

void record_store_close(record_store *s) {
    if (!s) return;
    IS_ASSERT(s->stats.n_held == 0); /* a record is still held by someone */
    while (s->lru_head) cache_drop(s, s->lru_head);
    disk_clear(s);
    pthread_mutex_destroy(&s->mu);
    close(s->lock_fd); /* releases the flock */
    close(s->dir_fd);
    free(s->buckets);
    free(s->dir);
    free(s);
}

void record_store_set_fault_hook(record_store *s, record_store_fault_fn fn, void *user_data) {
    pthread_mutex_lock(&s->mu);
    s->fault = fn;
    s->fault_user = user_data;
    pthread_mutex_unlock(&s->mu);
}

record_store_stats record_store_get_stats(record_store *s) {
    pthread_mutex_lock(&s->mu);
    record_store_stats st = s->stats;
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* ---- put ----------------------------------------------------------------------------- */

/* True if the hook lets the step run; an injected failure leaves errno 0. */
static bool step_ok(record_store_fault_fn fault, void *user, record_store_step step) {
    if (!fault || fault(step, user)) return true;
    errno = 0;
    return false;
}

/* Writes bytes [from, to) of a record given as its pieces. */
static int write_range(int fd, const fact_record_piece *pc, size_t from, size_t to) {
    struct iovec iov[FACT_RECORD_PIECES];
    while (from < to) {
        int n = 0;
        size_t at = 0;
        for (int i = 0; i < FACT_RECORD_PIECES; i++) {
            size_t a = at, b = at + pc[i].len;
            at = b;
            if (b <= from || a >= to) continue;
            size_t lo = from > a ? from : a, hi = to < b ? to : b;
            iov[n].iov_base = (void *)((const uint8_t *)pc[i].data + (lo - a));
            iov[n].iov_len = hi - lo;
            n++;
        }
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        from += (size_t)w;
    }
    return 0;
}

is_status record_store_put(record_store *s, const char *id, const fact_kv_meta *meta,
                           const int32_t *tokens, const void *k, const void *v) {
    return record_store_put_batch(s, 1, &id, &meta, &tokens, &k, &v, NULL);
}

/* One record of a batch on its way to disk. */
typedef struct put_item {
    void *head; /* the record's header piece (fact_record_encode_pieces) */
    fact_record_piece pieces[FACT_RECORD_PIECES];
    size_t len;
    rs_entry *e;     /* the written file mapped, entered into the cache at its rename */
    int fd;          /* the temporary file while open, else -1 */
    int write_errno; /* its write failed so */
    bool created;    /* the temporary file exists */
    char tmp[RS_NAME_CAP];
    char name[RS_NAME_CAP];
} put_item;

/* Most threads that write one batch's files. */
#define RS_WRITE_THREADS 8

/* One pass of a batch's writes, shared by the threads that take its
 * records one at a time. Plain threads, not OpenMP: a process that forks
 * (the crash tests do) cannot use OpenMP's pool in the child. */
typedef struct write_pass {
    put_item *it;
    int32_t n;
    int pass; /* 0: the first half of every record, 1: the rest */
    atomic_int next;
} write_pass;

static void *write_worker(void *arg) {
    write_pass *w = arg;
    for (;;) {
        int32_t i = atomic_fetch_add(&w->next, 1);
        if (i >= w->n) return NULL;
        put_item *p = &w->it[i];
        size_t half = p->len / 2;
        if (write_range(p->fd, p->pieces, w->pass ? half : 0, w->pass ? p->len : half) != 0) {
            p->write_errno = errno ? errno : EIO;
            continue;
        }
#ifdef SYNC_FILE_RANGE_WRITE
        /* Start the writeback now, so the fsyncs that follow overlap. */
        if (w->pass && w->n > 1) sync_file_range(p->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
    }
}

static void write_pass_run(put_item *it, int32_t n, int pass) {
    write_pass w = {.it = it, .n = n, .pass = pass};
    atomic_init(&w.next, 0);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int32_t want = n < cpus ? n : (int32_t)cpus;
    if (want > RS_WRITE_THREADS) want = RS_WRITE_THREADS;
    pthread_t th[RS_WRITE_THREADS];
    int started = 0;
    /* A thread that cannot start leaves its share to the others. */
    for (int32_t t = 1; t < want; t++)
        if (pthread_create(&th[started], NULL, write_worker, &w) == 0) started++;
    write_worker(&w);
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
}

static void items_free(put_item *it, int32_t n) {
    for (int32_t i = 0; i < n; i++) free(it[i].head);
    free(it);
}

static is_status batch_fail(record_store *s, put_item *it, int32_t from, int32_t n,
                            const char *what, const char *tmp, is_status *status) {
    int err = errno;
    is_status st = is_error_set(IS_ERR_IO, "record store: %s of %s/%s failed: %s", what, s->dir,
                                tmp, err ? strerror(err) : "injected fault");
    for (int32_t i = from; i < n; i++) {
        if (it[i].fd >= 0) close(it[i].fd);
        if (it[i].created) unlinkat(s->dir_fd, it[i].tmp, 0);
        if (it[i].e) entry_destroy(it[i].e);
        if (status) status[i] = st;
    }
    return st;
}

/* The written record mapped from its file, for the cache, if the cache can
 * keep it. Mapping costs no copy (the pages are the page cache's) and the
 * entry is checked as a read record is; if either fails the record stays
 * on disk and the first get reads it (and reports what is wrong). */
static rs_entry *map_written(record_store *s, const char *id, int fd, size_t len) {
    if (len > s->cache_cap) return NULL;
    void *base = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) return NULL;
    rs_entry *e = NULL;
    if (entry_create(s, id, base, len, true, &e) != IS_OK) {
        munmap(base, len);
        return NULL;
    }
    return e;
}

is_status record_store_put_batch(record_store *s, int32_t n, const char *const *ids,
                                 const fact_kv_meta *const *metas, const int32_t *const *tokens,
                                 const void *const *k, const void *const *v, is_status *status) {
    if (n <= 0) return IS_OK;
    if (!ids || !metas || !tokens || !k || !v)
        return is_error_set(IS_ERR_INVALID_ARG, "record store: put of NULL arrays");
    put_item *it = calloc((size_t)n, sizeof *it);
    if (!it) {
        is_status st = is_error_set(IS_ERR_NOMEM, "record store: out of memory");
        for (int32_t i = 0; status && i < n; i++) status[i] = st;
        return st;
    }
    /* The records are written from the caller's sections, never assembled:
     * a record is megabytes, and new memory for it costs its zero-fill and a
     * copy before the file's own copy into the page cache. */
    is_status st = IS_OK;
    for (int32_t i = 0; i < n && st == IS_OK; i++) {
        it[i].fd = -1;
        if ((st = check_id(ids[i])) == IS_OK)
            st = fact_record_encode_pieces(metas[i], tokens[i], k[i], v[i], &it[i].head,
                                           it[i].pieces, &it[i].len);
    }
    if (st != IS_OK) {
        for (int32_t i = 0; status && i < n; i++) status[i] = st;
        items_free(it, n);
        return st;
    }

    pthread_mutex_lock(&s->mu);
    uint64_t counter = s->tmp_counter;
    s->tmp_counter += (uint64_t)n;
    record_store_fault_fn fault = s->fault;
    void *fault_user = s->fault_user;
    pthread_mutex_unlock(&s->mu);

    for (int32_t i = 0; i < n; i++) {
        put_item *p = &it[i];
        snprintf(p->tmp, sizeof p->tmp, "%s" RS_TMP_MARK "%ld.%llu", ids[i], (long)getpid(),
                 (unsigned long long)(counter + (uint64_t)i));
        final_name(p->name, ids[i]);
        /* Read-write: the cache maps the file through this descriptor. */
        if (!step_ok(fault, fault_user, RECORD_STORE_STEP_CREATE) ||
            (p->fd = openat(s->dir_fd, p->tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0) {
            st = batch_fail(s, it, 0, n, "create", p->tmp, status);
            goto out;
        }
        p->created = true;
    }
    /* The files are written in parallel: copying megabytes into the page
     * cache is the cost, and it scales with cores. Each half of every
     * record is one pass; the fault hook is asked about every write of a
     * pass first, in order, so an injected failure (or crash) is the same
     * whatever the threads do, and one at the second half finds every
     * record half written. */
    for (int pass = 0; pass < 2; pass++) {
        record_store_step step = pass ? RECORD_STORE_STEP_WRITE_REST : RECORD_STORE_STEP_WRITE;
        for (int32_t i = 0; i < n; i++) {
            if (!step_ok(fault, fault_user, step)) {
                st = batch_fail(s, it, 0, n, "write", it[i].tmp, status);
                goto out;
            }
        }
        write_pass_run(it, n, pass);
        for (int32_t i = 0; i < n; i++) {
            if (it[i].write_errno) {
                errno = it[i].write_errno;
                st = batch_fail(s, it, 0, n, "write", it[i].tmp, status);
                goto out;
            }
        }
    }
    for (int32_t i = 0; i < n; i++) {
        put_item *p = &it[i];
        if (!step_ok(fault, fault_user, RECORD_STORE_STEP_FSYNC) || fsync(p->fd) != 0) {
            st = batch_fail(s, it, 0, n, "fsync", p->tmp, status);
            goto out;
        }
    }
    for (int32_t i = 0; i < n; i++) {
        it[i].e = map_written(s, ids[i], it[i].fd, it[i].len);
        int rc = close(it[i].fd);
        it[i].fd = -1;
        if (rc != 0) {
            st = batch_fail(s, it, 0, n, "close", it[i].tmp, status);
            goto out;
        }
    }

    /* The renames and the cache updates happen together under the mutex, so
     * concurrent puts and deletes of one id leave cache and disk agreeing. */
    pthread_mutex_lock(&s->mu);
    int32_t renamed = 0;
    uint64_t batch = ++s->batch_counter;
    for (; renamed < n; renamed++) {
        put_item *p = &it[renamed];
        if (!step_ok(fault, fault_user, RECORD_STORE_STEP_RENAME) ||
            renameat(s->dir_fd, p->tmp, s->dir_fd, p->name) != 0)
            break;
        s->generation++;
        rs_entry *old = cache_find(s, ids[renamed]);
        if (old) cache_drop(s, old);
        rs_disk *d = disk_touch(s, ids[renamed], p->len);
        if (d) d->batch = batch;
        if (p->e) {
            cache_insert(s, p->e);
            if (!p->e->cached) entry_destroy(p->e);
            p->e = NULL;
        }
        if (status) status[renamed] = IS_OK;
    }
    int err = errno;
    disk_evict(s, batch);
    pthread_mutex_unlock(&s->mu);
    if (renamed < n) {
        errno = err;
        st = batch_fail(s, it, renamed, n, "rename", it[renamed].tmp, status);
    }
    if (renamed > 0 &&
        (!step_ok(fault, fault_user, RECORD_STORE_STEP_DIR_FSYNC) || fsync(s->dir_fd) != 0)) {
        is_status dst =
            n == 1 ? is_error_set(IS_ERR_IO,
                                  "record store: fsync of directory %s failed after writing %s: "
                                  "the record may not survive a crash",
                                  s->dir, it[0].name)
                   : is_error_set(IS_ERR_IO,
                                  "record store: fsync of directory %s failed after writing %d "
                                  "records: they may not survive a crash",
                                  s->dir, (int)renamed);
        for (int32_t i = 0; status && i < renamed; i++) status[i] = dst;
        if (st == IS_OK) st = dst;
    }
out:
    items_free(it, n);
    return st;
}

/* ---- get / release --------------------------------------------------------------------- */

/* Opens <id>.fkv for reading: its descriptor and size (not empty), or the
 * error that names it. */
/* A read found the file `name` (the one fstat'd as *read) corrupt: it goes
 * to RECORD_STORE_CORRUPT_DIR unless a put has renamed another file over it
 * since (puts rename under the mutex, so the check and the move cannot
 * interleave with one). Best effort: a failed move leaves it where it was,
 * and the read reports the corruption either way. */
static void set_aside_corrupt(record_store *s, const char *id, const char *name,
                              const struct stat *read) {
    char to[RS_NAME_CAP + sizeof RECORD_STORE_CORRUPT_DIR + 1];
    snprintf(to, sizeof to, "%s/%s", RECORD_STORE_CORRUPT_DIR, name);
    struct stat now;
    pthread_mutex_lock(&s->mu);
    int rc = fstatat(s->dir_fd, name, &now, AT_SYMLINK_NOFOLLOW);
    if (rc == 0 && now.st_dev == read->st_dev && now.st_ino == read->st_ino) {
        rc = mkdirat(s->dir_fd, RECORD_STORE_CORRUPT_DIR, 0755);
        if (rc != 0 && errno == EEXIST) rc = 0;
        if (rc == 0) rc = renameat(s->dir_fd, name, s->dir_fd, to);
        if (rc == 0) {
            s->generation++;
            rs_entry *e = cache_find(s, id);
            if (e) cache_drop(s, e);
            disk_gone(s, id);
            s->stats.n_corrupt++;
        }
    } else {
        rc = -1;
    }
    pthread_mutex_unlock(&s->mu);
    if (rc == 0) (void)fsync(s->dir_fd);
}

static is_status open_record(record_store *s, const char *id, char name[RS_NAME_CAP], int *fd_out,
                             struct stat *sb) {
    final_name(name, id);
    int fd = openat(s->dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return is_error_set(IS_ERR_NOT_FOUND, "record store: no record '%s' in %s", id, s->dir);
        return is_error_set(IS_ERR_IO, "record store: cannot open %s/%s: %s", s->dir, name,
                            strerror(errno));
    }
    if (fstat(fd, sb) != 0) {
        int err = errno;
        close(fd);
        return is_error_set(IS_ERR_IO, "record store: cannot stat %s/%s: %s", s->dir, name,
                            strerror(err));
    }
    if (sb->st_size <= 0) {
        set_aside_corrupt(s, id, name, sb); /* fd open: the inode cannot be reused yet */
        close(fd);
        return is_error_set(IS_ERR_FORMAT, "record store: %s/%s is empty (truncated record)",
                            s->dir, name);
    }
    *fd_out = fd;
    return IS_OK;
}

/* Reads and checks <id>.fkv into a new, uncached entry. */
static is_status load_file(record_store *s, const char *id, rs_entry **out) {
    char name[RS_NAME_CAP];
    struct stat sb;
    int fd = -1;
    is_status ost = open_record(s, id, name, &fd, &sb);
    if (ost != IS_OK) return ost;
    size_t len = (size_t)sb.st_size;
    void *base = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (base == MAP_FAILED)
        return is_error_set(IS_ERR_IO, "record store: cannot map %s/%s: %s", s->dir, name,
                            strerror(err));
    is_status st = entry_create(s, id, base, len, true, out);
    if (st != IS_OK) {
        if (st == IS_ERR_FORMAT) {
            char why[400];
            snprintf(why, sizeof why, "%s", is_error_last());
            /* Still mapped: the file keeps its inode number, which a put
             * renamed over it since could otherwise be given again. */
            set_aside_corrupt(s, id, name, &sb);
            munmap(base, len);
            return is_error_set(st, "record store: %s/%s: %s", s->dir, name, why);
        }
        munmap(base, len);
        return st;
    }
    return IS_OK;
}

static is_status check_expected(const rs_entry *e, const fact_kv_meta *expected) {
    if (!expected) return IS_OK;
    is_status st = fact_meta_check(&e->kv.meta, expected);
    if (st != IS_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", is_error_last());
        return is_error_set(st, "record store: fact '%s' refused: %s", e->id, why);
    }
    return IS_OK;
}

is_status record_store_get(record_store *s, const char *id, const fact_kv_meta *expected,
                           const fact_kv **out) {
    is_status st = check_id(id);
    if (st != IS_OK) return st;
    if (!out) return is_error_set(IS_ERR_INVALID_ARG, "record store: out is NULL");

    pthread_mutex_lock(&s->mu);
    rs_entry *e = cache_find(s, id);
    if (e) {
        s->stats.hits++;
        if ((st = check_expected(e, expected)) == IS_OK) {
            e->refs++;
            s->stats.n_held++;
            lru_unlink(s, e);
            lru_push_front(s, e);
            disk_touch(s, id, e->len);
            *out = &e->kv;
        }
        pthread_mutex_unlock(&s->mu);
        return st;
    }
    s->stats.misses++;
    uint64_t gen = s->generation;
    pthread_mutex_unlock(&s->mu);

    /* Disk I/O and the checksum pass run without the mutex. */
    if ((st = load_file(s, id, &e)) != IS_OK) return st;
    if ((st = check_expected(e, expected)) != IS_OK) {
        entry_destroy(e);
        return st;
    }

    pthread_mutex_lock(&s->mu);
    rs_entry *now = cache_find(s, id);
    if (now && s->generation == gen) {
        /* Another get loaded the same file meanwhile: share its copy. */
        entry_destroy(e);
        e = now;
        lru_unlink(s, e);
        lru_push_front(s, e);
    } else if (!now && s->generation == gen) {
        cache_insert(s, e);
    }
    /* Otherwise a put or delete changed the directory while we read: the
     * caller still gets what the file held when the get started, but it is
     * not cached, since it may be stale. */
    if (s->generation == gen) disk_touch(s, id, e->len);
    e->refs++;
    s->stats.n_held++;
    *out = &e->kv;
    pthread_mutex_unlock(&s->mu);
    return IS_OK;
}

is_status record_store_read_into(record_store *s, const char *id, const fact_kv_meta *expected,
                                 void *(*alloc)(void *ud, size_t len),
                                 void (*release)(void *ud, void *p), void *ud, fact_kv *out,
                                 void **buf, size_t *len) {
    is_status st = check_id(id);
    if (st != IS_OK) return st;
    if (!alloc || !release || !out || !buf || !len)
        return is_error_set(IS_ERR_INVALID_ARG, "record store: read_into needs its buffers");
    char name[RS_NAME_CAP];
    struct stat sb;
    int fd = -1;
    is_status ost = open_record(s, id, name, &fd, &sb);
    if (ost != IS_OK) return ost;
    const size_t n = (size_t)sb.st_size;
    uint8_t *p = alloc(ud, n);
    if (!p) {
        close(fd);
        return is_error_set(IS_ERR_NOMEM, "record store: no buffer for %zu bytes of '%s'", n, id);
    }
    /* A record file is never modified in place (a put renames a new one
     * over it), so this descriptor reads one whole record. It is read in
     * pieces that stay in the CPU's cache, each hashed as it lands, so the
     * checksum does not read the whole record from memory a second time. */
    enum { PIECE = 256 << 10 };
    fact_record_sum sum;
    fact_record_sum_init(&sum);
    size_t at = 0;
    while (at < n) {
        const size_t want = n - at < PIECE ? n - at : PIECE;
        ssize_t r = pread(fd, p + at, want, (off_t)at);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        fact_record_sum_feed(&sum, p, at, at + (size_t)r);
        at += (size_t)r;
    }
    int err = errno;
    if (at < n) {
        close(fd);
        release(ud, p);
        return is_error_set(IS_ERR_IO, "record store: cannot read %s/%s: %s", s->dir, name,
                            err ? strerror(err) : "short read");
    }
    fact_kv kv = {0};
    st = fact_record_parse_summed(p, n, &sum, &kv.meta, &kv.tokens, &kv.k, &kv.v);
    if (st == IS_ERR_FORMAT) set_aside_corrupt(s, id, name, &sb);
    close(fd); /* after the set-aside's inode check (see load_file) */
    if (st == IS_OK && expected) st = fact_meta_check(&kv.meta, expected);
    if (st != IS_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", is_error_last());
        release(ud, p);
        return is_error_set(st, "record store: %s/%s: %s", s->dir, name, why);
    }
    kv.content_id = fact_record_content_id(p);
    pthread_mutex_lock(&s->mu);
    s->stats.misses++;
    /* Only a file still there: one deleted or set aside meanwhile (its
     * entry kept by a pin) is not on disk, and one put since has its own size. */
    rs_disk *d = disk_find(s, id);
    if (d && d->on_disk) disk_touch(s, id, d->bytes);
    pthread_mutex_unlock(&s->mu);
    *out = kv;
    *buf = p;
    *len = n;
    return IS_OK;
}

void record_store_release(record_store *s, const fact_kv *kv) {
    if (!kv) return;
    rs_entry *e = (rs_entry *)kv; /* kv is the entry's first member */
    pthread_mutex_lock(&s->mu);
    IS_ASSERT(e->store == s); /* released to the store it came from */
    IS_ASSERT(e->refs > 0);
    e->refs--;
    s->stats.n_held--;
    bool destroy = e->refs == 0 && !e->cached;
    pthread_mutex_unlock(&s->mu);
    if (destroy) entry_destroy(e);
}

/* ---- delete / contains ------------------------------------------------------------------ */

is_status record_store_delete(record_store *s, const char *id) {
    is_status st = check_id(id);
    if (st != IS_OK) return st;
    char name[RS_NAME_CAP];
    final_name(name, id);
    pthread_mutex_lock(&s->mu);
    s->generation++;
    rs_entry *e = cache_find(s, id);
    if (e) cache_drop(s, e);
    int rc = unlinkat(s->dir_fd, name, 0);
    int err = errno;
    disk_gone(s, id);
    pthread_mutex_unlock(&s->mu);
    if (rc != 0) {
        if (err == ENOENT)
            return is_error_set(IS_ERR_NOT_FOUND, "record store: no record '%s' in %s", id, s->dir);
        return is_error_set(IS_ERR_IO, "record store: cannot remove %s/%s: %s", s->dir, name,
                            strerror(err));
    }
    if (fsync(s->dir_fd) != 0)
        return is_error_set(IS_ERR_IO, "record store: fsync of directory %s failed: %s", s->dir,
                            strerror(errno));
    return IS_OK;
}

is_status record_store_set_aside(record_store *s, const char *id) {
    is_status st = check_id(id);
    if (st != IS_OK) return st;
    char name[RS_NAME_CAP], aside[RS_NAME_CAP + sizeof RECORD_STORE_ASIDE_DIR + 1];
    final_name(name, id);
    snprintf(aside, sizeof aside, "%s/%s", RECORD_STORE_ASIDE_DIR, name);
    pthread_mutex_lock(&s->mu);
    s->generation++;
    rs_entry *e = cache_find(s, id);
    if (e) cache_drop(s, e);
    int rc = mkdirat(s->dir_fd, RECORD_STORE_ASIDE_DIR, 0755);
    if (rc != 0 && errno == EEXIST) rc = 0;
    if (rc == 0) rc = renameat(s->dir_fd, name, s->dir_fd, aside);
    int err = errno;
    if (rc == 0) disk_gone(s, id);
    pthread_mutex_unlock(&s->mu);
    if (rc != 0) {
        if (err == ENOENT)
            return is_error_set(IS_ERR_NOT_FOUND, "record store: no record '%s' in %s", id, s->dir);
        return is_error_set(IS_ERR_IO, "record store: cannot move %s/%s to %s/%s: %s", s->dir, name,
                            s->dir, aside, strerror(err));
    }
    if (fsync(s->dir_fd) != 0)
        return is_error_set(IS_ERR_IO, "record store: fsync of directory %s failed: %s", s->dir,
                            strerror(errno));
    return IS_OK;
}

void record_store_set_model(record_store *s, const fact_kv_meta *model) {
    pthread_mutex_lock(&s->mu);
    s->has_model = model != NULL;
    if (model) s->model = *model;
    pthread_mutex_unlock(&s->mu);
}

/* Whether the file of `id` exists and, if want is not NULL, its header
 * names want's model: one read of the header, not of the record. */
static bool file_holds(record_store *s, const char *id, const fact_kv_meta *want) {
    char name[RS_NAME_CAP];
    final_name(name, id);
    if (!want) return faccessat(s->dir_fd, name, F_OK, 0) == 0;
    int fd = openat(s->dir_fd, name, O_RDONLY | O_CLOEXEC);
    /* Only a missing file is missing: a failed open (no descriptors left)
     * is the read's to report, as for a header that does not parse. */
    if (fd < 0) return errno != ENOENT;
    uint8_t head[FACT_RECORD_HEADER_BYTES];
    ssize_t got = pread(fd, head, sizeof head, 0);
    close(fd);
    fact_kv_meta meta;
    /* A header that does not parse is a corrupt file: a get sets it aside,
     * so it is counted, to be read (and then encoded again) the usual way. */
    if (got != (ssize_t)sizeof head || fact_record_parse_header(head, sizeof head, &meta) != IS_OK)
        return true;
    return fact_meta_same_model(&meta, want);
}

bool record_store_contains(record_store *s, const char *id) {
    if (!record_store_id_valid(id)) return false;
    pthread_mutex_lock(&s->mu);
    const rs_entry *e = cache_find(s, id);
    bool cached = e != NULL, has_model = s->has_model;
    bool usable = cached && (!has_model || fact_meta_same_model(&e->kv.meta, &s->model));
    fact_kv_meta want = s->model;
    pthread_mutex_unlock(&s->mu);
    if (cached) return usable;
    return file_holds(s, id, has_model ? &want : NULL);
}

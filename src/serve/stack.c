/*
 * stack: one set-up of embedder, memory service and KV encoder (stack.h).
 */
#include "serve/stack.h"

#include "core/status.h"
#include "core/threads.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

stack_params stack_default_params(void) {
    return (stack_params){.backend = "cpu", .dtype = KV_DTYPE_F16};
}

/* The last component of a folder path, trailing slashes ignored. */
static void folder_name(const char *dir, char *out, size_t cap) {
    size_t l = strlen(dir);
    while (l > 1 && dir[l - 1] == '/') l--;
    size_t b = l;
    while (b > 0 && dir[b - 1] != '/') b--;
    snprintf(out, cap, "%.*s", (int)(l - b), dir + b);
}

is_status stack_embedder_open(const char *dir, bool optional, int32_t n_threads, embedder **out,
                              char *name, size_t cap) {
    *out = NULL;
    snprintf(name, cap, "none");
    const char *edir = dir ? dir : STACK_DEFAULT_EMBEDDER;
    if (strcmp(edir, "none") == 0) return IS_OK;
    struct stat sb;
    if (stat(edir, &sb) != 0) {
        if (!dir && optional) return IS_OK;
        return is_error_set(IS_ERR_NOT_FOUND,
                            "embedding model '%s' not found (scripts/fetch_embedder.sh "
                            "fetches it; 'none' for BM25 retrieval only)",
                            edir);
    }
    is_status st = embedder_load(edir, out);
    if (st != IS_OK) return st;
    if (n_threads) embedder_set_n_threads(*out, n_threads);
    threads_init(n_threads); /* BLAS's count, once for the process */
    folder_name(edir, name, cap);
    return IS_OK;
}

is_status stack_model_load(const char *path, backend *be, model **out) {
    is_status st = model_load(path, be, out);
    if (st != IS_OK) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s", is_error_last());
        return is_error_set(st, "cannot load model '%s': %s", path, msg);
    }
    return IS_OK;
}

static is_status open_model(stack *s, const stack_params *p) {
    is_status st = backend_create(p->backend, p->n_threads, &s->be);
    if (st != IS_OK) return st;
    if ((st = stack_model_load(p->model_path, s->be, &s->model)) != IS_OK) return st;
    engine_params ep = engine_default_params();
    /* The serving prefix, an encoding (or a batch of them) and an answer. */
    ep.max_seqs = 2 + (p->encode_batch > 0 ? p->encode_batch : 1);
    ep.n_ctx = s->model->cfg.n_ctx_train;
    if ((st = engine_create(s->model, ep, &s->eng)) != IS_OK) return st;
    if ((st = ask_ctx_create(s->eng, memory_record_store(s->mem), p->dtype, &s->ask)) != IS_OK)
        return st;
    if (p->encode_batch <= 0) memory_set_encoder(s->mem, ask_memory_encoder, s->ask);
    return IS_OK;
}

is_status stack_open(const stack_params *p, stack **out) {
    if (!p || !p->data_dir || !*p->data_dir || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "stack_open: needs a data directory");
    stack *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    is_status st = IS_OK;
    if ((st = stack_embedder_open(p->embedder_dir, p->embedder_optional, p->n_threads, &s->emb,
                                  s->embed_name, sizeof s->embed_name)) != IS_OK)
        goto fail;
    if (mkdir(p->data_dir, 0755) != 0 && errno != EEXIST) {
        st = is_error_set(IS_ERR_IO, "cannot create data directory '%s': %s", p->data_dir,
                          strerror(errno));
        goto fail;
    }
    memory_params mp = memory_default_params();
    mp.embedder = s->emb;
    mp.embed_name = s->embed_name;
    mp.kv_window = p->window;
    mp.gpu_retrieval = p->gpu_retrieval;
    mp.gpu_device = p->gpu_device;
    mp.store_url = p->store_url;
    if ((st = memory_open(p->data_dir, &mp, &s->mem, &s->report)) != IS_OK) goto fail;
    if (p->model_path && (st = open_model(s, p)) != IS_OK) goto fail;
    *out = s;
    return IS_OK;
fail:
    stack_close(s);
    return st;
}

/* mkdir -p: the folder and its missing parents. */
static is_status make_dirs(const char *dir) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s", dir) >= (int)sizeof tmp)
        return is_error_set(IS_ERR_INVALID_ARG, "folder name too long: '%.64s...'", dir);
    for (char *q = tmp + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        mkdir(tmp, 0755);
        *q = '/';
    }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
        return is_error_set(IS_ERR_IO, "cannot create directory '%s': %s", dir, strerror(errno));
    return IS_OK;
}

is_status stack_open_records(const stack_records_params *p, stack **out) {
    if (!p || !p->model_path || !p->records_dir || !*p->records_dir || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "stack_open_records: needs a model and a folder");
    stack *s = calloc(1, sizeof *s);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    snprintf(s->embed_name, sizeof s->embed_name, "none");
    is_status st = backend_create(p->backend ? p->backend : "cpu", p->n_threads, &s->be);
    if (st == IS_OK) st = stack_model_load(p->model_path, s->be, &s->model);
    if (st == IS_OK) {
        engine_params ep = engine_default_params();
        ep.max_seqs = 3; /* the serving prefix, an encoding, an answer */
        ep.n_ctx = s->model->cfg.n_ctx_train;
        if (p->n_ctx_max > 0 && ep.n_ctx > p->n_ctx_max) ep.n_ctx = p->n_ctx_max;
        st = engine_create(s->model, ep, &s->eng);
    }
    if (st == IS_OK) st = make_dirs(p->records_dir);
    if (st == IS_OK) st = record_store_open(p->records_dir, p->cache_bytes, &s->rs);
    if (st == IS_OK) st = ask_ctx_create(s->eng, s->rs, p->dtype, &s->ask);
    if (st != IS_OK) {
        stack_close(s);
        return st;
    }
    *out = s;
    return IS_OK;
}

void stack_close(stack *s) {
    if (!s) return;
    memory_close(s->mem); /* before the ask context: no encoding can be running */
    ask_ctx_free(s->ask);
    if (s->rs) record_store_close(s->rs);
    engine_free(s->eng);
    model_free(s->model);
    if (s->be) s->be->ops->free(s->be);
    embedder_free(s->emb);
    free(s);
}

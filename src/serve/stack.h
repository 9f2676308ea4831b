/*
 * stack: the memory stack that the CLI's commands and the public memory
 * API (include/inferscale.h, is_memory_*) set up alike, in one place: the
 * sentence embedder (by folder; its folder name identifies it in the
 * store), the memory service over a data directory (memory/memory.h) and,
 * with a model, the served model's KV encoder and answering context
 * (backend, model, engine, serve/ask.h) wired into the service. One place,
 * so that the defaults, the error messages and the order of freeing are
 * the same for every caller.
 *
 * What stays with the caller: what to print about the open report
 * (orphans, repairs, facts without KV) and whether to encode the missing
 * KV now (memory_encode_missing, with a progress callback).
 *
 * The pieces stand alone too, for callers that set up more or less:
 * stack_embedder_open and stack_model_load (the server, serve/http/app.c,
 * which sizes its own engine and scheduler), and stack_open_records, the
 * answering half over a record store of its own, for tools that keep
 * their facts themselves (`ask`, `eval`).
 */
#ifndef IS_SERVE_STACK_H
#define IS_SERVE_STACK_H

#include "backend/backend.h"
#include "engine/engine.h"
#include "inferscale.h"
#include "kv/fact_record.h"
#include "memory/embedder.h"
#include "memory/memory.h"
#include "model/model.h"
#include "serve/ask.h"

#include <stdbool.h>
#include <stdint.h>

/* The embedding model a stack loads when none is named. */
#define STACK_DEFAULT_EMBEDDER "models/all-MiniLM-L6-v2"

typedef struct stack_params {
    const char *data_dir;     /* required: created if missing (not its parents) */
    const char *embedder_dir; /* NULL: STACK_DEFAULT_EMBEDDER; "none": BM25 retrieval only */
    const char *model_path;   /* NULL: facts are stored without KV, and no ask context */
    const char *backend;      /* the model's backend: "cpu" (default) or "cuda" */
    int32_t n_threads;        /* CPU threads; 0 = all cores */
    kv_dtype dtype;           /* precision of the KV records written (default f16) */
    int32_t window;           /* context turns encoded with a fact added without its own */
    /* 0: every fact added is encoded at once (the memory service's encoder);
     * N > 0: adds only store, and the caller encodes the missing KV N facts
     * a forward (serve/encoder.h's encoder_encode_missing over `ask`). */
    int32_t encode_batch;
    bool gpu_retrieval; /* dense search on the GPU (memory_params.gpu_retrieval) */
    int32_t gpu_device;
    const char *store_url; /* the fact store (memory_params.store_url): NULL for SQLite */
    /* embedder_dir NULL and STACK_DEFAULT_EMBEDDER missing: BM25 only (emb
     * NULL) instead of IS_ERR_NOT_FOUND. */
    bool embedder_optional;
} stack_params;

stack_params stack_default_params(void);

typedef struct stack {
    embedder *emb;    /* NULL: BM25 only */
    memory *mem;      /* NULL for stack_open_records */
    record_store *rs; /* stack_open_records: the record store it owns (else NULL: the memory's) */
    backend *be;      /* these four NULL without a model */
    model *model;
    engine *eng;
    ask_ctx *ask;
    char embed_name[256];      /* the embedder's name in the store ("none") */
    memory_open_report report; /* what memory_open found */
} stack;

/* Opens the stack. IS_ERR_NOT_FOUND: the embedder folder does not exist
 * (the message says how to fetch it, or to pass "none"); the errors of
 * embedder_load, memory_open, backend_create, model_load, engine_create and
 * ask_ctx_create otherwise, with a message naming the file. *out unchanged
 * on failure (nothing stays open). */
is_status stack_open(const stack_params *p, stack **out);

/* Closes the memory service first (no encoding can be running after), then
 * the rest. NULL is a no-op. */
void stack_close(stack *s);

/* ---- the pieces -------------------------------------------------------------- */

/* The sentence embedder in `dir` (NULL: STACK_DEFAULT_EMBEDDER; "none": no
 * embedder, *out NULL). With `optional`, a missing default (dir NULL) is
 * no error either: *out NULL, BM25 retrieval only. Its folder name (how a
 * store names the embedder its vectors came from; "none") into
 * name[cap]. n_threads > 0 sets its threads; BLAS gets n_threads (0: all
 * cores) once for the process. IS_ERR_NOT_FOUND: the folder does not exist
 * (the message says how to fetch it, or to pass "none"); embedder_load's
 * errors otherwise. *out NULL on failure. */
is_status stack_embedder_open(const char *dir, bool optional, int32_t n_threads, embedder **out,
                              char *name, size_t cap);

/* Loads the GGUF model on `be`. A failure's message names the file
 * ("cannot load model 'PATH': why"); model_load's status, *out unchanged. */
is_status stack_model_load(const char *path, backend *be, model **out);

typedef struct stack_records_params {
    const char *model_path;  /* required */
    const char *backend;     /* "cpu" (default) or "cuda" */
    int32_t n_threads;       /* CPU threads; 0 = all cores */
    int32_t n_ctx_max;       /* the engine's context: the model's training context, at most
                                this (0: no cap) */
    const char *records_dir; /* required: the record store, created with its parents */
    size_t cache_bytes;      /* the record store's cache */
    kv_dtype dtype;          /* precision of the records written */
} stack_records_params;

/* A stack without a memory service (emb and mem NULL): backend, model,
 * an engine of three sequences (serving prefix, an encoding, an answer),
 * the record store in records_dir (owned: rs) and the ask context that
 * writes and reads it. IS_ERR_INVALID_ARG, IS_ERR_IO (a folder cannot be
 * created), the errors of backend_create, stack_model_load, engine_create,
 * record_store_open and ask_ctx_create. *out unchanged on failure. */
is_status stack_open_records(const stack_records_params *p, stack **out);

#endif

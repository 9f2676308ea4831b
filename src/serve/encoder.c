#include "serve/encoder.h"

#include "core/status.h"

#include <stdlib.h>
#include <string.h>

is_status encoder_batch_fn(void *ud, record_store *store, const memory_encode_job *jobs, int32_t n,
                           is_status *status) {
    const encoder_params *p = ud;
    if (!p || !p->ask || store != ask_ctx_store(p->ask)) {
        is_status st = is_error_set(IS_ERR_INVALID_ARG, "encoder: the memory's record store is not "
                                                        "the one the ask context writes to");
        for (int32_t i = 0; i < n; i++) status[i] = st;
        return st;
    }
    if (n <= 0) return IS_OK;
    ask_fact *f = malloc((size_t)n * sizeof *f);
    int32_t *w = malloc((size_t)n * sizeof *w);
    bool *did = malloc((size_t)n * sizeof *did);
    if (!f || !w || !did) {
        free(f), free(w), free(did);
        is_status st = is_error_set(IS_ERR_NOMEM, "out of memory");
        for (int32_t i = 0; i < n; i++) status[i] = st;
        return st;
    }
    for (int32_t i = 0; i < n; i++) {
        f[i] = (ask_fact){jobs[i].record_id, jobs[i].text, jobs[i].context, jobs[i].n_context};
        w[i] = jobs[i].window;
    }
    is_status st = ask_encode_facts(p->ask, f, w, n, p->max_tokens, status, did);
    free(f), free(w), free(did);
    return st;
}

is_status encoder_run(memory *mem, const encoder_params *p, const memory_fact_ref *refs, int32_t n,
                      is_status *status, bool *encoded) {
    return memory_encode_batch(mem, refs, n, encoder_batch_fn, (void *)p, status, encoded);
}

void encoder_run_for_request(memory *mem, const encoder_params *p, const memory_fact_ref *refs,
                             const uint64_t *text_hash, int32_t n, char **record, bool *encoded,
                             int64_t *n_failed) {
    if (n_failed) *n_failed = 0;
    for (int32_t i = 0; i < n; i++) record[i] = NULL, encoded[i] = false;
    is_status *sts = n > 0 ? malloc((size_t)n * sizeof *sts) : NULL;
    if (!sts) return; /* nothing to do, or out of memory: the facts go as text */
    encoder_run(mem, p, refs, n, sts, encoded);
    for (int32_t i = 0; i < n; i++) {
        if (sts[i] != IS_OK) {
            encoded[i] = false;
            if (n_failed && sts[i] != IS_ERR_NOT_FOUND && sts[i] != IS_ERR_CONTEXT_FULL)
                (*n_failed)++;
            continue;
        }
        /* The row names the record now: the name it had, or the one the
         * first encoding of this version gave it. */
        mem_fact row;
        if (memory_get(mem, refs[i].tenant, refs[i].user, refs[i].id, &row) != IS_OK) {
            encoded[i] = false;
            continue;
        }
        if (row.kv_record && fact_text_hash(row.text, strlen(row.text)) == text_hash[i])
            record[i] = strdup(row.kv_record);
        if (!record[i]) encoded[i] = false;
        mem_fact_clear(&row);
    }
    is_error_clear(); /* the facts' failures are theirs: they go as text */
    free(sts);
}

is_status encoder_encode_missing(memory *mem, const encoder_params *p, int32_t batch,
                                 memory_progress_fn progress, void *ud, int64_t *n_encoded) {
    if (n_encoded) *n_encoded = 0;
    if (batch <= 0) batch = ENCODER_MAX_FACTS;
    memory_fact_ref *refs = NULL;
    int64_t n = 0, done = 0;
    is_status st = memory_list_missing(mem, &refs, &n);
    is_status *sts = st == IS_OK ? malloc((size_t)batch * sizeof *sts) : NULL;
    bool *did = st == IS_OK ? malloc((size_t)batch * sizeof *did) : NULL;
    if (st == IS_OK && (!sts || !did)) st = is_error_set(IS_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; st == IS_OK && i < n; i += batch) {
        int32_t nb = n - i < batch ? (int32_t)(n - i) : batch;
        st = encoder_run(mem, p, refs + i, nb, sts, did);
        for (int32_t j = 0; j < nb; j++) done += did[j];
        if (progress) progress(i + nb, n, ud);
    }
    if (n_encoded) *n_encoded = done;
    memory_fact_refs_free(refs, n);
    free(sts);
    free(did);
    return st;
}

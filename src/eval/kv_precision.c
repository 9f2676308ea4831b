/*
 * kv_precision: fact-KV record dtypes against f32 records (see
 * kv_precision.h).
 */
#include "eval/kv_precision.h"

#include "core/status.h"
#include "eval/nll_stats.h"
#include "eval/teacher.h"
#include "kv/record_store.h"
#include "model/model.h"
#include "serve/ask.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The f32 record `id` of `src` narrowed to dst's dtype and stored in dst
 * (what ask_encode_fact stores in that dtype: it narrows the same capture). */
static is_status copy_narrowed(record_store *src, record_store *dst, kv_dtype dtype,
                               const char *id) {
    const fact_kv *kv;
    is_status st = record_store_get(src, id, NULL, &kv);
    if (st != IS_OK) return st;
    fact_kv_meta m = kv->meta;
    m.dtype = dtype;
    const size_t n = (size_t)m.n_layers * m.n_tokens * fact_kv_row_elems(&m);
    void *k = malloc(fact_kv_bytes(&m)), *v = malloc(fact_kv_bytes(&m));
    float *kf = malloc(n * sizeof(float)), *vf = malloc(n * sizeof(float));
    if (!k || !v || !kf || !vf) {
        st = is_error_set(IS_ERR_NOMEM, "kv_precision: out of memory");
    } else {
        /* Records need no alignment; the f32 arrays do. */
        memcpy(kf, kv->k, n * sizeof(float));
        memcpy(vf, kv->v, n * sizeof(float));
        fact_kv_narrow(&m, kf, k);
        fact_kv_narrow(&m, vf, v);
        st = record_store_put(dst, id, &m, kv->tokens, k, v);
    }
    record_store_release(src, kv);
    free(k);
    free(v);
    free(kf);
    free(vf);
    return st;
}

is_status kv_precision_run(engine *e, const locomo_conv *conv, const kv_precision_params *p,
                           const char *tmp_dir, kv_precision_row rows[KV_DTYPE_COUNT]) {
    if (!e || !conv || !p || !tmp_dir || !rows || p->k < 1 || p->n_questions < 1 ||
        p->fact_stride < 0)
        return is_error_set(IS_ERR_INVALID_ARG, "kv_precision: bad arguments");
    if (conv->n_facts < p->k)
        return is_error_set(IS_ERR_INVALID_ARG, "kv_precision: %d facts, fewer than k = %d",
                            conv->n_facts, p->k);
    const model *mdl = engine_model(e);
    const int32_t n_vocab = mdl->cfg.n_vocab;
    record_store *store[KV_DTYPE_COUNT] = {0};
    ask_ctx *ac[KV_DTYPE_COUNT] = {0};
    float *logits = malloc((size_t)KV_DTYPE_COUNT * n_vocab * sizeof(float));
    float *lp = malloc(2 * (size_t)n_vocab * sizeof(float));
    char(*ids)[24] = calloc((size_t)p->k, sizeof *ids);
    const char **idp = calloc((size_t)p->k, sizeof *idp);
    const char **ctx = calloc((size_t)(p->window > 0 ? p->window : 1), sizeof *ctx);
    bool *encoded = calloc((size_t)conv->n_facts, sizeof *encoded);
    double sum_kl[KV_DTYPE_COUNT] = {0}, sum_dnll[KV_DTYPE_COUNT] = {0};
    is_status st = IS_OK;
    if (!logits || !lp || !ids || !idp || !ctx || !encoded)
        st = is_error_set(IS_ERR_NOMEM, "kv_precision: out of memory");
    memset(rows, 0, sizeof(kv_precision_row) * KV_DTYPE_COUNT);
    for (int d = 0; d < KV_DTYPE_COUNT && st == IS_OK; d++) {
        rows[d].dtype = (kv_dtype)d;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", tmp_dir, kv_dtype_name((kv_dtype)d));
        if (mkdir(dir, 0700) != 0) {
            st = is_error_set(IS_ERR_IO, "kv_precision: cannot create %s", dir);
            break;
        }
        st = record_store_open(dir, (size_t)256 << 20, &store[d]);
        if (st == IS_OK) st = ask_ctx_create(e, store[d], (kv_dtype)d, &ac[d]);
    }
    int32_t scored = 0;
    for (int32_t qi = 0; qi < conv->n_questions && scored < p->n_questions && st == IS_OK; qi++) {
        const locomo_question *q = &conv->questions[qi];
        if (!q->answer || !q->answer[0]) continue;
        const int32_t first =
            (int32_t)(((int64_t)p->fact_stride * scored) % (conv->n_facts - p->k + 1));
        for (int32_t i = 0; i < p->k && st == IS_OK; i++) {
            const int32_t fi = first + i;
            snprintf(ids[i], sizeof ids[i], "fact%d", fi);
            idp[i] = ids[i];
            if (encoded[fi]) continue;
            const locomo_fact *f = &conv->facts[fi];
            int32_t nc = locomo_fact_context(conv, f, p->window, ctx);
            ask_fact af = {ids[i], f->text, ctx, nc};
            bool did;
            st = ask_encode_fact(ac[KV_DTYPE_F32], &af, p->window, &did);
            for (int d = 1; d < KV_DTYPE_COUNT && st == IS_OK; d++)
                st = copy_narrowed(store[KV_DTYPE_F32], store[d], (kv_dtype)d, ids[i]);
            encoded[fi] = st == IS_OK;
        }
        int32_t *ans = NULL, n_ans = 0;
        if (st == IS_OK) st = teacher_answer_tokens(mdl, q->answer, &ans, &n_ans);
        double nll[KV_DTYPE_COUNT];
        for (int d = 0; d < KV_DTYPE_COUNT && st == IS_OK; d++) {
            ask_request r = {.mode = ASK_MODE_KV,
                             .query = q->question,
                             .fact_ids = idp,
                             .n_facts = p->k,
                             .max_tokens = 1,
                             .top_p = 1.0f};
            st = teacher_score_request(e, store[d], ac[d], &r, ans, n_ans, &nll[d],
                                       logits + (size_t)d * n_vocab);
        }
        free(ans);
        if (st != IS_OK) break;
        const float *ref = logits;
        float lo = ref[0], hi = ref[0];
        for (int32_t i = 1; i < n_vocab; i++) {
            lo = fminf(lo, ref[i]);
            hi = fmaxf(hi, ref[i]);
        }
        nll_log_softmax(ref, n_vocab, lp);
        const int32_t top_ref = nll_argmax(ref, n_vocab);
        for (int d = 0; d < KV_DTYPE_COUNT; d++) {
            const float *x = logits + (size_t)d * n_vocab;
            double dmax = 0, d2 = 0, r2 = 0;
            for (int32_t i = 0; i < n_vocab; i++) {
                const double dx = (double)x[i] - ref[i];
                dmax = fmax(dmax, fabs(dx));
                d2 += dx * dx;
                r2 += (double)ref[i] * ref[i];
            }
            nll_log_softmax(x, n_vocab, lp + n_vocab);
            const double kl = nll_kl(lp, lp + n_vocab, n_vocab);
            kv_precision_row *row = &rows[d];
            row->n++;
            row->max_abs_dlogit = fmax(row->max_abs_dlogit, dmax);
            row->max_rel_dlogit = fmax(row->max_rel_dlogit, dmax / fmax((double)hi - lo, 1e-30));
            row->max_rel_l2 = fmax(row->max_rel_l2, sqrt(d2 / fmax(r2, 1e-300)));
            row->max_kl = fmax(row->max_kl, kl);
            sum_kl[d] += kl;
            sum_dnll[d] += fabs(nll[d] - nll[KV_DTYPE_F32]);
            row->top1_agree += nll_argmax(x, n_vocab) == top_ref;
            size_t bytes = 0;
            for (int32_t i = 0; i < p->k; i++) {
                const fact_kv *kv;
                if (record_store_get(store[d], ids[i], NULL, &kv) == IS_OK) {
                    bytes += 2 * fact_kv_bytes(&kv->meta);
                    record_store_release(store[d], kv);
                }
            }
            row->kv_bytes = bytes;
        }
        scored++;
    }
    if (st == IS_OK && scored == 0)
        st = is_error_set(IS_ERR_INVALID_ARG, "kv_precision: no question with a gold answer");
    for (int d = 0; d < KV_DTYPE_COUNT; d++) {
        if (rows[d].n) {
            rows[d].mean_kl = sum_kl[d] / rows[d].n;
            rows[d].mean_abs_dnll = sum_dnll[d] / rows[d].n;
        }
        ask_ctx_free(ac[d]);
        record_store_close(store[d]);
    }
    free(logits);
    free(lp);
    free(ids);
    free(idp);
    free(ctx);
    free(encoded);
    return st;
}

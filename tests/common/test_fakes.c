/*
 * test_fakes: stand-in embedder and encoder of the memory tests (test_fakes.h).
 */
#include "test_fakes.h"

#include "kv/fact_record.h"

#include <ctype.h>
#include <math.h>
#include <string.h>

#ifdef IS_HAVE_LIBPQ
#include <libpq-fe.h>
#endif

void test_bow_embed(const char *const *texts, int32_t n, int32_t dim, float *out) {
    for (int32_t i = 0; i < n; i++) {
        float *e = out + (size_t)i * dim;
        memset(e, 0, (size_t)dim * sizeof(float));
        const char *p = texts[i];
        while (*p) {
            while (*p && !isalnum((unsigned char)*p)) p++;
            uint32_t h = 2166136261u; /* FNV-1a */
            int len = 0;
            while (*p && isalnum((unsigned char)*p)) {
                h = (h ^ (uint32_t)tolower((unsigned char)*p++)) * 16777619u;
                len++;
            }
            if (len) e[h % (uint32_t)dim] += 1.0f;
        }
        double n2 = 0;
        for (int32_t j = 0; j < dim; j++) n2 += (double)e[j] * e[j];
        if (n2 == 0) e[0] = 1.0f, n2 = 1;
        for (int32_t j = 0; j < dim; j++) e[j] = (float)(e[j] / sqrt(n2));
    }
}

is_status test_fake_embed(void *user_data, const char *const *texts, int32_t n, float *out) {
    (void)user_data;
    test_bow_embed(texts, n, TEST_FAKE_DIM, out);
    return IS_OK;
}

void test_fake_meta(fact_kv_meta *m, int32_t n_tokens, int32_t window, const char *hash_text) {
    memset(m, 0, sizeof *m);
    memcpy(m->model_fingerprint, "fa4efa4efa4efa4e", 17);
    m->dtype = KV_DTYPE_F32;
    m->n_layers = 1;
    m->n_kv_heads = 1;
    m->head_dim = 4;
    m->n_tokens = n_tokens;
    m->rope_n_rot = 4;
    m->rope_freq_base = 10000.0f;
    m->rope_freq_scale = 1.0f;
    m->window = window < -1 ? -1 : window;
    m->text_hash = fact_text_hash(hash_text, strlen(hash_text));
}

is_status test_fake_record_put(record_store *rs, const memory_encode_job *job, int32_t tokens0) {
    fact_kv_meta m;
    test_fake_meta(&m, 2, job->window, job->text);
    int32_t tokens[2] = {tokens0, job->window};
    float k[8] = {1, 2, 3, 4, 5, 6, 7, 8}, v[8] = {8, 7, 6, 5, 4, 3, 2, 1};
    return record_store_put(rs, job->record_id, &m, tokens, k, v);
}

bool test_pg_reset(const char *url) {
#ifdef IS_HAVE_LIBPQ
    PGconn *c = PQconnectdb(url);
    PQclear(PQexec(c, "SET client_min_messages = warning"));
    PGresult *r = PQexec(c, "DROP SCHEMA public CASCADE; CREATE SCHEMA public");
    bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    PQfinish(c);
    return ok;
#else
    (void)url;
    return false;
#endif
}

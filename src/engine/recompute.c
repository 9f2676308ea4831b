/*
 * recompute: see recompute.h.
 */
#include "engine/recompute.h"

#include "core/status.h"

#include <math.h>
#include <stdlib.h>

int32_t recompute_first_count(const engine_fact *facts, int32_t n_facts, int32_t m) {
    int32_t total = 0;
    for (int32_t i = 0; i < n_facts && m > 0; i++)
        total += facts[i].n_tokens < m ? facts[i].n_tokens : m;
    return total;
}

int32_t recompute_first_list(const engine_fact *facts, int32_t n_facts, int32_t m, int32_t begin,
                             int32_t *pos, int32_t *toks) {
    int32_t at = 0, off = begin;
    for (int32_t i = 0; i < n_facts; i++) {
        for (int32_t j = 0; j < facts[i].n_tokens && j < m; j++) {
            pos[at] = off + j;
            toks[at++] = facts[i].tokens[j];
        }
        off += facts[i].n_tokens;
    }
    return at;
}

int32_t recompute_blend_count(float ratio, int32_t n) {
    if (!(ratio > 0.0f) || n <= 0) return 0;
    if (ratio >= 1.0f) return n;
    /* The product rounded to float first, so that 0.3 * 10 gives 3, not 4. */
    double want = ceil((double)(float)(ratio * (float)n) - 1e-6);
    return want > n ? n : (int32_t)want;
}

typedef struct ranked {
    float dev;
    int32_t i;
} ranked;

/* Largest deviation first (NaN before any number), then the earlier index. */
static int cmp_ranked(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    bool na = isnan(a->dev), nb = isnan(b->dev);
    if (na != nb) return na ? -1 : 1;
    if (!na && a->dev != b->dev) return a->dev > b->dev ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

is_status recompute_select_top(const float *deviation, int32_t n, float ratio, bool *selected) {
    for (int32_t i = 0; i < n; i++) selected[i] = false;
    int32_t want = recompute_blend_count(ratio, n);
    if (want == 0) return IS_OK;
    ranked *r = malloc((size_t)n * sizeof *r);
    if (!r) return is_error_set(IS_ERR_NOMEM, "recompute: out of memory");
    for (int32_t i = 0; i < n; i++) r[i] = (ranked){deviation[i], i};
    qsort(r, (size_t)n, sizeof *r, cmp_ranked);
    for (int32_t i = 0; i < want; i++) selected[r[i].i] = true;
    free(r);
    return IS_OK;
}

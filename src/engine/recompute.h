/*
 * recompute: which memory tokens a recomputation runs again, the choices
 * the engine's recompute calls (engine.h: engine_recompute, the rewrite
 * field of engine_batch, engine_recompute_blend) leave to arithmetic on
 * the host:
 *   - static: the first m tokens of every fact (each fact's list marker
 *     and date, computed at encoding time as the first item after the
 *     header, read again with the facts before them visible);
 *   - selective (CacheBlend): the share r of the memory's tokens whose
 *     keys and values deviate most from the injected ones.
 */
#ifndef IS_ENGINE_RECOMPUTE_H
#define IS_ENGINE_RECOMPUTE_H

#include "engine/engine.h"

/* Tokens recompute_first_list lists: sum over facts of min(m, n_tokens). */
int32_t recompute_first_count(const engine_fact *facts, int32_t n_facts, int32_t m);

/* The first m tokens of every fact, the facts laid out one after another
 * from position `begin` (as engine_inject lays them out): positions into
 * pos[], tokens into toks[] (recompute_first_count entries each), in
 * increasing position. Returns the count. */
int32_t recompute_first_list(const engine_fact *facts, int32_t n_facts, int32_t m, int32_t begin,
                             int32_t *pos, int32_t *toks);

/* Tokens a ratio selects out of n: ceil(ratio * n) (a ratio in [0, 1]),
 * so that any positive ratio recomputes at least one token. */
int32_t recompute_blend_count(float ratio, int32_t n);

/* selected[i] = whether deviation[i] is among the recompute_blend_count
 * largest of n (NaN counts as largest; between equal deviations the
 * earlier index wins). IS_ERR_NOMEM. */
is_status recompute_select_top(const float *deviation, int32_t n, float ratio, bool *selected);

#endif

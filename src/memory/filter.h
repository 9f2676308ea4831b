/*
 * filter: Mem0's filter language over stored facts, for the routes that
 * list, search and delete by filters (the v2/v3 memory API).
 *
 * A filter is a JSON object. Several keys in one object are ANDed; the
 * logical keys take a list of filter objects:
 *
 *   {"AND": [f, ...]}   {"OR": [f, ...]}   {"NOT": [f, ...]}  (NOT: none matches)
 *
 * Any other key is a field condition, either a scalar (equality) or an
 * object of operators, all of which must hold:
 *
 *   {"user_id": "alice"}
 *   {"agent_id": {"in": ["a", "b"]}}
 *   {"created_at": {"gte": "2024-07-01", "lt": "2024-08-01T12:00:00Z"}}
 *   {"metadata": {"topic": "food", "stars": {"gte": 4}}}
 *   {"run_id": "*"}          (the field is present, whatever its value)
 *
 * operators: eq, ne, in, nin, gt, gte, lt, lte, contains, icontains.
 * Fields: user_id, agent_id, run_id (strings; a fact without the field
 * matches only ne / nin / NOT), created_at, updated_at (ISO 8601 dates or
 * date-times, UTC unless an offset is given, or unix seconds), metadata
 * (an object of metadata keys, each a scalar or an operator object), and
 * any other name is a metadata key too (Mem0's shorthand). Numbers compare
 * as numbers, strings by bytes; contains is a substring test (icontains
 * ignores ASCII case), or membership for a metadata list.
 *
 * Mem0 fields this store does not have (app_id, categories, keywords,
 * expiration_date, memory_ids, ...) are refused by name, never ignored: a
 * filter that silently matched more than asked would widen a delete.
 */
#ifndef IS_MEMORY_FILTER_H
#define IS_MEMORY_FILTER_H

#include "inferscale.h"
#include "memory/store.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct mem_filter_expr mem_filter_expr;

/* Parses the filter in json[0..len) into *out (mem_filter_expr_free).
 * IS_ERR_INVALID_ARG with a message naming the field or operator at fault
 * (is_error_last), IS_ERR_NOMEM. *out is NULL on failure. */
is_status mem_filter_parse(const char *json, size_t len, mem_filter_expr **out);

void mem_filter_expr_free(mem_filter_expr *e);

/* True if fact f satisfies e (f->user NULL: a fact stored without a user). */
bool mem_filter_match(const mem_filter_expr *e, const mem_fact *f);

/* The one user_id every match must have (an equality on user_id that is
 * ANDed at the top), or NULL when matches may belong to several users. A
 * caller scans only that user's facts when it is set. Owned by e. */
const char *mem_filter_user(const mem_filter_expr *e);

/* True if e names at least one of user_id, agent_id or run_id anywhere
 * (the routes that delete require a scope). */
bool mem_filter_has_scope(const mem_filter_expr *e);

/* Parses an ISO 8601 date ("2024-07-01"), date-time ("2024-07-01T10:20:30",
 * optional fraction, "Z" or "+hh:mm") into unix milliseconds. */
bool mem_filter_parse_time(const char *s, int64_t *unix_ms);

#endif

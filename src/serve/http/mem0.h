/*
 * mem0: the routes of Mem0's platform API that the official mem0ai
 * clients call (MemoryClient and AsyncMemoryClient, 1.x and 2.x), beside
 * the /v1/memories routes of memories.c:
 *
 *   GET    /v1/ping/                      key check; org_id, project_id (the tenant)
 *   POST   /v1/memories/, /v3/memories/add/   add (1.x, 2.x)
 *   DELETE /v1/memories/?user_id=|filters=    delete all matching
 *   POST   /v2/memories/, /v3/memories/   list by filters, paginated (count, next, previous)
 *   POST   /v2/memories/search/, /v3/memories/search/   search by filters, top_k, threshold
 *   PUT|DELETE /v1/batch/                 batch update / delete (up to 1000)
 *   GET    /v1/entities/                  users, agents and runs with memories
 *   DELETE /v2/entities/{type}/{name}/    delete an entity's memories
 *
 * Filters are Mem0's language (memory/filter.h). Memories scoped by an
 * agent_id or run_id alone are stored under a user no request can name
 * (HTTP_MEM0_NO_USER) and shown with user_id null. The other routes the
 * clients know (exports, summary, feedback, profiles, projects, webhooks)
 * answer 400 "unsupported_feature" naming the feature, never 404.
 */
#ifndef IS_SERVE_HTTP_MEM0_H
#define IS_SERVE_HTTP_MEM0_H

#include "serve/http/http_internal.h"

#include <stdbool.h>

/* The user of memories added without a user_id (agent or run scope only). */
#define HTTP_MEM0_NO_USER                                                                          \
    "\x1f"                                                                                         \
    "no-user"

/* True if path is one of the routes above that memories.c does not serve. */
bool http_mem0_route(const char *path);

/* Serves a path for which http_mem0_route is true. */
enum MHD_Result http_mem0(http_req *r);

/* Mem0's add (POST /v1/memories/, /v3/memories/add/) and delete-all
 * (DELETE /v1/memories/). */
enum MHD_Result http_mem0_add(http_req *r);
enum MHD_Result http_mem0_delete_all(http_req *r);

/* ---- from memories.c ---------------------------------------------------------------- */

/* A fact in Mem0's shape (user_id null for HTTP_MEM0_NO_USER), with
 * kv_ready from http_fact_kv_ready. */
cJSON *http_fact_json(http_server *srv, const mem_fact *f);

/* The add of memories.c on a body already in its own form (user_id set).
 * owner, when not NULL, replaces the body's user_id after parsing: the
 * agent- and run-only scope's HTTP_MEM0_NO_USER cannot travel through the
 * request parser, which refuses control characters in every id. */
enum MHD_Result http_memories_add_body(http_req *r, const char *body, size_t len,
                                       const char *owner);

#endif

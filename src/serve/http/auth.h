/*
 * auth: API keys and the tenants they stand for.
 *
 * A keys file holds one key per line, "KEY TENANT" separated by spaces or
 * tabs; blank lines and lines starting with '#' are ignored. A key is 8 to
 * 256 printable ASCII characters without spaces; a tenant is 1 to 64
 * characters of [A-Za-z0-9_.-]. Several keys may map to one tenant; a key
 * may appear once. Example:
 *
 *   # key                               tenant
 *   sk-test-0123456789abcdef            acme
 *   sk-test-fedcba9876543210            globex
 *
 * Every memory and every search of a request is scoped to the tenant of
 * its key (DESIGN.md, isolation). Keys are compared in constant time per
 * key, so response times do not reveal how much of a key was right.
 *
 * Immutable after load: any number of threads may look keys up at once.
 */
#ifndef IS_SERVE_HTTP_AUTH_H
#define IS_SERVE_HTTP_AUTH_H

#include "inferscale.h"

#include <stddef.h>
#include <stdint.h>

typedef struct auth_keys auth_keys;

#define AUTH_TENANT_MAX 64

/* Parses the text of a keys file. IS_ERR_FORMAT with a message naming the
 * line (never echoing a key), IS_ERR_NOMEM. An empty file (no keys) is
 * IS_ERR_FORMAT too: a server nobody can call is a mistake. */
is_status auth_keys_parse(const char *text, size_t len, auth_keys **out);

/* Reads and parses a keys file (IS_ERR_IO when unreadable). */
is_status auth_keys_load(const char *path, auth_keys **out);

void auth_keys_free(auth_keys *k);
int32_t auth_keys_count(const auth_keys *k);

/* The tenant of an Authorization header value ("Bearer KEY", the scheme
 * case-insensitive), or NULL when the header is missing, malformed or the
 * key unknown. The string is owned by k. */
const char *auth_tenant(const auth_keys *k, const char *authorization);

/* True if `t` is a valid tenant name. */
int auth_tenant_valid(const char *t);

#endif

#include "serve/http/auth.h"

#include "core/status.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define KEY_MIN 8
#define KEY_MAX 256

typedef struct auth_entry {
    char key[KEY_MAX + 1];
    size_t len;
    char tenant[AUTH_TENANT_MAX + 1];
} auth_entry;

struct auth_keys {
    auth_entry *e;
    int32_t n;
};

int auth_tenant_valid(const char *t) {
    size_t n = strlen(t);
    if (n == 0 || n > AUTH_TENANT_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = t[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return 0;
    }
    return 1;
}

static int key_char_ok(unsigned char c) { return c > 0x20 && c < 0x7f; }

is_status auth_keys_parse(const char *text, size_t len, auth_keys **out) {
    if (!text || !out) return is_error_set(IS_ERR_INVALID_ARG, "auth_keys_parse: NULL argument");
    auth_keys *k = calloc(1, sizeof *k);
    if (!k) return is_error_set(IS_ERR_NOMEM, "out of memory");
    int32_t cap = 0, lineno = 0;
    size_t pos = 0;
    is_status st = IS_OK;
    while (pos < len && st == IS_OK) {
        size_t end = pos;
        while (end < len && text[end] != '\n') end++;
        lineno++;
        const char *l = text + pos;
        size_t ll = end - pos;
        pos = end + 1;
        if (ll && l[ll - 1] == '\r') ll--;
        size_t i = 0;
        while (i < ll && (l[i] == ' ' || l[i] == '\t')) i++;
        if (i == ll || l[i] == '#') continue;
        size_t ks = i;
        while (i < ll && l[i] != ' ' && l[i] != '\t') i++;
        size_t klen = i - ks;
        while (i < ll && (l[i] == ' ' || l[i] == '\t')) i++;
        size_t ts = i;
        while (i < ll && l[i] != ' ' && l[i] != '\t') i++;
        size_t tlen = i - ts;
        while (i < ll && (l[i] == ' ' || l[i] == '\t')) i++;
        if (tlen == 0 || i != ll) {
            st = is_error_set(IS_ERR_FORMAT, "keys file line %d: expected 'KEY TENANT'", lineno);
            break;
        }
        if (klen < KEY_MIN || klen > KEY_MAX) {
            st = is_error_set(IS_ERR_FORMAT, "keys file line %d: a key must be %d to %d characters",
                              lineno, KEY_MIN, KEY_MAX);
            break;
        }
        for (size_t j = 0; j < klen; j++)
            if (!key_char_ok((unsigned char)l[ks + j])) {
                st = is_error_set(IS_ERR_FORMAT, "keys file line %d: a key must be printable ASCII",
                                  lineno);
                break;
            }
        if (st != IS_OK) break;
        char tenant[AUTH_TENANT_MAX + 2];
        if (tlen > AUTH_TENANT_MAX) tlen = AUTH_TENANT_MAX + 1; /* invalid below */
        memcpy(tenant, l + ts, tlen);
        tenant[tlen] = '\0';
        if (!auth_tenant_valid(tenant)) {
            st = is_error_set(IS_ERR_FORMAT,
                              "keys file line %d: a tenant must be 1 to %d characters of "
                              "[A-Za-z0-9_.-]",
                              lineno, AUTH_TENANT_MAX);
            break;
        }
        for (int32_t j = 0; j < k->n; j++)
            if (k->e[j].len == klen && memcmp(k->e[j].key, l + ks, klen) == 0) {
                st = is_error_set(IS_ERR_FORMAT, "keys file line %d: this key appeared before",
                                  lineno);
                break;
            }
        if (st != IS_OK) break;
        if (k->n == cap) {
            cap = cap ? cap * 2 : 16;
            auth_entry *ne = realloc(k->e, (size_t)cap * sizeof *ne);
            if (!ne) {
                st = is_error_set(IS_ERR_NOMEM, "out of memory");
                break;
            }
            k->e = ne;
        }
        auth_entry *e = &k->e[k->n++];
        memset(e, 0, sizeof *e);
        memcpy(e->key, l + ks, klen);
        e->len = klen;
        memcpy(e->tenant, tenant, tlen + 1);
    }
    if (st == IS_OK && k->n == 0) st = is_error_set(IS_ERR_FORMAT, "keys file holds no keys");
    if (st != IS_OK) {
        auth_keys_free(k);
        return st;
    }
    *out = k;
    return IS_OK;
}

is_status auth_keys_load(const char *path, auth_keys **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return is_error_set(IS_ERR_IO, "cannot open keys file '%s': %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap) {
            cap = cap ? cap * 2 : 8192;
            if (cap > (64u << 20)) {
                free(buf);
                fclose(f);
                return is_error_set(IS_ERR_FORMAT, "keys file '%s' is larger than 64 MiB", path);
            }
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return is_error_set(IS_ERR_NOMEM, "out of memory");
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return is_error_set(IS_ERR_IO, "cannot read keys file '%s'", path);
    }
    is_status st = auth_keys_parse(buf ? buf : "", len, out);
    free(buf);
    if (st == IS_ERR_FORMAT) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", is_error_last());
        return is_error_set(st, "%s: %s", path, msg);
    }
    return st;
}

void auth_keys_free(auth_keys *k) {
    if (!k) return;
    if (k->e) memset(k->e, 0, (size_t)k->n * sizeof *k->e); /* no keys left in freed memory */
    free(k->e);
    free(k);
}

int32_t auth_keys_count(const auth_keys *k) { return k ? k->n : 0; }

/* Compares every byte of both up to KEY_MAX, whatever matched so far. */
static int key_equal(const auth_entry *e, const char *key, size_t len) {
    unsigned diff = (unsigned)(e->len ^ len);
    for (size_t i = 0; i < KEY_MAX; i++) {
        unsigned char a = (unsigned char)e->key[i];
        unsigned char b = i < len ? (unsigned char)key[i] : 0;
        diff |= (unsigned)(a ^ b);
    }
    return diff == 0;
}

const char *auth_tenant(const auth_keys *k, const char *h) {
    if (!k || !h) return NULL;
    while (*h == ' ' || *h == '\t') h++;
    /* "Bearer" is OpenAI's form, "Token" the one mem0ai's clients send. */
    size_t scheme = strncasecmp(h, "Bearer", 6) == 0 ? 6 : strncasecmp(h, "Token", 5) == 0 ? 5 : 0;
    if (!scheme || (h[scheme] != ' ' && h[scheme] != '\t')) return NULL;
    h += scheme;
    while (*h == ' ' || *h == '\t') h++;
    size_t len = strlen(h);
    while (len && (h[len - 1] == ' ' || h[len - 1] == '\t')) len--;
    if (len < KEY_MIN || len > KEY_MAX) return NULL;
    const char *found = NULL;
    for (int32_t i = 0; i < k->n; i++)
        if (key_equal(&k->e[i], h, len) && !found) found = k->e[i].tenant;
    return found;
}

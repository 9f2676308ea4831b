#include "serve/memory_prompt.h"

#include "core/status.h"
#include "model/chat.h"

#include <stdlib.h>
#include <string.h>

/* Placeholders cut out of a rendered conversation to find where memory and
 * query go; chosen so no template or tokenizer treats them specially. */
#define MARK_MEMORY "\x01MEMORY\x01"
#define MARK_QUERY "\x01QUERY\x01"

struct memory_prompt {
    const model *m;
    int32_t *prefix; /* serving prefix tokens */
    int32_t n_prefix;
    char *suffix_before; /* text between the memory and the query */
    char *suffix_after;  /* text after the query */
};

/* Template text is tokenised with control tokens recognised; user text
 * (facts, turns, queries) without, so "<|im_end|>" typed by a user stays
 * text and cannot close a turn. */
static is_status tokenize(const model *m, const char *text, size_t len, bool special, int32_t **toks,
                          int32_t *n) {
    size_t nn = 0;
    is_status st = tokenizer_encode(m->tok, text, len, false, special, toks, &nn);
    if (st == IS_OK) *n = (int32_t)nn;
    return st;
}

is_status memory_prompt_create(const model *m, const char *header, memory_prompt **out) {
    if (!header) header = MEMORY_PROMPT_DEFAULT_HEADER;
    size_t hl = strlen(header);
    char *sys = malloc(hl + sizeof MARK_MEMORY);
    memory_prompt *p = calloc(1, sizeof *p);
    if (!sys || !p) {
        free(sys);
        free(p);
        return is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    }
    memcpy(sys, header, hl);
    memcpy(sys + hl, MARK_MEMORY, sizeof MARK_MEMORY);
    chat_message msgs[2] = {{"system", sys}, {"user", MARK_QUERY}};
    char *text = NULL;
    is_status st = chat_render(chat_template_detect(m->gguf), m->gguf, msgs, 2, true, &text);
    free(sys);
    if (st != IS_OK) {
        free(p);
        return st;
    }
    char *mem = strstr(text, MARK_MEMORY);
    char *q = mem ? strstr(mem, MARK_QUERY) : NULL;
    if (!mem || !q) {
        free(text);
        free(p);
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "memory prompt: the chat template does not keep the system message "
                            "before the user's");
    }
    p->m = m;
    st = tokenize(m, text, (size_t)(mem - text), true, &p->prefix, &p->n_prefix);
    char *before_start = mem + strlen(MARK_MEMORY);
    p->suffix_before = strndup(before_start, (size_t)(q - before_start));
    p->suffix_after = strdup(q + strlen(MARK_QUERY));
    free(text);
    if (st == IS_OK && (!p->suffix_before || !p->suffix_after))
        st = is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    if (st != IS_OK) {
        memory_prompt_free(p);
        return st;
    }
    *out = p;
    return IS_OK;
}

void memory_prompt_free(memory_prompt *p) {
    if (!p) return;
    free(p->prefix);
    free(p->suffix_before);
    free(p->suffix_after);
    free(p);
}

const int32_t *memory_prompt_prefix(const memory_prompt *p, int32_t *n) {
    *n = p->n_prefix;
    return p->prefix;
}

/* Joins pieces into one string and tokenises it. */
static is_status tokenize_join(const memory_prompt *p, const char *const *parts, int n_parts,
                               int32_t **toks, int32_t *n) {
    size_t len = 0;
    for (int i = 0; i < n_parts; i++) len += strlen(parts[i]);
    char *buf = malloc(len + 1);
    if (!buf) return is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    size_t o = 0;
    for (int i = 0; i < n_parts; i++) {
        size_t l = strlen(parts[i]);
        memcpy(buf + o, parts[i], l);
        o += l;
    }
    buf[o] = '\0';
    is_status st = tokenize(p->m, buf, o, false, toks, n);
    free(buf);
    return st;
}

is_status memory_prompt_fact(const memory_prompt *p, const char *text, int32_t **toks, int32_t *n) {
    const char *parts[] = {"- ", text, "\n"};
    return tokenize_join(p, parts, 3, toks, n);
}

is_status memory_prompt_context(const memory_prompt *p, const char *const *turns, int32_t n_turns,
                                int32_t **toks, int32_t *n) {
    const char **parts = malloc((size_t)(2 * n_turns + 1) * sizeof *parts);
    if (!parts) return is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    int k = 0;
    for (int32_t i = 0; i < n_turns; i++) {
        parts[k++] = turns[i];
        parts[k++] = "\n";
    }
    is_status st;
    if (k == 0) {
        *toks = NULL;
        *n = 0;
        st = IS_OK;
    } else {
        st = tokenize_join(p, parts, k, toks, n);
    }
    free(parts);
    return st;
}

is_status memory_prompt_suffix(const memory_prompt *p, const char *query, int32_t **toks, int32_t *n) {
    int32_t *a = NULL, *b = NULL, *c = NULL, na = 0, nb = 0, nc = 0;
    is_status st = tokenize(p->m, p->suffix_before, strlen(p->suffix_before), true, &a, &na);
    if (st == IS_OK) st = tokenize(p->m, query, strlen(query), false, &b, &nb);
    if (st == IS_OK) st = tokenize(p->m, p->suffix_after, strlen(p->suffix_after), true, &c, &nc);
    int32_t *all = st == IS_OK ? malloc((size_t)(na + nb + nc + 1) * sizeof *all) : NULL;
    if (st == IS_OK && !all) st = is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    if (st == IS_OK) {
        memcpy(all, a, (size_t)na * sizeof *all);
        memcpy(all + na, b, (size_t)nb * sizeof *all);
        memcpy(all + na + nb, c, (size_t)nc * sizeof *all);
        *toks = all;
        *n = na + nb + nc;
    }
    free(a);
    free(b);
    free(c);
    return st;
}

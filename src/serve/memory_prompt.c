#include "serve/memory_prompt.h"

#include "core/status.h"
#include "model/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Placeholders cut out of a rendered conversation to find where memory and
 * query go; chosen so no template or tokenizer treats them specially. */
#define MARK_MEMORY "\x01MEMORY\x01"
#define MARK_QUERY  "\x01QUERY\x01"

struct memory_prompt {
    const model *m;
    chat_template_kind kind;
    char *header;      /* the memory section's header, as given */
    char *prefix_text; /* the rendered text the prefix tokens come from */
    int32_t *prefix;   /* serving prefix tokens */
    int32_t n_prefix;
    char *suffix_before; /* text between the memory and the query */
    char *suffix_after;  /* text after the query */
};

/* Template text is tokenised with control tokens recognised; user text
 * (facts, turns, queries) without, so "<|im_end|>" typed by a user stays
 * text and cannot close a turn. */
static is_status tokenize(const model *m, const char *text, size_t len, bool special,
                          int32_t **toks, int32_t *n) {
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
    p->kind = chat_template_detect(m->gguf);
    is_status st = chat_render(p->kind, m->gguf, msgs, 2, true, &text);
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
    p->header = strdup(header);
    p->prefix_text = strndup(text, (size_t)(mem - text));
    free(text);
    if (st == IS_OK && (!p->suffix_before || !p->suffix_after || !p->header || !p->prefix_text))
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
    free(p->header);
    free(p->prefix_text);
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

is_status memory_prompt_dated_text(const char *date, const char *text, char **out) {
    if (!text || !out) return is_error_set(IS_ERR_INVALID_ARG, "memory prompt: NULL fact text");
    size_t n = strlen(text) + (date ? strlen(date) : 0) + 4;
    char *s = malloc(n);
    if (!s) return is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    if (date && *date) snprintf(s, n, "[%s] %s", date, text);
    else snprintf(s, n, "%s", text);
    *out = s;
    return IS_OK;
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

is_status memory_prompt_suffix(const memory_prompt *p, const char *query, int32_t **toks,
                               int32_t *n) {
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

/* ---- conversations ------------------------------------------------------------ */

/* A growable token list. */
typedef struct tok_list {
    int32_t *v;
    int32_t n, cap;
} tok_list;

static is_status tl_add_text(const model *m, tok_list *l, const char *text, size_t len,
                             bool special) {
    if (len == 0) return IS_OK;
    int32_t *t = NULL, nt = 0;
    is_status st = tokenize(m, text, len, special, &t, &nt);
    if (st != IS_OK) return st;
    if (l->n + nt > l->cap) {
        int32_t cap = l->cap ? l->cap : 64;
        while (cap < l->n + nt) cap *= 2;
        int32_t *nv = realloc(l->v, (size_t)cap * sizeof *nv);
        if (!nv) {
            free(t);
            return is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
        }
        l->v = nv;
        l->cap = cap;
    }
    memcpy(l->v + l->n, t, (size_t)nt * sizeof *t);
    l->n += nt;
    free(t);
    return IS_OK;
}

/* Placeholder of message i: no role, template or tokenizer produces \x01. */
#define MARK_MSG_FMT  "\x01MSG%d\x01"
#define MARK_MSG_SIZE 24

static bool role_ok(const char *r) {
    return strcmp(r, "system") == 0 || strcmp(r, "user") == 0 || strcmp(r, "assistant") == 0;
}

/* Renders msgs with placeholders for their contents (after the memory
 * system message when with_memory), then tokenises template text with
 * control tokens recognised and each content without. */
static is_status render_chat(const memory_prompt *p, const chat_message *msgs, int32_t n,
                             bool with_memory, int32_t **toks, int32_t *n_toks) {
    if (!msgs || n <= 0 || !toks || !n_toks)
        return is_error_set(IS_ERR_INVALID_ARG, "chat prompt: no messages");
    for (int32_t i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content)
            return is_error_set(IS_ERR_INVALID_ARG,
                                "chat prompt: message %d has no role or content", (int)i);
        if (!role_ok(msgs[i].role))
            return is_error_set(IS_ERR_INVALID_ARG,
                                "chat prompt: message %d has role \"%.40s\" (system, user or "
                                "assistant)",
                                (int)i, msgs[i].role);
    }
    char(*ph)[MARK_MSG_SIZE] = malloc((size_t)n * sizeof *ph);
    chat_message *cm = malloc((size_t)(n + 1) * sizeof *cm);
    char *sys = NULL, *text = NULL;
    tok_list out = {0};
    is_status st = ph && cm ? IS_OK : is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
    int32_t k = 0, first = 0;
    for (int32_t i = 0; st == IS_OK && i < n; i++)
        snprintf(ph[i], MARK_MSG_SIZE, MARK_MSG_FMT, (int)i);
    if (st == IS_OK && with_memory) {
        /* Mistral's template keeps one system message, the first: the
         * client's joins the memory one, after the memory segment. */
        bool merge = p->kind == CHAT_TEMPLATE_MISTRAL && strcmp(msgs[0].role, "system") == 0;
        size_t len = strlen(p->header) + strlen(MARK_MEMORY) + 2 + MARK_MSG_SIZE + 1;
        if (!(sys = malloc(len))) {
            st = is_error_set(IS_ERR_NOMEM, "memory prompt: out of memory");
        } else {
            snprintf(sys, len, "%s%s%s%s", p->header, MARK_MEMORY, merge ? "\n\n" : "",
                     merge ? ph[0] : "");
            cm[k++] = (chat_message){"system", sys};
            first = merge ? 1 : 0;
        }
    }
    for (int32_t i = first; st == IS_OK && i < n; i++)
        cm[k++] = (chat_message){msgs[i].role, ph[i]};
    if (st == IS_OK) st = chat_render(p->kind, p->m->gguf, cm, (size_t)k, true, &text);
    const char *cur = text;
    if (st == IS_OK && with_memory) {
        const char *mem = strstr(text, MARK_MEMORY);
        size_t pl = strlen(p->prefix_text);
        if (!mem || (size_t)(mem - text) != pl || memcmp(text, p->prefix_text, pl) != 0)
            st = is_error_set(IS_ERR_UNSUPPORTED,
                              "chat prompt: the chat template does not render the serving prefix "
                              "the same way for this conversation");
        else cur = mem + strlen(MARK_MEMORY);
    }
    for (int32_t i = 0; st == IS_OK && i < n; i++) {
        const char *at = strstr(cur, ph[i]);
        if (!at) {
            st = is_error_set(IS_ERR_UNSUPPORTED,
                              "chat prompt: the chat template dropped message %d", (int)i);
            break;
        }
        st = tl_add_text(p->m, &out, cur, (size_t)(at - cur), true);
        size_t c0, cl = chat_content_span(p->kind, msgs[i].content, &c0);
        if (st == IS_OK) st = tl_add_text(p->m, &out, msgs[i].content + c0, cl, false);
        cur = at + strlen(ph[i]);
    }
    if (st == IS_OK) st = tl_add_text(p->m, &out, cur, strlen(cur), true);
    if (st == IS_OK && out.n == 0) st = is_error_set(IS_ERR_INVALID_ARG, "chat prompt: no tokens");
    free(ph);
    free(cm);
    free(sys);
    free(text);
    if (st != IS_OK) {
        free(out.v);
        return st;
    }
    *toks = out.v;
    *n_toks = out.n;
    return IS_OK;
}

is_status memory_prompt_chat_suffix(const memory_prompt *p, const chat_message *msgs, int32_t n,
                                    int32_t **toks, int32_t *n_toks) {
    return render_chat(p, msgs, n, true, toks, n_toks);
}

is_status memory_prompt_chat_plain(const memory_prompt *p, const chat_message *msgs, int32_t n,
                                   int32_t **toks, int32_t *n_toks) {
    return render_chat(p, msgs, n, false, toks, n_toks);
}

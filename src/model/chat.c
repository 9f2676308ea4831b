/*
 * chat: the three chat formats of our models, rendered in C (see chat.h).
 *
 * Each renderer reproduces its Jinja template for plain conversations
 * (system/user/assistant text; no tools), including the details that are
 * easy to get wrong: SmolLM2's default system prompt, Llama 3's `| trim` on
 * every content (Python str.strip(), so Unicode spaces too), and the
 * spacing differences between revisions of Mistral's template. The variant
 * is read from the template text in the GGUF:
 *
 *   CHATML   default system prompt = the string literal in the template
 *            that starts with "<|im_start|>system\n" and holds
 *            "<|im_end|>" (SmolLM2, Qwen 2.5); none if there is no such
 *            literal.
 *   LLAMA3   "Cutting Knowledge Date" in the template (Llama 3.1/3.2):
 *            a system header with the knowledge and "Today Date: 26 Jul 2024"
 *            lines always comes first (the template's default date_string;
 *            3.2's template would use today's date under transformers).
 *   MISTRAL  "' [INST] '" (the 2024 revision): " [INST] " and " " before
 *            each reply; "eos_token + ' '" (first v0.1 revision): a space
 *            after each </s>; otherwise "[INST] ... [/INST]reply</s>".
 */
#include "model/chat.h"

#include "core/status.h"
#include "gguf/gguf.h"

#include <stdlib.h>
#include <string.h>

/* ---- a growable string ---------------------------------------------------- */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* ---- Python str.strip() ------------------------------------------------------ */

/* Length of the whitespace character (Python str.isspace()) at s[0..n), or 0. */
static size_t py_space_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    unsigned char c = s[0];
    if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return 1;
    if (c == 0xC2 && n >= 2 && (s[1] == 0x85 || s[1] == 0xA0)) return 2;
    if (c == 0xE1 && n >= 3 && s[1] == 0x9A && s[2] == 0x80) return 3; /* U+1680 */
    if (c == 0xE2 && n >= 3) {
        if (s[1] == 0x80 &&
            ((s[2] >= 0x80 && s[2] <= 0x8A) || s[2] == 0xA8 || s[2] == 0xA9 || s[2] == 0xAF))
            return 3;                               /* U+2000..200A, 2028, 2029, 202F */
        if (s[1] == 0x81 && s[2] == 0x9F) return 3; /* U+205F */
    }
    if (c == 0xE3 && n >= 3 && s[1] == 0x80 && s[2] == 0x80) return 3; /* U+3000 */
    return 0;
}

/* s with leading and trailing whitespace removed (Jinja's trim): the
 * bytes [*start, *start + return value). */
static size_t trim_span(const char *s, size_t *start) {
    const unsigned char *u = (const unsigned char *)s;
    size_t n = strlen(s), i = 0, k;
    while ((k = py_space_len(u + i, n - i)) > 0) i += k;
    /* Find the end: the last position after a non-space character. */
    size_t end = i, j = i;
    while (j < n) {
        k = py_space_len(u + j, n - j);
        if (k) {
            j += k;
            continue;
        }
        j++;
        while (j < n && (u[j] & 0xC0) == 0x80) j++; /* rest of the character */
        end = j;
    }
    *start = i;
    return end - i;
}

static void sb_trimmed(sbuf *b, const char *s) {
    size_t i, n = trim_span(s, &i);
    sb_add(b, s + i, n);
}

/* ---- template inspection -------------------------------------------------------- */

typedef struct tmpl_info {
    char *text;      /* tokenizer.chat_template, NUL-terminated copy, or NULL */
    char *bos, *eos; /* token texts, or NULL */
} tmpl_info;

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = '\0';
    }
    return p;
}

/* The text of the token whose id is stored at `id_key`, or NULL if the key,
 * the vocabulary or the id is missing. IS_ERR_NOMEM only. */
static is_status token_text(const gguf_ctx *g, const char *id_key, char **out) {
    uint32_t id;
    gguf_string s;
    *out = NULL;
    if (gguf_find_key(g, id_key) < 0 || gguf_get_u32(g, id_key, &id) != IS_OK) return IS_OK;
    if (gguf_get_arr_str(g, "tokenizer.ggml.tokens", id, &s) != IS_OK) return IS_OK;
    if (memchr(s.data, '\0', s.len)) return IS_OK;
    if (!(*out = dup_n(s.data, s.len))) return is_error_set(IS_ERR_NOMEM, "chat: out of memory");
    return IS_OK;
}

static void tmpl_free(tmpl_info *ti) {
    free(ti->text);
    free(ti->bos);
    free(ti->eos);
}

/* Reads what the renderers need from g (missing pieces stay NULL; only an
 * allocation failure is an error). */
static is_status tmpl_read(const gguf_ctx *g, tmpl_info *ti) {
    memset(ti, 0, sizeof *ti);
    if (!g) return IS_OK;
    gguf_string s;
    if (gguf_find_key(g, "tokenizer.chat_template") >= 0 &&
        gguf_get_str(g, "tokenizer.chat_template", &s) == IS_OK && !memchr(s.data, '\0', s.len)) {
        if (!(ti->text = dup_n(s.data, s.len))) goto nomem;
    }
    if (token_text(g, "tokenizer.ggml.bos_token_id", &ti->bos) != IS_OK ||
        token_text(g, "tokenizer.ggml.eos_token_id", &ti->eos) != IS_OK) {
        tmpl_free(ti);
        return IS_ERR_NOMEM;
    }
    return IS_OK;
nomem:
    tmpl_free(ti);
    return is_error_set(IS_ERR_NOMEM, "chat: out of memory");
}

static bool tmpl_has(const tmpl_info *ti, const char *needle) {
    return ti->text && strstr(ti->text, needle);
}

/* Decodes the Jinja string literal opened by the quote at *p (Python-style
 * escapes \n \t \r \\ \' \"). Returns a malloc'd value, or NULL if the
 * literal is unterminated or memory runs out. */
static char *jinja_literal(const char *p) {
    char q = *p++;
    sbuf b = {0};
    sb_add(&b, "", 0);
    for (; *p && *p != q; p++) {
        char c = *p;
        if (c == '\\' && p[1]) {
            p++;
            switch (*p) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case '\\':
            case '\'':
            case '"': c = *p; break;
            default:
                sb_add(&b, "\\", 1);
                c = *p;
                break;
            }
        }
        sb_add(&b, &c, 1);
    }
    if (*p != q || b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

/* The ChatML default system prompt written in the template, or NULL. */
static char *chatml_default_system(const tmpl_info *ti) {
    static const char head[] = "<|im_start|>system\n";
    if (!ti->text) return NULL;
    for (const char *p = ti->text; (p = strstr(p, "<|im_start|>system")) != NULL; p++) {
        if (p == ti->text || (p[-1] != '\'' && p[-1] != '"')) continue;
        char *lit = jinja_literal(p - 1);
        if (!lit) continue;
        char *end = strstr(lit, "<|im_end|>");
        if (strncmp(lit, head, sizeof head - 1) == 0 && end) {
            size_t n = (size_t)(end - lit) - (sizeof head - 1);
            memmove(lit, lit + sizeof head - 1, n);
            lit[n] = '\0';
            return lit;
        }
        free(lit);
    }
    return NULL;
}

/* ---- renderers -------------------------------------------------------------------- */

static is_status render_chatml(const tmpl_info *ti, const chat_message *m, size_t n,
                               bool add_assistant, sbuf *b) {
    if (strcmp(m[0].role, "system") != 0) {
        char *def = chatml_default_system(ti);
        if (def) {
            sb_str(b, "<|im_start|>system\n");
            sb_str(b, def);
            sb_str(b, "<|im_end|>\n");
            free(def);
        }
    }
    for (size_t i = 0; i < n; i++) {
        sb_str(b, "<|im_start|>");
        sb_str(b, m[i].role);
        sb_str(b, "\n");
        sb_str(b, m[i].content);
        sb_str(b, "<|im_end|>\n");
    }
    if (add_assistant) sb_str(b, "<|im_start|>assistant\n");
    return IS_OK;
}

static is_status render_llama3(const tmpl_info *ti, const chat_message *m, size_t n,
                               bool add_assistant, sbuf *b) {
    sb_str(b, ti->bos ? ti->bos : "<|begin_of_text|>");
    size_t first = 0;
    if (tmpl_has(ti, "Cutting Knowledge Date")) {
        /* Llama 3.1/3.2: the system turn always exists and carries dates. */
        sb_str(b, "<|start_header_id|>system<|end_header_id|>\n\n"
                  "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
        if (strcmp(m[0].role, "system") == 0) {
            sb_trimmed(b, m[0].content);
            first = 1;
        }
        sb_str(b, "<|eot_id|>");
    }
    for (size_t i = first; i < n; i++) {
        sb_str(b, "<|start_header_id|>");
        sb_str(b, m[i].role);
        sb_str(b, "<|end_header_id|>\n\n");
        sb_trimmed(b, m[i].content);
        sb_str(b, "<|eot_id|>");
    }
    if (add_assistant) sb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return IS_OK;
}

static is_status render_mistral(const tmpl_info *ti, const chat_message *m, size_t n, sbuf *b) {
    const bool spaced = tmpl_has(ti, "' [INST] '");
    const bool eos_space = !spaced && tmpl_has(ti, "eos_token + ' '");
    const char *sys = NULL;
    size_t first = 0;
    if (strcmp(m[0].role, "system") == 0) {
        sys = m[0].content;
        first = 1;
    }
    for (size_t i = first; i < n; i++) {
        const char *want = (i - first) % 2 == 0 ? "user" : "assistant";
        if (strcmp(m[i].role, want) != 0)
            return is_error_set(IS_ERR_INVALID_ARG,
                                "chat: mistral: message %zu has role \"%s\", expected \"%s\" "
                                "(an optional system message, then user/assistant alternating)",
                                i, m[i].role, want);
    }
    sb_str(b, ti->bos ? ti->bos : "<s>");
    for (size_t i = first; i < n; i++) {
        if ((i - first) % 2 == 0) {
            sb_str(b, spaced ? " [INST] " : "[INST] ");
            if (sys && i == first) {
                sb_str(b, sys);
                sb_str(b, "\n\n");
            }
            sb_str(b, m[i].content);
            sb_str(b, " [/INST]");
        } else {
            if (spaced) sb_str(b, " ");
            sb_str(b, m[i].content);
            sb_str(b, ti->eos ? ti->eos : "</s>");
            if (eos_space) sb_str(b, " ");
        }
    }
    return IS_OK;
}

/* ---- public ------------------------------------------------------------------------- */

chat_template_kind chat_template_detect(const gguf_ctx *g) {
    gguf_string s;
    if (!g || gguf_find_key(g, "tokenizer.chat_template") < 0 ||
        gguf_get_str(g, "tokenizer.chat_template", &s) != IS_OK)
        return CHAT_TEMPLATE_CHATML;
    /* memmem: the template is not NUL-terminated in the mapping. */
    if (memmem(s.data, s.len, "<|im_start|>", 12)) return CHAT_TEMPLATE_CHATML;
    if (memmem(s.data, s.len, "<|start_header_id|>", 19)) return CHAT_TEMPLATE_LLAMA3;
    if (memmem(s.data, s.len, "[INST]", 6)) return CHAT_TEMPLATE_MISTRAL;
    return CHAT_TEMPLATE_CHATML;
}

const char *chat_template_name(chat_template_kind kind) {
    switch (kind) {
    case CHAT_TEMPLATE_CHATML: return "chatml";
    case CHAT_TEMPLATE_LLAMA3: return "llama3";
    case CHAT_TEMPLATE_MISTRAL: return "mistral";
    }
    return "unknown";
}

is_status chat_render(chat_template_kind kind, const gguf_ctx *g_or_null, const chat_message *msgs,
                      size_t n, bool add_assistant, char **out) {
    if (!out || !msgs || n == 0)
        return is_error_set(IS_ERR_INVALID_ARG, "chat_render: no messages");
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return is_error_set(IS_ERR_INVALID_ARG, "chat_render: message %zu has a NULL field", i);
    if (kind != CHAT_TEMPLATE_CHATML && kind != CHAT_TEMPLATE_LLAMA3 &&
        kind != CHAT_TEMPLATE_MISTRAL)
        return is_error_set(IS_ERR_INVALID_ARG, "chat_render: unknown template kind %d", (int)kind);
    tmpl_info ti;
    is_status st = tmpl_read(g_or_null, &ti);
    if (st != IS_OK) return st;
    sbuf b = {0};
    sb_add(&b, "", 0);
    switch (kind) {
    case CHAT_TEMPLATE_CHATML: st = render_chatml(&ti, msgs, n, add_assistant, &b); break;
    case CHAT_TEMPLATE_LLAMA3: st = render_llama3(&ti, msgs, n, add_assistant, &b); break;
    case CHAT_TEMPLATE_MISTRAL: st = render_mistral(&ti, msgs, n, &b); break;
    }
    tmpl_free(&ti);
    if (st == IS_OK && b.oom) st = is_error_set(IS_ERR_NOMEM, "chat: out of memory");
    if (st != IS_OK) {
        free(b.p);
        return st;
    }
    *out = b.p;
    return IS_OK;
}

size_t chat_content_span(chat_template_kind kind, const char *content, size_t *start) {
    if (kind == CHAT_TEMPLATE_LLAMA3) return trim_span(content, start);
    *start = 0;
    return strlen(content);
}

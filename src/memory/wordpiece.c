/*
 * wordpiece: BERT's tokenizer. See wordpiece.h for the steps and the
 * reference; this file is cut in sections: vocabulary, UTF-8 and Unicode
 * classes, normalisation, WordPiece, encode.
 */
#include "memory/wordpiece.h"

#include "core/status.h"
#include "core/utf8.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ---- vocabulary ------------------------------------------------------- */

struct wordpiece {
    wordpiece_params params;
    int32_t n_vocab;
    char *arena;      /* all tokens, each NUL-terminated */
    uint32_t *offset; /* (n_vocab) start of token i in arena */
    uint32_t *len;    /* (n_vocab) byte length of token i */
    int32_t *table;   /* (table_mask + 1) open addressing, id or -1 */
    uint32_t table_mask;
    uint32_t max_token_bytes; /* longest token, to bound lookups */
    int32_t cls_id, sep_id, unk_id, pad_id;
    /* Special tokens matched in raw text, as HF's added vocabulary does. */
    int32_t special[5];
    int32_t n_special;
};

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

int32_t wordpiece_token_id(const wordpiece *wp, const char *text, size_t len) {
    if (!wp || (!text && len) || len > wp->max_token_bytes) return -1;
    uint32_t i = (uint32_t)hash_bytes(text, len) & wp->table_mask;
    for (;;) {
        int32_t id = wp->table[i];
        if (id < 0) return -1;
        if (wp->len[id] == len && memcmp(wp->arena + wp->offset[id], text, len) == 0) return id;
        i = (i + 1) & wp->table_mask;
    }
}

wordpiece_params wordpiece_default_params(void) {
    wordpiece_params p = {
        .lowercase = true,
        .strip_accents = -1,
        .tokenize_chinese_chars = true,
        .max_input_chars_per_word = 100,
    };
    return p;
}

void wordpiece_free(wordpiece *wp) {
    if (!wp) return;
    free(wp->arena);
    free(wp->offset);
    free(wp->len);
    free(wp->table);
    free(wp);
}

is_status wordpiece_load_buffer(const char *data, size_t n, wordpiece_params params,
                                wordpiece **out) {
    if ((!data && n) || !out) return is_error_set(IS_ERR_INVALID_ARG, "wordpiece: NULL argument");
    if (params.max_input_chars_per_word < 1)
        return is_error_set(IS_ERR_INVALID_ARG, "wordpiece: max_input_chars_per_word < 1");
    if (n > UINT32_MAX / 2) return is_error_set(IS_ERR_FORMAT, "wordpiece: vocabulary too large");
    /* Count lines; a final line without "\n" counts too. */
    size_t n_lines = 0;
    for (size_t i = 0; i < n; i++) n_lines += data[i] == '\n';
    if (n && data[n - 1] != '\n') n_lines++;
    if (n_lines == 0) return is_error_set(IS_ERR_FORMAT, "wordpiece: empty vocabulary");
    if (n_lines > INT32_MAX / 4) return is_error_set(IS_ERR_FORMAT, "wordpiece: too many tokens");

    wordpiece *wp = calloc(1, sizeof *wp);
    if (!wp) return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
    wp->params = params;
    wp->n_vocab = (int32_t)n_lines;
    uint32_t cap = 1;
    while (cap < 2 * n_lines) cap <<= 1;
    wp->table_mask = cap - 1;
    wp->arena = malloc(n + n_lines + 1);
    wp->offset = malloc(n_lines * sizeof *wp->offset);
    wp->len = malloc(n_lines * sizeof *wp->len);
    wp->table = malloc((size_t)cap * sizeof *wp->table);
    if (!wp->arena || !wp->offset || !wp->len || !wp->table) {
        wordpiece_free(wp);
        return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
    }
    memset(wp->table, 0xff, (size_t)cap * sizeof *wp->table);

    size_t pos = 0, ap = 0;
    for (int32_t id = 0; id < wp->n_vocab; id++) {
        size_t end = pos;
        while (end < n && data[end] != '\n') end++;
        size_t tl = end - pos;
        if (tl && data[pos + tl - 1] == '\r') tl--;
        if (tl == 0) {
            wordpiece_free(wp);
            return is_error_set(IS_ERR_FORMAT, "wordpiece: empty token on line %d", id + 1);
        }
        if (!utf8_valid(data + pos, tl)) {
            wordpiece_free(wp);
            return is_error_set(IS_ERR_FORMAT, "wordpiece: invalid UTF-8 on line %d", id + 1);
        }
        memcpy(wp->arena + ap, data + pos, tl);
        wp->arena[ap + tl] = 0;
        wp->offset[id] = (uint32_t)ap;
        wp->len[id] = (uint32_t)tl;
        if (tl > wp->max_token_bytes) wp->max_token_bytes = (uint32_t)tl;
        ap += tl + 1;
        pos = end + 1;
        /* Insert; a duplicate is a corrupt vocabulary (ids would be ambiguous). */
        uint32_t i = (uint32_t)hash_bytes(wp->arena + wp->offset[id], tl) & wp->table_mask;
        while (wp->table[i] >= 0) {
            int32_t o = wp->table[i];
            if (wp->len[o] == tl &&
                memcmp(wp->arena + wp->offset[o], wp->arena + wp->offset[id], tl) == 0) {
                is_status st = is_error_set(IS_ERR_FORMAT,
                                            "wordpiece: duplicate token \"%s\" on lines %d and %d",
                                            wp->arena + wp->offset[id], o + 1, id + 1);
                wordpiece_free(wp);
                return st;
            }
            i = (i + 1) & wp->table_mask;
        }
        wp->table[i] = id;
    }
    wp->cls_id = wordpiece_token_id(wp, "[CLS]", 5);
    wp->sep_id = wordpiece_token_id(wp, "[SEP]", 5);
    wp->unk_id = wordpiece_token_id(wp, "[UNK]", 5);
    wp->pad_id = wordpiece_token_id(wp, "[PAD]", 5);
    if (wp->cls_id < 0 || wp->sep_id < 0 || wp->unk_id < 0) {
        wordpiece_free(wp);
        return is_error_set(IS_ERR_FORMAT, "wordpiece: vocabulary lacks [CLS], [SEP] or [UNK]");
    }
    static const char *const specials[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    for (size_t k = 0; k < sizeof specials / sizeof *specials; k++) {
        int32_t id = wordpiece_token_id(wp, specials[k], strlen(specials[k]));
        if (id >= 0) wp->special[wp->n_special++] = id;
    }
    *out = wp;
    return IS_OK;
}

is_status wordpiece_load(const char *vocab_path, wordpiece_params params, wordpiece **out) {
    if (!vocab_path || !out) return is_error_set(IS_ERR_INVALID_ARG, "wordpiece: NULL argument");
    FILE *f = fopen(vocab_path, "rb");
    if (!f)
        return is_error_set(IS_ERR_IO, "wordpiece: cannot open %s: %s", vocab_path,
                            strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 1 << 18;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return is_error_set(IS_ERR_IO, "wordpiece: read error on %s", vocab_path);
    }
    is_status st = wordpiece_load_buffer(buf, n, params, out);
    free(buf);
    return st;
}

int32_t wordpiece_n_vocab(const wordpiece *wp) { return wp ? wp->n_vocab : 0; }
int32_t wordpiece_cls_id(const wordpiece *wp) { return wp->cls_id; }
int32_t wordpiece_sep_id(const wordpiece *wp) { return wp->sep_id; }
int32_t wordpiece_unk_id(const wordpiece *wp) { return wp->unk_id; }
int32_t wordpiece_pad_id(const wordpiece *wp) { return wp->pad_id; }

const char *wordpiece_token_text(const wordpiece *wp, int32_t id) {
    if (!wp || id < 0 || id >= wp->n_vocab) return NULL;
    return wp->arena + wp->offset[id];
}

/* ---- UTF-8 and Unicode classes ---------------------------------------- */

/* Decodes one scalar value at s[0..n); on an ill-formed sequence returns
 * U+FFFD and consumes one byte (the replacement is dropped by cleaning, so
 * how many are emitted does not matter, only that no valid character that
 * follows is swallowed). */
static size_t utf8_next(const uint8_t *s, size_t n, uint32_t *cp) {
    int k = utf8_decode((const char *)s, n, cp);
    if (k < 0) {
        *cp = 0xFFFD;
        return 1;
    }
    return (size_t)k;
}

/* Rust's char::is_whitespace (the White_Space property), plus \t \n \r. */
static bool is_ws(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* "Other" minus unassigned: control, format, surrogate, private use. */
static bool is_other(uint32_t c) {
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO: return true;
    default: return false;
    }
}

static bool is_punct(uint32_t c) {
    if (c < 0x80)
        return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
               (c >= 123 && c <= 126);
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO: return true;
    default: return false;
    }
}

/* The blocks HF (and the original BERT) treat as CJK ideographs. */
static bool is_cjk(uint32_t c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
           (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

/* ---- normalisation ----------------------------------------------------- */

/* A growable array of code points. */
typedef struct cpbuf {
    uint32_t *v;
    size_t n, cap;
} cpbuf;

static bool cpbuf_reserve(cpbuf *b, size_t need) {
    if (need <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    uint32_t *nv = realloc(b->v, cap * sizeof *nv);
    if (!nv) return false;
    b->v = nv;
    b->cap = cap;
    return true;
}

/* Steps 1-4 of wordpiece.h on bytes s[0..n), appended to `out`. */
static is_status normalize_segment(const wordpiece *wp, const uint8_t *s, size_t n, cpbuf *out) {
    const wordpiece_params *p = &wp->params;
    bool strip = p->strip_accents < 0 ? p->lowercase : p->strip_accents != 0;
    /* 1-2: clean and isolate CJK, as UTF-8 (utf8proc's NFD reads UTF-8). */
    char *clean = malloc(3 * n + 1 > 16 ? 3 * n + 1 : 16);
    if (!clean) return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        i += utf8_next(s + i, n - i, &c);
        if (c == 0 || c == 0xFFFD || (c != '\t' && c != '\n' && c != '\r' && is_other(c))) continue;
        if (is_ws(c)) {
            clean[m++] = ' ';
        } else if (p->tokenize_chinese_chars && is_cjk(c)) {
            clean[m++] = ' ';
            m += utf8_encode(c, clean + m);
            clean[m++] = ' ';
        } else {
            m += utf8_encode(c, clean + m);
        }
    }
    /* 3: NFD (with canonical reordering of marks) then drop Mn. */
    utf8proc_int32_t *dec = NULL;
    utf8proc_ssize_t nd = 0;
    if (strip && m) {
        utf8proc_ssize_t need = utf8proc_decompose((const uint8_t *)clean, (utf8proc_ssize_t)m,
                                                   NULL, 0, UTF8PROC_DECOMPOSE);
        if (need < 0) {
            free(clean);
            return is_error_set(IS_ERR_INTERNAL, "wordpiece: utf8proc: %s", utf8proc_errmsg(need));
        }
        dec = malloc(((size_t)need + 1) * sizeof *dec);
        if (!dec) {
            free(clean);
            return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
        }
        nd = utf8proc_decompose((const uint8_t *)clean, (utf8proc_ssize_t)m, dec, need,
                                UTF8PROC_DECOMPOSE);
        if (nd < 0 || nd > need) {
            free(dec);
            free(clean);
            return is_error_set(IS_ERR_INTERNAL, "wordpiece: utf8proc decompose failed");
        }
    } else {
        dec = malloc((m + 1) * sizeof *dec);
        if (!dec) {
            free(clean);
            return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
        }
        for (size_t i = 0; i < m;) {
            uint32_t c;
            i += utf8_next((const uint8_t *)clean + i, m - i, &c);
            dec[nd++] = (utf8proc_int32_t)c;
        }
    }
    free(clean);
    /* 4: lowercase. Rust's full mapping differs from the simple one only for
     * U+0130 (-> "i" U+0307), which stripping has already decomposed. */
    if (!cpbuf_reserve(out, out->n + 2 * (size_t)nd)) {
        free(dec);
        return is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
    }
    for (utf8proc_ssize_t i = 0; i < nd; i++) {
        uint32_t c = (uint32_t)dec[i];
        if (strip && utf8proc_category((utf8proc_int32_t)c) == UTF8PROC_CATEGORY_MN) continue;
        if (p->lowercase) {
            if (c == 0x130) {
                out->v[out->n++] = 'i';
                out->v[out->n++] = 0x307;
                continue;
            }
            c = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c);
        }
        out->v[out->n++] = c;
    }
    free(dec);
    return IS_OK;
}

/* ---- WordPiece --------------------------------------------------------- */

/* Per-call scratch for one word: its UTF-8 bytes, the byte offset of each
 * character, and the "##"-prefixed lookup key. */
typedef struct word_scratch {
    char *bytes; /* the word's UTF-8 */
    char *key;   /* "##" + a suffix of bytes */
    size_t *off; /* (n_chars + 1) byte offset of char i in bytes */
} word_scratch;

/* Appends the pieces of word w[0..nw) to ids[*n..cap); returns false when
 * ids is full (the rest is truncated, as HF's truncation would). */
static bool wordpiece_word(const wordpiece *wp, const uint32_t *w, size_t nw, word_scratch *ws,
                           int32_t *ids, int32_t *n, int32_t cap) {
    if (*n >= cap) return false;
    if (nw > (size_t)wp->params.max_input_chars_per_word) {
        ids[(*n)++] = wp->unk_id;
        return true;
    }
    size_t b = 0;
    for (size_t i = 0; i < nw; i++) {
        ws->off[i] = b;
        b += utf8_encode(w[i], ws->bytes + b);
    }
    ws->off[nw] = b;
    int32_t first = *n;
    size_t start = 0;
    while (start < nw) {
        /* The key for [start, end) is key[0..2 + off[end] - off[start]) for
         * continuation pieces, bytes + off[start] for the first. */
        const char *key = ws->bytes;
        size_t pre = 0;
        if (start > 0) {
            memcpy(ws->key + 2, ws->bytes + ws->off[start], b - ws->off[start]);
            key = ws->key;
            pre = 2;
        }
        int32_t found = -1;
        size_t end = nw;
        for (; end > start; end--) {
            size_t klen = pre + ws->off[end] - ws->off[start];
            if (klen > wp->max_token_bytes) continue;
            found = wordpiece_token_id(wp, key, klen);
            if (found >= 0) break;
        }
        if (found < 0) {
            *n = first;
            ids[(*n)++] = wp->unk_id;
            return true;
        }
        if (*n >= cap) return false;
        ids[(*n)++] = found;
        start = end;
    }
    return true;
}

/* ---- encode ------------------------------------------------------------- */

/* Steps 5-6 over normalised code points; appends to ids up to cap. */
static bool pretokenize_and_piece(const wordpiece *wp, const cpbuf *cp, word_scratch *ws,
                                  int32_t *ids, int32_t *n, int32_t cap) {
    size_t i = 0;
    while (i < cp->n) {
        uint32_t c = cp->v[i];
        if (is_ws(c)) {
            i++;
            continue;
        }
        if (is_punct(c)) {
            if (!wordpiece_word(wp, cp->v + i, 1, ws, ids, n, cap)) return false;
            i++;
            continue;
        }
        size_t j = i;
        while (j < cp->n && !is_ws(cp->v[j]) && !is_punct(cp->v[j])) j++;
        if (!wordpiece_word(wp, cp->v + i, j - i, ws, ids, n, cap)) return false;
        i = j;
    }
    return true;
}

/* If a special token starts at s[0..n), its id and length; else -1. */
static int32_t match_special(const wordpiece *wp, const char *s, size_t n, size_t *len) {
    int32_t best = -1;
    size_t best_len = 0;
    for (int32_t k = 0; k < wp->n_special; k++) {
        int32_t id = wp->special[k];
        size_t tl = wp->len[id];
        if (tl <= n && tl > best_len && memcmp(s, wp->arena + wp->offset[id], tl) == 0) {
            best = id;
            best_len = tl;
        }
    }
    *len = best_len;
    return best;
}

is_status wordpiece_encode(const wordpiece *wp, const char *text, size_t len, int32_t max_len,
                           int32_t *ids, int32_t *n_out) {
    if (n_out) *n_out = 0;
    if (!wp || (!text && len) || !ids || !n_out)
        return is_error_set(IS_ERR_INVALID_ARG, "wordpiece_encode: NULL argument");
    if (max_len < 2) return is_error_set(IS_ERR_INVALID_ARG, "wordpiece_encode: max_len < 2");
    int32_t n = 0, cap = max_len - 1; /* room for [SEP] */
    ids[n++] = wp->cls_id;
    cpbuf cp = {0};
    size_t wcap = (size_t)wp->params.max_input_chars_per_word;
    word_scratch ws = {
        .bytes = malloc(4 * wcap + 1),
        .key = malloc(2 + 4 * wcap + 1),
        .off = malloc((wcap + 1) * sizeof(size_t)),
    };
    is_status st = IS_OK;
    if (!ws.bytes || !ws.key || !ws.off) {
        st = is_error_set(IS_ERR_NOMEM, "wordpiece: out of memory");
        goto done;
    }
    ws.key[0] = ws.key[1] = '#';
    size_t seg = 0;
    for (size_t i = 0; i <= len && n < cap;) {
        size_t sl = 0;
        int32_t sid = -1;
        if (i < len && text[i] == '[') sid = match_special(wp, text + i, len - i, &sl);
        if (sid < 0 && i < len) {
            i++;
            continue;
        }
        /* Text before the special token (or the end) is one segment. */
        cp.n = 0;
        st = normalize_segment(wp, (const uint8_t *)text + seg, i - seg, &cp);
        if (st != IS_OK) goto done;
        if (!pretokenize_and_piece(wp, &cp, &ws, ids, &n, cap)) break;
        if (sid >= 0 && n < cap) ids[n++] = sid;
        if (i == len) break;
        i += sl;
        seg = i;
    }
    ids[n++] = wp->sep_id;
    *n_out = n;
done:
    free(cp.v);
    free(ws.bytes);
    free(ws.key);
    free(ws.off);
    return st;
}

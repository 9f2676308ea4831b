/*
 * locomo_eval: LoCoMo's scoring functions (see the header for the list).
 *
 * Text is handled as arrays of code points, because every step of the
 * reference is defined on Python str: lowercasing, the ASCII punctuation
 * set, regex word boundaries, str.split() whitespace, and the Porter
 * stemmer's len() and indexing all count code points, not bytes.
 */
#include "eval/locomo_eval.h"

#include "core/status.h"
#include "core/utf8.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ---- code point strings ------------------------------------------------ */

typedef struct ustr {
    int32_t *c;
    int32_t n, cap;
} ustr;

static bool us_reserve(ustr *s, int32_t extra) {
    if (s->n + extra <= s->cap) return true;
    int32_t cap = s->cap ? s->cap : 16;
    while (cap < s->n + extra) cap *= 2;
    int32_t *nc = realloc(s->c, (size_t)cap * sizeof *nc);
    if (!nc) return false;
    s->c = nc;
    s->cap = cap;
    return true;
}

static bool us_push(ustr *s, int32_t cp) {
    if (!us_reserve(s, 1)) return false;
    s->c[s->n++] = cp;
    return true;
}

/* UTF-8 -> code points; each invalid byte becomes U+FFFD. */
static bool us_decode(const char *text, size_t len, ustr *out) {
    size_t i = 0;
    while (i < len) {
        uint32_t cp;
        int k = utf8_decode(text + i, len - i, &cp);
        if (k < 0) {
            cp = 0xFFFD;
            k = 1;
        }
        if (!us_push(out, (int32_t)cp)) return false;
        i += (size_t)k;
    }
    return true;
}

static char *us_encode(const int32_t *c, int32_t n) {
    char *out = malloc((size_t)n * 4 + 1);
    if (!out) return NULL;
    size_t len = 0;
    for (int32_t i = 0; i < n; i++) len += utf8_encode((uint32_t)c[i], out + len);
    out[len] = '\0';
    return out;
}

/* ---- Python's character classes ---------------------------------------- */

/* str.isspace(): bidirectional class WS, B, S or category Zs. */
static bool py_isspace(int32_t c) {
    if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return true;
    if (c < 0x85) return false;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* string.punctuation. */
static bool py_ispunct_ascii(int32_t c) {
    return c < 0x80 && c > 0x20 && strchr("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", (int)c) != NULL;
}

/* \w of the `regex` module: Alphabetic, marks, decimal digits, connector
 * punctuation, join controls. Alphabetic = letters, Nl and the circled
 * letters (So with Other_Alphabetic). */
static bool regex_isword(int32_t c) {
    if (c < 0x80)
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
               c == '_';
    if (c == 0x200C || c == 0x200D) return true;
    if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
        (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189))
        return true;
    switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
    }
}

static bool is_cased(int32_t c) {
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

static bool is_case_ignorable(int32_t c) {
    switch (c) {
    case 0x27:
    case 0x2E:
    case 0x3A:
    case 0xB7:
    case 0x387:
    case 0x55F:
    case 0x5F4:
    case 0x2018:
    case 0x2019:
    case 0x2024:
    case 0x2027:
    case 0xFE13:
    case 0xFE52:
    case 0xFE55:
    case 0xFF07:
    case 0xFF0E:
    case 0xFF1A: return true;
    }
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK;
}

/* str.lower(): the simple mapping (utf8proc's equals Python's for every
 * code point but two), U+0130's two-code-point lowercase, and the final
 * sigma rule: capital sigma after a cased letter and not before one
 * (case-ignorable characters skipped) becomes final sigma. */
static bool py_lower(const ustr *in, ustr *out) {
    for (int32_t i = 0; i < in->n; i++) {
        int32_t c = in->c[i];
        if (c == 0x130) {
            if (!us_push(out, 'i') || !us_push(out, 0x307)) return false;
            continue;
        }
        if (c == 0x3A3) {
            int32_t j = i - 1, k = i + 1;
            while (j >= 0 && is_case_ignorable(in->c[j])) j--;
            while (k < in->n && is_case_ignorable(in->c[k])) k++;
            bool final = j >= 0 && is_cased(in->c[j]) && !(k < in->n && is_cased(in->c[k]));
            if (!us_push(out, final ? 0x3C2 : 0x3C3)) return false;
            continue;
        }
        if (!us_push(out, c < 0x80 ? (c >= 'A' && c <= 'Z' ? c + 32 : c) : utf8proc_tolower(c)))
            return false;
    }
    return true;
}

/* ---- normalize_answer -------------------------------------------------- */

static bool is_article_at(const ustr *s, int32_t i, int32_t *len) {
    static const char *const words[] = {"a", "an", "the", "and"};
    if (i > 0 && regex_isword(s->c[i - 1])) return false;
    for (int w = 0; w < 4; w++) {
        int32_t l = (int32_t)strlen(words[w]);
        if (i + l > s->n) continue;
        bool eq = true;
        for (int32_t j = 0; j < l && eq; j++) eq = s->c[i + j] == words[w][j];
        if (eq && (i + l == s->n || !regex_isword(s->c[i + l]))) {
            *len = l;
            return true;
        }
    }
    return false;
}

/* normalize_answer on code points: the result's words are separated by
 * single spaces. */
static bool normalize_cp(const ustr *in, ustr *out) {
    ustr a = {0}, b = {0}, c = {0};
    bool ok = true;
    for (int32_t i = 0; i < in->n && ok; i++)
        if (in->c[i] != ',') ok = us_push(&a, in->c[i]);
    ok = ok && py_lower(&a, &b);
    a.n = 0;
    for (int32_t i = 0; i < b.n && ok; i++)
        if (!py_ispunct_ascii(b.c[i])) ok = us_push(&a, b.c[i]);
    /* regex.sub(r'\b(a|an|the|and)\b', ' ', text): matches are found on the
     * original text, left to right, without overlap. */
    for (int32_t i = 0; i < a.n && ok;) {
        int32_t l;
        if (is_article_at(&a, i, &l)) {
            ok = us_push(&c, ' ');
            i += l;
        } else {
            ok = us_push(&c, a.c[i++]);
        }
    }
    /* ' '.join(text.split()) */
    for (int32_t i = 0; i < c.n && ok;) {
        while (i < c.n && py_isspace(c.c[i])) i++;
        if (i == c.n) break;
        if (out->n > 0) ok = us_push(out, ' ');
        while (ok && i < c.n && !py_isspace(c.c[i])) ok = us_push(out, c.c[i++]);
    }
    free(a.c);
    free(b.c);
    free(c.c);
    return ok;
}

is_status locomo_eval_normalize(const char *text, char **out) {
    if (!text || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_normalize: NULL argument");
    ustr in = {0}, norm = {0};
    char *s = NULL;
    if (us_decode(text, strlen(text), &in) && normalize_cp(&in, &norm))
        s = us_encode(norm.c, norm.n);
    free(in.c);
    free(norm.c);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    *out = s;
    return IS_OK;
}

/* ---- NLTK's Porter stemmer (NLTK_EXTENSIONS) --------------------------- */

/* A word being stemmed: room for the one letter a step may add. */
typedef struct pword {
    int32_t *c;
    int32_t n;
} pword;

static bool p_vowel(int32_t c) { return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u'; }

/* Consonant flags left to right: a 'y' is a consonant at the start or
 * after a vowel. cons[] has room for n entries. */
static void p_flags(const int32_t *c, int32_t n, bool *cons) {
    for (int32_t i = 0; i < n; i++) {
        if (p_vowel(c[i])) cons[i] = false;
        else if (c[i] == 'y') cons[i] = i == 0 ? true : !cons[i - 1];
        else cons[i] = true;
    }
}

/* Words are short; a fixed flag buffer covers them, longer ones fall back to
 * the heap. */
#define P_FLAGS_STACK 256

static int32_t p_measure(const int32_t *c, int32_t n) {
    bool stack[P_FLAGS_STACK], *cons = n <= P_FLAGS_STACK ? stack : malloc((size_t)n);
    if (!cons) return 0; /* unreachable in practice; treated as m = 0 */
    p_flags(c, n, cons);
    int32_t m = 0;
    for (int32_t i = 0; i + 1 < n; i++) m += !cons[i] && cons[i + 1];
    if (cons != stack) free(cons);
    return m;
}

static bool p_contains_vowel(const int32_t *c, int32_t n) {
    bool stack[P_FLAGS_STACK], *cons = n <= P_FLAGS_STACK ? stack : malloc((size_t)n);
    if (!cons) return false;
    p_flags(c, n, cons);
    bool v = false;
    for (int32_t i = 0; i < n && !v; i++) v = !cons[i];
    if (cons != stack) free(cons);
    return v;
}

/* _is_consonant(word, i) */
static bool p_cons(const int32_t *c, int32_t i) {
    if (p_vowel(c[i])) return false;
    if (c[i] != 'y') return true;
    bool negate = false;
    while (i > 0 && c[i] == 'y') {
        negate = !negate;
        i--;
    }
    return (!p_vowel(c[i])) != negate;
}

static bool p_ends_double(const int32_t *c, int32_t n) {
    return n >= 2 && c[n - 1] == c[n - 2] && p_cons(c, n - 1);
}

static bool p_ends_cvc(const int32_t *c, int32_t n) {
    return (n >= 3 && p_cons(c, n - 3) && !p_cons(c, n - 2) && p_cons(c, n - 1) &&
            c[n - 1] != 'w' && c[n - 1] != 'x' && c[n - 1] != 'y') ||
           (n == 2 && !p_cons(c, 0) && p_cons(c, 1));
}

static bool p_ends(const pword *w, const char *suf) {
    int32_t l = (int32_t)strlen(suf);
    if (l > w->n) return false;
    for (int32_t i = 0; i < l; i++)
        if (w->c[w->n - l + i] != (unsigned char)suf[i]) return false;
    return true;
}

/* Replaces the last `drop` letters by `repl` (ASCII). */
static void p_set(pword *w, int32_t drop, const char *repl) {
    w->n -= drop;
    for (const char *p = repl; *p; p++) w->c[w->n++] = (unsigned char)*p;
}

typedef enum p_cond {
    P_NONE,  /* unconditional */
    P_M0,    /* measure(stem) > 0 */
    P_M1,    /* measure(stem) > 1 */
    P_ION,   /* measure(stem) > 1 and stem ends in s or t */
    P_LOGI,  /* measure(word[:-3]) > 0 */
    P_LL,    /* measure(word[:-1]) > 1 */
    P_E_CVC, /* measure(stem) == 1 and stem ends cvc */
    P_Y,     /* len(stem) > 1 and stem's last letter is a consonant */
} p_cond;

typedef struct p_rule {
    const char *suffix, *repl;
    p_cond cond;
} p_rule;

static bool p_check(p_cond cond, const pword *w, int32_t stem_n) {
    switch (cond) {
    case P_NONE: return true;
    case P_M0: return p_measure(w->c, stem_n) > 0;
    case P_M1: return p_measure(w->c, stem_n) > 1;
    case P_ION:
        return p_measure(w->c, stem_n) > 1 && stem_n > 0 &&
               (w->c[stem_n - 1] == 's' || w->c[stem_n - 1] == 't');
    case P_LOGI: return p_measure(w->c, w->n - 3) > 0;
    case P_LL: return p_measure(w->c, w->n - 1) > 1;
    case P_E_CVC: return p_measure(w->c, stem_n) == 1 && p_ends_cvc(w->c, stem_n);
    case P_Y: return stem_n > 1 && p_cons(w->c, stem_n - 1);
    }
    return false;
}

/* _apply_rule_list: the first rule whose suffix matches decides; if its
 * condition fails the word is left as it is. Returns whether a suffix
 * matched. */
static bool p_apply(pword *w, const p_rule *rules, int32_t n_rules) {
    for (int32_t r = 0; r < n_rules; r++) {
        if (!p_ends(w, rules[r].suffix)) continue;
        int32_t stem_n = w->n - (int32_t)strlen(rules[r].suffix);
        if (p_check(rules[r].cond, w, stem_n))
            p_set(w, (int32_t)strlen(rules[r].suffix), rules[r].repl);
        return true;
    }
    return false;
}

#define N_RULES(r) ((int32_t)(sizeof(r) / sizeof((r)[0])))

static void p_step1a(pword *w) {
    if (p_ends(w, "ies") && w->n == 4) {
        p_set(w, 3, "ie");
        return;
    }
    static const p_rule rules[] = {
        {"sses", "ss", P_NONE},
        {"ies", "i", P_NONE},
        {"ss", "ss", P_NONE},
        {"s", "", P_NONE},
    };
    p_apply(w, rules, N_RULES(rules));
}

static void p_step1b(pword *w) {
    if (p_ends(w, "ied")) {
        p_set(w, 3, w->n == 4 ? "ie" : "i");
        return;
    }
    if (p_ends(w, "eed")) {
        if (p_measure(w->c, w->n - 3) > 0) p_set(w, 3, "ee");
        return;
    }
    bool ok = false;
    if (p_ends(w, "ed") && p_contains_vowel(w->c, w->n - 2)) {
        w->n -= 2;
        ok = true;
    } else if (p_ends(w, "ing") && p_contains_vowel(w->c, w->n - 3)) {
        w->n -= 3;
        ok = true;
    }
    if (!ok) return;
    /* The rule list applied to the intermediate stem. */
    static const p_rule first[] = {
        {"at", "ate", P_NONE}, {"bl", "ble", P_NONE}, {"iz", "ize", P_NONE}};
    if (p_apply(w, first, N_RULES(first))) return;
    /* "*d": a double consonant loses one letter unless it is l, s or z. The
     * reference also tries the literal suffix "*d" at this point. */
    if (p_ends_double(w->c, w->n)) {
        int32_t last = w->c[w->n - 1];
        if (last != 'l' && last != 's' && last != 'z') w->n--;
        return;
    }
    if (p_ends(w, "*d")) {
        int32_t last = w->c[w->n - 1];
        if (last != 'l' && last != 's' && last != 'z') {
            w->n -= 2;
            w->c[w->n++] = last;
        }
        return;
    }
    /* "": add e to a short cvc stem. */
    if (p_check(P_E_CVC, w, w->n)) p_set(w, 0, "e");
}

static void p_step1c(pword *w) {
    static const p_rule rules[] = {{"y", "i", P_Y}};
    p_apply(w, rules, N_RULES(rules));
}

static void p_step2(pword *w) {
    if (p_ends(w, "alli") && p_measure(w->c, w->n - 4) > 0) {
        p_set(w, 4, "al");
        p_step2(w);
        return;
    }
    static const p_rule rules[] = {
        {"ational", "ate", P_M0}, {"tional", "tion", P_M0}, {"enci", "ence", P_M0},
        {"anci", "ance", P_M0},   {"izer", "ize", P_M0},    {"bli", "ble", P_M0},
        {"alli", "al", P_M0},     {"entli", "ent", P_M0},   {"eli", "e", P_M0},
        {"ousli", "ous", P_M0},   {"ization", "ize", P_M0}, {"ation", "ate", P_M0},
        {"ator", "ate", P_M0},    {"alism", "al", P_M0},    {"iveness", "ive", P_M0},
        {"fulness", "ful", P_M0}, {"ousness", "ous", P_M0}, {"aliti", "al", P_M0},
        {"iviti", "ive", P_M0},   {"biliti", "ble", P_M0},  {"fulli", "ful", P_M0},
        {"logi", "log", P_LOGI},
    };
    p_apply(w, rules, N_RULES(rules));
}

static void p_step3(pword *w) {
    static const p_rule rules[] = {
        {"icate", "ic", P_M0}, {"ative", "", P_M0}, {"alize", "al", P_M0}, {"iciti", "ic", P_M0},
        {"ical", "ic", P_M0},  {"ful", "", P_M0},   {"ness", "", P_M0},
    };
    p_apply(w, rules, N_RULES(rules));
}

static void p_step4(pword *w) {
    static const p_rule rules[] = {
        {"al", "", P_M1},    {"ance", "", P_M1}, {"ence", "", P_M1}, {"er", "", P_M1},
        {"ic", "", P_M1},    {"able", "", P_M1}, {"ible", "", P_M1}, {"ant", "", P_M1},
        {"ement", "", P_M1}, {"ment", "", P_M1}, {"ent", "", P_M1},  {"ion", "", P_ION},
        {"ou", "", P_M1},    {"ism", "", P_M1},  {"ate", "", P_M1},  {"iti", "", P_M1},
        {"ous", "", P_M1},   {"ive", "", P_M1},  {"ize", "", P_M1},
    };
    p_apply(w, rules, N_RULES(rules));
}

static void p_step5a(pword *w) {
    if (!p_ends(w, "e")) return;
    int32_t m = p_measure(w->c, w->n - 1);
    if (m > 1 || (m == 1 && !p_ends_cvc(w->c, w->n - 1))) w->n--;
}

static void p_step5b(pword *w) {
    static const p_rule rules[] = {{"ll", "l", P_LL}};
    p_apply(w, rules, N_RULES(rules));
}

/* Irregular forms NLTK maps directly (its `pool`). */
static const char *p_irregular(const int32_t *c, int32_t n) {
    static const char *const pool[][2] = {
        {"sky", "sky"},         {"skies", "sky"},        {"dying", "die"},
        {"lying", "lie"},       {"tying", "tie"},        {"news", "news"},
        {"innings", "inning"},  {"inning", "inning"},    {"outings", "outing"},
        {"outing", "outing"},   {"cannings", "canning"}, {"canning", "canning"},
        {"howe", "howe"},       {"proceed", "proceed"},  {"exceed", "exceed"},
        {"succeed", "succeed"},
    };
    for (size_t k = 0; k < sizeof pool / sizeof pool[0]; k++) {
        const char *s = pool[k][0];
        int32_t l = (int32_t)strlen(s), i = 0;
        if (l != n) continue;
        while (i < n && c[i] == (unsigned char)s[i]) i++;
        if (i == n) return pool[k][1];
    }
    return NULL;
}

/* stem() on code points; the result replaces *w (w has room for +1). */
static bool stem_cp(const ustr *word, ustr *out) {
    ustr low = {0};
    if (!py_lower(word, &low)) return false;
    bool ok = true;
    const char *irr = p_irregular(low.c, low.n);
    if (irr) {
        out->n = 0;
        for (const char *p = irr; *p && ok; p++) ok = us_push(out, (unsigned char)*p);
    } else if (word->n <= 2) {
        out->n = 0;
        ok = us_reserve(out, low.n);
        if (ok) {
            memcpy(out->c, low.c, (size_t)low.n * sizeof *low.c);
            out->n = low.n;
        }
    } else {
        ok = us_reserve(&low, 2);
        if (ok) {
            pword w = {low.c, low.n};
            p_step1a(&w);
            p_step1b(&w);
            p_step1c(&w);
            p_step2(&w);
            p_step3(&w);
            p_step4(&w);
            p_step5a(&w);
            p_step5b(&w);
            out->n = 0;
            ok = us_reserve(out, w.n);
            if (ok) {
                memcpy(out->c, w.c, (size_t)w.n * sizeof *w.c);
                out->n = w.n;
            }
        }
    }
    free(low.c);
    return ok;
}

is_status locomo_eval_stem(const char *word, char **out) {
    if (!word || !out) return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_stem: NULL argument");
    ustr in = {0}, st = {0};
    char *s = NULL;
    if (us_decode(word, strlen(word), &in) && stem_cp(&in, &st)) s = us_encode(st.c, st.n);
    free(in.c);
    free(st.c);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    *out = s;
    return IS_OK;
}

/* ---- token lists ------------------------------------------------------- */

typedef struct toks {
    char **t;
    int32_t n;
} toks;

static void toks_free(toks *t) {
    for (int32_t i = 0; i < t->n; i++) free(t->t[i]);
    free(t->t);
    t->t = NULL;
    t->n = 0;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* normalize_answer(text).split(), each word stemmed if `stem`; sorted. */
static bool tokens_of(const char *text, size_t len, bool stem, toks *out) {
    ustr in = {0}, norm = {0}, word = {0}, st = {0};
    bool ok = us_decode(text, len, &in) && normalize_cp(&in, &norm);
    int32_t n_words = 0;
    for (int32_t i = 0; ok && i < norm.n; i++)
        n_words += norm.c[i] != ' ' && (i == 0 || norm.c[i - 1] == ' ');
    if (ok) {
        out->t = calloc((size_t)(n_words ? n_words : 1), sizeof *out->t);
        ok = out->t != NULL;
    }
    for (int32_t i = 0; ok && i < norm.n;) {
        int32_t j = i;
        while (j < norm.n && norm.c[j] != ' ') j++;
        word.n = 0;
        ok = us_reserve(&word, j - i);
        if (ok) {
            memcpy(word.c, norm.c + i, (size_t)(j - i) * sizeof *word.c);
            word.n = j - i;
            if (stem) ok = stem_cp(&word, &st);
        }
        if (ok) {
            char *s = stem ? us_encode(st.c, st.n) : us_encode(word.c, word.n);
            ok = s != NULL;
            if (ok) out->t[out->n++] = s;
        }
        i = j + 1;
    }
    free(in.c);
    free(norm.c);
    free(word.c);
    free(st.c);
    if (!ok) {
        toks_free(out);
        return false;
    }
    qsort(out->t, (size_t)out->n, sizeof *out->t, cmp_str);
    return true;
}

/* f1_score on byte ranges. */
static bool f1_range(const char *p, size_t pl, const char *g, size_t gl, double *out) {
    toks a = {0}, b = {0};
    if (!tokens_of(p, pl, true, &a)) return false;
    if (!tokens_of(g, gl, true, &b)) {
        toks_free(&a);
        return false;
    }
    /* Counter(a) & Counter(b): a merge of the two sorted lists. */
    int32_t same = 0;
    for (int32_t i = 0, j = 0; i < a.n && j < b.n;) {
        int c = strcmp(a.t[i], b.t[j]);
        if (c == 0) {
            same++;
            i++;
            j++;
        } else if (c < 0) {
            i++;
        } else {
            j++;
        }
    }
    double f1 = 0.0;
    if (same > 0) {
        double precision = 1.0 * same / a.n, recall = 1.0 * same / b.n;
        f1 = (2 * precision * recall) / (precision + recall);
    }
    toks_free(&a);
    toks_free(&b);
    *out = f1;
    return true;
}

is_status locomo_eval_f1(const char *prediction, const char *gold, double *out) {
    if (!prediction || !gold || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_f1: NULL argument");
    if (!f1_range(prediction, strlen(prediction), gold, strlen(gold), out))
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    return IS_OK;
}

is_status locomo_eval_f1_multi(const char *prediction, const char *gold, double *out) {
    if (!prediction || !gold || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_f1_multi: NULL argument");
    /* Stripping the parts is a no-op for the score: normalisation drops
     * surrounding whitespace anyway. */
    double sum = 0.0;
    int32_t n_gold = 0;
    for (const char *g = gold;;) {
        size_t gl = strcspn(g, ",");
        double best = 0.0;
        bool first = true;
        for (const char *p = prediction;;) {
            size_t pl = strcspn(p, ",");
            double f;
            if (!f1_range(p, pl, g, gl, &f)) return is_error_set(IS_ERR_NOMEM, "out of memory");
            if (first || f > best) best = f;
            first = false;
            if (!p[pl]) break;
            p += pl + 1;
        }
        sum += best;
        n_gold++;
        if (!g[gl]) break;
        g += gl + 1;
    }
    *out = sum / n_gold;
    return IS_OK;
}

/* The prediction contains one of the adversarial category's phrases. */
static is_status adversarial(const char *prediction, bool *out) {
    ustr in = {0}, low = {0};
    char *s = NULL;
    if (us_decode(prediction, strlen(prediction), &in) && py_lower(&in, &low))
        s = us_encode(low.c, low.n);
    free(in.c);
    free(low.c);
    if (!s) return is_error_set(IS_ERR_NOMEM, "out of memory");
    *out = strstr(s, "no information available") || strstr(s, "not mentioned");
    free(s);
    return IS_OK;
}

/* A category-3 gold answer is scored by its part before the first ';'. */
static char *gold_for(const char *gold, int32_t category) {
    return category == 3 ? strndup(gold, strcspn(gold, ";")) : strdup(gold);
}

is_status locomo_eval_score(const char *prediction, const char *gold, int32_t category,
                            double *out) {
    if (!prediction || !gold || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_score: NULL argument");
    if (category < 1 || category > 5)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_score: category %d is not 1-5",
                            category);
    if (category == 5) {
        bool hit;
        is_status st = adversarial(prediction, &hit);
        if (st == IS_OK) *out = hit ? 1.0 : 0.0;
        return st;
    }
    char *g = gold_for(gold, category);
    if (!g) return is_error_set(IS_ERR_NOMEM, "out of memory");
    is_status st = category == 1 ? locomo_eval_f1_multi(prediction, g, out)
                                 : locomo_eval_f1(prediction, g, out);
    free(g);
    return st;
}

is_status locomo_eval_exact_match(const char *prediction, const char *gold, bool *out) {
    if (!prediction || !gold || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_exact_match: NULL argument");
    toks a = {0}, b = {0};
    if (!tokens_of(prediction, strlen(prediction), false, &a))
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    if (!tokens_of(gold, strlen(gold), false, &b)) {
        toks_free(&a);
        return is_error_set(IS_ERR_NOMEM, "out of memory");
    }
    /* Set equality of two sorted lists: walk both, skipping repeats. */
    bool eq = true;
    int32_t i = 0, j = 0;
    while (eq && (i < a.n || j < b.n)) {
        if (i == a.n || j == b.n || strcmp(a.t[i], b.t[j]) != 0) {
            eq = false;
            break;
        }
        const char *w = a.t[i];
        while (i < a.n && strcmp(a.t[i], w) == 0) i++;
        while (j < b.n && strcmp(b.t[j], w) == 0) j++;
    }
    toks_free(&a);
    toks_free(&b);
    *out = eq;
    return IS_OK;
}

is_status locomo_eval_exact(const char *prediction, const char *gold, int32_t category, bool *out) {
    if (!prediction || !gold || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_exact: NULL argument");
    if (category < 1 || category > 5)
        return is_error_set(IS_ERR_INVALID_ARG, "locomo_eval_exact: category %d is not 1-5",
                            category);
    if (category == 5) return adversarial(prediction, out);
    char *g = gold_for(gold, category);
    if (!g) return is_error_set(IS_ERR_NOMEM, "out of memory");
    is_status st = locomo_eval_exact_match(prediction, g, out);
    free(g);
    return st;
}

double locomo_eval_recall(const char *const *evidence, int32_t n_evidence,
                          const char *const *retrieved, int32_t n_retrieved) {
    if (n_evidence <= 0) return 1.0;
    int32_t found = 0;
    for (int32_t i = 0; i < n_evidence; i++) {
        for (int32_t j = 0; j < n_retrieved; j++) {
            if (strcmp(evidence[i], retrieved[j]) == 0) {
                found++;
                break;
            }
        }
    }
    return (double)found / n_evidence;
}

/* ---- aggregation ------------------------------------------------------- */

void locomo_eval_acc_add(locomo_eval_acc *acc, const locomo_eval_result *r) {
    acc->n++;
    acc->f1 += r->f1;
    acc->em += r->em;
    acc->recall += r->recall;
    acc->ttft_ms += r->ttft_ms;
    if (r->agree >= 0) {
        acc->n_agree++;
        acc->agree += r->agree;
        acc->f1_vs_prompt += r->f1_vs_prompt;
    }
}

locomo_eval_result locomo_eval_acc_mean(const locomo_eval_acc *acc) {
    locomo_eval_result m = {0};
    if (acc->n > 0) {
        m.f1 = acc->f1 / acc->n;
        m.em = acc->em / acc->n;
        m.recall = acc->recall / acc->n;
        m.ttft_ms = acc->ttft_ms / acc->n;
    }
    m.agree = m.f1_vs_prompt = -1.0;
    if (acc->n_agree > 0) {
        m.agree = acc->agree / acc->n_agree;
        m.f1_vs_prompt = acc->f1_vs_prompt / acc->n_agree;
    }
    return m;
}

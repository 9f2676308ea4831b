/*
 * tokenizer: byte-level BPE and SentencePiece BPE encoders and decoders
 * (see tokenizer.h for the contract and the reference we match).
 *
 * Sections: UTF-8 helpers, hash tables, construction (spec and GGUF),
 * special-token splitting, pre-tokenizers (PCRE2), BPE merging, SPM merging,
 * encode, decode.
 *
 * Both merge loops are the classic bigram priority queue (HF tokenizers'
 * Word::merge_all, llama.cpp's llm_bigram_bpe / llm_bigram_spm, sentencepiece's
 * bpe_model.cc): symbols form a linked list, candidate pairs sit in a binary
 * heap ordered by (rank or -score, left position), stale pairs are skipped
 * when popped. A word of n symbols costs O(n log n).
 *
 * Where we knowingly differ from the reference:
 *   - Unicode version: PCRE2 10.42 (Debian 12) classifies code points with
 *     Unicode 14 tables; HF's Oniguruma and Rust use newer ones. About 9,400
 *     code points assigned since (mostly CJK extensions H/I and new scripts)
 *     are \p{Cn} to us and letters or digits to HF, so words containing them
 *     split differently. A sweep of planes 0-3 and 14 with every family
 *     found no other difference.
 *   - Qwen2's NFC normaliser is utf8proc's (Debian 12: 2.8, Unicode 15);
 *     HF's is the Rust unicode-normalization crate, on a newer Unicode.
 *   - SPM: merges into UNUSED pieces (which sentencepiece performs and then
 *     resegments) are not made; none of Llama 2 / Mistral's pieces are UNUSED.
 */
#include "model/tokenizer.h"

#include "core/status.h"
#include "core/utf8.h"
#include "gguf/gguf.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#define TOKENIZER_MAX_TEXT ((size_t)1 << 30)

/* ========================= GPT-2 byte alphabet ========================== */

/* GPT-2's byte -> printable code point map: bytes that are printable and not
 * whitespace map to themselves, the other 68 to U+0100.. in byte order. */
static uint32_t gpt2_byte_to_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return (uint32_t)b;
    int n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256u + (uint32_t)n;
}

/* ============================ hash tables =============================== */

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 0x100000001b3ull;
    h ^= h >> 31;
    h *= 0x7fb5d329728ea185ull;
    h ^= h >> 27;
    return h;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint32_t table_size_for(uint64_t n) {
    uint32_t s = 16;
    while (s < 2 * n) s <<= 1;
    return s;
}

typedef struct merge_slot {
    uint64_t key;   /* (left id << 32) | right id; UINT64_MAX when empty */
    int32_t rank;   /* index in tokenizer.ggml.merges: lower merges first */
    int32_t result; /* id of left+right */
} merge_slot;

/* ============================ the tokenizer ============================= */

typedef enum pre_kind {
    PRE_GPT2,   /* HF ByteLevel(use_regex) alone */
    PRE_SMOLLM, /* HF Digits(individual) then ByteLevel(use_regex) */
    PRE_LLAMA3, /* HF Split(Llama 3 regex) then ByteLevel; ignore_merges */
    PRE_QWEN2,  /* HF NFC, Split(Qwen2 regex) then ByteLevel */
} pre_kind;

struct tokenizer {
    tokenizer_type type;
    pre_kind pre;
    bool ignore_merges; /* BPE: a word already in the vocab is one token */
    bool nfc;           /* BPE: the reference NFC-normalises text */
    bool add_bos;
    bool add_space_prefix; /* SPM */
    int32_t n_vocab;
    int32_t bos, eos, unk;

    char *text_pool;     /* raw vocab strings, each followed by a NUL */
    uint64_t *text_off;  /* [n_vocab] into text_pool */
    uint32_t *text_len;  /* [n_vocab] */
    char *piece_pool;    /* decoded bytes of each token */
    uint64_t *piece_off; /* [n_vocab] */
    uint32_t *piece_len; /* [n_vocab] */
    uint8_t *types;      /* [n_vocab] tokenizer_token_type */
    float *scores;       /* [n_vocab] SPM scores */
    uint8_t *eog;        /* [n_vocab] 1 if end of generation */

    int32_t *vocab_slots; /* string -> id, open addressing, -1 empty */
    uint32_t vocab_mask;
    merge_slot *merges; /* BPE (left,right) -> rank, result */
    uint32_t merge_mask;

    /* BPE: id of the single GPT-2 character of each byte; SPM: id of <0xNN>.
     * -1 where the vocab lacks it. */
    int32_t byte_token[256];

    /* Tokens recognised inside text, grouped by first byte, longest first
     * within a group: special[special_start[b] .. special_start[b+1]). */
    int32_t *special;
    uint32_t special_start[257];

    pcre2_code *re;       /* the family's word regex (BPE) */
    pcre2_code *re_digit; /* \p{N}, for PRE_SMOLLM */
};

static const char *tok_text(const tokenizer *t, int32_t id) {
    return t->text_pool + t->text_off[id];
}

/* Id of the vocab string p[0..n), or -1. */
static int32_t vocab_lookup(const tokenizer *t, const char *p, size_t n) {
    uint32_t i = (uint32_t)hash_bytes(p, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_slots[i];
        if (id < 0) return -1;
        if (t->text_len[id] == n && memcmp(tok_text(t, id), p, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

static const merge_slot *merge_lookup(const tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *s = &t->merges[i];
        if (s->key == UINT64_MAX) return NULL;
        if (s->key == key) return s;
        i = (i + 1) & t->merge_mask;
    }
}

/* ============================ construction ============================== */

void tokenizer_spec_init(tokenizer_spec *spec) {
    memset(spec, 0, sizeof *spec);
    spec->bos_id = spec->eos_id = spec->eot_id = spec->eom_id = -1;
    spec->unk_id = spec->pad_id = -1;
    spec->add_bos = -1;
    spec->add_space_prefix = -1;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->text_pool);
    free(t->text_off);
    free(t->text_len);
    free(t->piece_pool);
    free(t->piece_off);
    free(t->piece_len);
    free(t->types);
    free(t->scores);
    free(t->eog);
    free(t->vocab_slots);
    free(t->merges);
    free(t->special);
    pcre2_code_free(t->re);
    pcre2_code_free(t->re_digit);
    free(t);
}

/* Pre-tokenizer names, as llama.cpp groups them (llama-vocab.cpp). */
static int pre_from_name(const char *name, pre_kind *out) {
    static const struct {
        const char *name;
        pre_kind kind;
    } names[] = {
        {"default", PRE_GPT2},     {"gpt2", PRE_GPT2},        {"gpt-2", PRE_GPT2},
        {"mpt", PRE_GPT2},         {"olmo", PRE_GPT2},        {"jais", PRE_GPT2},
        {"smollm", PRE_SMOLLM},    {"starcoder", PRE_SMOLLM}, {"refact", PRE_SMOLLM},
        {"command-r", PRE_SMOLLM}, {"codeshell", PRE_SMOLLM}, {"exaone", PRE_SMOLLM},
        {"llama3", PRE_LLAMA3},    {"llama-v3", PRE_LLAMA3},  {"llama-bpe", PRE_LLAMA3},
        {"dbrx", PRE_LLAMA3},      {"smaug-bpe", PRE_LLAMA3}, {"qwen2", PRE_QWEN2},
        {"stablelm2", PRE_QWEN2},
    };
    if (!name || !*name) {
        *out = PRE_GPT2;
        return 1;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(names[i].name, name) == 0) {
            *out = names[i].kind;
            return 1;
        }
    return 0;
}

/* The word regexes of HF's tokenizer.json files (ByteLevel's built-in GPT-2
 * regex; the Split patterns of Llama 3 and Qwen2.5), with \s spelled out:
 * HF runs them with Oniguruma, whose \s is Unicode White_Space, while
 * PCRE2's \s also matches U+180E MONGOLIAN VOWEL SEPARATOR. */
#define WS                                                                                         \
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}" \
    "\\x{3000}"
static const char RE_GPT2[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+"
                              "|[" WS "]+(?![^" WS "])|[" WS "]+";
static const char RE_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+";
static const char RE_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+";
#undef WS

static is_status regex_compile(const char *pattern, pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return is_error_set(IS_ERR_INTERNAL, "tokenizer: PCRE2 rejects pattern at %zu: %s",
                            (size_t)off, (const char *)msg);
    }
    /* JIT is a speed-up only: pcre2_match() uses it when present. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return IS_OK;
}

static bool is_special_type(uint8_t ty) {
    return ty == TOKENIZER_TOKEN_CONTROL || ty == TOKENIZER_TOKEN_USER_DEFINED ||
           ty == TOKENIZER_TOKEN_UNKNOWN;
}

/* Decoded bytes of token `id` into out (at most 4 * text_len bytes). */
static size_t piece_build(const tokenizer *t, int32_t id, const int32_t *cp_to_byte, char *out) {
    const uint8_t *s = (const uint8_t *)tok_text(t, id);
    size_t n = t->text_len[id], o = 0;
    uint8_t ty = t->types[id];
    if (is_special_type(ty)) { /* rendered verbatim */
        memcpy(out, s, n);
        return n;
    }
    if (t->type == TOKENIZER_TYPE_SPM) {
        unsigned v;
        char tail;
        if (ty == TOKENIZER_TOKEN_BYTE && n == 6 &&
            sscanf((const char *)s, "<0x%2x%c", &v, &tail) == 2 && tail == '>') {
            out[0] = (char)v;
            return 1;
        }
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) {
                out[o++] = ' ';
                i += 3;
            } else {
                out[o++] = (char)s[i++];
            }
        }
        return o;
    }
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = utf8_decode((const char *)s + i, n - i, &cp);
        if (k < 0) {
            out[o++] = (char)s[i++];
            continue;
        }
        if (cp < 324 && cp_to_byte[cp] >= 0) out[o++] = (char)cp_to_byte[cp];
        else {
            memcpy(out + o, s + i, (size_t)k);
            o += (size_t)k;
        }
        i += (size_t)k;
    }
    return o;
}

static int special_order(const tokenizer *t, int32_t a, int32_t b) {
    uint8_t fa = (uint8_t)tok_text(t, a)[0], fb = (uint8_t)tok_text(t, b)[0];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (t->text_len[a] != t->text_len[b]) return t->text_len[a] > t->text_len[b] ? -1 : 1;
    return a < b ? -1 : (a > b);
}

static bool id_ok(int32_t id, int32_t n) { return id >= -1 && id < n; }

is_status tokenizer_create(const tokenizer_spec *spec, tokenizer **out) {
    if (!spec || !out || spec->n_vocab < 1 || !spec->tokens)
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_create: empty or NULL spec");
    const int32_t nv = spec->n_vocab;
    if (spec->type != TOKENIZER_TYPE_BPE && spec->type != TOKENIZER_TYPE_SPM)
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_create: bad type %d", (int)spec->type);
    if (spec->type == TOKENIZER_TYPE_BPE && spec->n_merges > 0 && !spec->merges)
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_create: merges missing");
    if (spec->n_merges < 0 || spec->n_merges > INT32_MAX)
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_create: bad merge count");
    if (!id_ok(spec->bos_id, nv) || !id_ok(spec->eos_id, nv) || !id_ok(spec->eot_id, nv) ||
        !id_ok(spec->eom_id, nv) || !id_ok(spec->unk_id, nv) || !id_ok(spec->pad_id, nv))
        return is_error_set(IS_ERR_INVALID_ARG,
                            "tokenizer_create: special token id out of range (n_vocab %d)", nv);
    pre_kind pre = PRE_GPT2;
    if (spec->type == TOKENIZER_TYPE_BPE && !pre_from_name(spec->pre, &pre))
        return is_error_set(IS_ERR_UNSUPPORTED, "tokenizer: unknown pre-tokenizer \"%s\"",
                            spec->pre);

    tokenizer *t = calloc(1, sizeof *t);
    if (!t) return is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
    is_status st = IS_ERR_NOMEM;
    t->type = spec->type;
    t->pre = pre;
    t->n_vocab = nv;
    t->bos = spec->bos_id;
    t->eos = spec->eos_id;
    t->unk = spec->unk_id;
    t->ignore_merges = spec->type == TOKENIZER_TYPE_BPE && pre == PRE_LLAMA3;
    t->nfc = spec->type == TOKENIZER_TYPE_BPE && pre == PRE_QWEN2;
    if (spec->add_bos >= 0) t->add_bos = spec->add_bos != 0;
    else t->add_bos = spec->type == TOKENIZER_TYPE_SPM || pre == PRE_LLAMA3;
    t->add_space_prefix = spec->type == TOKENIZER_TYPE_SPM && spec->add_space_prefix != 0;

    /* Vocab strings, types, scores. */
    uint64_t total = 0;
    for (int32_t i = 0; i < nv; i++) {
        if (spec->tokens[i].len > UINT32_MAX / 8 ||
            (spec->tokens[i].len && !spec->tokens[i].data)) {
            tokenizer_free(t);
            return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_create: token %d too long", i);
        }
        total += spec->tokens[i].len + 1;
    }
    t->text_pool = malloc(total);
    t->text_off = malloc(sizeof *t->text_off * (size_t)nv);
    t->text_len = malloc(sizeof *t->text_len * (size_t)nv);
    t->types = malloc((size_t)nv);
    t->scores = calloc((size_t)nv, sizeof *t->scores);
    t->eog = calloc((size_t)nv, 1);
    if (!t->text_pool || !t->text_off || !t->text_len || !t->types || !t->scores || !t->eog)
        goto fail;
    uint64_t off = 0;
    for (int32_t i = 0; i < nv; i++) {
        size_t n = spec->tokens[i].len;
        if (n) memcpy(t->text_pool + off, spec->tokens[i].data, n);
        t->text_pool[off + n] = '\0';
        t->text_off[i] = off;
        t->text_len[i] = (uint32_t)n;
        off += n + 1;
        int32_t ty = spec->token_types ? spec->token_types[i] : TOKENIZER_TOKEN_NORMAL;
        if (ty < 0 || ty > TOKENIZER_TOKEN_BYTE) ty = TOKENIZER_TOKEN_UNDEFINED;
        t->types[i] = (uint8_t)ty;
        if (spec->scores) t->scores[i] = spec->scores[i];
    }

    /* string -> id; a later duplicate wins, as in llama.cpp's map. */
    t->vocab_mask = table_size_for((uint64_t)nv) - 1;
    t->vocab_slots = malloc(sizeof *t->vocab_slots * ((size_t)t->vocab_mask + 1));
    if (!t->vocab_slots) goto fail;
    memset(t->vocab_slots, 0xFF, sizeof *t->vocab_slots * ((size_t)t->vocab_mask + 1));
    for (int32_t id = 0; id < nv; id++) {
        const char *p = tok_text(t, id);
        size_t n = t->text_len[id];
        uint32_t i = (uint32_t)hash_bytes(p, n) & t->vocab_mask;
        for (;;) {
            int32_t o = t->vocab_slots[i];
            if (o < 0) {
                t->vocab_slots[i] = id;
                break;
            }
            if (t->text_len[o] == n && memcmp(tok_text(t, o), p, n) == 0) {
                t->vocab_slots[i] = id;
                break;
            }
            i = (i + 1) & t->vocab_mask;
        }
    }

    /* Byte tokens. */
    int32_t cp_to_byte[324];
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        char s[8];
        size_t n;
        if (t->type == TOKENIZER_TYPE_BPE) {
            uint32_t cp = gpt2_byte_to_cp(b);
            cp_to_byte[cp] = b;
            n = utf8_encode(cp, s);
        } else {
            n = (size_t)snprintf(s, sizeof s, "<0x%02X>", b);
        }
        int32_t id = vocab_lookup(t, s, n);
        if (id >= 0 && t->type == TOKENIZER_TYPE_SPM && spec->token_types &&
            t->types[id] != TOKENIZER_TOKEN_BYTE)
            id = -1;
        t->byte_token[b] = id;
    }

    /* Decoded pieces. */
    {
        uint64_t cap = 0;
        for (int32_t i = 0; i < nv; i++) cap += t->text_len[i];
        t->piece_pool = malloc(cap + 1);
        t->piece_off = malloc(sizeof *t->piece_off * (size_t)nv);
        t->piece_len = malloc(sizeof *t->piece_len * (size_t)nv);
        if (!t->piece_pool || !t->piece_off || !t->piece_len) goto fail;
        uint64_t o = 0;
        char *tmp = NULL;
        uint32_t maxlen = 0;
        for (int32_t i = 0; i < nv; i++)
            if (t->text_len[i] > maxlen) maxlen = t->text_len[i];
        tmp = malloc((size_t)maxlen + 8);
        if (!tmp) goto fail;
        for (int32_t i = 0; i < nv; i++) {
            /* A piece is never longer than its text: unmapping shrinks. */
            size_t n = piece_build(t, i, cp_to_byte, tmp);
            IS_ASSERT(n <= t->text_len[i]);
            memcpy(t->piece_pool + o, tmp, n);
            t->piece_off[i] = o;
            t->piece_len[i] = (uint32_t)n;
            o += n;
        }
        free(tmp);
    }

    /* Merges. */
    if (t->type == TOKENIZER_TYPE_BPE) {
        t->merge_mask = table_size_for((uint64_t)spec->n_merges) - 1;
        t->merges = malloc(sizeof *t->merges * ((size_t)t->merge_mask + 1));
        if (!t->merges) goto fail;
        for (uint32_t i = 0; i <= t->merge_mask; i++) t->merges[i].key = UINT64_MAX;
        char *cat = NULL;
        size_t cat_cap = 0;
        for (int64_t r = 0; r < spec->n_merges; r++) {
            const char *m = spec->merges[r].data;
            size_t n = spec->merges[r].len;
            if (!m || n < 3) continue;
            const char *sp = memchr(m + 1, ' ', n - 1);
            if (!sp) continue;
            size_t la = (size_t)(sp - m), lb = n - la - 1;
            int32_t a = vocab_lookup(t, m, la), b = vocab_lookup(t, sp + 1, lb);
            if (a < 0 || b < 0) continue;
            if (la + lb > cat_cap) {
                free(cat);
                cat_cap = (la + lb) * 2;
                cat = malloc(cat_cap);
                if (!cat) goto fail;
            }
            memcpy(cat, m, la);
            memcpy(cat + la, sp + 1, lb);
            int32_t res = vocab_lookup(t, cat, la + lb);
            if (res < 0) continue;
            uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
            uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
            while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
                i = (i + 1) & t->merge_mask;
            if (t->merges[i].key == key) continue; /* keep the first rank */
            t->merges[i].key = key;
            t->merges[i].rank = (int32_t)r;
            t->merges[i].result = res;
        }
        free(cat);
    }

    /* Tokens recognised in text, bucketed by first byte, longest first. */
    {
        int32_t ns = 0;
        for (int32_t i = 0; i < nv; i++)
            if (is_special_type(t->types[i]) && t->text_len[i] > 0) ns++;
        t->special = malloc(sizeof *t->special * (size_t)(ns ? ns : 1));
        if (!t->special) goto fail;
        int32_t k = 0;
        for (int32_t i = 0; i < nv; i++)
            if (is_special_type(t->types[i]) && t->text_len[i] > 0) t->special[k++] = i;
        /* insertion sort: few specials (17 in SmolLM2, 256 in Llama 3) */
        for (int32_t i = 1; i < ns; i++) {
            int32_t v = t->special[i], j = i - 1;
            while (j >= 0 && special_order(t, v, t->special[j]) < 0) {
                t->special[j + 1] = t->special[j];
                j--;
            }
            t->special[j + 1] = v;
        }
        uint32_t pos = 0;
        for (int b = 0; b < 256; b++) {
            t->special_start[b] = pos;
            while (pos < (uint32_t)ns && (uint8_t)tok_text(t, t->special[pos])[0] == b) pos++;
        }
        t->special_start[256] = pos;
    }

    /* End of generation. */
    {
        static const char *const eog_names[] = {
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "<|end_of_text|>",
            "<|return|>",
            ("<\xEF\xBD\x9C"
             "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"), /* DeepSeek */
        };
        int32_t ids[] = {spec->eos_id, spec->eot_id, spec->eom_id};
        for (size_t i = 0; i < 3; i++)
            if (ids[i] >= 0) t->eog[ids[i]] = 1;
        for (size_t i = 0; i < sizeof eog_names / sizeof eog_names[0]; i++) {
            int32_t id = vocab_lookup(t, eog_names[i], strlen(eog_names[i]));
            if (id >= 0 && (t->types[id] == TOKENIZER_TOKEN_CONTROL ||
                            t->types[id] == TOKENIZER_TOKEN_USER_DEFINED))
                t->eog[id] = 1;
        }
    }

    if (t->type == TOKENIZER_TYPE_BPE) {
        const char *pat = pre == PRE_LLAMA3 ? RE_LLAMA3 : pre == PRE_QWEN2 ? RE_QWEN2 : RE_GPT2;
        if ((st = regex_compile(pat, &t->re)) != IS_OK) goto fail_st;
        if (pre == PRE_SMOLLM && (st = regex_compile("\\p{N}", &t->re_digit)) != IS_OK)
            goto fail_st;
    }
    *out = t;
    return IS_OK;

fail:
    st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory building a %d-token vocab", nv);
fail_st:
    tokenizer_free(t);
    return st;
}

/* ---- from GGUF ----------------------------------------------------------- */

static is_status gguf_opt_id(const gguf_ctx *g, const char *key, int32_t *id) {
    if (gguf_find_key(g, key) < 0) return IS_OK;
    uint32_t v;
    is_status st = gguf_get_u32(g, key, &v);
    if (st != IS_OK) {
        int32_t s;
        if (gguf_get_i32(g, key, &s) == IS_OK && s == -1) {
            *id = -1;
            return IS_OK;
        }
        return st;
    }
    *id = (int32_t)(v > INT32_MAX ? INT32_MAX : v);
    return IS_OK;
}

static is_status gguf_opt_bool(const gguf_ctx *g, const char *key, int8_t *v) {
    if (gguf_find_key(g, key) < 0) return IS_OK;
    bool b;
    is_status st = gguf_get_bool(g, key, &b);
    if (st == IS_OK) *v = b ? 1 : 0;
    return st;
}

is_status tokenizer_load(const gguf_ctx *g, tokenizer **out) {
    if (!g || !out) return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_load: NULL argument");
    gguf_string model;
    is_status st = gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (st != IS_OK) return st;
    tokenizer_spec spec;
    tokenizer_spec_init(&spec);
    if (model.len == 4 && memcmp(model.data, "gpt2", 4) == 0) {
        spec.type = TOKENIZER_TYPE_BPE;
    } else if (model.len == 5 && memcmp(model.data, "llama", 5) == 0) {
        spec.type = TOKENIZER_TYPE_SPM;
        spec.bos_id = 1;
        spec.eos_id = 2;
        spec.unk_id = 0; /* llama.cpp's SPM defaults */
    } else {
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "tokenizer: model \"%.*s\" is not supported "
                            "(only \"gpt2\" byte-level BPE and \"llama\" SentencePiece)",
                            (int)(model.len > 64 ? 64 : model.len), model.data);
    }

    gguf_value_type et;
    uint64_t n;
    if ((st = gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n)) != IS_OK) return st;
    if (et != GGUF_VALUE_STRING || n == 0 || n > INT32_MAX)
        return is_error_set(IS_ERR_FORMAT, "tokenizer.ggml.tokens: want a non-empty string array");
    const int32_t nv = (int32_t)n;
    spec.n_vocab = nv;

    char pre[64] = "";
    gguf_string s;
    if (gguf_find_key(g, "tokenizer.ggml.pre") >= 0) {
        if ((st = gguf_get_str(g, "tokenizer.ggml.pre", &s)) != IS_OK) return st;
        if (s.len >= sizeof pre || memchr(s.data, '\0', s.len))
            return is_error_set(IS_ERR_UNSUPPORTED, "tokenizer: unknown pre-tokenizer \"%.*s\"",
                                (int)(s.len > 63 ? 63 : s.len), s.data);
        memcpy(pre, s.data, s.len);
        pre[s.len] = '\0';
        spec.pre = pre;
    }

    tokenizer_str *toks = malloc(sizeof *toks * (size_t)nv);
    int32_t *types = NULL;
    float *scores = NULL;
    tokenizer_str *merges = NULL;
    if (!toks) return is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
    for (int32_t i = 0; i < nv; i++) {
        if ((st = gguf_get_arr_str(g, "tokenizer.ggml.tokens", (uint64_t)i, &s)) != IS_OK)
            goto done;
        toks[i].data = s.data;
        toks[i].len = (size_t)s.len;
    }
    spec.tokens = toks;

    if (gguf_find_key(g, "tokenizer.ggml.token_type") >= 0) {
        const void *d;
        if ((st = gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n)) != IS_OK) goto done;
        if ((et != GGUF_VALUE_INT32 && et != GGUF_VALUE_UINT32) || n != (uint64_t)nv) {
            st =
                is_error_set(IS_ERR_FORMAT, "tokenizer.ggml.token_type: want %d int32, got %llu %s",
                             nv, (unsigned long long)n, gguf_value_type_name(et));
            goto done;
        }
        if ((st = gguf_get_arr_data(g, "tokenizer.ggml.token_type", &d)) != IS_OK) goto done;
        types = malloc(sizeof *types * (size_t)nv);
        if (!types) {
            st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
            goto done;
        }
        memcpy(types, d, sizeof *types * (size_t)nv); /* may be unaligned in the file */
        spec.token_types = types;
    }
    if (gguf_find_key(g, "tokenizer.ggml.scores") >= 0) {
        const void *d;
        if ((st = gguf_get_arr(g, "tokenizer.ggml.scores", &et, &n)) != IS_OK) goto done;
        if (et != GGUF_VALUE_FLOAT32 || n != (uint64_t)nv) {
            st = is_error_set(IS_ERR_FORMAT, "tokenizer.ggml.scores: want %d f32, got %llu %s", nv,
                              (unsigned long long)n, gguf_value_type_name(et));
            goto done;
        }
        if ((st = gguf_get_arr_data(g, "tokenizer.ggml.scores", &d)) != IS_OK) goto done;
        scores = malloc(sizeof *scores * (size_t)nv);
        if (!scores) {
            st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
            goto done;
        }
        memcpy(scores, d, sizeof *scores * (size_t)nv);
        spec.scores = scores;
    }
    if (spec.type == TOKENIZER_TYPE_BPE) {
        if ((st = gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n)) != IS_OK) goto done;
        if (et != GGUF_VALUE_STRING || n > INT32_MAX) {
            st = is_error_set(IS_ERR_FORMAT, "tokenizer.ggml.merges: want a string array");
            goto done;
        }
        merges = malloc(sizeof *merges * (size_t)(n ? n : 1));
        if (!merges) {
            st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
            goto done;
        }
        for (uint64_t i = 0; i < n; i++) {
            if ((st = gguf_get_arr_str(g, "tokenizer.ggml.merges", i, &s)) != IS_OK) goto done;
            merges[i].data = s.data;
            merges[i].len = (size_t)s.len;
        }
        spec.n_merges = (int64_t)n;
        spec.merges = merges;
    }

    if ((st = gguf_opt_id(g, "tokenizer.ggml.bos_token_id", &spec.bos_id)) != IS_OK ||
        (st = gguf_opt_id(g, "tokenizer.ggml.eos_token_id", &spec.eos_id)) != IS_OK ||
        (st = gguf_opt_id(g, "tokenizer.ggml.eot_token_id", &spec.eot_id)) != IS_OK ||
        (st = gguf_opt_id(g, "tokenizer.ggml.eom_token_id", &spec.eom_id)) != IS_OK ||
        (st = gguf_opt_id(g, "tokenizer.ggml.unknown_token_id", &spec.unk_id)) != IS_OK ||
        (st = gguf_opt_id(g, "tokenizer.ggml.padding_token_id", &spec.pad_id)) != IS_OK ||
        (st = gguf_opt_bool(g, "tokenizer.ggml.add_bos_token", &spec.add_bos)) != IS_OK ||
        (st = gguf_opt_bool(g, "tokenizer.ggml.add_space_prefix", &spec.add_space_prefix)) != IS_OK)
        goto done;
    int32_t *idp[] = {&spec.bos_id, &spec.eos_id, &spec.eot_id,
                      &spec.eom_id, &spec.unk_id, &spec.pad_id};
    for (size_t i = 0; i < sizeof idp / sizeof idp[0]; i++) {
        if (*idp[i] >= nv) {
            st = is_error_set(IS_ERR_FORMAT,
                              "tokenizer: special token id %d out of range (n_vocab %d)", *idp[i],
                              nv);
            goto done;
        }
    }
    st = tokenizer_create(&spec, out);
done:
    free(toks);
    free(types);
    free(scores);
    free(merges);
    return st;
}

/* ============================== accessors =============================== */

tokenizer_type tokenizer_get_type(const tokenizer *t) { return t->type; }
int32_t tokenizer_n_vocab(const tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const tokenizer *t) { return t->eos; }
bool tokenizer_add_bos(const tokenizer *t) { return t->add_bos; }

bool tokenizer_is_eog(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->eog[id];
}

const char *tokenizer_token_text(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? tok_text(t, id) : "";
}

tokenizer_token_type tokenizer_token_get_type(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? (tokenizer_token_type)t->types[id]
                                      : TOKENIZER_TOKEN_UNDEFINED;
}

int32_t tokenizer_find(const tokenizer *t, const char *text) {
    return text ? vocab_lookup(t, text, strlen(text)) : -1;
}

/* ============================ encode state ============================== */

typedef struct sym {
    int32_t id; /* BPE: token id; SPM: unused */
    int32_t prev, next;
    uint32_t start, len; /* bytes in the word / fragment */
} sym;

typedef struct bigram {
    uint32_t key; /* BPE: rank; SPM: -score as an ordered integer. Lower pops first */
    int32_t left, right;
    uint32_t size;    /* SPM: bytes of the pair when pushed (staleness check) */
    int32_t lid, rid; /* BPE: ids when pushed */
    int32_t res;      /* BPE: id of the merged pair */
} bigram;

/* Maps a float to a uint32 with the same order (for heap keys). */
static uint32_t float_order(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

typedef struct enc {
    const tokenizer *t;
    int32_t *ids;
    size_t n, cap;
    sym *syms;
    size_t syms_cap;
    bigram *heap;
    size_t heap_n, heap_cap;
    char *buf; /* SPM fragment text / BPE mapped word */
    size_t buf_cap;
    pcre2_match_data *md;
    is_status st;
} enc;

/* Makes room for `need` elements of `elem` bytes in the array *pp of
 * capacity *cap (doubling). False, with the array untouched, on failure. The
 * GROW macro passes the typed pointer without aliasing it as void *. */
static bool grow_to(void *old, void **out, size_t *cap, size_t need, size_t elem) {
    *out = old;
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(old, c * elem);
    if (!q) return false;
    *out = q;
    *cap = c;
    return true;
}
#define GROW(ptr, cap, need)                                                                       \
    __extension__({                                                                                \
        void *np_;                                                                                 \
        bool ok_ = grow_to((ptr), &np_, &(cap), (need), sizeof *(ptr));                            \
        (ptr) = np_;                                                                               \
        ok_;                                                                                       \
    })

static bool emit(enc *e, int32_t id) {
    if (!GROW(e->ids, e->cap, e->n + 1)) {
        e->st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
        return false;
    }
    e->ids[e->n++] = id;
    return true;
}

/* (key, left) order: lower key first, then leftmost, as in HF and
 * sentencepiece. */
static inline bool bigram_before(const bigram *a, const bigram *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

static bool heap_push(enc *e, bigram b) {
    if (!GROW(e->heap, e->heap_cap, e->heap_n + 1)) {
        e->st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
        return false;
    }
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_before(&b, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = b;
    return true;
}

static bigram heap_pop(enc *e) {
    bigram top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && bigram_before(&e->heap[c + 1], &e->heap[c])) c++;
        if (!bigram_before(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

/* ============================== BPE ==================================== */

static bool bpe_try_pair(enc *e, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    const merge_slot *m = merge_lookup(e->t, e->syms[l].id, e->syms[r].id);
    if (!m) return true;
    bigram b = {(uint32_t)m->rank, l, r, 0, e->syms[l].id, e->syms[r].id, m->result};
    return heap_push(e, b);
}

/* Encodes one pre-tokenized word (raw bytes) by merge rank. */
static bool bpe_word(enc *e, const uint8_t *w, size_t n) {
    const tokenizer *t = e->t;
    if (n == 0) return true;
    if (t->ignore_merges) {
        /* HF BPE ignore_merges: a word that is a vocab entry is one token. */
        if (!GROW(e->buf, e->buf_cap, n * 2)) goto nomem;
        size_t m = 0;
        for (size_t i = 0; i < n; i++) m += utf8_encode(gpt2_byte_to_cp(w[i]), e->buf + m);
        int32_t id = vocab_lookup(t, e->buf, m);
        if (id >= 0) return emit(e, id);
    }
    if (n > INT32_MAX) goto nomem;
    if (!GROW(e->syms, e->syms_cap, n)) goto nomem;
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_token[w[i]];
        if (id < 0) continue; /* the vocab lacks this byte: HF (no unk) drops it */
        e->syms[ns] = (sym){id, ns - 1, ns + 1, (uint32_t)i, 1};
        ns++;
    }
    if (ns == 0) return true;
    e->syms[ns - 1].next = -1;
    e->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!bpe_try_pair(e, i, i + 1)) return false;
    while (e->heap_n) {
        bigram b = heap_pop(e);
        sym *L = &e->syms[b.left], *R = &e->syms[b.right];
        if (L->len == 0 || R->len == 0 || L->next != b.right || L->id != b.lid || R->id != b.rid)
            continue; /* stale */
        L->id = b.res;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0) e->syms[R->next].prev = b.left;
        if (!bpe_try_pair(e, L->prev, b.left) || !bpe_try_pair(e, b.left, L->next)) return false;
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next)
        if (!emit(e, e->syms[i].id)) return false;
    return true;
nomem:
    e->st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
    return false;
}

/* Runs `re` over s[0..n) as a whole subject (so lookaheads stop at n) and
 * encodes every match and every gap between matches as a word (HF Split
 * "Isolated"). */
static bool bpe_regex_words(enc *e, const pcre2_code *re, const char *s, size_t n) {
    size_t off = 0;
    while (off < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            e->st = is_error_set(IS_ERR_INTERNAL, "tokenizer: PCRE2 match failed: %s",
                                 (const char *)msg);
            return false;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (ms > off && !bpe_word(e, (const uint8_t *)s + off, ms - off)) return false;
        if (me == ms) { /* empty match: our patterns have none; step one char */
            me = ms + utf8_seq_len((uint8_t)s[ms]);
            if (!bpe_word(e, (const uint8_t *)s + ms, me - ms)) return false;
        } else if (!bpe_word(e, (const uint8_t *)s + ms, me - ms)) {
            return false;
        }
        off = me;
    }
    return off >= n || bpe_word(e, (const uint8_t *)s + off, n - off);
}

static bool bpe_fragment(enc *e, const char *s, size_t n) {
    const tokenizer *t = e->t;
    if (t->pre != PRE_SMOLLM) return bpe_regex_words(e, t->re, s, n);
    /* HF Digits(individual_digits): every \p{N} character is its own piece;
     * the ByteLevel regex then runs on each stretch between them. */
    size_t off = 0;
    while (off < n) {
        int rc = pcre2_match(t->re_digit, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            e->st = is_error_set(IS_ERR_INTERNAL, "tokenizer: PCRE2 match failed (%d)", rc);
            return false;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (ms > off && !bpe_regex_words(e, t->re, s + off, ms - off)) return false;
        if (!bpe_word(e, (const uint8_t *)s + ms, me - ms)) return false;
        off = me;
    }
    return off >= n || bpe_regex_words(e, t->re, s + off, n - off);
}

/* ============================== SPM ==================================== */

/* Vocab id usable as a merge result or initial symbol (sentencepiece's
 * pieces_: normal and user-defined; control, byte and unknown are not text). */
static int32_t spm_lookup(const tokenizer *t, const char *p, size_t n) {
    int32_t id = vocab_lookup(t, p, n);
    if (id < 0) return -1;
    uint8_t ty = t->types[id];
    return ty == TOKENIZER_TOKEN_NORMAL || ty == TOKENIZER_TOKEN_USER_DEFINED ? id : -1;
}

static bool spm_try_pair(enc *e, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    const sym *L = &e->syms[l], *R = &e->syms[r];
    int32_t id = spm_lookup(e->t, e->buf + L->start, L->len + R->len);
    if (id < 0) return true;
    bigram b = {float_order(-e->t->scores[id]), l, r, L->len + R->len, id, 0, 0};
    return heap_push(e, b);
}

static bool spm_fragment(enc *e, const char *s, size_t n, bool prefix) {
    const tokenizer *t = e->t;
    /* Escape spaces as U+2581 and add the dummy prefix. */
    size_t cap = n * 3 + 3;
    if (!GROW(e->buf, e->buf_cap, cap)) goto nomem;
    size_t m = 0;
    if (prefix) {
        memcpy(e->buf, "\xE2\x96\x81", 3);
        m = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(e->buf + m, "\xE2\x96\x81", 3);
            m += 3;
        } else e->buf[m++] = s[i];
    }
    if (m > INT32_MAX) goto nomem;
    if (!GROW(e->syms, e->syms_cap, m)) goto nomem;
    int32_t ns = 0;
    for (size_t i = 0; i < m;) {
        size_t k = utf8_seq_len((uint8_t)e->buf[i]);
        e->syms[ns] = (sym){-1, ns - 1, ns + 1, (uint32_t)i, (uint32_t)k};
        ns++;
        i += k;
    }
    if (ns == 0) return true;
    e->syms[ns - 1].next = -1;
    e->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!spm_try_pair(e, i, i + 1)) return false;
    while (e->heap_n) {
        bigram b = heap_pop(e);
        sym *L = &e->syms[b.left], *R = &e->syms[b.right];
        if (L->len == 0 || R->len == 0 || L->next != b.right || L->len + R->len != b.size) continue;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0) e->syms[R->next].prev = b.left;
        if (!spm_try_pair(e, L->prev, b.left) || !spm_try_pair(e, b.left, L->next)) return false;
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next) {
        const sym *S = &e->syms[i];
        int32_t id = spm_lookup(t, e->buf + S->start, S->len);
        if (id >= 0) {
            if (!emit(e, id)) return false;
            continue;
        }
        /* Byte fallback, else the unknown token (once per symbol). */
        bool all_bytes = true;
        for (uint32_t k = 0; k < S->len; k++)
            if (t->byte_token[(uint8_t)e->buf[S->start + k]] < 0) all_bytes = false;
        if (all_bytes) {
            for (uint32_t k = 0; k < S->len; k++)
                if (!emit(e, t->byte_token[(uint8_t)e->buf[S->start + k]])) return false;
        } else if (t->unk >= 0 && !emit(e, t->unk)) {
            return false;
        }
    }
    return true;
nomem:
    e->st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
    return false;
}

/* ============================== encode ================================= */

/* Encodes the text between two special tokens. For SPM every such fragment
 * gets the dummy "▁" prefix, as sentencepiece run on each fragment (HF's
 * legacy Llama tokenizer, llama.cpp) does. */
static bool encode_text(enc *e, const char *s, size_t n) {
    const tokenizer *t = e->t;
    if (n == 0) return true;
    if (t->type == TOKENIZER_TYPE_SPM) return spm_fragment(e, s, n, t->add_space_prefix);
    if (t->nfc) {
        utf8proc_uint8_t *norm = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &norm,
                                          UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (r < 0) {
            e->st = is_error_set(r == UTF8PROC_ERROR_NOMEM ? IS_ERR_NOMEM : IS_ERR_INTERNAL,
                                 "tokenizer: NFC failed: %s", utf8proc_errmsg(r));
            return false;
        }
        bool ok = bpe_fragment(e, (const char *)norm, (size_t)r);
        free(norm);
        return ok;
    }
    return bpe_fragment(e, s, n);
}

is_status tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_bos,
                           bool parse_special, int32_t **out, size_t *n_out) {
    if (!t || !out || !n_out || (!text && len))
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_encode: NULL argument");
    if (len > TOKENIZER_MAX_TEXT)
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_encode: text of %zu bytes exceeds 1 GiB",
                            len);
    char *fixed = NULL;
    size_t flen = 0;
    is_status st = utf8_sanitize(text, len, &fixed, &flen);
    if (st != IS_OK) return st;
    const char *s = fixed ? fixed : text;
    size_t n = fixed ? flen : len;

    enc e = {.t = t, .st = IS_OK};
    if (t->type == TOKENIZER_TYPE_BPE) {
        e.md = pcre2_match_data_create_from_pattern(t->re, NULL);
        if (!e.md) {
            e.st = is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
            goto end;
        }
    }
    if (add_bos && t->add_bos && t->bos >= 0 && !emit(&e, t->bos)) goto end;

    /* Split out special tokens, leftmost-longest, then encode the text
     * between them. */
    size_t frag = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t hit = -1;
        for (uint32_t k = t->special_start[b]; k < t->special_start[b + 1]; k++) {
            int32_t id = t->special[k];
            uint32_t l = t->text_len[id];
            if (l > n - i || memcmp(s + i, tok_text(t, id), l) != 0) continue;
            if (!parse_special && t->types[id] != TOKENIZER_TOKEN_USER_DEFINED) continue;
            hit = id;
            break; /* longest first within the bucket */
        }
        if (hit < 0) continue;
        if (!encode_text(&e, s + frag, i - frag)) goto end;
        if (!emit(&e, hit)) goto end;
        i += t->text_len[hit] - 1;
        frag = i + 1;
    }
    if (!encode_text(&e, s + frag, n - frag)) goto end;

end:
    pcre2_match_data_free(e.md);
    free(e.syms);
    free(e.heap);
    free(e.buf);
    free(fixed);
    if (e.st != IS_OK) {
        free(e.ids);
        return e.st;
    }
    *out = e.ids;
    *n_out = e.n;
    return IS_OK;
}

/* ============================== decode ================================= */

size_t tokenizer_token_to_piece(const tokenizer *t, int32_t id, bool render_special, char *buf,
                                size_t cap) {
    if (!t || id < 0 || id >= t->n_vocab) return 0;
    uint8_t ty = t->types[id];
    if (!render_special && (ty == TOKENIZER_TOKEN_CONTROL || ty == TOKENIZER_TOKEN_UNKNOWN))
        return 0;
    size_t n = t->piece_len[id];
    if (buf) memcpy(buf, t->piece_pool + t->piece_off[id], n < cap ? n : cap);
    return n;
}

is_status tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool render_special,
                           char **out, size_t *n_out) {
    if (!t || !out || !n_out || (!ids && n))
        return is_error_set(IS_ERR_INVALID_ARG, "tokenizer_decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += tokenizer_token_to_piece(t, ids[i], render_special, NULL, 0);
    char *o = malloc(total + 1);
    if (!o) return is_error_set(IS_ERR_NOMEM, "tokenizer: out of memory");
    size_t m = 0;
    bool strip = t->type == TOKENIZER_TYPE_SPM && t->add_space_prefix;
    for (size_t i = 0; i < n; i++) {
        size_t k = tokenizer_token_to_piece(t, ids[i], render_special, o + m, total - m);
        tokenizer_token_type ty = tokenizer_token_get_type(t, ids[i]);
        if (strip && ty != TOKENIZER_TOKEN_CONTROL && ty != TOKENIZER_TOKEN_UNKNOWN &&
            ty != TOKENIZER_TOKEN_UNDEFINED) {
            strip = false;
            if (k > 0 && o[m] == ' ' && ty == TOKENIZER_TOKEN_NORMAL) {
                memmove(o + m, o + m + 1, k - 1);
                k--;
            }
        }
        m += k;
    }
    o[m] = '\0';
    *out = o;
    *n_out = m;
    return IS_OK;
}

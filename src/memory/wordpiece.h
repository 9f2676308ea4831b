/*
 * wordpiece: the BERT tokenizer (text -> token ids) of the memory layer's
 * sentence-embedding model (memory/embedder.h).
 *
 * What we match token for token is Hugging Face `tokenizers` with the
 * model's tokenizer.json (BertNormalizer, BertPreTokenizer, WordPiece,
 * [CLS] ... [SEP] template), which is what sentence-transformers runs:
 *
 *   0. special tokens written in the raw text ("[SEP]", "[MASK]", ...: the
 *      five of the vocabulary, case-sensitive, leftmost-longest) are kept as
 *      their ids, as HF's added-token matching does; text between them goes
 *      through the steps below;
 *   1. clean: drop U+0000, U+FFFD and "other" characters (Cc, Cf, Co, Cs)
 *      except \t \n \r; every whitespace character becomes a space;
 *   2. CJK ideographs (the CJK Unified Ideographs blocks and compatibility
 *      ideographs) get a space on each side, so each is a word;
 *   3. strip accents (when lowercasing and strip_accents is not false):
 *      canonical decomposition (NFD) and removal of nonspacing marks (Mn);
 *   4. lowercase (per character, full Unicode mapping);
 *   5. split on whitespace, and make every punctuation character (ASCII
 *      punctuation and Unicode P*) a word of its own;
 *   6. WordPiece per word: greedy longest-match-first against the
 *      vocabulary, continuation pieces prefixed "##"; a word with more than
 *      max_input_chars_per_word characters, or one with a position that no
 *      piece matches, becomes a single [UNK];
 *   7. [CLS] pieces [SEP], truncated to max_len ids in all (so at most
 *      max_len - 2 pieces, taken from the start).
 *
 * Unicode data come from utf8proc 2.8 (Unicode 15: categories, NFD, case
 * mapping). HF uses Rust's current tables for whitespace, NFD and lowercase
 * but the much older tables of the `unicode_categories` crate for "other",
 * punctuation and nonspacing marks, so characters added to Unicode since
 * then tokenise differently: tried one at a time inside words, 568 of the
 * 1,112,063 scalar values differ, all of them marks, punctuation or format
 * characters assigned in Unicode 9.0 or later (e.g. U+0890 ARABIC POUND
 * MARK ABOVE is dropped here and kept there, U+2E52 is punctuation here).
 * The golden corpus (tests/golden/embed/) leaves those out on purpose.
 *
 * Input need not be valid UTF-8: an ill-formed sequence becomes U+FFFD,
 * which step 1 drops (so invalid bytes vanish, as if the caller had decoded
 * with errors="replace" before calling HF).
 *
 * A wordpiece is immutable after loading; any number of threads may encode
 * with it at once.
 */
#ifndef IS_MEMORY_WORDPIECE_H
#define IS_MEMORY_WORDPIECE_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct wordpiece wordpiece;

/* Normalisation switches, from the model's tokenizer_config.json. */
typedef struct wordpiece_params {
    bool lowercase;                   /* do_lower_case */
    int32_t strip_accents;            /* -1: follow lowercase (HF's null), 0: no, 1: yes */
    bool tokenize_chinese_chars;      /* space around CJK ideographs */
    int32_t max_input_chars_per_word; /* longer words become [UNK]; HF: 100 */
} wordpiece_params;

/* BERT uncased defaults: lowercase, strip accents, CJK split, 100. */
wordpiece_params wordpiece_default_params(void);

/* Reads a vocab.txt (one token a line, line i is id i; "\n" or "\r\n").
 * IS_ERR_IO if the file cannot be read; IS_ERR_FORMAT if it is empty, holds
 * a duplicate token, an empty line, invalid UTF-8, or lacks [CLS], [SEP] or
 * [UNK]; IS_ERR_NOMEM. *out is unchanged on failure. */
is_status wordpiece_load(const char *vocab_path, wordpiece_params params, wordpiece **out);

/* Same, from `n` bytes of vocab.txt content already in memory. */
is_status wordpiece_load_buffer(const char *data, size_t n, wordpiece_params params,
                                wordpiece **out);

void wordpiece_free(wordpiece *wp);

int32_t wordpiece_n_vocab(const wordpiece *wp);

/* The id of token `text` (exact bytes, e.g. "##ing"), or -1. */
int32_t wordpiece_token_id(const wordpiece *wp, const char *text, size_t len);

/* The NUL-terminated text of token `id`, or NULL when out of range. */
const char *wordpiece_token_text(const wordpiece *wp, int32_t id);

int32_t wordpiece_cls_id(const wordpiece *wp);
int32_t wordpiece_sep_id(const wordpiece *wp);
int32_t wordpiece_unk_id(const wordpiece *wp);
int32_t wordpiece_pad_id(const wordpiece *wp); /* -1 if the vocabulary has no [PAD] */

/* Tokenises `len` bytes of `text` (any bytes) into [CLS] pieces [SEP],
 * writing at most `max_len` ids to `ids` and their count to *n_out
 * (2 <= *n_out <= max_len). IS_ERR_INVALID_ARG if max_len < 2 or a pointer
 * is NULL (text may be NULL when len is 0); IS_ERR_NOMEM. On failure
 * *n_out is 0 and ids are unspecified. */
is_status wordpiece_encode(const wordpiece *wp, const char *text, size_t len, int32_t max_len,
                           int32_t *ids, int32_t *n_out);

#endif

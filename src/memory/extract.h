/*
 * extract: facts from a conversation, written by the served LLM (ingestion
 * path (b) of the memory layer; Mem0's `add` with infer=true).
 *
 * The conversation's messages are shown to the model as one user message
 * ("Input:" then "role: content" lines) under a fixed system prompt that
 * asks for the facts worth remembering about the user as JSON:
 *
 *   {"facts": ["Is vegetarian", "Lives in Lisbon with two cats"]}
 *
 * and the reply is generated greedily, begun for the model with the
 * object's opening `{"facts": [` (which small models then mostly continue
 * in the right shape, where left alone they often answer in prose; that
 * opening counts as part of the reply when it is parsed). Models do
 * not always comply, so the reply is parsed leniently where that is safe
 * and strictly where it is not:
 *
 *   - text around the JSON object is ignored (a preamble, a code fence):
 *     the first balanced {...} of the reply is taken (braces inside JSON
 *     strings do not count), and generation stops as soon as it closes;
 *   - that object must parse as JSON and have a "facts" array (at its top,
 *     or in an object nested in it) of at most EXTRACT_MAX_FACTS facts:
 *     strings, or objects (small models write {"name": ..., "description":
 *     ...}), which become their first text-like field ("fact", "text",
 *     "memory", "content", "description", "statement", "value") or else
 *     their scalar fields as "key: value; ...". Each fact must be non-empty once surrounding
 *     whitespace is trimmed, at most EXTRACT_MAX_FACT_BYTES bytes and valid
 *     UTF-8; exact duplicates are dropped, order is kept.
 *
 * Anything else (no object, an unterminated one, invalid JSON, a missing
 * or mistyped "facts", too many or too long facts) is IS_ERR_FORMAT, with a
 * message naming the problem and quoting the start of the reply: the
 * caller skips the messages and warns, nothing is stored. An empty array is
 * a valid answer (nothing worth remembering).
 *
 * The caller runs the model (serve/http/memories.c, through the scheduler,
 * stopping when the object closes). The system prompt is the same for
 * every call, so its KV is reused and only the new conversation is
 * prefilled.
 */
#ifndef IS_MEMORY_EXTRACT_H
#define IS_MEMORY_EXTRACT_H

#include "inferscale.h"

#include <stddef.h>
#include <stdint.h>

#define EXTRACT_MAX_FACTS      50
#define EXTRACT_MAX_FACT_BYTES 500

/* The fixed system prompt (a constant string). */
const char *extract_system_prompt(void);
/* The opening the reply is begun with ({"facts": [); a caller that runs
 * the model itself prefills it and parses it followed by the model's text. */
const char *extract_reply_start(void);

/* Parses and validates a model reply of `len` bytes (any bytes, not
 * necessarily NUL-terminated) as described above. On success *facts is a
 * malloc'd array of *n_facts malloc'd strings (free with
 * extract_facts_free; the array is allocated even when *n_facts == 0).
 * IS_ERR_FORMAT (message says why), IS_ERR_INVALID_ARG (NULL pointers),
 * IS_ERR_NOMEM. Outputs unchanged on failure. */
is_status extract_parse(const char *reply, size_t len, char ***facts, int32_t *n_facts);

void extract_facts_free(char **facts, int32_t n_facts);

#endif

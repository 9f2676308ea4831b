/*
 * memory_prompt: the token layout shared by the `prompt` and `kv` memory
 * modes, so that they differ only in how the memory segment's KV arrives.
 *
 *   [ serving prefix ][ fact 1 ][ fact 2 ] ... [ fact k ][ suffix ]
 *
 * The serving prefix is the chat template up to and including the header of
 * the memory section in the system message; each fact is "- text\n"; the
 * suffix closes the system message and holds the user's query and the
 * assistant header. Every piece is tokenised on its own, so the concatenated
 * token sequence is the same whether a fact's KV is injected or its tokens
 * are prefilled.
 *
 * A fact's encoding context (issue: context-window encoding) is the serving
 * prefix, then its `w` preceding conversation turns, one "turn\n" each, then
 * the fact itself.
 */
#ifndef IS_SERVE_MEMORY_PROMPT_H
#define IS_SERVE_MEMORY_PROMPT_H

#include "model/model.h"

typedef struct memory_prompt memory_prompt;

/* Default memory-section header placed in the system message. */
#define MEMORY_PROMPT_DEFAULT_HEADER                                                               \
    "You are a helpful assistant with a long-term memory of the user. Answer the user's "         \
    "question using what you remember. What you remember:\n"

/* Renders the layout for `m`'s chat template. header may be NULL (default). */
is_status memory_prompt_create(const model *m, const char *header, memory_prompt **out);
void memory_prompt_free(memory_prompt *p);

/* The serving prefix, owned by p. */
const int32_t *memory_prompt_prefix(const memory_prompt *p, int32_t *n);

/* Tokens of one fact as it appears in the memory segment ("- text\n"). */
is_status memory_prompt_fact(const memory_prompt *p, const char *text, int32_t **toks, int32_t *n);

/* Tokens of encoding-context turns ("turn\n" each). */
is_status memory_prompt_context(const memory_prompt *p, const char *const *turns, int32_t n_turns,
                                int32_t **toks, int32_t *n);

/* Tokens after the memory segment: end of the system message, the query as
 * the user's message, and the assistant header. */
is_status memory_prompt_suffix(const memory_prompt *p, const char *query, int32_t **toks, int32_t *n);

#endif

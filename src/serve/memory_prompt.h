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

#include "model/chat.h"
#include "model/model.h"

typedef struct memory_prompt memory_prompt;

/* Default memory-section header placed in the system message. */
#define MEMORY_PROMPT_DEFAULT_HEADER                                                               \
    "You are a helpful assistant with a long-term memory of the user. Answer the user's "          \
    "question using what you remember. What you remember:\n"

/* Renders the layout for `m`'s chat template. header may be NULL (default). */
is_status memory_prompt_create(const model *m, const char *header, memory_prompt **out);
void memory_prompt_free(memory_prompt *p);

/* The serving prefix, owned by p. */
const int32_t *memory_prompt_prefix(const memory_prompt *p, int32_t *n);

/* Tokens of one fact as it appears in the memory segment ("- text\n"). */
is_status memory_prompt_fact(const memory_prompt *p, const char *text, int32_t **toks, int32_t *n);

/* A fact's text with the date it was learnt, "[8 May 2023] text", the one
 * form both memory modes show and encode (a dated fact is tokenised as
 * the fact "- [date] text\n"), so that "when" questions can be answered
 * from memory. An empty or NULL date gives the text alone. *out is
 * malloc'd. IS_ERR_INVALID_ARG (NULL text), IS_ERR_NOMEM. */
is_status memory_prompt_dated_text(const char *date, const char *text, char **out);

/* Tokens of encoding-context turns ("turn\n" each). */
is_status memory_prompt_context(const memory_prompt *p, const char *const *turns, int32_t n_turns,
                                int32_t **toks, int32_t *n);

/* Tokens after the memory segment: end of the system message, the query as
 * the user's message, and the assistant header. */
is_status memory_prompt_suffix(const memory_prompt *p, const char *query, int32_t **toks,
                               int32_t *n);

/* Tokens after the memory segment for a conversation (the client's
 * messages, oldest first): the end of the memory system message, each
 * message as its own turn (a client system message becomes a system turn
 * after the memory one; Mistral, whose template keeps one system message,
 * gets it appended to the memory one instead), then the assistant header.
 * The template is rendered with placeholders for the contents: its text is
 * tokenised with control tokens recognised, each content on its own
 * without, so "<|im_end|>" typed by a user stays text. For one user
 * message this equals memory_prompt_suffix(). Roles must be system, user
 * or assistant. IS_ERR_INVALID_ARG (no messages, NULL fields, another
 * role, an order the template refuses), IS_ERR_UNSUPPORTED (a template
 * that renders the serving prefix differently or drops a message),
 * IS_ERR_NOMEM. *toks is malloc'd. */
is_status memory_prompt_chat_suffix(const memory_prompt *p, const chat_message *msgs, int32_t n,
                                    int32_t **toks, int32_t *n_toks);

/* The whole prompt of a conversation with no memory (mode off): the
 * messages rendered with the chat template alone (its default system
 * prompt included where it has one), then the assistant header; same
 * tokenisation rule and errors as memory_prompt_chat_suffix(). */
is_status memory_prompt_chat_plain(const memory_prompt *p, const chat_message *msgs, int32_t n,
                                   int32_t **toks, int32_t *n_toks);

#endif

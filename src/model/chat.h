/*
 * chat: renders a conversation into the prompt text a chat model was tuned on.
 *
 * Models carry their chat format as a Jinja template (tokenizer.chat_template
 * in the GGUF). We do not embed a Jinja interpreter: the Llama-family models
 * we serve use one of three formats, which we detect from the template text
 * and render in C. The reference for each is the model's own template run by
 * jinja2 (tools/make_tokenizer_golden.py); tests compare byte for byte.
 *
 *   CHATML   <|im_start|>role\ncontent<|im_end|>\n ...   (SmolLM2, Qwen 2.5)
 *            If the first message is not a system message, the template's
 *            default system prompt is inserted first (SmolLM2: "You are a
 *            helpful AI assistant named SmolLM, trained by Hugging Face").
 *            The default is read from the GGUF's template; with no GGUF or
 *            no literal default there, none is inserted.
 *   LLAMA3   <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n
 *            content (trimmed)<|eot_id|> ...   (Meta-Llama-3-Instruct)
 *   MISTRAL  <s>[INST] user [/INST]assistant</s>[INST] ...   (Mistral
 *            Instruct v0.1/v0.2); a system message is prepended to the first
 *            user message followed by "\n\n", as Mistral's later templates do.
 *
 * The rendered text contains the control tokens as text (and, for LLAMA3
 * and MISTRAL, the BOS token's text): encode it with parse_special = true
 * and add_bos = false.
 */
#ifndef IS_MODEL_CHAT_H
#define IS_MODEL_CHAT_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct gguf_ctx gguf_ctx;

typedef enum chat_template_kind {
    CHAT_TEMPLATE_CHATML = 0,
    CHAT_TEMPLATE_LLAMA3 = 1,
    CHAT_TEMPLATE_MISTRAL = 2,
} chat_template_kind;

typedef struct chat_message {
    const char *role;    /* "system", "user", "assistant" (NUL-terminated UTF-8) */
    const char *content; /* NUL-terminated */
} chat_message;

/* The format of `g`'s tokenizer.chat_template: "<|im_start|>" -> CHATML,
 * "<|start_header_id|>" -> LLAMA3, "[INST]" -> MISTRAL; CHATML when the key
 * is absent, unreadable or unrecognised (and for g == NULL). */
chat_template_kind chat_template_detect(const gguf_ctx *g);

/* A constant name: "chatml", "llama3", "mistral". */
const char *chat_template_name(chat_template_kind kind);

/* Renders msgs[0..n) in `kind`'s format. add_assistant appends the header
 * that starts the assistant's reply (CHATML, LLAMA3; MISTRAL needs none).
 * g_or_null supplies the default system prompt (CHATML) and the BOS/EOS
 * token texts (LLAMA3, MISTRAL; defaults "<|begin_of_text|>", "<s>", "</s>").
 * On success *out is a malloc'd NUL-terminated string (caller frees).
 * Errors: IS_ERR_INVALID_ARG (NULL pointers, a message with NULL role or
 * content, an unknown kind; MISTRAL: roles other than system/user/assistant,
 * a system message not first, or user/assistant not alternating from user,
 * which the reference template rejects too), IS_ERR_NOMEM. *out unchanged on
 * failure. */
is_status chat_render(chat_template_kind kind, const gguf_ctx *g_or_null, const chat_message *msgs,
                      size_t n, bool add_assistant, char **out);

/* The part of a message's content that `kind` writes into the rendered
 * text: bytes [*start, *start + return value) of content. All of it, except
 * LLAMA3, whose template trims whitespace (Python str.strip()). Lets a
 * caller render a conversation with placeholders for the contents and
 * tokenise the contents on their own (serve/memory_prompt.c). */
size_t chat_content_span(chat_template_kind kind, const char *content, size_t *start);

#endif

/*
 * textout: what of the generated text may be shown yet.
 *
 * Generated text grows a token piece at a time, and two things must not
 * reach a client early:
 *   - the beginning of a stop string: a stop string is never shown, and
 *     until the text after it is known, "Obs" may be the start of the stop
 *     string "Observation:". The longest suffix of the pending text that is
 *     a proper prefix of some stop string is held back;
 *   - half a UTF-8 character: byte-level tokenizers split multi-byte
 *     characters across tokens, and a client building JSON strings or
 *     terminal output from each piece would see invalid text. A trailing
 *     lead byte whose continuation bytes have not arrived is held back (an
 *     invalid sequence is not held: it never completes).
 * When a stop string completes, the text before it is the rest of the
 * answer and the stop string and everything after it are dropped. At the
 * end of generation (end of turn, length) whatever was held is given out.
 *
 * Used by the public API's sessions (engine/api.c) and by the serving
 * scheduler (serve/scheduler.c), so both end and cut text the same way.
 */
#ifndef IS_ENGINE_TEXTOUT_H
#define IS_ENGINE_TEXTOUT_H

#include "inferscale.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct textout {
    char *buf; /* everything generated so far (NUL-terminated) */
    size_t len, cap;
    size_t emitted; /* bytes of buf already given out */
    size_t stop_at; /* where the stop string begins, once one completed */
    bool stopped;
    const char *const *stop; /* borrowed; must outlive the textout */
    size_t n_stop;
} textout;

/* Starts empty; stop strings are borrowed (empty ones are ignored). */
void textout_init(textout *o, const char *const *stop, size_t n_stop);
void textout_free(textout *o);

/* Appends a piece (any bytes, NULs included). Sets *stopped when a stop
 * string is now complete (then nothing more should be appended).
 * IS_ERR_NOMEM leaves the textout unchanged. */
is_status textout_push(textout *o, const char *piece, size_t len, bool *stopped);

/* The text that may be given out now, from the last call on: after a stop,
 * everything up to the stop string; otherwise up to what is held back.
 * Marks it given out. *len may be 0. */
const char *textout_take(textout *o, size_t *len);

/* At the end of generation: everything not given out yet (held-back bytes
 * included; after a stop, what textout_take gives). */
const char *textout_flush(textout *o, size_t *len);

#endif

/*
 * status: the one error mechanism of InferScale.
 *
 * Every fallible function returns an is_status (zero ok, negative failure).
 * Where the reason matters to a person (a file offset, a key name), the
 * function also records a one-line message with is_error_set(); callers
 * print it with is_error_last(). The message is thread-local, so HTTP threads
 * and the engine thread do not overwrite each other's.
 *
 * Broken invariants (bugs) are not statuses: they trip IS_ASSERT, which
 * prints file and line and aborts.
 */
#ifndef IS_CORE_STATUS_H
#define IS_CORE_STATUS_H

#include "inferscale.h"

#include <stdio.h>
#include <stdlib.h>

/* Records a formatted message for the current thread and returns `st`, so a
 * failure path reads `return is_error_set(IS_ERR_FORMAT, "...", ...);`. */
is_status is_error_set(is_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Forgets the current thread's message. */
void is_error_clear(void);

#define IS_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif

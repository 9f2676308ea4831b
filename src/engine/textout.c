#include "engine/textout.h"

#include "core/status.h"
#include "core/utf8.h"

#include <stdlib.h>
#include <string.h>

void textout_init(textout *o, const char *const *stop, size_t n_stop) {
    memset(o, 0, sizeof *o);
    o->stop = stop;
    o->n_stop = stop ? n_stop : 0;
}

void textout_free(textout *o) {
    free(o->buf);
    memset(o, 0, sizeof *o);
}

/* Bytes at the end of the pending text that are a proper prefix of a stop
 * string (the longest such suffix over all stop strings). */
static size_t stop_hold(const textout *o) {
    size_t pending = o->len - o->emitted, hold = 0;
    for (size_t i = 0; i < o->n_stop; i++) {
        size_t sl = strlen(o->stop[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--) {
            if (k <= pending && memcmp(o->buf + o->len - k, o->stop[i], k) == 0) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

/* Bytes of an unfinished UTF-8 character at the end of the text, which
 * the next piece may complete. */
static size_t utf8_hold(const textout *o) { return o->len - utf8_complete_prefix(o->buf, o->len); }

is_status textout_push(textout *o, const char *piece, size_t len, bool *stopped) {
    *stopped = o->stopped;
    if (o->stopped) return IS_OK;
    if (o->len + len + 1 > o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 256;
        while (cap < o->len + len + 1) cap *= 2;
        char *nb = realloc(o->buf, cap);
        if (!nb) return is_error_set(IS_ERR_NOMEM, "out of memory");
        o->buf = nb;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, piece, len);
    o->len += len;
    o->buf[o->len] = '\0';
    /* A stop string cannot begin in text already given out: its start would
     * have been held back. So the search starts at `emitted`. */
    size_t at = (size_t)-1;
    for (size_t i = 0; i < o->n_stop; i++) {
        size_t sl = strlen(o->stop[i]);
        if (sl == 0) continue;
        const char *hit = memmem(o->buf + o->emitted, o->len - o->emitted, o->stop[i], sl);
        if (hit && (size_t)(hit - o->buf) < at) at = (size_t)(hit - o->buf);
    }
    if (at != (size_t)-1) {
        o->stopped = true;
        o->stop_at = at;
        *stopped = true;
    }
    return IS_OK;
}

const char *textout_take(textout *o, size_t *len) {
    size_t ready;
    if (o->stopped) {
        ready = o->stop_at;
    } else {
        size_t hs = stop_hold(o), hu = utf8_hold(o);
        size_t hold = hs > hu ? hs : hu;
        ready = o->len - hold;
    }
    const char *p = o->buf ? o->buf + o->emitted : "";
    *len = ready > o->emitted ? ready - o->emitted : 0;
    if (ready > o->emitted) o->emitted = ready;
    return p;
}

const char *textout_flush(textout *o, size_t *len) {
    if (o->stopped) return textout_take(o, len);
    const char *p = o->buf ? o->buf + o->emitted : "";
    *len = o->len - o->emitted;
    o->emitted = o->len;
    return p;
}

#include "core/status.h"

#include <stdarg.h>
#include <string.h>

static _Thread_local char error_message[512];

const char *is_status_to_string(is_status st) {
    switch (st) {
    case IS_OK: return "ok";
    case IS_ERR_INVALID_ARG: return "invalid argument";
    case IS_ERR_IO: return "I/O error";
    case IS_ERR_FORMAT: return "malformed file or data";
    case IS_ERR_UNSUPPORTED: return "unsupported";
    case IS_ERR_NOMEM: return "out of memory";
    case IS_ERR_CONTEXT_FULL: return "context full";
    case IS_ERR_NOT_FOUND: return "not found";
    case IS_ERR_MISMATCH: return "mismatch";
    case IS_ERR_INTERNAL: return "internal error";
    case IS_ERR_BUSY: return "busy";
    case IS_ERR_CANCELLED: return "cancelled";
    }
    return "unknown status";
}

is_status is_error_set(is_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_message, sizeof error_message, fmt, ap);
    va_end(ap);
    return st;
}

void is_error_clear(void) { error_message[0] = '\0'; }

const char *is_error_last(void) {
    return error_message[0] ? error_message : "no error message recorded";
}

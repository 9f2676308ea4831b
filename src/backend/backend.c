/*
 * backend: what every backend shares behind the interface (options, status,
 * fault injection). Creating a backend by name is registry.c's, which sits
 * above the implementations in the link order.
 */
#include "backend/backend.h"

#include "core/status.h"

#include <string.h>

/* ---- options --------------------------------------------------------------------- */

is_status backend_set_option(backend *be, backend_option opt, uint64_t value) {
    if (!be) return is_error_set(IS_ERR_INVALID_ARG, "backend_set_option: no backend");
    is_status st = be->ops->set_option ? be->ops->set_option(be, opt, value) : IS_ERR_UNSUPPORTED;
    if (st == IS_ERR_UNSUPPORTED)
        return is_error_set(st, "%s backend: no option %d", be->ops->name, (int)opt);
    return st;
}

is_status backend_configure(backend *be, const char *spec, char *desc, size_t n) {
    if (!be) return is_error_set(IS_ERR_INVALID_ARG, "backend_configure: no backend");
    if (be->ops->configure) return be->ops->configure(be, spec, desc, n);
    if (spec && spec[strspn(spec, " ,")])
        return is_error_set(IS_ERR_UNSUPPORTED, "%s backend: no settings (got '%s')", be->ops->name,
                            spec);
    if (desc && n) desc[0] = '\0';
    return IS_OK;
}

const char *backend_options_help(const char *name) {
#ifdef IS_HAVE_CUDA
    if (name && strcmp(name, "cuda") == 0) return cuda_options_help();
#endif
    return name && strcmp(name, "cuda") == 0
               ? "                          (none: this build has no CUDA backend)\n"
               : "                          (none)\n";
}

size_t backend_free_bytes(backend *be) {
    return be && be->ops->free_bytes ? be->ops->free_bytes(be) : 0;
}

/* ---- failures and fault injection ------------------------------------------------- */

is_status backend_status(backend *be) {
    if (!be || !be->ops->status) return IS_OK;
    return be->ops->status(be);
}

is_status backend_recover(backend *be) {
    if (!be) return IS_OK;
    if (__atomic_load_n(&be->fault.stuck, __ATOMIC_ACQUIRE))
        return is_error_set(IS_ERR_INTERNAL, "%s backend: an injected fault keeps it failed",
                            be->ops->name);
    if (!be->ops->recover) return IS_OK;
    return be->ops->recover(be);
}

void backend_fault_arm(backend *be, int64_t n, bool stuck) {
    int64_t at = n > 0 ? __atomic_load_n(&be->fault.ops, __ATOMIC_ACQUIRE) + n : 0;
    __atomic_store_n(&be->fault.stuck, n > 0 && stuck, __ATOMIC_RELEASE);
    __atomic_store_n(&be->fault.fail_at, at, __ATOMIC_RELEASE);
}

int64_t backend_op_count(const backend *be) {
    return __atomic_load_n(&be->fault.ops, __ATOMIC_ACQUIRE);
}

bool backend_fault_tick(backend *be) {
    int64_t i = __atomic_add_fetch(&be->fault.ops, 1, __ATOMIC_ACQ_REL);
    int64_t at = __atomic_load_n(&be->fault.fail_at, __ATOMIC_ACQUIRE);
    /* Fires once: a later op of the same count cannot fail again. */
    return at != 0 && i == at &&
           __atomic_compare_exchange_n(&be->fault.fail_at, &at, 0, false, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

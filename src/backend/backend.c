/*
 * backend_create: the one place a backend is chosen by name, so the public
 * API, the CLI and the benchmarks agree on what "cuda" means in a build
 * without it.
 */
#include "backend/backend.h"

#include "core/status.h"
#ifdef IS_HAVE_CUDA
#include "backend_cuda.h"
#endif

#include <string.h>

bool backend_available(const char *name) {
    if (!name || strcmp(name, "cpu") == 0) return true;
#ifdef IS_HAVE_CUDA
    if (strcmp(name, "cuda") == 0) return true;
#endif
    return false;
}

is_status backend_create(const char *name, int32_t n_threads, backend **out) {
    if (!out) return is_error_set(IS_ERR_INVALID_ARG, "backend_create: no output");
    if (!name || strcmp(name, "cpu") == 0) return backend_cpu_create(n_threads, out);
    if (strcmp(name, "cuda") == 0) {
#ifdef IS_HAVE_CUDA
        return backend_cuda_create(0, out);
#else
        return is_error_set(IS_ERR_UNSUPPORTED, "backend 'cuda' is not available in this build "
                                                "(configure with nvcc present and -DIS_CUDA=ON)");
#endif
    }
    return is_error_set(IS_ERR_UNSUPPORTED, "unknown backend '%s' (cpu or cuda)", name);
}

/*
 * registry: the one place a backend is chosen by name, so the public API,
 * the CLI and the benchmarks agree on what "cuda" means in a build without
 * it. It is the only file that names the implementations: it belongs to the
 * library above them (CMakeLists.txt), so that the CUDA library links down
 * to the backend interface and never back up to its creator.
 */
#include "backend/backend.h"
#include "backend/retrieval.h"

#include "core/status.h"
#ifdef IS_HAVE_CUDA
#include "backend_cuda.h"
#include "retrieval_cuda.h"
#endif

#include <string.h>

#define NO_CUDA_HINT "(configure with nvcc present and -DIS_CUDA=ON)"

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
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "backend 'cuda' is not available in this build " NO_CUDA_HINT);
#endif
    }
    return is_error_set(IS_ERR_UNSUPPORTED, "unknown backend '%s' (cpu or cuda)", name);
}

is_status retrieval_backend_get(const char *name, const retrieval_ops **out) {
    if (!name || !out)
        return is_error_set(IS_ERR_INVALID_ARG, "retrieval_backend_get: NULL argument");
    if (strcmp(name, "cpu") == 0)
        return is_error_set(IS_ERR_UNSUPPORTED,
                            "retrieval on 'cpu' is the memory layer's own embedder and index");
    if (strcmp(name, "cuda") == 0) {
#ifdef IS_HAVE_CUDA
        *out = retrieval_cuda_ops();
        return IS_OK;
#else
        return is_error_set(
            IS_ERR_UNSUPPORTED,
            "GPU retrieval: backend 'cuda' is not available in this build " NO_CUDA_HINT);
#endif
    }
    return is_error_set(IS_ERR_UNSUPPORTED, "unknown retrieval backend '%s' (cuda)", name);
}

#!/usr/bin/env bash
# build_llamacpp.sh: builds llama.cpp's CPU benchmark tools, the outside reference that
# bench/run_cpu_bench.sh compares InferScale against.
#
# Why this route: only Debian and PyPI are reachable from our machines, and the PyPI package
# llama-cpp-python ships its source distribution with llama.cpp vendored under vendor/llama.cpp.
# So we fetch that sdist with pip (no binary wheel, no dependencies), unpack it, and build only
# llama.cpp itself with CMake (CPU only, Release, -DGGML_NATIVE=ON so it uses this machine's
# AVX2/AVX-512 like our own -march=native build).
#
# Idempotent: every step is skipped when its output is already there. Everything lives under
# third_party/ (git-ignored):
#   third_party/llama-cpp-python-sdist/   the downloaded sdist (.tar.gz)
#   third_party/llama-cpp-python-src/     the unpacked sdist
#   third_party/llama.cpp-build/          the CMake build tree; binaries in bin/
#
# Usage: scripts/build_llamacpp.sh            (default: pinned version below, -j2)
#        LLAMACPP_PY_VERSION=0.3.36 JOBS=2 scripts/build_llamacpp.sh
#        FORCE=1 scripts/build_llamacpp.sh     (rebuild the CMake tree from scratch)
# Prints the path of llama-bench on its last line. Takes ~10-20 min on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TP="$ROOT/third_party"
# Pinned so benchmark numbers are comparable between runs; bump deliberately.
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
SDIST_DIR="$TP/llama-cpp-python-sdist"
SRC_DIR="$TP/llama-cpp-python-src"
BUILD_DIR="$TP/llama.cpp-build"
LLAMA_DIR="$SRC_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"

mkdir -p "$TP" "$SDIST_DIR" "$SRC_DIR"

# 1. Download the sdist (only the source archive, never a wheel, never dependencies).
SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    echo "== downloading llama-cpp-python $VERSION sdist"
    python3 -m pip download --no-binary :all: --no-deps \
        -d "$SDIST_DIR" "llama-cpp-python==$VERSION"
    SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz)"
fi

# 2. Unpack.
if [ ! -f "$LLAMA_DIR/CMakeLists.txt" ]; then
    echo "== extracting $SDIST"
    tar -xzf "$SDIST" -C "$SRC_DIR"
fi
if [ ! -f "$LLAMA_DIR/CMakeLists.txt" ]; then
    echo "error: $LLAMA_DIR/CMakeLists.txt not found in the sdist" >&2
    exit 1
fi

# 3. Configure (CPU only). Always re-run: it is cheap, and it makes a change of flags below
#    take effect on an existing build tree (CMake then rebuilds only what changed).
#    AMX is switched off on purpose: with -march=native on a CPU that has AMX (Sapphire Rapids
#    and later, like our CI machines), ggml repacks Q4_1/Q8_0 weights into its AMX buffer and
#    llama-bench segfaults in ggml_backend_amx_mul_mat at the first prefill (seen here with
#    llama.cpp 0c1e570; a known, unfixed bug: llama.cpp's GitHub issue 20824). -mno-amx-* keeps every
#    other native feature (AVX-512, VNNI, BF16) and the regular CPU kernels. LLAMACPP_AMX=1
#    re-enables it. The sdist has no build number; the vendored commit is recorded below.
AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "${LLAMACPP_AMX:-0}" = "1" ]; then
    AMX_FLAGS=""
fi
if [ "${FORCE:-0}" = "1" ]; then
    rm -rf "$BUILD_DIR"
fi
echo "== configuring into $BUILD_DIR"
cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$AMX_FLAGS" -DCMAKE_CXX_FLAGS="$AMX_FLAGS" \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENCL=OFF \
    -DGGML_BLAS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
    -DBUILD_SHARED_LIBS=OFF > "$TP/llama.cpp-configure.log"

# 4. Build only what we use: llama-bench (the benchmark), llama-simple (a tiny greedy
#    generator, to eyeball that the GGUF loads and produces sane text) and llama-tokenize
#    (to cross-check our tokenizer's ids). Both extras are small once libllama is built.
echo "== building llama-bench, llama-simple, llama-tokenize (-j$JOBS)"
cmake --build "$BUILD_DIR" --config Release -j "$JOBS" --target llama-bench llama-simple llama-tokenize

# 5. Record what was built, for the benchmark report. The sdist keeps the vendored submodule's
#    git metadata, so the exact llama.cpp commit is usually known; otherwise fall back to the
#    CHANGELOG line that names it.
#    Guard: without its own .git, git would walk up and report *our* repository's commit.
LLAMA_COMMIT=""
if [ "$(git -C "$LLAMA_DIR" rev-parse --show-toplevel 2>/dev/null || true)" = "$(cd "$LLAMA_DIR" && pwd -P)" ]; then
    LLAMA_COMMIT="$(git -C "$LLAMA_DIR" rev-parse HEAD 2>/dev/null || true)"
fi
case "$LLAMA_COMMIT" in
    ""|*" "*) LLAMA_COMMIT="$(grep -m1 -o 'llama.cpp@[0-9a-f]*' "$SRC_DIR/llama_cpp_python-$VERSION/CHANGELOG.md" \
                             | sed 's/.*@//' || echo unknown)" ;;
esac
{
    echo "llama.cpp commit: ${LLAMA_COMMIT:-unknown} (vendored in llama-cpp-python $VERSION, PyPI sdist)"
    echo "cmake: -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BLAS=OFF (CPU only); extra flags: ${AMX_FLAGS:-none}"
    echo "compiler: $(${CXX:-c++} --version | head -1)"
} > "$BUILD_DIR/VERSION.txt"

BENCH_BIN="$BUILD_DIR/bin/llama-bench"
if [ ! -x "$BENCH_BIN" ]; then
    echo "error: $BENCH_BIN was not produced" >&2
    exit 1
fi
cat "$BUILD_DIR/VERSION.txt"
echo "$BENCH_BIN"

#!/usr/bin/env bash
# Builds InferScale and runs its test suite (the README's test command).
# Installs what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
cd build
# GPU tests are included: without a device they report "Skipped" (exit 77).
ctest --output-on-failure -j"$(nproc)" "$@"

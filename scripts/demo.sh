#!/usr/bin/env bash
# The main job on the default model: sets up, builds, and runs InferScale.
# Extra arguments go to 'inferscale generate' (default: a chat question).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target inferscale-cli >/dev/null
if [ $# -eq 0 ]; then
  set -- --chat -p "What are three good ways to remember a friend's birthday?" -n 128 --temp 0
fi
exec build/tools/inferscale generate "$@"

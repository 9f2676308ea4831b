#!/usr/bin/env bash
# Runs `inferscale eval locomo` on the GPU machine (issue 4's full table):
# every question of every conversation, k = 20 and k = 50 in parallel, with
# the CUDA backend. Retrieval needs the embedding model, which that machine
# does not have, so it is done here first and carried:
#
#   here:   for k in 20 50; do build/tools/inferscale eval locomo --retrieve-only --k $k \
#             --save-retrieval .evaldata/retr_k$k.tsv; done
#           mkdir -p .evaldata/locomo && cp ../shared/data/locomo/*.json .evaldata/locomo/
#           scripts/gpu_prepare.sh                      (deps and the model in two parts)
#   device: call 1: carry [".gpumodel_a"], command "bash scripts/gpu_eval_locomo.sh --stage"
#           call 2 (within the 30 s the machine stays warm): carry [".gpumodel_b", ".gpudeps",
#           ".evaldata"], command "bash scripts/gpu_eval_locomo.sh"
#
# Results come back in $OUT: locomo_k20.csv(.md), locomo_k50.csv(.md) and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
BUILD=$REPO/build-gpu
mkdir -p "$OUT"
if [ "${1:-}" = "--stage" ]; then
  # The first half of the model stays in the ignored models/ folder while
  # the machine is warm; carried folders not named in the next call are not.
  mkdir -p models/.stage && cp .gpumodel_a/part.* models/.stage/ && ls -la models/.stage
  exit
fi
[ -d models/.stage ] && [ ! -d .gpumodel_a ] && mkdir -p .gpumodel_a && cp models/.stage/part.* .gpumodel_a/
section() { echo; echo "=== $* ($(date +%T))"; }
exec > >(tee "$OUT/gpu_eval.log") 2>&1
source "$REPO/scripts/gpu_env.sh"

section build
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON "${CMAKE_EXTRA[@]}" \
  > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" --target inferscale-cli > "$OUT/build.log" 2>&1 \
  || { grep -E 'error' "$OUT/build.log" | head -30; exit 1; }

section "eval locomo (k = 20 and 50 in parallel)"
for k in 20 50; do
  timeout "${IS_EVAL_TIMEOUT:-500}" "$BUILD/tools/inferscale" eval locomo --backend cuda \
    --data-dir .evaldata/locomo --load-retrieval ".evaldata/retr_k$k.tsv" --k "$k" \
    --kv-dtype f16 --store "/tmp/locomo-store-k$k" --out "$OUT/locomo_k$k.csv" -t 4 \
    > "$OUT/locomo_k$k.log" 2>&1 &
done
wait
for k in 20 50; do echo "--- k = $k"; tail -25 "$OUT/locomo_k$k.log"; done

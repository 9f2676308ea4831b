#!/usr/bin/env bash
# Runs `inferscale eval locomo` on the GPU machine (BENCHMARKS.md's LoCoMo table):
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

# Jobs "K:CONV" (default: every conversation at k = 20 and 50), one process
# each: the small model leaves the GPU mostly idle between launches, so
# parallel processes (through MPS where it starts) finish sooner than one.
JOBS=${IS_EVAL_JOBS:-}
if [ -z "$JOBS" ]; then
  for k in 20 50; do for f in .evaldata/locomo/*.json; do JOBS+="$k:$(basename "$f" .json) "; done; done
fi
command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
section "eval locomo: $JOBS"
mkdir -p "$OUT/eval"
pids=()
for job in $JOBS; do
  k=${job%%:*} conv=${job#*:}
  timeout "${IS_EVAL_TIMEOUT:-500}" "$BUILD/tools/inferscale" eval locomo --backend cuda \
    --data-dir .evaldata/locomo --conv "$conv" --load-retrieval ".evaldata/retr_k$k.tsv" --k "$k" \
    --kv-dtype f16 --store "/tmp/locomo-store-k$k-$conv" --out "$OUT/eval/locomo_k${k}_$conv.csv" -t 2 \
    > "$OUT/eval/locomo_k${k}_$conv.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
echo quit | nvidia-cuda-mps-control 2>/dev/null
for f in "$OUT"/eval/*.log; do echo "--- $f"; grep -E "^time:|error" "$f"; done
# At most 8 files come back: one archive.
tar -czf "$OUT/eval.tar.gz" -C "$OUT" eval && rm -rf "$OUT/eval"

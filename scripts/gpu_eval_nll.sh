#!/usr/bin/env bash
# The teacher-forced LoCoMo table (`inferscale eval locomo --nll`) on the GPU
# machine, in two device calls, for a tree that the device does not have
# (a branch): the main checkout travels, and this branch's changed files
# travel in an overlay archive beside the evaluation data.
#
#   here:   retrieval files as in scripts/gpu_eval_locomo.sh (retr_k20.tsv,
#           retr_k50.tsv), then in the main checkout's ignored .dev/NAME/:
#           overlay.tar (git archive of this branch's changed files),
#           locomo.tar.xz (the conversations), retr_k*.tsv, this script
#   device: call 1: carry [".gpumodel_a", ".dev/NAME"],
#                   command "bash .dev/NAME/gpu_eval_nll.sh --stage NAME"
#           call 2 (within the 30 s the machine stays warm): carry
#                   [".gpumodel_b", ".gpudeps"], command
#                   "bash models/.stage/gpu_eval_nll.sh NAME"
#
# The source is copied to models/.src (ignored, so later calls do not put
# main's files back over the overlay), built there with the CUDA backend,
# and the runs in IS_NLL_JOBS ("K:MODES:EXTRA" each, EXTRA's commas become
# spaces) go in parallel, every conversation in one process per job so that
# each job's table covers all of them. Results: $OUT/nll.tar.gz.
set -uo pipefail
if [ "${1:-}" = "--stage" ]; then
  mkdir -p models/.stage && cp .gpumodel_a/part.* ".dev/$2"/* models/.stage/ && ls -la models/.stage
  exit
fi
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT" "$OUT/nll"
exec > >(tee "$OUT/gpu_eval_nll.log") 2>&1
section() { echo; echo "=== $* ($(date +%T))"; }
mkdir -p .gpumodel_a && cp models/.stage/part.* .gpumodel_a/
rm -rf models/.src && mkdir -p models/.src
cp -r CMakeLists.txt include src cuda tools tests bench scripts fuzz models/.src/
tar -xf models/.stage/overlay.tar -C models/.src
mkdir -p models/.src/.evaldata/locomo && tar -xJf models/.stage/locomo.tar.xz -C models/.src/.evaldata/locomo
cp models/.stage/retr_k*.tsv models/.src/.evaldata/
cp -r .gpumodel_a .gpumodel_b .gpudeps models/.src/ 2>/dev/null
cd models/.src
BUILD=$PWD/build-gpu
REPO=$PWD
source scripts/gpu_env.sh
section build
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON "${CMAKE_EXTRA[@]}" \
  > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" --target inferscale-cli > "$OUT/build.log" 2>&1 \
  || { grep -E 'error' "$OUT/build.log" | head -30; exit 1; }
JOBS=${IS_NLL_JOBS:-"20:kv0,kv3,kv20: 50:kv0,kv20: 20:kv0:--no-dates"}
command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
section "eval locomo --nll: $JOBS"
pids=()
i=0
for job in $JOBS; do
  k=${job%%:*} rest=${job#*:} modes=${rest%%:*} extra=${rest#*:}
  i=$((i + 1))
  timeout "${IS_NLL_TIMEOUT:-400}" "$BUILD/tools/inferscale" eval locomo --backend cuda --nll --no-generate \
    --data-dir .evaldata/locomo --load-retrieval ".evaldata/retr_k$k.tsv" --k "$k" --modes "$modes" \
    --kv-dtype f16 --store "/tmp/nll-store-$i" --out "$OUT/nll/job${i}_k${k}.csv" -t 2 ${extra//,/ } \
    > "$OUT/nll/job${i}_k${k}.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
echo quit | nvidia-cuda-mps-control 2>/dev/null
for f in "$OUT"/nll/*.log; do echo "--- $f"; grep -E "^time:|error" "$f"; done
tar -czf "$OUT/nll.tar.gz" -C "$OUT" nll && rm -rf "$OUT/nll"

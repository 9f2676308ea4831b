#!/usr/bin/env bash
# The teacher-forced LoCoMo table (`inferscale eval locomo --nll`) on the GPU
# machine, for a tree that the device does not have
# (a branch): the main checkout travels, and this branch's changed files
# travel in an overlay archive beside the evaluation data.
#
#   here:   retrieval files as in scripts/gpu_eval_locomo.sh (retr_k20.tsv,
#           retr_k50.tsv), then in the main checkout's ignored .dev/NAME/:
#           overlay.tar (git archive of this branch's changed files),
#           locomo.tar.xz (the conversations), retr_k*.tsv, this script
#           and the default model cut into pieces that fit a call beside the
#           tree (split -b 48000000 -d -a 1 MODEL m.part.; sha256 in
#           model.sha256), the last piece in .dev/NAME, the others in
#           .dev/NAME1, .dev/NAME2, ...
#   device: one call per other piece, each within the 30 s the machine
#           stays warm: carry [".dev/NAMEi"], command
#           "mkdir -p models/.stage && cp .dev/NAMEi/m.part.* models/.stage/";
#           then carry [".dev/NAME", ".gpudeps"], command
#           "bash .dev/NAME/gpu_eval_nll.sh"
#
# The source is copied to models/.src (ignored, so later calls do not put
# main's files back over the overlay), built there with the CUDA backend,
# and the runs in IS_NLL_JOBS ("K:MODES:EXTRA" each, EXTRA's commas become
# spaces) go in parallel, every conversation in one process per job so that
# each job's table covers all of them. Results: $OUT/nll.tar.gz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT" "$OUT/nll"
exec > >(tee "$OUT/gpu_eval_nll.log") 2>&1
section() { echo; echo "=== $* ($(date +%T))"; }
rm -rf models/.src && mkdir -p models/.src/models
cp -r CMakeLists.txt include src cuda tools tests bench scripts fuzz .gpudeps models/.src/
tar -xf "$HERE/overlay.tar" -C models/.src
mkdir -p models/.src/.evaldata/locomo && tar -xJf "$HERE/locomo.tar.xz" -C models/.src/.evaldata/locomo
cp "$HERE"/retr_k*.tsv models/.src/.evaldata/
MODEL=models/.src/models/SmolLM2-135M-Instruct.Q4_1.gguf
cat models/.stage/m.part.* "$HERE"/m.part.* > "$MODEL"
[ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat "$HERE/model.sha256")" ] && echo "model reassembled" \
  || { echo "model pieces do not match their sha256"; ls -la models/.stage "$HERE"; exit 1; }
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

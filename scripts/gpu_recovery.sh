#!/usr/bin/env bash
# The recovery techniques' device call (memory scaling, BENCHMARKS.md "Memory:
# the kv-vs-prompt gap by gold-answer likelihood"): GPU tests, the
# teacher-forced LoCoMo instrument over a grid of memory scalings, and the
# TTFT cost of the chosen one, in one call on the H200.
#
#   here:   build (cmake --build build --target inferscale-cli bench_gpu
#           test_mem_scale_cuda test_cuda_ops test_flash_engines), then in the
#           main checkout's ignored .dev/NAME/: this branch's tree without
#           tests/golden, bench/results and docs; the binaries, stripped, in
#           prebuilt/; retrieval made here in evaldata/ (OMP_WAIT_POLICY=PASSIVE
#           inferscale eval locomo --retrieve-only --k 50 -t 1 --save-retrieval
#           evaldata/retr_k50.tsv; retr_k20.tsv is its first 20 of each line,
#           the same list since hybrid search ranks the top max(k, 100)):
#           awk -F'\t' 'BEGIN{OFS="\t"} {n=split($5,a,","); m=n<20?n:20;
#           s=a[1]; for(i=2;i<=m;i++) s=s","a[i]; $3=m; $5=s; print}'.
#   device: three calls, each within the 30 s the machine stays warm, since
#           a call's tree (the main checkout, 14 MB) and carry must fit 64 MiB:
#           carry [".gm1", ".gpudeps"]: "cp .gm1/part /tmp/p1 && cp -r
#           .gpudeps /tmp/gpudeps"; carry [".gm2", "locomo", ".whl"]: "cp
#           .gm2/part /tmp/p2 && cp -r locomo /tmp/locomo && cp -r .whl
#           /tmp/whl"; carry [".gm3", ".dev/NAME"]: "cat /tmp/p1 /tmp/p2
#           .gm3/part > /tmp/model.gguf && cd .dev/NAME && ln -s /tmp/gpudeps
#           .gpudeps && bash scripts/gpu_recovery.sh".
#
# The binaries built here run there with the carried -dev packages' libraries
# (scripts/gpu_env.sh); where they do not, the tree is built there instead.
# Conversations are split: TUNE (parameters chosen on them) and the others
# (reported). Each conversation is one process (all modes of the grid share
# its prompt and off passes and its fact records); the processes run at once.
# Results under $OUT: recovery.log, nll.tar.gz (per-question CSVs), bench.tar.gz.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$SRC/gpu-out}
mkdir -p "$OUT/nll" "$OUT/bench"
exec > >(tee "$OUT/recovery.log") 2>&1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
section() { echo; echo "=== $* ($(el) s)"; }
cd "$SRC"
BUILD=$SRC/build-gpu
REPO=$SRC
source scripts/gpu_env.sh
MODEL=/tmp/model.gguf
DATA=${IS_LOCOMO:-/tmp/locomo}
echo "model: $(sha256sum "$MODEL" | cut -c1-16) (expect $(cut -c1-16 ../../.gm3/sha256 2>/dev/null))"

section binaries
BIN=$SRC/prebuilt
ok=1
for b in inferscale bench_gpu test_mem_scale_cuda test_blend_cuda; do
  [ -x "$BIN/$b" ] || ok=0
  [ -x "$BIN/$b" ] && ldd "$BIN/$b" | grep "not found" && ok=0
done
if [ $ok = 0 ]; then
  echo "prebuilt binaries do not run here: building"
  GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON "${CMAKE_EXTRA[@]}" \
    > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build "$BUILD" -j "$(nproc)" --target inferscale-cli bench_gpu test_mem_scale_cuda \
    test_blend_cuda test_cuda_ops test_flash_engines > "$OUT/build.log" 2>&1 || { grep error "$OUT/build.log" | head -30; exit 1; }
  mkdir -p "$BIN"
  cp "$BUILD"/tools/inferscale "$BUILD"/bench/bench_gpu "$BUILD"/tests/engine/test_mem_scale_cuda \
    "$BUILD"/tests/engine/test_blend_cuda \
    "$BUILD"/tests/cuda/test_cuda_ops "$BUILD"/tests/cuda/test_flash_engines "$BIN"/
fi
echo "binaries ready ($(el) s)"

# The 8B shape's random GGUF for the TTFT cost, written meanwhile.
GGUF=/tmp/llama31-8b.f16.gguf
if [ "${IS_REC_8B:-1}" = 1 ] && ls /tmp/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/whl/*.whl \
    > "$OUT/bench/pip.log" 2>&1
  ( PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gen_random_gguf.py --preset llama31-8b \
      --type f16 --out "$GGUF" > "$OUT/bench/gen.log" 2>&1; echo "rc $? at $(el) s" >> "$OUT/bench/gen.log" ) &
  GEN_PID=$!
fi

section "tests (gpu)"
# The engine case reads the default model where the test was built to find it.
want=$(strings "$BIN/test_mem_scale_cuda" | grep -m1 'SmolLM2-135M-Instruct.Q4_1.gguf$' || true)
[ -n "$want" ] && mkdir -p "$(dirname "$want")" && ln -sf "$MODEL" "$want"
# IS_REC_TESTS=0 skips them where `ctest -L gpu` ran them in the same call.
if [ "${IS_REC_TESTS:-1}" = 1 ]; then
  for t in test_mem_scale_cuda test_blend_cuda test_flash_engines test_cuda_ops; do
    [ -x "$BIN/$t" ] || continue
    timeout 120 "$BIN/$t" > "$OUT/bench/$t.log" 2>&1
    echo "$t: rc $? ($(grep -cE '^\[       OK' "$OUT/bench/$t.log") ok, $(grep -cE '^\[  FAILED|^\[  ERROR' "$OUT/bench/$t.log") failed)"
  done
  grep -E "err|moved|vs prefill" "$OUT/bench/test_mem_scale_cuda.log" | head -60
  grep -E "ratio|deviations" "$OUT/bench/test_blend_cuda.log" | head -20
fi

# The cost side on the 8B shape, before the eval (which does not time):
# the mapped attention's cost does not depend on the values of T and S,
# only on whether a tile holds memory keys, so one scaling stands for all.
bench() { # MODEL TAG ARGS...
  local m=$1 tag=$2; shift 2
  timeout 120 "$BIN/bench_gpu" -m "$m" -k 50 -c bf16 -t '' -r "${IS_REC_REPS:-9}" -o "$OUT/bench/$tag.csv" "$@" \
    > "$OUT/bench/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E "^\| 50 \||^\| k \|" "$OUT/bench/$tag.log" | head -4
}
if [ -n "${GEN_PID:-}" ]; then
  section "TTFT at k = 50, 8B shape: plain kv, scaled (1.5, 2), first 4 tokens recomputed"
  while kill -0 "$GEN_PID" 2>/dev/null && [ "$(el)" -lt "${IS_REC_GEN_BY:-150}" ]; do sleep 2; done
  kill -0 "$GEN_PID" 2>/dev/null && { echo "GGUF not written by $(el) s: no 8B bench"; pkill -P "$GEN_PID"; }
  tail -2 "$OUT/bench/gen.log"
  if ! kill -0 "$GEN_PID" 2>/dev/null && [ -s "$GGUF" ]; then
    bench "$GGUF" 8b_plain
    bench "$GGUF" 8b_scaled -M 1.5,2
    bench "$GGUF" 8b_r2 -R 2  # fused into the query's forward
    bench "$GGUF" 8b_r4 -R 4
    bench "$GGUF" 8b_b0.15 -B 0.15  # CacheBlend: its two passes after the injection
    bench "$GGUF" 8b_b0.3 -B 0.3
  fi
  rm -f "$GGUF"
fi

GRID20=${IS_REC_GRID:-kv0,kv0t1.2,kv0t1.5,kv0t2,kv0t3,kv0s2,kv0t1.5s2,kv0t2s2,kv0t1.5s0.7,kv0r2,kv0r4,kv0r8,kv0r16,kv0t1.5s2r4}
GRID50=${IS_REC_GRID50:-kv0,kv0t1.5,kv0t2,kv0t1.5s2,kv0r2,kv0r4,kv0r8}
section "eval locomo --nll: k = 20 $GRID20; k = 50 $GRID50"
command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
CONVS=${IS_REC_CONVS:-"26 30 41 42 43 44 47"}
pids=()
job() { # K MODES TAG CONV: a process of its own (killed at the time limit, its rows so far kept)
  timeout "${IS_REC_T:-130}" "$BIN/inferscale" eval locomo --backend cuda --nll --no-generate \
    --data-dir "$DATA" --conv "$4" --load-retrieval "evaldata/retr_k$1.tsv" --k "$1" --modes "$2" \
    --kv-dtype f16 --store "/tmp/rec-store-$4-k$1" --out "$OUT/nll/$3_$4.csv" -t 1 \
    > "$OUT/nll/$3_$4.log" 2>&1 &
  pids+=($!)
}
for c in $CONVS; do job 20 "$GRID20" k20 "$c"; job 50 "$GRID50" k50 "$c"; done
wait "${pids[@]}"
echo quit | nvidia-cuda-mps-control 2>/dev/null
for f in "$OUT"/nll/*.log; do
  echo "  $(basename "$f"): $(grep -E '^time:' "$f" || tail -c 160 "$f" | tr '\r\n' '  ')"
  echo "    questions scored: $(grep -c ",prompt," "${f%.log}.csv.nll.csv" 2>/dev/null)"
done
echo "eval done at $(el) s"

# The scaling chosen on the tuning conversations alone (recovered share over
# categories 1-4 at k = 20).
TUNE=${IS_REC_TUNE:-"26 30"}
BEST=$(python3 tools/recovery_pick.py --tune "$TUNE" "$OUT"/nll/k20_*.csv.nll.csv)
echo "chosen on conversations $TUNE: $BEST"
BEST=$(python3 tools/recovery_pick.py --no-recompute --tune "$TUNE" "$OUT"/nll/k20_*.csv.nll.csv)
echo "scaling alone, chosen on conversations $TUNE: $BEST"

section "TTFT at k = 50, default model: plain kv vs $BEST"
TS=$(python3 -c "import re,sys; m=re.fullmatch(r'kv-?\d+(?:t([0-9.]+))?(?:s([0-9.]+))?', sys.argv[1]); print((m.group(1) or '1')+','+(m.group(2) or '1') if m else '1,1')" "$BEST")
if [ "$(el)" -lt "${IS_REC_SMOL_BEFORE:-300}" ]; then
  bench "$MODEL" smol_plain
  bench "$MODEL" smol_scaled -M "$TS"
  bench "$MODEL" smol_r4 -R 4
fi
[ -n "${GEN_PID:-}" ] && kill "$GEN_PID" 2>/dev/null
tar -czf "$OUT/nll.tar.gz" -C "$OUT" nll && rm -rf "$OUT/nll"
tar -czf "$OUT/bench.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
echo "done at $(el) s"

# Sourced from the repository root by the benchmark scripts that run on the
# GPU machine (run_gpu_bench.sh, run_gpu_ab.sh):
#  - REPO, OUT (the device tool's folder that comes back; ./gpu-out
#    elsewhere), LOG (OUT/work, tarred into OUT/logs.tar.gz at exit),
#    SUMMARY (OUT/summary.md, emptied) and stamp (prints a line with the
#    seconds since the start and appends it to the summary);
#  - GGUF (the random-weight Llama-3.1-8B-shaped model, /tmp/llama31-8b.
#    BENCH_TYPE.gguf unless set) and gen_gguf, which writes it in the
#    background (GEN_PID; bench/gen_random_gguf.py, the `gguf` wheel from
#    .whl; GEN_ONLY_CPU=1 draws with numpy) unless /tmp holds it already
#    (a later call on the warm machine reuses it; GEN_PID empty).
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
LOG=$OUT/work
mkdir -p "$LOG"
SUMMARY=$OUT/summary.md
: > "$SUMMARY"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$SUMMARY"; }
trap 'tar -czf "$OUT/logs.tar.gz" -C "$LOG" . 2>/dev/null && rm -rf "$LOG"' EXIT

GGUF=${GGUF:-/tmp/llama31-8b.${BENCH_TYPE:-f16}.gguf}
GEN_PID=
gen_gguf() {
  if [ -s "$GGUF" ]; then
    GEN_PID=
    echo "reused $GGUF" > "$LOG/gen.log"
    return
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$LOG/pip.log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  ( start=$(date +%s)
    PYTHONUNBUFFERED=1 python3 bench/gen_random_gguf.py --preset llama31-8b --type "${BENCH_TYPE:-f16}" \
      --out "$GGUF" ${GEN_ONLY_CPU:+--cpu} > "$LOG/gen.log" 2>&1
    echo "rc $? in $(( $(date +%s) - start )) s" >> "$LOG/gen.log" ) &
  GEN_PID=$!
}

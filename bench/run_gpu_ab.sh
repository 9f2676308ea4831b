#!/usr/bin/env bash
# Before and after in one device call, for a change that has no switch to
# turn it off in the same process: the working tree ("new") against a
# baseline tree ("base"), each built with the same flags, their benchmark
# programs run in alternating order (base new, new base, ...) on the same
# machine, so that neither order nor the machine favours one.
#
# The baseline travels as a carried archive of a commit, made here:
#   mkdir -p .base && git archive --format=tar.gz <commit> > .base/base.tar.gz
# Call: carry [".gpudeps", ".whl", ".base"], command "bash bench/run_gpu_ab.sh".
# Or it is a source tree already on the machine, AB_BASE_DIR (e.g. the
# repository the call sent, with the new tree carried inside it).
#
# Environment: ROUNDS (4), AB_ATTN_ARGS (bench_attn_gpu's arguments; "-"
# skips it, and its build), AB_BENCH_ARGS (bench_gpu's on the random-weight
# 8B GGUF; "-" skips it). The GGUF is written in the background from the
# start where /tmp does not hold it yet (a later call on the warm machine
# reuses it). CHECK=0 to build the new tree without running `ctest -L gpu`
# on it, AB_TIMEOUT (seconds a benchmark run, 240). IS_CUDA_OPTIONS (the backend's
# options, cuda/options.h) applies to both trees' programs alike.
# Results: $OUT/summary.md (each run's output in order, then a table of kv
# TTFT by configuration and k: each tree's median over the rounds of its
# runs' medians, and new / base), $OUT/logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh

if [ -n "${AB_BASE_DIR:-}" ]; then
  [ -f "$AB_BASE_DIR/CMakeLists.txt" ] || { stamp "AB_BASE_DIR=$AB_BASE_DIR: no source tree"; exit 2; }
  AB_BASE_DIR=$(cd "$AB_BASE_DIR" && pwd)
else
  [ -f .base/base.tar.gz ] || { stamp "no .base/base.tar.gz nor AB_BASE_DIR (see the header)"; exit 2; }
fi
ATTN_ARGS=${AB_ATTN_ARGS:--r 50}
BENCH_ARGS=${AB_BENCH_ARGS:--k 5,50 -r 15 -c bf16,bf16+r2 -t none}
stamp "machine: $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | head -1)"

gen_gguf # beside the builds

# The new tree: built and checked (gpu_check.sh unpacks the -dev packages
# into build-gpu/deps, which the baseline's build uses too).
if [ "${CHECK:-1}" = 1 ]; then
  OUT=$LOG IS_GPU_SANITIZE=0 timeout 400 bash scripts/gpu_check.sh > "$LOG/check.out" 2>&1
  stamp "gpu_check rc $?"
  sed -n '/=== summary/,$p' "$LOG/check.out" >> "$SUMMARY"
  grep -E 'differ|not finite|FAILED|Passed|Failed' "$LOG/ctest.log" | head -40 >> "$SUMMARY"
else
  OUT=$LOG IS_GPU_CTEST=0 IS_GPU_SANITIZE=0 timeout 400 bash scripts/gpu_check.sh \
    > "$LOG/check.out" 2>&1
  stamp "gpu_check (build only) rc $?"
fi
BUILD=$REPO/build-gpu
section() { :; }
source scripts/gpu_env.sh > "$LOG/env.log" 2>&1
TARGETS=()
[ "$ATTN_ARGS" != - ] && TARGETS+=(bench_attn_gpu)
[ "$BENCH_ARGS" != - ] && TARGETS+=(bench_gpu)
[ ${#TARGETS[@]} -gt 0 ] || { stamp "AB_ATTN_ARGS and AB_BENCH_ARGS both '-': nothing to run"; exit 2; }
cmake --build build-gpu -j "$(nproc)" --target "${TARGETS[@]}" > "$LOG/build_new.log" 2>&1 ||
  { stamp "new benchmarks: build FAILED"; tail -20 "$LOG/build_new.log" | tee -a "$SUMMARY"; exit 1; }

# The baseline tree, configured as gpu_check.sh configures the new one.
BASE_SRC=${AB_BASE_DIR:-/tmp/base-src}
if [ -z "${AB_BASE_DIR:-}" ]; then
  rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar -xzf .base/base.tar.gz -C /tmp/base-src
fi
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if ! { cmake -S "$BASE_SRC" -B build-base "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON \
         "${CMAKE_EXTRA[@]}" > "$LOG/cmake_base.log" 2>&1 &&
       cmake --build build-base -j "$(nproc)" --target "${TARGETS[@]}" > "$LOG/build_base.log" 2>&1; }; then
  stamp "baseline: configure or build FAILED"
  { tail -20 "$LOG/build_base.log" 2>/dev/null || tail -20 "$LOG/cmake_base.log"; } |
    tee -a "$SUMMARY"
  exit 1
fi
stamp "built both"

# Alternating runs: round r runs base then new when r is odd, else new then base.
run_pair() { # program, its arguments (one string), log name
  local r tree
  for r in $(seq 1 "${ROUNDS:-4}"); do
    for tree in $([ $((r % 2)) = 1 ] && echo "base new" || echo "new base"); do
      local bin=build-gpu/bench/$1
      [ "$tree" = base ] && bin=build-base/bench/$1
      stamp "round $r, $tree: $1 $2"
      timeout "${AB_TIMEOUT:-240}" "$bin" $2 > "$LOG/$3_${r}_$tree.log" 2>&1
      echo "rc $?" >> "$LOG/$3_${r}_$tree.log"
      cat "$LOG/$3_${r}_$tree.log" >> "$SUMMARY"
    done
  done
}
[ "$ATTN_ARGS" != - ] && run_pair bench_attn_gpu "$ATTN_ARGS" attn
[ -n "$GEN_PID" ] && wait "$GEN_PID"
stamp "gguf: $(tail -2 "$LOG/gen.log" | tr '\n' ' ')"
[ "$BENCH_ARGS" != - ] && run_pair bench_gpu "-m $GGUF $BENCH_ARGS" bench

# kv TTFT from bench_gpu's tables ("### TTFT, CONFIG ..." then rows
# "| k | prompt tokens | prompt TTFT | kv TTFT | ..."): per tree, the median
# over the rounds of each run's median, and new / base.
if [ "$BENCH_ARGS" != - ]; then
  python3 - "$LOG" "${ROUNDS:-4}" >> "$SUMMARY" <<'PY'
import re, statistics, sys
log, rounds = sys.argv[1], int(sys.argv[2])
runs = {}  # (tree, config, k) -> [kv TTFT of each round]
for r in range(1, rounds + 1):
    for tree in ("base", "new"):
        try:
            text = open(f"{log}/bench_{r}_{tree}.log").read()
        except OSError:
            continue
        cfg = None
        for line in text.splitlines():
            m = re.match(r"### TTFT, (\S+) ", line)
            if m:
                cfg = m.group(1)
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cfg and len(cells) > 3 and cells[0].isdigit():
                runs.setdefault((tree, cfg, int(cells[0])), []).append(float(cells[3]))
print("\n### kv TTFT, base and new: median over the rounds of each run's median, ms\n")
print("| config | k | base | new | new / base | runs (base, new) |")
print("|---|---:|---:|---:|---:|---|")
for (tree, cfg, k) in sorted(runs):
    if tree != "base" or ("new", cfg, k) not in runs:
        continue
    b, n = runs[("base", cfg, k)], runs[("new", cfg, k)]
    mb, mn = statistics.median(b), statistics.median(n)
    print(f"| {cfg} | {k} | {mb:.2f} | {mn:.2f} | {mn / mb:.3f} | "
          f"{' '.join(f'{x:.2f}' for x in b)}; {' '.join(f'{x:.2f}' for x in n)} |")
PY
fi
stamp done

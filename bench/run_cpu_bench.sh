#!/usr/bin/env bash
# run_cpu_bench.sh: InferScale vs llama.cpp on the CPU, same GGUF, same thread count.
#
# Why: llama.cpp is the reference CPU engine for GGUF models; a prefill/decode throughput ratio
# against it is the honest measure of our kernels. Both sides run the same model file with the
# same number of threads, both built for this machine's CPU (-march=native / GGML_NATIVE=ON), and
# both report the median over repetitions.
#
# What it does:
#   (a) builds bench_engine (bench/bench_engine.c) into build-bench/ (Release, IS_NATIVE=ON) and
#       runs it. Its contract: one line per measurement on stdout,
#           inferscale,<prefill|decode>,<n_prompt>,<tokens_per_s_median>
#       (for decode, <n_prompt> is the number of generated tokens, decoded one at a time after
#       a short 8-token prompt); other lines are ignored. It is invoked as
#           bench_engine -m M -t T -r R -p 128,512,2048 -n 128
#       (override the arguments with INFERSCALE_BENCH_ARGS="..."). If bench/bench_engine.c does
#       not exist yet, or does not build, the InferScale columns read "n/a" and a message says why.
#   (b) runs llama-bench (built by scripts/build_llamacpp.sh; built here if missing) with T threads:
#           -p 128,512,2048 -n 0 -r R      (prefill, ppN)
#           -p 0 -n 128 -r R               (decode tg128 from an empty context)
#       as JSON, and takes the median of its per-repetition samples. llama-bench runs with its
#       defaults otherwise (f16 KV cache, flash attention auto, weight repacking on). It is built
#       without AMX (scripts/build_llamacpp.sh says why: llama.cpp's AMX path crashes here).
#       On a shared, busy machine llama.cpp's spinning worker threads lose far more than ours
#       (decode can drop 50x): only compare numbers taken on an idle machine (see WAIT_IDLE_S).
#   (c) prints the machine, the llama.cpp commit, and one markdown table per phase with the ratio
#       InferScale / llama.cpp (> 1 means we are faster).
#
# Usage: bench/run_cpu_bench.sh [MODEL.gguf]
#   env: THREADS (2), REPS (5), PROMPTS (128,512,2048), DECODE (128), SKIP_INFERSCALE=1,
#        SKIP_LLAMACPP=1, OUT_DIR (build-bench/results) where raw outputs are kept,
#        WAIT_IDLE_S=N: before each side's run, wait up to N s until no other process uses >20%
#        of a CPU (three samples in a row), for machines shared with other work.
# Takes ~2-4 minutes on 2 cores once both sides are built (llama.cpp's build: ~10 min, once).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-2}"
REPS="${REPS:-5}"
PROMPTS="${PROMPTS:-128,512,2048}"
DECODE="${DECODE:-128}"
BUILD="$ROOT/build-bench"
OUT_DIR="${OUT_DIR:-$BUILD/results}"
LLAMA_BUILD="$ROOT/third_party/llama.cpp-build"
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"

if [ ! -f "$MODEL" ]; then
    echo "error: model not found: $MODEL" >&2
    exit 1
fi
mkdir -p "$OUT_DIR"
IS_CSV="$OUT_DIR/inferscale.csv"
LC_PP="$OUT_DIR/llamacpp_prefill.json"
LC_TG="$OUT_DIR/llamacpp_decode.json"
: > "$IS_CSV"
rm -f "$LC_PP" "$LC_TG"
IS_NOTE=""
LC_NOTE=""
wait_idle() {
    local limit="${WAIT_IDLE_S:-0}" quiet=0 start=$SECONDS busy
    [ "$limit" -gt 0 ] || return 0
    while [ $((SECONDS - start)) -lt "$limit" ]; do
        busy="$(top -bn1 | sed -n '8,20p' | awk '$9 > 20 { print $12 }' | tr '\n' ' ')"
        if [ -z "$busy" ]; then quiet=$((quiet + 1)); else quiet=0; fi
        [ "$quiet" -ge 3 ] && return 0
        sleep 5
    done
    echo "note: machine still busy after ${limit}s (${busy:-?}); measuring anyway" >&2
}

# Throughput on 2 cores is only meaningful on an otherwise idle machine: keep the load average.
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"

# ---- (a) InferScale --------------------------------------------------------------------------
if [ "${SKIP_INFERSCALE:-0}" = "1" ]; then
    IS_NOTE="skipped (SKIP_INFERSCALE=1)"
elif [ ! -f "$ROOT/bench/bench_engine.c" ]; then
    IS_NOTE="bench/bench_engine.c does not exist yet: InferScale columns are n/a"
else
    echo "== building bench_engine (Release, IS_NATIVE=ON) in $BUILD" >&2
    if cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DIS_NATIVE=ON > "$OUT_DIR/cmake.log" 2>&1 \
       && cmake --build "$BUILD" -j 2 --target bench_engine > "$OUT_DIR/build.log" 2>&1; then
        BIN="$(find "$BUILD" -type f -name bench_engine -perm -u+x | head -1)"
        # shellcheck disable=SC2206
        ARGS=(${INFERSCALE_BENCH_ARGS:--m "$MODEL" -t "$THREADS" -r "$REPS" -p "$PROMPTS" -n "$DECODE"})
        wait_idle
        echo "== $BIN ${ARGS[*]}" >&2
        if "$BIN" "${ARGS[@]}" > "$OUT_DIR/inferscale.out" 2> "$OUT_DIR/inferscale.err"; then
            grep -E '^inferscale,(prefill|decode),[0-9]+,[0-9.eE+-]+$' "$OUT_DIR/inferscale.out" > "$IS_CSV" || true
            [ -s "$IS_CSV" ] || IS_NOTE="bench_engine printed no 'inferscale,...' lines (see $OUT_DIR/inferscale.out)"
        else
            IS_NOTE="bench_engine failed (exit $?): see $OUT_DIR/inferscale.err"
        fi
    else
        IS_NOTE="bench_engine did not build: see $OUT_DIR/build.log"
    fi
fi
[ -z "$IS_NOTE" ] || echo "note: $IS_NOTE" >&2

# ---- (b) llama.cpp ---------------------------------------------------------------------------
if [ "${SKIP_LLAMACPP:-0}" = "1" ]; then
    LC_NOTE="skipped (SKIP_LLAMACPP=1)"
else
    if [ ! -x "$LLAMA_BENCH" ]; then
        echo "== llama-bench missing; building it (scripts/build_llamacpp.sh, ~10 min)" >&2
        "$ROOT/scripts/build_llamacpp.sh" >&2
    fi
    wait_idle
    echo "== llama-bench prefill: -t $THREADS -p $PROMPTS -n 0 -r $REPS" >&2
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p "$PROMPTS" -n 0 -r "$REPS" -o json > "$LC_PP" 2> "$OUT_DIR/llamacpp_prefill.err" \
        || LC_NOTE="llama-bench prefill failed: see $OUT_DIR/llamacpp_prefill.err"
    echo "== llama-bench decode: -t $THREADS -p 0 -n $DECODE -r $REPS" >&2
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 0 -n "$DECODE" -r "$REPS" -o json > "$LC_TG" 2> "$OUT_DIR/llamacpp_decode.err" \
        || LC_NOTE="${LC_NOTE:+$LC_NOTE; }llama-bench decode failed: see $OUT_DIR/llamacpp_decode.err"
fi

# ---- (c) report --------------------------------------------------------------------------------
CPU_MODEL="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
CPU_COUNT="$(nproc)"
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"
LC_VERSION="$(head -1 "$LLAMA_BUILD/VERSION.txt" 2>/dev/null || echo "llama.cpp version unknown")"

python3 - "$MODEL" "$THREADS" "$REPS" "$IS_CSV" "$LC_PP" "$LC_TG" "$CPU_MODEL" "$CPU_COUNT" \
          "$LC_VERSION" "$IS_NOTE" "$LC_NOTE" "$LOAD_BEFORE" "$LOAD_AFTER" <<'EOF'
import json, os, statistics, sys
(model, threads, reps, is_csv, lc_pp, lc_tg, cpu, ncpu, lc_ver, is_note, lc_note,
 load_before, load_after) = sys.argv[1:]

ours = {}                                   # (phase, n_prompt) -> tok/s
for line in open(is_csv):
    _, phase, n, ts = line.strip().split(",")
    ours[(phase, int(n))] = float(ts)

def load(path):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return []
    try:
        return json.load(open(path))
    except ValueError:
        return []

theirs = {}                                 # (phase, n) -> median tok/s over repetitions
build = None
for r in load(lc_pp) + load(lc_tg):
    build = build or f"{r.get('build_commit', '?')} (build {r.get('build_number', '?')})"
    samples = r.get("samples_ts") or [r["avg_ts"]]
    if r["n_gen"] == 0:
        theirs[("prefill", r["n_prompt"])] = statistics.median(samples)
    else:
        theirs[("decode", r["n_gen"])] = statistics.median(samples)

def fmt(v):
    return "n/a" if v is None else f"{v:.1f}"

def ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"

print(f"# CPU benchmark: InferScale vs llama.cpp\n")
print(f"- model: `{os.path.basename(model)}`")
print(f"- machine: {cpu}, {ncpu} CPUs; threads: {threads}; repetitions: {reps} (median tok/s)")
print(f"- llama.cpp: {lc_ver}; llama-bench reports build {build or 'n/a'}")
print(f"- load average before / after: {load_before} / {load_after}"
      + (" (machine was busy: numbers are pessimistic)" if float(load_before.split()[0]) > 0.5 else ""))
if is_note:
    print(f"- InferScale: {is_note}")
if lc_note:
    print(f"- llama.cpp: {lc_note}")

print("\n## Prefill\n")
print("| prompt length | InferScale prefill tok/s | llama.cpp prefill tok/s | ratio |")
print("|---:|---:|---:|---:|")
ns = sorted({n for p, n in list(ours) + list(theirs) if p == "prefill"})
for n in ns:
    a, b = ours.get(("prefill", n)), theirs.get(("prefill", n))
    print(f"| {n} | {fmt(a)} | {fmt(b)} | {ratio(a, b)} |")

print("\n## Decode\n")
print("N tokens generated one at a time: llama.cpp tgN from an empty context (llama-bench -p 0 -n N), "
      "InferScale after an 8-token prompt.\n")
print("| generated tokens | InferScale decode tok/s | llama.cpp decode tok/s | ratio |")
print("|---:|---:|---:|---:|")
ns = sorted({n for p, n in list(ours) + list(theirs) if p == "decode"})
for n in ns:
    a, b = ours.get(("decode", n)), theirs.get(("decode", n))
    print(f"| {n} | {fmt(a)} | {fmt(b)} | {ratio(a, b)} |")
EOF

#!/usr/bin/env bash
# Ingestion on the GPU, in one device call: the engine half in-process
# (bench_ingest: facts' KV encoded one a forward against many, split into
# forward, narrowing and record writes) and the served path (bench_load
# --ingest-only: facts added through POST /v1/memories/ by several
# concurrent clients, until every fact's KV is encoded), on the CUDA
# backend with the random-weight Llama-3.1-8B-shaped GGUF, beside the
# disk's own write rate (records are 40 tokens x 128 KiB of bf16/f16 KV a
# token: the disk bounds facts/s).
# Results: $OUT/summary.md, $OUT/logs.tar.gz.
#
# Carry: .gpudeps (scripts/gpu_prepare.sh --no-model), .whl (the `gguf`
# wheel), locomo (a copy of ../shared/data/locomo). Environment: USERS
# (100), FACTS (10), CLIENTS ("1 8 32"), FACTS_INPROC (512), BATCHES
# (1,16,64,128).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
BUILD=$REPO/build-gpu
section() { echo; echo "=== $* ($(date +%T))"; }

stamp "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1), $(nproc) cores"
gen_gguf
source scripts/gpu_env.sh > "$LOG/env.log" 2>&1
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if ! cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DIS_CUDA=ON "${CMAKE_EXTRA[@]}" \
    > "$LOG/cmake.log" 2>&1; then
  stamp "configure FAILED"; tail -30 "$LOG/cmake.log" | tee -a "$SUMMARY"; exit 1
fi
if ! cmake --build "$BUILD" -j "$(nproc)" --target bench_ingest bench_load > "$LOG/build.log" 2>&1; then
  stamp "build FAILED"; grep -E "error|Error" "$LOG/build.log" | head -30 | tee -a "$SUMMARY"; exit 1
fi
stamp "built bench_ingest, bench_load"
export LD_LIBRARY_PATH="$BUILD/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The disk under /tmp: 2 GiB written and made durable, as the records are.
stamp "disk: $(dd if=/dev/zero of=/tmp/ddtest bs=16M count=128 conv=fdatasync 2>&1 | tail -1)"
rm -f /tmp/ddtest

if [ -n "$GEN_PID" ]; then wait "$GEN_PID"; fi
stamp "gguf: $(tail -1 "$LOG/gen.log")"
[ -s "$GGUF" ] || { stamp "no GGUF"; exit 1; }

stamp "bench_ingest -n ${FACTS_INPROC:-512} -b ${BATCHES:-1,16,64,128}"
timeout 150 "$BUILD/bench/bench_ingest" -m "$GGUF" --backend cuda --locomo locomo/26.json \
  -n "${FACTS_INPROC:-512}" -b "${BATCHES:-1,16,64,128}" -r 3 --kv-mem 16000 --dir /tmp/ingest-inproc \
  2>&1 | tee "$LOG/bench_ingest.log" | tee -a "$SUMMARY"
stamp "bench_ingest rc ${PIPESTATUS[0]}"

for c in ${CLIENTS:-1 8 32}; do
  rm -rf /tmp/ingest-data
  stamp "bench_load --ingest-only --ingest-clients $c (${USERS:-100} users x ${FACTS:-10} facts)"
  timeout 120 "$BUILD/bench/bench_load" -m "$GGUF" --backend cuda --embedder none --locomo locomo \
    --data /tmp/ingest-data --users "${USERS:-100}" -c 1 --facts-per-user "${FACTS:-10}" --ctx 4096 \
    --kv-mem 16000 --max-running 128 --ingest-clients "$c" --ingest-only --encode-timeout 100 \
    > "$LOG/load_$c.out" 2> "$LOG/load_$c.err"
  rc=$?
  grep -E "^ingestion" "$LOG/load_$c.out" | tee -a "$SUMMARY"
  grep -E "^(memory|error)" "$LOG/load_$c.err" | head -6 >> "$SUMMARY"
  stamp "bench_load rc $rc"
done

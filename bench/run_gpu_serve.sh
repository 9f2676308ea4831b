#!/usr/bin/env bash
# The served path on the GPU, in one device call: `inferscale serve`'s code
# (http_app, started in-process by bench/bench_load) on the CUDA backend with
# the random-weight Llama-3.1-8B-shaped GGUF, measured at the client over
# loopback HTTP, next to bench_gpu (the engine in-process) in the same call.
#   1. writes the GGUF in the background (bench/gpu_common.sh gen_gguf);
#   2. builds the CUDA backend, bench_gpu, bench_load and the CLI with the
#      carried -dev packages (scripts/gpu_env.sh; gpu_prepare.sh now carries
#      libmicrohttpd and libcurl, so the server and the bench build there);
#   3. bench_gpu: TTFT vs k (prompt, kv) and throughput vs users at k = 50;
#   4. bench_load in three regimes, on one memory (USERS users x FACTS LoCoMo
#      observations, added through POST /v1/memories/ and encoded by the
#      server), users drawn with Zipf(1) popularity:
#        hot     the default fact cache (everything fits), after a pass that
#                makes every user's facts resident;
#        tiered  --fact-cache-gb TIER_GB (all users' fact KV >= 4x of it),
#                a miss read and widened per request (--host-cache-gb 0);
#        tiered_host  the same with the pinned host tier (--host-cache-gb
#                HOST_GB, default 8): a miss read into pinned memory and
#                copied to the GPU in layer groups under the forward;
#        tiered_churn  the same with a host tier smaller than the records
#                (CHURN_GB, default 2): evictions from it under load;
#        cold    the server started again on the same data (records on disk,
#                the page cache dropped where the machine lets us), the
#                first requests measured with nothing resident.
# Results: $OUT/summary.md (tables), $OUT/*.csv, $OUT/logs.tar.gz.
#
# Carry (the repository copy has none of these): .gpudeps (scripts/
# gpu_prepare.sh --no-model), .whl (the `gguf` wheel), locomo (a copy of
# ../shared/data/locomo). Environment: USERS (10), FACTS (100), TIER_GB
# (0.75), TIER_RUNS, TIER_N (200), SKIP_GPU_BENCH=1, GPU_BENCH_ARGS (bench_gpu's), STAGES ("hot tiered
# olddefaults cold"; tiered_host, tiered_churn and sessions are added by name: which of
# the bench_load stages run; SESSION_RUNS, SESSION_N), HOST_GB (8), CHURN_GB (2), HOT_RUNS, HOT_N, COLD_RUNS, STAGE_S (each
# stage's time limit, s; default per stage), GPU_TESTS (ctest names of GPU
# tests to build and run first, on the random-weight model when
# IS_TEST_MODEL names it, e.g. "test_fact_tiers_cuda").
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
grep -iE "microhttpd|curl" "$LOG/cmake.log" | tee -a "$SUMMARY"
TARGETS=(bench_load inferscale-cli ${GPU_TESTS:-})
[ "${SKIP_GPU_BENCH:-0}" != 1 ] && TARGETS+=(bench_gpu)
if ! cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" > "$LOG/build.log" 2>&1; then
  stamp "build FAILED"; grep -E "error|Error" "$LOG/build.log" | head -30 | tee -a "$SUMMARY"; exit 1
fi
stamp "built bench_gpu, bench_load, inferscale"
export LD_LIBRARY_PATH="$BUILD/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ -n "$GEN_PID" ]; then wait "$GEN_PID"; fi
stamp "gguf: $(tail -1 "$LOG/gen.log")"
[ -s "$GGUF" ] || { stamp "no GGUF"; exit 1; }

# GPU tests named in GPU_TESTS (they skip, 77, where their model is missing).
for t in ${GPU_TESTS:-}; do
  stamp "ctest $t"
  (cd "$BUILD" && timeout 200 ctest -R "^$t\$" --output-on-failure -V) > "$LOG/$t.log" 2>&1
  stamp "ctest $t rc $?"
  grep -E "OK|FAILED|PASSED|ERROR|LINE|differ|skipped|facts|ask|chat|Passed|Failed" "$LOG/$t.log" | head -30 >> "$SUMMARY"
done

# 3. The engine in-process.
if [ "${SKIP_GPU_BENCH:-0}" != 1 ]; then
  GB_ARGS=${GPU_BENCH_ARGS:--k 5,20,50,100 -u 1,10,50,100,200 -K 50 -r 5 -c bf16x2 -t bf16x2}
  stamp "bench_gpu $GB_ARGS"
  timeout 150 "$BUILD/bench/bench_gpu" -m "$GGUF" $GB_ARGS \
    -o "$OUT/bench_gpu.csv" 2>&1 | tee "$LOG/bench_gpu.log" | tee -a "$SUMMARY"
  stamp "bench_gpu rc ${PIPESTATUS[0]}"
fi

# 4. The served path.
DATA=/tmp/serve-data
rm -rf "$DATA"
USERS=${USERS:-10}
FACTS=${FACTS:-100}
COMMON=(-m "$GGUF" --backend cuda --embedder none --locomo locomo --data "$DATA" --users "$USERS"
        --facts-per-user "$FACTS" --zipf 1 --ctx 8192 --kv-mem 40000 --max-running 64
        --min-requests 30 --per-client 2 --request-timeout 60 --encode-timeout 200 --time-limit 60)
load() { # label, seconds, extra arguments...
  local label=$1 limit=$2; shift 2
  stamp "bench_load $label $*"
  timeout "$limit" "$BUILD/bench/bench_load" "${COMMON[@]}" --label "$label" \
    -o "$OUT/load_$label.csv" "$@" > "$LOG/load_$label.out" 2> "$LOG/load_$label.err"
  local rc=$?
  cat "$LOG/load_$label.out" >> "$SUMMARY"
  grep -E "^(memory|server|fact cache|model|error|  first error|note)" "$LOG/load_$label.err" | head -30 >> "$SUMMARY"
  stamp "bench_load $label rc $rc"
}
# --ctx 8192: LoCoMo facts average about 40 tokens, so some users' 100 facts
# pass 4096. The kv rows come first, as the prompt rows take most of a
# stage's time.
K1KV="5/1/kv/1,20/1/kv/1,50/1/kv/1,100/1/kv/1"
K1P="5/1/prompt/1,20/1/prompt/1,50/1/prompt/1,100/1/prompt/1"
CL="50/10/kv/1,50/50/kv/1,50/100/kv/1,50/200/kv/1,50/100/prompt/1"
T32="50/100/kv/32,50/100/prompt/32"
# hot: a first run (k = 100 = every fact of a user) makes the facts resident.
STAGES=" ${STAGES:-hot tiered olddefaults cold} "
[[ $STAGES == *" hot "* ]] && load hot "${STAGE_S:-240}" --runs "${HOT_RUNS:-100/50/kv/1,$K1KV,$CL,$T32,$K1P}" -n "${HOT_N:-200}"
TIERED=(--fact-cache-gb "${TIER_GB:-0.75}" --runs "${TIER_RUNS:-100/50/kv/1,$K1KV,50/10/kv/1,50/100/kv/1,50/200/kv/1}"
        -n "${TIER_N:-200}")
[[ $STAGES == *" tiered_host "* ]] && load tiered_host "${STAGE_S:-150}" "${TIERED[@]}" --host-cache-gb "${HOST_GB:-8}"
[[ $STAGES == *" tiered "* ]] && load tiered "${STAGE_S:-150}" "${TIERED[@]}" --host-cache-gb 0
# tiered_churn (by name): the host tier smaller than the records too (CHURN_GB, default 2, against
# about 5 GB of f16 records), so disk reads keep evicting host-tier records under load and every
# eviction waits for the GPU's copies from host memory (host_wait).
[[ $STAGES == *" tiered_churn "* ]] && load tiered_churn "${STAGE_S:-150}" "${TIERED[@]}" \
  --host-cache-gb "${CHURN_GB:-2}"
# The old defaults beside (steps of 256 tokens, prompt chunks of 128, a 2 GiB
# fact cache): what the same build serves with the settings it had before.
[[ $STAGES == *" olddefaults "* ]] && load olddefaults 90 --step-tokens 256 --prefill-chunk 128 --fact-cache-gb 2 \
  --runs "50/1/kv/1,50/1/prompt/1,50/100/kv/1,50/100/prompt/1" -n 100
# sessions (by name): each run starts on a node without KV records (the
# facts stay in the store), so a user's first request of the run encodes its
# facts' KV on demand; the 'sessions:' lines give those first requests' TTFT
# beside the later ones', kv next to prompt.
[[ $STAGES == *" sessions "* ]] && load sessions "${STAGE_S:-240}" --cold-sessions \
  --runs "${SESSION_RUNS:-50/1/kv/1,50/1/prompt/1,50/10/kv/1}" -n "${SESSION_N:-60}"
sync; { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null && stamp "page cache dropped" || stamp "page cache not dropped"
[[ $STAGES == *" cold "* ]] && load cold "${STAGE_S:-90}" --no-warmup --host-cache-gb "${COLD_HOST_GB:-0}" \
  --runs "${COLD_RUNS:-50/1/kv/1,50/1/kv/1,50/100/kv/1}" -n 30
nvidia-smi --query-gpu=clocks.sm,memory.used,temperature.gpu,power.draw --format=csv >> "$SUMMARY" 2>&1

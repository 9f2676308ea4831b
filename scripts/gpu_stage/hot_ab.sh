#!/usr/bin/env bash
# One call after the README's first two (the first with BASE_TARGETS=bench_load): the hot served
# rows of the base tree's bench_load against this tree's, alternated ROUNDS times (default 2), over
# the same 10 users x 100 facts with every fact resident in the GPU fact cache (a first run at
# k = 100 draws them all), kv at k = 5 and 50 and prompt at 50, one client; then bench_gpu at the
# same fact length (F_TOK, 38: a dated LoCoMo fact) for the in-process TTFT of the same call.
# Other regimes through the environment (tier_ab.sh): TAG (the files' label, hot), EXTRA (more
# bench_load arguments), RUNS (its --runs), WHO (the trees, "base new"), BENCH_GPU=0 (no bench_gpu).
set -u
. "$(dirname "$0")/common.sh"
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
cd /tmp/src
wait_for 400 /tmp/build.done /tmp/base.done
wait_gguf
TAG=${TAG:-hot}
LOAD=(-m $G --backend cuda --embedder none --locomo locomo --data /tmp/sv --users 10
  --facts-per-user 100 --zipf 1 --ctx 8192 --kv-mem 40000 --max-running 64 --ingest-clients 8
  -n "${N:-120}" --runs "${RUNS:-100/50/kv/1,5/1/kv/1,50/1/kv/1,50/1/prompt/1}" ${EXTRA:-})
for r in $(seq 1 "${ROUNDS:-2}"); do
  for who in ${WHO:-base new}; do
    b=build-base/bench/bench_load; [ $who = new ] && b=build-gpu/bench/bench_load
    timeout 170 $b "${LOAD[@]}" --label "${TAG}_${who}_$r" -o "$OUT/${TAG}_${who}_$r.csv" \
      > "$OUT/${TAG}_${who}_$r.out" 2>&1
    st "$TAG $who round $r rc $?"
    grep -E "^ingestion|^timing: k (5|50), 1 |^note: k (5|50), 1 " "$OUT/${TAG}_${who}_$r.out" | cut -c1-300
  done
done
[ "${BENCH_GPU:-1}" = 1 ] || exit 0
timeout 150 build-gpu/bench/bench_gpu -m $G -k 5,50 -F "${F_TOK:-38}" -c bf16x2 -t '' -r 9 -o "$OUT/hot_bench_gpu.csv" \
  > "$OUT/hot_bench_gpu.log" 2>&1
st "bench_gpu rc $?"; grep -E "^\| (5|50) \|" "$OUT/hot_bench_gpu.log"

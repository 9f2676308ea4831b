#!/usr/bin/env bash
# One call after the README's first two (the first with BASE_TARGETS=bench_load): the tiered served
# rows of the base tree's bench_load against this tree's, alternated ROUNDS times (default 1), over
# 10 users x 100 facts whose fact KV is about 7x the GPU fact cache (--fact-cache-gb 0.75) with the
# pinned host tier (--host-cache-gb 8): a warm-up run at k = 100, 50 clients, then kv at k = 5 and
# 50, one client; then this tree's hot rows (the default cache holds every fact) for the
# "tiered at most hot + 3 ms" target measured in the same call.
set -u
. "$(dirname "$0")/common.sh"
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
cd /tmp/src
wait_for 400 /tmp/build.done /tmp/base.done
wait_gguf
LOAD=(-m $G --backend cuda --embedder none --locomo locomo --data /tmp/sv --users 10
  --facts-per-user 100 --zipf 1 --ctx 8192 --kv-mem 40000 --max-running 64 --ingest-clients 8
  -n "${N:-120}" --runs 100/50/kv/1,5/1/kv/1,50/1/kv/1)
for r in $(seq 1 "${ROUNDS:-1}"); do
  for who in base new; do
    b=build-base/bench/bench_load; [ $who = new ] && b=build-gpu/bench/bench_load
    timeout 170 $b "${LOAD[@]}" --fact-cache-gb 0.75 --host-cache-gb 8 --label "tiered_${who}_$r" \
      -o "$OUT/tiered_${who}_$r.csv" > "$OUT/tiered_${who}_$r.out" 2>&1
    st "tiered $who round $r rc $?"
    grep -E "^timing: k (5|50), 1 |^note: k (5|50), 1 " "$OUT/tiered_${who}_$r.out" | cut -c1-300
  done
done
[ "${HOT:-1}" = 1 ] && {
  timeout 150 build-gpu/bench/bench_load "${LOAD[@]}" --label hot_new -o "$OUT/hot_new.csv" \
    > "$OUT/hot_new.out" 2>&1
  st "hot new rc $?"
  grep -E "^timing: k (5|50), 1 " "$OUT/hot_new.out" | cut -c1-300
}

#!/usr/bin/env bash
# One call after the first (which may carry locomo itself): 100 clients at k = 50, max_tokens 1, over
# 100 users x 50 facts (bench_load prints how the server batched them: steps, prompt tokens a step,
# requests an injection), then bench_gpu's in-process throughput at 100 users in the same call.
set -u
. "$(dirname "$0")/common.sh"
cp -r locomo /tmp/src/locomo 2>/dev/null
cd /tmp/src
wait_for 400 /tmp/build.done
wait_gguf
timeout 240 build-gpu/bench/bench_load -m $G --backend cuda --embedder none --locomo locomo \
  --data /tmp/sv100 --users 100 --facts-per-user 50 --zipf 1 --ctx 8192 --kv-mem 40000 \
  --max-running 128 --ingest-clients 8 -n 300 --runs "${C100_RUNS:-100/100/kv/1,50/100/kv/1,50/100/kv/1}" \
  --label c100 -o "$OUT/c100.csv" > "$OUT/c100.out" 2>&1
st "bench_load rc $?"
grep -E "^ingestion|^engine|^timing: k 50" "$OUT/c100.out" | cut -c1-250
grep -E "^ +50 +1 +100 kv" "$OUT/c100.out"
timeout 100 build-gpu/bench/bench_gpu -m $G -k 50 -F 38 -u 100 -K 50 -c '' -t bf16x2 -r 5 \
  > "$OUT/c100_bench_gpu.log" 2>&1
st "bench_gpu rc $?"; grep -E "^\| 100 " "$OUT/c100_bench_gpu.log"

#!/usr/bin/env bash
# The served run (from /tmp/src): bench_load on the 8B shape, 8 clients adding 1,000 facts, then
# hot rows whose TTFT is split into its parts (the timing lines); once a loan (/tmp/served.done).
[ -f /tmp/served.done ] && exit 0
S1=$(date +%s)
. "$(dirname "$0")/common.sh"
rm -rf /tmp/sv
timeout 220 build-gpu/bench/bench_load -m $G --backend cuda --embedder none --locomo locomo --data /tmp/sv \
  --users 10 --facts-per-user 100 --zipf 1 --ctx 8192 --kv-mem 40000 --max-running 64 --ingest-clients 8 \
  --runs 100/50/kv/1,5/1/kv/1,50/1/kv/1,50/1/prompt/1 -n 50 --label hot -o "$OUT/serve_hot.csv" \
  > "$OUT/serve_hot.out" 2> "$OUT/serve_hot.err"
echo "[served $(( $(date +%s) - S1 )) s] bench_load rc $?"
grep -hE "^ingestion|^timing|^note" "$OUT/serve_hot.out" "$OUT/serve_hot.err" | cut -c1-300
grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ (kv|prompt)" "$OUT/serve_hot.out"
touch /tmp/served.done

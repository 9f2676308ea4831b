#!/usr/bin/env bash
# The served cost of static recomputation (from any directory, after served.sh made /tmp/sv): for
# each M of REC_MS (default "0 2 8 16 24 48") a server started with --recompute M over the same
# users; a run of 8 clients fills the GPU fact cache, then one client's k = 50 TTFT (and prompt
# mode's once, at M = 0). serve_rec.csv, one label rM a server.
cd /tmp/src
S1=$(date +%s)
. "$(dirname "$0")/common.sh"
for m in ${REC_MS:-0 2 8 16 24 48}; do
  runs=50/8/kv/1,50/1/kv/1; [ "$m" = 0 ] && runs=$runs,50/1/prompt/1
  timeout 100 build-gpu/bench/bench_load -m $G --backend cuda --embedder none --locomo locomo \
    --data /tmp/sv --users 10 --facts-per-user 100 --zipf 1 --ctx 8192 --kv-mem 40000 \
    --max-running 64 --recompute "$m" --runs "$runs" -n 60 --label "r$m" -o "/tmp/serve_rec_$m.csv" \
    > "$OUT/serve_rec_$m.out" 2> "$OUT/serve_rec_$m.err"
  echo "[served_rec $(( $(date +%s) - S1 )) s] M=$m rc $?"
  grep -E "^ +50 +1 +[0-9]+ (kv|prompt)" "$OUT/serve_rec_$m.out"
done
head -1 /tmp/serve_rec_0.csv > "$OUT/serve_rec.csv"
for f in /tmp/serve_rec_*.csv; do tail -n +2 "$f" >> "$OUT/serve_rec.csv"; done

#!/usr/bin/env bash
# Recompute / blend TTFT at k = 50 on the 8B shape, plain kv before and after.
cd /tmp/src
. "$(dirname "$0")/common.sh"
for a in "" "-R 2" "-R 16" "-B 0.3" "-B 0.15" ""; do
  echo "### bench_gpu -k 50 -c bf16 -t '' -r 9 $a" >> "$OUT/rec_ttft.log"
  timeout 70 build-gpu/bench/bench_gpu -m $G -k 50 -c bf16 -t '' -r 9 $a >> "$OUT/rec_ttft.log" 2>&1
  st "ttft '$a' rc $?"; grep -E "^\| 50 \|" "$OUT/rec_ttft.log" | tail -1
done
grep -E "^\| k \|" "$OUT/rec_ttft.log" | head -1

#!/usr/bin/env bash
# Recompute / blend TTFT at k = 50 on the 8B shape, plain kv before and after.
cd /tmp/src
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export LD_LIBRARY_PATH="/tmp/src/build-gpu/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
G=/tmp/llama31-8b.f16.gguf
for a in "" "-R 2" "-R 16" "-B 0.3" "-B 0.15" ""; do
  echo "### bench_gpu -k 50 -c bf16 -t '' -r 9 $a" >> "$OUT/rec_ttft.log"
  timeout 70 build-gpu/bench/bench_gpu -m $G -k 50 -c bf16 -t '' -r 9 $a >> "$OUT/rec_ttft.log" 2>&1
  st "ttft '$a' rc $?"; grep -E "^\| 50 \|" "$OUT/rec_ttft.log" | tail -1
done
grep -E "^\| k \|" "$OUT/rec_ttft.log" | head -1

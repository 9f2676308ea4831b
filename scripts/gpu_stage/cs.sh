#!/usr/bin/env bash
# One call: ctest -L gpu on the default model, then the served benchmark in the time left.
S0=$(date +%s)
bash /tmp/src/scripts/gpu_stage/ctest.sh
cd /tmp/src
left=$(( ${CS_LIMIT:-585} - ($(date +%s) - S0) ))
echo "serve bench with ${left} s"
STAGES="hot tiered_host sessions" STAGE_S=${STAGE_S:-85} HOT_N=50 TIER_N=50 SESSION_N=30 \
  HOT_RUNS="100/50/kv/1,5/1/kv/1,50/1/kv/1,50/1/prompt/1,50/100/kv/1,50/100/prompt/1,50/100/kv/32,50/100/prompt/32" \
  TIER_RUNS="100/50/kv/1,5/1/kv/1,50/1/kv/1,50/100/kv/1" \
  GPU_BENCH_ARGS="-k 5,50 -u 1,100 -K 50 -r 5 -c bf16x2 -t bf16x2" \
  timeout $left bash bench/run_gpu_serve.sh > /tmp/serve_stdout.log 2>&1
echo "serve rc $?"
grep -vE "^\s*$" $OUT/summary.md | cut -c1-220 | head -120

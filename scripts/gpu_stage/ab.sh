#!/usr/bin/env bash
# A/B: bench_gpu of a baseline tree (build-base, made by bg.sh from /tmp/base.tar.gz) and of
# this tree, alternated (base new, new base), then the recompute/blend TTFT (ttft.sh).
cd /tmp/src
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
st "base.done? $(ls /tmp/base.done 2>&1)"; tail -3 /tmp/bg.log
export LD_LIBRARY_PATH="/tmp/src/build-gpu/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
G=/tmp/llama31-8b.f16.gguf
for r in 1 2; do
  for tree in $([ $r = 1 ] && echo "base new" || echo "new base"); do
    b=build-gpu/bench/bench_gpu; [ $tree = base ] && b=build-base/bench/bench_gpu
    echo "### round $r $tree" >> "$OUT/ab.log"
    timeout 80 $b -m $G -k 5,50 -r 9 -c bf16 -t none >> "$OUT/ab.log" 2>&1
    st "round $r $tree rc $?"; grep -E "^\| (5|50) \|" "$OUT/ab.log" | tail -2
  done
done
[ $(( $(date +%s) - T0 )) -lt ${TTFT_BEFORE:-300} ] && bash scripts/gpu_stage/ttft.sh

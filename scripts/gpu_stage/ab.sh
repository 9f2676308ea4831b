#!/usr/bin/env bash
# A/B: bench_gpu of a baseline tree (build-base, made by bg.sh from /tmp/base.tar.gz) and of
# this tree, alternated (base new, new base), then the recompute/blend TTFT (ttft.sh).
cd /tmp/src
. "$(dirname "$0")/common.sh"
st "base.done? $(ls /tmp/base.done 2>&1)"; tail -3 /tmp/bg.log
for r in 1 2; do
  for tree in $([ $r = 1 ] && echo "base new" || echo "new base"); do
    b=build-gpu/bench/bench_gpu; [ $tree = base ] && b=build-base/bench/bench_gpu
    echo "### round $r $tree" >> "$OUT/ab.log"
    timeout 80 $b -m $G -k 5,50 -r 9 -c bf16 -t none >> "$OUT/ab.log" 2>&1
    st "round $r $tree rc $?"; grep -E "^\| (5|50) \|" "$OUT/ab.log" | tail -2
  done
done
[ $(( $(date +%s) - S0 )) -lt ${TTFT_BEFORE:-300} ] && bash scripts/gpu_stage/ttft.sh

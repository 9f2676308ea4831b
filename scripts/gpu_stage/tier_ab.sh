#!/usr/bin/env bash
# One call after the README's first two (the first with BASE_TARGETS=bench_load): the tiered served
# rows of the base tree's bench_load against this tree's (hot_ab.sh's loop), alternated ROUNDS times
# (default 1), over 10 users x 100 facts whose fact KV is about 7x the GPU fact cache
# (--fact-cache-gb 0.75) with the pinned host tier (--host-cache-gb 8): a warm-up run at k = 100, 50
# clients, then kv at k = 5 and 50, one client; then this tree's hot rows (the default cache holds
# every fact; HOT=0: none) for the "tiered at most hot + 3 ms" target measured in the same call.
set -u
d=$(dirname "$0")
RUNS=100/50/kv/1,5/1/kv/1,50/1/kv/1
TAG=tiered EXTRA="--fact-cache-gb 0.75 --host-cache-gb 8" RUNS=$RUNS ROUNDS=${ROUNDS:-1} BENCH_GPU=0 \
  bash "$d/hot_ab.sh"
[ "${HOT:-1}" = 1 ] && TAG=hot WHO=new RUNS=$RUNS ROUNDS=1 BENCH_GPU=0 bash "$d/hot_ab.sh"
exit 0

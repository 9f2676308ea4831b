#!/usr/bin/env bash
cd /tmp/src
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
for i in $(seq 1 150); do [ -f /tmp/build.done ] && break; sleep 2; done
st "build.done? $(ls /tmp/build.done 2>&1)"; cat /tmp/bg.log
export LD_LIBRARY_PATH="/tmp/src/build-gpu/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
(cd build-gpu && timeout 300 ctest -L gpu -j 5 --timeout 240 --output-on-failure -V) > "$OUT/ctest.log" 2>&1
st "ctest rc $?"
grep -E "^ *[0-9]+/[0-9]+ Test|tests passed|Not Run|Failed|\*\*\*" "$OUT/ctest.log" | tail -30
grep -E "rel L2|arena:|facts: gpu|LINE|ERROR" "$OUT/ctest.log" | head -30

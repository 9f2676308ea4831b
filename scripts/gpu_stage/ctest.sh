#!/usr/bin/env bash
. "$(dirname "$0")/common.sh"
cd /tmp/src
wait_for 300 /tmp/build.done; cat /tmp/bg.log
(cd build-gpu && timeout 300 ctest -L gpu -j 5 --timeout 240 --output-on-failure -V) > "$OUT/ctest.log" 2>&1
st "ctest rc $?"
grep -E "^ *[0-9]+/[0-9]+ Test|tests passed|Not Run|Failed|\*\*\*" "$OUT/ctest.log" | tail -30
grep -E "rel L2|arena:|facts: gpu|LINE|ERROR" "$OUT/ctest.log" | head -30

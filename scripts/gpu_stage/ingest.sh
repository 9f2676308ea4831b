#!/usr/bin/env bash
# Call 5 (optional): test_cuda_ops and bench_encode_host, the served run (served.sh), then bench_ingest of the base tree (bg.sh with
# BASE_TARGETS=bench_ingest) against this one, and with the server's grouping (-b 256 -s 2048).
. "$(dirname "$0")/common.sh"
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
cd /tmp/src
wait_for 400 /tmp/build.done
# The capture's narrowing on the GPU against the record conversions, and the host path's stages.
( cd build-gpu && timeout 120 ctest -R '^test_cuda_ops$' --output-on-failure > "$OUT/ctest_ops.log" 2>&1 )
st "test_cuda_ops rc $? $(grep -E 'tests passed|narrow' "$OUT/ctest_ops.log" | head -3 | tr '\n' ' ')"
timeout 60 build-gpu/bench/bench_encode_host -r 5 --dir /tmp/beh > "$OUT/encode_host.log" 2>&1
st "bench_encode_host rc $?"; tail -9 "$OUT/encode_host.log"
wait_gguf
bash scripts/gpu_stage/served.sh
wait_for 120 /tmp/base.done
ING=(-m $G --backend cuda --locomo locomo/26.json -n 512 -r 5 --kv-mem 16000)
for who in base new; do
  b=build-base/bench/bench_ingest; [ $who = new ] && b=build-gpu/bench/bench_ingest
  echo "### $who: -b 50" >> "$OUT/ingest_ab.log"
  timeout 90 $b "${ING[@]}" -b 50 --dir /tmp/ing-$who >> "$OUT/ingest_ab.log" 2>&1; st "$who b50 rc $?"
  tail -1 "$OUT/ingest_ab.log"
done
echo "### new: -b 256 -s 2048" >> "$OUT/ingest_ab.log"
timeout 90 build-gpu/bench/bench_ingest "${ING[@]}" -b 256 -s 2048 --dir /tmp/ing-news >> "$OUT/ingest_ab.log" 2>&1
st "new b256 s2048 rc $?"; tail -1 "$OUT/ingest_ab.log"

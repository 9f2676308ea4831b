#!/usr/bin/env bash
# Call 3 of the recovery loan (README): the model, the build and the 8B GGUF, plain kv TTFT around
# bench_gpu -R for each of TTFT_FLAGS (default "-R 8,-R 24,-R 48"), bench_encode_host (SKIP_HOST=1:
# not), then rec_eval.sh in the background (EVAL=0: not); returns when it is done or at C3_LIMIT s
# (540).
set -u
. "$(dirname "$0")/common.sh"
cat /tmp/p1 /tmp/p2 .gm3/part > /tmp/model.gguf
echo "model sha ok? $( [ "$(sha256sum /tmp/model.gguf | cut -d' ' -f1)" = "$(cat .gm3/sha256)" ] && echo yes || echo NO)"
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
mkdir -p /tmp/src/models && ln -sf /tmp/model.gguf /tmp/src/models/SmolLM2-135M-Instruct.Q4_1.gguf
cd /tmp/src
wait_for 300 /tmp/build.done; cat /tmp/bg.log
cmake --build build-gpu -j 16 --target bench_encode_host bench_ingest bench_load > /tmp/b3.log 2>&1 &
B3=$!
wait_gguf
wait_for 40 /tmp/base.done; st "$(tail -2 /tmp/bg_base.log)"
# plain kv before and after the recovery flags (TTFT_FLAGS, comma-separated)
IFS=, read -ra FL <<< "${TTFT_FLAGS:--R 8,-R 24,-R 48}"
for a in "" "${FL[@]}" ""; do
  ks=50; [ -z "$a" ] && ks=5,50
  echo "### bench_gpu -k $ks -c bf16 -t '' -r 9 $a" >> "$OUT/rec_ttft_m.log"
  timeout 80 build-gpu/bench/bench_gpu -m $G -k $ks -c bf16 -t '' -r 9 $a >> "$OUT/rec_ttft_m.log" 2>&1
  st "ttft '$a' rc $?"; grep -E "^\| 50 \|" "$OUT/rec_ttft_m.log" | tail -1
done
grep -E "^\| k \|" "$OUT/rec_ttft_m.log" | head -1
wait $B3; st "build3 rc $?"
if [ "${SKIP_HOST:-0}" != 1 ]; then
  timeout 60 build-gpu/bench/bench_encode_host -r 5 > "$OUT/encode_host.log" 2>&1
  st "encode_host rc $?"; tail -12 "$OUT/encode_host.log"
fi
[ "${EVAL:-1}" = 0 ] && exit 0
( setsid nohup bash scripts/gpu_stage/rec_eval.sh > /tmp/ev.log 2>&1 < /dev/null & )
st "eval started"
while [ ! -f /tmp/ev.done ] && [ $(( $(date +%s) - S0 )) -lt ${C3_LIMIT:-540} ]; do sleep 5; done
st "ev done? $(ls /tmp/ev.done 2>&1)"; tail -5 /tmp/ev.log
tar -czf "$OUT/ev_sofar.tar.gz" -C /tmp evout 2>/dev/null

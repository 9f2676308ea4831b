#!/usr/bin/env bash
# One call after the README's first (bg.sh building; BASE_TARGETS=none): where an encoding
# forward's GPU time goes. bench_ingest -p (the op profile of one warm encoding) with one forward a
# call (-b 50) and with the server's grouping (-b 256 -s 2048), each with the default matmul
# precision and with bf16 (half the product's arithmetic), then bench_gpu -p's prompt forward of
# about as many tokens (k = 50 of 38-token facts) for the same ops on one plain sequence.
set -u
. "$(dirname "$0")/common.sh"
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
cd /tmp/src
wait_for 400 /tmp/build.done
wait_gguf
ING=(-m $G --backend cuda --locomo locomo/26.json -n 184 -r 3 --kv-mem 16000 -p)
for prec in bf16x2 bf16; do
  for grp in "-b 50" "-b 256 -s 2048"; do
    echo "### precision $prec: $grp" >> "$OUT/ingest_profile.log"
    IS_CUDA_OPTIONS=precision=$prec timeout 120 build-gpu/bench/bench_ingest "${ING[@]}" $grp \
      --dir /tmp/ingp >> "$OUT/ingest_profile.log" 2>&1
    st "$prec $grp rc $?"
  done
done
grep -E "^ +[0-9]+ |^\| (live|GPU alone)|^###" "$OUT/ingest_profile.log" | cut -c1-240
timeout 150 build-gpu/bench/bench_gpu -m $G -k 50 -F 38 -c bf16x2 -t '' -r 5 -p \
  > "$OUT/prompt_profile.log" 2>&1
st "bench_gpu -p rc $?"; grep -E "^\| (kv|prompt)" "$OUT/prompt_profile.log" | cut -c1-240

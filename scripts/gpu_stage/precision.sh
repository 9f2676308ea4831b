#!/usr/bin/env bash
# One call after the README's first two (carry .gm3): the model, then the matmul precision's share of
# the served-vs-in-process gap. bench_gpu at k = BG_K (5,50) with facts of F_TOK tokens (38: a dated
# LoCoMo fact) in both precisions, then for each precision a server over the same 10 users x 100
# facts: a first run at k = 100 (every fact of the users drawn) leaves every fact resident in the
# GPU fact cache (the hot regime), then kv at k = 5, 20, 50, 100 and prompt at 50, one client; and
# servers with --recompute M (kv at 50). SERVERS: PRECISION:M each (default bf16x2:0 bf16:0
# bf16:2 bf16:16).
set -u
. "$(dirname "$0")/common.sh"
cat /tmp/p1 /tmp/p2 .gm3/part > /tmp/model.gguf
cp scripts/gpu_stage/*.sh /tmp/src/scripts/gpu_stage/ 2>/dev/null
mkdir -p /tmp/src/models && ln -sf /tmp/model.gguf /tmp/src/models/SmolLM2-135M-Instruct.Q4_1.gguf
cd /tmp/src
wait_for 300 /tmp/build.done
wait_gguf
timeout 150 build-gpu/bench/bench_gpu -m $G -k "${BG_K:-5,50}" -F "${F_TOK:-38}" -c bf16x2,bf16 -t '' -r 9 -o "$OUT/prec_bench_gpu.csv" \
  > "$OUT/prec_bench_gpu.log" 2>&1
st "bench_gpu rc $?"; grep -E "^#|^\| (5|20|50|100) \|" "$OUT/prec_bench_gpu.log"
LOAD=(-m $G --backend cuda --embedder none --locomo locomo --data /tmp/sv --users 10
  --facts-per-user 100 --zipf 1 --ctx 8192 --kv-mem 40000 --max-running 64 --ingest-clients 8 -n 120)
for pm in ${SERVERS:-bf16x2:0 bf16:0 bf16:2 bf16:16}; do
    p=${pm%:*} m=${pm#*:}
    runs=100/50/kv/1,50/1/kv/1
    [ "$m" = 0 ] && runs=100/50/kv/1,5/1/kv/1,20/1/kv/1,50/1/kv/1,100/1/kv/1,50/1/prompt/1
    timeout 120 build-gpu/bench/bench_load "${LOAD[@]}" --cuda-opt "precision=$p" --recompute $m \
      --runs "$runs" --label "${p}_r$m" -o "$OUT/prec_${p}_r$m.csv" > "$OUT/prec_${p}_r$m.out" 2>&1
    st "served $p M=$m rc $?"
    grep -E "^ingestion|^timing: k [0-9]+, 1 |^note: k [0-9]+, 1 " "$OUT/prec_${p}_r$m.out" | cut -c1-230
    grep -E "^ +[0-9]+ +1 +1 (kv|prompt)" "$OUT/prec_${p}_r$m.out"
done

#!/usr/bin/env bash
# The recovery eval on all 7 conversations, started by rec.sh (setsid) from /tmp/src: eval locomo
# --nll at k = 20 (G20 modes) and 50 (G50), and with EV_F1=1 (default) F1 with generation at
# k = 20, one process a conversation and table, EV_T s each (420); /tmp/evout, then /tmp/ev.done.
cd /tmp/src
. "$(dirname "$0")/common.sh"
command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
E=/tmp/evout; mkdir -p $E
T=${EV_T:-420}
st "eval with $T s"
BIN=build-gpu/tools/inferscale
G20=${G20:-kv0,kv0r2,kv0r8,kv0r16,kv0r24,kv0b0.3}
G50=${G50:-kv0,kv0r2,kv0r16,kv0r24,kv0b0.3}
job() { # K MODES TAG CONV EXTRA...
  local k=$1 m=$2 tag=$3 c=$4; shift 4
  timeout "$T" $BIN eval locomo --backend cuda --data-dir /tmp/locomo --conv "$c" \
    --load-retrieval "evaldata/retr_k$k.tsv" --k "$k" --modes "$m" --kv-dtype f16 \
    --store "/tmp/ev-store-$tag-$c" --out "$E/${tag}_$c.csv" -t 1 "$@" > "$E/${tag}_$c.log" 2>&1 &
}
for c in 26 30 41 42 43 44 47; do
  job 20 "$G20" k20 $c --nll --no-generate
  job 50 "$G50" k50 $c --nll --no-generate
  [ "${EV_F1:-1}" = 1 ] && job 20 "prompt,kv0,kv0r2,kv0r16,kv0r24" f1k20 $c
done
wait
echo quit | nvidia-cuda-mps-control 2>/dev/null
for f in $E/*.log; do
  echo "  $(basename $f): $(grep -E '^time:' $f || tail -c 160 $f | tr '\r\n' '  ')"
  echo "    scored: nll $(grep -c ',prompt,' ${f%.log}.csv.nll.csv 2>/dev/null) rows $(($(wc -l < ${f%.log}.csv 2>/dev/null || echo 1) - 1))"
done
st done
touch /tmp/ev.done

#!/usr/bin/env bash
# Call 4 of the recovery loan: waits for rec_eval.sh (C4_LIMIT s, 560), then its results as ev.tar.gz.
S0=$(date +%s)
while [ ! -f /tmp/ev.done ] && [ $(( $(date +%s) - S0 )) -lt ${C4_LIMIT:-560} ]; do sleep 5; done
echo "ev done? $(ls /tmp/ev.done 2>&1) after $(( $(date +%s) - S0 )) s"
tail -40 /tmp/ev.log
tar -czf "$OUT/ev.tar.gz" -C /tmp evout

# Sourced by the staged calls that run on the device (`. "$(dirname "$0")/common.sh"`): the log's
# clock (st), the libraries scripts/gpu_prepare.sh carried, the 8B-shaped GGUF's path (G), and the
# waits for what bg.sh makes in the background.
S0=$(date +%s); st() { echo "[$(( $(date +%s) - S0 )) s] $*"; }
export LD_LIBRARY_PATH="/tmp/src/build-gpu/deps/ldlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
G=/tmp/llama31-8b.f16.gguf
# wait_for SECONDS FILE...: until every FILE exists or SECONDS have passed; says which exist.
wait_for() {
  local limit=$1; shift
  for _ in $(seq 1 $(( limit / 2 ))); do
    local all=1 f
    for f in "$@"; do [ -f "$f" ] || all=0; done
    [ $all = 1 ] && break
    sleep 2
  done
  st "ready? $(ls "$@" 2>&1 | tr '\n' ' ')"
}
# wait_gguf: until bg.sh has written the GGUF (at most 240 s).
wait_gguf() {
  for _ in $(seq 1 120); do [ -s $G ] && grep -q "gen rc" /tmp/gen.log 2>/dev/null && break; sleep 2; done
  st "gguf: $(tail -1 /tmp/gen.log 2>&1)"
}

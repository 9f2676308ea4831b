# Sourced from the repository root by the benchmark scripts that run on the
# GPU machine (run_gpu_bench.sh, run_gpu_ab.sh): sets REPO, OUT (the device
# tool's folder that comes back; ./gpu-out elsewhere), LOG (OUT/work, tarred
# into OUT/logs.tar.gz at exit), SUMMARY (OUT/summary.md, emptied) and
# stamp (prints a line with the seconds since the start and appends it to
# the summary).
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
LOG=$OUT/work
mkdir -p "$LOG"
SUMMARY=$OUT/summary.md
: > "$SUMMARY"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$SUMMARY"; }
trap 'tar -czf "$OUT/logs.tar.gz" -C "$LOG" . 2>/dev/null && rm -rf "$LOG"' EXIT

# fuzz_run.sh: sourced by scripts/fuzz_*.sh. fuzz_run runs one libFuzzer
# target built in $build on $corpus and $seeds for $secs seconds, keeps its
# log in $build/TARGET.log, prints libFuzzer's summary lines and returns its
# exit status (non-zero when it found a crash, whose reproducer lies under
# the artifact prefix).
#
#   fuzz_run TARGET MAX_LEN ARTIFACT_PREFIX DICT [extra libFuzzer flags...]
#   (DICT "" for none)
fuzz_run() {
    local target=$1 max_len=$2 prefix=$3 dict=$4
    shift 4
    local dict_flag=()
    [ -n "$dict" ] && dict_flag=(-dict="$dict")
    echo "== fuzzing for ${secs}s"
    set +e
    "$build/$target" "$corpus" "$seeds" \
        -max_total_time="$secs" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
        "${dict_flag[@]}" -artifact_prefix="$prefix" -print_final_stats=1 "$@" 2>&1 |
        tee "$build/$target.log" |
        grep -E '^(#[0-9]+[[:space:]]+(INITED|DONE)|stat::|==[0-9]+==ERROR|SUMMARY|artifact|Done)'
    local rc=${PIPESTATUS[0]}
    set -e
    echo "corpus: $(ls "$corpus" | wc -l) inputs; full log: $build/$target.log"
    [ "$rc" -eq 0 ] || echo "$target exited $rc: see crashes in $crashes" >&2
    return "$rc"
}

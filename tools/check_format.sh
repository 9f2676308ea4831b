#!/bin/bash
# Checks that the C, CUDA and header files of the tree are formatted as
# .clang-format says, with the clang-format major version the tree was
# formatted with (other versions lay out some constructs differently, so
# their verdict would not be about our code).
#   tools/check_format.sh [--fix] [ROOT]
# Exit 0: formatted; 1: files differ (listed; --fix rewrites them);
# 77: no clang-format of that version here (skipped, with the reason).
set -u
fix=0
if [ "${1:-}" = "--fix" ]; then fix=1; shift; fi
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
want=14
cf=""
for c in clang-format-$want clang-format; do
    if command -v "$c" >/dev/null 2>&1; then cf=$c; break; fi
done
if [ -z "$cf" ]; then
    echo "check_format: skipped: no clang-format (Debian package clang-format, version $want)"
    exit 77
fi
ver=$("$cf" --version | sed -n 's/.*version \([0-9]*\).*/\1/p')
if [ "$ver" != "$want" ]; then
    echo "check_format: skipped: $cf is version $ver; the tree is formatted with version $want"
    exit 77
fi
cd "$root" || exit 1
mapfile -t files < <(find src cuda tools tests bench include fuzz -type f \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)
if [ "$fix" = 1 ]; then
    "$cf" -i "${files[@]}"
    exit 0
fi
bad=0
for f in "${files[@]}"; do
    if ! "$cf" --dry-run --Werror "$f" >/dev/null 2>&1; then
        echo "not formatted: $f"
        bad=$((bad + 1))
    fi
done
echo "check_format: ${#files[@]} files, $bad not formatted (tools/check_format.sh --fix formats them)"
[ "$bad" = 0 ]

#!/usr/bin/env bash
# fuzz_http_url.sh: build the request-target libFuzzer target
# (fuzz/fuzz_http_url.c: libmicrohttpd's URL decoding, then the server's URL,
# query-string and id checks in src/serve/http/parse.c) with ASan + UBSan and
# run it for a while on a seed corpus of request targets.
#
#   scripts/fuzz_http_url.sh [SECONDS] [extra libFuzzer flags...]     (default 60 s)
#
# Everything lives in fuzz-corpus/ (git-ignored): http-url-seeds/ (regenerated
# each run), http-url/ (the corpus libFuzzer grows and keeps) and crashes/
# (reproducers, named http-url-crash-*; rerun one with build-fuzz/fuzz_http_url
# FILE). Built straight with clang from the sources it needs, the system cJSON
# and the system libmicrohttpd (its decoder is the one under test, so it is not
# rebuilt). Exit status is non-zero if a crash was found.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
shift || true
cc=${CC:-clang}
build=$root/build-fuzz
corpus=$root/fuzz-corpus/http-url
seeds=$root/fuzz-corpus/http-url-seeds
crashes=$root/fuzz-corpus/crashes
mkdir -p "$build" "$corpus" "$crashes"
rm -rf "$seeds" && mkdir -p "$seeds"

inc=(-I"$root/include" -I"$root/src" -D_GNU_SOURCE -std=gnu11 $(pkg-config --cflags libcjson libmicrohttpd))

echo "== building $build/fuzz_http_url with $cc"
"$cc" "${inc[@]}" -g -O1 -Wall -Wextra -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$root/fuzz/fuzz_http_url.c" "$root/src/serve/http/parse.c" "$root/src/memory/metadata.c" "$root/src/core/status.c" \
    $(pkg-config --libs libcjson libmicrohttpd) -lm -o "$build/fuzz_http_url"

echo "== seeds"
n=0
seed() { n=$((n + 1)); printf '%s' "$1" > "$seeds/seed_$n"; }
seed '/v1/memories/?user_id=alice'
seed '/v1/memories/?user_id=victim%00attacker'
seed '/v1/memories/?user_id=alice&agent_id=bot&run_id=r1&metadata=%7B%22topic%22%3A%22travel%22%7D'
seed '/v1/memories/0123456789abcdef-_ABC/'
seed '/v1/memories/abc%00def/history/'
seed '/v1/memories/?user_id=a%0Ab&user_id=a%0Ab'
seed '/v1/memories/?user_id=caf%C3%A9&agent_id=%C2%85'
seed '/v1/memories/?user_id=%zz&run_id=%4'
seed '/v1/memories/?user_id=&agent_id'
seed '/health?x=%7F'
echo "seeds: $(ls "$seeds" | wc -l) files"

source "$root/scripts/fuzz_run.sh"
fuzz_run fuzz_http_url 1024 "$crashes/http-url-" "$root/fuzz/http.dict" "$@"

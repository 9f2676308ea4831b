#!/usr/bin/env bash
# fuzz_http.sh: build the HTTP request parsers' libFuzzer target
# (fuzz/fuzz_http_parse.c over src/serve/http/parse.c) with ASan + UBSan and
# run it for a while on a seed corpus of well-formed requests.
#
#   scripts/fuzz_http.sh [SECONDS] [extra libFuzzer flags...]     (default 60 s)
#
# Seeds (written below) are the request shapes of the API: chat completions
# (OpenAI's fields, content parts, stop lists, the memory object with
# filters), Mem0's memory add / search / update bodies, list and delete query
# strings, and a few malformed ones. Everything lives in fuzz-corpus/
# (git-ignored): http-seeds/ (regenerated each run), http/ (the corpus
# libFuzzer grows and keeps between runs) and crashes/ (reproducers, named
# http-crash-*; rerun one with build-fuzz/fuzz_http_parse FILE). Built straight
# with clang from the two sources it needs (and the system cJSON), so a
# half-written file elsewhere in the tree does not stop it. Exit status is
# non-zero if a crash was found.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
shift || true
cc=${CC:-clang}
build=$root/build-fuzz
corpus=$root/fuzz-corpus/http
seeds=$root/fuzz-corpus/http-seeds
crashes=$root/fuzz-corpus/crashes
mkdir -p "$build" "$corpus" "$crashes"
rm -rf "$seeds" && mkdir -p "$seeds"

inc=(-I"$root/include" -I"$root/src" -D_GNU_SOURCE -std=gnu11 $(pkg-config --cflags libcjson))

echo "== building $build/fuzz_http_parse with $cc"
"$cc" "${inc[@]}" -g -O1 -Wall -Wextra -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$root/fuzz/fuzz_http_parse.c" "$root/src/serve/http/parse.c" "$root/src/memory/metadata.c" "$root/src/core/status.c" \
    $(pkg-config --libs libcjson) -lm -o "$build/fuzz_http_parse"

echo "== seeds"
n=0
seed() { n=$((n + 1)); printf '%s' "$1" > "$seeds/seed_$n"; }
seed '{"model":"smol","messages":[{"role":"user","content":"What do I like?"}],"max_tokens":16}'
seed '{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"Where was I in May?"}],"temperature":0,"top_p":0.9,"top_k":40,"seed":42,"stop":["\n","END"],"user":"alice","memory":{"k":20,"mode":"kv","filters":{"agent_id":"a1","metadata":{"topic":"travel","year":2023,"ok":true,"x":null}}}}'
seed '{"messages":[{"role":"developer","content":[{"type":"text","text":"part one "},{"type":"text","text":"part two"}]}],"stream":true,"stream_options":{"include_usage":false},"max_completion_tokens":8,"n":1,"tools":[]}'
seed '{"messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude00 \u20ac"}],"user":"b\u00f6b","memory":{"mode":"prompt","k":0},"stop":"."}'
seed '{"messages":[{"role":"user","content":"x"}],"memory":{"mode":"off"},"frequency_penalty":0,"logit_bias":{},"user":null}'
seed '{"messages":[{"role":"user","content":"x"}],"max_tokens":2.0,"temperature":2,"memory":{"filters":{"user_id":"u","run_id":"r","color":"red","n":1.5}}}'
seed '{"messages":[{"role":"user","content":"I love teal."},{"role":"assistant","content":"Noted."}],"user_id":"alice","agent_id":"bot","run_id":"r1","metadata":{"source":"chat","n":3},"infer":false}'
seed '{"facts":["Alice likes teal.","Bob lives in Oslo."],"user_id":"alice","infer":false}'
seed '{"messages":[{"role":"user","content":"remember this"}],"facts":["f"],"user_id":"u"}'
seed '{"query":"favourite colour","user_id":"alice","top_k":5}'
seed '{"query":"q","limit":3,"filters":{"user_id":"alice","agent_id":"bot","metadata":{"topic":"t"}}}'
seed '{"query":"q","filters":{"user_id":"a"},"user_id":"a","run_id":"r"}'
seed '{"text":"Alice now likes green.","metadata":{"edited":true}}'
seed '{"data":"new text","user_id":"alice"}'
seed '{"memory":"new text","metadata":null}'
seed '{"metadata":{}}'
seed 'user_id=alice'
seed 'user_id=alice&agent_id=bot&run_id=r1&metadata={"topic":"travel","n":2}'
seed 'metadata={"a":"b"}&user_id=u&user_id=u'
seed 'user_id=&colour=red'
seed '0123456789abcdef-_ABC'
seed '{"messages":[{"role":"user","content":"x"}]} trailing'
seed '{"messages":[{"role":"user","content":"\u0000"}]}'
seed '[1,2,3]'
printf '{"messages":[{"role":"user","content":"\xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80"}]}' > "$seeds/seed_bad_utf8"
printf 'caf\xc3\xa9 \xe2\x82' > "$seeds/seed_cut_utf8"
echo "seeds: $(ls "$seeds" | wc -l) files"

source "$root/scripts/fuzz_run.sh"
fuzz_run fuzz_http_parse 4096 "$crashes/http-" "$root/fuzz/http.dict" "$@"

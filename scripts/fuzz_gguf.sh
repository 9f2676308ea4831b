#!/usr/bin/env bash
# fuzz_gguf.sh: build the GGUF reader's libFuzzer target with ASan + UBSan and
# run it for a while on a seed corpus of small valid GGUF files.
#
#   scripts/fuzz_gguf.sh [SECONDS] [extra libFuzzer flags...]     (default 60 s)
#
# Seeds come from two independent writers: the test's own writer
# (tests/gguf/test_gguf.c run with IS_GGUF_SEED_DIR) and the python `gguf`
# package's GGUFWriter (skipped if it is not installed). Everything lives in
# fuzz-corpus/ (git-ignored): gguf-seeds/ (regenerated each run), gguf/ (the
# corpus libFuzzer grows and keeps between runs) and crashes/ (reproducers;
# rerun one with build-fuzz/fuzz_gguf FILE). The fuzzer is built straight
# with clang from the three sources it needs, so a half-written file elsewhere
# in the tree does not stop it. Exit status is non-zero if a crash was found.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
shift || true
cc=${CC:-clang}
build=$root/build-fuzz
corpus=$root/fuzz-corpus/gguf
seeds=$root/fuzz-corpus/gguf-seeds
crashes=$root/fuzz-corpus/crashes
mkdir -p "$build" "$corpus" "$crashes"
rm -rf "$seeds" && mkdir -p "$seeds"

lib_src=("$root/src/gguf/gguf.c" "$root/src/gguf/verify.c" "$root/src/gguf/tensor_type.c"
         "$root/src/core/status.c")
inc=(-I"$root/include" -I"$root/src" -D_GNU_SOURCE -std=gnu11)

echo "== building $build/fuzz_gguf with $cc"
"$cc" "${inc[@]}" -g -O1 -Wall -Wextra -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$root/fuzz/fuzz_gguf.c" "${lib_src[@]}" -o "$build/fuzz_gguf"

echo "== seeds from the test writer"
"$cc" "${inc[@]}" -O1 -DIS_DEFAULT_MODEL="\"/nonexistent\"" \
    -I"$root/tests/common" "$root/tests/gguf/test_gguf.c" "$root/tests/common/test_util.c" \
    "${lib_src[@]}" -lcmocka -lm -o "$build/test_gguf_seeds"
IS_GGUF_SEED_DIR="$seeds" "$build/test_gguf_seeds" >/dev/null 2>&1 || {
    echo "test_gguf failed while writing seeds" >&2
    exit 1
}

echo "== seeds from python gguf.GGUFWriter"
python3 - "$seeds" <<'PY' || echo "(python gguf package unavailable: no python seeds)"
import sys, numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, GGUFValueType

out = sys.argv[1]

def write(name, fill, alignment=None):
    w = GGUFWriter(f"{out}/{name}.gguf", "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

def kv_all(w):
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 60000); w.add_int16("t.i16", -300)
    w.add_uint32("llama.block_count", 2); w.add_int32("t.i32", -70000)
    w.add_float32("llama.rope.freq_base", 10000.0); w.add_bool("t.bool", True)
    w.add_string("tokenizer.ggml.pre", "smollm"); w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40)); w.add_float64("t.f64", 0.125)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "", "\u00e9t\u00e9"])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 1])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])

def tensors(w):
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("blk.0.f16", np.ones((2, 8), dtype=np.float16))
    # Quantised tensors are given as bytes: (rows, bytes per row).
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 34), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((1, 40), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q4_1)

write("py_kv_only", kv_all)
write("py_tensors", lambda w: (kv_all(w), tensors(w)))
write("py_align64", lambda w: (w.add_string("general.name", "x"), tensors(w)), alignment=64)
write("py_min_tensor", lambda w: w.add_tensor("x", np.zeros(1, dtype=np.float32)))
PY
echo "seeds: $(ls "$seeds" | wc -l) files, $(du -sh "$seeds" | cut -f1)"

source "$root/scripts/fuzz_run.sh"
fuzz_run fuzz_gguf 16384 "$crashes/" "$root/fuzz/gguf.dict" "$@"

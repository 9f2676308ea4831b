#!/usr/bin/env bash
# fuzz_fact_record.sh: build the fact-KV record parser's libFuzzer target
# with ASan + UBSan and run it for a while on a seed corpus of valid records.
#
#   scripts/fuzz_fact_record.sh [SECONDS] [extra libFuzzer flags...]  (default 60 s)
#
# Seeds come from two independent writers: the test's encoder
# (tests/kv/test_fact_record.c run with IS_FACT_SEED_DIR) and a Python writer
# below that follows the byte layout documented in src/kv/fact_record.h
# (needs the `xxhash` package; skipped if it is missing). The Python side
# also reads every C-written seed, recomputes its checksum and re-encodes it,
# and fails the script if the two disagree about a single byte. Everything
# lives in fuzz-corpus/ (git-ignored): fact-seeds/ (regenerated each run),
# fact/ (the corpus libFuzzer grows and keeps) and crashes/ (reproducers;
# rerun one with build-fuzz/fuzz_fact_record FILE). Built straight with clang
# from the sources it needs, so a half-written file elsewhere in the tree
# does not stop it. Exit status is non-zero if a crash was found.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
shift || true
cc=${CC:-clang}
build=$root/build-fuzz
corpus=$root/fuzz-corpus/fact
seeds=$root/fuzz-corpus/fact-seeds
crashes=$root/fuzz-corpus/crashes
mkdir -p "$build" "$corpus" "$crashes"
rm -rf "$seeds" && mkdir -p "$seeds"

lib_src=("$root/src/kv/fact_record.c" "$root/src/gguf/quant.c"
         "$root/src/gguf/tensor_type.c" "$root/src/core/status.c")
inc=(-I"$root/include" -I"$root/src" -D_GNU_SOURCE -std=gnu11)

echo "== building $build/fuzz_fact_record with $cc"
"$cc" "${inc[@]}" -g -O1 -Wall -Wextra -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$root/fuzz/fuzz_fact_record.c" "${lib_src[@]}" -lm -o "$build/fuzz_fact_record"

echo "== seeds from the test encoder"
"$cc" "${inc[@]}" -O1 "$root/tests/kv/test_fact_record.c" "${lib_src[@]}" -lcmocka -lm \
    -o "$build/test_fact_record_seeds"
IS_FACT_SEED_DIR="$seeds" "$build/test_fact_record_seeds" >/dev/null 2>&1 || {
    echo "test_fact_record failed while writing seeds" >&2
    exit 1
}

echo "== seeds from an independent Python writer (and a check of the C seeds)"
set +e
python3 - "$seeds" <<'PY'
import glob, os, struct, sys
try:
    import xxhash
except ImportError:
    print("(python xxhash package unavailable: no python seeds, no cross-check)")
    sys.exit(0)

out = sys.argv[1]
HDR = struct.Struct("<4sIII16siiiiiiffQiIQQ24s")  # bytes 0..119
assert HDR.size == 120
pad = lambda n: (n + 63) // 64 * 64
DSIZE = {0: 4, 1: 2, 2: 2}

def encode(fp, dtype, nl, nh, hd, nt, layout, nrot, base, scale, fhash, window, thash,
           tokens, k, v):
    kvb = nl * nt * nh * hd * DSIZE[dtype]
    assert len(k) == kvb and len(v) == kvb and len(tokens) == nt
    total = 128 + pad(4 * nt) + 2 * pad(kvb)
    hdr = HDR.pack(b"IFKV", 1, 128, dtype, fp, nl, nh, hd, nt, layout, nrot, base, scale,
                   fhash, window, 0, thash, total, bytes(24))
    tok = struct.pack(f"<{nt}i", *tokens)
    payload = (tok + bytes(pad(len(tok)) - len(tok)) + k + bytes(pad(kvb) - kvb)
               + v + bytes(pad(kvb) - kvb))
    rec = hdr + struct.pack("<Q", xxhash.xxh64_intdigest(hdr + payload)) + payload
    assert len(rec) == total
    return rec

def decode_reencode(rec):
    f = HDR.unpack_from(rec, 0)
    magic, ver, hb, dtype, fp, nl, nh, hd, nt, layout, nrot, base, scale, fhash, window, \
        r0, thash, total, r1 = f
    assert magic == b"IFKV" and ver == 1 and hb == 128 and total == len(rec)
    kvb = nl * nt * nh * hd * DSIZE[dtype]
    koff = 128 + pad(4 * nt)
    voff = koff + pad(kvb)
    tokens = struct.unpack_from(f"<{nt}i", rec, 128)
    return encode(fp, dtype, nl, nh, hd, nt, layout, nrot, base, scale, fhash, window, thash,
                  tokens, rec[koff:koff + kvb], rec[voff:voff + kvb])

checked = 0
for path in sorted(glob.glob(os.path.join(out, "*.fkv"))):
    rec = open(path, "rb").read()
    if decode_reencode(rec) != rec:
        print(f"python reader disagrees with the C encoder on {path}", file=sys.stderr)
        sys.exit(1)
    checked += 1
print(f"python reader agrees byte for byte with {checked} C-written records")

import random
rnd = random.Random(7)
n = 0
for dtype in (0, 1, 2):
    for (nl, nh, hd, nt) in ((1, 1, 1, 1), (3, 5, 6, 7), (2, 1, 64, 2)):
        kvb = nl * nt * nh * hd * DSIZE[dtype]
        rec = encode(b"%016x" % rnd.getrandbits(64), dtype, nl, nh, hd, nt, rnd.randint(0, 1),
                     hd - hd % 2, 10000.0, 1.0, rnd.getrandbits(64), rnd.randint(-1, 5),
                     xxhash.xxh64_intdigest(b"fact %d" % n),
                     [rnd.randint(0, 49151) for _ in range(nt)],
                     bytes(rnd.getrandbits(8) for _ in range(kvb)),
                     bytes(rnd.getrandbits(8) for _ in range(kvb)))
        open(os.path.join(out, f"py_{n}.fkv"), "wb").write(rec)
        n += 1
print(f"python seeds: {n}")
PY
py=$?
set -e
[ "$py" -eq 0 ] || { echo "python cross-check failed" >&2; exit 1; }
echo "seeds: $(ls "$seeds" | wc -l) files, $(du -sh "$seeds" | cut -f1)"

source "$root/scripts/fuzz_run.sh"
fuzz_run fuzz_fact_record 8192 "$crashes/" "" "$@"

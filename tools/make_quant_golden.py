#!/usr/bin/env python3
"""make_quant_golden: reference dequantisation results for tests/gguf/test_quant.c.

For each element type we read, this draws random raw blocks with numpy (fixed
seed), dequantises them with the Python `gguf` package (gguf.quants.dequantize,
the reference that ships with llama.cpp), and writes both to
tests/golden/quant_<type>.bin. The C test dequantises the same raw bytes with
quant_dequantize() and demands bitwise-equal floats.

File format (all little-endian):
    offset  size  field
    0       4     magic b"ISQG"
    4       4     u32 version = 1
    8       4     u32 tensor type id (ggml numbering, src/gguf/tensor_type.h)
    12      4     u32 n_blocks
    16      4     u32 block_elems (values per block)
    20      4     u32 block_bytes (bytes per block)
    24      4     u32 seed used for this file
    28      4     u32 reserved = 0
    32      n_blocks * block_bytes               raw blocks, as in a GGUF file
    ...     n_blocks * block_elems * 4           expected f32 values

Random blocks: every byte is uniform, except the f16 scale fields, which are
uniform over all finite half bit patterns (both signs, subnormals and zero
included) so that the products stay finite; in blocks 0 and 1 of each file
the scales are forced to zero / negative values to cover those edge cases.
For F16 the values are uniform over all half bit patterns, but signalling
NaNs are made quiet (payload bit 9 set) before writing: IEEE 754, x86 F16C
and quant_f16_to_f32 turn a signalling NaN into a quiet one, while numpy's
half->float keeps it signalling, so the two would disagree by one payload bit
on those 2^10-2 patterns (test_quant checks them against IEEE instead).
BF16 and F32 use all bit patterns (their conversions are bit shifts and
copies, NaNs included).

Usage: python3 tools/make_quant_golden.py [--out tests/golden]
"""

import argparse
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

MAGIC = b"ISQG"
VERSION = 1

# type -> (file name, number of blocks, byte offsets of the f16 scale fields)
TYPES = {
    T.F32: ("f32", 512, []),
    T.F16: ("f16", 1024, []),
    T.BF16: ("bf16", 1024, []),
    T.Q4_0: ("q4_0", 32, [0]),
    T.Q4_1: ("q4_1", 32, [0, 2]),
    T.Q5_0: ("q5_0", 32, [0]),
    T.Q5_1: ("q5_1", 32, [0, 2]),
    T.Q8_0: ("q8_0", 32, [0]),
    T.Q4_K: ("q4_k", 4, [0, 2]),
    T.Q5_K: ("q5_k", 4, [0, 2]),
    T.Q6_K: ("q6_k", 4, [208]),
}


def random_finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n half bit patterns, uniform over the finite ones."""
    out = rng.integers(0, 1 << 16, size=n, dtype=np.uint32)
    bad = (out & 0x7C00) == 0x7C00
    while bad.any():
        out[bad] = rng.integers(0, 1 << 16, size=int(bad.sum()), dtype=np.uint32)
        bad = (out & 0x7C00) == 0x7C00
    return out.astype(np.uint16)


def make_blocks(qtype: T, n_blocks: int, f16_offsets: list[int], rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if qtype == T.F16:
        h = raw.view(np.uint16)
        snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0) & ((h & 0x0200) == 0)
        h[snan] |= 0x0200  # make them quiet (see the module docstring)
    for off in f16_offsets:
        raw[:, off:off + 2] = random_finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    # blocks 0 and 1: a negative scale with a zero second scale, and the reverse
    specials = [[0xBE00, 0x0000], [0x0000, 0xC080]]  # -1.5, +0.0 / +0.0, -2.25
    for blk, bits in enumerate(specials[:n_blocks] if f16_offsets else []):
        for off, b in zip(f16_offsets, bits):
            raw[blk, off:off + 2] = np.array([b], dtype=np.uint16).view(np.uint8)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for qtype, (name, n_blocks, f16_offsets) in TYPES.items():
        seed = 1000 + int(qtype)
        rng = np.random.default_rng(seed)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = make_blocks(qtype, n_blocks, f16_offsets, rng)
        flat = np.ascontiguousarray(raw).reshape(-1)
        expected = np.asarray(dequantize(flat, qtype), dtype=np.float32).reshape(-1)
        assert expected.size == n_blocks * block_elems, (name, expected.size)
        header = MAGIC + struct.pack("<7I", VERSION, int(qtype), n_blocks, block_elems, block_bytes, seed, 0)
        path = os.path.join(args.out, f"quant_{name}.bin")
        with open(path, "wb") as f:
            f.write(header)
            f.write(flat.tobytes())
            f.write(expected.astype("<f4").tobytes())
        print(f"{path}: {n_blocks} blocks of {name}, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()

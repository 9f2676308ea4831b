#!/usr/bin/env python3
"""Writes tests/golden/fp8_e4m3.txt: the fp8 e4m3 reference for tests/core/test_fp8.c.

An independent reference for src/core/fp8.c: the 256 codes' values are built
from the format's definition as exact fractions, and each f32 input is
converted by searching for the nearest finite value (ties to the even
mantissa, i.e. the even code), saturating past 448, NaN to 0x7F. The C code
instead works on the f32 bits; a disagreement on any line fails the test.

Lines:  "d CODE F32BITS"   decode of a code (NaN codes: 7fffffff)
        "e F32BITS CODE"   encode of an f32 (hex bits)
Usage: python3 tools/make_fp8_golden.py > tests/golden/fp8_e4m3.txt
"""
import math
import struct
from fractions import Fraction


def code_value(c):
    """Exact value of an e4m3 code, None for NaN."""
    s = -1 if c & 0x80 else 1
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return None
    if e == 0:
        return s * Fraction(m, 512)
    return s * Fraction(8 + m, 8) * Fraction(2) ** (e - 7)


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


POS = [(c, code_value(c)) for c in range(0x7F)]  # 0x00..0x7E: 0 .. 448


def encode(b):
    x = bits_f32(b)
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if b >> 31 else 0
    if math.isinf(x):
        return sign | 0x7E
    a = abs(Fraction(x))
    if a >= 448:
        return sign | 0x7E
    best = None
    for c, v in POS:
        d = abs(v - a)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return sign | best[1]


def main():
    print("# fp8 e4m3 reference: tools/make_fp8_golden.py (exact fractions, nearest value)")
    for c in range(256):
        v = code_value(c)
        if v is None:
            print("d %02x 7fffffff" % c)
        else:
            b = f32_bits(float(v))
            if v == 0 and c & 0x80:
                b = 0x80000000
            print("d %02x %08x" % (c, b))
    inputs = set()
    vals = [v for _, v in POS]
    for i, v in enumerate(vals):
        b = f32_bits(float(v))
        for d in (-1, 0, 1):
            inputs.add((b + d) & 0x7FFFFFFF)
        if i + 1 < len(vals):
            mid = f32_bits(float((v + vals[i + 1]) / 2))  # exact in f32
            for d in (-2, -1, 0, 1, 2):
                inputs.add(mid + d)
    for b in (0x00000001, 0x007FFFFF, 0x00800000, 0x3A800000, 0x3A000000, 0x39FFFFFF,
              0x3A000001, 0x43E00000, 0x43E7FFFF, 0x43E80000, 0x43F00000, 0x477FE000,
              0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001, 0x3F800000, 0x3F880000,
              0x3F900000, 0x3F980000):
        inputs.add(b)
    x = 0x2F000000  # a sweep of every 2^17-th f32 bit pattern from 2^-33 up past 448
    while x < 0x44000000:
        inputs.add(x)
        x += 1 << 17
    for b in sorted(inputs):
        for s in (0, 0x80000000):
            print("e %08x %02x" % (b | s, encode(b | s)))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reference XXH64 values for tests/kv/test_fact_record.c (test_xxh64_reference_vectors).

Runs the reference xxHash implementation through the PyPI package `xxhash`
(pip install xxhash) and prints the values the C test expects, so anyone can
regenerate and compare them:  python3 tools/make_xxh64_golden.py
"""
import xxhash

cases = {
    "empty": b"",
    "a": b"a",
    "abc": b"abc",
    "bytes(range(256)) * 3 + b'xyz'": bytes(range(256)) * 3 + b"xyz",
}
print(f"# xxhash {xxhash.VERSION}, seed 0")
for name, data in cases.items():
    print(f"{name}: 0x{xxhash.xxh64_intdigest(data):016x}ull")

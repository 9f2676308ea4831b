#!/usr/bin/env python3
"""Writes a copy of a sentence-transformers model folder with its F32
weights stored as F16, for carrying the embedder to the GPU machine (one
device call carries at most 64 MiB; MiniLM is 88 MB in F32, 44 MB in F16).
memory/embedder.c reads F16 safetensors (widened to f32 on load), so tests
there compare the CPU and GPU embedders on the same rounded weights.
Standard library only (the GPU machine's image and ours may lack numpy).

Usage: tools/embedder_to_f16.py SRC_DIR DST_DIR
"""
import json
import os
import shutil
import struct
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    os.makedirs(dst, exist_ok=True)
    for root, _, files in os.walk(src):
        for f in files:
            if f == "model.safetensors" and root == src:
                continue
            rel = os.path.relpath(os.path.join(root, f), src)
            if rel.endswith((".bin", ".onnx", ".h5", ".msgpack", ".ot")) or "onnx" in rel:
                continue  # other weight formats: not read by the C embedder
            os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
            shutil.copyfile(os.path.join(root, f), os.path.join(dst, rel))
    with open(os.path.join(src, "model.safetensors"), "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        base = 8 + n
        out_header, chunks, off = {}, [], 0
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]
                              if kv[0] != "__metadata__" else -1):
            if name == "__metadata__":
                out_header[name] = t
                continue
            a, b = t["data_offsets"]
            fh.seek(base + a)
            data = fh.read(b - a)
            dtype = t["dtype"]
            if dtype == "F32":
                count = len(data) // 4
                data = struct.pack("<%de" % count, *struct.unpack("<%df" % count, data))
                dtype = "F16"
            out_header[name] = {"dtype": dtype, "shape": t["shape"],
                                "data_offsets": [off, off + len(data)]}
            chunks.append(data)
            off += len(data)
    hdr = json.dumps(out_header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(os.path.join(dst, "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(hdr)))
        fh.write(hdr)
        for c in chunks:
            fh.write(c)
    print("%s: %d tensors, %.1f MB" % (dst, len(chunks), off / 1e6))


if __name__ == "__main__":
    main()

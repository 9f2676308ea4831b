#!/usr/bin/env python3
"""gen_random_gguf.py: the random-weight GGUF of tools/make_random_gguf.py, with the random
numbers drawn on the GPU (torch) when one is there, for bench/run_gpu_bench.sh.

Why: the benchmark machine is lent for minutes and starts bare, so the 16 GB Llama-3.1-8B-shaped
file is written again in every call; numpy draws 8e9 normals on one core in about a minute, a
GPU in well under a second, and then the time is the copy back and the write. Everything else is
make_random_gguf.py's own: the metadata, the tensor plan and order, the synthetic tokenizer, the
streaming writer (write_gguf), the llama3 rope factors, the value distributions (N(0, 1/cols)
for matrices, N(0, 1) for the embedding, 1 + 0.1 N(0, 1) for norms). Values differ from the
numpy path's (another generator); both are seeded. Storage: f16 or bf16 (drawn directly in that
type) or f32; without torch or a GPU it falls back to the numpy producer.

    python3 bench/gen_random_gguf.py --preset llama31-8b --type f16 --out /tmp/llama31-8b.f16.gguf
"""

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import make_random_gguf as mrg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(mrg.PRESETS), default="llama31-8b")
    ap.add_argument("--type", choices=["f16", "bf16", "f32"], default="f16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--cpu", action="store_true", help="use the numpy producer")
    a = ap.parse_args()
    shape = mrg._parse_set(dict(mrg.PRESETS[a.preset]), a.set)
    t0 = time.time()
    dev = None
    if not a.cpu:
        try:
            import torch
            if torch.cuda.is_available():
                dev = torch.device("cuda")
        except ImportError:
            pass
    if dev is None:
        n = mrg.write_random_gguf(a.out, shape, a.type, a.seed, log=None)
        print(f"wrote {a.out} (numpy producer): {n / 1e9:.2f} GB of tensor data in {time.time() - t0:.1f} s")
        return

    import torch
    tdtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[a.type]
    hd = mrg.head_dim_of(shape)
    gen = torch.Generator(device=dev)
    orig_encode = mrg.encode_rows

    def encode(x, qtype):
        # Rows drawn on the GPU arrive already in the storage type (bf16 as its uint16 bits).
        if isinstance(x, np.ndarray) and x.dtype in (np.float16, np.uint16) and x.ndim == 2:
            return x
        return orig_encode(x, qtype)

    mrg.encode_rows = encode
    tensors = []
    for idx, (name, np_shape, kind) in enumerate(mrg.tensor_plan(shape)):
        def produce(r0, r1, idx=idx, np_shape=np_shape, kind=kind):
            cols = np_shape[-1]
            if kind == "rope_freqs":
                return mrg.llama3_rope_factors(hd, shape["rope_theta"], shape["rope_scaling"])
            rng = np.random.default_rng([a.seed, idx, r0])
            if kind == "norm":
                return 1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)
            if kind == "bias":
                return 0.1 * rng.standard_normal(cols, dtype=np.float32)
            gen.manual_seed((a.seed * 1000003 + idx) * 1000003 + r0)
            x = torch.randn((r1 - r0, cols), generator=gen, device=dev, dtype=torch.float32)
            if kind == "matrix":
                x *= 1.0 / math.sqrt(cols)
            x = x.to(tdtype)
            if tdtype == torch.bfloat16:
                return x.view(torch.int16).cpu().numpy().view(np.uint16)
            return x.cpu().numpy()
        tensors.append((name, np_shape, kind, produce))
    n = mrg.write_gguf(a.out, shape, tensors, a.type, None, chunk_bytes=256 << 20, log=None)
    print(f"wrote {a.out} (GPU producer): {n / 1e9:.2f} GB of tensor data in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

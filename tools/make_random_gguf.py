#!/usr/bin/env python3
"""make_random_gguf.py: writes GGUF files of any Llama-family shape (llama, mistral, qwen2)
laid out exactly as llama.cpp's convert_hf_to_gguf.py lays them out, streaming tensor by tensor.

What it is and why: the GPU work needs files shaped like Llama-3.1-8B, Mistral-7B and
Qwen2.5-7B (16 GB of weights each in bf16) without downloading them, and the forward-pass tests
need tiny models whose weights come from transformers. Both share the GGUF writer here:
metadata keys, tensor names, dimension order, the Q/K row permutation of llama/mistral and the
llama3 `rope_freqs.weight` tensor are those of llama.cpp's converter (conversion/base.py,
conversion/llama.py: LlamaModel.permute, generate_extra_tensors). Random files never hold more
than one chunk of one tensor in memory: every tensor's info is declared first
(GGUFWriter.add_tensor_info), then its data is generated and written chunk by chunk of rows.
The values are random (seeded, N(0, 1/cols) for matrices, N(0, 1) for the embedding, 1 +- small
noise for norms) and only make sense for speed and memory work; the tokenizer section is a
made-up byte-level BPE vocabulary of the right size (or copied from a real GGUF with
--tokenizer-from) that our loader accepts.

How to run (needs numpy and the `gguf` package; no torch):

    python3 tools/make_random_gguf.py --preset llama31-8b --type bf16 --out /data/llama31-8b.bf16.gguf
    python3 tools/make_random_gguf.py --preset mistral-7b --type f16  --out mistral-7b.f16.gguf
    python3 tools/make_random_gguf.py --preset qwen25-7b  --type bf16 --out qwen25-7b.bf16.gguf
    python3 tools/make_random_gguf.py --preset tiny-llama --type q8_0 --out /tmp/t.gguf   # small test
    python3 tools/make_random_gguf.py --list                                               # presets

A preset can be changed field by field: --set n_layers=2 --set n_vocab=1000. Storage types:
f32, f16, bf16 (2-D weights; 1-D norms, biases and rope_freqs stay f32 as llama.cpp writes
them) and q8_0 (row length must be a multiple of 32).

Python API (used by tools/make_tiny_models.py):
    synthetic_tokenizer(n_vocab, pre)                  -> dict of tokenizer.* metadata
    llama3_rope_factors(head_dim, rope_theta, scaling) -> np.float32 [head_dim/2] (converter formula)
    gguf_metadata(shape, file_type)                    -> list of (key, value, GGUFValueType)
    tensor_plan(shape)                                 -> [(gguf_name, numpy_shape, kind)]
    write_gguf(path, shape, tensors, storage, tokenizer, log)  streaming writer
    write_random_gguf(path, shape, storage, seed, tokenizer)
A `shape` is a dict: arch, n_layers, dim, ffn_dim, n_heads, n_kv_heads, head_dim (None =
dim / n_heads), n_vocab, n_ctx, rope_theta, rms_eps, rope_scaling (None or a dict like
transformers' rope_parameters with rope_type "llama3"), qkv_bias, tied, name.
"""

import argparse
import math
import os
import sys
import time

import numpy as np

try:
    import gguf
except ImportError:  # fall back to the copy vendored with llama.cpp, when present
    _VENDORED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party",
                             "llama-cpp-python-src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp",
                             "gguf-py")
    sys.path.insert(0, _VENDORED)
    import gguf

from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

STORAGE = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType

LLAMA3_SCALING_31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS = {
    # meta-llama/Llama-3.1-8B-Instruct config.json
    "llama31-8b": dict(name="Llama-3.1-8B-shaped (random)", arch="llama", n_layers=32, dim=4096,
                       ffn_dim=14336, n_heads=32, n_kv_heads=8, head_dim=128, n_vocab=128256,
                       n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5,
                       rope_scaling=LLAMA3_SCALING_31, qkv_bias=False, tied=False,
                       pre="llama-bpe"),
    # mistralai/Mistral-7B-Instruct-v0.3 config.json (converted as arch "llama", like
    # convert_hf_to_gguf.py does for MistralForCausalLM)
    "mistral-7b": dict(name="Mistral-7B-v0.3-shaped (random)", arch="llama", n_layers=32, dim=4096,
                       ffn_dim=14336, n_heads=32, n_kv_heads=8, head_dim=128, n_vocab=32768,
                       n_ctx=32768, rope_theta=1000000.0, rms_eps=1e-5, rope_scaling=None,
                       qkv_bias=False, tied=False, pre="default"),
    # Qwen/Qwen2.5-7B-Instruct config.json
    "qwen25-7b": dict(name="Qwen2.5-7B-shaped (random)", arch="qwen2", n_layers=28, dim=3584,
                      ffn_dim=18944, n_heads=28, n_kv_heads=4, head_dim=None, n_vocab=152064,
                      n_ctx=32768, rope_theta=1000000.0, rms_eps=1e-6, rope_scaling=None,
                      qkv_bias=True, tied=False, pre="qwen2"),
    # for testing this script
    "tiny-llama": dict(name="tiny llama (random)", arch="llama", n_layers=2, dim=128, ffn_dim=256,
                       n_heads=4, n_kv_heads=2, head_dim=None, n_vocab=1000, n_ctx=2048,
                       rope_theta=500000.0, rms_eps=1e-5,
                       rope_scaling=dict(LLAMA3_SCALING_31, original_max_position_embeddings=64),
                       qkv_bias=False, tied=False, pre="llama-bpe"),
    "tiny-qwen2": dict(name="tiny qwen2 (random)", arch="qwen2", n_layers=2, dim=128, ffn_dim=256,
                       n_heads=4, n_kv_heads=2, head_dim=None, n_vocab=1000, n_ctx=2048,
                       rope_theta=1000000.0, rms_eps=1e-6, rope_scaling=None, qkv_bias=True,
                       tied=True, pre="qwen2"),
}


# ---------------------------------------------------------------------------- tokenizer

def _gpt2_byte_chars():
    """GPT-2's bytes_to_unicode(): the printable stand-in of each byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def synthetic_tokenizer(n_vocab, pre="default"):
    """A byte-level BPE vocabulary of exactly n_vocab tokens: the 256 byte tokens, then tokens
    built by merges over 'Ġ' (space) and a-z (every merge "x y" has x, y and xy in the vocab),
    and a last control token <|endoftext|> used as BOS/EOS."""
    if n_vocab < 258:
        raise ValueError("n_vocab must be at least 258")
    byte_chars = _gpt2_byte_chars()
    tokens = list(byte_chars)
    alphabet = [byte_chars[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges = []
    want = n_vocab - 1
    level = alphabet  # tokens of the previous length
    while len(tokens) < want:
        nxt = []
        for x in level:
            for y in alphabet:
                if len(tokens) >= want:
                    break
                tokens.append(x + y)
                merges.append(x + " " + y)
                nxt.append(x + y)
        level = nxt
    tokens.append("<|endoftext|>")
    types = [1] * (n_vocab - 1) + [3]  # normal, control
    eos = n_vocab - 1
    return {
        "tokenizer.ggml.model": ("gpt2", VT.STRING),
        "tokenizer.ggml.pre": (pre, VT.STRING),
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY),
        "tokenizer.ggml.token_type": (types, VT.ARRAY),
        "tokenizer.ggml.merges": (merges, VT.ARRAY),
        "tokenizer.ggml.bos_token_id": (eos, VT.UINT32),
        "tokenizer.ggml.eos_token_id": (eos, VT.UINT32),
        "tokenizer.ggml.add_bos_token": (False, VT.BOOL),
    }


def tokenizer_from_gguf(path):
    """Copies the tokenizer.* metadata of an existing GGUF (e.g. a real model of the same
    family, to get its exact vocabulary)."""
    r = gguf.GGUFReader(path)
    out = {}
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == VT.ARRAY:
            out[key] = (list(f.contents()), VT.ARRAY)
        else:
            out[key] = (f.contents(), vtype)
    return out


# ---------------------------------------------------------------------------- metadata

def head_dim_of(shape):
    return shape.get("head_dim") or shape["dim"] // shape["n_heads"]


def llama3_rope_factors(head_dim, rope_theta, scaling):
    """rope_freqs.weight as convert_hf_to_gguf.py computes it (LlamaModel.generate_extra_tensors):
    per-pair divisors of the inverse frequencies, f32 [head_dim / 2]. The arithmetic follows the
    converter step by step in float32 (there `freq` is a torch float32 scalar)."""
    base = np.float32(rope_theta)
    dim = head_dim
    freqs = np.float32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor = scaling.get("factor", 8.0)
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (np.float32(old_context_len) / wavelen - np.float32(low_freq_factor)) / \
                np.float32(high_freq_factor - low_freq_factor)
            out.append(np.float32(1) / ((np.float32(1) - smooth) / np.float32(factor) + smooth))
    return np.asarray(out, dtype=np.float32)


def gguf_metadata(shape, file_type):
    """The <arch>.* and general.* keys convert_hf_to_gguf.py writes for this family."""
    a = shape["arch"]
    hd = head_dim_of(shape)
    kv = [
        ("general.name", shape.get("name", "random"), VT.STRING),
        ("general.file_type", file_type, VT.UINT32),
        ("general.quantization_version", 2, VT.UINT32),
        (f"{a}.block_count", shape["n_layers"], VT.UINT32),
        (f"{a}.context_length", shape["n_ctx"], VT.UINT32),
        (f"{a}.embedding_length", shape["dim"], VT.UINT32),
        (f"{a}.feed_forward_length", shape["ffn_dim"], VT.UINT32),
        (f"{a}.attention.head_count", shape["n_heads"], VT.UINT32),
        (f"{a}.attention.head_count_kv", shape["n_kv_heads"], VT.UINT32),
        (f"{a}.rope.freq_base", float(shape["rope_theta"]), VT.FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", float(shape["rms_eps"]), VT.FLOAT32),
    ]
    if shape.get("head_dim"):  # the converter writes these when config.json has head_dim
        kv += [(f"{a}.attention.key_length", hd, VT.UINT32),
               (f"{a}.attention.value_length", hd, VT.UINT32)]
    if a in ("llama", "mistral"):  # LlamaModel.set_gguf_parameters
        kv += [(f"{a}.vocab_size", shape["n_vocab"], VT.UINT32),
               (f"{a}.rope.dimension_count", hd, VT.UINT32)]
    sc = shape.get("rope_scaling")
    if sc and sc.get("rope_type") == "linear":
        kv += [(f"{a}.rope.scaling.type", "linear", VT.STRING),
               (f"{a}.rope.scaling.factor", float(sc["factor"]), VT.FLOAT32)]
    # llama3 scaling writes no key: it travels as the rope_freqs.weight tensor.
    return kv


def tensor_plan(shape):
    """[(gguf name, numpy shape (rows, cols) or (n,), kind)] in the converter's order: the
    generated rope_freqs first, then the checkpoint's tensors (embedding, layers, norm, head).
    kind is one of emb, norm, bias, matrix, rope_freqs."""
    hd = head_dim_of(shape)
    d, f = shape["dim"], shape["ffn_dim"]
    q, kvd = shape["n_heads"] * hd, shape["n_kv_heads"] * hd
    plan = []
    sc = shape.get("rope_scaling")
    if sc and sc.get("rope_type") == "llama3":
        plan.append(("rope_freqs.weight", (hd // 2,), "rope_freqs"))
    plan.append(("token_embd.weight", (shape["n_vocab"], d), "emb"))
    for i in range(shape["n_layers"]):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (d,), "norm"))
        plan.append((b + "attn_q.weight", (q, d), "matrix"))
        if shape.get("qkv_bias"):
            plan.append((b + "attn_q.bias", (q,), "bias"))
        plan.append((b + "attn_k.weight", (kvd, d), "matrix"))
        if shape.get("qkv_bias"):
            plan.append((b + "attn_k.bias", (kvd,), "bias"))
        plan.append((b + "attn_v.weight", (kvd, d), "matrix"))
        if shape.get("qkv_bias"):
            plan.append((b + "attn_v.bias", (kvd,), "bias"))
        plan.append((b + "attn_output.weight", (d, q), "matrix"))
        plan.append((b + "ffn_norm.weight", (d,), "norm"))
        plan.append((b + "ffn_gate.weight", (f, d), "matrix"))
        plan.append((b + "ffn_up.weight", (f, d), "matrix"))
        plan.append((b + "ffn_down.weight", (d, f), "matrix"))
    plan.append(("output_norm.weight", (d,), "norm"))
    if not shape.get("tied"):
        plan.append(("output.weight", (shape["n_vocab"], d), "matrix"))
    return plan


# ---------------------------------------------------------------------------- Q/K permutation

def permute_rows(w, n_head):
    """LlamaModel.permute of convert_hf_to_gguf.py (n_head = n_kv_head for K): inside each head
    the HF rows [x0..x_{d/2-1}, y0..y_{d/2-1}] (rotate_half halves) become interleaved
    [x0, y0, x1, y1, ...], so llama.cpp's adjacent-pair RoPE rotates the same pairs.
    Works for weights [rows, cols] and biases [rows]."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_rows(w, n_head):
    """Inverse of permute_rows (what transformers' GGUF loader applies)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ---------------------------------------------------------------------------- writer

def _storage_type(kind, ndim, storage):
    # llama.cpp keeps 1-D tensors (norms, biases, rope_freqs) in f32 whatever the file type.
    return QT.F32 if ndim == 1 or kind == "rope_freqs" else STORAGE[storage]


def _nbytes(np_shape, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(np_shape[:-1])) if len(np_shape) > 1 else 1
    assert np_shape[-1] % block == 0, f"row length {np_shape[-1]} is not a multiple of {block}"
    return rows * (np_shape[-1] // block) * size


def encode_rows(x, qtype):
    """f32 rows -> the bytes GGUF stores for them."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == QT.F32:
        return x
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype == QT.BF16:  # round to nearest even, as gguf.quants does
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return gguf.quants.quantize(x, qtype)


def decode_rows(raw, qtype, np_shape):
    """Bytes as stored -> f32 with the logical shape (what a reader sees)."""
    if qtype == QT.F32:
        return np.asarray(raw, dtype=np.float32).reshape(np_shape)
    if qtype == QT.F16:
        return np.asarray(raw, dtype=np.float16).astype(np.float32).reshape(np_shape)
    if qtype == QT.BF16:
        return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(np_shape)
    return gguf.quants.dequantize(np.asarray(raw).view(np.uint8), qtype).reshape(np_shape)


def write_gguf(path, shape, tensors, storage="f32", tokenizer=None, chunk_bytes=64 << 20, log=None):
    """Writes a GGUF file with this shape's metadata, `tokenizer` (dict key -> (value, type);
    default synthetic_tokenizer) and `tensors`: a list of (name, numpy_shape, kind, produce)
    where produce(r0, r1) returns f32 rows [r0, r1) (1-D tensors: r0 = 0, r1 = 1, the whole
    vector). Tensor infos are declared first; then each tensor is produced, encoded and written
    a chunk of rows at a time, so at most one chunk is in memory."""
    t0 = time.time()
    arch = shape["arch"]
    w = gguf.GGUFWriter(path, arch)
    for key, val, vtype in gguf_metadata(shape, FILE_TYPE[storage]):
        w.add_key_value(key, val, vtype, sub_type=None)
    tok = tokenizer if tokenizer is not None else synthetic_tokenizer(shape["n_vocab"], shape.get("pre", "default"))
    for key, (val, vtype) in tok.items():
        if vtype == VT.ARRAY:
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, vtype)
    planned = []
    for name, np_shape, kind, produce in tensors:
        qtype = _storage_type(kind, len(np_shape), storage)
        nbytes = _nbytes(np_shape, qtype)
        w.add_tensor_info(name, np_shape, np.float32, nbytes, raw_dtype=qtype)
        planned.append((name, np_shape, qtype, nbytes, produce))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    total = 0
    for name, np_shape, qtype, nbytes, produce in planned:
        # The same steps as GGUFWriter.write_tensor_data, but for a tensor arriving in chunks.
        ti_name = next(iter(w.tensors[0]))
        assert ti_name == name, (ti_name, name)
        ti = w.tensors[0].pop(ti_name)
        assert ti.nbytes == nbytes
        w.write_padding(fout, fout.tell())
        rows = np_shape[0] if len(np_shape) > 1 else 1
        row_bytes = max(1, nbytes // rows)
        step = max(1, chunk_bytes // max(row_bytes, 4 * (np_shape[-1])))
        written = 0
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            x = produce(r0, r1)
            enc = encode_rows(x, qtype)
            enc.tofile(fout)
            written += enc.nbytes
        assert written == nbytes, (name, written, nbytes)
        w.write_padding(fout, nbytes)
        total += nbytes
        if log:
            log(f"  {name:28s} {str(np_shape):18s} {qtype.name:5s} {time.time() - t0:7.1f} s")
    w.state = gguf.gguf_writer.WriterState.WEIGHTS
    w.close()
    return total


def write_random_gguf(path, shape, storage="bf16", seed=0, tokenizer=None, log=None):
    """A random-weight model of `shape` (see the module comment), streamed to `path`."""
    hd = head_dim_of(shape)
    tensors = []
    for idx, (name, np_shape, kind) in enumerate(tensor_plan(shape)):
        def produce(r0, r1, idx=idx, np_shape=np_shape, kind=kind):
            cols = np_shape[-1]
            # A fresh generator per (tensor, chunk start): values do not depend on what else
            # is in the file, only on the seed, the tensor's position and the chunk size.
            rng = np.random.default_rng([seed, idx, r0])
            if kind == "rope_freqs":
                return llama3_rope_factors(hd, shape["rope_theta"], shape["rope_scaling"])
            if kind == "norm":
                return 1.0 + 0.1 * rng.standard_normal(cols, dtype=np.float32)
            if kind == "bias":
                return 0.1 * rng.standard_normal(cols, dtype=np.float32)
            x = rng.standard_normal((r1 - r0, cols), dtype=np.float32)
            if kind == "matrix":
                x *= np.float32(1.0 / math.sqrt(cols))
            return x
        tensors.append((name, np_shape, kind, produce))
    return write_gguf(path, shape, tensors, storage, tokenizer, log=log)


def _parse_set(shape, items):
    for it in items:
        k, _, v = it.partition("=")
        if k not in shape:
            raise SystemExit(f"--set: unknown field {k!r} (fields: {', '.join(shape)})")
        old = shape[k]
        if v.lower() in ("none", "null"):
            shape[k] = None
        elif isinstance(old, bool):
            shape[k] = v.lower() in ("1", "true", "yes")
        elif isinstance(old, int):
            shape[k] = int(v)
        elif isinstance(old, float):
            shape[k] = float(v)
        else:
            shape[k] = v
    return shape


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny-llama")
    ap.add_argument("--type", choices=sorted(STORAGE), default="bf16")
    ap.add_argument("--out", help="output .gguf path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a preset field, e.g. n_layers=2")
    ap.add_argument("--tokenizer-from", help="copy tokenizer.* metadata from this GGUF")
    ap.add_argument("--list", action="store_true", help="print the presets and exit")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    if a.list:
        for k, v in PRESETS.items():
            print(k, v)
        return
    if not a.out:
        ap.error("--out is required")
    shape = _parse_set(dict(PRESETS[a.preset]), a.set)
    tok = tokenizer_from_gguf(a.tokenizer_from) if a.tokenizer_from else None
    if tok is not None and len(tok["tokenizer.ggml.tokens"][0]) != shape["n_vocab"]:
        raise SystemExit("--tokenizer-from: vocabulary size differs from n_vocab")
    n = write_random_gguf(a.out, shape, a.type, a.seed, tok, log=None if a.quiet else print)
    print(f"wrote {a.out}: {n / 1e9:.2f} GB of tensor data")


if __name__ == "__main__":
    main()

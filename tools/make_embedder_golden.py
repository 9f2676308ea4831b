#!/usr/bin/env python3
"""make_embedder_golden.py: reference token ids and embeddings for tests/memory/test_embedder.c.

The reference is sentence-transformers running the model folder fetched by scripts/fetch_embedder.sh
(all-MiniLM-L6-v2), offline, on CPU, one text per batch (so no padding is involved).

Reads  tests/golden/embed/sentences.json   the committed inputs (~50 texts: LoCoMo-like facts and
                                            questions, dialogue turns, and odd inputs)
Writes tests/golden/embed/embeddings.json  per sentence: text, the token ids sentence-transformers fed
                                            the model (truncated to max_seq_length), the embedding
       tests/golden/embed/tokens.json      a wider tokenizer corpus (random mixes of scripts, marks,
                                            controls, emoji; long words; truncation; invalid UTF-8), each
                                            as UTF-8 bytes in hex, with the HF tokenizer's ids at
                                            max_seq_length. Invalid UTF-8 is decoded with
                                            errors="replace" first, the documented C behaviour.

Usage: HF_HUB_OFFLINE=1 python3 tools/make_embedder_golden.py [--model models/all-MiniLM-L6-v2]
"""
import argparse
import hashlib
import json
import os
import random
import sys


def stable_class(c):
    """False for a character added after Unicode 3.2 whose class matters to BERT's normaliser
    (mark, punctuation, other, separator). HF `tokenizers` classifies those with the old tables
    of the `unicode_categories` crate, utf8proc with Unicode 15; the C header documents the
    difference (about 570 code points, all added in Unicode 9.0 or later), and it is kept out of
    the random corpus so that the golden ids test the shared behaviour."""
    import unicodedata
    if unicodedata.ucd_3_2_0.category(c) != "Cn":
        return True
    return unicodedata.category(c)[0] not in "MPCZ"


def tokenizer_corpus():
    rnd = random.Random(20240507)
    ranges = [(0x20, 0x7F, 6), (0xA0, 0x250, 1), (0x300, 0x370, 1), (0x370, 0x530, 1),
              (0x600, 0x700, 1), (0x900, 0x980, 1), (0x1E00, 0x1F00, 1), (0x2000, 0x2070, 1),
              (0x20A0, 0x20C0, 1), (0x2100, 0x2200, 1), (0x3000, 0x3100, 1), (0x3400, 0x3440, 1),
              (0x4E00, 0x4F00, 1), (0xAC00, 0xAC80, 1), (0xF900, 0xF940, 1), (0xFF00, 0xFF70, 1),
              (0x1F300, 0x1F700, 1), (0x20000, 0x20040, 1)]
    pool = []
    for lo, hi, w in ranges:
        pool += [chr(c) for c in range(lo, hi) if stable_class(chr(c))] * w
    pool += [chr(c) for c in (0x0, 0x1, 0x7, 0x9, 0xA, 0xD, 0x1F, 0x7F, 0x85, 0xAD, 0x200B, 0x200D,
                              0x2028, 0xFEFF, 0xE000, 0xFFFD, 0x130, 0x1C5)]
    items = []
    for _ in range(400):
        n = rnd.randint(0, 40)
        items.append("".join(rnd.choice(pool) for _ in range(n)).encode())
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in (99, 100, 101, 150):
        items.append(("".join(rnd.choice(letters) for _ in range(n))).encode())
        items.append(("é" * n).encode())
    items.append(("Ä" * 100 + " ok").encode())
    items.append(" ".join(["antidisestablishmentarianism"] * 120).encode())  # truncation mid-word
    items.append(("word " * 300).encode())
    items.append(("[SEP]" * 300).encode())
    items.append("a[CLS]b[SEP]c[MASK]d[PAD]e[UNK]f[unk][Sep][[SEP]]".encode())
    items.append(b"")
    items.append(b"\x00\x00")
    # Invalid UTF-8: stray continuation, truncated sequences, overlong, surrogate, > U+10FFFF.
    items += [b"abc\x80def", b"caf\xc3", b"\xe2\x82 euro", b"\xc0\xafslash", b"\xed\xa0\x80x",
              b"\xf4\x90\x80\x80y", b"ok \xff\xfe done", b"\xf0\x9f\x98 smile"]
    return items


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(root, "models", "all-MiniLM-L6-v2"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", "embed"))
    args = ap.parse_args()

    import numpy as np
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(2)
    model = SentenceTransformer(args.model, device="cpu")
    tok = model.tokenizer
    max_len = model.max_seq_length
    with open(os.path.join(args.out, "sentences.json")) as f:
        sentences = json.load(f)
    with open(os.path.join(args.model, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()

    items = []
    for text in sentences:
        feats = model.preprocess([text])
        ids = [int(x) for x in feats["input_ids"][0][feats["attention_mask"][0] == 1]]
        emb = model.encode([text], batch_size=1, normalize_embeddings=True, convert_to_numpy=True)[0]
        items.append({"text": text, "ids": ids, "embedding": [float("%.9g" % v) for v in emb.astype(np.float32)]})
    meta = {
        "generator": "tools/make_embedder_golden.py",
        "model": os.path.basename(os.path.normpath(args.model)),
        "weights_sha256": sha,
        "versions": {"sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "torch": torch.__version__},
        "max_seq_length": max_len,
        "dim": int(len(items[0]["embedding"])),
    }
    with open(os.path.join(args.out, "embeddings.json"), "w") as f:
        json.dump(dict(meta, items=items), f, ensure_ascii=True, indent=0)

    toks = []
    for raw in tokenizer_corpus():
        text = raw.decode("utf-8", errors="replace")
        ids = tok(text, truncation=True, max_length=max_len)["input_ids"]
        toks.append({"hex": raw.hex(), "ids": [int(x) for x in ids]})
    with open(os.path.join(args.out, "tokens.json"), "w") as f:
        json.dump(dict(meta, items=toks), f, ensure_ascii=True, indent=0)
    print("wrote %d embeddings and %d tokenizer cases to %s" % (len(items), len(toks), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

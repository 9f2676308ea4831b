#!/usr/bin/env python3
"""make_nll_golden.py: reference values for the teacher-forced scoring of `inferscale eval locomo
--nll` (src/eval/teacher.c), written to tests/golden/nll.json for tests/eval/test_nll.c.

What is checked: given a context and an answer, the mean over the answer's tokens of
-log softmax(logits)[token], where each answer token is predicted by the position before it (the
last context position predicts the first answer token). The reference is Hugging Face
transformers running the same GGUF on the CPU in float32, as in tools/make_golden_logits.py; the
log-softmax is taken here in float64.

Sources of the logits (same quantity either way):
  --source transformers    run transformers on the default model (needs torch, transformers,
                           gguf, accelerate; ~1 min on 2 cores)
  --source golden-logits   (default) the every-position logits that make_golden_logits.py wrote
                           from transformers for its "short" prompt (tests/golden/logits/
                           short.all.f32), for machines without torch; only numpy is needed

The sequence is the "short" prompt of tests/golden/logits/manifest.json, split after
--split tokens into context and answer.

    python3 tools/make_nll_golden.py [--source golden-logits|transformers] [--split 5]
"""

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGITS_DIR = os.path.join(ROOT, "tests", "golden", "logits")


def scores(all_logits, tokens, split):
    """Per-token NLL of tokens[split:] from the every-position logits (T x V)."""
    x = all_logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    nll = [-logp[j - 1, tokens[j]] for j in range(split, len(tokens))]
    first = logp[split - 1]
    return nll, int(first.argmax()), float(np.exp(first).max())


def transformers_logits(model_path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                 gguf_file=os.path.basename(model_path),
                                                 torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return out.logits[0].numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["golden-logits", "transformers"], default="golden-logits")
    ap.add_argument("--split", type=int, default=5, help="context tokens; the rest is the answer")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "golden", "nll.json"))
    a = ap.parse_args()

    with open(os.path.join(LOGITS_DIR, "manifest.json")) as f:
        man = json.load(f)
    short = next(p for p in man["prompts"] if p["name"] == "short")
    tokens = short["tokens"]
    if not 1 <= a.split < len(tokens):
        raise SystemExit(f"--split must be in 1..{len(tokens) - 1}")
    if a.source == "transformers":
        logits = transformers_logits(a.model, tokens)
        generated_by = "transformers " + __import__("transformers").__version__ + " (CPU, float32, eager)"
    else:
        raw = np.fromfile(os.path.join(LOGITS_DIR, short["all_logits"]), dtype="<f4")
        logits = raw.reshape(len(tokens), man["vocab_size"])
        generated_by = "transformers logits of tools/make_golden_logits.py (" + short["all_logits"] + ", " + \
            man["generated_by"] + ")"
    nll, top1, p_top1 = scores(logits, tokens, a.split)
    out = {
        "generated_by": "tools/make_nll_golden.py --source " + a.source,
        "logits_from": generated_by,
        "model_sha256": man["model_sha256"],
        "context": tokens[:a.split],
        "answer": tokens[a.split:],
        "token_nll": nll,
        "nll_mean": float(np.mean(nll)),
        "first_top1": top1,
        "first_top1_prob": p_top1,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}: mean NLL {out['nll_mean']:.6f} over {len(nll)} answer tokens")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Predicts, on the CPU, how far the CUDA backend's logits land from f32.

The CUDA backend keeps weight matrices in bf16 and rounds each matmul's
input rows either to bf16 (CUDA_MATMUL_BF16) or to hi + lo bf16
(CUDA_MATMUL_BF16X2); everything else is f32. This script runs the same
GGUF through transformers (f32, on the CPU) three ways -- f32, and each
rounding simulated with forward pre-hooks on every nn.Linear -- and prints
the relative L2 error of the logits and the share of positions whose argmax
is unchanged: the numbers tests/cuda/test_cuda_model.c then measures on the
GPU (docs/notes/cuda-diary.md records both).

Usage: cuda/predict_precision.py MODEL.gguf [--text FILE | --random N]
"""
import argparse, math, os, random
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def split(a):
    hi = a.bfloat16().float()
    return hi + (a - hi).bfloat16().float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--text", help="text file, tokenised (with BOS) and repeated to 320 tokens")
    ap.add_argument("--random", type=int, default=0, help="this many random tokens instead")
    a = ap.parse_args()
    d, f = os.path.split(os.path.abspath(a.gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    if a.random:
        random.seed(7)
        ids = [random.randrange(model.config.vocab_size) for _ in range(a.random)]
    else:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        ids = tok(open(a.text).read())["input_ids"]
        if tok.bos_token_id is not None and ids[0] != tok.bos_token_id:
            ids = [tok.bos_token_id] + ids
        ids = [ids[i % len(ids)] for i in range(320)]
    x = torch.tensor([ids])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(x).logits[0].double()
    top2 = ref.topk(2, dim=1).values
    print(f"{f}: {len(ids)} positions, smallest top-2 margin {(top2[:, 0] - top2[:, 1]).min():.2e}")
    for name, hook in (("bf16", lambda m, i: (i[0].bfloat16().float(),)),
                       ("bf16x2", lambda m, i: (split(i[0]),))):
        model.load_state_dict(state)
        hooks = []
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.data = mod.weight.data.bfloat16().float()
                hooks.append(mod.register_forward_pre_hook(hook))
        emb = model.get_input_embeddings()
        emb.weight.data = emb.weight.data.bfloat16().float()
        with torch.no_grad():
            out = model(x).logits[0].double()
        for h in hooks:
            h.remove()
        rel = math.sqrt(((out - ref) ** 2).sum().item() / (ref ** 2).sum().item())
        per = (((out - ref) ** 2).sum(1) / (ref ** 2).sum(1)).sqrt().max().item()
        same = (out.argmax(1) == ref.argmax(1)).double().mean().item()
        print(f"  {name:7s} rel err {rel:.3e}, worst position {per:.3e}, same argmax {100 * same:.2f}%")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""hf_reference.py: the outside reference for bench/bench_gpu.c: Hugging Face transformers doing
the prompt-mode prefill on the same shape, on the same GPU, in the same device call.

A LlamaForCausalLM built from a Llama-3.1-8B config (random bf16 weights, made on the GPU; speed
does not depend on the values), attention through PyTorch SDPA. Same layout as bench_gpu:
a 60-token serving prefix whose KV cache is computed once; per request the k*25 fact tokens +
30 query tokens are prefilled after it, logits of the last position only, argmax on the host.
The prefix cache is rebuilt before each timed run, outside the timing (bench_gpu's fork of the
cached prefix is inside its timing, and costs well under a millisecond). Medians of --reps runs
after one warm-up. Then prompt-mode throughput: U users in one batch, each prefix + facts +
query (the prefix recomputed per user, 4% more tokens than bench_gpu prefills), requests/s.

    python3 bench/hf_reference.py [--k 5,10,20,50,100] [--users 1,10,50] [--reps 7] [--csv out.csv]
"""

import argparse
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def make_config():
    base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:  # rope_parameters carries rope_theta and the scaling in v5
        try:
            return LlamaConfig(**base, rope_parameters=dict(SCALING, rope_theta=500000.0))
        except TypeError:
            pass
    return LlamaConfig(**base, rope_theta=500000.0, rope_scaling=dict(SCALING))


def forward(model, ids, cache=None, use_cache=True):
    kw = dict(use_cache=use_cache)
    if cache is not None:
        kw["past_key_values"] = cache
    try:
        return model(ids, logits_to_keep=1, **kw)
    except TypeError:  # older transformers
        return model(ids, num_logits_to_keep=1, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="5,10,20,50,100")
    ap.add_argument("--users", default="1,10,50")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--csv")
    a = ap.parse_args()
    ks = [int(x) for x in a.k.split(",") if x]
    users = [int(x) for x in a.users.split(",") if x]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.time()
    cfg = make_config()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}; model built in {time.time() - t0:.1f} s, "
          f"attention: {model.config._attn_implementation}, "
          f"params {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B ({next(model.parameters()).dtype})")
    P, F, Q, V = 60, 25, 30, cfg.vocab_size
    g = torch.Generator(device=dev).manual_seed(1)
    prefix = torch.randint(0, V - 1, (1, P), device=dev, generator=g)
    kmax = max(ks)
    suffix_all = torch.randint(0, V - 1, (1, kmax * F + Q), device=dev, generator=g)
    rows = []
    print("\n### Hugging Face transformers, prompt mode (SDPA, bf16), medians of %d runs, ms\n" % a.reps)
    print("| k | prompt tokens | prompt TTFT |")
    print("|---:|---:|---:|")
    with torch.inference_mode():
        for k in ks:
            suffix = suffix_all[:, (kmax - k) * F:]
            times = []
            for r in range(a.reps + 1):
                cache = forward(model, prefix).past_key_values
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = forward(model, suffix, cache=cache)
                int(out.logits[0, -1].argmax().item())
                dt = (time.perf_counter() - t) * 1e3
                if r > 0:
                    times.append(dt)
                del cache, out
            med = statistics.median(times)
            print(f"| {k} | {suffix.shape[1]} | {med:.2f} |", flush=True)
            rows.append(f"hf_ttft,{k},{suffix.shape[1]},{med:.4f}")
        K = 50
        print(f"\n### Hugging Face transformers, prompt-mode throughput at k = {K}\n")
        print("| users | req/s | batch ms |")
        print("|---:|---:|---:|")
        for U in users:
            ids = torch.randint(0, V - 1, (U, P + K * F + Q), device=dev, generator=g)
            times = []
            for r in range(3 if U <= 10 else 2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = forward(model, ids, use_cache=False)
                out.logits[:, -1].argmax(-1).tolist()
                dt = (time.perf_counter() - t) * 1e3
                if r > 0 or U > 10:
                    times.append(dt)
                del out
            med = statistics.median(times)
            print(f"| {U} | {1e3 * U / med:.1f} | {med:.1f} |", flush=True)
            rows.append(f"hf_throughput,{K},{U},{med:.4f},{1e3 * U / med:.4f}")
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("# hf_ttft,k,prompt_tokens,ms\n# hf_throughput,k,users,batch_ms,rps\n")
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""make_tiny_models.py: tiny random-weight models of the architecture variants the default model
(SmolLM2: llama, tied head, no biases, no RoPE scaling) does not exercise, written as GGUF the way
llama.cpp's converter writes them, with reference logits from Hugging Face transformers.

What it is and why: the C forward pass (src/engine/, src/backend/cpu/) has code paths for qwen2
(q/k/v biases, NeoX RoPE on unpermuted Q/K), for Llama-3.1 frequency scaling (the
`rope_freqs.weight` divisors), for an untied output head and for head_dim != dim / n_heads
(Mistral-Nemo style, read from attention.key_length). Each model here is built with transformers
(seeded random init, float32, eager attention), converted to GGUF by tools/make_random_gguf.py
(the converter's metadata keys, tensor names, Q/K permutation for llama, none for qwen2,
rope_freqs from the converter's formula), and run by transformers on fixed token sequences;
tests/engine/test_tiny_models.c compares the C engine on the GGUF with these outputs.

How to run (CPU, ~1 min on 2 cores; torch, transformers 5.x (tested 5.24), gguf, numpy):

    python3 tools/make_tiny_models.py                  # writes tests/golden/tiny/
    python3 tools/make_tiny_models.py --out /tmp/tiny  # elsewhere
    python3 tools/make_tiny_models.py --check-llama-cpp  # + compare with llama.cpp (below)

Models (all GQA with 2 KV heads, untied output head, vocabulary of 320 made-up BPE tokens):
    qwen2_f32     Qwen2ForCausalLM, 3 layers, dim 64, 4 heads x 16, ffn 128, q/k/v biases, f32
    qwen2_q8_0    the same architecture (other seed) with 2-D weights stored as Q8_0
    llama31_f32   LlamaForCausalLM, rope_type llama3 (factor 8, low 1, high 4, original
                  context 64, theta 500000), 2 layers, dim 96, 4 heads x 24, ffn 128, f32
    mistral_f32   MistralForCausalLM (converted as arch "llama", as convert_hf_to_gguf.py does),
                  head_dim 32 with dim 64 and 4 heads (q width 128 != dim), theta 1e6, f32
The reference weights are exactly the GGUF's: for Q8_0 the transformers model is loaded with the
dequantised GGUF tensors (un-permuted), so the reference and the C code see the same numbers.

Output (tests/golden/tiny/):
    <model>.gguf        the model
    manifest.json       {"generated_by", "versions", "models": [{"name", "gguf", "arch",
                         "n_vocab", "config", "checks", "prompts": [{"name", "tokens",
                         "all_logits", "greedy", "greedy_margins"}]}]}
    <model>.<prompt>.f32  len(tokens) x n_vocab float32 little-endian, row-major: the logits
                        at every prompt position
greedy: 16 tokens chosen by argmax (lowest id on ties, as numpy does) after the prompt, each
from a full no-cache forward over prompt + tokens so far; greedy_margins are top1 - top2 of the
logits that chose each (the script refuses a model whose margins are below 1e-3 of the logit
range, where float rounding could legitimately flip a token).

Checks recorded in the manifest (the script fails if one does not hold):
  * the GGUF read back with gguf.GGUFReader gives exactly the tensors the reference uses
    (after undoing the permutation), and rope_freqs, when present, equals the factors implied by
    transformers' own llama3 inverse frequencies (ratio of plain to scaled, to 1e-6);
  * sensitivity: the same model with the feature turned off (llama3 scaling replaced by plain
    RoPE; for qwen2 the NeoX layout replaced by rotating adjacent pairs; for mistral the key
    dimensions of each head reversed) moves the logits by far more than the C test's tolerance
    (1e-3 of the range), so the test can fail;
  * with --check-llama-cpp (needs third_party/llama.cpp-build/bin, git-ignored): llama.cpp's own
    llama-simple, on a ~320-token prompt, generates the same greedy tokens as transformers from
    each f32 GGUF, which shows the files follow llama.cpp's conventions (Q/K permutation,
    rope_freqs as divisors, key_length). On the Q8_0 file the result is only recorded: llama.cpp
    quantises activations to 8 bits there, so it is not held to the f32 reference.
"""

import argparse
import importlib.metadata
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_random_gguf as mrg  # noqa: E402

from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "tests", "golden", "tiny")
N_VOCAB = 320
N_GREEDY = 16
TOL = 1e-3  # the C test's tolerance, relative to the logit range

MODELS = [
    dict(name="qwen2_f32", cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config, arch="qwen2", storage="f32",
         seed=1, pre="qwen2", lengths=[7, 200],
         cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  tie_word_embeddings=False, use_sliding_window=False)),
    dict(name="qwen2_q8_0", cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config, arch="qwen2", storage="q8_0",
         seed=2, pre="qwen2", lengths=[7, 200],
         cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  tie_word_embeddings=False, use_sliding_window=False)),
    dict(name="llama31_f32", cls=LlamaForCausalLM, cfg_cls=LlamaConfig, arch="llama", storage="f32",
         seed=3, pre="llama-bpe", lengths=[7, 200, 300],
         cfg=dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
                  tie_word_embeddings=False)),
    dict(name="mistral_f32", cls=MistralForCausalLM, cfg_cls=MistralConfig, arch="llama",
         storage="f32", seed=4, pre="default", lengths=[7, 200],
         cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  sliding_window=None, tie_word_embeddings=False)),
]

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<rest>
    assert parts[0] == "model" and parts[1] == "layers", hf
    return f"blk.{parts[2]}." + HF_TO_GGUF[".".join(parts[3:])]


def build_hf(spec):
    """The transformers model with a seeded random init. Scales are chosen so that every
    sub-layer matters: matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 +- 0.2,
    biases N(0, 0.5) (Qwen's real K biases are large)."""
    cfg = spec["cfg_cls"](vocab_size=N_VOCAB, bos_token_id=N_VOCAB - 1, eos_token_id=N_VOCAB - 1,
                          pad_token_id=None, **spec["cfg"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = spec["cls"](cfg).float().eval()
    g = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    assert model.config._attn_implementation == "eager"
    return model


def shape_of(spec, model):
    c = model.config
    hp = c.to_dict()
    rp = c.rope_parameters
    return dict(name=f"tiny {spec['name']} (random, tools/make_tiny_models.py)", arch=spec["arch"],
                n_layers=c.num_hidden_layers, dim=c.hidden_size, ffn_dim=c.intermediate_size,
                n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                head_dim=hp.get("head_dim"), n_vocab=c.vocab_size, n_ctx=c.max_position_embeddings,
                rope_theta=rp["rope_theta"], rms_eps=c.rms_norm_eps,
                rope_scaling=rp if rp.get("rope_type") not in (None, "default") else None,
                qkv_bias=spec["arch"] == "qwen2", tied=c.tie_word_embeddings, pre=spec["pre"])


def to_gguf_tensors(spec, model, shape):
    """{gguf name: (f32 array as the converter stores it, kind)}: Q/K rows permuted for llama."""
    permute = spec["arch"] in ("llama", "mistral")
    n_head, n_kv = shape["n_heads"], shape["n_kv_heads"]
    out = {}
    for hf, p in model.state_dict().items():
        if hf == "lm_head.weight" and shape["tied"]:
            continue
        x = p.detach().float().numpy().copy()
        if permute and (".q_proj." in hf):
            x = mrg.permute_rows(x, n_head)
        elif permute and (".k_proj." in hf):
            x = mrg.permute_rows(x, n_kv)
        out[gguf_name(hf)] = x
    return out


def load_into_hf(spec, model, tensors, shape):
    """Replaces the HF weights with the GGUF's values (dequantised, un-permuted)."""
    permute = spec["arch"] in ("llama", "mistral")
    sd = model.state_dict()
    with torch.no_grad():
        for hf, p in sd.items():
            if hf == "lm_head.weight" and shape["tied"]:
                continue
            x = tensors[gguf_name(hf)]
            if permute and ".q_proj." in hf:
                x = mrg.unpermute_rows(x, shape["n_heads"])
            elif permute and ".k_proj." in hf:
                x = mrg.unpermute_rows(x, shape["n_kv_heads"])
            p.copy_(torch.from_numpy(np.array(x, dtype=np.float32)))


def read_back(path):
    """Every tensor of the written GGUF, as f32 with numpy shape."""
    import gguf
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        np_shape = tuple(int(v) for v in reversed(t.shape.tolist()))  # GGUF lists ne[0] first
        out[t.name] = mrg.decode_rows(t.data, t.tensor_type, np_shape)
    return out


@torch.no_grad()
def logits_all(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def greedy(model, tokens, n):
    seq = list(tokens)
    toks, margins = [], []
    for _ in range(n):
        last = logits_all(model, seq)[-1]
        t = int(np.argmax(last))
        top2 = np.sort(last)[-2:]
        toks.append(t)
        margins.append(float(top2[1] - top2[0]))
        seq.append(t)
    return toks, margins


def rel_range(a, ref):
    """max over positions of max |a - ref| / range(ref)."""
    rng = ref.max(axis=-1) - ref.min(axis=-1)
    return float((np.abs(a - ref).max(axis=-1) / rng).max())


def hf_llama3_factors(model):
    """The divisors transformers' llama3 init applies: plain inv_freq / scaled inv_freq."""
    c = model.config
    hd = c.to_dict().get("head_dim") or c.hidden_size // c.num_attention_heads
    base = c.rope_parameters["rope_theta"]
    plain = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaled = model.model.rotary_emb.inv_freq.float()
    return (plain / scaled).numpy()


def sensitivity_model(spec, model):
    """A copy of the model with its distinguishing feature switched off, or None."""
    import copy
    if spec["name"].startswith("llama31"):
        cfg = copy.deepcopy(model.config)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
        m2 = spec["cls"](cfg).float().eval()
        m2.load_state_dict(model.state_dict())
        return m2, "llama3 scaling replaced by plain RoPE"
    if spec["arch"] == "qwen2":
        return neox_to_norm_equivalent(model), "rotate adjacent pairs instead of NeoX halves on the same weights"
    if spec["name"].startswith("mistral"):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for layer in m.model.layers:  # k rows of each head in reverse: breaks q.k pairing
                w = layer.self_attn.k_proj.weight
                hd = m.config.head_dim
                w.copy_(w.view(-1, hd, w.shape[1]).flip(1).reshape(w.shape))
        return m, "key dimensions of each head reversed (a wrong Q/K pairing)"
    return None, ""


def neox_to_norm_equivalent(model):
    """Qwen2 sensitivity: what the C code would compute with the wrong (adjacent-pair) layout on
    the stored weights. Rotating pairs (2i, 2i+1) of rows W equals rotating halves (i, i + d/2)
    of rows unpermute(W), so transformers (which rotates halves) runs the un-permuted Q/K."""
    import copy
    m = copy.deepcopy(model)
    c = m.config
    hd = c.hidden_size // c.num_attention_heads
    with torch.no_grad():
        for layer in m.model.layers:
            for proj, nh in ((layer.self_attn.q_proj, c.num_attention_heads),
                             (layer.self_attn.k_proj, c.num_key_value_heads)):
                # unpermute makes adjacent pairs of the stored rows the rotated halves
                proj.weight.copy_(torch.from_numpy(mrg.unpermute_rows(proj.weight.numpy(), nh)))
                proj.bias.copy_(torch.from_numpy(mrg.unpermute_rows(proj.bias.numpy(), nh)))
    assert hd % 2 == 0
    return m


LLAMA_CPP_BIN = os.path.join(ROOT, "third_party", "llama.cpp-build", "bin")


def llama_cpp_check(spec, model, path, text):
    """Independent check of the GGUF against llama.cpp itself: llama-tokenize gives the ids of
    `text`, llama-simple greedily generates 16 tokens (it stops at EOS), and transformers'
    greedy tokens, turned back into bytes, must be the same. Returns a dict for the manifest."""
    import subprocess
    tok = subprocess.run([os.path.join(LLAMA_CPP_BIN, "llama-tokenize"), "-m", path, "-p", text,
                          "--ids", "--log-disable"], capture_output=True, text=True, check=True)
    ids = json.loads(tok.stdout.strip().splitlines()[-1])
    run = subprocess.run([os.path.join(LLAMA_CPP_BIN, "llama-simple"), "-m", path, "-n",
                          str(N_GREEDY), text], capture_output=True, check=True)
    generated = run.stdout.split(text.encode(), 1)[1]
    toks, margins = greedy(model, ids, N_GREEDY)
    if N_VOCAB - 1 in toks:  # llama-simple stops at the end-of-generation token
        toks = toks[:toks.index(N_VOCAB - 1)]
    strs = mrg.synthetic_tokenizer(N_VOCAB)["tokenizer.ggml.tokens"][0]
    byte_of = {c: b for b, c in enumerate(mrg._gpt2_byte_chars())}
    ours = bytes(byte_of[ch] for t in toks for ch in strs[t])
    ok = generated[:len(ours)] == ours
    print(f"{spec['name']:12s} llama.cpp greedy on {len(ids)} prompt tokens: "
          f"{'same' if ok else 'DIFFERENT'} ({len(toks)} tokens, first margin {margins[0]:.3f})")
    # llama.cpp quantises activations to 8 bits for its Q8_0 dot products, so on a Q8_0 file
    # it is further from the f32 reference than float rounding: record, do not insist.
    assert ok or spec["storage"] != "f32", (generated, ours)
    return {"prompt_tokens": len(ids), "greedy_tokens_compared": len(toks), "same": ok,
            "first_margin": margins[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check-llama-cpp", action="store_true",
                    help="also compare greedy tokens with llama.cpp's llama-simple (built under "
                         "third_party/llama.cpp-build/bin)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    manifest = {
        "generated_by": "tools/make_tiny_models.py",
        "versions": {p: importlib.metadata.version(p) for p in ("torch", "transformers", "gguf", "numpy")},
        "tolerance": TOL,
        "models": [],
    }
    for spec in MODELS:
        model = build_hf(spec)
        shape = shape_of(spec, model)
        tensors = to_gguf_tensors(spec, model, shape)
        checks = {}
        if shape["rope_scaling"]:
            rf = mrg.llama3_rope_factors(mrg.head_dim_of(shape), shape["rope_theta"], shape["rope_scaling"])
            hf_rf = hf_llama3_factors(model)
            err = float(np.abs(rf / hf_rf - 1).max())
            assert err < 1e-6, f"rope_freqs differ from transformers' llama3 factors: {err}"
            checks["rope_freqs_vs_transformers_rel_err"] = err
            checks["rope_freqs"] = rf.tolist()
            tensors["rope_freqs.weight"] = rf
        plan = mrg.tensor_plan(shape)
        assert sorted(n for n, _, _ in plan) == sorted(tensors), "tensor names differ from the plan"
        path = os.path.join(a.out, spec["name"] + ".gguf")
        mrg.write_gguf(path, shape,
                       [(n, s, k, (lambda r0, r1, n=n: tensors[n] if tensors[n].ndim == 1 else tensors[n][r0:r1]))
                        for n, s, k in plan],
                       storage=spec["storage"])
        # What the C code will see; the reference runs on exactly these values.
        stored = read_back(path)
        assert set(stored) == set(tensors)
        max_q = 0.0
        for n in tensors:
            assert stored[n].shape == tensors[n].shape, (n, stored[n].shape, tensors[n].shape)
            max_q = max(max_q, float(np.abs(stored[n] - tensors[n]).max()))
        if spec["storage"] == "f32":
            assert max_q == 0.0
        checks["max_abs_storage_error"] = max_q
        load_into_hf(spec, model, stored, shape)
        for n, p in model.state_dict().items():
            assert p.dtype == torch.float32, n

        rng = np.random.default_rng(1000 + spec["seed"])
        entry = {"name": spec["name"], "gguf": spec["name"] + ".gguf", "arch": spec["arch"],
                 "storage": spec["storage"], "n_vocab": N_VOCAB,
                 "config": {k: v for k, v in shape.items() if k != "name"}, "checks": checks,
                 "prompts": []}
        alt, alt_what = sensitivity_model(spec, model)
        sens = 0.0
        for L in spec["lengths"]:
            tokens = rng.integers(0, N_VOCAB - 1, size=L).tolist()
            ref = logits_all(model, tokens)
            gr, margins = greedy(model, tokens, N_GREEDY)
            rngs = ref.max(-1) - ref.min(-1)
            last_range = float(rngs.min())
            if min(margins) < TOL * last_range:
                raise SystemExit(f"{spec['name']}/{L}: greedy margin {min(margins):.2e} too small; "
                                 "change the seed")
            pname = f"len{L}"
            fname = f"{spec['name']}.{pname}.f32"
            ref.astype("<f4").tofile(os.path.join(a.out, fname))
            entry["prompts"].append({"name": pname, "tokens": tokens, "all_logits": fname,
                                     "greedy": gr, "greedy_margins": margins})
            if alt is not None:
                e = rel_range(logits_all(alt, tokens), ref)
                sens = max(sens, e)
            print(f"{spec['name']:12s} {pname:7s} range {rngs.mean():6.2f}  min greedy margin "
                  f"{min(margins):.3f}  greedy {gr}")
        if a.check_llama_cpp:
            text = " ".join(["the cat sat on a mat and then it was gone"] * 12)  # ~300 tokens
            checks["llama_cpp_greedy"] = llama_cpp_check(spec, model, path, text)
        if alt is not None:
            checks["sensitivity"] = {"what": alt_what, "max_rel_range_err": sens}
            print(f"{spec['name']:12s} sensitivity ({alt_what}): {sens:.3f}")
            assert sens > 20 * TOL, f"{spec['name']}: the feature does not change the logits enough"
        manifest["models"].append(entry)
        print(f"{spec['name']:12s} -> {path} ({os.path.getsize(path)} bytes)")
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

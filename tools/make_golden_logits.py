#!/usr/bin/env python3
"""make_golden_logits.py: reference run that produces the committed golden logits for the
forward-pass tests.

What it is and why: InferScale's C forward pass (src/engine/) must reproduce the model's logits.
The reference is Hugging Face transformers running the *same GGUF file* on CPU in float32 with
eager attention: transformers dequantises every Q4_1/Q8_0 tensor to f32 with the `gguf` package
and un-permutes the Q/K rows (see "RoPE layout" below), so the reference sees exactly the weights
our C code sees, and differs from it only by float rounding. The C test
(tests/engine/test_forward.c) reads the files written here and compares without any Python.

How to run (CPU only, ~2.5 min on 2 cores; needs torch, transformers 5.x (tested with 5.24), gguf,
numpy, and accelerate, which transformers requires to load a GGUF: `pip install accelerate`):

    python3 tools/make_golden_logits.py                      # default model, default out dir
    python3 tools/make_golden_logits.py --model models/X.gguf --out tests/golden/logits

Output (tests/golden/logits/):
    manifest.json   {"model_sha256", "generated_by", "versions", "checks", "prompts": [
                       {"name", "text", "tokens", "last_logits", "all_logits" (short only),
                        "greedy", "greedy_margins", ...}]}
    <name>.last.f32 vocab float32 little-endian: logits at the last prompt position
    short.all.f32   T x vocab float32 little-endian, row-major (position-major): every position
The greedy continuation is a manual argmax loop over the KV cache (EOS does not stop it; ties
go to the lowest token id, as numpy.argmax does). greedy_margins[i] is top1 - top2 of the logits
that chose greedy[i]: a C implementation may legitimately pick a different token where that
margin is below its logit error.

The script also checks, and records under "checks" in the manifest:
  * transformers' LlamaConfig matches the GGUF metadata (rope_theta 100000, rms eps 1e-5,
    tied embeddings, 30 layers, 9 heads, 3 KV heads, head_dim 64, vocab 49152);
  * every parameter is float32 and attention is "eager";
  * every HF weight equals our own dequantisation of the GGUF tensor (Q/K after un-permuting);
  * RoPE layout: an independent float64 numpy forward pass that uses the GGUF Q/K weights *as
    stored* with llama.cpp's NORM RoPE (rotating adjacent pairs x[2i], x[2i+1]) reproduces the HF
    logits, while the same weights with NeoX rotation (x[i], x[i+32]) do not. This is the layout
    the C code must use with the stored weights;
  * the KV-cache greedy loop agrees with a full no-cache forward over prompt + continuation;
  * the size of the f32 reference's own rounding error (HF in float64 vs float32).

RoPE layout: llama.cpp's convert script permutes the rows of attn_q/attn_k inside each head so
that HF's "rotate_half" (NeoX-style, pairs (i, i + d/2)) becomes llama.cpp's LLAMA_ROPE_TYPE_NORM
(adjacent pairs (2i, 2i+1)). transformers undoes that permutation on load. Since q.k is invariant
under the same permutation of q's and k's dimensions, and V/O are not permuted, both views give
identical attention; but the stored GGUF weights must be paired with adjacent-pair rotation:
for pair i in [0, 32) of each head, angle = pos * 100000^(-2i/64), rotate (x[2i], x[2i+1]).
Pre-RoPE keys kept by the fact-KV store are therefore in the stored (GGUF) dimension order too.

Precision: the reference multiplies f32 activations by f32-dequantised weights. llama.cpp instead
quantises activations to 8 bits for its Q4_1/Q8_0 dot products, so llama.cpp's own logits sit
further from this reference than float rounding; an f32 C implementation should not.
"""

import argparse
import copy
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(ROOT, "tests", "golden", "logits")
LLAMA_TOKENIZE = os.path.join(ROOT, "third_party", "llama.cpp-build", "bin", "llama-tokenize")
LOCOMO = os.path.join(os.path.dirname(ROOT), "shared", "data", "locomo", "26.json")

N_GREEDY = 32
MEDIUM_MAX_TOKENS = 512   # whole dialogue turns, as many as fit
LONG_MIN_TOKENS = 2100    # whole dialogue turns, until at least this many

# What the default model must look like; checked against both the GGUF and transformers.
EXPECTED = {
    "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
}

SHORT_TEXT = "The Eiffel Tower is located in the city of"   # 10 tokens: keeps short.all.f32 ~2 MB
CHAT_QUESTION = "What are three good ways to remember someone's name after meeting them?"


def log(msg):
    print(msg, flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# GGUF side: metadata and our own dequantisation (independent of transformers' loader).

def gguf_open(path):
    from gguf import GGUFReader
    return GGUFReader(path)


def gguf_field(reader, key):
    f = reader.fields[key]
    return f.contents()


def gguf_weights(reader):
    """name -> float64 array in numpy (rows, cols) = (ggml ne1, ne0) order, as stored."""
    from gguf import dequantize
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
    return out


def unpermute_qk(w, n_head):
    """Inverse of llama.cpp convert_hf_to_gguf's permute(): GGUF (NORM layout) rows -> HF rows.
    Within each head of d rows, stored row 2i+j (j in {0,1}) is HF row i + j*d/2."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_config(reader, cfg):
    gg = {
        "rope_theta": float(gguf_field(reader, "llama.rope.freq_base")),
        "rms_norm_eps": float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "num_hidden_layers": int(gguf_field(reader, "llama.block_count")),
        "num_attention_heads": int(gguf_field(reader, "llama.attention.head_count")),
        "num_key_value_heads": int(gguf_field(reader, "llama.attention.head_count_kv")),
        "head_dim": int(gguf_field(reader, "llama.rope.dimension_count")),
        "hidden_size": int(gguf_field(reader, "llama.embedding_length")),
        "intermediate_size": int(gguf_field(reader, "llama.feed_forward_length")),
        "vocab_size": int(gguf_field(reader, "llama.vocab_size")),
    }
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    hf = {
        "rope_theta": float(rope_params.get("rope_theta", getattr(cfg, "rope_theta", float("nan")))),
        "rope_type": rope_params.get("rope_type", "default"),
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    ok = True
    log("config check (expected | gguf | transformers):")
    for k, exp in EXPECTED.items():
        if isinstance(exp, float):
            # the GGUF stores eps as f32 (9.99999975e-06); compare at f32 precision
            good = (np.float32(gg[k]) == np.float32(exp)) and (np.float32(hf[k]) == np.float32(exp))
        else:
            good = gg[k] == exp and hf[k] == exp
        ok &= bool(good)
        log(f"  {k:22s} {exp!s:>10} | {gg[k]!s:>22} | {hf[k]!s:>22}  {'ok' if good else 'MISMATCH'}")
    if hf["rope_type"] != "default":
        ok = False
        log(f"  rope_type {hf['rope_type']} is not plain RoPE: MISMATCH")
    return ok, {"gguf": gg, "transformers": hf}


def check_weights(model, gw, cfg):
    """Every HF parameter must equal our dequantisation of the GGUF tensor (exactly)."""
    sd = model.state_dict()
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    pairs = [("model.embed_tokens.weight", "token_embd.weight", None),
             ("model.norm.weight", "output_norm.weight", None)]
    names = {"self_attn.q_proj": ("attn_q", nh), "self_attn.k_proj": ("attn_k", nkv),
             "self_attn.v_proj": ("attn_v", None), "self_attn.o_proj": ("attn_output", None),
             "mlp.gate_proj": ("ffn_gate", None), "mlp.up_proj": ("ffn_up", None),
             "mlp.down_proj": ("ffn_down", None), "input_layernorm": ("attn_norm", None),
             "post_attention_layernorm": ("ffn_norm", None)}
    for l in range(cfg.num_hidden_layers):
        for hfn, (ggn, heads) in names.items():
            pairs.append((f"model.layers.{l}.{hfn}.weight", f"blk.{l}.{ggn}.weight", heads))
    worst = 0.0
    for hfn, ggn, heads in pairs:
        w = gw[ggn]
        if heads is not None:
            w = unpermute_qk(w, heads)
        h = sd[hfn].detach().numpy()
        if h.shape != w.shape:
            raise SystemExit(f"shape mismatch {hfn} {h.shape} vs {ggn} {w.shape}")
        worst = max(worst, float(np.max(np.abs(h.astype(np.float64) - w))))
    lm_tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    log(f"weights: {len(pairs)} tensors, max |HF - own GGUF dequant| = {worst:g}; "
        f"lm_head tied to embed_tokens: {lm_tied}")
    return worst == 0.0 and lm_tied, {"n_tensors": len(pairs), "max_abs_diff": worst,
                                       "lm_head_tied": lm_tied}


# ----------------------------------------------------------------------------------------------
# Independent float64 numpy forward on the GGUF weights as stored, to pin the RoPE layout.

def np_forward(tokens, gw, cfg, rope):
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    eps = float(np.float32(cfg.rms_norm_eps))
    theta = float(EXPECTED["rope_theta"])
    T = len(tokens)
    f64 = lambda n: gw[n].astype(np.float64)
    emb = f64("token_embd.weight")
    x = emb[np.asarray(tokens)]

    def rms(v, w):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w

    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)          # [hd/2]
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]         # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]          # [T, 1, hd/2]

    def apply_rope(v):                                                    # v: [T, heads, hd]
        v = v.copy()
        if rope == "norm":    # llama.cpp LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i+1)
            a, b = v[..., 0::2].copy(), v[..., 1::2].copy()
            v[..., 0::2], v[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        else:                 # NeoX / HF rotate_half: pairs (i, i + hd/2)
            a, b = v[..., : hd // 2].copy(), v[..., hd // 2:].copy()
            v[..., : hd // 2], v[..., hd // 2:] = a * cos - b * sin, a * sin + b * cos
        return v

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg.num_hidden_layers):
        p = f"blk.{l}."
        h = rms(x, f64(p + "attn_norm.weight"))
        q = apply_rope((h @ f64(p + "attn_q.weight").T).reshape(T, nh, hd))
        k = apply_rope((h @ f64(p + "attn_k.weight").T).reshape(T, nkv, hd))
        v = (h @ f64(p + "attn_v.weight").T).reshape(T, nkv, hd)
        rep = nh // nkv                        # query head j reads KV head j // rep
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + o @ f64(p + "attn_output.weight").T
        h = rms(x, f64(p + "ffn_norm.weight"))
        g = h @ f64(p + "ffn_gate.weight").T
        u = h @ f64(p + "ffn_up.weight").T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ f64(p + "ffn_down.weight").T
    x = rms(x, f64("output_norm.weight"))
    return x @ emb.T


# ----------------------------------------------------------------------------------------------
# Prompts.

def locomo_lines():
    with open(LOCOMO) as f:
        conv = json.load(f)
    sessions = sorted((k for k in conv if k.startswith("session_") and k[8:].isdigit()
                       and isinstance(conv[k], list)), key=lambda k: int(k[8:]))
    for s in sessions:
        for turn in conv[s]:
            yield f"{turn['speaker']}: {turn['text']}"


def dialogue_prompt(tok, max_tokens=None, min_tokens=None):
    """Whole "Speaker: text" turns from the start of conversation 26, joined by newlines:
    as many as fit in max_tokens, or the fewest that reach min_tokens."""
    lines, text = [], ""
    for line in locomo_lines():
        cand = "\n".join(lines + [line])
        n = len(tok(cand, add_special_tokens=False).input_ids)
        if max_tokens is not None and n > max_tokens:
            break
        lines.append(line)
        text = cand
        if min_tokens is not None and n >= min_tokens:
            break
    return text


def build_prompts(tok):
    chat_text = tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                        add_generation_prompt=True, tokenize=False)
    texts = [("short", SHORT_TEXT), ("chat", chat_text),
             ("medium", dialogue_prompt(tok, max_tokens=MEDIUM_MAX_TOKENS)),
             ("long", dialogue_prompt(tok, min_tokens=LONG_MIN_TOKENS))]
    out = []
    for name, text in texts:
        # add_special_tokens=False: this GGUF says add_bos_token=False, and the chat template
        # already spells out its special tokens (<|im_start|> etc. are parsed as single ids).
        ids = tok(text, add_special_tokens=False).input_ids
        out.append((name, text, [int(i) for i in ids]))
    return out


def llama_cpp_tokens(model_path, text):
    """Token ids from llama.cpp's own tokenizer (special tokens parsed, BOS per the GGUF)."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run([LLAMA_TOKENIZE, "-m", model_path, "-f", f.name, "--ids", "--log-disable"],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    lists = [l for l in r.stdout.splitlines() if l.startswith("[")]
    return json.loads(lists[-1])


# ----------------------------------------------------------------------------------------------
# Reference runs.

def greedy(model, tokens, n):
    """Manual greedy loop over the KV cache; never stops early. Returns (ids, margins)."""
    import inspect
    import torch
    # transformers 5.x renamed past_key_values to cache (the old name is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids, margins = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].numpy()
            nxt = int(np.argmax(row))
            top2 = np.partition(row, -2)[-2:]
            ids.append(nxt)
            margins.append(float(top2[1] - top2[0]))
            out = model(input_ids=torch.tensor([[nxt]]), use_cache=True,
                        **{cache_kw: getattr(out, cache_kw)})
    return ids, margins


def teacher_forced_argmax(model, tokens, cont):
    """Argmax at the positions that predicted cont, from one full forward without a cache."""
    import torch
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([tokens + cont[:-1]]), use_cache=False).logits[0]
    lg = lg[len(tokens) - 1:].numpy()
    return [int(i) for i in np.argmax(lg, axis=-1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    t_start = time.time()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir, model_file = os.path.split(os.path.abspath(args.model))
    os.makedirs(args.out, exist_ok=True)

    log(f"model {args.model}")
    model_sha = sha256_file(args.model)
    log(f"sha256 {model_sha}")

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    t_loaded = time.time()
    log(f"loaded {type(model).__name__} in {t_loaded - t_start:.1f}s")

    checks = {}
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    attn_impl = cfg._attn_implementation
    log(f"parameter dtypes {dtypes}; attention implementation {attn_impl!r}")
    if dtypes != ["torch.float32"] or attn_impl != "eager":
        raise SystemExit("reference must be float32 with eager attention")
    checks["dtypes"], checks["attn_implementation"] = dtypes, attn_impl

    reader = gguf_open(args.model)
    ok, checks["config"] = check_config(reader, cfg)
    if not ok:
        raise SystemExit("config mismatch between GGUF, transformers and expectations")
    gw = gguf_weights(reader)
    ok, checks["weights"] = check_weights(model, gw, cfg)
    if not ok:
        raise SystemExit("transformers' weights differ from the GGUF dequantisation")

    prompts = build_prompts(tok)
    for name, _, ids in prompts:
        log(f"prompt {name}: {len(ids)} tokens")
    assert len(prompts[3][2]) > 2000, "long prompt must exceed 2000 tokens"
    if os.access(LLAMA_TOKENIZE, os.X_OK):
        try:
            same = {name: llama_cpp_tokens(args.model, text) == ids for name, text, ids in prompts}
        except (OSError, subprocess.CalledProcessError, ValueError, IndexError) as e:
            same = f"llama-tokenize failed: {e}"
        log(f"token ids identical to llama.cpp's llama-tokenize: {same}")
        checks["tokens_match_llama_cpp"] = same
    else:
        log("llama-tokenize not built (scripts/build_llamacpp.sh): tokenizer cross-check skipped")
        checks["tokens_match_llama_cpp"] = "not checked"

    model64 = copy.deepcopy(model).double()
    manifest_prompts = []
    short_all = None
    for name, text, ids in prompts:
        t0 = time.time()
        with torch.no_grad():
            all_lg = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
            all64 = model64(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
        last = np.ascontiguousarray(all_lg[-1], dtype="<f4")
        g, margins = greedy(model, ids, N_GREEDY)
        if g[0] != int(np.argmax(last)):
            raise SystemExit(f"{name}: cached greedy disagrees with the full forward")
        tf = teacher_forced_argmax(model, ids, g)
        tf64 = teacher_forced_argmax(model64, ids, g)
        if tf != g:
            raise SystemExit(f"{name}: KV-cache greedy {g} != no-cache argmax {tf}")
        f64_err = float(np.max(np.abs(all_lg.astype(np.float64) - all64)))
        f64_err_last = float(np.max(np.abs(all_lg[-1].astype(np.float64) - all64[-1])))
        n_agree64 = sum(int(a == b) for a, b in zip(g, tf64))

        entry = {"name": name, "n_tokens": len(ids), "text": text, "tokens": ids,
                 "last_logits": f"{name}.last.f32"}
        last.tofile(os.path.join(args.out, f"{name}.last.f32"))
        if name == "short":
            short_all = np.ascontiguousarray(all_lg, dtype="<f4")
            short_all.tofile(os.path.join(args.out, "short.all.f32"))
            entry["all_logits"] = "short.all.f32"
            entry["all_logits_shape"] = list(short_all.shape)
        entry.update({
            "greedy": g, "greedy_margins": [round(m, 5) for m in margins],
            "greedy_min_margin": round(min(margins), 5),
            "ref_f32_vs_f64_max_abs_diff_all_positions": f64_err,
            "ref_f32_vs_f64_max_abs_diff_last": f64_err_last,
            "greedy_steps_agreeing_in_f64": n_agree64,
        })
        manifest_prompts.append(entry)
        top = np.argsort(-last)[:5]
        log(f"\n[{name}] {len(ids)} tokens, {time.time() - t0:.1f}s; |f32-f64| max over all positions "
            f"{f64_err:.2e} (last {f64_err_last:.2e}); greedy agrees in f64 on {n_agree64}/{N_GREEDY}; "
            f"min greedy margin {min(margins):.4f}")
        log("  top-5: " + ", ".join(f"{int(t)} {tok.convert_ids_to_tokens(int(t))!r} {last[t]:.4f}"
                                    for t in top))
        log(f"  greedy: {tok.decode(g)!r}")

    # RoPE layout check on "short": stored GGUF weights, float64, NORM vs NeoX rotation.
    short_ids = prompts[0][2]
    ref_norm = np_forward(short_ids, gw, cfg, "norm")
    ref_neox = np_forward(short_ids, gw, cfg, "neox")
    d_norm = float(np.max(np.abs(ref_norm - short_all)))
    d_neox = float(np.max(np.abs(ref_neox - short_all)))
    log(f"\nRoPE layout (numpy f64 forward, GGUF Q/K as stored, 'short', all positions):")
    log(f"  adjacent pairs (x[2i],x[2i+1]), llama.cpp NORM: max |numpy - HF f32| = {d_norm:.2e}")
    log(f"  half rotation (x[i],x[i+32]), NeoX:            max |numpy - HF f32| = {d_neox:.2e}")
    if not (d_norm < 1e-2 and d_neox > 1e-1):
        raise SystemExit("RoPE layout check failed")
    checks["rope_layout"] = {
        "with_gguf_weights_as_stored": "norm (adjacent pairs x[2i], x[2i+1])",
        "numpy_f64_norm_vs_hf_max_abs_diff": d_norm,
        "numpy_f64_neox_vs_hf_max_abs_diff": d_neox,
    }

    runtime = time.time() - t_start
    manifest = {
        "model_file": model_file,
        "model_sha256": model_sha,
        "generated_by": "tools/make_golden_logits.py",
        "reference": "transformers LlamaForCausalLM from the GGUF (weights dequantised to f32), "
                     "float32, eager attention, CPU, no cache for logits; greedy via KV cache",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "gguf": importlib.metadata.version("gguf"),
                     "accelerate": importlib.metadata.version("accelerate"), "numpy": np.__version__},
        "vocab_size": int(cfg.vocab_size),
        "dtype": "float32 little-endian",
        "greedy_tokens": N_GREEDY,
        "runtime_s": round(runtime, 1),
        "checks": checks,
        "prompts": manifest_prompts,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    log(f"\nwrote {args.out}: {total / 1e6:.2f} MB; runtime {runtime:.1f}s "
        f"(load {t_loaded - t_start:.1f}s)")


if __name__ == "__main__":
    main()

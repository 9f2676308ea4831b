#!/usr/bin/env python3
"""compare_embedders.py: retrieval recall of candidate embedding models on LoCoMo.

Chooses the memory layer's embedder (src/memory/embedder.h) by the measure that matters to us:
for each LoCoMo question (categories 1-4), embed the question, retrieve the k nearest facts of
that conversation by cosine similarity, and count the fraction of the question's evidence turns
(dia_ids) that the retrieved facts cover. Two fact sets are scored:
  turns: every dialogue turn ("Speaker: text"), fact id = its own dia_id;
  obs:   every session observation (the facts InferScale stores), each linked to the evidence
         dia_id(s) it was written from.
recall@k = mean over questions of |evidence ∩ dia_ids of the top-k facts| / |evidence|.
Questions without a parseable evidence id are skipped (counted in the table's n).

The reference for each model is sentence-transformers on the model's own folder (offline).
A BM25 row (Okapi, k1=1.2, b=0.75, lowercase word tokens) is printed as a lexical baseline.

Usage: HF_HUB_OFFLINE=1 python3 tools/compare_embedders.py \
           [--data ../shared/data/locomo] [--model NAME=DIR ...]
Default models: all-MiniLM-L6-v2=models/all-MiniLM-L6-v2 and bge-small-en-v1.5=models/bge-small-en-v1.5
(a model whose folder is absent is reported as unavailable).
"""
import argparse
import glob
import json
import math
import os
import re
import sys
import time
from collections import Counter

import numpy as np

KS = (5, 10, 20, 50)
DIA_RE = re.compile(r"D:?(\d+):(\d+)")


def dia_ids(x):
    """All dia_ids named in a string or (nested) list; tolerates the release's typos."""
    if isinstance(x, list):
        out = []
        for y in x:
            out.extend(dia_ids(y))
        return out
    if not isinstance(x, str):
        return []
    return ["D%s:%s" % m for m in DIA_RE.findall(x)]


def load_conversations(data_dir):
    convs = []
    for path in sorted(glob.glob(os.path.join(data_dir, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        turns, obs = [], []
        for key, val in d.items():
            if re.fullmatch(r"session_\d+", key):
                for t in val:
                    text = "%s: %s" % (t["speaker"], t["text"])
                    turns.append((text, [t["dia_id"]]))
            elif re.fullmatch(r"session_\d+_observation", key):
                for _speaker, lst in val.items():
                    for item in lst:
                        obs.append((item[0], dia_ids(item[1])))
        qs = []
        for q in d["qa"]:
            if q.get("category") not in (1, 2, 3, 4):
                continue
            ev = sorted(set(dia_ids(q.get("evidence", []))))
            qs.append((q["question"], ev, q["category"]))
        convs.append({"name": os.path.basename(path), "turns": turns, "obs": obs, "qs": qs})
    return convs


def recall_table(convs, scorer):
    """scorer(conv, facts, questions) -> [n_q][n_facts] similarity. Returns {set: {k: recall}}."""
    res = {}
    for fact_set in ("turns", "obs"):
        sums = Counter()
        n = 0
        for c in convs:
            facts = c[fact_set]
            qs = [q for q in c["qs"] if q[1]]
            if not qs or not facts:
                continue
            sim = scorer(c["name"] + fact_set, [f[0] for f in facts], [q[0] for q in qs])
            order = np.argsort(-sim, axis=1, kind="stable")
            for qi, (_text, ev, _cat) in enumerate(qs):
                for k in KS:
                    got = set()
                    for fi in order[qi, :k]:
                        got.update(facts[fi][1])
                    sums[k] += len(set(ev) & got) / len(ev)
                n += 1
        res[fact_set] = {k: sums[k] / max(n, 1) for k in KS}
        res[fact_set]["n"] = n
    return res


def st_scorer(model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    stats = {"texts": 0, "seconds": 0.0, "params": sum(p.numel() for p in model.parameters())}

    def score(_key, facts, questions):
        t0 = time.perf_counter()
        ef = model.encode(facts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        eq = model.encode(questions, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        stats["seconds"] += time.perf_counter() - t0
        stats["texts"] += len(facts) + len(questions)
        return eq @ ef.T

    return score, stats


WORD_RE = re.compile(r"\w+")


def bm25_scorer():
    def toks(s):
        return WORD_RE.findall(s.lower())

    def score(_key, facts, questions, k1=1.2, b=0.75):
        docs = [Counter(toks(f)) for f in facts]
        lens = np.array([sum(d.values()) for d in docs], dtype=np.float64)
        avg = lens.mean() if len(lens) else 1.0
        df = Counter()
        for d in docs:
            df.update(d.keys())
        n = len(docs)
        sim = np.zeros((len(questions), n))
        for qi, q in enumerate(questions):
            for w in set(toks(q)):
                if w not in df:
                    continue
                idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                for di, d in enumerate(docs):
                    tf = d.get(w, 0)
                    if tf:
                        sim[qi, di] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lens[di] / avg))
        return sim

    return score


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(root, "..", "shared", "data", "locomo"))
    ap.add_argument("--model", action="append", default=None, help="NAME=DIR (repeatable)")
    ap.add_argument("--no-bm25", action="store_true")
    args = ap.parse_args()
    models = args.model or [
        "all-MiniLM-L6-v2=" + os.path.join(root, "models", "all-MiniLM-L6-v2"),
        "bge-small-en-v1.5=" + os.path.join(root, "models", "bge-small-en-v1.5"),
    ]
    convs = load_conversations(args.data)
    print("LoCoMo: %d conversations, %d turns, %d observations, %d questions (cat 1-4)"
          % (len(convs), sum(len(c["turns"]) for c in convs), sum(len(c["obs"]) for c in convs),
             sum(len(c["qs"]) for c in convs)))

    rows = []
    for spec in models:
        name, _, path = spec.partition("=")
        if not os.path.isfile(os.path.join(path, "config.json")):
            rows.append((name, None, "unavailable: no model files at %s" % path))
            continue
        scorer, stats = st_scorer(path)
        res = recall_table(convs, scorer)
        note = "%.1fM params, %.0f texts/s (sentence-transformers, CPU)" % (
            stats["params"] / 1e6, stats["texts"] / max(stats["seconds"], 1e-9))
        rows.append((name, res, note))
    if not args.no_bm25:
        rows.append(("BM25 (baseline)", recall_table(convs, bm25_scorer()), "lexical"))

    hdr = "| model | facts | n_q | " + " | ".join("R@%d" % k for k in KS) + " | note |"
    print(hdr)
    print("|" + "---|" * (4 + len(KS)))
    for name, res, note in rows:
        if res is None:
            print("| %s | - | - | %s | %s |" % (name, " | ".join("-" for _ in KS), note))
            continue
        for fact_set in ("turns", "obs"):
            r = res[fact_set]
            print("| %s | %s | %d | %s | %s |" % (name, fact_set, r["n"],
                  " | ".join("%.3f" % r[k] for k in KS), note))
    return 0


if __name__ == "__main__":
    sys.exit(main())

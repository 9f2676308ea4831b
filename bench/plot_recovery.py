#!/usr/bin/env python3
"""Recovered share of prompt mode's NLL benefit against kv TTFT, one point per
recovery technique (issue: the cost side of every technique).

  python3 bench/plot_recovery.py --ttft bench/results/gpu_recovery_ttft_DATE.log \
      --nll bench/results/locomo_nll_gpu_k20_DATE.csv [--nll ..._k50_DATE.csv] --out PNG

--ttft: the log of bench_gpu runs at k = 50 (".dev"-staged ttft call: a line
"### bench_gpu ... FLAGS" before each run's table); the kv TTFT of the k = 50
row, the median of the runs with the same flags. --nll: `eval locomo --nll`'s
per-question rows; the recovered share is sum(NLL_off - NLL_mode) /
sum(NLL_off - NLL_prompt) over the questions of categories 1-4 that have a row
in every mode plotted. Prints the table it plots.
"""
import argparse
import collections
import csv
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FLAG_MODE = {"": "kv0", "-R 2": "kv0r2", "-R 4": "kv0r4", "-R 16": "kv0r16",
             "-B 0.15": "kv0b0.15", "-B 0.3": "kv0b0.3"}


def read_ttft(path):
    runs = collections.defaultdict(list)
    flags = None
    for line in open(path):
        m = re.match(r"### bench_gpu .*-r \d+ ?(.*)$", line.rstrip())
        if m:
            flags = m.group(1).strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if flags is not None and len(cells) > 3 and cells[0] == "50":
            runs[FLAG_MODE.get(flags, flags)].append(float(cells[3]))
    return {mode: statistics.median(v) for mode, v in runs.items()}


def read_shares(path, modes):
    nll = collections.defaultdict(dict)
    for r in csv.DictReader(open(path)):
        if r["category"] in ("1", "2", "3", "4") and r["nll"]:
            nll[(r["conv"], r["question"])][r["mode"]] = float(r["nll"])
    need = set(modes) | {"prompt", "off"}
    qs = [q for q, m in nll.items() if need <= m.keys()]
    den = sum(nll[q]["off"] - nll[q]["prompt"] for q in qs)
    return len(qs), {m: 100 * sum(nll[q]["off"] - nll[q][m] for q in qs) / den for m in modes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft", required=True)
    ap.add_argument("--nll", action="append", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ttft = read_ttft(a.ttft)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in a.nll:
        k = re.search(r"_k(\d+)_", path)
        modes = [m for m in ttft if m in open(path).read()]
        n, share = read_shares(path, modes)
        label = f"k = {k.group(1) if k else '?'} facts retrieved ({n} questions)"
        print(f"{label}: " + ", ".join(f"{m} {share[m]:.1f}% at {ttft[m]:.2f} ms" for m in modes))
        pts = sorted((ttft[m], share[m], m) for m in modes)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=label)
        for x, y, m in pts:
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("kv TTFT at k = 50, ms (bench_gpu in-process, Llama-3.1-8B shape, H200)")
    ax.set_ylabel("share of prompt mode's NLL benefit recovered, %")
    ax.set_title("Recovery techniques: accuracy (SmolLM2, LoCoMo) vs cost (8B shape)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)


if __name__ == "__main__":
    main()

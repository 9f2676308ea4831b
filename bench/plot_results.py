#!/usr/bin/env python3
"""Draws the headline plots of BENCHMARKS.md from the CSV files in bench/results/.

Every plot is made from committed CSVs only (never from numbers typed here), so
re-running this after a new benchmark run that writes new CSVs, and pointing the
arguments at them, redraws the document's figures:

  python3 bench/plot_results.py                      # the files BENCHMARKS.md names
  python3 bench/plot_results.py --gpu NEW.csv --hf NEW_HF.csv --out docs/plots

Plots written (PNG, rendered by GitHub in the Markdown):
  ttft_vs_k_gpu.png            TTFT vs k per mode (bench_gpu + transformers, H200)
  throughput_vs_users_gpu.png  requests/s vs concurrent users at k = 50
  locomo_f1_by_category.png    LoCoMo F1 by category and mode, k = 20 and k = 50
  retrieval_gpu.png            query embedding + top-k search, CPU vs GPU

Needs matplotlib (scripts/plot_setup.sh installs it from PyPI); it is not part of
the build or of the test suite.
"""
import argparse
import collections
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")

CATS = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def rows_of(path, kind):
    """The comma-separated rows of a bench CSV whose first field is `kind`
    (bench_gpu and hf_reference write several kinds into one file, with a
    '#' header line for each)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            fields = line.strip().split(",")
            if fields[0] == kind:
                out.append(fields)
    return out


def plot_ttft(plt, gpu, hf, out):
    t = [r for r in rows_of(gpu, "ttft") if r[1] == "bf16"]
    k = [int(r[2]) for r in t]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(k, [float(r[5]) for r in t], "o-", label="kv (facts' KV injected, GPU-resident)")
    ax.plot(k, [float(r[9]) for r in t], "s--", label="kv cold (records uploaded)")
    ax.plot(k, [float(r[4]) for r in t], "^-", label="prompt (facts prefilled as text)")
    h = rows_of(hf, "hf_ttft") if hf else []
    if h:
        ax.plot([int(r[1]) for r in h], [float(r[3]) for r in h], "x:",
                label="transformers, prompt mode")
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title("TTFT vs k, Llama-3.1-8B shape, bf16, H200 (in-process)")
    ax.set_xscale("log")
    ax.set_xticks(k)
    ax.set_xticklabels([str(x) for x in k])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ttft_vs_k_gpu.png"), dpi=110)
    plt.close(fig)


def plot_throughput(plt, gpu, hf, out):
    t = [r for r in rows_of(gpu, "throughput") if r[1] == "bf16"]
    u = [int(r[3]) for r in t]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(u, [float(r[7]) for r in t], "o-", label="kv")
    ax.plot(u, [float(r[6]) for r in t], "^-", label="prompt")
    h = rows_of(hf, "hf_throughput") if hf else []
    if h:
        ax.plot([int(r[2]) for r in h], [float(r[4]) for r in h], "x:",
                label="transformers, prompt mode")
    ax.set_xlabel("concurrent users (one batch)")
    ax.set_ylabel("requests/s (prefill to first token)")
    ax.set_title("Throughput at k = 50, Llama-3.1-8B shape, H200 (in-process)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(u)
    ax.set_xticklabels([str(x) for x in u])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput_vs_users_gpu.png"), dpi=110)
    plt.close(fig)


def locomo_f1(path):
    """Mean F1 by (mode, category) over categories 1-4, and the count."""
    s = collections.defaultdict(float)
    n = collections.defaultdict(int)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            c = int(row["category"])
            if c not in CATS:
                continue
            for key in ((row["mode"], c), (row["mode"], 0)):
                s[key] += float(row["f1"])
                n[key] += 1
    return {key: s[key] / n[key] for key in s}, n


def plot_locomo(plt, files, out):
    fig, axes = plt.subplots(1, len(files), figsize=(6.0 * len(files), 4.2), sharey=True)
    if len(files) == 1:
        axes = [axes]
    for ax, (k, path) in zip(axes, files):
        f1, _ = locomo_f1(path)
        modes = sorted({m for (m, _) in f1}, key=lambda m: (m != "prompt", m))
        cats = [1, 2, 3, 4, 0]
        width = 0.8 / len(modes)
        for i, m in enumerate(modes):
            xs = [j + i * width for j in range(len(cats))]
            ax.bar(xs, [f1.get((m, c), 0.0) for c in cats], width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))])
        ax.set_xticklabels([CATS.get(c, "1-4 all") for c in cats], fontsize=8)
        ax.set_title(f"LoCoMo F1 by category, k = {k}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("token F1 (mean)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "locomo_f1_by_category.png"), dpi=110)
    plt.close(fig)


def plot_retrieval(plt, path, out):
    r = rows_of(path, "retrieval")
    n = [int(x[1]) for x in r]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(n, [float(x[3]) + float(x[4]) for x in r], "^-", label="CPU: embed + search")
    ax.plot(n, [float(x[7]) for x in r], "o-", label="GPU: embed + search")
    ax.set_xscale("log")
    ax.set_xlabel("facts of the user")
    ax.set_ylabel("ms per query (median)")
    ax.set_title("Retrieval, MiniLM-L6-v2 + exact top-50 (in-process)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "retrieval_gpu.png"), dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default=os.path.join(RES, "gpu_8b_run108_2026-12-04.csv"),
                    help="bench_gpu CSV (ttft and throughput rows)")
    ap.add_argument("--hf", default=os.path.join(RES, "gpu_8b_hf_run108_2026-12-04.csv"),
                    help="bench/hf_reference.py CSV of the same device call ('' for none)")
    ap.add_argument("--locomo", nargs="*", default=[f"20={os.path.join(RES, 'locomo_k20_cuda.csv')}",
                                                    f"50={os.path.join(RES, 'locomo_k50_cuda.csv')}"],
                    help="K=PATH of merged `inferscale eval locomo` CSVs")
    ap.add_argument("--retrieval", default=os.path.join(RES, "gpu_retrieval_2026-12-03.csv"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "plots"))
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is missing (bash scripts/plot_setup.sh installs it)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    plot_ttft(plt, a.gpu, a.hf, a.out)
    plot_throughput(plt, a.gpu, a.hf, a.out)
    plot_locomo(plt, [(int(s.split("=", 1)[0]), s.split("=", 1)[1]) for s in a.locomo], a.out)
    plot_retrieval(plt, a.retrieval, a.out)
    print(f"plot_results: wrote 4 plots to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

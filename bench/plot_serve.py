#!/usr/bin/env python3
"""Plots of the served path on the GPU (bench/run_gpu_serve.sh's results).

  python3 bench/plot_serve.py [--results bench/results] [--date 2026-12-05] [--out bench/results]
                              [--machine H200] [--tag TAG]

Reads gpu_serve_{hot,tiered_host or tiered}[_TAG]_DATE.csv (bench_load, client-measured) and
gpu_serve_bench_gpu[_TAG]_DATE.csv (bench_gpu, in-process, same device call; its lines are left
out when the call ran none) and writes two PNGs (named with _TAG too):
  gpu_serve_ttft_DATE.png        TTFT p50 vs memory tokens a request (served kv and
                                 prompt modes, one client; in-process kv and prompt);
                                 memory tokens rather than k, since LoCoMo facts are
                                 longer than bench_gpu's 25-token facts
  gpu_serve_throughput_DATE.png  requests/s vs concurrent clients at k = 50,
                                 max_tokens 1 (served) and users (in-process)
"""
import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f)]


def read_bench_gpu(path):
    ttft, tp = [], []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            p = line.strip().split(",")
            if p[0] == "ttft":
                ttft.append({"k": int(p[2]), "prompt_tokens": int(p[3]), "prompt_ms": float(p[4]),
                             "kv_ms": float(p[5])})
            elif p[0] == "throughput":
                tp.append({"users": int(p[3]), "prompt_rps": float(p[6]), "kv_rps": float(p[7])})
    return ttft, tp


def ok(r):
    return r["errors"] in ("", "0")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--date", default="2026-12-05")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: --results)")
    ap.add_argument("--machine", default="H200", help="the GPU the results came from, for the titles")
    ap.add_argument("--tag", default="", help="the results' label between name and date (one call's files)")
    a = ap.parse_args()
    out = a.out or a.results
    tag = f"_{a.tag}" if a.tag else ""
    path = lambda name: os.path.join(a.results, f"gpu_serve_{name}{tag}_{a.date}.csv")  # noqa: E731
    # The tiered regime with the pinned host tier where the call ran it.
    tier_name = "tiered_host" if os.path.exists(path("tiered_host")) else "tiered"
    hot, tiered = read_load(path("hot")), read_load(path(tier_name))
    ttft, tp = read_bench_gpu(path("bench_gpu")) if os.path.exists(path("bench_gpu")) else ([], [])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows, mode, style, name in [(hot, "kv", "o-", "served kv, hot"), (hot, "prompt", "s-", "served prompt"),
                                    (tiered, "kv", "^--", "served kv, tiered (Zipf users)")]:
        pts = sorted((float(r["memory_tokens_per_req"]), float(r["ttft_p50_ms"])) for r in rows
                     if r["mode"] == mode and r["clients"] == "1" and r["max_tokens"] == "1" and ok(r))
        if pts:
            ax.plot(*zip(*pts), style, label=name)
    # bench_gpu: prefix 60 + query 30 tokens around the memory
    if ttft:
        ax.plot([t["prompt_tokens"] - 90 for t in ttft], [t["kv_ms"] for t in ttft], "o:", label="in-process kv (bench_gpu)")
        ax.plot([t["prompt_tokens"] - 90 for t in ttft], [t["prompt_ms"] for t in ttft], "s:",
                label="in-process prompt (bench_gpu)")
    ax.set_xlabel("memory tokens a request")
    ax.set_ylabel("TTFT p50, ms (served: at the client)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT vs memory, Llama-3.1-8B shape, {a.machine}, one client")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"gpu_serve_ttft{tag}_{a.date}.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows, mode, style, name in [(hot, "kv", "o-", "served kv, hot"), (hot, "prompt", "s-", "served prompt"),
                                    (tiered, "kv", "^--", "served kv, tiered")]:
        pts = sorted((int(r["clients"]), float(r["req_per_s"])) for r in rows
                     if r["mode"] == mode and r["k"] == "50" and r["max_tokens"] == "1" and ok(r))
        if pts:
            ax.plot(*zip(*pts), style, label=name)
    if tp:
        ax.plot([t["users"] for t in tp], [t["kv_rps"] for t in tp], "o:", label="in-process kv (bench_gpu)")
        ax.plot([t["users"] for t in tp], [t["prompt_rps"] for t in tp], "s:", label="in-process prompt (bench_gpu)")
    ax.set_xlabel("concurrent clients (in-process: users in one batch)")
    ax.set_ylabel("requests/s, k = 50, max_tokens 1")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"Throughput vs clients, Llama-3.1-8B shape, {a.machine}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"gpu_serve_throughput{tag}_{a.date}.png"), dpi=120)


if __name__ == "__main__":
    main()

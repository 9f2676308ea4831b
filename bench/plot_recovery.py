#!/usr/bin/env python3
"""Recovered share of prompt mode's NLL benefit against kv TTFT, one point per
recovery technique (issue: the cost side of every technique).

  python3 bench/plot_recovery.py --served bench/results/gpu_serve_recompute_DATE.csv \
      [--ttft bench/results/gpu_recovery_ttft_DATE.log] \
      --nll bench/results/locomo_nll_gpu_k20_DATE.csv [--nll ..._k50_DATE.csv] --out PNG

--served (may repeat): bench_load's CSV of servers started with --recompute M,
each labelled ...rM (scripts/gpu_stage/served_rec.sh): the client's kv TTFT p50
of the k = 50, one-client row is mode kv0rM's cost (r0: kv0), its prompt row
prompt mode's. --ttft (may repeat): the log of bench_gpu runs at k = 50 (a line
"### bench_gpu ... FLAGS" before each run's table): the in-process kv TTFT of
the k = 50 row, the median of the runs with the same flags over the logs; it
gives the modes the server does not run (CacheBlend) a cost, drawn hollow.
--nll: `eval locomo --nll`'s
per-question rows; the recovered share is sum(NLL_off - NLL_mode) /
sum(NLL_off - NLL_prompt) over the questions of categories 1-4 that have a row
in every mode plotted. Prints the table it plots.

--curve FILE (may repeat; files whose names say the same _kK are merged by
question): a second panel, for each k the share against m for the static modes
kv0rM (m = 0: kv0) over the questions that have every one of them, with the measured TTFT written next to
the points that --ttft has: how much of each fact must be recomputed to reach
the target, and what that costs.
"""
import argparse
import collections
import csv
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402



def flag_mode(flags):
    """bench_gpu's recovery flags as the eval's mode name: "" kv0, "-R M" kv0rM, "-B R" kv0bR."""
    m = re.fullmatch(r"-([RB]) ([0-9.]+)", flags)
    return f"kv0{m.group(1).lower()}{m.group(2)}" if m else (flags or "kv0")


def read_ttft(paths):
    runs = collections.defaultdict(list)
    flags = None
    for line in (ln for path in paths for ln in open(path)):
        m = re.match(r"### bench_gpu .*-r \d+ ?(.*)$", line.rstrip())
        if m:
            flags = m.group(1).strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if flags is not None and len(cells) > 3 and cells[0] == "50":
            runs[flag_mode(flags)].append(float(cells[3]))
            runs["prompt"].append(float(cells[2]))
    return {mode: statistics.median(v) for mode, v in runs.items()}


def read_served(paths):
    runs = collections.defaultdict(list)
    for r in (r for path in paths for r in csv.DictReader(open(path))):
        m = re.search(r"r(\d+)$", r["label"])
        if not m or r["k"] != "50" or r["clients"] != "1" or r["max_tokens"] != "1":
            continue
        m = int(m.group(1))
        mode = "prompt" if r["mode"] == "prompt" else f"kv0r{m}" if m else "kv0"
        runs[mode].append(float(r["ttft_p50_ms"]))
    return {mode: statistics.median(v) for mode, v in runs.items()}


def read_nll(paths):
    """{(conv, question): {mode: NLL}} over categories 1-4, the files' rows merged."""
    nll = collections.defaultdict(dict)
    for path in paths:
        for r in csv.DictReader(open(path)):
            if r["category"] in ("1", "2", "3", "4") and r["nll"]:
                nll[(r["conv"], r["question"])][r["mode"]] = float(r["nll"])
    return nll


def shares(nll, modes):
    """The questions that have prompt, off and every mode, and each mode's share."""
    need = set(modes) | {"prompt", "off"}
    qs = [q for q, m in nll.items() if need <= m.keys()]
    den = sum(nll[q]["off"] - nll[q]["prompt"] for q in qs)
    return len(qs), {m: 100 * sum(nll[q]["off"] - nll[q][m] for q in qs) / den for m in modes}


def read_curve(paths):
    nll = read_nll(paths)
    ms = sorted({int(mode[4:]) for q in nll.values() for mode in q
                 if re.fullmatch(r"kv0r\d+", mode)})
    pts = [(0, "kv0")] + [(m, f"kv0r{m}") for m in ms]
    n, share = shares(nll, [mode for _, mode in pts])
    return n, pts, share


def plot_curve(ax, paths, ttft, where):
    groups = collections.defaultdict(list)  # k (from the file name) -> files
    for path in paths:
        k = re.search(r"_k(\d+)", path)
        groups[k.group(1) if k else "?"].append(path)
    for k, files in sorted(groups.items()):
        n, pts, share = read_curve(files)
        xs = [m for m, _ in pts]
        ys = [share[mode] for _, mode in pts]
        print(f"curve k = {k} ({n} questions): " +
              ", ".join(f"m = {m} {share[mode]:.1f}%" for m, mode in pts))
        ax.plot(xs, ys, "o-", label=f"k = {k} ({n} questions, CPU f32)")
        for (m, mode), y in zip(pts, ys):
            if mode in ttft and k == "20":
                ax.annotate(f"{ttft[mode]:.1f} ms", (m, y), textcoords="offset points",
                            xytext=(4, -12), fontsize=7)
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("first m tokens of every fact recomputed (fused)")
    ax.set_ylabel("share recovered, %")
    ax.set_title(f"Static recomputation over m (ms: {where} kv TTFT at k = 50, 8B shape)",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--served", action="append", default=[])
    ap.add_argument("--ttft", action="append", default=[])
    ap.add_argument("--gpu", default="H100", help="the card the costs were measured on")
    ap.add_argument("--nll", action="append", required=True)
    ap.add_argument("--curve", action="append")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not a.served and not a.ttft:
        ap.error("--served or --ttft is needed: the cost side")
    served = read_served(a.served)
    inproc = {m: v for m, v in read_ttft(a.ttft).items() if m not in served}
    ttft = {**inproc, **served}
    where = "served" if served else "in-process"
    if a.curve:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        plot_curve(ax2, a.curve, ttft, where)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in a.nll:
        k = re.search(r"_k(\d+)_", path)
        modes = [m for m in ttft if m != "prompt" and m in open(path).read()]
        n, share = shares(read_nll([path]), modes)
        label = f"k = {k.group(1) if k else '?'} facts retrieved ({n} questions)"
        print(f"{label}: " + ", ".join(f"{m} {share[m]:.1f}% at {ttft[m]:.2f} ms" for m in modes))
        pts = sorted((ttft[m], share[m], m) for m in modes)
        line, = ax.plot([p[0] for p in pts if p[2] in served],
                        [p[1] for p in pts if p[2] in served], "o", label=label)
        hollow = [p for p in pts if p[2] not in served]
        if hollow:
            ax.plot([p[0] for p in hollow], [p[1] for p in hollow], "o", mfc="none",
                    color=line.get_color(), label=f"{label}, in-process cost" if served else None)
        for x, y, m in pts:
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    if "prompt" in ttft:
        ax.axvline(ttft["prompt"], color="grey", ls=":", lw=0.8)
        ax.annotate(f"prompt mode {ttft['prompt']:.0f} ms", (ttft["prompt"], 5), fontsize=7,
                    rotation=90, textcoords="offset points", xytext=(-9, 0))
    ax.set_xlabel(f"kv TTFT at k = 50, ms (served: client p50, 1 client, 8B shape, {a.gpu})" if served else
                  f"kv TTFT at k = 50, ms (bench_gpu in-process, Llama-3.1-8B shape, {a.gpu})")
    ax.set_ylabel("share of prompt mode's NLL benefit recovered, %")
    ax.set_title("Recovery techniques: accuracy (SmolLM2, LoCoMo) vs cost (8B shape)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)


if __name__ == "__main__":
    main()

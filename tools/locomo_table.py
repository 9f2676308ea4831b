#!/usr/bin/env python3
"""Merges CSVs written by `inferscale eval locomo` (one run, or several runs
over disjoint conversations, e.g. parallel processes on a GPU machine) and
prints the same table by mode and category that the eval prints, then each
mode's F1 over prompt mode's (categories 1-4) with a 95% paired bootstrap
interval over the questions.

Rows are keyed by (conversation, question, mode); a later file's row replaces
an earlier one's, so a run interrupted part-way and redone can be merged.
Only conversations whose every question has a row in every mode count:
a partial conversation is reported and left out.

usage: tools/locomo_table.py [--out MERGED.csv] FILE.csv [FILE.csv ...]
       tools/locomo_table.py --nll [--same-as OTHER.nll.csv] [--out MERGED.nll.csv] FILE.nll.csv [...]

--nll merges the per-question files of `eval locomo --nll` (FILE.nll.csv)
instead and prints its table (gold NLL, recovered share, first-token KL and
top-1 agreement with prompt mode, P(list item)) with 95% paired bootstrap
intervals over the questions that have a row in every mode (numpy's
generator, fixed seed: the intervals differ from the eval's own by
resampling noise only). --same-as keeps only the questions that OTHER also
has in full, so two runs (say, with and without dates) compare on the same
questions.
"""
import argparse
import collections
import csv
import json
import os
import sys

CATS = {1: "1 multi-hop", 2: "2 temporal", 3: "3 open-domain", 4: "4 single-hop", 5: "5 adversarial"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--out", help="write the merged rows here")
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "locomo"),
                    help="LoCoMo conversations, to check each conversation is complete")
    ap.add_argument("--k", type=int, default=None, help="k, for the header")
    ap.add_argument("--nll", action="store_true", help="the files are FILE.nll.csv of `eval locomo --nll`")
    ap.add_argument("--same-as", help="with --nll: only questions complete in this file too")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    a = ap.parse_args()
    if a.nll:
        return nll_table(a)

    rows, header = {}, None
    for path in a.csv:
        with open(path, newline="") as f:
            r = csv.DictReader(f)
            header = r.fieldnames
            for row in r:
                rows[(row["conv"], int(row["question"]), row["mode"])] = row
    modes = []
    for (_, _, m) in rows:
        if m not in modes:
            modes.append(m)
    modes.sort(key=lambda m: (m != "prompt", m))

    # Completeness: every question of the conversation in every mode.
    complete = []
    for conv in sorted({c for (c, _, _) in rows}):
        path = os.path.join(a.data_dir, conv + ".json")
        nq = len(json.load(open(path))["qa"]) if os.path.exists(path) else None
        have = {q for (c, q, m) in rows if c == conv}
        full = nq is not None and all((conv, q, m) in rows for q in range(nq) for m in modes)
        if full:
            complete.append(conv)
        else:
            print(f"conversation {conv}: incomplete ({len(have)} of {nq} questions), left out", file=sys.stderr)

    acc = collections.defaultdict(lambda: collections.defaultdict(float))
    for (conv, q, m), row in rows.items():
        if conv not in complete:
            continue
        cat = int(row["category"])
        for key in ([cat, "all"] if cat <= 4 else [cat]):
            d = acc[(m, key)]
            d["n"] += 1
            d["f1"] += float(row["f1"])
            d["em"] += float(row["em"])
            d["recall"] += float(row["recall"])
            d["ttft"] += float(row["ttft_ms"])
            if row["agree_prompt"] != "":
                d["n_agree"] += 1
                d["agree"] += float(row["agree_prompt"])
                d["f1p"] += float(row["f1_vs_prompt"])

    k = f"@{a.k}" if a.k else "@k"
    print(f"conversations: {', '.join(complete)}\n")
    print(f"| mode | category | n | F1 | EM | recall{k} | agree w/ prompt | F1 vs prompt | TTFT ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        for key, label in [(1, CATS[1]), (2, CATS[2]), (3, CATS[3]), (4, CATS[4]), ("all", "**1-4 all**"), (5, CATS[5])]:
            d = acc.get((m, key))
            if not d or not d["n"]:
                continue
            n = d["n"]
            ag = f"{d['agree'] / d['n_agree']:.3f}" if d["n_agree"] else "-"
            fp = f"{d['f1p'] / d['n_agree']:.3f}" if d["n_agree"] else "-"
            print(f"| {m} | {label} | {int(n)} | {d['f1'] / n:.3f} | {d['em'] / n:.3f} | {d['recall'] / n:.3f} | "
                  f"{ag} | {fp} | {d['ttft'] / n:.0f} |")

    f1_ratios(rows, complete, modes, a.bootstrap)

    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            for key in sorted(rows):
                if key[0] in complete:
                    w.writerow(rows[key])


def f1_ratios(rows, complete, modes, n_boot):
    """Each mode's mean F1 over prompt mode's, categories 1-4, with a 95%
    paired bootstrap interval over questions (the issue's "kv F1 at least
    95% of prompt F1")."""
    import numpy as np

    if "prompt" not in modes:
        return
    qs = sorted({(c, q) for (c, q, m), r in rows.items()
                 if c in complete and int(r["category"]) <= 4})
    if not qs:
        return
    f1 = {m: np.array([float(rows[(c, q, m)]["f1"]) for c, q in qs]) for m in modes}
    rng = np.random.default_rng(1234)
    idx = rng.integers(0, len(qs), size=(n_boot, len(qs)))
    print(f"\nF1 over prompt mode's, categories 1-4 ({len(qs)} questions; 95% paired bootstrap):\n")
    print("| mode | F1 | F1 / prompt F1 |")
    print("|---|---:|---:|")
    for m in modes:
        if m == "prompt":
            continue
        boot = f1[m][idx].sum(axis=1) / np.maximum(f1["prompt"][idx].sum(axis=1), 1e-12)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(f"| {m} | {f1[m].mean():.3f} | {100 * f1[m].sum() / f1['prompt'].sum():.1f}% "
              f"[{100 * lo:.1f}, {100 * hi:.1f}] |")


def nll_load(paths):
    """{(conv, q): {mode: row}} over the questions complete in every mode."""
    rows = collections.defaultdict(dict)
    modes, header = [], []
    for path in paths:
        with open(path, newline="") as f:
            r = csv.DictReader(f)
            header = r.fieldnames
            for row in r:
                rows[(row["conv"], int(row["question"]))][row["mode"]] = row
                if row["mode"] not in modes:
                    modes.append(row["mode"])
    full = {key: r for key, r in rows.items() if all(m in r for m in modes)}
    return full, modes, header


def nll_table(a):
    import numpy as np

    full, modes, header = nll_load(a.csv)
    if a.same_as:
        other, _, _ = nll_load([a.same_as])
        full = {key: r for key, r in full.items() if key in other}
    keys = sorted(full)
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            for key in keys:
                for m in modes:
                    w.writerow(full[key][m])
    rng_seed = 1234
    print(f"{len(keys)} questions of categories 1-4 complete in every mode "
          f"({len({c for c, _ in keys})} conversations)\n")
    print("| category | mode | n | gold NLL | recovered share % | KL(prompt‖mode) | top-1 = prompt % | P(list item) % |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")

    def ci(num, den=None, scale=1.0, prec=3):
        num = np.asarray(num, dtype=np.float64)
        n = len(num)
        if n == 0:
            return "-"
        den = np.ones(n) if den is None else np.asarray(den, dtype=np.float64)
        rng = np.random.default_rng(rng_seed)
        idx = rng.integers(0, n, size=(a.bootstrap, n))
        s_num, s_den = num[idx].sum(axis=1), den[idx].sum(axis=1)
        ok = s_den != 0
        stat = s_num[ok] / s_den[ok]
        point = num.sum() / den.sum() if den.sum() != 0 else float("nan")
        lo, hi = np.percentile(stat, [2.5, 97.5])
        return f"{point * scale:.{prec}f} [{lo * scale:.{prec}f}, {hi * scale:.{prec}f}]"

    for cat, label in [(1, CATS[1]), (2, CATS[2]), (3, CATS[3]), (4, CATS[4]), (0, "1-4 all")]:
        sel = [full[k] for k in keys if cat == 0 or int(full[k][modes[0]]["category"]) == cat]
        if not sel:
            continue
        for m in modes:
            nll = [float(r[m]["nll"]) for r in sel]
            rec = kl = ag = "-"
            if m != "prompt":
                kl = ci([float(r[m]["kl_vs_prompt"]) for r in sel])
                ag = ci([float(r[m]["top1_agree_prompt"]) for r in sel], scale=100, prec=1)
            if m not in ("prompt", "off") and "off" in modes and "prompt" in modes:
                rec = ci([float(r["off"]["nll"]) - float(r[m]["nll"]) for r in sel],
                         [float(r["off"]["nll"]) - float(r["prompt"]["nll"]) for r in sel], scale=100, prec=1)
            pl = ci([float(r[m]["p_list"]) for r in sel], scale=100, prec=1)
            print(f"| {label} | {m} | {len(sel)} | {ci(nll)} | {rec} | {kl} | {ag} | {pl} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Merges CSVs written by `inferscale eval locomo` (one run, or several runs
over disjoint conversations, e.g. parallel processes on a GPU machine) and
prints the same table by mode and category that the eval prints.

Rows are keyed by (conversation, question, mode); a later file's row replaces
an earlier one's, so a run interrupted part-way and redone can be merged.
Only conversations whose every question has a row in every mode count:
a partial conversation is reported and left out.

usage: tools/locomo_table.py [--out MERGED.csv] FILE.csv [FILE.csv ...]
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
    a = ap.parse_args()

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

    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            for key in sorted(rows):
                if key[0] in complete:
                    w.writerow(rows[key])


if __name__ == "__main__":
    main()

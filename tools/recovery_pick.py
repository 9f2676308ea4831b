#!/usr/bin/env python3
"""Picks a kv mode (e.g. a memory scaling kv0t0.85s2) by its recovered share
on tuning conversations only, from `inferscale eval locomo --nll` rows
(FILE.nll.csv), so that the reported conversations play no part in the
choice.

recovered share = sum(NLL_off - NLL_mode) / sum(NLL_off - NLL_prompt) over
the questions (categories 1-4) of the tuning conversations that every mode
scored. Prints the best kv mode's name on stdout and the whole ranking on
stderr. Ties keep the mode listed first.

  tools/recovery_pick.py --tune "26 30" out/k20_*.csv.nll.csv
"""
import argparse
import csv
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="FILE.nll.csv files of eval locomo --nll")
    ap.add_argument("--tune", required=True, help="tuning conversations, space- or comma-separated")
    ap.add_argument("--no-recompute", action="store_true",
                    help="only modes without recomputation (no 'r' or 'b' part): the scalings alone")
    a = ap.parse_args()
    tune = set(a.tune.replace(",", " ").split())
    rows = {}  # (conv, question) -> {mode: nll}
    order = []
    for path in a.csv:
        try:
            with open(path, newline="") as f:
                for r in csv.DictReader(f):
                    if r["conv"] not in tune or not (1 <= int(r["category"]) <= 4):
                        continue
                    rows.setdefault((r["conv"], r["question"]), {})[r["mode"]] = float(r["nll"])
                    if r["mode"] not in order:
                        order.append(r["mode"])
        except (OSError, KeyError, ValueError) as e:
            print(f"recovery_pick: skipping {path}: {e}", file=sys.stderr)
    kv = [m for m in order if m.startswith("kv") and not (a.no_recompute and ("r" in m or "b" in m))]
    if not kv or "prompt" not in order or "off" not in order:
        print("recovery_pick: no prompt, off and kv rows for the tuning conversations", file=sys.stderr)
        print("kv0")
        return 1
    full = [q for q in rows.values() if all(m in q for m in ["prompt", "off"] + kv)]
    denom = sum(q["off"] - q["prompt"] for q in full)
    if not full or denom == 0:
        print("recovery_pick: no complete question", file=sys.stderr)
        print("kv0")
        return 1
    share = {m: sum(q["off"] - q[m] for q in full) / denom for m in kv}
    ranked = sorted(kv, key=lambda m: (-share[m], kv.index(m)))
    print(f"recovery_pick: {len(full)} questions of conversations {sorted(tune)}", file=sys.stderr)
    for m in ranked:
        print(f"  {m:14s} {100 * share[m]:6.1f}%", file=sys.stderr)
    print(ranked[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

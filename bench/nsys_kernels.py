#!/usr/bin/env python3
"""Per-kernel table from an Nsight Systems report (bench/run_gpu_bench.sh, NSYS=1).

The op profiler of the CUDA backend times whole ops (an attention op is an
upload, the flash kernel and the merge kernel); this splits them into kernels.
Kernels are grouped by name and grid, so the same kernel at a kv request's
shape (30 query tokens) and at a prompt's shape fall in different rows.

usage: nsys_kernels.py REPORT.nsys-rep [--top N]
"""
import argparse
import csv
import io
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=45)
    a = ap.parse_args()
    r = subprocess.run(["nsys", "stats", "-q", "--report", "cuda_gpu_trace", "--format", "csv",
                        "--output", "-", a.report], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("nsys stats failed: " + r.stderr[-2000:])
    text = r.stdout[r.stdout.find('"Start'):] if '"Start' in r.stdout else r.stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        sys.exit("no rows in the trace")
    col = {k.split(" (")[0]: k for k in rows[0].keys()}
    groups = {}
    for row in rows:
        name = row[col["Name"]]
        grid = "x".join(row.get(col.get(g, g), "") or "" for g in ("GrdX", "GrdY", "GrdZ"))
        if grid.strip("x") == "":
            grid = "-"  # a copy or memset
        groups.setdefault((name[:70], grid), []).append(float(row[col["Duration"]]) / 1e3)
    table = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[: a.top]
    print("| kernel | grid | count | median us | total ms |")
    print("|---|---|---:|---:|---:|")
    for (name, grid), d in table:
        print(f"| {name} | {grid} | {len(d)} | {statistics.median(d):.1f} | {sum(d) / 1e3:.2f} |")


if __name__ == "__main__":
    main()

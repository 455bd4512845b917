"""Summarise Nsight Compute's per-instruction warp-stall sampling (the source page as CSV) of one kernel.

    ncu --section SourceCounters -k regex:NAME --launch-skip S --launch-count 1 -o rep ./binary ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/probes/ncu_regions.py src.csv [--top 40]

Prints (1) regions: runs of consecutive SASS instructions with the same execution count (a loop body, a phase,
a branch arm), each with its share of the executed warp-instructions and of the stall samples, the four largest
stall reasons and its first instruction; (2) the instructions with the most samples, each with the two
instructions before it (what it waits on is usually there). Column names differ between ncu versions: the
stall reasons are the ``stall_<reason>`` columns of ncu 2025; the header is printed first so a mismatch shows.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys


def _num(s: str) -> float:
    s = (s or "").replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def load(path: str):
    """Rows of the CSV's SASS table as dicts, and the header; skips ncu's preamble lines before the header."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"') or ln.startswith("Address")), None)
    if start is None:
        sys.exit(f"{path}: no SASS table (a header line starting with Address) found")
    rd = csv.reader(lines[start:])
    header = next(rd)
    rows = [dict(zip(header, r)) for r in rd if len(r) == len(header)]
    return header, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40, help="instructions with the most samples to list")
    a = ap.parse_args(argv)
    header, rows = load(a.csv)
    print("columns:", " | ".join(header))

    def col(*pats):
        for p in pats:
            for h in header:
                if re.search(p, h, re.I):
                    return h
        return None

    c_src = col(r"^Source$")
    c_samp = col(r"Warp Stall Sampling \(All", r"stall_sampl.*all", r"Sampling.*All")
    c_exec = col(r"^Instructions Executed$", r"inst_executed$", r"Instructions Executed")
    if not (c_src and c_samp and c_exec):
        sys.exit(f"missing columns: source {c_src}, samples {c_samp}, executed {c_exec}")
    # the stall reasons: ncu 2025's "stall_<reason>" columns (all samples; not the "(Not Issued)" copies)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    if not reasons:
        sys.exit("no stall_<reason> columns in the CSV (an ncu version that names them otherwise)")
    tot_s = sum(_num(r[c_samp]) for r in rows) or 1.0
    tot_e = sum(_num(r[c_exec]) for r in rows) or 1.0
    print(f"total samples {tot_s:.0f}, warp-instructions executed {tot_e:.0f}, {len(rows)} instructions")

    def top_reasons(rs, k=4):
        agg = {h: sum(_num(r.get(h)) for r in rs) for h in reasons}
        s = sum(agg.values()) or 1.0
        best = sorted(agg.items(), key=lambda kv: -kv[1])[:k]
        return " ".join(f"{_short(h)}={100 * v / s:.0f}" for h, v in best if v > 0)

    print("\n## regions (runs of equal execution count; share of executed instructions / of samples)")
    i = 0
    while i < len(rows):
        j = i
        e = _num(rows[i][c_exec])
        while j + 1 < len(rows) and _num(rows[j + 1][c_exec]) == e:
            j += 1
        rs = rows[i:j + 1]
        ins = sum(_num(r[c_exec]) for r in rs) / tot_e * 100
        sm = sum(_num(r[c_samp]) for r in rs) / tot_s * 100
        if sm >= 0.5 or ins >= 0.5:
            print(f"@{i:5d} n={len(rs):4d} exec={e:9.0f} instr%={ins:5.1f} samples%={sm:5.1f} "
                  f"{top_reasons(rs)} | {rs[0][c_src].strip()[:60]}")
        i = j + 1

    print(f"\n## the {a.top} instructions with the most samples (with the two before each)")
    order = sorted(range(len(rows)), key=lambda k: -_num(rows[k][c_samp]))[:a.top]
    for k in sorted(order):
        r = rows[k]
        ctx = " ; ".join(rows[m][c_src].strip()[:40] for m in range(max(0, k - 2), k))
        print(f"@{k:5d} samples%={100 * _num(r[c_samp]) / tot_s:5.2f} {top_reasons([r], 3):40s} "
              f"| {r[c_src].strip()[:56]}   <- {ctx}")


def _short(h: str) -> str:
    return h[len("stall_"):]


if __name__ == "__main__":
    main()

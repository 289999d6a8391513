"""Pool the in-job A/B rounds of several `fault_tolerance.py --ab-rounds` runs: live (or copying) commits'
window over the same round's no-commit window, median and the distribution-free 95% interval of the median.

Run:  cd benchmarks && python fault_tolerance_pool.py "after=results/fault_tolerance-cpu2-run9-ab-after-np4-*.windows.jsonl" \\
             "before=results/fault_tolerance-cpu2-run9-ab-before-np4-*.windows.jsonl"   (--mode none2: the control)

Each file is the window rows of one run's rank 0 log (`--keep DIR`: DIR/ab-N/log.jsonl, or the rows with
"what": "window" copied out of it). Rounds are paired within their own run only. Also printed: rank 0's
median share of its live window spent inside `commit()`, and the mean number of votes (the commits'
int64 allreduces) per live window, where the log counted them.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics

from dp_vs_ddp import median_ci


def rounds(path: str, mode: str) -> tuple[list[float], list[float], list[int]]:
    """One run's per-round ratios (``mode`` over "none"), its ``mode`` windows' shares inside commit(), votes."""
    with open(path) as f:
        wins = [r for r in map(json.loads, f) if r.get("what") == "window"]
    by: dict[int, dict[str, dict]] = {}
    for r in wins:
        by.setdefault(r["round"], {})[r["mode"]] = r
    ratios = [got[mode]["s"] / got["none"]["s"] for _, got in sorted(by.items()) if mode in got and "none" in got]
    mine = [r for r in wins if r["mode"] == mode]
    return ratios, [r["commit_s"] / r["s"] for r in mine], [r["votes"] for r in mine if "votes" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="+", metavar="LABEL=GLOB", help="a label and the window files pooled under it")
    p.add_argument("--mode", default="live", choices=("live", "copy", "none2"))
    a = p.parse_args()
    for group in a.groups:
        label, sep, pattern = group.partition("=")
        files = sorted(glob.glob(pattern)) if sep else []
        if not files:
            p.error(f"{group!r}: give LABEL=GLOB matching at least one window file")
        ratios, inside, votes, each = [], [], [], []
        for path in files:
            r, i, v = rounds(path, a.mode)
            ratios += r
            inside += i
            votes += v
            each.append(f"{statistics.median(r):.3f}" if r else "-")
        ci = median_ci(ratios)
        print(f"{label}: {a.mode} {statistics.median(ratios):.3f} [CI {ci[0]:.3f}-{ci[1]:.3f}], {len(ratios)} rounds, "
              f"{len(files)} runs (each {', '.join(each)}); inside commit() {statistics.median(inside):.2%}"
              + (f"; votes per window {statistics.mean(votes):.2f}" if votes else ""))


if __name__ == "__main__":
    main()

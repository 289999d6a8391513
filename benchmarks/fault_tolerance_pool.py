"""Pool the in-job A/B rounds of several `fault_tolerance.py --ab-rounds` runs: live (or copying) commits'
window over the same round's no-commit window, median and the distribution-free 95% interval of the median.

Run:  cd benchmarks && python fault_tolerance_pool.py "after=results/fault_tolerance-cpu2-run9-ab-after-np4-*.windows.jsonl" \\
             "before=results/fault_tolerance-cpu2-run9-ab-before-np4-*.windows.jsonl"   (--mode none2: the control)

Each file is the window rows of one run's log (`--keep DIR`: DIR/ab-N/log.jsonl, or the rows with
"what": "window" or "rank_window" copied out of it). Rounds are paired within their own run only (rank 0's
windows). Also printed: rank 0's median share of its live window spent inside `commit()`, the mean number
of votes (the commits' int64 allreduces) per live window, and every rank's share where the log has it.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics

from dp_vs_ddp import median_ci


def rounds(path: str, mode: str) -> tuple[list[float], list[float], list[int], dict[int, list[float]]]:
    """One run's per-round ratios (``mode`` over "none"), its ``mode`` windows' shares inside commit(), votes,
    and every rank's shares where the log has them (rank 0's rows are "window", the others' "rank_window")."""
    with open(path) as f:
        every = [r for r in map(json.loads, f) if r.get("what") in ("window", "rank_window")]
    wins = [r for r in every if r["what"] == "window"]
    by: dict[int, dict[str, dict]] = {}
    for r in wins:
        by.setdefault(r["round"], {})[r["mode"]] = r
    ratios = [got[mode]["s"] / got["none"]["s"] for _, got in sorted(by.items()) if mode in got and "none" in got]
    mine = [r for r in wins if r["mode"] == mode]
    ranks: dict[int, list[float]] = {}
    for r in every:
        if r["mode"] == mode and "rank" in r:
            ranks.setdefault(r["rank"], []).append(r["commit_s"] / r["s"])
    return ratios, [r["commit_s"] / r["s"] for r in mine], [r["votes"] for r in mine if "votes" in r], ranks


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
        ratios, inside, votes, each, ranks = [], [], [], [], {}
        for path in files:
            r, i, v, k = rounds(path, a.mode)
            ratios += r
            inside += i
            votes += v
            for rank, shares in k.items():
                ranks.setdefault(rank, []).extend(shares)
            each.append(f"{statistics.median(r):.3f}" if r else "-")
        ci = median_ci(ratios)
        print(f"{label}: {a.mode} {statistics.median(ratios):.3f} [CI {ci[0]:.3f}-{ci[1]:.3f}], {len(ratios)} rounds, "
              f"{len(files)} runs (each {', '.join(each)}); inside commit() {statistics.median(inside):.2%}"
              + (f"; votes per window {statistics.mean(votes):.2f}" if votes else "")
              + ("; every rank inside commit(): " + ", ".join(f"r{k} {statistics.median(v):.2%}" for k, v in
                                                           sorted(ranks.items())) if len(ranks) > 1 else ""))


if __name__ == "__main__":
    main()

"""``phalanx report``: scaling report (throughput, speedup, efficiency, Amdahl's P) as HTML + PNG.

Example::

    phalanx report --np 4                        # the digits demo at 1, 2, 3, 4 workers
    phalanx report --np 2 --out scaling -- python train.py
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="measure scaling at 1..N workers and write an HTML/PNG report",
                              description="Run the demo (or COMMAND under `phalanx run`) at 1..N workers.")
    p.add_argument("--np", type=int, default=2, help="largest worker count (default 2)")
    p.add_argument("--workers", default=None, help="explicit comma-separated worker counts, e.g. 1,2,4")
    p.add_argument("--out", default="phalanx-report", help="output folder (default phalanx-report)")
    p.add_argument("--epochs", type=int, default=3, help="demo epochs per run (default 3)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="optional command to run instead of the demo")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from phalanx.profiler import report

    try:
        workers = [int(w) for w in args.workers.split(",")] if args.workers else list(range(1, args.np + 1))
        if 1 not in workers or min(workers) < 1:
            raise ValueError("--workers must include 1 (the baseline) and only positive counts")
    except ValueError as err:
        print(f"phalanx report: {err}", file=sys.stderr)
        return 2
    command = [c for c in args.command if c != "--"]
    if command:
        rows = report.measure_script(workers, command, timeout=args.timeout)
        unit = "runs/s (1 / job wall time)"
        note = (f"command: {' '.join(command)}; a whole run per point, start-up included: this is the "
                "scaling of a fixed amount of work (strong scaling) only if the script splits its work "
                "over the workers")
    else:
        from phalanx.demo import measure

        rows = [report.ScalingRow(*row) for row in measure(workers, epochs=args.epochs, timeout=args.timeout)]
        unit, note = "samples/s", f"digits MLP demo, {args.epochs} epochs, global batch 128"
    out = report.write_report(rows, args.out, unit=unit, note=note)
    print(f"{'workers':>8} {unit:>12} {'speedup':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r.workers:>8} {r.throughput:>12.4g} {out['speedup'][r.workers]:>8.2f} "
              f"{out['efficiency'][r.workers]:>10.0%}")
    print(f"Amdahl P = {out['amdahl_p']:.3f}; report: {out['html']}")
    return 0

"""``phalanx demo``: data-parallel training on scikit-learn's bundled digits, then a scaling report.

It trains the same MLP with the same global batch twice: on ``--np`` workers
and on one, and prints test accuracy, samples per second, speedup and scaling
efficiency. Nothing is downloaded (the digits ship inside scikit-learn).

    phalanx demo                 # 2 workers, 10 epochs
    phalanx demo --np 4 --epochs 20

``phalanx report`` runs the same training at several worker counts
(:func:`phalanx.demo.measure`). The workload itself is :mod:`phalanx.demo`.
"""

from __future__ import annotations

import argparse
import sys

from phalanx.demo import threads_per_worker, train

__all__ = ["check", "register"]

_TARGET_ACCURACY = 0.9


def check(np: int, global_batch: int, epochs: int) -> str | None:
    """What is wrong with these demo settings (one line), or None."""
    if np < 1:
        return f"--np must be at least 1, got {np}"
    if epochs < 1:
        return f"--epochs must be at least 1, got {epochs}"
    if global_batch < 1:
        return f"--batch must be at least 1, got {global_batch}"
    if global_batch % np:
        near = [b for b in (global_batch - global_batch % np, global_batch - global_batch % np + np) if b > 0]
        return (f"--batch {global_batch} (the global batch) is not divisible by --np {np}; "
                f"use --batch {' or '.join(map(str, near))}, or another --np")
    return None


def _run(args: argparse.Namespace) -> int:
    from phalanx.launcher.spawn import run

    problem = check(args.np, args.batch, args.epochs)
    if problem:
        print(f"phalanx demo: {problem}", file=sys.stderr)
        return 2
    kwargs = {"epochs": args.epochs, "global_batch": args.batch, "lr": args.lr, "hidden": args.hidden}
    # Like with like: every worker has the same cores in both runs, as adding a GPU or a machine
    # adds its own compute (a single process given all the cores is not what scaling out buys).
    threads = threads_per_worker(args.np)
    print(f"phalanx demo: MLP on digits, {args.epochs} epochs, global batch {args.batch}: "
          f"{args.np} workers against 1, each worker on {threads} core(s) in both runs")
    multi = run(train, np=args.np, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    single = run(train, np=1, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    speedup = single["seconds"] / multi["seconds"]
    print(f"{'workers':>8} {'test acc':>9} {'samples/s':>10} {'time s':>7}")
    for n, r in ((args.np, multi), (1, single)):
        print(f"{n:>8} {r['accuracy']:>9.4f} {r['samples_per_s']:>10.0f} {r['seconds']:>7.2f}")
    print(f"speedup {speedup:.2f}x: {args.np} workers x {threads} core(s) against 1 worker x {threads} "
          f"core(s), scaling efficiency {speedup / args.np:.0%}")
    if multi["accuracy"] < _TARGET_ACCURACY:
        print(f"test accuracy {multi['accuracy']:.1%} after {args.epochs} epoch(s) (10 epochs usually reach "
              f"{_TARGET_ACCURACY:.0%}; train longer with --epochs)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train on the bundled digits data and report scaling")
    p.add_argument("--np", type=int, default=2, help="number of workers (default %(default)s)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the data (default %(default)s)")
    p.add_argument("--batch", type=int, default=128,
                   help="global batch size, split evenly over the workers (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default %(default)s)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before a hung run is stopped (default %(default)s)")
    p.set_defaults(func=_run)

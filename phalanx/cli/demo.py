"""``phalanx demo``: data-parallel training on scikit-learn's bundled digits, then a scaling report.

It trains the same MLP with the same global batch twice: on ``--np`` workers
and on one, and prints test accuracy, samples per second, speedup and scaling
efficiency. Nothing is downloaded (the digits ship inside scikit-learn).

    phalanx demo                 # 2 workers, 10 epochs
    phalanx demo --np 4 --epochs 20

``phalanx report`` runs the same training at several worker counts (:func:`measure`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["load_digits", "make_model", "train", "measure", "register"]

_TARGET_ACCURACY = 0.9


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """Digits as float tensors ``(x_train, y_train, x_test, y_test)``, pixels scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as err:  # pragma: no cover - the demo extra installs it
        raise SystemExit("phalanx demo needs scikit-learn: pip install 'phalanx[demo]'") from err
    data = _load()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train_idx = order[:n_test], order[n_test:]
    return x[train_idx], y[train_idx], x[test], y[test]


def make_model(hidden: int = 512, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def train(epochs: int = 10, global_batch: int = 64, lr: float = 0.05, hidden: int = 512, progress: bool = True):
    """One rank's share of the run (``phalanx.init()`` already done). Returns a result dict."""
    from phalanx.comm.collectives import barrier
    from phalanx.parallel.data import DataParallel
    from phalanx.runtime import topology

    topo = topology()
    if global_batch % topo.size:
        raise ValueError(f"global batch {global_batch} is not divisible by {topo.size} workers")
    local_batch = global_batch // topo.size
    x_train, y_train, x_test, y_test = load_digits()
    model = DataParallel(make_model(hidden))  # fused, overlapped gradient averaging
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(x_train) // global_batch
    bar = None
    if progress and topo.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, desc=f"{topo.size} worker(s)", unit="step",
                   leave=False, disable=None, mininterval=0.5)
    barrier()
    started = time.perf_counter()
    for epoch in range(epochs):
        # The same global permutation on every rank; each takes its slice of every global batch.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            idx = order[step * global_batch + topo.rank * local_batch:][:local_batch]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()  # gradients are averaged across workers when this returns
            optimizer.step()
            if bar is not None:
                bar.update()
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
    barrier()
    elapsed = time.perf_counter() - started
    if bar is not None:
        bar.close()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    samples = epochs * steps_per_epoch * global_batch
    return {"accuracy": accuracy, "seconds": elapsed, "samples_per_s": samples / elapsed}


def measure(workers: Sequence[int], epochs: int = 3, global_batch: int = 128, hidden: int = 1024,
            timeout: float = 600.0):
    """Train with the same global batch on each worker count; ``[(workers, samples/s, seconds)]``."""
    from phalanx.launcher.spawn import run

    rows = []
    # Every worker gets the same share of cores at every count, as adding machines would.
    threads = max(1, (os.cpu_count() or 1) // max(workers))
    for n in workers:
        kwargs = {"epochs": epochs, "global_batch": global_batch, "hidden": hidden, "progress": False}
        result = run(train, np=n, kwargs=kwargs, timeout=timeout, threads=threads)[0]
        rows.append((n, result["samples_per_s"], result["seconds"]))
    return rows


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
    print(f"phalanx demo: MLP on digits, {args.epochs} epochs, global batch {args.batch}, "
          f"{args.np} workers vs 1")
    # Each worker gets the same share of cores in both runs, as adding machines would.
    threads = max(1, (os.cpu_count() or 1) // args.np)
    multi = run(train, np=args.np, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    single = run(train, np=1, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    speedup = single["seconds"] / multi["seconds"]
    print(f"{'workers':>8} {'test acc':>9} {'samples/s':>10} {'time s':>7}")
    for n, r in ((args.np, multi), (1, single)):
        print(f"{n:>8} {r['accuracy']:>9.4f} {r['samples_per_s']:>10.0f} {r['seconds']:>7.2f}")
    print(f"speedup {speedup:.2f}x on {args.np} workers ({threads} core(s) each), "
          f"scaling efficiency {speedup / args.np:.0%}")
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

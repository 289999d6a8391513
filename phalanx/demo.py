"""``phalanx demo``: data-parallel training on scikit-learn's bundled digits, then a scaling report.

It trains the same MLP with the same global batch twice: on ``--np`` workers
and on one, and prints test accuracy, samples per second, speedup and scaling
efficiency. Nothing is downloaded (the digits ship inside scikit-learn).

    phalanx demo                 # 2 workers, 10 epochs
    phalanx demo --np 4 --epochs 20
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

__all__ = ["load_digits", "make_model", "train", "register"]


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
    import phalanx as px

    topo = px.topology()
    if global_batch % topo.size:
        raise ValueError(f"global batch {global_batch} is not divisible by {topo.size} workers")
    local_batch = global_batch // topo.size
    x_train, y_train, x_test, y_test = load_digits()
    model = px.DataParallel(make_model(hidden))  # fused, overlapped gradient averaging
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(x_train) // global_batch
    bar = None
    if progress and topo.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, desc=f"{topo.size} worker(s)", unit="step",
                   leave=False, disable=None, mininterval=0.5)
    px.barrier()
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
    px.barrier()
    elapsed = time.perf_counter() - started
    if bar is not None:
        bar.close()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    samples = epochs * steps_per_epoch * global_batch
    return {"accuracy": accuracy, "seconds": elapsed, "samples_per_s": samples / elapsed}


def _run(args: argparse.Namespace) -> int:
    import phalanx as px

    kwargs = {"epochs": args.epochs, "global_batch": args.batch, "lr": args.lr, "hidden": args.hidden}
    print(f"phalanx demo: MLP on digits, {args.epochs} epochs, global batch {args.batch}, "
          f"{args.np} workers vs 1")
    # Each worker gets the same share of cores in both runs, as adding machines would.
    threads = max(1, (os.cpu_count() or 1) // args.np)
    multi = px.run(train, np=args.np, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    single = px.run(train, np=1, kwargs=kwargs, timeout=args.timeout, threads=threads)[0]
    speedup = single["seconds"] / multi["seconds"]
    print(f"{'workers':>8} {'test acc':>9} {'samples/s':>10} {'time s':>7}")
    for n, r in ((args.np, multi), (1, single)):
        print(f"{n:>8} {r['accuracy']:>9.4f} {r['samples_per_s']:>10.0f} {r['seconds']:>7.2f}")
    print(f"speedup {speedup:.2f}x on {args.np} workers ({threads} core(s) each), "
          f"scaling efficiency {speedup / args.np:.0%}")
    if multi["accuracy"] < 0.9:
        print("phalanx demo: accuracy below 90% — training did not converge")
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train on the bundled digits data and report scaling")
    p.add_argument("--np", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="global batch size (default 64)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run is stopped")
    p.set_defaults(func=_run)

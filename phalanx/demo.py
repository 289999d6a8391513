"""The digits demo's workload: data, model, one rank's training, and a run at several worker counts.

scikit-learn's bundled digits (1797 8x8 images, nothing downloaded), an MLP, SGD with
momentum under :class:`~phalanx.parallel.data.DataParallel`. ``phalanx demo``
(:mod:`phalanx.cli.demo`) and ``phalanx report`` run it; examples, tests and benchmarks
take its data from here.

Example::

    from phalanx.demo import load_digits
    x_train, y_train, x_test, y_test = load_digits()
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["load_digits", "make_model", "train", "measure", "threads_per_worker"]


def threads_per_worker(workers: int) -> int:
    """Cores each worker gets, the same at every worker count (as adding a machine or a GPU adds
    its own compute): the machine's cores split over the largest count."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


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
    threads = threads_per_worker(max(workers))
    for n in workers:
        kwargs = {"epochs": epochs, "global_batch": global_batch, "hidden": hidden, "progress": False}
        result = run(train, np=n, kwargs=kwargs, timeout=timeout, threads=threads)[0]
        rows.append((n, result["samples_per_s"], result["seconds"]))
    return rows



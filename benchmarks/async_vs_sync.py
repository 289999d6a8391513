"""Sync DP vs async PS vs SSP vs local SGD with one worker made 3x slower (injected sleep).

Run:  python benchmarks/async_vs_sync.py --seconds 5 --repeats 3

Every method trains the same MLP on digits for a fixed wall time with 3 workers;
the parameter-server runs add one server rank. A worker's "compute" is its real
forward/backward plus a sleep of --step-ms (3x that on worker 0). Prints samples/s
(all workers together) and test accuracy after the time is up; the median over
interleaved repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits
from phalanx.ps import LocalSGD, run_ps

WORKERS, LOCAL_BATCH = 3, 32


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _adam(params):
    return torch.optim.Adam(params, lr=2e-3)


def _batches(index, seed=0):
    x, y, _, _ = load_digits()  # loaded here, before the clock starts (sklearn import is slow)
    g = torch.Generator().manual_seed(seed * 100 + index)
    yield None
    while True:
        idx = torch.randint(len(x), (LOCAL_BATCH,), generator=g)
        yield x[idx], y[idx]


_TEST = []


def _accuracy(model):
    if not _TEST:
        _TEST.extend(load_digits()[2:])
    xt, yt = _TEST
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


def _sleep(index, step_ms):
    time.sleep(step_ms / 1000 * (3 if index == 0 else 1))


def _sync_dp(seconds, step_ms):
    model, r = _model(), px.rank()
    opt, data, steps = _adam(model.parameters()), _batches(r), 0
    next(data)
    px.barrier()
    start = time.perf_counter()
    while True:
        x, y = next(data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        _sleep(r, step_ms)
        for p in model.parameters():
            px.allreduce(p.grad, op=px.Average, inplace=True)
        opt.step()
        steps += 1
        stop = torch.tensor([float(time.perf_counter() - start > seconds)])
        if px.allreduce(stop, op=px.Max).item():
            break
    return steps * LOCAL_BATCH, time.perf_counter() - start, _accuracy(model)


def _local_sgd(seconds, step_ms, sync_every=8):
    model, r = _model(), px.rank()
    opt = LocalSGD(_adam(model.parameters()), model, sync_every=sync_every)
    data, steps = _batches(r), 0
    next(data)
    px.barrier()
    start = time.perf_counter()
    while True:
        x, y = next(data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        _sleep(r, step_ms)
        opt.step()
        steps += 1
        if steps % sync_every == 0:  # decide together, at a sync point
            stop = torch.tensor([float(time.perf_counter() - start > seconds)])
            if px.allreduce(stop, op=px.Max).item():
                break
    return steps * LOCAL_BATCH, time.perf_counter() - start, _accuracy(model)


def _ps(seconds, step_ms, mode, staleness):
    def train(worker):
        data, steps = _batches(worker.index), 0
        next(data)
        _accuracy(worker.model)  # warm the data cache before the clock starts
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            worker.pull()
            x, y = next(data)
            worker.model.zero_grad()
            nn.functional.cross_entropy(worker.model(x), y).backward()
            _sleep(worker.index, step_ms)
            worker.push()
            steps += 1
        worker.pull()
        return steps * LOCAL_BATCH, time.perf_counter() - start, _accuracy(worker.model)

    px.barrier()
    out = run_ps(_model, _adam, train, num_servers=1, mode=mode, staleness=staleness)
    return out["result"]


def _gather(fn, np, *args):
    results = [r for r in px.run(fn, np=np, args=args, timeout=300, threads=1) if r is not None]
    samples = sum(r[0] for r in results)
    wall = max(r[1] for r in results)
    return samples / wall, results[0][2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--step-ms", type=float, default=20.0, help="sleep per step of a fast worker")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    methods = {
        "sync DP (allreduce)": lambda: _gather(_sync_dp, WORKERS, args.seconds, args.step_ms),
        "async PS": lambda: _gather(_ps, WORKERS + 1, args.seconds, args.step_ms, "async", 0),
        "SSP PS (s=3)": lambda: _gather(_ps, WORKERS + 1, args.seconds, args.step_ms, "ssp", 3),
        "local SGD (H=8)": lambda: _gather(_local_sgd, WORKERS, args.seconds, args.step_ms),
    }
    runs = {m: [] for m in methods}
    for _ in range(args.repeats):  # interleaved: each repeat runs every method once
        for name, fn in methods.items():
            runs[name].append(fn())
    base = statistics.median(r[0] for r in runs["sync DP (allreduce)"])
    print(f"{WORKERS} workers, worker 0 3x slower ({args.step_ms:g} ms vs {3 * args.step_ms:g} ms sleep/step), "
          f"{args.seconds:g} s wall each, median of {args.repeats}")
    print(f"{'method':<22}{'samples/s':>10}{'vs sync':>9}{'test acc':>10}")
    for name, rs in runs.items():
        sps = statistics.median(r[0] for r in rs)
        acc = statistics.median(r[1] for r in rs)
        print(f"{name:<22}{sps:>10.0f}{sps / base:>8.2f}x{acc:>10.4f}")


if __name__ == "__main__":
    main()

"""Sync DP vs async PS vs SSP vs local SGD when workers are slow: samples/s and accuracy after a fixed time.

Run:  python benchmarks/async_vs_sync.py --seconds 5 --repeats 3
      python benchmarks/async_vs_sync.py --protocol-ab 0ca3a52^ --repeats 3   (PS protocol A/B)

Every method trains the same MLP on digits for a fixed wall time with 3 workers;
the parameter-server runs add one server rank. A worker's "compute" is its real
forward/backward plus an injected sleep of --step-ms, three times longer when the
worker straggles. Two straggler patterns, each in its own table:

  fixed   worker 0 is 3x slower at every step (the persistent straggler)
  random  at every step each worker is 3x slower with probability 1/3 (transient)

Prints samples/s (all workers together), the ratio to synchronous data parallel
(phalanx's DataParallel engine), test accuracy when the time is up, and for the
parameter server the fraction of the time its loop was busy. Each configuration
runs once per repeat, interleaved; the table holds medians. Every method does one
warm-up step before its clock starts (first-call imports, gloo connections).

What to expect from the sleeps alone (compute and messages are extra):

                     fixed straggler                 random stragglers
  sync DP            all at the slowest: 3/60ms      max of 3 per step: E = 48 ms
  async PS           each at its own pace: 2.33x     each at its mean 33 ms: 1.44x
  SSP (s=3)          the fast ones wait: ~1.0x       slack absorbs most jitter: <= 1.44x
  local SGD (H=8)    waits every 8 steps: ~1.0x      slowest sum of 8 steps: ~1.23x
  local SGD (160 ms) each at its own pace, but the    each at its own pace: < 1.44x
                     fast ones wait up to one slow
                     step per average: < 2.33x
  (local SGD: plus what it saves on messages, in both columns)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits
from phalanx.ps import LocalSGD, run_ps

WORKERS, LOCAL_BATCH, SYNC_EVERY, STALENESS = 3, 32, 8, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _adam(params):
    return torch.optim.Adam(params, lr=2e-3)


class _Worker:
    """Batches and the injected per-step sleep of worker ``index``."""

    def __init__(self, index: int, straggler: str, step_ms: float) -> None:
        x, y, self.xt, self.yt = load_digits()  # before the clock starts (the sklearn import is slow)
        self.x, self.y, self.index, self.straggler, self.step_s = x, y, index, straggler, step_ms / 1000
        self.gen = torch.Generator().manual_seed(index)
        self.rng = random.Random(1000 + index)

    def batch(self):
        idx = torch.randint(len(self.x), (LOCAL_BATCH,), generator=self.gen)
        return self.x[idx], self.y[idx]

    def sleep(self) -> None:
        slow = self.index == 0 if self.straggler == "fixed" else self.rng.random() < 1 / WORKERS
        time.sleep(self.step_s * (3 if slow else 1))

    def accuracy(self, model) -> float:
        with torch.no_grad():
            return (model(self.xt).argmax(1) == self.yt).float().mean().item()


def _step(model, opt, w: _Worker) -> None:
    x, y = w.batch()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    w.sleep()
    opt.step()


def _time_up(start: float, seconds: float) -> bool:
    """Every rank decides together (one tiny allreduce), so collectives stay matched."""
    return bool(px.allreduce(torch.tensor([float(time.perf_counter() - start > seconds)]), op=px.Max).item())


def _sync_dp(seconds, straggler, step_ms):
    w = _Worker(px.rank(), straggler, step_ms)
    model = px.DataParallel(_model())
    opt = _adam(model.parameters())
    _step(model, opt, w)  # warm-up
    px.barrier()
    start, steps = time.perf_counter(), 0
    while True:
        _step(model, opt, w)
        steps += 1
        if steps % SYNC_EVERY == 0 and _time_up(start, seconds):  # same stop check as local SGD
            break
    return steps * LOCAL_BATCH, time.perf_counter() - start, w.accuracy(model), None


def _local_sgd(seconds, straggler, step_ms, timed):
    w = _Worker(px.rank(), straggler, step_ms)
    model = _model()
    every = {"sync_every_s": SYNC_EVERY * step_ms / 1000} if timed else {"sync_every": SYNC_EVERY}
    opt = LocalSGD(_adam(model.parameters()), model, **every)
    _step(model, opt, w)
    while not opt.synced:  # warm-up: one full round, ending with an average
        _step(model, opt, w)
    px.barrier()
    start, steps = time.perf_counter(), 0
    while True:
        _step(model, opt, w)
        steps += 1
        if opt.synced and _time_up(start, seconds):  # at a sync point: replicas equal
            break
    return steps * LOCAL_BATCH, time.perf_counter() - start, w.accuracy(model), None


def _ps(seconds, straggler, step_ms, mode):
    def train(worker):
        w = _Worker(worker.index, straggler, step_ms)
        model = worker.model

        def step():
            worker.pull()
            x, y = w.batch()
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            w.sleep()
            worker.push()

        step()  # warm-up (the server's start-up is in here, off the clock)
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            step()
            steps += 1
        worker.pull()
        return steps * LOCAL_BATCH, time.perf_counter() - start, w.accuracy(model)

    px.barrier()
    out = run_ps(_model, _adam, train, num_servers=1, mode=mode, staleness=STALENESS)
    if out["role"] == "server":
        st = out["stats"]
        return st["busy_s"] / max(st["busy_s"] + st["idle_s"], 1e-9)
    return out["result"] + (None,)


def _gather(fn, np, *args):
    results = px.run(fn, np=np, args=args, timeout=300, threads=1)
    busy = results[0] if not isinstance(results[0], tuple) else None
    rows = [r for r in results if isinstance(r, tuple)]
    samples = sum(r[0] for r in rows)
    wall = max(r[1] for r in rows)
    return samples / wall, rows[0][2], busy


def _message_bound(which, ab_dir, mode, seconds):
    """No sleeps: steps/s of 3 workers against 1 server, with this tree's PS or an older one."""
    if which == "old":
        sys.path.insert(0, ab_dir)
        from ps_old import run_ps as run
    else:
        run = run_ps
    x, y = torch.randn(LOCAL_BATCH, 64), torch.randint(10, (LOCAL_BATCH,))

    def train(worker):
        def step():
            worker.pull()
            worker.model.zero_grad()
            nn.functional.cross_entropy(worker.model(x), y).backward()
            worker.push()

        step()  # warm-up, off the clock
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            step()
            steps += 1
        worker.pull()
        return steps, time.perf_counter() - start

    px.barrier()
    out = run(_model, _adam, train, num_servers=1, mode=mode, staleness=STALENESS)
    return out["result"]


def protocol_ab(rev: str, repeats: int, seconds: float) -> None:
    """The PS of git revision ``rev`` (copied to a temp dir as ``ps_old``) vs this tree's, interleaved."""
    ab_dir = tempfile.mkdtemp(prefix="phalanx-ps-ab-")
    os.makedirs(os.path.join(ab_dir, "ps_old"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("__init__", "protocol", "server", "worker", "local_sgd"):
        text = subprocess.run(["git", "show", f"{rev}:phalanx/ps/{name}.py"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        with open(os.path.join(ab_dir, "ps_old", f"{name}.py"), "w") as f:
            f.write(text.replace("phalanx.ps.", "ps_old."))
    rates: dict = {}
    for _ in range(repeats):
        for mode in ("async", "sync"):
            for which in ("old", "new"):
                rows = [r for r in px.run(_message_bound, np=WORKERS + 1, args=(which, ab_dir, mode, seconds),
                                          timeout=300, threads=1) if r is not None]
                rates.setdefault((mode, which), []).append(sum(r[0] for r in rows) / max(r[1] for r in rows))
    print(f"PS protocol, 1 server + {WORKERS} workers, no sleeps, {seconds:g} s each, median of {repeats}")
    print(f"{'mode':<8}{rev + ' steps/s':>22}{'this tree steps/s':>20}{'ratio':>8}")
    for mode in ("async", "sync"):
        old, new = (statistics.median(rates[(mode, w)]) for w in ("old", "new"))
        print(f"{mode:<8}{old:>22.0f}{new:>20.0f}{new / old:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="training wall time per run")
    ap.add_argument("--step-ms", type=float, default=20.0, help="sleep per step of a worker that is not slow")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stragglers", default="fixed,random", help="comma list of: fixed, random")
    ap.add_argument("--protocol-ab", default=None, metavar="REV",
                    help="instead: message-bound steps/s of the PS at git revision REV vs this tree's")
    args = ap.parse_args()
    if args.protocol_ab:
        return protocol_ab(args.protocol_ab, args.repeats, min(args.seconds, 2.0))
    patterns = args.stragglers.split(",")
    for p in patterns:
        if p not in ("fixed", "random"):
            raise SystemExit(f"--stragglers: unknown pattern {p!r}; use fixed and/or random")
    methods = {
        "sync DP (DataParallel)": lambda s: _gather(_sync_dp, WORKERS, args.seconds, s, args.step_ms),
        "async PS": lambda s: _gather(_ps, WORKERS + 1, args.seconds, s, args.step_ms, "async"),
        f"SSP PS (s={STALENESS})": lambda s: _gather(_ps, WORKERS + 1, args.seconds, s, args.step_ms, "ssp"),
        f"local SGD (H={SYNC_EVERY})": lambda s: _gather(_local_sgd, WORKERS, args.seconds, s, args.step_ms, False),
        f"local SGD ({SYNC_EVERY * args.step_ms:g} ms)": lambda s: _gather(_local_sgd, WORKERS, args.seconds, s,
                                                                         args.step_ms, True),
    }
    runs = {(p, m): [] for p in patterns for m in methods}
    for _ in range(args.repeats):  # interleaved: each repeat runs every configuration once
        for p in patterns:
            for name, fn in methods.items():
                runs[(p, name)].append(fn(p))
    for p in patterns:
        what = "worker 0 is 3x slower at every step" if p == "fixed" else "each worker 3x slower w.p. 1/3 per step"
        print(f"\n{WORKERS} workers, {what} ({args.step_ms:g} vs {3 * args.step_ms:g} ms sleep), "
              f"{args.seconds:g} s each, median of {args.repeats}")
        print(f"{'method':<26}{'samples/s':>10}{'vs sync':>9}{'test acc':>10}{'server busy':>13}")
        base = statistics.median(r[0] for r in runs[(p, "sync DP (DataParallel)")])
        for name in methods:
            rs = runs[(p, name)]
            sps = statistics.median(r[0] for r in rs)
            acc = statistics.median(r[1] for r in rs)
            busy = [r[2] for r in rs if r[2] is not None]
            busy_s = f"{statistics.median(busy):.0%}" if busy else "-"
            print(f"{name:<26}{sps:>10.0f}{sps / base:>8.2f}x{acc:>10.4f}{busy_s:>13}")


if __name__ == "__main__":
    main()

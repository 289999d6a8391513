"""Autotune's bucket-size pick vs a grid search, DataParallel on loopback gloo.

Run: python benchmarks/autotune.py [--np 2] [--repeats 3]

In one spawned job per repeat: (1) autotune sweeps CANDIDATES during the first
steps of a fresh DataParallel model and keeps its pick; (2) a grid search then
times every candidate, interleaved round-robin, 3 rounds x 8 steps, median. The
claim: the pick's measured throughput is within 5% of the grid's best.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px
from phalanx.planner import autotune

CANDIDATES = (0.0625, 0.25, 1.0, 4.0, 16.0)


def _body(hidden, batch):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                              torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    model = px.DataParallel(net, bucket_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))

    def step():
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    tuner = autotune.for_data_parallel(model, CANDIDATES, warmup=2, steps_per_trial=5)
    steps = 0
    while not tuner.done:
        tuner.step(step())
        steps += 1
    grid = {mb: [] for mb in CANDIDATES}
    for _ in range(3):
        for mb in CANDIDATES:
            autotune.set_bucket_mb(model, mb)
            step()
            times = [step() for _ in range(8)]
            t = px.allreduce(torch.tensor([statistics.median(times)]), op=px.Max).item()
            grid[mb].append(t)
    return {"pick": tuner.best, "tuning_steps": steps, "log": tuner.log,
            "grid": {mb: statistics.median(v) for mb, v in grid.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ratios = []
    print(f"{'repeat':>6} {'pick MB':>8} {'best MB':>8} {'pick ms':>8} {'best ms':>8} {'pick/best thr':>13}  grid ms")
    for r in range(args.repeats):
        res = px.run(_body, np=args.np, args=(args.hidden, args.batch), timeout=600)[0]
        grid = res["grid"]
        best = min(grid, key=grid.get)
        ratio = grid[best] / grid[res["pick"]]  # throughput of the pick relative to the best
        ratios.append(ratio)
        cells = " ".join(f"{mb:g}:{t * 1e3:.1f}" for mb, t in grid.items())
        print(f"{r:>6} {res['pick']:>8g} {best:>8g} {grid[res['pick']] * 1e3:>8.2f} {grid[best] * 1e3:>8.2f} "
              f"{ratio:>13.1%}  {cells}")
    print(f"median pick/best throughput: {statistics.median(ratios):.1%} (goal >= 95%)")


if __name__ == "__main__":
    main()

"""Autotune's bucket-size pick vs a grid search, DataParallel on loopback gloo.

Run: python benchmarks/autotune.py [--np 2] [--repeats 3] [--layers 48] [--width 128]

The model is a deep, narrow MLP (48 layers of 128x128 by default: 0.8M parameters in
96 tensors), where the bucket size matters: tiny buckets pay one launch per tensor,
one huge bucket waits for the whole backward. In one spawned job per repeat:

  1. the tuner as a single sweep (``rounds=1``, one trial per candidate: the old
     behaviour, for contrast) on a fresh DataParallel model;
  2. the tuner as shipped (successive halving, ``rounds=2``, settling steps dropped)
     on another fresh model; its pick is the claim;
  3. a grid search in the same process: every candidate timed in ``--grid-rounds``
     interleaved rounds (order reversed each round), each round 1 settling step +
     ``--grid-steps`` timed steps, median per round on the slowest rank, then the
     median over rounds.

The claim: the pick's measured throughput (grid time of the best / grid time of the
pick) is within 5% of the grid's best; reported as the median over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px
from phalanx.planner import autotune

CANDIDATES = (0.0625, 0.25, 1.0, 4.0, 16.0)


def _net(layers, width):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(256, width)]
    for _ in range(layers - 1):
        mods += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*mods, torch.nn.ReLU(), torch.nn.Linear(width, 10))


def _body(layers, width, batch, grid_rounds, grid_steps):
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))

    def trainer():
        model = px.DataParallel(_net(layers, width), bucket_mb=25)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t0

        return model, step

    out = {}
    for name, rounds in (("sweep", 1), ("halving", 2)):
        model, step = trainer()
        tuner = autotune.for_data_parallel(model, CANDIDATES, warmup=3, steps_per_trial=5, rounds=rounds)
        steps = 0
        while not tuner.done:
            tuner.step(step())
            steps += 1
        out[name] = {"pick": tuner.best, "steps": steps}
        model._engine.remove_hooks()
    model, step = trainer()
    for _ in range(3):
        step()
    grid = {mb: [] for mb in CANDIDATES}
    for r in range(grid_rounds):
        for mb in (CANDIDATES if r % 2 == 0 else CANDIDATES[::-1]):
            autotune.set_bucket_mb(model, mb)
            step()  # settling: the first step after re-bucketing
            times = [step() for _ in range(grid_steps)]
            grid[mb].append(px.allreduce(torch.tensor([statistics.median(times)]), op=px.Max).item())
    out["grid"] = {mb: statistics.median(v) for mb, v in grid.items()}
    out["grid_spread"] = {mb: (min(v), max(v)) for mb, v in grid.items()}
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--grid-rounds", type=int, default=30)
    ap.add_argument("--grid-steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ratios = {"halving": [], "sweep": []}
    print(f"{'repeat':>6} {'pick MB':>8} {'best MB':>8} {'pick ms':>8} {'best ms':>8} {'pick/best thr':>13} "
          f"{'tuning steps':>12} {'sweep pick':>10} {'sweep/best':>10}  grid ms (median of rounds)")
    for r in range(args.repeats):
        res = px.run(_body, np=args.np, args=(args.layers, args.width, args.batch, args.grid_rounds,
                                               args.grid_steps), timeout=600)[0]
        grid = res["grid"]
        best = min(grid, key=grid.get)
        for name in ratios:
            ratios[name].append(grid[best] / grid[res[name]["pick"]])  # throughput of the pick relative to best
        pick = res["halving"]["pick"]
        cells = " ".join(f"{mb:g}:{t * 1e3:.2f}" for mb, t in grid.items())
        print(f"{r:>6} {pick:>8g} {best:>8g} {grid[pick] * 1e3:>8.2f} {grid[best] * 1e3:>8.2f} "
              f"{ratios['halving'][-1]:>13.1%} {res['halving']['steps']:>12} {res['sweep']['pick']:>10g} "
              f"{ratios['sweep'][-1]:>10.1%}  {cells}", flush=True)
        spread = " ".join(f"{mb:g}:{lo * 1e3:.1f}-{hi * 1e3:.1f}" for mb, (lo, hi) in res["grid_spread"].items())
        print(f"{'':>6} grid per-round range ms: {spread}; {res['params'] / 1e6:.2f}M params", flush=True)
    print(f"median pick/best throughput: {statistics.median(ratios['halving']):.1%} (goal >= 95%); "
          f"a single sweep (rounds=1) would give {statistics.median(ratios['sweep']):.1%}")


if __name__ == "__main__":
    main()

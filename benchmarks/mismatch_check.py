"""Cost of the collectives' cross-rank mismatch check, on vs off: per call and per training step.

Run:  python benchmarks/mismatch_check.py [--calls 200 --steps 20 --repeats 5]

Per call: ``px.allreduce`` of a 1 KiB, 64 KiB and 4 MiB float32 tensor, check on vs
off, interleaved repeats on the same two gloo ranks; the check is one extra 16-byte
blocking allreduce per call. Per step, on a 60-layer MLP (122 parameter tensors):
a step that averages each gradient with its own ``px.allreduce`` (the loop of the
README's minimal script: 122 checked calls per step), and a DataParallel step with
25 MB and 0.05 MB buckets (the engine probes only in the first iteration, so its
steady-state steps should show no difference). Prints median microseconds and on/off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def _bench(calls: int, steps: int, repeats: int):
    import phalanx as px
    from phalanx.comm.mismatch import set_mismatch_check

    rows = {}
    for label, numel in (("allreduce 1 KiB", 256), ("allreduce 64 KiB", 16384), ("allreduce 4 MiB", 2**20)):
        t = torch.randn(numel)
        per = {True: [], False: []}
        for rep in range(repeats):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                set_mismatch_check(on)
                px.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    px.allreduce(t, op=px.Sum, name="bench")
                per[on].append((time.perf_counter() - start) / calls * 1e6)
        rows[label + " (per call)"] = (statistics.median(per[True]), statistics.median(per[False]))
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    layers = [m for _ in range(60) for m in (nn.Linear(64, 64), nn.ReLU())]
    plain = nn.Sequential(*layers, nn.Linear(64, 10))
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    per = {True: [], False: []}
    for rep in range(repeats):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            set_mismatch_check(on)
            px.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad()
                nn.functional.cross_entropy(plain(x), y).backward()
                for p in plain.parameters():
                    px.allreduce(p.grad, op=px.Average, inplace=True, name="grad")
                opt.step()
            per[on].append((time.perf_counter() - start) / steps * 1e6)
    rows["per-tensor allreduce loop step"] = (statistics.median(per[True]), statistics.median(per[False]))
    for mb in (25.0, 0.05):
        layers = [m for _ in range(60) for m in (nn.Linear(64, 64), nn.ReLU())]
        model = px.DataParallel(nn.Sequential(*layers, nn.Linear(64, 10)), bucket_mb=mb)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        nbuckets = len(model._engine.buckets.buckets)
        per = {True: [], False: []}
        for rep in range(repeats + 1):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                set_mismatch_check(on)
                px.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                if rep:  # the first round is warm-up (bucket rebuild)
                    per[on].append((time.perf_counter() - start) / steps * 1e6)
        rows[f"DP step, {nbuckets} bucket(s)"] = (statistics.median(per[True]), statistics.median(per[False]))
    set_mismatch_check(True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import phalanx as px

    rows = px.run(_bench, np=2, args=(args.calls, args.steps, args.repeats), threads=1, timeout=900)[0]
    print(f"world 2 gloo, {args.repeats} interleaved repeats, median microseconds")
    print(f"{'what':<32} {'check on':>10} {'check off':>10} {'on/off':>7} {'extra us':>9}")
    for label, (on, off) in rows.items():
        print(f"{label:<32} {on:>10.0f} {off:>10.0f} {on / off:>7.2f} {on - off:>9.0f}")


if __name__ == "__main__":
    main()

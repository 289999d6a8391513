"""RayExecutor vs ``phalanx run``: start-up time and per-step time of the same 2-rank job.

The job: DataParallel MLP (256-1024-1024-10, 1.3M params), SGD, local batch 64 of fixed
random data; ``--warmup`` steps, then ``--steps`` timed one by one (median per repeat).

* start-up: from the launcher's first call (``executor.start()``, or starting the
  ``phalanx run`` process) to ``px.init()`` returning on rank 0. The Ray cluster itself
  (``ray.init``) is started once before and reported on its own line.
* step: the median step time inside the job, the same code under both launchers.

Repeats are interleaved (ray, cli, ray, cli, ...). Run under the benchmark lock::

    flock /tmp/phalanx-bench.lock python benchmarks/ray_executor.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


def job(warmup: int, steps: int, launched_at: float) -> dict:
    import phalanx as px

    px.init()
    init_at = time.time()
    torch.manual_seed(0)
    model = px.DataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                          nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(px.rank())
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    px.barrier()
    return {"startup_s": init_at - launched_at, "step_ms": 1000 * statistics.median(times),
            "threads": torch.get_num_threads()}


def run_ray(warmup: int, steps: int) -> dict:
    from phalanx.ray import RayExecutor

    launched = time.time()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
    executor.start()
    try:
        return executor.run(job, args=[warmup, steps, launched])[0]
    finally:
        executor.shutdown()


def run_cli(warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        launched = time.time()
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, os.path.abspath(__file__),
               "--worker", out, "--warmup", str(warmup), "--steps", str(steps), "--launched", repr(launched)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:  # one rank under `phalanx run`
        import phalanx as px

        result = job(args.warmup, args.steps, args.launched)
        if px.rank() == 0:
            with open(args.worker, "w") as f:
                json.dump(result, f)
        return

    import ray

    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - t
    rows = {"ray": [], "cli": []}
    for r in range(args.repeats):
        for name, fn in (("ray", run_ray), ("cli", run_cli)):
            rows[name].append(fn(args.warmup, args.steps))
            print(f"repeat {r} {name}: {rows[name][-1]}", flush=True)
    ray.shutdown()
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("startup_s", "step_ms")} for k, v in rows.items()}
    print(f"\nray.init (once, local cluster, 2 CPUs): {ray_init_s:.2f} s; load {os.getloadavg()[0]:.1f}")
    print("| launcher | start-up to px.init (s) | step (ms, median) |\n|---|---|---|")
    for k, label in (("ray", "RayExecutor"), ("cli", "phalanx run -np 2")):
        print(f"| {label} | {med[k]['startup_s']:.2f} | {med[k]['step_ms']:.3f} |")
    print(f"RayExecutor / phalanx run: start-up {med['ray']['startup_s'] / med['cli']['startup_s']:.2f}x, "
          f"step {med['ray']['step_ms'] / med['cli']['step_ms']:.3f}x "
          f"({100 * (med['ray']['step_ms'] / med['cli']['step_ms'] - 1):+.1f}%)")


if __name__ == "__main__":
    main()

"""RayExecutor vs ``phalanx run``: start-up time and per-step time of the same 2-rank job.

The job: DataParallel MLP (256-1024-1024-10, 1.3M params), SGD, local batch 64 of fixed
random data; ``--warmup`` steps, then ``--steps`` timed one by one; a run's figure is the
median of its timed steps (rank 0).

Each repeat is one pair, run back to back: a RayExecutor run on a fresh local Ray cluster
(``ray.init`` before, ``ray.shutdown`` after, so the ``phalanx run`` half never shares the
machine with Ray's daemons) and a ``phalanx run -np 2`` run; the order alternates between
repeats (ray first in even repeats). The step-time figure is the median of the per-repeat
ratios ray/cli with their spread, so drift of the machine between repeats cancels out.

* ``ray.init``: the local cluster's start (``num_cpus=2, include_dashboard=False``), a
  start-up figure of its own, never in the step time.
* start-up: from the launcher's first call (``executor.start()``, or starting the
  ``phalanx run`` process) to ``px.init()`` returning on rank 0.
* step: as above; each run also reports what differs between the two launchers' ranks
  (niceness, OS threads, torch threads, CPU affinity, MASTER_ADDR).

Run under the benchmark lock, when ``uptime`` shows a load below 3::

    flock /tmp/phalanx-bench.lock python benchmarks/ray_executor.py

(defaults: 6 repeats x 400 timed steps: 453 s on cpu2 at load 3-5; a fresh Ray cluster per repeat costs ~10 s
of start and a `phalanx run` start ~12 s, so fewer repeats (`--repeats 4`) are the way to a shorter run.)
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
    times, cpu_at = [], 0.0
    for i in range(warmup + steps):
        if i == warmup:
            cpu_at = time.process_time()
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    cpu_ms = 1000 * (time.process_time() - cpu_at) / steps  # this process's CPU (every thread) per step
    px.barrier()
    times.sort()
    return {"startup_s": init_at - launched_at, "step_ms": 1000 * statistics.median(times),
            "p10_ms": 1000 * times[len(times) // 10], "p90_ms": 1000 * times[(9 * len(times)) // 10], "cpu_ms": cpu_ms,
            "torch_threads": torch.get_num_threads(), "os_threads": len(os.listdir("/proc/self/task")),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
            "master_addr": os.environ.get("MASTER_ADDR")}


def run_ray(warmup: int, steps: int) -> dict:
    import ray

    from phalanx.ray import RayExecutor

    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - t
    try:
        launched = time.time()
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
        executor.start()
        try:
            return {**executor.run(job, args=[warmup, steps, launched])[0], "ray_init_s": ray_init_s}
        finally:
            executor.shutdown()
    finally:
        ray.shutdown()
        _wait_for_ray_to_leave()


def _wait_for_ray_to_leave(timeout: float = 30.0) -> None:
    """ray.shutdown() returns before every daemon is gone; the next run must not share the CPUs with them."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        time.sleep(0.1)


def run_cli(warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        launched = time.time()
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, os.path.abspath(__file__),
               "--worker", out, "--warmup", str(warmup), "--steps", str(steps), "--launched", repr(launched)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=400)
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

    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"^\[\d+\]: ")  # before ray, as phalanx.ray does
    began, loads = time.perf_counter(), [os.getloadavg()[0]]
    rows: dict[str, list[dict]] = {"ray": [], "cli": []}
    for r in range(args.repeats):
        order = (("ray", run_ray), ("cli", run_cli)) if r % 2 == 0 else (("cli", run_cli), ("ray", run_ray))
        for name, fn in order:
            row = fn(args.warmup, args.steps)
            rows[name].append(row)
            print(f"repeat {r} {name}: step {row['step_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}), "
                  f"rank 0 CPU {row['cpu_ms']:.3f} ms/step, "
                  f"start-up {row['startup_s']:.2f} s" + (f", ray.init {row['ray_init_s']:.2f} s" if name == "ray" else "")
                  + f"; rank 0: nice {row['nice']}, {row['os_threads']} OS threads, torch threads "
                  f"{row['torch_threads']}, cpus {row['cpus']}, MASTER_ADDR {row['master_addr']}", flush=True)
        loads.append(os.getloadavg()[0])
        print(f"repeat {r}: ray/cli step {rows['ray'][-1]['step_ms'] / rows['cli'][-1]['step_ms']:.4f}; "
              f"load {loads[-1]:.1f}", flush=True)
    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(rows["ray"], rows["cli"])]
    ratio = statistics.median(ratios)
    print(f"\n{args.repeats} paired repeats x {args.steps} timed steps ({args.warmup} warm-up), "
          f"{time.perf_counter() - began:.0f} s; load {min(loads):.1f}-{max(loads):.1f}; torch {torch.__version__}")
    print("| launcher | ray.init (s) | start-up to px.init (s) | step (ms) | rank 0 CPU per step (ms) |")
    print("|---|---|---|---|---|")
    print(f"| RayExecutor | {_spread([x['ray_init_s'] for x in rows['ray']], '{:.2f}')} | "
          f"{_spread([x['startup_s'] for x in rows['ray']], '{:.2f}')} | {_spread([x['step_ms'] for x in rows['ray']])} | "
          f"{_spread([x['cpu_ms'] for x in rows['ray']])} |")
    print(f"| phalanx run -np 2 | - | {_spread([x['startup_s'] for x in rows['cli']], '{:.2f}')} | "
          f"{_spread([x['step_ms'] for x in rows['cli']])} | {_spread([x['cpu_ms'] for x in rows['cli']])} |")
    print("(each cell: median (min-max) over the repeats)")
    cpu = statistics.median(a["cpu_ms"] / b["cpu_ms"] for a, b in zip(rows["ray"], rows["cli"]))
    print(f"paired CPU-per-step ratio ray/cli: median {cpu:.4f} ({100 * (cpu - 1):+.2f}%)")
    print(f"paired step ratio ray/cli: median {ratio:.4f} ({100 * (ratio - 1):+.2f}%), per repeat "
          + " ".join(f"{100 * (x - 1):+.1f}%" for x in ratios)
          + f"; goal within 2%: {'met' if abs(ratio - 1) <= 0.02 else 'NOT met'} by the median")


if __name__ == "__main__":
    main()

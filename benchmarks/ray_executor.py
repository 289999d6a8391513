"""RayExecutor vs ``phalanx run``: start-up time and per-step time of the same 2-rank job.

The job: DataParallel MLP (256-1024-1024-10, 1.3M params), SGD, local batch 64 of fixed
random data; ``--warmup`` steps, then ``--steps`` timed one by one; a run's figure is the
median of its timed steps (rank 0).

Two ways to pair them (``--method``):

* ``windows`` (default, the step-time verdict): both jobs run at once, taking turns. While one
  side runs, every process of the other side is SIGSTOPped: the RayExecutor side is a driver
  process of its own with everything it started (Ray's daemons, the actors), the other side is
  ``phalanx run`` with its ranks. Sides switch every ``--window`` seconds; a pair is one window
  of each, the order alternating between pairs, so a pair's two figures are seconds apart on the
  same machine and drift between runs cancels out. A window's figure is the median of rank 0's
  steps that began ``--settle`` s after the resume and ended inside the window. The verdict is
  the median of the per-pair ratios ray/cli with a distribution-free 95% interval.
* ``runs`` (start-up figures): each repeat is one pair of whole runs back to back: a
  RayExecutor run on a fresh local Ray cluster (``ray.init`` before, ``ray.shutdown`` after, so
  the ``phalanx run`` half never shares the machine with Ray's daemons) and a ``phalanx run -np
  2`` run; the order alternates between repeats. The step figure is the median of the per-repeat
  ratios; on a 2-core machine runs minutes apart differ by +-15%, more than the goal.

The figures of ``runs``:

* ``ray.init``: the local cluster's start (``num_cpus=2, include_dashboard=False``), a
  start-up figure of its own, never in the step time.
* start-up: from the launcher's first call (``executor.start()``, or starting the
  ``phalanx run`` process) to ``px.init()`` returning on rank 0.
* step: as above; each run also reports what differs between the two launchers' ranks
  (niceness, OS threads, torch threads, CPU affinity, MASTER_ADDR).

Run under the benchmark lock, when ``uptime`` shows a load below 3::

    flock /tmp/phalanx-bench.lock python benchmarks/ray_executor.py                 # windows
    flock /tmp/phalanx-bench.lock python benchmarks/ray_executor.py --method runs   # start-up

(windows: 30 pairs of 3 s, about 4 minutes; runs: 6 repeats x 400 timed steps, 453 s on cpu2 at
load 3-5; a fresh Ray cluster per repeat costs ~10 s of start and a `phalanx run` start ~12 s, so fewer repeats (`--repeats 4`) are the way to a shorter run.)
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


def _setup():
    """The job's model, optimizer and this rank's fixed batch (after ``px.init()``)."""
    import phalanx as px

    torch.manual_seed(0)
    model = px.DataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                          nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(px.rank())
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    return model, opt, x, y


def job(warmup: int, steps: int, launched_at: float) -> dict:
    import phalanx as px

    px.init()
    init_at = time.time()
    model, opt, x, y = _setup()
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



def job_windows(ready: str, stop: str, out: str, warmup: int) -> None:
    """The same job as ``job``, stepping until ``stop`` exists; rank 0 writes each step's
    (start, end) on the system-wide monotonic clock to ``out``. Whether to stop is agreed every
    20 steps by a MAX allreduce of one flag, outside the timed steps, so both ranks stop together."""
    import phalanx as px

    px.init()
    model, opt, x, y = _setup()
    spans, i = [], 0
    while True:
        if i % 20 == 0:
            if px.allreduce(torch.tensor([float(os.path.exists(stop))]), op=px.Max).item():
                break
        t = time.monotonic()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        spans.append((t, time.monotonic()))
        i += 1
        if i == warmup and px.rank() == 0:
            open(ready, "w").close()
    if px.rank() == 0:
        with open(out, "w") as f:
            json.dump({"spans": spans, "nice": os.getpriority(os.PRIO_PROCESS, 0),
                       "os_threads": len(os.listdir("/proc/self/task"))}, f)
    px.barrier()

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




def ray_windows_driver(ready: str, stop: str, out: str, warmup: int) -> None:
    """The RayExecutor side of ``run_windows``: a driver process of its own, so that every Ray
    process (this driver, the daemons it starts, the actors) is in one process tree."""
    import ray

    from phalanx.ray import RayExecutor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # (with --ray-env in the environment)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
    executor.start()
    try:
        executor.run(job_windows, args=[ready, stop, out, warmup])
    finally:
        executor.shutdown()
        ray.shutdown()

def _tree(pid: int) -> list:
    import psutil

    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_cpu(procs: list) -> float:
    """CPU seconds (user + system, every thread) the processes have used so far."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # gone
            pass
    return total


def _signal(procs: list, sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except Exception:  # gone: nothing to stop or resume
            pass


def run_windows(args) -> None:
    """Both launchers' jobs alive at once, taking turns: while one side runs, every process of the
    other (Ray's daemons and actors, or `phalanx run`'s launcher and ranks) is SIGSTOPped. A pair of
    windows is a few seconds apart on the same machine, so its ratio is free of the drift between runs."""
    import signal

    began = time.perf_counter()
    loads = [os.getloadavg()[0]]
    d = tempfile.mkdtemp(prefix="px-raywin-")
    paths = {side: {k: os.path.join(d, f"{side}.{k}") for k in ("ready", "stop", "out")} for side in ("ray", "cli")}
    me = [sys.executable, os.path.abspath(__file__)]
    r, c = paths["ray"], paths["cli"]
    ray_env = {**os.environ, **dict(kv.split("=", 1) for kv in args.ray_env)}
    procs = {"ray": subprocess.Popen([*me, "--windows-ray-driver", r["ready"], r["stop"], r["out"],
                                      "--warmup", str(args.warmup)], env=ray_env),
             "cli": subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-np", "2", *me,
                                      "--windows-worker", c["ready"], c["stop"], c["out"], "--warmup", str(args.warmup)],
                                     stdout=subprocess.DEVNULL)}

    def sides() -> dict:  # each side's whole process tree: Ray's driver, daemons and actors; the launcher and ranks
        return {side: _tree(proc.pid) for side, proc in procs.items()}

    while not (os.path.exists(r["ready"]) and os.path.exists(c["ready"])):
        for side, proc in procs.items():
            if proc.poll() is not None:
                raise SystemExit(f"the {side} job ended early with {proc.returncode}")
        time.sleep(0.1)
    windows = []  # (side, resumed_at, stopped_at)
    _signal(sides()["cli"], signal.SIGSTOP)
    running = "ray"
    try:
        for k in range(2 * args.pairs):
            side = ("ray", "cli")[(k + k // 2) % 2]  # ray cli | cli ray | ray cli ...: each pair alternates its order
            trees = sides()
            if side != running:
                _signal(trees[running], signal.SIGSTOP)
                _signal(trees[side], signal.SIGCONT)
                running = side
            t0, cpu0 = time.monotonic(), _tree_cpu(trees[side])
            time.sleep(args.window)
            windows.append((side, t0, time.monotonic(), _tree_cpu(trees[side]) - cpu0))
    finally:
        trees = sides()
        _signal(trees["ray"] + trees["cli"], signal.SIGCONT)
    loads.append(os.getloadavg()[0])
    for side in ("ray", "cli"):
        open(paths[side]["stop"], "w").close()
    for side, proc in procs.items():
        if proc.wait(timeout=120):
            raise SystemExit(f"the {side} job failed with {proc.returncode}")
    results = {}
    for side in ("ray", "cli"):
        with open(paths[side]["out"]) as f:
            results[side] = json.load(f)
    per_window, cpu_per_step = [], {"ray": [], "cli": []}
    for side, t0, t1, cpu in windows:
        steps = [b - a for a, b in results[side]["spans"] if a >= t0 + args.settle and b <= t1]
        per_window.append((side, 1000 * statistics.median(steps) if steps else float("nan"), len(steps)))
        ended = sum(1 for _, b in results[side]["spans"] if t0 <= b <= t1)
        cpu_per_step[side].append(1000 * cpu / max(ended, 1))
    ratios = []
    for k in range(0, len(per_window), 2):
        pair = dict((side, ms) for side, ms, _ in per_window[k:k + 2])
        ratios.append(pair["ray"] / pair["cli"])
    for k, ratio in enumerate(ratios):
        w = per_window[2 * k:2 * k + 2]
        print(f"pair {k}: " + ", ".join(f"{side} {ms:.3f} ms ({n} steps)" for side, ms, n in w)
              + f"; ray/cli {ratio:.4f}")
    from dp_vs_ddp import median_ci  # this folder is on sys.path when the script runs

    lo, hi = median_ci(ratios) or (min(ratios), max(ratios))
    ratio = statistics.median(ratios)
    print(f"\n{len(ratios)} pairs of {args.window:g} s windows ({args.settle:g} s settle), "
          f"{time.perf_counter() - began:.0f} s; load {min(loads):.1f}-{max(loads):.1f}; torch {torch.__version__}; "
          f"rank 0 nice ray {results['ray']['nice']} cli {results['cli']['nice']}, OS threads "
          f"ray {results['ray']['os_threads']} cli {results['cli']['os_threads']}"
          + (f"; Ray side with {' '.join(args.ray_env)}" if args.ray_env else ""))
    for side in ("ray", "cli"):
        ms = [m for s_, m, _ in per_window if s_ == side]
        print(f"{side}: window medians {_spread(ms)} ms")
    cpu_ratios = [a / b for a, b in zip(cpu_per_step["ray"], cpu_per_step["cli"])]
    print("CPU per step of every process of the side (launcher, daemons, ranks), ms: ray "
          f"{_spread(cpu_per_step['ray'])}, cli {_spread(cpu_per_step['cli'])}; paired ratio median "
          f"{statistics.median(cpu_ratios):.4f}")
    print(f"paired step ratio ray/cli: median {ratio:.4f} ({100 * (ratio - 1):+.2f}%), 95% CI "
          f"[{lo:.4f}, {hi:.4f}]; goal within 2%: "
          + ("too few pairs for an interval (6 at least)" if len(ratios) < 6 else "met" if 0.98 <= lo and hi <= 1.02
             else "NOT met" if hi < 0.98 or lo > 1.02 else "not decided")
          + " (by the interval)")


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--method", choices=("windows", "runs"), default="windows",
                   help="windows: both jobs alive, taking turns (default); runs: whole runs, paired")
    p.add_argument("--pairs", type=int, default=30, help="windows: pairs of windows")
    p.add_argument("--window", type=float, default=3.0, help="windows: seconds per window")
    p.add_argument("--settle", type=float, default=0.3, help="windows: seconds left out after a resume")
    p.add_argument("--ray-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="windows: variables for the Ray side only (e.g. Ray's RAY_<config> settings)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--windows-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--windows-ray-driver", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:  # one rank under `phalanx run`
        import phalanx as px

        result = job(args.warmup, args.steps, args.launched)
        if px.rank() == 0:
            with open(args.worker, "w") as f:
                json.dump(result, f)
        return
    if args.windows_worker:
        job_windows(*args.windows_worker, args.warmup)
        return
    if args.windows_ray_driver:
        ray_windows_driver(*args.windows_ray_driver, args.warmup)
        return

    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"^\[\d+\]: ")  # before ray, as phalanx.ray does
    if args.method == "windows":
        run_windows(args)
        return
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

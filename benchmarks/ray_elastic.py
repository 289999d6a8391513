"""Elastic recovery on Ray vs ``phalanx run --min-np``: a rank killed mid-run, the time to the next step.

The job (both launchers run exactly this): DataParallel MLP (8-32-3), SGD, ``phalanx.elastic``
TorchState committed every step, steps paced at ``--pace`` seconds. Every rank appends
``{t, step, size, gen, rank, pid}`` to a log file after each commit. When rank 1 has logged step
``--kill-at`` at size 2, the driver kills it: ``ray.kill`` of its actor (RayExecutor with
``min_workers=1, max_workers=2``), SIGKILL of its process (``phalanx run -np 2 --min-np 1
--max-np 2``). Measured from the kill:

* recovery: the first step a survivor completes after the kill (in-process re-form, roll back
  to the last commit, one step at size 1). Goal: under 10 s.
* regrow: the first step completed at size 2 again (a replacement started, admitted at a commit).

Repeats are interleaved (ray, cli, ...). Run under the benchmark lock on a quiet machine::

    flock /tmp/phalanx-bench.lock python benchmarks/ray_elastic.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch import nn


def job(out: str, kill_at: int, pace: float, max_steps: int = 3000) -> int:
    import phalanx as px
    from phalanx import elastic
    from phalanx.elastic import inprocess

    px.init()
    torch.manual_seed(0)
    model = px.DataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model, opt, step=0)

    @elastic.run
    def loop(state):
        while state.step < max_steps:
            g = torch.Generator().manual_seed(100 * state.step + px.rank())
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            state.commit()
            row = {"t": time.time(), "step": state.step, "size": px.size(), "gen": inprocess.generation(),
                   "rank": px.rank(), "pid": os.getpid()}
            with open(os.path.join(out, "log.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            if inprocess.generation() >= 2 and px.size() == 2 and state.step % 10 == 0:
                return  # grown back and a few steps on: every member sees the same step and generation
            time.sleep(pace)

    loop(state)
    return state.step


def _rows(out: str) -> list[dict]:
    path = os.path.join(out, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]


def _killer(out: str, kill_at: int, kill, stop: threading.Event, killed: list) -> None:
    while not stop.wait(0.005):
        hit = [r for r in _rows(out) if r["rank"] == 1 and r["size"] == 2 and r["step"] >= kill_at]
        if hit:
            killed.append(time.time())
            kill(hit[0])
            return


def _measure(out: str, killed: list) -> dict:
    if not killed:
        return {"recovery_s": float("nan"), "regrow_s": float("nan")}
    t = killed[0]
    after = [r for r in _rows(out) if r["t"] > t]
    rec = min((r["t"] for r in after if r["size"] == 1), default=float("nan"))
    grow = min((r["t"] for r in after if r["size"] == 2 and r["gen"] >= 2), default=float("nan"))
    return {"recovery_s": rec - t, "regrow_s": grow - t}


def run_ray(kill_at: int, pace: float) -> dict:
    import ray

    from phalanx.ray import RayExecutor

    out = tempfile.mkdtemp(prefix="px-ray-elastic-")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=1, max_workers=2,
                           num_workers=2, cpus_per_worker=1)
    executor.start(extra_env_vars={"PHALANX_TIMEOUT": "60", "OMP_NUM_THREADS": "1"})
    stop, killed = threading.Event(), []
    kill = lambda row: ray.kill(ray.get_actor(executor.worker_names[1]))  # noqa: E731 - rank 1 of gen 0
    watcher = threading.Thread(target=_killer, args=(out, kill_at, kill, stop, killed), daemon=True)
    watcher.start()
    try:
        executor.run(job, args=[out, kill_at, pace])
    finally:
        stop.set()
        executor.shutdown()
    return {**_measure(out, killed), "sizes": [s for _, s in executor.world_sizes]}


def run_cli(kill_at: int, pace: float) -> dict:
    out = tempfile.mkdtemp(prefix="px-cli-elastic-")
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(out, "job.py")
    with open(script, "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {here!r})\nimport ray_elastic\n"
                f"ray_elastic.job({out!r}, {kill_at}, {pace})\n")
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_killer, args=(out, kill_at, lambda r: os.kill(r["pid"], signal.SIGKILL),
                                                     stop, killed), daemon=True)
    watcher.start()
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "1", "--max-np", "2",
                           "--timeout", "60", sys.executable, script], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"phalanx run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    sizes = [r["size"] for r in _rows(out) if r["rank"] == 0]
    return {**_measure(out, killed), "sizes": [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=20, help="rank 1 is killed once it logged this step")
    p.add_argument("--pace", type=float, default=0.02, help="seconds between steps")
    args = p.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"^\[\d+\]: ")  # before ray: every rank's lines
    import ray

    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - t:.1f} s; load {os.getloadavg()[0]:.1f}", flush=True)
    rows = {"ray": [], "cli": []}
    for i in range(args.repeats):
        for name, fn in (("ray", run_ray), ("cli", run_cli)):
            r = fn(args.kill_at, args.pace)
            rows[name].append(r)
            print(f"repeat {i} {name:3s}: recovery {r['recovery_s']:.2f} s, regrow {r['regrow_s']:.2f} s, "
                  f"sizes {r['sizes']}; load {os.getloadavg()[0]:.1f}", flush=True)
    ray.shutdown()
    print("\n| measure | RayExecutor (min 1, max 2) | `phalanx run --min-np 1 --max-np 2` | ratio |")
    print("|---|---|---|---|")
    for key, label in (("recovery_s", "kill -> next step (s)"), ("regrow_s", "kill -> size 2 again (s)")):
        a = [r[key] for r in rows["ray"]]
        b = [r[key] for r in rows["cli"]]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {label} | {' / '.join(f'{v:.2f}' for v in a)} (median {ma:.2f}) | "
              f"{' / '.join(f'{v:.2f}' for v in b)} (median {mb:.2f}) | {ma / mb:.2f}x |")
    print(f"\ngoal: recovery under 10 s; torch {torch.__version__}")


if __name__ == "__main__":
    main()

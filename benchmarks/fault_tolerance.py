"""Fault tolerance side by side: phalanx elastic vs torchft vs torchrun --max-restarts + DCP, same job, same faults.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/fault_tolerance.py            (default: ~10-15 min)
      ... --np 2 --faults kill --runners phalanx,torchft --repeats 3                (a subset, more repeats)
      ... --keep DIR                                                                 (keep every run's logs)

The job: a 2-layer transformer encoder (d 64, 4 heads, sequence 16, ~70k parameters), fixed data
(256 samples drawn from seed 1), SGD with momentum. Step s takes the global batch rows
[s*G, s*G+G) mod 256 (G = 48) and splits it over the workers there are (worker r of n takes its
r-th slice), gradients averaged: whatever the world size, every step is the same full-batch step,
so the final parameters of any run can be compared with one single-process reference of the same
number of steps (max abs difference; a lost or twice-applied step shows as a large one).

Runners (each with its own defaults; the collective timeout is --timeout for all three):
  phalanx   `phalanx run -np N --min-np 1 --max-np N --max-restarts 100` (in-process elastic),
            phalanx.elastic TorchState(recover=--recover) + run, px.DataParallel, state.commit() every
            --commit-every steps (recover="live": no copy per commit, the vote waited one commit later,
            rank 0's snapshot every --snapshot-every commits in the background).
            Added worker: -np N-1 and a --host-discovery-script whose slots go from N-1 to N.
  torchft   one replica group of one process per worker, each under its own `torchrun --max-restarts 100`
            (torchft's README), the `torchft_lighthouse` it ships (--min_replicas 1), Manager(ProcessGroupGloo,
            min_replica_size=1, use_async_quorum=False) + torchft DistributedDataParallel + OptimizerWrapper;
            the state comes from a live peer (its HTTP checkpoint transport). Added worker: a new replica group.
  torchrun  `torchrun --nproc-per-node N --max-restarts 100`, torch DDP, a DCP checkpoint
            (torch.distributed.checkpoint.save of get_state_dict) every --ckpt-every steps, loaded at start.
            Added worker: two agents on a c10d rendezvous (--nnodes 1:2, last_call_timeout 1 s): N-1
            processes, then an agent of 1 joins, and every worker restarts from the checkpoint.
  ddp       plain torch DDP under torchrun, no checkpoints: the fault-free baseline of the step time.
  phalanx-file  (steady state only) phalanx with TorchState(snapshot_every=1, recover="commit"): a copy in
            memory and the commit's file every step (every rank writes its part).
  phalanx-copy  (steady state only) phalanx with recover="commit": the commit's copy in memory every step,
            the file every --snapshot-every commits (the default before recover="live").
  phalanx-plain (steady state only) px.DataParallel with no commit at all: DataParallel's own cost.
  torchft-ar    torchft without its DDP wrapper: the Manager's own allreduce of one flat gradient (the
            wrapper's survivor fails here, see the torchft rows).

Faults, into the worker of the highest rank, once the job has done --fault-at steps at its full size:
kill (SIGKILL), stop (SIGSTOP: frozen), raise (a marker file makes it raise RuntimeError at its next
step), add (a worker added). Measured per run, from one log of completed steps (every worker, with
time, step, world size and a membership key: phalanx (restart, generation), torchft (pid set and
participants), torchrun restart count):
  next step s   fault -> the first step completed after the fault by a later membership (add: the
                first step completed after the fault at all: do the members keep training?)
  stall s       the longest gap between two completed steps from the fault to back at full size
  admission s   (add) the gap before the first step completed at the full size: the admission's own pause
                plus one step (stall s also catches the load's hiccups anywhere in that window)
  full size s   fault -> the first step completed at the full size again (add: with the newcomer)
  steps redone  the highest step reached before the recovery minus the step the recovery resumed at
  max |dp|      final parameters vs the single-process reference of the same number of steps
                (the fault-free run's figure is the floor: float reassociation across the world sizes)
Steady state: the median step time of each runner's fault-free run over the plain DDP run of the
same repeat (paired: each repeat runs all four back to back, in an order reversed every other repeat).

Repeats: --repeats R runs every (runner, np, fault) R times; the table gives the median and min-max
over the repeats, and a 95% distribution-free interval of the median where R >= 6.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chaos import rows  # the job log reader (this script's folder is sys.path[0])
from dp_vs_ddp import median_ci
from fault_tolerance_pool import rounds as ab_rounds

WORKER = (Path(__file__).resolve().parent / "fault_tolerance_worker.py").read_text()  # the job, as text

RUNNERS = ("phalanx", "torchft", "torchft-ar", "torchrun")
FAULTS = ("kill", "stop", "raise", "add")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """The processes of one run (each in its own session, so whatever is left is killed by group id)."""

    def __init__(self, out: str, runner: str, np: int, a, initial: int) -> None:
        self.out, self.runner, self.np, self.a = out, runner, np, a
        self.procs: list[subprocess.Popen] = []
        self.script = os.path.join(out, "worker.py")
        with open(self.script, "w") as f:
            f.write(WORKER)
        self.args = json.dumps({"batch": a.batch, "steps": a.max_steps, "timeout": a.timeout,
                                "ckpt_every": a.ckpt_every,
                                "snapshot_every": 1 if runner == "phalanx-file" else a.snapshot_every,
                                "snapshot_period": None if runner == "phalanx-file" else a.snapshot_period,
                                "recover": "commit" if runner in ("phalanx-file", "phalanx-copy") else a.recover,
                                "commit_every": 0 if runner == "phalanx-plain" else a.commit_every,
                                "ft_ddp": runner == "torchft", "ab_rounds": a.ab_rounds, "ab_window": a.ab_window,
                                "ab_control": a.ab_control, "ab_copy": a.ab_copy, "vote_s": a.vote_s,
                                "trace": a.trace})
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = open(os.path.join(out, "output.log"), "w")
        if runner.startswith("phalanx"):
            if a.spare:   # the launcher keeps a warm spare: a replacement's imports are done ahead
                self.env["PHALANX_ELASTIC_SPARE"] = "1"
            cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(initial), "--min-np", "1", "--max-np", str(np),
                   "--max-restarts", "100", "--timeout", str(int(a.timeout))]
            if initial < np:  # a worker is added: discovery's slots go from np-1 to np
                with open(os.path.join(out, "slots"), "w") as f:
                    f.write(str(initial))
                hosts = os.path.join(out, "hosts.sh")
                with open(hosts, "w") as f:
                    f.write(f"#!/bin/sh\necho localhost:$(cat {out}/slots)\n")
                os.chmod(hosts, 0o755)
                cmd += ["--host-discovery-script", hosts]
            self.start(cmd + [sys.executable, self.script, out, runner, self.args])
        elif runner in ("torchft", "torchft-ar"):
            lport = free_port()
            self.env["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{lport}"
            self.start(["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
                        "--join_timeout_ms", "10000", "--bind", f"[::]:{lport}"])
            for i in range(initial):
                self.add_replica(i)
        elif runner in ("torchrun", "ddp"):
            if initial < np:   # two agents on one c10d rendezvous: np-1 processes now, one more later
                self.rdzv = free_port()
                self.start(self.agent(initial, nnodes="1:2"))
            else:
                self.start(["torchrun", "--nproc-per-node", str(np), "--max-restarts", "100",
                            "--master-port", str(free_port()), "--monitor-interval", "0.1",
                            self.script, out, runner, self.args])

    def agent(self, nproc: int, nnodes: str) -> list[str]:
        return ["torchrun", "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", "100",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv}", "--rdzv-id", "ft",
                "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.1",
                self.script, self.out, self.runner, self.args]

    def start(self, cmd: list[str], env: dict | None = None) -> None:
        self.procs.append(subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or self.env,
                                           start_new_session=True, cwd=self.out))

    def add_replica(self, i: int) -> None:
        self.start(["torchrun", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "100",
                    "--master-port", str(free_port()), "--monitor-interval", "0.1",
                    self.script, self.out, self.runner, self.args], env={**self.env, "FT_REPLICA": str(i)})

    def add_worker(self) -> None:
        if self.runner == "phalanx":
            with open(os.path.join(self.out, "slots.tmp"), "w") as f:
                f.write(str(self.np))
            os.replace(os.path.join(self.out, "slots.tmp"), os.path.join(self.out, "slots"))
        elif self.runner.startswith("torchft"):
            self.add_replica(self.np - 1)
        else:
            self.start(self.agent(1, nnodes="1:2"))

    def victim(self) -> int | None:
        """The pid of the live worker of the highest rank (from the workers' start rows)."""
        import psutil
        mine = set()
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                mine |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        starts = [r for r in rows(self.out) if r["what"] == "start" and r["pid"] in mine]
        steps = {r["pid"]: r["rank"] for r in rows(self.out) if r["what"] == "step"}
        live = [(steps.get(r["pid"], r["rank"]), r["pid"]) for r in starts]
        return max(live)[1] if live else None

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs if p.args[0] != "torchft_lighthouse")

    def end(self, wait: float) -> list[int | None]:
        deadline = time.time() + wait
        for p in self.procs:
            if p.args[0] == "torchft_lighthouse":
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.time()))
        codes = [p.poll() for p in self.procs]
        import psutil
        for p in self.procs:   # torchrun starts its workers in sessions of their own: end those by pid
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        c.send_signal(signal.SIGCONT)
                        c.kill()
        for p in self.procs:   # whatever is left (a frozen worker, the lighthouse): its own session only
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.log.close()
        return codes


def steps_of(out: str) -> list[dict]:
    return [r for r in rows(out) if r["what"] == "step"]


def key(r: dict) -> tuple:
    return tuple(r.get("key") or ())


def one_run(runner: str, np: int, fault: str | None, a, out: str) -> dict:
    """Run the job; inject ``fault`` once it has done --fault-at steps at its starting size; end it
    --tail steps after it is back at the full size (or --bound s after the fault)."""
    os.makedirs(out)
    initial = np - 1 if fault == "add" else np
    job = Job(out, runner, np, a, initial)
    info: dict = {"runner": runner, "np": np, "fault": fault}
    try:
        t_start = time.time()
        while True:   # ready: --fault-at steps done at the starting size (bounded)
            done = [r for r in steps_of(out) if r["size"] == initial]
            if (fault and done and done[-1]["step"] >= a.fault_at) or (not fault and steps_of(out)) \
                    or not job.running() or time.time() > t_start + a.bound + 60:
                break
            time.sleep(0.05)
        if fault and job.running() and done and done[-1]["step"] >= a.fault_at:
            before = steps_of(out)
            info["key0"] = key(before[-1])
            t0 = time.time()
            if fault == "add":
                job.add_worker()
            else:
                pid = job.victim()
                info["victim"] = pid
                if fault == "raise":
                    open(os.path.join(out, f"raise.{pid}"), "w").close()
                else:
                    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            info["t0"] = t0
            while time.time() < t0 + a.bound and job.running():   # back at the full size
                if any(r["t"] > t0 and r["size"] == np and (fault == "add" or key(r) != info["key0"])
                       for r in steps_of(out)):
                    break
                time.sleep(0.05)
        if fault:
            last = max((r["step"] for r in steps_of(out)), default=0)
            with open(os.path.join(out, "stop.tmp"), "w") as f:
                f.write(str(last + a.tail))
            os.replace(os.path.join(out, "stop.tmp"), os.path.join(out, "stop"))
        info["codes"] = job.end(a.bound + 60)
    finally:
        if job.procs and any(p.poll() is None for p in job.procs):
            job.end(0)
    info["rows"] = rows(out)
    return info


def analyse(info: dict, np: int) -> dict:
    steps = [r for r in info["rows"] if r["what"] == "step"]
    end = next((r for r in info["rows"] if r["what"] == "end"), None)
    res = {"end_step": end["step"] if end else None}
    if "t0" not in info:
        return res
    t0, k0, fault = info["t0"], tuple(info["key0"]), info["fault"]
    later = [r for r in steps if r["t"] > t0 and (fault == "add" or key(r) != k0)]
    if not later:
        return res
    first = later[0]
    res["next_step_s"] = first["t"] - t0
    full = [r for r in later if r["size"] == np]
    res["full_size_s"] = full[0]["t"] - t0 if full else None
    # redone: steps trained again in the new membership (a new key). For "add" the old one trains on past
    # t0, and ranks log each step a few ms apart: a rank's row of step n after t0, when another logged n
    # before it, is no step redone
    renewed = next((r for r in later if key(r) != k0), first)
    reached = max((r["step"] for r in steps if r["t"] < renewed["t"]), default=0)
    res["steps_redone"] = max(0, reached - (renewed["step"] - 1))
    until = full[0]["t"] if full else first["t"]
    win = [t for t in sorted({r["t"] for r in steps} | {t0}) if t0 <= t <= until]
    res["stall_s"] = max((b - a_ for a_, b in zip(win, win[1:])), default=None)
    if fault == "add" and full:   # the admission's own gap: the last step before the first at the full size
        before = [r["t"] for r in steps if r["t"] < full[0]["t"]]
        res["admit_s"] = full[0]["t"] - max(before) if before else None
    return res


def step_time(info: dict, skip: int) -> float | None:
    """Mean time per step (rank 0's log) after ``skip`` warm-up steps: every step's cost, the
    checkpoint or commit steps included."""
    steps = [r for r in info["rows"] if r["what"] == "step" and r["rank"] == 0 and r["step"] > skip]
    if len(steps) < 2:
        return None
    return (steps[-1]["t"] - steps[0]["t"]) / (steps[-1]["step"] - steps[0]["step"])


def reference(batch: int, wanted: set[int]) -> dict[int, list]:
    """Single-process params after each wanted number of full-batch steps (the same math as every runner)."""
    ns: dict = {}
    src = WORKER.split("\nif MODE")[0].replace("OUT, MODE, A = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])",
                                                f"A = {{'batch': {batch}}}")
    exec(src, ns)  # the worker's own make(), data and optimizer
    import torch
    net, out = ns["make"](), {}
    opt = ns["optimizer"](net)
    for s in range(max(wanted, default=0)):
        x, y = ns["batch"](s, 0, 1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if s + 1 in wanted:
            out[s + 1] = [p.detach().clone() for p in net.parameters()]
    return out


def final_params(out: str):
    import torch
    files = sorted(f for f in os.listdir(out) if f.startswith("params."))
    return torch.load(os.path.join(out, files[-1])) if files else None


def summary(vals: list) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    m = statistics.median(vals)
    ci = median_ci(vals)
    if len(vals) == 1:
        return f"{m:.2f}"
    rng = f" [{min(vals):.2f}-{max(vals):.2f}]"
    return f"{m:.2f}{rng}" + (f" ci {ci[0]:.2f}-{ci[1]:.2f}" if ci else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch", type=int, default=48, help="global batch (split over the workers)")
    p.add_argument("--commit-every", type=int, default=1, help="phalanx: state.commit() every N steps")
    p.add_argument("--recover", default="live", choices=("live", "commit"),
                   help="phalanx: TorchState(recover=...): survivors go on from the live state (no copy per "
                        "commit) or roll back to the last commit's copy in memory (default live)")
    p.add_argument("--snapshot-every", type=int, default=10,
                   help="phalanx: TorchState(snapshot_every=N): the commit's file every N commits (memory: each)")
    p.add_argument("--snapshot-period", type=float, default=None,
                   help="phalanx (recover live): TorchState(snapshot_period_s=S): at most one snapshot every S "
                        "seconds (default: TorchState's, 10 s; 0: every --snapshot-every-th commit)")
    p.add_argument("--torchft-ddp-np", default="2",
                   help="world sizes at which the torchft runner (its DistributedDataParallel) runs (default 2)")
    p.add_argument("--ckpt-every", type=int, default=10, help="torchrun: a DCP checkpoint every N steps")
    p.add_argument("--fault-at", type=int, default=15, help="inject after this many steps at the starting size")
    p.add_argument("--tail", type=int, default=10, help="steps to run after the recovery")
    p.add_argument("--steady-steps", type=int, default=120, help="steps of the fault-free runs")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout (s), all runners")
    p.add_argument("--bound", type=float, default=45.0, help="seconds to wait for a recovery")
    p.add_argument("--steady-repeats", type=int, default=None,
                   help="repeats of the fault-free runs (default: --repeats)")
    p.add_argument("--steady-extras", action="store_true",
                   help="also the fault-free phalanx-plain, phalanx-copy and phalanx-file runs")
    p.add_argument("--ab-rounds", type=int, default=0,
                   help="phalanx's commit cost inside one job: R rounds of three windows (no commit, live "
                        "commits, copying commits; order rotating), paired per round (default 0: not run)")
    p.add_argument("--ab-window", type=int, default=20, help="steps per window of --ab-rounds")
    p.add_argument("--ab-control", action="store_true",
                   help="--ab-rounds: a fourth window a round, committing nothing like the first (an A/A control: "
                        "its ratio is what the A/B reads where nothing differs)")
    p.add_argument("--ab-no-copy", dest="ab_copy", action="store_false",
                   help="--ab-rounds: no copying-commit window, so no window follows a copy's 35%% slower one "
                        "(the rotation puts the no-commit window after it twice as often as the live one)")
    p.add_argument("--vote-s", type=float, default=None,
                   help="phalanx: set pending.VOTE_S, the members' vote spacing while nothing is pending (a "
                        "diagnostic; default: the library's 0.5 s; at most one vote in 101 commits either way)")
    p.add_argument("--spare", action="store_true",
                   help="phalanx: PHALANX_ELASTIC_SPARE=1 (a warm spare process replaces a lost or added worker)")
    p.add_argument("--trace", action="store_true",
                   help="phalanx: log each step of a re-form (phase rows: leave, adopt, runtime init, sync, ...)")
    p.add_argument("--keep", metavar="DIR", help="keep every run's logs under DIR (new)")
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    a = p.parse_args()
    sizes = [int(n) for n in a.np.split(",")]
    ddp_np = [int(n) for n in a.torchft_ddp_np.split(",") if n]
    runners = [r for r in a.runners.split(",") if r]
    faults = [f for f in a.faults.split(",") if f]
    if any(r not in RUNNERS for r in runners) or any(f not in FAULTS for f in faults):
        p.error(f"--runners of {','.join(RUNNERS)}; --faults of {','.join(FAULTS)}")
    if any(n < 2 or a.batch % n or a.batch % (n - 1) for n in sizes):
        p.error("--np: each at least 2, and --batch divisible by it and by it minus one")
    try:
        import psutil  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/fault_tolerance.py needs psutil (pip install psutil)")
    if "torchft" in runners and shutil.which("torchft_lighthouse") is None:
        sys.exit("torchft runner: no torchft_lighthouse on PATH (pip install torchft); or --runners phalanx,torchrun")

    root = a.keep or tempfile.mkdtemp(prefix="ft-bench-")
    os.makedirs(root, exist_ok=True)
    results: list[dict] = []
    t_all = time.time()
    saved = {"steady_steps": a.steady_steps}
    a.max_steps, saved_max = a.steady_steps, a.max_steps
    steady = [*runners, *(["phalanx-plain", "phalanx-copy", "phalanx-file"]
                          if "phalanx" in runners and a.steady_extras else [])]
    steady_repeats = a.repeats if a.steady_repeats is None else a.steady_repeats
    for rep in range(steady_repeats):   # steady state: fault-free runs, paired with plain DDP
        for n in sizes:
            order = ["ddp", *steady] if rep % 2 == 0 else [*reversed(steady), "ddp"]
            for r in order:
                if r == "torchft" and n not in ddp_np:
                    continue
                info = one_run(r, n, None, a, os.path.join(root, f"ff-{r}-{n}-{rep}"))
                results.append({**{k: v for k, v in info.items() if k != "rows"}, "repeat": rep,
                                "step_s": step_time(info, 20), "end_step": a.steady_steps,
                                "out": os.path.join(root, f"ff-{r}-{n}-{rep}")})
                print(f"fault-free {r} np {n}: step {results[-1]['step_s']}", flush=True)
    a.max_steps = saved_max
    ab, ab_read = {}, {}   # np -> mode -> ratios; np -> mode -> all that fault_tolerance_pool.rounds reads
    if a.ab_rounds:   # the commit's cost against the same job's own steps, window by window
        for n in sizes:
            one_run("phalanx-ab", n, None, a, os.path.join(root, f"ab-{n}"))
            modes = ("live", *(["copy"] if a.ab_copy else []), *(["none2"] if a.ab_control else []))
            ab_read[n] = {m: ab_rounds(os.path.join(root, f"ab-{n}", "log.jsonl"), m) for m in modes}
            ab[n] = {m: got[0] for m, got in ab_read[n].items()}
            print(f"ab np {n}: " + json.dumps({m: summary(v) for m, v in ab[n].items()}), flush=True)
    for rep in range(a.repeats):
        for n in sizes:
            for f in faults:
                for r in runners if rep % 2 == 0 else list(reversed(runners)):
                    if r == "torchft" and n not in ddp_np:
                        continue
                    out = os.path.join(root, f"{r}-{n}-{f}-{rep}")
                    info = one_run(r, n, f, a, out)
                    res = analyse(info, n)
                    results.append({**{k: v for k, v in info.items() if k not in ("rows", "key0")}, **res,
                                    "repeat": rep, "out": out})
                    print(f"{f} {r} np {n}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                          for k, v in res.items()}), flush=True)
    # final parameters vs the single-process reference of the same number of steps
    ref = reference(a.batch, {r["end_step"] for r in results if r.get("end_step")})
    for r in results:
        got = final_params(r["out"])
        want = ref.get(r.get("end_step"))
        if got is not None and want is not None:
            r["max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(got, want))
        r["error"] = None
        if r.get("next_step_s") is None and r["fault"]:
            with open(os.path.join(r["out"], "output.log"), errors="replace") as fh:
                err = [ln for ln in fh.read().splitlines() if "Error" in ln or "error" in ln]
            r["error"] = err[-1][:300] if err else "no recovery and no error line"
    wall = time.time() - t_all

    print(f"\nfault tolerance: {a.repeats} repeat(s), np {a.np}, phalanx commit every {a.commit_every}, "
          f"snapshot every {a.snapshot_every} (period {a.snapshot_period} s), DCP every {a.ckpt_every}, timeout {a.timeout:.0f}s, {wall / 60:.1f} min; median [min-max] over repeats")
    print(f"{'np':>2} {'fault':<5} {'runner':<8} {'next step s':>16} {'stall s':>16} {'full size s':>16} "
          f"{'redone':>10} {'max|dp|':>9} {'admission s':>16}  error")
    for n in sizes:
        for f in faults:
            for r in runners:
                rs = [x for x in results if x["runner"] == r and x["np"] == n and x["fault"] == f]
                diffs = [x.get("max_abs_diff") for x in rs if x.get("max_abs_diff") is not None]
                errs = {x["error"] for x in rs if x.get("error")}
                print(f"{n:>2} {f:<5} {r:<8} {summary([x.get('next_step_s') for x in rs]):>16} "
                      f"{summary([x.get('stall_s') for x in rs]):>16} {summary([x.get('full_size_s') for x in rs]):>16} "
                      f"{summary([x.get('steps_redone') for x in rs]):>10} "
                      f"{(f'{max(diffs):.1e}' if diffs else '-'):>9} {summary([x.get('admit_s') for x in rs]):>16}"
                      f"  {'; '.join(sorted(errs))}")
    print(f"\nsteady state (fault-free, {a.steady_steps} steps): step time / plain DDP's, paired per repeat")
    for n in sizes:
        for r in steady:
            ratios, diffs = [], []
            for rep in range(steady_repeats):
                mine = [x for x in results if x["fault"] is None and x["runner"] == r and x["np"] == n
                        and x["repeat"] == rep]
                base = [x for x in results if x["fault"] is None and x["runner"] == "ddp" and x["np"] == n
                        and x["repeat"] == rep]
                if mine and base and mine[0]["step_s"] and base[0]["step_s"]:
                    ratios.append(mine[0]["step_s"] / base[0]["step_s"])
                diffs += [x["max_abs_diff"] for x in mine if x.get("max_abs_diff") is not None]
            ddp = [x["step_s"] for x in results if x["fault"] is None and x["runner"] == "ddp" and x["np"] == n
                   and x["step_s"]]
            print(f"np {n} {r:<8} {summary(ratios)} (ddp step {statistics.median(ddp) * 1e3 if ddp else 0:.1f} ms; "
                  f"fault-free max|dp| {max(diffs) if diffs else float('nan'):.1e})")
    if ab:
        print(f"\ncommit cost inside one job ({a.ab_rounds} rounds of {a.ab_window}-step windows, order rotating): "
              "window time / the same round's window without commits")
        for n, by in ab.items():
            none_ms = [r["s"] / a.ab_window * 1e3 for r in rows(os.path.join(root, f"ab-{n}"))
                       if r["what"] == "window" and r["mode"] == "none"]
            inside = {m: statistics.median(ab_read[n][m][1] if m in ab_read[n] else [float("nan")])
                      for m in ("live", "copy")}
            voted, ranks = ab_read[n]["live"][2], ab_read[n]["live"][3]   # (ranks: every rank's live shares)
            print(f"np {n}: live commits {summary(by['live'])}, copying commits {summary(by.get('copy', []))} "
                  f"(no-commit step {statistics.median(none_ms) if none_ms else float('nan'):.1f} ms; rank 0's time "
                  f"inside commit(), median share of its window: live {inside['live']:.1%}, copy {inside['copy']:.1%}"
                  + (f"; votes per live window: mean {statistics.mean(voted):.2f}" if voted else "")
                  + ("; every rank's live share: " + ", ".join(f"r{k} {statistics.median(v):.2%}" for k, v in
                                                              sorted(ranks.items())) if len(ranks) > 1 else "") + ")"
                  + (f"; control, no commits either: {summary(by['none2'])}" if "none2" in by else ""))
    doc = {"bench": "fault_tolerance", "ab": {str(n): by for n, by in ab.items()}, "repeats": a.repeats, "np": sizes, "commit_every": a.commit_every,
           "snapshot_every": a.snapshot_every, "snapshot_period": a.snapshot_period, "recover": a.recover, "spare": a.spare,
           "ckpt_every": a.ckpt_every, "timeout": a.timeout, "minutes": round(wall / 60, 2), **saved,
           "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "out"}
                    for r in results]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

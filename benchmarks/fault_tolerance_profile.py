"""Where the steady cost of ``recover="live"`` goes: rank 0 per thread, a live-commit job vs a no-commit job.

Run:  scripts/px-bench timeout 600 python benchmarks/fault_tolerance_profile.py              (np 2, ~1 min)
      ... --np 4 --seconds 20 --py-spy 0                                             (CPU per thread only)

The job is benchmarks/fault_tolerance_worker.py under `phalanx run` (in-process elastic), the same one
benchmarks/fault_tolerance.py times: a commit every step with recover="live" (TorchState's defaults
apart from --snapshot-every / --snapshot-period), and the same job with no commit at all. For each,
once warm, over --seconds:
  * CPU per thread of every rank, from /proc/<pid>/task/*/stat, as a share of one core; rank 0's
    Python threads named from `py-spy dump` (the rest are native: gloo's and torch's own threads);
  * (--py-spy, default on) `py-spy record --threads --idle` of rank 0 at --rate Hz: the training
    thread's samples inside commit(), split into the snapshot, the vote's allreduce launch, the rest
    of the vote and the rest of commit(); and how often each background thread was not waiting.
The step time printed is each job's own, over the profiled stretch (not a paired comparison: that is
fault_tolerance.py --ab-rounds).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = (Path(__file__).resolve().parent / "fault_tolerance_worker.py").read_text()


def cpu_ticks(pid: int) -> dict[int, int]:
    """Thread id -> user + system clock ticks so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return out


def thread_names(pid: int) -> dict[int, str]:
    dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    return {int(tid, 0): name for tid, name in re.findall(r"Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): \"([^\"]+)\"", dump)}


def last_step(out: str) -> int:
    with open(os.path.join(out, "log.jsonl")) as f:
        return max((r["step"] for r in map(json.loads, f) if r["what"] == "step"), default=0)


def commit_split(raw: str) -> tuple[int, collections.Counter, dict[str, float]]:
    """py-spy's raw samples: the training thread's count, its commit() samples by part, and the share of
    samples each other thread spent not waiting."""
    parts: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    seen: collections.Counter = collections.Counter()
    main = 0
    with open(raw) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            thread, names = frames[0].split(": ")[-1], [fr.split(" (")[0] for fr in frames]
            if thread != "MainThread":
                seen[thread] += int(n)
                busy[thread] += int(n) if names[-1] != "Condition.wait" else 0
                continue
            main += int(n)
            if "TorchState.commit" in names:
                part = ("snapshot" if "TorchState._snapshot_alone" in names else "vote: allreduce launch"
                        if "all_reduce" in names else "vote: the rest" if "commit_round" in names else "the rest")
                parts[part] += int(n)
    return main, parts, {t: busy[t] / seen[t] for t in seen if t.startswith("phalanx")}


def job(label: str, commit_every: int, a, root: str) -> None:
    out = os.path.join(root, label)
    os.makedirs(out)
    with open(os.path.join(out, "worker.py"), "w") as f:
        f.write(WORKER)
    args = json.dumps({"batch": 48, "steps": 10 ** 6, "timeout": 20, "ckpt_every": 10, "recover": "live",
                       "snapshot_every": a.snapshot_every, "snapshot_period": a.snapshot_period,
                       "commit_every": commit_every, "ft_ddp": False, "ab_rounds": 0, "ab_window": 20})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(out, "output.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-np", str(a.np), "--min-np", "1",
                                 "--max-np", str(a.np), "--max-restarts", "0", "--timeout", "20", sys.executable,
                                 os.path.join(out, "worker.py"), out, "phalanx", args],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pids: dict[int, int] = {}
        deadline = time.time() + 180
        while len(pids) < a.np and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if os.path.exists(os.path.join(out, "log.jsonl")):
                with open(os.path.join(out, "log.jsonl")) as f:
                    pids.update({r["rank"]: r["pid"] for r in map(json.loads, f) if r["what"] == "start"})
        if len(pids) < a.np:
            sys.exit(f"{label}: the job did not start (see {out}/output.log)")
        time.sleep(a.warmup)
        names = thread_names(pids[0])
        before, s0, t0 = {r: cpu_ticks(p) for r, p in pids.items()}, last_step(out), time.time()
        raw = os.path.join(out, "py-spy.txt")
        if a.py_spy:
            spy = subprocess.run(["py-spy", "record", "--pid", str(pids[0]), "--threads", "--idle", "-r", str(a.rate),
                                  "-d", str(a.seconds), "--format", "raw", "-o", raw, *(["--native"] if a.native else ["--nonblocking"])],
                                 capture_output=True, text=True)
            if spy.returncode != 0:
                sys.exit(f"{label}: py-spy record failed: {(spy.stderr or spy.stdout).strip().splitlines()[-1:]}")
        else:
            time.sleep(a.seconds)
        after, s1, t1 = {r: cpu_ticks(p) for r, p in pids.items()}, last_step(out), time.time()
        hz = os.sysconf("SC_CLK_TCK")
        print(f"== {label}: {(t1 - t0) / max(1, s1 - s0) * 1e3:.2f} ms a step over {s1 - s0} steps")
        for r in sorted(pids):
            share = sorted((((after[r][t] - before[r].get(t, 0)) / hz / (t1 - t0)), t) for t in after[r])
            print(f"  rank {r} CPU, share of a core: total {sum(s for s, _ in share):.1%}; " + ", ".join(
                f"{names.get(t, 'native') if r == 0 else 'thread'}-{t} {s:.1%}" for s, t in reversed(share) if s >= 0.001))
        if a.py_spy and os.path.exists(raw):
            main, parts, busy = commit_split(raw)
            inside = sum(parts.values())
            print(f"  rank 0 training thread, {main} samples: inside commit() {inside / max(1, main):.2%} (" + ", ".join(
                f"{k} {n / max(1, main):.2%}" for k, n in parts.most_common()) + ")")
            print("  rank 0 background threads, share of samples not waiting: " + ", ".join(
                f"{t} {s:.2%}" for t, s in sorted(busy.items())))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--seconds", type=int, default=12, help="the profiled stretch of each job (whole seconds)")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds after every rank started")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    p.add_argument("--py-spy", type=int, default=1, help="1: also py-spy rank 0 (0: CPU per thread only)")
    p.add_argument("--native", action="store_true",
                   help="py-spy --native: C/C++ frames too (stops rank 0 at each sample, so its step time is not the job's)")
    p.add_argument("--jobs", default="none,live", help="which of the two jobs to run (comma-separated)")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--snapshot-period", type=float, default=None,
                   help="TorchState(snapshot_period_s=); default: TorchState's own (10 s); 0: every due commit")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--keep", metavar="DIR", help="keep the logs and py-spy samples under DIR")
    a = p.parse_args()
    if a.py_spy and shutil.which("py-spy") is None:
        sys.exit("benchmarks/fault_tolerance_profile.py: no py-spy on PATH (pip install py-spy), or --py-spy 0")
    root = a.keep or tempfile.mkdtemp(prefix="ft-profile-")
    os.makedirs(root, exist_ok=True)
    print(f"np {a.np}, snapshot every {a.snapshot_every} commits, period {a.snapshot_period} "
          f"(None: TorchState's default), {a.seconds} s profiled per job")
    for rep in range(a.repeats):
        for label, every in (("none", 0), ("live", 1)) if rep % 2 == 0 else (("live", 1), ("none", 0)):
            if label in a.jobs.split(","):
                job(f"{label}-{a.np}-{rep}", every, a, root)
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Job start to first training step on a 2-node SLURM cluster: ``salloc … phalanx run`` vs ``salloc … srun``.

Run (root; needs slurm-wlm and munge: scripts/install-test-deps.sh)::

    flock /tmp/phalanx-bench.lock python benchmarks/slurm_start.py [--repeats 5] [--nodes 2] [--per-node 1]

Starts the test cluster of tests/jobs/slurm_cluster.py (munged, slurmctld, two slurmd on this
machine), then, interleaved per repeat, times from the moment ``salloc`` is started to the end
of rank 0's first ``DataParallel`` step for::

    phalanx   salloc -N2 -n2 phalanx run python step.py     (one agent per node through srun)
    srun      salloc -N2 -n2 srun python step.py            (the ranks read srun's variables)

and prints the medians side by side with the ratio. Both include salloc's own allocation
time, the interpreter and torch import, ``px.init()`` and one step.

``--requeue``: preempt -> requeue -> first resumed step, per repeat one ``sbatch --requeue`` job
(docs/slurm.md's preemption script: ``exec phalanx run --preempt-signal USR1 python loop.py``, 2
nodes x 1) that trains until its first step is done; then ``scancel --signal=USR1 --full`` and the
times from that signal to: the checkpoint and ``scontrol requeue`` done (job pending again,
``Restarts=1``), the job running again, and rank 0's first step of the requeued run (resumed from
the checkpoint). Printed: the medians of each, and ``sbatch`` -> first step of the first run::

    flock /tmp/phalanx-bench.lock python benchmarks/slurm_start.py --requeue --repeats 5
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

STEP = '''
import time, torch, phalanx as px
topo = px.init()
model = torch.nn.Linear(32, 1)
ddp = px.DataParallel(model)
ddp(torch.randn(4, 32)).sum().backward()
if topo.rank == 0:
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
px.shutdown()
'''


def _one(cluster, argv, cwd):
    t0 = time.time()
    res = cluster.run(argv, cwd=cwd, timeout=300)
    if res.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}")
    stamps = [float(line.split("FIRST_STEP ")[1]) for line in res.stdout.splitlines() if "FIRST_STEP " in line]
    if len(stamps) != 1:
        raise SystemExit(f"expected one FIRST_STEP line from rank 0: {res.stdout[-2000:]}")
    return stamps[0] - t0


LOOP = '''
import os, sys, time, torch, phalanx as px
from phalanx.checkpoint import CheckpointManager, RNGState
out = sys.argv[1]
topo = px.init()
torch.manual_seed(0)
model = px.DataParallel(torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mgr = CheckpointManager(os.path.join(out, "ckpt"))
state = {"model": model.module, "optim": opt, "rng": RNGState(), "step": 0}
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
with px.preemption.watch() as preempt:
    preempt.resume(mgr, state)
    first = state["step"]
    for step in range(first, 100000):
        opt.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        state["step"] = step + 1
        if step == first and topo.rank == 0:
            with open(os.path.join(out, f"first.{restart}"), "w") as f:
                f.write(f"{time.time():.6f} {first}")
        if restart != "0" and step >= first + 3:
            break
        if preempt.requested():
            preempt.save_and_exit(mgr, state["step"], state)
        time.sleep(0.01)
px.shutdown()
'''

JOB = """#!/usr/bin/env bash
#SBATCH -N2 -n2
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -o {out}/slurm.out
export PYTHONPATH={pythonpath}
exec {python} -m phalanx run --preempt-signal USR1 {python} {out}/loop.py {out}
"""


def _job(cluster, job_id):
    out = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState"), int(fields.get("Restarts", "0") or 0)


def _wait_for(what, check, deadline, log):
    while True:
        got = check()
        if got:
            return time.time()
        if time.monotonic() > deadline:
            raise SystemExit(f"slurm_start --requeue: no {what} in time; job output: {log()[-3000:]}")
        time.sleep(0.02)


def _requeue_once(cluster, root, i):
    out = os.path.join(root, f"r{i}")
    os.makedirs(out)
    os.chmod(out, 0o755)
    with open(os.path.join(out, "loop.py"), "w") as f:
        f.write(LOOP)
    with open(os.path.join(out, "job.sh"), "w") as f:
        f.write(JOB.format(out=out, python=sys.executable, pythonpath=os.environ.get("PYTHONPATH", "")))
    first = [os.path.join(out, f"first.{k}") for k in (0, 1)]

    def log():
        with contextlib.suppress(OSError), open(os.path.join(out, "slurm.out")) as f:
            return f.read()
        return ""

    t0 = time.time()
    sub = cluster.run(["sbatch", "--parsable", os.path.join(out, "job.sh")])
    if sub.returncode:
        raise SystemExit(f"sbatch failed: {sub.stderr}")
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    _wait_for("first step", lambda: os.path.exists(first[0]), deadline, log)
    t_first = float(open(first[0]).read().split()[0])
    t_sig = time.time()
    sig = cluster.run(["scancel", "--signal=USR1", "--full", job])
    if sig.returncode:
        raise SystemExit(f"scancel failed: {sig.stderr}")
    t_pending = _wait_for("requeue", lambda: _job(cluster, job)[1] >= 1, deadline, log)  # Restarts=1
    t_running = _wait_for("restart", lambda: _job(cluster, job)[0] in ("RUNNING", "COMPLETED")
                          and _job(cluster, job)[1] == 1, deadline, log)
    _wait_for("first resumed step", lambda: os.path.exists(first[1]), deadline, log)
    t_resumed, resumed_at = open(first[1]).read().split()
    if int(resumed_at) == 0:
        raise SystemExit(f"the requeued run did not resume from the checkpoint: {log()[-3000:]}")
    _wait_for("job end", lambda: _job(cluster, job)[0] in ("COMPLETED", "FAILED", "CANCELLED"), deadline, log)
    return {"sbatch -> first step": t_first - t0, "signal -> requeued": t_pending - t_sig,
            "requeued -> running": t_running - t_pending, "running -> first resumed step": float(t_resumed) - t_running,
            "signal -> first resumed step": float(t_resumed) - t_sig}


def requeue_main(args) -> None:
    from slurm_cluster import SlurmCluster

    rows = []
    with SlurmCluster(cred_expire=args.cred_expire) as cluster, tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o755)
        for i in range(args.repeats):
            rows.append(_requeue_once(cluster, root, i))
    load = os.getloadavg()[0]
    print(f"preempt -> requeue -> first resumed step, 2 nodes x 1, sbatch --requeue + phalanx run --preempt-signal "
          f"USR1, median of {args.repeats} (1-min load at the end {load:.2f}); SLURM holds a requeued job for "
          f"AuthInfo cred_expire={args.cred_expire} s (its default: 120) before it may start again")
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"{key:>32} {statistics.median(values):7.2f}s   all: {' '.join(f'{v:.2f}' for v in values)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nodes", type=int, default=2, choices=(1, 2))
    p.add_argument("--per-node", type=int, default=1)
    p.add_argument("--requeue", action="store_true",
                   help="time preempt -> requeue -> first resumed step instead (sbatch --requeue)")
    p.add_argument("--cred-expire", type=int, default=120,
                   help="with --requeue: the cluster's AuthInfo cred_expire, SLURM's hold on a requeued job "
                        "(default 120, SLURM's own default)")
    args = p.parse_args()
    from slurm_cluster import SlurmCluster, requirements_missing

    why = requirements_missing()
    if why:
        raise SystemExit(f"slurm_start: {why}")
    if args.requeue:
        return requeue_main(args)
    n = args.nodes * args.per_node
    alloc = ["salloc", f"-N{args.nodes}", f"-n{n}"]
    runs = {"phalanx": [*alloc, sys.executable, "-m", "phalanx", "run", "python", "step.py"],
            "srun": [*alloc, "srun", sys.executable, "step.py"]}
    times = {k: [] for k in runs}
    with SlurmCluster() as cluster, tempfile.TemporaryDirectory() as cwd:
        with open(os.path.join(cwd, "step.py"), "w") as f:
            f.write(STEP)
        _one(cluster, runs["srun"], cwd)  # warm the page cache (python, torch) before timing
        for _ in range(args.repeats):
            for name, argv in runs.items():
                times[name].append(_one(cluster, argv, cwd))
    load = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"job start -> first step, {args.nodes} node(s) x {args.per_node}, median of {args.repeats} "
          f"(1-min load at the end {load:.2f})")
    print(f"{'salloc … phalanx run':>24} {'salloc … srun':>16} {'ratio':>8}")
    print(f"{med['phalanx']:>23.2f}s {med['srun']:>15.2f}s {med['phalanx'] / med['srun']:>8.2f}")
    print("all phalanx:", " ".join(f"{t:.2f}" for t in times["phalanx"]))
    print("all srun:   ", " ".join(f"{t:.2f}" for t in times["srun"]))


if __name__ == "__main__":
    main()

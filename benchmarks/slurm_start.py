"""Job start to first training step on a 2-node SLURM cluster: ``salloc … phalanx run`` vs ``salloc … srun``.

Run (root; needs slurm-wlm and munge: scripts/install-test-deps.sh)::

    flock /tmp/phalanx-bench.lock python benchmarks/slurm_start.py [--repeats 5] [--nodes 2] [--per-node 1]

Starts the test cluster of tests/slurm_cluster.py (munged, slurmctld, two slurmd on this
machine), then, interleaved per repeat, times from the moment ``salloc`` is started to the end
of rank 0's first ``DataParallel`` step for::

    phalanx   salloc -N2 -n2 phalanx run python step.py     (one agent per node through srun)
    srun      salloc -N2 -n2 srun python step.py            (the ranks read srun's variables)

and prints the medians side by side with the ratio. Both include salloc's own allocation
time, the interpreter and torch import, ``px.init()`` and one step.
"""

import argparse
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nodes", type=int, default=2, choices=(1, 2))
    p.add_argument("--per-node", type=int, default=1)
    args = p.parse_args()
    from slurm_cluster import SlurmCluster, requirements_missing

    why = requirements_missing()
    if why:
        raise SystemExit(f"slurm_start: {why}")
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

"""Hierarchical vs flat (gloo's own) allreduce on a simulated 2-host x 2-rank cluster with 1 Gbit/s links.

Run (root; needs ip, tc, sshd)::

    python benchmarks/allreduce_cluster.py [--sizes 64MB] [--rate 1gbit] [--repeats 5]
    python benchmarks/allreduce_cluster.py --phases [--sizes 64MB]     # where the time goes

Brings up the cluster, runs `phalanx bench allreduce` through the real SSH launch
path (one agent per simulated host), prints its table (flat, ring, hierarchical
interleaved per repeat; medians) and removes the cluster.

``--phases`` runs this file's worker instead and times, interleaved, each piece a
hierarchical allreduce is made of next to gloo's flat ring: the inter-host step
alone (gloo allreduce of one 1/L shard on the cross group, the floor for any
hierarchical schedule), gloo's intra-host reduce_scatter_tensor and
all_gather_into_tensor, hierarchical unpipelined (one chunk) and pipelined. For
each it prints the time, the CPU our ranks used (CPU-seconds of the four processes
/ wall / cores), how busy the whole machine was, and the bytes that left and
entered host 0's link with the rate that makes.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def _cpu_ticks():
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def _link_bytes(ifname):
    for line in open("/proc/net/dev"):
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            f = rest.split()
            return int(f[8]), int(f[0])  # tx, rx
    return 0, 0


def _phases_worker(size, repeats, ifname):
    import torch
    import torch.distributed as dist

    import phalanx as px
    from phalanx.comm.algorithms import allreduce
    from phalanx.comm.collectives import all_gather_flat, reduce_scatter_flat

    topo = px.init()
    local, cross = topo.local_group(), topo.cross_group()
    x = torch.ones(size // 4)
    shard = torch.empty(x.numel() // topo.local_size)
    cases = {
        "flat (gloo ring, world)": lambda: dist.all_reduce(x),
        "inter-host step only": lambda: dist.all_reduce(shard, group=cross),
        "gloo reduce_scatter, host": lambda: reduce_scatter_flat(shard, x, group=local),
        "gloo all_gather, host": lambda: all_gather_flat(x, shard, group=local),
        "gloo allreduce, host": lambda: dist.all_reduce(x, group=local),
        "hierarchical, 1 chunk": lambda: allreduce(x, "hierarchical", topology=topo, chunk_bytes=size),
        "hierarchical, pipelined": lambda: allreduce(x, "hierarchical", topology=topo),
    }
    rows = {name: [] for name in cases}
    for rep in range(repeats + 1):  # round 0 warms up connections and buffers
        for name, fn in cases.items():
            dist.barrier()
            ticks0, link0, cpu0 = _cpu_ticks(), _link_bytes(ifname), time.process_time()
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
            cpu, ticks1, link1 = time.process_time() - cpu0, _cpu_ticks(), _link_bytes(ifname)
            t = torch.tensor([wall, cpu], dtype=torch.float64)
            dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(t[1:])
            busy = 1 - (ticks1[1] - ticks0[1]) / max(1, ticks1[0] - ticks0[0])
            if rep:
                rows[name].append((float(t[0]), float(t[1]) / float(t[0]) / os.cpu_count(), busy,
                                   link1[0] - link0[0], link1[1] - link0[1]))
    if px.rank() == 0:
        flat = statistics.median(r[0] for r in rows["flat (gloo ring, world)"])
        print(f"{size >> 20} MB, {topo.size} ranks on {topo.cross_size} hosts, medians of {repeats}; "
              f"link bytes are host 0's {ifname}", flush=True)
        print(f"{'phase':>26} {'ms':>8} {'vs flat':>8} {'our CPU':>8} {'machine':>8} {'tx MB':>7} {'rx MB':>7} "
              f"{'tx Gbit/s':>10}", flush=True)
        for name, rs in rows.items():
            t, ours, busy, tx, rx = (statistics.median(r[i] for r in rs) for i in range(5))
            print(f"{name:>26} {t * 1e3:8.1f} {flat / t:7.2f}x {ours:8.0%} {busy:8.0%} {tx / 1e6:7.1f} "
                  f"{rx / 1e6:7.1f} {tx * 8 / t / 1e9:10.3f}", flush=True)
    px.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64MB")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--repeats", default="5")
    ap.add_argument("--phases", action="store_true", help="time the pieces of hierarchical (see the docstring)")
    ap.add_argument("--worker-phases", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from phalanx.cli.bench_cmd import parse_size
    from phalanx.testing.cluster import IFNAME, SimCluster

    if a.worker_phases:
        return _phases_worker(parse_size(a.sizes), int(a.repeats), IFNAME)
    gbit = float(a.rate.lower().removesuffix("gbit")) if a.rate.lower().endswith("gbit") else None
    with SimCluster(hosts=2, rate=a.rate, ssh=True) as c:
        cmd = ["phalanx", "run", "-np", "4", "-H", c.host_spec(2), "--ssh-config", c.ssh_config,
               "--network-interface", IFNAME, "--", sys.executable]
        if a.phases:
            cmd += [os.path.abspath(__file__), "--worker-phases", "--sizes", a.sizes, "--repeats", a.repeats]
        else:
            cmd += ["-m", "phalanx", "bench", "allreduce", "--sizes", a.sizes, "--repeats", a.repeats]
            cmd += ["--link-gbit", str(gbit)] if gbit else []
        print("$", " ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())

"""Hierarchical vs flat (gloo's own) allreduce on a simulated 2-host x 2-rank cluster with 1 Gbit/s links.

Run (root; needs ip, tc, sshd):  python benchmarks/allreduce_cluster.py [--sizes 64MB] [--rate 1gbit]

Brings up the cluster, runs `phalanx bench allreduce` through the real SSH launch
path (one agent per simulated host), prints its table (flat, ring, hierarchical
interleaved per repeat; medians) and removes the cluster.
"""

import argparse
import subprocess
import sys

from phalanx.testing.cluster import IFNAME, SimCluster

ap = argparse.ArgumentParser()
ap.add_argument("--sizes", default="64MB")
ap.add_argument("--rate", default="1gbit")
ap.add_argument("--repeats", default="5")
a = ap.parse_args()
gbit = float(a.rate.lower().removesuffix("gbit")) if a.rate.lower().endswith("gbit") else None
with SimCluster(hosts=2, rate=a.rate, ssh=True) as c:
    cmd = ["phalanx", "run", "-np", "4", "-H", c.host_spec(2), "--ssh-config", c.ssh_config,
           "--network-interface", IFNAME, "--", sys.executable, "-m", "phalanx", "bench", "allreduce",
           "--sizes", a.sizes, "--repeats", a.repeats] + (["--link-gbit", str(gbit)] if gbit else [])
    print("$", " ".join(cmd), flush=True)
    sys.exit(subprocess.run(cmd).returncode)

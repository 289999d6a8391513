"""``phalanx cluster up|down``: a simulated multi-host cluster on this machine (root needed).

Example::

    phalanx cluster up --hosts 4 --rate 1gbit --ssh      # prints the -H and --ssh-config to use
    phalanx cluster down                                  # removes every pxc* namespace, link, sshd
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def register(subparsers) -> None:
    p = subparsers.add_parser("cluster", help="simulated multi-host cluster (network namespaces, root)")
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    up = sub.add_parser("up", help="create N hosts on a bridge with capped links")
    up.add_argument("--hosts", type=int, default=2, help="number of simulated hosts (default 2)")
    up.add_argument("--rate", default="1gbit", help="per-host link rate for tc tbf, e.g. 1gbit; 'none' = uncapped")
    up.add_argument("--ssh", action="store_true", help="run an sshd in every host (for phalanx run -H …)")
    up.add_argument("--slots", type=int, default=2, help="slots per host in the printed -H value")
    up.set_defaults(func=_up)
    down = sub.add_parser("down", help="remove every simulated host (all pxc* namespaces and links)")
    down.set_defaults(func=_down)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _up(args: argparse.Namespace) -> int:
    from phalanx.testing.cluster import IFNAME, ClusterUnavailable, SimCluster

    try:
        c = SimCluster(hosts=args.hosts, rate=None if args.rate == "none" else args.rate, ssh=args.ssh).up()
    except (ClusterUnavailable, ValueError, RuntimeError) as err:
        print(f"phalanx cluster up: {err}", file=sys.stderr)
        return 2
    print(f"cluster {c.id}: hosts {' '.join(c.addresses)} (namespaces {' '.join(c.namespaces)}), "
          f"link {args.rate}, interface {IFNAME}")
    ssh = f" --ssh-config {c.ssh_config}" if c.ssh_config else ""
    print(f"run: phalanx run -np {args.slots * args.hosts} -H {c.host_spec(args.slots)}{ssh} "
          f"--network-interface {IFNAME} python train.py")
    print("stop: phalanx cluster down")
    return 0


def _down(args: argparse.Namespace) -> int:
    from phalanx.testing.cluster import teardown_all

    removed = teardown_all()
    print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove")
    return 0

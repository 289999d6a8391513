"""torchrun's spellings on ``phalanx run``: the ones that map, and a hint for the ones that do not.

A job written for ``torchrun`` should start with ``torchrun`` replaced by ``phalanx run``::

    torchrun --standalone --nproc-per-node 4 train.py
    phalanx run --standalone --nproc-per-node 4 train.py          # the same: 4 workers here

    # two machines, torchrun's way: the same line on each, rendezvous on node0
    phalanx run --nnodes 2 --nproc-per-node 4 --rdzv-endpoint node0:29500 train.py

(``phalanx run -np 8 -H node0:4,node1:4 python train.py`` starts both machines from
one over SSH instead.) Both ``--nproc-per-node`` and ``--nproc_per_node`` are read.
What maps:

    --nproc-per-node N|auto|cpu|gpu   workers on this host (-np, when one host)
    --nnodes N or MIN:MAX              hosts joining the rendezvous (each runs phalanx run)
    --rdzv-endpoint HOST[:PORT]        the rendezvous store (--master-addr/--master-port alike)
    --node-rank R                      R == 0 hosts the store (else: the host named by the endpoint)
    --rdzv-id ID                       run id; the same on every host (default "none", as torchrun)
    --rdzv-backend c10d|static         phalanx always uses c10d
    --standalone                       one host, a free port: what phalanx run does anyway
    --monitor-interval S, --local-addr ADDR, --max-restarts N (already a phalanx flag)
    --no-python / -m, --module         run the command as given / as ``python -m MODULE``
    --local-ranks-filter 0,1           (a phalanx run flag) show only these ranks' output

What does not (``--redirects``, ``--tee``, ``--rdzv-conf``, ``--role``, ``--run-path``,
``--rdzv-backend etcd``) stops with one line saying what phalanx does instead.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["add_torchrun_arguments", "torchrun_layout", "parse_ranks"]

_UNSUPPORTED = {
    ("--redirects", "-r"): "phalanx run keeps every rank's output on the console with a [rank] prefix; "
                           "--output-filename DIR also writes DIR/rank.N/stdout and stderr",
    ("--tee", "-t"): "phalanx run always shows and keeps output as --redirects/--tee would; "
                     "use --local-ranks-filter to show only some ranks, --output-filename DIR to keep files",
    ("--rdzv-conf", "--rdzv_conf"): "phalanx sets the rendezvous timeouts from --start-timeout",
    ("--role",): "phalanx workers have one role",
    ("--run-path", "--run_path"): "give the script as the command: phalanx run -np 2 python train.py",
}


class _Unsupported(argparse.Action):
    def __init__(self, option_strings, dest, hint: str = "", **kw) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (a torchrun flag) has no phalanx counterpart: {self.hint}")


def add_torchrun_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun compatibility (see docs/horovod.md)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", default=None, metavar="N",
                   help="workers on this host: a number, or auto/cpu/gpu as torchrun reads them")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="hosts that each run this same line and meet at --rdzv-endpoint (default 1)")
    g.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R",
                   help="with --nnodes: 0 on the host that holds the rendezvous store")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT]",
                   help="the rendezvous store of a --nnodes job (port default 29400)")
    g.add_argument("--master-addr", "--master_addr", default=None, help=argparse.SUPPRESS)
    g.add_argument("--master-port", "--master_port", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, help="run id, the same on every host (default none)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=None, choices=["c10d", "static"],
                   help="accepted for torchrun's lines; phalanx rendezvous is always c10d")
    g.add_argument("--standalone", action="store_true", help="one host on a free port (phalanx run's default)")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=None, metavar="S",
                   help="seconds between the agent's checks of its workers (default 0.1)")
    g.add_argument("--local-addr", "--local_addr", default=None, help="this host's address for the rendezvous")
    g.add_argument("--no-python", "--no_python", action="store_true",
                   help="run a .py command as it is (by default a .py command runs with this Python, as torchrun)")
    g.add_argument("-m", "--module", action="store_true", help="run the command as `python -m MODULE …`")
    for flags, hint in _UNSUPPORTED.items():
        g.add_argument(*flags, action=_Unsupported, hint=hint)


def parse_ranks(text: str) -> frozenset[int]:
    """``"0,2"`` -> {0, 2}; ValueError with the fix."""
    try:
        ranks = frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r}: write rank numbers, e.g. 0 or 0,1") from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--local-ranks-filter {text!r}: write rank numbers from 0, e.g. 0 or 0,1")
    return ranks


def _nproc(text: str) -> int:
    if text in ("auto", "gpu", "cpu"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and not gpus:
            raise ValueError("--nproc-per-node gpu: this machine has no CUDA device; give a number")
        return gpus if text == "gpu" or (text == "auto" and gpus) else (os.cpu_count() or 1)
    if not text.lstrip("-").isdigit():
        raise ValueError(f"--nproc-per-node {text!r}: give a number, or auto, cpu or gpu")
    return int(text)


def torchrun_layout(args: argparse.Namespace) -> dict | None:
    """Read the torchrun flags: None when none was given, else ``{np, min_nodes, max_nodes, rdzv_endpoint,
    is_host, run_id, per_node}``. Raises ValueError naming the flag and the fix."""
    given = [args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.master_addr,
             args.master_port, args.rdzv_id, args.rdzv_backend]
    if all(v is None for v in given) and not args.standalone:
        return None
    per_node = _nproc(args.nproc_per_node) if args.nproc_per_node is not None else None
    low, _, high = (args.nnodes or "1").partition(":")
    if not (low.isdigit() and (not high or high.isdigit())) or int(low) < 1 or int(high or low) < int(low):
        raise ValueError(f"--nnodes {args.nnodes!r}: write a count (2) or a range MIN:MAX (1:4)")
    min_nodes, max_nodes = int(low), int(high or low)
    endpoint = args.rdzv_endpoint
    if args.master_addr:
        endpoint = endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    if max_nodes == 1:
        if per_node is not None and args.np is not None and per_node != args.np:
            raise ValueError(f"-np {args.np} and --nproc-per-node {per_node} disagree; give one of them")
        return {"np": per_node if per_node is not None else args.np, "multi": False}
    if args.standalone:
        raise ValueError(f"--standalone means one host, but --nnodes {args.nnodes}; drop one of them")
    if not endpoint:
        raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every host), "
                         "or start every host from here: phalanx run -np TOTAL -H host1:N,host2:N …")
    if args.hosts or args.hostfile:
        raise ValueError("-H/--hostfile (phalanx starts the hosts over SSH) and --nnodes (each host runs "
                         "phalanx run itself) are two ways to run on several hosts; use one")
    if args.np is not None:
        raise ValueError(f"-np counts every worker of a job started from one machine; with --nnodes {args.nnodes} "
                         "give each host's count with --nproc-per-node N instead")
    if per_node is None:
        raise ValueError(f"--nnodes {args.nnodes}: say how many workers each host runs with --nproc-per-node N")
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    if not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: write HOST:PORT, e.g. node0:29400")
    if args.node_rank is not None:
        is_host = args.node_rank == 0
    else:
        from phalanx.launcher.hosts import is_local

        is_host = is_local(host)
    return {"np": per_node, "multi": True, "min_nodes": min_nodes, "max_nodes": max_nodes,
            "rdzv_endpoint": f"{host}:{port}", "is_host": is_host, "run_id": args.rdzv_id or "none"}

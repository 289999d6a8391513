"""``phalanx bench``: measurements from the command line. ``bench allreduce`` is the first sub-command.

``phalanx bench allreduce`` times every allreduce algorithm of
:mod:`phalanx.comm.algorithms` (flat = the backend's own, ring, hierarchical) on
message sizes 4 KB .. 256 MB, repeats interleaved across algorithms, and prints
the median time, the algorithm bandwidth S/t and the bus bandwidth
2(N-1)/N * S/t. With ``--link-gbit`` it adds the fraction of the link bound:
the least time any allreduce needs when each host's link carries 2(H-1)/H * S
bytes each way at that rate.

Example::

    phalanx bench allreduce --np 4 --local-size 2 --sizes 1MB,64MB       # local ranks
    phalanx run -np 4 -H h1:2,h2:2 -- phalanx bench allreduce --link-gbit 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from phalanx.cli.parser import UsageError

__all__ = ["register", "parse_size", "DEFAULT_SIZES"]

DEFAULT_SIZES = "4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB,256MB"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4KB"``, ``"4kb"``, ``"4K"``, ``"4KiB"`` -> 4096; ``"1M"`` -> 1 MiB (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m or not int(m.group(1)):
        raise ValueError(f"--sizes: cannot read {text!r}; write positive sizes such as 4KB, 64MB, 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure collectives (and more) on this job's ranks")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    p = sub.add_parser("allreduce", help="time each allreduce algorithm over message sizes")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--algorithms", default="flat,ring,hierarchical", help="which algorithms to time")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size and algorithm (median)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--link-gbit", type=float, default=None, help="per-host link rate, for the link-bound column")
    p.add_argument("--np", type=int, default=2, help="ranks to start here when not under a launcher")
    p.add_argument("--local-size", type=int, default=None, help="ranks per simulated host when started here")
    p.set_defaults(func=main_allreduce)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def _measure(sizes, algorithms, repeats, dtype_name):
    import torch
    import torch.distributed as dist

    from phalanx.comm.algorithms import allreduce
    from phalanx.comm.collectives import barrier
    from phalanx.runtime import topology

    topo = topology()
    dtype = getattr(torch, dtype_name)
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // torch.empty((), dtype=dtype).element_size()), dtype=dtype)
        times = {a: [] for a in algorithms}
        for rep in range(repeats + 1):  # the first round warms up connections and buffers
            for algo in algorithms:
                barrier()
                start = time.perf_counter()
                allreduce(x, algo, topology=topo)
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the collective ends when its slowest rank does
                if rep:
                    times[algo].append(float(took))
        for algo in algorithms:
            rows.append((size, algo, statistics.median(times[algo])))
    return rows, topo.size, topo.cross_size, topo.backend


def _body(sizes, algorithms, repeats, dtype):
    return _measure(sizes, algorithms, repeats, dtype)


def _table(rows, n, hosts, backend, link_gbit) -> str:
    head = f"allreduce on {n} ranks, {hosts} host(s), backend {backend}"
    cols = f"{'size':>9} {'algorithm':>13} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"
    if link_gbit and hosts > 1:
        cols += f" {'of link bound':>14}"
    lines = [head, cols]
    by_size: dict[int, dict[str, float]] = {}
    for size, algo, t in rows:
        line = f"{_fmt(size):>9} {algo:>13} {t * 1e3:>10.2f} {size / t / 1e9:>11.3f} {2 * (n - 1) / n * size / t / 1e9:>11.3f}"
        if link_gbit and hosts > 1:
            bound_s = 2 * (hosts - 1) / hosts * size / (link_gbit * 1e9 / 8)
            line += f" {bound_s / t:>13.0%}"
        lines.append(line)
        by_size.setdefault(size, {})[algo] = t
    for size, ts in by_size.items():
        if "flat" in ts and "hierarchical" in ts:
            lines.append(f"{_fmt(size)}: hierarchical is {ts['flat'] / ts['hierarchical']:.2f}x flat")
    return "\n".join(lines)


def _fmt(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}B"
    return f"{size}B"


def main_allreduce(args: argparse.Namespace) -> int:
    from phalanx.comm.algorithms import ALGORITHMS

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        raise UsageError(str(err)) from None
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if not sizes:
        raise UsageError(f"--sizes {args.sizes!r} lists no size; e.g. --sizes 4KB,64MB")
    if bad or not algorithms:
        raise UsageError(f"--algorithms: {', '.join(bad) or 'none given'}; choose from {', '.join(ALGORITHMS)}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    if args.np < 1 or (args.local_size is not None and (args.local_size < 1 or args.np % args.local_size)):
        raise UsageError(f"--np {args.np} must be at least 1" + (f" and a multiple of --local-size {args.local_size}" if args.local_size else ""))
    if "RANK" in os.environ:  # under phalanx run / torchrun: this process is one rank
        from phalanx import runtime
        from phalanx.launcher.startup import join

        join()
        rows, n, hosts, backend = _measure(sizes, algorithms, args.repeats, args.dtype)
        if runtime.rank() == 0:
            print(_table(rows, n, hosts, backend, args.link_gbit), flush=True)
        runtime.shutdown()
        return 0
    from phalanx.launcher.spawn import run

    results = run(_body, np=args.np, args=(sizes, algorithms, args.repeats, args.dtype),
                  local_size=args.local_size, timeout=3600)
    print(_table(*results[0], args.link_gbit))
    return 0

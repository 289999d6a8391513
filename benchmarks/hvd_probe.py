"""What a Horovod facade collective pays before its data moves: ``hvd.allreduce`` vs ``px.allreduce``.

Run:  python benchmarks/hvd_probe.py [--calls 200 --repeats 5]

``hvd.allreduce`` on the global set starts with the join negotiation (``phalanx.comm.horovod_ops.negotiate``);
``px.allreduce`` with the cross-rank check only; ``px.allreduce`` with the check off pays neither.
Since the probe became the check itself (one 24-byte MAX allreduce), ``hvd``/``px`` should be
about 1.00; before (a 4-byte join probe, then the check) it was one blocking round trip more.
Run it on two trees for the A/B (the script only imports ``phalanx``). Two gloo ranks, 1 KiB
and 64 KiB float32 tensors, interleaved repeats; prints median microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _bench(calls: int, repeats: int):
    import phalanx as px
    import phalanx.horovod.torch as hvd
    from phalanx.comm.mismatch import set_mismatch_check

    kinds = {
        "hvd.allreduce": lambda t: hvd.allreduce(t, op=hvd.Sum, name="bench"),
        "px.allreduce": lambda t: px.allreduce(t, op=px.Sum, name="bench"),
        "px.allreduce, check off": lambda t: px.allreduce(t, op=px.Sum, name="bench"),
    }
    rows = {}
    for label, numel in (("1 KiB", 256), ("64 KiB", 16384)):
        t = torch.randn(numel)
        per = {k: [] for k in kinds}
        for rep in range(repeats):
            order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
            for kind in order:
                set_mismatch_check(kind != "px.allreduce, check off")
                px.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    kinds[kind](t)
                per[kind].append((time.perf_counter() - start) / calls * 1e6)
        rows[label] = {k: statistics.median(v) for k, v in per.items()}
    set_mismatch_check(True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import phalanx as px

    rows = px.run(_bench, np=2, args=(args.calls, args.repeats), threads=1, timeout=900)[0]
    print(f"world 2 gloo, {args.repeats} interleaved repeats, {args.calls} calls each, median microseconds per call")
    print(f"{'size':<8} {'hvd':>8} {'px':>8} {'px off':>8} {'hvd/px':>7} {'hvd/off':>8}")
    for label, r in rows.items():
        hv, px_, off = r["hvd.allreduce"], r["px.allreduce"], r["px.allreduce, check off"]
        print(f"{label:<8} {hv:>8.0f} {px_:>8.0f} {off:>8.0f} {hv / px_:>7.2f} {hv / off:>8.2f}")


if __name__ == "__main__":
    main()

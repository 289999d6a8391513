"""Where an async checkpoint save's blocked time goes: the phases of ``save(..., async_=True)`` per rank.

Run:  python benchmarks/checkpoint_blocked.py [--kind replicated] [--np 2] [--saves 7] [--mb 64]
      python benchmarks/checkpoint_blocked.py --handoff      (the thread start alone, one process)
      python benchmarks/checkpoint_blocked.py --copy         (memmove vs Tensor.copy_, one process)

The state is benchmarks/checkpoint.py's (a model of --mb MiB fp32 + Adam; replicated: all of it on
every rank, + the rank's RNG state; sharded: 1/np of every tensor). One warm-up async save (it
allocates the staging buffers), then --saves async saves, each waited for; for each, the time the
caller was blocked, split into the phases save() runs before it returns: the pieces' state_dict()
calls, the snapshot copy into the staging buffers (encode), the save id, the background writer's
start, and the rest. Prints the median over the saves, per rank (ms). No peer here: DCP's
async_save is timed beside phalanx's in benchmarks/checkpoint.py.

--handoff: why starting the background writer cost milliseconds: time ``Thread.start()`` of a
thread whose body runs Python at once (the caller waits for the GIL the new thread holds),
against one whose body first waits on an Event the caller sets after ``start()`` (what
phalanx.checkpoint.async_save does), against a queue put to a thread already running; 30
interleaved samples each, median and max.

--copy: the snapshot copy's two ways, one process, one torch thread: 48 x 4 MiB fp32 into
buffers already touched, ``Tensor.copy_`` against ``ctypes.memmove`` (what
phalanx.checkpoint uses for dense CPU tensors), 21 interleaved repeats, order alternating; the
median of the per-repeat ratio memmove / copy_.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checkpoint as bench  # noqa: E402  (this folder, put on the path above)

import phalanx as px  # noqa: E402
import phalanx.checkpoint as ckpt  # noqa: E402

PHASES = (("sharded", "to_tree", "state_dict() calls (to_tree)"), ("sharded", "encode", "snapshot copy (encode)"),
          ("sharded", "_next_save_id", "save id"), ("writer", "submit", "writer thread start (submit)"))


def _rank(kind: str, mb: int, saves: int, root: str) -> list[dict]:
    from phalanx.checkpoint import async_save, sharded

    state = bench._states(kind, mb)[0]
    acc: dict[str, float] = {}
    owners = {"sharded": sharded, "writer": async_save.AsyncWriter}
    for owner, name, label in PHASES:  # time each phase where save() calls it
        fn = getattr(owners[owner], name)

        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] = acc.get(_label, 0.0) + time.perf_counter() - t0
        setattr(owners[owner], name, timed)
    rows = []
    for i in range(saves + 1):
        acc.clear()
        path = os.path.join(root, f"a{i}")
        px.barrier()
        t0 = time.perf_counter()
        ckpt.save(path, state, async_=True)
        total = time.perf_counter() - t0
        ckpt.wait()
        px.barrier()
        if px.rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        if i:  # i = 0: the warm-up save
            rows.append({**acc, "other": total - sum(acc.values()), "total blocked": total})
    return rows


def _handoff(samples: int = 30) -> None:
    import queue
    import threading

    def busy() -> None:  # the writer's first 50 ms of Python (planning, JSON) stand-in
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
    res: dict[str, list[float]] = {"start, body runs Python at once": [], "start, body waits for the caller": [],
                                   "queue put to a running thread": []}
    jobs: queue.Queue = queue.Queue()

    def serve() -> None:
        while True:
            jobs.get()()
            jobs.task_done()
    threading.Thread(target=serve, daemon=True).start()
    for _ in range(samples):
        t0 = time.perf_counter()
        th = threading.Thread(target=busy)
        th.start()
        res["start, body runs Python at once"].append(time.perf_counter() - t0)
        th.join()
        go = threading.Event()

        def body(go=go) -> None:
            go.wait()
            busy()
        t0 = time.perf_counter()
        th = threading.Thread(target=body)
        th.start()
        go.set()
        res["start, body waits for the caller"].append(time.perf_counter() - t0)
        th.join()
        t0 = time.perf_counter()
        jobs.put(busy)
        res["queue put to a running thread"].append(time.perf_counter() - t0)
        jobs.join()
    print(f"thread start as seen by the caller, {samples} samples each, load average {os.getloadavg()[0]:.1f}:")
    for k, v in res.items():
        print(f"  {k:36s} median {1e3 * statistics.median(v):7.3f} ms, max {1e3 * max(v):7.2f} ms")


def _copy_ab(repeats: int = 21) -> None:
    import ctypes

    import torch

    torch.set_num_threads(1)
    src = [torch.randn(1 << 20) for _ in range(48)]
    dst = [torch.empty_like(t) for t in src]
    for a, b in zip(src, dst):
        b.copy_(a)
    ratios, took = [], {"copy_": [], "memmove": []}
    for i in range(repeats):
        t: dict[str, float] = {}
        for how in (("copy_", "memmove") if i % 2 else ("memmove", "copy_")):
            t0 = time.perf_counter()
            for a, b in zip(src, dst):
                if how == "copy_":
                    b.copy_(a)
                else:
                    ctypes.memmove(b.data_ptr(), a.data_ptr(), a.numel() * a.element_size())
            t[how] = time.perf_counter() - t0
            took[how].append(t[how])
        ratios.append(t["memmove"] / t["copy_"])
    print(f"192 MiB (48 x 4 MiB) into touched buffers, {repeats} interleaved repeats, load average "
          f"{os.getloadavg()[0]:.1f}: copy_ median {1e3 * statistics.median(took['copy_']):.1f} ms, memmove "
          f"{1e3 * statistics.median(took['memmove']):.1f} ms; memmove / copy_ per repeat: median "
          f"{statistics.median(ratios):.3f}, quartiles {[round(q, 3) for q in statistics.quantiles(ratios, n=4)]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="replicated", choices=("replicated", "sharded"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--saves", type=int, default=7)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--handoff", action="store_true", help="time the writer thread's start alone")
    ap.add_argument("--copy", action="store_true", help="time memmove against Tensor.copy_ alone")
    args = ap.parse_args()
    if args.copy:
        return _copy_ab()
    if args.handoff:
        return _handoff()
    root = tempfile.mkdtemp(prefix="phalanx-ckpt-blocked-", dir="/tmp")
    try:
        res = px.run(_rank, np=args.np, args=(args.kind, args.mb, args.saves, root), timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.kind}, {args.np} ranks, {3 * args.mb} MiB of state, {args.saves} async saves after one warm-up; "
          f"median over the saves, per rank (ms); load average {os.getloadavg()[0]:.1f}")
    for k in res[0][0]:
        print(f"  {k:32s} " + "  ".join(f"rank{r} {1e3 * statistics.median(row[k] for row in res[r]):7.1f}"
                                         for r in range(args.np)))


if __name__ == "__main__":
    main()

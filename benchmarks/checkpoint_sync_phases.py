"""Where a sync checkpoint save's time goes: the phases of ``save()`` per rank, phalanx beside DCP.

Run:  python benchmarks/checkpoint_sync_phases.py [--kind sharded] [--np 4] [--saves 9] [--mb 64]

The state is benchmarks/checkpoint.py's (a model of --mb MiB fp32 + Adam; sharded: 1/np of
every tensor per rank; replicated: all of it on every rank, + the rank's RNG state). One warm-up
save per side, then --saves sync saves per side, alternating (who goes first alternates), each
between two barriers. For phalanx, the time of each phase save() runs, per rank (phases nest:
"write_tensors" includes its fsync and its hashing, "wait for ranks" is rank 0 waiting for the
others' reports before the manifest): the number of fsync calls, their time and the largest call's
(the data file's; the rest is the small files' and the directory's), the time
hashing (on the hashing thread, beside the file writes), the file count. For DCP: its total,
its fsync calls and their time, its file count. Prints medians over the saves (ms), per rank,
and the median of the paired ratio phalanx/DCP of the slowest rank's total.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checkpoint as bench  # noqa: E402  (this folder, put on the path above)

import phalanx as px  # noqa: E402
import phalanx.checkpoint as ckpt  # noqa: E402


def _rank(kind: str, mb: int, saves: int, root: str) -> list[dict]:
    import torch.distributed.checkpoint as dcp

    from phalanx.checkpoint import io, pieces, sharded

    px_state, dcp_state = bench._states(kind, mb)[:2]
    acc: dict[str, float] = {}
    lock = threading.Lock()

    def add(label: str, dt: float) -> None:
        with lock:
            acc[label] = acc.get(label, 0.0) + dt

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                add(label, time.perf_counter() - t0)
        setattr(owner, name, timed)

    for owner, name, label in ((sharded, "to_tree", "to_tree"), (sharded, "encode", "encode"),
                               (sharded, "_next_save_id", "save id"), (sharded, "describe", "describe"),
                               (sharded, "_plan", "plan (store round trips)"),
                               (io, "write_tensors", "write_tensors"), (io, "write_json", "write_json"),
                               (io, "sync_dir", "sync_dir"), (sharded, "_check_shared", "check shared"),
                               (sharded, "_write_manifest", "manifest"), (sharded, "barrier", "final barrier")):
        wrap(owner, name, label)
    wait_keys = pieces.Job.wait_keys

    def timed_wait(self, store, keys, what):
        t0 = time.perf_counter()
        try:
            return wait_keys(self, store, keys, what)
        finally:
            add("wait for ranks" if "did not write" in what else "wait (plan)", time.perf_counter() - t0)
    pieces.Job.wait_keys = timed_wait
    fsync = os.fsync

    def timed_fsync(fd):
        t0 = time.perf_counter()
        try:
            return fsync(fd)
        finally:
            dt = time.perf_counter() - t0
            add("fsync", dt)
            add("fsync calls", 1)
            with lock:  # the data file's fsync against the small files' and the directory's
                acc["fsync: largest call"] = max(acc.get("fsync: largest call", 0.0), dt)
    os.fsync = timed_fsync
    hasher = io._hasher

    class Timed:  # the checksum's update() calls, on whichever thread runs them
        def __init__(self, h):
            self._h, self.name = h, h.name

        def update(self, data):
            t0 = time.perf_counter()
            self._h.update(data)
            add("hashing", time.perf_counter() - t0)

        def hexdigest(self):
            return self._h.hexdigest()
    io._hasher = lambda expected=None: Timed(hasher(expected))

    rows = []
    for i in range(saves + 1):
        for who in (("px", "dcp") if i % 2 == 0 else ("dcp", "px")):
            acc.clear()
            path = os.path.join(root, f"{who}-{i}")
            px.barrier()
            t0 = time.perf_counter()
            if who == "px":
                ckpt.save(path, px_state)
            else:
                dcp.save(dcp_state, checkpoint_id=path)
            px.barrier()
            total = time.perf_counter() - t0
            files = len(os.listdir(path)) if px.rank() == 0 else 0
            px.barrier()
            if px.rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            if i:  # i = 0: the warm-up save
                rows.append({"who": who, **acc, "files": files, "total": total})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="sharded", choices=("replicated", "sharded"))
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--mb", type=int, default=64)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="phalanx-ckpt-phases-", dir="/tmp")
    load0 = os.getloadavg()[0]
    try:
        res = px.run(_rank, np=args.np, args=(args.kind, args.mb, args.saves, root), timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.kind}, {args.np} ranks, {3 * args.mb} MiB of state, {args.saves} sync saves per side after one "
          f"warm-up, alternating; median over the saves, per rank (ms; 'fsync calls' and 'files' are counts); "
          f"checksum {ckpt.io.checksum_algorithm()}; load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    for who, name in (("px", "phalanx"), ("dcp", "DCP")):
        rows = {r: [row for row in res[r] if row["who"] == who] for r in range(args.np)}
        keys = [k for k in rows[0][0] if k != "who"]
        keys += sorted({k for r in rows for row in rows[r] for k in row if k != "who" and k not in keys})
        print(name)
        for k in keys:
            scale = 1 if k in ("fsync calls", "files") else 1e3
            print(f"  {k:26s} " + "  ".join(
                f"rank{r} {scale * statistics.median(row.get(k, 0.0) for row in rows[r]):7.1f}"
                for r in range(args.np)))
    slow = {who: [max(res[r][i]["total"] for r in range(args.np)) for i in range(len(res[0]))
                  if res[0][i]["who"] == who] for who in ("px", "dcp")}
    ratio = [a / b for a, b in zip(slow["px"], slow["dcp"])]
    print(f"slowest rank's total: phalanx {1e3 * statistics.median(slow['px']):.1f} ms, DCP "
          f"{1e3 * statistics.median(slow['dcp']):.1f} ms; phalanx/DCP per save pair: median "
          f"{statistics.median(ratio):.3f} {[round(x, 3) for x in ratio]}")


if __name__ == "__main__":
    main()

"""Does a bucket's collective run while later backward kernels are still computing? Checked from a trace.

Run:  python benchmarks/gpu/overlap.py --device cuda --out results.jsonl --trace-dir DIR
      python benchmarks/gpu/overlap.py --device cpu          (the dry run: CPU ops stand in for kernels)

Two ranks share cuda:0 on gloo. A deep MLP (``--layers`` x ``--width``², several 25 MB buckets)
trains under ``px.DataParallel`` and, for reference, torch DDP. Rank 0 records two steps with
``torch.profiler`` (CPU and CUDA activity) and writes the Chrome trace; this script then reads the
trace back and checks, per step, inside the backward window (``record_function`` around
``loss.backward()``, the GPU drained before it):

- *collective intervals*: the gloo work (``gloo:*`` events on gloo's worker thread: its copy to
  pinned memory, the TCP allreduce, the copy back) and the device copies on streams other than
  the compute stream (gloo's side stream; its copies wait for the gradients through an event);
- *compute intervals*: the kernels on the compute stream (on the CPU dry run: the autograd ops
  on the backward thread).

The verdict is the share of collective time that overlaps compute, and whether the first
bucket's collective began before the last backward kernel ended: that is what overlap means. A
wrapper that waited for the whole backward before sending would show 0 and fail.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser  # noqa: E402

WINDOW = "overlap:backward"


def _model(layers: int, width: int) -> nn.Module:
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 10))


def _profile(kind: str, args, topo) -> str | None:
    """Train ``kind`` (phalanx or ddp) a few steps; rank 0 profiles the last ones. The trace's path."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, record_function

    import phalanx as px

    device = topo.device
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    net = _model(args.layers, args.width).to(device)
    if kind == "phalanx":
        model = px.DataParallel(net, bucket_mb=args.bucket_mb)
    else:
        model = DDP(net, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)

    def step(mark: bool):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        if cuda:
            torch.cuda.synchronize()  # forward drained: the window holds backward only
        if mark:
            with record_function(WINDOW):
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
        else:
            loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step(False)
    if topo.rank != 0:
        for _ in range(args.steps):
            step(True)
        return None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step(True)
    path = os.path.join(args.trace_dir, f"overlap_{kind}_{device.type}.json")
    prof.export_chrome_trace(path)
    return path


def _rank(args):
    import phalanx as px

    topo = px.topology()
    out = {}
    for kind in ("phalanx", "ddp"):
        try:
            out[kind] = _profile(kind, args, topo)
        except Exception as exc:  # noqa: BLE001 - one shot on the GPU: report it and go on
            out[kind] = f"error: {type(exc).__name__}: {exc}"
        if topo.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _intervals(events, pred):
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if pred(e))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the union of ``a`` that lies inside the union of ``b`` (microseconds)."""
    def union(iv):
        out = []
        for lo, hi in sorted(iv):
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return out
    ua, ub = union(a), union(b)
    total, j = 0.0, 0
    for lo, hi in ua:
        while j < len(ub) and ub[j][1] <= lo:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < hi:
            total += max(0.0, min(hi, ub[k][1]) - max(lo, ub[k][0]))
            k += 1
    return total


def _stream(e) -> object:
    args = e.get("args", {})
    return args.get("stream", e.get("tid"))


def check_trace(path: str) -> list[dict]:
    """Per backward window of the trace: collective time, the part overlapping compute, and
    whether the first collective began before the last compute interval ended."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    windows = _intervals(events, lambda e: e["name"] == WINDOW and e.get("cat") in ("user_annotation", "cpu_op"))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    on_gpu = bool(kernels)
    if on_gpu:
        busy: dict[object, float] = {}
        for e in kernels:
            busy[_stream(e)] = busy.get(_stream(e), 0.0) + e.get("dur", 0)
        compute_stream = max(busy, key=busy.get)
        compute = _intervals(kernels, lambda e: _stream(e) == compute_stream)
        side_copies = _intervals(events, lambda e: e.get("cat") in ("gpu_memcpy", "kernel")
                                 and _stream(e) != compute_stream)
    else:
        compute = _intervals(events, lambda e: e.get("cat") == "cpu_op"
                             and e["name"].startswith("autograd::engine::evaluate_function"))
        side_copies = []
    gloo = _intervals(events, lambda e: e["name"].startswith(("gloo:", "nccl:")))
    rows = []
    for lo, hi in windows:
        def inside(iv, lo=lo, hi=hi):
            return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]
        comm = inside(gloo) + inside(side_copies)
        comp = inside(compute)
        comm_us = _overlap(comm, comm)
        shared_us = _overlap(comm, comp)
        first_comm = min((a for a, _ in comm), default=None)
        last_compute = max((b for _, b in comp), default=None)
        rows.append({
            "window_ms": (hi - lo) / 1e3,
            "compute_ms": _overlap(comp, comp) / 1e3,
            "collective_ms": comm_us / 1e3,
            "overlapped_ms": shared_us / 1e3,
            "overlap_share": shared_us / comm_us if comm_us else 0.0,
            "first_collective_before_last_compute_end": (first_comm is not None and last_compute is not None
                                                         and first_comm < last_compute),
            "collective_events": len(inside(gloo)), "side_stream_copies": len(inside(side_copies)),
        })
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--trace-dir", default=".", help="where rank 0 writes the Chrome traces")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    check_device(args.device)
    cpu = args.device == "cpu"
    args.layers, args.width, args.batch = (4, 512, 256) if cpu else (8, 4096, 8192)
    if cpu:
        args.bucket_mb = min(args.bucket_mb, 1.0)
        args.warmup = 1
    os.makedirs(args.trace_dir, exist_ok=True)

    import phalanx as px

    env = {"PHALANX_BACKEND": "gloo", "PHALANX_DEVICE": "cpu" if cpu else "cuda:0"}
    traces = px.run(_rank, np=2, args=(args,), env=env, timeout=args.timeout)[0]
    for kind, path in traces.items():
        if path.startswith("error: "):
            emit(args.out, "overlap", args.device, runner=kind, ok=False, error=path[7:])
            continue
        rows = check_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(path)
        ok = bool(rows) and all(r["overlapped_ms"] > 0 and r["first_collective_before_last_compute_end"]
                                for r in rows)
        emit(args.out, "overlap", args.device, runner=kind, layers=args.layers, width=args.width,
             batch=args.batch, bucket_mb=args.bucket_mb, steps=rows, trace=os.path.basename(path) + ".gz",
             ok=ok)


if __name__ == "__main__":
    main()

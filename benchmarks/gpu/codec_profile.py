"""Where a codec's round trip spends its time on the GPU: device kernels or the host.

Run:  python benchmarks/gpu/codec_profile.py --device cuda --out results.jsonl
      python benchmarks/gpu/codec_profile.py --device cpu      (the dry run: 0.1 MB)

benchmarks/gpu/codecs.py times ``decompress(*compress(g))`` of a 100 MB gradient against a device
copy; on an H100 int8's compiled compress alone took 1.7x a copy (variants.py) while its round
trip took 6.7x. This step says where the rest goes. For each codec (registry defaults, with and
without error feedback) it runs 5 round trips to warm up (compiles), then 10 under
``torch.profiler`` (CPU and CUDA activities) and 10 under ``cProfile``, and writes one JSON line:

* ``wall_us``: a round trip's wall time (synchronised at the end of the 10);
* ``device_us``: the sum of the CUDA kernels' and memcpy/memset self times per round trip, and
  ``kernels`` their count: ``device_us`` near ``wall_us`` means device-bound, far below host-bound;
* ``top_ops``: the 12 torch operators with the largest CPU time per round trip (name, us, calls);
* ``top_python``: the 12 Python functions with the largest own time per round trip (cProfile);
* ``host_ops``: the number of torch operator calls per round trip (every profiled CPU op, nested
  ones included), and ``outside_ops`` those of them outside the fused kernels' calls (each such
  call, ``kernels.run``, counts as one): on CUDA a compiled call is one host call, so
  ``outside_ops`` is what the host pays per round trip around them, however fast the host is.

``--fused`` runs the codecs' fused (compiled-on-CUDA) paths on any device, eagerly off CUDA
(``kernels.everywhere()``): on the CPU it counts the CUDA path's ``outside_ops`` without a GPU.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import sys
import time

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser, sync  # noqa: E402

CODECS = (("int8", True), ("int8", False), ("int4", True), ("int4", False), ("2bit", True), ("sign", True))
ROUNDS = 10


def _codec(name: str, ef: bool):
    from phalanx.comm.compression import get_compressor
    return get_compressor(name) if ef else get_compressor(name, error_feedback=False)


def _device_us(prof, rounds: int) -> tuple[float, int]:
    total, count = 0.0, 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # a kernel, memcpy or memset on the device
            total += e.time_range.elapsed_us()
            count += 1
    return total / rounds, count // rounds


def _top_ops(prof, rounds: int) -> list:
    rows = sorted(prof.key_averages(), key=lambda a: a.cpu_time_total, reverse=True)
    return [[a.key, round(a.cpu_time_total / rounds, 1), a.count // rounds] for a in rows[:12]]


def _top_python(stats: pstats.Stats, rounds: int) -> list:
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # (cc, nc, tottime, cumtime, callers)
    out = []
    for (path, line, fn), (_, calls, tottime, cumtime, _) in rows[:12]:
        out.append([f"{os.path.basename(path)}:{line}:{fn}", round(tottime / rounds * 1e6, 1),
                    round(cumtime / rounds * 1e6, 1), calls // rounds])
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=None, help="gradient size (default 100; cpu: 0.1)")
    ap.add_argument("--fused", action="store_true", help="the fused paths on any device (eager off CUDA)")
    args = ap.parse_args()
    check_device(args.device)
    from phalanx.comm.compression import kernels
    with kernels.everywhere() if args.fused else contextlib.nullcontext():
        _profile(args)


FUSED = "phalanx::fused_kernel"


def _host_ops(prof, rounds: int) -> tuple[int, int]:
    """(all CPU ops, ops outside the fused kernels' calls, each call counted once) per round trip."""
    total = outside = 0
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue
        total += 1
        parent = e.cpu_parent
        while parent is not None and parent.name != FUSED:
            parent = parent.cpu_parent
        outside += parent is None
    return total // rounds, outside // rounds


def _mark_fused_calls() -> None:
    """Wrap ``kernels.run`` in a profiler range, so that ops inside a fused call can be told apart."""
    from phalanx.comm.compression import kernels
    plain = kernels.run

    def run(fn, *args):
        with torch.profiler.record_function(FUSED):
            return plain(fn, *args)
    kernels.run = run  # the codecs call it as kernels.run


def _profile(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    _mark_fused_calls()
    mb = args.mb or (0.1 if args.device == "cpu" else 100.0)
    n = int(mb * 1e6 / 4)
    g = torch.randn(n, device=args.device, generator=torch.Generator(device=args.device).manual_seed(0)) * 1e-3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    for name, ef in CODECS:
        try:
            codec = _codec(name, ef)

            def rt(codec=codec):
                return codec.decompress(*codec.compress(g))
            for _ in range(5):
                rt()
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                rt()
            sync(args.device)
            wall = (time.perf_counter() - t0) / ROUNDS
            with profile(activities=activities) as prof:
                for _ in range(ROUNDS):
                    rt()
                sync(args.device)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(ROUNDS):
                rt()
            sync(args.device)
            pr.disable()
            device_us, kernels = _device_us(prof, ROUNDS)
            emit(args.out, "codec_profile", args.device, codec=name, error_feedback=ef, mb=mb,
                 fused=args.fused, wall_us=round(wall * 1e6, 1), device_us=round(device_us, 1), kernels=kernels,
                 **dict(zip(("host_ops", "outside_ops"), _host_ops(prof, ROUNDS))),
                 top_ops=_top_ops(prof, ROUNDS), top_python=_top_python(pstats.Stats(pr), ROUNDS), ok=True)
        except Exception as exc:  # noqa: BLE001 - one shot on the GPU: report it and go on
            emit(args.out, "codec_profile", args.device, codec=name, error_feedback=ef, ok=False,
                 error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()

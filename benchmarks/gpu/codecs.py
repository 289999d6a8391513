"""Codecs on the GPU: compress + decompress GB/s of every compressor vs a plain device copy.

Issue: "Codecs on the GPU: compress + decompress GB/s of every compressor on a 100 MB gradient
vs a plain device copy (the memory-bandwidth bound). Goal: within 5x of the copy."

Run:
    python benchmarks/gpu/codecs.py --device cuda --out results.jsonl  # 100 MB, ~15-30 s (H100)
    python benchmarks/gpu/codecs.py --device cpu --out /tmp/c.jsonl    # dry run: 1 MB, 2 calls

What it measures, on one fp32 gradient of ``--mb`` MB (10^6 bytes; 100 MB = 25M values, drawn
N(0, 1e-3^2) so that the threshold codec's default cut 1e-3 keeps about a third of it):

* ``copy``: ``dst.copy_(src)`` of the same tensor (reads and writes it once: the memory-bandwidth
  bound). GB/s = gradient bytes / seconds, as for the codecs.
* every name in ``phalanx.comm.compression.codecs.available_compressors()``, from ``get_compressor(name)`` at
  its registry defaults (lossy ones wrapped in error feedback, as ``DataParallel`` uses them):
  one round trip ``decompress(*compress(g))`` timed after a warm-up, the device synchronised
  before and after ``iters`` calls, ``rounds`` such blocks, the median block (with a ~95% interval
  of the median, ``common.median_ci``). ``compress`` alone and ``decompress`` alone are timed the
  same way. PowerSGD gets the gradient as a 2-D matrix (``sqrt(n) x sqrt(n)``, 5000 x 5000 for
  100 MB; its ``compress`` is the local rank-r power step, no communication); it also gets a row
  ``variant="reduce_many"``: ``PowerSGDCompressor.reduce_many([matrix])`` in a world of one (the
  path DataParallel takes: residual add in place, warm-started factors, ``P Q^T`` written out).
* variant ``no-ef``: the same codec with ``error_feedback=False`` (the codec alone).
* variant ``ef-unfused`` (codecs that add error feedback's gradient inside their compress): the
  same error feedback with that add as its own pass first (``res += g``, then ``compress_ef(res)``),
  timed in the same run on the same card: the A/B of the fused add.
* ``ratio_vs_copy`` = copy seconds / round-trip seconds; ``within_goal``: round trip <= 5 x copy.
* ``payload_bytes`` (what one rank would send), ``rel_err`` = ||decompress(compress(g)) - g|| /
  ||g|| of a fresh codec (its first call: no residual yet), ``max_diff_vs_cpu``: the same round trip
  on the first 2^20 values on the device and on the CPU (fresh codecs), the largest difference
  over max |g| (``agrees_with_cpu`` below 1e-3: a bit-packing or dtype bug on the GPU shows here),
  ``peak_extra_bytes``: CUDA's peak allocation during the codec's second round trip above what
  was allocated before it (payload, output and temporaries; the error-feedback residual already
  exists then). Error feedback accumulates what was not sent, so the threshold codec keeps more
  entries call after call on this stream of i.i.d. gradients: ``payload_bytes`` is its first
  call's, ``payload_bytes_last`` its last timed call's. ``ef_steps_vs_unfused`` (codecs with error
  feedback): 3 steps of error feedback against adding into the residual first and compressing
  that, on the same device: per step the largest difference of the decoded values and of the
  residuals over max |g| (0 where the add fused into the compress gives the same bits).

``none`` does no work (the payload is the gradient itself): its row is the call overhead.
Iterations adapt to the codec's speed (a codec slower than expected is timed with fewer calls,
so the run stays short); a codec that raises gets a JSON line with its error and the run goes on.
The cpu dry run uses one thread: it checks the code, its times mean nothing.
One JSON line per (codec, variant), step "codecs", plus one for the copy.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_device, emit, median_ci, parser, sync, timed  # noqa: E402

from phalanx.comm.compression import kernels  # noqa: E402
from phalanx.comm.compression.abilities import AddendResidual  # noqa: E402
from phalanx.comm.compression.codecs import available_compressors, get_compressor  # noqa: E402

STEP = "codecs"
GOAL_X = 5.0  # a round trip within 5x of the copy's time
GRAD_STD = 1e-3
CPU_CHECK_NUMEL = 1 << 20  # 1024 x 1024 for PowerSGD
AGREE_TOL = 1e-3


def _nbytes(payload) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (tuple, list)):
        return sum(_nbytes(p) for p in payload)
    return 0


def _as_input(name: str, flat: torch.Tensor) -> torch.Tensor:
    """PowerSGD compresses a matrix: a near-square 2-D view when n has such a factorisation
    (else the flat tensor, which the codec pads to near-square itself)."""
    if name != "powersgd":
        return flat
    n = flat.numel()
    rows = math.isqrt(n)
    while rows > 1 and n % rows:
        rows -= 1
    return flat.view(rows, n // rows) if rows > 1 and n // rows <= 4 * rows else flat


def _make(name: str, variant: str):
    if variant == "no-ef":
        return get_compressor(name, error_feedback=False)
    return get_compressor(name)


def _roundtrip_fn(codec, variant: str, x: torch.Tensor):
    if variant == "reduce_many":
        return lambda: codec.reduce_many([x], name="g")[0][0]
    if variant == "ef-unfused":  # the A side of the fused add: res += g as its own pass, then compress_ef(res)
        from phalanx.comm.compression.abilities import codec_of
        from phalanx.comm.compression.error_feedback import compress_residual

        _, inner = codec_of(codec)

        def unfused():
            res = codec.accumulate("unfused", x)
            return inner.decompress(*compress_residual(inner, res.view(-1)))

        return unfused
    return lambda: codec.decompress(*codec.compress(x))


def _err_text(err: BaseException) -> tuple[str, str]:
    tb = traceback.format_exception(type(err), err, err.__traceback__)
    return f"{type(err).__name__}: {err}"[:2000], "".join(tb[-6:])[-3000:]


def _cuda_alive(device: str) -> bool:
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing more can run in this process
        return False


def _time(fn, device: str, iters: int, rounds: int) -> tuple[float, float, float]:
    return median_ci([timed(fn, device, iters) for _ in range(rounds)])


def _plan(first_s: float, args) -> tuple[int, int]:
    """Iterations per block and blocks for a call that took ``first_s``: at most ``args.budget``
    seconds for the round-trip timing (compress and decompress alone take about as long again)."""
    if args.device == "cpu":
        return args.iters, args.rounds
    per_block = max(1, min(args.iters, int(args.budget / max(first_s, 1e-6) / args.rounds)))
    rounds = args.rounds if per_block > 1 or first_s * args.rounds <= args.budget else 1
    return per_block, rounds


def _rel_err(codec, variant: str, x: torch.Tensor) -> float:
    y = _roundtrip_fn(codec, variant, x)()
    d = (y.reshape(-1).float() - x.reshape(-1).float()).norm()
    return float(d / x.float().norm().clamp_min(1e-30))


def _vs_cpu(name: str, variant: str, grad: torch.Tensor) -> float:
    m = min(grad.numel(), CPU_CHECK_NUMEL)
    x_dev = _as_input(name, grad[:m].clone())
    x_cpu = x_dev.cpu()
    y_dev = _roundtrip_fn(_make(name, variant), variant, x_dev)().cpu()
    y_cpu = _roundtrip_fn(_make(name, variant), variant, x_cpu)()
    scale = float(x_cpu.abs().max().clamp_min(1e-30))
    return float((y_dev.float() - y_cpu.float()).abs().max()) / scale


def bench_copy(grad: torch.Tensor, args) -> dict:
    dst = torch.empty_like(grad)
    dst.copy_(grad)
    sync(args.device)
    iters = args.copy_iters if args.device == "cuda" else args.iters
    s, lo, hi = _time(lambda: dst.copy_(grad), args.device, iters, args.rounds)
    nbytes = grad.numel() * grad.element_size()
    return {
        "codec": "copy",
        "variant": "dst.copy_(src)",
        "numel": grad.numel(),
        "grad_bytes": nbytes,
        "seconds": s,
        "ci_lo": lo,
        "ci_hi": hi,
        "gbps": nbytes / s / 1e9,
        "iters": iters,
        "rounds": args.rounds,
        "note": "GB/s = gradient bytes / seconds (the copy moves twice that: one read, one write)",
    }


def bench_codec(name: str, variant: str, grad: torch.Tensor, copy_s: float | None, args) -> dict:
    device = args.device
    x = _as_input(name, grad)
    nbytes = grad.numel() * grad.element_size()
    row = {
        "codec": name,
        "variant": variant,
        "numel": grad.numel(),
        "grad_bytes": nbytes,
        "input_shape": list(x.shape),
    }
    codec = _make(name, variant)
    row["codec_repr"] = repr(codec)
    # PowerSGD's compress/decompress is its stateless local power step; reduce_many keeps residuals
    ef = getattr(codec, "enabled", False) or (variant == "reduce_many" and codec.error_feedback)
    row["error_feedback"] = bool(ef)
    # a fresh codec's first round trip: the error, then the extra memory of the next call
    row["rel_err"] = _rel_err(codec, variant, x)
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    _roundtrip_fn(codec, variant, x)()
    sync(device)
    first_s = time.perf_counter() - t0
    row["peak_extra_bytes"] = (
        torch.cuda.max_memory_allocated() - before if device == "cuda" else None
    )
    if variant == "reduce_many":
        row["payload_bytes"] = codec.payload_nbytes(x)
    else:
        payload, ctx = codec.compress(x)
        row["payload_bytes"] = _nbytes(payload)
    row["compression_x"] = nbytes / row["payload_bytes"] if row["payload_bytes"] else None
    for _ in range(max(0, args.warmup - 1)):  # the plan follows the last warm-up call's time
        t0 = time.perf_counter()
        _roundtrip_fn(codec, variant, x)()
        sync(device)
        first_s = time.perf_counter() - t0
    iters, rounds = _plan(first_s, args)
    fn = _roundtrip_fn(codec, variant, x)
    s, lo, hi = _time(fn, device, iters, rounds)
    row.update(seconds=s, ci_lo=lo, ci_hi=hi, gbps=nbytes / s / 1e9, iters=iters, rounds=rounds)
    if variant not in ("reduce_many", "ef-unfused"):  # the codec's own compress and decompress
        row["compress_s"] = _time(lambda: codec.compress(x), device, iters, rounds)[0]
        payload, ctx = codec.compress(x)
        row["payload_bytes_last"] = _nbytes(payload)
        decode = lambda: codec.decompress(payload, ctx)  # noqa: E731
        row["decompress_s"] = _time(decode, device, iters, rounds)[0]
    if copy_s:
        row["copy_s"] = copy_s
        row["ratio_vs_copy"] = copy_s / s
        row["x_copy_time"] = s / copy_s
        row["goal"] = f"round trip <= {GOAL_X:g} x copy time"
        row["within_goal"] = s <= GOAL_X * copy_s
    row["kernel_fallbacks"] = kernels.fallbacks()  # compiled kernels that failed and ran eagerly
    try:
        diff = _vs_cpu(name, variant, grad)
        row["max_diff_vs_cpu"] = diff
        row["agrees_with_cpu"] = diff <= AGREE_TOL
    except Exception as err:  # noqa: BLE001 - the timing above still stands
        row["vs_cpu_error"] = _err_text(err)[0]
    if ef and variant == "default":
        try:
            row["ef_steps_vs_unfused"] = _ef_steps_vs_unfused(name, grad)
        except Exception as err:  # noqa: BLE001
            row["ef_steps_error"] = _err_text(err)[0]
    return row


def _ef_steps_vs_unfused(name: str, grad: torch.Tensor) -> list:
    """Error feedback over 3 steps (from the second on, a codec that ``takes_addend`` adds the
    gradient inside its compress) against the unfused path on the same device (``res += g``, then
    ``compress_ef(res)``), on the first 2^20 + 77 values (a partial last chunk): per step, the
    largest difference of the decoded values and of the residuals, over max |g|."""
    from phalanx.comm.compression.abilities import codec_of
    from phalanx.comm.compression.error_feedback import ErrorFeedback, compress_residual

    m = min(grad.numel(), CPU_CHECK_NUMEL + 77)
    fused = _make(name, "ef")
    if not isinstance(fused, ErrorFeedback):  # PowerSGD keeps its own residuals
        return None
    _, inner = codec_of(fused)
    res, out = None, []
    for step in range(3):
        g = _as_input(name, grad[:m] * (1 + step))
        p1, c1 = fused.compress(g, name="g")
        res = g.reshape(-1).float().clone() if res is None else res.add_(g.reshape(-1))
        p2, c2 = compress_residual(inner, res)
        scale = float(g.abs().max().clamp_min(1e-30))
        d = (fused.decompress(p1, c1).float() - inner.decompress(p2, c2).float()).abs().max()
        r = (fused.memory.residuals["g"].reshape(-1) - res).abs().max()
        out.append([float(d) / scale, float(r) / scale])
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument(
        "--mb", type=float, default=None, help="gradient size in MB (default 100; cpu: 1)"
    )
    ap.add_argument(
        "--iters", type=int, default=None, help="calls per timed block (default 10; cpu: 2)"
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="timed blocks, median taken (default 5; cpu: 1)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 3; cpu: 1)"
    )
    ap.add_argument("--copy-iters", type=int, default=100, help="copies per timed block (cuda)")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.6,
        help="cuda: seconds of round-trip timing per codec at most (iterations adapt)",
    )
    ap.add_argument(
        "--codecs", default=None, help="comma list (default: every available compressor)"
    )
    ap.add_argument(
        "--no-variants", action="store_true", help="skip the no-ef and powersgd reduce_many rows"
    )
    args = ap.parse_args()
    check_device(args.device)
    cpu = args.device == "cpu"
    if cpu:  # the dry run checks the code, not speed: one thread is immune to a busy machine
        torch.set_num_threads(1)
    args.mb = args.mb if args.mb is not None else (1.0 if cpu else 100.0)
    args.iters = args.iters if args.iters is not None else (2 if cpu else 10)
    args.rounds = args.rounds if args.rounds is not None else (1 if cpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    names = available_compressors() if not args.codecs else [c for c in args.codecs.split(",") if c]
    t_start = time.perf_counter()

    numel = int(args.mb * 1e6) // 4
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    grad = torch.randn(numel, generator=gen, device=dev).mul_(GRAD_STD)
    common = {"mb": args.mb, "grad_std": GRAD_STD}

    copy_s = None
    try:
        row = bench_copy(grad, args)
        copy_s = row["seconds"]
        emit(args.out, STEP, args.device, **common, **row)
    except Exception as err:  # noqa: BLE001 - the GPU run is one shot: report and go on
        msg, tb = _err_text(err)
        emit(args.out, STEP, args.device, **common, codec="copy", error=msg, traceback=tb)

    jobs = []
    for name in names:
        jobs.append((name, "default"))
        if args.no_variants:
            continue
        probe = None
        try:
            probe = get_compressor(name)
        except Exception:  # noqa: BLE001 - the default row reports it
            pass
        if probe is not None and hasattr(probe, "inner"):  # error feedback around a codec
            jobs.append((name, "no-ef"))
            if isinstance(probe.inner, AddendResidual):
                jobs.append((name, "ef-unfused"))
        if name == "powersgd":
            jobs.append((name, "reduce_many"))

    broken = None
    for name, variant in jobs:
        if broken is not None:
            emit(args.out, STEP, args.device, **common, codec=name, variant=variant,
                 error=f"skipped: CUDA unusable after {broken} failed")
            continue
        try:
            row = bench_codec(name, variant, grad, copy_s, args)
            emit(args.out, STEP, args.device, **common, **row)
        except Exception as err:  # noqa: BLE001 - one codec's failure must not end the run
            msg, tb = _err_text(err)
            emit(args.out, STEP, args.device, **common, codec=name, variant=variant, error=msg, traceback=tb)
            if not _cuda_alive(args.device):
                broken = f"{name}/{variant}"
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"codecs: {len(jobs)} rows in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

"""int8's compress on CUDA: the library's eager loop against the same arithmetic compiled.

Run:  python benchmarks/gpu/fused_int8.py --device cuda --out results.jsonl
      python benchmarks/gpu/fused_int8.py --device cpu     (the dry run: 1 MB, compiled with backend="eager")

comm/compression/kernels.py compiles sign's and 4/2-bit's hot loops into one Triton kernel each on CUDA. int8's
compress is still the eager loop of comm/compression/quantize.py (max, min, scale, round, convert: five
passes). This script times, in one process on one 100 MB fp32 gradient: a device copy, the
library's int8 compress, its arithmetic as one function run eagerly, and that function compiled
with dynamic and with static shapes. On an H100 (2026-11-26): copy 71 us, library 340 us, the
function compiled 78-81 us. Wiring it into the codec is the next step; codecs.py's int8 figures
moved between 376 and 627 us from run to run for the same eager code, so compare here.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser, timed  # noqa: E402


def int8_rows(rows: torch.Tensor, levels: float, residual: bool):
    """int8 codes of each row and its max |x| (the library's arithmetic in one function)."""
    amax = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg())
    inv = torch.nan_to_num(levels / amax, nan=0.0, posinf=0.0, neginf=0.0)
    q = (rows * inv).round()
    if residual:
        rows.addcmul_(q, amax / levels, value=-1.0)
    return q.to(torch.int8), amax


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=None, help="gradient size (default 100; cpu: 1)")
    args = ap.parse_args()
    check_device(args.device)
    from phalanx.comm.compression.quantize import QuantizeCompressor

    cpu = args.device == "cpu"
    mb = args.mb or (1.0 if cpu else 100.0)
    n = int(mb * 1e6 / 4) // 256 * 256
    g = torch.randn(n, device=args.device) * 1e-3
    rows = g.view(-1, 256)
    dst = torch.empty_like(g)
    backend = "eager" if cpu else "inductor"  # the dry run checks the tracing, not the code it makes
    codec = QuantizeCompressor(bits=8)
    dynamic = torch.compile(int8_rows, dynamic=True, backend=backend)
    static = torch.compile(int8_rows, dynamic=False, backend=backend)
    variants = {
        "copy": lambda: dst.copy_(g),
        "library_int8_compress": lambda: codec.compress(g),
        "function_eager": lambda: int8_rows(rows, 127.0, False),
        "function_compiled_dynamic": lambda: dynamic(rows, 127.0, False),
        "function_compiled_static": lambda: static(rows, 127.0, False),
    }
    iters, blocks = (2, 1) if cpu else (10, 5)
    copy_s = None
    for name, fn in variants.items():
        try:
            for _ in range(3):
                fn()
            s = statistics.median(timed(fn, args.device, iters) for _ in range(blocks))
        except Exception as exc:  # noqa: BLE001 - one shot on the GPU: report it and go on
            emit(args.out, "fused_int8", args.device, variant=name, ok=False, error=f"{type(exc).__name__}: {exc}")
            continue
        copy_s = s if name == "copy" else copy_s
        emit(args.out, "fused_int8", args.device, variant=name, mb=mb, us=s * 1e6,
             x_copy_time=s / copy_s if copy_s else None, ok=True)


if __name__ == "__main__":
    main()

"""Error feedback's add fused into the compiled encode, or as its own pass: a paired, interleaved A/B in one process.

codecs.py times each codec's variants one after the other, and on the H100 the order decided the winner (runs 8
and 9, benchmarks/LOG.md "A real Llama 3 8B step": the variant measured second won in both runs, either form). Here
the two forms of each codec with error feedback (int8, int4, 2bit, sign) alternate round by round, the order of the
pair swapped every round, a device copy of the same gradient timed in each round as the yardstick: one JSON line
per codec with the median time of each form, the paired ratio unfused / fused with a ~95% interval, and each form
in multiples of the copy.

Run: ``python benchmarks/gpu/fused_add_ab.py --device cuda`` (about a minute on one H100). ``--device cpu`` is the
dry run (the fused path run eagerly under ``kernels.everywhere()``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import check_device, emit, median_ci, parser, timed  # noqa: E402


def _codecs_script():
    """benchmarks/gpu/codecs.py (its name is the standard library's ``codecs``, so it is loaded by path)."""
    spec = importlib.util.spec_from_file_location("gpu_codecs", HERE / "codecs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

CODECS = ("int8", "int4", "2bit", "sign")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=None, help="gradient size (default cuda 100, cpu 0.1)")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (default cuda 21, cpu 3)")
    ap.add_argument("--iters", type=int, default=10, help="calls timed per form per round")
    args = ap.parse_args()
    check_device(args.device)
    from phalanx.comm.compression import kernels
    cpu = args.device == "cpu"
    with kernels.everywhere() if cpu else contextlib.nullcontext():
        run(args, cpu)


def run(args, cpu: bool) -> None:
    mb = args.mb or (0.1 if cpu else 100.0)
    rounds = args.rounds or (3 if cpu else 21)
    g = torch.Generator(device=args.device).manual_seed(0)
    grad = torch.randn(int(mb * 1e6 / 4), device=args.device, generator=g) * 1e-3
    dst = torch.empty_like(grad)
    script = _codecs_script()
    for name in CODECS:
        forms = {form: script._roundtrip_fn(script._make(name, variant), variant, grad)
                 for form, variant in (("fused", "default"), ("unfused", "ef-unfused"))}
        for fn in forms.values():  # warm-up: compile both forms' kernels before anything is timed
            for _ in range(3):
                fn()
        times = {"fused": [], "unfused": [], "copy": []}
        ratios = []
        for r in range(rounds):
            order = ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")
            times["copy"].append(timed(lambda: dst.copy_(grad), args.device, args.iters))
            got = {k: timed(forms[k], args.device, args.iters) for k in order}
            for k, v in got.items():
                times[k].append(v)
            ratios.append(got["unfused"] / got["fused"])
        med = {k: median_ci(v)[0] for k, v in times.items()}
        ratio, lo, hi = median_ci(ratios)
        emit(args.out, "fused_add", args.device, codec=name, mb=mb, rounds=rounds, iters=args.iters,
             fused_s=med["fused"], unfused_s=med["unfused"], copy_s=med["copy"],
             fused_x_copy=med["fused"] / med["copy"], unfused_x_copy=med["unfused"] / med["copy"],
             unfused_over_fused=ratio, ci_lo=lo, ci_hi=hi,
             verdict="fused faster" if lo > 1 else ("unfused faster" if hi < 1 else "no difference shown"))


if __name__ == "__main__":
    main()

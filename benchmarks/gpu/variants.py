"""The pieces of the codecs that compiling does not fuse, timed alone against a device copy.

Run:  python benchmarks/gpu/variants.py --device cuda --out results.jsonl
      python benchmarks/gpu/variants.py --device cpu     (the dry run: 1 MB, compiled with backend="eager")

comm/compression/kernels.py runs int8, 4/2-bit and sign as one compiled call each. Top-k and the
threshold codec are a selection and a stream compaction, and PowerSGD a thin matrix product and
an orthogonalisation; this step times, on one fp32 gradient of ``--mb`` MB (N(0, 1e-3^2), as in
codecs.py), the alternatives each could take, so that the codecs can take the fastest:

* ``copy``: ``dst.copy_(src)``, the unit; ``ef_add``: ``res.add_(g)``, error feedback's own pass.
* top-k of |g| at the registry's ratio 0.05: ``torch.topk`` on all of it; the library's
  ``top_indices`` (a strided sample's threshold, ``nonzero``, then the exact top-k among the
  candidates: made for the CPU).
* threshold 1e-3: ``(|g| >= t).nonzero()`` eagerly and with the mask compiled (nonzero itself
  cannot be fused: its size is data-dependent), and ``masked_select`` for the values.
* PowerSGD's orthogonalisation of P (sqrt(n) x 4): ``torch.linalg.qr`` against kernels.py's
  compiled Gram-Schmidt.
* int8's whole compress (kernels.int8_encode, rows of 256, with the residual) compiled as the
  library compiles it (default mode) against CUDA graphs (``mode="reduce-overhead"``, static
  shapes): the host cost of one compiled call is the codecs' bound on an H100 (docs/design.md),
  which a replayed graph cuts to one launch; the library would then have to consume each
  output before the next call (a graph's outputs are overwritten by its next replay).
One JSON line per variant, step "variants", with ``x_copy_time``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser, timed  # noqa: E402


def _mask(x: torch.Tensor, threshold: float) -> torch.Tensor:
    return x.abs() >= threshold


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=None, help="gradient size (default 100; cpu: 1)")
    args = ap.parse_args()
    check_device(args.device)
    from phalanx.comm.compression import kernels
    from phalanx.comm.compression.sparsify import top_indices

    cpu = args.device == "cpu"
    mb = args.mb or (1.0 if cpu else 100.0)
    n = int(mb * 1e6 / 4)
    g = torch.randn(n, device=args.device, generator=torch.Generator(device=args.device).manual_seed(0)) * 1e-3
    dst, res, mag = torch.empty_like(g), torch.zeros_like(g), g.abs()
    k = math.ceil(0.05 * n)
    side = math.isqrt(n)
    p = torch.randn(side, 4, device=args.device)
    backend = "eager" if cpu else "inductor"  # the dry run checks the tracing, not the code it makes
    mask = torch.compile(_mask, dynamic=True, backend=backend)
    gram = torch.compile(kernels.orthonormal_columns, dynamic=True, backend=backend)
    body, tail, _ = kernels.split_rows(g.clone(), 256)
    enc_default = torch.compile(kernels.int8_encode, dynamic=True, backend=backend)
    enc_graphs = (torch.compile(kernels.int8_encode, mode="reduce-overhead", dynamic=False) if not cpu
                  else torch.compile(kernels.int8_encode, dynamic=False, backend=backend))
    variants = {
        "copy": lambda: dst.copy_(g),
        "ef_add": lambda: res.add_(g),
        "topk_torch": lambda: mag.topk(k, sorted=False),
        "topk_library_sampled": lambda: top_indices(mag, k),
        "threshold_nonzero_eager": lambda: (g.abs() >= 1e-3).nonzero(),
        "threshold_nonzero_compiled_mask": lambda: mask(g, 1e-3).nonzero(),
        "threshold_masked_select": lambda: g.masked_select(mask(g, 1e-3)),
        "orth_qr": lambda: torch.linalg.qr(p).Q,
        "orth_gram_schmidt_compiled": lambda: gram(p),
        "int8_encode_compiled": lambda: enc_default(body, tail, 127, True),
        "int8_encode_cuda_graphs": lambda: enc_graphs(body, tail, 127, True),
    }
    iters, blocks = (2, 1) if cpu else (10, 5)
    copy_s = None
    for name, fn in variants.items():
        try:
            for _ in range(3):
                fn()
            s = statistics.median(timed(fn, args.device, iters) for _ in range(blocks))
        except Exception as exc:  # noqa: BLE001 - one shot on the GPU: report it and go on
            emit(args.out, "variants", args.device, variant=name, ok=False, error=f"{type(exc).__name__}: {exc}")
            continue
        copy_s = s if name == "copy" else copy_s
        emit(args.out, "variants", args.device, variant=name, mb=mb, us=s * 1e6,
             x_copy_time=s / copy_s if copy_s else None, ok=True)


if __name__ == "__main__":
    main()

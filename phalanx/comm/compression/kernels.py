"""Fused GPU kernels for the codecs: a whole compress or decompress in one compiled call.

On a GPU a codec is memory-bound, and eager torch runs each operation as its own kernel that
reads and writes the whole gradient, plus a launch from Python for each: int8's eager compress
took 4.8x, sign's 16x the time of a plain device copy of the gradient on an H100
(benchmarks/gpu/codecs.py). The functions here take the flat gradient as it is (a partial last
chunk is padded inside, where TorchInductor turns the padding into masked loads instead of a
copy), do the per-chunk reduction, the element-wise tail and the error-feedback residual, and
are compiled by ``torch.compile`` for CUDA tensors (one or two Triton kernels a function) the
first time they run, with dynamic shapes so that every bucket size shares one compilation. The
decoders take the payload's bytes as ``uint8`` and the scales as a tensor of their own: the
compile of a decoder that read a float32 view of the payload's bytes failed on an H100 ("when
making fake tensor call"). On the CPU they run eagerly: the codecs' CPU paths are tuned for it,
and compiling there costs tens of seconds at start-up for nothing. If compiling fails (no
Triton, an unsupported torch), the eager function is used from then on, after one warning,
and :func:`fallbacks` names it. ``PHALANX_COMPILE_CODECS=0`` keeps the codecs on their eager
paths on CUDA too.

:func:`wanted` is the codecs' one question ("take the fused path for this tensor?"); tests
answer it yes on the CPU with :func:`everywhere`, which runs the same functions eagerly, so
the CUDA path's arithmetic is checked against the CPU codec in CI.

Example::

    from phalanx.comm.compression import kernels
    codes, scales = kernels.run(kernels.int8_encode, x, 127, 256, False)   # compiled on CUDA
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phalanx.log import get_logger
from phalanx.runtime import current_settings

__all__ = ["run", "wanted", "everywhere", "fallbacks", "int8_encode", "int8_decode", "packed_encode",
           "packed_decode", "sign_encode", "sign_decode", "orthonormal_columns"]

_log = get_logger(__name__)
_lock = threading.Lock()
_compiled: dict[Callable, Callable | None] = {}  # None: compiling failed, run eagerly
_everywhere = False


def _rows(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Flat ``x`` zero-padded to whole chunks, as ``(rows, chunk)`` (a view when nothing is padded)."""
    return F.pad(x, (0, (-x.numel()) % chunk)).view(-1, chunk)


def _valid(rows: torch.Tensor, n: int) -> torch.Tensor:
    """True for the first ``n`` values of ``rows`` (False on the last row's padding)."""
    return torch.arange(rows.numel(), device=rows.device).view(rows.shape) < n


def int8_encode(x: torch.Tensor, levels: int, chunk: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of flat fp32 ``x`` (``round(x * L / amax)`` per chunk) and each chunk's scale
    ``amax / L``; with ``residual``, ``x`` becomes ``x - code * scale`` in place. A chunk whose
    ``L / amax`` is not finite (amax 0, or below ~1e-37) sends zeros and keeps its values."""
    n = x.numel()
    rows = _rows(x, chunk)
    amax = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg())
    inv = torch.nan_to_num(levels / amax, nan=0.0, posinf=0.0, neginf=0.0)
    q = (rows * inv).round()
    scale = amax / levels
    if residual:
        x.sub_((q * scale).view(-1)[:n])
    return q.view(-1)[:n].to(torch.int8), scale.view(-1)


def int8_decode(codes: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor, add: bool) -> torch.Tensor:
    """``out`` ``=`` (or ``+=``) ``code * scale`` for the int8 codes stored as the bytes ``codes`` (uint8)."""
    n = codes.numel()
    c = codes.to(torch.int32)
    c = c - ((c >> 7) << 8)  # the two's-complement byte as a signed value, without a dtype view
    values = (_rows(c.float(), chunk) * scales.view(-1, 1)).view(-1)[:n]
    return out.add_(values) if add else out.copy_(values)


def packed_encode(x: torch.Tensor, levels: int, bits: int, chunk: int, residual: bool):
    """4- or 2-bit codes of flat fp32 ``x``, ``code = clamp(round(x * L / amax), -L, L) + L``,
    packed ``8 // bits`` to a byte, low bits first (padding packed as 0, as
    ``quantize.pack_bits`` does), and each chunk's scale ``amax / L``; with ``residual``, ``x``
    becomes ``x - (code - L) * scale``. ``chunk * bits`` must be a multiple of 8."""
    n = x.numel()
    rows = _rows(x, chunk)
    amax = rows.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = (rows * inv).round().clamp(-levels, levels)
    scale = amax / levels
    if residual:
        x.sub_((q * scale).view(-1)[:n])
    codes = torch.where(_valid(rows, n), q + levels, torch.zeros_like(q)).to(torch.uint8)
    per_byte = 8 // bits
    slots = codes.view(rows.shape[0], -1, per_byte)
    packed = slots[..., 0]
    for i in range(1, per_byte):
        packed = packed | (slots[..., i] << (i * bits))
    return packed.reshape(-1)[: (n * bits + 7) // 8], scale.view(-1)


def packed_decode(packed: torch.Tensor, scales: torch.Tensor, levels: int, bits: int, chunk: int, n: int,
                  out: torch.Tensor, alpha: float, add: bool) -> torch.Tensor:
    """Inverse of :func:`packed_encode`: ``out`` ``=`` (or ``+=``) ``alpha * (code - L) * scale``."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(-1)
    values = ((_rows(codes.float(), chunk) - levels) * scales.view(-1, 1)).view(-1)[:n]
    return out.add_(values, alpha=alpha) if add else torch.mul(values, alpha, out=out)


def sign_encode(x: torch.Tensor, chunk: int, two_level: bool, residual: bool):
    """1-bit codes of flat fp32 ``x`` (chunk a multiple of 32): ``(words, up, down)``.

    Bit i is 1 where x_i's sign bit is clear ("up"), packed 32 to an int32 word, low bit first
    (8 to a byte in little-endian memory; the padding's bits 0); ``up`` / ``down`` are each
    chunk's two magnitudes (one, the mean |x|, without ``two_level``), as
    :class:`phalanx.comm.compression.onebit.SignCompressor` computes them, the padding not
    counted. With ``residual``, ``x`` becomes ``x + down - bit * (up + down)`` in place.
    """
    n = x.numel()
    rows = _rows(x, chunk)
    valid = _valid(rows, n)
    u = torch.where(valid, (rows.view(torch.int32) >> 31) + 1, torch.zeros_like(rows, dtype=torch.int32))
    uf = u.float()
    total = rows.sum(1)
    l1 = rows.abs().sum(1)
    count = valid.float().sum(1)
    if two_level:
        npos = uf.sum(1)
        up = (total + l1) * 0.5 / npos.clamp(min=1)
        down = (l1 - total) * 0.5 / (count - npos).clamp(min=1)
    else:
        up = down = l1 / count
    shifts = torch.arange(32, device=x.device, dtype=torch.int32)
    words = (u.view(rows.shape[0], -1, 32) << shifts).sum(-1, dtype=torch.int32)
    if residual:
        x.copy_((rows + down.view(-1, 1) - uf * (up + down).view(-1, 1)).view(-1)[:n])
    return words.view(-1), up, down


def sign_decode(bits: torch.Tensor, span: torch.Tensor, low: torch.Tensor, chunk: int, n: int,
                out: torch.Tensor, add: bool) -> torch.Tensor:
    """``out`` ``=`` (or ``+=``) ``low + bit * span`` per chunk, for the sign bits packed in the bytes ``bits``."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    b = ((bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1).view(-1)
    values = (_rows(b[:n].float(), chunk) * span.view(-1, 1) + low.view(-1, 1)).view(-1)[:n]
    return out.add_(values) if add else out.copy_(values)


def orthonormal_columns(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """An orthonormal basis of ``p``'s (few) columns by modified Gram-Schmidt with
    re-orthogonalisation, as PyTorch's own PowerSGD hook orthogonalises, but twice (Vogels et al.
    2019, arXiv:1905.13727): a column that is
    (nearly) zero stays (nearly) zero instead of dividing by zero. The same span as a QR's Q,
    with each column's sign chosen by the data, which no product ``P P^T M`` depends on; for
    the tall, thin P of PowerSGD it is a few fused reductions where ``torch.linalg.qr`` on
    CUDA is a solver library call of many small kernels."""
    cols = []
    for j in range(p.shape[1]):
        v = p[:, j]
        for _ in range(2):  # "twice is enough" (Giraud et al. 2005): one pass loses orthogonality
            for u in cols:  # when the column is nearly in the others' span (a low-rank gradient)
                v = v - (u @ v) * u
        cols.append(v / (v.norm() + eps))
    return torch.stack(cols, 1)


def wanted(t: torch.Tensor) -> bool:
    """Take the fused path for ``t``: on CUDA unless PHALANX_COMPILE_CODECS=0, or anywhere under :func:`everywhere`."""
    return _everywhere or (t.device.type == "cuda" and _compiling())


@contextlib.contextmanager
def everywhere():
    """Within the block the codecs take their fused paths on every device (eagerly off CUDA): for tests."""
    global _everywhere
    before, _everywhere = _everywhere, True
    try:
        yield
    finally:
        _everywhere = before


def fallbacks() -> list[str]:
    """The functions whose compile failed in this process (they run eagerly)."""
    return sorted(fn.__name__ for fn, compiled in _compiled.items() if compiled is None)


_enabled: bool | None = None


def _compiling() -> bool:
    """PHALANX_COMPILE_CODECS, read once (the setting init() checked; before init, the environment)."""
    global _enabled
    if _enabled is None:
        _enabled = current_settings().comm.compile_codecs
    return _enabled


def run(fn: Callable, tensor: torch.Tensor, *args):
    """``fn(tensor, *args)``, compiled when ``tensor`` is on CUDA."""
    if tensor.device.type != "cuda" or not _compiling():
        return fn(tensor, *args)
    compiled = _compiled.get(fn, fn)
    if compiled is fn:
        with _lock:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True)
            compiled = _compiled[fn]
    if compiled is None:
        return fn(tensor, *args)
    try:
        return compiled(tensor, *args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager function is correct
        _log.warning("fused codec kernel %s could not be compiled (%s: %s); running it eagerly",
                     fn.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        _compiled[fn] = None
        return fn(tensor, *args)

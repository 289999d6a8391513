"""Fused GPU kernels for the codecs: each chunk-row pass of a compress or decompress in one compiled call.

On a GPU a codec is memory-bound, and eager torch runs each operation as its own kernel that
reads and writes the whole gradient, plus a launch from Python for each: int8's eager compress
took 4.8x, sign's 16x the time of a plain device copy of the gradient on an H100
(benchmarks/gpu/codecs.py). The functions here take the gradient's whole chunks as a 2-D view,
``(rows, chunk)``, and do the per-row reduction, the element-wise tail and the error-feedback
residual in place; the codecs call them once more on a zero-padded copy of a partial last chunk
(:func:`row_blocks`). They are compiled by ``torch.compile`` for CUDA tensors (one or two Triton
kernels a function) the first time they run, with the number of rows dynamic and the row width
static (see :func:`run`). The decoders take the payload's bytes as ``uint8`` and the scales as a
tensor of their own: the compile of a decoder that read a float32 view of the payload's bytes
failed on an H100 ("when making fake tensor call"), and so did one that shifted by a symbolic
bit count. On the CPU they run eagerly: the codecs' CPU paths are tuned for it, and compiling
there costs tens of seconds at start-up for nothing. If compiling fails (no Triton, an
unsupported torch), the eager function is used from then on, after one warning, and
:func:`fallbacks` names it. ``PHALANX_COMPILE_CODECS=0`` keeps the codecs on their eager paths
on CUDA too.

:func:`wanted` is the codecs' one question ("take the fused path for this tensor?"); tests
answer it yes on the CPU with :func:`everywhere`, which runs the same functions eagerly, so
the CUDA path's arithmetic is checked against the CPU codec in CI.

Example::

    from phalanx.comm.compression import kernels
    codes, scales = kernels.run(kernels.int8_rows, rows, 127, False)   # compiled on CUDA
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from phalanx.log import get_logger
from phalanx.runtime import current_settings

__all__ = ["run", "wanted", "everywhere", "fallbacks", "row_blocks", "write_back", "padded_rows", "int8_rows",
           "int8_rows_decode", "packed_rows", "packed_rows_decode", "sign_rows", "sign_rows_decode",
           "threshold_mask", "orthonormal_columns"]

_log = get_logger(__name__)
_lock = threading.Lock()
_compiled: dict[Callable, Callable | None] = {}  # None: compiling failed, run eagerly
_everywhere = False


def row_blocks(x: torch.Tensor, chunk: int):
    """The flat ``x`` as kernel inputs: ``(rows, count, start, stop)`` for its whole chunks (a
    ``(n // chunk, chunk)`` view of ``x``), then for a partial last chunk a zero-padded ``(1, chunk)``
    copy; ``count`` is how many of the block's values are real, ``x[start:stop]`` what it holds
    (a kernel's residual in the copy goes back there with :func:`write_back`)."""
    n = x.numel()
    full = n // chunk
    if full:
        yield x[: full * chunk].view(full, chunk), full * chunk, 0, full * chunk
    if full * chunk < n:
        tail = x.new_zeros(1, chunk)
        tail[0, : n - full * chunk] = x[full * chunk :]
        yield tail, n - full * chunk, full * chunk, n


def write_back(x: torch.Tensor, rows: torch.Tensor, start: int, stop: int) -> None:
    """Copy a padded block's values back to ``x[start:stop]`` (nothing for a view of ``x``)."""
    if rows.numel() != stop - start:
        x[start:stop].copy_(rows.view(-1)[: stop - start])


def padded_rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` (bytes of a partial last chunk) zero-padded to one row of ``width``."""
    row = flat.new_zeros(1, width)
    row[0, : flat.numel()] = flat
    return row


def int8_rows(rows: torch.Tensor, levels: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of each row (``round(x * L / amax)``) and its scale ``amax / L``; with ``residual``,
    ``rows`` becomes ``rows - code * scale`` in place. A row whose ``L / amax`` is not finite (amax 0,
    or below ~1e-37) sends zeros and keeps its values."""
    amax = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg())
    inv = torch.nan_to_num(levels / amax, nan=0.0, posinf=0.0, neginf=0.0)
    q = (rows * inv).round()
    scale = amax / levels
    if residual:
        rows.sub_(q * scale)
    return q.to(torch.int8), scale


def int8_rows_decode(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, add: bool) -> torch.Tensor:
    """``out`` ``=`` (or ``+=``) ``code * scale`` for rows of int8 codes stored as bytes (uint8)."""
    c = codes.to(torch.int32)
    values = (c - ((c >> 7) << 8)).float() * scales  # the two's-complement byte, without a dtype view
    return out.add_(values) if add else out.copy_(values)


def packed_rows(rows: torch.Tensor, levels: int, bits: int, count: int, residual: bool):
    """4- or 2-bit codes of each row, ``code = clamp(round(x * L / amax), -L, L) + L``, packed
    ``8 // bits`` to a byte, low bits first, and its scale ``amax / L``; codes past the first ``count``
    values (the padding) are packed as 0, as ``quantize.pack_bits`` does; with ``residual``, ``rows``
    becomes ``rows - (code - L) * scale``. The row length times ``bits`` is a multiple of 8."""
    amax = rows.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = (rows * inv).round().clamp(-levels, levels)
    scale = amax / levels
    if residual:
        rows.sub_(q * scale)
    index = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    codes = torch.where(index < count, q + levels, torch.zeros_like(q)).to(torch.uint8)
    per_byte = 8 // bits
    slots = codes.view(rows.shape[0], -1, per_byte)
    packed = slots[..., 0]
    for i in range(1, per_byte):
        packed = packed | (slots[..., i] << (i * bits))
    return packed, scale


def packed_rows_decode(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, alpha: float,
                       add: bool) -> torch.Tensor:
    """Inverse of :func:`packed_rows`: ``out`` ``=`` (or ``+=``) ``alpha * (code - L) * scale``; the
    width is read off the shapes (``out``'s rows are ``8 // bits`` times ``packed``'s)."""
    bits = 8 // (out.shape[1] // packed.shape[1])
    levels = 2 ** (bits - 1) - 1
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(out.shape)
    values = (codes.float() - levels) * scales
    return out.add_(values, alpha=alpha) if add else out.copy_(values * alpha)


def sign_rows(rows: torch.Tensor, two_level: bool, count: int, residual: bool):
    """1-bit codes of rows whose length is a multiple of 32: ``(words, up, down)``.

    Bit i is 1 where x_i's sign bit is clear ("up"), packed 32 to an int32 word, low bit first
    (8 to a byte in little-endian memory; the padding past the first ``count`` values gets 0);
    ``up`` / ``down`` are each row's two magnitudes (one, the mean |x|, without ``two_level``), as
    :class:`phalanx.comm.compression.onebit.SignCompressor` computes them, the padding not counted.
    With ``residual``, ``rows`` becomes ``x + down - bit * (up + down)`` in place.
    """
    valid = torch.arange(rows.numel(), device=rows.device).view(rows.shape) < count
    u = torch.where(valid, (rows.view(torch.int32) >> 31) + 1, torch.zeros_like(rows, dtype=torch.int32))
    uf = u.float()
    total = rows.sum(1)
    l1 = rows.abs().sum(1)
    real = valid.float().sum(1)
    if two_level:
        npos = uf.sum(1)
        up = (total + l1) * 0.5 / npos.clamp(min=1)
        down = (l1 - total) * 0.5 / (real - npos).clamp(min=1)
    else:
        up = down = l1 / real
    shifts = torch.arange(32, device=rows.device, dtype=torch.int32)
    words = (u.view(rows.shape[0], -1, 32) << shifts).sum(-1, dtype=torch.int32)
    if residual:
        rows.add_(down.view(-1, 1)).addcmul_(uf, (up + down).view(-1, 1), value=-1.0)
    return words, up, down


def sign_rows_decode(bits: torch.Tensor, span: torch.Tensor, low: torch.Tensor, out: torch.Tensor,
                     add: bool) -> torch.Tensor:
    """``out`` ``=`` (or ``+=``) ``low + bit * span`` per row, for the sign bits packed in the bytes ``bits``."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    b = ((bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1).view(out.shape).float()
    values = b * span + low
    return out.add_(values) if add else out.copy_(values)


def threshold_mask(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """``|x| >= threshold``, one pass (the threshold codec's selection; its ``nonzero`` stays eager)."""
    return x.abs() >= threshold


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
    """``fn(tensor, *args)``, compiled when ``tensor`` is on CUDA.

    Compiled with dynamic shapes, but the width of every 2-D tensor argument (a chunk, its bytes,
    its words) is marked static: it is fixed per codec, and a symbolic width turns each element's
    index into 64-bit divisions (compiled on the CPU, the int8 compress of a flat, padded input
    ran 56x slower than of a 2-D view with the width known). The number of rows varies freely."""
    if tensor.device.type != "cuda" or not _compiling():
        return fn(tensor, *args)
    for t in (tensor, *args):
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            torch._dynamo.mark_static(t, 1)
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

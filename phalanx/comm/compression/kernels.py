"""Fused GPU kernels for the codecs: a whole compress, or a whole decode, in one compiled call.

On a GPU a codec is memory-bound, and eager torch runs each operation as its own kernel that
reads and writes the whole gradient, plus a launch from Python for each: int8's eager compress
took 4.8x, sign's 16x the time of a plain device copy of the gradient on an H100
(benchmarks/gpu/codecs.py). On that machine's host one call of a compiled function costs about
as long as a device copy of 100 MB, so each compress and each decode here is a single call
(``*_encode`` / ``*_decode``): it takes the gradient's whole chunks as a 2-D view, ``(rows,
chunk)``, and the partial last chunk as a flat view (:func:`split_rows`), pads that to a row
itself (padded on the host, with ``F.pad`` before the call and its residual copied back after,
the tail cost an H100's host hundreds of microseconds a round trip), and does the per-row
reduction, the element-wise tail and the error-feedback residual in place. The encoders also
take error feedback's gradient as an addend: ``res + g`` is formed inside the call, so the
residual's ``res += g`` needs no pass of its own over the gradient (105 us of 312 on an H100,
run 6). They are compiled by ``torch.compile`` for CUDA tensors the first time they run, with
the number of rows (and the tail's length) dynamic and the row width static (see :func:`run`);
the padded tail row's width is that static width. The decoders take the payload's bytes as ``uint8`` and the scales as a
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
    body, tail, rest = kernels.split_rows(x, 256)
    codes, tail_codes, scales = kernels.run(kernels.int8_encode, body, tail, 127, False)  # compiled on CUDA
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phalanx.log import get_logger
from phalanx.runtime import current_settings

__all__ = ["run", "wanted", "everywhere", "fallbacks", "split_rows", "pad_row", "int8_encode", "int8_decode",
           "packed_encode", "packed_decode", "sign_encode", "sign_decode", "threshold_mask", "orthonormal_columns"]

_log = get_logger(__name__)
_lock = threading.Lock()
_compiled: dict[tuple, Callable | None] = {}  # (function, flags) -> compiled; None: compiling failed, run eagerly
_everywhere = False


def split_rows(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The flat ``x`` as kernel inputs: ``(body, tail, rest)``: its whole chunks as a
    ``(n // chunk, chunk)`` view, and a partial last chunk of ``rest`` values as a flat view
    (None when there is none). The kernels pad the tail to a row themselves, inside the
    compiled call (no host-side padding), and write its residual back into the view."""
    full, rest = divmod(x.numel(), chunk)
    body = x[: full * chunk].view(full, chunk)
    return body, (x[full * chunk :] if rest else None), rest


def pad_row(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` zero-padded to one row of ``width`` (inside the kernels: its length may be
    symbolic, ``width`` is static, so the padded row's width is known to the compiler)."""
    return F.pad(flat, (0, width - flat.numel())).view(1, width)


def _encode_rows(rows_fn: Callable, body: torch.Tensor, tail: torch.Tensor | None, residual: bool,
                 add_body: torch.Tensor | None, add_tail: torch.Tensor | None):
    """``(rows_fn(body rows, count), rows_fn(tail row, rest) or None)``: the values encoded are
    ``body (+ add_body)`` and the flat ``tail (+ add_tail)`` zero-padded to a row; ``rows_fn``
    leaves the residual in the rows it is given, which goes back into ``body`` and ``tail``.

    With an addend this is error feedback's ``res += g`` and the compress in one pass: the sum
    is formed in registers and only the new residual is written (one read of each, one write)."""
    xb = body if add_body is None else body + add_body
    rb = rows_fn(xb, xb.numel())
    if residual and xb is not body:
        body.copy_(xb)
    if tail is None:
        return rb, None
    rest = tail.numel()
    xt = pad_row(tail if add_tail is None else tail + add_tail, body.shape[1])
    rt = rows_fn(xt, rest)
    if residual:
        tail.copy_(xt.view(-1)[:rest])
    return rb, rt


# ------------------------------------------------------------------ the per-row arithmetic
def _int8_rows(rows: torch.Tensor, levels: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg())
    inv = torch.nan_to_num(levels / amax, nan=0.0, posinf=0.0, neginf=0.0)
    q = (rows * inv).round()
    scale = amax / levels
    if residual:
        rows.sub_(q * scale)
    return q.to(torch.int8), scale


def _int8_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    return (c - ((c >> 7) << 8)).float() * scales  # the two's-complement byte, without a dtype view


def _packed_rows(rows: torch.Tensor, levels: int, bits: int, count, residual: bool):
    amax = rows.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = (rows * inv).round().clamp(-levels, levels)
    scale = amax / levels
    if residual:
        rows.sub_(q * scale)
    index = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    codes = torch.where(index < count, q + levels, torch.zeros_like(q)).to(torch.uint8)
    per_byte = 8 // bits
    slots = codes.view(rows.shape[0], rows.shape[1] // per_byte, per_byte)
    packed = slots[..., 0]
    for i in range(1, per_byte):
        packed = packed | (slots[..., i] << (i * bits))
    return packed, scale


def _packed_values(packed: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
    bits = 8 // (width // packed.shape[1])  # read off the static shapes: a symbolic shift failed to compile
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(packed.shape[0], width)
    return (codes.float() - (2 ** (bits - 1) - 1)) * scales


def _sign_rows(rows: torch.Tensor, two_level: bool, count, residual: bool):
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
    words = (u.view(rows.shape[0], rows.shape[1] // 32, 32) << shifts).sum(-1, dtype=torch.int32)
    if residual:
        rows.add_(down.view(-1, 1)).addcmul_(uf, (up + down).view(-1, 1), value=-1.0)
    return words, up, down


def _sign_values(bits: torch.Tensor, span: torch.Tensor, low: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    b = ((bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], width).float()
    return b * span + low


def _store(out_body: torch.Tensor, out_tail: torch.Tensor | None, body: torch.Tensor, tail: torch.Tensor | None,
           alpha: float, add: bool) -> None:
    if add:
        out_body.add_(body, alpha=alpha)
    else:
        out_body.copy_(body * alpha)
    if out_tail is not None:
        values = tail.view(-1)[: out_tail.numel()]
        out_tail.add_(values, alpha=alpha) if add else out_tail.copy_(values * alpha)


# ------------------------------------------------------- one compiled call per compress / decode
def int8_encode(body: torch.Tensor, tail: torch.Tensor | None, levels: int, residual: bool,
                add_body: torch.Tensor | None = None, add_tail: torch.Tensor | None = None):
    """int8 codes of the rows of ``body`` and the flat partial ``tail`` (``round(x * L / amax)``
    per row, the tail zero-padded to a row) and every row's scale ``amax / L``: ``(body codes,
    tail codes, scales)``; with ``residual`` they become ``x - code * scale`` in place. With
    ``add_body`` / ``add_tail`` (error feedback's gradient, ``residual`` on) ``x`` is their sum
    with ``body`` / ``tail``. A row whose ``L / amax`` is not finite (amax 0, or below ~1e-37)
    sends zeros and keeps its values."""
    (qb, sb), t = _encode_rows(lambda x, count: _int8_rows(x, levels, residual), body, tail, residual,
                               add_body, add_tail)
    if t is None:
        return qb, None, sb.view(-1)
    return qb, t[0], torch.cat([sb, t[1]]).view(-1)


def int8_decode(body: torch.Tensor, tail: torch.Tensor | None, scales: torch.Tensor, out_body: torch.Tensor,
                out_tail: torch.Tensor | None, alpha: float, add: bool) -> None:
    """``out`` ``=`` (or ``+=``) ``code * (scale * alpha)`` for int8 codes stored as bytes (uint8),
    rows of ``body`` then the flat partial ``tail`` (zero-padded to a row here); ``scales`` one per
    row, as a column."""
    scales = scales * alpha  # folded in first, as the eager loop does
    full = body.shape[0]
    vt = None if tail is None else _int8_values(pad_row(tail, body.shape[1]), scales[full:])
    _store(out_body, out_tail, _int8_values(body, scales[:full]), vt, 1.0, add)


def packed_encode(body: torch.Tensor, tail: torch.Tensor | None, levels: int, bits: int, residual: bool, add_body: torch.Tensor | None = None, add_tail: torch.Tensor | None = None):
    """4- or 2-bit codes of the rows, ``code = clamp(round(x * L / amax), -L, L) + L``, packed
    ``8 // bits`` to a byte, low bits first, the padding past the tail's values packed as
    0 (as ``quantize.pack_bits`` does), and every row's scale ``amax / L``: ``(body bytes, tail
    bytes, scales)``; with ``residual`` the rows become ``x - (code - L) * scale``; the addends as
    in :func:`int8_encode`."""
    (pb, sb), t = _encode_rows(lambda x, count: _packed_rows(x, levels, bits, count, residual), body, tail,
                               residual, add_body, add_tail)
    if t is None:
        return pb, None, sb.view(-1)
    return pb, t[0], torch.cat([sb, t[1]]).view(-1)


def packed_decode(body: torch.Tensor, tail: torch.Tensor | None, scales: torch.Tensor, out_body: torch.Tensor,
                  out_tail: torch.Tensor | None, alpha: float, add: bool) -> None:
    """Inverse of :func:`packed_encode`: ``out`` ``=`` (or ``+=``) ``alpha * (code - L) * scale``."""
    full, width = body.shape[0], out_body.shape[1]
    vt = None if tail is None else _packed_values(pad_row(tail, body.shape[1]), scales[full:], width)
    _store(out_body, out_tail, _packed_values(body, scales[:full], width), vt, alpha, add)


def sign_encode(body: torch.Tensor, tail: torch.Tensor | None, two_level: bool, residual: bool,
                add_body: torch.Tensor | None = None, add_tail: torch.Tensor | None = None):
    """1-bit codes of rows whose length is a multiple of 32: ``(body words, tail words, up, down)``.

    Bit i is 1 where x_i's sign bit is clear ("up"), packed 32 to an int32 word, low bit first (8
    to a byte in little-endian memory; the padding past the tail's values gets 0); ``up`` /
    ``down`` are each row's two magnitudes (one, the mean |x|, without ``two_level``), as
    :class:`phalanx.comm.compression.onebit.SignCompressor` computes them, the padding not counted.
    With ``residual`` the rows become ``x + down - bit * (up + down)`` in place; the addends as in
    :func:`int8_encode`.
    """
    (wb, ub, db), t = _encode_rows(lambda x, count: _sign_rows(x, two_level, count, residual), body, tail,
                                   residual, add_body, add_tail)
    if t is None:
        return wb, None, ub, db
    return wb, t[0], torch.cat([ub, t[1]]), torch.cat([db, t[2]])


def sign_decode(body: torch.Tensor, tail: torch.Tensor | None, span: torch.Tensor, low: torch.Tensor,
                out_body: torch.Tensor, out_tail: torch.Tensor | None, add: bool) -> None:
    """``out`` ``=`` (or ``+=``) ``low + bit * span`` per row, for the sign bits packed in the bytes
    of ``body`` and the flat partial ``tail`` (``span`` and ``low`` columns, one per row)."""
    full, width = body.shape[0], out_body.shape[1]
    vt = None if tail is None else _sign_values(pad_row(tail, body.shape[1]), span[full:], low[full:], width)
    _store(out_body, out_tail, _sign_values(body, span[:full], low[:full], width), vt, 1.0, add)


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
    return sorted({key[0].__name__ for key, compiled in _compiled.items() if compiled is None})


_enabled: bool | None = None


def _compiling() -> bool:
    """PHALANX_COMPILE_CODECS, read once (the setting init() checked; before init, the environment)."""
    global _enabled
    if _enabled is None:
        _enabled = current_settings().comm.compile_codecs
    return _enabled


def _compile_for(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and _compiling()


def run(fn: Callable, tensor: torch.Tensor, *args):
    """``fn(tensor, *args)``, compiled when ``tensor`` is on CUDA.

    Compiled with dynamic shapes, but the width of every 2-D tensor argument (a chunk, its bytes,
    its words) is marked static: it is fixed per codec, and a symbolic width turns each element's
    index into 64-bit divisions (compiled on the CPU, the int8 compress of a flat, padded input
    ran 56x slower than of a 2-D view with the width known). The number of rows varies freely.
    Each combination of the flags (bool arguments, and which optional tensors are None) compiles
    a copy of its own, so that the few specialisations of one (empty or single rows, bit widths)
    never meet torch.compile's limit of 8 recompilations a function."""
    if not _compile_for(tensor):
        return fn(tensor, *args)
    for t in (tensor, *args):
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            torch._dynamo.mark_static(t, 1)
    # the flags, and for each tensor argument whether it is None (a tail, an addend)
    key = (fn, tuple(a if isinstance(a, bool) else a is None for a in args
                     if a is None or isinstance(a, (bool, torch.Tensor))))
    compiled = _compiled.get(key, fn)
    if compiled is fn:
        with _lock:
            if key not in _compiled:
                # a fresh code object: torch.compile caches (and counts recompilations) per code object
                copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
                _compiled[key] = torch.compile(copy, dynamic=True)
            compiled = _compiled[key]
    if compiled is None:
        return fn(tensor, *args)
    try:
        return compiled(tensor, *args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager function is correct
        _log.warning("fused codec kernel %s could not be compiled (%s: %s); running it eagerly",
                     fn.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        _compiled[key] = None
        return fn(tensor, *args)

"""Fused GPU kernels for the codecs' hot loops: one pass where eager torch makes five.

On a GPU a codec is memory-bound, and eager torch runs each operation as its own kernel
that reads and writes the whole gradient: sign's compress took 16x, int4's 10x the time of a
plain device copy of the gradient on an H100 (benchmarks/gpu/codecs.py). The functions here are written once in plain torch and, for CUDA
tensors, compiled by ``torch.compile`` (TorchInductor generates one Triton kernel per
function: a per-chunk reduction and the element-wise tail fused) the first time they run,
with dynamic shapes so that every bucket size shares the one compilation. On the CPU they
run eagerly: the codecs' CPU paths are tuned for it, and compiling there costs tens of
seconds at start-up for nothing. If compiling fails (no Triton, an unsupported torch), the
eager function is used from then on, after one warning. ``PHALANX_COMPILE_CODECS=0`` keeps
them eager on CUDA too (the first compilation in a process takes seconds a kernel; later
processes read TorchInductor's on-disk cache).

Example::

    from phalanx.comm.compression import kernels
    packed, amax = kernels.run(kernels.packed_rows, rows, 7, 4, rows.numel())   # compiled on CUDA
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from phalanx.log import get_logger
from phalanx.runtime import current_settings

__all__ = ["run", "packed_rows", "unpacked_rows", "unpack_inputs", "sign_rows", "sign_decode_into"]

_log = get_logger(__name__)
_lock = threading.Lock()
_compiled: dict[Callable, Callable | None] = {}  # None: compiling failed, run eagerly


def packed_rows(rows: torch.Tensor, levels: int, bits: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4- or 2-bit codes of ``rows`` packed ``8 // bits`` to a byte, low bits first, and each
    row's ``max |x|``: ``code = clamp(round(x * L / amax), -L, L) + L``; codes past the first
    ``count`` values (the last row's padding) are packed as 0, as ``quantize.pack_bits`` does."""
    amax = rows.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    codes = (rows * inv).round().clamp(-levels, levels).add(levels)
    index = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    codes = torch.where(index < count, codes, torch.zeros_like(codes)).to(torch.uint8)
    per_byte = 8 // bits
    slots = codes.view(rows.shape[0], -1, per_byte)
    out = slots[..., 0]
    for i in range(1, per_byte):
        out = out | (slots[..., i] << (i * bits))
    return out, amax


def unpacked_rows(packed: torch.Tensor, scales: torch.Tensor, levels: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`packed_rows`: ``(code - L) * scale`` per value, rows of fp32."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (codes.reshape(packed.shape[0], -1).float() - levels) * scales


def unpack_inputs(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of :func:`unpacked_rows` as tensors of their own (copies of a few bytes a chunk).

    On an H100 the compile of the decode failed twice ("RuntimeError when making fake tensor
    call") and it ran eagerly; the CPU compiles it. The likeliest suspect, not yet confirmed on a
    GPU, is that the payload's scales are a float32 view of uint8 bytes."""
    return packed.contiguous(), scales.clone()


def sign_rows(rows: torch.Tensor, two_level: bool, residual: bool):
    """1-bit codes of whole chunks (``rows``, chunk a multiple of 32): ``(words, up, down)``.

    Bit i of a chunk is 1 where x_i's sign bit is clear ("up"), packed 32 to an int32 word, low
    bit first; ``up`` / ``down`` are the chunk's two magnitudes (one, the mean |x|, without
    ``two_level``), as :class:`phalanx.comm.compression.onebit.SignCompressor` computes them. With
    ``residual``, ``rows`` becomes ``x + down - bit * (up + down)`` in place.
    """
    chunk = rows.shape[1]
    u = (rows.view(torch.int32) >> 31) + 1
    uf = u.float()
    total = rows.sum(1)
    l1 = rows.abs().sum(1)
    if two_level:
        npos = uf.sum(1)
        up = (total + l1) * 0.5 / npos.clamp(min=1)
        down = (l1 - total) * 0.5 / (chunk - npos).clamp(min=1)
    else:
        up = down = l1 / chunk
    shifts = torch.arange(32, device=rows.device, dtype=torch.int32)
    words = (u.view(rows.shape[0], -1, 32) << shifts).sum(-1, dtype=torch.int32)
    if residual:
        rows.add_(down.view(-1, 1)).addcmul_(uf, (up + down).view(-1, 1), value=-1.0)
    return words, up, down


def sign_decode_into(out: torch.Tensor, words: torch.Tensor, span: torch.Tensor, low: torch.Tensor,
                     add: bool) -> torch.Tensor:
    """``out`` (rows of a chunk) ``=`` or ``+=`` ``low + bit * span`` for the bits in ``words``."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(out.shape).float()
    values = bits * span + low
    return out.add_(values) if add else out.copy_(values)


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

"""Gradient codecs by name: the registry, and the casts (none, fp16, bf16) that a plain allreduce can sum.

Horovod's 74-line interface, kept: ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor``. ``summable`` says whether payloads of
different ranks may be summed directly by an allreduce (fp16/bf16: yes; int8
with per-rank scales, top-k, packed signs: no — those need a two-phase or
allgather collective: :func:`phalanx.comm.compression.allreduce.allreduce_compressed`).
Users pass a name (``compression="fp16"``, ``get_compressor("topk", ratio=0.01)``) or an object.

That is all a compressor must have; the optional abilities the collectives use
(fused error feedback, fused decode, chunked pieces, own collective, warm-up, state) are
in :mod:`phalanx.comm.compression.abilities`.

Registered names and where they live::

    none fp16 bf16          here                summable, lossless-ish
    int8 int4 2bit          comm/compression/quantize.py    per-chunk scale, packed, optional stochastic rounding
    topk threshold          comm/compression/sparsify.py    (int32 index, fp32 value) pairs; top-k keeps 5%
    sign                    comm/compression/onebit.py      1 bit per value, packed 8 per byte, two values per 32
    powersgd                comm/compression/powersgd.py    rank-r factors, warm start (Vogels et al. 2019)

Lossy names come wrapped in :class:`~phalanx.comm.compression.error_feedback.ErrorFeedback`
(residual memory on by default, ``error_feedback=False`` to switch it off,
``warmup_steps=N`` for N uncompressed steps first).

Example::

    from phalanx.comm.compression.codecs import get_compressor
    c = get_compressor("fp16")
    payload, ctx = c.compress(grad)
    grad_again = c.decompress(payload, ctx)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.comm.compression.abilities import Compressor

__all__ = [
    "Compressor",
    "NoneCompressor",
    "CastCompressor",
    "register_compressor",
    "get_compressor",
    "available_compressors",
]


class NoneCompressor:
    """No compression: the payload is the tensor itself."""

    name = "none"
    summable = True

    def compress(self, tensor: torch.Tensor):
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        return payload


class CastCompressor:
    """Send floating-point tensors as ``dtype`` (fp16 or bf16); halves the bytes of fp32."""

    summable = True

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype = dtype
        self.name = name

    def compress(self, tensor: torch.Tensor):
        if not tensor.is_floating_point() or tensor.dtype == self.dtype:
            return tensor, None
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        return payload if ctx is None else payload.to(ctx)


def _lossy(make: Callable[..., Any], ef_default: bool) -> Callable[..., Any]:
    """A factory that wraps the lossy compressor in error feedback + warm-up (imports lazily)."""

    def factory(*, error_feedback: bool = ef_default, warmup_steps: int = 0, **kwargs):
        from phalanx.comm.compression.error_feedback import ErrorFeedback

        return ErrorFeedback(make(**kwargs), enabled=error_feedback, warmup_steps=warmup_steps)

    return factory


def _int8(**kw):
    from phalanx.comm.compression.quantize import QuantizeCompressor

    return QuantizeCompressor(bits=8, **kw)


def _int4(**kw):
    from phalanx.comm.compression.quantize import QuantizeCompressor

    return QuantizeCompressor(bits=4, **kw)


def _2bit(**kw):
    from phalanx.comm.compression.quantize import QuantizeCompressor

    return QuantizeCompressor(bits=2, **kw)


TOPK_RATIO = 0.05
"""The registry's top-k ratio: 5% of the entries (10x fewer bytes than fp32, with int32 indices). At
0.02 (25x) top-k + error feedback at a constant learning rate ended up to 2.4 points below
uncompressed on digits (mean of the last 3 epochs); at 0.05 within 0.6 (docs/compression.md)."""


def _topk(**kw):
    from phalanx.comm.compression.sparsify import TopKCompressor

    kw.setdefault("ratio", TOPK_RATIO)
    return TopKCompressor(**kw)


def _threshold(**kw):
    from phalanx.comm.compression.sparsify import ThresholdCompressor

    return ThresholdCompressor(**kw)


SIGN_CHUNK = 32
"""The registry's sign chunk: two reconstruction values per 32 entries (3 bits a value, 10.7x fewer
bytes than fp32). At 256 (1.25 bits, 25.6x) sign + error feedback at a constant learning rate ended
4.5-20.6 points below uncompressed on digits; at 32 within 1 point (docs/compression.md)."""


def _sign(**kw):
    from phalanx.comm.compression.onebit import SignCompressor

    kw.setdefault("chunk", SIGN_CHUNK)
    return SignCompressor(**kw)


def _powersgd(**kw):
    from phalanx.comm.compression.powersgd import PowerSGDCompressor

    return PowerSGDCompressor(**kw)


# Error feedback is on by default for every lossy compressor: the literature needs it for
# sign, top-k, threshold and PowerSGD, and for int8/int4 it costs one buffer and never hurts.
_REGISTRY: dict[str, Callable[..., Compressor]] = {
    "none": NoneCompressor,
    "fp16": lambda: CastCompressor(torch.float16, "fp16"),
    "bf16": lambda: CastCompressor(torch.bfloat16, "bf16"),
    "int8": _lossy(_int8, True),
    "int4": _lossy(_int4, True),
    "2bit": _lossy(_2bit, True),
    "topk": _lossy(_topk, True),
    "threshold": _lossy(_threshold, True),
    "sign": _lossy(_sign, True),
    "powersgd": _powersgd,  # keeps its own residuals (they live in its matrix shape)
}


def register_compressor(name: str, factory: Callable[..., Compressor]) -> None:
    """Make ``factory(**kwargs)`` available as ``compression=name``."""
    _REGISTRY[name] = factory


def available_compressors() -> list[str]:
    return sorted(_REGISTRY)


def get_compressor(spec: str | Compressor | None, **kwargs) -> Compressor:
    """A compressor from a name (``"fp16"``), an object (returned as is) or None (no compression)."""
    if spec is None:
        return NoneCompressor()
    if isinstance(spec, str):
        if spec not in _REGISTRY:
            raise ValueError(
                f"unknown compression {spec!r}; choose one of {available_compressors()} or pass a Compressor"
            )
        try:
            return _REGISTRY[spec](**kwargs)
        except TypeError as err:
            raise TypeError(f"compression {spec!r}: bad option ({err})") from None
    if not isinstance(spec, Compressor):
        raise TypeError(f"compression must be a name or a Compressor, got {type(spec).__name__}")
    return spec

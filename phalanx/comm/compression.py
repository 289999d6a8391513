"""Gradient compression: the ``Compressor`` protocol, a registry by name, and the lossless-ish casts.

Horovod's 74-line interface, kept: ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor``. ``summable`` says whether payloads of
different ranks may be summed directly by an allreduce (fp16/bf16: yes; int8
with per-rank scales, top-k, packed signs: no — those need a two-phase or
allgather collective, see the Compression issue). Users pass a name
(``compression="fp16"``) or an object.

Example::

    from phalanx.comm.compression import get_compressor
    c = get_compressor("fp16")
    payload, ctx = c.compress(grad)
    grad_again = c.decompress(payload, ctx)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "Compressor",
    "NoneCompressor",
    "CastCompressor",
    "register_compressor",
    "get_compressor",
    "available_compressors",
]


@runtime_checkable
class Compressor(Protocol):
    """What a gradient compressor provides."""

    name: str
    summable: bool  # payloads from different ranks can be summed by a plain allreduce

    def compress(self, tensor: torch.Tensor) -> tuple[Any, Any]: ...

    def decompress(self, payload: Any, ctx: Any) -> torch.Tensor: ...


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


_REGISTRY: dict[str, Callable[..., Compressor]] = {
    "none": NoneCompressor,
    "fp16": lambda: CastCompressor(torch.float16, "fp16"),
    "bf16": lambda: CastCompressor(torch.bfloat16, "bf16"),
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
        try:
            return _REGISTRY[spec](**kwargs)
        except KeyError:
            raise ValueError(
                f"unknown compression {spec!r}; choose one of {available_compressors()} or pass a Compressor"
            ) from None
    if not isinstance(spec, Compressor):
        raise TypeError(f"compression must be a name or a Compressor, got {type(spec).__name__}")
    return spec

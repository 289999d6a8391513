"""The compressor interface: the ``Compressor`` protocol and the optional abilities the collectives use.

A compressor needs only ``name``, ``summable``, ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx)`` (Horovod's interface). What the collectives use beyond that
is written down here as small abilities, each an ABC checked with ``isinstance`` (a class
that defines the methods counts, as with ``collections.abc``, and the answer is cached per
class; the data-only :class:`ChunkedCodec` is inherited explicitly)::

    Warmup            tick(name) -> bool            first calls per name go uncompressed
    CollectiveCodec   reduce / reduce_many          reduces by itself (PowerSGD's two allreduces)
    ChunkedCodec      chunk: int                    payload laid out per chunk: compress in pieces
    FixedSizePayload  payload_nbytes(numel)         sizes known without asking the other ranks
    FusedResidual     compress_ef(x)                compress and leave the residual in x
    AddendResidual    takes_addend / compress_ef_add compress_ef(x + g), the add inside the compress
    FusedDecode       decompress_add(p, ctx, out)   out (+)= alpha * decompress(p)
    ResidualFeedback  inner, enabled, accumulate    error feedback around a codec
    Stateful          state_dict / load_state_dict  residuals, warm starts, counts
    Resettable        reset_state()                 forget residuals (after a non-finite step)

Example::

    from phalanx.comm.compression.abilities import FusedDecode, codec_of
    feedback, codec = codec_of(get_compressor("int8"))    # ErrorFeedback, QuantizeCompressor
    isinstance(codec, FusedDecode)                        # True: decoded straight into the sum
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "Compressor",
    "Warmup",
    "CollectiveCodec",
    "ChunkedCodec",
    "FixedSizePayload",
    "FusedResidual",
    "AddendResidual",
    "FusedDecode",
    "ResidualFeedback",
    "Stateful",
    "Resettable",
    "codec_of",
]


@runtime_checkable
class Compressor(Protocol):
    """What a gradient compressor provides (all a user's compressor needs)."""

    name: str
    summable: bool  # payloads from different ranks can be summed by a plain allreduce

    def compress(self, tensor: torch.Tensor) -> tuple[Any, Any]: ...

    def decompress(self, payload: Any, ctx: Any) -> torch.Tensor: ...


class _Ability(abc.ABC):  # noqa: B024 (abilities add the abstract methods)
    """An optional ability: a class has it when it defines every method in ``_methods``
    (checked once per class and cached by ``abc``) or inherits the ABC explicitly."""

    _methods: tuple[str, ...] = ()

    @classmethod
    def __subclasshook__(cls, sub):
        if not cls._methods or cls.__dict__.get("_methods") is None:
            return NotImplemented
        if all(callable(getattr(sub, m, None)) for m in cls._methods):
            return True
        return NotImplemented


class Warmup(_Ability):
    """Counts calls per tensor name; ``tick(name)`` is True while that name still goes uncompressed."""

    _methods = ("tick",)

    @abc.abstractmethod
    def tick(self, name: str) -> bool: ...


class CollectiveCodec(_Ability):
    """Reduces by itself instead of handing payloads to a generic collective (PowerSGD).

    ``reduce(tensor, group=, name=) -> (average, bytes_sent)``; ``reduce_many(tensors, group=,
    name=, outs=) -> (averages, bytes_sent)`` treats each tensor as its own matrix.
    """

    _methods = ("reduce", "reduce_many")

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, *, group=None, name: str = "default") -> tuple[torch.Tensor, int]: ...

    @abc.abstractmethod
    def reduce_many(self, tensors: Sequence[torch.Tensor], *, group=None, name: str = "default",
                    outs: Sequence[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], int]: ...


class ChunkedCodec(abc.ABC):
    """The payload is laid out per ``chunk`` values (one scale per chunk): compressing a tensor
    in pieces of whole chunks gives the same bits as compressing it at once (inherit explicitly)."""

    chunk: int


class FixedSizePayload(_Ability):
    """``payload_nbytes(numel)``: the payload's size from the number of values alone, so every
    rank knows every other's without exchanging sizes."""

    _methods = ("payload_nbytes",)

    @abc.abstractmethod
    def payload_nbytes(self, numel: int) -> int: ...


class FusedResidual(_Ability):
    """``compress_ef(x)``: compress the flat fp32 ``x`` and leave ``x - decompress(payload)`` in it."""

    _methods = ("compress_ef",)

    @abc.abstractmethod
    def compress_ef(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]: ...


class AddendResidual(FusedResidual):
    """``compress_ef_add(x, g)``: :meth:`FusedResidual.compress_ef` of ``x + g``, leaving the new
    residual in ``x``, with the add formed inside the compress where ``takes_addend(x)`` says so
    (the compiled kernels, on CUDA: error feedback's ``res += g`` then needs no pass of its own);
    elsewhere it adds first (the same bits). Error feedback hands its gradient to such a codec
    instead of adding it into the residual itself (:func:`~phalanx.comm.compression.error_feedback.compress_residual`).
    A codec gives ``takes_addend`` and ``encode_ef_add`` (the fused encode); the rest is here."""

    _methods = ("compress_ef", "takes_addend", "encode_ef_add")

    @abc.abstractmethod
    def takes_addend(self, x: torch.Tensor) -> bool: ...

    @abc.abstractmethod
    def encode_ef_add(self, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        """The payload of ``x + addend`` with the new residual left in ``x``; called where ``takes_addend(x)``."""

    def compress_ef_add(self, x: torch.Tensor, addend: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """:meth:`compress_ef` of ``x + addend`` (flat, fp32 ``x``): where the codec fuses it, ``x`` is
        read once and written once, with the new residual; elsewhere the add is its own pass."""
        if not self.takes_addend(x):
            x.add_(addend)
            return self.compress_ef(x)
        return self.encode_ef_add(x, addend), (x.numel(), x.dtype, tuple(x.shape))


class FusedDecode(_Ability):
    """``decompress_add(payload, ctx, out, alpha, add=True)``: ``out += alpha * decompress(payload)``
    (``add=False``: ``out = ...``), ``out`` flat fp32, without a full-size temporary."""

    _methods = ("decompress_add",)

    @abc.abstractmethod
    def decompress_add(self, payload: torch.Tensor, ctx, out: torch.Tensor, alpha: float = 1.0,
                       add: bool = True) -> torch.Tensor: ...


class ResidualFeedback(_Ability):
    """Error feedback around a codec: ``inner`` is the codec, ``enabled`` whether residuals are
    kept; ``accumulate(key, t)`` returns the residual buffer with ``t`` added (the corrected
    tensor, compressed in place), ``accumulate_parts(key, parts, numel)`` the same piece by piece,
    ``prepare(key, t)`` the buffer and whether ``t`` is still to be added (by an
    :class:`AddendResidual` codec, inside its compress)."""

    _methods = ("accumulate", "accumulate_parts", "prepare")
    inner: Any
    enabled: bool

    @abc.abstractmethod
    def accumulate(self, key: str, tensor: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def accumulate_parts(self, key: str, parts, numel: int): ...

    @abc.abstractmethod
    def prepare(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]: ...


class Stateful(_Ability):
    """Keeps state across steps that a checkpoint must carry (residuals, warm starts, counts)."""

    _methods = ("state_dict", "load_state_dict")

    @abc.abstractmethod
    def state_dict(self) -> dict: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


class Resettable(_Ability):
    """``reset_state()`` forgets residuals and warm starts (they came from a non-finite step)."""

    _methods = ("reset_state",)

    @abc.abstractmethod
    def reset_state(self) -> None: ...


def codec_of(compressor) -> tuple[ResidualFeedback | None, Any]:
    """``(feedback, codec)``: the error-feedback wrapper when one is on (else None) and the codec
    that makes the payloads (the wrapper's ``inner``, or the compressor itself)."""
    if isinstance(compressor, ResidualFeedback):
        return (compressor if compressor.enabled else None), compressor.inner
    return None, compressor

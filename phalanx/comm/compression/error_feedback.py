"""Error feedback (residual memory) for lossy compressors, and the warm-up switch.

A lossy compressor ``C`` drops part of every gradient. Error feedback keeps what
was dropped and adds it to the next gradient before compressing, so nothing is
lost, only delayed (Seide et al. 2014, "1-bit SGD"; Stich et al. 2018;
Karimireddy et al. 2019, "EF-SignSGD")::

    corrected_t = grad_t + residual_{t-1}
    sent_t      = C(corrected_t)
    residual_t  = corrected_t - sent_t          =>  sum_t sent_t = sum_t grad_t - residual_T

The sum of what was sent over T steps differs from the sum of the true gradients
by one bounded residual, which is why sign and top-k converge with it and
diverge (or stall) without. Residuals are kept per tensor ``name`` (per bucket in
the data-parallel engine) and are part of ``state_dict()``.

Example::

    from phalanx.comm.compression.error_feedback import ErrorFeedback
    from phalanx.comm.compression.onebit import SignCompressor
    c = ErrorFeedback(SignCompressor(), warmup_steps=10)
    payload, ctx = c.compress(grad, name="bucket0")
    approx = c.decompress(payload, ctx)
    sd = c.state_dict()            # {"residuals": {"bucket0": ...}, "steps": {...}}
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.comm.compression.abilities import (
    AddendResidual,
    FusedResidual,
    Resettable,
    ResidualFeedback,
    Stateful,
    Warmup,
)

__all__ = ["ResidualMemory", "ErrorFeedback", "compress_residual", "takes_addend"]


def compress_residual(inner: Any, x: torch.Tensor, addend: torch.Tensor | None = None):
    """Compress the flat fp32 ``x`` (``x + addend``) with ``inner`` and leave the residual
    ``x - decompress(payload)`` in ``x``.

    With an ``addend`` (error feedback's gradient, not yet in the residual ``x``) a codec that is an
    :class:`~phalanx.comm.compression.abilities.AddendResidual` adds it inside its compress (one
    pass on CUDA); for any other the add comes first, as its own pass. Uses the codec's fused
    ``compress_ef`` when it is a :class:`~phalanx.comm.compression.abilities.FusedResidual` (int8,
    sign, top-k: no decompress, no temporaries), else compresses, decompresses and subtracts.
    """
    if addend is not None:
        if isinstance(inner, AddendResidual):
            return inner.compress_ef_add(x, addend)
        x.add_(addend.reshape(x.shape))
    if isinstance(inner, FusedResidual):
        return inner.compress_ef(x)
    payload, ctx = inner.compress(x)
    x.sub_(inner.decompress(payload, ctx).reshape(x.shape).to(x.dtype))
    return payload, ctx


def takes_addend(inner: Any, tensor: torch.Tensor) -> bool:
    """Whether ``inner`` adds error feedback's gradient inside its compress for ``tensor``: then the
    caller keeps the residual buffer as it is (:meth:`ErrorFeedback.prepare`) and hands the gradient
    to :func:`compress_residual` as the addend; else it accumulates first (:meth:`ErrorFeedback.accumulate`)."""
    return isinstance(inner, AddendResidual) and inner.takes_addend(tensor)


def _plain_ctx(ctx) -> bool:
    """True for the usual ``(numel, dtype, shape)`` context, which records the caller's dtype and shape."""
    return isinstance(ctx, tuple) and len(ctx) == 3 and isinstance(ctx[1], torch.dtype)


class ResidualMemory:
    """Residual tensors keyed by name, with ``state_dict`` / ``load_state_dict``."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def correct(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor + residual[key]`` (a new tensor; ``tensor`` is not modified)."""
        res = self.residuals.get(key)
        if res is None or res.shape != tensor.shape:
            return tensor.clone()
        return tensor + res.to(tensor.dtype)

    def accumulate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The fp32 residual buffer of ``key`` with ``tensor`` added in place (fused error feedback:
        the caller compresses it and leaves what was not sent in the same buffer). A missing (or
        differently shaped) residual starts as a copy of ``tensor`` in fp32."""
        res, pending = self.prepare(key, tensor)
        if pending:
            res.add_(tensor.detach())
        return res

    def prepare(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(buffer, pending)``: the fp32 residual buffer of ``key``, and whether ``tensor`` is still
        to be added to it (False when the buffer was just made as a copy of ``tensor``)."""
        res = self.residuals.get(key)
        if res is None or res.shape != tensor.shape or res.dtype != torch.float32 or res.device != tensor.device:
            res = self.residuals[key] = tensor.detach().float().clone(memory_format=torch.contiguous_format)
            return res, False
        return res, True

    def update(self, key: str, corrected: torch.Tensor, approx: torch.Tensor) -> None:
        """Remember what compression dropped: ``corrected - approx``."""
        self.residuals[key] = (corrected - approx).detach()

    def clear(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}


class ErrorFeedback(Warmup, ResidualFeedback, Stateful, Resettable):
    """Wrap a lossy compressor with residual memory and an uncompressed warm-up.

    ``enabled=False`` keeps only the warm-up switch. ``warmup_steps=N``: the first N
    calls for each name go uncompressed (``allreduce_compressed`` calls :meth:`tick`),
    like PowerSGD's ``start_powerSGD_iter``. Other attributes are read from the inner
    compressor (``get_compressor("topk").ratio``); the collectives themselves ask the
    inner codec for its abilities (``phalanx.comm.compression.codecs.codec_of``).
    """

    def __init__(self, inner: Any, *, enabled: bool = True, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.inner = inner
        self.enabled = bool(enabled)
        self.warmup_steps = int(warmup_steps)
        self.memory = ResidualMemory()
        self.steps: dict[str, int] = {}

    def __getattr__(self, attr: str):  # the inner codec's settings (ratio, bits, chunk ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def summable(self) -> bool:
        return self.inner.summable

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r}, enabled={self.enabled}, warmup_steps={self.warmup_steps})"

    def tick(self, name: str) -> bool:
        """Count one call for ``name``; True while that name is still warming up."""
        n = self.steps.get(name, 0)
        self.steps[name] = n + 1
        return n < self.warmup_steps

    def in_warmup(self, name: str) -> bool:
        return self.steps.get(name, 0) < self.warmup_steps

    def correct(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.memory.correct(key, tensor) if self.enabled else tensor

    def update(self, key: str, corrected: torch.Tensor, approx: torch.Tensor) -> None:
        if self.enabled:
            self.memory.update(key, corrected, approx)

    def accumulate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The residual buffer of ``key`` with ``tensor`` added in place: the corrected tensor.

        Fused error feedback: compress it with :func:`compress_residual` (or slices of it),
        which leaves the new residual in the same buffer, so no step allocates a corrected
        copy or a residual (:meth:`ResidualMemory.accumulate`).
        """
        return self.memory.accumulate(key, tensor)

    def prepare(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(buffer, pending)``: the residual buffer of ``key`` and whether ``tensor`` is still to be
        added to it, for a codec that adds it inside its compress (:func:`takes_addend`)."""
        return self.memory.prepare(key, tensor)

    def accumulate_parts(self, key: str, parts, numel: int):
        """:meth:`accumulate` of the concatenation of ``parts`` (flattened), without building it,
        one piece at a time: returns ``(buffer, add)``; ``add(start, stop)`` adds the parts'
        values for elements ``[start, stop)`` into the residual buffer (one fused
        ``_foreach_add_``), so a caller compressing piece by piece adds each piece just before
        compressing it (every element exactly once)."""
        res = self.memory.residuals.get(key)
        flats = [t.reshape(-1) for t in parts]
        if res is None or res.shape != (numel,) or res.dtype != torch.float32 or res.device != parts[0].device:
            res = self.memory.residuals[key] = torch.cat([t.float() for t in flats])
            return res, lambda start, stop: None  # it already holds the parts
        offsets = [0]
        for t in flats:
            offsets.append(offsets[-1] + t.numel())

        def add(start: int, stop: int) -> None:
            dst, src = [], []
            for t, off, end in zip(flats, offsets, offsets[1:]):
                lo, hi = max(start, off), min(stop, end)
                if lo < hi:
                    dst.append(res[lo:hi])
                    src.append(t[lo - off : hi - off])
            if dst:
                torch._foreach_add_(dst, src)

        return res, add

    def compress(self, tensor: torch.Tensor, name: str = "default"):
        if not self.enabled:
            return self.inner.compress(tensor)
        if takes_addend(self.inner, tensor):  # res += g inside the compress (the compiled kernels)
            res, pending = self.prepare(name, tensor)
            payload, ctx = compress_residual(self.inner, res.view(-1),
                                             tensor.detach().reshape(-1) if pending else None)
        else:
            res = self.accumulate(name, tensor)
            payload, ctx = compress_residual(self.inner, res.view(-1) if isinstance(self.inner, FusedResidual) else res)
        return payload, ((ctx[0], tensor.dtype, tuple(tensor.shape)) if _plain_ctx(ctx) else ctx)

    def decompress(self, payload, ctx) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"residuals": self.memory.state_dict(), "steps": dict(self.steps)}
        if isinstance(self.inner, Stateful):
            out["inner"] = self.inner.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state.get("residuals", {}))
        self.steps = dict(state.get("steps", {}))
        if "inner" in state and isinstance(self.inner, Stateful):
            self.inner.load_state_dict(state["inner"])

    def reset_state(self) -> None:
        """Forget every residual (and the inner codec's state, when it keeps any)."""
        self.memory.clear()
        if isinstance(self.inner, Resettable):
            self.inner.reset_state()

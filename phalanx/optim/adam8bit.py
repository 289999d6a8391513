"""Adam / AdamW with 8-bit block-wise quantized moments (Dettmers, Lewis, Shleifer, Zettlemoyer,
"8-bit Optimizers via Block-wise Quantization", ICLR 2022, arXiv:2110.02861).

Adam keeps two fp32 moments, 8 bytes a parameter: the largest block of training
memory. Here each moment is one byte a parameter (plus 4 bytes per 2,048 for the
block scale, :mod:`phalanx.optim.quantize`); the step dequantizes, updates in
fp32 and quantizes back into the same bytes, :data:`SLICE` elements at a time, so
only one slice's fp32 moments exist at a time::

    m8, v8 ─ dequantize ─► m, v ─ m = β1·m + (1-β1)·g ; v = β2·v + (1-β2)·g² ─► p -= lr·m̂/(√v̂ + ε)
                                └──────────────────── quantize ◄───────────────┘

Memory: the state is allocated once, at a parameter's first step, before any
scratch buffer; the step then takes one set of scratch buffers (~26 bytes x SLICE)
and writes the moments back in place. An earlier version allocated fresh bytes and
fp32 moments per parameter each step; on the CPU glibc's heap kept the holes
between the short-lived fp32 moments and the long-lived bytes, and a 4-rank ZeRO-3
run's resident set grew by ~250 MiB in the first step, more than the 6 bytes a
parameter the state saves (benchmarks/LOG.md, big-model-cpu-run3).

What this file adds: the step clamps m̂/√v̂ to the most exact Adam can reach
(:func:`_ratio_bound`), against a second moment that underflowed to code 0 in a
block whose scale another parameter sets (ZeRO's flat shards).

What the paper adds and this file does not: its "stable embedding" layer
(layer norm after the embedding, for NLP models trained from scratch at large
scale), and keeping 32-bit state for tensors under 4,096 elements.

Checkpoints: ``state_dict()`` holds the bytes and scales themselves (the same
layout reloads them exactly); :meth:`Adam8bit.full_precision_state` gives the
moments as fp32 tensors shaped like the parameter, which is what ZeRO's sharded
checkpoint cuts and reassembles at another world size (they are quantized again
on load).

Example::

    opt = Adam8bit(model.parameters(), lr=1e-3)            # or: Adam8bit.like(torch.optim.AdamW(...))
    opt = px.zero(model, torch.optim.AdamW(model.parameters()), stage=3, state_bits=8)[1]
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from phalanx.optim.quantize import (
    BLOCK,
    CODE_SIGNED,
    CODE_UNSIGNED,
    Workspace,
    dequantize,
    dequantize_,
    padded,
    quantize,
    quantize_,
)

__all__ = ["Adam8bit", "STATE_BITS", "FullPrecisionState", "check_state_bits"]

STATE_BITS = (32, 8)  # what ``state_bits=`` accepts where an optimizer is wrapped
# The step updates a parameter this many elements at a time (a multiple of BLOCK): its fp32 moments and
# temporaries are then ~26 bytes x SLICE (26 MiB) whatever the size of the parameter. ZeRO's inner
# parameters are chunks of this size already (phalanx.parallel.zero.shard.CHUNK_NUMEL).
SLICE = 1 << 20


@runtime_checkable
class FullPrecisionState(Protocol):
    """An optimizer whose stored state is not elementwise fp32 but can be read and written as such
    (what a resharding checkpoint needs: state it can cut at any element)."""

    def full_precision_state(self, p: torch.Tensor) -> dict: ...

    def load_full_precision_state(self, p: torch.Tensor, state: dict) -> None: ...


def check_state_bits(where: str, state_bits, optimizer) -> None:
    """One line for a bad ``state_bits=`` (or an optimizer 8 bits cannot hold) before anything is built."""
    if state_bits not in STATE_BITS:
        raise ValueError(f"{where}(state_bits={state_bits!r}): use 32 (fp32 state) or 8 (8-bit Adam moments)")
    if state_bits == 8 and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"{where}(state_bits=8) quantizes Adam's moments; got {type(optimizer).__name__}, "
                         "pass torch.optim.Adam or torch.optim.AdamW (or leave state_bits=32)")
    if state_bits == 8 and optimizer.state:
        raise ValueError(f"{where}(state_bits=8): the optimizer has already stepped; wrap it before the first step")


class Adam8bit(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW with 8-bit moments.

    Example::

        opt = Adam8bit(model.parameters(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Adam8bit: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0 "
                             f"and betas={betas} in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay))

    @classmethod
    def like(cls, optimizer: torch.optim.Optimizer, params=None) -> Adam8bit:
        """The 8-bit twin of a ``torch.optim.Adam`` / ``AdamW``: same hyperparameters per group,
        over ``params`` (a list of param groups' params, one per group; default: the same ones)."""
        check_state_bits("Adam8bit.like", 8, optimizer)
        groups = []
        for i, pg in enumerate(optimizer.param_groups):
            if pg.get("amsgrad") or pg.get("maximize"):
                raise ValueError("state_bits=8: amsgrad and maximize are not supported; turn them off")
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(pg.get("decoupled_weight_decay"))
            groups.append({"params": pg["params"] if params is None else params[i], "lr": pg["lr"],
                           "betas": pg["betas"], "eps": pg["eps"], "weight_decay": pg["weight_decay"],
                           "decoupled_weight_decay": decoupled})
        return cls(groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not todo:
            return loss
        for _, p in todo:  # new state first, so no scratch buffer sits between the long-lived bytes
            if "exp_avg_q" not in self.state[p]:
                self._allocate(self.state[p], p)
        # one set of scratch buffers for the whole step, at most SLICE elements: see the module docstring
        largest = min(SLICE, padded(max(p.numel() for _, p in todo)))
        by_device: dict = {}
        for group, p in todo:
            if p.device not in by_device:
                by_device[p.device] = (Workspace(largest, p.device),
                                       torch.empty(2, largest, dtype=torch.float32, device=p.device))
            self._step_one(group, p, *by_device[p.device])
        return loss

    def _step_one(self, group: dict, p: torch.Tensor, ws: Workspace, mv: torch.Tensor) -> None:
        """Adam's update of ``p``, slice by slice: dequantize a slice of each moment into ``mv``, update,
        quantize back into the same bytes."""
        beta1, beta2 = group["betas"]
        st = self.state[p]
        first = not st["step"]
        st["step"] += 1
        t = float(st["step"])
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if wd and group["decoupled_weight_decay"]:
            p.mul_(1 - lr * wd)
        p_flat, g_flat = _flat(p), _flat(p.grad)
        bc2_sqrt, step_size = (1 - beta2**t) ** 0.5, -lr / (1 - beta1**t)
        limit = _ratio_bound(beta1, beta2, t)
        for lo in range(0, p.numel(), SLICE):
            n = min(SLICE, p.numel() - lo)
            span, blocks = slice(lo, lo + padded(n)), slice(lo // BLOCK, (lo + padded(n)) // BLOCK)
            m, v = mv[0, : padded(n)], mv[1, : padded(n)]
            if first:
                mv.zero_()
            else:
                dequantize_(st["exp_avg_q"][span], st["exp_avg_absmax"][blocks], CODE_SIGNED, m, ws)
                dequantize_(st["exp_avg_sq_q"][span], st["exp_avg_sq_absmax"][blocks], CODE_UNSIGNED, v, ws)
            g, ps = g_flat[lo : lo + n].float(), p_flat[lo : lo + n]
            if wd and not group["decoupled_weight_decay"]:
                g = g.add(ps.float(), alpha=wd)
            m[:n].mul_(beta1).add_(g, alpha=1 - beta1)
            v[:n].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m[n:].zero_()
            v[n:].zero_()
            # torch.optim.Adam's order of operations, so a run with no rounding matches it
            denom = (v[:n].sqrt() / bc2_sqrt).add_(eps)
            if limit is None:
                ps.addcdiv_(m[:n].to(p.dtype), denom.to(p.dtype), value=step_size)
            else:  # no element moves further than exact Adam can move one (see _ratio_bound)
                ratio = torch.div(m[:n], denom, out=denom).clamp_(-limit, limit)
                ps.add_(ratio.to(p.dtype), alpha=step_size)
            del denom, g
            quantize_(m, CODE_SIGNED, st["exp_avg_q"][span], st["exp_avg_absmax"][blocks], ws)
            quantize_(v, CODE_UNSIGNED, st["exp_avg_sq_q"][span], st["exp_avg_sq_absmax"][blocks], ws)
        if not p.is_contiguous():
            p.copy_(p_flat.view_as(p))

    @staticmethod
    def _allocate(st: dict, p: torch.Tensor) -> None:
        """The 8-bit state of ``p``, allocated once: later steps write into the same bytes."""
        n = padded(p.numel())
        st["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            st[key + "_q"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
            st[key + "_absmax"] = torch.zeros(n // BLOCK, dtype=torch.float32, device=p.device)

    @staticmethod
    def _moments(p: torch.Tensor, st: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = p.numel()
        return (dequantize(st["exp_avg_q"], st["exp_avg_absmax"], CODE_SIGNED, n),
                dequantize(st["exp_avg_sq_q"], st["exp_avg_sq_absmax"], CODE_UNSIGNED, n))

    @staticmethod
    def _store(st: dict, m: torch.Tensor, v: torch.Tensor) -> None:
        st["exp_avg_q"], st["exp_avg_absmax"] = quantize(m, CODE_SIGNED)
        st["exp_avg_sq_q"], st["exp_avg_sq_absmax"] = quantize(v, CODE_UNSIGNED)

    # -- fp32 views for checkpoints that reshard ----------------------------------------
    def full_precision_state(self, p: torch.Tensor) -> dict:
        """``{"step", "exp_avg", "exp_avg_sq"}`` of ``p`` in fp32, shaped like ``p`` (torch Adam's keys);
        ``{}`` before its first step."""
        st = self.state.get(p, {})
        if "exp_avg_q" not in st:
            return {}
        m, v = self._moments(p, st)
        return {"step": st["step"].clone(), "exp_avg": m.view_as(p), "exp_avg_sq": v.view_as(p)}

    def load_full_precision_state(self, p: torch.Tensor, state: dict) -> None:
        """Quantize fp32 moments (torch Adam's keys, any shape of ``p.numel()`` elements) into ``p``'s state."""
        st = self.state[p] = {"step": torch.as_tensor(state["step"], dtype=torch.float32).clone()}
        self._store(st, state["exp_avg"].float().reshape(-1), state["exp_avg_sq"].float().reshape(-1))


def _ratio_bound(beta1: float, beta2: float, t: float) -> float | None:
    """The most exact Adam's ``m_t / (sqrt(v_t) / sqrt(1 - β2^t))`` can be: the ratio the step multiplies
    by ``lr / (1 - β1^t)`` (``None``: no bound, when β1² >= β2).

    By Cauchy-Schwarz on m_t = (1-β1) Σ β1^k g_(t-k) against v_t = (1-β2) Σ β2^k g²_(t-k):
    |m_t| <= (1-β1) sqrt(Σ (β1²/β2)^k) sqrt(v_t / (1-β2)), the sum over k < t. A quantized
    second moment can underflow to 0 in a block whose scale another element sets (ZeRO's flat
    shards put several parameters in one block) while the signed first moment, scaled by its own
    block, does not: the update m/(0 + eps) would then be ~1e5 x lr. Clamping the ratio to what
    exact Adam can reach leaves every exact-Adam update as it is and bounds that one.
    """
    r = beta1 * beta1 / beta2
    if r >= 1:
        return None
    bound = (1 - beta1) * ((1 - r**t) / (1 - r) / (1 - beta2)) ** 0.5
    return bound * (1 - beta2**t) ** 0.5


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one flat tensor: a view when contiguous, else a copy (the step then copies ``p`` back)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()

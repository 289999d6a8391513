"""Adam / AdamW with 8-bit block-wise quantized moments (Dettmers, Lewis, Shleifer, Zettlemoyer,
"8-bit Optimizers via Block-wise Quantization", ICLR 2022, arXiv:2110.02861).

Adam keeps two fp32 moments, 8 bytes a parameter: the largest block of training
memory. Here each moment is one byte a parameter (plus 4 bytes per 2,048 for the
block scale, :mod:`phalanx.optim.quantize`); the step dequantizes, updates in
fp32 and quantizes back, per parameter, so only one parameter's fp32 moments
exist at a time::

    m8, v8 ─ dequantize ─► m, v ─ m = β1·m + (1-β1)·g ; v = β2·v + (1-β2)·g² ─► p -= lr·m̂/(√v̂ + ε)
                                └──────────────────── quantize ◄───────────────┘

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

from phalanx.optim.quantize import CODE_SIGNED, CODE_UNSIGNED, dequantize, quantize

__all__ = ["Adam8bit", "STATE_BITS", "FullPrecisionState", "check_state_bits"]

STATE_BITS = (32, 8)  # what ``state_bits=`` accepts where an optimizer is wrapped


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
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                m, v = self._moments(p, st)
                st["step"] = st.get("step", torch.zeros((), dtype=torch.float32)) + 1
                t = float(st["step"])
                if group["weight_decay"]:
                    if group["decoupled_weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    else:
                        g = g.add(p.detach().float(), alpha=group["weight_decay"])
                m.mul_(beta1).add_(g.reshape(-1), alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g.reshape(-1), g.reshape(-1), value=1 - beta2)
                # torch.optim.Adam's order of operations, so a run with no rounding matches it
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                p.addcdiv_(m.view_as(p).to(p.dtype), denom.view_as(p).to(p.dtype), value=-group["lr"] / (1 - beta1**t))
                self._store(st, m, v)
        return loss

    @staticmethod
    def _moments(p: torch.Tensor, st: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "exp_avg_q" not in st:
            zeros = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            return zeros, zeros.clone()
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

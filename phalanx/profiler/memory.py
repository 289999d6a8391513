"""Bytes per rank of parameters, gradients and optimizer state, and the process peak.

Reads real tensor sizes, so users see what each ZeRO stage saves::

    stage 1: params 2Ψ  grads 2Ψ   optimizer KΨ/N        (mixed precision, K = 12 for Adam;
                                                           + a 2Ψ/N grad shard between the reduce and step)
    stage 2: params 2Ψ  grads 2Ψ/N optimizer KΨ/N
    stage 3: params 4Ψ/N grads 4Ψ/N optimizer 8Ψ/N       (the fp32 shard is the parameter, as in FSDP2;
                                                           + one gathered unit while it runs)

Example::

    model, opt = px.zero(model, opt, stage=2)
    ...
    print(px.memory_report(opt))   # {'params': …, 'grads': …, 'optimizer_state': …, 'peak': …}
"""

from __future__ import annotations

import resource
import sys

import torch

from phalanx.parallel.zero import ZeroOptimizer

__all__ = ["memory_report", "peak_bytes"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def peak_bytes(device: torch.device | None = None) -> int:
    """Peak bytes: CUDA's max allocated on a GPU, else the process's peak resident set."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _state_bytes(optimizer: torch.optim.Optimizer, skip: set[int] = frozenset()) -> int:
    return sum(
        _nbytes(v)
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and id(v) not in skip
    )


def memory_report(optimizer) -> dict[str, int]:
    """This rank's bytes of ``params``, ``grads``, ``optimizer_state`` and ``peak``.

    ``optimizer`` is a :class:`phalanx.parallel.zero.ZeroOptimizer` (fp32 master shards
    count as optimizer state, as in the ZeRO paper, unless they are also the
    parameters: stage 3) or any plain ``torch.optim`` optimizer.
    """
    if isinstance(optimizer, ZeroOptimizer):
        engine = optimizer.engine
        masters = optimizer.masters
        aliased = optimizer.stage == 3  # the masters are the parameters, counted by param_bytes()
        opt = _state_bytes(optimizer.inner) + (0 if aliased else sum(_nbytes(m) for m in masters))
        device = masters[0].device if masters else None
        return {"params": engine.param_bytes(), "grads": engine.grad_bytes(), "optimizer_state": opt,
                "peak": peak_bytes(device)}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_report(optimizer=…): expected an optimizer, got {type(optimizer).__name__}")
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}.values()
    device = next(iter(params)).device if params else None
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": _state_bytes(optimizer),
        "peak": peak_bytes(device),
    }

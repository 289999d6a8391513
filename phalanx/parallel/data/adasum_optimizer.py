"""``AdasumOptimizer``: Horovod's ``DistributedOptimizer(op=hvd.Adasum)``, the delta optimizer.

Adasum combines whole updates, not gradients (Maleki et al., MLSys 2021; Horovod's
``_DistributedAdasumOptimizer``). Each rank steps its own optimizer on its own gradient, and
the ranks combine the parameters' changes with Adasum (:mod:`phalanx.comm.horovod_ops.adasum`)::

    start = p                  (every parameter with a gradient)
    inner.step()               local update from the local gradient
    delta = p - start          per parameter: its own Adasum coefficients
    p = start + Adasum(delta over the ranks)

The deltas of one dtype travel fused in one Adasum (each parameter keeps coefficients of its
own, as in Horovod's fusion buffer). Power-of-two worlds only, as Horovod. In a world of one
it is the inner optimizer (Horovod then uses its plain optimizer too).

Example::

    opt = AdasumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from phalanx.comm.compression.codecs import get_compressor
from phalanx.comm.horovod_ops import adasum
from phalanx.parallel.data.delegation import WrapsOptimizer

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer(WrapsOptimizer):
    """Step locally, then combine the parameter deltas across ``group`` with Adasum."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *, compression=None,
                 group=None) -> None:
        self.optimizer = optimizer
        self.group = group
        self.compressor = get_compressor(compression)
        if not self.compressor.summable:
            raise ValueError(f"DistributedOptimizer(op=Adasum) takes compression none, fp16 or bf16, got "
                             f"{self.compressor.name!r} (Adasum combines whole vectors, not codes)")
        n = dist.get_world_size(group) if dist.is_initialized() else 1
        if not adasum.is_power_of_two(n):
            raise ValueError(f"DistributedOptimizer(op=Adasum) needs a power-of-two number of ranks, the group "
                             f"has {n} (Horovod: 'Running Adasum with non-power-of-two ranks is not supported "
                             "yet'); use 2, 4, 8, … ranks or op=Average")
        self.world = n
        names = dict((id(p), name) for name, p in named_parameters) if named_parameters is not None else {}
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.names = [names.get(id(p), f"param.{i}") for i, p in enumerate(self.params)]

    # delegation: param_groups, state, defaults, zero_grad (WrapsOptimizer) ---------
    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are combined inside ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.world == 1:
            self.optimizer.step()
            return loss
        stepping = [p for p in self.params if p.grad is not None]
        if len(stepping) != len(self.params):
            for p in self.params:  # Horovod reduces every parameter: one without a gradient moves by nothing
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        with torch.no_grad():
            start = [p.detach().clone() for p in self.params]
            self.optimizer.step()
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, p in enumerate(self.params):
                by_dtype.setdefault(p.dtype, []).append(i)
            for dtype, idx in by_dtype.items():
                flat = torch.cat([(self.params[i].detach() - start[i]).reshape(-1) for i in idx])
                payload, ctx = self.compressor.compress(flat)
                payload = payload.contiguous()
                adasum.adasum_(payload, [self.params[i].numel() for i in idx], group=self.group,
                               name=f"adasum.{dtype}")
                delta = self.compressor.decompress(payload, ctx).to(dtype)
                for i, piece in zip(idx, delta.split([self.params[i].numel() for i in idx])):
                    self.params[i].copy_(start[i] + piece.view_as(start[i]))
        return loss

    def __repr__(self) -> str:
        return f"AdasumOptimizer({self.optimizer!r})"

"""Local SGD and post-local SGD: step locally, average parameters every H steps.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019); post-local
SGD after Lin et al., "Don't Use Large Mini-Batches, Use Local SGD" (ICLR 2020);
the outer optimizer after Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models" (2023).

Schedule (H = sync_every, warm-up = ``warmup_steps`` of ordinary data parallel)::

    step:      1   2  ...  w | w+1 ... w+H | w+H+1 ... w+2H
    warm-up:   allreduce grads every step (exactly synchronous SGD)
    local:                     local steps, then average params ─┐ one allreduce per H steps
    DiLoCo:    at each average, pseudo-grad = anchor - mean(params); the outer optimizer
               (SGD+Nesterov) steps the anchor; every replica restarts from it

Compared with synchronous data parallel this sends one parameter-sized allreduce
every H steps instead of one gradient-sized allreduce per step, and a slow
worker holds the others back only at the H-step boundaries, not at every step.

A worker that is *always* slower still holds the others back at every average:
with H steps each, the round takes as long as its H steps. ``sync_every_s=T``
averages every T seconds of local training instead, so each worker takes as many
local steps as its speed allows (the fast ones more). Averaging after unequal
numbers of local steps is unbiased only when every worker draws from the same data
distribution (the usual data-parallel case); with non-IID shards it tilts the
objective toward the fast workers (Wang et al., "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020).
Every rank still averages exactly once per period, so the collectives stay
matched; the training loop must stop at a sync point (``opt.synced``) by a
decision every rank shares, not after a per-rank number of steps.

Example::

    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=8, warmup_steps=50)
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.synchronize()                # make every replica equal before evaluation
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from phalanx.comm.collectives import Average, allreduce
from phalanx.comm.compression.codecs import get_compressor

__all__ = ["LocalSGD", "DiLoCo", "LocalSGDStats"]


@dataclasses.dataclass
class DiLoCo:
    """Outer optimizer settings (the DiLoCo paper uses SGD, lr 0.7, Nesterov momentum 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclasses.dataclass
class LocalSGDStats:
    steps: int = 0
    syncs: int = 0  # parameter averages
    grad_syncs: int = 0  # warm-up gradient allreduces
    bytes_sent: int = 0  # payload bytes this rank contributed to allreduces


class LocalSGD:
    """Wrap an optimizer: local steps, parameter averaging every ``sync_every`` steps.

    Args:
        optimizer: the inner (local) optimizer; kept and delegated to.
        model: the module whose parameters (and floating buffers) are averaged.
        sync_every: H, local steps between averages (1 = average every step); default 8.
        sync_every_s: average every this many seconds of local steps instead of every H
            steps (for workers of different speed; see the module docstring).
        warmup_steps: steps of gradient allreduce first (post-local SGD).
        outer: a :class:`DiLoCo` to step an outer optimizer on the averaged delta.
        group: process group to average over (default: the world).
        compression: a summable compressor name (``"fp16"``/``"bf16"``) for the averages.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *, sync_every: int | None = None,
                 sync_every_s: float | None = None, warmup_steps: int = 0, outer: DiLoCo | None = None,
                 group=None, compression=None) -> None:
        if sync_every is not None and sync_every_s is not None:
            raise ValueError("give sync_every (local steps) or sync_every_s (seconds), not both")
        if sync_every_s is not None and not sync_every_s > 0:
            raise ValueError(f"sync_every_s must be > 0 seconds, got {sync_every_s}")
        sync_every = 8 if sync_every is None else sync_every
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 local steps, got {sync_every}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.optimizer, self.model = optimizer, model
        self.sync_every, self.warmup_steps, self.group = sync_every, warmup_steps, group
        self.sync_every_s = sync_every_s
        self.synced = False  # whether the last step() ended with an average
        self._period_start = time.perf_counter()
        self.compressor = get_compressor(compression)
        if not self.compressor.summable:
            raise ValueError(f"compression={self.compressor.name!r} cannot be summed by an allreduce; "
                             "use 'fp16', 'bf16' or None for local SGD")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stats = LocalSGDStats()
        self._outer = None
        if outer is not None:
            self._anchor = [p.detach().clone().requires_grad_(True) for p in self.params]
            self._outer = torch.optim.SGD(self._anchor, lr=outer.lr, momentum=outer.momentum,
                                          nesterov=outer.nesterov)

    # delegate the usual optimizer surface
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"inner": self.optimizer.state_dict(), "steps": self.stats.steps,
                "outer": self._outer.state_dict() if self._outer else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["inner"])
        self.stats.steps = int(state["steps"])
        if self._outer and state.get("outer"):
            self._outer.load_state_dict(state["outer"])

    def _average(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        payload, ctx = self.compressor.compress(flat)
        allreduce(payload, op=Average, group=self.group, inplace=True, name="local_sgd")
        flat = self.compressor.decompress(payload, ctx)
        self.stats.bytes_sent += payload.numel() * payload.element_size()
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def step(self, closure=None):
        """Inner step; gradient allreduce during warm-up, parameter average every H steps after."""
        warm = self.stats.steps < self.warmup_steps
        if warm:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                self._average(grads)
                self.stats.grad_syncs += 1
        loss = self.optimizer.step(closure)
        self.stats.steps += 1
        self.synced = False
        if warm:
            if self.stats.steps == self.warmup_steps:
                self._period_start = time.perf_counter()
                if self._outer is not None:
                    self._reset_anchor()
        elif self.sync_every_s is not None:
            if time.perf_counter() - self._period_start >= self.sync_every_s:
                self.synchronize()
        elif (self.stats.steps - self.warmup_steps) % self.sync_every == 0:
            self.synchronize()
        return loss

    def _reset_anchor(self) -> None:
        with torch.no_grad():
            for a, p in zip(self._anchor, self.params):
                a.copy_(p)

    def synchronize(self) -> None:
        """Average parameters (and floating buffers) now; with DiLoCo, take an outer step."""
        self._average(self.params)
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        if buffers:
            self._average(buffers)
        self.stats.syncs += 1
        self.synced = True
        self._period_start = time.perf_counter()  # every rank leaves the average together
        if self._outer is None:
            return
        with torch.no_grad():
            for a, p in zip(self._anchor, self.params):
                a.grad = a.detach() - p.detach()  # pseudo-gradient: how far the average moved, negated
        self._outer.step()
        with torch.no_grad():
            for a, p in zip(self._anchor, self.params):
                p.copy_(a)

"""Horovod-style front of the data-parallel engine: ``DistributedOptimizer``.

``DistributedOptimizer`` holds a plain ``torch.optim`` optimizer (composition,
no classes built at run time). Gradients are bucketed and launched during
backward exactly as under ``DataParallel``; the wait happens in
``synchronize()`` or ``step()``, so you can clip or unscale in between::

    loss.backward()            # buckets launched as gradients become ready
    opt.synchronize()          # wait: p.grad now holds the average
    scaler.unscale_(opt); clip_grad_norm_(...)
    with opt.skip_synchronize():
        scaler.step(opt)

Example::

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    px.broadcast_parameters(model.state_dict(), root_rank=0)
    px.broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from phalanx import trace
from phalanx.comm.collectives import Average, ReduceOp
from phalanx.comm.horovod_ops import negotiate
from phalanx.optim.adam8bit import Adam8bit, check_state_bits
from phalanx.parallel.data.config import EngineConfig, resolve_topology
from phalanx.parallel.data.delegation import WrapsOptimizer
from phalanx.parallel.data.gradients import GradientEngine
from phalanx.parallel.data.hooks import resolve_balance

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(WrapsOptimizer):
    """Average gradients across ranks before the inner optimizer's step (Horovod's front).

    Args mirror ``horovod.torch.DistributedOptimizer``; ``bucket_mb`` and
    ``find_unused_parameters`` (default True here: a parameter without a gradient
    contributes zeros; one that no rank used keeps ``grad=None``, at the cost of one small
    allreduce per step) tune the shared engine. ``missing_as_zeros=True`` is Horovod's rule
    instead: every parameter without a gradient contributes zeros and gets the average (zeros
    where no rank had one), with no per-step count (what ``hvd.DistributedOptimizer`` does).

    ``join_ready`` (default True, as Horovod) lets :meth:`join` work with uneven data: each
    rank's "I am stepping" rides as one extra element in the step's first bucket (with a lossy
    compressor, or an op other than Sum/Average, a small separate allreduce starts each step
    instead; ``join_ready=False`` drops both). On the whole world the steps run on a second group
    of it (``Topology.steps_group()``), so that ``hvd.join`` can wait for a step and for a facade
    collective at once.

    ``state_bits=8`` (``torch.optim.Adam`` / ``AdamW``) steps an :class:`~phalanx.optim.Adam8bit` with the
    same hyperparameters instead, whose moments are block-wise quantized bytes (2 bytes a parameter,
    not 8); it is ``opt.optimizer`` (give LR schedulers that one).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
        *,
        compression=None,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        group=None,
        sparse_as_dense: bool = False,
        topology=None,
        bucket_mb: float | None = None,
        find_unused_parameters: bool = True,
        algorithm: str | None = None,
        balance=None,
        join_ready: bool = True,
        missing_as_zeros: bool = False,
        state_bits: int = 32,
    ) -> None:
        check_state_bits("DistributedOptimizer", state_bits, optimizer)
        if state_bits == 8:
            optimizer = Adam8bit.like(optimizer)
        self.optimizer = optimizer
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(opt_params)]
        else:
            named = list(named_parameters)
            if len({n for n, _ in named}) != len(named):
                raise ValueError("named_parameters has duplicate names; pass model.named_parameters()")
            known = {id(p) for _, p in named}
            unnamed = [p for p in opt_params if id(p) not in known]
            if unnamed:
                raise ValueError(
                    f"named_parameters is missing {len(unnamed)} parameter(s) the optimizer updates; "
                    "pass model.named_parameters() of the same model the optimizer was built from"
                )
            in_opt = {id(p) for p in opt_params}
            named = [(n, p) for n, p in named if id(p) in in_opt]
        named = [(n, p) for n, p in named if p.requires_grad]
        self._join_flag = None  # the fallback's per-step "I still have data" allreduce (see join())
        self._flag_device = named[0][1].device if named else torch.device("cpu")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.join_ready = join_ready
        topology = resolve_topology(topology)
        # ready for hvd.join on the world: the steps go on a group of their own (not with balance=,
        # which refuses join and whose Balancer reduces on the group it was given). Built in a world
        # of one (an elastic newcomer before it is admitted), it moves there at the re-form.
        steps = group is None and join_ready and balance is None
        self.group = topology.steps_group() if steps and world > 1 else group
        self._engine = GradientEngine(named, EngineConfig(
            group=self.group, topology=topology, join_flag=join_ready, follows_world=steps,
            bucket_mb=bucket_mb, compression=compression, op=op,
            gradient_predivide_factor=gradient_predivide_factor, find_unused_parameters=find_unused_parameters,
            missing_as_zeros=missing_as_zeros, sparse_as_dense=sparse_as_dense, algorithm=algorithm,
            backward_passes_per_step=backward_passes_per_step, wait_in_backward=False,
        ))
        # The engine calls it once per step, at the first gradient, before any bucket launches
        # (one call a step, not a Python hook on every parameter).
        if world > 1 and join_ready and not self._engine.join_flag:
            self._engine.on_first_grad = self._announce
        self._engine.on_reform.append(self._world_changed)
        # a phalanx.balance.Balancer (or a global batch size): docs/load_balancing.md
        self.balancer = self._engine.attach(resolve_balance(balance, group))
        self._skip = False

    def _world_changed(self) -> None:
        """Elastic re-form: the steps group (the engine moved) and the fallback announcement follow the new world."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = self._engine.group
        self._join_flag = None
        fallback = world > 1 and self.join_ready and not self._engine.join_flag
        self._engine.on_first_grad = self._announce if fallback else None

    # delegation: param_groups, state, defaults, zero_grad (WrapsOptimizer) ---------
    def add_param_group(self, group: dict) -> None:
        raise NotImplementedError("DistributedOptimizer: build a new one after adding param groups")

    @property
    def bytes_sent(self) -> int:
        return self._engine.bytes_sent

    def state_dict(self) -> dict:
        out = self.optimizer.state_dict()
        comm = self._engine.state_dict()
        if "compression" in comm:
            out = {**out, "compression": comm["compression"]}
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        comm = state.pop("compression", None)
        self.optimizer.load_state_dict(state)
        if comm is not None:
            self._engine.load_state_dict({"compression": comm})

    # synchronisation -------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every launched reduction; afterwards ``p.grad`` holds the average."""
        self._engine.wait()
        if self._join_flag is not None:
            self._join_flag.wait()
            self._join_flag = None

    def _announce(self) -> None:
        # First gradient of a pass that communicates: one small MAX tells ranks that already
        # joined that one more step is coming, before this step's first bucket is launched (the
        # same probe the Horovod facade's collectives start with: phalanx.comm.horovod_ops.negotiate).
        if self._join_flag is None:
            flag = negotiate.step_probe(self._flag_device)
            self._join_flag = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def join(self) -> int:
        """Uneven data: call when this rank has no more batches; returns when every rank has.

        Until then this rank answers each step of the others with zero gradients (the average
        still divides by the whole group, as Horovod's join does). Every rank's first bucket
        carries its "I am stepping" flag, so a joined rank learns from the step's own first
        collective whether to take part in the rest of it or to leave
        (:mod:`phalanx.parallel.data.joined`)::

            training rank:  [b0|1][b1…] [b0|1][b1…] join: [b0 zeros|0] -> sum 0: done
            joined rank:    join: [b0 zeros|0] -> sum > 0: [b1… zeros] [b0 zeros|0] -> … -> sum 0: done

        Only the optimizer's gradient reductions are answered: other collectives the training
        ranks make meanwhile must come after ``join()``. Returns the global rank that joined
        last (the highest such rank when several joined in the same step).
        """
        if self.balancer is not None:
            raise RuntimeError("join() cannot be combined with balance=: BalancedSampler gives every rank "
                               "the same number of steps, so there are no uneven inputs to join")
        if not self.join_ready:
            raise RuntimeError("join() needs DistributedOptimizer(join_ready=True) (the default) on every rank: "
                               "its flag in each step's first bucket tells joined ranks whether another step is coming")
        self.synchronize()
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return dist.get_rank() if dist.is_initialized() else 0
        answered = self.answer_steps()
        every = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64, device=self._flag_device)
        every[dist.get_rank(self.group)] = answered  # steps each rank answered with zeros
        dist.all_reduce(every, op=dist.ReduceOp.SUM, group=self.group)
        every = every.tolist()
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(len(every)))
        fewest = min(every)
        return max(r for r, n in zip(ranks, every) if n == fewest)

    def answer_steps(self) -> int:
        """A joined rank: answer the others' steps with zeros until every rank has joined; how many."""
        answered = 0
        if self._engine.join_flag:
            while self._engine.answer_step():
                answered += 1
            return answered
        while negotiate.joined_wait(self.group, self._flag_device):
            self.join_step()
            answered += 1
        return answered

    @property
    def on_steps_group(self) -> bool:
        """Its steps run on the world's steps group (``hvd.join`` answers them on a thread of their own)."""
        return self._engine.follows_world and self._engine.group is not None

    def join_step(self) -> None:
        """Take part in one step of the other ranks with zero gradients (a rank that has joined).

        For a ``join`` loop of one's own (the Horovod facade's ``hvd.join`` answers the
        optimizer's steps with it): every rank must have the same ``DistributedOptimizer``.
        """
        self._engine.shadow()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside the block ``step()`` does not synchronize (you already called ``synchronize()``)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        with trace.span("optimizer_step", "compute"):
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

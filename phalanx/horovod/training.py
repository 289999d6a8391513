"""The training half of the Horovod facade: optimizer, state broadcasts, join, timeline, SyncBatchNorm.

Each function maps Horovod's arguments onto phalanx's data-parallel optimizer
(:mod:`phalanx.parallel.data.optimizer`), :mod:`phalanx.comm.horovod_ops.ops` and the profiler.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.broadcast import broadcast_optimizer_state as broadcast_state_of
from phalanx.comm.broadcast import broadcast_parameters as broadcast_params
from phalanx.comm.horovod_ops import ops as ops
from phalanx.comm.horovod_ops.process_sets import global_process_set, group_of
from phalanx.parallel.data.adasum_optimizer import AdasumOptimizer
from phalanx.parallel.data.delegation import WrapsOptimizer
from phalanx.parallel.data.optimizer import DistributedOptimizer as PlainDistributedOptimizer
from phalanx.parallel.sync_batchnorm import SyncBatchNorm

__all__ = [
    "DistributedOptimizer",
    "HorovodOptimizer",
    "OutsideSetOptimizer",
    "SyncBatchNorm",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "join",
    "start_timeline",
    "stop_timeline",
]

_last_optimizer = None
_SYNC_THEN_STEP = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                   "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class HorovodOptimizer(PlainDistributedOptimizer):
    """phalanx's ``DistributedOptimizer`` plus Horovod's warning when ``step()`` follows an explicit
    ``synchronize()`` outside ``skip_synchronize()`` (the gradients would be waited for twice), its
    ``_parameter_names`` (``{parameter: name}``, read by Horovod's own tests and some scripts), and
    sparse gradients for ``SparseAdam`` after ``sparse_as_dense=True``."""

    _parameter_names: dict = {}

    synchronized = False

    def synchronize(self) -> None:
        super().synchronize()
        self.synchronized = True
        if isinstance(self.optimizer, torch.optim.SparseAdam):
            # sparse_as_dense reduced them dense; SparseAdam steps sparse gradients only (Horovod
            # turns an averaged gradient back to sparse when it came sparse)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.layout is torch.strided:
                        p.grad = p.grad.to_sparse()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self.synchronized = False
        with super().skip_synchronize():
            yield

    def step(self, closure=None):
        if self.synchronized:
            warnings.warn(_SYNC_THEN_STEP, stacklevel=2)
        try:
            return super().step(closure)
        finally:
            self.synchronized = False


class OutsideSetOptimizer(WrapsOptimizer):
    """What ``DistributedOptimizer(..., process_set=ps)`` is on a rank outside ``ps``, as in Horovod:
    nothing is reduced (no hooks, ``synchronize()`` returns at once) and ``step()`` is the inner
    optimizer's, on this rank's own gradients."""

    def __init__(self, optimizer, parameter_names: dict) -> None:
        self.optimizer = optimizer
        self._parameter_names = parameter_names

    def synchronize(self) -> None:
        """Nothing to wait for: this rank is outside the optimizer's process set."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self, closure=None):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()


def _named(optimizer, named_parameters) -> list:
    """Horovod's names: ``named_parameters`` as given (tuples of name and parameter), or
    ``allreduce.noname.{group}.{index}`` for every parameter of the optimizer when it is None."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p)
                for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters()")
    return named


def DistributedOptimizer(  # noqa: N802 - Horovod's spelling
    optimizer,
    named_parameters=None,
    compression=None,
    backward_passes_per_step: int = 1,
    op=c.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=global_process_set,
):
    """Wrap ``optimizer`` so that ``step()`` averages gradients across the process set first.

    ``num_groups`` (fuse gradients into that many allreduces) is honoured by choosing the
    bucket size; explicit ``groups`` lists are treated the same way (phalanx buckets by size
    in backward order).
    """
    global _last_optimizer
    process_set = process_set or global_process_set
    named_parameters = _named(optimizer, named_parameters)
    names = {p: n for n, p in sorted(named_parameters, key=lambda item: item[0])}  # Horovod's _parameter_names
    if op == ops.ADASUM and process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if not process_set.included():
        return OutsideSetOptimizer(optimizer, names)
    if op == ops.ADASUM:
        # Horovod's delta optimizer: local step, then the parameter changes combined with Adasum
        return AdasumOptimizer(optimizer, named_parameters, compression=compression)
    if gradient_predivide_factor != 1.0 and c.ReduceOp(op) is not c.ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average (it splits the averaging "
                         "into a division before and after the sum), as in Horovod")
    params = [p for _, p in named_parameters]
    kwargs = {}
    n_groups = len(groups) if isinstance(groups, (list, tuple)) else (groups or num_groups)
    if n_groups:
        total = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        kwargs["bucket_mb"] = max(math.ceil(total / n_groups) / 2**20, 1e-3)
    _last_optimizer = HorovodOptimizer(
        optimizer, named_parameters=named_parameters, compression=compression,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        group=group_of(process_set), missing_as_zeros=True, **kwargs,
    )
    _last_optimizer._parameter_names = names
    return _last_optimizer


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Copy parameters (a state_dict, named_parameters() or parameters()) from ``root_rank``, in place."""
    if not isinstance(params, (Mapping, torch.nn.Module)):
        params = list(params)
        if not all(isinstance(p, (tuple, torch.Tensor)) for p in params):
            raise ValueError("broadcast_parameters takes a state_dict, model.named_parameters() or "
                             f"model.parameters(); got items of type {type(params[0]).__name__}")
        params = [p if isinstance(p, tuple) else (f"param.{i:06d}", p) for i, p in enumerate(params)]
    broadcast_params(params, root_rank=root_rank, group=group_of(process_set or global_process_set))


def broadcast_optimizer_state(optimizer, root_rank: int = 0, process_set=global_process_set) -> None:
    """Copy optimizer state (also when still empty, or when some parameters have no gradient yet)
    from ``root_rank`` to every rank of the process set.

    As after Horovod's, a parameter that requires a gradient and has none holds zeros in ``.grad``
    afterwards when the state was empty (sparse zeros for ``SparseAdam``). Horovod gets there by
    stepping the inner optimizer once on zero gradients to create the state; that step is not
    copied (it would apply weight decay once and start Adam's bias correction a step late): the
    whole state dict travels as it is, empty or not.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not inner.state:
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(inner, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
    broadcast_state_of(inner, root_rank=root_rank, group=group_of(process_set or global_process_set))


def join(device: int = -1) -> int:
    """Called by a rank that ran out of data; returns when every rank has, with the rank that joined last.

    Until then this rank answers the others' collectives with zeros of the right shape: facade
    collectives (allreduce, allgather, broadcast, alltoall, reducescatter, objects, barrier) and the
    gradient reductions of the last ``DistributedOptimizer`` created. Broadcast the parameters from
    the returned rank afterwards (a joined rank stops stepping). ``device`` is ignored.
    """
    opt = _last_optimizer
    if opt is not None:
        opt.synchronize()
        opt.synchronized = False
    if opt is None or not opt.on_steps_group or not dist.is_initialized() or dist.get_world_size() == 1:
        return ops.join(on_step=None if opt is None else opt.join_step)
    # The optimizer's steps run on the world's steps group: answer them on a thread of their own
    # while this one answers the facade's collectives on the world group; each loop ends when
    # every rank has joined (the steps loop when a first bucket's flags sum to zero).
    steps: dict = {}

    def answer() -> None:
        try:
            steps["answered"] = opt.answer_steps()
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            steps["error"] = err

    thread = threading.Thread(target=answer, name="phalanx-join-steps", daemon=True)
    thread.start()

    def answered_steps() -> int:
        thread.join()
        if "error" in steps:
            raise steps["error"]
        return steps["answered"]

    return ops.join(on_step=None, also_answered=answered_steps)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline of this job to ``file_path`` (collective: every rank)."""
    from phalanx.profiler import start_timeline as start

    start(file_path)


def stop_timeline() -> None:
    from phalanx.profiler import stop_timeline as stop

    stop()

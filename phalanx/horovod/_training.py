"""The training half of the Horovod facade: optimizer, state broadcast, join, timeline.

Each function maps Horovod's arguments onto phalanx's engine and delegates.
"""

from __future__ import annotations

import math

import phalanx.runtime as _rt
from phalanx.comm import collectives as _c
from phalanx.comm.compression import NoneCompressor

__all__ = [
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "join",
    "start_timeline",
    "stop_timeline",
]

_last_optimizer = None
_NO_COMPRESSION = NoneCompressor()


def DistributedOptimizer(  # noqa: N802 - Horovod's spelling
    optimizer,
    named_parameters=None,
    compression=_NO_COMPRESSION,
    backward_passes_per_step: int = 1,
    op=_c.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=None,
):
    """Wrap ``optimizer`` so that ``step()`` averages gradients across ranks first.

    ``num_groups`` (fuse gradients into that many allreduces) is honoured by
    choosing the bucket size; explicit ``groups`` lists are accepted and
    treated the same way (phalanx buckets by size in backward order).
    """
    global _last_optimizer
    from phalanx.horovod import Adasum, global_process_set
    from phalanx.parallel.data_optimizer import DistributedOptimizer as _Engine

    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by phalanx; use op=hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and _c.ReduceOp(op) is not _c.ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average (it splits the averaging "
                         "into a division before and after the sum), as in Horovod")
    process_set = process_set or global_process_set
    named_parameters = list(named_parameters) if named_parameters is not None else None
    params = [p for _, p in (named_parameters or [])] or [
        p for g in optimizer.param_groups for p in g["params"]
    ]
    kwargs = {}
    n_groups = len(groups) if isinstance(groups, (list, tuple)) else (groups or num_groups)
    if n_groups:
        total = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        kwargs["bucket_mb"] = max(math.ceil(total / n_groups) / 2**20, 1e-3)
    _last_optimizer = _Engine(
        optimizer,
        named_parameters=named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense,
        group=process_set.group,
        **kwargs,
    )
    return _last_optimizer


def broadcast_parameters(params, root_rank: int = 0, process_set=None) -> None:
    """Copy parameters (a state_dict, named_parameters() or parameters()) from ``root_rank``, in place."""
    from collections.abc import Mapping

    import torch

    from phalanx.parallel.data_optimizer import broadcast_parameters as _bp

    if not isinstance(params, (Mapping, torch.nn.Module)):
        params = list(params)
        if not all(isinstance(p, (tuple, torch.Tensor)) for p in params):
            raise ValueError("broadcast_parameters takes a state_dict, model.named_parameters() or "
                             f"model.parameters(); got items of type {type(params[0]).__name__}")
        params = [p if isinstance(p, tuple) else (f"param.{i:06d}", p) for i, p in enumerate(params)]
    _bp(params, root_rank=root_rank, **({"group": process_set.group} if process_set is not None else {}))


def broadcast_optimizer_state(optimizer, root_rank: int = 0, process_set=None) -> None:
    """Copy optimizer state (also when still empty) from ``root_rank`` to every rank."""
    from phalanx.parallel.data_optimizer import broadcast_optimizer_state as _bos

    inner = getattr(optimizer, "optimizer", optimizer)
    _bos(inner, root_rank=root_rank, **({"group": process_set.group} if process_set is not None else {}))


def join(device: int = -1) -> int:
    """Called by a rank that ran out of data; returns when every rank has joined.

    Until then this rank answers the others' gradient reductions with zeros
    (through the last ``DistributedOptimizer`` created; see
    ``phalanx.parallel.data_optimizer.DistributedOptimizer.join``). Returns the
    rank that joined last, as Horovod does: broadcast its parameters afterwards
    (a joined rank stops stepping, so its replica is stale). ``device`` is ignored.
    """
    if _last_optimizer is None:
        _c.barrier()
        return _rt.size() - 1  # nobody trained: every rank joined in the same step
    return _last_optimizer.join()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline of this job to ``file_path``."""
    from phalanx.profiler import start_timeline as _start

    _start(file_path)


def stop_timeline() -> None:
    from phalanx.profiler import stop_timeline as _stop

    _stop()

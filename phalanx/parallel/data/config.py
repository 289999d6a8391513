"""The data-parallel engine's settings: bucket size and algorithm from the job, and its Topology.

Example::

    from phalanx.parallel.data.config import job_defaults
    bucket_mb, algorithm = job_defaults(None, None)     # 25.0, "flat" unless the job says otherwise
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from phalanx import runtime, settings
from phalanx.comm.algorithms import ALGORITHMS
from phalanx.comm.collectives import ReduceOp

__all__ = ["DEFAULT_BUCKET_MB", "VIEW_MIN_NUMEL", "EngineConfig", "describe_engine", "job_defaults",
           "resolve_topology"]

DEFAULT_BUCKET_MB = 25.0
# gradient_as_bucket_view hands out views only for gradients this large: assigning p.grad
# from Python costs ~5 us a parameter, more than copying a small gradient back with one
# fused _foreach_copy_ (measured on many 64x64 layers: views 8.50 ms/step, copies 7.74).
VIEW_MIN_NUMEL = 1 << 14


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every option of a :class:`~phalanx.parallel.data.gradients.GradientEngine`, one line each.

    ``DataParallel``, ``DistributedOptimizer`` and ZeRO each build one from their own arguments.

    Example::

        engine = GradientEngine(model.named_parameters(), EngineConfig(bucket_mb=25, wait_in_backward=True))
    """

    group: Any = None
    """The process group the gradients are reduced over; None: the whole world."""
    topology: Any = None
    """The job's Topology (the hierarchical algorithm needs it); None: ``phalanx.init()``'s, read once."""
    bucket_mb: float | None = None
    """Bucket size in MB; None: the job's (PHALANX_BUCKET_MB, HOROVOD_FUSION_THRESHOLD) or 25."""
    compression: Any = None
    """A codec name or Compressor (``phalanx.comm.compression``); None: uncompressed."""
    op: ReduceOp = ReduceOp.AVERAGE
    """Average or Sum of the ranks' gradients."""
    gradient_predivide_factor: float = 1.0
    """Divide by this before the sum and by world/this after (Horovod's option)."""
    find_unused_parameters: bool = False
    """Count which ranks gave each parameter a gradient (one small allreduce a step)."""
    missing_as_zeros: bool = False
    """A missing gradient counts as zeros and gets the average (Horovod's rule; no count)."""
    join_flag: bool = False
    """Bucket 0 carries each rank's 'I am stepping' (DistributedOptimizer's join)."""
    follows_world: bool = False
    """The group is the job's steps group and follows an elastic re-form."""
    sparse_as_dense: bool = False
    """Reduce sparse gradients as dense ones (else: allgathered)."""
    sparse_ids: frozenset[int] = frozenset()
    """ids of the parameters whose gradients come sparse (nn.Embedding(sparse=True))."""
    algorithm: str | None = None
    """Allreduce algorithm (flat, ring, hierarchical, auto); None: the job's, else flat."""
    backward_passes_per_step: int = 1
    """Backward passes accumulated locally before a reduction."""
    wait_in_backward: bool = True
    """Finish the reduction in the end-of-backward callback (DDP); False: in wait() (Horovod)."""
    gradient_as_bucket_view: bool = True
    """Leave large gradients as views into their bucket after the first reduction."""
    plan: Sequence[Sequence[Any]] | None = None
    """A fixed bucket layout (ZeRO lays its master shard out from it); None: planned from the order."""
    pad_to: int = 1
    """Pad each planned bucket to a multiple of this (the group size, for reduce-scatter)."""
    lazy_buckets: bool = False
    """Planned buckets get their storage only while in use (a reduction with buffers of its own)."""


def job_defaults(bucket_mb: float | None, algorithm: str | None) -> tuple[float, str]:
    """Bucket size and allreduce algorithm when the caller leaves them None: the job's settings
    (:class:`phalanx.settings.DataParallelSettings`: ``phalanx run --fusion-threshold-mb /
    --hierarchical-allreduce`` export PHALANX_BUCKET_MB / PHALANX_ALGORITHM; Horovod's
    HOROVOD_FUSION_THRESHOLD, in bytes, and HOROVOD_HIERARCHICAL_ALLREDUCE=1 when those are
    unset), else 25 MB and "flat". A caller's own values are checked with the settings' validators.
    """
    if bucket_mb is not None and algorithm is not None:  # nothing to take from the job
        return float(settings.positive("bucket_mb", bucket_mb)), settings.choice("algorithm", algorithm, ALGORITHMS)
    job = runtime.current_settings().data_parallel
    if bucket_mb is None:
        bucket_mb = job.bucket_mb if job.bucket_mb is not None else DEFAULT_BUCKET_MB
    else:
        bucket_mb = settings.positive("bucket_mb", bucket_mb)
    if algorithm is None:
        algorithm = job.algorithm or "flat"
    else:
        algorithm = settings.choice("algorithm", algorithm, ALGORITHMS)
    return float(bucket_mb), algorithm


def resolve_topology(topology: runtime.Topology | None) -> runtime.Topology | None:
    """The Topology a strategy keeps: the one passed in, else ``phalanx.init()``'s, read once at
    construction; None when only torch.distributed was initialised (no phalanx runtime: the
    flat algorithm needs none, the hierarchical one says so)."""
    if topology is not None:
        return topology
    return runtime.topology() if runtime.is_initialized() else None


def check_engine_args(op, predivide: float, passes: int) -> None:
    """A gradient engine's arguments, each mistake one line naming what is accepted."""
    try:
        op = ReduceOp(op)
    except ValueError:
        raise settings.SettingsError(f"op={op!r} is not accepted; accepted: px.Average | px.Sum "
                                     "(ReduceOp.AVERAGE | ReduceOp.SUM)") from None
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"op must be Sum or Average for gradients, got {ReduceOp(op).name.title()}")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide}")
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")


def describe_engine(engine) -> str:
    """One line: the bucket plan, compression, algorithm and sparse parameters (logged at INFO
    when the engine starts; the plan is re-made once from the first step's gradient order)."""
    sizes = [b.nbytes / 2**20 for b in engine.buckets.buckets]
    shown = ", ".join(f"{mb:.3g}" for mb in sizes[:8]) + (f", … ({len(sizes) - 8} more)" if len(sizes) > 8 else "")
    return (f"bucket plan: {len(sizes)} buckets, sizes {shown or '-'} MB ({sum(sizes):.3g} MB in all, "
            f"{len(engine.buckets.params)} parameters), compression {engine.compressor.name}, algorithm "
            f"{engine.algorithm}, {len(engine.sparse)} sparse parameter(s) by allgather, world {engine.world}")


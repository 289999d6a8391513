"""Data parallelism: every rank holds the whole model and averages its gradients with the others.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB 2020); Sergeev & Del Balso, "Horovod" (2018). One step::

    forward → backward ─┬─ post-accumulate-grad hook per parameter ─► bucket view
                        └─ bucket full → [compress] → async collective (overlaps the rest of backward)
    DataParallel:          wait at the end of backward (grads ready when backward returns)
    DistributedOptimizer:  wait in synchronize() / step() (clip or unscale in between)

The modules, lowest first::

    config.py         bucket size / algorithm from the job, the Topology a strategy keeps
    hooks.py          the seam services attach through (engine hooks, StepObserver for balance=)
    reduction.py      BucketReduction plug point; AllReduceReduction, the default
    followups.py      what a step launches after its buckets (sparse, used, non-finite flag)
    gradients.py      GradientEngine: buckets, hooks, accumulation, wait
    overlap.py        OptimizerOverlap: the optimizer stepped piece by piece as the average lands
    data_parallel.py  DataParallel (DDP's front)
    optimizer.py      DistributedOptimizer (Horovod's front)
    adasum.py         AdasumOptimizer (Horovod's op=Adasum: local step, deltas combined with Adasum)

Buckets live in :mod:`phalanx.comm.buckets`, the broadcasts in :mod:`phalanx.comm.broadcast`.

Example::

    import torch, phalanx as px
    px.init()
    model = px.DataParallel(torch.nn.Linear(10, 1), bucket_mb=25)
    model(torch.randn(8, 10)).sum().backward()   # gradients averaged when this returns
"""

from phalanx.parallel.data.config import VIEW_MIN_NUMEL
from phalanx.parallel.data.data_parallel import DataParallel
from phalanx.parallel.data.gradients import GradientEngine
from phalanx.parallel.data.hooks import StepObserver, register_engine_hook
from phalanx.parallel.data.optimizer import DistributedOptimizer
from phalanx.parallel.data.reduction import AllReduceReduction, BucketReduction

__all__ = [
    "DataParallel",
    "DistributedOptimizer",
    "GradientEngine",
    "BucketReduction",
    "AllReduceReduction",
    "StepObserver",
    "register_engine_hook",
    "VIEW_MIN_NUMEL",
]

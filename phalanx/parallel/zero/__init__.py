"""ZeRO (Rajbhandari et al., SC 2020): optimizer state, gradients and parameters sharded over data-parallel ranks.

The package, one module per seam::

    optimizer.py   zero() and ZeroOptimizer: the inner optimizer over this rank's fp32 shard, clipping, fp16 scaling
    shard.py       the flat partition (units split evenly across ranks) and its two collectives
    stage12.py     stages 1-2: ShardReduction, the data-parallel engine's per-bucket reduce-scatter
    stage3.py      stage 3: parameters gathered per module just in time, freed after use
    checkpoint.py  the sharded (any world size) and consolidated (torch.optim) checkpoint formats

``phalanx.parallel.zero.zero`` and ``phalanx.parallel.zero.ZeroOptimizer`` are the
documented import paths (``px.zero`` is the same function).

Example::

    import torch, phalanx as px
    px.init()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, opt = px.zero(model, torch.optim.Adam(model.parameters()), stage=2)
"""

from phalanx.parallel.zero.checkpoint import FORMAT, FULL_FORMAT
from phalanx.parallel.zero.optimizer import ZeroOptimizer, zero
from phalanx.parallel.zero.shard import CHUNK_NUMEL

__all__ = ["zero", "ZeroOptimizer", "FORMAT", "FULL_FORMAT", "CHUNK_NUMEL"]

"""Pipeline parallelism: split a model by layers across ranks and stream micro-batches through.

* :mod:`.partition` — balanced split (uniform / parameters / time / flops, exact min-bottleneck)
* :mod:`.by_path` — stages of a model that is not an ``nn.Sequential`` (HF, torchtitan), by module path
* :mod:`.schedules` — GPipe, 1F1B, eager 1F1B and interleaved 1F1B, with their timelines drawn; ideal-network replay
* :mod:`.stage` — one stage's executor (p2p activations/gradients, loss, accumulation)

Example::

    from phalanx.parallel.pipeline import PipelineStage, partition
    plan = partition(model, 2, method="parameters")
    stage = PipelineStage(plan.split(model)[px.rank()], px.rank(), 2, loss_fn=F.cross_entropy)
"""

from phalanx.parallel.pipeline.by_path import (
    PassThrough,
    StageOfModel,
    TiedParameter,
    Zeros,
    find_blocks,
    holder_groups,
    recompute_blocks,
    split_by_path,
)
from phalanx.parallel.pipeline.partition import (
    Partition,
    block_costs,
    min_bottleneck_split,
    partition,
    uniform_split,
)
from phalanx.parallel.pipeline.schedules import (
    SCHEDULES,
    EagerOneFOneB,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    bubble_bound,
    bubble_fraction,
    draw,
    get_schedule,
    replay,
)
from phalanx.parallel.pipeline.stage import PipelineStage, Span, StageLink

__all__ = [
    "split_by_path",
    "find_blocks",
    "recompute_blocks",
    "StageOfModel",
    "TiedParameter",
    "holder_groups",
    "PassThrough",
    "Zeros",
    "Partition",
    "block_costs",
    "min_bottleneck_split",
    "partition",
    "uniform_split",
    "SCHEDULES",
    "EagerOneFOneB",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Schedule",
    "bubble_bound",
    "bubble_fraction",
    "draw",
    "get_schedule",
    "replay",
    "PipelineStage",
    "Span",
    "StageLink",
]

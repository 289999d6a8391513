"""Pipeline parallelism: split a model by layers across ranks and stream micro-batches through.

* :mod:`.partition` — balanced split (uniform / parameters / time / flops, exact min-bottleneck)
* :mod:`.schedules` — GPipe and 1F1B, with their timelines drawn
* :mod:`.stage` — one stage's executor (p2p activations/gradients, loss, accumulation)

Example::

    from phalanx.parallel.pipeline import PipelineStage, partition
    plan = partition(model, 2, method="parameters")
    stage = PipelineStage(plan.split(model)[px.rank()], px.rank(), 2, loss_fn=F.cross_entropy)
"""

from phalanx.parallel.pipeline.partition import (
    Partition,
    block_costs,
    min_bottleneck_split,
    partition,
    uniform_split,
)
from phalanx.parallel.pipeline.schedules import (
    SCHEDULES,
    GPipe,
    OneFOneB,
    Schedule,
    bubble_fraction,
    get_schedule,
)
from phalanx.parallel.pipeline.stage import PipelineStage

__all__ = [
    "Partition",
    "block_costs",
    "min_bottleneck_split",
    "partition",
    "uniform_split",
    "SCHEDULES",
    "GPipe",
    "OneFOneB",
    "Schedule",
    "bubble_fraction",
    "get_schedule",
    "PipelineStage",
]

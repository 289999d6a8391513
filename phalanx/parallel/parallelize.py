"""``parallelize(model, mesh, …)``: tensor, then pipeline, then data parallel, in that fixed order.

Why this order (torchtitan's rule: each step must see the model the previous one left):

1. **Partition decision** on the full model (costs of whole blocks), made before
   anything is cut so every rank agrees on the same stage bounds.
2. **Tensor parallel** rewrites layers inside blocks. It must come before the
   pipeline split because the plan names sub-modules by their path in the full
   model (``block3.mlp.fc``), and the cut layers' shapes are what a stage sends.
3. **Pipeline**: keep only this rank's stage (a slice of the ``nn.Sequential``).
4. **Data parallel** last: it averages the gradients of exactly the parameters
   this rank ends up holding (a TP shard of a PP stage), over the ranks holding
   the same shard — the dp group of the mesh.

Data flow of one step on rank (d, s, t)::

    local batch ─▶ [stage s of replica d; TP layers all-reduce over tp group]
                   ─▶ p2p to (d, s+1, t) … loss on the last stage
                   ◀─ grads back through the stages (1F1B / GPipe)
    then  grads all-reduced (average) over the dp group {(·, s, t)}

Example::

    mesh = DeviceMesh(dp=1, pp=2, tp=2)
    pm = parallelize(GPT(cfg), mesh, tp_plan=gpt_tp_plan(model), num_microbatches=4,
                     loss_fn=lambda out, y: vocab_parallel_cross_entropy(out, y, mesh.tp_group))
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(x, y); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from phalanx.comm.collectives import Average, allreduce, broadcast, broadcast_object
from phalanx.parallel.mesh import DeviceMesh
from phalanx.parallel.pipeline import PipelineStage, partition
from phalanx.parallel.tensor import apply_tensor_parallel

__all__ = ["parallelize", "ParallelModel"]


class ParallelModel(nn.Module):
    """This rank's piece of the model and the step that trains it.

    ``step(inputs, targets)`` runs forward and backward of the local batch
    (``inputs`` are used on the first stage, ``targets`` on the last), leaves
    dp-averaged gradients in ``.grad`` and returns the batch loss, averaged over
    the dp group, on every rank.
    """

    def __init__(self, stage: PipelineStage, mesh: DeviceMesh, num_microbatches: int, schedule,
                 bounds: tuple[int, ...]) -> None:
        super().__init__()
        self.module = stage.module  # the plain stage (parameter names as in the full model)
        self.stage = stage
        self.mesh = mesh
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.bounds = bounds
        self._dp = None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a ParallelModel trains with .step(inputs, targets); its stage's module is .module")

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        loss = self.stage.step(inputs if self.stage.is_first else None,
                               targets if self.stage.is_last else None,
                               num_microbatches=self.num_microbatches, schedule=self.schedule)
        self._sync_grads()
        # Every rank reports the loss: the last stage broadcasts it along the pipeline,
        # then the dp replicas average theirs (equal local batches -> the global mean).
        if loss is None:
            loss = torch.zeros((), device=self.stage._device())
        loss = broadcast(loss, root_rank=self.mesh.pp_ranks[-1], group=self.mesh.pp_group, name="pp.loss")
        return allreduce(loss, op=Average, group=self.mesh.dp_group, name="dp.loss")

    def _sync_grads(self) -> None:
        if self.mesh.dp == 1 or self._dp is not None:
            return  # DataParallel already averaged the gradients inside the last backward
        # Fallback when phalanx.parallel.data is missing: average each gradient over the
        # dp group once per step with the plain collective (correct, not overlapped).
        for p in self.module.parameters():
            if p.grad is not None:
                allreduce(p.grad, op=Average, group=self.mesh.dp_group, inplace=True, name="dp.grad")


def parallelize(
    model: nn.Sequential,
    mesh: DeviceMesh,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tp_plan: dict[str, str] | None = None,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    partition_method: str = "parameters",
    sample: torch.Tensor | None = None,
    checkpoint: bool = False,
    sync_init: bool = True,
    data_parallel: str = "auto",
) -> ParallelModel:
    """Cut ``model`` (an ``nn.Sequential`` of blocks, same weights on every rank) over ``mesh``.

    ``data_parallel="auto"`` uses ``phalanx.parallel.data.DataParallel`` when it is
    installed; ``"allreduce"`` averages each gradient once per step with a plain
    collective instead (no buckets, no overlap).
    """
    if data_parallel not in ("auto", "allreduce"):
        raise ValueError(f"data_parallel={data_parallel!r}: use 'auto' or 'allreduce'")
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"parallelize needs an nn.Sequential of blocks, got {type(model).__name__}")
    if mesh.tp > 1 and not tp_plan:
        raise ValueError(f"mesh has tp={mesh.tp} but tp_plan is empty: pass tp_plan={{name: 'colwise'|'rowwise'|'vocab'}}")
    d, s, t = mesh.coord

    # 1. Decide the split on the whole model; rank 0's choice wins, since measured costs
    #    ("time") differ from rank to rank and every rank must cut at the same place.
    bounds = partition(model, mesh.pp, method=partition_method, sample=sample).bounds
    bounds = tuple(broadcast_object(bounds, root_rank=0))

    # 2. Tensor parallel on the full model: plan names are full-model paths.
    if tp_plan and mesh.tp > 1:
        apply_tensor_parallel(model, tp_plan, mesh.tp_group)

    # 3. Pipeline: keep this rank's slice of the blocks.
    children = list(model.named_children())
    stage_module = nn.Sequential(OrderedDict(children[bounds[s] : bounds[s + 1]]))
    stage = PipelineStage(stage_module, s, mesh.pp, ranks=mesh.pp_ranks, group=mesh.pp_group,
                          loss_fn=loss_fn if s == mesh.pp - 1 else None, checkpoint=checkpoint)

    # 4. Data parallel: replicas of the same (stage, shard) start equal and average gradients.
    #    DataParallel (bucketed, overlapped with the last micro-batch's backward) when it is
    #    installed; its no_sync() keeps the other micro-batches' backwards local.
    pm = ParallelModel(stage, mesh, num_microbatches, schedule, bounds)
    if mesh.dp > 1:
        DataParallel = None
        if data_parallel == "auto":
            try:
                from phalanx.parallel.data import DataParallel
            except ImportError:
                pass
        if DataParallel is not None:
            # It broadcasts the parameters from the dp group's first rank when it wraps.
            pm._dp = DataParallel(stage_module, group=mesh.dp_group, broadcast_buffers=False)
            stage.module, stage.no_sync = pm._dp, pm._dp.no_sync
        elif sync_init:
            for p in stage_module.parameters():
                broadcast(p.data, root_rank=mesh.dp_ranks[0], group=mesh.dp_group, inplace=True, name="dp.init")
    return pm

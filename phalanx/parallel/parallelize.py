"""``parallelize(model, mesh, …)``: tensor, then pipeline, then data parallel or ZeRO, in that fixed order.

Why this order (torchtitan's rule: each step must see the model the previous one left):

1. **Partition decision** on the full model (costs of whole blocks), made before
   anything is cut so every rank agrees on the same stage bounds.
2. **Tensor parallel** rewrites layers inside blocks. It must come before the
   pipeline split because the plan names sub-modules by their path in the full
   model (``block3.mlp.fc``), and the cut layers' shapes are what a stage sends.
2b. **Expert parallel** (mesh ``ep > 1``): each MoE layer keeps its E/ep experts and
   dispatches over the ep group (:mod:`phalanx.parallel.expert`); after tensor parallel
   (the plan leaves experts whole) and before the cut, like the plan it finds layers
   by their path in the full model.
3. **Pipeline**: keep only this rank's stage (a slice of the ``nn.Sequential``;
   with ``schedule="interleaved_1f1b"`` the model is cut in 2·pp pieces and the
   rank keeps pieces s and s + pp, its virtual stages).
4. **Data parallel or ZeRO** last: it averages the gradients of exactly the
   parameters this rank ends up holding (a TP shard of a PP stage), over the
   ranks holding the same shard — the dp group of the mesh. ZeRO
   (``data_parallel="zero1"|"zero2"|"zero3"``) also shards the optimizer state
   (and gradients, parameters) of that piece over the same dp group, so it
   needs the optimizer: pass ``optimizer=lambda params: torch.optim.AdamW(params)``.
   With ``ep > 1`` the weights that are not experts are averaged over the dense group
   (dp × ep ranks, each with its own tokens) and the experts over dp (their gradient
   divided by ep: the all-to-all already summed the ep group's tokens into it), with
   the plain per-step all-reduce; ZeRO there is :func:`phalanx.parallel.expert.expert_parallel`'s.

Data flow of one step on rank (d, s, t)::

    local batch ─▶ [stage s of replica d; TP layers all-reduce over tp group]
                   ─▶ p2p to (d, s+1, t) … loss on the last stage
                   ◀─ grads back through the stages (1F1B / GPipe)
    then  grads all-reduced (average) over the dp group {(·, s, t)}
          (ZeRO: reduce-scattered to their owners in that group, at step or in backward)

Example::

    mesh = RankGrid(dp=1, pp=2, tp=2)
    pm = parallelize(GPT(cfg), mesh, tp_plan=gpt_tp_plan(model), num_microbatches=4,
                     loss_fn=lambda out, y: vocab_parallel_cross_entropy(out, y, mesh.tp_group))
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(x, y); opt.step(); opt.zero_grad()

    # 3D with ZeRO-1 on the data-parallel axis (here dp=2, pp=2 on 4 ranks):
    pm = parallelize(GPT(cfg), RankGrid(dp=2, pp=2), loss_fn=F.cross_entropy, num_microbatches=4,
                     data_parallel="zero1", optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    loss = pm.step(x, y); pm.optimizer.step(); pm.optimizer.zero_grad()
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from phalanx.comm.collectives import Average, allreduce, broadcast, broadcast_object
from phalanx.parallel import composition
from phalanx.parallel.clip import clip_grad_norm_
from phalanx.parallel.expert.data import scale_expert_grads
from phalanx.parallel.expert.shard import moe_layers, shard_experts, split_named_parameters
from phalanx.parallel.grid import RankGrid
from phalanx.parallel.pipeline import PipelineStage, Schedule, get_schedule, partition
from phalanx.parallel.pipeline.by_path import tied_of
from phalanx.parallel.tensor import apply_tensor_parallel

__all__ = ["parallelize", "ParallelModel"]

_DATA_PARALLEL = composition.DATA_PARALLEL_NAMES  # the list the planner searches too


class ParallelModel(nn.Module):
    """This rank's piece of the model and the step that trains it.

    ``step(inputs, targets)`` runs forward and backward of the local batch
    (``inputs`` are used on the first stage, ``targets`` on the last), leaves
    dp-averaged gradients in ``.grad`` (ZeRO: in its shards, reduced by
    ``optimizer.step()``) and returns the batch loss, averaged over the dp
    group, on every rank. ``optimizer`` is the one built from ``optimizer=``
    (a ``ZeroOptimizer`` under ZeRO), else ``None``.
    """

    def __init__(self, module: nn.Module, stage: PipelineStage, mesh: RankGrid, num_microbatches: int, schedule,
                 bounds: tuple[int, ...]) -> None:
        super().__init__()
        self.module = module  # this rank's blocks, unwrapped, named as in the full model
        self.stage, self.mesh, self.bounds = stage, mesh, bounds
        self.num_microbatches, self.schedule = num_microbatches, schedule
        self.optimizer = None
        self._grads_reduced = mesh.dp * mesh.ep == 1  # True when DataParallel or ZeRO owns the dp reduction
        self._experts: set[int] = set()  # ids of expert weights: reduced over dp, the rest over dp × ep
        self._sharded = False  # ZeRO holds the gradients (and clips them)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a ParallelModel trains with .step(inputs, targets); its stage's module is .module")

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        for role, value in (("inputs", inputs), ("targets", targets)):
            if isinstance(value, Mapping):  # an HF-style batch {'input_ids': ..., 'labels': ...}
                raise TypeError(f"ParallelModel.step: {role} is a dict (keys {', '.join(map(repr, value))}); pass "
                                "tensors: pm.step(batch['input_ids'], batch['labels'])")
        loss = self.stage.step(inputs if self.stage.is_first else None,
                               targets if self.stage.is_last else None,
                               num_microbatches=self.num_microbatches, schedule=self.schedule)
        if not self._grads_reduced:
            # Plain fallback: average each gradient over the dp group once per step (not overlapped).
            for p in self.module.parameters():
                if p.grad is not None:
                    group = self.mesh.dp_group if id(p) in self._experts else self.mesh.dense_group
                    allreduce(p.grad, op=Average, group=group, inplace=True, name="dp.grad")
        # Every rank reports the loss: the pipeline shares its last stage's, then the dp
        # replicas average theirs (equal local batches -> the global mean).
        loss = self.stage.share_loss(loss)
        return allreduce(loss, op=Average, group=self.mesh.dense_group, name="dp.loss")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After :meth:`step`: clip ``.grad`` by the whole model's norm (every stage, every TP shard, a
        tied head once, the experts summed over ep; :func:`phalanx.parallel.clip.clip_grad_norm_`). Returns that
        norm. Every rank calls it."""
        if self._sharded:
            raise ValueError("ParallelModel.clip_grad_norm_: under ZeRO the gradients live in its shards; pass "
                             "zero_options={'max_grad_norm': ...} to parallelize (ZeRO clips by the whole model's norm)")
        return clip_grad_norm_(self.module, max_norm, tp_group=self.mesh.tp_group if self.mesh.tp > 1 else None,
                               pp_group=self.mesh.pp_group if self.mesh.pp > 1 else None,
                               ep_group=self.mesh.ep_group if self.mesh.ep > 1 else None)


def parallelize(
    model: nn.Module,
    mesh: RankGrid,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tp_plan: dict[str, str] | None = None,
    num_microbatches: int = 1,
    schedule: str | Schedule = "1f1b",
    partition_method: str = "parameters",
    sample: torch.Tensor | None = None,
    checkpoint: bool = False,
    sync_init: bool = True,
    data_parallel: str = "auto",
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    zero_options: dict | None = None,
) -> ParallelModel:
    """Cut ``model`` (an ``nn.Sequential`` of blocks, or an HF / torchtitan causal LM cut by module
    path; same weights on every rank) over ``mesh``.

    For a model that is not an ``nn.Sequential``, ``tp_plan=None`` takes the family's Megatron plan
    (:func:`phalanx.parallel.plans.tp_plan`), the loss must be ``vocab_parallel_cross_entropy`` over
    ``mesh.tp_group`` when tp > 1 (the logits stay cut by vocabulary), and ``checkpoint=True``
    recomputes each block in backward.

    ``data_parallel`` picks what runs on the dp axis: ``"auto"`` uses
    ``phalanx.parallel.data.DataParallel`` when it is installed; ``"allreduce"``
    averages each gradient once per step with a plain collective (no buckets, no
    overlap); ``"zero1"`` / ``"zero2"`` / ``"zero3"`` shard optimizer state /
    + gradients / + parameters over the dp group with :func:`phalanx.parallel.zero.zero`
    and need ``optimizer`` (a function from parameters to a torch optimizer).
    With ``optimizer`` given, ``pm.optimizer`` is the optimizer to step. ``zero_options``: more
    arguments for :func:`phalanx.parallel.zero.zero` (``mixed_precision="bf16"``, ``state_bits=8``, …).
    An interleaved schedule (several chunks per stage) averages gradients with
    the plain all-reduce under ``"auto"``: the bucketed engine reduces in the
    step's last backward, which touches only one chunk; ZeRO is refused there.
    """
    if data_parallel not in _DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r}: use one of {', '.join(map(repr, _DATA_PARALLEL))}")
    zero_stage = int(data_parallel[-1]) if data_parallel.startswith("zero") else 0
    if zero_stage and optimizer is None:
        raise ValueError(f"data_parallel={data_parallel!r} shards the optimizer, so it must build it: "
                         "pass optimizer=lambda params: torch.optim.AdamW(params, lr=...)")
    if zero_options and not zero_stage:
        raise ValueError(f"zero_options={zero_options!r} are for ZeRO: pass data_parallel='zero1'|'zero2'|'zero3' "
                         f"(got {data_parallel!r})")
    if zero_options and mesh.dp == 1:
        raise ValueError(f"zero_options={zero_options!r}: ZeRO shards over the dp axis and this mesh has dp=1, so "
                         "no ZeRO runs and these options would be ignored; use a mesh with dp > 1, or drop "
                         "zero_options (clip with pm.clip_grad_norm_)")
    if optimizer is not None and not callable(optimizer):
        raise TypeError("optimizer= must be a function from parameters to an optimizer, "
                        "e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)")
    by_path = not isinstance(model, nn.Sequential)
    if by_path:
        _refuse_by_path(model, mesh, schedule, tp_plan)
    elif mesh.tp > 1 and not tp_plan:
        raise ValueError(f"mesh has tp={mesh.tp} but tp_plan is empty: pass tp_plan={{name: 'colwise'|'rowwise'|'vocab'}}")
    if mesh.ep > 1 and zero_stage:
        raise ValueError(f"data_parallel={data_parallel!r} with ep={mesh.ep} is not supported by parallelize: the "
                         "experts and the other weights reduce over different groups; use data_parallel='allreduce', "
                         "or phalanx.parallel.expert.expert_parallel for ZeRO on a dp × ep mesh")
    d, s, t = mesh.coord
    if by_path:
        return _parallelize_by_path(model, mesh, loss_fn=loss_fn, tp_plan=tp_plan, num_microbatches=num_microbatches,
                                    schedule=schedule, partition_method=partition_method, checkpoint=checkpoint,
                                    sync_init=sync_init, data_parallel=data_parallel, optimizer=optimizer,
                                    zero_options=zero_options)
    chunks = getattr(get_schedule(schedule), "chunks", 1)
    if chunks > 1 and zero_stage and mesh.dp > 1:
        raise ValueError(f"data_parallel={data_parallel!r} with an interleaved schedule ({chunks} chunks per stage) "
                         "is not supported: ZeRO reduces in the step's last backward, which reaches one chunk only; "
                         "use data_parallel='allreduce' or schedule='1f1b'")

    # 1. Decide the split on the whole model; rank 0's choice wins, since measured costs
    #    ("time") differ from rank to rank and every rank must cut at the same place.
    bounds = partition(model, mesh.pp * chunks, method=partition_method, sample=sample).bounds
    bounds = tuple(broadcast_object(bounds, root_rank=0))

    # 2. Tensor parallel on the full model: plan names are full-model paths.
    if tp_plan and mesh.tp > 1:
        apply_tensor_parallel(model, tp_plan, mesh.tp_group)

    # 2b. Expert parallel: every MoE layer keeps its experts (full-model paths, like the plan).
    layers = moe_layers(model)
    if mesh.ep > 1:
        shard_experts(model, mesh.ep_group)
    for _, moe in layers:  # each micro-batch's loss counts 1/m; so does its balance loss
        moe.aux_grad_scale = 1.0 / num_microbatches
    experts = {id(p) for _, p in split_named_parameters(model)[1]} if layers else set()

    # 3. Pipeline: keep this rank's slice of the blocks (its virtual stages s, s + pp, …
    #    when interleaved). stage_module holds them all under their full-model names.
    children = list(model.named_children())
    pieces = [OrderedDict(children[bounds[k] : bounds[k + 1]]) for k in range(s, len(bounds) - 1, mesh.pp)]
    stage_module = nn.Sequential(OrderedDict(kv for piece in pieces for kv in piece.items()))
    stage = PipelineStage(stage_module if chunks == 1 else [nn.Sequential(piece) for piece in pieces], s, mesh.pp,
                          ranks=mesh.pp_ranks, group=mesh.pp_group, grad_group=mesh.pp_grad_group,
                          loss_fn=loss_fn if s == mesh.pp - 1 else None, checkpoint=checkpoint)
    pm = ParallelModel(stage_module, stage, mesh, num_microbatches, schedule, bounds)
    pm._experts = experts
    if mesh.ep > 1:
        scale_expert_grads([(n, p) for n, p in stage_module.named_parameters() if id(p) in experts], mesh.ep)

    # 4. Data parallel or ZeRO over the ranks holding the same (stage, TP shard). Last,
    #    because it must see exactly the parameters this rank keeps after steps 2 and 3.
    return _data_axis(pm, stage, stage_module, mesh, data_parallel, optimizer, chunks, experts, sync_init,
                      zero_options)


def _data_axis(pm, stage, stage_module, mesh, data_parallel, optimizer, chunks, experts, sync_init,
               zero_options=None):
    """Step 4: ZeRO, or the optimizer and DataParallel (or the plain per-step fallback), over dp."""
    zero_stage = int(data_parallel[-1]) if data_parallel.startswith("zero") else 0
    if zero_stage and mesh.dp > 1:
        from phalanx.parallel.zero import zero

        # ZeRO starts every replica from the dp group's first rank and reduces the gradients
        # itself; each micro-batch is one backward pass, so a step is m passes (stage 1 then
        # reduces once per step, in the last micro-batch's backward).
        # A head tied across stages (cut by module path): ZeRO sums its copies over the pipeline.
        # tp_group / pp_group: max_grad_norm clips by the whole model's norm, not this piece's.
        tied = mesh.pp_group if tied_of(stage_module) else None
        _, pm.optimizer = zero(stage_module, optimizer(stage_module.parameters()), stage=zero_stage,
                               group=mesh.dp_group, backward_passes_per_step=pm.num_microbatches,
                               tied_group=tied, tp_group=mesh.tp_group if mesh.tp > 1 else None,
                               pp_group=mesh.pp_group if mesh.pp > 1 else None, **(zero_options or {}))
        pm._grads_reduced = pm._sharded = True
        return pm
    if optimizer is not None:
        pm.optimizer = optimizer(stage_module.parameters())
    if mesh.dp * mesh.ep > 1:
        DataParallel = None
        if data_parallel == "auto" and chunks == 1 and mesh.ep == 1:
            try:
                from phalanx.parallel.data import DataParallel
            except ImportError:
                pass
        if DataParallel is not None:
            # Bucketed and overlapped with the last micro-batch's backward; its no_sync()
            # keeps the other micro-batches' backwards local. It broadcasts the parameters
            # from the dp group's first rank when it wraps.
            dp = DataParallel(stage_module, group=mesh.dp_group, broadcast_buffers=False)
            stage.module, stage.no_sync = dp, dp.no_sync
            pm._grads_reduced = True
        elif sync_init:
            for p in stage_module.parameters():
                ranks, group = (mesh.dp_ranks, mesh.dp_group) if id(p) in experts else (mesh.dense_ranks, mesh.dense_group)
                broadcast(p.data, root_rank=ranks[0], group=group, inplace=True, name="dp.init")
    return pm


def _refuse_by_path(model: nn.Module, mesh: RankGrid, schedule, tp_plan) -> None:
    """What parallelize does not do to a model cut by module path, each in one line."""
    name = type(model).__name__
    if mesh.ep > 1:
        raise ValueError(f"parallelize: ep={mesh.ep} on {name} (not an nn.Sequential) is not supported; "
                         "use phalanx.parallel.expert.expert_parallel, or pass an nn.Sequential of blocks")
    if getattr(get_schedule(schedule), "chunks", 1) > 1:
        raise ValueError(f"parallelize: schedule={schedule!r} keeps several chunks per stage, which needs an "
                         f"nn.Sequential; {name} is cut by module path into one stage per rank: use '1f1b' or 'gpipe'")
    if tp_plan is not None and not isinstance(tp_plan, dict):
        raise TypeError(f"tp_plan= must be a dict of module path -> style, got {type(tp_plan).__name__}")


def _parallelize_by_path(model: nn.Module, mesh: RankGrid, *, loss_fn, tp_plan, num_microbatches, schedule,
                         partition_method, checkpoint, sync_init, data_parallel, optimizer,
                         zero_options) -> ParallelModel:
    """:func:`parallelize` for a model that is not an ``nn.Sequential`` (HF, torchtitan): the same four
    steps, with the family's Megatron plan (:func:`phalanx.parallel.plans.apply_tp_plan`) when
    ``tp_plan`` is None, the pipeline cut by module path (:func:`split_by_path`) and, with
    ``checkpoint=True``, every block recomputed (:func:`recompute_blocks`, so that ZeRO-3 gathers a
    block's parameters again for its recompute). ``pm.module`` is the stage (a ``StageOfModel``);
    ``pm.module.model`` the model itself, under its own parameter names."""
    from phalanx.parallel.pipeline import recompute_blocks, split_by_path
    from phalanx.parallel.plans import apply_tp_plan

    s = mesh.coord[1]
    plan = partition(model, mesh.pp, method=partition_method)
    boundaries = list(broadcast_object(plan.boundaries(model), root_rank=0))
    if mesh.tp > 1:
        apply_tp_plan(model, mesh.tp_group, tp_plan)
    if checkpoint:
        recompute_blocks(model)
    stage_module = split_by_path(model, boundaries, s)
    stage = PipelineStage(stage_module, s, mesh.pp, ranks=mesh.pp_ranks, group=mesh.pp_group,
                          grad_group=mesh.pp_grad_group, loss_fn=loss_fn if s == mesh.pp - 1 else None)
    pm = ParallelModel(stage_module, stage, mesh, num_microbatches, schedule, plan.bounds)
    return _data_axis(pm, stage, stage_module, mesh, data_parallel, optimizer, 1, set(), sync_init, zero_options)

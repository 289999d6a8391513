"""Pipeline stages of a model that is not an ``nn.Sequential``, cut by module path (torchtitan's way).

A transformer is an embedding, a stack of blocks (an ``nn.ModuleList`` or ``nn.ModuleDict``:
``transformer.h`` in HF GPT-2, ``model.layers`` in HF Llama, ``layers`` in torchtitan) and a
head. Stage s keeps its own modules and the model's code runs unchanged; what belongs to
other stages is swapped for a stand-in that passes the activation through::

    stage 0          [embed] [wpe] [block 0] [block 1] (pass) (pass) (Identity) (Identity)   → hidden
    stage 1   hidden → (pass) (zeros) (pass) (pass) [block 2] [block 3] [norm] [head]       → logits

* blocks of other stages → :class:`PassThrough` (returns its first argument, which is what
  a block returns in HF and torchtitan);
* modules with parameters before the blocks → stage 0 only: the input embedding is skipped
  by feeding hidden states as ``inputs_embeds=`` (HF) or passed through (torchtitan); other
  embeddings (GPT-2's learned positions) become :class:`Zeros`, since stage 0 already added them;
* modules with parameters after the blocks (final norm, head) → the last stage only; others
  get ``nn.Identity``, so the model returns the hidden state as its "logits";
* modules without parameters (dropout, rotary position tables) run on every stage.

A parameter shared by modules of two stages (a head tied to the embedding, as GPT-2 and small
Llamas build it) stays on every stage that uses it, each holding a copy of the same values
(Megatron-LM's tied embedding, Shoeybi et al. 2019, arXiv:1909.08053): the stage lists it in
``tied_across_stages`` and :class:`PipelineStage` makes the copies equal at its first step and sums
their gradients after every step, so the same optimizer step keeps them equal. Only the stages
holding a copy take part (:func:`holder_groups`: a group of its holders per tied parameter,
Megatron's embedding group); a stage between them without a copy does nothing for it. Under ZeRO
(``px.zero(stage, opt, tied_group=pipeline_group)``) ZeRO does both instead
(``tied_summed_by = "zero"``): it sums the copies' gradient shards after its own reduction
(:mod:`phalanx.parallel.zero.tied`).

Example::

    from phalanx.parallel.pipeline import PipelineStage, partition, split_by_path
    plan = partition(model, 2, method="parameters")            # any HF / torchtitan causal LM
    stage = split_by_path(model, plan.boundaries(model), px.rank())
    pipe = PipelineStage(stage, px.rank(), 2, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

__all__ = ["PassThrough", "Zeros", "find_blocks", "split_by_path", "StageOfModel", "TiedParameter", "tied_of", "holder_groups", "held_sets",
           "path_costs", "recompute_blocks"]


@dataclasses.dataclass(frozen=True)
class TiedParameter:
    """A parameter the modules of several stages share (a head tied to the input embedding)."""

    name: str
    """its name on the first stage that holds it (``transformer.wte.weight``)"""
    stages: tuple[int, ...]
    """the stages holding a copy (first and last for a tied head)"""
    shape: tuple[int, ...]
    param: nn.Parameter | None
    """this stage's copy; None on a stage that does not use it (it sends zeros in the sum)"""


class PassThrough(nn.Module):
    """A block of another stage: returns its first argument (the hidden state), ignores the rest."""

    def forward(self, x, *args, **kwargs):
        return x


class Zeros(nn.Module):
    """An embedding already added on stage 0 (learned positions): adds nothing on later stages."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The stack of blocks: the ``nn.ModuleList`` / ``nn.ModuleDict`` with the most children.

    Returns its path and its blocks' paths (``("model.layers", ["model.layers.0", …])``).
    """
    best = None
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        raise TypeError(f"pipeline by module path: {type(model).__name__} has no nn.ModuleList / nn.ModuleDict "
                        "of blocks to split; pass an nn.Sequential or a list of blocks")
    name, stack = best
    return name, [f"{name}.{k}" if name else k for k, _ in stack.named_children()]


def _recomputed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_blocks(model: nn.Module) -> nn.Module:
    """Each block of ``model``'s stack recomputed in backward (per-block activation checkpointing,
    Chen et al. 2016, arXiv:1604.06174; non-reentrant ``torch.utils.checkpoint``), in place.

    The block's ``forward`` is wrapped on the instance, so module paths and state-dict keys stay
    as they were and the block's own hooks (ZeRO-3 gathers its parameters in them) run outside the
    recomputed region, once in forward and again when backward recomputes it. For a model with no
    switch of its own (torchtitan); HF models have ``gradient_checkpointing_enable()``.
    """
    _, blocks = find_blocks(model)
    for b in blocks:
        block = model.get_submodule(b)
        if not isinstance(block.forward, functools.partial):  # twice is once
            block.forward = functools.partial(_recomputed, block.forward)
    return model


def _outer_modules(model: nn.Module, stack: str) -> tuple[list[str], list[str]]:
    """Modules with parameters of their own outside the stack, before it and after it (registration order)."""
    before, after, seen_stack = [], [], False
    for name, m in model.named_modules():
        if name == stack or name.startswith(stack + "."):
            seen_stack = True
            continue
        side = after if seen_stack else before
        if any(True for _ in m.parameters(recurse=False)) and not any(name.startswith(o + ".") for o in side):
            side.append(name)
    return before, after


def path_costs(model: nn.Module, method: str) -> list[float]:
    """Each block's cost ("uniform" or "parameters"); the embedding's parameters count in the first
    block, the norm's and head's in the last, since those stages run them."""
    if method not in ("uniform", "parameters"):
        raise ValueError(f"partition(method={method!r}) of a model split by module path: use 'uniform' or "
                         "'parameters' (timing a block alone needs the arguments the model's forward gives it)")
    stack, blocks = find_blocks(model)
    if method == "uniform":
        return [1.0] * len(blocks)
    costs = [float(sum(p.numel() for p in model.get_submodule(b).parameters())) for b in blocks]
    before, after = _outer_modules(model, stack)
    seen: set[int] = set()
    for b in blocks:
        seen.update(id(p) for p in model.get_submodule(b).parameters())

    def own(names):
        total = 0
        for n in names:
            for p in model.get_submodule(n).parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return float(total)

    costs[0] += own(before)
    costs[-1] += own(after)
    return costs


class StageOfModel(nn.Module):
    """The whole model with other stages' modules swapped out; ``forward(x)`` → tensor.

    Stage 0 takes the model's input (token ids); later stages take the hidden state, fed as
    ``inputs_embeds=`` when the model's forward has that argument (HF), else positionally.
    Returns the output's ``logits`` (the hidden state on all but the last stage) or the output itself.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, hidden_kwarg: str | None,
                 tied_across_stages: Sequence[TiedParameter] = ()) -> None:
        super().__init__()
        self.model = model
        self.stage_index, self.num_stages = stage_index, num_stages
        self.hidden_kwarg = hidden_kwarg
        self.tied_across_stages = list(tied_across_stages)
        # Who keeps the copies equal: "pipeline" (PipelineStage: a broadcast at the first step, the
        # copies' .grad summed after each) or "zero" (px.zero(..., tied_group=): at wrap, and the
        # copies' reduced gradient shards summed in step(), as it holds the gradients).
        self.tied_summed_by = "pipeline"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage_index > 0 and self.hidden_kwarg:
            out = self.model(**{self.hidden_kwarg: x})
        else:
            out = self.model(x)
        return out.logits if hasattr(out, "logits") else out


def tied_of(module) -> list[TiedParameter]:
    """The parameters ``module`` shares with other pipeline stages: a :class:`StageOfModel`'s
    ``tied_across_stages``; none for any other module (or a bare list of parameters)."""
    return module.tied_across_stages if isinstance(module, StageOfModel) else []


def holder_groups(tied: Sequence[TiedParameter], group) -> dict[tuple[int, ...], object]:
    """The process group of each set of stages holding a tied copy, for the sets this stage is in.

    ``group``: the pipeline's process group, group rank s running stage s. Returns ``{stages: group}``
    (``stages`` as in :attr:`TiedParameter.stages`): ``group`` itself for a set that is every stage
    (two stages, or a copy on each), else a group of those stages only, so that with 3 or more stages
    the copies' sums and broadcasts leave the stages between them alone (Megatron-LM's embedding
    group of the first and last stage, Shoeybi et al. 2019, arXiv:1909.08053: it makes one per
    pipeline on every rank, ``parallel_state.initialize_model_parallel``). A stage in no set gets ``{}``.

    ``dist.new_group`` is collective over the whole world, in one order, so every rank makes the
    group of every set of every pipeline replica (dp x tp of them). The pipeline's group alone does
    not say who the other replicas are, so when it is not the whole world, each rank's pipeline
    ranks are gathered once over the world (``all_gather_object``): a plain pipeline group works
    without a :class:`~phalanx.parallel.grid.RankGrid`, and the grid need not know which stages a
    model's split ties (that depends on the model). Hence every rank of the world calls this at
    once, as they build a ``RankGrid``: ``px.zero(..., tied_group=)`` at wrap, :class:`PipelineStage`
    at its first step. ``use_local_synchronization=True`` (only members call) is not used: it names
    a group from its ranks and the number of groups this rank has, which a middle stage, never in
    the holders' groups, counts differently.

    Example::

        groups = holder_groups(stage.tied_across_stages, mesh.pp_group)   # every rank, at once
        for stages, g in groups.items(): ...                             # this stage's holder sets
    """
    if not tied or not dist.is_initialized():
        return {}
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    sets = sorted({tuple(t.stages) for t in tied})
    out = {s: group for s in sets if len(s) == n and me in s}
    subsets = [s for s in sets if len(s) < n]
    if not subsets:  # every set is the whole pipeline (two stages): its own group, no collective
        return out
    mine = tuple(dist.get_global_rank(group, s) for s in range(n))
    if n == dist.get_world_size():
        pipelines = [mine]
    else:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, subsets))
        if any(sub != subsets for _, sub in every):
            raise ValueError(f"tied parameters: the pipelines tie different stages ({sorted({tuple(s) for _, s in every})}); "
                             "split the same model at the same boundaries on every pipeline")
        pipelines = sorted({p for p, _ in every})
    for pipeline in pipelines:  # the same order on every rank
        for s in subsets:
            ranks = sorted(pipeline[i] for i in s)
            g = dist.new_group(ranks)
            if pipeline == mine and me in s:
                out[s] = g
    return out


def held_sets(tied: Sequence[TiedParameter], groups: dict) -> list[tuple[tuple[int, ...], object, list]]:
    """``(stages, their group, the copies this stage holds)`` per set of holders this stage is in, in the
    same order on every holder (none on a stage without a copy); ``groups`` from :func:`holder_groups`."""
    sets: dict[tuple[int, ...], list] = {}
    for t in tied:
        if t.param is not None:
            sets.setdefault(tuple(t.stages), []).append(t)
    return [(s, groups[s], ts) for s, ts in sorted(sets.items())]


def _set(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if isinstance(owner, nn.ModuleDict):
        owner[leaf] = module
    else:
        setattr(owner, leaf, module)


def split_by_path(model: nn.Module, boundaries: Sequence[str], stage_index: int) -> StageOfModel:
    """Stage ``stage_index`` of ``model`` cut before each block path in ``boundaries``, in place.

    ``boundaries``: the first block of every stage but the first (``["model.layers.2"]`` makes
    two stages); :meth:`~phalanx.parallel.pipeline.Partition.boundaries` gives a balanced set.
    The model is changed in place (the other stages' modules are dropped: build the full model
    on every rank, or on the ``meta`` device and materialise after the split).
    """
    stack, blocks = find_blocks(model)
    where = {b: i for i, b in enumerate(blocks)}
    bad = [b for b in boundaries if b not in where or where[b] == 0]
    if bad:
        raise ValueError(f"pipeline boundaries {bad}: each must name a block of {stack!r} other than the first "
                         f"(one of {blocks[1:3] + ['…'] if len(blocks) > 3 else blocks[1:]})")
    cuts = [0] + sorted(where[b] for b in boundaries) + [len(blocks)]
    if len(set(cuts)) != len(cuts):
        raise ValueError(f"pipeline boundaries {list(boundaries)}: a block named twice makes an empty stage")
    num_stages = len(cuts) - 1
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index}: {list(boundaries)} make {num_stages} stages")
    before, after = _outer_modules(model, stack)
    first, last = stage_index == 0, stage_index == num_stages - 1
    mine = set(blocks[cuts[stage_index] : cuts[stage_index + 1]])
    holders: dict[int, dict[int, tuple[str, nn.Parameter]]] = {}  # parameter → {stage: (its name there, it)}
    for s in range(num_stages):
        names = blocks[cuts[s] : cuts[s + 1]] + (before if s == 0 else []) + (after if s == num_stages - 1 else [])
        for n in names:
            for pn, p in model.get_submodule(n).named_parameters():
                holders.setdefault(id(p), {}).setdefault(s, (f"{n}.{pn}", p))
    tied = []
    for by_stage in holders.values():
        if len(by_stage) > 1:
            tied_name, tied_param = by_stage[min(by_stage)]
            copy = by_stage[stage_index][1] if stage_index in by_stage else None
            tied.append(TiedParameter(tied_name, tuple(sorted(by_stage)), tuple(tied_param.shape), copy))
    hidden_kwarg = "inputs_embeds" if "inputs_embeds" in inspect.signature(model.forward).parameters else None
    input_embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for b in blocks:
        if b not in mine:
            _set(model, b, PassThrough())
    if not first:
        for i, n in enumerate(before):
            m = model.get_submodule(n)
            # the input embedding (the first, or HF's get_input_embeddings()) passes the hidden state on;
            # another embedding before the blocks (learned positions) was added on stage 0 already
            is_input = m is input_embedding if input_embedding is not None else i == 0
            _set(model, n, Zeros() if isinstance(m, nn.Embedding) and not is_input else PassThrough())
    if not last:
        for n in after:
            _set(model, n, nn.Identity())
    return StageOfModel(model, stage_index, num_stages, hidden_kwarg, tied)

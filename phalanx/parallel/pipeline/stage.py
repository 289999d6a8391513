"""One pipeline stage: its slice of the model, its neighbours, and its schedule.

Data flow for stage s of p (activations right, gradients left)::

    stage s-1 ──x_s (isend/recv)──▶ [ stage s: module ] ──y_s──▶ stage s+1
              ◀──dL/dx_s──────────                    ◀──dL/dy_s──

Three seams, one module each:

* :mod:`.link` — :class:`StageLink`, the point-to-point plumbing to the
  neighbours: shape header once, non-blocking sends, receive buffers recycled.
* :mod:`.executor` — :class:`~phalanx.parallel.pipeline.executor.StepRun`, one
  step of the schedule: receives posted ahead of the action that needs them,
  activation sends waited at their backward, ``no_sync`` for all but the last backward.
* here — the stage itself, and its gradient group: activations and gradients
  travel on two process groups (``grad_group``), one gloo connection per
  direction, because two neighbours sending to each other at once over one
  connection stalled a send by 4-7 ms here.

* Interleaved schedules: ``module`` is a list of v chunks, chunk c being virtual
  stage ``c·p + s``; a micro-batch leaving rank p-1's chunk c enters rank 0's
  chunk c+1. Each chunk has its own link, its messages tagged by stream.
* The last stage applies ``loss_fn(output, target) / m`` to each micro-batch;
  backward accumulates into ``.grad`` across the m micro-batches, so after
  ``step`` the gradients equal those of the mean loss over the whole batch.
* ``checkpoint=True`` recomputes the stage's activations in backward
  (``torch.utils.checkpoint``, non-reentrant): memory per micro-batch drops to
  its input, at about one extra forward.
* ``no_sync`` (a data-parallel wrapper's context manager): all backwards but the
  step's last run inside it, so gradients are reduced once per step.
* A parameter tied across stages (``module.tied_across_stages``, from
  :func:`~phalanx.parallel.pipeline.split_by_path`: a head tied to the embedding) has a copy on
  each stage using it: the first step broadcasts the first holder's values to the others, and
  every step ends with one all-reduce (sum) of those copies' gradients over the stages holding
  one (Megatron-LM's tied embedding and its embedding group; a middle stage takes no part), after
  the data-parallel reduction, so every copy takes the same optimizer step. Under ZeRO the module says ``tied_summed_by == "zero"`` and ZeRO does both
  (it holds the gradients, sharded: :mod:`phalanx.parallel.zero.tied`).
* Each forward, backward and receive wait is a :mod:`phalanx.trace` span
  (``pp.forward`` / ``pp.backward`` / ``pp.recv``, with ``mb`` = micro-batch), so
  ``phalanx run --timeline`` draws every stage's schedule; ``last_timeline``
  keeps the last step's compute spans for bubble measurements.

Example::

    stage = PipelineStage(my_layers, stage_index=px.rank(), num_stages=2,
                          loss_fn=torch.nn.functional.cross_entropy)
    loss = stage.step(x if stage.is_first else None, y if stage.is_last else None,
                      num_microbatches=4, schedule="1f1b")   # loss on the last stage, else None
    opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from phalanx.comm.collectives import Sum, allreduce, broadcast
from phalanx.log import get_logger
from phalanx.parallel.pipeline.by_path import held_sets, holder_groups, tied_of
from phalanx.parallel.pipeline.executor import Span, StepRun
from phalanx.parallel.pipeline.link import StageLink
from phalanx.parallel.pipeline.schedules import Schedule, get_schedule

_log = get_logger(__name__)

__all__ = ["PipelineStage", "StageLink", "Span"]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``; ``ranks[s]`` is the global rank running stage s.

    ``module`` is this stage's layers, or a list of v chunks for an interleaved
    schedule (chunk c is virtual stage ``c·p + stage_index`` of the v·p pieces).
    ``ranks`` defaults to ``range(num_stages)`` (a world that is one pipeline).
    ``group`` is the pipeline's process group (``None``: the world).
    ``recv_ahead`` bounds the receives a stage posts ahead when it is about to
    wait (``None``: all of the step's; each holds one input-sized buffer, so a
    stage keeps up to m input buffers instead of p; 1 posts only the next).
    ``grad_group`` carries the gradients (activations go on ``group``):
    ``"own"`` (default) makes a second group of the pipeline's ranks at the
    first step when the pipeline is the whole world (``dist.new_group``, which
    every rank of the world must call in the same order: every stage's first
    step); a pipeline on part of the world shares ``group`` then (a group made
    by only some ranks can hang, see :meth:`_make_grad_group`); a process
    group uses that one (``RankGrid`` makes one per pipeline on every rank,
    ``pp_grad_group``); pass ``group`` itself to share one.
    Why two: on gloo, one connection per pair of ranks carries both directions,
    and when two neighbours send to each other at the same moment (in 1F1B's
    steady state an activation one way, a gradient the other) a send can stall
    for 4-7 ms (measured on loopback; ``benchmarks/pipeline.py``); a
    connection per direction never did.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        stage_index: int,
        num_stages: int,
        *,
        ranks: Sequence[int] | None = None,
        group=None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        checkpoint: bool = False,
        no_sync=None,
        recv_ahead: int | None = None,
        grad_group="own",
    ) -> None:
        ranks = list(range(num_stages)) if ranks is None else [int(r) for r in ranks]
        if len(ranks) != num_stages:
            raise ValueError(f"ranks={ranks} must name one global rank per stage (num_stages={num_stages})")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index} must be in [0, num_stages={num_stages})")
        if stage_index == num_stages - 1 and loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn=(output, target) -> scalar")
        if recv_ahead is not None and (not isinstance(recv_ahead, int) or recv_ahead < 1):
            raise ValueError(f"recv_ahead={recv_ahead!r} must be a positive integer (receives posted ahead of "
                             "the one a stage waits on) or None (all of the step's)")
        self.recv_ahead = recv_ahead
        self.chunks = [module] if isinstance(module, nn.Module) else list(module)
        if not self.chunks or not all(isinstance(c, nn.Module) for c in self.chunks):
            raise TypeError("module must be an nn.Module or a non-empty list of nn.Module chunks")
        self.module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.ranks = ranks
        self.group = group
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        # A data-parallel wrapper's no_sync(): every backward but the step's last runs inside
        # it, so gradients are reduced once per step, not once per micro-batch.
        self.no_sync = no_sync
        v = len(self.chunks)
        if isinstance(grad_group, str) and grad_group != "own":
            raise ValueError(f"grad_group={grad_group!r}: pass 'own' (a group of its own, made at the first "
                             "step), a process group, or the activations' group to share it")
        self._own_grad_group = isinstance(grad_group, str)
        self.links = [StageLink(ranks, c * num_stages + stage_index, group,
                                grad_group=None if self._own_grad_group else grad_group, tagged=v > 1)
                      for c in range(v)]
        self.tied = list(tied_of(self.chunks[0])) if v == 1 else []
        self._tied_synced = False
        # {stages holding a tied copy: their group}, for the sets this stage is in: made at the first step
        self.tied_groups: dict[tuple[int, ...], object] = {}
        self.busy_s = 0.0  # compute seconds in the last step
        self.last_timeline: list[Span] = []  # the last step's forwards and backwards, in order

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def run_chunk(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Forward of model chunk ``chunk`` (recomputed in backward with ``checkpoint=True``)."""
        module = self.module if len(self.chunks) == 1 else self.chunks[chunk]  # .module may be a DP wrapper
        if self.checkpoint:
            return _checkpoint(module, x, use_reentrant=False)
        return module(x)

    def _actions(self, schedule: str | Schedule, m: int) -> list[tuple[str, int, int]]:
        sched = get_schedule(schedule)
        v = getattr(sched, "chunks", 1)
        if v != len(self.chunks):
            raise ValueError(f"schedule {sched.name!r} runs {v} model chunk(s) per stage but this stage holds "
                             f"{len(self.chunks)}; pass module=[chunk_0, …, chunk_{v - 1}] (or pick a matching "
                             "schedule)")
        actions = []
        for a in sched.actions(self.stage_index, self.num_stages, m):
            kind, i, c = a[0], a[1], (a[2] if len(a) > 2 else 0)
            if kind not in ("F", "B"):
                raise ValueError(f"unknown schedule action {kind!r}; use 'F' or 'B'")
            actions.append((kind, i, c))
        return actions

    def step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        num_microbatches: int,
        schedule: str | Schedule = "1f1b",
    ) -> torch.Tensor | None:
        """Run forward and backward of every micro-batch; returns the mean loss on the last stage.

        ``inputs`` is the whole batch (first stage only), ``targets`` too (last
        stage only); both are split into ``num_microbatches`` equal chunks along dim 0.
        Gradients accumulate into ``.grad``; call the optimizer afterwards.
        """
        m = num_microbatches
        xs = self._chunks(inputs, m, "inputs") if self.is_first else None
        ts = self._chunks(targets, m, "targets") if self.is_last else None
        actions = self._actions(schedule, m)
        self._make_grad_group()
        tied = self.tied and self.chunks[0].tied_summed_by == "pipeline"  # (self.tied: a StageOfModel)
        if tied and not self._tied_synced:
            self._sync_tied()
        run = StepRun(self, actions, xs, ts, m, self._device())
        loss_sum = run.run()
        if tied:
            self._sum_tied_grads()
        self.last_timeline = run.timeline
        self.busy_s = sum(s.end_s - s.start_s for s in run.timeline)
        return loss_sum if self.is_last else None

    def _make_grad_group(self) -> None:
        """At the first step, before any message (every stage of the pipeline is here): the gradients' group.

        Only for a pipeline that is the whole world: ``dist.new_group`` needs every rank of the world,
        in the same order. Not ``use_local_synchronization=True``: it names the group from its ranks and
        the number of groups this rank already has, so a stage that is not in some earlier group (a
        process set, another pipeline's group) names it differently from its peers and both hang.
        """
        if not self._own_grad_group:
            return
        self._own_grad_group = False
        if self.num_stages > 1 and dist.is_initialized():
            members = sorted(set(self.ranks))
            if len(members) != dist.get_world_size():
                _log.info("pipeline on ranks %s (part of the world): gradients share the activations' group; "
                          "pass grad_group= a group every rank made (RankGrid.pp_grad_group) for one of "
                          "their own", members)
                return
            grad_group = dist.new_group(members)
            for link in self.links:
                link.grad_group = grad_group

    @torch.no_grad()
    def _sync_tied(self) -> None:
        """First step (every rank of the world is here): the groups of each tied parameter's holders
        (:func:`holder_groups`), then every copy takes the values of its first holder's."""
        self._tied_synced = True
        self.tied_groups = holder_groups(self.tied, self.group)
        for stages, group, tied in held_sets(self.tied, self.tied_groups):
            for t in tied:  # in fp32 on every holder: a holder's copy may be cast later
                buf = t.param.data.float()
                broadcast(buf, root_rank=self.ranks[stages[0]], group=group, inplace=True, name="pp.tied.init")
                t.param.data.copy_(buf)

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """Each tied parameter's gradient summed over the stages holding a copy, one all-reduce per set
        of holders over them only (a middle stage takes no part); its last element counts the copies
        that had no ``.grad``."""
        for _, group, tied in held_sets(self.tied, self.tied_groups):
            grads = [t.param.grad for t in tied]
            missing = float(sum(g is None for g in grads))
            parts = [g.reshape(-1).float() if g is not None else torch.zeros(t.param.numel(), device=t.param.device)
                     for t, g in zip(tied, grads)]
            flat = torch.cat(parts + [torch.tensor([missing], device=parts[0].device)])
            flat = allreduce(flat, op=Sum, group=group, inplace=True, name="pp.tied.grad")
            if flat[-1].item():
                names = ", ".join(t.name for t in tied)
                raise RuntimeError(f"pipeline: {names} is tied across stages but a copy has no .grad after backward "
                                   "(a wrapper took it: ZeRO shards gradients); build the model untied "
                                   "(HF: tie_word_embeddings=False)")
            off = 0
            for t, part in zip(tied, parts):
                t.param.grad.copy_(flat[off : off + part.numel()].view_as(t.param.grad))
                off += part.numel()

    def share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss (what :meth:`step` returned there) on every stage, by one broadcast.

        Collective over the pipeline: every stage calls it with what its ``step`` returned.
        """
        if loss is None:
            loss = torch.zeros((), device=self._device())
        return broadcast(loss, root_rank=self.ranks[-1], group=self.group, name="pp.loss")

    @staticmethod
    def _chunks(batch: torch.Tensor | None, m: int, field: str) -> list[torch.Tensor]:
        if batch is None:
            raise ValueError(f"{field} is required on this stage")
        if not isinstance(batch, torch.Tensor):  # e.g. an HF-style batch {'input_ids': ..., 'labels': ...}
            what = f"a dict (keys {', '.join(map(repr, batch))})" if isinstance(batch, dict) else f"a {type(batch).__name__}"
            raise TypeError(f"PipelineStage.step: {field} is {what}; pass one tensor a stage, e.g. "
                            "pipe.step(batch['input_ids'], batch['labels'], num_microbatches=...)")
        if m < 1 or batch.shape[0] % m:
            raise ValueError(f"{field}: batch of {batch.shape[0]} rows does not split into "
                             f"num_microbatches={m} equal micro-batches; pick m dividing the batch")
        return list(batch.chunk(m))

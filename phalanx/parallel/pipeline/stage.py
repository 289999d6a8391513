"""One pipeline stage: its slice of the model, its neighbours, and the schedule executor.

Data flow for stage s of p (activations right, gradients left)::

    stage s-1 ──x_s (isend/recv)──▶ [ stage s: module ] ──y_s──▶ stage s+1
              ◀──dL/dx_s──────────                    ◀──dL/dy_s──

* Shapes are exchanged once: the first activation a stage sends is preceded by
  a small int64 header (ndim, dtype, dims); later ones reuse it, so every
  micro-batch of every step must have the same shape (keep the batch size
  fixed; drop or pad a short last batch). Gradients have the shape of the
  activation they answer, so they need no header.
* Sends are non-blocking (the process group's ``send``, as ``isend``). A
  micro-batch's activation send is waited on at its backward, when its
  gradient is back (so the send is done and the wait returns at once; the
  activation is not kept alive past it); header and gradient sends at the end
  of the step. A stage never blocks on a send in flight.
  The receive each action needs is posted (``irecv``) at least one action
  ahead, while the current action computes, so the transfer overlaps compute
  instead of starting when the stage asks for it. When a stage is about to
  wait for a receive, it first posts the step's later receives (up to
  ``recv_ahead``), so posting (0.1-0.2 ms of CPU each on a busy CPU) happens
  while it idles, not between two computes. Receives are posted in action
  order, so each stream matches its messages in order. Waits are bounded by
  the process group timeout.
* Activations and gradients travel on two process groups (``grad_group``):
  one gloo connection per direction, because two neighbours sending to each
  other at once over one connection stalled a send by 4-7 ms here.
* Receive buffers are recycled: a gradient's buffer once its backward has run,
  an activation's once the backward of its micro-batch has sent the input's
  gradient (its ``.grad`` is dropped first, so nothing accumulates into a
  gradient still being sent). After the first step a stage allocates no
  receive buffers.
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

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from phalanx import trace
from phalanx.comm.collectives import broadcast
from phalanx.parallel.pipeline.schedules import Schedule, get_schedule

__all__ = ["PipelineStage", "StageLink", "Span"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # ndim, dtype code, up to 8 dims


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Span(NamedTuple):
    """One compute action of a step: ``kind`` "F" or "B", micro-batch ``mb``, perf_counter seconds, ``chunk``."""

    kind: str
    mb: int
    start_s: float
    end_s: float
    chunk: int = 0


class StageLink:
    """Point-to-point plumbing between (virtual) stage ``index`` and its neighbours ``index ± 1``.

    Virtual stage k runs on ``ranks[k % p]`` (p = len(ranks)); without
    interleaving k is the stage. Activations go to the next stage, gradients to
    the previous one. The first activation sent is preceded by its shape header;
    every receive is an ``irecv`` the executor waits on when it needs the tensor.
    With ``tagged=True`` (interleaved schedules, where two streams can join the
    same pair of ranks) messages to virtual stage k carry tag 2k (activations)
    or 2k+1 (gradients), so each stream matches its own receives.

    Example::

        link = StageLink(ranks=[0, 1], index=0, group=None)
        link.send_activation(y, pending)          # to rank 1
    """

    def __init__(self, ranks: Sequence[int], index: int, group=None, *, grad_group=None,
                 tagged: bool = False) -> None:
        self.ranks, self.index, self.group, self.tagged = list(ranks), index, group, tagged
        self.grad_group = group if grad_group is None else grad_group
        self._recv_header: tuple[torch.dtype, tuple[int, ...]] | None = None
        self._sent_header = False
        self.sent_like: torch.Tensor | None = None  # a meta tensor shaped like the activations sent
        self._free: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # gradient? -> spare buffers
        self._pg = None  # gradient? -> (process group, group rank of the previous stage, of the next), at first use

    @property
    def knows_shape(self) -> bool:
        """Whether the previous stage's shape header has arrived (receives can be posted ahead)."""
        return self._recv_header is not None

    def _peer(self, offset: int) -> int:
        return self.ranks[(self.index + offset) % len(self.ranks)]

    def _tag(self, to: int, gradient: bool) -> int:
        return 2 * to + int(gradient) if self.tagged else 0

    def _p2p(self, t: torch.Tensor, offset: int, tag: int, send: bool):
        # The process group's own send/recv: dist.isend/irecv re-resolve the group and re-check the
        # arguments on every call, Python that runs on the stage's critical path once per message.
        # Gradients (sent to the previous stage, received from the next) travel on grad_group.
        if self._pg is None:
            self._pg = {}
            for gradient, group in ((False, self.group), (True, self.grad_group)):
                pg = group if group is not None else dist.group.WORLD
                self._pg[gradient] = (pg, dist.get_group_rank(pg, self._peer(-1)),
                                      dist.get_group_rank(pg, self._peer(1)))
        pg, prev, nxt = self._pg[(offset < 0) == send]
        peer = nxt if offset > 0 else prev
        return pg.send([t], peer, tag) if send else pg.recv([t], peer, tag)

    def send_activation(self, y: torch.Tensor, pending: list):
        """Send ``y`` to the next stage; returns the send's work (a first shape header's goes to ``pending``)."""
        if not self._sent_header:
            if y.dim() > _HEADER - 2 or y.dtype not in _DTYPES:
                raise ValueError(f"stage {self.index}: cannot send an activation of shape {tuple(y.shape)} and dtype "
                                 f"{y.dtype} (at most {_HEADER - 2} dims, dtype in {_DTYPES})")
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            pending.append(self._p2p(header.to(y.device), 1, self._tag(self.index + 1, False), True))
            self._sent_header = True
            self.sent_like = y.new_empty(y.shape, device="meta")
        return self._p2p(y, 1, self._tag(self.index + 1, False), True)

    def send_gradient(self, grad: torch.Tensor, pending: list) -> None:
        pending.append(self._p2p(grad, -1, self._tag(self.index - 1, True), True))

    def post_activation(self, device: torch.device) -> tuple[torch.Tensor, object]:
        """``(buffer, work)`` of the next activation from the previous stage."""
        if self._recv_header is None:  # once: the shape header (blocking, it is tiny)
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            self._p2p(header, -1, self._tag(self.index, False), False).wait()
            ndim, code = int(header[0]), int(header[1])
            self._recv_header = (_DTYPES[code], tuple(int(d) for d in header[2 : 2 + ndim]))
        dtype, shape = self._recv_header
        x = self._buffer(False, shape, dtype, device)
        return x, self._p2p(x, -1, self._tag(self.index, False), False)

    def post_gradient(self, like: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        """``(buffer, work)`` of the next gradient from the next stage, shaped like the activations sent."""
        grad = self._buffer(True, like.shape, like.dtype, device)
        return grad, self._p2p(grad, 1, self._tag(self.index, True), False)

    def release(self, buffer: torch.Tensor, gradient: bool) -> None:
        """Give back a receive buffer whose contents are no longer needed (reused by the next post)."""
        if buffer.requires_grad:  # a received activation: detach it from its finished step
            buffer.grad = None
            buffer.requires_grad_(False)
        self._free[gradient].append(buffer)

    def _buffer(self, gradient: bool, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[gradient]
        while free:
            buf = free.pop()
            if buf.shape == shape and buf.dtype == dtype and buf.device == device:
                return buf
        return torch.empty(shape, dtype=dtype, device=device)


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
    first step (``dist.new_group(..., use_local_synchronization=True)``: every
    stage's first step makes it, so make the pipeline's stages on every rank
    in the same order); a process group uses that one (``DeviceMesh`` makes one
    per pipeline, ``pp_grad_group``); pass ``group`` itself to share one.
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

    def _forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
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
        device = self._device()
        actions = self._actions(schedule, m)
        if self._own_grad_group:  # once, before any message: every stage of the pipeline is here
            self._own_grad_group = False
            if self.num_stages > 1 and dist.is_initialized():
                grad_group = dist.new_group(sorted(set(self.ranks)), use_local_synchronization=True)
                for link in self.links:
                    link.grad_group = grad_group
        last_virtual = len(self.chunks) * self.num_stages - 1
        last_backward = max(k for k, a in enumerate(actions) if a[0] == "B")
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        posted: dict[int, tuple[torch.Tensor, object]] = {}  # action index -> (buffer, irecv work)
        pending: list = []  # header and gradient sends, waited at the end of the step
        act_sent: dict[tuple[int, int], object] = {}  # (mb, chunk) -> its activation send, waited at its backward
        loss_sum = torch.zeros((), device=device)
        timeline: list[Span] = []

        def virtual(c: int) -> int:
            return c * self.num_stages + self.stage_index

        cursor = 0  # receives are posted in action order (each stream matches its messages FIFO)

        def post_through(limit: int, now: int = -1) -> None:
            # Post the receives of actions cursor .. limit-1 that need one. Ahead of time only when it
            # cannot block: the activation's shape header has arrived (or action ``now`` needs it
            # now), and a gradient's shape (that of the activations this chunk sends) is known.
            nonlocal cursor
            while cursor < min(limit, len(actions)):
                kind, _, c = actions[cursor]
                link = self.links[c]
                if kind == "F" and virtual(c) > 0:
                    if not (link.knows_shape or cursor == now):
                        return
                    posted[cursor] = link.post_activation(device)
                elif kind == "B" and virtual(c) < last_virtual:
                    if link.sent_like is None:
                        return
                    posted[cursor] = link.post_gradient(link.sent_like, device)
                cursor += 1

        def received(at: int) -> torch.Tensor:
            if at not in posted:
                post_through(at + 1, now=at)
            buf, work = posted.pop(at)
            # About to wait (gloo reports no receive complete before its wait): post the step's later
            # receives first, while this stage idles anyway, not one per action between two computes
            # (a post costs 0.1-0.2 ms of CPU there); once they are all posted this is a no-op.
            post_through(len(actions) if self.recv_ahead is None else at + 1 + self.recv_ahead)
            with trace.span("pp.recv", "comm", mb=actions[at][1], kind=actions[at][0], chunk=actions[at][2]):
                work.wait()
            return buf

        for at, (kind, i, c) in enumerate(actions):
            if kind == "F":
                if virtual(c) == 0:
                    x = xs[i]
                else:
                    x = received(at)
                    x.requires_grad_(x.is_floating_point())
                post_through(at + 2)  # the next action's input travels while this one computes
                t0 = time.perf_counter()
                with trace.span("pp.forward", "compute", mb=i, stage=self.stage_index, chunk=c):
                    y = self._forward(x, c)
                    if virtual(c) == last_virtual:
                        y = self.loss_fn(y, ts[i]) / m
                        loss_sum += y.detach()
                timeline.append(Span("F", i, t0, time.perf_counter(), c))
                if virtual(c) < last_virtual:
                    out = y.detach().contiguous()
                    act_sent[(i, c)] = self.links[c].send_activation(out, pending)
                saved[(i, c)] = (x, y)
            else:
                x, y = saved.pop((i, c))
                grad = None if virtual(c) == last_virtual else received(at)
                if virtual(c) < last_virtual:  # its gradient is back, so its activation was received: done
                    act_sent.pop((i, c)).wait()
                post_through(at + 2)
                t0 = time.perf_counter()
                quiet = self.no_sync is not None and at != last_backward
                with trace.span("pp.backward", "compute", mb=i, stage=self.stage_index, chunk=c):
                    with self.no_sync() if quiet else contextlib.nullcontext():
                        torch.autograd.backward(y, grad_tensors=grad)
                timeline.append(Span("B", i, t0, time.perf_counter(), c))
                if virtual(c) > 0:
                    if x.grad is None:
                        raise RuntimeError(f"stage {self.stage_index} (chunk {c}): the input received no "
                                           "gradient; does the stage's output depend on its input?")
                    sent = x.grad.contiguous()
                    self.links[c].send_gradient(sent, pending)
                    # reusable even where the activation send read x (a pass-through stage): that send was waited
                    self.links[c].release(x, gradient=False)
                else:
                    sent = None
                # autograd may pass the received gradient through as the input's (a pass-through stage)
                if grad is not None and (sent is None or not _shares(sent, grad)):
                    self.links[c].release(grad, gradient=True)
                del x, y, grad, sent
            post_through(at + 2)  # when it had to wait for this action (a header, a gradient's shape)
        if saved:
            raise RuntimeError(f"schedule left micro-batches {sorted(saved)} without a backward")
        for work in pending:
            work.wait()
        self.last_timeline = timeline
        self.busy_s = sum(s.end_s - s.start_s for s in timeline)
        return loss_sum if self.is_last else None

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
        if m < 1 or batch.shape[0] % m:
            raise ValueError(f"{field}: batch of {batch.shape[0]} rows does not split into "
                             f"num_microbatches={m} equal micro-batches; pick m dividing the batch")
        return list(batch.chunk(m))

"""One pipeline stage: its slice of the model, its neighbours, and the schedule executor.

Data flow for stage s of p (activations right, gradients left)::

    stage s-1 ──x_s (isend/recv)──▶ [ stage s: module ] ──y_s──▶ stage s+1
              ◀──dL/dx_s──────────                    ◀──dL/dy_s──

* Shapes are exchanged once: the first activation a stage sends is preceded by
  a small int64 header (ndim, dtype, dims); later ones reuse it, so every
  micro-batch of every step must have the same shape (keep the batch size
  fixed; drop or pad a short last batch). Gradients have the shape of the
  activation they answer, so they need no header.
* Sends are ``isend``, reaped as they complete (so a sent activation is not
  kept alive past its backward) and all waited on at the end of the step; a
  stage never blocks on a send. The receive each action needs is posted
  (``irecv``) one action ahead, while the current action computes, so the
  transfer overlaps compute instead of starting when the stage asks for it;
  waits are bounded by the process group timeout.
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

    def __init__(self, ranks: Sequence[int], index: int, group=None, *, tagged: bool = False) -> None:
        self.ranks, self.index, self.group, self.tagged = list(ranks), index, group, tagged
        self._recv_header: tuple[torch.dtype, tuple[int, ...]] | None = None
        self._sent_header = False
        self._free: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # gradient? -> spare buffers

    @property
    def knows_shape(self) -> bool:
        """Whether the previous stage's shape header has arrived (receives can be posted ahead)."""
        return self._recv_header is not None

    def _peer(self, offset: int) -> int:
        return self.ranks[(self.index + offset) % len(self.ranks)]

    def _tag(self, to: int, gradient: bool) -> int:
        return 2 * to + int(gradient) if self.tagged else 0

    def send_activation(self, y: torch.Tensor, pending: list) -> None:
        if not self._sent_header:
            if y.dim() > _HEADER - 2 or y.dtype not in _DTYPES:
                raise ValueError(f"stage {self.index}: cannot send an activation of shape {tuple(y.shape)} and dtype "
                                 f"{y.dtype} (at most {_HEADER - 2} dims, dtype in {_DTYPES})")
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            pending.append(dist.isend(header.to(y.device), dst=self._peer(1), group=self.group,
                                      tag=self._tag(self.index + 1, False)))
            self._sent_header = True
        pending.append(dist.isend(y, dst=self._peer(1), group=self.group, tag=self._tag(self.index + 1, False)))

    def send_gradient(self, grad: torch.Tensor, pending: list) -> None:
        pending.append(dist.isend(grad, dst=self._peer(-1), group=self.group, tag=self._tag(self.index - 1, True)))

    def post_activation(self, device: torch.device) -> tuple[torch.Tensor, object]:
        """``(buffer, work)`` of the next activation from the previous stage."""
        if self._recv_header is None:  # once: the shape header (blocking, it is tiny)
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            dist.recv(header, src=self._peer(-1), group=self.group, tag=self._tag(self.index, False))
            ndim, code = int(header[0]), int(header[1])
            self._recv_header = (_DTYPES[code], tuple(int(d) for d in header[2 : 2 + ndim]))
        dtype, shape = self._recv_header
        x = self._buffer(False, shape, dtype, device)
        return x, dist.irecv(x, src=self._peer(-1), group=self.group, tag=self._tag(self.index, False))

    def post_gradient(self, like: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        """``(buffer, work)`` of the next gradient from the next stage, shaped like the activations sent."""
        grad = self._buffer(True, like.shape, like.dtype, device)
        return grad, dist.irecv(grad, src=self._peer(1), group=self.group, tag=self._tag(self.index, True))

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
    ) -> None:
        ranks = list(range(num_stages)) if ranks is None else [int(r) for r in ranks]
        if len(ranks) != num_stages:
            raise ValueError(f"ranks={ranks} must name one global rank per stage (num_stages={num_stages})")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index} must be in [0, num_stages={num_stages})")
        if stage_index == num_stages - 1 and loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn=(output, target) -> scalar")
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
        self.links = [StageLink(ranks, c * num_stages + stage_index, group, tagged=v > 1) for c in range(v)]
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
        last_virtual = len(self.chunks) * self.num_stages - 1
        last_backward = max(k for k, a in enumerate(actions) if a[0] == "B")
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        posted: dict[int, tuple[torch.Tensor, object]] = {}  # action index -> (buffer, irecv work)
        pending: list = []
        sent_like: dict[int, torch.Tensor] = {}  # chunk -> empty tensor shaped like what it sends
        keep: set[tuple[int, int]] = set()  # received activations a pending send may still read
        loss_sum = torch.zeros((), device=device)
        timeline: list[Span] = []

        def virtual(c: int) -> int:
            return c * self.num_stages + self.stage_index

        def post(at: int, now: bool = False) -> None:
            # Post the receive action ``at`` needs, if it needs one and is not posted yet. Ahead of
            # time only when it cannot block: the activation's shape header has arrived, and a
            # gradient's shape (that of an activation this chunk sent) is known.
            if at >= len(actions) or at in posted:
                return
            kind, _, c = actions[at]
            if kind == "F" and virtual(c) > 0 and (now or self.links[c].knows_shape):
                posted[at] = self.links[c].post_activation(device)
            elif kind == "B" and virtual(c) < last_virtual and c in sent_like:
                posted[at] = self.links[c].post_gradient(sent_like[c], device)

        def received(at: int) -> torch.Tensor:
            post(at, now=True)
            buf, work = posted.pop(at)
            with trace.span("pp.recv", "comm", mb=actions[at][1], kind=actions[at][0], chunk=actions[at][2]):
                work.wait()
            return buf

        for at, (kind, i, c) in enumerate(actions):
            pending[:] = [w for w in pending if not w.is_completed()]  # drop finished sends' buffers
            if kind == "F":
                if virtual(c) == 0:
                    x = xs[i]
                else:
                    x = received(at)
                    x.requires_grad_(x.is_floating_point())
                post(at + 1)  # the next action's input travels while this one computes
                t0 = time.perf_counter()
                with trace.span("pp.forward", "compute", mb=i, stage=self.stage_index, chunk=c):
                    y = self._forward(x, c)
                    if virtual(c) == last_virtual:
                        y = self.loss_fn(y, ts[i]) / m
                        loss_sum += y.detach()
                timeline.append(Span("F", i, t0, time.perf_counter(), c))
                if virtual(c) < last_virtual:
                    out = y.detach().contiguous()
                    self.links[c].send_activation(out, pending)
                    if c not in sent_like:
                        sent_like[c] = out.new_empty(out.shape, device="meta")
                    if virtual(c) > 0 and _shares(out, x):  # a pass-through stage: its send reads x
                        keep.add((i, c))
                saved[(i, c)] = (x, y)
            else:
                x, y = saved.pop((i, c))
                grad = None if virtual(c) == last_virtual else received(at)
                post(at + 1)
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
                    if (i, c) not in keep:
                        self.links[c].release(x, gradient=False)
                    keep.discard((i, c))
                else:
                    sent = None
                # autograd may pass the received gradient through as the input's (a pass-through stage)
                if grad is not None and (sent is None or not _shares(sent, grad)):
                    self.links[c].release(grad, gradient=True)
                del x, y, grad, sent
            post(at + 1)  # when it had to wait for this action (a header, a gradient's shape)
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

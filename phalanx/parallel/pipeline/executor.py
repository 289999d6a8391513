"""One step of a pipeline schedule on one stage: run its actions in order, receives posted ahead.

A schedule gives the stage a list of actions ``(kind, micro-batch, chunk)``,
``kind`` "F" (forward) or "B" (backward). :class:`StepRun` executes them::

    for each action:   [wait its receive] → post the next receives → compute → send
      F:  x = input (first virtual stage) or received activation → y = chunk(x)
          (last virtual stage: y = loss_fn(y, target) / m) → send y.detach() to the next stage
      B:  wait y's activation send · backward(y, received gradient) → send x.grad to the previous
          stage · give x's and the gradient's buffers back to the link

* Sends are non-blocking. A micro-batch's activation send is waited on at its
  backward, when its gradient is back (so the send is done and the wait
  returns at once; the activation is not kept alive past it); header and
  gradient sends at the end of the step. A stage never blocks on a send in flight.
* The receive each action needs is posted (``irecv``) at least one action
  ahead, while the current action computes, so the transfer overlaps compute
  instead of starting when the stage asks for it. When a stage is about to
  wait for a receive, it first posts the step's later receives (up to
  ``recv_ahead``), so posting (0.1-0.2 ms of CPU each on a busy CPU) happens
  while it idles, not between two computes. Receives are posted in action
  order, so each stream matches its messages in order.
* Receive buffers go back to the link: a gradient's once its backward has run,
  an activation's once the backward of its micro-batch has sent the input's
  gradient (its ``.grad`` is dropped first, so nothing accumulates into a
  gradient still being sent).
* ``no_sync``: every backward but the step's last runs inside it, so a
  data-parallel wrapper reduces gradients once per step.

Example (what :meth:`PipelineStage.step` does)::

    run = StepRun(stage, actions, xs, ts, m, device)
    loss = run.run()            # the summed loss on the last stage
    stage.last_timeline = run.timeline
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from phalanx import trace
from phalanx.parallel.pipeline.link import StageLink

__all__ = ["StepRun", "Span", "Stage"]


class Stage(Protocol):
    """What a step needs from its stage (:class:`~phalanx.parallel.pipeline.PipelineStage` is one)."""

    links: Sequence[StageLink]
    chunks: Sequence[torch.nn.Module]
    stage_index: int
    num_stages: int
    recv_ahead: int | None
    loss_fn: Callable | None
    no_sync: Callable | None

    def run_chunk(self, x: torch.Tensor, chunk: int) -> torch.Tensor: ...


class Span(NamedTuple):
    """One compute action of a step: ``kind`` "F" or "B", micro-batch ``mb``, perf_counter seconds, ``chunk``."""

    kind: str
    mb: int
    start_s: float
    end_s: float
    chunk: int = 0


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class StepRun:
    """The state of one step: activations saved for backward, receives posted, sends in flight."""

    def __init__(self, stage: Stage, actions: list[tuple[str, int, int]], xs, ts, m: int,
                 device: torch.device) -> None:
        self.stage, self.actions, self.xs, self.ts, self.m, self.device = stage, actions, xs, ts, m, device
        self.links = stage.links
        self.index, self.p = stage.stage_index, stage.num_stages
        self.last_virtual = len(stage.chunks) * stage.num_stages - 1
        self.last_backward = max(k for k, a in enumerate(actions) if a[0] == "B")
        self.ahead = stage.recv_ahead
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.posted: dict[int, tuple[torch.Tensor, object]] = {}  # action index -> (buffer, irecv work)
        self.pending: list = []  # header and gradient sends, waited at the end of the step
        self.act_sent: dict[tuple[int, int], object] = {}  # (mb, chunk) -> its activation send
        self.loss_sum = torch.zeros((), device=device)
        self.timeline: list[Span] = []
        self.cursor = 0  # receives are posted in action order (each stream matches its messages FIFO)

    def virtual(self, c: int) -> int:
        """The virtual stage that chunk ``c`` of this stage is."""
        return c * self.p + self.index

    def run(self) -> torch.Tensor:
        for at, (kind, i, c) in enumerate(self.actions):
            if kind == "F":
                self.forward(at, i, c)
            else:
                self.backward(at, i, c)
            self.post_through(at + 2)  # when it had to wait for this action (a header, a gradient's shape)
        if self.saved:
            raise RuntimeError(f"schedule left micro-batches {sorted(self.saved)} without a backward")
        for work in self.pending:
            work.wait()
        return self.loss_sum

    # -- receives ------------------------------------------------------------------------------
    def post_through(self, limit: int, now: int = -1) -> None:
        """Post the receives of actions ``cursor .. limit-1`` that need one.

        Ahead of time only when it cannot block: the activation's shape header has arrived
        (or action ``now`` needs it now), and a gradient's shape (that of the activations
        this chunk sends) is known.
        """
        actions, posted = self.actions, self.posted
        while self.cursor < min(limit, len(actions)):
            kind, _, c = actions[self.cursor]
            link = self.links[c]
            v = self.virtual(c)
            if kind == "F" and v > 0:
                if not (link.knows_shape or self.cursor == now):
                    return
                posted[self.cursor] = link.post_activation(self.device)
            elif kind == "B" and v < self.last_virtual:
                if link.sent_like is None:
                    return
                posted[self.cursor] = link.post_gradient(link.sent_like, self.device)
            self.cursor += 1

    def received(self, at: int) -> torch.Tensor:
        """The tensor action ``at`` receives, once it is in."""
        if at not in self.posted:
            self.post_through(at + 1, now=at)
        buf, work = self.posted.pop(at)
        # About to wait (gloo reports no receive complete before its wait): post the step's later
        # receives first, while this stage idles anyway, not one per action between two computes
        # (a post costs 0.1-0.2 ms of CPU there); once they are all posted this is a no-op.
        self.post_through(len(self.actions) if self.ahead is None else at + 1 + self.ahead)
        kind, i, c = self.actions[at]
        with trace.span("pp.recv", "comm", mb=i, kind=kind, chunk=c):
            work.wait()
        return buf

    # -- compute -------------------------------------------------------------------------------
    def forward(self, at: int, i: int, c: int) -> None:
        v = self.virtual(c)
        if v == 0:
            x = self.xs[i]
        else:
            x = self.received(at)
            x.requires_grad_(x.is_floating_point())
        self.post_through(at + 2)  # the next action's input travels while this one computes
        t0 = time.perf_counter()
        with trace.span("pp.forward", "compute", mb=i, stage=self.index, chunk=c):
            y = self.stage.run_chunk(x, c)
            if v == self.last_virtual:
                y = self.stage.loss_fn(y, self.ts[i]) / self.m
                self.loss_sum += y.detach()
        self.timeline.append(Span("F", i, t0, time.perf_counter(), c))
        if v < self.last_virtual:
            self.act_sent[(i, c)] = self.links[c].send_activation(y.detach().contiguous(), self.pending)
        self.saved[(i, c)] = (x, y)

    def backward(self, at: int, i: int, c: int) -> None:
        v, link = self.virtual(c), self.links[c]
        x, y = self.saved.pop((i, c))
        grad = None if v == self.last_virtual else self.received(at)
        if v < self.last_virtual:  # its gradient is back, so its activation was received: done
            self.act_sent.pop((i, c)).wait()
        self.post_through(at + 2)
        t0 = time.perf_counter()
        no_sync = self.stage.no_sync
        quiet = no_sync is not None and at != self.last_backward
        with trace.span("pp.backward", "compute", mb=i, stage=self.index, chunk=c):
            with no_sync() if quiet else contextlib.nullcontext():
                torch.autograd.backward(y, grad_tensors=grad)
        self.timeline.append(Span("B", i, t0, time.perf_counter(), c))
        sent = None
        if v > 0:
            if x.grad is None:
                raise RuntimeError(f"stage {self.index} (chunk {c}): the input received no "
                                   "gradient; does the stage's output depend on its input?")
            sent = x.grad.contiguous()
            link.send_gradient(sent, self.pending)
            # reusable even where the activation send read x (a pass-through stage): that send was waited
            link.release(x, gradient=False)
        # autograd may pass the received gradient through as the input's (a pass-through stage)
        if grad is not None and (sent is None or not _shares(sent, grad)):
            link.release(grad, gradient=True)

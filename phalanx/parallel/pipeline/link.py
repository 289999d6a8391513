"""The point-to-point link between a pipeline stage and its neighbours: activations right, gradients left.

* Shapes are exchanged once: the first activation a stage sends is preceded by
  a small int64 header (ndim, dtype, dims); later ones reuse it, so every
  micro-batch of every step must have the same shape (keep the batch size
  fixed; drop or pad a short last batch). Gradients have the shape of the
  activation they answer, so they need no header.
* Sends and receives are the process group's own ``send``/``recv`` (as
  ``isend``/``irecv``): ``dist.isend`` re-resolves the group and re-checks its
  arguments on every call, Python on the stage's critical path once per message.
* Activations and gradients travel on two process groups (``grad_group``):
  one gloo connection per direction, because two neighbours sending to each
  other at once over one connection stalled a send by 4-7 ms here.
* Receive buffers are recycled (:meth:`StageLink.release`): after the first
  step a stage allocates no receive buffers.

Example::

    link = StageLink(ranks=[0, 1], index=0, group=None)
    work = link.send_activation(y, pending)   # to rank 1; the first send carries the shape header
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["StageLink"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # ndim, dtype code, up to 8 dims


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

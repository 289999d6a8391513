"""Dtypes on the wire: carry what the backend lacks, fuse many tensors into one buffer per dtype.

gloo and NCCL have no int16, uint16 or uint32 (``RuntimeError: Invalid scalar type``); Horovod
takes them (TensorFlow's uint16 tensors, say). A
tensor of a missing dtype travels as the smallest wider dtype that holds every value
(int16 → int32) and comes back cast: lossless for data movement, and for sums it wraps on
overflow exactly as int16 arithmetic does. Checked dtype by dtype in
``tests/fronts/test_horovod_dtypes.py`` (uint8 … bool, every op, 1/2/4 ranks).

``fuse`` packs a list of tensors into one flat buffer per dtype, so a grouped collective
costs one call per dtype instead of one per tensor; :class:`FusedHandle` splits the
results back into the original shapes.
"""

from __future__ import annotations

import torch

from phalanx.comm.collectives import Handle
from phalanx.runtime.backends import engine

__all__ = ["to_wire", "fuse", "FusedHandle"]

# dtype the backend lacks -> the dtype it travels as
_CARRY = {
    "gloo": {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64},
    "nccl": {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64},
}


def to_wire(tensor: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.dtype | None]:
    """``(tensor as it travels, dtype to cast the result back to or None)``."""
    wire = _CARRY.get(engine(group), {}).get(tensor.dtype)
    if wire is None:
        return tensor, None
    return tensor.to(wire), tensor.dtype


def fuse(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Group tensors by dtype into flat buffers: ``[(indices, flat), ...]`` (one per dtype)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [(idx, torch.cat([tensors[i].reshape(-1) for i in idx])) for idx in groups.values()]


class FusedHandle(Handle):
    """Waits for the fused collectives, then splits the results back into the tensors' shapes.

    ``parts`` is ``[(indices, handle), ...]`` as made from :func:`fuse`; with ``inplace`` the
    results are copied into the original tensors.
    """

    def __init__(self, parts, tensors, inplace: bool) -> None:
        super().__init__(None, None)
        self._parts, self._tensors, self._inplace = parts, tensors, inplace

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for _, h in self._parts)

    def wait(self):
        if not self._done:
            parts, tensors, inplace = self._parts, self._tensors, self._inplace
            out = [None] * len(tensors)
            for idx, h in parts:
                flat, offset = h.wait(), 0
                for i in idx:
                    t = tensors[i]
                    piece = flat[offset:offset + t.numel()].view_as(t)
                    offset += t.numel()
                    out[i] = t.copy_(piece) if inplace else piece.clone()
            self._result, self._done = out, True
        return self._result

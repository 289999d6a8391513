"""Average a list of gradients across ranks in fused buckets (the Keras and TensorFlow fronts' reduction).

Keras hands its optimizer the whole gradient list at once (after backward), so
there is nothing to overlap with: the list is packed into buckets of about
``bucket_mb`` (in reverse order, as backward would have produced them), each
bucket is flattened with one copy, every bucket's allreduce is launched
asynchronously, and the results come back as views of the reduced buffers::

    grads ──pack (reverse order, ≤ bucket_mb, one dtype each)──> [b0][b1]…
    b_i ──cat──> flat_i ──compress──> allreduce (async) ──> decompress ──> / n
    result: views of flat_i, reshaped like the inputs

Compressors are phalanx's (``phalanx.comm.compression``): summable ones (none,
fp16, bf16) go through one allreduce of the payload; the others take
``allreduce_compressed``'s allgather / two-phase paths with error feedback keyed
by bucket.

Example::

    from phalanx.keras.fused import allreduce_list
    averaged = allreduce_list([g1, g2, g3], compression="fp16")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives
from phalanx.comm.buckets import pack
from phalanx.comm.compressed import allreduce_compressed
from phalanx.comm.compression import NoneCompressor, get_compressor

__all__ = ["allreduce_list", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0
"""Bucket size, as DDP's and Horovod's fusion buffer defaults (25 MiB; Horovod 64 MiB)."""


def allreduce_list(
    tensors: Sequence[torch.Tensor | None],
    *,
    average: bool = True,
    compression=None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    group=None,
    name: str = "keras.grads",
    align_bytes: int = 0,
) -> list[torch.Tensor | None]:
    """Average (or sum) every tensor of ``tensors`` over ``group``; ``None`` entries stay ``None``.

    The inputs are not modified. With one rank, the inputs are returned as they are.
    ``align_bytes``: start each result at a multiple of this many bytes inside its bucket
    (TensorFlow refuses tensors that are not 64-byte aligned; padding the bucket by a few
    values is cheaper than copying each result out).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    out: list[torch.Tensor | None] = list(tensors)
    if world == 1:
        return out
    compressor = get_compressor(compression)
    plain = isinstance(compressor, NoneCompressor)
    present = [i for i, t in enumerate(tensors) if t is not None][::-1]
    sizes = [tensors[i].numel() * tensors[i].element_size() for i in present]
    breaks = [k > 0 and tensors[i].dtype != tensors[present[k - 1]].dtype for k, i in enumerate(present)]
    pending = []
    for b, positions in enumerate(pack(sizes, bucket_mb * 2**20, breaks)):
        members = [present[k] for k in positions]
        offsets, flat = _layout([tensors[i] for i in members], align_bytes)
        tag = f"{name}.{b}"
        if plain or not flat.is_floating_point():
            op = collectives.Average if average else collectives.Sum
            handle = collectives.allreduce(flat, op, group=group, async_op=True, name=tag, inplace=True)
        else:
            handle = allreduce_compressed(flat, compressor, group=group, async_op=True, name=tag, average=average)
        pending.append((members, handle, offsets))
    for members, handle, offsets in pending:
        reduced = handle.wait()
        for i, start in zip(members, offsets):
            out[i] = reduced[start:start + tensors[i].numel()].view(tensors[i].shape)
    return out


def _layout(tensors: list[torch.Tensor], align_bytes: int) -> tuple[list[int], torch.Tensor]:
    """One flat buffer holding ``tensors`` (one copy), each starting at an aligned offset."""
    if align_bytes <= 0:
        offsets = [0]
        for t in tensors[:-1]:
            offsets.append(offsets[-1] + t.numel())
        return offsets, torch.cat([t.detach().reshape(-1) for t in tensors])
    step = max(align_bytes // tensors[0].element_size(), 1)
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() // step) * step
    flat = torch.zeros(end, dtype=tensors[0].dtype, device=tensors[0].device)
    views = [flat[o:o + t.numel()] for o, t in zip(offsets, tensors)]
    torch._foreach_copy_(views, [t.detach().reshape(-1) for t in tensors])
    return offsets, flat

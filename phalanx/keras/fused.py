"""Average a list of gradients across ranks in fused buckets (the Keras and TensorFlow fronts' reduction).

Keras hands its optimizer the whole gradient list at once (after backward), so
there is nothing to overlap with: the list is packed into buckets of about
``bucket_mb`` (in reverse order, as backward would have produced them), each
bucket is flattened with one copy, every bucket's allreduce is launched
asynchronously, and the results come back as views of the reduced buffers::

    grads ──pack (reverse order, ≤ bucket_mb, one dtype each)──> [b0][b1]…
    b_i ──cat──> flat_i ──compress──> allreduce (async) ──> decompress ──> / n
    result: views of flat_i, reshaped like the inputs

The packing is planned once per list of shapes and dtypes (cached). The first time a plan
is used its buckets go through the cross-rank mismatch check (a blocking 16-byte round
trip per bucket); after that the plan's collectives skip it, as DataParallel's steady
state does: the ranks were shown to agree on exactly these buckets.

Compressors are phalanx's (``phalanx.comm.compression.codecs``): summable ones (none,
fp16, bf16) go through one allreduce of the payload; the others take
``allreduce_compressed``'s allgather / two-phase paths with error feedback keyed
by bucket.

Example::

    from phalanx.keras.fused import allreduce_list
    averaged = allreduce_list([g1, g2, g3], compression="fp16")
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx import runtime
from phalanx.comm import collectives
from phalanx.comm.buckets import pack
from phalanx.comm.compression.allreduce import allreduce_compressed
from phalanx.comm.compression.codecs import NoneCompressor, get_compressor
from phalanx.keras.tensors import over_torch

__all__ = ["allreduce_list", "reduce_gradients", "reduce_with_local_variables", "DEFAULT_BUCKET_MB"]

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
    # The process group object is part of the key: after an elastic re-form every rank checks afresh.
    signature = (tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors), float(bucket_mb),
                 int(align_bytes), name, dist.group.WORLD if group is None else group)
    plan = _plan(signature)
    checked = (signature, bool(average), getattr(compressor, "name", type(compressor).__name__)) in _CHECKED
    pending = []
    for b, (members, offsets, total) in enumerate(plan):
        flat = _layout([tensors[i] for i in members], offsets, total, align_bytes > 0)
        tag = f"{name}.{b}"
        if plain or not flat.is_floating_point():
            op = collectives.Average if average else collectives.Sum
            handle = collectives.allreduce(flat, op, group=group, async_op=True, name=tag, inplace=True,
                                           check=not checked)
        else:
            handle = allreduce_compressed(flat, compressor, group=group, async_op=True, name=tag, average=average)
        pending.append((members, handle, offsets))
    for members, handle, offsets in pending:
        reduced = handle.wait()
        for i, start in zip(members, offsets):
            out[i] = reduced[start:start + tensors[i].numel()].view(tensors[i].shape)
    if not checked:
        if len(_CHECKED) >= _MAX_PLANS:
            _CHECKED.clear()
        _CHECKED.add((signature, bool(average), getattr(compressor, "name", type(compressor).__name__)))
    return out


_MAX_PLANS = 64
_CHECKED: set = set()  # plans whose buckets passed the cross-rank check once


@functools.lru_cache(maxsize=_MAX_PLANS)
def _plan(signature) -> list[tuple[list[int], list[int], int]]:
    """Buckets for one list of (shape, dtype): ``(member indices, element offsets, flat length)`` each."""
    specs, bucket_mb, align_bytes, _, _ = signature
    present = [i for i, s in enumerate(specs) if s is not None][::-1]
    numel = {i: math.prod(specs[i][0]) for i in present}
    itemsize = {i: specs[i][1].itemsize for i in present}
    sizes = [numel[i] * itemsize[i] for i in present]
    breaks = [k > 0 and specs[i][1] != specs[present[k - 1]][1] for k, i in enumerate(present)]
    plan = []
    for positions in pack(sizes, bucket_mb * 2**20, breaks):
        members = [present[k] for k in positions]
        step = max(align_bytes // itemsize[members[0]], 1) if align_bytes > 0 else 1
        offsets, end = [], 0
        for i in members:
            offsets.append(end)
            end += -(-numel[i] // step) * step
        plan.append((members, offsets, end))
    return plan


def _layout(tensors: list[torch.Tensor], offsets: list[int], total: int, padded: bool) -> torch.Tensor:
    """One flat buffer holding ``tensors`` at ``offsets`` (one copy; padding, if any, zeroed)."""
    flats = [t.detach().reshape(-1) for t in tensors]
    if not padded:
        return torch.cat(flats)
    flat = torch.zeros(total, dtype=tensors[0].dtype, device=tensors[0].device)
    torch._foreach_copy_([flat[o:o + f.numel()] for o, f in zip(offsets, flats)], flats)
    return flat


def reduce_gradients(grads, *, average: bool = True, compression=None, bucket_mb: float = DEFAULT_BUCKET_MB,
                     predivide: float = 1.0, name: str = "keras.grads", when=None):
    """Average (or sum) gradients (torch, TensorFlow or JAX arrays) across ranks; ``None`` entries stay ``None``.

    Works eagerly, inside a ``tf.function`` (through one ``tf.py_function``) and inside
    ``jax.jit`` (one ``io_callback``). ``when``: a boolean scalar of the backend, the same
    on every rank; where it is false the gradients come back as they are, no collective
    (JAX's accumulation step, which cannot branch around a host call).
    """
    grads = list(grads)
    if runtime.size() == 1:
        return grads

    def on_torch(tensors, align_bytes):
        if when is not None:
            flag, tensors = tensors[-1], tensors[:-1]
            if not bool(flag):
                return [None if t is None else t.clone() for t in tensors] + [flag]
            return on_torch_now(tensors, align_bytes) + [flag]
        return on_torch_now(tensors, align_bytes)

    def on_torch_now(tensors, align_bytes):
        if predivide != 1.0:
            tensors = [None if t is None else t / predivide for t in tensors]
        out = allreduce_list(tensors, average=average, compression=compression, bucket_mb=bucket_mb, name=name,
                             align_bytes=align_bytes)
        return [None if t is None else t.mul_(predivide) for t in out] if predivide != 1.0 else out

    if when is None:
        return over_torch(on_torch, grads)
    return over_torch(on_torch, grads + [when])[:-1]


def reduce_with_local_variables(grads, variables, *, local, scale_local, op, compression, predivide, bucket_mb, name):
    """Reduce ``grads`` over the ranks, except those of variables in ``local`` (``var.ref()`` s): these stay,
    divided by the number of ranks when ``scale_local`` (Horovod's ``scale_local_gradients``)."""
    is_local = [v.ref() in local for v in variables]
    shared = [None if mine else g for g, mine in zip(grads, is_local)]
    reduced = reduce_gradients(shared, average=collectives.ReduceOp(op) is collectives.ReduceOp.AVERAGE, compression=compression,
                               predivide=predivide, name=name, **({"bucket_mb": bucket_mb} if bucket_mb else {}))
    size = float(runtime.size())
    out = []
    for g, r, mine in zip(grads, reduced, is_local):
        if not mine:
            out.append(r)
        elif g is not None and scale_local:
            out.append(g / size)
        else:
            out.append(g)
    return out

"""Compressed allreduce, the entry point: the bytes on the wire really shrink, and a counter says by how much.

``allreduce_compressed(tensor, compressor)`` returns the average (or sum) of
``tensor`` over the group, sending compressed payloads. Which path it takes:

* **summable** payloads (none, fp16, bf16) and warm-up steps: one allreduce of the
  payload itself.
* compressors with their own collective (**PowerSGD**, a ``CollectiveCodec``):
  ``compressor.reduce`` / ``reduce_many`` (two small allreduces of the factors).
* everything else (int8/int4/2-bit with per-rank scales, top-k/threshold pairs,
  packed signs) takes the cheaper of two schemes for the group size ``n``::

    allgather     rank r: x_r ─compress─> p_r ── allgather ──> p_0..p_{n-1}
                  every rank: sum_r decompress(p_r)            sends (n-1)·|p| bytes

    two-phase     rank r: x_r = [c_0 | c_1 | ... | c_{n-1}] ─compress each─> p_{r,j}
      phase 1     alltoall: p_{r,j} goes to rank j            (a reduce-scatter of
                  rank j: s_j = sum_r decompress(p_{r,j})       compressed chunks)
      phase 2     rank j: s_j ─compress (server-side error feedback)─> q_j
                  allgather q_0..q_{n-1}; every rank decompresses and concatenates
                                                               sends ~2(n-1)/n·|p| bytes

  The allgather sends less or the same for ``n <= 2`` and loses less (one
  compression instead of two); two-phase wins from ``n = 3`` on. Error feedback
  applies to the rank's own compression (key ``name``) and to the re-compression
  of its summed chunk (key ``name + "/server"``), as in 1-bit Adam.

Every rank ends with bitwise the same result (the same payloads are decoded in
the same order), so replicas stay in sync. ``async_op=True`` returns a handle
whose ``wait()`` gives the result; the first phase is in flight when it returns,
the second (two-phase only) runs inside ``wait()``.

Bytes sent are counted in :data:`wire` — what this rank puts on the wire with
bandwidth-optimal algorithms (ring allreduce: ``2(n-1)/n`` of the payload,
allgather: ``(n-1)`` times its own payload, alltoall: the chunks for the others),
next to ``dense_bytes``, what an fp32 ring allreduce of the same tensors would send.

The paths themselves, and :data:`wire`, are in :mod:`phalanx.comm.compression.paths`;
this module picks one (:func:`choose_path`) and hands the input over in the form it reads.

Example::

    from phalanx.comm.compression.codecs import get_compressor
    from phalanx.comm.compression.allreduce import allreduce_compressed, wire
    c = get_compressor("topk", ratio=0.01)
    wire.reset()
    avg = allreduce_compressed(grad_flat, c, name="bucket0")
    print(wire.bytes_sent, wire.dense_bytes)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from phalanx.comm.collectives import Handle
from phalanx.comm.compression.abilities import CollectiveCodec, Warmup, codec_of
from phalanx.comm.compression.codecs import get_compressor
from phalanx.comm.compression.paths import (
    PIECE_NUMEL,
    WireCounter,
    allgather_path,
    choose_algorithm,
    finished,
    ring_bytes,
    summable_path,
    two_phase_path,
    wire,
)

__all__ = ["allreduce_compressed", "choose_path", "choose_algorithm", "WireCounter", "wire", "PIECE_NUMEL"]

PATHS = ("local", "summable", "reduce_many", "reduce", "allgather", "two_phase")


def choose_path(compressor, n: int, *, warm: bool, many: bool, numel: int, algorithm: str = "auto") -> str:
    """Which of :data:`PATHS` reduces ``numel`` values over ``n`` ranks with ``compressor``.

    ``warm``: a warm-up step (sent uncompressed); ``many``: the input is several tensors
    (a bucket's ``shapes``) that a ``CollectiveCodec`` may treat one by one.
    """
    if n == 1:
        return "local"
    if warm or compressor.summable:
        return "summable"
    if isinstance(compressor, CollectiveCodec):
        return "reduce_many" if many else "reduce"
    return choose_algorithm(compressor, numel, n) if algorithm == "auto" else algorithm


def allreduce_compressed(
    tensor: torch.Tensor,
    compressor="none",
    *,
    group=None,
    async_op: bool = False,
    name: str | None = None,
    average: bool = True,
    algorithm: str = "auto",
    shapes=None,
    out: torch.Tensor | None = None,
    piece_numel: int | None = None,
    parts=None,
    on_piece=None,
):
    """Average (``average=True``) or sum ``tensor`` over ``group`` with compressed payloads.

    ``shapes``: when ``tensor`` is a flat bucket of several parameters, their shapes in
    order; a ``CollectiveCodec`` (PowerSGD) then treats each as its own matrix.

    ``compressor`` is a name or a Compressor (see ``phalanx.comm.compression.codecs``);
    ``name`` keys per-tensor state (residuals, PowerSGD's Q, warm-up counts) and must
    be the same on every rank. ``algorithm``: ``"auto"``, ``"allgather"`` or
    ``"two_phase"`` (non-summable compressors only).

    ``out``: where the allgather path writes the result (it may be ``tensor`` itself: the
    input is fully read, into the error-feedback buffer or the payloads, before anything is
    written); DataParallel passes its bucket so no copy back is needed. ``piece_numel``:
    values per piece of the pipelined allgather (default :data:`PIECE_NUMEL`).

    ``parts``: the input as separate tensors whose concatenation (flattened) is the value to
    reduce; ``tensor`` is then only the buffer of that size (its content is ignored). Paths
    that can read them directly do (PowerSGD's per-tensor factors, the allgather path's
    error-feedback add); the others first copy them into ``tensor``. DataParallel passes its
    parameters' gradients so it need not copy them into the bucket first.

    ``on_piece(start, stop)``: called once elements ``[start, stop)`` of ``out`` hold their
    final average, while later pieces may still be on the wire (the allgather path writing
    straight into ``out`` only; it is called for no piece otherwise, and the caller handles
    the whole result after ``wait()``). DataParallel steps the optimizer there
    (``overlap_optimizer``).
    """
    if algorithm not in ("auto", "allgather", "two_phase"):
        raise ValueError(f"algorithm must be 'auto', 'allgather' or 'two_phase', got {algorithm!r}")
    compressor = get_compressor(compressor)
    name = "default" if name is None else str(name)
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    warm = compressor.tick(name) if isinstance(compressor, Warmup) else False
    path = choose_path(compressor, n, warm=warm, many=shapes is not None, numel=tensor.numel(), algorithm=algorithm)
    if parts is not None:
        parts = _direct_parts(tensor, parts, compressor, path)
    if path == "local":
        return finished(tensor.clone(), async_op)
    dense = ring_bytes(tensor.numel() * 4, n)
    if path == "summable":
        return summable_path(tensor, None if warm else compressor, group, n, average, async_op, dense)
    if path == "reduce_many":
        return _reduce_many(tensor, compressor, group, n, name, average, async_op, dense, shapes, out, parts)
    if path == "reduce":
        res, sent = compressor.reduce(tensor, group=group, name=name)
        wire.add(sent, dense)
        return finished(res if average else res * n, async_op)
    flat = tensor.detach().reshape(-1)
    if path == "allgather":
        return allgather_path(flat, tensor, compressor, group, n, name, average, async_op, dense, out,
                              piece_numel, parts, on_piece)
    res = two_phase_path(flat, tensor, compressor, group, n, name, average, async_op, dense)
    if out is None:
        return res
    if async_op:
        return Handle(None, res, lambda h: out.copy_(h.wait().view(out.shape)))
    return out.copy_(res.view(out.shape))


def _direct_parts(tensor: torch.Tensor, parts, compressor, path: str):
    """``parts`` for the paths that read them directly (PowerSGD's per-tensor factors, the
    allgather path's error-feedback add); for the others they are copied into ``tensor`` and
    None is returned."""
    parts = [t.detach() for t in parts]
    if sum(t.numel() for t in parts) != tensor.numel():
        raise ValueError(f"allreduce_compressed(parts=...): {sum(t.numel() for t in parts)} values in the parts "
                         f"for a tensor of {tensor.numel()}")
    if path == "reduce_many" or (path == "allgather" and codec_of(compressor)[0] is not None):
        return parts
    views = list(tensor.detach().reshape(-1).split([t.numel() for t in parts]))
    torch._foreach_copy_(views, [t.reshape(-1) for t in parts])
    return None


def _reduce_many(tensor, compressor, group, n, name, average, async_op, dense, shapes, out, parts):
    """A ``CollectiveCodec`` over the bucket's tensors one by one, written straight into ``out``
    when it is a flat fp32 buffer of the right size."""
    sizes = [math.prod(s) for s in shapes]
    src = tensor.detach().reshape(-1).split(sizes) if parts is None else parts
    views = [v.reshape(shape) for v, shape in zip(src, shapes)]
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == tensor.numel()
    targets = [v.view(shape) for v, shape in zip(out.view(-1).split(sizes), shapes)] if direct else None
    outs, sent = compressor.reduce_many(views, group=group, name=name, outs=targets)
    wire.add(sent, dense)
    if direct:
        return finished(out if average else out.mul_(n), async_op)
    res = torch.cat([o.reshape(-1) for o in outs]).view(tensor.shape)
    res = res if average else res * n
    return finished(res if out is None else out.copy_(res.view(out.shape)), async_op)

"""Compressed allreduce: the bytes on the wire really shrink, and a counter says by how much.

``allreduce_compressed(tensor, compressor)`` returns the average (or sum) of
``tensor`` over the group, sending compressed payloads. Which path it takes:

* **summable** payloads (none, fp16, bf16) and warm-up steps: one allreduce of the
  payload itself.
* compressors with their own collective (**PowerSGD**): ``compressor.reduce``
  (two small allreduces of the factors).
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

Example::

    from phalanx.comm.compressed import allreduce_compressed, wire
    from phalanx.comm.compression import get_compressor
from phalanx.comm.error_feedback import compress_residual
    c = get_compressor("topk", ratio=0.01)
    wire.reset()
    avg = allreduce_compressed(grad_flat, c, name="bucket0")
    print(wire.bytes_sent, wire.dense_bytes)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from phalanx.comm.collectives import Handle, all_gather_flat
from phalanx.comm.compression import get_compressor
from phalanx.comm.error_feedback import compress_residual

__all__ = ["allreduce_compressed", "WireCounter", "wire", "choose_algorithm"]


@dataclasses.dataclass
class WireCounter:
    """Bytes this rank sent through ``allreduce_compressed`` since the last ``reset()``."""

    bytes_sent: int = 0
    dense_bytes: int = 0  # what an uncompressed fp32 ring allreduce would have sent
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.dense_bytes = self.calls = 0

    def add(self, sent: int, dense: int) -> None:
        self.bytes_sent += int(sent)
        self.dense_bytes += int(dense)
        self.calls += 1

    @property
    def ratio(self) -> float:
        """dense_bytes / bytes_sent (how many times fewer bytes went out)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes, "calls": self.calls}


wire = WireCounter()
"""The module-level counter; the data-parallel engine and benchmarks read it each step."""


def _ring_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def _parts(compressor):
    """(accumulate, inner): the fused error-feedback entry point (None when off) and the codec."""
    if hasattr(compressor, "accumulate") and hasattr(compressor, "inner"):
        return (compressor.accumulate if compressor.enabled else None), compressor.inner
    return None, compressor


def _compress(inner, accumulate, key: str, src: torch.Tensor):
    """Compress ``src`` (a slice of the error-feedback buffer when ``accumulate`` is set, which
    then keeps the residual) with ``inner``."""
    if accumulate is not None:
        return compress_residual(inner, src)
    return inner.compress(src)


def _decode(inner, payload, ctx, out: torch.Tensor, alpha: float, add: bool) -> None:
    """``out (+)= alpha * decompress(payload)``, fused where the codec can."""
    if hasattr(inner, "decompress_add"):
        inner.decompress_add(payload, ctx, out, alpha, add=add)
        return
    y = inner.decompress(payload, ctx).reshape(-1).float()
    if add:
        out.add_(y, alpha=alpha)
    else:
        torch.mul(y, alpha, out=out)


PIECE_NUMEL = 1 << 19
"""Values per piece when a large tensor goes through the allgather path in pieces (codecs
with a per-chunk layout only: int8/int4/2-bit, sign), so that compressing piece i+1 and
decoding piece i overlap piece i's transfer, and the codecs' temporaries stay small. On 2
simulated hosts at 1 Gbit/s, 4.35M values: int8 84 ms in one piece, 43 ms in pieces of 1M,
40 ms of 512K and 256K, 45 ms of 128K; sign 83, 21, 23, 29, 32 ms."""


def _pieces(inner, numel: int, piece_numel: int | None) -> list[tuple[int, int]]:
    """[start, stop) ranges: whole chunks of the codec's ``chunk`` per piece (same payload bits
    as compressing the whole tensor); one piece for codecs without a chunk layout (top-k picks
    its k over the whole tensor)."""
    chunk = getattr(inner, "chunk", None)
    size = PIECE_NUMEL if piece_numel is None else int(piece_numel)
    if not isinstance(chunk, int) or size <= 0 or numel <= size:
        return [(0, numel)]
    step = max(1, size // math.lcm(chunk, 32)) * math.lcm(chunk, 32)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


class _PiecesHandle:
    """A handle over several in-flight allgathers; ``wait()`` decodes each as it lands."""

    def __init__(self, works, finish) -> None:
        self._works, self._finish, self._result, self._done = works, finish, None, False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self):
        if not self._done:
            self._result = self._finish()
            self._done = True
        return self._result


def _chunk_sizes(numel: int, n: int) -> list[int]:
    return [numel // n + (1 if j < numel % n else 0) for j in range(n)]


def choose_algorithm(compressor, numel: int, n: int) -> str:
    """``"allgather"`` or ``"two_phase"``: whichever sends fewer bytes for ``n`` ranks."""
    size = getattr(compressor, "payload_nbytes", lambda k: None)
    full = size(numel)
    if full is None:  # data-dependent size: assume it scales with numel
        return "allgather" if n <= 2 else "two_phase"
    chunk = max(1, math.ceil(numel / n))
    two_phase = 2 * (n - 1) * size(chunk)
    return "allgather" if (n - 1) * full <= two_phase else "two_phase"


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
    order; compressors with ``reduce_many`` (PowerSGD) then treat each as its own matrix.

    ``compressor`` is a name or a Compressor (see ``phalanx.comm.compression``);
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
    warm = compressor.tick(name) if hasattr(compressor, "tick") else False
    if n == 1:
        path = "local"
    elif warm or compressor.summable:
        path = "summable"
    elif shapes is not None and hasattr(compressor, "reduce_many"):
        path = "reduce_many"
    elif hasattr(compressor, "reduce"):
        path = "reduce"
    else:
        path = choose_algorithm(compressor, tensor.numel(), n) if algorithm == "auto" else algorithm
    if parts is not None:
        parts = [t.detach() for t in parts]
        if sum(t.numel() for t in parts) != tensor.numel():
            raise ValueError(f"allreduce_compressed(parts=...): {sum(t.numel() for t in parts)} values in the parts "
                             f"for a tensor of {tensor.numel()}")
        direct = path == "reduce_many" or (path == "allgather" and _parts(compressor)[0] is not None)
        if not direct:  # this path reads the flat tensor: fill it
            views = list(tensor.detach().reshape(-1).split([t.numel() for t in parts]))
            torch._foreach_copy_(views, [t.reshape(-1) for t in parts])
            parts = None
    if path == "local":
        return _finished(tensor.clone(), async_op)
    wire_dense = _ring_bytes(tensor.numel() * 4, n)
    if path == "summable":
        return _allreduce_summable(tensor, None if warm else compressor, group, n, average, async_op, wire_dense)
    if path == "reduce_many":
        src = tensor.detach().reshape(-1).split([math.prod(s) for s in shapes]) if parts is None else parts
        views = [v.reshape(shape) for v, shape in zip(src, shapes)]
        direct = (out is not None and out.dtype == torch.float32 and out.is_contiguous()
                  and out.numel() == tensor.numel())
        targets = None
        if direct:
            targets = [v.view(shape) for v, shape in
                       zip(out.view(-1).split([math.prod(s) for s in shapes]), shapes)]
        outs, sent = compressor.reduce_many(views, group=group, name=name, outs=targets)
        wire.add(sent, wire_dense)
        if direct:
            return _finished(out if average else out.mul_(n), async_op)
        res = torch.cat([o.reshape(-1) for o in outs]).view(tensor.shape)
        res = res if average else res * n
        return _finished(res if out is None else out.copy_(res.view(out.shape)), async_op)
    if path == "reduce":
        out, sent = compressor.reduce(tensor, group=group, name=name)
        wire.add(sent, wire_dense)
        return _finished(out if average else out * n, async_op)
    flat = tensor.detach().reshape(-1)
    if path == "allgather":
        return _allgather_path(flat, tensor, compressor, group, n, name, average, async_op, wire_dense, out,
                               piece_numel, parts, on_piece)
    res = _two_phase_path(flat, tensor, compressor, group, n, name, average, async_op, wire_dense)
    if out is None:
        return res
    if async_op:
        return Handle(None, res, lambda h: out.copy_(h.wait().view(out.shape)))
    return out.copy_(res.view(out.shape))


def _finished(result, async_op: bool):
    return Handle(None, result) if async_op else result


def _allreduce_summable(tensor, compressor, group, n, average, async_op, dense):
    if compressor is None:
        payload, ctx = tensor.detach().clone(), None
    else:
        payload, ctx = compressor.compress(tensor.detach())
        if payload is tensor:
            payload = payload.clone()
    wire.add(_ring_bytes(payload.numel() * payload.element_size(), n), dense)
    work = dist.all_reduce(payload, group=group, async_op=True)

    def finish(p):
        out = p if compressor is None else compressor.decompress(p, ctx)
        out = out.to(tensor.dtype)
        return out.div_(n) if average else out

    handle = Handle(work, payload, finish)
    return handle if async_op else handle.wait()


def _gather_bytes(payload: torch.Tensor, group, n: int, known: list[int] | None):
    """Start an allgather of uint8 payloads; returns (work, buffer, per-rank sizes, padded size).

    ``known``: every rank's payload size when the compressor fixes it, else they are exchanged.
    """
    if known is None:
        sizes = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
        every = torch.empty(n, dtype=torch.int64, device=payload.device)
        all_gather_flat(every, sizes, group=group)
        counts = [int(c) for c in every.tolist()]
    else:
        counts = list(known)
    width = -(-max(counts) // 8) * 8  # 8-byte aligned slots: codecs view their words without a copy
    if payload.numel() < width:
        payload = torch.cat([payload, payload.new_zeros(width - payload.numel())])
    out = torch.empty(n * width, dtype=torch.uint8, device=payload.device)
    work = all_gather_flat(out, payload, group=group, async_op=True)
    return work, out, counts, width


def _allgather_path(flat, tensor, compressor, group, n, name, average, async_op, dense, out, piece_numel,
                    parts=None, on_piece=None):
    """Every rank's payload to every rank, in pieces: piece i is on the wire while piece i+1
    is compressed, and piece i is decoded while later ones are still arriving. ``parts``
    (error feedback on): added into the residual buffer straight from the given tensors, one
    piece at a time, so the first piece leaves after its own share of the add."""
    accumulate, inner = _parts(compressor)
    add_piece = None
    if parts is not None:
        src, add_piece = compressor.accumulate_parts(name, parts, flat.numel())
    else:
        src = accumulate(name, flat) if accumulate is not None else flat
    fixed = getattr(inner, "fixed_size", False)
    launched, sent = [], 0
    for a, b in _pieces(inner, flat.numel(), piece_numel):
        if add_piece is not None:
            add_piece(a, b)
        payload, ctx = _compress(inner, accumulate, name, src[a:b])
        known = [payload.numel()] * n if fixed else None
        work, buf, counts, width = _gather_bytes(payload, group, n, known)
        sent += (n - 1) * width
        launched.append((work, buf, counts, width, ctx, a, b))
    wire.add(sent, dense)
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == flat.numel()
    alpha = 1.0 / n if average else 1.0

    def finish():
        total = out.view(-1) if direct else torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        for work, buf, counts, width, ctx, a, b in launched:
            work.wait()
            seg = total[a:b]
            for r in range(n):  # in rank order on every rank: bitwise the same sum everywhere
                _decode(inner, buf[r * width : r * width + counts[r]], ctx, seg, alpha, add=r > 0)
            if direct and on_piece is not None:
                on_piece(a, b)
        if direct:
            return out
        result = total.to(tensor.dtype).reshape(tensor.shape)
        return result if out is None else out.copy_(result.view(out.shape))

    handle = _PiecesHandle([w for w, *_ in launched], finish)
    return handle if async_op else handle.wait()


def _two_phase_path(flat, tensor, compressor, group, n, name, average, async_op, dense):
    accumulate, inner = _parts(compressor)
    me = dist.get_rank(group)
    sizes = _chunk_sizes(flat.numel(), n)
    src = accumulate(name, flat) if accumulate is not None else flat
    payloads = [_compress(inner, accumulate, name, chunk)[0] for chunk in torch.split(src, sizes)]
    in_splits = [p.numel() for p in payloads]
    send = torch.cat(payloads)
    if getattr(inner, "fixed_size", False):
        out_splits = [payloads[me].numel()] * n  # every rank's chunk ``me`` has the same size
    else:
        counts_in = torch.tensor(in_splits, dtype=torch.int64, device=flat.device)
        counts_out = torch.empty_like(counts_in)
        dist.all_to_all_single(counts_out, counts_in, group=group)
        out_splits = [int(c) for c in counts_out.tolist()]
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=flat.device)
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)
    phase1 = sum(s for j, s in enumerate(in_splits) if j != me)
    fixed = getattr(inner, "fixed_size", False)
    if fixed:  # both phases' sizes are known now: count at launch, as the other paths do
        wire.add(phase1 + (n - 1) * max(inner.payload_nbytes(s) for s in sizes), dense)

    def finish(buf):
        ctx_me = (sizes[me], torch.float32, (sizes[me],))
        mine = torch.empty(sizes[me], dtype=torch.float32, device=flat.device)
        for r, part in enumerate(torch.split(buf, out_splits)):
            _decode(inner, part, ctx_me, mine, 1.0 / n if average else 1.0, add=r > 0)
        key = name + "/server"
        src_me = accumulate(key, mine) if accumulate is not None else mine
        q, _ = _compress(inner, accumulate, key, src_me)
        known = [inner.payload_nbytes(s) for s in sizes] if fixed else None
        work2, out, counts, width = _gather_bytes(q, group, n, known)
        work2.wait()
        if not fixed:  # data-dependent sizes (threshold): known only now
            wire.add(phase1 + (n - 1) * width, dense)
        result = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        for r, seg in enumerate(torch.split(result, sizes)):
            _decode(inner, out[r * width : r * width + counts[r]], (sizes[r], torch.float32, (sizes[r],)), seg,
                    1.0, add=False)
        return result.to(tensor.dtype).reshape(tensor.shape)

    handle = Handle(work, recv, finish)
    return handle if async_op else handle.wait()

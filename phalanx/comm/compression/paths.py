"""The paths of :func:`~phalanx.comm.compression.allreduce.allreduce_compressed`, and the wire counter.

Each path reduces a flat tensor with one compressor and counts what this rank sent in
:data:`wire`; the entry point picks the path (``choose_path`` there)::

    summable     one allreduce of the payload itself (none, fp16, bf16, warm-up steps)
    collective   the codec reduces by itself (PowerSGD: reduce / reduce_many)
    allgather    every payload to every rank, in pieces of whole chunks, decoded as they land
    two_phase    alltoall of compressed chunks, sum, re-compress, allgather

Example::

    from phalanx.comm.compression.paths import wire
    wire.reset(); ...; print(wire.bytes_sent, wire.dense_bytes, wire.ratio)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from phalanx.comm.collectives import Handle, all_gather_flat
from phalanx.comm.compression.abilities import (
    ChunkedCodec,
    FixedSizePayload,
    FusedDecode,
    ResidualFeedback,
    codec_of,
)
from phalanx.comm.compression.error_feedback import compress_residual, takes_addend

__all__ = ["WireCounter", "wire", "PIECE_NUMEL", "pieces", "decode_into", "choose_algorithm", "ring_bytes",
           "finished", "summable_path", "allgather_path", "two_phase_path"]


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


def ring_bytes(nbytes: int, n: int) -> int:
    """What a bandwidth-optimal (ring) allreduce of ``nbytes`` sends from each of ``n`` ranks."""
    return 2 * (n - 1) * nbytes // n


def _compress(codec, feedback: ResidualFeedback | None, src: torch.Tensor, addend: torch.Tensor | None = None):
    """Compress ``src`` with ``codec``; with error feedback ``src`` is a slice of the residual
    buffer, which then keeps what was not sent (``addend``: the gradient still to be added to it)."""
    if feedback is not None:
        return compress_residual(codec, src, addend)
    return codec.compress(src)


def _source(codec, feedback: ResidualFeedback | None, key: str, flat: torch.Tensor):
    """``(src, addend)``: what to compress: ``flat`` itself without error feedback; else the
    residual buffer of ``key``, with ``flat`` added (addend None) or, for a codec that adds inside
    its compress (``takes_addend``), still to be added (the addend ``flat``)."""
    if feedback is None:
        return flat, None
    if takes_addend(codec, flat):
        res, pending = feedback.prepare(key, flat)
        return res, (flat if pending else None)
    return feedback.accumulate(key, flat), None


def _part(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if t is None else t[a:b]


def decode_into(codec, payload, ctx, out: torch.Tensor, alpha: float, add: bool) -> None:
    """``out (+)= alpha * decompress(payload)``, fused where the codec is a ``FusedDecode``."""
    if isinstance(codec, FusedDecode):
        codec.decompress_add(payload, ctx, out, alpha, add=add)
        return
    y = codec.decompress(payload, ctx).reshape(-1).float()
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


def pieces(codec, numel: int, piece_numel: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) ranges: whole chunks of a ``ChunkedCodec`` per piece (same payload bits as
    compressing the whole tensor); one piece for other codecs (top-k picks its k over the
    whole tensor)."""
    size = PIECE_NUMEL if piece_numel is None else int(piece_numel)
    if not isinstance(codec, ChunkedCodec) or size <= 0 or numel <= size:
        return [(0, numel)]
    step = max(1, size // math.lcm(codec.chunk, 32)) * math.lcm(codec.chunk, 32)
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
    _, codec = codec_of(compressor)
    if not isinstance(codec, FixedSizePayload):  # data-dependent size: assume it scales with numel
        return "allgather" if n <= 2 else "two_phase"
    full = codec.payload_nbytes(numel)
    chunk = max(1, math.ceil(numel / n))
    two_phase = 2 * (n - 1) * codec.payload_nbytes(chunk)
    return "allgather" if (n - 1) * full <= two_phase else "two_phase"


def finished(result, async_op: bool):
    """``result`` as the collectives return it: itself, or a completed handle with ``async_op``."""
    return Handle(None, result) if async_op else result


def summable_path(tensor, compressor, group, n, average, async_op, dense):
    """One plain allreduce of the payload (``compressor`` None: of the tensor itself, a warm-up step)."""
    if compressor is None:
        payload, ctx = tensor.detach().clone(), None
    else:
        payload, ctx = compressor.compress(tensor.detach())
        if payload is tensor:
            payload = payload.clone()
    wire.add(ring_bytes(payload.numel() * payload.element_size(), n), dense)
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


def allgather_path(flat, tensor, compressor, group, n, name, average, async_op, dense, out, piece_numel,
                    parts=None, on_piece=None):
    """Every rank's payload to every rank, in pieces: piece i is on the wire while piece i+1
    is compressed, and piece i is decoded while later ones are still arriving. ``parts``
    (error feedback on): added into the residual buffer straight from the given tensors, one
    piece at a time, so the first piece leaves after its own share of the add."""
    feedback, codec = codec_of(compressor)
    add_piece = addend = None
    if parts is not None:  # the caller checked: error feedback is on
        src, add_piece = feedback.accumulate_parts(name, parts, flat.numel())
    else:
        src, addend = _source(codec, feedback, name, flat)
    fixed = isinstance(codec, FixedSizePayload)
    launched, sent = [], 0
    for a, b in pieces(codec, flat.numel(), piece_numel):
        if add_piece is not None:
            add_piece(a, b)
        payload, ctx = _compress(codec, feedback, src[a:b], _part(addend, a, b))
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
                decode_into(codec, buf[r * width : r * width + counts[r]], ctx, seg, alpha, add=r > 0)
            if direct and on_piece is not None:
                on_piece(a, b)
        if direct:
            return out
        result = total.to(tensor.dtype).reshape(tensor.shape)
        return result if out is None else out.copy_(result.view(out.shape))

    handle = _PiecesHandle([w for w, *_ in launched], finish)
    return handle if async_op else handle.wait()


def two_phase_path(flat, tensor, compressor, group, n, name, average, async_op, dense):
    feedback, codec = codec_of(compressor)
    me = dist.get_rank(group)
    sizes = _chunk_sizes(flat.numel(), n)
    src, addend = _source(codec, feedback, name, flat)
    bounds = [(sum(sizes[:j]), sum(sizes[: j + 1])) for j in range(n)]
    payloads = [_compress(codec, feedback, src[a:b], _part(addend, a, b))[0] for a, b in bounds]
    in_splits = [p.numel() for p in payloads]
    send = torch.cat(payloads)
    fixed = isinstance(codec, FixedSizePayload)
    if fixed:
        out_splits = [payloads[me].numel()] * n  # every rank's chunk ``me`` has the same size
    else:
        counts_in = torch.tensor(in_splits, dtype=torch.int64, device=flat.device)
        counts_out = torch.empty_like(counts_in)
        dist.all_to_all_single(counts_out, counts_in, group=group)
        out_splits = [int(c) for c in counts_out.tolist()]
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=flat.device)
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)
    phase1 = sum(s for j, s in enumerate(in_splits) if j != me)
    if fixed:  # both phases' sizes are known now: count at launch, as the other paths do
        wire.add(phase1 + (n - 1) * max(codec.payload_nbytes(s) for s in sizes), dense)

    def finish(buf):
        ctx_me = (sizes[me], torch.float32, (sizes[me],))
        mine = torch.empty(sizes[me], dtype=torch.float32, device=flat.device)
        for r, part in enumerate(torch.split(buf, out_splits)):
            decode_into(codec, part, ctx_me, mine, 1.0 / n if average else 1.0, add=r > 0)
        key = name + "/server"
        src_me, addend_me = _source(codec, feedback, key, mine)
        q, _ = _compress(codec, feedback, src_me, addend_me)
        known = [codec.payload_nbytes(s) for s in sizes] if fixed else None
        work2, out, counts, width = _gather_bytes(q, group, n, known)
        work2.wait()
        if not fixed:  # data-dependent sizes (threshold): known only now
            wire.add(phase1 + (n - 1) * width, dense)
        result = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        for r, seg in enumerate(torch.split(result, sizes)):
            decode_into(codec, out[r * width : r * width + counts[r]], (sizes[r], torch.float32, (sizes[r],)), seg,
                    1.0, add=False)
        return result.to(tensor.dtype).reshape(tensor.shape)

    handle = Handle(work, recv, finish)
    return handle if async_op else handle.wait()

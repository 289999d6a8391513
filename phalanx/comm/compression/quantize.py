"""Quantisation to 8, 4 or 2 bits with a per-chunk scale, packed into bytes with plain torch ops.

Each chunk of ``chunk`` values gets one fp32 scale ``max|x| / L`` with
``L = 2**(bits-1) - 1`` levels each side (127, 7, 1). Values become integer codes:
int8 stores them as signed bytes in ``[-127, 127]``; 4 and 2 bits store ``code + L``
in ``[0, 2L]``, ``8 // bits`` codes to a byte. Payload layout (one uint8 tensor,
so it can go on the wire as is)::

    [ packed codes: ceil(n * bits / 8) bytes ][ scales: ceil(n / chunk) * 4 bytes ]

int8 is 3.9x smaller than fp32, int4 7.5x, 2-bit 14x (chunk 256). Rounding is to
nearest (error <= scale/2 per value) or, with ``stochastic=True``, up or down at
random with the probability that makes it unbiased (``E[decompress] == x``).
Payloads of different ranks have different scales, so they are not summable:
``phalanx.comm.compression.allreduce.allreduce_compressed`` reduces them.

int8 also has the two fused forms ``allreduce_compressed`` uses: ``compress_ef(x)``
compresses ``x`` and leaves in it, in place, what compression dropped (the error
feedback residual, ``x - decompress(payload)``), and ``decompress_add(payload, ctx,
out, alpha)`` adds ``alpha * decompress(payload)`` to ``out``; both work chunk-row by
chunk-row with no full-size temporaries besides one fp32 scratch buffer that is reused.

Example::

    from phalanx.comm.compression.quantize import QuantizeCompressor
    q = QuantizeCompressor(bits=8)
    payload, ctx = q.compress(torch.randn(1000))   # payload: uint8 tensor, 1016 bytes
    x = q.decompress(payload, ctx)
"""

from __future__ import annotations

import math

import torch

from phalanx.comm.compression import kernels
from phalanx.comm.compression.abilities import (
    AddendResidual,
    ChunkedCodec,
    FixedSizePayload,
    FusedDecode,
)

__all__ = ["QuantizeCompressor", "pack_bits", "unpack_bits", "per_chunk", "to_bytes", "from_bytes"]


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s memory (no copy for a contiguous tensor)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The first ``count`` items of dtype ``dtype`` stored in uint8 ``buf``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    part = buf[: count * itemsize]
    if part.storage_offset() % itemsize or not part.is_contiguous():
        part = part.clone()  # a view needs aligned storage
    return part.view(dtype)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer codes (each < 2**bits, bits in 1, 2, 4, 8) into uint8, low bits first."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.clone()
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    v = codes.view(-1, per_byte)
    out = v[:, 0].clone()
    for i in range(1, per_byte):  # one shifted OR per slot: ~3x faster than a sum over a size-8 dim
        out.bitwise_or_(v[:, i] << (i * bits))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as uint8."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:count].clone()
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per_byte, dtype=torch.uint8, device=packed.device)
    for i in range(per_byte):
        torch.bitwise_and(packed >> (i * bits), mask, out=out[:, i])
    return out.view(-1)[:count]


def per_chunk(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """``values`` (length n) zero-padded to whole chunks, viewed as ``(ceil(n / chunk), chunk)``."""
    n = values.numel()
    pad = (-n) % chunk
    if not pad:
        return values.reshape(-1, chunk)
    out = values.new_zeros(n + pad)
    out[:n] = values.reshape(-1)
    return out.view(-1, chunk)


class QuantizeCompressor(ChunkedCodec, FixedSizePayload, AddendResidual, FusedDecode):
    """Per-chunk scaled integer quantisation to ``bits`` in {8, 4, 2}."""

    summable = False

    def __init__(self, bits: int = 8, chunk: int = 256, stochastic: bool = False, seed: int | None = None) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.bits, self.chunk, self.stochastic = bits, int(chunk), bool(stochastic)
        self.levels = 2 ** (bits - 1) - 1
        self.name = "int8" if bits == 8 else ("int4" if bits == 4 else "2bit")
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self._buf: torch.Tensor | None = None  # scratch kept between calls

    def __repr__(self) -> str:
        return f"QuantizeCompressor(bits={self.bits}, chunk={self.chunk}, stochastic={self.stochastic})"

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel * self.bits / 8) + math.ceil(numel / self.chunk) * 4

    def compress(self, tensor: torch.Tensor):
        x = tensor.detach().reshape(-1).float()
        ctx = (x.numel(), tensor.dtype, tuple(tensor.shape))
        if self._fused(x):  # one compiled call on CUDA (comm/compression/kernels.py)
            return self._fused_encode(x, residual=False), ctx
        if self.bits == 8:
            return self._int8(x, residual=False), ctx
        n = x.numel()
        rows = per_chunk(x, self.chunk)
        amax = rows.abs().amax(1, keepdim=True)
        scale = amax / self.levels
        inv = torch.where(amax > 0, self.levels / amax, torch.zeros_like(amax))
        y = rows * inv
        if self.stochastic:
            noise = torch.rand(y.shape, generator=self._gen, device=y.device) if self._gen is not None and y.device.type == "cpu" else torch.rand_like(y)
            q = y.add_(noise).floor_()
        else:
            q = y.round_()
        codes = q.clamp_(-self.levels, self.levels).add_(self.levels).reshape(-1)[:n]
        payload = torch.cat([pack_bits(codes, self.bits), to_bytes(scale.reshape(-1))])
        return payload, ctx

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        n, dtype, shape = ctx
        if self.bits == 8 or self._fused(payload):
            out = torch.empty(n, dtype=torch.float32, device=payload.device)
            return self.decompress_add(payload, ctx, out, add=False).to(dtype).reshape(shape)
        code_bytes = math.ceil(n * self.bits / 8)
        chunks = math.ceil(n / self.chunk)
        values = per_chunk(unpack_bits(payload[:code_bytes], self.bits, n), self.chunk).float()
        scale = from_bytes(payload[code_bytes:], torch.float32, chunks)
        out = values.sub_(self.levels).mul_(scale.view(-1, 1)).view(-1)[:n]
        return out.to(dtype).reshape(shape)

    def _fused(self, t: torch.Tensor) -> bool:
        """The compiled kernels (on CUDA): rounding to nearest, whole bytes a chunk."""
        return kernels.wanted(t) and not self.stochastic and (self.chunk * self.bits) % 8 == 0

    def _fused_encode(self, x: torch.Tensor, residual: bool, addend: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of flat fp32 ``x`` (``x + addend``) from one compiled call (and ``x`` left
        holding the residual with ``residual``): codes, then scales, as the eager forms lay them out."""
        body, tail, rest = kernels.split_rows(x, self.chunk)
        adds = () if addend is None else kernels.split_rows(addend, self.chunk)[:2]
        if self.bits == 8:
            cb, ct, scales = kernels.run(kernels.int8_encode, body, tail, self.levels, residual, *adds)
        else:
            cb, ct, scales = kernels.run(kernels.packed_encode, body, tail, self.levels, self.bits, residual, *adds)
        if tail is None:
            return torch.cat([to_bytes(cb), to_bytes(scales)])
        return torch.cat([to_bytes(cb), to_bytes(ct)[: math.ceil(rest * self.bits / 8)], to_bytes(scales)])

    def _fused_decode(self, payload: torch.Tensor, n: int, out: torch.Tensor, alpha: float, add: bool):
        chunk = self.chunk
        full, rest = divmod(n, chunk)
        row_bytes = chunk * self.bits // 8
        code_bytes = math.ceil(n * self.bits / 8)
        # the scales as a tensor of their own (not a float32 view of the payload's bytes)
        scales = from_bytes(payload[code_bytes:], torch.float32, full + (rest > 0)).clone().view(-1, 1)
        tail = payload[full * row_bytes : code_bytes] if rest else None  # padded to a row in the kernel
        kernels.run(kernels.int8_decode if self.bits == 8 else kernels.packed_decode,
                    payload[: full * row_bytes].view(full, row_bytes), tail, scales,
                    out[: full * chunk].view(full, chunk), out[full * chunk :] if rest else None, alpha, add)
        return out

    def takes_addend(self, x: torch.Tensor) -> bool:
        """:meth:`compress_ef_add` fuses the add for ``x`` (the compiled path, on CUDA)."""
        return self._fused(x)

    def encode_ef_add(self, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        """The fused encode of ``x + addend`` (:class:`AddendResidual`)."""
        return self._fused_encode(x, residual=True, addend=addend)

    # ------------------------------------------------------------ fused int8 forms
    def compress_ef(self, x: torch.Tensor):
        """Compress the flat fp32 ``x`` and leave the residual ``x - decompress(payload)`` in it."""
        if self._fused(x):
            return self._fused_encode(x, residual=True), (x.numel(), x.dtype, tuple(x.shape))
        if self.bits != 8:  # 4/2 bits: compress, then subtract what the payload decodes to
            payload, ctx = self.compress(x)
            x.sub_(self.decompress(payload, ctx).reshape(-1))
            return payload, ctx
        return self._int8(x, residual=True), (x.numel(), x.dtype, tuple(x.shape))

    def decompress_add(self, payload: torch.Tensor, ctx, out: torch.Tensor, alpha: float = 1.0,
                       add: bool = True) -> torch.Tensor:
        """``out += alpha * decompress(payload)`` (``add=False``: ``out = ...``); ``out`` flat fp32."""
        n = ctx[0]
        if self._fused(payload):
            return self._fused_decode(payload, n, out, alpha, add)
        if self.bits != 8:
            y = self.decompress(payload, ctx).reshape(-1).float()
            return out.add_(y, alpha=alpha) if add else torch.mul(y, alpha, out=out)
        return self._int8_decode(payload, n, out, alpha, add)

    def _scratch(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < rows * self.chunk or buf.device != like.device:
            buf = self._buf = torch.empty(rows * self.chunk, dtype=torch.float32, device=like.device)
        return buf[: rows * self.chunk].view(rows, self.chunk)

    def _int8(self, x: torch.Tensor, residual: bool) -> torch.Tensor:
        """int8 payload of flat fp32 ``x``; with ``residual``, ``x`` becomes ``x - decode(payload)``.

        Per chunk-row: one min/max pass (no |x| temporary), ``x * (L / amax)`` into the
        scratch buffer, round in place, convert into the payload, and for the residual one
        fused ``x -= q * scale``. A partial last chunk is handled on a small padded copy.
        """
        n, chunk, levels = x.numel(), self.chunk, self.levels
        chunks = math.ceil(n / chunk)
        payload = torch.empty(n + 4 * chunks, dtype=torch.uint8, device=x.device)
        codes = payload[:n].view(torch.int8)
        scales = torch.empty(chunks, dtype=torch.float32, device=x.device)
        full = n // chunk
        blocks = []
        if full:
            blocks.append((x[: full * chunk].view(full, chunk), 0, full * chunk))
        if full < chunks:
            blocks.append((per_chunk(x[full * chunk :], chunk), full * chunk, n))
        for row, (rows, start, stop) in enumerate(blocks):
            # amax and amin as two float reductions: 2x faster than |x|.amax, 15x than aminmax (CPU)
            amax = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg_())
            first = 0 if row == 0 else full
            scales[first : first + rows.shape[0]] = (amax / levels).view(-1)
            # 0 where L/amax is not finite (amax 0, or below ~1e-37): such a chunk sends zeros and its
            # values stay in the residual; x * inv then never exceeds L, so no clamp pass is needed
            inv = torch.nan_to_num_(levels / amax, nan=0.0, posinf=0.0, neginf=0.0)
            q = torch.mul(rows, inv, out=self._scratch(rows.shape[0], x))
            if self.stochastic:
                noise = torch.rand(q.shape, generator=self._gen, device=q.device) \
                    if self._gen is not None and q.device.type == "cpu" else torch.rand_like(q)
                q.add_(noise).floor_().clamp_(-levels, levels)
            else:
                q.round_()  # |x * L / amax| <= L (+ rounding): never past L after rounding
            codes[start:stop].copy_(q.view(-1)[: stop - start])
            if residual:
                rows.addcmul_(q, amax.div_(levels), value=-1.0)
                if stop - start < rows.numel():  # the padded copy of the last chunk: write it back
                    x[start:stop].copy_(rows.view(-1)[: stop - start])
        payload[n:].copy_(to_bytes(scales))
        return payload

    def _int8_decode(self, payload: torch.Tensor, n: int, out: torch.Tensor, alpha: float, add: bool):
        chunk = self.chunk
        chunks = math.ceil(n / chunk)
        full = n // chunk
        codes = payload[:n].view(torch.int8)
        scales = from_bytes(payload[n:], torch.float32, chunks).view(-1, 1)
        if alpha != 1.0:
            scales = scales * alpha
        if full:
            body = out[: full * chunk].view(full, chunk)
            c = codes[: full * chunk].view(full, chunk)
            if add:
                body.addcmul_(c, scales[:full])
            else:
                torch.mul(c, scales[:full], out=body)
        if full < chunks:
            tail = codes[full * chunk :].float().mul_(scales[full])
            if add:
                out[full * chunk :].add_(tail)
            else:
                out[full * chunk :].copy_(tail)
        return out

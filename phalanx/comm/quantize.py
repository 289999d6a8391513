"""Quantisation to 8, 4 or 2 bits with a per-chunk scale, packed into bytes with plain torch ops.

Each chunk of ``chunk`` values gets one fp32 scale ``max|x| / L`` with
``L = 2**(bits-1) - 1`` levels each side (127, 7, 1). Values become integer codes
in ``[0, 2L]``; ``8 // bits`` codes share a byte. Payload layout (one uint8 tensor,
so it can go on the wire as is)::

    [ packed codes: ceil(n * bits / 8) bytes ][ scales: ceil(n / chunk) * 4 bytes ]

int8 is 3.9x smaller than fp32, int4 7.5x, 2-bit 14x (chunk 256). Rounding is to
nearest (error <= scale/2 per value) or, with ``stochastic=True``, up or down at
random with the probability that makes it unbiased (``E[decompress] == x``).
Payloads of different ranks have different scales, so they are not summable:
``phalanx.comm.compressed.allreduce_compressed`` reduces them.

Example::

    from phalanx.comm.quantize import QuantizeCompressor
    q = QuantizeCompressor(bits=8)
    payload, ctx = q.compress(torch.randn(1000))   # payload: uint8 tensor, 1016 bytes
    x = q.decompress(payload, ctx)
"""

from __future__ import annotations

import math

import torch

__all__ = ["QuantizeCompressor", "pack_bits", "unpack_bits", "to_bytes", "from_bytes"]


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
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.view(-1, per_byte) << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).reshape(-1)[:count]


class QuantizeCompressor:
    """Per-chunk scaled integer quantisation to ``bits`` in {8, 4, 2}."""

    summable = False
    fixed_size = True

    def __init__(self, bits: int = 8, chunk: int = 256, stochastic: bool = False, seed: int | None = None) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.bits, self.chunk, self.stochastic = bits, int(chunk), bool(stochastic)
        self.levels = 2 ** (bits - 1) - 1
        self.name = "int8" if bits == 8 else ("int4" if bits == 4 else "2bit")
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def __repr__(self) -> str:
        return f"QuantizeCompressor(bits={self.bits}, chunk={self.chunk}, stochastic={self.stochastic})"

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel * self.bits / 8) + math.ceil(numel / self.chunk) * 4

    def compress(self, tensor: torch.Tensor):
        flat = tensor.detach().reshape(-1).float()
        n = flat.numel()
        pad = (-n) % self.chunk
        x = torch.cat([flat, flat.new_zeros(pad)]).view(-1, self.chunk) if pad else flat.view(-1, self.chunk)
        scale = x.abs().amax(1, keepdim=True) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = x / safe
        if self.stochastic:
            noise = torch.rand(y.shape, generator=self._gen, device=y.device) if self._gen is not None and y.device.type == "cpu" else torch.rand_like(y)
            q = torch.floor(y + noise)
        else:
            q = torch.round(y)
        codes = (q.clamp_(-self.levels, self.levels) + self.levels).reshape(-1)[:n]
        payload = torch.cat([pack_bits(codes, self.bits), to_bytes(scale.reshape(-1))])
        return payload, (n, tensor.dtype, tuple(tensor.shape))

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        n, dtype, shape = ctx
        code_bytes = math.ceil(n * self.bits / 8)
        codes = unpack_bits(payload[:code_bytes], self.bits, n).float() - self.levels
        scale = from_bytes(payload[code_bytes:], torch.float32, math.ceil(n / self.chunk))
        per_value = scale.repeat_interleave(self.chunk)[:n]
        return (codes * per_value).to(dtype).reshape(shape)

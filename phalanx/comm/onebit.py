"""1-bit compression: the sign of every entry, 8 per byte, times one scale per chunk.

As in 1-bit SGD (Seide et al. 2014) and EF-SignSGD (Karimireddy et al. 2019):
``C(x) = (||x||_1 / d) * sign(x)`` per chunk of ``d`` values, which keeps the
chunk's mean magnitude. Without error feedback sign compression is biased and
can fail to converge; with it (on by default in the registry) it matches SGD
on many problems. Payload, one uint8 tensor::

    [ sign bits: ceil(n / 8) bytes ][ scales: ceil(n / chunk) * 4 bytes ]

about 28x smaller than fp32 at the default chunk of 256 values (a smaller chunk
follows the gradient's scale more closely, so the residual stays smaller).

Example::

    from phalanx.comm.onebit import SignCompressor
    c = SignCompressor()
    payload, ctx = c.compress(torch.tensor([0.5, -2.0, 1.5]))
    c.decompress(payload, ctx)         # tensor([ 1.3333, -1.3333,  1.3333])
"""

from __future__ import annotations

import math

import torch

from phalanx.comm.quantize import from_bytes, pack_bits, to_bytes, unpack_bits

__all__ = ["SignCompressor"]


class SignCompressor:
    """Scaled sign, bit-packed. ``x >= 0`` is sent as +scale."""

    summable = False
    fixed_size = True

    def __init__(self, chunk: int = 256) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)
        self.name = "sign"

    def __repr__(self) -> str:
        return f"SignCompressor(chunk={self.chunk})"

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel / 8) + math.ceil(numel / self.chunk) * 4

    def compress(self, tensor: torch.Tensor):
        flat = tensor.detach().reshape(-1).float()
        n = flat.numel()
        pad = (-n) % self.chunk
        padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
        sums = padded.abs().view(-1, self.chunk).sum(1)
        counts = torch.full_like(sums, float(self.chunk))
        if pad:
            counts[-1] = self.chunk - pad
        scale = sums / counts
        payload = torch.cat([pack_bits(flat >= 0, 1), to_bytes(scale)])
        return payload, (n, tensor.dtype, tuple(tensor.shape))

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        n, dtype, shape = ctx
        nbits = math.ceil(n / 8)
        signs = unpack_bits(payload[:nbits], 1, n).float() * 2 - 1
        scale = from_bytes(payload[nbits:], torch.float32, math.ceil(n / self.chunk))
        return (signs * scale.repeat_interleave(self.chunk)[:n]).to(dtype).reshape(shape)

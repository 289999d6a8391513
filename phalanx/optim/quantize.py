"""Block-wise dynamic 8-bit quantization of optimizer state (Dettmers et al., ICLR 2022, arXiv:2110.02861).

A tensor is cut into blocks of :data:`BLOCK` elements; each block is scaled by its
own absolute maximum into [-1, 1] and every element is stored as the index (one
byte) of the nearest value of a fixed 256-entry *dynamic* code::

    x_flat ─ pad ─ view(nblocks, BLOCK) ─ / absmax(block) ─ nearest code index ─► uint8[n_padded]
                                         └──────────────────────────────────────► fp32[nblocks]

Dynamic (tree) quantization spends the byte as sign · exponent · fraction with a
variable split: after the sign, a run of zero bits sets the decimal exponent
(10^-6 … 10^0), a one bit ends the run and the bits left are a linear fraction in
[0.1, 1]. Values near 0 get fine steps and large ones coarse steps, which
suits Adam's moments, whose magnitudes span many orders. The second moment is
never negative, so its code gives the sign bit to the fraction instead
(:func:`dynamic_code` ``signed=False``). The block-wise scale bounds the effect
of an outlier to its block of 2,048 elements, the paper's choice (Section 2.1).

Bytes per element: 1 + 4/BLOCK (0.002) for the scale.

Example::

    q, absmax = quantize(exp_avg, CODE_SIGNED)
    exp_avg_again = dequantize(q, absmax, CODE_SIGNED, exp_avg.numel())
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK", "dynamic_code", "quantize", "dequantize", "quantize_", "dequantize_", "Workspace", "padded",
           "CODE_SIGNED", "CODE_UNSIGNED"]

# The paper's block size: smaller blocks would track outliers more closely but add 4 bytes of
# scale per block; at 2,048 the scale costs 0.2% of the state.
BLOCK = 2048


def dynamic_code(signed: bool = True) -> torch.Tensor:
    """The 256 sorted values of the dynamic tree code in [-1, 1] (``signed``) or [0, 1].

    Exponent i = 0..6 gets 2^i fraction steps (signed) or 2^(i+1) (unsigned) at the
    midpoints of ``linspace(0.1, 1)``, scaled by 10^(i-6); plus 0 and 1. Same table
    as bitsandbytes' ``create_dynamic_map(signed, 7, 8)``.
    """
    exponent_bits = 7
    values: list[float] = []
    for i in range(exponent_bits):
        steps = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1, steps + 1, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - exponent_bits + 1)).tolist()
        values += means + ([-v for v in means] if signed else [])
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


CODE_SIGNED = dynamic_code(signed=True)
CODE_UNSIGNED = dynamic_code(signed=False)


def _nearest_table(code: torch.Tensor) -> torch.Tensor:
    """For each of the 65,536 fp16 bit patterns, the index of the nearest code (uint8).

    Quantizing is then one cast to fp16 and one table lookup per element, instead of a
    binary search over the 255 midpoints (``torch.bucketize``), which made an 8-bit Adam
    step 4x a fp32 AdamW step on the CPU. Rounding to fp16 first (11 significant bits)
    can move a value within half an fp16 step of a midpoint to the neighbouring code; the
    codes are at least 2^-7 apart near 1 and fp16 is 2^-11 there.
    """
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    values = torch.nan_to_num(values, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0, 1.0)
    index = torch.bucketize(values, (code[1:] + code[:-1]) / 2).to(torch.uint8)
    table = torch.empty(2**16, dtype=torch.uint8)
    table[torch.arange(-(2**15), 2**15, dtype=torch.int32) & 0xFFFF] = index  # by the pattern's unsigned value
    return table


_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def _table(code: torch.Tensor, device: torch.device) -> torch.Tensor:
    key = (id(code), str(device))
    if key not in _TABLES:
        _TABLES[key] = _nearest_table(code).to(device)
    return _TABLES[key]


def padded(numel: int) -> int:
    """``numel`` rounded up to whole blocks."""
    return max(1, math.ceil(numel / BLOCK)) * BLOCK


class Workspace:
    """The scratch buffers of :func:`quantize_` / :func:`dequantize_` for up to ``numel`` elements
    (rounded up to whole blocks): an int32 index and an fp16 copy, 6 bytes an element.

    Allocated once per optimizer step and reused for every tensor, so quantizing in place allocates
    nothing: the allocator sees the same few blocks each step instead of a train of short-lived ones
    between the long-lived state (which glibc's heap would keep as holes, see :mod:`phalanx.optim.adam8bit`).
    """

    def __init__(self, numel: int, device) -> None:
        n = padded(numel)
        self.index = torch.empty(n, dtype=torch.int32, device=device)
        self.half = torch.empty(n, dtype=torch.float16, device=device)


def dequantize_(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
    """``out`` (fp32, ``q.numel()`` long, a multiple of BLOCK) = the values :func:`quantize_` stored."""
    index = ws.index[: q.numel()]
    index.copy_(q)
    torch.index_select(code.to(q.device), 0, index, out=out)
    out.view(-1, BLOCK).mul_(absmax.unsqueeze(1))


def quantize_(x: torch.Tensor, code: torch.Tensor, q: torch.Tensor, absmax: torch.Tensor, ws: Workspace) -> None:
    """``x`` (fp32, flat, a multiple of BLOCK long) → ``q`` (uint8) and ``absmax`` (fp32, one per block),
    in place. ``x`` is overwritten (divided by its block scales)."""
    blocks = x.view(-1, BLOCK)
    torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1, out=absmax)
    blocks.div_(absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    half, index = ws.half[: x.numel()], ws.index[: x.numel()]
    half.copy_(x)
    index.copy_(half.view(torch.int16)).bitwise_and_(0xFFFF)  # the fp16 bit pattern, as unsigned
    torch.index_select(_table(code, x.device), 0, index, out=q)


def quantize(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape) → (uint8 indices [padded(numel)], fp32 block scales [padded/BLOCK])."""
    n = x.numel()
    flat = torch.zeros(padded(n), dtype=torch.float32, device=x.device)
    flat[:n] = x.detach().reshape(-1)
    q = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(flat.numel() // BLOCK, dtype=torch.float32, device=x.device)
    quantize_(flat, code, q, absmax, Workspace(n, x.device))
    return q, absmax


def dequantize(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values (flat, ``numel`` long) that :func:`quantize` stored."""
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    dequantize_(q, absmax, code, out, Workspace(q.numel(), q.device))
    return out[:numel]

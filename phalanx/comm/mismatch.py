"""The cross-rank check before a collective: do all ranks mean the same call?

Before a collective is sent, the ranks compare a 63-bit digest of what each is about to do
(operation, name, dtype, shape, op, root) with one 16-byte allreduce (MAX of ``[h, -h]``: equal
on every rank exactly when ``max(h) == -max(-h)``, i.e. ``max == min``); if they differ, every rank
raises :class:`CollectiveMismatchError` naming the tensor and the ranks that disagree, instead of
hanging or silently summing garbage. The digest of a repeated call is cached. Off with
``set_mismatch_check(False)`` or ``PHALANX_CHECK_COLLECTIVES=0`` (or ``false``/``no``/``off``);
``benchmarks/mismatch_check.py`` measures what it costs.

Example::

    from phalanx.comm.mismatch import check_call
    check_call("allreduce", "grad", tensor, group=None, op="sum")   # raises on every rank if they differ
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist

from phalanx import trace
from phalanx.runtime.backends import engine
from phalanx.runtime.heartbeat import RECORD
from phalanx.settings import CommSettings, SettingsError

__all__ = ["CollectiveMismatchError", "check_call", "describe_mismatch", "set_mismatch_check",
           "mismatch_check_enabled", "default_device"]


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one on incompatible tensors."""


def _from_environment() -> bool:
    try:
        return CommSettings.one("check_collectives")
    except SettingsError:  # init() names the bad value in one line (settings.load); until then: on
        return True


_check_enabled = _from_environment()


def set_mismatch_check(enabled: bool) -> None:
    """Turn the cross-rank metadata check on or off for this process (all ranks must agree)."""
    global _check_enabled
    _check_enabled = bool(enabled)


def mismatch_check_enabled() -> bool:
    return _check_enabled


@functools.lru_cache(maxsize=4096)
def _digest(signature: tuple) -> int:
    raw = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1  # fits a signed int64


def check_call(kind: str, name: str | None, tensor: torch.Tensor | None, group,
               entry: list | None = None, **extra) -> None:
    """Raise on every rank if the ranks are not all about to make the same call."""
    if not _check_enabled:
        return
    shape = tuple(tensor.shape) if tensor is not None else None
    dtype = str(tensor.dtype) if tensor is not None else None
    if kind in ("allgather", "alltoall") and shape:
        shape = ("*",) + shape[1:]  # the first dimension may differ across ranks
    signature = (kind, name, dtype, shape, tuple(sorted(extra.items())))
    h = _digest(signature)
    device = tensor.device if tensor is not None and tensor.device.type != "meta" else default_device()
    probe = torch.tensor([h, -h], dtype=torch.int64, device=device)
    with trace.span("negotiate", "comm", call=kind, tensor=name):  # shown apart on the timeline
        if entry is None:
            dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        else:
            RECORD.blocking(entry, dist.all_reduce, probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[0]) == -int(probe[1]):
        return
    mine = {"call": kind, "name": name, "dtype": dtype, "shape": shape, **extra}
    every: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(every, mine, group=group)
    raise CollectiveMismatchError(describe_mismatch(every, group))


def describe_mismatch(every: list[dict], group) -> str:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(every)))
    fields = [k for k in every[0] if len({repr(m.get(k)) for m in every}) > 1]
    fields += [k for m in every for k in m if k not in every[0] and k not in fields]
    names = sorted({str(m.get("name")) for m in every})
    lines = [
        f"phalanx: collective mismatch on tensor {', '.join(names)}: the ranks disagree on "
        f"{', '.join(fields)}."
    ]
    for r, m in zip(ranks, every):
        desc = ", ".join(f"{k}={m[k]}" for k in m if k != "call")
        lines.append(f"  rank {r}: {m['call']}({desc})")
    lines.append(
        "Every rank must make the same collectives in the same order on tensors of the same "
        "dtype and shape. Check for rank-dependent branches or data-dependent shapes."
    )
    return "\n".join(lines)


def default_device(group=None) -> torch.device:
    """The device a tensor must be on to travel in ``group``: this rank's GPU on NCCL (which sends
    CUDA tensors only), else the CPU. Where a probe or flag with no tensor of its own goes."""
    if engine(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Which engine a process group runs on, through the names c10d gives it.

``torch.distributed.get_backend(group)`` returns the name a group was made with. A c10d backend
registered by name (``torch.distributed.Backend.register_backend``) wraps an engine under a new
name: phalanx's elastic admission adopts a connected gloo group as ``phalanx_staged``
(``phalanx.elastic.staging``). Code that picks a path by engine (the dtypes gloo lacks, gloo's
in-place reduce-scatter, the device NCCL sends from) asks :func:`engine` instead, which reads
through the names registered with :func:`register_alias`.

Example::

    register_alias("phalanx_staged", "gloo")
    engine()            # "gloo" on a default group made with phalanx_staged
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["engine", "register_alias"]

_ALIASES: dict[str, str] = {}


def register_alias(name: str, engine_name: str) -> None:
    """Groups made with the c10d backend ``name`` run on ``engine_name`` ("gloo", "nccl", ...)."""
    _ALIASES[name] = engine_name


def engine(group=None) -> str:
    """The engine under ``group`` (default: the default group): "gloo", "nccl", ...; "gloo" when no
    group exists (a process of one with nothing initialized moves tensors as gloo would)."""
    if not dist.is_initialized():
        return "gloo"
    name = dist.get_backend(group)
    return _ALIASES.get(name, name)

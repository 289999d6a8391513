"""Rank-aware logging: every record says which rank wrote it; rank-0-only helpers for scripts.

Example::

    from phalanx.log import get_logger
    log = get_logger(__name__)
    log.info("bucket plan: %d buckets", 4)      # -> [rank 1] phalanx.x: bucket plan: 4 buckets
    rank0_info(log, "only rank 0 says this")

In a training script (``px.print0`` / ``px.log0`` are these)::

    px.print0(f"epoch {epoch}: loss {loss:.4f}")   # printed once, by rank 0, flushed at once
    px.log0("epoch %d: loss %.4f", epoch, loss)    # INFO on rank 0 through the 'phalanx' logger

The rank is the one ``init()`` recorded (:func:`set_rank`); before it, the launcher's
variable (RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK), else 0.
"""

from __future__ import annotations

import logging
import os

from phalanx.settings import RuntimeSettings, SettingsError

__all__ = ["get_logger", "rank0_info", "print0", "log0", "set_rank", "set_level", "current_rank"]

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_rank: int | None = None


def current_rank() -> int:
    """This process's rank as far as logging knows (see the module docstring)."""
    if _rank is not None:
        return _rank
    for var in _RANK_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def set_rank(rank: int | None) -> None:
    """Record this process's rank for log prefixes and the rank-0 helpers (``init()`` calls it)."""
    global _rank
    _rank = rank


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


def _level_from_env() -> str:
    # A bad PHALANX_LOG_LEVEL must not break an import; init() rejects it with one line.
    try:
        return RuntimeSettings.one("log_level")
    except SettingsError:
        return "WARNING"


def get_logger(name: str) -> logging.Logger:
    """A logger under ``phalanx`` whose lines carry a ``[rank N]`` prefix."""
    root = logging.getLogger("phalanx")
    if not any(getattr(h, "_phalanx", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler._phalanx = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(_level_from_env())
        root.propagate = False
    return logging.getLogger(name)


def set_level(level: str) -> None:
    """Set the library's log level (a validated name such as ``"INFO"``)."""
    get_logger("phalanx").setLevel(level)


def rank0_info(logger: logging.Logger, msg: str, *args) -> None:
    """Log at INFO on rank 0 only."""
    if current_rank() == 0:
        logger.info(msg, *args)


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed at once (so it shows under ``phalanx run`` straight away).

    Example::

        px.print0("epoch", epoch, "loss", round(loss, 4))
    """
    if current_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def log0(msg: str, *args, level: int = logging.INFO) -> None:
    """Log ``msg % args`` on rank 0 only, as ``[rank 0] phalanx.user: …``.

    The ``phalanx.user`` logger shows INFO whatever PHALANX_LOG_LEVEL says of the library's
    own lines; ``logging.getLogger("phalanx.user").setLevel(...)`` changes that.

    Example::

        px.log0("epoch %d: loss %.4f", epoch, loss)
    """
    if current_rank() == 0:
        logger = get_logger("phalanx.user")
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        logger.log(level, msg, *args)

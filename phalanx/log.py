"""Rank-aware logging: every record says which rank wrote it.

Example::

    from phalanx.log import get_logger
    log = get_logger(__name__)
    log.info("bucket plan: %d buckets", 4)      # -> [rank 1] phalanx.x: bucket plan: 4 buckets
    rank0_info(log, "only rank 0 says this")
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "rank0_info"]


def _rank() -> str:
    return os.environ.get("RANK", "0")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def get_logger(name: str) -> logging.Logger:
    """A logger under ``phalanx`` whose lines carry a ``[rank N]`` prefix."""
    root = logging.getLogger("phalanx")
    if not any(getattr(h, "_phalanx", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler._phalanx = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("PHALANX_LOG_LEVEL", "WARNING").upper())
        root.propagate = False
    return logging.getLogger(name)


def rank0_info(logger: logging.Logger, msg: str, *args) -> None:
    """Log at INFO on rank 0 only."""
    if _rank() == "0":
        logger.info(msg, *args)

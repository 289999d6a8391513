"""Multi-rank test harness (nanotron / DeepSpeed style) on top of ``phalanx.run``.

``distributed(body, np=…)`` runs ``body`` on ``np`` gloo ranks over loopback with a
free port (retried when taken), returns each rank's result, re-raises the first
rank's exception as :class:`RankError` with its traceback, and on a hang kills
the ranks and raises :class:`RankTimeoutError` with each hung rank's Python stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.launcher.spawn import run

__all__ = ["distributed", "world_sizes", "assert_same_on_all_ranks"]


def distributed(
    body: Callable[..., Any],
    np: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    local_size: int | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``body`` on ``np`` real ranks (``phalanx.init()`` done) and return their results."""
    return run(body, np=np, args=args, kwargs=kwargs, timeout=timeout, local_size=local_size, env=env)


def world_sizes(*sizes: int):
    """``@world_sizes(2, 4)`` == ``pytest.mark.parametrize("np", [2, 4])``."""
    import pytest

    return pytest.mark.parametrize("np", list(sizes))


def assert_same_on_all_ranks(results: Sequence[Any], atol: float = 0.0) -> None:
    """Every rank returned the same tensors (or dicts/lists of tensors)."""
    first = results[0]
    for r, other in enumerate(results[1:], start=1):
        _assert_close(first, other, atol, f"rank {r} vs rank 0")


def _assert_close(a, b, atol: float, where: str) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _assert_close(a[k], b[k], atol, f"{where}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, atol, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"

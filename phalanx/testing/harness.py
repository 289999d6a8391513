"""Multi-rank test harness (nanotron / DeepSpeed style) on top of ``phalanx.run``.

``distributed(body, np=…)`` runs ``body`` on ``np`` gloo ranks over loopback with a
free port (retried when taken), returns each rank's result, re-raises the first
rank's exception as :class:`RankError` with its traceback, and on a hang kills
the ranks and raises :class:`RankTimeoutError` with each hung rank's Python stack.

``PHALANX_TEST_DEVICE=cuda`` runs the same bodies with their tensors on the GPU: each rank
computes on ``cuda`` with the random numbers of the CPU run (:mod:`phalanx.testing.device`), on
NCCL when there is a GPU per rank and on gloo with CUDA tensors when ranks share one, and hands
its results back on the CPU. CI leaves it at ``cpu``;
``benchmarks/gpu/run.sh`` turns it on for the core test modules on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.launcher.spawn import run
from phalanx.settings import TestingSettings
from phalanx.testing.device import on_device

__all__ = ["distributed", "world_sizes", "assert_same_on_all_ranks", "device_under_test"]

TEST_DEVICES = ("cpu", "cuda")


def device_under_test() -> str:
    """The device the rank bodies of :func:`distributed` compute on: PHALANX_TEST_DEVICE
    (``cpu`` | ``cuda``; default ``cpu``). A bad value raises one line naming it."""
    return TestingSettings.one("test_device")


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
    """Run ``body`` on ``np`` real ranks (``phalanx.init()`` done) and return their results.

    Under ``PHALANX_TEST_DEVICE=cuda`` the body makes its tensors on CUDA and its results come
    back on the CPU (see the module docstring); ``env`` still wins over the
    backend and device chosen for it.
    """
    if device_under_test() == "cuda":
        env = {**cuda_env(np), **(env or {})}
        args, kwargs, body = (body, tuple(args), dict(kwargs or {})), None, on_test_device
    return run(body, np=np, args=args, kwargs=kwargs, timeout=timeout, local_size=local_size, env=env)


def cuda_env(np: int) -> dict[str, str]:
    """The ranks' backend and device for a CUDA test run of ``np`` ranks: NCCL with a GPU each
    when the machine has ``np`` GPUs; otherwise gloo, every rank on ``cuda:0`` (NCCL refuses two
    ranks on one GPU; gloo stages CUDA tensors through pinned host memory)."""
    if not torch.cuda.is_available():
        raise RuntimeError("PHALANX_TEST_DEVICE=cuda but torch sees no CUDA device; unset it to test on the CPU")
    if torch.cuda.device_count() >= np:
        return {"PHALANX_BACKEND": "nccl"}
    return {"PHALANX_BACKEND": "gloo", "PHALANX_DEVICE": "cuda:0"}


def on_test_device(body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """In a rank: ``body`` on the rank's device (:func:`phalanx.testing.device.on_device`)."""
    from phalanx.runtime import topology

    return on_device(topology().device, body, args, kwargs)


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

"""Run a Python function on N local ranks and collect what each returns.

``phalanx.run(fn, np=2, args=…)`` is the notebook and test entry point (like
``horovod.run``). Ranks are forked from a forkserver that has already imported
torch, so a rank starts in tens of milliseconds, not seconds.

Failure handling, in the spirit of DeepSpeed's test launcher: nothing waits
forever. When a rank raises, the others get a short grace period and are then
killed; when the deadline passes, each rank still running is asked for its
Python stack (faulthandler on SIGUSR2) and the error names the ranks that hung
with their stacks.

Example::

    import phalanx as px

    def work(scale):
        px.init()
        return px.allreduce(torch.ones(1) * px.rank(), op=px.Sum).item() * scale

    print(px.run(work, np=2, args=(10,)))   # [10.0, 10.0]
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_any
from typing import Any

from phalanx.launcher.stall import lost_a_peer
from phalanx.settings import RuntimeSettings

__all__ = ["run", "RankError", "RankTimeoutError", "free_port"]

_GRACE_S = 5.0


class RankError(RuntimeError):
    """A rank raised. ``.rank`` says which, ``.exception`` is its exception when it could be pickled."""

    def __init__(self, message: str, rank: int, exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exception = exception


class RankTimeoutError(RankError):
    """Ranks were still running at the deadline; the message holds their Python stacks."""


@dataclasses.dataclass
class _Failure:
    kind: str
    text: str
    exception: BaseException | None
    at: float = dataclasses.field(default_factory=time.time)  # wall clock: ranks share it


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        # The server imports torch once; every rank is then a cheap fork of it. torch._dynamo is
        # what the first optimizer step imports (~1 s a rank otherwise); PHALANX_SPAWN_PRELOAD
        # (comma list) adds more, e.g. the test suite's sklearn.datasets.
        extra = RuntimeSettings.one("spawn_preload")
        _ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "phalanx", *extra])
    return _ctx


def _rank_main(fn, rank, size, local_size, port, args, kwargs, conn, stack_path, init, env, threads):
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(rank % local_size),
            "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(rank // local_size),
            "GROUP_WORLD_SIZE": str(size // local_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PHALANX_LAUNCHER": "spawn",
        }
    )
    os.environ.update(env)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR2, file=stack_file, all_threads=True)
    import torch

    torch.set_num_threads(threads)
    from phalanx import runtime
    from phalanx.launcher.startup import join

    try:
        if init:
            join()
        result = fn(*args, **kwargs)
        # Plain pickle copies tensors into the message; multiprocessing's own pickler would
        # share their memory through a channel that closes when this rank exits.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            conn.send_bytes(pickle.dumps(("err", _Failure(type(exc).__name__, text, exc))))
        except Exception:  # the exception itself would not pickle
            conn.send_bytes(pickle.dumps(("err", _Failure(type(exc).__name__, text, None))))
    finally:
        try:
            runtime.shutdown()
        finally:
            conn.close()


def _port_taken(failure: _Failure) -> bool:
    text = failure.text.lower()
    return "address already in use" in text or "eaddrinuse" in text


def run(
    fn: Callable[..., Any],
    np: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    local_size: int | None = None,
    env: dict[str, str] | None = None,
    init: bool = True,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` local ranks; return the results in rank order.

    Args:
        fn: a module-level function (it is sent to the ranks by reference).
        timeout: seconds before hung ranks are killed and reported with their stacks.
        local_size: ranks per simulated host (default all on one); ``np=4, local_size=2``
            gives the topology of 2 hosts x 2 ranks, for hierarchical code paths.
        env: extra environment variables for the ranks.
        init: call ``phalanx.init()`` in each rank before ``fn``.
        threads: torch threads per rank (default: cores / np, at least 1).

    Raises:
        RankError: a rank raised; the message has its traceback.
        RankTimeoutError: ranks were still running at the deadline.
    """
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    local_size = local_size or np
    if np % local_size:
        raise ValueError(f"np={np} is not a multiple of local_size={local_size}")
    threads = threads or max(1, (os.cpu_count() or 1) // np)
    for attempt in range(3):
        try:
            return _run_once(fn, np, tuple(args), dict(kwargs or {}), timeout, local_size, dict(env or {}), init, threads)
        except _PortTaken:
            if attempt == 2:
                raise RankError("could not find a free port for the rendezvous after 3 tries", 0) from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _run_once(fn, np, args, kwargs, timeout, local_size, env, init, threads):
    ctx = _context()
    port = free_port()
    stack_dir = tempfile.mkdtemp(prefix="phalanx-stacks-")
    procs, readers = [], {}
    for rank in range(np):
        reader, writer = ctx.Pipe(duplex=False)
        stack_path = os.path.join(stack_dir, f"rank{rank}.txt")
        p = ctx.Process(
            target=_rank_main,
            args=(fn, rank, np, local_size, port, args, kwargs, writer, stack_path, init, env, threads),
            name=f"phalanx-rank{rank}",
        )
        p.start()
        writer.close()
        procs.append(p)
        readers[reader] = rank
    results: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    returned_at: dict[int, float] = {}  # wall clock, as _Failure.at
    deadline = time.monotonic() + timeout
    first_failure_at = 0.0
    try:
        while readers:
            now = time.monotonic()
            limit = deadline if not failures else min(deadline, first_failure_at + _GRACE_S)
            if now >= limit:
                break
            for reader in wait_any(list(readers), timeout=limit - now):
                rank = readers.pop(reader)
                try:
                    status, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    procs[rank].join(1)
                    code = procs[rank].exitcode
                    status, payload = "err", _Failure("died", f"rank {rank} exited with code {code} before returning", None)
                if status == "ok":
                    results[rank] = payload
                    returned_at[rank] = time.time()
                else:
                    if not failures:
                        first_failure_at = time.monotonic()
                    failures[rank] = payload
        hung = sorted(readers.values())
        stacks = _collect_stacks(procs, hung, stack_dir) if hung and not failures else {}
    finally:
        if not readers:  # every rank answered: let them finish shutdown and exit on their own, so
            exit_by = time.monotonic() + _GRACE_S  # their atexit/finalizers run (no leaked semaphores)
            for p in procs:
                p.join(max(0.0, exit_by - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
    if failures:
        if any(_port_taken(f) for f in failures.values()):
            raise _PortTaken()
        # the root cause fails first, and is not a rank that only lost its peer
        real = [r for r in failures if not lost_a_peer(failures[r].text)]
        rank = min(real or failures, key=lambda r: failures[r].at)
        others = sorted(set(failures) - {rank})
        extra = f" (ranks {others} failed too)" if others else ""
        if hung:
            extra += f"; ranks {hung} were killed after the failure"
        f = failures[rank]
        early = sorted(r for r, t in returned_at.items() if t <= f.at) if not real else []
        if early:  # every failure is a lost peer, and these ranks had returned before: they are the cause
            raise RankError(f"rank {early[0]} returned while ranks {sorted(failures)} were still running "
                            f"collectives (uneven work per rank? call join() on the DataParallel model or "
                            f"optimizer when a rank runs out of data); then rank {rank} failed{extra}:\n{f.text}",
                            early[0], f.exception)
        raise RankError(f"rank {rank} failed{extra}:\n{f.text}", rank, f.exception)
    if hung:
        report = "\n".join(f"--- rank {r} stack ---\n{stacks.get(r, '(no stack)')}" for r in hung)
        raise RankTimeoutError(f"ranks {hung} did not finish within {timeout:.0f}s:\n{report}", hung[0])
    return [results[r] for r in range(np)]


def _collect_stacks(procs, ranks: list[int], stack_dir: str) -> dict[int, str]:
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    stacks = {}
    for r in ranks:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.txt")) as f:
                stacks[r] = f.read().strip()
        except OSError:
            stacks[r] = "(no stack written)"
    return stacks


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use phalanx.run(fn, np=…) from Python")

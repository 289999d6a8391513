"""Calibration probes for the cost model, run on the job's own ranks (collective calls).

- :func:`measure_link`: alpha and beta of the backend allreduce, from message sizes
  timed in interleaved rounds (warm-up rounds dropped, median per size, slowest rank),
  fitted in relative error (:func:`phalanx.planner.cost.fit_link`).
- :func:`measure_overlap`: how much of an allreduce hides behind compute on these cores
  (``cost.Cluster.overlap``), from compute alone, the allreduce alone, one after the
  other and both at once, interleaved the same way (:func:`phalanx.planner.cost.fit_overlap`);
  and the waiting a collective right after compute adds (``plan.ModelSpec.wait_s``).

Interleaving matters on a shared machine: a burst of load then lands on every size (or
on all three timings) of one round instead of biasing one of them; the median drops it.

Example (every rank)::

    from phalanx.planner import calibrate, cost
    link, samples = calibrate.measure_link()
    e, parts = calibrate.measure_overlap(lambda: train_step(plain_model), nbytes=4 * n_params)
    cluster = cost.Cluster(hosts=1, ranks_per_host=px.size(), intra=link, inter=link, overlap=e)
    spec = plan.ModelSpec(params=n_params, compute_s=..., wait_s=parts["wait_s"])
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.planner import cost

__all__ = ["DEFAULT_SIZES", "measure_link", "measure_overlap"]

DEFAULT_SIZES = (8, 2**16, 2**20, 2**22, 2**24)
"""Bytes: one tiny message pins alpha, the large ones beta."""


def _check(rounds: int, warmup: int, group) -> int:
    if not dist.is_initialized():
        raise RuntimeError("calibration probes are collective: call phalanx.init() (or run under phalanx run) first")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds} warmup={warmup}")
    return dist.get_world_size(group)


def _slowest(medians: Sequence[float], group) -> list[float]:
    """Each timing's median on the slowest rank (a collective ends when its last rank does)."""
    t = torch.tensor(list(medians), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def measure_link(sizes: Sequence[int] = DEFAULT_SIZES, *, dtype: torch.dtype = torch.float32, rounds: int = 15,
                 warmup: int = 3, group=None) -> tuple[cost.Link, list[tuple[int, float]]]:
    """Fit ``cost.Link`` to timed backend allreduces of ``sizes`` bytes; returns it and the samples.

    Each round times every size once (after a barrier, so all ranks start together);
    the first ``warmup`` rounds are dropped. ``dtype`` matters: the backend sums each
    dtype at its own speed (gloo sums float16 several times slower than float32).
    """
    n = _check(rounds, warmup, group)
    if n < 2:
        raise ValueError("measure_link needs at least 2 ranks")
    if len(set(sizes)) < 2:
        raise ValueError(f"measure_link needs at least two different sizes, got {list(sizes)}")
    elem = torch.empty((), dtype=dtype).element_size()
    bufs = [torch.ones(max(1, int(m) // elem), dtype=dtype) for m in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(warmup + rounds):
        for i, buf in enumerate(bufs):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            took = time.perf_counter() - t0
            if r >= warmup:
                times[i].append(took)
    slow = _slowest([statistics.median(t) for t in times], group)
    samples = [(buf.numel() * elem, t) for buf, t in zip(bufs, slow)]
    return cost.fit_link(samples, n), samples


def measure_overlap(compute: Callable[[], object], nbytes: int, *, buckets: int = 1,
                    prepare: Callable[[], object] | None = None, dtype: torch.dtype = torch.float32,
                    rounds: int = 11, warmup: int = 2, group=None) -> tuple[float, dict[str, float]]:
    """Share of the allreduce of ``nbytes`` (in ``buckets`` equal messages) that hides behind ``compute()``,
    and what synchronising right after compute costs beyond the collective itself.

    Four timings per round, interleaved: ``compute`` alone (C); the allreduces alone, after
    a barrier (A); ``compute`` then the allreduces (S, serial); the allreduces launched
    asynchronously, then ``compute``, then the waits (T). ``wait_s = S - C - A`` is the
    waiting a collective after compute adds (ranks finish compute at different moments,
    and the communication threads start cold); ``e = fit_overlap(C, S - C, T)``.

    ``compute`` should be the work communication would overlap in training (the backward
    of the plain, non-distributed model, with ``prepare`` running its forward untimed
    before each timing); ``buckets`` as many as the layout will send, since each launch
    has its own cost on the compute thread. Returns ``e`` (see
    :func:`phalanx.planner.cost.fit_overlap`; negative when running both at once costs
    more than one after the other) and the medians ``{"compute_s", "comm_s", "serial_s",
    "both_s", "wait_s"}`` (slowest rank).
    """
    _check(rounds, warmup, group)
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    elem = torch.empty((), dtype=dtype).element_size()
    bufs = [torch.ones(max(1, int(nbytes) // elem // buckets), dtype=dtype) for _ in range(buckets)]

    def comm() -> None:
        for buf in bufs:
            dist.all_reduce(buf, group=group)

    def serial() -> None:
        compute()
        comm()

    def both() -> None:
        works = [dist.all_reduce(buf, group=group, async_op=True) for buf in bufs]
        compute()
        for work in works:
            work.wait()

    fns = {"compute_s": compute, "comm_s": comm, "serial_s": serial, "both_s": both}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for key, fn in fns.items():
            if prepare is not None and key != "comm_s":
                prepare()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            if r >= warmup:
                times[key].append(took)
    slow = dict(zip(fns, _slowest([statistics.median(times[k]) for k in fns], group)))
    c, a, s = slow["compute_s"], slow["comm_s"], slow["serial_s"]
    slow["wait_s"] = max(0.0, s - c - a)
    return cost.fit_overlap(c, max(s - c, a), slow["both_s"]), slow

"""Calibration probes for the cost model, run on the job's own ranks (collective calls).

- :func:`measure_link`: alpha and beta of the backend allreduce, from message sizes
  timed in interleaved rounds (warm-up rounds dropped, median per size, slowest rank),
  fitted in relative error (:func:`phalanx.planner.cost.fit_link`).
- :func:`measure_overlap`: how much of an allreduce hides behind compute on these cores
  (``cost.Cluster.overlap``), from compute alone, the allreduce alone, one after the
  other and both at once, interleaved the same way (:func:`phalanx.planner.cost.fit_overlap`);
  and the waiting a collective right after compute adds (``plan.ModelSpec.wait_s``).
- :func:`measure_buckets`: the same terms, measured the way data parallel will talk: the
  model's own buckets (from the order its gradients arrive), sent back to back in launch
  order for the link, and launched from gradient hooks as each bucket fills for the
  overlap. :meth:`BucketProbe.fit` turns it into a link and ``e``.

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

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.planner import cost

__all__ = ["DEFAULT_SIZES", "BucketProbe", "measure_buckets", "measure_link", "measure_overlap"]

DEFAULT_SIZES = (8, 2**16, 2**20, 2**22, 2**24)
"""Bytes: one tiny message pins alpha, the large ones beta."""


def _check(rounds: int, warmup: int, group) -> int:
    if not dist.is_initialized():
        raise RuntimeError("calibration probes are collective: call phalanx.init() (or run under phalanx run) first")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds} warmup={warmup}")
    return dist.get_world_size(group)


def _interleaved_times(fns, warmup: int, rounds: int, prepare, group) -> dict[str, list[float]]:
    """Time each of ``fns`` (key -> fn(kept)) once per round, interleaved, each after a barrier;
    ``prepare()`` runs before every timing but the communication-only one. Keeps rounds after
    ``warmup``; ``kept`` tells a function whether this round is kept."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for key, fn in fns.items():
            if prepare is not None and key != "comm_s":
                prepare()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn(r >= warmup)
            took = time.perf_counter() - t0
            if r >= warmup:
                times[key].append(took)
    return times


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
    times = _interleaved_times({k: (lambda kept, fn=fn: fn()) for k, fn in fns.items()}, warmup, rounds,
                               prepare, group)
    slow = dict(zip(fns, _slowest([statistics.median(times[k]) for k in fns], group)))
    c, a, s = slow["compute_s"], slow["comm_s"], slow["serial_s"]
    slow["wait_s"] = max(0.0, s - c - a)
    return cost.fit_overlap(c, max(s - c, a), slow["both_s"]), slow


@dataclasses.dataclass(frozen=True)
class BucketProbe:
    """What :func:`measure_buckets` measured (seconds, slowest rank; bytes as sent)."""

    tensor_bytes: tuple[int, ...]
    """each gradient's bytes in the order backward produced them (``plan.ModelSpec.tensor_bytes``)"""
    bucket_bytes: tuple[int, ...]
    """each bucket's payload bytes, in launch order"""
    bucket_s: tuple[float, ...]
    """each bucket's mean time within the back-to-back sends"""
    compute_s: float
    """``compute`` alone (C)"""
    comm_s: float
    """the buckets back to back, no compute (A)"""
    serial_s: float
    """``compute`` then the buckets (S)"""
    both_s: float
    """``compute`` with each bucket launched asynchronously as its last gradient arrives, then the waits (T)"""
    wait_s: float
    """``max(0, S - C - A)``: what a collective right after compute costs beyond itself"""

    def fit(self, n: int) -> tuple[cost.Link, float]:
        """The link and overlap ``e`` for ``n`` ranks, as ``plan.predict`` will use them.

        The link: a plain least-squares fit of ``2(n-1) alpha + 2(n-1)/n M beta`` to the
        buckets' times (their sum is kept; one bucket: bandwidth alone). ``e``: from the
        model's own bucket times and tail (buckets ready at ``cost.ready_fractions``),
        so that ``C + exposed + wait`` reproduces ``T`` (:func:`phalanx.planner.cost.fit_overlap`).
        """
        samples = list(zip(self.bucket_bytes, self.bucket_s))
        if len(set(self.bucket_bytes)) >= 2:
            link = cost.fit_link(samples, n, relative=False)
        else:
            moved = sum(2 * (n - 1) / n * m for m, _ in samples)
            link = cost.Link(alpha_s=0.0, beta_s=sum(t for _, t in samples) / moved)
        times = [cost.ring_allreduce(m, n, link) for m in self.bucket_bytes]
        tail = cost.overlapped_exposure(times, self.compute_s, 1.0, cost.ready_fractions(self.bucket_bytes))
        e = cost.fit_overlap(self.compute_s, sum(times), self.both_s - self.wait_s, tail_s=tail)
        return link, e


def measure_buckets(params: Sequence[torch.nn.Parameter], compute: Callable[[], object], *, bucket_mb: float,
                    prepare: Callable[[], object] | None = None, dtype: torch.dtype | None = None,
                    rounds: int = 11, warmup: int = 2, group=None) -> BucketProbe:
    """Time the communication of data parallel over ``params`` the way the job will send it.

    ``compute`` is the backward of the plain (non-distributed) model that owns ``params``
    (``prepare``, its forward, runs untimed before each timing). One untimed ``compute``
    records the order the gradients arrive in (rank 0's order, as the engine uses); they
    are packed into buckets by the engine's rule (``cost.bucket_sizes`` with
    ``bucket_mb``). Buffers of the buckets' sizes, in ``dtype`` (default: the parameters';
    ``torch.float16`` for an fp16-compressed layout), stand in for the gradients. Four
    timings per round, interleaved, after a barrier each: ``compute`` alone (C); the
    buckets' allreduces back to back in launch order, each timed (A); ``compute`` then
    the same (S); ``compute`` with a gradient hook launching each bucket asynchronously
    once its last gradient is in, in bucket order as the engine does, then the waits (T).
    Communication only is timed in A: no model compute, nothing fitted to a training step.
    """
    _check(rounds, warmup, group)
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("measure_buckets needs parameters that require gradients")
    order: list[int] = []
    index = {id(p): i for i, p in enumerate(params)}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: order.append(index[id(p)])) for p in params]
    try:
        if prepare is not None:
            prepare()
        compute()
    finally:
        for h in hooks:
            h.remove()
    order += [i for i in range(len(params)) if i not in set(order)]  # no gradient: last, as the engine does
    box = [order]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    order = box[0]
    # the engine's buckets (phalanx.comm.buckets): fill in arrival order, a new bucket past bucket_mb
    limit = bucket_mb * 2**20
    groups: list[list[int]] = []
    size = 0
    for i in order:
        nbytes = params[i].numel() * params[i].element_size()
        if groups and groups[-1] and size + nbytes <= limit:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    dtype = dtype or params[0].dtype
    bufs = [torch.ones(sum(params[i].numel() for i in g), dtype=dtype) for g in groups]
    bucket_of = {id(params[i]): k for k, g in enumerate(groups) for i in g}
    state: dict = {"armed": False}
    works: list = []

    def hook(p) -> None:
        if not state["armed"]:
            return
        k = bucket_of[id(p)]
        state["left"][k] -= 1
        while state["next"] < len(bufs) and state["left"][state["next"]] == 0:
            works.append(dist.all_reduce(bufs[state["next"]], group=group, async_op=True))
            state["next"] += 1

    per: list[list[float]] = [[] for _ in bufs]

    def comm(record: bool) -> None:
        for k, buf in enumerate(bufs):
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if record:
                per[k].append(time.perf_counter() - t0)

    def serial() -> None:
        compute()
        comm(False)

    def both() -> None:
        state.update(armed=True, next=0, left=[len(g) for g in groups])
        try:
            compute()
        finally:
            state["armed"] = False
        for buf in bufs[state["next"]:]:  # buckets whose gradients never came: at the end, as the engine does
            works.append(dist.all_reduce(buf, group=group, async_op=True))
        while works:
            works.pop(0).wait()

    hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
    fns = {"compute_s": lambda kept: compute(), "comm_s": comm, "serial_s": lambda kept: serial(),
           "both_s": lambda kept: both()}
    try:
        times = _interleaved_times(fns, warmup, rounds, prepare, group)
    finally:
        for h in hooks:
            h.remove()
    slow = _slowest([statistics.median(times[k]) for k in fns] + [statistics.fmean(t) for t in per], group)
    c, a, s, t = slow[:4]
    elem = torch.empty((), dtype=dtype).element_size()
    return BucketProbe(tensor_bytes=tuple(params[i].numel() * params[i].element_size() for i in order),
                       bucket_bytes=tuple(b.numel() * elem for b in bufs), bucket_s=tuple(slow[4:]),
                       compute_s=c, comm_s=a, serial_s=s, both_s=t, wait_s=max(0.0, s - c - a))

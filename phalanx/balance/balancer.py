"""Dynamic load balancing for data parallelism: faster ranks get more of a fixed global batch.

In synchronous data parallelism the slowest rank sets the pace ("one slow, all
wait"). The seed articles' remedy is dynamic sharding — give a faster device
more data — and their measure of balance is the load standard deviation
σ = sqrt(mean((t_i − t̄)²)) over the ranks' compute times t_i. This module does
both, without changing the mathematics of the update::

    every `every` steps:  each rank ── allgather [compute s, wait s, samples, steps] ──► all ranks
                          speed_i = samples_i / compute_i         (samples per second of compute)
                          shares  += damping · (speed / Σ speed − shares)   (the first exchange: damping 1)
                          sizes'  = split_sizes(G, shares, min_batch)   integers, Σ = G
                          apply sizes' only if the predicted step time max_i sizes_i/speed_i
                          drops by more than `tolerance` (hysteresis: noise does not move samples)

    every step:           rank i trains on sizes_i samples; its mean-loss gradient is weighted by
                          sizes_i / G in the allreduce (a sum), so Σ_i (sizes_i/G) · mean_i = the mean
                          over all G samples — the same update as uniform data parallelism.

Every rank computes the new split from the same gathered numbers, so the
sizes agree without a broadcast. With a fixed overhead per step the proportional
rule still converges to equal step times (its fixed point has a_i + b_i·n_i equal
on every rank). "Compute" is the time from the step's first forward (for
``DistributedOptimizer``: from the end of the previous step) to the end of
backward; "wait" is the time then spent blocked on the gradient allreduce.

Example::

    import phalanx as px
    balancer = px.balance.Balancer(global_batch=256, every=5)
    model = px.DataParallel(net, balance=balancer)
    sampler = px.balance.BalancedSampler(len(dataset), balancer, seed=0)   # phalanx/balance/sampler.py
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    for x, y in loader:                       # this rank's share of each global batch
        loss_fn(model(x), y).backward()       # mean loss; the engine weights it by the share
        opt.step(); opt.zero_grad()
    print(balancer.last_report)               # per-rank compute / wait, σ, sizes
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import torch
import torch.distributed as dist

from phalanx import trace
from phalanx.balance.sampler import split_sizes
from phalanx.comm.collectives import ReduceOp, all_gather_flat
from phalanx.log import get_logger
from phalanx.parallel.data.hooks import StepObserver

__all__ = ["Balancer", "StragglerReport", "load_sigma"]

_log = get_logger(__name__)


def load_sigma(times) -> float:
    """The seed's load standard deviation σ = sqrt(mean((t_i − t̄)²)) (population, not sample).

    Example::

        load_sigma([1, 1, 1, 5])   # sqrt(3) ≈ 1.73, the seed's own example
    """
    times = [float(t) for t in times]
    mean = sum(times) / len(times)
    return math.sqrt(sum((t - mean) ** 2 for t in times) / len(times))


@dataclasses.dataclass
class StragglerReport:
    """One exchange: what every rank measured over the last window, and the split that follows.

    Times are per step (means over the window), in seconds.
    """

    step: int
    sizes: list[int]          # local batch sizes the window ran with
    new_sizes: list[int]      # sizes from the next step on (== sizes when unchanged)
    compute_s: list[float]    # per rank: forward + backward per step
    wait_s: list[float]       # per rank: blocked on the gradient allreduce per step
    samples_per_s: list[float]  # per rank: samples per second of compute (its speed)
    sigma_s: float            # load standard deviation of compute_s
    changed: bool

    @property
    def slowest(self) -> int:
        return max(range(len(self.compute_s)), key=lambda i: self.compute_s[i])

    @property
    def imbalance(self) -> float:
        """Slowest compute time over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.compute_s) / len(self.compute_s)
        return max(self.compute_s) / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        lines = [f"balance @ step {self.step}: σ = {self.sigma_s * 1e3:.2f} ms, imbalance {self.imbalance:.2f}x, "
                 f"sizes {self.sizes}" + (f" -> {self.new_sizes}" if self.changed else " (kept)"),
                 f"{'rank':>6}{'batch':>7}{'compute ms':>12}{'wait ms':>10}{'samples/s':>11}"]
        for r, (n, c, w, s) in enumerate(zip(self.sizes, self.compute_s, self.wait_s, self.samples_per_s)):
            lines.append(f"{r:>6}{n:>7}{c * 1e3:>12.2f}{w * 1e3:>10.2f}{s:>11.0f}")
        return "\n".join(lines)


class Balancer(StepObserver):
    """Re-split a fixed global batch across ranks in proportion to their measured speed.

    Args:
        global_batch: samples per step over all ranks (``G``); fixed.
        every: steps between exchanges of timings (one small allgather each).
        warmup: first steps not measured (bucket rebuild, allocator warm-up).
        damping: fraction of the way to the measured target taken per exchange (0, 1]; the first
            exchange goes all the way (the starting split is not a measurement).
        tolerance: apply a new split only if it shortens the predicted step by more than this.
        min_batch: no rank gets fewer samples than this.
        adjust: False = only measure and report (the straggler report without re-splitting).
        group: the process group of the data-parallel ranks (None = world).

    Attach it with ``DataParallel(..., balance=balancer)``, ``DistributedOptimizer(...,
    balance=balancer)`` or ``Trainer(..., balance=True)``; in a hand-written loop read
    :attr:`local_batch` and call :meth:`record` once per step on every rank.

    Example::

        bal = Balancer(global_batch=64)
        for step in range(100):
            n = bal.local_batch                     # this rank's share
            t0 = time.perf_counter(); work(n); t1 = time.perf_counter()
            bal.record(compute_s=t1 - t0, samples=n)
    """

    def __init__(self, global_batch: int, *, every: int = 5, warmup: int = 2, damping: float = 0.5,
                 tolerance: float = 0.03, min_batch: int = 1, adjust: bool = True, group=None,
                 keep_history: int = 1000) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_group_rank(group, dist.get_rank()) if dist.is_initialized() and group is not None \
            else (dist.get_rank() if dist.is_initialized() else 0)
        if int(global_batch) != global_batch or global_batch < self.world_size * max(min_batch, 1):
            raise ValueError(f"Balancer(global_batch={global_batch}): need an integer >= world size "
                             f"{self.world_size} x min_batch {max(min_batch, 1)}")
        if every < 1 or warmup < 0 or min_batch < 1:
            raise ValueError(f"Balancer: every ({every}) and min_batch ({min_batch}) must be >= 1, "
                             f"warmup ({warmup}) >= 0")
        if not 0.0 < damping <= 1.0:
            raise ValueError(f"Balancer(damping={damping}): must be in (0, 1]; 1 jumps to the measured split")
        if tolerance < 0:
            raise ValueError(f"Balancer(tolerance={tolerance}): must be >= 0")
        self.global_batch, self.every, self.warmup = int(global_batch), int(every), int(warmup)
        self.damping, self.tolerance, self.min_batch, self.adjust = float(damping), float(tolerance), \
            int(min_batch), adjust
        self.shares = [1.0 / self.world_size] * self.world_size
        self.sizes = split_sizes(self.global_batch, self.shares, self.min_batch)
        self.steps = 0  # steps recorded (all ranks agree)
        self.history: collections.deque[StragglerReport] = collections.deque(maxlen=keep_history)
        self._window = [0.0, 0.0, 0.0, 0]  # compute s, wait s, samples, steps
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # (local, global) per batch
        self._step_counts = [0, 0]
        self._t_start: float | None = None
        self._t_last: float | None = None
        self._compute_s: float | None = None
        self._warned = False

    # ------------------------------------------------------------------ what a rank reads
    @property
    def local_batch(self) -> int:
        """This rank's share of the global batch for the current step."""
        return self.sizes[self.rank]

    @property
    def weight(self) -> float:
        """This rank's gradient weight ``local_batch / global_batch`` (weights sum to 1)."""
        return self.sizes[self.rank] / self.global_batch

    @property
    def last_report(self) -> StragglerReport | None:
        return self.history[-1] if self.history else None

    # ------------------------------------------------------------------ measurement
    def record(self, compute_s: float, wait_s: float = 0.0, samples: int | None = None) -> bool:
        """One step's measurement on this rank. Collective every ``every`` steps (all ranks call it
        equally often); returns True when the split changed (read :attr:`local_batch` again)."""
        self.steps += 1
        if self.steps <= self.warmup:
            return False
        w = self._window
        w[0] += float(compute_s)
        w[1] += float(wait_s)
        w[2] += float(self.local_batch if samples is None else samples)
        w[3] += 1
        if w[3] < self.every:
            return False
        return self._exchange()

    def _exchange(self) -> bool:
        t0 = time.perf_counter()
        mine = torch.tensor([self._window + [self.steps]], dtype=torch.float64)
        self._window = [0.0, 0.0, 0.0, 0]
        if self.world_size > 1:
            # One collective, straight to the backend: the checked allgather costs three round trips
            # (signature probe, sizes, data), 3-5 ms on gloo loopback per exchange (0.6-1 ms per step).
            # Every rank reaches this point at the same step with the same (1, 5) float64 tensor; the
            # step number travels along, so ranks configured differently fail here with the reason.
            out = torch.empty((self.world_size, 5), dtype=torch.float64)
            all_gather_flat(out, mine, group=self.group)
            rows = out.tolist()
            steps = [int(r[4]) for r in rows]
            if len(set(steps)) > 1:
                raise RuntimeError(
                    f"Balancer: the ranks exchanged timings at different steps {steps}: every rank needs the "
                    "same every= and warmup= and one record() per step (DataParallel / DistributedOptimizer "
                    "record for you), and load_state_dict() on every rank or none")
        else:
            rows = mine.tolist()
        rows = [r[:4] for r in rows]
        compute = [c / max(n, 1) for c, _, _, n in rows]
        wait = [w / max(n, 1) for _, w, _, n in rows]
        speed = [s / c if c > 0 and s > 0 else 0.0 for c, _, s, _ in rows]
        old = list(self.sizes)
        if all(v > 0 for v in speed):
            total = sum(speed)
            # The first exchange jumps to the measured split: the starting split (uniform, or one
            # restored from a checkpoint) is not a measurement, so there is nothing to damp against.
            damping = self.damping if self.history else 1.0
            self.shares = [s + damping * (v / total - s) for s, v in zip(self.shares, speed)]
            candidate = split_sizes(self.global_batch, self.shares, self.min_batch)
            before = max(n / v for n, v in zip(old, speed))
            after = max(n / v for n, v in zip(candidate, speed))
            if self.adjust and candidate != old and before > after * (1.0 + self.tolerance):
                self.sizes = candidate
        report = StragglerReport(step=self.steps, sizes=old, new_sizes=list(self.sizes), compute_s=compute,
                                 wait_s=wait, samples_per_s=speed, sigma_s=load_sigma(compute),
                                 changed=self.sizes != old)
        self.history.append(report)
        self._emit(report, t0)
        return report.changed

    def _emit(self, report: StragglerReport, t0: float) -> None:
        trace.instant("balance", "balance", t0, time.perf_counter(), step=report.step,
                      sizes=report.new_sizes, sigma_ms=round(report.sigma_s * 1e3, 3),
                      compute_ms=[round(c * 1e3, 3) for c in report.compute_s],
                      wait_ms=[round(w * 1e3, 3) for w in report.wait_s], changed=report.changed)
        if self.rank != 0:
            return
        if report.changed:
            _log.info("step %d: sizes %s -> %s (compute ms %s, σ %.2f ms)", report.step, report.sizes,
                      report.new_sizes, [round(c * 1e3, 1) for c in report.compute_s], report.sigma_s * 1e3)
        else:
            _log.debug("%s", report)
        if not self.adjust and report.imbalance > 1.2 and not self._warned:
            self._warned = True
            _log.warning("straggler: rank %d computes %.2fx the mean (σ %.2f ms); balancing is off "
                         "(Balancer(adjust=True) would re-split the batch)", report.slowest, report.imbalance,
                         report.sigma_s * 1e3)

    # ------------------------------------------------------------------ sampler side
    def push_batch(self, local: int, total: int) -> None:
        """A sampler handed this rank ``local`` of a step's ``total`` samples (in training order)."""
        self._pending.append((int(local), int(total)))

    def clear_pending(self) -> None:
        self._pending.clear()

    # ------------------------------------------------------------------ engine side (StepObserver)
    def bind(self, engine) -> None:
        """Check that this balancer fits ``engine`` (same group and size, dense gradients, an average)."""
        if self.group is not engine.group:
            raise ValueError("balance=: the Balancer was built for a different process group than the model; "
                             "pass Balancer(..., group=<the same group>)")
        if self.world_size != engine.world:
            raise ValueError(f"balance=: the Balancer was built for {self.world_size} rank(s) but the group has "
                             f"{engine.world}; build it after phalanx.init()")
        if engine.sparse:
            raise ValueError("balance= needs dense gradients (sparse ones are averaged unweighted); "
                             "pass sparse_as_dense=True")
        if engine.op is not ReduceOp.AVERAGE:
            raise ValueError("balance= combines gradients as a weighted average; it cannot be used with op=Sum")

    def forward_begins(self) -> None:
        if self._t_start is None and torch.is_grad_enabled():
            self._t_start = time.perf_counter()

    def backward_begins(self) -> float:
        """One backward pass starts: count its batch; return the weight of the gradient so far."""
        local, total = self._pending.popleft() if self._pending else (self.local_batch, self.global_batch)
        self._step_counts[0] += local
        self._step_counts[1] += total
        return self._step_counts[0] / self._step_counts[1]

    def compute_ends(self) -> None:
        now = time.perf_counter()
        start = self._t_start if self._t_start is not None else self._t_last
        self._compute_s = None if start is None else now - start

    def wait_ends(self, wait_s: float) -> None:
        samples = self._step_counts[0]
        self._step_counts = [0, 0]
        self._t_start = None
        if self._compute_s is None:  # first step of DistributedOptimizer: no start seen; count it unmeasured
            self._compute_s = 0.0
        self.record(self._compute_s, wait_s, samples)
        self._compute_s = None
        self._t_last = time.perf_counter()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"sizes": list(self.sizes), "shares": list(self.shares), "steps": self.steps,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if len(state["sizes"]) != self.world_size or int(state["global_batch"]) != self.global_batch:
            # a different world or batch: keep the uniform split and re-learn the speeds
            _log.warning("Balancer.load_state_dict: saved for %d ranks / global batch %s, now %d / %d; "
                         "starting from a uniform split", len(state["sizes"]), state["global_batch"],
                         self.world_size, self.global_batch)
            return
        self.sizes, self.shares = list(state["sizes"]), list(state["shares"])
        self.steps = int(state["steps"])

    def __repr__(self) -> str:
        return f"Balancer(global_batch={self.global_batch}, sizes={self.sizes}, every={self.every})"

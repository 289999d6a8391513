"""The gradient-synchronisation engine: buckets, hooks, accumulation, timing; a reduction per bucket.

Shared by :class:`~phalanx.parallel.data.DataParallel`, ``DistributedOptimizer`` (and so
the Horovod facade and the Trainer) and ZeRO (:mod:`phalanx.parallel.zero`). The engine
fuses gradients into flat buckets and launches each bucket's collective the moment its
last gradient is in, overlapping the rest of backward::

    backward ──► post-accumulate-grad hook(p) ──► bucket full? ─► reduction.launch(bucket)  (async)
    end of backward (autograd callback) ──► launch what is left · follow-ups (sparse, used, finite)
    wait() ──► reduction.finish(bucket) for every bucket, in order · follow-ups finish

What a bucket's reduction *is* is pluggable (``reduction=``, :mod:`.reduction`): by default
:class:`~phalanx.parallel.data.reduction.AllReduceReduction`, whose average lands back in
``p.grad``; ZeRO plugs in a reduce-scatter into the owner's gradient shard. ``plan=`` fixes
the buckets (ZeRO's layout is fixed at wrap time because its master shard is laid out from
it); otherwise buckets are re-planned once from the order gradients arrived in the first
iteration, as DDP does. Services attach through :mod:`.hooks` (engine hooks, step observers).

Example::

    engine = GradientEngine(model.named_parameters(), EngineConfig(bucket_mb=25, wait_in_backward=True))
    model(x).sum().backward()          # p.grad averaged over the ranks when this returns
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx import trace
from phalanx.comm.broadcast import root_of
from phalanx.comm.buckets import Bucket, BucketManager, PlannedBuckets
from phalanx.comm.collectives import ReduceOp, broadcast_object
from phalanx.comm.compression.abilities import Resettable, Stateful
from phalanx.comm.compression.codecs import get_compressor
from phalanx.comm.compression.paths import ring_bytes
from phalanx.log import get_logger
from phalanx.parallel.data.config import (
    EngineConfig,
    check_engine_args,
    describe_engine,
    job_defaults,
    resolve_topology,
)
from phalanx.parallel.data.followups import FiniteGuard, FollowUp, UsedCounts, launch_sparse
from phalanx.parallel.data.hooks import StepObserver, run_engine_hooks
from phalanx.parallel.data.joined import JoinedSteps
from phalanx.parallel.data.learned import agree_learned
from phalanx.parallel.data.reduction import (
    AllReduceReduction,
    BucketReduction,
    ReductionContext,
    ReportsComplete,
    TakesGrads,
)

__all__ = ["GradientEngine", "reform_engines"]

_log = get_logger(__name__)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every engine with hooks on: re-derived at a change of world


def reform_engines(topology) -> int:
    """After an elastic re-form: every live engine re-derives itself for the new world (``topology``).

    Old ranks and a newcomer must then issue the same collectives: each engine goes back to
    the layout a fresh one has (buckets in reverse parameter order, re-planned from rank 0's
    order at the end of the first step, mismatch-checked until then), forgets the step in
    flight and its accumulation count, and reads the new world size. Returns how many engines
    were re-derived.
    """
    engines = [e for e in list(_LIVE) if e._hooks]
    agree_learned(engines)  # the bucket size and autotune result rank 0 (the oldest member) learned
    for engine in engines:
        engine.reform(topology)
    return len(engines)


class GradientEngine(JoinedSteps):
    """Buckets, hooks and collectives shared by :class:`DataParallel` and ``DistributedOptimizer``.

    ``wait_in_backward=True`` finishes the reduction inside the end-of-backward
    callback (DDP semantics); otherwise :meth:`wait` does it (Horovod semantics).
    ``topology``: the job's Topology (the hierarchical algorithm needs it); None reads
    ``phalanx.init()``'s once, here.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], config: EngineConfig | None = None, *,
                 reduction: BucketReduction | None = None) -> None:
        named_params = list(named_params)
        c = self.config = config if config is not None else EngineConfig()
        check_engine_args(c.op, c.gradient_predivide_factor, c.backward_passes_per_step)
        self.op = ReduceOp(c.op)
        self.group = c.group
        self.topology = resolve_topology(c.topology)
        self.world = dist.get_world_size(c.group) if dist.is_initialized() else 1
        self.predivide = float(c.gradient_predivide_factor)
        # Horovod's rule: a missing gradient counts as zeros and gets the average (no per-step count)
        self.missing_as_zeros = c.missing_as_zeros
        self.find_unused = c.find_unused_parameters and not c.missing_as_zeros
        self.sparse_as_dense = c.sparse_as_dense
        bucket_mb, self.algorithm = job_defaults(c.bucket_mb, c.algorithm)
        self.k = c.backward_passes_per_step
        self.wait_in_backward = c.wait_in_backward
        self.grad_as_view = c.gradient_as_bucket_view
        self.compressor = get_compressor(c.compression)
        # join_flag: bucket 0 carries each rank's "I am stepping" (1, or 0 from a joined rank) where
        # the bucket is summed exactly as sent; follows_world: group is the job's steps_group()
        self.join_flag = c.join_flag and self.compressor.summable and self.op in (ReduceOp.SUM, ReduceOp.AVERAGE) \
            and c.plan is None and reduction is None
        self.follows_world = c.follows_world
        dense = self._split_params(named_params, c.sparse_ids)
        self.reduction = reduction if reduction is not None else AllReduceReduction()
        # A reduction like ZeRO's reduces in a group of one too: its gradient shard is what steps.
        self._needs_sync = self.world > 1 or self.find_unused or self.reduction.reduces_alone
        self.buckets = self._make_buckets(dense, c.plan, bucket_mb, c.pad_to, c.lazy_buckets)
        self.join_flag = self.join_flag and bool(self.buckets.buckets)  # (no dense parameter: no bucket 0)
        self.finite = FiniteGuard(self.compressor, self.buckets.params)
        self._on_grad = self.reduction.on_grad if isinstance(self.reduction, TakesGrads) else None
        self.reduction.bind(ReductionContext(self))
        self._init_step_state()
        self._hooked = [p for _, p in named_params if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._hooked]
        self._bucket_bytes = int(bucket_mb * 2**20)
        self.on_reform: list[Callable[[], None]] = []  # the fronts' own per-world state (join flags)
        _LIVE.add(self)
        if c.plan is None:  # a fixed plan (ZeRO) has nothing for the services to tune
            run_engine_hooks(self)
        _log.info("%s", describe_engine(self))

    def _split_params(self, named_params, sparse_ids) -> list[nn.Parameter]:
        """Record names and sparse parameters (reduced by allgather); return the dense ones."""
        self.names = {id(p): n for n, p in named_params}
        sparse_ids = set(sparse_ids) if not self.sparse_as_dense else set()
        self.sparse = [p for _, p in named_params if id(p) in sparse_ids]
        self._sparse_found: list[nn.Parameter] = []  # bucketed, but their gradient came sparse (gather_grads)
        return [p for _, p in named_params if id(p) not in sparse_ids]

    def _make_buckets(self, dense, plan, bucket_mb: float, pad_to: int, lazy: bool) -> BucketManager:
        if plan is None:
            return BucketManager(dense, int(bucket_mb * 2**20), self.reduction.launch, self.join_flag)
        planned = {id(p) for ps in plan for p in ps}
        if planned != {id(p) for p in dense} or sum(len(ps) for ps in plan) != len(planned):
            raise ValueError("GradientEngine(plan=...): the plan must hold every dense parameter exactly once")
        on_complete = self.reduction.complete if isinstance(self.reduction, ReportsComplete) else None
        return PlannedBuckets(plan, self.reduction.launch, pad_to=pad_to, lazy=lazy, on_complete=on_complete)

    def _init_step_state(self) -> None:
        """What one engine carries from step to step (copied over when DataParallel re-buckets)."""
        self.sample_weight: float | None = None
        self.observer: StepObserver | None = None  # told when a step's phases begin and end (hooks.py)
        # at the first gradient of a pass that reduces, before any bucket (DistributedOptimizer's join)
        self.on_first_grad: Callable[[], None] | None = None
        self.bytes_sent = 0
        self.require_sync = True
        self._passes = 0
        self._queued = False
        self._syncing = False
        self.shadowing = False
        self._pending = False
        self._used: set[int] = set()
        self._zero_filled: list[nn.Parameter] = []  # missing_as_zeros: given the bucket's average at wait()
        self._followups: list[FollowUp] = []  # launched after the buckets, finished after them
        self.warned_unused = False
        # Called with the seconds since the previous synchronised step ended, once per step,
        # after the gradients are in place and nothing is in flight (settings may change here).
        self.step_hooks: list[Callable[[float], None]] = []
        # phalanx.parallel.data.optimizer_overlap.OptimizerOverlap: steps the optimizer on each piece of the
        # averaged gradient as it is final (DataParallel(overlap_optimizer=...)).
        self.overlap = None
        self.backward_start: float | None = None  # set by DataParallel's traced forward
        self._last_step_end: float | None = None

    @property
    def pass_index(self) -> int:
        """The index of the backward pass now running, or of the last one when none runs (the
        end-of-backward callback counts it)."""
        return self._passes - (0 if self._queued else 1)

    def reset_passes(self) -> None:
        """Start counting backward passes from zero (ZeRO at ``zero_grad`` and after a load)."""
        self._passes = 0

    @property
    def device(self) -> torch.device:
        """The gradients' device, where the flags a step sends live (NCCL sends CUDA tensors only)."""
        return self.finite.device

    def busy(self) -> bool:
        """A backward pass is running or a reduction is in flight (settings must not change now)."""
        return self._pending or self._queued

    def take_over(self, old: GradientEngine) -> None:
        """Carry on from ``old`` (DataParallel re-bucketing after a ``requires_grad`` change)."""
        self._passes, self.require_sync = old._passes, old.require_sync
        self.sample_weight, self.bytes_sent = old.sample_weight, old.bytes_sent
        self.observer, self.overlap = old.observer, old.overlap

    def attach(self, observer: StepObserver | None) -> StepObserver | None:
        """Tell ``observer`` about every synchronised step from now on (after ``observer.bind(self)``)."""
        if observer is not None:
            observer.bind(self)
        self.observer = observer
        return observer

    def reform(self, topology) -> None:
        """The world changed under this engine (elastic re-form): start over as a fresh engine would.

        Only engines on the default group follow the job; one on an explicit group keeps it
        (that group belonged to the old world: build a new engine on a new group instead).
        """
        if self.follows_world:
            self.group = topology.steps_group() if dist.get_world_size() > 1 else None
        elif self.group is not None:
            _log.warning("a gradient engine on an explicit process group cannot follow an elastic re-form; "
                         "build DataParallel/DistributedOptimizer on the new group after the re-form")
            return
        self.topology = topology
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._needs_sync = self.world > 1 or self.find_unused or self.reduction.reduces_alone
        if not isinstance(self.buckets, PlannedBuckets):
            self.buckets = BucketManager(self.buckets.params, self.buckets.bucket_bytes, self.reduction.launch,  # agreed
                                         self.join_flag)
        else:
            self.buckets.reset()
        self.finite = FiniteGuard(self.compressor, self.buckets.params)
        if isinstance(self.compressor, Resettable):
            self.compressor.reset_state()  # error-feedback residuals: a newcomer has none either
        self.reduction.bind(ReductionContext(self))
        self._passes, self._queued, self._syncing, self._pending, self.shadowing = 0, False, False, False, False
        self._used, self._followups, self._zero_filled = set(), [], []
        self._last_step_end = None
        for fn in self.on_reform:
            fn()
        # after the fronts' hooks (a DistributedOptimizer's join announcement runs first on each
        # parameter, before any bucket launches), as at construction
        for h in self._hooks:
            h.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._hooked]

    # ------------------------------------------------------------------ backward
    def sync_now(self) -> bool:
        return self.require_sync and (self._passes + 1) % self.k == 0

    def _hook(self, p: torch.Tensor) -> None:
        # The hot path: one call per parameter per backward. Only bookkeeping here; the
        # gradient copies happen once per bucket with a single _foreach_copy_ (the reduction).
        if not self._queued:
            self._queued = True
            self._syncing = self.sync_now() and self._needs_sync
            if self._syncing and self.on_first_grad is not None:
                self.on_first_grad()
            if self.observer is not None:
                weight = self.observer.backward_begins()
                if self._syncing:
                    self.sample_weight = weight
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self._syncing:
            bucket = self.buckets._bucket_of.get(id(p))
            if bucket is not None:
                self._used.add(id(p))
                if self._on_grad is not None:
                    self._on_grad(p, bucket)
                self.buckets.mark_ready(p)

    def _end_of_backward(self) -> None:
        self._queued = False
        start, self.backward_start = self.backward_start, None
        if start is not None:
            trace.instant("backward", "compute", start, time.perf_counter())
        sync = self.sync_now()
        self._passes += 1
        self.reduction.end_of_backward(sync)
        if not sync or not self._needs_sync:
            return
        if self.observer is not None:
            self.observer.compute_ends()
        self._launch_rest()
        if self.wait_in_backward:
            self.wait()

    def _launch_rest(self) -> None:
        missing = self.buckets.missing()
        no_grad = [p for p in missing if p.grad is None]
        if self.missing_as_zeros:
            self._zero_filled = no_grad
        elif no_grad and not self.find_unused and not self.reduction.tolerates_missing:
            names = ", ".join(self.names[id(p)] for p in no_grad[:8])
            raise RuntimeError(
                f"phalanx DataParallel: {len(no_grad)} parameter(s) got no gradient in this backward "
                f"({names}{', …' if len(no_grad) > 8 else ''}). Pass find_unused_parameters=True when parts "
                "of the model are skipped, or set requires_grad=False on frozen parameters before wrapping."
            )
        for p in missing:
            if p.grad is not None:  # accumulated in earlier no_sync passes, unused in this one
                self._used.add(id(p))
            self.buckets.bucket_of(p).mark(p)
        self.buckets.launch_ready()
        self._launch_followups(shadow=False)
        self._pending = True

    def _launch_followups(self, shadow: bool) -> None:
        self._followups.extend(launch_sparse(self, shadow=shadow))
        if self.find_unused:
            used = [0.0 if shadow or id(p) not in self._used else 1.0 for p in self.buckets.params]
            self._followups.append(UsedCounts(torch.tensor(used, device=self.device), self.group))
        flag = self.finite.launch(self.group, steady=self.buckets.rebuilt)
        if flag is not None:
            self._followups.append(flag)

    def launch_all(self) -> None:
        """Launch every bucket not launched yet, as if all gradients were in (a step after fewer
        backward passes than ``backward_passes_per_step``; every rank calls it at the same point)."""
        if self.missing_as_zeros:
            self._zero_filled = [p for p in self.buckets.missing() if p.grad is None]
        for p in self.buckets.params:
            self.buckets.bucket_of(p).mark(p)
        self.buckets.launch_ready()
        self._pending = True

    def _fill_missing(self) -> None:
        """missing_as_zeros: a parameter without gradient gets its slot's average (Horovod's rule)."""
        for p in self._zero_filled:
            if p.grad is None:
                p.grad = self.buckets.bucket_of(p).view(p).clone()
        self._zero_filled = []

    def gather_grads(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients into its flat (zeros for a missing gradient)."""
        grads, views = [], []
        for p, view in zip(bucket.params, bucket.views):
            g = p.grad
            if g is None:
                view.zero_()
                continue
            if g.layout is torch.strided and g.data_ptr() == view.data_ptr():
                continue  # already the bucket's view (gradient_as_bucket_view): nothing to copy
            if g.layout is not torch.strided:
                if not self.sparse_as_dense:
                    self._found_sparse(p, view)
                    continue
                g = p.grad = g.to_dense()
            grads.append(g)
            views.append(view)
        if grads:
            torch._foreach_copy_(views, grads)

    def _found_sparse(self, p: nn.Parameter, view: torch.Tensor) -> None:
        """``p``'s gradient came sparse (an ``nn.Embedding(sparse=True)`` not declared): allgathered
        by this step's follow-up as Horovod does, its bucket slot zeros once, re-planned out at the
        end of the step (every rank finds the same ones in the same order)."""
        view.zero_()
        if p not in self.sparse:
            self.sparse.append(p)
            self._sparse_found.append(p)

    def _unbucket_sparse(self) -> None:
        """Re-plan the buckets without the parameters found sparse (keeping the order)."""
        gone, self._sparse_found = self._sparse_found, []
        self.buckets = self.buckets.without(gone)
        self.finite = FiniteGuard(self.compressor, self.buckets.params)
        _log.info("%d parameter(s) have sparse gradients: reduced by allgather, outside the %d bucket(s)",
                  len(gone), len(self.buckets.buckets))

    # ------------------------------------------------------------------ collectives
    def ring_bytes(self, nbytes: int) -> int:
        """What a bandwidth-optimal (ring) allreduce of ``nbytes`` sends from each rank."""
        return ring_bytes(nbytes, self.world)

    def scales(self) -> tuple[ReduceOp, float, float]:
        """(op, prescale, postscale) of this step: a weighted sum under a balancer's weight."""
        if self.sample_weight is not None:
            return ReduceOp.SUM, self.sample_weight / self.predivide, self.predivide
        return self.op, 1.0 / self.predivide, self.predivide

    def wait(self) -> None:
        """Finish every launched collective and write the averaged gradients into ``p.grad``."""
        if not self._pending:
            return
        self._pending = False
        t_wait = time.perf_counter()
        for bucket in self.buckets.buckets:
            self.reduction.finish(bucket)
        if self._zero_filled:
            self._fill_missing()
        for followup in self._followups:
            followup.finish(self)
        self._end_step()
        if self.observer is not None:
            self.observer.wait_ends(time.perf_counter() - t_wait)
        if self.step_hooks:
            if self._last_step_end is not None:
                seconds = time.perf_counter() - self._last_step_end
                for fn in self.step_hooks:
                    fn(seconds)
            self._last_step_end = time.perf_counter()

    def _end_step(self) -> None:
        self._followups, self._used = [], set()
        self._maybe_rebuild()
        if self._sparse_found:
            self._unbucket_sparse()
        self.buckets.reset()

    def _maybe_rebuild(self) -> None:
        if self.buckets.rebuilt:
            return
        order = self.buckets.observed if dist.get_rank() == root_of(self.group) else None
        order = broadcast_object(order, root_rank=root_of(self.group), group=self.group)
        if self.buckets.maybe_rebuild(order):
            _log.debug("rebuilt %d buckets from the order gradients arrived in", len(self.buckets.buckets))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        out = {"passes": self._passes}
        if isinstance(self.compressor, Stateful):
            out["compression"] = self.compressor.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self._passes = int(state.get("passes", 0))
        if "compression" in state and isinstance(self.compressor, Stateful):
            self.compressor.load_state_dict(state["compression"])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


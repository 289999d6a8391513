"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) across data-parallel ranks.

Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC 2020, arXiv:1910.02054). Per-rank bytes with
mixed precision and Adam (K = 12: fp32 master + two moments), Ψ parameters,
N ranks::

    stage 1  P_os        2Ψ + 2Ψ + KΨ/N
    stage 2  P_os+g      2Ψ + (2 + K)Ψ/N
    stage 3  P_os+g+p    (2 + 2 + K)Ψ/N

Data flow of one step (every stage; the stages differ in what stays whole)::

    forward/backward (full params: stages 1-2; gathered per module: 3)
      → grads reduce-scattered during backward (1: last micro-batch only; 2, 3: every one) → grad shard
      → global-norm clip (one allreduce of a scalar) → inner optimizer on the fp32 shard
      → params: allgather into the full flats (1, 2) / refresh the low-precision shard (3)

Example::

    import torch, phalanx as px
    px.init()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = px.zero(model, opt, stage=2, max_grad_norm=1.0)
    loss = model(torch.randn(8, 32)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from phalanx import runtime
from phalanx.comm.compression.codecs import get_compressor
from phalanx.log import get_logger
from phalanx.optim.adam8bit import Adam8bit, check_state_bits
from phalanx.optim.face import OptimizerFace
from phalanx.parallel import composition
from phalanx.parallel.clip import counted_elsewhere, sum_over
from phalanx.parallel.norm import scale_grads_
from phalanx.parallel.pipeline.by_path import tied_of
from phalanx.parallel.zero.checkpoint import ShardedCheckpoint
from phalanx.parallel.zero.shard import assign_shard_offsets, build_units, chunks, segments
from phalanx.parallel.zero.stage3 import Stage3
from phalanx.parallel.zero.stage12 import Stage12
from phalanx.parallel.zero.tied import TiedCopies

__all__ = ["zero", "ZeroOptimizer"]

_log = get_logger(__name__)
_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.defaults`` limited to what its constructor takes (AdamW records
    ``decoupled_weight_decay`` in its defaults but does not accept it back)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def _check_args(model, optimizer, stage, bucket_mb, mixed_precision, max_grad_norm, passes, compression,
                state_bits=32, tied_group=None):
    if stage not in (1, 2, 3):
        raise ValueError(f"zero(stage={stage!r}): stage must be 1, 2 or 3")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero(model=…): expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OptimizerFace):
        raise TypeError(f"zero(optimizer=…): expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
                        + (" (a phalanx wrapper: pass the torch optimizer it wraps; zero does the data-parallel"
                           " reduction itself)" if isinstance(optimizer, OptimizerFace) else ""))
    if optimizer.state:
        raise ValueError("zero(optimizer=…): the optimizer has already stepped; wrap it before the first step")
    if mixed_precision not in _DTYPES:
        raise ValueError(f"zero(mixed_precision={mixed_precision!r}): use None, 'bf16' or 'fp16'")
    if not bucket_mb or bucket_mb <= 0:
        raise ValueError(f"zero(bucket_mb={bucket_mb!r}): must be a positive number of MiB")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"zero(max_grad_norm={max_grad_norm!r}): must be positive, or None to not clip")
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"zero(backward_passes_per_step={passes!r}): must be an integer >= 1")
    check_state_bits("zero", state_bits, optimizer)
    tied = tied_of(model)  # a pipeline stage cut by module path
    if tied and tied_group is None:
        raise ValueError(composition.tied_across_stages(tied[0].name, tied[0].stages, f"zero(stage={stage})"))
    compressor = get_compressor(compression)
    if not composition.accepts_compressor(f"zero{stage}", compressor.summable, compressor.name):
        raise ValueError(
            f"zero(compression={compression!r}): ZeRO reduce-scatters gradients, which sums the payloads on "
            "the wire, so only summable compressors work ('fp16', 'bf16'); for int8/top-k/sign/PowerSGD use "
            "px.DataParallel"
        )
    return compressor


def zero(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int = 1,
    *,
    topology=None,
    group=None,
    bucket_mb: float = 25.0,
    mixed_precision: str | None = None,
    max_grad_norm: float | None = None,
    backward_passes_per_step: int = 1,
    compression=None,
    state_bits: int = 32,
    tied_group=None,
    tp_group=None,
    pp_group=None,
):
    """Shard ``optimizer`` (and, by stage, gradients and parameters) over the ranks of ``group``.

    Returns ``(model, optimizer)``: the same module with hooks added, and a
    :class:`ZeroOptimizer` used like the original (``step``, ``zero_grad``).
    Parameters start equal to rank 0's. ``mixed_precision="bf16"|"fp16"`` computes
    in that dtype with fp32 master weights in the shard (for fp16, backward on
    ``optimizer.scale_loss(loss)``). ``max_grad_norm`` clips by the global norm.
    ``backward_passes_per_step=k``: micro-batches per step; stage 1 then
    reduces once, during the k-th backward (stages 2 and 3 reduce every
    backward, which is what frees their gradient memory). Any other number of
    passes is still correct, only less overlapped. ``compression="fp16"|"bf16"``
    sends gradients in that dtype (summed in it too); the shard stays in the compute dtype.
    ``state_bits=8`` (Adam / AdamW only) keeps the two moments as block-wise quantized bytes
    (:class:`~phalanx.optim.Adam8bit`, Dettmers et al. 2021): 2 bytes a parameter instead of 8, sharded.
    ``topology``: the job's :class:`~phalanx.runtime.Topology` (default: the one ``px.init()``
    made); ``group`` defaults to its world group.
    ``tied_group``: on a pipeline stage holding a copy of a parameter tied across stages (a head
    tied to the embedding, ``model.tied_across_stages`` from ``split_by_path``), the pipeline's
    process group (group rank s = stage s: ``RankGrid.pp_group``): ZeRO starts the copies equal, sums
    their reduced gradient shards on the first stage holding one, which alone keeps the copy's optimizer
    state and steps it, and sends the result to the other holders (:mod:`phalanx.parallel.zero.tied`).
    ``tp_group`` / ``pp_group``: on a piece of a split model (a TP shard, a pipeline stage; ``pp_group``
    defaults to ``tied_group``), the norm that ``max_grad_norm`` clips by (and the fp16 overflow check)
    is the whole model's: the squares summed over dp, then tp, then pp, each element once
    (:mod:`phalanx.parallel.clip`; Megatron-LM's rule). ``parallelize`` passes both.

    Example::

        model, opt = px.zero(model, torch.optim.Adam(model.parameters()), stage=3)
    """
    compressor = _check_args(model, optimizer, stage, bucket_mb, mixed_precision, max_grad_norm,
                             backward_passes_per_step, compression, state_bits, tied_group)
    if topology is None:
        if not runtime.is_initialized():
            raise RuntimeError("zero(): phalanx is not initialised; call px.init() first (or pass topology=)")
        topology = runtime.topology()
    group = group if group is not None else topology.world_group()
    return model, ZeroOptimizer(model, optimizer, stage, group, bucket_mb, _DTYPES[mixed_precision], max_grad_norm,
                                backward_passes_per_step, compressor, state_bits, tied_group,
                                tp_group, tied_group if pp_group is None else pp_group)


def _inside(chunk: torch.Tensor, master: torch.Tensor, units, ids: set[int]) -> bool:
    """Whether ``chunk`` (a view of ``master``) lies in the slice of a unit holding one of ``ids`` alone."""
    if not ids:
        return False
    a = chunk.storage_offset() - master.storage_offset()
    return any(u.shard_offset <= a < u.shard_offset + u.shard_numel
               for u in units if len(u.params) == 1 and id(u.params[0]) in ids)


def _cast(dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return cast


class ZeroOptimizer(ShardedCheckpoint, OptimizerFace):
    """The inner optimizer, rebuilt over this rank's flat fp32 shard of each parameter group.

    Checkpoints: ``sharded_state_dict`` / ``load_sharded_state_dict`` (any world size) and
    ``full_state_dict`` / ``load_full_state_dict`` (torch.optim's format), from
    :class:`~phalanx.parallel.zero.checkpoint.ShardedCheckpoint`.
    """

    def __init__(self, model, optimizer, stage, group, bucket_mb, compute_dtype, max_grad_norm,
                 backward_passes_per_step: int = 1, compressor=None, state_bits: int = 32,
                 tied_group=None, tp_group=None, pp_group=None) -> None:
        self.model, self.stage, self.group = model, stage, group
        self.split_groups = (tp_group, pp_group)  # the norm's squares are summed over these after dp
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.max_grad_norm = max_grad_norm
        # a function giving the squares of the gradients of the model that this optimizer does not hold,
        # summed over their own groups (the same on every rank), added to the norm: ExpertOptimizer's experts
        self.outside_squares = None
        self.loss_scale = 2.0**16 if compute_dtype == torch.float16 else 1.0
        self._good_steps = 0
        names = {id(p): n for n, p in model.named_parameters()}
        groups_named = []
        for gi, pg in enumerate(optimizer.param_groups):
            missing = [p for p in pg["params"] if id(p) not in names]
            if missing:
                raise ValueError(
                    f"zero: param_groups[{gi}] holds {len(missing)} tensor(s) that are not parameters of the "
                    "model; build the optimizer from model.parameters()"
                )
            groups_named.append([(names[id(p)], p) for p in pg["params"]])
        first = next(model.parameters(), None)
        param_dtype = first.dtype if first is not None else torch.float32
        self.compute_dtype = compute_dtype or param_dtype
        master_dtype = torch.float32 if compute_dtype is not None else param_dtype
        self._check_layout(groups_named)
        self._group_names = [[n for n, _ in named] for named in groups_named]
        self._shapes = {n: tuple(p.shape) for named in groups_named for n, p in named}
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for _, p in model.named_parameters():  # everyone starts from rank 0's values
            dist.broadcast(p.data, src=src, group=group)
        tied = tied_of(model)
        device = first.device if first is not None else torch.device("cpu")
        self.tied = TiedCopies(tied, tied_group, device) if tied else None
        if self.tied is not None:  # the copies start equal; ZeRO, not the pipeline, sums their gradients
            self.tied.sync()
            model.tied_summed_by = "zero"
        alone = self.tied.alone() if self.tied is not None else set()
        registration = {id(p): i for i, p in enumerate(model.parameters())}
        if stage == 3:
            self.engine = Stage3(model, groups_named, master_dtype, self.compute_dtype, group, self.rank, self.world,
                                 registration, compressor, alone)
            self.masters = self.engine.masters
        else:
            bucket_numel = max(1, int(bucket_mb * 2**20 / torch.finfo(self.compute_dtype).bits * 8))
            # Reverse registration order: gradients of the last layers arrive first in backward.
            units = [build_units(list(reversed(named)), self.world, bucket_numel, alone) for named in groups_named]
            self.masters = [torch.zeros(assign_shard_offsets(us), dtype=master_dtype, device=device) for us in units]
            self.engine = Stage12(stage, units, self.masters, self.compute_dtype, group, self.rank,
                                  backward_passes_per_step, registration, compressor)
        hparams = [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]
        # a tied copy's slice starts and ends views of its own (8-bit blocks then line up across stages)
        self._cuts = [[off for u in us if id(u.params[0]) in alone and len(u.params) == 1
                       for off in (u.shard_offset, u.shard_offset + u.shard_numel)] for us in self.engine.units]
        self.chunks = [chunks(m, cuts) for m, cuts in zip(self.masters, self._cuts)]
        self._norm_spans = self._counted_spans(model, tp_group, pp_group)
        # a copy whose first holder is another stage: stepped there (its state kept once), sent here
        elsewhere = self.tied.state_elsewhere() if self.tied is not None else set()
        self.state_elsewhere = {n for n, p in model.named_parameters() if id(p) in elsewhere}
        stepped = [[c for c in cs if not _inside(c, m, us, elsewhere)]
                   for cs, m, us in zip(self.chunks, self.masters, self.engine.units)]
        if state_bits == 8:
            self.inner = Adam8bit.like(optimizer, params=stepped)
        else:
            self.inner = type(optimizer)([{"params": cs, **hp} for cs, hp in zip(stepped, hparams)],
                                         **_constructor_defaults(optimizer))
        model.register_forward_pre_hook(lambda m, args: self.engine.before_forward())
        if compute_dtype is not None:
            model.register_forward_pre_hook(lambda m, args, kw: tree_map(_cast(compute_dtype), (args, kw)), with_kwargs=True)
            model.register_forward_hook(lambda m, args, out: tree_map(_cast(torch.float32), out))
        if stage == 3:
            model.register_state_dict_pre_hook(lambda *a, **k: self.engine.gather_all())
            model.register_state_dict_post_hook(lambda *a: self._full_state_dict_post(*a))
        model.register_load_state_dict_pre_hook(self._load_full_pre)
        model.register_load_state_dict_post_hook(self._load_full_post)

    def _counted_spans(self, model, tp_group, pp_group) -> list[list[tuple[int, int]]]:
        """Per master shard, the ``[a, b)`` ranges whose squares this rank adds to the norm: all of it,
        less the parameters another tp rank or stage counts (:func:`~phalanx.parallel.clip.counted_elsewhere`)."""
        skip = counted_elsewhere(model, tp_group, pp_group)
        by_name = dict(model.named_parameters())
        out = []
        for master, us in zip(self.masters, self.engine.units):
            gaps = sorted((off, off + n) for name, _, n, off in segments(us, self.rank) if id(by_name[name]) in skip)
            spans, start = [], 0
            for a, b in gaps:
                if a > start:
                    spans.append((start, a))
                start = max(start, b)
            if start < master.numel():
                spans.append((start, master.numel()))
            out.append(spans)
        return out

    def _check_layout(self, groups_named) -> None:
        mine = [[(n, tuple(p.shape)) for n, p in named] for named in groups_named]
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        for r, other in enumerate(every):
            if other != mine:
                raise ValueError(f"zero: rank {r} has different parameters (names/shapes) than rank {self.rank}")

    @torch.no_grad()
    def _load_full_pre(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        """``model.load_state_dict(full)``: each rank copies its slice of every full tensor into its master shard.

        Keys, shapes and ``strict`` are left to torch, which reports missing, unexpected and
        mis-shaped keys as for any module; a tensor whose shape is wrong is skipped here too.
        Stage 3 gets its full flats allocated (not gathered: no communication) for torch to
        copy into, and freed again in :meth:`_load_full_post`.
        """
        if local_metadata.get("assign_to_params_buffers") and self.stage == 3:
            raise RuntimeError(
                "zero stage 3: model.load_state_dict(..., assign=True) would replace the sharded parameters; "
                "load with assign=False (the default): each rank keeps its slice of every full tensor"
            )
        for g, us in enumerate(self.engine.units):
            master = self.masters[g]
            for u in us:
                lo, hi = u.owned(self.rank)
                for name, shape, off in zip(u.names, u.shapes, u.offsets):
                    full = state_dict.get(prefix + name)
                    if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(shape):
                        continue
                    n = math.prod(shape)
                    a, b = max(lo, off), min(hi, off + n)
                    if a < b:
                        dst = u.shard_offset + a - lo
                        master[dst : dst + b - a].copy_(full.detach().reshape(-1)[a - off : b - off])
        if self.stage == 3:
            self.engine.allocate_all()

    def _load_full_post(self, module, incompatible_keys) -> None:
        if self.stage == 3:
            self.engine.free_all()
            self.engine.publish()  # the compute-dtype shard follows the masters

    def _full_state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor):
                state_dict[k] = v.clone()
        self.engine.free_all()

    # -- the optimizer interface --------------------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (1 unless fp16); call backward on this in fp16 mode."""
        return loss * self.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce gradients to their owners, clip, step the shard, republish the parameters.

        Returns the global gradient norm when it was computed (clipping or fp16), else ``None``.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step(closure=…) is not supported; compute the loss before step()")
        shards = self.engine.grad_shards_for_step()
        if self.tied is not None:  # the copies of a parameter tied across pipeline stages: one gradient
            self.tied.reduce_grad_shards(self.engine.units, shards)
        grads = [g.float() if g.dtype != m.dtype else g for g, m in zip(shards, self.masters)]
        if self.loss_scale != 1.0:
            for g in grads:
                g.div_(self.loss_scale)
        total_norm = None
        if self.max_grad_norm is not None or self.loss_scale != 1.0:  # else no norm is needed: skip its pass
            sq = torch.zeros(1, device=self.masters[0].device)
            for g, spans in zip(grads, self._norm_spans):
                for a, b in spans:
                    sq += torch.linalg.vector_norm(g[a:b], dtype=torch.float32) ** 2
            dist.all_reduce(sq, group=self.group)  # the dp shards, then the other pieces of a split model
            sq = sum_over(sq, *self.split_groups)
            if self.outside_squares is not None:
                sq = sq + self.outside_squares().to(sq.device)
            total_norm = sq.sqrt()
        if total_norm is not None and not torch.isfinite(total_norm).item():
            self.loss_scale /= 2.0
            self._good_steps = 0
            _log.warning("zero: non-finite gradient norm; step skipped, loss scale now %g", self.loss_scale)
            self.engine.after_step()
            return None
        if self.max_grad_norm is not None:
            scale_grads_(grads, self.max_grad_norm, total_norm)
        for cs, g, cuts in zip(self.chunks, grads, self._cuts):
            for c, gc in zip(cs, chunks(g, cuts)):
                c.grad = gc
        self.inner.step()
        for cs in self.chunks:
            for c in cs:
                c.grad = None
        if self.tied is not None:  # the first holder stepped each copy: its values to the other holders
            self.tied.send_updated(self.engine.units, self.masters)
        self.engine.publish()
        self.engine.after_step()
        if self.loss_scale != 1.0:
            self._good_steps += 1
            if self._good_steps % 2000 == 0:
                self.loss_scale *= 2.0
        return total_norm

"""ZeRO stage 3 (P_os+g+p): parameters sharded too, gathered per module just in time.

Each *unit* is a module that owns parameters directly (with all its descendants'
parameters, so ``nn.MultiheadAttention`` reading ``out_proj.weight`` itself still
works). A unit's parameters are views into one padded flat whose storage is
freed (``resize_(0)``) between uses, so tensors autograd saved in forward keep
pointing at the same storage, which is refilled before backward::

    forward:   pre-hook(u_i): wait gather(u_i) · prefetch gather(u_i+1) → run u_i → free(u_i)
    backward:  grad of u_i's output: wait gather(u_i) · prefetch gather(u_i-1)
               grads in → free(u_i) → the data-parallel engine's bucket u_i: copy into its flat,
               drop the grads, reduce_scatter(async, fixed order) into the shard, free the flat
    step():    inner optimizer on the fp32 shard, in place: the next gather reads it

Under mixed precision the fp32 shard is the parameter itself, as in FSDP2: a gather casts it into the
unit's compute-dtype flat (the rank's own slot, or a shard-sized temporary on NCCL), and the gradient
shard is fp32 too, the compute-dtype reduce-scatter's result added into it. Persistent bytes are
those of the paper's mixed-precision layout, 16Ψ/N (4 + 4 + Adam's 8, against its 2 + 2 + 12), but
nothing is copied at the step: the paper's layout casts its 2-byte gradient shard to fp32 there, a
4Ψ/N transient that made ZeRO-3's peak 1.13x FSDP2's on an H100 (benchmarks/LOG.md, GPU ZeRO memory).

The model's code is untouched: only forward pre/post hooks, a multi-grad hook on
each unit's outputs and post-accumulate-grad hooks on parameters are added.

Tied parameters (GPT-2's and small Llamas' head *is* the token embedding) are
sharded once, in the unit of the first module that owns them; every later user
gathers that unit too before it runs and frees it after, as FSDP2 does with the
root module. In backward the shared unit stays gathered from its last user's
backward to its first one's, when its (single, summed) gradient is in.

A copy of a parameter tied across *pipeline stages* (``alone``) is a unit of its own inside its
module's, so its shard lines up with the other stages' copies (:mod:`phalanx.parallel.zero.tied`).

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant, per block)
composes: a forward that runs *inside* backward is the block's recomputation,
so its pre-hooks gather again and its post-hooks do not free (autograd is about
to use those parameters); each unit is freed when its gradients are in::

    backward of block b:  recompute(b): gather u_b0 … u_bk (no prefetch, no free)
                          → grads of u_bk … u_b0 arrive → each freed, reduce-scattered
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from phalanx.parallel.zero.shard import Unit, assign_shard_offsets, build_units, gather_into
from phalanx.parallel.zero.stage12 import grad_bytes, shard_engine

__all__ = ["Stage3", "unit_modules"]


def unit_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that own parameters directly and have no such ancestor (outermost first)."""
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, m in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c, _ in chosen if c) or (chosen and chosen[0][0] == ""):
            continue
        if any(True for _ in m.parameters(recurse=False)):
            chosen.append((name, m))
    return chosen


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a forward now is a checkpointed block's recomputation."""
    return torch._C._current_graph_task_id() != -1


class Stage3:
    """Sharded parameters with per-module gather/free hooks (see module docstring)."""

    def __init__(self, model, groups_named, master_dtype, compute_dtype, group, rank: int, world: int,
                 registration: dict[int, int] | None = None, compressor=None,
                 alone: frozenset[int] | set[int] = frozenset()) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.compute_dtype = compute_dtype
        group_of = {id(p): g for g, named in enumerate(groups_named) for _, p in named}
        names = {id(p): n for named in groups_named for n, p in named}
        self.units: list[list[Unit]] = [[] for _ in groups_named]
        self.module_units: list[tuple[torch.nn.Module, list[tuple[int, Unit]]]] = []
        owner: dict[int, tuple[int, Unit]] = {}  # parameter → the (group, unit) that holds its one shard
        for _, m in unit_modules(model):
            per_group: dict[int, list] = {}
            shared: list[tuple[int, Unit]] = []
            for p in m.parameters():
                if id(p) in owner:  # tied (GPT-2's head is its embedding): gather the owner's unit here too
                    if all(owner[id(p)][1] is not u for _, u in shared):
                        shared.append(owner[id(p)])
                    continue
                if id(p) not in group_of:
                    raise ValueError(
                        f"zero(stage=3): parameter {names.get(id(p), '?')} is not in the optimizer; "
                        "stage 3 shards every parameter — pass all of model.parameters() to the optimizer"
                    )
                per_group.setdefault(group_of[id(p)], []).append((names[id(p)], p))
            mu = []
            for g, named in sorted(per_group.items()):
                for u in build_units(named, world, None, alone):
                    self.units[g].append(u)
                    mu.append((g, u))
                    owner.update({id(p): (g, u) for p in u.params})
            self.module_units.append((m, mu + shared))
        self.masters = [
            torch.zeros(assign_shard_offsets(us), dtype=master_dtype, device=self._device(us)) for us in self.units
        ]
        self.flats: dict[int, torch.Tensor] = {}
        for g, us in enumerate(self.units):
            for u in us:
                full = u.flatten(dtype=master_dtype)
                lo, hi = u.owned(rank)
                self.masters[g][u.shard_offset : u.shard_offset + u.shard_numel].copy_(full[lo:hi])
                flat = torch.empty(u.padded, dtype=compute_dtype, device=full.device)
                for p, v in zip(u.params, u.views(flat)):
                    p.data = v
                self.flats[id(u)] = flat
                self._free(u)
        # What is gathered is the master shard itself, cast into the compute-dtype flat at each gather;
        # the gradient shard is in the master's dtype (the module docstring says why).
        self.grad_shards = [torch.zeros_like(m) for m in self.masters]
        self._gathered: set[int] = set()
        self._prefetch: dict[int, object] = {}
        self._order: list[int] = []  # forward order of module units, learned on the first pass
        self._order_done = False
        # Gradients: the data-parallel engine with ZeRO's reduce-scatter, one bucket per module unit.
        self.grad_engine, self.reduction = shard_engine(
            self.units, self.grad_shards, group, registration=registration, compressor=compressor,
            on_unit_complete=self._free, on_backward_end=self._backward_end)
        for i, (m, _) in enumerate(self.module_units):
            m.register_forward_pre_hook(self._make_pre(i))
            m.register_forward_hook(self._make_post(i))
        model.register_forward_hook(self._end_of_forward)

    def _end_of_forward(self, module, args, output) -> None:
        self._order_done = bool(self._order)  # one full forward has taught us the order

    @staticmethod
    def _device(us):
        return us[0].params[0].device if us else torch.device("cpu")

    # -- gather / free -------------------------------------------------------------------
    def _free(self, u: Unit) -> None:
        self.flats[id(u)].untyped_storage().resize_(0)
        if hasattr(self, "_gathered"):
            self._gathered.discard(id(u))

    def _launch_gather(self, g: int, u: Unit):
        flat = self.flats[id(u)]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        mine = self.masters[g][u.shard_offset : u.shard_offset + u.shard_numel]
        return gather_into(flat, mine, self.group, self.rank, self.world)

    def _gather_module(self, i: int) -> None:
        works = []
        for g, u in self.module_units[i][1]:
            if id(u) in self._gathered:
                continue
            work = self._prefetch.pop(id(u), None) or self._launch_gather(g, u)
            works.append(work)
            self._gathered.add(id(u))
        for w in works:
            w.wait()

    def _prefetch_module(self, i: int) -> None:
        for g, u in self.module_units[i][1]:
            if id(u) not in self._gathered and id(u) not in self._prefetch:
                self._prefetch[id(u)] = self._launch_gather(g, u)

    def gather_all(self) -> None:
        for i in range(len(self.module_units)):
            self._gather_module(i)

    def allocate_all(self) -> None:
        """Give every unit's flat its storage without gathering (a full load overwrites it)."""
        for us in self.units:
            for u in us:
                flat = self.flats[id(u)]
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())

    def free_all(self) -> None:
        for work in self._prefetch.values():
            work.wait()
        self._prefetch.clear()
        for us in self.units:
            for u in us:
                self._free(u)

    # -- hooks ---------------------------------------------------------------------------
    def _make_pre(self, i: int):
        def pre(module, args):
            if _in_backward():  # a recomputation (activation checkpointing): gather only
                self._gather_module(i)
                return
            if not self._order_done and i not in self._order:
                self._order.append(i)
            self._gather_module(i)
            if self._order_done:
                k = self._order.index(i)
                if k + 1 < len(self._order):
                    self._prefetch_module(self._order[k + 1])

        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            if _in_backward():
                # Recomputed inside backward: autograd is about to use these parameters, so they stay
                # gathered until their gradients are in (the engine frees a unit once all have arrived).
                return
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and tensors:
                register_multi_grad_hook(tensors, lambda grads: self._pre_backward(i), mode="any")
            for _, u in self.module_units[i][1]:
                self._free(u)

        return post

    def _pre_backward(self, i: int) -> None:
        self._gather_module(i)
        if i in self._order:
            k = self._order.index(i)
            if k > 0:
                self._prefetch_module(self._order[k - 1])

    def _backward_end(self) -> None:
        self.free_all()

    # -- step ----------------------------------------------------------------------------
    def before_forward(self) -> None:
        pass

    def grad_shards_for_step(self) -> list[torch.Tensor]:
        self.grad_engine.wait()
        return self.grad_shards

    def after_step(self) -> None:
        self.grad_engine.reset_passes()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_engine.wait()
        self.grad_engine.reset_passes()
        self.reduction.zero()

    def publish(self) -> None:
        """Nothing to refresh: a gather reads the master shard itself."""

    def param_bytes(self) -> int:
        gathered = sum(
            self.flats[id(u)].untyped_storage().nbytes() for us in self.units for u in us
        )
        return gathered + sum(s.numel() * s.element_size() for s in self.masters)

    def grad_bytes(self) -> int:
        return grad_bytes(self.grad_engine, self.grad_shards)

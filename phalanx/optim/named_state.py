"""An optimizer's state keyed by parameter *name*, the form that moves between layouts.

``torch.optim`` keys its state dict by a parameter's index in ``param_groups``, which changes
with every layout (a pipeline stage holds some parameters, a tensor-parallel rank slices of
them). Keyed by the model's parameter names instead, one dict loads into any optimizer over
any subset of the same model::

    {"state": {"model.layers.0.mlp.up_proj.weight": {"step": tensor(3.), "exp_avg": …, "exp_avg_sq": …}, …},
     "param_groups": [{"lr": 1e-2, "betas": (0.9, 0.999), …, "params": ["model.embed_tokens.weight", …]}]}

:func:`named_optimizer_state` reads one (a ``torch.optim`` optimizer, an 8-bit ``Adam8bit``,
whose moments it reads as fp32, or a ZeRO optimizer, whose shards it consolidates: collective
there); :func:`load_named_optimizer_state` writes one into an optimizer whose parameters are
a subset (a stage) of the names, each with the saved shape. Tensor parallel's
:func:`phalanx.parallel.tensor.gather_tp_optimizer_state` gathers the slices of every tp rank
into such a dict, so Adam's moments follow the parameters from tp 2 to world 1, ZeRO or a pipeline.

Example::

    state = named_optimizer_state(opt, model.named_parameters())
    load_named_optimizer_state(stage_opt, state, stage.named_parameters())   # this stage's names only
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from phalanx.optim.adam8bit import FullPrecisionState

__all__ = ["named_optimizer_state", "load_named_optimizer_state", "Consolidating"]


@runtime_checkable
class Consolidating(Protocol):
    """An optimizer whose state is sharded over a group and read or written whole (ZeRO's:
    :class:`phalanx.parallel.zero.checkpoint.ShardedCheckpoint`); collective over that group."""

    def full_state_dict(self, rank: int | None = 0) -> dict | None: ...

    def load_full_state_dict(self, state_dict: dict) -> None: ...


def _names_of(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> list[list]:
    names = {id(p): n for n, p in named_parameters}
    out = []
    for g, pg in enumerate(optimizer.param_groups):
        missing = sum(id(p) not in names for p in pg["params"])
        if missing:
            raise ValueError(f"optimizer param_groups[{g}] holds {missing} tensor(s) that are not in named_parameters; "
                             "pass the named_parameters() of the model the optimizer was built on")
        out.append([(names[id(p)], p) for p in pg["params"]])
    return out


def named_optimizer_state(optimizer, named_parameters: Iterable[tuple[str, nn.Parameter]] = ()) -> dict:
    """``optimizer``'s state keyed by parameter name (tensors are copies).

    A ZeRO optimizer (:class:`Consolidating`) is consolidated over its group first: every rank
    of the group must call this, and ``named_parameters`` is not needed. An optimizer with
    ``full_precision_state`` (``Adam8bit``) gives its moments as fp32.
    """
    if isinstance(optimizer, Consolidating):  # ZeRO: consolidated, keyed by index, with the names
        full = optimizer.full_state_dict(rank=None)
        state, groups = {}, []
        for names, pg in zip(full["phalanx"]["names"], full["param_groups"]):
            for name, idx in zip(names, pg["params"]):
                if idx in full["state"]:
                    state[name] = full["state"][idx]
            groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": list(names)})
        return {"state": state, "param_groups": groups}
    read = optimizer.full_precision_state if isinstance(optimizer, FullPrecisionState) else None
    state, groups = {}, []
    for named, pg in zip(_names_of(optimizer, named_parameters), optimizer.param_groups):
        for name, p in named:
            st = read(p) if read is not None and optimizer.state.get(p) else optimizer.state.get(p, {})
            if st:
                state[name] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": [n for n, _ in named]})
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(optimizer, state: dict, named_parameters: Iterable[tuple[str, nn.Parameter]] = ()) -> None:
    """Load a dict of :func:`named_optimizer_state` into ``optimizer``, whose parameters are named by
    ``named_parameters`` (a subset of the saved names: a pipeline stage's). The hyperparameters of
    the saved group that holds a parameter are taken over. A ZeRO optimizer loads it through its
    ``load_full_state_dict`` (each rank keeps its shard; ``named_parameters`` not needed)."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or "param_groups" not in state:
        raise ValueError("load_named_optimizer_state: expected {'state': {name: {...}}, 'param_groups': [...]} "
                         "as named_optimizer_state() or gather_tp_optimizer_state() return it")
    if isinstance(optimizer, Consolidating):  # ZeRO: names are looked up in its own layout
        optimizer.load_full_state_dict(state)
        return
    group_of = {n: g for g in state["param_groups"] for n in g["params"]}
    per_param, groups, index = {}, [], 0
    for named, pg in zip(_names_of(optimizer, named_parameters), optimizer.param_groups):
        ids = []
        for name, p in named:
            if name not in group_of:
                raise ValueError(f"load_named_optimizer_state: parameter {name} is not in the saved state "
                                 f"({len(group_of)} names, e.g. {next(iter(group_of), None)!r}); save from the same model")
            st = state["state"].get(name)
            if st:
                bad = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape]
                if bad:
                    saved = st[bad[0]]
                    fix = ("this parameter is a tensor-parallel slice: gathered moments load into an uncut model "
                           "(world 1, a pipeline stage, px.zero); to resume at the same tp, save and load each rank's "
                           "optimizer.state_dict()") if saved.numel() > p.numel() else (
                           "gather the tensor-parallel slices first (gather_tp_optimizer_state)")
                    raise ValueError(f"load_named_optimizer_state: {name}'s {bad[0]} has shape "
                                     f"{tuple(saved.shape)}, the parameter {tuple(p.shape)}; {fix}")
                # copies: torch's load_state_dict keeps a tensor that already has the right dtype and
                # device, and the optimizer would then step the caller's dict in place
                per_param[index] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            ids.append(index)
            index += 1
        saved = group_of[named[0][0]] if named else {}
        mine = {k: v for k, v in pg.items() if k != "params"}  # keys the saved kind of optimizer lacks stay
        groups.append({**mine, **{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    # Adam8bit: requantized from fp32
    write = optimizer.load_full_precision_state if isinstance(optimizer, FullPrecisionState) else None
    optimizer.load_state_dict({"state": {} if write else per_param, "param_groups": groups})
    if write is not None:
        params = [p for pg in optimizer.param_groups for p in pg["params"]]
        for i, st in per_param.items():
            write(params[i], st)

"""ZeRO's checkpoint formats: the sharded one (any world size reloads it) and the consolidated one.

Two formats, both keyed by parameter *name* so that a load never depends on the
world size, the stage or the bucket plan of the save:

- **sharded** (``FORMAT``): each rank's pieces of the fp32 master weights and of the
  optimizer state, one record per (parameter, contiguous run of elements)::

      {"format": "phalanx.zero/1", "stage": 2, "world_size": 4, "rank": 1,
       "groups": [{"pieces": [{"name": "0.weight", "start": 512, "numel": 512, "shape": (32, 32),
                               "master": fp32[512], "state": {"exp_avg": …, "exp_avg_sq": …}}, …],
                   "scalars": {"step": tensor(10.)}, "hparams": {"lr": 1e-3, …}}, …]}

  A loader at any world size copies, for every element it owns, the saved piece that
  holds it (:meth:`ShardedCheckpoint.load_sharded_state_dict`). This is what
  ``phalanx.checkpoint`` saves for a ZeRO optimizer: the object reshards itself.
- **consolidated** (``FULL_FORMAT``): ``torch.optim``'s own ``{"state", "param_groups"}``
  with full-shape tensors, plus ``"phalanx": {"names", "master"}``; a plain optimizer of
  the unwrapped model loads it.

Example::

    sd = opt.sharded_state_dict()                      # this rank's pieces
    opt.load_sharded_state_dict([sd_rank0, sd_rank1])  # every saved rank's, at any world size
    full = opt.full_state_dict()                       # consolidated on rank 0 (collective)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from phalanx.optim.adam8bit import FullPrecisionState
from phalanx.parallel.zero.shard import segments

__all__ = ["FORMAT", "FULL_FORMAT", "ShardedCheckpoint", "consolidate", "full_as_shard_groups", "by_name_as_groups"]

FORMAT = "phalanx.zero/1"
FULL_FORMAT = "phalanx.zero.full/1"


class ShardedCheckpoint:
    """The checkpoint methods of :class:`~phalanx.parallel.zero.ZeroOptimizer`.

    A mixin over the optimizer's layout: ``masters`` (one flat fp32 shard per parameter
    group), ``chunks`` (their views the ``inner`` optimizer steps), ``engine.units``,
    ``rank``, ``world``, ``group``, ``stage``, ``_group_names``, ``_shapes`` and ``state_elsewhere``
    (names of tied copies whose optimizer state another pipeline stage keeps: saved without state).
    """

    def _stepped(self) -> set[int]:
        """ids of the chunks the inner optimizer steps (not a tied copy another stage steps)."""
        return {id(c) for pg in self.inner.param_groups for c in pg["params"]}

    def _flat_state(self, g: int) -> dict:
        """Group ``g``'s optimizer state as one flat tensor per key (chunks joined), scalars as they are;
        zeros where a chunk has none (a tied copy stepped on another stage: its pieces are saved stateless)."""
        cs = self.chunks[g]
        if isinstance(self.inner, FullPrecisionState):  # 8-bit state: cut and saved as fp32, requantized on load
            per_chunk = [self.inner.full_precision_state(c) for c in cs]
        else:
            per_chunk = [self.inner.state.get(c, {}) for c in cs]
        i = next((i for i, st in enumerate(per_chunk) if st), None)
        if i is None:
            return {}
        flat = {k for k, v in per_chunk[i].items() if isinstance(v, torch.Tensor) and v.shape == cs[i].shape}
        return {k: torch.cat([st[k] if st else torch.zeros_like(c, dtype=v.dtype) for st, c in zip(per_chunk, cs)])
                if k in flat else v for k, v in per_chunk[i].items()}

    def sharded_state_dict(self) -> dict:
        """This rank's pieces of master weights and optimizer state, addressed by parameter name.

        Every piece records ``name``, ``start`` (element offset in the flattened
        parameter), ``numel`` and ``shape``; a load at any world size reassembles from them.
        """
        groups = []
        for g, (m, us) in enumerate(zip(self.masters, self.engine.units)):
            st = self._flat_state(g)
            flat_keys = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.shape == m.shape]
            pieces = []
            for name, start, n, off in segments(us, self.rank):
                shape = next(s for u in us for nm, s in zip(u.names, u.shapes) if nm == name)
                piece = {"name": name, "start": start, "numel": n, "shape": tuple(shape),
                         "master": m[off : off + n].clone()}
                piece["state"] = ({} if name in self.state_elsewhere else  # its first holder saves the state
                                  {k: st[k][off : off + n].clone() for k in flat_keys})
                pieces.append(piece)
            scalars = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items() if k not in flat_keys}
            hp = {k: v for k, v in self.inner.param_groups[g].items() if k != "params"}
            groups.append({"pieces": pieces, "scalars": scalars, "hparams": hp})
        return {"format": FORMAT, "stage": self.stage, "world_size": self.world, "rank": self.rank, "groups": groups}

    @torch.no_grad()
    def load_sharded_state_dict(self, shards) -> None:
        """Load from the sharded dicts of every saved rank (any world size, any stage).

        Example::

            opt.load_sharded_state_dict([torch.load(f"ckpt/rank{r}.pt") for r in range(4)])
        """
        shards = [shards] if isinstance(shards, dict) else list(shards)
        for s in shards:
            if s.get("format") != FORMAT:
                raise ValueError(f"load_sharded_state_dict: not a {FORMAT} shard (format={s.get('format')!r})")
        if len(shards) != shards[0]["world_size"]:
            raise ValueError(
                f"load_sharded_state_dict: got {len(shards)} shard(s) but they were saved by "
                f"{shards[0]['world_size']} ranks; pass every rank's shard"
            )
        if len(shards[0]["groups"]) != len(self.masters):
            raise ValueError(
                f"load_sharded_state_dict: the checkpoint has {len(shards[0]['groups'])} param group(s), this "
                f"optimizer {len(self.masters)}; build the optimizer with the param groups it was saved with"
            )
        for g, (m, us) in enumerate(zip(self.masters, self.engine.units)):
            saved = [s["groups"][g] for s in shards]
            index: dict[str, list[dict]] = {}
            for sg in saved:
                for piece in sg["pieces"]:
                    index.setdefault(piece["name"], []).append(piece)
            _check_same_parameters(index, us, g, self.state_elsewhere)
            keys = list(dict.fromkeys(k for sg in saved for piece in sg["pieces"] for k in piece["state"]))
            state = {k: torch.zeros_like(m) for k in keys}
            for name, start, n, off in segments(us, self.rank):
                for piece in index.get(name, []):
                    a, b = max(start, piece["start"]), min(start + n, piece["start"] + piece["numel"])
                    if a >= b:
                        continue
                    dst, src = slice(off + a - start, off + b - start), slice(a - piece["start"], b - piece["start"])
                    if piece.get("master") is not None:
                        m[dst].copy_(piece["master"][src])
                    for k in piece["state"]:
                        state[k][dst].copy_(piece["state"][k][src])
            for k, v in saved[0]["scalars"].items():
                state[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if state:
                lo, stepped = 0, self._stepped()
                for c in self.chunks[g]:
                    st = {k: (v[lo : lo + c.numel()] if k in keys else (v.clone() if isinstance(v, torch.Tensor) else v))
                          for k, v in state.items()}
                    lo += c.numel()
                    if id(c) not in stepped:  # a tied copy whose first holder (another stage) keeps its state
                        continue
                    if isinstance(self.inner, FullPrecisionState):
                        self.inner.load_full_precision_state(c, st)
                    else:
                        self.inner.state[c] = st
            self.inner.param_groups[g].update(saved[0]["hparams"])
        self.engine.publish()

    def full_state_dict(self, rank: int | None = 0) -> dict | None:
        """The consolidated optimizer state, in ``torch.optim``'s own format, on group rank ``rank``.

        Collective: every rank must call it. ``state`` is keyed by parameter index
        over the original ``param_groups`` and holds full-shape tensors, so a plain
        ``torch.optim`` optimizer of the unwrapped model loads it; the extra key
        ``"phalanx"`` holds the parameter names and the fp32 master weights. Returns
        ``None`` on the other ranks (``rank=None``: the dict on every rank).

        Example::

            full = opt.full_state_dict()
            if px.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": full}, "ckpt.pt")
        """
        mine = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, self.sharded_state_dict())
        shards = [None] * self.world
        if rank is None:
            dist.all_gather_object(shards, mine, group=self.group)
        else:
            if not 0 <= rank < self.world:
                raise ValueError(f"full_state_dict(rank={rank}): must be in [0, {self.world}) or None")
            dst = dist.get_global_rank(self.group, rank) if self.group is not None else rank
            dist.gather_object(mine, shards if self.rank == rank else None, dst=dst, group=self.group)
            if self.rank != rank:
                return None
        return consolidate(shards, self._group_names, self._shapes, FULL_FORMAT)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated dict (from :meth:`full_state_dict`, or a plain ``torch.optim``
        one of the same model, or one keyed by parameter name: ``named_optimizer_state``,
        ``gather_tp_optimizer_state``) on every rank; each rank keeps only what it owns.

        Without ``"phalanx"`` master weights the current parameters stay the masters.
        """
        groups = state_dict.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(i, str) for g in groups for i in g.get("params", [1])):
            groups = by_name_as_groups(groups, self._group_names)
            state_dict = {**state_dict, "param_groups": groups}
        if not isinstance(groups, list) or len(groups) != len(self._group_names):
            raise ValueError(
                f"load_full_state_dict: expected {len(self._group_names)} param_groups, got "
                f"{len(groups) if isinstance(groups, list) else groups!r}; save with full_state_dict()"
            )
        out = full_as_shard_groups(state_dict, self._group_names, self._shapes)
        self.load_sharded_state_dict({"format": FORMAT, "stage": self.stage, "world_size": 1, "rank": 0, "groups": out})


def by_name_as_groups(saved: list[dict], group_names: list[list[str]]) -> list[dict]:
    """``param_groups`` whose ``params`` are names (:func:`phalanx.optim.named_state.named_optimizer_state`,
    any grouping, a superset of the names: a whole model's for a stage) in this optimizer's grouping;
    each group takes the hyperparameters of the saved group that holds its first name."""
    group_of = {n: g for g in saved for n in g["params"]}
    missing = [n for names in group_names for n in names if n not in group_of]
    if missing:
        raise ValueError(f"load_full_state_dict: parameter {missing[0]} (and {len(missing) - 1} more) is not in "
                         "the saved state; save from the same model")
    return [{**{k: v for k, v in (group_of[names[0]] if names else {}).items() if k != "params"}, "params": list(names)}
            for names in group_names]


def full_as_shard_groups(state_dict: dict, group_names: list[list[str]], shapes: dict) -> list[dict]:
    """A consolidated (torch-format) optimizer dict as the ``groups`` of one whole-parameter shard."""
    master = state_dict.get("phalanx", {}).get("master", {})
    out = []
    for g, (names, saved) in enumerate(zip(group_names, state_dict["param_groups"])):
        if len(saved["params"]) != len(names):
            raise ValueError(f"load_full_state_dict: param_groups[{g}] has {len(saved['params'])} parameters, "
                             f"this optimizer {len(names)}")
        pieces, scalars = [], {}
        for name, idx in zip(names, saved["params"]):
            st = state_dict["state"].get(idx, {})
            numel = math.prod(shapes[name])
            flat = {k: v.reshape(-1) for k, v in st.items()
                    if isinstance(v, torch.Tensor) and k != "step" and tuple(v.shape) == shapes[name]}
            scalars.update({k: v for k, v in st.items() if k not in flat})
            m = master.get(name)
            pieces.append({"name": name, "start": 0, "numel": numel, "shape": shapes[name],
                           "master": m.reshape(-1) if m is not None else None, "state": flat})
        out.append({"pieces": pieces, "scalars": scalars,
                    "hparams": {k: v for k, v in saved.items() if k != "params"}})
    return out


def consolidate(shards: list[dict], group_names: list[list[str]], shapes: dict, fmt: str) -> dict:
    """Every rank's sharded dict → one torch-format optimizer state dict with full tensors."""
    state, param_groups, master, index = {}, [], {}, 0
    for g, names in enumerate(group_names):
        full: dict[str, dict[str, torch.Tensor]] = {}
        for s in shards:
            for piece in s["groups"][g]["pieces"]:
                n, sl = piece["name"], slice(piece["start"], piece["start"] + piece["numel"])
                numel = math.prod(shapes[n])
                if n not in master:
                    master[n] = torch.zeros(numel, dtype=piece["master"].dtype)
                    full[n] = {}
                master[n][sl] = piece["master"]
                for k, v in piece["state"].items():
                    if k not in full[n]:
                        full[n][k] = torch.zeros(numel, dtype=v.dtype)
                    full[n][k][sl] = v
        saved = shards[0]["groups"][g]
        ids = []
        for n in names:
            st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved["scalars"].items()}
            st.update({k: v.view(shapes[n]) for k, v in full.get(n, {}).items()})
            if n in full and not full[n]:
                st = {}  # saved stateless (a tied copy: its state is under its first holder's name)
            if st:
                state[index] = st
            master[n] = master[n].view(shapes[n])
            ids.append(index)
            index += 1
        param_groups.append({**saved["hparams"], "params": ids})
    return {"state": state, "param_groups": param_groups,
            "phalanx": {"format": fmt, "names": group_names, "master": master}}


def _check_same_parameters(index: dict[str, list[dict]], units, group: int, elsewhere: set[str]) -> None:
    """Refuse, in one line, a checkpoint that lacks one of this optimizer's parameters or saved it
    with another shape (another model's shards would otherwise load silently, misaligned). A tied
    copy stepped on another stage (``elsewhere``) may be absent: its first holder sends its values."""
    for u in units:
        for name, shape in zip(u.names, u.shapes):
            pieces = index.get(name)
            if not pieces and name in elsewhere:
                continue
            if not pieces:
                raise ValueError(
                    f"load_sharded_state_dict: parameter {name!r} (param group {group}) is not in the "
                    f"checkpoint, which holds {len(index)} other(s) (e.g. {sorted(index)[:3]}); load the shards "
                    f"saved from this model (and this pipeline stage)"
                )
            saved = tuple(pieces[0]["shape"])
            if saved != tuple(shape):
                raise ValueError(
                    f"load_sharded_state_dict: parameter {name!r} was saved with shape {list(saved)} but is "
                    f"{list(shape)} here; the checkpoint is of another model configuration"
                )

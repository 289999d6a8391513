"""Expert-sharded model state that loads at another ep degree.

Expert j of a layer is ``{path}.experts.{j}.{name}`` in the model, but on an
expert-parallel rank it sits at local index ``j − expert_offset``. A checkpoint
piece that used those names would tie the files to one ep degree. Here every
expert weight of a layer is one stacked tensor ``{path}.experts.*.{name}`` of
shape ``(E, *weight)``, saved as a :class:`phalanx.checkpoint.Shard` (this rank's
experts, at row ``expert_offset``); the checkpoint reader fills a Shard with any
other offsets from whichever files hold those rows, which is all resharding takes.
Dense weights are plain tensors (equal on every rank, written once).

It lives with the checkpoint code (a service, which may know the strategies; the expert
package may not import the checkpoint code).

Example::

    state = {"model": ExpertCheckpoint(model, opt), "dense_optim": opt.dense, "step": step}
    ckpt.save(path, state)                 # at ep = 4
    ckpt.load(path, state)                 # at ep = 2 (or 1): each rank reads its experts' rows

``optimizer`` (the :class:`~phalanx.parallel.expert.data.ExpertOptimizer`): the experts'
optimizer state is stacked the same way (``optim.{stacked name}.{state key}``), so it
reshards too; it loads into a fresh optimizer (a resumed job) as well as into one that has stepped.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.checkpoint._tree import Shard
from phalanx.parallel.expert import ExpertOptimizer, moe_layers

__all__ = ["ExpertCheckpoint"]


class ExpertCheckpoint:
    """A checkpoint piece (``state_dict`` / ``load_state_dict``) for an expert-parallel model."""

    def __init__(self, model: nn.Module, optimizer: ExpertOptimizer | None = None) -> None:
        if optimizer is not None and not isinstance(optimizer, ExpertOptimizer):
            raise TypeError(f"ExpertCheckpoint: optimizer must be expert_parallel's ExpertOptimizer, got "
                            f"{type(optimizer).__name__}; save a plain optimizer as its own piece")
        self.model = model
        self.inner = optimizer.experts.optimizer if optimizer is not None else None

    def _stacks(self):
        """``stacked name -> (E, offset, [local parameters in order])`` for every expert weight."""
        out = {}
        for path, moe in moe_layers(self.model):
            prefix = f"{path}.experts.*." if path else "experts.*."
            for name, _ in moe.experts[0].named_parameters() if len(moe.experts) else ():
                params = [e.get_parameter(name) for e in moe.experts]
                out[prefix + name] = (moe.num_experts, moe.expert_offset, params)
        return out

    def _expert_keys(self, stacks) -> set[str]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)] for _, _, ps in stacks.values() for p in ps}

    def state_dict(self) -> dict:
        stacks = self._stacks()
        model = {k: v for k, v in self.model.state_dict().items() if k not in self._expert_keys(stacks)}
        optim = {}
        for key, (num, offset, params) in stacks.items():
            local = torch.stack([p.detach() for p in params])
            model[key] = Shard(local, (num,) + tuple(local.shape[1:]), (offset,) + (0,) * (local.dim() - 1))
            state = self.inner.state.get(params[0], {}) if self.inner is not None else {}
            for skey, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == params[0].shape:
                    rows = torch.stack([self.inner.state[p][skey] for p in params])
                    optim[f"{key}.{skey}"] = Shard(rows, (num,) + tuple(rows.shape[1:]),
                                                   (offset,) + (0,) * (rows.dim() - 1))
                else:  # a step count: the same for every expert
                    optim[f"{key}.{skey}"] = value
        return {"model": model, "optim": optim}

    def load_state_dict(self, tree: dict) -> None:
        stacks = self._stacks()
        model = dict(tree["model"])
        with torch.no_grad():
            for key, (_, _, params) in stacks.items():
                shard = model.pop(key)
                for p, row in zip(params, shard.tensor):
                    p.copy_(row)
        missing = [k for k in self.model.state_dict() if k not in model and k not in self._expert_keys(stacks)]
        if missing:
            raise KeyError(f"ExpertCheckpoint: the checkpoint has no {missing[0]!r}; load one saved from this model")
        self.model.load_state_dict(model, strict=False)
        if self.inner is None:
            return
        for key, (num, offset, params) in stacks.items():
            for okey, value in tree.get("optim", {}).items():
                if not okey.startswith(key + "."):
                    continue
                skey = okey[len(key) + 1:]
                rows = value.tensor if isinstance(value, Shard) else None
                if rows is None and isinstance(value, torch.Tensor) and value.shape == (num,) + params[0].shape:
                    # a fresh optimizer (a resumed job) has no slot to template a Shard: the whole stack was read
                    rows = value[offset:offset + len(params)]
                for j, p in enumerate(params):
                    slot = self.inner.state.setdefault(p, {})
                    if rows is not None:
                        slot[skey] = rows[j].clone()
                    else:  # a step count: each expert its own (Adam adds 1 in place: one shared tensor counted E times)
                        slot[skey] = value.clone() if isinstance(value, torch.Tensor) else value

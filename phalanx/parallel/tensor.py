"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053).

A linear layer's weight is cut across the ``tp`` ranks of a group. An MLP pairs
a column-parallel layer (output features cut) with a row-parallel one (input
features cut), so only one all-reduce per direction is needed::

          x (replicated)
          │ f: identity fwd / all-reduce bwd
      ┌───┴─────────┐
    X·A₁  …  X·A_tp        ColumnParallelLinear  (A cut by columns = out features)
      │ GeLU  …  │         (local, no communication)
    Y₁·B₁ …  Y_tp·B_tp     RowParallelLinear     (B cut by rows = in features)
      └───┬─────────┘
          │ g: all-reduce fwd / identity bwd
          z (replicated)

The embedding is cut by vocabulary rows (each rank looks up the ids it owns,
zeros the rest, then ``g``), and the loss over vocabulary-sharded logits is
computed without gathering them (:func:`vocab_parallel_cross_entropy`).

``apply_tensor_parallel(model, plan, group)`` swaps sub-modules for their
parallel forms from a plain dict, so model code stays untouched; attention must
infer its local head count (``view(B, T, -1, head_dim)``).

Example::

    plan = {"mlp.fc": "colwise", "mlp.proj": "rowwise", "embed.tok": "vocab"}
    apply_tensor_parallel(model, plan, group=mesh.tp_group)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "apply_tensor_parallel",
    "gather_tp_state_dict",
    "gather_tp_optimizer_state",
    "TP_STYLES",
]


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class _CopyToTP(torch.autograd.Function):
    """Megatron's **f** operator: identity in forward, all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _size(ctx.group) > 1:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's **g** operator: all-reduce (sum) in forward, identity of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        if _size(group) == 1:
            return x.view_as(x)
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward, all-reduce backward (enter a tensor-parallel region)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """g: all-reduce forward, identity backward (leave a tensor-parallel region)."""
    return _ReduceFromTP.apply(x, group)


def _shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = _size(group), _rank(group)
    if full.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not divide by the tensor-parallel "
                         f"size {n}; pick tp dividing it")
    return full.chunk(n, dim=dim)[r].detach().clone()


def _shard_parts(full: torch.Tensor, dim: int, parts: int, group) -> torch.Tensor:
    """A fused tensor of ``parts`` equal pieces along ``dim`` (GPT-2's [q | k | v]): each piece cut, the cuts joined."""
    if parts == 1:
        return _shard(full, dim, group)
    return torch.cat([_shard(piece, dim, group) for piece in full.chunk(parts, dim=dim)], dim=dim)


def _param(t: torch.Tensor, tp_dim: int | None, parts: int = 1) -> nn.Parameter:
    p = nn.Parameter(t)
    p.tp_dim = tp_dim  # the dimension cut across the group; None = replicated
    p.tp_parts = parts  # fused pieces along tp_dim, each cut separately (gather_tp_state_dict reassembles)
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x Aᵀ + b`` with A's output rows (and b) cut across the group; output stays sharded.

    ``from_linear(linear, group)`` takes this rank's slice of an existing layer.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, parts: int = 1) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(_shard_parts(weight, 0, parts, group), 0, parts)
        self.bias = _param(_shard_parts(bias, 0, parts, group), 0, parts) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module, group, parts: int = 1) -> ColumnParallelLinear:
        """``parts=3``: a fused q/k/v projection, each of the three cut by heads."""
        return cls(*_linear_weights(linear, "colwise"), group, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = g(x_local A_localᵀ) + b`` with A's input columns cut; input is sharded, output replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(_shard(weight, 1, group), 1)
        self.bias = _param(bias.detach().clone(), None) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module, group) -> RowParallelLinear:
        return cls(*_linear_weights(linear, "rowwise"), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are cut across the group; output replicated (via g)."""

    def __init__(self, weight: torch.Tensor, group, padding_idx: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(_shard(weight, 0, group), 0)
        self.vocab_start = _rank(group) * self.weight.shape[0]
        # the padding row (HF Llama's pad token) gets no gradient, on the rank that holds it
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.weight.shape[0] else None

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group) -> VocabParallelEmbedding:
        return cls(emb.weight.data, group, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        vocab_local = logits.shape[-1]
        start = _rank(group) * vocab_local
        logits_max = logits.max(dim=-1).values
        if _size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_t = target - start
        outside = (local_t < 0) | (local_t >= vocab_local)
        local_t = local_t.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if _size(group) > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = F.one_hot(local_t, grad.shape[-1]).to(grad.dtype) * (~outside).unsqueeze(-1).to(grad.dtype)
        grad -= onehot
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy over logits whose last (vocabulary) dim is cut across ``group``.

    Never gathers the logits: it all-reduces the row max, the sum of exponentials
    and the target's logit. With a group of one it equals ``F.cross_entropy``.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat.float(), target.reshape(-1), group).mean()


def _linear_weights(m: nn.Module, style: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias)`` of an ``nn.Linear``, or of HF GPT-2's ``Conv1D`` (a linear layer
    storing its weight as [in, out]; its parallel form is a linear layer, weight transposed)."""
    if isinstance(m, nn.Linear):
        return m.weight.data, None if m.bias is None else m.bias.data
    if type(m).__name__ == "Conv1D" and getattr(m, "nf", None) == m.weight.shape[1]:
        return m.weight.data.t(), None if m.bias is None else m.bias.data
    raise TypeError(f"style {style!r} applies to nn.Linear (or HF's Conv1D), got {type(m).__name__}")


def _colwise(m: nn.Module, group) -> nn.Module:
    return ColumnParallelLinear.from_linear(m, group)


def _colwise_qkv(m: nn.Module, group) -> nn.Module:
    return ColumnParallelLinear.from_linear(m, group, parts=3)


def _rowwise(m: nn.Module, group) -> nn.Module:
    return RowParallelLinear.from_linear(m, group)


def _vocab(m: nn.Module, group) -> nn.Module:
    _expect(m, nn.Embedding, "vocab")
    return VocabParallelEmbedding.from_embedding(m, group)


def _expect(m: nn.Module, kind: type, style: str) -> None:
    if not isinstance(m, kind):
        raise TypeError(f"style {style!r} applies to nn.{kind.__name__}, got {type(m).__name__}")


TP_STYLES = {"colwise": _colwise, "colwise_qkv": _colwise_qkv, "rowwise": _rowwise, "vocab": _vocab}


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], group) -> nn.Module:
    """Replace each sub-module named in ``plan`` by its tensor-parallel form, in place.

    ``plan`` maps a sub-module name (as in ``model.named_modules()``) to
    "colwise", "colwise_qkv" (a fused [q | k | v] projection), "rowwise" or "vocab". Every rank of ``group`` must start from the
    same full weights; each keeps its own slice. Returns ``model``.
    """
    for name, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"plan[{name!r}] = {style!r}: styles are {sorted(TP_STYLES)}")
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            child = getattr(parent, leaf)
        except AttributeError:
            raise ValueError(f"plan names {name!r}, which is not a sub-module of {type(model).__name__} (its names: "
                             "[n for n, _ in model.named_modules()]; the family's own plan: "
                             "phalanx.parallel.plans.tp_plan(model))") from None
        try:
            setattr(parent, leaf, TP_STYLES[style](child, group))
        except TypeError as err:  # a block or attention module named instead of one of its linear layers
            raise TypeError(f"plan[{name!r}] = {style!r}: {err}; name the layers inside it") from None
    return model


def gather_tp_state_dict(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters: each sharded one is all-gathered along its ``tp_dim``.

    Values come from ``model.state_dict()``, so a wrapper that keeps parameters
    elsewhere (ZeRO-3 frees them between uses) materialises them first.
    """
    values = model.state_dict()
    out = {}
    for name, p in model.named_parameters():
        value = values[name].detach()
        if value.numel() and value.untyped_storage().nbytes() < value.numel() * value.element_size():
            raise ValueError(f"gather_tp_state_dict: {name} has no storage here (ZeRO-3 frees parameters between "
                             f"uses): pass the module px.zero wrapped, whose state_dict() gathers them")
        out[name] = _gather(value, p, group)
    return out


def _gather(value: torch.Tensor, p: nn.Parameter, group) -> torch.Tensor:
    """``value`` (shaped like this rank's slice of ``p``) of every rank of ``group``, joined along ``p.tp_dim``."""
    dim = getattr(p, "tp_dim", None)
    if dim is None or _size(group) == 1:
        return value.clone()
    per_rank = [torch.empty_like(value) for _ in range(_size(group))]
    dist.all_gather(per_rank, value.contiguous(), group=group)
    k = getattr(p, "tp_parts", 1)  # fused pieces: piece j of the full tensor = piece j of every rank, joined
    pieces = [torch.cat([t.chunk(k, dim=dim)[j] for t in per_rank], dim=dim) for j in range(k)]
    return torch.cat(pieces, dim=dim)


def gather_tp_optimizer_state(model: nn.Module, optimizer, group) -> dict:
    """The optimizer's state for the full parameters, keyed by name: each per-element tensor
    (Adam's ``exp_avg``, ``exp_avg_sq``) gathered along its parameter's ``tp_dim`` as
    :func:`gather_tp_state_dict` gathers the parameter; scalars (``step``) as they are.

    ``optimizer``: a ``torch.optim`` one over ``model``'s parameters, ``Adam8bit`` (moments as fp32)
    or a ZeRO optimizer of ``model`` (consolidated over its dp group first; pass the module
    ``px.zero`` wrapped). Collective over ``group`` (and ZeRO's group). The result is
    :func:`phalanx.optim.named_state.named_optimizer_state`'s format: load it with
    ``load_named_optimizer_state`` at world 1, under ZeRO at any dp size, or into a pipeline stage.
    HF GPT-2's ``Conv1D`` moments come back as a linear layer's, like its weights (``.t()`` them).

    Example::

        params, moments = gather_tp_state_dict(model, tp_group), gather_tp_optimizer_state(model, opt, tp_group)
        plain.load_state_dict(params, strict=False)
        load_named_optimizer_state(torch.optim.AdamW(plain.parameters()), moments, plain.named_parameters())
    """
    from phalanx.optim.named_state import named_optimizer_state

    local = named_optimizer_state(optimizer, model.named_parameters())
    state = {}
    for name, p in model.named_parameters():  # the same order on every rank of the group
        st = local["state"].get(name, {})
        state[name] = {k: (_gather(v.detach(), p, group) if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim()
                           else v) for k, v in st.items()}
    return {"state": {n: st for n, st in state.items() if st}, "param_groups": local["param_groups"]}

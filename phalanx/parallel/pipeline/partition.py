"""Split a stack of blocks into pipeline stages with the slowest stage as fast as possible.

A pipeline runs at the pace of its slowest stage, so the split minimises the
*bottleneck* (the largest per-stage cost), not the sum. Three cost models:

    uniform      every block costs 1 (same block count per stage, ±1)
    parameters   a block costs its parameter count
    time         a block costs its measured forward+backward seconds on a sample batch
    flops        a block costs its forward FLOPs on a sample batch (torch's FlopCounterMode)

The measured costs are those each block has inside the pipeline: the first block
gets ``sample`` as it is (a model input needs no gradient, so its backward skips
one matrix product per input layer), the others an input that requires a
gradient (the activation a stage receives), and with ``loss_fn`` and ``target``
the last block's cost includes the loss the last stage computes.

Given the costs, :func:`min_bottleneck_split` finds an exactly optimal contiguous
split by dynamic programming over prefix sums (O(n² p), n blocks, p stages; n is
a few hundred at most). The imbalance is reported as the standard deviation of
the per-stage costs (the seed's "load std-dev").

Example::

    from phalanx.parallel.pipeline import partition
    plan = partition(model, 4, method="parameters")     # model: nn.Sequential
    print(plan.stage_costs, plan.bottleneck, plan.std)
    my_stage = plan.split(model)[stage_index]
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from phalanx.parallel.pipeline.by_path import find_blocks, path_costs

__all__ = ["Partition", "block_costs", "min_bottleneck_split", "partition", "uniform_split"]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Stage ``s`` holds blocks ``bounds[s]:bounds[s+1]``."""

    bounds: tuple[int, ...]
    block_costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def stage_costs(self) -> list[float]:
        return [sum(self.block_costs[a:b]) for a, b in zip(self.bounds, self.bounds[1:])]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    @property
    def std(self) -> float:
        """Population standard deviation of the stage costs: 0 is a perfect balance."""
        return statistics.pstdev(self.stage_costs)

    def boundaries(self, model: nn.Module) -> list[str]:
        """The first block of every stage but the first, by module path (for :func:`split_by_path`)."""
        blocks = find_blocks(model)[1]
        if len(blocks) != len(self.block_costs):
            raise ValueError(f"partition was made for {len(self.block_costs)} blocks, the model has {len(blocks)}")
        return [blocks[b] for b in self.bounds[1:-1]]

    def split(self, blocks: nn.Sequential | Sequence[nn.Module]) -> list[nn.Sequential]:
        """One ``nn.Sequential`` per stage; children keep their names from an ``nn.Sequential``."""
        named = list(blocks.named_children()) if isinstance(blocks, nn.Sequential) else [
            (str(i), b) for i, b in enumerate(blocks)
        ]
        if len(named) != len(self.block_costs):
            raise ValueError(f"partition was made for {len(self.block_costs)} blocks, got {len(named)}")
        return [nn.Sequential(OrderedDict(named[a:b])) for a, b in zip(self.bounds, self.bounds[1:])]


def _check(n: int, p: int) -> None:
    if p < 1:
        raise ValueError(f"num_stages must be >= 1, got {p}")
    if n < p:
        raise ValueError(f"cannot split {n} blocks into {p} stages: each stage needs at least one block; "
                         "use fewer stages or split the model into more blocks")


def uniform_split(n: int, p: int) -> tuple[int, ...]:
    """Bounds giving each stage n//p blocks, the first n%p stages one more."""
    _check(n, p)
    bounds, at = [0], 0
    for s in range(p):
        at += n // p + (1 if s < n % p else 0)
        bounds.append(at)
    return tuple(bounds)


def min_bottleneck_split(costs: Sequence[float], p: int) -> tuple[int, ...]:
    """Exact contiguous split of ``costs`` into ``p`` non-empty parts minimising the largest sum.

    ``best[k][i]`` is the smallest bottleneck for the first ``i`` blocks in ``k`` stages:
    ``best[k][i] = min_j max(best[k-1][j], sum(costs[j:i]))``. Ties go to the earliest cut.

    >>> min_bottleneck_split([1, 1, 1, 9, 1, 1], 3)
    (0, 3, 4, 6)
    """
    n = len(costs)
    _check(n, p)
    if any(c < 0 for c in costs):
        raise ValueError("block costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, n - (p - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(p, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return tuple(reversed(bounds))


def _blocks(model) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        return list(model.children())
    if isinstance(model, (list, tuple, nn.ModuleList)):
        return list(model)
    raise TypeError(f"partition needs an nn.Sequential or a list of blocks, got {type(model).__name__}")


def block_costs(model, method: str = "parameters", sample: torch.Tensor | None = None,
                repeats: int = 5, *, loss_fn=None, target: torch.Tensor | None = None,
                rounds: int = 3) -> list[float]:
    """Cost of each block under ``method`` ("uniform", "parameters", "time" or "flops").

    With ``loss_fn(output, target)`` ("time" and "flops"), the last block's cost
    includes the loss, as the last pipeline stage computes it. ``"time"`` times
    forward + backward of each block ``repeats`` times in each of ``rounds`` passes
    over the whole model and keeps each block's median over the rounds: blocks timed
    one after another in a single pass share any burst of load on the machine, which
    then skews a contiguous run of them and so the split (a benchmark run cut stages
    20 % apart that way; three rounds gave the balanced cut in every later run).
    """
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} and rounds={rounds!r} must be positive integers")
    if method == "time" and rounds > 1:
        per_round = [block_costs(model, method, sample, repeats, loss_fn=loss_fn, target=target, rounds=1)
                     for _ in range(rounds)]
        return [statistics.median(costs) for costs in zip(*per_round)]
    if isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        return path_costs(model, method)  # a transformer's stack of blocks, split by module path
    blocks = _blocks(model)
    if (loss_fn is None) != (target is None):
        raise ValueError("pass loss_fn and target together (the loss is costed on the last block's output), "
                         "or neither")
    if method == "uniform":
        return [1.0] * len(blocks)
    if method == "parameters":
        return [float(sum(p.numel() for p in b.parameters())) for b in blocks]
    if method not in ("time", "flops"):
        raise ValueError(f"method={method!r}: use 'uniform', 'parameters', 'time' or 'flops'")
    if sample is None:
        raise ValueError(f"method={method!r} measures each block on a batch: pass sample=<a model input>")
    costs, x = [], sample
    for k, b in enumerate(blocks):
        # The first block sees the model input as given (no gradient wanted, as on the first stage);
        # the others an activation that wants one (what a later stage receives).
        x_in = x if k == 0 else x.detach().requires_grad_(x.is_floating_point())
        with_loss = loss_fn is not None and k == len(blocks) - 1
        if method == "flops":
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                y = b(x_in)
                if with_loss:
                    loss_fn(y, target)
            costs.append(float(counter.get_total_flops()))
        else:
            times = []
            for _ in range(repeats + 1):  # the first call warms the allocator and kernels; dropped below
                t0 = time.perf_counter()
                y = b(x_in)
                out = loss_fn(y, target) if with_loss else y
                if out.requires_grad:
                    out.backward(None if with_loss else torch.ones_like(out))
                times.append(time.perf_counter() - t0)
            b.zero_grad(set_to_none=True)
            costs.append(statistics.median(times[1:]))
        x = y.detach()
    return costs


def partition(model, num_stages: int, method: str = "parameters", sample: torch.Tensor | None = None, *,
              loss_fn=None, target: torch.Tensor | None = None, repeats: int = 5, rounds: int = 3) -> Partition:
    """Split ``model`` (an ``nn.Sequential``, a list of blocks, or a model whose blocks sit in an
    ``nn.ModuleList`` / ``nn.ModuleDict``: see :func:`split_by_path`) into ``num_stages`` balanced stages.

    ``uniform`` splits by block count; the other methods use the exact
    min-bottleneck split of their costs. ``loss_fn`` and ``target`` (a target
    batch matching ``sample``) add the loss to the last block's cost. ``repeats``
    and ``rounds``: how ``"time"`` measures (:func:`block_costs`).
    """
    costs = block_costs(model, method, sample, repeats, loss_fn=loss_fn, target=target, rounds=rounds)
    if method == "uniform":
        bounds = uniform_split(len(costs), num_stages)
    else:
        bounds = min_bottleneck_split(costs, num_stages)
    return Partition(bounds, tuple(costs))

"""All-to-all dispatch of routed tokens to the ranks that own their experts, and back.

GShard (Lepikhin et al. 2020, arXiv:2006.16668) and Switch Transformer
(Fedus et al. 2021, arXiv:2101.03961): E experts over the ep ranks of a group,
E/ep consecutive experts a rank (rank r owns r·E/ep … (r+1)·E/ep − 1). One MoE
forward on rank r, with its rows already sorted by global expert::

    counts_E ──all-to-all (E/ep ints to each rank)──▶ recv_counts[src, j]   (host sync: the splits)
    x_MD  ──all-to-all, splits = rows for each rank's experts──▶ x_recv   (by source, then local expert)
          regroup by local expert (stable) ─▶ expert j on its rows ─▶ back to (source, expert) order
    y_recv ──all-to-all, the splits reversed──▶ y_MD   (in x_MD's order)

Backward is the same path reversed: each all-to-all's gradient is the
all-to-all with send and receive splits swapped (:class:`AllToAll`), and the
regrouping's gradient is its inverse permutation (autograd's indexing). The
split sizes vary from step to step (they are what the router chose), so
every forward exchanges the counts first; that exchange is the only host sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.models.moe import run_experts

__all__ = ["AllToAll", "all_to_all", "AllToAllDispatch"]


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with variable splits; backward is the transposed exchange."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, recv_splits, send_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows ``send_splits[i]`` of ``x`` (in order) to rank i of ``group``; ``recv_splits[i]`` rows come
    back from rank i. Differentiable: the gradient travels the same way back."""
    return AllToAll.apply(x, list(send_splits), list(recv_splits), group)


class AllToAllDispatch:
    """The MoE layer's dispatcher under expert parallelism (``MoE.dispatcher``).

    ``group``: the ep group; this rank holds experts ``index·E/ep …`` of the
    layer (``MoE.experts`` holds only those). ``last_splits`` keeps the last
    forward's (send, receive) rows per rank, for tests and the benchmark.
    """

    def __init__(self, group, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.local = num_experts // self.ep
        self.last_splits: tuple[list[int], list[int]] | None = None

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
        ep, local = self.ep, self.local
        # 1. How many rows each source sends each of my experts (E/ep counts to every rank).
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E.contiguous(), group=self.group)
        send_EL, recv_SL = counts_E.view(ep, local), recv_counts.view(ep, local)
        send_splits, recv_splits = send_EL.sum(1).tolist(), recv_SL.sum(1).tolist()
        self.last_splits = (send_splits, recv_splits)
        # 2. Rows out to their experts' ranks.
        x_recv = all_to_all(x_MD, send_splits, recv_splits, self.group)
        # 3. (source, expert) order -> expert order, every expert on its rows, and back.
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x_MD.device).repeat(ep),
                                                recv_SL.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        y_grouped = run_experts(x_recv[perm], recv_SL.sum(0).tolist(), experts)
        y_recv = y_grouped[torch.argsort(perm)]
        # 4. Outputs home, in x_MD's order.
        return all_to_all(y_recv, recv_splits, send_splits, self.group)

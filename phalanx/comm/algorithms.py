"""Allreduce algorithms: ring on point-to-point ops, and hierarchical on the topology's groups.

Ring allreduce (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 2009; popularised for deep learning by Baidu and
Horovod). The buffer is cut into N chunks; in N-1 reduce-scatter steps every rank
sends one chunk to its right neighbour and adds the chunk it receives from the
left, then N-1 allgather steps pass the finished chunks around::

    step     rank0      rank1      rank2          (N = 3, chunk c moves right)
    rs 0     send c0 -> recv c0+=  send c1 -> ...
    rs 1     ...                                  after N-1 steps rank r owns chunk r+1
    ag 0..   send owned chunk right, overwrite the one received

Each rank sends 2(N-1)/N * S bytes, the bound for any allreduce.

Hierarchical allreduce (as in Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE and NCCL's
tree/ring split): the fast links inside a host carry most of the bytes, and each
of the L ranks on a host sends only 1/L of the buffer across hosts::

    host A: r0 r1        host B: r2 r3
      1. reduce-scatter inside each host   r0:[s0]  r1:[s1]   r2:[s0]  r3:[s1]
      2. allreduce shard i across hosts    r0<->r2 on s0,     r1<->r3 on s1
      3. allgather inside each host        every rank: [s0 s1] = full sum

Per host link and direction: 2(H-1)/H * S bytes for H hosts; a flat ring over all
N = H*L ranks sends 2(N-1)/N * S over each ring edge that crosses a host boundary.

Example::

    import torch, phalanx as px
    from phalanx.comm.algorithms import allreduce
    topo = px.init()
    g = torch.ones(1000)
    allreduce(g, algorithm="auto", topology=topo, op=px.Average)   # in place
    h = allreduce(g, "ring", topology=topo, async_op=True); h.wait()
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading

import torch
import torch.distributed as dist

from phalanx.comm.collectives import Average, ReduceOp, Sum, all_gather_flat, reduce_scatter_flat

__all__ = ["allreduce", "choose_algorithm", "ALGORITHMS", "HIERARCHICAL_MIN_BYTES", "AlgorithmHandle"]

ALGORITHMS = ("auto", "ring", "hierarchical", "flat")

HIERARCHICAL_MIN_BYTES = 256 * 1024
"""Below this size the three extra steps of hierarchical cost more than they save (latency-bound)."""

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
_COMBINE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVERAGE: torch.Tensor.add_,
    ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
    ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    ReduceOp.PRODUCT: torch.Tensor.mul_,
}


class AlgorithmHandle:
    """Pending result of ``allreduce(..., async_op=True)``; same interface as collectives.Handle."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self):
        return self._future.result()


# One helper thread per process: algorithms issued asynchronously run in issue order,
# so every rank performs its point-to-point steps in the same order (no cross-talk).
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _submit(fn, *args) -> AlgorithmHandle:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="phalanx-allreduce")
        return AlgorithmHandle(_executor.submit(fn, *args))


def _is_world(group) -> bool:
    return group is None or group is dist.group.WORLD or dist.get_world_size(group) == dist.get_world_size()


def choose_algorithm(nbytes: int, topology, group=None) -> str:
    """What ``algorithm="auto"`` runs for a message of ``nbytes`` on this topology and group.

    One host, a sub-group, uneven hosts or a small message: the backend's own
    allreduce ("flat"). Several hosts with several ranks each and a large message:
    "hierarchical".
    """
    multi_level = topology.cross_size > 1 and topology.local_size > 1 and topology.is_homogeneous
    if multi_level and _is_world(group) and nbytes >= HIERARCHICAL_MIN_BYTES:
        return "hierarchical"
    return "flat"


def allreduce(
    tensor: torch.Tensor,
    algorithm: str = "auto",
    *,
    topology,
    group=None,
    op: ReduceOp = Sum,
    async_op: bool = False,
):
    """Reduce ``tensor`` in place across ``group`` with the named algorithm; return it (or a handle).

    Args:
        tensor: any dtype the backend reduces (float32/16, bfloat16, float64, integers).
        algorithm: "auto" (see :func:`choose_algorithm`), "ring", "hierarchical" or "flat".
        topology: the :class:`phalanx.runtime.Topology` from ``phalanx.init()``.
        group: the ranks to reduce over (default: the world). "hierarchical" needs the world.
        op: Sum, Average, Min, Max or Product.
        async_op: return an :class:`AlgorithmHandle` with ``wait()`` / ``is_completed()``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    op = ReduceOp(op)
    n = dist.get_world_size(group)
    if n == 1:
        return _submit(lambda: tensor) if async_op else tensor
    if algorithm == "auto":
        algorithm = choose_algorithm(tensor.numel() * tensor.element_size(), topology, group)
    if algorithm == "hierarchical":
        if not _is_world(group):
            raise ValueError("algorithm='hierarchical' reduces over the whole world: pass group=None "
                             "or use algorithm='ring' / 'flat' for a sub-group")
        if not topology.is_homogeneous:
            raise ValueError(f"algorithm='hierarchical' needs the same ranks on every host; hosts are "
                             f"{[len(h) for h in topology.hosts]}; use 'ring' or 'flat'")
    if algorithm == "flat":
        work = dist.all_reduce(tensor, op=_TORCH_OP[op], group=group, async_op=True)
        if async_op:
            return _submit(lambda: (work.wait(), _finish(tensor, op, n))[1])
        work.wait()
        return _finish(tensor, op, n)
    body = _ring if algorithm == "ring" else _hierarchical
    timeout = datetime.timedelta(seconds=topology.timeout_s)

    def run():
        return _finish(_in_place(tensor, lambda flat: body(flat, op, group, topology, timeout)), op, n)

    return _submit(run) if async_op else run()


def _finish(tensor: torch.Tensor, op: ReduceOp, n: int) -> torch.Tensor:
    if op is Average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(n)
        else:
            tensor.floor_divide_(n)
    return tensor


def _in_place(tensor: torch.Tensor, body) -> torch.Tensor:
    """Run ``body`` on a flat contiguous view of ``tensor`` (a copy when it is not contiguous)."""
    if tensor.is_contiguous():
        body(tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1)
        body(flat)
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, numel) into ``parts`` ranges whose sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _ring(flat: torch.Tensor, op: ReduceOp, group, topology, timeout) -> None:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    n, me = len(ranks), dist.get_rank(group)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    chunks = [flat[a:b] for a, b in _bounds(flat.numel(), n)]
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype, device=flat.device)
    combine = _COMBINE[op]

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        # Post the receive first; isend/irecv on distinct peers cannot deadlock.
        works = [dist.irecv(recv, src=left, group=group), dist.isend(send.contiguous(), dst=right, group=group)]
        for w in works:
            w.wait(timeout)

    for step in range(n - 1):  # reduce-scatter: after it rank me owns chunk (me+1) % n
        send_i, recv_i = (me - step) % n, (me - step - 1) % n
        buf = scratch[: chunks[recv_i].numel()]
        exchange(chunks[send_i], buf)
        combine(chunks[recv_i], buf)
    for step in range(n - 1):  # allgather: pass finished chunks to the right
        send_i, recv_i = (me + 1 - step) % n, (me - step) % n
        buf = scratch[: chunks[recv_i].numel()]
        exchange(chunks[send_i], buf)
        chunks[recv_i].copy_(buf)


def _hierarchical(flat: torch.Tensor, op: ReduceOp, group, topology, timeout) -> None:
    local, cross = topology.local_group(), topology.cross_group()
    lsize = topology.local_size
    shard = -(-flat.numel() // lsize)  # ceil: pad so the intra-host collectives split evenly
    padded = flat.new_zeros(shard * lsize) if shard * lsize != flat.numel() else flat
    if padded is not flat:
        padded[: flat.numel()].copy_(flat)
        if op is ReduceOp.PRODUCT:
            padded[flat.numel():].fill_(1)
    mine = torch.empty(shard, dtype=flat.dtype, device=flat.device)
    # Backend reduce-scatter knows SUM for every dtype; MIN/MAX/PRODUCT keep their own op.
    reduce_scatter_flat(mine, padded, op=_TORCH_OP[op], group=local)
    if topology.cross_size > 1:
        dist.all_reduce(mine, op=_TORCH_OP[op], group=cross)
    all_gather_flat(padded, mine, group=local)
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])

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
N = H*L ranks sends 2(N-1)/N * S over each ring edge that crosses a host boundary
(2 hosts x 2 ranks: S against 1.5 S, so hierarchical can be at most 1.5x faster).

The three steps are pipelined over chunks of :data:`PIPELINE_CHUNK_BYTES` so the
inter-host link stays busy while the intra-host steps of neighbouring chunks run.
The intra-host steps are our own point-to-point exchanges: gloo's
reduce_scatter_tensor took 670 ms for 64 MB on two local ranks, three times its own
full allreduce of the same buffer (212 ms), and unpipelined steps left the link idle
for most of the call (measured: ``benchmarks/allreduce_cluster.py --phases``).

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

from phalanx.comm.collectives import Average, ReduceOp, Sum
from phalanx.runtime.backends import engine
from phalanx.settings import ALGORITHMS  # one list: PHALANX_ALGORITHM is checked against it at init

__all__ = ["allreduce", "choose_algorithm", "ALGORITHMS", "HIERARCHICAL_MIN_BYTES", "PIPELINE_CHUNK_BYTES",
           "AlgorithmHandle"]


HIERARCHICAL_MIN_BYTES = 256 * 1024
"""Below this size the three extra steps of hierarchical cost more than they save (latency-bound)."""

PIPELINE_CHUNK_BYTES = 2 << 20
"""Hierarchical pipelines chunks of this size: small enough that the first inter-host
transfer starts early and the last intra-host allgather is short, large enough that
the per-message latency stays small next to the transfer (2 MiB at 1 Gbit/s is ~17 ms).
Measured on the simulated cluster (2 hosts x 2 ranks, 1 Gbit/s, 64 MB): 1 and 2 MiB
within 2% of each other, 4 MiB 5-15% slower (longer pipeline fill and drain)."""

_PIPELINE_DEPTH = 3
"""Chunks in each stage at once: reduce-scatters posted ahead, cross allreduces queued."""

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
    chunk_bytes: int | None = None,
):
    """Reduce ``tensor`` in place across ``group`` with the named algorithm; return it (or a handle).

    Args:
        tensor: any dtype the backend reduces (float32/16, bfloat16, float64, integers).
        algorithm: "auto" (see :func:`choose_algorithm`), "ring", "hierarchical" or "flat".
        topology: the :class:`phalanx.runtime.Topology` from ``phalanx.init()``.
        group: the ranks to reduce over (default: the world). "hierarchical" needs the world.
        op: Sum, Average, Min, Max or Product.
        async_op: return an :class:`AlgorithmHandle` with ``wait()`` / ``is_completed()``.
        chunk_bytes: pipeline chunk of "hierarchical" (default :data:`PIPELINE_CHUNK_BYTES`).
    """
    chunk_bytes = PIPELINE_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
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
        topology.local_group()  # made here, on the caller's thread, in program order (not on the helper)
    if algorithm == "flat":
        work = dist.all_reduce(tensor, op=_TORCH_OP[op], group=group, async_op=True)
        if async_op:
            return _submit(lambda: (work.wait(), _finish(tensor, op, n))[1])
        work.wait()
        return _finish(tensor, op, n)
    timeout = datetime.timedelta(seconds=topology.timeout_s)
    if algorithm == "ring":
        def body(flat):
            _ring(flat, op, group, topology, timeout)
    else:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")

        def body(flat):
            _hierarchical(flat, op, group, topology, timeout, chunk_bytes)

    def run():
        return _finish(_in_place(tensor, body, group), op, n)

    # A blocking call also runs on the helper thread, behind any asynchronous ones already
    # issued: the point-to-point steps of two calls must never interleave (same peers, tags).
    handle = _submit(run)
    return handle if async_op else handle.wait()


def _finish(tensor: torch.Tensor, op: ReduceOp, n: int) -> torch.Tensor:
    if op is Average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(n)
        else:
            tensor.floor_divide_(n)
    return tensor


def _in_place(tensor: torch.Tensor, body, group=None) -> torch.Tensor:
    """Run ``body`` on a flat contiguous view of ``tensor`` (a copy when it is not contiguous).

    A CUDA tensor on gloo goes through a pinned host copy: gloo's send and receive take host
    memory only (a CUDA pointer fails in the socket write, "Bad address"; seen on an H100).
    """
    if tensor.device.type == "cuda" and engine(group) != "nccl":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        body(host.view(-1))
        tensor.copy_(host)
        return tensor
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


def _p2p(recvs, sends, group, tag: int) -> list:
    """Post receives ``(peer, buf)`` then sends ``(peer, buf)``, skipping empty ones; return the works."""
    works = [dist.irecv(buf, src=peer, group=group, tag=tag) for peer, buf in recvs if buf.numel()]
    return works + [dist.isend(buf, dst=peer, group=group, tag=tag) for peer, buf in sends if buf.numel()]


def _hierarchical(flat: torch.Tensor, op: ReduceOp, group, topology, timeout, chunk_bytes: int) -> None:
    """Pipelined hierarchical allreduce over chunks of ``flat`` (see the module docstring).

    The buffer is cut into chunks of about ``chunk_bytes``; each chunk into L shards,
    shard j owned by local rank j. Three stages run at once on different chunks, so
    the inter-host link never waits for the intra-host copies::

        chunk   k-1          k                 k+1
                allgather    cross allreduce   reduce-scatter      (all in flight together)

    Intra-host steps are direct point-to-point exchanges with each local peer (one
    round, (L-1)/L of the chunk each way, the ring's byte count) received straight
    into place; the cross step is the backend's allreduce of the shard on the cross
    group, in place on a view of ``flat``. No padding: uneven shards stay uneven.
    """
    local, cross = topology.local_group(), topology.cross_group()
    lsize, me = topology.local_size, topology.local_rank
    peers = list(topology.hosts[topology.cross_rank])
    per_chunk = max(lsize, chunk_bytes // flat.element_size())
    chunks = _bounds(flat.numel(), -(-flat.numel() // per_chunk))
    combine, torch_op = _COMBINE[op], _TORCH_OP[op]
    multi_host = topology.cross_size > 1
    if not flat.numel():
        return

    def shards(k: int) -> list[torch.Tensor]:
        a, b = chunks[k]
        return [flat[a + s:a + e] for s, e in _bounds(b - a, lsize)]

    others = [j for j in range(lsize) if j != me]

    def post_reduce_scatter(k: int):
        parts = shards(k)
        mine = parts[me]
        bufs = [torch.empty_like(mine) for _ in others]
        works = _p2p(zip([peers[j] for j in others], bufs), [(peers[j], parts[j]) for j in others], local, tag=1)
        return mine, bufs, works

    def finish_reduce_scatter(pending) -> torch.Tensor:
        mine, bufs, works = pending
        for w in works:
            w.wait(timeout)
        for buf in bufs:  # only this rank reduces this shard, so every rank ends with the same bits
            if buf.numel():
                combine(mine, buf)
        return mine

    def post_allgather(k: int) -> list:
        parts = shards(k)
        return _p2p([(peers[j], parts[j]) for j in others], [(peers[j], parts[me]) for j in others], local, tag=2)

    depth = _PIPELINE_DEPTH
    gathers: list = []
    crossing: list = []  # (chunk index, work) of cross allreduces in flight
    scattering = [post_reduce_scatter(k) for k in range(min(depth, len(chunks)))]
    for k in range(len(chunks)):
        mine = finish_reduce_scatter(scattering.pop(0))
        if k + depth < len(chunks):
            scattering.append(post_reduce_scatter(k + depth))
        if multi_host and mine.numel():
            crossing.append((k, dist.all_reduce(mine, op=torch_op, group=cross, async_op=True)))
        else:
            crossing.append((k, None))
        if len(crossing) >= depth:  # keep depth-1 cross allreduces queued behind the running one
            done, work = crossing.pop(0)
            if work is not None:
                work.wait(timeout)
            gathers += post_allgather(done)
    for done, work in crossing:
        if work is not None:
            work.wait(timeout)
        gathers += post_allgather(done)
    for w in gathers:
        w.wait(timeout)

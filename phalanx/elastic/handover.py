"""The state handed to newcomers at a staged admission, while the members train on.

At a staged admission (:mod:`phalanx.elastic.staging`) every member of the old generation already
holds the job's state (``TorchState(recover="live")``: the members agree at every step), so only the
newcomers need it. ``sync()``'s ordinary path (an allgather of who holds a state, a broadcast of the
skeletons, one broadcast per dtype) stopped every member until the slowest process had taken part:
at np 4 on cpu2, 20-35 ms of the members' 55-65 ms pause, the largest part of it. Here rank 0 copies
the state once (:func:`~phalanx.elastic.snapshots.pack`: one flat buffer per dtype) and *sends* it to
each newcomer without waiting (gloo point-to-point, ``isend``); the other members do nothing at all::

    members   switch ─ sync(): rank 0 isend(header, buffers) ─ forward ─ backward ─ allreduce ─ step
                                 other members: nothing        ─ forward ─ backward ─┘ (waits for the newcomer)
    newcomer  switch ─ sync(): recv(header, buffers), load ──────── forward ─ backward ─┘

This is torchft's recovery (a healing replica fetches a checkpoint from a healthy peer while the
healthy ones run the step) without its cost in data: torchft's healing replica takes part in that
step with its gradient counted as zero, so that step averages over the healthy replicas' batches only;
here the newcomer receives the state before it computes, and the admission step is the same
full-batch step as any other, so the final parameters equal the fault-free run's. The members'
step still waits for the newcomer's gradient at its allreduce, so what is hidden is the members' own
part in the transfer and the rendezvous it forced, not the newcomer's receive.

Rank 0's sends read its private copy, so it may change its parameters meanwhile; the copy and the
work handles are kept until the next handover or :func:`settle` (the newcomer received them before
its gradient took part in the first step's allreduce, so waiting then costs nothing).

Example (what ``TorchState.sync()`` does; every rank of the staged generation calls one side)::

    if rank == 0:
        send({"model": [p.detach() for p in params], "counters": (7, 3)}, newcomers=range(3, 4))
    elif rank >= 3:
        tree = receive()          # the same tree, every tensor a copy
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.pieces import is_stateful
from phalanx.elastic.snapshots import pack, unpack
from phalanx.log import get_logger

__all__ = ["share", "send", "receive", "settle", "TAG"]

log = get_logger(__name__)

TAG = 0x5048  # point-to-point tags TAG (the header's size), TAG + 1 (the header), TAG + 2 + i (buffer i)
_in_flight: list[tuple[Any, list[torch.Tensor]]] = []  # rank 0's sends not yet waited for, and what they read


def share(pieces: dict[str, Any], tensors: list[torch.Tensor], others: list[str], counters: tuple, rank: int,
          newcomers: range) -> tuple:
    """A state from rank 0 to the ``newcomers``, loaded into theirs in place: ``tensors`` (the modules'
    parameters and buffers, the tensor pieces) copied into, and the ``others`` of ``pieces`` (stateful
    objects loaded, plain values replaced in ``pieces``); the other members keep theirs. Returns
    ``counters`` as rank 0 holds them (its own on a member)."""
    if rank == 0:
        sent = send({"tensors": [t.detach() for t in tensors], "counters": counters,
                     "others": {k: pieces[k].state_dict() if is_stateful(pieces[k]) else pieces[k] for k in others}},
                    newcomers)
        log.warning("state handed to newcomer rank(s) %s (%d bytes each) while the members train on",
                    ", ".join(map(str, newcomers)), sent)
    if rank not in newcomers:
        return counters
    tree = receive()
    shapes = [tuple(t.shape) for t in tree["tensors"]]
    if shapes != [tuple(t.shape) for t in tensors] or sorted(tree["others"]) != sorted(others):
        raise ValueError(f"rank {rank} joined with a state unlike rank 0's (tensor shapes {shapes[:4]}... against "
                         f"{[tuple(t.shape) for t in tensors][:4]}..., pieces {sorted(tree['others'])} against "
                         f"{sorted(others)}): every worker must build the same model and state")
    with torch.no_grad():
        for mine, given in zip(tensors, tree["tensors"]):
            mine.copy_(given)
    for k in others:
        if is_stateful(pieces[k]):
            pieces[k].load_state_dict(tree["others"][k])
        else:
            pieces[k] = tree["others"][k]
    return tree["counters"]


def send(tree: Any, newcomers: range) -> int:
    """Rank 0: start sending a copy of ``tree`` to each rank in ``newcomers``; returns at once (the
    sends run in gloo's own threads). Returns the bytes sent to each newcomer."""
    settle()
    skeleton, buffers = pack(tree)
    header = pickle.dumps((skeleton, [(b.dtype, b.numel()) for b in buffers]))
    parts = [torch.tensor([len(header)], dtype=torch.int64), torch.frombuffer(bytearray(header), dtype=torch.uint8),
             *buffers]
    for dst in newcomers:
        works = [dist.isend(part, dst, tag=TAG + i) for i, part in enumerate(parts)]
        _in_flight.append((works, parts))
    return sum(p.numel() * p.element_size() for p in parts)


def receive() -> Any:
    """A newcomer: the tree rank 0 :func:`send` s, each tensor its own copy (blocks until it is here)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, 0, tag=TAG)
    header = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(header, 0, tag=TAG + 1)
    skeleton, metas = pickle.loads(header.numpy().tobytes())
    buffers = [torch.empty(numel, dtype=dtype) for dtype, numel in metas]
    works = [dist.irecv(b, 0, tag=TAG + 2 + i) for i, b in enumerate(buffers)]
    for work in works:
        work.wait()
    return unpack(skeleton, buffers)


def settle() -> None:
    """Rank 0: wait for the sends in flight (long done once the newcomers trained a step) and drop them.
    A send that failed (its newcomer died) is only logged: that loss is re-formed like any other."""
    while _in_flight:
        works, _ = _in_flight.pop(0)
        for work in works:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001 - the newcomer is gone; the members re-formed without it
                log.info("a state send to a newcomer failed (%s: %s)", type(err).__name__, str(err)[:160])

"""What a checkpoint state holds: pieces (modules, optimizers, …), how each becomes a tree, and the job it runs in.

A *state* is a dict ``name -> piece``. A piece is one of:

- *gathered* (:func:`is_gathered`): split across ranks in its own format (ZeRO's
  optimizer); it saves ``sharded_state_dict()`` per rank and loads from every saved
  rank's at once, at any world size;
- *stateful* (:func:`is_stateful`): anything with ``state_dict`` / ``load_state_dict``
  (modules, optimizers, schedulers, samplers, :class:`RNGState`);
- a tensor (copied into in place on load) or a plain value (replaced on load).

:class:`Job` is the part of the topology a checkpoint needs: this rank, the world
size, the collective timeout and the job's c10d store (through which the ranks agree
on who writes what, and rank 0 assembles the manifest).

Example::

    state = {"model": model, "optim": opt, "rng": RNGState(), "step": 10}
    tree = to_tree(state)          # {"model": {...state dict...}, "optim": {...}, "rng": {...}, "step": 10}
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx import runtime

__all__ = ["is_gathered", "is_stateful", "to_tree", "RNGState", "Job", "job_of"]


def is_gathered(v: Any) -> bool:
    """A piece whose state is split across ranks in its own format (ZeRO's optimizer): it saves
    ``sharded_state_dict()`` per rank and loads from every saved rank's at once, at any world size."""
    return hasattr(v, "sharded_state_dict") and hasattr(v, "load_sharded_state_dict")


def is_stateful(v: Any) -> bool:
    """A piece with ``state_dict`` / ``load_state_dict`` (a module, optimizer, scheduler, sampler, …)."""
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(v, torch.Tensor)


def to_tree(state: dict) -> dict:
    """The state as plain nested data: every piece replaced by its (sharded) state dict."""
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict of name -> piece, got {type(state).__name__}")
    return {k: (v.sharded_state_dict() if is_gathered(v) else v.state_dict() if is_stateful(v) else v)
            for k, v in state.items()}


class RNGState:
    """Every random generator of this process as one state piece: torch CPU (and CUDA), Python, numpy.

    Example::

        state = {"rng": RNGState(), ...}; ckpt.save(path, state)   # later load() restores the streams
    """

    def state_dict(self) -> dict:
        import random

        import numpy as np

        out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, sd: dict) -> None:
        import random

        import numpy as np

        torch.set_rng_state(sd["torch"])
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


@dataclasses.dataclass(frozen=True)
class Job:
    """This rank, the world size, the collective timeout, and the topology they came from (None: one process)."""

    rank: int
    world: int
    timeout_s: float
    topology: Any = None

    def store(self) -> dist.Store:
        """The job's c10d store (the default process group's), under a ``phalanx/ckpt`` prefix.

        Safe from the background writer thread: a store call is one request/response
        under the client's own lock, not a collective on the training group.
        """
        from torch.distributed.distributed_c10d import _get_default_store

        return dist.PrefixStore("phalanx/ckpt/", _get_default_store())

    def wait_keys(self, store: dist.Store, keys: list[str], what: str) -> None:
        """Wait (bounded by the topology's timeout) until every key is set; name what is missing otherwise.

        Checks with a short backoff (0.5 to 4 ms) instead of one blocking ``store.wait``: the
        store client serialises its calls under one lock, and a wait of seconds on the
        background writer thread would hold up the training thread's own store calls. (A
        20 ms cap cost a save up to 20 ms per wait, three waits per save; one check is a
        store round trip of ~0.1 ms.)
        """
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
                raise TimeoutError(f"{what}: no answer within {self.timeout_s:.0f}s (the topology's timeout) "
                                   f"from rank(s) {', '.join(missing[:8])}")
            time.sleep(pause)
            pause = min(pause * 2, 0.004)


def job_of(topology=None) -> Job:
    """The :class:`Job` of ``topology``; ``None``: the one ``phalanx.init()`` made, or one process."""
    if topology is None and runtime.is_initialized():
        topology = runtime.topology()
    if topology is None:
        return Job(0, 1, runtime.DEFAULT_TIMEOUT_S)
    return Job(topology.rank, topology.size, topology.timeout_s, topology)

"""``hvd.elastic``: Horovod's elastic API (run, TorchState, ElasticSampler) on :mod:`phalanx.elastic`.

Horovod keeps the last commit in the memory of the surviving workers and
re-forms its ring in-process; so does phalanx under ``phalanx run --min-np/--max-np``
(or ``--host-discovery-script``). Under ``--max-restarts`` alone TorchElastic's agent
restarts the whole group instead, so a commit is also a snapshot the restarted group
loads. What a Horovod script sees is the same loop::

    Horovod:  sync → train … worker lost → restore (memory) → reset → on_reset() → sync → train …
    phalanx:  restore → sync → train … worker lost → survivors re-form in-process →
              restore (memory) → on_reset() → sync → train …   (or: group restart → snapshot)

As in Horovod, a host change the launcher announces (discovery added or removed a host) reaches
``state._host_messages`` within about a second, as ``(timestamp, HostUpdateResult)``, and makes
the next ``commit()`` (or ``check_host_updates()``) raise on every rank; the workers then re-form
when the new workers are ready. That interrupt is ``HostsUpdatedInterrupt`` (with Horovod's
``skip_sync``; also a ``phalanx.elastic.MembershipChanged``), so ``except
hvd.elastic.HostsUpdatedInterrupt`` catches it. Differences, all documented in docs/horovod.md:
``save()`` also asks for changes and writes the snapshot, a ``HostsUpdatedInterrupt`` raised by a
user only rolls back and re-syncs, and the sampler drops the tail of an epoch that does not split
evenly instead of padding it with repeated samples.

Example (Horovod's elastic recipe, only the import changed)::

    import phalanx.horovod.torch as hvd
    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([lambda: set_lr(base_lr * hvd.size())])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, y) in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, 32)
                if batch_idx % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

Horovod's layout: ``state`` (TorchState, ObjectState, the host messages) and ``sampler``
(ElasticSampler) are submodules, also importable as ``phalanx.horovod.torch.elastic.state`` /
``.sampler`` (see :mod:`phalanx.horovod`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from phalanx import elastic as _elastic
from phalanx.comm.horovod_ops.ops import HorovodInternalError
from phalanx.elastic import HostsUpdatedInterrupt, restart_count
from phalanx.horovod.elastic.sampler import ElasticSampler
from phalanx.horovod.elastic.state import HostUpdateResult, ObjectState, TorchState

__all__ = ["run", "TorchState", "ObjectState", "ElasticSampler", "HostsUpdatedInterrupt", "HorovodInternalError",
           "HostUpdateResult", "restart_count"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)`` so it resumes from the last commit after a reset (Horovod's
    ``hvd.elastic.run``); delegates to :func:`phalanx.elastic.run`."""
    inner = _elastic.run(func)

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, TorchState):
            return inner(state, *args, **kwargs)
        state._run_begins()
        try:
            return inner(state, *args, **kwargs)
        finally:
            state._run_ends()

    return wrapper

"""``hvd.elastic.TorchState`` and ``ObjectState`` (Horovod's ``horovod.torch.elastic.state``), with the
host-change messages a state reads: ``from phalanx.horovod.torch.elastic.state import TorchState``.

See :mod:`phalanx.horovod.elastic` for the model.

Example::

    state = TorchState(model, optimizer, epoch=0)
    state.register_reset_callbacks([lambda: set_lr(base_lr * hvd.size())])
"""

from __future__ import annotations

import enum
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

from phalanx import elastic as _elastic
from phalanx.elastic import inprocess, restart_count, vote

__all__ = ["TorchState", "ObjectState", "HostUpdateResult", "HostMessages"]


class HostUpdateResult(enum.IntFlag):
    """What a host change did (Horovod's values): hosts removed, added, or both."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


class HostMessages(queue.Queue):
    """``state._host_messages``: a ``queue.Queue`` of ``(timestamp, HostUpdateResult)``, one per host
    change the launcher announced that this worker's generation does not cover yet (Horovod's meaning:
    non-empty means the next ``commit()`` raises and the job resets).

    Filled by a store read inside ``empty()``, ``qsize()`` and ``get()``, not by a thread: a script
    that never looks pays nothing, one that polls pays one store round trip per look (the launcher
    posts a notice within its ``--discovery-interval`` of the change). A re-form empties it, as
    Horovod's reset does. ``put()`` is the plain queue's.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen = 0  # the last launcher notice put here
        self._gen: int | None = None

    def _poll(self) -> None:
        if not inprocess.active() or inprocess.is_joiner():
            return
        gen = inprocess.generation()
        if gen != self._gen:  # a new generation acted on what it covers; the rest is queued again
            with self.mutex:
                self.queue.clear()
            self._gen, self._seen = gen, 0
        for n, stamp, update in inprocess.host_updates(self._seen):
            self.put((stamp, HostUpdateResult(update)))
            self._seen = n

    def empty(self) -> bool:
        self._poll()
        return super().empty()

    def qsize(self) -> int:
        self._poll()
        return super().qsize()

    def get(self, block: bool = True, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._poll()
            try:
                return super().get(block=False)
            except queue.Empty:
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    raise
            time.sleep(0.1)



class TorchState(_elastic.TorchState):
    """Model, optimizer and named extras as one elastic state (Horovod's ``TorchState``).

    Extras become attributes (``state.epoch``, ``state.sampler``). ``commit()`` saves and raises
    when the launcher announced a host change (``_host_messages`` non-empty) or changed the
    membership, one allreduce for both as in Horovod's ``save()`` + ``check_host_updates()``;
    ``register_reset_callbacks``
    functions run after every reset (a group restart or resize, or a ``HostsUpdatedInterrupt``),
    after the state is restored and before it is synced from rank 0. ``commit_dir``
    and ``keep`` (phalanx's) choose where and how many snapshots are kept.
    """

    _host_notices = True  # commit() acts on the launcher's host-change notices, as Horovod's does

    def __init__(self, model=None, optimizer=None, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        object.__setattr__(self, "_host_messages", HostMessages())
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_restores_in_run", None)  # counted while hvd.elastic.run drives us

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after each reset, e.g. to rescale the learning rate to ``hvd.size()``."""
        callbacks = list(callbacks)
        bad = [c for c in callbacks if not callable(c)]
        if bad:
            raise TypeError(f"register_reset_callbacks takes a list of functions, got {bad!r}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """Raise on every rank (one allreduce) when the launcher announced a host change or changed the
        membership since this generation formed; ``phalanx.elastic.run`` then re-forms. ``commit()``
        makes the same check itself."""
        interrupt = vote.change_at_commit(notices=True)
        if interrupt is not None:
            raise interrupt

    def save(self) -> None:
        """Remember this point in memory and as a snapshot a restarted group loads (and, as
        ``commit()``, raise when the hosts changed: the check and the save are one step here)."""
        super().commit()

    def commit(self) -> None:
        self.save()  # (Horovod's save() + check_host_updates(): save() asks, with one allreduce)

    def restore(self) -> bool:
        from_memory = self._memory is not None
        restored = super().restore()
        count = self._restores_in_run
        if count is not None:
            object.__setattr__(self, "_restores_in_run", count + 1)
            # The first restore of a run is a reset when this group was restarted or resized
            # (it loaded a snapshot an earlier group committed); later ones, after a
            # HostsUpdatedInterrupt, always are.
            if count > 0 or restart_count() > 0 or (restored and not from_memory):
                self.on_reset()
        return restored

    def _run_begins(self) -> None:
        object.__setattr__(self, "_restores_in_run", 0)

    def _run_ends(self) -> None:
        object.__setattr__(self, "_restores_in_run", None)


class ObjectState(TorchState):
    """Horovod's ``ObjectState(bcast_object, get_rank, **kwargs)``: plain picklable values as one
    elastic state (``state.epoch``, ``state.batch``), synced from rank 0 with ``bcast_object``.

    phalanx syncs with its own object broadcast; the two callables are accepted for Horovod's
    signature (and must be callable when given).
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        for name, fn in (("bcast_object", bcast_object), ("get_rank", get_rank)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ObjectState({name}=...) takes a function, got {fn!r}")
        super().__init__(None, None, **kwargs)

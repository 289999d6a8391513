"""Named submission for the Horovod facade: pending names, negotiation rounds, handles.

A collective of :mod:`phalanx.comm.horovod_ops.ops` goes through here first. A blocking call
(:func:`start_call`) negotiates at once; an asynchronous one (:func:`submit`) with a ``name`` on
the global set is held as a :class:`DeferredHandle` and started in the first round in which every
training rank has submitted that name, as Horovod's coordinator matches tensors by name
(:mod:`phalanx.comm.horovod_ops.negotiate` draws the protocol). A second submission of a name
still in flight raises ``ValueError`` on the submitting rank, before anything is sent.
``synchronize``/``poll`` take every handle the facade returns.
"""

from __future__ import annotations

import time

import torch

from phalanx import runtime
from phalanx.comm import collectives as c
from phalanx.comm.horovod_ops import negotiate
from phalanx.comm.horovod_ops.process_sets import ProcessSet, group_of
from phalanx.comm.mismatch import CollectiveMismatchError

__all__ = ["HorovodInternalError", "CompositeHandle", "DeferredHandle", "start_call", "submit", "track",
           "check_name", "synchronize", "poll", "reset"]


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that cannot be carried out (e.g. a scalar reducescatter)."""


class CompositeHandle(c.Handle):
    """A handle over inner handles: ``poll`` is true once all are; ``wait`` applies ``finish`` once.

    Callable, so Horovod's ``sparse_allreduce_async(...)()`` form works too.
    """

    def __init__(self, inner, finish) -> None:
        super().__init__(None, None)
        self._inner, self._then = list(inner), finish

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h in self._inner)

    def wait(self):
        if not self._done:
            self._result, self._done = self._then(self._inner), True
        return self._result

    __call__ = wait


_in_flight: dict[tuple, c.Handle] = {}
_pending: dict[str, DeferredHandle] = {}  # named ops on the global set, submitted here, not started


class DeferredHandle(c.Handle):
    """A named collective on the global set, submitted but not started: it starts in the first
    round (``synchronize()`` or a facade collective, on every rank) in which every training rank
    has submitted its name, as Horovod's coordinator matches collectives by name
    (:mod:`phalanx.comm.horovod_ops.negotiate`). ``poll`` is False until then."""

    def __init__(self, desc: dict, run) -> None:
        super().__init__(None, None)
        self.desc, self._run, self._inner, self._refused, self._polled = desc, run, None, None, None

    @property
    def started(self) -> bool:
        return self._inner is not None

    def start(self, refused: str | None = None) -> None:
        """Launch it (every rank does so in the same round, in the same order), or record why the
        training ranks refuse it (a kind Horovod does not support while a rank has joined)."""
        if refused is not None:
            self._refused, self._inner = refused, c.Handle(None, None)
        else:
            self._inner = self._run(None, False)

    def is_completed(self) -> bool:
        if self._inner is None:
            # a loop that only polls would never start it: bounded by the collective timeout
            now = time.monotonic()
            self._polled = self._polled or now
            if now - self._polled > runtime.topology().timeout_s:
                raise HorovodInternalError(
                    f"poll: {self.desc['call']} {self.desc['name']!r} has not started within the collective "
                    "timeout: a named asynchronous collective starts at the next synchronize() or facade "
                    "collective of every rank; call hvd.synchronize(handle)")
            return False
        return self._done or self._inner.is_completed()

    def wait(self):
        if not self._done:
            while self._inner is None:
                _settle(sync=self)
            if self._refused is not None:
                raise HorovodInternalError(self._refused)
            self._result, self._done = self._inner.wait(), True
        return self._result


def _settle(desc: dict | None = None, sync: DeferredHandle | None = None) -> bool:
    """Negotiation rounds (:mod:`~phalanx.comm.horovod_ops.negotiate`) until this rank's blocking call
    ``desc`` may run (True: it was checked across ranks) or until ``sync``, a pending named op, has
    started. Every round starts the pending names that every training rank has submitted."""
    while True:
        mine = list(_pending.values())
        if sync is not None:
            code = negotiate.digest(sync.desc) if mine == [sync] else negotiate.PENDING
        else:
            code = negotiate.PENDING if mine else negotiate.digest(desc)
        high, low, joined = negotiate.probe(code, desc or sync.desc)
        if not joined and high == -low == code != negotiate.PENDING:  # every rank: this same call
            if sync is None:
                return True
            del _pending[sync.desc["name"]]
            sync.start()
            return False
        try:
            plan = negotiate.plan(negotiate.exchange({
                "call": desc, "sync": None if sync is None else sync.desc["name"],
                "pending": [h.desc for h in mine], "joined": False}))
        except CollectiveMismatchError as err:
            for h in mine:  # every rank drops its pending names: the next call starts afresh
                del _pending[h.desc["name"]]
                h.start(refused=str(err))
            raise
        for d in plan.ready:
            _pending.pop(d["name"]).start(negotiate.refusal(d, plan.joined))
        if sync is not None:
            if sync.started:
                return False
        elif plan.call is not None:
            refused = negotiate.refusal(plan.call, plan.joined)
            if refused is not None:
                raise HorovodInternalError(refused)
            return True


def _describe(kind: str, name, tensor: torch.Tensor | None, extra: dict) -> dict:
    shape = None if tensor is None else tuple(tensor.shape)
    if shape and kind in ("allgather", "alltoall"):
        shape = ("*",) + shape[1:]
    return {"call": kind, "name": name, "dtype": None if tensor is None else str(tensor.dtype), "shape": shape,
            **extra}


def check_name(kind: str, name, ps: ProcessSet) -> None:
    if name is not None:
        previous = _in_flight.get((ps.process_set_id, name))
        if previous is not None and not previous.is_completed():
            raise ValueError(f"{kind}: a collective named {name!r} is already in flight on {ps}; "
                             "synchronize it first or give pending operations unique names")


def start_call(kind: str, name, ps: ProcessSet, tensor: torch.Tensor | None, **extra):
    """A blocking call's prologue: the group, the duplicate-name check, the negotiation.
    Returns ``(group, check)``; ``check`` is False once the ranks' calls were compared."""
    group = group_of(ps)
    check_name(kind, name, ps)
    desc = _describe(kind, name, tensor, extra)
    return group, not (negotiate.active(group) and _settle(desc))


def submit(kind: str, name, ps: ProcessSet, tensor: torch.Tensor, run, **extra) -> c.Handle:
    """An asynchronous call: ``run(group, check)`` launches it and returns its handle. A named call
    on the global set waits in the pending list (a :class:`DeferredHandle`) and never blocks here."""
    group = group_of(ps)
    check_name(kind, name, ps)
    desc = _describe(kind, name, tensor, extra)
    if name is not None and negotiate.active(group):
        handle = _pending[name] = DeferredHandle(desc, run)
    else:
        handle = run(group, not (negotiate.active(group) and _settle(desc)))
    return track(name, ps, handle)


def reset() -> None:
    """Forget pending names (``hvd.init()`` / ``hvd.shutdown()``: a new job has none)."""
    _pending.clear()
    _in_flight.clear()


def track(name, ps: ProcessSet, handle: c.Handle) -> c.Handle:
    if name is not None:
        _in_flight[(ps.process_set_id, name)] = handle
    return handle


def synchronize(handle):
    """Wait for an asynchronous operation and return its result."""
    try:
        return handle.wait()
    finally:
        for key in [k for k, h in _in_flight.items() if h is handle]:
            del _in_flight[key]


def poll(handle) -> bool:
    """True when the asynchronous operation has finished (never blocks)."""
    return handle.is_completed()

"""One preemption checkpoint at the same step on every rank, then exit 85 ("preempted, resume me").

The signal reaches ranks at different moments (the launcher forwards it one worker after
another; ``scancel --signal=USR1 --full`` hits each process when SLURM gets to it; a spot
reclaim may hit one host only). Each rank only notes it (:mod:`.signals`); the ranks agree
at a step boundary through **a flag carried by a collective**:

    rank 0: step 41 ─ allreduce(MAX, [0])      ─ step 42 ─ allreduce(MAX, [10]) = 10 → save step 42, exit
    rank 1: step 41 ─ allreduce(MAX, [0])      ─ step 42 ─ allreduce(MAX, [0])  = 10 → save step 42, exit
                            SIGUSR1 reaches rank 0 here ┘

The reduced value is the largest signal number any rank got (0: none), so every rank
leaves the collective with the same answer at the same call, whatever the arrival
order. Why a collective and not the job's store: a store flag needs a round trip per
step to the store host *and* a second round to agree on the step (a rank that read the
flag late may already be one step further), while a data-parallel step already
synchronises the ranks; one 4-byte allreduce is the whole protocol. The Trainer adds the
flag to the allreduce it already makes each step (the inf/NaN check), so there it costs
nothing; in a plain loop :meth:`Preemption.requested` starts a 4-byte allreduce and reads
it at the next call, so its latency overlaps a step (the save comes one step later); on
5-6 ms steps it still cost x1.07-1.19 (docs/preemption.md), so ``every=N`` votes on every N-th
call only.

Example (a plain loop)::

    import phalanx as px
    from phalanx.checkpoint import CheckpointManager, RNGState

    px.init()
    mgr = CheckpointManager("ckpts")
    state = {"model": model, "optim": opt, "rng": RNGState(), "step": 0}
    with px.preemption.watch() as preempt:     # SIGTERM + $PHALANX_PREEMPT_SIGNAL (phalanx run --preempt-signal)
        preempt.resume(mgr, state)              # --resume-from DIR, or a requeued SLURM job: the newest checkpoint
        for step in range(state["step"], 1000):
            train_step()
            state["step"] = step + 1
            if preempt.requested():             # the same answer on every rank
                preempt.save_and_exit(mgr, state["step"], state)   # raises Preempted: exit status 85
"""

from __future__ import annotations

import signal
import time

import torch

from phalanx import runtime
from phalanx.comm import collectives as c
from phalanx.log import get_logger
from phalanx.preemption import guard, slurm
from phalanx.preemption import signals as notes
from phalanx.settings import CheckpointSettings

__all__ = ["Preempted", "Preemption", "watch"]

log = get_logger(__name__)


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is complete.

    A ``SystemExit`` with code 85 (:data:`~phalanx.preemption.notes.PREEMPTED_EXIT_CODE`):
    left uncaught, the process exits quietly with that status, which ``phalanx run`` passes
    on. ``path`` is the checkpoint, ``signal`` the signal agreed on, ``requeued`` whether
    SLURM took the job back. Catch it to clean up, then re-raise. Once it is raised the process
    ends with 85 (right after the exit hooks), even where a handler swallowed it.
    """

    def __init__(self, path: str | None, sig: signal.Signals | None, requeued: bool = False) -> None:
        super().__init__(notes.PREEMPTED_EXIT_CODE)
        self.path, self.signal, self.requeued = path, sig, requeued


class Preemption:
    """Watch for preemption signals; agree on one step; save once; exit with status 85.

    ``signals``: which to catch (default SIGTERM + ``$PHALANX_PREEMPT_SIGNAL``). ``every``:
    :meth:`requested` talks to the other ranks on every N-th call only (the save may then
    come up to N-1 steps later). ``topology``: the job (default: ``phalanx.init()``'s, or
    one process). Handlers are installed by ``with`` (or :meth:`install`) and removed at exit.
    """

    def __init__(self, signals=None, *, every: int = 1, topology=None) -> None:
        if every < 1:
            raise ValueError(f"Preemption(every={every}): check every 1 or more calls")
        self.signals = list(notes.from_env() if signals is None else [notes.parse_signal(s) for s in signals])
        self.every, self._calls = every, 0
        if topology is None and runtime.is_initialized():
            topology = runtime.topology()
        self.topology = topology
        self.signal: signal.Signals | None = None  # the agreed one, once requested() said True
        self._pending = None  # the vote in flight (requested() reads it at its next call)

    # ------------------------------------------------------------------ handlers
    def install(self) -> Preemption:
        if not notes.install(self.signals):
            log.warning("preemption signals can only be caught on the main thread; not watching")
        return self

    def close(self, drain: bool = True) -> None:
        """Remove the handlers. ``drain``: first finish the vote in flight (every rank started it, so
        it must end before other collectives); False when leaving on an error, where the group may be
        broken and that vote may never end (a peer died: the agent is restarting the group)."""
        pending, self._pending = self._pending, None
        if pending is not None and drain:
            pending.wait()
        notes.uninstall()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, exc_type, *exc) -> None:
        self.close(drain=exc_type is None)

    def retopologize(self, topology) -> None:
        """The job re-formed (elastic): vote among ``topology``'s members; a vote in flight is dropped."""
        self.topology, self._pending, self._calls = topology, None, 0

    # ------------------------------------------------------------------ agreement
    def local_flag(self) -> int:
        """This rank's vote: the number of the signal it got, 0 for none."""
        sig = notes.received()
        return int(sig) if sig is not None else 0

    def decide(self, reduced: int) -> bool:
        """Record the reduced vote (the largest signal number any rank got); True means stop now."""
        if reduced and self.signal is None:
            self.signal = signal.Signals(int(reduced))
            guard.agreed()
        return bool(reduced)

    def requested(self) -> bool:
        """True on every rank at the same call once any rank got a preemption signal.

        A collective when the job has more than one rank: every rank calls it at the same
        point of its loop. The vote is an asynchronous 4-byte allreduce started here and read
        at the next call (``every``-th call), so its latency hides behind a step; a signal is
        acted on one or two calls after it came.
        """
        self._calls += 1
        if self.signal is not None:
            return True
        if self._calls % self.every:
            return False
        topo = self.topology
        if topo is None or topo.size == 1:
            return self.decide(self.local_flag())
        reduced = int(self._pending.wait().item()) if self._pending is not None else 0
        self._pending = None
        if not reduced:
            flag = torch.tensor([self.local_flag()], dtype=torch.int32, device=topo.device)
            self._pending = c.allreduce(flag, op=c.Max, name="preemption", check=False, async_op=True)
        return self.decide(reduced)

    def requested_now(self) -> bool:
        """:meth:`requested` answered at this very call: a blocking 4-byte allreduce, nothing left in
        flight. For points that are rare and already synchronise the ranks (an elastic commit), where a
        vote still running into the next steps would tie a failure's detection to it."""
        if self.signal is not None:
            return True
        topo = self.topology
        if topo is None or topo.size == 1:
            return self.decide(self.local_flag())
        flag = torch.tensor([self.local_flag()], dtype=torch.int32, device=topo.device)
        return self.decide(int(c.allreduce(flag, op=c.Max, name="preemption", check=False).item()))

    # ------------------------------------------------------------------ save, requeue, exit
    def save_and_exit(self, manager, step: int, state: dict):
        """Every rank: save ``state`` as checkpoint ``step`` of ``manager`` (synchronously), then :meth:`finish`."""
        started = time.monotonic()
        path = manager.save(step, state)  # synchronous: returns on every rank once the manifest exists
        self.finish(path, save_s=time.monotonic() - started)

    def finish(self, path: str | None, save_s: float | None = None):
        """After every rank's save is complete: requeue under SLURM (rank 0), then raise :class:`Preempted`."""
        rank = self.topology.rank if self.topology is not None else 0
        requeued = False
        if rank == 0:
            at = notes.received_at()
            since = f"{time.monotonic() - at:.2f} s after the signal reached rank 0" if at is not None else \
                "signal reached another rank"
            took = f" (save {save_s:.2f} s)" if save_s is not None else ""
            log.warning("preempted by %s: checkpoint %s complete on every rank, %s%s; exiting with status %d "
                        "(resume me)", self.signal.name if self.signal else "a signal", path, since, took,
                        notes.PREEMPTED_EXIT_CODE)
            if slurm.requeue_wanted(self.signal):
                requeued = slurm.requeue()
        runtime.exit_after_hooks(notes.PREEMPTED_EXIT_CODE)  # decided: no teardown abort may change it
        raise Preempted(path, self.signal, requeued)

    def resume(self, manager, state: dict) -> str | None:
        """Load the newest intact checkpoint into ``state`` when this run continues an earlier one.

        From ``$PHALANX_RESUME_FROM`` (``phalanx run --resume-from DIR``) when set; else from
        ``manager``'s directory when SLURM requeued this job (``SLURM_RESTART_COUNT`` > 0);
        else nothing (a fresh run; returns None).
        """
        from phalanx.checkpoint import load_latest

        root = CheckpointSettings.one("resume_from") or (manager.root if slurm.restarted() else None)
        if not root:
            return None
        path = load_latest(root, state, topology=self.topology)
        if path is not None and (self.topology is None or self.topology.rank == 0):
            log.warning("resumed from %s", path)
        return path


def watch(signals=None, *, every: int = 1, topology=None) -> Preemption:
    """A :class:`Preemption` to use as a context manager (``with px.preemption.watch() as p:``)."""
    return Preemption(signals, every=every, topology=topology)

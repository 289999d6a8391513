"""``phalanx run`` on a preemption signal: pass it to every worker, wait for their checkpoint, exit 85.

TorchElastic's agent answers SIGTERM by sending SIGTERM to the workers and killing them
30 s later, and exits 143 whatever they did; SIGUSR1 (SLURM's ``--signal=USR1@90``)
would simply kill the launcher. Instead, on SIGTERM and ``--preempt-signal``:

    signal ─ forward it to each worker ─ wait (≤ GRACE_S) until every worker exited ─┐
    every worker exited 85 (its preemption checkpoint is complete) ─ phalanx run exits 85
    anything else (a worker without a preemption handler died of the signal) ─ 128 + signal

The wait happens inside the handler, on the agent's main thread, so the agent cannot
restart the group meanwhile (``--max-restarts``); the handler then raises TorchElastic's
own ``SignalException``, which shuts the agent down as a SIGTERM always did. Exit
statuses are read with ``waitid(WNOWAIT)``: the agent still reaps its children itself.

Example::

    with forward_preemption([signal.SIGTERM, signal.SIGUSR1]) as outcome:
        ...                                   # run the agent
    outcome.preempted                          # True when every worker exited 85
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time

from phalanx.preemption.guard import mark as preempt_mark
from phalanx.preemption.signals import PREEMPTED_EXIT_CODE
from phalanx.settings import PreemptionSettings

__all__ = ["GRACE_S", "Outcome", "forward_preemption", "direct_children", "all_preempted", "report_preempted",
           "preempt_signals", "torchelastic_signals"]

# How long the launcher waits for the workers' preemption checkpoint after forwarding the signal.
# Longer than a step plus a save; shorter than SLURM's usual --signal lead (90 s) would be too tight
# for large models, and the scheduler's own SIGKILL bounds it anyway.
GRACE_S = 120.0


@dataclasses.dataclass
class Outcome:
    signal: signal.Signals | None = None
    codes: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> exit code (-N: killed by N)

    @property
    def preempted(self) -> bool:
        return all_preempted(self.codes.values())


def all_preempted(codes) -> bool:
    """True when a worker exited 85 and every other one did too or was stopped by the launcher afterwards.

    One 85 is enough to know the checkpoint is complete: a rank raises ``Preempted`` only after
    the save's closing barrier, so every rank had written its part.
    """
    codes = list(codes)
    stopped = (-int(signal.SIGTERM), -int(signal.SIGKILL))
    return PREEMPTED_EXIT_CODE in codes and all(c == PREEMPTED_EXIT_CODE or c in stopped for c in codes)


def direct_children(pid: int | None = None) -> list[int]:
    """The processes whose parent is ``pid`` (default: this one), from /proc."""
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return out


def _exit_code(pid: int) -> int | None:
    """The child's exit code if it has exited (left unreaped for its owner), else None."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -1  # already reaped elsewhere: gone, status unknown
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


@contextlib.contextmanager
def forward_preemption(signals, grace_s: float = GRACE_S, mark: str | None = None):
    """While inside, ``signals`` are forwarded to this process's children and waited on (see above).

    ``mark``: a file created before forwarding (``$PHALANX_PREEMPT_MARK`` in the workers), which
    tells a worker blocked in a collective that this SIGTERM is a preemption and not the agent
    stopping the group (:mod:`phalanx.preemption.guard`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    outcome = Outcome()

    def handler(signum, frame):
        if outcome.signal is not None:
            return  # a repeat while we wait
        outcome.signal = signal.Signals(signum)
        if mark:
            preempt_mark(mark)
        workers = direct_children()
        print(f"phalanx: received {outcome.signal.name}; forwarded to {len(workers)} worker(s), waiting up to "
              f"{grace_s:.0f} s for their preemption checkpoint", file=sys.stderr, flush=True)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + grace_s
        pending = set(workers)
        while pending and time.monotonic() < deadline:
            for pid in list(pending):
                code = _exit_code(pid)
                if code is not None:
                    outcome.codes[pid] = code
                    pending.discard(pid)
            time.sleep(0.05)
        for pid in pending:
            outcome.codes[pid] = -int(signal.SIGKILL)  # the agent kills the rest on its way out
        raise SignalException(f"Process {os.getpid()} got signal: {outcome.signal}", sigval=outcome.signal)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield outcome
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def preempt_signals(signals, env) -> tuple[signal.Signals, ...]:
    """``signals`` plus ``PHALANX_PREEMPT_SIGNAL`` from ``env``: an agent started over SSH or srun learns
    the job's ``--preempt-signal`` from the environment it passes to the workers."""
    from phalanx.preemption.signals import parse_signal

    extra = [parse_signal(s) for s in PreemptionSettings.one("signals", env)]
    return tuple(dict.fromkeys([*map(signal.Signals, signals), *extra]))


def torchelastic_signals(signals) -> str:
    """LaunchConfig.signals_to_handle: TorchElastic's default list less ours (it would replace our handler)."""
    return ",".join(s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if signal.Signals[s] not in signals)


def report_preempted(sig: signal.Signals | None) -> int:
    """The launcher's last line when every worker saved and exited 85; returns 85."""
    why = f" by {sig.name}" if sig is not None else ""
    print(f"phalanx: preempted{why}: every worker saved its preemption checkpoint; exiting with status "
          f"{PREEMPTED_EXIT_CODE} (resume with --resume-from DIR; a requeued SLURM job resumes by itself)",
          file=sys.stderr, flush=True)
    return PREEMPTED_EXIT_CODE

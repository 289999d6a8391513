"""Watch the ranks' heartbeats: warn about a stall, name the rank behind it, kill what cannot stop.

Each rank publishes a heartbeat to the launcher's store (:mod:`phalanx.runtime.heartbeat`):
its collective sequence number, whether it is blocked in one and for how long, its pid.
Here the launcher reads them every half second.

* :class:`StallDetector` turns them into facts: which ranks are *silent* (the ``beat``
  counter stopped moving, measured on the launcher's clock) and in what process state
  (``T`` stopped, ``D`` uninterruptible, …), which are *waiting* in a collective, and
  which are *behind* (the others wait in collective #k, this one never reached it).
  ``stalled(timeout)`` is the elastic supervisor's question: which workers are lost?
* :class:`Watcher` is the thread ``phalanx run`` runs beside TorchElastic's agent: after
  ``--stall-warning`` seconds of one collective waiting (or a rank silent) it prints one
  block with each rank's position and the Python stack of every live rank (SIGUSR2 ->
  faulthandler, written to ``PHALANX_STACK_DIR``); when a worker has gone and another is
  stopped (state T), it SIGKILLs the stopped one at once (a stopped process never honours
  the agent's SIGTERM, which would cost its 30 s grace); with ``--stall-timeout`` it also
  kills a rank that stayed stalled that long. :meth:`Watcher.cause` says, at the end, which
  rank stalled or left first.

Example (what the elastic supervisor does)::

    detector = StallDetector(store, ranks=range(4))
    for stall in detector.stalled(timeout_s=30):
        if is_child(stall.pid):                 # a heartbeat's pid is only a claim
            os.kill(stall.pid, signal.SIGKILL)  # then re-form as for a killed worker
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable

from phalanx.runtime.heartbeat import describe_position, heartbeat_key

__all__ = ["PEER_LOST", "lost_a_peer", "ended_then_aborted", "RankView", "Stall", "StallDetector", "Watcher", "process_state", "describe_position", "is_child"]

_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible (disk/driver)", "T": "stopped",
           "t": "stopped by a debugger", "Z": "exited (zombie)", "X": "dead", "I": "idle"}


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T`` stopped, ``Z`` zombie, …), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# What a rank prints when a peer died or left before it: a consequence, not the cause of the failure.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "peer closed",
             "collectiveabort", "a peer rank failed", "socket timeout", "recvbytes", "read error",
             "gloo/transport", "timed out waiting")


def describe_exit(code: int) -> str:
    """``killed by SIGKILL`` / ``exit code 1``; a remote worker's ``128 + N`` as its agent reports it."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    if code > 128 and code - 128 < 65:
        with contextlib.suppress(ValueError):
            return f"exit code {code} ({signal.Signals(code - 128).name})"
    return f"exit code {code}"


def lost_a_peer(text: str) -> bool:
    """Whether a rank's last words say it only lost a peer (a timeout, a closed connection)."""
    text = text.lower()
    return any(p in text for p in PEER_LOST)


def ended_then_aborted(store, ident: int | str, code: int) -> bool:
    """Whether a worker that died of SIGABRT had ended its script first: its last heartbeat, written
    by the exit hooks, says ``exited``. The abort then came from the interpreter's teardown (torch's
    "terminate called without an active exception", seen after elastic re-forms), not from training."""
    if code not in (-signal.SIGABRT, 128 + signal.SIGABRT):
        return False
    try:
        key = heartbeat_key(ident)
        return bool(store.check([key])) and json.loads(store.get(key)).get("state") == "exited"
    except Exception:  # noqa: BLE001 - no heartbeat to read: it counts as the failure it looks like
        return False


def is_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process: the only processes the watcher will signal.

    A heartbeat's pid is a claim made over the store, which has no authentication; the
    launcher signals a pid only if it started that process itself.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, IndexError, ValueError):
        return False


def _state_words(letter: str | None) -> str:
    return "gone" if letter is None else f"{letter} ({_STATES.get(letter, '?')})"


@dataclasses.dataclass
class RankView:
    """What the launcher knows of one rank: its last heartbeat and when that last changed."""

    rank: int
    value: dict
    changed_at: float  # launcher monotonic clock: when ``beat`` last moved
    gone_at: float | None = None  # when the process was first seen gone (or a zombie)

    @property
    def pid(self) -> int:
        return int(self.value.get("pid", 0))

    def silent_s(self, now: float) -> float:
        return now - self.changed_at

    def waited_s(self, now: float) -> float:
        """How long it has been blocked in its current collective (0 when not)."""
        if self.value.get("state") != "waiting":
            return 0.0
        return float(self.value.get("waited_s", 0.0)) + (now - self.changed_at)


def _without_heartbeat(dump: str) -> str:
    """faulthandler's dump less the heartbeat thread's own block (always the same, never the culprit)."""
    blocks = dump.strip().split("\n\n")
    return "\n\n".join(b for b in blocks if "runtime/heartbeat.py" not in b)


@dataclasses.dataclass
class Stall:
    """A rank the detector judges lost: ``reason`` is one line, ready to print."""

    rank: int
    pid: int
    reason: str
    since_s: float


class StallDetector:
    """Reads the heartbeats of ``ranks`` from ``store`` (the launcher's) and judges them.

    ``ranks``: the ids the workers publish under: their ranks, or in an elastic job their
    worker ids (``"w0"``, ``"w1"``: PHALANX_ELASTIC_WID), which survive a re-form.
    """

    def __init__(self, store, ranks: Iterable[int | str], clock=time.monotonic) -> None:
        self.store, self.ranks, self.clock = store, list(ranks), clock
        self.views: dict[int, RankView] = {}

    def poll(self) -> dict[int, RankView]:
        now = self.clock()
        for rank in self.ranks:
            key = heartbeat_key(rank)
            try:
                if not self.store.check([key]):
                    continue
                value = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - the store is closing, or a torn value: try next time
                continue
            old = self.views.get(rank)
            if old is None or old.value.get("beat") != value.get("beat") or old.pid != value.get("pid"):
                self.views[rank] = RankView(rank, value, now)
        for view in self.views.values():
            if view.gone_at is None and process_state(view.pid) in (None, "Z", "X"):
                view.gone_at = now
        return self.views

    def silent(self, after_s: float) -> list[RankView]:
        """Live ranks whose heartbeat has not moved for ``after_s`` seconds (and did not say goodbye)."""
        now = self.clock()
        return [v for v in self.views.values() if v.gone_at is None and v.value.get("state") != "exited"
                and v.silent_s(now) >= after_s]

    def silent_stalls(self, after_s: float) -> list[Stall]:
        """:meth:`silent` as stalls, each with its one-line reason (the process state it is in)."""
        now = self.clock()
        return [Stall(v.rank, v.pid, f"stopped responding {v.silent_s(now):.0f} s ago: process state "
                      f"{_state_words(process_state(v.pid))}", v.silent_s(now)) for v in self.silent(after_s)]

    def waiting(self, after_s: float) -> list[RankView]:
        now = self.clock()
        return [v for v in self.views.values() if v.gone_at is None and v.waited_s(now) >= after_s]

    def behind(self) -> tuple[int | str | None, list[RankView]]:
        """(k, ranks that never reached collective #k while others wait in it)."""
        k, behind, _ = self.behind_and_waiters()
        return k, behind

    def behind_and_waiters(self) -> tuple[int | str | None, list[RankView], list[RankView]]:
        """(k, the ranks behind collective k, the ranks waiting in it). Compared within the waited
        collective's process group (heartbeats name it and count its collectives apart): a rank that
        is not a member, or that runs other sub-groups' collectives, is neither behind nor ahead."""
        views = list(self.views.values())
        waiting = [v for v in views if v.value.get("state") == "waiting"]
        if not waiting:
            return None, [], []
        if any("gat" not in v.value for v in waiting):  # heartbeats without per-group counts
            k = max(int(v.value.get("at", 0)) for v in waiting)
            behind = [v for v in views if int(v.value.get("seq", 0)) < k]
            return k, behind, [v for v in views if v not in behind]
        found = None
        for gid, gat in sorted({(v.value["group"], int(v.value["gat"])) for v in waiting}, key=lambda w: -w[1]):
            members = [v for v in views if gid == "world" or str(v.value.get("rank")) in gid.split(",")]
            behind = [v for v in members if int(v.value.get("groups", {}).get(gid, 0)) < gat]
            waiters = [v for v in members if v.value.get("group") == gid and v.value.get("gat") == gat
                       and v.value.get("state") == "waiting"]
            label = gat if gid == "world" else f"{gat} of group [{gid}]"
            if behind:
                return label, behind, waiters
            found = found or (label, [], waiters)
        return found

    def stalled(self, timeout_s: float) -> list[Stall]:
        """The workers to treat as lost: silent for ``timeout_s``, or behind a collective every other
        live member has waited in that long. Polls first."""
        self.poll()
        now = self.clock()
        out = {s.rank: s for s in self.silent_stalls(timeout_s)}
        k, behind, waiters = self.behind_and_waiters()
        waiters = [v for v in waiters if v.gone_at is None]
        if behind and waiters and all(v.waited_s(now) >= timeout_s for v in waiters):
            waited = min(v.waited_s(now) for v in waiters)
            for v in behind:
                if v.gone_at is None and v.rank not in out:
                    out[v.rank] = Stall(v.rank, v.pid, f"never reached collective #{k} that every other rank has "
                                        f"waited in for {waited:.0f} s (it is at {describe_position(v.value)})",
                                        waited)
        return sorted(out.values(), key=lambda s: s.rank)


class Watcher(threading.Thread):
    """``phalanx run``'s stall watcher: the warning block, the immediate kill of stopped workers."""

    def __init__(self, store, ranks: Iterable[int], *, stall_warning_s: float = 60.0,
                 stall_timeout_s: float | None = None, stack_dir: str | None = None, interval_s: float = 0.5,
                 out=None) -> None:
        super().__init__(name="phalanx-stall-watcher", daemon=True)
        self.detector = StallDetector(store, ranks)
        self.stall_warning_s, self.stall_timeout_s = stall_warning_s, stall_timeout_s
        self.stack_dir, self.interval_s, self.out = stack_dir, interval_s, out
        self.killed: dict[int, tuple[int, str]] = {}  # rank -> (pid, why) for the ones this watcher killed
        self._warned: set = set()
        self._stack_offsets: dict[int, int] = {}
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(2)
        self.detector.poll()  # the last word of ranks that exited meanwhile

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.detector.poll()
                self._kill_stopped()
                self._warn()
            except Exception as err:  # noqa: BLE001 - watching must never take the job down
                print(f"phalanx: stall watcher: {err}", file=self.out or sys.stderr, flush=True)

    def _kill(self, view: RankView, why: str) -> None:
        if not is_child(view.pid):
            return
        self.killed[view.rank] = (view.pid, why)
        try:
            os.kill(view.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_stopped(self) -> None:
        views = self.detector.views.values()
        ending = any(v.gone_at is not None for v in views)  # a stopped worker then only delays the end
        now = time.monotonic()
        for v in views:
            if v.gone_at is not None or self._was_killed(v.rank, v.pid):
                continue
            state = process_state(v.pid)
            if ending and state in ("T", "t"):
                self._kill(v, f"stopped responding {v.silent_s(now):.0f} s ago: process state {_state_words(state)}")
        if self.stall_timeout_s:
            for stall in self.detector.stalled(self.stall_timeout_s):
                if not self._was_killed(stall.rank, stall.pid):
                    self._kill(self.detector.views[stall.rank], stall.reason)

    def _was_killed(self, rank: int, pid: int) -> bool:
        """Killed already (a group restart gives the rank a new pid: that one may be killed again)."""
        return self.killed.get(rank, (None,))[0] == pid

    def _warn(self) -> None:
        waiting = self.detector.waiting(self.stall_warning_s)
        silent = self.detector.silent(self.stall_warning_s)
        if not waiting and not silent:
            return
        # a stopped rank can be both waiting (its last heartbeat) and silent: keys of one type, sortable
        episode = tuple(sorted({(str(v.rank), str(v.value.get("at"))) for v in waiting}
                               | {(str(v.rank), "silent") for v in silent}))
        if episode in self._warned:
            return
        self._warned.add(episode)
        print(self.report(), file=self.out or sys.stderr, flush=True)

    def report(self) -> str:
        """One block: every rank's position, the silent ones' process state, the live ones' stacks."""
        now = time.monotonic()
        views = sorted(self.detector.views.values(), key=lambda v: v.rank)
        k, behind = self.detector.behind()
        longest = max((v.waited_s(now) for v in views), default=0.0)
        head = f"collective #{k} has waited {longest:.0f} s" if k else "a rank stopped responding"
        lines = [f"phalanx: stall warning: {head} (--stall-warning {self.stall_warning_s:g} s)"]
        live = []
        for v in views:
            state = process_state(v.pid)
            who = f"  rank {v.rank} (pid {v.pid})"
            if v.gone_at is not None:
                lines.append(f"{who}: exited, last at {describe_position(v.value)}")
            elif v.silent_s(now) >= max(3 * self.interval_s, 2.0) and v.value.get("state") != "exited":
                lines.append(f"{who} stopped responding {v.silent_s(now):.0f} s ago: process state "
                             f"{_state_words(state)}; last at {describe_position(v.value)}")
            elif v.value.get("state") == "waiting":
                lines.append(f"{who}: waiting in {describe_position(v.value)} for {v.waited_s(now):.0f} s")
                live.append(v)
            else:
                mark = "behind: " if v in behind else ""
                lines.append(f"{who}: {mark}running, last at {describe_position(v.value)}")
                live.append(v)
        lines.extend(self._stacks(live))
        return "\n".join(lines)

    def _stacks(self, views: list[RankView]) -> list[str]:
        if not self.stack_dir or not views:
            return []
        views = [v for v in views if is_child(v.pid)]
        for v in views:
            try:
                os.kill(v.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        lines = []
        deadline = time.monotonic() + 2.0
        for v in views:
            path = os.path.join(self.stack_dir, f"rank{v.rank}.txt")
            self._wait_written(path, self._stack_offsets.get(v.rank, 0), deadline)
            text = _without_heartbeat(self._read_new(path, v.rank))
            lines.append(f"  --- rank {v.rank} (pid {v.pid}) Python stack ---")
            lines.extend("    " + line for line in (text.strip().splitlines() or ["(no stack written)"]))
        return lines

    @staticmethod
    def _wait_written(path: str, offset: int, deadline: float) -> None:
        """Until faulthandler's dump past ``offset`` stops growing (or the deadline)."""
        last = -1
        while time.monotonic() < deadline:
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if offset < size == last:
                return
            last = size
            time.sleep(0.1)

    def _read_new(self, path: str, rank: int) -> str:
        try:
            with open(path, errors="replace") as f:
                f.seek(self._stack_offsets.get(rank, 0))
                text = f.read()
                self._stack_offsets[rank] = f.tell()
                return text
        except OSError:
            return ""
    def cause(self, failed: Iterable[int], consequence: Iterable[int]) -> tuple[int, str] | None:
        """(rank, one line) of the rank that stalled or left first, when the heartbeats show one.

        ``failed``: the ranks that exited non-zero; ``consequence``: those of them whose last
        words are a peer's loss (timeouts, closed connections), never a cause by themselves.
        """
        failed, consequence = set(failed), set(consequence)
        views = self.detector.views
        if self.killed:
            rank = min(self.killed, key=lambda r: (views[r].changed_at, r))
            return rank, (f"rank {rank} (pid {views[rank].pid}) stalled: {self.killed[rank][1]}; it was at "
                          f"{describe_position(views[rank].value)}; killed it (SIGKILL)")
        if not failed or failed - consequence:
            return None
        early = [v for v in views.values() if v.value.get("state") == "exited"
                 or (v.rank not in failed and v.gone_at is not None)]
        if early:
            v = min(early, key=lambda v: (v.changed_at, v.rank))
            how = "exit code 0" if v.rank not in failed else "its script ended; stopped during its exit"
            others = sorted(failed - {v.rank})
            return v.rank, (f"rank {v.rank} (pid {v.pid}) exited early ({how}) while ranks {others} were still "
                            f"running collectives; its last was {describe_position(v.value)}. If ranks have "
                            "different amounts of data, call join() on the DataParallel model or optimizer when a "
                            "rank runs out (or make every rank run the same number of steps)")
        now = time.monotonic()
        silent = [v for v in views.values() if v.silent_s(now) >= 5.0 and v.value.get("state") != "exited"]
        if silent:
            v = min(silent, key=lambda v: v.changed_at)
            return v.rank, (f"rank {v.rank} (pid {v.pid}) stalled: stopped responding {v.silent_s(now):.0f} s "
                            f"before the end; it was at {describe_position(v.value)}")
        k, behind = self.detector.behind()
        if behind:
            v = behind[0]
            return v.rank, (f"rank {v.rank} (pid {v.pid}) never reached collective #{k} that the others waited "
                            f"in; it was running, at {describe_position(v.value)}")
        return None


class ElasticStalls:
    """For the elastic supervisor: the workers (by worker id) to treat as lost because they stalled.

    With ``--stall-timeout S``: a worker silent for S seconds, or behind a collective every other
    member has waited in that long (:meth:`StallDetector.stalled`). Without it, only a worker whose
    heartbeat has stopped is lost: after ``silent_s`` when its process cannot be running (stopped,
    a zombie, or not on this host, where its state cannot be read), after ``busy_s`` (at least
    15 s) when it is here and running or sleeping: a heartbeat thread starved on a loaded host is
    not a frozen worker. A slow worker that still beats is left to the collective ``--timeout``.
    """

    BUSY_S = 15.0  # the silence a worker this host sees running or sleeping gets (the rule before issue 43)

    def __init__(self, store, timeout_s: float | None, silent_s: float = 15.0) -> None:
        self.detector = StallDetector(store, [])
        self.timeout_s, self.silent_s = timeout_s, silent_s
        self.busy_s = max(silent_s, self.BUSY_S)

    def lost(self, wids: Iterable[str]) -> list[Stall]:
        self.detector.ranks = list(wids)
        if self.timeout_s:
            return self.detector.stalled(self.timeout_s)
        self.detector.poll()
        return [s for s in self.detector.silent_stalls(self.silent_s) if s.rank in self.detector.ranks
                and (s.since_s >= self.busy_s or process_state(s.pid) not in ("R", "S", "D", "I"))]

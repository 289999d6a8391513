"""Stalls, early exits and the heartbeat: the launcher names the rank behind a hang, first.

Two `phalanx run` jobs of 2 ranks (a DataParallel MLP): rank 1 freezes itself (SIGSTOP),
and rank 1 returns early (exit 0). The rest runs in-process or on `phalanx.run` ranks.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

PHALANX = [sys.executable, "-m", "phalanx"]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import phalanx as px
    px.init()
    mode, marker = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = px.DataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.monotonic()
    for step in range(100000):
        # after 2.5 s, so that a heartbeat (every 1 s) has shown some training first
        if px.rank() == 1 and time.monotonic() - started > 2.5:
            with open(marker, "w") as f:
                f.write(str(time.time()))
            if mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            sys.exit(0)  # mode "leave": the uneven-data bug
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.02)
""")


def _phalanx_run(tmp_path, mode, *flags):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    marker = tmp_path / f"{mode}.time"
    proc = subprocess.run(PHALANX + ["run", "-np", "2", *flags, sys.executable, str(script), mode, str(marker)],
                          capture_output=True, text=True, timeout=240)
    ended = time.time()
    return proc, float(marker.read_text()) if marker.exists() else None, ended


def _report(stderr: str) -> list[str]:
    """The launcher's final report: from its first root-cause line to the end."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("phalanx: rank ")]
    assert starts, f"no failure report in:\n{stderr[-3000:]}"
    return lines[starts[0]:]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    return _phalanx_run(tmp_path_factory.mktemp("freeze"), "freeze", "--timeout", "15", "--stall-warning", "4")


def test_frozen_rank_is_named_as_stalled_and_the_job_ends(frozen):
    proc, froze_at, ended = frozen
    assert froze_at is not None, proc.stderr[-3000:]
    assert proc.returncode != 0
    report = _report(proc.stderr)
    assert report[0].startswith("phalanx: rank 1 "), report
    assert "stalled" in report[0] and "process state T (stopped)" in report[0], report[0]
    assert "allreduce" in report[0] or "collective #" in report[0], report[0]  # what it was doing
    assert any(line.strip().startswith("rank 0 (pid") for line in report[1:]), report  # folded, one line
    # No 30 s SIGTERM grace for the stopped rank: the goal is --timeout + 10 s (seen here 5-11 s past
    # the timeout under load 9-11, launcher exit included); the bound is generous
    # for a loaded CI box and still fails the old behaviour (timeout + 30 s grace + teardown).
    assert ended - froze_at < 15 + 25, f"ended {ended - froze_at:.0f} s after the freeze"


def test_stall_warning_block_names_ranks_and_shows_the_stack(frozen):
    proc, _, _ = frozen
    err = proc.stderr
    assert "phalanx: stall warning:" in err, err[-3000:]
    # one block per stall episode: on a loaded machine the first may come before rank 0's heartbeat
    # says it waits (rank 1 silent alone); a later block of the same stall must name both
    blocks = ["phalanx: stall warning:" + b for b in err.split("phalanx: stall warning:")[1:]]
    full = [b for b in blocks if "rank 1 (pid" in b and "stopped responding" in b and "T (stopped)" in b
            and "rank 0 (pid" in b and "waiting in" in b and "--- rank 0" in b]
    assert full, "no stall block names rank 1 stopped and rank 0 waiting, with its stack:\n" + err[-4000:]
    stack = full[0][full[0].index("--- rank 0"):]
    assert "train.py" in stack and "most recent call first" in stack, stack[:2000]  # rank 0's own Python stack


def test_early_exit_is_named_as_the_cause_with_the_join_hint(tmp_path):
    proc, left_at, _ = _phalanx_run(tmp_path, "leave", "--timeout", "30")
    assert left_at is not None, proc.stderr[-3000:]
    assert proc.returncode != 0
    report = _report(proc.stderr)
    assert report[0].startswith("phalanx: rank 1 ") and "exited early" in report[0], report
    assert "join()" in report[0], report[0]
    assert any(line.strip().startswith("rank 0 (pid") for line in report[1:]), report


def _record_body():
    import phalanx as px
    from phalanx.runtime.heartbeat import RECORD, Heartbeat

    start = RECORD.seq
    px.allreduce(torch.ones(3, 2), name="grad.w")
    h = px.allgather(torch.ones(2), name="ids", async_op=True)
    h.wait()
    px.barrier()
    entries = [e for e in RECORD.entries if e[0] > start]
    store = torch.distributed.HashStore()
    beat = Heartbeat(store, px.rank())
    beat.publish()
    value = json.loads(store.get(f"phalanx/heartbeat/{px.rank()}"))
    beat.stop("exited")
    last = json.loads(store.get(f"phalanx/heartbeat/{px.rank()}"))
    dp = px.DataParallel(torch.nn.Linear(4, 2))
    mark = RECORD.seq
    for _ in range(3):  # past the first step: the buckets' plan is fixed, the unchecked fast path runs
        dp(torch.ones(2, 4)).sum().backward()
    dp_names = sorted({(e[1], e[2] or "") for e in RECORD.entries if e[0] > mark})
    return [[e[0] - start, e[1], e[2], [list(s) for s in e[3]], e[5] is not None and e[5] >= e[4]]
            for e in entries], value, last["state"], os.getpid(), dp_names


def test_heartbeat_record_contents():
    results = distributed(_record_body, np=2, timeout=120)
    for rank, (entries, value, last_state, pid, dp_names) in enumerate(results):
        # DP buckets are named in the record in the steady state too (a "behind" report names them)
        assert ("allreduce", "dp.bucket0") in dp_names and ("collective", "") not in dp_names, dp_names
        assert entries == [[1, "allreduce", "grad.w", [[3, 2]], True], [2, "allgather", "ids", [[2]], True],
                           [3, "barrier", None, [], True]], entries
        assert value["rank"] == rank and value["pid"] == pid and value["state"] == "running"
        assert value["seq"] == value["done"] and value["op"] == "barrier"
        assert [r[1] for r in value["recent"][-3:]] == ["allreduce", "allgather", "barrier"]
        assert last_state == "exited"


def _leaves_early():
    import phalanx as px

    if px.rank() == 1:
        return "left"  # the uneven-data bug: this rank's loop ended first
    for _ in range(100):
        px.allreduce(torch.ones(1))
    return "finished"


def test_phalanx_run_names_a_rank_that_returned_early():
    from phalanx.launcher.spawn import RankError

    with pytest.raises(RankError) as err:
        distributed(_leaves_early, np=2, env={"PHALANX_TIMEOUT": "5"}, timeout=120)
    assert str(err.value).startswith("rank 1 returned while ranks [0] were still running collectives"), err.value
    assert err.value.rank == 1 and "join()" in str(err.value).splitlines()[0]


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_detector_names_silent_and_behind_ranks():
    from phalanx.launcher.stall import StallDetector

    store, clock, pid = torch.distributed.HashStore(), _Clock(), os.getpid()  # pid: a live process

    def beat(rank, n, **value):
        store.set(f"phalanx/heartbeat/{rank}", json.dumps({"rank": rank, "pid": pid, "beat": n, **value}))

    detector = StallDetector(store, ranks=[0, 1, 2], clock=clock)
    beat(0, 1, state="waiting", seq=9, at=9, op="allreduce", waited_s=0.0)
    beat(1, 1, state="running", seq=8, at=8, op="allreduce")
    beat(2, 1, state="waiting", seq=9, at=9, op="allreduce", waited_s=0.0)
    assert detector.stalled(timeout_s=5) == []
    clock.now += 6  # ranks 0 and 2 keep beating while they wait; rank 1 keeps beating but never arrives
    beat(0, 2, state="waiting", seq=9, at=9, op="allreduce", waited_s=6.0)
    beat(1, 2, state="running", seq=8, at=8, op="allreduce")
    beat(2, 2, state="waiting", seq=9, at=9, op="allreduce", waited_s=6.0)
    stalls = detector.stalled(timeout_s=5)
    assert [s.rank for s in stalls] == [1] and "never reached collective #9" in stalls[0].reason, stalls
    clock.now += 6  # now rank 2 stops beating too
    beat(0, 3, state="waiting", seq=9, at=9, op="allreduce", waited_s=12.0)
    beat(1, 3, state="running", seq=8, at=8, op="allreduce")
    stalls = {s.rank: s for s in detector.stalled(timeout_s=5)}
    assert set(stalls) == {1, 2} and "stopped responding" in stalls[2].reason, stalls


def test_behind_is_judged_within_the_waited_collectives_group():
    from phalanx.launcher.stall import StallDetector

    store, clock, pid = torch.distributed.HashStore(), _Clock(), os.getpid()

    def beat(rank, n, **value):
        store.set(f"phalanx/heartbeat/{rank}", json.dumps({"rank": rank, "pid": pid, "beat": n, **value}))

    detector = StallDetector(store, ranks=[0, 1, 2], clock=clock)
    for n in (1, 2):  # rank 0 waits in the 5th collective of group {0, 1}; rank 1 ran more world
        # collectives (a higher seq) but only 4 of that group's; rank 2 is not in the group at all
        beat(0, n, state="waiting", seq=8, at=8, group="0,1", gat=5, groups={"world": 3, "0,1": 5},
             op="allreduce", waited_s=6.0 * (n - 1))
        beat(1, n, state="running", seq=12, at=12, group="world", gat=8, groups={"world": 8, "0,1": 4},
             op="allreduce")
        beat(2, n, state="running", seq=3, at=3, group="world", gat=3, groups={"world": 3}, op="allreduce")
        if n == 1:
            assert detector.stalled(timeout_s=5) == []
            clock.now += 6
    stalls = detector.stalled(timeout_s=5)
    assert [s.rank for s in stalls] == [1], stalls  # by global seq numbers: rank 2, the wrong one
    assert "never reached collective #5 of group [0,1]" in stalls[0].reason, stalls
    beat(1, 3, state="waiting", seq=13, at=13, group="0,1", gat=5, groups={"world": 8, "0,1": 5},
         op="allreduce", waited_s=0.0)  # rank 1 arrives: nobody is behind, rank 2 least of all
    detector.poll()
    assert detector.behind()[1] == [], detector.behind()


def test_warning_for_a_rank_both_waiting_and_silent():
    """A rank stopped inside a collective is waiting (its last heartbeat) and silent at once: one block."""
    import io

    from phalanx.launcher.stall import Watcher

    store, clock, pid, out = torch.distributed.HashStore(), _Clock(), os.getpid(), io.StringIO()

    def beat(rank, n, **value):
        store.set(f"phalanx/heartbeat/{rank}", json.dumps({"rank": rank, "pid": pid, "beat": n, **value}))

    watcher = Watcher(store, ranks=[0, 1], stall_warning_s=5, out=out)
    watcher.detector.clock = clock
    beat(0, 1, state="waiting", seq=9, at=9, op="allreduce", waited_s=0.0)
    beat(1, 1, state="waiting", seq=9, at=9, op="allreduce", waited_s=0.0)
    watcher.detector.poll()
    clock.now += 6  # rank 0 beats on; rank 1 froze in the collective
    beat(0, 2, state="waiting", seq=9, at=9, op="allreduce", waited_s=6.0)
    watcher.detector.poll()
    watcher._warn()
    watcher._warn()  # the same episode: not printed twice
    assert out.getvalue().count("phalanx: stall warning:") == 1, out.getvalue()


def test_elastic_workers_beat_under_their_worker_id():
    from phalanx.launcher.stall import StallDetector
    from phalanx.runtime.heartbeat import Heartbeat

    store, clock = torch.distributed.HashStore(), _Clock()
    Heartbeat(store, rank=0, ident="w3").publish()  # rank 0 now, worker w3 for the life of the job
    detector = StallDetector(store, ranks=["w3"], clock=clock)
    assert detector.poll()["w3"].value["rank"] == 0 and detector.stalled(timeout_s=5) == []
    clock.now += 6
    assert [s.rank for s in detector.stalled(timeout_s=5)] == ["w3"]


def test_stall_flags_are_checked():
    proc = subprocess.run(PHALANX + ["run", "-np", "2", "--stall-warning", "0", sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--stall-warning must be positive" in proc.stderr, proc.stderr


if not hasattr(signal, "SIGSTOP"):  # pragma: no cover
    pytest.skip("needs POSIX signals", allow_module_level=True)


def test_a_sigabrt_after_the_script_ended_is_told_apart():
    """The elastic supervisor counts a worker as finished when it aborted in teardown after its script
    ended (last heartbeat "exited"), and as failed otherwise."""
    import signal as sig

    from phalanx.launcher.stall import ended_then_aborted

    store = torch.distributed.HashStore()
    store.set("phalanx/heartbeat/w0", json.dumps({"rank": 0, "pid": 1, "beat": 9, "state": "exited"}))
    store.set("phalanx/heartbeat/w1", json.dumps({"rank": 1, "pid": 2, "beat": 9, "state": "failed"}))
    assert ended_then_aborted(store, "w0", -sig.SIGABRT) and ended_then_aborted(store, "w0", 128 + sig.SIGABRT)
    assert not ended_then_aborted(store, "w0", 1)  # a plain failure stays one
    assert not ended_then_aborted(store, "w1", -sig.SIGABRT)  # the script itself failed
    assert not ended_then_aborted(store, "w2", -sig.SIGABRT)  # no heartbeat: a failure

"""The frozen-worker rule of in-process elastic: a worker whose heartbeat stopped for
``--heartbeat-timeout`` / ``PHALANX_HEARTBEAT_TIMEOUT`` seconds (default 3) is lost when its process
cannot be running (stopped, gone); one this host sees running or sleeping only after 15 s (a starved
heartbeat thread on a loaded host). (With real ranks: tests/services/test_elastic_membership.py's
frozen worker, SIGSTOPped, is killed and replaced.)"""

import argparse
import json
import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from phalanx.launcher.stall import ElasticStalls
from phalanx.settings import ElasticSettings

pytestmark = pytest.mark.unit


class _Clock:
    now = 100.0

    def __call__(self):
        return self.now


def _stalls(silent_s):
    store, clock = torch.distributed.HashStore(), _Clock()
    stalls = ElasticStalls(store, None, silent_s=silent_s)
    stalls.detector.clock = clock

    def beat(wid, n, pid=None):  # pid: this live process unless given
        store.set(f"phalanx/heartbeat/{wid}", json.dumps({"rank": wid, "pid": pid or os.getpid(), "beat": n}))

    return stalls, clock, beat


def _wait_stopped(pid, within_s=30.0):
    """SIGSTOP takes effect when the target next runs (its own context enters the stopped state):
    on a loaded host that is not at once, and the rule under test reads the state from /proc."""
    deadline = time.monotonic() + within_s
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within {within_s} s of SIGSTOP"
        time.sleep(0.01)


def test_a_worker_silent_for_the_heartbeat_timeout_is_lost_and_not_before():
    timeout = ElasticSettings.one("heartbeat_timeout_s", {})
    assert timeout == 3.0
    stalls, clock, beat = _stalls(timeout)
    frozen = subprocess.Popen(["sleep", "60"])  # w1's process: SIGSTOPped, as a frozen worker's
    try:
        frozen.send_signal(signal.SIGSTOP)
        _wait_stopped(frozen.pid)
        beat("w0", 1), beat("w1", 1, frozen.pid), beat("w2", 1)  # w2: silent too, but its process runs
        assert stalls.lost(["w0", "w1", "w2"]) == []
        for n in range(2, 6):  # w0 beats every 0.5 s; w1 and w2 fell silent after their first beat
            clock.now += 0.5
            beat("w0", n)
            assert stalls.lost(["w0", "w1", "w2"]) == [], n
        clock.now += 1.0   # w1 and w2 silent 3.0 s now: the stopped one is lost, the running one not yet
        beat("w0", 6)
        lost = stalls.lost(["w0", "w1", "w2"])
        assert [s.rank for s in lost] == ["w1"] and "process state T (stopped)" in lost[0].reason, lost
        clock.now += 12.0  # w2 silent 15 s: a running process that long without a beat is lost too
        beat("w0", 7)
        assert sorted(s.rank for s in stalls.lost(["w0", "w1", "w2"])) == ["w1", "w2"]
    finally:
        frozen.kill()
        frozen.wait()


def test_the_setting_is_read_from_the_environment_and_checked():
    assert ElasticSettings.one("heartbeat_timeout_s", {"PHALANX_HEARTBEAT_TIMEOUT": "7.5"}) == 7.5
    with pytest.raises(Exception, match="PHALANX_HEARTBEAT_TIMEOUT"):
        ElasticSettings.one("heartbeat_timeout_s", {"PHALANX_HEARTBEAT_TIMEOUT": "-1"})


def test_a_bad_heartbeat_timeout_flag_is_one_line():
    from phalanx.launcher.launch_options import stall_launch_options

    args = argparse.Namespace(stall_warning=60.0, stall_timeout=None, heartbeat_timeout=0.0)
    with pytest.raises(ValueError, match=r"^--heartbeat-timeout must be positive seconds, got 0$"):
        stall_launch_options(args)

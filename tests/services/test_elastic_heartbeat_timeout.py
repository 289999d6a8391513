"""The frozen-worker rule of in-process elastic: a worker whose heartbeat stopped for
``--heartbeat-timeout`` / ``PHALANX_HEARTBEAT_TIMEOUT`` seconds (default 3) is lost. (With real
ranks: tests/services/test_elastic_membership.py's frozen worker, SIGSTOPped, is killed and replaced.)"""

import argparse
import json
import os

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

    def beat(wid, n):  # pid: this live process
        store.set(f"phalanx/heartbeat/{wid}", json.dumps({"rank": wid, "pid": os.getpid(), "beat": n}))

    return stalls, clock, beat


def test_a_worker_silent_for_the_heartbeat_timeout_is_lost_and_not_before():
    timeout = ElasticSettings.one("heartbeat_timeout_s", {})
    assert timeout == 3.0
    stalls, clock, beat = _stalls(timeout)
    beat("w0", 1), beat("w1", 1)
    assert stalls.lost(["w0", "w1"]) == []
    for n in range(2, 6):  # w0 beats every 0.5 s; w1 stopped after its first beat
        clock.now += 0.5
        beat("w0", n)
        assert stalls.lost(["w0", "w1"]) == [], n
    clock.now += 1.0   # w1 silent 3.0 s now
    beat("w0", 6)
    lost = stalls.lost(["w0", "w1"])
    assert [s.rank for s in lost] == ["w1"] and "stopped responding" in lost[0].reason, lost


def test_the_setting_is_read_from_the_environment_and_checked():
    assert ElasticSettings.one("heartbeat_timeout_s", {"PHALANX_HEARTBEAT_TIMEOUT": "7.5"}) == 7.5
    with pytest.raises(Exception, match="PHALANX_HEARTBEAT_TIMEOUT"):
        ElasticSettings.one("heartbeat_timeout_s", {"PHALANX_HEARTBEAT_TIMEOUT": "-1"})


def test_a_bad_heartbeat_timeout_flag_is_one_line():
    from phalanx.launcher.launch_options import stall_launch_options

    args = argparse.Namespace(stall_warning=60.0, stall_timeout=None, heartbeat_timeout=0.0)
    with pytest.raises(ValueError, match=r"^--heartbeat-timeout must be positive seconds, got 0$"):
        stall_launch_options(args)

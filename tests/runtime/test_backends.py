"""A group made under a c10d name registered over gloo (phalanx_staged, an elastic admission's) is
treated as gloo: Horovod's dtypes gloo lacks travel wider, the topology says gloo."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "staged_group.py")


def test_a_staged_group_is_gloo_to_every_path_that_picks_by_engine(tmp_path):
    procs = [subprocess.Popen([sys.executable, JOB, str(r), str(tmp_path / "store")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for out, _ in outs:
        got = json.loads(out.splitlines()[-1])
        assert got["name"] == "phalanx_staged" and got["engine"] == got["topology"] == "gloo", got
        # one process's reference: rank 0 sends [1, 2, 300], rank 1 twice that
        assert got["torch.int16"] == ["torch.int16", [3, 6, 900]], got
        assert got["torch.uint16"] == ["torch.uint16", [3, 6, 900]], got

"""DataParallel's arguments are checked when it is built, each bad one named in one line."""

import subprocess
import sys
import textwrap

import pytest

from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

def _build_with_each_bad_argument():
    import torch

    import phalanx as px

    model, said = torch.nn.Linear(2, 2), []
    for kw in ({"algorithm": "rign"}, {"bucket_mb": "25"}, {"op": "mean"}, {"bucket_mb": -1}):
        try:
            px.DataParallel(model, **kw)
            said.append(f"ACCEPTED {kw}")
        except ValueError as err:          # SettingsError is a ValueError
            said.append(f"{type(err).__name__} {err}")
    px.DataParallel(model, algorithm="ring", bucket_mb=1)
    return said + ["GOOD ARGUMENTS BUILD"]


def test_bad_arguments_are_refused_at_construction_naming_the_argument():
    # a rank forked from the test harness's server (torch already imported): no interpreter of its own to start
    (lines,) = distributed(_build_with_each_bad_argument, np=1, timeout=120)
    assert lines[:4] == [
        "SettingsError algorithm='rign' is not accepted; accepted: auto | ring | hierarchical | flat",
        "SettingsError bucket_mb='25' is not a number; accepted: a number > 0",
        "SettingsError op='mean' is not accepted; accepted: px.Average | px.Sum (ReduceOp.AVERAGE | ReduceOp.SUM)",
        "SettingsError bucket_mb=-1 is not accepted; accepted: a number > 0",
    ], lines
    assert lines[4] == "GOOD ARGUMENTS BUILD"


def test_a_bad_bucket_size_in_the_environment_is_one_line():
    script = "import torch, phalanx as px\npx.init()\npx.DataParallel(torch.nn.Linear(2, 2))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PHALANX_BUCKET_MB": "big"})
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == "phalanx: error: PHALANX_BUCKET_MB='big' is not a number; accepted: a number > 0"
    assert "Traceback" not in out.stderr


def test_the_bucket_plan_and_compression_are_logged_at_info_once():
    script = textwrap.dedent("""
        import torch, phalanx as px
        px.init()
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
        px.DataParallel(model, bucket_mb=0.5, compression="fp16")
    """)
    env = {**__import__("os").environ}
    env.pop("PHALANX_LOG_LEVEL", None)
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    loud = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "PHALANX_LOG_LEVEL": "INFO"})
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    assert "bucket plan" not in quiet.stderr
    plan = [line for line in loud.stderr.splitlines() if "bucket plan" in line]
    assert len(plan) == 1, loud.stderr
    # reverse order: the last layer and the first bias (4 + 2048 + 512 floats), then the 1 MB weight
    assert "bucket plan: 2 buckets, sizes 0.00978, 1 MB" in plan[0], plan[0]
    assert "compression fp16" in plan[0] and "algorithm flat" in plan[0], plan[0]

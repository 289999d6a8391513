"""DataParallel's arguments are checked when it is built, each bad one named in one line."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, phalanx as px
    px.init()
    model = torch.nn.Linear(2, 2)
    for kw in ({"algorithm": "rign"}, {"bucket_mb": "25"}, {"op": "mean"}, {"bucket_mb": -1}):
        try:
            px.DataParallel(model, **kw)
            print("ACCEPTED", kw)
        except ValueError as err:          # SettingsError is a ValueError
            print(type(err).__name__, err)
    px.DataParallel(model, algorithm="ring", bucket_mb=1)
    print("GOOD ARGUMENTS BUILD")
""")


def test_bad_arguments_are_refused_at_construction_naming_the_argument():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == [
        "SettingsError algorithm='rign' is not accepted; accepted: auto | ring | hierarchical | flat",
        "SettingsError bucket_mb='25' is not a number; accepted: a number > 0",
        "SettingsError op='mean' is not accepted; accepted: px.Average | px.Sum (ReduceOp.AVERAGE | ReduceOp.SUM)",
        "SettingsError bucket_mb=-1 is not accepted; accepted: a number > 0",
    ], out.stdout
    assert lines[4] == "GOOD ARGUMENTS BUILD"


def test_a_bad_bucket_size_in_the_environment_is_one_line():
    script = "import torch, phalanx as px\npx.init()\npx.DataParallel(torch.nn.Linear(2, 2))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PHALANX_BUCKET_MB": "big"})
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == "phalanx: error: PHALANX_BUCKET_MB='big' is not a number; accepted: a number > 0"
    assert "Traceback" not in out.stderr

"""The ``phalanx`` command driven as a user drives it (subprocess): bad input gets one line and exit 2,
torchrun's spellings work, a bare ``python`` is the launcher's own, logs only where asked."""

import os
import subprocess
import sys
import textwrap

import pytest

from phalanx.cli.bench_cmd import parse_size

pytestmark = pytest.mark.ranks

PHALANX = [sys.executable, "-m", "phalanx"]


def _run(args, timeout=120, env=None):
    return subprocess.run(PHALANX + args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# The user errors run in one fresh interpreter through the console script's own ``main`` (one
# torch import instead of one per case); test_a_user_error_in_a_real_process checks the process.
_DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from phalanx.cli.main import main
    results = []
    for argv in json.loads(sys.argv[1]):
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
            except BaseException:  # noqa: BLE001  (reported as the case's failure)
                code = None
                traceback.print_exc()
        results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
    print(json.dumps(results))
""")

USER_ERRORS = [
    (["run", "-np", "0", "true"], "-np must be at least 1, got 0"),
    (["run", "-np", "-1", "true"], "-np must be at least 1, got -1"),
    (["run", "-np", "two", "true"], "invalid int value: 'two'"),
    (["run", "-np", "2"], "no command given"),
    (["run", "-np", "4", "-H", "localhost:2", "true"], "exceeds the 2 slots"),
    (["run", "-H", "localhost:x", "true"], "host:slots"),
    (["run", "-np", "4", "--min-np", "5", "true"], "--min-np 5 is larger than -np 4"),
    (["run", "--nnodes", "2", "--nproc-per-node", "2", "true"], "needs --rdzv-endpoint"),
    (["run", "--nnodes", "x", "true"], "--nnodes 'x'"),
    (["run", "--nnodes", "2", "-np", "4", "--rdzv-endpoint", "h:1", "true"], "give each host's count"),
    (["run", "--nproc-per-node", "2", "-np", "3", "true"], "disagree"),
    (["run", "--tee", "3", "true"], "--tee (a torchrun flag) has no phalanx counterpart"),
    (["run", "--local-ranks-filter", "x", "true"], "--local-ranks-filter 'x'"),
    (["demo", "--np", "0"], "--np must be at least 1, got 0"),
    (["demo", "--np", "3"], "--batch 128 (the global batch) is not divisible by --np 3"),
    (["bench", "allreduce", "--sizes", "4kb,x"], "cannot read 'x'"),
    (["bench", "allreduce", "--algorithms", "rign"], "--algorithms: rign; choose from"),
    (["plan", "--model", "torch.nn:Linear"], "Linear() failed (TypeError"),
    (["plan", "--model", "torch.nn"], "use MODULE:FACTORY"),
    (["plan", "--params", "1e6", "--hosts", "0"], "--hosts must be at least 1, got 0"),
    (["plan", "--params", "1e6", "--memory-gb", "0"], "--memory-gb must be positive"),
    (["report", "--workers", "2,3"], "--workers must include 1"),
    (["nonsense"], "invalid choice: 'nonsense'"),
]


@pytest.fixture(scope="module")
def user_errors():
    import json
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([a for a, _ in USER_ERRORS])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip((tuple(a) for a, _ in USER_ERRORS), json.loads(proc.stdout.splitlines()[-1])))


@pytest.mark.parametrize("args, says", USER_ERRORS)
def test_a_user_error_is_one_line_and_exit_2(args, says, user_errors):
    got = user_errors[tuple(args)]
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 2, (got["code"], got["stderr"])
    assert "Traceback" not in got["stderr"] + got["stdout"]
    assert len(lines) == 1, got["stderr"]
    assert says in lines[0], lines[0]


def test_a_user_error_in_a_real_process():
    proc = _run(["run", "-np", "0", "true"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == "phalanx run: -np must be at least 1, got 0", proc.stderr


def test_version_and_help_defaults():
    version = _run(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("phalanx 0.1.0 (torch "), version.stdout
    demo_help = _run(["demo", "--help"]).stdout
    assert "(default 128)" in " ".join(demo_help.split())  # --batch: the help names the real default


def test_sizes_read_like_nccl_tests():
    assert parse_size("4kb") == parse_size("4KB") == parse_size("4K") == parse_size("4KiB") == 4096
    assert parse_size("1M") == parse_size("1MB") == 1 << 20 and parse_size("2G") == 2 << 30 and parse_size("7") == 7
    for bad in ("x", "4TB", "0", "-1MB", "1.5MB"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_size(bad)


def _fake_python(tmp_path):
    """A `python` first on PATH that is not the launcher's (as an unactivated venv's would be)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text("#!/bin/sh\necho WRONG PYTHON; exit 3\n")
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_torchrun_spellings_rank_filter_and_horovodrun_log_layout(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, phalanx as px\npx.init()\n"
                      f"print(px.rank(), px.size(), sys.executable == {sys.executable!r})\n")
    scratch, logs = tmp_path / "tmp", tmp_path / "logs"
    scratch.mkdir()
    env = {**_fake_python(tmp_path), "TMPDIR": str(scratch)}
    # torchrun's line with torchrun replaced; a .py command runs with the launcher's Python, as in torchrun
    proc = _run(["run", "--standalone", "--nproc_per_node=2", "--rdzv-backend", "c10d", "--local-ranks-filter", "1",
                 "--output-filename", str(logs), "--verbose", str(script)], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[1]: 1 2 True"]  # rank 0 filtered out of the console
    assert "joined: rank 1 of 2" in proc.stderr and "rank 0 of 2" not in proc.stderr
    # horovodrun's --output-filename layout, every rank kept
    assert (logs / "rank.0" / "stdout").read_text().strip() == "0 2 True"
    assert (logs / "rank.1" / "stdout").read_text().strip() == "1 2 True"
    assert "joined: rank 0 of 2, local rank 0 of 2, host 0 of 1; backend gloo" in (logs / "rank.0" / "stderr").read_text()
    assert not list(scratch.glob("phalanx-logs-*")), "the launcher's temporary logs were left behind"


def test_bare_python_is_the_launchers_and_a_failure_prints_one_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch 17")
        time.sleep(60)   # rank 0 is stopped by the launcher
    """))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _run(["run", "-np", "2", "python", str(script)], env={**_fake_python(tmp_path), "TMPDIR": str(scratch)})
    out = proc.stdout + proc.stderr
    assert "WRONG PYTHON" not in out
    assert proc.returncode == 1, out
    # the traceback once, and its last line again on the summary's first line: the one line to read
    assert out.count("Traceback") == 1 and out.count("ValueError: bad batch 17") == 2, out
    assert "phalanx: rank 1 (local rank 1" in proc.stderr, proc.stderr
    assert "failed first: exit code 1: ValueError: bad batch 17" in proc.stderr, proc.stderr
    assert not list(scratch.glob("phalanx-logs-*")), "the launcher's temporary logs were left behind"
    # a path is taken as given: the user's way to run another interpreter
    other = _run(["run", "-np", "1", str(tmp_path / "bin" / "python")])
    assert other.returncode == 3 and "[0]: WRONG PYTHON" in other.stdout


def test_torchrun_multi_node_line_meets_at_the_endpoint(tmp_path):
    # torchrun's two-machine line, both "machines" here: each runs phalanx run itself, node 0 holds the store
    from phalanx.launcher.spawn import free_port

    script = tmp_path / "ok.py"
    script.write_text("import phalanx as px, torch\npx.init()\n"
                      "print('rank', px.rank(), 'of', px.size(), px.allreduce(torch.ones(1), op=px.Sum).item())\n")
    line = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    other = subprocess.Popen(PHALANX + line + ["--node-rank", "1", str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        first = _run(line + ["--node-rank", "0", str(script)])
        out, err = other.communicate(timeout=120)
    finally:
        other.kill()
    assert first.returncode == 0 and other.returncode == 0, first.stderr + err
    assert {first.stdout.split()[2], out.split()[2]} == {"0", "1"}  # one rank each, both of 2
    assert "of 2 2.0" in first.stdout and "of 2 2.0" in out

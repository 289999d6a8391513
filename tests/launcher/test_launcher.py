"""``phalanx run``: rank-prefixed output, failure reports, no orphans; and the demo."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from phalanx.launcher.hosts import parse_hostfile, parse_hosts

pytestmark = pytest.mark.ranks

PHALANX = [sys.executable, "-m", "phalanx"]


def _run(args, timeout=120, **kw):
    return subprocess.run(PHALANX + args, capture_output=True, text=True, timeout=timeout, **kw)


# One `phalanx run -np 2` job (a good run with the default flags) serves three tests below: the prefixed
# output, Horovod's variables, the addresses the job listens on. Each reads its own lines of the output.
_GOOD_JOB = textwrap.dedent("""
    import os, shutil, subprocess, sys, time, phalanx as px
    print("HVD", os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"], flush=True)
    px.init()
    if px.rank() == 0 and shutil.which("ss"):
        mine = {os.getpid(), os.getppid()}
        for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
            if any(f"pid={p}," in line for p in mine):
                print("LISTEN", line.split()[3])
    px.barrier()
    print(px.rank(), px.size())
    print("part one,", end="", flush=True); time.sleep(0.3); print(" part two", flush=True)
    print("err one,", end="", file=sys.stderr, flush=True); time.sleep(0.3); print(" err two", file=sys.stderr)
    print("last", end="")""")


@pytest.fixture(scope="module")
def good_job():
    return _run(["run", "-np", "2", "--", sys.executable, "-c", _GOOD_JOB], env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_run_prints_rank_and_size_with_prefixes(good_job):
    # also: a line written in two pieces (print(..., end="") then the rest, or any print under
    # PYTHONUNBUFFERED=1) is one line under one prefix, and a last line without a newline is kept
    # (TorchElastic's own follower printed "[0]: part one,[0]:  part two" and is not used)
    proc = good_job
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for r in (0, 1):
        own = [ln for ln in lines if ln.startswith(f"[{r}]: ") and not ln.startswith((f"[{r}]: HVD ", f"[{r}]: LISTEN "))]
        assert own == [f"[{r}]: {r} 2", f"[{r}]: part one, part two", f"[{r}]: last"], proc.stdout
        assert f"[{r}]: err one, err two" in proc.stderr.splitlines(), proc.stderr


def test_horovod_variables_are_exported(good_job):
    proc = good_job
    assert proc.returncode == 0, proc.stderr
    assert "[0]: HVD 0 2" in proc.stdout.splitlines() and "[1]: HVD 1 2" in proc.stdout.splitlines(), proc.stdout


def test_the_exec_shim_reads_settings_without_loading_torch():
    # every worker starts through phalanx/launcher/_exec.py, which execs the worker's command: loading
    # torch there (it did, through phalanx.settings, from issue 38 on) cost each worker ~2 s of CPU first
    import json

    import phalanx.launcher

    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import _exec
        env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
        _exec.worker_env(env)
        print(json.dumps([json.loads(env["TF_CONFIG"]), env["HOROVOD_RANK"], env["HOROVOD_LOCAL_SIZE"],
                          sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "phalanx"))]))
    """)
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(phalanx.launcher.__file__)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    config, rank, local_size, modules = json.loads(proc.stdout)
    assert config == {"cluster": {"worker": ["127.0.0.1:29501", "127.0.0.1:29502"]}, "task": {"type": "worker", "index": 1}}
    assert (rank, local_size) == ("1", "2")
    assert modules == ["phalanx", "phalanx.settings", "phalanx.settings.areas", "phalanx.settings.checks"], modules


def _descendants_of(pid):
    from phalanx.launcher.local import _children_map

    children, found, todo = _children_map(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def test_sigkill_of_one_worker_stops_the_job_fast_and_leaves_nothing(tmp_path):
    marker = tmp_path / "pids"
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])      # a grandchild that must not survive
        with open({str(marker)!r}, "a") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}\\n")
        if os.environ["RANK"] == "1":
            time.sleep(2)
            os.kill(os.getpid(), 9)
        time.sleep(300)
    """))
    # The survivor sleeps 300 s: the job ends only because the launcher stops it after the
    # SIGKILL, so subprocess's timeout (TimeoutExpired) is the hang check here, not a timing claim.
    proc = _run(["run", "-np", "2", sys.executable, str(script)], timeout=60)
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    time.sleep(0.5)
    pids = [int(p) for line in marker.read_text().split() for p in [line]]
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
    assert not alive, f"processes left behind: {alive}"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_failure_report_has_the_traceback_tail():
    proc = _run(["run", "-np", "2", sys.executable, "-c",
                 "import os\nif os.environ['RANK']=='1': raise ValueError('bad batch 17')\nimport time; time.sleep(30)"])
    assert proc.returncode == 1
    assert "rank 1" in proc.stderr and "exit code 1" in proc.stderr
    assert "ValueError: bad batch 17" in proc.stderr


def test_an_unreachable_host_is_explained():
    # (the other bad invocations, one line each: tests/launcher/test_cli.py)
    far = _run(["run", "-np", "2", "-H", "far-away.invalid:2", "true"])  # remote: fails fast at the ssh probe
    assert far.returncode == 255 and "far-away.invalid" in far.stderr and "cannot be reached by ssh" in far.stderr


def test_host_parsing(tmp_path):
    assert [(h.name, h.slots) for h in parse_hosts("a:2,b")] == [("a", 2), ("b", 1)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8\n\nnode3\n")
    assert [(h.name, h.slots) for h in parse_hostfile(str(hostfile))] == [("node1", 4), ("node2", 2), ("node3", 1)]
    hostfile.write_text("node1 slots=four\n")
    with pytest.raises(ValueError, match=":1"):
        parse_hostfile(str(hostfile))


def test_demo_trains_and_reports():
    # a short run reports its accuracy (it does not fail for having trained little), and the
    # ranks exit cleanly: no multiprocessing semaphore is left for the resource tracker to report
    proc = _run(["demo", "--np", "2", "--epochs", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "speedup" in proc.stdout and "test acc" in proc.stdout
    # like with like: the same cores a worker in both runs, and it says so (issue 38)
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert f"2 workers against 1, each worker on {threads} core(s) in both runs" in proc.stdout, proc.stdout
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_horovodrun_flags_are_honoured_or_named(tmp_path):
    # horovodrun's launch line with only the launcher swapped: settings reach the engine,
    # coordinator-only knobs are accepted with a warning that names them, MPI is refused.
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import torch, phalanx as px
        px.init()
        dp = px.DataParallel(torch.nn.Linear(4, 4))
        print(dp._engine.buckets.bucket_bytes, dp._engine.algorithm)
    """))
    logs = tmp_path / "logs"
    proc = _run(["run", "-np", "2", "--fusion-threshold-mb", "0.5", "--hierarchical-allreduce",
                 "--cycle-time-ms", "5", "--no-stall-check", "--output-filename", str(logs),
                 "--timeline-filename", str(tmp_path / "tl.json"), sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr
    assert f"[0]: {2**19} hierarchical" in proc.stdout and f"[1]: {2**19} hierarchical" in proc.stdout
    assert "ignoring --cycle-time-ms" in proc.stderr and "ignoring --no-stall-check" in proc.stderr
    assert (tmp_path / "tl.json").exists()
    assert (logs / "rank.1" / "stdout").read_text().strip() == f"{2**19} hierarchical"  # horovodrun's layout
    build = _run(["run", "-cb"])
    assert build.returncode == 0 and "[X] Gloo" in build.stdout and "[ ] MPI" in build.stdout
    mpi = _run(["run", "-np", "2", "--mpi", sys.executable, "-c", "pass"])
    assert mpi.returncode == 2 and "not MPI" in mpi.stderr


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to list listening sockets")
def test_job_services_listen_on_the_chosen_address_only(good_job):
    # The rendezvous store (hosted by the launcher) and the workers' own listeners: none on *.
    proc = good_job
    assert proc.returncode == 0, proc.stderr
    addrs = [line.split()[-1] for line in proc.stdout.splitlines() if "LISTEN" in line]
    assert addrs, proc.stdout  # the launcher's store at least
    assert all(a.startswith("127.0.0.1:") for a in addrs), addrs

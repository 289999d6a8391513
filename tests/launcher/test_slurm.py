"""``phalanx run`` inside a SLURM allocation, on a real SLURM cluster (tests/jobs/slurm_cluster.py), and host lists.

The host-list and allocation tables run anywhere; the cluster tests need root and slurm-wlm + munge
(skipped with the reason otherwise; scripts/install-test-deps.sh installs them).
"""

import os
import shutil
import subprocess
import sys

import pytest
from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm: the session's cluster fixture)

from phalanx.launcher.slurm import allocation, plan_nodes, srun_command
from phalanx.runtime import detect_environment
from phalanx.runtime.hostlist import expand_counts, expand_hostlist

pytestmark = pytest.mark.cluster

# Forms SLURM writes in SLURM_JOB_NODELIST, and what `scontrol show hostnames` makes of them.
HOSTLISTS = [
    ("n1", ["n1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu-[01-04,07],cpu[1-2]", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu1", "cpu2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[001-003,10-11],y", ["x001", "x002", "x003", "x10", "x11", "y"]),
    ("h[7]", ["h7"]),
    ("n[1-2],n1", ["n1", "n2", "n1"]),
]


@pytest.mark.parametrize("text,hosts", HOSTLISTS, ids=[h[0] for h in HOSTLISTS])
def test_hostlist_expands_like_scontrol(text, hosts):
    assert expand_hostlist(text) == hosts


def test_counts_and_bad_inputs_name_the_problem():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    assert expand_counts("1(x2)") == [1, 1]
    for bad, words in (("n[1-", "unclosed"), ("n[a-b]", "bad range"), ("n[3-1]", "backwards"), ("n1]", "without")):
        with pytest.raises(ValueError, match=words):
            expand_hostlist(bad)
    with pytest.raises(ValueError, match="2x3"):
        expand_counts("2x3")


def test_allocation_is_read_only_outside_a_step():
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[01-03],cpu1", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_JOB_CPUS_PER_NODE": "8(x3),4", "SLURM_PROCID": "0", "SLURM_NTASKS": "7"}
    alloc = allocation(job)
    assert (alloc.nodes, alloc.tasks, alloc.total) == (["gpu-01", "gpu-02", "gpu-03", "cpu1"], [2, 2, 2, 1], 7)
    assert allocation({**job, "SLURM_STEP_ID": "0"}) is None  # inside srun: the step is the launcher
    assert allocation({}) is None
    # an sbatch script's own SLURM_PROCID/SLURM_NTASKS describe the allocation: plain python there is one rank
    assert detect_environment(job).source == "single"
    assert detect_environment({**job, "SLURM_STEP_ID": "0"}).source == "slurm"
    assert plan_nodes(alloc, 7) == [("gpu-01", 2), ("gpu-02", 2), ("gpu-03", 2), ("cpu1", 1)]
    assert plan_nodes(alloc, 3) == [("gpu-01", 2), ("gpu-02", 1)]
    with pytest.raises(ValueError) as err:
        plan_nodes(alloc, 8)
    assert "\n" not in str(err.value) and "-np 8 is more than the 7 task(s) of SLURM job 7" in str(err.value)
    argv = srun_command(alloc, plan_nodes(alloc, 3), [], ["python", "t.py"])
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu-01,gpu-02"]
    assert "--cpus-per-task=8" in argv and "--input=all" in argv and argv[-3:] == ["--", "python", "t.py"]
    with pytest.raises(ValueError, match="lists 2 node"):
        allocation({**job, "SLURM_TASKS_PER_NODE": "2(x2)"})


def test_elastic_in_allocation_uses_its_nodes_through_srun_steps(monkeypatch):
    import phalanx.launcher.slurm as slurm_launcher
    from phalanx.launcher.slurm import elastic_options

    monkeypatch.setattr(slurm_launcher, "node_addresses", lambda names: {n: "127.0.0.1" for n in names})
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[01-03],cpu1", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_JOB_CPUS_PER_NODE": "8(x3),4"}
    opts = elastic_options(allocation(job), 7)
    assert opts["hosts"] == {"gpu-01": 2, "gpu-02": 2, "gpu-03": 2, "cpu1": 1}  # task counts are the slots
    assert opts["store_addr"] == "127.0.0.1" and opts["replace_failed"] is True  # NodeAddr; replaced, not set aside
    line = "cd /x; exec python -m phalanx.launcher.agent worker -- python t.py"
    argv = opts["ssh"].command("cpu1", line)
    assert argv[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=cpu1", "--overlap", "--input=all"]
    assert "--cpus-per-task=4" in argv and "--unset=SLURM_PROCID" in argv and argv[-3:] == ["sh", "-c", line]
    assert "--cpus-per-task=4" in opts["ssh"].command("gpu-01", line)  # 8 CPUs over its 2 tasks
    with pytest.raises(ValueError, match="-np 8 is more than the 7 task"):
        elastic_options(allocation(job), 8)


@needs_slurm
def test_hostlist_against_scontrol_show_hostnames(slurm):  # noqa: F811
    for text, _ in HOSTLISTS:
        res = slurm.run(["scontrol", "show", "hostnames", text])
        assert res.returncode == 0, res.stderr
        assert expand_hostlist(text) == res.stdout.split(), text


WHERE = "import os; print('worker', os.environ['RANK'], os.environ.get('SLURMD_NODENAME'), os.environ.get('SLURM_PROCID'))"


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):  # noqa: F811
    """This module's two allocations, started at once (the cluster holds both); each test checks its own."""
    where = tmp_path_factory.mktemp("slurm_jobs")
    run = [sys.executable, "-m", "phalanx", "run"]
    started = {"uneven": slurm.start(["salloc", "-N2", "-n3", *run, "python", "-c", WHERE], cwd=where),
               "too many": slurm.start(["salloc", "-N2", "-n2", *run, "-np", "3", "python", "-c", "pass"], cwd=where)}
    yield started
    for job in started.values():
        job.wait()


@needs_slurm
def test_uneven_allocation_fills_nodes_in_order_and_hides_the_agent_procid(jobs):
    # salloc -N2 -n3: SLURM_TASKS_PER_NODE=2,1, so n1 runs two workers and n2 one (the docs' tests cover 1 and 2
    # per node, and the parameters)
    res = jobs["uneven"].wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    workers = sorted(line.split(": ", 1)[1].split() for line in res.stdout.splitlines() if ": worker " in line)
    assert sorted(w[2] for w in workers) == ["n1", "n1", "n2"], res.stdout  # nodes filled in order
    # ranks: one contiguous block per node (TorchElastic orders the nodes' blocks by agent address)
    blocks = {node: sorted(int(w[1]) for w in workers if w[2] == node) for node in ("n1", "n2")}
    assert sorted(map(tuple, blocks.values())) in ([(0, 1), (2,)], [(0,), (1, 2)]), res.stdout
    assert {w[3] for w in workers} == {"None"}, res.stdout  # the agent step's SLURM_PROCID is not the worker's
    assert "different numbers of workers [2, 1]" in res.stderr


@needs_slurm
def test_np_more_than_the_allocation_is_one_line(jobs):
    res = jobs["too many"].wait()
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("phalanx")]
    assert lines == [lines[0]] and "-np 3 is more than the 2 task(s) of SLURM job" in lines[0], res.stderr


def test_allocation_without_srun_on_path_runs_here_with_one_line(tmp_path):
    # SLURM's variables but no srun (a container started inside the job): one warning, then this host
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sh", "env"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_dir / tool)
    env = {**os.environ, "PATH": str(bin_dir), "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "1(x2)"}
    for k in ("SLURM_STEP_ID", "SLURM_STEPID"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "phalanx", "run", "python", "-c",
                          "import phalanx as px; px.init(); print('size', px.size())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[0]: size 1" in res.stdout, res.stdout  # -np defaults to 1 here, as outside SLURM
    warnings = [ln for ln in res.stderr.splitlines() if "srun is not on PATH" in ln]
    assert len(warnings) == 1 and "SLURM job 5" in warnings[0], res.stderr

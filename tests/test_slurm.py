"""``phalanx run`` inside a SLURM allocation, on a real SLURM cluster (tests/slurm_cluster.py), and host lists.

The host-list and allocation tables run anywhere; the cluster tests need root and slurm-wlm + munge
(skipped with the reason otherwise; scripts/install-test-deps.sh installs them).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm: the session's cluster fixture)

from phalanx.launcher.slurm import allocation, plan_nodes, srun_command
from phalanx.runtime import detect_environment
from phalanx.runtime.hostlist import expand_counts, expand_hostlist

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


@needs_slurm
def test_hostlist_against_scontrol_show_hostnames(slurm):  # noqa: F811
    for text, _ in HOSTLISTS:
        res = slurm.run(["scontrol", "show", "hostnames", text])
        assert res.returncode == 0, res.stderr
        assert expand_hostlist(text) == res.stdout.split(), text


TRAIN = textwrap.dedent('''
    import os, sys, torch, phalanx as px
    topo = px.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    x = torch.randn(8, 6, dtype=torch.float64); y = x.sum(1, keepdim=True)
    ddp = px.DataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    n = 8 // topo.size
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[n * topo.rank:n * topo.rank + n]), y[n * topo.rank:n * topo.rank + n]).backward()
        opt.step()
    torch.save(dict(params=[p.detach() for p in model.parameters()], node=os.environ.get("SLURMD_NODENAME"),
                    size=topo.size, procid=os.environ.get("SLURM_PROCID")), f"{sys.argv[1]}/rank{topo.rank}.pt")
    px.shutdown()
''')


def _results(folder):
    return {int(n[4:-3]): torch.load(os.path.join(folder, n)) for n in os.listdir(folder) if n.startswith("rank")}


@needs_slurm
def test_salloc_phalanx_run_puts_one_rank_on_each_node_and_matches_one_host(slurm, tmp_path):  # noqa: F811
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    on_slurm, on_host = tmp_path / "slurm", tmp_path / "host"
    on_slurm.mkdir()
    on_host.mkdir()
    # no -np: the allocation's task count (2)
    res = slurm.run(["salloc", "-N2", "-n2", sys.executable, "-m", "phalanx", "run", "python", str(script),
                     str(on_slurm)], timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ref = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "python", str(script), str(on_host)],
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _results(on_slurm), _results(on_host)
    assert sorted(got) == [0, 1], res.stdout[-2000:]
    assert {r["size"] for r in got.values()} == {2}
    assert sorted(r["node"] for r in got.values()) == ["n1", "n2"]  # one rank on each node
    assert all(r["procid"] is None for r in got.values())  # the agent step's SLURM_PROCID is not the worker's
    for rank in (0, 1):
        for a, b in zip(got[rank]["params"], want[rank]["params"]):
            assert torch.equal(a, b), f"rank {rank}: parameters differ from phalanx run -np 2 on one host"


@needs_slurm
def test_np_more_than_the_allocation_is_one_line(slurm, tmp_path):  # noqa: F811
    res = slurm.run(["salloc", "-N2", "-n2", sys.executable, "-m", "phalanx", "run", "-np", "3", "python", "-c",
                     "pass"], timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("phalanx")]
    assert lines == [lines[0]] and "-np 3 is more than the 2 task(s) of SLURM job" in lines[0], res.stderr

"""Environment detection for each launcher, the world of one, and init/shutdown cycles."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import phalanx as px
from phalanx.runtime import PhalanxRuntimeError, detect_environment, expand_nodelist
from phalanx.testing import distributed


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    info = detect_environment(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (5, 8, 1, 4)
    assert (info.cross_rank, info.cross_size) == (1, 2)
    assert (info.master_addr, info.master_port, info.source) == ("node0", 1234, "torchrun")


def test_slurm_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_ID": "42"}
    info = detect_environment(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (3, 4, 1, 2)
    assert (info.cross_rank, info.cross_size, info.master_addr, info.source) == (1, 2, "gpu07", "slurm")
    assert info.master_port == detect_environment(env).master_port  # same on every rank


def test_slurm_tasks_per_node_with_repeat_syntax():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "a,b"}
    assert detect_environment(env).local_size == 4


def test_openmpi_environment():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    info = detect_environment(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (2, 4, 0, 2)
    assert (info.cross_rank, info.cross_size, info.master_addr, info.source) == (1, 2, "10.0.0.1", "openmpi")


def test_openmpi_across_hosts_without_master_addr_says_what_to_set():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(PhalanxRuntimeError, match="MASTER_ADDR"):
        detect_environment(env)


def test_pmi_environment_single_host():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = detect_environment(env)
    assert (info.rank, info.size, info.local_rank, info.master_addr, info.source) == (1, 2, 1, "127.0.0.1", "pmi")


def test_plain_python_is_a_world_of_one():
    info = detect_environment({})
    assert (info.rank, info.size, info.source) == (0, 1, "single")


def test_bad_variable_is_named():
    with pytest.raises(PhalanxRuntimeError, match="WORLD_SIZE"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "two"})


def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("single") == ["single"]


def test_world_of_one_init_shutdown_init(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PhalanxRuntimeError, match="init"):
        px.rank()
    for _ in range(2):
        topo = px.init(timeout=30)
        assert (px.rank(), px.size(), px.local_size(), px.cross_size()) == (0, 1, 1, 1)
        assert topo.backend == "gloo" and topo.timeout_s == 30
        # a group of one returns at once, unchanged (Average of one value is itself)
        assert torch.equal(px.allreduce(torch.arange(3.0)), torch.arange(3.0))
        assert px.allgather(torch.ones(2)).shape == (2,)
        assert px.broadcast_object({"a": 1}) == {"a": 1}
        px.shutdown()
        assert not px.is_initialized()


def test_bad_timeout_is_rejected(monkeypatch):
    monkeypatch.setenv("PHALANX_TIMEOUT", "soon")
    with pytest.raises(PhalanxRuntimeError, match="PHALANX_TIMEOUT"):
        px.init()


def _topology_and_reinit():
    import torch.distributed as dist

    topo = px.topology()
    local = px.allreduce(torch.ones(1), op=px.Sum, group=topo.local_group()).item()
    cross = px.allreduce(torch.ones(1), op=px.Sum, group=topo.cross_group()).item()
    first = (topo.rank, topo.local_rank, topo.cross_rank, topo.hosts, local, cross)
    px.shutdown()
    assert not dist.is_initialized()
    px.init()  # the same process joins again (the spawn env is still set)
    again = px.allreduce(torch.ones(1), op=px.Sum).item()
    return first, again


def test_topology_groups_and_reinit_with_four_ranks_on_two_simulated_hosts():
    results = distributed(_topology_and_reinit, np=4, local_size=2)
    for r, ((rank, lr, cr, hosts, local, cross), again) in enumerate(results):
        assert (rank, lr, cr) == (r, r % 2, r // 2)
        assert hosts == ((0, 1), (2, 3))
        assert (local, cross, again) == (2.0, 2.0, 4.0)


def test_process_group_is_shut_down_at_exit_when_the_script_forgets():
    # A hook registered *before* init() runs *after* phalanx's own exit hook (atexit is LIFO),
    # so it sees whether the group was destroyed.
    import subprocess
    import sys

    script = (
        "import atexit, torch.distributed as dist, phalanx as px\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "px.init(); px.allgather_object(px.rank())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM", "OMPI", "PMI"))}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "initialized at exit: False" in out.stdout


def test_exit_hook_stops_gloo_threads_even_after_dynamo_import():
    # torch.optim imports torch._dynamo at the first step; imported while a gloo group exists, it
    # kept the group alive past destroy_process_group(), and its threads' teardown at process exit
    # sometimes aborted a finished job. init() imports it first; the threads must be gone.
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc/self/task (Linux) to list the process's threads")
    code = textwrap.dedent("""
        import os, torch, phalanx as px
        px.init()
        model = torch.nn.Linear(4, 4)
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()   # imports torch._dynamo
        from phalanx import runtime
        runtime._shutdown_at_exit()
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print("THREADS", sorted(names))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("THREADS"))
    assert "pt_gloo_runloop" not in line and "gloo_tcp_loop" not in line, line

"""Environment detection for each launcher, the settings checked at init, the world of one, and
init/shutdown cycles."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import phalanx as px
from phalanx import settings
from phalanx.log import current_rank, log0, print0, set_rank
from phalanx.runtime import PhalanxRuntimeError, detect_environment, expand_nodelist
from phalanx.settings import SettingsError
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

_LAUNCHERS = [
    # (name, environment, (rank, size, local_rank, local_size, cross_rank, cross_size, master_addr, source))
    ("phalanx run", {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                     "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "4000", "PHALANX_LAUNCHER": "1"},
     (3, 4, 1, 2, 1, 2, "10.0.0.5", "phalanx")),
    ("torchrun", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
     (2, 4, 0, 2, 1, 2, "127.0.0.1", "torchrun")),
    ("slurm", {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
               "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "3(x2)"},
     (5, 6, 2, 3, 1, 2, "n1", "slurm")),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     (1, 2, 1, 2, 0, 1, "127.0.0.1", "openmpi")),
    ("pmi", {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "MASTER_ADDR": "h0"},
     (3, 4, 1, 2, 1, 2, "h0", "pmi")),
    ("none", {"PATH": "/usr/bin"}, (0, 1, 0, 1, 0, 1, "127.0.0.1", "single")),
]


@pytest.mark.parametrize("name,env,expected", _LAUNCHERS, ids=[launcher[0] for launcher in _LAUNCHERS])
def test_environment_detection_table(name, env, expected):
    info = detect_environment(env)
    got = (info.rank, info.size, info.local_rank, info.local_size, info.cross_rank, info.cross_size,
           info.master_addr, info.source)
    assert got == expected, name
    assert 1024 <= info.master_port < 65536


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
           "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}
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
    with pytest.raises(SettingsError, match="PHALANX_TIMEOUT='soon'"):
        px.init()
    assert not px.is_initialized()


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


# ---------------------------------------------------------------- settings: read once, every bad value one line

_BAD_SETTINGS = [
    # (variable, value, what the line must also name among the accepted values)
    ("PHALANX_BACKEND", "ncl", "gloo | nccl"),
    ("PHALANX_LOG_LEVEL", "LOUD", "DEBUG | INFO | WARNING | ERROR | CRITICAL"),
    ("PHALANX_DEVICE", "cuda:0" if not torch.cuda.is_available() else "cuda:99", "cpu"),
    ("PHALANX_DEVICE", "gpu", "cpu"),
    ("PHALANX_CHECK_COLLECTIVES", "nope", "1/0, true/false"),
    ("PHALANX_BUCKET_MB", "big", "a number > 0"),
    ("PHALANX_BUCKET_MB", "0", "a number > 0"),
    ("PHALANX_TIMEOUT", "soon", "a number > 0"),
    ("PHALANX_TIMEOUT", "-5", "a number > 0"),
    ("PHALANX_ALGORITHM", "rign", "auto | ring | hierarchical | flat"),
    ("PHALANX_CHECKPOINT_CHECKSUM", "md5", "xxh3 | crc32 | sha256"),
    ("PHALANX_CHECKPOINT_FORMAT", "pickle", "safetensors | torch"),
    ("PHALANX_COMPILE_CODECS", "maybe", "1/0, true/false"),
]


@pytest.mark.parametrize("var,value,accepted", _BAD_SETTINGS, ids=[f"{v}={x}" for v, x, _ in _BAD_SETTINGS])
def test_every_bad_setting_gets_one_line_naming_it(var, value, accepted):
    with pytest.raises(SettingsError) as err:
        settings.load({var: value})
    line = str(err.value)
    assert "\n" not in line
    assert f"{var}={value!r}" in line and accepted in line, line


@pytest.mark.parametrize("kwargs,named", [
    ({"backend": "ncl"}, "init(backend='ncl')"),
    ({"device": "tpu"}, "init(device='tpu')"),
    ({"timeout": "30"}, "init(timeout='30')"),
    ({"timeout": 0}, "init(timeout=0)"),
])
def test_bad_init_arguments_are_named(kwargs, named, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SettingsError, match=__import__("re").escape(named)):
        px.init(**kwargs)
    assert not px.is_initialized()


def test_good_settings_are_read_once_into_one_object():
    s = settings.load({"PHALANX_BACKEND": "GLOO", "PHALANX_DEVICE": "cpu", "PHALANX_TIMEOUT": "12.5",
                       "PHALANX_LOG_LEVEL": "trace", "PHALANX_CHECK_COLLECTIVES": "off",
                       "PHALANX_BUCKET_MB": "4", "PHALANX_ALGORITHM": "ring"})
    r = s.runtime
    assert (r.backend, r.device, r.timeout_s, r.log_level) == ("gloo", torch.device("cpu"), 12.5, "DEBUG")
    assert (s.comm.check_collectives, s.data_parallel.bucket_mb, s.data_parallel.algorithm) == (False, 4.0, "ring")
    assert settings.load({}) == settings.Settings()
    assert settings.load({"PHALANX_TIMEOUT": "9"}, timeout=3).runtime.timeout_s == 3.0  # the argument wins


def test_validators_for_constructor_arguments():
    assert settings.choice("DataParallel(algorithm=)", "ring", settings.ALGORITHMS) == "ring"
    with pytest.raises(SettingsError, match=r"DataParallel\(algorithm='rign'\) is not accepted; accepted: auto"):
        settings.choice("DataParallel(algorithm=)", "rign", settings.ALGORITHMS)
    assert settings.choice("op", "SUM", ("sum", "average"), case_sensitive=False) == "sum"
    with pytest.raises(SettingsError, match="op=\\['sum'\\]"):
        settings.choice("op", ["sum"], ("sum",))  # unhashable: refused, not a TypeError
    assert settings.positive("DataParallel(bucket_mb=)", 2.5) == 2.5
    with pytest.raises(SettingsError, match=r"bucket_mb='25'\) is not a number"):
        settings.positive("DataParallel(bucket_mb=)", "25")  # an argument's string is a type mistake
    assert settings.positive("PHALANX_BUCKET_MB", "25") == 25.0  # the environment's is parsed
    assert settings.positive("Trainer(batch_size=)", 32, integer=True) == 32
    for bad in (0, -1, 2.5, True, float("nan")):
        with pytest.raises(SettingsError, match="Trainer"):
            settings.positive("Trainer(batch_size=)", bad, integer=True)
    assert settings.positive("x", 0, allow_zero=True) == 0
    assert [settings.boolean("B", v) for v in ("1", "yes", "ON", True, "0", "false", "", 0)] == [True] * 4 + [False] * 4
    with pytest.raises(SettingsError, match="B='nope'"):
        settings.boolean("B", "nope")


def _run_script(tmp_path, code, env_extra):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM", "OMPI", "PMI", "PHALANX_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("var,value", [("PHALANX_BACKEND", "ncl"), ("PHALANX_LOG_LEVEL", "LOUD"),
                                       ("PHALANX_CHECK_COLLECTIVES", "nope")])
def test_bad_variable_under_plain_python_is_one_line_without_traceback(tmp_path, var, value):
    out = _run_script(tmp_path, """
        import phalanx as px
        px.init()
        print("trained")
    """, {var: value})
    assert out.returncode != 0 and "trained" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("phalanx: error: ") and f"{var}={value!r}" in lines[0], lines


def test_other_errors_keep_their_traceback_and_init_logs_its_topology(tmp_path):
    out = _run_script(tmp_path, """
        import phalanx as px
        px.init()
        raise KeyError("mine")
    """, {"PHALANX_LOG_LEVEL": "INFO"})
    assert "Traceback" in out.stderr and "KeyError: 'mine'" in out.stderr
    assert "[rank 0] phalanx.runtime: init: rank 0/1" in out.stderr
    assert "backend gloo device cpu" in out.stderr


def test_rank_zero_helpers(capsys, monkeypatch):
    import logging

    monkeypatch.delenv("RANK", raising=False)
    records = []
    catcher = logging.Handler()
    catcher.emit = records.append
    logging.getLogger("phalanx.user").addHandler(catcher)
    try:
        set_rank(1)
        print0("from rank 1")
        log0("log from rank 1")
        set_rank(0)
        assert current_rank() == 0
        print0("from rank 0")
        log0("log from %s", "rank 0")
    finally:
        set_rank(None)
        logging.getLogger("phalanx.user").removeHandler(catcher)
    assert capsys.readouterr().out == "from rank 0\n"
    assert [r.getMessage() for r in records] == ["log from rank 0"]  # INFO shown at the default level
    monkeypatch.setenv("SLURM_PROCID", "7")
    assert current_rank() == 7


@pytest.mark.parametrize("caught", [False, True])
def test_skip_teardown_if_uncaught_exits_1_after_the_traceback_and_hooks(tmp_path, caught):
    # An elastic worker whose script failed after a re-form: status 1 with the traceback and the exit
    # hooks, but no interpreter teardown (where c10d sometimes aborted); a caught exception changes nothing
    code = textwrap.dedent(f"""
        import atexit
        from phalanx import runtime

        class Teardown:
            def __del__(self):
                print("teardown ran", flush=True)

        kept = Teardown()
        atexit.register(lambda: print("exit hook ran", flush=True))
        try:
            runtime.skip_teardown_if_uncaught()
            raise ValueError("the script failed")
        except ValueError:
            if not {caught}:
                raise
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "exit hook ran" in proc.stdout, proc.stdout + proc.stderr
    if caught:
        assert proc.returncode == 0 and "teardown ran" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1 and "ValueError: the script failed" in proc.stderr, proc.stderr
        assert "teardown ran" not in proc.stdout, proc.stdout


def test_more_ranks_than_gpus_on_nccl_is_one_line_at_init(monkeypatch):
    """Two ranks on a host with one GPU under NCCL: NCCL refuses two ranks on one device, first at
    the first collective; init says it at once, with the two ways out (tried on an H100 by
    `phalanx run -np 2` in benchmarks/gpu/run.sh)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "PHALANX_LAUNCHER": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    monkeypatch.delenv("PHALANX_DEVICE", raising=False)
    with pytest.raises(SettingsError, match=r"2 ranks on this host share 1 GPU\(s\) but NCCL needs a GPU per rank; "
                                            r"start at most 1 rank\(s\) per host .*PHALANX_BACKEND=gloo"):
        px.init()
    assert not px.is_initialized()

"""Multi-host launch through the real SSH path in a simulated 2-host cluster, and the job secret.

The cluster tests need root, ip, tc and sshd (skipped with the reason otherwise);
the secret test runs anywhere.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from phalanx.launcher.secret import AuthenticatedStore, AuthenticationError, load_secret, new_secret
from phalanx.profiler.timeline import load
from phalanx.testing.cluster import IFNAME, SimCluster, requirements_missing

pytestmark = pytest.mark.cluster

_why = requirements_missing(ssh=True)
needs_cluster = pytest.mark.skipif(_why is not None, reason=f"simulated cluster unavailable: {_why}")


@pytest.fixture(scope="module")
def cluster():
    c = SimCluster(hosts=2, rate=None, ssh=True)
    try:
        yield c.up()
    finally:
        c.down()


def _run(cluster, script, *extra, options=(), timeout=180):
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "4", "-H", cluster.host_spec(2),
           "--ssh-config", cluster.ssh_config, "--network-interface", IFNAME, "--start-timeout", "60",
           *options, "--", sys.executable, str(script), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


TRAIN = textwrap.dedent('''
    import glob, os, sys, torch, phalanx as px
    from phalanx.launcher.secret import load_secret
    topo = px.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
    x = torch.randn(16, 6, dtype=torch.float64); y = x.sum(1, keepdim=True)
    mine = slice(4 * topo.rank, 4 * topo.rank + 4)
    # tiny buckets, several per step, each reduced by the hierarchical allreduce across the two hosts
    ddp = px.DataParallel(model, algorithm="hierarchical", bucket_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    key = load_secret()
    leaked = [p for p in glob.glob("/proc/[0-9]*/cmdline") if key in open(p, "rb").read()]
    mode = oct(os.stat(os.environ["PHALANX_SECRET_FILE"]).st_mode & 0o777)
    out = dict(params=[p.detach() for p in model.parameters()], hosts=topo.hosts, cross=topo.cross_rank,
               local=topo.local_rank, leaked=leaked, mode=mode, secret_len=len(key),
               buckets=len(ddp._engine.buckets.buckets))
    torch.save(out, f"{sys.argv[1]}/rank{topo.rank}.pt")
    px.shutdown()
''')


@needs_cluster
def test_two_hosts_by_two_ranks_over_ssh_match_single_process(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    trace = tmp_path / "trace.json"
    res = _run(cluster, script, str(tmp_path), options=("--timeline", str(trace)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
    x = torch.randn(16, 6, dtype=torch.float64)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(5):  # the mean of 4 equal shards' mean losses = the full-batch mean loss
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for r in range(4):
        out = torch.load(tmp_path / f"rank{r}.pt")
        assert out["hosts"] == ((0, 1), (2, 3))
        assert (out["cross"], out["local"]) == (r // 2, r % 2)  # host-major ranks
        assert out["buckets"] >= 2, "several buckets, so the test covers more than one hierarchical call"
        for got, want in zip(out["params"], ref.parameters()):
            torch.testing.assert_close(got, want.detach(), atol=1e-12, rtol=1e-10)
        assert out["leaked"] == [], "the job secret appears on a process command line"
        assert out["mode"] == "0o600" and out["secret_len"] == 64
    assert "[0]:" in res.stdout or "[0]:" in res.stderr  # output streamed back with rank prefixes
    # --timeline on remote hosts: the launcher collected every rank's part and merged them
    events = load(str(trace))
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1, 2, 3}
    assert not list(tmp_path.glob("trace.json.rank*")), "timeline parts left behind"


@needs_cluster
def test_unreachable_host_fails_fast_naming_it(cluster, tmp_path):
    dead = cluster.addresses[0].rsplit(".", 1)[0] + ".250"  # on the bridge's subnet, nobody there
    # No wall clock: the rendezvous would wait --start-timeout 600 s for the missing host, so
    # only a failure at the ssh probe (ConnectTimeout 5 s) returns before this 90 s limit;
    # a hang raises TimeoutExpired and fails the test.
    res = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "4", "--start-timeout", "600",
                          "-H", f"{cluster.addresses[0]}:2,{dead}:2", "--ssh-config", cluster.ssh_config,
                          "--", "true"], capture_output=True, text=True, timeout=90)
    assert res.returncode == 255
    assert dead in res.stderr and "cannot be reached by ssh" in res.stderr, res.stderr
    assert _host_processes(cluster, 0) == [], "no agent may be left on the reachable host"


def _host_processes(cluster, i):
    """What runs in simulated host ``i`` besides its sshd."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.namespaces[i]], capture_output=True, text=True).stdout
    names = [open(f"/proc/{p}/comm").read().strip() for p in pids.split() if os.path.exists(f"/proc/{p}/comm")]
    return [n for n in names if n != "sshd"]


KILLED = textwrap.dedent('''
    import os, signal, time, torch, phalanx as px
    topo = px.init()
    px.allreduce(torch.ones(1))
    if topo.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
''')


@needs_cluster
def test_killed_worker_on_one_host_stops_every_host_with_no_leftovers(cluster, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    res = _run(cluster, script, timeout=120)
    assert res.returncode != 0
    assert "rank 3" in res.stdout + res.stderr and "SIGKILL" in res.stdout + res.stderr
    time.sleep(1)
    for i in range(len(cluster.namespaces)):  # only sshd may remain in each host
        assert _host_processes(cluster, i) == [], f"host {i} still runs {_host_processes(cluster, i)}"
    mine = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert mine == [], f"processes of the job left on this machine: {mine}"


def test_process_without_the_secret_is_refused(tmp_path):
    key = new_secret()
    path = tmp_path / "secret"
    path.write_bytes(key)
    path.chmod(0o600)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = AuthenticatedStore(server, load_secret({"PHALANX_SECRET_FILE": str(path)}))
    job.set("ctl/stop", {"reason": "test"})
    assert job.get("ctl/stop") == {"reason": "test"}
    # An intruder (a separate process, no secret) reaches the store and plants a pickle that runs code.
    marker = tmp_path / "pwned"
    intruder = textwrap.dedent(f'''
        import pickle, os, torch.distributed as dist
        from phalanx.launcher.secret import AuthenticatedStore, AuthenticationError, load_secret
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        s = dist.TCPStore("127.0.0.1", {server.port}, is_master=False)
        assert load_secret() is None
        try:
            AuthenticatedStore(s, load_secret()).set("ctl/stop", 1)
            raise SystemExit("signed without a secret")
        except AuthenticationError:
            pass
        s.set("ctl/stop", b"\\0" * 32 + pickle.dumps(Evil()))
    ''')
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_SECRET_FILE"}
    res = subprocess.run([sys.executable, "-c", intruder], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    with pytest.raises(AuthenticationError, match="refused"):
        job.get("ctl/stop")
    assert not marker.exists(), "a message without the secret was unpickled"
    # a correctly signed message under a different key name is a replay and is refused too
    server.set("ctl/other", server.get("ctl/stop"))
    job.set("ctl/go", 1)
    server.set("ctl/other", server.get("ctl/go"))
    with pytest.raises(AuthenticationError, match="signed for"):
        job.get("ctl/other")

"""The simulated cluster: hosts reach each other over the bridge, links are capped, teardown leaves nothing.

Needs root, ip, tc (and sshd for the ssh check); skips with the reason otherwise.
"""

import subprocess

import pytest

from phalanx.testing.cluster import SimCluster, leftovers, requirements_missing

_why = requirements_missing(ssh=True)
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(_why is not None, reason=f"simulated cluster unavailable: {_why}")]


@pytest.fixture
def cluster():
    c = SimCluster(hosts=2, rate="100mbit", ssh=True)
    try:
        yield c.up()
    finally:
        c.down()  # runs even when the test fails


def test_hosts_talk_over_capped_links_and_ssh(cluster):
    a, b = cluster.addresses
    assert cluster.exec(0, ["tc", "qdisc", "show", "dev", "px0"]).stdout.count("tbf") == 1
    # each namespace sees only its own address
    assert a in cluster.exec(0, ["ip", "-o", "addr"]).stdout and b not in cluster.exec(0, ["ip", "-o", "addr"]).stdout
    res = subprocess.run(["ssh", "-F", cluster.ssh_config, b, "ip -o addr show px0"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and b in res.stdout, res.stderr
    # host 0 -> host 1 over TCP through the bridge (python on both sides)
    server = cluster.popen(1, ["python3", "-c", f"import socket;s=socket.create_server(('{b}',5999));"
                                                "c,_=s.accept();print(c.recv(5).decode())"],
                           stdout=subprocess.PIPE, text=True)
    client = cluster.exec(0, ["python3", "-c", "import socket,time\nfor _ in range(50):\n try:\n"
                                               f"  socket.create_connection(('{b}',5999)).sendall(b'hello');break\n"
                                               " except OSError: time.sleep(0.1)"], timeout=30)
    assert client.returncode == 0
    assert server.communicate(timeout=30)[0].strip() == "hello"


def test_teardown_removes_namespaces_links_and_sshd():
    c = SimCluster(hosts=2, rate="1gbit", ssh=True).up()
    pids = list(c.sshd_pids)
    assert len(pids) == 2 and leftovers(c.id)
    c.down()
    assert leftovers(c.id) == []
    for pid in pids:
        assert not _alive(pid), f"sshd {pid} survived teardown"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except FileNotFoundError:
        return False


def test_bad_rate_is_explained():
    with pytest.raises(ValueError, match="rate"):
        SimCluster(hosts=2, rate="fast")

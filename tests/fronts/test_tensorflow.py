"""TF_CONFIG for tf.distribute, and a MultiWorkerMirroredStrategy run under ``phalanx run``.

phalanx.tensorflow's own rank checks run in test_tensorflow_horovod.py's spawned group (TensorFlow's
import takes seconds: one group of ranks pays it for both).
"""

import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest

from phalanx.launcher.tf_config import parse_hosts, tf_config

pytestmark = pytest.mark.ranks

HAS_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None
HAS_TF_KERAS = HAS_TF and importlib.util.find_spec("tf_keras") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tf_config_lists_every_worker_in_rank_order():
    one_host = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.5",
                "MASTER_PORT": "29500"}
    assert json.loads(tf_config(one_host)) == {
        "cluster": {"worker": ["10.0.0.5:29501", "10.0.0.5:29502", "10.0.0.5:29503"]},
        "task": {"type": "worker", "index": 1}}
    two_hosts = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "PHALANX_WORKER_HOSTS": "a:2,b:2",
                 "PHALANX_TF_PORT": "7000"}
    assert json.loads(tf_config(two_hosts)) == {
        "cluster": {"worker": ["a:7000", "a:7001", "b:7000", "b:7001"]}, "task": {"type": "worker", "index": 3}}
    # Several hosts and nobody said which: no TF_CONFIG rather than a wrong one.
    assert tf_config({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) is None
    assert tf_config({}) is None
    assert parse_hosts("a, b:3") == [("a", 1), ("b", 3)]
    with pytest.raises(ValueError, match="4 slots for a world of 3"):
        tf_config({"RANK": "0", "WORLD_SIZE": "3", "PHALANX_WORKER_HOSTS": "a:2,b:2"})
    with pytest.raises(ValueError, match="HOST:SLOTS"):
        parse_hosts("a:zero")


def test_multi_host_launch_gives_every_worker_a_tf_config_naming_all_workers(monkeypatch):
    """`phalanx run -H a:1,b:2`: the environment the launcher hands each host's agent (captured at the ssh
    call, nothing started) gives every worker the same worker list, with itself at its own index."""
    import shlex

    from phalanx.launcher import ssh
    from phalanx.launcher.hosts import Host

    started = []

    class FakeAgent:  # the ssh process: records its command, exits at once with 0
        def __init__(self, argv, **_):
            started.append(argv)
            self.stdin, self.stdout, self.returncode, self.pid = io.StringIO(), io.StringIO(""), 0, -1

        def poll(self):
            return 0

        def wait(self, _timeout=None):
            return 0

    monkeypatch.setattr(ssh, "probe", lambda *a, **k: None)
    monkeypatch.setattr(ssh.subprocess, "Popen", FakeAgent)
    assert ssh.launch_remote([Host("hostA", 1), Host("hostB", 2)], 3, ["python", "mwms.py"], port=29400) == 0
    assert len(started) == 2
    configs = []
    for host_index, argv in enumerate(started):
        words = shlex.split(argv[-1])
        env = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--env")
        assert env["PHALANX_WORKER_HOSTS"] == "hostA:1,hostB:2", env
        for local in range(2 if host_index else 1):
            # the rendezvous may number hosts in any order: here hostB's workers get ranks 0-1
            rank = local if host_index else 2
            worker = {**env, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(local),
                      "LOCAL_WORLD_SIZE": "2" if host_index else "1", "MASTER_PORT": "29400"}
            configs.append((("hostA", "hostB")[host_index], local, json.loads(tf_config(worker))))
    want = ["hostA:29401", "hostB:29401", "hostB:29402"]
    assert all(c["cluster"]["worker"] == want for _, _, c in configs), configs
    assert sorted(c["task"]["index"] for _, _, c in configs) == [0, 1, 2]
    for host, local, c in configs:  # each worker finds its own address at its index
        assert c["cluster"]["worker"][c["task"]["index"]] == f"{host}:{29401 + local}"
    with pytest.raises(ValueError, match="not a slot"):
        tf_config({"RANK": "0", "WORLD_SIZE": "2", "PHALANX_WORKER_HOSTS": "a:1,b:1", "PHALANX_HOST_INDEX": "2"})


# phalanx.tensorflow on two ranks (the alias modules, eager and tf.function collectives,
# DistributedGradientTape against one process) runs in test_tensorflow_horovod.py's group of ranks.


@pytest.mark.skipif(not HAS_TF_KERAS, reason="tf-keras is not installed (pip install 'phalanx[tensorflow]')")
def test_multi_worker_mirrored_strategy_script_trains_under_phalanx_run():
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "EPOCHS": "2", "PYTHONPATH": ROOT}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable,
                           os.path.join(ROOT, "examples", "keras_seed_000_mwms.py")],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if ": worker " in line)
    assert len(lines) == 2 and lines[0].startswith("worker 0 of 2") and lines[1].startswith("worker 1 of 2"), lines
    weights = {line.rsplit("weights ", 1)[1] for line in lines}
    assert len(weights) == 1, f"the workers' replicas differ: {lines}"
    accuracy = float(lines[0].split("accuracy ")[1].split()[0])
    assert accuracy > 0.5, f"MultiWorkerMirroredStrategy did not learn: {lines[0]}"

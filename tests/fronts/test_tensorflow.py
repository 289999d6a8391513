"""phalanx.tensorflow on real ranks, TF_CONFIG for tf.distribute, and a MultiWorkerMirroredStrategy run.

The rank checks share one spawned group (TensorFlow's import takes seconds).
"""

import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from phalanx.launcher.tf_config import parse_hosts, tf_config
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

HAS_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None
HAS_TF_KERAS = HAS_TF and importlib.util.find_spec("tf_keras") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_tf = pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed (pip install 'phalanx[tensorflow]')")


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


B, STEPS = 8, 4


def _tf_checks():
    import tensorflow as tf

    import phalanx.keras
    import phalanx.tensorflow as hvd

    # `import phalanx.tensorflow.keras as hvd` (the module is an alias, which isort cannot see)
    hvd_keras = importlib.import_module("phalanx.tensorflow.keras")
    callbacks = importlib.import_module("phalanx.tensorflow.keras.callbacks")
    hvd.init()
    r = hvd.rank()
    out = {"alias": hvd_keras is phalanx.keras and callbacks is phalanx.keras.callbacks,
           "optimizer_alias": isinstance(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                                         phalanx.keras.DistributedOptimizer)}
    if HAS_TF_KERAS:  # tf-keras's optimizer takes the other path: the same argument checks (s6-ux)
        import tf_keras

        try:
            hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.1), backward_passes_per_step=0)
        except ValueError as e:
            out["tf_keras_k0"] = str(e)
    x = tf.constant([1.0, 2.0]) * (r + 1)
    out["eager_avg"] = hvd.allreduce(x).numpy()
    out["eager_sum"] = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16).numpy()

    @tf.function
    def in_graph(v):
        return hvd.allreduce(v, average=False), hvd.allgather(tf.fill([r + 1, 2], float(r))), hvd.broadcast(v, 1)

    s, g, b = in_graph(x)
    out["graph"] = (s.numpy(), g.numpy(), b.numpy())
    v = tf.Variable(tf.fill([3], float(r)))
    hvd.broadcast_variables([v], root_rank=1)
    out["broadcast_variables"] = v.numpy()

    # DistributedGradientTape in a tf.function loop: 2 ranks x B rows == 1 process x 2B rows.
    rng = np.random.default_rng(0)
    data_x = rng.standard_normal((2 * B * STEPS, 6)).astype("float32")
    data_y = rng.standard_normal((2 * B * STEPS, 1)).astype("float32")

    def train(distributed_tape, xs, ys, batch):
        w = tf.Variable(np.linspace(-1, 1, 6, dtype="float32").reshape(6, 1))
        bias = tf.Variable([0.5])

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.tanh(xb @ w + bias) - yb) ** 2)
            if distributed_tape:
                tape = hvd.DistributedGradientTape(tape)
            gw, gb = tape.gradient(loss, [w, bias])
            w.assign_sub(0.3 * gw)
            bias.assign_sub(0.3 * gb)

        for i in range(len(xs) // batch):
            step(xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch])
        return np.concatenate([w.numpy().ravel(), bias.numpy()])

    mine_rows = np.concatenate([np.arange(j * 2 * B + r * B, j * 2 * B + (r + 1) * B) for j in range(STEPS)])
    out["tape"] = train(True, data_x[mine_rows], data_y[mine_rows], B)
    out["tape_ref"] = train(False, data_x, data_y, 2 * B)
    return out


@needs_tf
def test_phalanx_tensorflow_on_two_ranks():
    a, b = distributed(_tf_checks, np=2, env={"KERAS_BACKEND": "tensorflow"}, timeout=300)
    for res in (a, b):
        assert res["alias"] and res["optimizer_alias"], "phalanx.tensorflow.keras must be phalanx.keras (and its optimizer)"
        if HAS_TF_KERAS:
            assert "backward_passes_per_step must be an integer >= 1" in res.get("tf_keras_k0", ""), res
        np.testing.assert_allclose(res["eager_avg"], [1.5, 3.0])
        np.testing.assert_allclose(res["eager_sum"], [3.0, 6.0])
        s, g, bc = res["graph"]
        np.testing.assert_allclose(s, [3.0, 6.0])
        np.testing.assert_allclose(g, [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_allclose(bc, [2.0, 4.0])
        np.testing.assert_allclose(res["broadcast_variables"], [1.0, 1.0, 1.0])
        np.testing.assert_allclose(res["tape"], res["tape_ref"], atol=1e-5,
                                   err_msg="DistributedGradientTape: 2 ranks x B differ from 1 process x 2B")
    np.testing.assert_array_equal(a["tape"], b["tape"])


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

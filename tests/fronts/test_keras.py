"""phalanx.keras on real ranks, on the torch, TensorFlow and JAX Keras backends.

One spawned group per backend runs every check (TensorFlow's import alone takes
seconds): 2 ranks with local batch B against one process with batch 2B (SGD with
momentum and Adam, backward_passes_per_step 1 and 2), Horovod's warm-up formula
batch by batch, metric averaging, the broadcast callback, the collectives and
load_model (JAX: the equivalence through both of its reduction paths and the
collectives). On torch and TensorFlow that group is seed 002's ``phalanx run`` job: its
script first, then the checks in the same two processes (Keras and its backend start once;
each check still its own test). Then an elastic Keras job that loses a worker.
"""

import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

HAS_KERAS = importlib.util.find_spec("keras") is not None
HAS_TF = importlib.util.find_spec("tensorflow") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None

ATOL = 1e-5  # as tests/parallel/test_data_parallel.py: float32 sums in another order
ALL_CASES = ("sgd_k1", "sgd_k2", "adam_k1", "adam_k2")
# JAX runs one case of each of its two reduction paths (direct; accumulated without branches)
EQUIVALENCE = {"torch": ALL_CASES, "tensorflow": ALL_CASES, "jax": ("sgd_k1", "adam_k2")}
B, STEPS, FEATURES, CLASSES = 8, 6, 12, 5


def _data():
    rng = np.random.default_rng(0)
    n = 2 * B * STEPS * 2
    x = rng.standard_normal((n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, n)
    return x, y


def _model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def _optimizer(keras, kind):
    return keras.optimizers.SGD(0.1, momentum=0.9) if kind == "sgd" else keras.optimizers.Adam(0.01)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _local_rows(x, global_batch, rank, size):
    """Rank r's share of each global batch, in order: rows [j*G + r*G/n, j*G + (r+1)*G/n)."""
    local = global_batch // size
    idx = np.concatenate([np.arange(j * global_batch + rank * local, j * global_batch + (rank + 1) * local)
                          for j in range(len(x) // global_batch)])
    return x[idx]


def _equivalence(keras, hvd, kind, k):
    x, y = _data()
    n, r = hvd.size(), hvd.rank()
    model = _model(keras)
    opt = hvd.DistributedOptimizer(_optimizer(keras, kind), backward_passes_per_step=k,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Rank r's passes: its share of the first pass's global batch, then of the second's, ...
    g = B * n
    model.fit(_local_rows(x, g, r, n), _local_rows(y, g, r, n), batch_size=B, shuffle=False, verbose=0)
    ref = _model(keras)
    ref.compile(optimizer=_optimizer(keras, kind), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(x, y, batch_size=g * k, shuffle=False, verbose=0)
    mine = _weights(model)
    overlap = getattr(opt, "_overlap", None)  # torch backend: buckets launched from backward
    return {"mine": mine, "diff": max(float(np.abs(a - b).max()) for a, b in zip(mine, _weights(ref))),
            "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
            "overlapped": None if overlap is None else overlap.overlapped_steps}


def _keras_checks(backend, tmp):
    import keras

    import phalanx.keras as hvd

    assert keras.backend.backend() == backend
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    out = {"sizes": (n, r, hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank())}
    for key in EQUIVALENCE[backend]:
        out[key] = _equivalence(keras, hvd, key[:-3], int(key[-1]))
    x, y = _data()
    if backend == "jax":  # its own paths only (each fit compiles a step): the reduction, the collectives
        _collectives(keras, hvd, r, out)
        return out

    # Warm-up: the learning rate each batch starts with, and metrics averaged at epoch end.
    seen, logs_seen = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            logs_seen.append(dict(logs))

    model = _model(keras, seed=100 + r)  # different weights per rank: the broadcast must fix them
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    steps = 5
    rows = slice(r * steps * B, (r + 1) * steps * B)  # the ranks see different data: different metrics
    model.fit(x[rows], y[rows], batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), Record()])
    out["warmup_lr"] = seen
    out["logs"] = logs_seen
    out["broadcast_weights"] = _weights(model)

    _collectives(keras, hvd, r, out)

    # load_model: the optimizer (and its state) comes back distributed, and trains on.
    path = f"{tmp}/model_{r}.keras"
    model.save(path)
    loaded = hvd.load_model(path)
    out["loaded_optimizer"] = type(loaded.optimizer).__name__
    out["loaded_iterations"] = int(keras.ops.convert_to_numpy(loaded.optimizer.iterations))
    loaded.fit(x[:2 * B], y[:2 * B], batch_size=B, verbose=0)
    out["loaded_after"] = _weights(loaded)
    return out


def _collectives(keras, hvd, r, out):
    """Collectives on backend tensors, NumPy and numbers."""
    t = keras.ops.convert_to_tensor(np.array([1.0, 2.0], dtype="float32") * (r + 1))
    out["allreduce"] = np.array(keras.ops.convert_to_numpy(hvd.allreduce(t)))
    out["allreduce_sum_fp16"] = np.array(hvd.allreduce(np.ones(3, "float32") * r, op=hvd.Sum,
                                                       compression=hvd.Compression.fp16))
    out["allreduce_kind"] = type(hvd.allreduce(t)).__module__.split(".")[0]
    out["allgather"] = np.array(keras.ops.convert_to_numpy(hvd.allgather(
        keras.ops.convert_to_tensor(np.full((r + 1, 2), r, dtype="float32")))))
    out["broadcast"] = np.array(keras.ops.convert_to_numpy(hvd.broadcast(
        keras.ops.convert_to_tensor(np.array([r], dtype="float32")), root_rank=1)))


def _warmup_expected(initial_lr, warmup_epochs, steps_per_epoch, epochs, size):
    """Horovod's formula, written out: lr at the start of each batch of the warm-up epochs."""
    lrs = []
    for epoch in range(epochs):
        for batch in range(steps_per_epoch):
            if epoch < warmup_epochs:
                e = epoch + batch / steps_per_epoch + 1 / steps_per_epoch
                lrs.append(initial_lr / size * (e * (size - 1) / warmup_epochs + 1))
            else:
                lrs.append(lrs[-1])
    return lrs


SEED_BACKENDS = ("torch", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Seed 002's script under `phalanx run -np 2`, then, in the same two processes, _keras_checks (each rank's
# results pickled to OUT): Keras and its backend start once for both tests of a backend.
SEED_THEN_CHECKS = textwrap.dedent("""
    import os, pickle, runpy, sys, traceback
    root, out = sys.argv[1], sys.argv[2]
    runpy.run_path(os.path.join(root, "examples", "keras_seed_002.py"), run_name="__main__")
    print("SEED DONE", flush=True)
    sys.path.insert(0, os.path.join(root, "tests", "fronts"))
    import keras
    from test_keras import _keras_checks
    import phalanx.keras as hvd
    try:  # a failing check fails its own test, not the seed script's
        results = _keras_checks(keras.backend.backend(), os.path.join(out, "checks"))
    except Exception:
        results = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"checks.{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(results, f)
""")


@pytest.fixture(scope="module")
def seed_job(tmp_path_factory):
    """seed_job(backend) -> (the finished `phalanx run`, its working directory); one job per backend."""
    jobs = {}

    def get(backend):
        if backend not in jobs:
            if not (HAS_KERAS and HAS_TF):
                pytest.skip("the seed script needs keras and tensorflow (TensorBoard); pip install 'phalanx[tensorflow]'")
            tmp_path = tmp_path_factory.mktemp(f"seed_{backend}")
            (tmp_path / "checks").mkdir()
            (tmp_path / "job.py").write_text(SEED_THEN_CHECKS)
            env = {**os.environ, "KERAS_BACKEND": backend, "EPOCHS": "3", "PYTHONPATH": ROOT}
            jobs[backend] = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable,
                                            str(tmp_path / "job.py"), ROOT, str(tmp_path)],
                                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420), tmp_path
        return jobs[backend]

    return get


@pytest.mark.skipif(not HAS_KERAS, reason="keras is not installed (pip install 'phalanx[keras]')")
@pytest.mark.parametrize("backend", [
    "torch",
    pytest.param("tensorflow", marks=pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed "
                                                                              "(pip install 'phalanx[tensorflow]')")),
    pytest.param("jax", marks=pytest.mark.skipif(not HAS_JAX, reason="jax is not installed (pip install "
                                                                      "'phalanx[jax]')")),
])
def test_keras_front_on_two_ranks(backend, tmp_path, seed_job):
    if backend in SEED_BACKENDS and HAS_TF:  # in the ranks of seed 002's job, after its script
        proc, out = seed_job(backend)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = [pickle.loads((out / f"checks.{r}.pkl").read_bytes()) for r in (0, 1)]
        assert not any("error" in res for res in results), "\n".join(res.get("error", "") for res in results)
    else:
        results = distributed(_keras_checks, np=2, args=(backend, str(tmp_path)), env={"KERAS_BACKEND": backend},
                              timeout=300)
    a, b = results
    assert a["sizes"][:2] == (2, 0) and b["sizes"][:2] == (2, 1)
    for key in EQUIVALENCE[backend]:
        assert a[key]["diff"] < ATOL, f"{key}: 2 ranks x batch {B} differ from 1 process by {a[key]['diff']}"
        for w0, w1 in zip(a[key]["mine"], b[key]["mine"]):
            np.testing.assert_array_equal(w0, w1, err_msg=f"{key}: ranks ended with different weights")
        assert a[key]["iterations"] == STEPS * 2 // int(key[-1]), f"{key}: iterations counts updates"
        if backend == "torch" and key.endswith("k1"):  # every step's buckets started during backward
            assert a[key]["overlapped"] == STEPS * 2, f"{key}: overlapped {a[key]['overlapped']} of {STEPS * 2} steps"
    for res in results:
        np.testing.assert_allclose(res["allreduce"], [1.5, 3.0])
        np.testing.assert_allclose(res["allreduce_sum_fp16"], [1.0, 1.0, 1.0])
        assert res["allreduce_kind"] == {"torch": "torch", "tensorflow": "tensorflow", "jax": "jaxlib"}[backend]
        np.testing.assert_allclose(res["allgather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_allclose(res["broadcast"], [1.0])
    if backend == "jax":
        return
    expected = _warmup_expected(0.4, 2, 5, 3, 2)
    for res in results:
        np.testing.assert_allclose(res["warmup_lr"], expected, rtol=1e-6, err_msg="warm-up differs from Horovod's")
    for la, lb in zip(a["logs"], b["logs"]):
        assert la.keys() == lb.keys() and {"loss", "accuracy", "lr"} <= la.keys()
        for k in la:
            assert la[k] == pytest.approx(lb[k], rel=1e-6), f"metric {k} not averaged: {la[k]} vs {lb[k]}"
    for w0, w1 in zip(a["broadcast_weights"], b["broadcast_weights"]):
        np.testing.assert_array_equal(w0, w1, err_msg="BroadcastGlobalVariablesCallback left ranks apart")
    for res in results:
        assert res["loaded_optimizer"] == "DistributedOptimizer"
        assert res["loaded_iterations"] == 3 * 5
    for w0, w1 in zip(a["loaded_after"], b["loaded_after"]):
        np.testing.assert_array_equal(w0, w1, err_msg="the loaded model's training left ranks apart")


@pytest.mark.skipif(not (HAS_KERAS and HAS_TF), reason="the seed script needs keras and tensorflow "
                                                        "(TensorBoard); pip install 'phalanx[tensorflow]'")
@pytest.mark.parametrize("backend", SEED_BACKENDS)
def test_seed_002_keras_script_runs_under_phalanx_run(backend, seed_job):
    proc, tmp_path = seed_job(backend)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"[{r}]: SEED DONE" in proc.stdout.splitlines() for r in (0, 1)), proc.stdout[-2000:]
    finals = {}
    for line in proc.stdout.splitlines():
        if ": rank " in line and " weights " in line:
            rank_part, rest = line.split(": rank ", 1)[1].split(": ", 1)
            finals[int(rank_part)] = rest
    assert sorted(finals) == [0, 1], proc.stdout[-2000:]
    # Same weights (the optimizer averaged), same loss/accuracy (the metrics were averaged: the
    # ranks trained on different halves of the data), the warm-up's final rate on both.
    assert finals[0] == finals[1], f"ranks differ: {finals}"
    accuracy = float(finals[0].split("accuracy ")[1].split()[0])
    assert accuracy > 0.5, f"the seed script did not learn: {finals[0]}"
    # Checkpoints and TensorBoard: rank 0 only.
    assert sorted(p.name for p in tmp_path.glob("digits_horovod_*.weights.h5")), "no checkpoint written"
    assert not any(line.startswith("[1]") and "saving model" in line for line in proc.stdout.splitlines())
    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert len(events) == 1, f"TensorBoard files from more than one rank: {events}"


ELASTIC_WORKER = textwrap.dedent("""
    import os, signal, sys, zlib
    import numpy as np
    import keras
    import phalanx.keras as hvd
    from phalanx.elastic import inprocess

    EPOCHS, B, COMMIT_EVERY = 3, 8, 4

    def main(out):
        hvd.init()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2 * 6 * B, 12)).astype("float32")
        y = rng.integers(0, 5, len(x))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(5)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        state = hvd.elastic.KerasState(model, batch=0, epoch=0, commit_dir=os.path.join(out, "commits"))
        resets = []
        state.register_reset_callbacks([lambda: resets.append(hvd.size())])

        def digest():
            values = model.get_weights() + [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables]
            return zlib.crc32(b"".join(np.asarray(w).tobytes() for w in values))

        def event(what):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{what} rank={hvd.rank()} size={hvd.size()} pid={os.getpid()} gen={inprocess.generation()} "
                        f"epoch={state.epoch} batch={state.batch} w={digest()} resets={len(resets)}\\n")

        class Watch(keras.callbacks.Callback):  # after the state callbacks: sees what they committed
            seen = 0

            def on_train_batch_end(self, batch, logs=None):
                if state.commits != self.seen:
                    self.seen = state.commits
                    event("commit")
                if state.epoch == 1 and batch == 4 and hvd.rank() == 1 and inprocess.generation() == 0:
                    event("kill")
                    os.kill(os.getpid(), signal.SIGKILL)

            def on_epoch_end(self, epoch, logs=None):
                self.seen = state.commits
                event("commit")

        callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY), Watch()]

        @hvd.elastic.run
        def train(state):
            event("start")
            n, r = hvd.size(), hvd.rank()
            state.model.fit(x[r::n], y[r::n], batch_size=B, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                            callbacks=callbacks)

        train(state)
        event("end")

    if __name__ == "__main__":
        main(sys.argv[1])
""")


@pytest.mark.skipif(not HAS_KERAS, reason="keras is not installed (pip install 'phalanx[keras]')")
def test_keras_elastic_survivor_rolls_back_to_the_commit_and_finishes(tmp_path):
    """hvd.elastic.KerasState + the three callbacks under `phalanx run --min-np 1 --max-np 2`: rank 1 is
    killed in epoch 1 after the mid-epoch commit; rank 0 fails in its next step, re-forms alone in the same process, restores that
    commit (weights and optimizer state, epoch and batch), runs its reset callback and finishes."""
    script = tmp_path / "worker.py"
    script.write_text(ELASTIC_WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--max-restarts", "0", "--timeout", "60", sys.executable, str(script), str(tmp_path)]
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    rows = [dict(kv.split("=", 1) for kv in line.split()[1:]) | {"what": line.split()[0]}
            for line in (tmp_path / "events.txt").read_text().splitlines()]
    kill = [e for e in rows if e["what"] == "kill"]
    assert len(kill) == 1 and kill[0]["rank"] == "1", report
    mine = [e for e in rows if e["pid"] == [s for s in rows if s["what"] == "start" and s["rank"] == "0"][0]["pid"]]
    before = [e for e in mine if e["gen"] == "0"]
    last_commit = [e for e in before if e["what"] == "commit"][-1]
    # every 4 batches, counted across epochs (as Horovod's callback): epoch 0's batch 3, then epoch 1's batch 1
    assert (last_commit["epoch"], last_commit["batch"]) == ("1", "1"), before
    resumed = [e for e in mine if e["what"] == "start" and e["gen"] != "0"]
    assert len(resumed) == 1, (mine, report)
    # the same process, alone now, back at the commit: weights and optimizer state, epoch and batch
    assert resumed[0]["size"] == "1" and resumed[0]["resets"] == "1", resumed
    assert (resumed[0]["epoch"], resumed[0]["batch"], resumed[0]["w"]) == (
        last_commit["epoch"], last_commit["batch"], last_commit["w"]), (last_commit, resumed)
    end = [e for e in mine if e["what"] == "end"]
    assert len(end) == 1 and end[0]["epoch"] == "3" and end[0]["batch"] == "0", mine

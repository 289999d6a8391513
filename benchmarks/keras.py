"""phalanx.keras vs its peers: samples/s on the same model and data, two ranks.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/keras.py [--steps 60 --repeats 3 --batch 64 --models mlp,wide]

Two launches of ``phalanx run -np 2`` (each rank imports its framework once; inside a
launch the contenders alternate, who goes first rotating, and the median is reported):

* TensorFlow backend: ``model.fit`` with ``phalanx.keras.DistributedOptimizer`` (Keras 3)
  against ``model.fit`` under TensorFlow's own ``MultiWorkerMirroredStrategy`` (tf-keras,
  ``TF_USE_LEGACY_KERAS=1``: Keras 3's ``fit`` does not run under MWMS, keras-team/keras#20585),
  plus each one's single-process pace without communication (``local``). The MWMS
  workers find each other through the TF_CONFIG that ``phalanx run`` exports.
  Also measured: what crossing into phalanx costs per step (the gradients of one step
  through ``tf.py_function`` and DLPack and back, no collective).
* torch backend: ``model.fit`` with ``phalanx.keras`` against phalanx's own
  ``DataParallel`` with a plain torch loop on the same model, plus both without
  communication, for each model of ``--models``. The single-rank pair (Keras ``fit``
  vs the torch loop, no communication) is the frameworks' own cost; the two-rank
  pair's scaling efficiency (two-rank samples/s over twice the one-rank pace) is what
  the communication costs each, so their ratio isolates phalanx.keras's part.

Models (softmax cross-entropy, SGD, random data in memory):

* ``mlp``: MLP 64-512-512-10 (301k parameters), local batch ``--batch``: Keras's fixed
  per-step cost dominates;
* ``wide``: MLP 256-2048-2048-10 (4.7M parameters), local batch ``--wide-batch``:
  compute-dominated, Keras's per-step cost is small next to the matmuls.
The TensorFlow comparison runs on ``mlp``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# This file is benchmarks/keras.py: run as a script, its folder is sys.path[0] and `import keras`
# (inside phalanx.keras) would import this file instead of the Keras package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = 10
MODELS = {"mlp": (64, 512), "wide": (256, 2048)}  # name: (features, hidden); two hidden layers each
FEATURES, HIDDEN = MODELS["mlp"]  # the TensorFlow comparison's model


def _data(n, seed=0, features=FEATURES):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype("float32"), rng.integers(0, CLASSES, n).astype("int64")


def _params(features, hidden):
    return features * hidden + hidden + hidden * hidden + hidden + hidden * CLASSES + CLASSES


def _keras_model(keras, distributed_opt=None, features=FEATURES, hidden=HIDDEN):
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(CLASSES)])
    opt = keras.optimizers.SGD(0.01)
    model.compile(optimizer=distributed_opt(opt) if distributed_opt else opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _median_rounds(contenders, repeats):
    for fn in contenders.values():  # warm-up: tracing, bucket plans, first allocations
        fn()
    times = {k: [] for k in contenders}
    names = list(contenders)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(contenders[name]())
    return {k: statistics.median(v) for k, v in times.items()}


def worker_tensorflow(steps, repeats, batch):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first: collectives are set up at start-up
    import keras

    import phalanx.keras as hvd
    from phalanx.keras.tensors import over_torch

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    x, y = _data(batch * n * steps)
    mine_x, mine_y = x[r::n], y[r::n]
    ours, local = _keras_model(keras, hvd.DistributedOptimizer), _keras_model(keras)
    hvd.broadcast_variables(ours.variables, root_rank=0)
    with strategy.scope():
        legacy = tf.keras.Sequential([tf.keras.layers.Dense(HIDDEN, activation="relu", input_shape=(FEATURES,)),
                                      tf.keras.layers.Dense(HIDDEN, activation="relu"),
                                      tf.keras.layers.Dense(CLASSES)])
        legacy.compile(optimizer=tf.keras.optimizers.SGD(0.01),
                       loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    global_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * n).with_options(options).cache()

    def timed(fn):
        def run():
            hvd.allreduce(0.0, name="bench.barrier")
            start = time.perf_counter()
            fn()
            hvd.allreduce(0.0, name="bench.barrier")
            return time.perf_counter() - start
        return run

    contenders = {
        "phalanx.keras": timed(lambda: ours.fit(mine_x, mine_y, batch_size=batch, shuffle=False, verbose=0)),
        "MWMS": timed(lambda: legacy.fit(global_ds, verbose=0)),
        "local": timed(lambda: local.fit(mine_x, mine_y, batch_size=batch, shuffle=False, verbose=0)),
    }
    med = _median_rounds(contenders, repeats)
    result = {k: (batch * steps * (n if k != "local" else 1)) / v for k, v in med.items()}

    # The crossing alone: one step's gradients through py_function + DLPack and back, no collective.
    grads = [tf.ones_like(v.value) for v in ours.trainable_variables]

    @tf.function
    def cross(gs):
        return over_torch(lambda ts, align: ts, gs)

    @tf.function
    def stay(gs):
        return [g + 0.0 for g in gs]

    for f in (cross, stay):
        f(grads)
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        cross(grads)
    t1 = time.perf_counter()
    for _ in range(reps):
        stay(grads)
    t2 = time.perf_counter()
    result["crossing_us"] = ((t1 - t0) - (t2 - t1)) / reps * 1e6
    result["tensors"] = len(grads)
    result["step_ms_phalanx"] = med["phalanx.keras"] / steps * 1e3
    return result if r == 0 else None


def worker_torch(steps, repeats, batches, models):
    import keras
    import torch
    from torch import nn

    import phalanx as px
    import phalanx.keras as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    results = {}
    loss_fn = nn.CrossEntropyLoss()
    for model_name in models:
        features, hidden = MODELS[model_name]
        batch = batches[model_name]
        x, y = _data(batch * n * steps, features=features)
        mine_x, mine_y = x[r::n], y[r::n]
        ours = _keras_model(keras, hvd.DistributedOptimizer, features, hidden)
        local = _keras_model(keras, None, features, hidden)
        hvd.broadcast_variables(ours.variables, root_rank=0)

        def torch_mlp(features=features, hidden=hidden):
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, CLASSES))

        dp, plain = px.DataParallel(torch_mlp()), torch_mlp()
        opts = {id(dp): torch.optim.SGD(dp.parameters(), lr=0.01),
                id(plain): torch.optim.SGD(plain.parameters(), lr=0.01)}
        tx, ty = torch.from_numpy(mine_x), torch.from_numpy(mine_y)

        def loop(model, opts=opts, tx=tx, ty=ty, batch=batch):
            opt = opts[id(model)]
            for i in range(steps):
                xb, yb = tx[i * batch:(i + 1) * batch], ty[i * batch:(i + 1) * batch]
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()

        def timed(fn):
            def run():
                px.barrier()
                start = time.perf_counter()
                fn()
                px.barrier()
                return time.perf_counter() - start
            return run

        def fit(model, mine_x=mine_x, mine_y=mine_y, batch=batch):
            model.fit(mine_x, mine_y, batch_size=batch, shuffle=False, verbose=0)

        contenders = {
            "phalanx.keras": timed(lambda ours=ours: fit(ours)),
            "DataParallel": timed(lambda dp=dp: loop(dp)),
            "keras local": timed(lambda local=local: fit(local)),
            "torch local": timed(lambda plain=plain: loop(plain)),
        }
        med = _median_rounds(contenders, repeats)
        results[model_name] = {k: (batch * steps * (n if "local" not in k else 1)) / v for k, v in med.items()}
        results[model_name]["batch"] = batch
    return results if r == 0 else None


def _launch(backend, args):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, os.path.abspath(__file__),
           "--worker", backend, "--steps", str(args.steps), "--repeats", str(args.repeats), "--batch", str(args.batch),
           "--wide-batch", str(args.wide_batch), "--models", args.models]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit(f"{backend} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _print_torch(model_name, row):
    features, hidden = MODELS[model_name]
    framework = row["keras local"] / row["torch local"]
    eff_keras = row["phalanx.keras"] / (2 * row["keras local"])
    eff_dp = row["DataParallel"] / (2 * row["torch local"])
    print(f"\ntorch backend, {model_name}: MLP {features}-{hidden}-{hidden}-{CLASSES} "
          f"({_params(features, hidden) / 1e6:.2f}M parameters), local batch {row['batch']} (samples/s)\n"
          f"  1 rank, no communication: Keras fit {row['keras local']:9.0f}  torch loop {row['torch local']:9.0f}"
          f"  Keras/torch {framework:.2f}  (the frameworks' own cost)\n"
          f"  2 ranks:        phalanx.keras {row['phalanx.keras']:9.0f}  DataParallel {row['DataParallel']:9.0f}"
          f"  ratio {row['phalanx.keras'] / row['DataParallel']:.2f}  (goal >= 0.90)\n"
          f"  scaling efficiency (2 ranks / twice 1 rank): phalanx.keras {eff_keras:.2f}, DataParallel "
          f"{eff_dp:.2f}; ratio {eff_keras / eff_dp:.2f} (phalanx.keras's own part)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="local batch of the mlp model")
    parser.add_argument("--wide-batch", type=int, default=256, help="local batch of the wide model")
    parser.add_argument("--models", default="mlp,wide", help="torch-backend models: mlp, wide")
    parser.add_argument("--worker", choices=["tensorflow", "torch"])
    parser.add_argument("--backends", default="tensorflow,torch")
    args = parser.parse_args()
    if args.worker:
        if args.worker == "tensorflow":
            result = worker_tensorflow(args.steps, args.repeats, args.batch)
        else:
            result = worker_torch(args.steps, args.repeats, {"mlp": args.batch, "wide": args.wide_batch},
                                  args.models.split(","))
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return
    print(f"2 ranks, {args.steps} steps, median of {args.repeats}; load {os.getloadavg()[0]:.1f}")
    for backend in args.backends.split(","):
        res = _launch(backend, args)
        if backend == "tensorflow":
            ratio = res["phalanx.keras"] / res["MWMS"]
            print(f"\nTensorFlow backend, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, local batch {args.batch} "
                  f"(samples/s, whole job)\n  phalanx.keras {res['phalanx.keras']:9.0f}\n"
                  f"  MWMS (tf-keras) {res['MWMS']:7.0f}\n  ratio phalanx/MWMS {ratio:.2f}  (goal >= 1.00)\n"
                  f"  one rank alone, no communication (Keras 3 fit): {res['local']:.0f}\n"
                  f"  crossing (py_function + DLPack both ways, {res['tensors']} tensors): "
                  f"{res['crossing_us']:.0f} us/step of {res['step_ms_phalanx']:.2f} ms")
        else:
            for model_name, row in res.items():
                _print_torch(model_name, row)
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

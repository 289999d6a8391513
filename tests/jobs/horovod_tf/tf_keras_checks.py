"""Keras 2 code (tf-keras, ``TF_USE_LEGACY_KERAS=1``) with ``import phalanx.tensorflow.keras as hvd``.

Run on 2 ranks by ``tests/fronts/test_tensorflow_horovod_examples.py`` (after two of Horovod's
example scripts, in the same processes). Each check prints one line ``CHECK <name> <json>``:

* ``equivalence_<opt>_k<k>``: 2 ranks x local batch B against one process with batch 2kB,
  max |weight difference| (SGD with momentum, Adam; backward_passes_per_step 1 and 2; the legacy
  Adam, ``tf.keras.optimizers.legacy``, k = 1; ``legacy_k2``: k = 2 there is refused in one line);
* ``callbacks``: after a fit with the broadcast, metric-average and warm-up callbacks, whether
  the ranks' weights agree, the averaged loss and the learning rate of each batch;
* ``state``: KerasState's sync then restore on a tf-keras model;
* ``partial``: PartialDistributedOptimizer keeps the local layer's gradient (divided by size);
* ``private_names``: Horovod's ``opt._compute_gradients`` + ``apply_gradients`` with k = 2 over 3
  passes (the variable after each pass, ``iterations``, ``_agg_helper.counter``).
"""

import json

import numpy as np
import phalanx.tensorflow.keras as hvd
import tensorflow as tf

import phalanx.tensorflow as hvd_tf

B, STEPS, FEATURES, CLASSES = 8, 4, 6, 3


def check(name, value):
    print(f"CHECK {name} {json.dumps(value)}", flush=True)


def model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(8, activation="tanh"),
                                tf.keras.layers.Dense(CLASSES)])


def data():
    rng = np.random.default_rng(0)
    n = 2 * B * STEPS * 2
    return rng.standard_normal((n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n)


def local_rows(x, global_batch, rank, size):
    local = global_batch // size
    idx = np.concatenate([np.arange(j * global_batch + rank * local, j * global_batch + (rank + 1) * local)
                          for j in range(len(x) // global_batch)])
    return x[idx]


def optimizer(kind):
    if kind == "legacy-adam":  # an OptimizerV2 (tf.keras.optimizers.legacy), with its deprecated lr=
        return tf.keras.optimizers.legacy.Adam(lr=0.01)
    return tf.keras.optimizers.SGD(0.1, momentum=0.9) if kind == "sgd" else tf.keras.optimizers.Adam(0.01)


def equivalence(kind, k):
    x, y = data()
    n, r = hvd.size(), hvd.rank()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mine = model()
    mine.compile(optimizer=hvd.DistributedOptimizer(optimizer(kind), backward_passes_per_step=k,
                                                    average_aggregated_gradients=True), loss=loss)
    g = B * n
    mine.fit(local_rows(x, g, r, n), local_rows(y, g, r, n), batch_size=B, shuffle=False, verbose=0)
    ref = model()
    ref.compile(optimizer=optimizer(kind), loss=loss)
    ref.fit(x, y, batch_size=g * k, shuffle=False, verbose=0)
    return max(float(np.abs(a - b).max()) for a, b in zip(mine.get_weights(), ref.get_weights()))


def callbacks():
    x, y = data()
    r = hvd.rank()
    m = model(seed=100 + r)  # different weights per rank: the broadcast must make them equal
    m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(tf.keras.backend.get_value(self.model.optimizer.learning_rate)))

    rows = slice(r * 2 * B, (r + 1) * 2 * B)
    history = m.fit(x[rows], y[rows], batch_size=B, epochs=2, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), Record()])
    weights = hvd_tf.allgather_object([w.tolist() for w in m.get_weights()])
    losses = hvd_tf.allgather_object(history.history["loss"])
    return {"same_weights": weights[0] == weights[1], "same_loss": losses[0] == losses[1], "lr": seen}


def state():
    r = hvd.rank()
    m = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(2)])
    m.set_weights([np.full((2, 2), float(r + 1), "float32"), np.full((2,), float(r + 1), "float32")])
    s = hvd.elastic.KerasState(m, hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), epoch=5 + r)
    s.sync()
    m.set_weights([np.zeros((2, 2), "float32"), np.zeros((2,), "float32")])
    s.restore()
    return {"weights": [w.tolist() for w in m.get_weights()], "epoch": s.epoch}


def partial():
    m = model()
    x, _ = data()
    xb = tf.constant(x[hvd.rank() * B:(hvd.rank() + 1) * B])
    opt = hvd.PartialDistributedOptimizer(tf.keras.optimizers.SGD(1.0), local_layers=[m.layers[-1]])
    before = [w.copy() for w in m.get_weights()]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(m(xb) ** 2)
    grads = tape.gradient(loss, m.trainable_variables)
    opt.apply_gradients(zip(grads, m.trainable_variables))
    moved = [b - a for a, b in zip(m.get_weights(), before)]  # = the applied gradient (lr 1)
    local = max(float(np.abs(moved[i] - grads[i].numpy() / hvd.size()).max()) for i in (2, 3))
    return {"local_scaled": local}


def private_names():
    """Rank r's gradient on pass p is (r + 1)(p + 1) per element; SGD with rate 1, k = 2."""
    x = tf.Variable([1.0, 2.0])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    seen, returned = [], []
    for p in range(3):
        scale = float((hvd.rank() + 1) * (p + 1))
        pairs = opt._compute_gradients(lambda s=scale: tf.reduce_sum(x * s), [x])
        returned.append(pairs[0][0].numpy().tolist())
        opt.apply_gradients(pairs)
        seen.append(x.numpy().tolist())
    return {"x": seen, "returned": returned, "iterations": int(opt.iterations.numpy()),
            "counter": int(opt._agg_helper.counter.numpy())}


def main():
    hvd.init()
    for kind in ("sgd", "adam"):
        for k in (1, 2):
            check(f"equivalence_{kind}_k{k}", equivalence(kind, k))
    check("equivalence_legacy-adam_k1", equivalence("legacy-adam", 1))
    try:
        hvd.DistributedOptimizer(optimizer("legacy-adam"), backward_passes_per_step=2)
        check("legacy_k2", "no error")
    except ValueError as err:
        check("legacy_k2", str(err))
    check("callbacks", callbacks())
    check("state", state())
    check("partial", partial())
    check("private_names", private_names())


if __name__ == "__main__":
    main()

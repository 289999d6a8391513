"""phalanx.tensorflow's own checks on real ranks (the alias modules, eager and tf.function collectives,
DistributedGradientTape against one process); tf_horovod_checks.tf_body runs them last in its group."""

import importlib
import importlib.util

import numpy as np

HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None

B, STEPS = 8, 4


def phalanx_tensorflow(tf, hvd):
    """Each rank's outcomes, checked by test_tensorflow_horovod.py::test_phalanx_tensorflow_on_two_ranks."""
    import phalanx.keras

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

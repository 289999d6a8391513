"""Horovod's ``horovod.tensorflow`` API on phalanx: every collective, its gradient, graph mode and the
Keras pieces, on 2 real ranks against what one process computes from both ranks' inputs.

One spawned group (Keras 3 on TensorFlow) runs every check; each check is its own test.
The Keras 2 (tf-keras) side and Horovod's own example scripts are in
``test_tensorflow_horovod_examples.py``.
"""

import importlib.util

import numpy as np
import pytest

from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

HAS_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed (pip install 'phalanx[tensorflow]')")


def _value(rank, shape=(3, 2)):
    """Rank r's input: the same on any process that asks, so each rank can compute the reference."""
    return (np.arange(np.prod(shape), dtype="float64").reshape(shape) + 1.0) * (rank + 1) - 2.0 * rank


def _collectives(tf, hvd, r, n, out):
    xs = [_value(q) for q in range(n)]
    x = tf.constant(xs[r], tf.float32)
    for name, op, ref in (("sum", hvd.Sum, sum(xs)), ("average", hvd.Average, sum(xs) / n),
                          ("min", hvd.Min, np.min(xs, 0)), ("max", hvd.Max, np.max(xs, 0)),
                          ("product", hvd.Product, np.prod(xs, 0))):
        out[f"allreduce_{name}"] = float(np.abs(hvd.allreduce(x, op=op).numpy() - ref).max())
    out["allreduce_prescale"] = float(np.abs(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                                           postscale_factor=0.5).numpy() - sum(xs)).max())
    out["dtypes"] = {}
    for dtype in (tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.int64, tf.float16, tf.float64):
        got = hvd.allreduce(tf.cast(tf.fill([4], r + 1), dtype), op=hvd.Sum)
        out["dtypes"][dtype.name] = (got.dtype.name, got.numpy().tolist())
    a, b = hvd.grouped_allreduce([x, tf.fill([2], float(r)), tf.constant([r + 1], tf.int32)], op=hvd.Sum)[:2]
    out["grouped_allreduce"] = (float(np.abs(a.numpy() - sum(xs)).max()), b.numpy().tolist())
    rows = [tf.fill([q + 1, 2], float(q)) for q in range(n)]
    out["allgather"] = hvd.allgather(rows[r]).numpy().tolist()
    g1, g2 = hvd.grouped_allgather([rows[r], tf.constant([r], tf.int64)])
    out["grouped_allgather"] = (g1.shape.as_list(), g2.numpy().tolist())
    out["broadcast"] = hvd.broadcast(x, root_rank=1).numpy().tolist()
    v = tf.Variable(tf.fill([3], float(r)))
    returned = hvd.broadcast_([v], root_rank=1)
    out["broadcast_"] = (v.numpy().tolist(), returned[0] is v)
    # alltoall: rank r sends r+1 rows to rank 0 and the rest to rank 1
    send = tf.reshape(tf.range(8 * (r + 1), 8 * (r + 1) + 8), [4, 2])
    received, splits = hvd.alltoall(send, splits=[r + 1, 3 - r])
    out["alltoall"] = (received.numpy().tolist(), splits.numpy().tolist())
    out["alltoall_even"] = hvd.alltoall(tf.range(4) + 10 * r).numpy().tolist()
    big = [_value(q, (5, 2)) for q in range(n)]
    out["reducescatter_sum"] = hvd.reducescatter(tf.constant(big[r]), op=hvd.Sum).numpy().tolist()
    out["reducescatter_avg"] = hvd.reducescatter(tf.constant(big[r]), op=hvd.Average).numpy().tolist()
    out["reducescatter_ref"] = (sum(big)[:3].tolist(), sum(big)[3:].tolist())
    g = hvd.grouped_reducescatter([tf.constant(big[r]), tf.ones([2, 3]) * (r + 1)], op=hvd.Sum)
    out["grouped_reducescatter"] = [t.numpy().tolist() for t in g]
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([3, 2]))
    reduced = hvd.allreduce(slices, op=hvd.Average)
    out["indexed_slices"] = (type(reduced).__name__, tf.convert_to_tensor(reduced).numpy().tolist())
    t16, ctx = hvd.Compression.fp16.compress(x)
    out["fp16"] = (t16.dtype.name, hvd.Compression.fp16.decompress(t16, ctx).dtype.name,
                   float(np.abs(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16).numpy()
                                - sum(xs)).max()))
    out["objects"] = (hvd.broadcast_object({"from": r}, root_rank=1), hvd.allgather_object(r * 10),
                      hvd.broadcast_object_fn(root_rank=0)(["x", r]))
    out["ops"] = [int(t.numpy()) for t in (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                                           hvd.process_set_included_op())]
    out["built"] = [f() for f in (hvd.mpi_built, hvd.gloo_built, hvd.nccl_built, hvd.ccl_built)]


def _mismatch(tf, hvd, r, out):
    try:
        hvd.allreduce(tf.ones([2 + r]))
        out["mismatch"] = "no error"
    except tf.errors.FailedPreconditionError as err:
        out["mismatch"] = (type(err).__name__, isinstance(err, hvd.MismatchError), "allreduce" in err.message)
    out["after_mismatch"] = float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()[0])

    def kind_of_error(run):
        try:
            run()
            return "no error"
        except tf.errors.OpError as err:
            return type(err).__name__, "allreduce" in err.message

    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        bad, good = hvd.allreduce(tf.ones([2 + r])), hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        out["mismatch_graph"] = kind_of_error(lambda: session.run(bad))
        out["after_mismatch_graph"] = session.run(good).tolist()
    out["mismatch_function"] = kind_of_error(lambda: tf.function(hvd.allreduce)(tf.ones([2 + r])))


def _gradients(tf, hvd, r, n, out):
    w = tf.Variable([1.0, 2.0, 3.0, 4.0])

    def grads(fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(w * float(r + 1)) ** 2 / 2.0)
        return tape.gradient(loss, w).numpy().tolist()

    out["grads_eager"] = {
        "allreduce": grads(lambda t: hvd.allreduce(t, op=hvd.Sum)),
        "allgather": grads(lambda t: hvd.allgather(t)),
        "broadcast": grads(lambda t: hvd.broadcast(t, root_rank=0)),
        "alltoall": grads(lambda t: hvd.alltoall(t)),
        "reducescatter": grads(lambda t: hvd.reducescatter(t, op=hvd.Sum)),
    }

    @tf.function
    def in_function():
        with tf.GradientTape() as tape:
            y = hvd.allreduce(w * float(r + 1), op=hvd.Sum)
            z = hvd.allgather(w * float(r + 1))
            loss = tf.reduce_sum(y ** 2) / 2.0 + tf.reduce_sum(z ** 2) / 2.0
        return tape.gradient(loss, w)

    out["grads_function"] = in_function().numpy().tolist()


def _graph_mode(tf, hvd, r, out):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant([float(r + 1), 2.0])
        summed = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.fill([r + 1], float(r)))
        broadcast = hvd.broadcast(x, root_rank=1)
        v = tf.compat.v1.Variable([float(r)] * 2, use_resource=True)
        init = tf.compat.v1.global_variables_initializer()
        sync = hvd.broadcast_global_variables(1)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            got = session.run([summed, gathered, broadcast])  # three collectives in one run
            session.run(sync)
            out["graph"] = [t.tolist() for t in got] + [session.run(v).tolist()]
    try:
        hvd.broadcast_global_variables(0)
        out["eager_global_variables"] = "no error"
    except RuntimeError as err:
        out["eager_global_variables"] = str(err)


V1_X = np.random.default_rng(3).standard_normal((8, 3)).astype("float32")
V1_Y = np.random.default_rng(4).standard_normal((8, 1)).astype("float32")


def _v1_graph_train(tf, x, y, wrap, steps=3):
    """TF1 code: a linear model trained with MomentumOptimizer in a v1 graph; ``wrap`` the optimizer or not."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        w = tf.compat.v1.Variable(np.ones((3, 1), "float32"), use_resource=True)
        b = tf.compat.v1.Variable(np.zeros((1,), "float32"), use_resource=True)
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        opt = wrap(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
        train_op = opt.minimize(loss)
        local = wrap(tf.compat.v1.train.GradientDescentOptimizer(1.0))
        if hasattr(local, "register_local_var"):
            local.register_local_var(b)
        first_grads = local.compute_gradients(loss, [w, b])
        session.run(tf.compat.v1.global_variables_initializer())
        grads = session.run([g for g, _ in first_grads])
        for _ in range(steps):
            session.run(train_op)
        return {"w": session.run(w).ravel().tolist(), "b": session.run(b).tolist(),
                "grads": [g.ravel().tolist() for g in grads], "slots": opt.get_slot_names(),
                "is_v1": isinstance(opt, tf.compat.v1.train.Optimizer)}


def _v1_optimizer(tf, hvd, r, n, out):
    rows = slice(r * 4, (r + 1) * 4)
    out["v1_opt"] = _v1_graph_train(tf, V1_X[rows], V1_Y[rows], hvd.DistributedOptimizer)
    out["v1_opt_ref"] = _v1_graph_train(tf, V1_X, V1_Y, lambda opt: opt)  # one process, both ranks' rows
    try:
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
        out["v1_opt_k2"] = "no error"
    except ValueError as err:
        out["v1_opt_k2"] = str(err)


def _in_function_broadcast(tf, hvd, r, out):
    model_w = tf.Variable(tf.fill([2], float(r)))
    step_count = tf.Variable(0.0)

    @tf.function
    def step(first_batch):
        model_w.assign_add([1.0, 1.0])
        step_count.assign_add(1.0)
        if first_batch:  # Horovod's examples: a Python bool, one trace each
            hvd.broadcast_variables([model_w], root_rank=1)
        return model_w.read_value()

    out["function_broadcast"] = (step(True).numpy().tolist(), step(False).numpy().tolist())


def _tapes(tf, hvd, r, n, out):
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    x = tf.constant(_value(r, (4, 3)), tf.float32)

    def local_grads(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(xb) ** 2)
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    every = [local_grads(tf.constant(_value(q, (4, 3)), tf.float32)) for q in range(n)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    got = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    first = len(model.layers[0].trainable_weights)
    shared = max(float(np.abs(g - sum(e[i] for e in every) / n).max()) for i, g in enumerate(got[:first]))
    local = max(float(np.abs(g - every[r][first + i] / n).max()) for i, g in enumerate(got[first:]))
    out["partial_tape"] = (shared, local)


def _sync_batch_norm(tf, hvd, r, n, out):
    xs = np.stack([_value(q, (4, 2)) for q in range(n)]).astype("float32")  # rank q's batch: xs[q]
    reference = tf.keras.layers.BatchNormalization(axis=-1)
    ref_out = reference(tf.constant(xs.reshape(-1, 2)), training=True).numpy().reshape(n, 4, 2)
    sync = hvd.SyncBatchNormalization(axis=-1)
    x = tf.Variable(xs[r])
    with tf.GradientTape() as tape:
        y = sync(x, training=True)
        loss = tf.reduce_sum(y[:, 0] * tf.range(1.0, 5.0))
    grad = tape.gradient(loss, x).numpy()
    xall = tf.Variable(xs.reshape(-1, 2))
    with tf.GradientTape() as tape:
        yall = tf.keras.layers.BatchNormalization(axis=-1)(xall, training=True)
        loss_all = tf.reduce_sum(tf.reshape(yall, [n, 4, 2])[:, :, 0] * tf.range(1.0, 5.0))
    grad_all = tape.gradient(loss_all, xall).numpy().reshape(n, 4, 2)[r]
    out["sync_bn"] = (float(np.abs(y.numpy() - ref_out[r]).max()),
                      float(np.abs(sync.moving_mean.numpy() - reference.moving_mean.numpy()).max()),
                      float(np.abs(sync.moving_variance.numpy() - reference.moving_variance.numpy()).max()),
                      float(np.abs(grad - grad_all).max()))


def _keras_state(tf, hvd, r, out):
    keras = tf.keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.set_weights([np.full((2, 2), float(r + 1), "float32"), np.full((2,), float(r + 1), "float32")])
    state = hvd.elastic.TensorFlowKerasState(model, keras.optimizers.Adam(0.01), batch=20 + r, epoch=10 + r)
    state.sync()
    synced = [w.tolist() for w in model.get_weights()]
    model.set_weights([np.zeros((2, 2), "float32"), np.zeros((2,), "float32")])
    state.batch = 99
    state.restore()
    out["keras_state"] = (synced, [w.tolist() for w in model.get_weights()], state.batch, state.epoch)
    variables = [tf.Variable([float(r)])]
    tf_state = hvd.elastic.TensorFlowState(variables, step=r)
    tf_state.sync()
    variables[0].assign([42.0])
    tf_state.restore()
    out["tf_state"] = (variables[0].numpy().tolist(), tf_state.step)


def _broadcast_callback_local(tf, hvd, r, out):
    keras = tf.keras
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(r), trainable=False),
                              keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r), trainable=False)])
    model.compile(optimizer=hvd.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    local = list(model.layers[0].variables)
    model.fit(np.ones((2, 3), "float32"), np.ones((2, 2), "float32"), epochs=1, verbose=0,
              callbacks=[hvd.keras.callbacks.BroadcastGlobalVariablesCallback(root_rank=1, local_variables=local)])
    out["broadcast_local"] = [float(np.asarray(v).ravel()[0]) for v in model.variables]


def _tf_body():
    import tensorflow as tf

    import phalanx.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    _collectives(tf, hvd, r, n, out)
    _mismatch(tf, hvd, r, out)
    _gradients(tf, hvd, r, n, out)
    _graph_mode(tf, hvd, r, out)
    _v1_optimizer(tf, hvd, r, n, out)
    _in_function_broadcast(tf, hvd, r, out)
    _tapes(tf, hvd, r, n, out)
    _sync_batch_norm(tf, hvd, r, n, out)
    _keras_state(tf, hvd, r, out)
    _broadcast_callback_local(tf, hvd, r, out)
    return out


@pytest.fixture(scope="module")
def tf_ranks():
    """One spawned group of 2 ranks runs every check below (TensorFlow's import alone takes seconds)."""
    if not HAS_TF:
        pytest.skip("tensorflow is not installed (pip install 'phalanx[tensorflow]')")
    return distributed(_tf_body, np=2, env={"KERAS_BACKEND": "tensorflow", "TF_USE_LEGACY_KERAS": "0"},
                       timeout=240)


N = 2
XS = [_value(q) for q in range(N)]


@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "product", "prescale"])
def test_allreduce_every_op_matches_one_process(op, tf_ranks):
    for r, out in enumerate(tf_ranks):
        assert out[f"allreduce_{op}"] < 1e-4, f"rank {r} allreduce {op}: max error {out[f'allreduce_{op}']}"


def test_allreduce_keeps_every_integer_and_float_dtype(tf_ranks):
    for out in tf_ranks:
        for name, (got_dtype, values) in out["dtypes"].items():
            assert got_dtype == name and values == [3] * 4, (name, got_dtype, values)


def test_grouped_allreduce_reduces_each_tensor(tf_ranks):
    for out in tf_ranks:
        assert out["grouped_allreduce"][0] < 1e-4 and out["grouped_allreduce"][1] == [1.0, 1.0]


def test_allgather_and_grouped_allgather_take_uneven_first_dimensions(tf_ranks):
    for out in tf_ranks:
        assert out["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["grouped_allgather"] == ([3, 2], [0, 1])


def test_broadcast_and_in_place_broadcast_(tf_ranks):
    for out in tf_ranks:
        np.testing.assert_allclose(out["broadcast"], XS[1])
        assert out["broadcast_"] == ([1.0, 1.0, 1.0], True)


def test_alltoall_with_and_without_splits(tf_ranks):
    sends = [np.arange(8 * (q + 1), 8 * (q + 1) + 8).reshape(4, 2) for q in range(N)]
    want = [np.concatenate([sends[0][:1], sends[1][:2]]), np.concatenate([sends[0][1:], sends[1][2:]])]
    for r, out in enumerate(tf_ranks):
        received, splits = out["alltoall"]
        np.testing.assert_array_equal(received, want[r])
        assert splits == [[1, 2], [3, 2]][r]
        assert out["alltoall_even"] == [[0, 1, 10, 11], [2, 3, 12, 13]][r]


def test_reducescatter_sum_average_and_grouped(tf_ranks):
    for r, out in enumerate(tf_ranks):
        ref = out["reducescatter_ref"][r]
        np.testing.assert_allclose(out["reducescatter_sum"], ref)
        np.testing.assert_allclose(out["reducescatter_avg"], np.array(ref) / N)
        np.testing.assert_allclose(out["grouped_reducescatter"][0], ref)
        np.testing.assert_allclose(out["grouped_reducescatter"][1], np.full((1, 3), 3.0))


def test_indexed_slices_are_reduced_by_gathering(tf_ranks):
    for out in tf_ranks:
        kind, dense = out["indexed_slices"]
        assert kind == "IndexedSlices"
        np.testing.assert_allclose(dense, [[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]])


def test_compression_fp16_on_tf_tensors(tf_ranks):
    for out in tf_ranks:
        assert out["fp16"][:2] == ("float16", "float32") and out["fp16"][2] < 0.05, out["fp16"]


def test_objects_rank_ops_and_build_flags(tf_ranks):
    for r, out in enumerate(tf_ranks):
        assert out["objects"] == ({"from": 1}, [0, 10], ["x", 0])
        assert out["ops"] == [r, N, r, N, 1]
        assert out["built"] == [False, True, False, False]


def test_a_cross_rank_mismatch_is_a_failed_precondition_and_the_group_goes_on(tf_ranks):
    for out in tf_ranks:
        assert out["mismatch"] == ("MismatchError", True, True), out["mismatch"]
        assert out["after_mismatch"] == 2.0


def test_a_mismatch_in_a_v1_graph_or_tf_function_is_a_failed_precondition_too(tf_ranks):
    for out in tf_ranks:
        assert out["mismatch_graph"] == ("FailedPreconditionError", True), out["mismatch_graph"]
        assert out["after_mismatch_graph"] == [2.0], "the graph's next collective runs"
        assert out["mismatch_function"] == ("FailedPreconditionError", True), out["mismatch_function"]


def _expected_gradients(r):
    """The gradient of sum(f(w * (r+1))^2 / 2) with respect to w, by Horovod's rules, for N=2."""
    w = np.array([1.0, 2.0, 3.0, 4.0])
    inputs = [w * (q + 1) for q in range(N)]
    c = r + 1
    summed = sum(inputs)
    allreduce = c * summed * N  # d/dx of the Sum is the Sum of the upstream gradients (each = summed)
    allgather = c * sum(inputs[r] for _ in range(N)) / N  # upstream averaged, own rows
    broadcast = c * inputs[0] if r == 0 else 0 * w  # upstream averaged (all equal) on the root, 0 elsewhere
    halves = [np.split(x, N) for x in inputs]  # alltoall: rank q gets half q of every rank
    received = [np.concatenate([halves[s][q] for s in range(N)]) for q in range(N)]
    alltoall = c * np.concatenate([np.split(received[q], N)[r] for q in range(N)])
    scattered = np.split(summed, N)  # reducescatter Sum: upstream allgathered, times the set size
    reducescatter = c * N * np.concatenate(scattered)
    return {"allreduce": allreduce, "allgather": allgather, "broadcast": broadcast, "alltoall": alltoall,
            "reducescatter": reducescatter}


@pytest.mark.parametrize("op", ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"])
def test_gradient_flows_through_each_collective_eagerly(op, tf_ranks):
    for r, out in enumerate(tf_ranks):
        np.testing.assert_allclose(out["grads_eager"][op], _expected_gradients(r)[op], rtol=1e-5,
                                   err_msg=f"rank {r}: gradient through {op}")


def test_gradients_flow_inside_tf_function(tf_ranks):
    for r, out in enumerate(tf_ranks):
        want = _expected_gradients(r)
        np.testing.assert_allclose(out["grads_function"], want["allreduce"] + want["allgather"], rtol=1e-5)


def test_v1_session_runs_several_collectives_in_one_run(tf_ranks):
    for out in tf_ranks:
        summed, gathered, broadcast, variable = out["graph"]
        assert summed == [3.0, 4.0] and gathered == [0.0, 1.0, 1.0] and broadcast == [2.0, 2.0]
        assert variable == [1.0, 1.0], "broadcast_global_variables(1) in the session"
        assert "broadcast_variables" in out["eager_global_variables"]


def test_v1_optimizer_in_a_graph_trains_as_one_process_on_both_ranks_rows(tf_ranks):
    for r, out in enumerate(tf_ranks):
        got, ref = out["v1_opt"], out["v1_opt_ref"]
        assert got["is_v1"] and got["slots"] == ["momentum"], "a tf.compat.v1.train.Optimizer, the inner one's slots"
        np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-5, err_msg=f"rank {r} weights")
        np.testing.assert_allclose(got["b"], ref["b"], rtol=1e-5, atol=1e-7, err_msg=f"rank {r} bias")
        assert not np.allclose(ref["w"], 1.0), "the reference trained"
        assert "backward_passes_per_step" in out["v1_opt_k2"] and "\n" not in out["v1_opt_k2"], out["v1_opt_k2"]


def test_v1_optimizer_compute_gradients_averages_and_scales_a_local_var(tf_ranks):
    w = np.ones((3, 1))
    own = []
    for q in range(N):
        x, y = V1_X[q * 4:(q + 1) * 4].astype("float64"), V1_Y[q * 4:(q + 1) * 4].astype("float64")
        err = x @ w - y
        own.append((2 * x.T @ err / len(x), 2 * err.mean(0)))
    for r, out in enumerate(tf_ranks):
        grad_w, grad_b = out["v1_opt"]["grads"]
        np.testing.assert_allclose(grad_w, np.mean([g[0] for g in own], 0).ravel(), rtol=1e-5)
        np.testing.assert_allclose(grad_b, own[r][1] / N, rtol=1e-5, err_msg="local var: own gradient / size")


def test_broadcast_variables_inside_tf_function_on_the_first_step(tf_ranks):
    for out in tf_ranks:
        first, second = out["function_broadcast"]
        assert first == [2.0, 2.0] and second == [3.0, 3.0], out["function_broadcast"]


def test_partial_tape_averages_shared_and_scales_local_gradients(tf_ranks):
    for out in tf_ranks:
        shared, local = out["partial_tape"]
        assert shared < 1e-5 and local < 1e-6, out["partial_tape"]


def test_sync_batch_normalization_matches_one_process_on_the_global_batch(tf_ranks):
    for r, out in enumerate(tf_ranks):
        assert max(out["sync_bn"]) < 1e-4, f"rank {r}: output, moving mean, moving variance, grad: {out['sync_bn']}"


def test_keras_state_sync_then_restore_returns_to_the_synced_weights(tf_ranks):
    for out in tf_ranks:
        synced, restored, batch, epoch = out["keras_state"]
        assert synced == [[[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]] and restored == synced
        assert (batch, epoch) == (20, 10)
        assert out["tf_state"] == ([0.0], 0)


def test_broadcast_callback_leaves_local_variables_alone(tf_ranks):
    for r, out in enumerate(tf_ranks):
        # [kernel, bias] of the local first layer (each rank's own), then of the second (rank 1's)
        assert out["broadcast_local"] == [float(r), 0.0, 1.0, 0.0], out["broadcast_local"]

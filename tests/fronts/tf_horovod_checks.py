"""What the ranks of ``test_tensorflow_horovod.py`` run: Horovod's ``horovod.tensorflow`` API on phalanx,
each check writing its outcome (or what one process computes from both ranks' inputs) into ``out``.

:func:`tf_body` runs them all in one spawned group of 2 ranks (TensorFlow's import alone takes
seconds); the test module asserts on each entry.
"""

import numpy as np
from tf_phalanx_checks import phalanx_tensorflow


def value(rank, shape=(3, 2)):
    """Rank r's input: the same on any process that asks, so each rank can compute the reference."""
    return (np.arange(np.prod(shape), dtype="float64").reshape(shape) + 1.0) * (rank + 1) - 2.0 * rank


def _collectives(tf, hvd, r, n, out):
    xs = [value(q) for q in range(n)]
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
    big = [value(q, (5, 2)) for q in range(n)]
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


def _graph_chain(tf, hvd, r, out):
    """A variable broadcast built after a step that reads a placeholder runs alone (a graph collective
    depends on no other), here through BroadcastGlobalVariablesHook in a MonitoredSession."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.compat.v1.Variable([[float(r + 1)], [float(r + 1)]], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w))
        grad = hvd.allreduce(tf.gradients(loss, [w])[0])
        step = w.assign_sub(0.1 * grad)
        hook = hvd.BroadcastGlobalVariablesHook(1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:  # runs the broadcast alone first
            synced = session.run(w).ravel().tolist()
            session.run(step, feed_dict={x: np.full((2, 2), float(r + 1), "float32")})
            out["hook"] = {"synced": synced, "stepped": session.run(w).ravel().tolist()}


GRAPH_N = 12


def _graph_order(tf, hvd, r, out):
    """A v1 graph's collectives ordered at run time: GRAPH_N allreduces built in a loop, each fed by its
    own placeholder and run alone (a run that also ran the earlier ones, as a build-time chain does,
    would ask for their feeds), then all in one run fetched in a different order on each rank, an
    allreduce of an allgather's result beside them, and Horovod's fused-allgather pattern (each run
    fetches every allgather built so far)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        feeds = [tf.compat.v1.placeholder(tf.float32, [2]) for _ in range(GRAPH_N)]
        summed = [hvd.allreduce(f, op=hvd.Sum) for f in feeds]
        out["graph_loop"] = [session.run(summed[i], {feeds[i]: [r + i, i]}).tolist() for i in range(GRAPH_N)]
        order = list(range(GRAPH_N))[::-1] if r else list(range(GRAPH_N))
        gathered = hvd.allgather(tf.fill([r + 1, 1], float(r + 1)))
        chained = hvd.allreduce(tf.reduce_sum(gathered), op=hvd.Sum)  # needs the allgather's result first
        got = session.run([summed[i] for i in order] + [chained, gathered],
                          {f: [10.0 * r + i, 1.0] for i, f in enumerate(feeds)})
        out["graph_fetch_order"] = [got[order.index(i)].tolist() for i in range(GRAPH_N)]
        out["graph_dependent"] = float(got[GRAPH_N])
        checks = []
        for i in range(3):
            checks.append(hvd.allgather(tf.fill([r + 1], float(10 * i + r))))
            fetched = session.run(checks)
        out["graph_refetch"] = [t.tolist() for t in fetched]


def _coordinator(out):
    """graph_order's Coordinator alone (no TF), two of them on one in-memory store standing for 2 ranks:
    the same order on both whatever order they post in, nothing run before both posted, a timeout
    and a late post each one clear failure."""
    import time

    import torch.distributed as dist

    from phalanx.tensorflow.graph_order import Coordinator

    def pair(timeout_s):
        store = dist.HashStore()
        return [Coordinator(dist.PrefixStore("t", store), q, timeout_s) for q in (0, 1)]

    ran = ([], [])

    def post(c, name):
        return c.post(name, lambda ts: ran[c.rank].append(name) or ts, [name], [0, 1], lambda err: None)

    cs = pair(60.0)
    ids = [[post(cs[0], k) for k in "abc"], [post(cs[1], k) for k in "cab"]]
    ids[0].append(post(cs[0], "d"))
    time.sleep(0.2)
    early = "d" in ran[0]
    ids[1].append(post(cs[1], "d"))
    outputs = [[cs[q].take(i).outputs for i in ids[q]] for q in (0, 1)]
    out["coord_order"] = (list(ran[0]), list(ran[1]), early, outputs[1])
    late = pair(0.2)
    waited = late[0].take(post(late[0], "e")).message
    refused = late[1].take(post(late[1], "e")).message
    out["coord_timeout"] = (waited, refused)
    for c in cs + late:
        c.close()


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
    x = tf.constant(value(r, (4, 3)), tf.float32)

    def local_grads(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(xb) ** 2)
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    every = [local_grads(tf.constant(value(q, (4, 3)), tf.float32)) for q in range(n)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    got = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    first = len(model.layers[0].trainable_weights)
    shared = max(float(np.abs(g - sum(e[i] for e in every) / n).max()) for i, g in enumerate(got[:first]))
    local = max(float(np.abs(g - every[r][first + i] / n).max()) for i, g in enumerate(got[first:]))
    out["partial_tape"] = (shared, local)


def _sync_batch_norm(tf, hvd, r, n, out):
    xs = np.stack([value(q, (4, 2)) for q in range(n)]).astype("float32")  # rank q's batch: xs[q]
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


def _private_names(tf, hvd, r, out):
    """Horovod's opt._compute_gradients / apply_gradients / _agg_helper.counter on Keras 3, k = 2, 3 passes;
    rank r's gradient on pass p is (r + 1)(p + 1) per element, SGD with rate 1."""
    x = tf.Variable([1.0, 2.0])
    opt = hvd.keras.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    seen, returned = [], []
    for p in range(3):
        scale = float((r + 1) * (p + 1))
        pairs = opt._compute_gradients(lambda s=scale: tf.reduce_sum(x * s), [x])
        returned.append(pairs[0][0].numpy().tolist())
        opt.apply_gradients(pairs)
        seen.append(x.numpy().tolist())
    out["private_names"] = {"x": seen, "returned": returned, "iterations": int(opt.iterations.numpy()),
                            "counter": int(opt._agg_helper.counter.numpy())}


def tf_body():
    import tensorflow as tf

    import phalanx.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    _collectives(tf, hvd, r, n, out)
    _mismatch(tf, hvd, r, out)
    _gradients(tf, hvd, r, n, out)
    _graph_mode(tf, hvd, r, out)
    _graph_chain(tf, hvd, r, out)
    _graph_order(tf, hvd, r, out)
    if r == 0:
        _coordinator(out)
    _v1_optimizer(tf, hvd, r, n, out)
    _in_function_broadcast(tf, hvd, r, out)
    _tapes(tf, hvd, r, n, out)
    _sync_batch_norm(tf, hvd, r, n, out)
    _keras_state(tf, hvd, r, out)
    _broadcast_callback_local(tf, hvd, r, out)
    _private_names(tf, hvd, r, out)
    out["phalanx_tf"] = phalanx_tensorflow(tf, hvd)  # last: it imports tf_keras too
    return out

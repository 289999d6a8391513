"""Horovod's ``horovod.tensorflow`` API on phalanx: every collective, its gradient, graph mode and the
Keras pieces, on 2 real ranks against what one process computes from both ranks' inputs.

One spawned group (Keras 3 on TensorFlow) runs every check (``tf_horovod_checks.py``: what the ranks
run), phalanx.tensorflow's own ones last (the alias modules, eager and tf.function collectives,
DistributedGradientTape against one process); each check is its own test here.
The Keras 2 (tf-keras) side and Horovod's own example scripts are in
``test_tensorflow_horovod_examples.py``.
"""

import importlib.util

import numpy as np
import pytest
from tf_horovod_checks import GRAPH_N, V1_X, V1_Y, tf_body, value
from tf_phalanx_checks import HAS_TF_KERAS

from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

HAS_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("keras") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed (pip install 'phalanx[tensorflow]')")


@pytest.fixture(scope="module")
def tf_ranks():
    """One spawned group of 2 ranks runs every check below (TensorFlow's import alone takes seconds)."""
    if not HAS_TF:
        pytest.skip("tensorflow is not installed (pip install 'phalanx[tensorflow]')")
    return distributed(tf_body, np=2, env={"KERAS_BACKEND": "tensorflow", "TF_USE_LEGACY_KERAS": "0"},
                       timeout=240)


N = 2
XS = [value(q) for q in range(N)]


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


def test_v1_graph_collectives_run_alone_in_any_fetch_order_and_fetched_again(tf_ranks):
    for r, out in enumerate(tf_ranks):
        assert out["graph_loop"] == [[float(1 + 2 * i), float(2 * i)] for i in range(GRAPH_N)], \
            f"rank {r}: each allreduce run alone with its own feed"
        assert out["graph_fetch_order"] == [[10.0 + 2 * i, 2.0] for i in range(GRAPH_N)], \
            f"rank {r}: all in one run, fetched in a different order on each rank"
        assert out["graph_dependent"] == 2 * (1.0 + 2.0 * 2), "allreduce of the allgather's sum (1 + 2 + 2), both ranks"
        assert out["graph_refetch"] == [[0.0, 1.0, 1.0], [10.0, 11.0, 11.0], [20.0, 21.0, 21.0]], out["graph_refetch"]


def test_graph_coordinators_agree_on_one_order_and_time_out_clearly(tf_ranks):
    ran0, ran1, early, outputs = tf_ranks[0]["coord_order"]
    assert ran0 == ran1 and sorted(ran0) == ["a", "b", "c", "d"], (ran0, ran1)
    assert not early, "a collective ran before every member had posted it"
    assert outputs == [["c"], ["a"], ["b"], ["d"]], "each post gets its own collective's result"
    waited, refused = tf_ranks[0]["coord_timeout"]
    assert "only 1 of the 2 ranks" in waited and "0.2 s" in waited and "\n" not in waited, waited
    assert "gave up waiting" in refused and "\n" not in refused, refused


def test_v1_broadcast_hook_runs_alone_after_the_step_is_built(tf_ranks):
    # rank 1's w (2, 2) on both ranks, then one step: the mean over ranks of d/dw mean(x w) = mean of x's
    # column, x = r + 1 everywhere: (1 + 2) / 2 = 1.5 -> 2 - 0.1 * 1.5 = 1.85
    for out in tf_ranks:
        assert out["hook"]["synced"] == [2.0, 2.0], out["hook"]
        np.testing.assert_allclose(out["hook"]["stepped"], [1.85, 1.85], rtol=1e-6)


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


def test_horovods_private_compute_gradients_and_counter_on_keras_3(tf_ranks):
    # k = 2: pass 0 sums locally (rank r returns its own r + 1), pass 1 reduces the sums (mean over
    # ranks of 1 + 2 = 1.5, times 1 + 2 passes = 4.5) and updates, pass 2 sums again.
    for r, out in enumerate(tf_ranks):
        got = out["private_names"]
        assert got["returned"] == [[r + 1.0] * 2, [4.5, 4.5], [3.0 * (r + 1)] * 2], got
        assert got["x"] == [[1.0, 2.0], [-3.5, -2.5], [-3.5, -2.5]], got
        assert got["iterations"] == 3 and got["counter"] == 1, got


def test_phalanx_tensorflow_on_two_ranks(tf_ranks):
    """phalanx.tensorflow's own checks (tf_phalanx_checks.py), in this module's group."""
    a, b = (out["phalanx_tf"] for out in tf_ranks)
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

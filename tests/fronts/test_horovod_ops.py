"""Horovod's options and handles, Adasum and the optimizer wrapper's Horovod behaviours, on 2 real ranks.

One spawned group runs every check; each check is its own test against values worked out
from Horovod 0.28's documented semantics.
"""

import warnings

import pytest
import torch
from rank_outcomes import per_rank, record

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks



def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _options():
    r = hvd.rank()
    out = {}
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (r + 1)
    record(out, "grouped_reducescatter_scaled", lambda: hvd.grouped_reducescatter(
        [x, x * 10], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
    record(out, "reducescatter_prescale_average", lambda: hvd.reducescatter(x, prescale_factor=2.0))
    record(out, "alltoall_received_splits", lambda: hvd.alltoall(torch.arange(3.0) + 10 * r, splits=[1, 2])[1])
    record(out, "reducescatter_scalar", lambda: hvd.reducescatter(torch.tensor(1.0)))
    record(out, "int_scaled_allreduce", lambda: hvd.allreduce(torch.tensor([3, 5], dtype=torch.int32) * (r + 1),
                                                             op=hvd.Sum, prescale_factor=2, postscale_factor=0.5))
    record(out, "int_scaled_reducescatter", lambda: hvd.reducescatter(
        torch.tensor([4, 6, 8, 10]) * (r + 1), op=hvd.Sum, prescale_factor=1.5))
    record(out, "int_float_factor_truncates", lambda: hvd.allreduce(torch.tensor([3 + r, -3 + r]), op=hvd.Sum,
                                                                   postscale_factor=0.5))

    def sparse_callable():
        handle = hvd.sparse_allreduce_async(torch.sparse_coo_tensor([[r]], torch.ones(1, 2) * (r + 1), (3, 2)),
                                            name="emb", op=hvd.Sum)
        return callable(handle), handle().to_dense()
    record(out, "sparse_callable", sparse_callable)

    def every_async_handle():
        t = torch.ones(3) * (r + 1)
        pending = [hvd.allreduce_async(t, op=hvd.Sum), hvd.allreduce_async_(t.clone(), op=hvd.Sum),
                   hvd.grouped_allreduce_async([t]), hvd.grouped_allreduce_async_([t.clone()]),
                   hvd.allgather_async(t), hvd.grouped_allgather_async([t]), hvd.broadcast_async(t, 0),
                   hvd.broadcast_async_(t.clone(), 0), hvd.alltoall_async(torch.ones(2)),
                   hvd.reducescatter_async(torch.ones(2)), hvd.grouped_reducescatter_async([torch.ones(2)]),
                   hvd.sparse_allreduce_async(torch.ones(2, 1).to_sparse(), name="s2", op=hvd.Sum)]
        polls = [isinstance(hvd.poll(h), bool) for h in pending]
        results = [hvd.synchronize(h) for h in pending]
        return all(polls), all(hvd.poll(h) for h in pending), len([x for x in results if x is not None])
    record(out, "every_async_handle", every_async_handle)

    def adasum():
        a = torch.tensor([1.0, 0.0]) if r == 0 else torch.tensor([0.0, 1.0])  # orthogonal: the sum
        b = torch.tensor([2.0, 2.0])  # equal: the vector itself
        c = torch.tensor([1.0, 1.0]) * (r + 1)  # parallel 1 and 2: 1.5 * [1, 1]
        return [hvd.allreduce(v, op=hvd.Adasum) for v in (a, b, c)]
    record(out, "adasum", adasum)
    def init_with_process_sets():
        pair = hvd.ProcessSet([0, 1])
        hvd.init(process_sets=[pair])  # already running: registers the set, as Horovod's init does
        return pair.process_set_id is not None, hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair).item()
    record(out, "init_with_process_sets", init_with_process_sets)
    record(out, "internal_error_type", lambda: issubclass(hvd.HorovodInternalError, RuntimeError))

    # the optimizer wrapper
    def no_named_parameters():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(2, 4) * (r + 1)).sum().backward()
        opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    record(out, "no_named_parameters", no_named_parameters)

    def sync_then_step_warns():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        caught = []
        for skip in (False, True):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                model(torch.ones(2, 4)).sum().backward()
                opt.synchronize()
                if skip:
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
                caught.append([str(m.message) for m in w if "skip_synchronize" in str(m.message)])
        return caught
    record(out, "sync_then_step_warns", sync_then_step_warns)

    def optimizer_state_without_grads():
        model = _model()
        unused = torch.nn.Parameter(torch.full((2,), float(r)))
        opt = torch.optim.Adam([*model.parameters(), unused], lr=0.1 * (r + 1))
        model(torch.ones(1, 4)).sum().backward()  # unused has no gradient
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=1)
        return opt.param_groups[0]["lr"], len(opt.state)
    record(out, "optimizer_state_without_grads", optimizer_state_without_grads)

    def missing_gradients_as_horovod():
        # Horovod's optimizer: a parameter without a gradient contributes zeros and gets the average;
        # "head" is used on rank 1 only, "idle" on no rank (Horovod gives it zeros, not None)
        trunk, head, idle = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([trunk, head, idle], lr=0.0),
                                       named_parameters=[("trunk", trunk), ("head", head), ("idle", idle)])
        grads = []
        for _ in range(2):  # the second step runs on the re-planned buckets
            opt.zero_grad()
            loss = (trunk * (r + 1)).sum() + ((head * 4).sum() if r == 1 else 0)
            loss.backward()
            opt.step()
            grads.append([None if p.grad is None else p.grad.tolist() for p in (trunk, head, idle)])
        return grads
    record(out, "missing_gradients_as_horovod", missing_gradients_as_horovod)

    def broadcast_parameters_forms():
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(r)
        hvd.broadcast_parameters(model.state_dict(), root_rank=1)
        by_state = all(p.eq(1).all().item() for p in model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(r + 5)
        hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
        return by_state, all(p.eq(5).all().item() for p in model.parameters())
    record(out, "broadcast_parameters_forms", broadcast_parameters_forms)
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_options, np=2, timeout=180)



def test_grouped_reducescatter_takes_prescale_and_postscale(results):
    for r, (a, b) in enumerate(per_rank(results, "grouped_reducescatter_scaled")):
        full = torch.tensor([1.0, 2.0, 3.0, 4.0]) * 3 * 0.5 * 3.0  # ranks contribute x and 2x
        torch.testing.assert_close(a, full[2 * r:2 * r + 2])
        torch.testing.assert_close(b, full[2 * r:2 * r + 2] * 10)


def test_reducescatter_prescale_gives_the_scaled_average(results):
    for r, got in enumerate(per_rank(results, "reducescatter_prescale_average")):
        torch.testing.assert_close(got, (torch.tensor([1.0, 2.0, 3.0, 4.0]) * 3 * 2.0 / 2)[2 * r:2 * r + 2])


def test_alltoall_returns_the_received_splits(results):
    assert [s.tolist() for s in per_rank(results, "alltoall_received_splits")] == [[1, 1], [2, 2]]


def test_reducescatter_of_a_scalar_raises_horovods_error(results):
    for o in results:
        assert o["reducescatter_scalar"].startswith("HorovodInternalError:") and "scalar" in o["reducescatter_scalar"]


def test_integer_prescale_and_postscale(results):
    for got in per_rank(results, "int_scaled_allreduce"):
        assert got.dtype == torch.int32 and got.tolist() == [9, 15]  # (2*3 + 2*6) * 0.5
    for r, got in enumerate(per_rank(results, "int_scaled_reducescatter")):
        assert got.dtype == torch.int64 and got.tolist() == [[18, 27], [36, 45]][r]  # trunc(1.5 x) summed
    for got in per_rank(results, "int_float_factor_truncates"):
        assert got.tolist() == [3, -2]  # (7, -5) * 0.5, truncated toward zero


def test_sparse_allreduce_async_returns_a_callable(results):
    for is_callable, dense in per_rank(results, "sparse_callable"):
        assert is_callable and dense.tolist() == [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]


def test_poll_and_synchronize_on_every_async_handle(results):
    for polled_bool, done_after, n_results in per_rank(results, "every_async_handle"):
        assert polled_bool and done_after and n_results == 12


def test_adasum_on_cpu(results):
    for orthogonal, equal, parallel in per_rank(results, "adasum"):
        assert orthogonal.tolist() == [1.0, 1.0] and equal.tolist() == [2.0, 2.0]
        torch.testing.assert_close(parallel, torch.tensor([1.5, 1.5]))


def test_init_registers_process_sets(results):
    assert per_rank(results, "init_with_process_sets") == [(True, 2.0), (True, 2.0)]


def test_horovod_internal_error_is_exported(results):
    assert per_rank(results, "internal_error_type") == [True, True]
    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError


def test_distributed_optimizer_gives_missing_gradients_the_average_as_horovod(results):
    for steps in per_rank(results, "missing_gradients_as_horovod"):
        for trunk, head, idle in steps:
            assert trunk == [1.5, 1.5] and head == [2.0, 2.0] and idle == [0.0, 0.0], (trunk, head, idle)


def test_distributed_optimizer_without_named_parameters(results):
    got = per_rank(results, "no_named_parameters")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(torch.ones(2, 4)).sum() + model(torch.ones(2, 4) * 2).sum()).div(2).backward()
    opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for g in got:
        torch.testing.assert_close(g, want)


def test_synchronize_then_step_warns_unless_skip_synchronize(results):
    for without_skip, with_skip in per_rank(results, "sync_then_step_warns"):
        assert len(without_skip) == 1 and with_skip == []


def test_broadcast_optimizer_state_when_some_parameters_have_no_gradient(results):
    assert per_rank(results, "optimizer_state_without_grads") == [(0.2, 4), (0.2, 4)]


def test_broadcast_parameters_takes_state_dict_and_named_parameters(results):
    assert per_rank(results, "broadcast_parameters_forms") == [(True, True), (True, True)]

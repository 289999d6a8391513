"""Adasum on 4 real ranks against a one-process reference of the formula (Maleki et al., MLSys 2021):
``hvd.allreduce(op=hvd.Adasum)`` (Horovod's vector-halving tree), ``grouped_allreduce`` (each
tensor its own coefficients), inside a process set, ``DistributedOptimizer(op=hvd.Adasum)``
(the delta optimizer), and Horovod's refusal of a world that is not a power of two.
"""

import pytest
import torch
from rank_outcomes import per_rank, record

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks


def _combine(a, b):
    """Adasum of two vectors, written out here as the paper and Horovod's docs give it."""
    a, b = a.double(), b.double()
    dot = (a * b).sum()
    ca = 1 - dot / (2 * (a * a).sum()) if (a * a).sum() >= 1e-8 else 1.0
    cb = 1 - dot / (2 * (b * b).sum()) if (b * b).sum() >= 1e-8 else 1.0
    return ca * a + cb * b


def _tree(vectors):
    """((v0, v1), (v2, v3)): Horovod's pairing (rank ^ 1, then rank ^ 2)."""
    while len(vectors) > 1:
        vectors = [_combine(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _vec(r, n=11, seed=0):
    g = torch.Generator().manual_seed(100 * seed + r)
    return torch.randn(n, generator=g) + (1.0 if r % 2 else 0.0)  # neither parallel nor orthogonal


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(r):
    g = torch.Generator().manual_seed(r)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)



def _adasum():
    r = hvd.rank()
    out = {}
    record(out, "allreduce", lambda: hvd.allreduce(_vec(r), op=hvd.Adasum))
    record(out, "allreduce_f64_2d", lambda: hvd.allreduce(_vec(r, 12, 1).double().reshape(3, 4), op=hvd.Adasum))
    record(out, "tiny", lambda: hvd.allreduce(_vec(r, 3, 2), op=hvd.Adasum))  # fewer elements than ranks
    record(out, "prescale", lambda: hvd.allreduce(_vec(r), op=hvd.Adasum, prescale_factor=2.0,
                                                 postscale_factor=0.25))
    record(out, "grouped", lambda: hvd.grouped_allreduce([_vec(r, 5, 3), _vec(r, 7, 4)], op=hvd.Adasum))
    pair = hvd.add_process_set([1, 3])
    trio = hvd.add_process_set([0, 1, 2])
    record(out, "in_set", lambda: hvd.allreduce(_vec(r), op=hvd.Adasum, process_set=pair) if pair.included()
          else None)
    record(out, "three_ranks", lambda: hvd.allreduce(_vec(r), op=hvd.Adasum, process_set=trio) if trio.included()
          else None)

    def optimizer():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum)
        x, y = _batch(r)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    record(out, "optimizer", optimizer)
    record(out, "optimizer_in_set", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(_model().parameters(), lr=0.1), op=hvd.Adasum, process_set=pair))
    hvd.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_adasum, np=4, timeout=300)



@pytest.mark.parametrize("key,make", [
    ("allreduce", lambda r: _vec(r)),
    ("allreduce_f64_2d", lambda r: _vec(r, 12, 1).double().reshape(3, 4)),
    ("tiny", lambda r: _vec(r, 3, 2)),
])
def test_allreduce_adasum_is_the_pairwise_tree(results, key, make):
    want = _tree([make(r).reshape(-1) for r in range(4)])
    for got in per_rank(results, key):
        torch.testing.assert_close(got.reshape(-1).double(), want, atol=1e-5, rtol=1e-5)


def test_prescale_and_postscale_wrap_the_adasum(results):
    want = _tree([2.0 * _vec(r) for r in range(4)]) * 0.25
    for got in per_rank(results, "prescale"):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_grouped_allreduce_gives_each_tensor_its_own_coefficients(results):
    want = [_tree([_vec(r, 5, 3) for r in range(4)]), _tree([_vec(r, 7, 4) for r in range(4)])]
    fused = _tree([torch.cat([_vec(r, 5, 3), _vec(r, 7, 4)]) for r in range(4)])
    assert not torch.allclose(torch.cat(want), fused, atol=1e-3)  # the check can tell the two apart
    for got in per_rank(results, "grouped"):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_adasum_inside_a_process_set(results):
    got = per_rank(results, "in_set")
    want = _combine(_vec(1), _vec(3))
    assert got[0] is None and got[2] is None
    for r in (1, 3):
        torch.testing.assert_close(got[r].double(), want, atol=1e-5, rtol=1e-5)


def test_a_world_that_is_not_a_power_of_two_raises_horovods_error(results):
    for r, o in enumerate(results):
        if r == 3:
            assert o["three_ranks"] is None
        else:
            assert o["three_ranks"].startswith("HorovodInternalError") and "power-of-two" in o["three_ranks"]


def test_distributed_optimizer_adasum_combines_the_steps_deltas(results):
    # reference: every rank steps its own SGD (momentum state per rank), the deltas combine with Adasum
    models = [_model() for _ in range(4)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    for _ in range(3):
        starts = [[p.detach().clone() for p in m.parameters()] for m in models]
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            x, y = _batch(r)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        for k, start in enumerate(starts[0]):
            delta = _tree([(list(m.parameters())[k].detach() - s[k]).reshape(-1) for m, s in zip(models, starts)])
            for m in models:
                with torch.no_grad():
                    list(m.parameters())[k].copy_(start + delta.float().view_as(start))
    want = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
    for got in per_rank(results, "optimizer"):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_distributed_optimizer_adasum_refuses_a_process_set_as_horovod(results):
    for o in results:
        assert o["optimizer_in_set"].startswith("NotImplementedError") and "process sets" in o["optimizer_in_set"]

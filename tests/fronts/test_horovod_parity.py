"""The behaviours Horovod's own PyTorch suite (test/parallel/test_torch.py) checks that phalanx
lacked, on 2 real ranks (scripts/horovod_torch_suite runs that suite itself, by hand).

Named collectives match by name, not by order, and a second submission of a pending name raises
at once; ``join`` answers allreduce and refuses allgather/broadcast as Horovod's controller does;
``DistributedOptimizer`` outside its process set, without named parameters and over
``SparseAdam``; ``broadcast_optimizer_state`` before any gradient; an integer average truncates. One spawned group runs every
check; each check is its own test, numeric ones against a one-process reference.
"""

import pytest
import torch
from rank_outcomes import per_rank, record

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks



def _x(r):
    return torch.tensor([1.0, 2.0, 4.0]) * (r + 1)


def _duplicate_at_submission(r):
    # Horovod's test_horovod_allreduce_duplicate_name_error: rank 0 submits while rank 1 waits in a
    # barrier; neither submission may block, the second one of the same name raises at once
    raised, handle = [], None
    for turn in (0, 1):
        if r == turn:
            handle = hvd.allreduce_async(_x(r), name="dup", op=hvd.Sum)
            try:
                hvd.allreduce_async(_x(r), name="dup")
            except ValueError as e:
                raised.append(str(e))
            raised.append(hvd.poll(handle))
        hvd.barrier()
    return raised, hvd.synchronize(handle)


def _any_order(r):
    a, b = _x(r), torch.arange(4.0) * (r + 1)
    names = ["a", "b"] if r == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async(a if n == "a" else b, name=n, op=hvd.Sum) for n in names}
    return {n: hvd.synchronize(handles[n]) for n in names}


def _one_rank_only(r):
    if r == 0:
        return hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="only.rank0"))
    return hvd.allreduce(torch.ones(2), name="only.rank1")


def _join(r):
    out = {}
    if r == 0:
        out["last"] = hvd.join()
        return out
    out["average"] = hvd.allreduce(_x(r), name="avg")  # rank 0 contributes zeros, divides by 2
    out["async"] = hvd.synchronize(hvd.allreduce_async(_x(r), name="async.avg", op=hvd.Sum))
    for key, fn in (("allgather", lambda: hvd.allgather(_x(r))),
                    ("broadcast", lambda: hvd.broadcast(_x(r), root_rank=1, name="b"))):
        record(out, key, fn)
    out["last"] = hvd.join()
    return out


def _outside_set(r):
    ps = hvd.add_process_set([0])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=ps)
    model(torch.ones(2, 3) * (r + 1)).sum().backward()
    opt.step()
    hvd.barrier()  # rank 1 stays until rank 0 is done with the set
    hvd.remove_process_set(ps)
    return type(opt).__name__, model.weight.detach().clone()


def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))


def _without_names(r):
    model = _two_layers()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, generator=g)
    for _ in range(2):
        opt.zero_grad()
        model(x[2 * r:2 * r + 2]).pow(2).mean().backward()
        opt.step()
    return sorted(opt._parameter_names.values()), torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state_before_any_gradient(r):
    frozen = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
    free = torch.nn.Parameter(torch.ones(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, free], lr=0.1 * (r + 1), momentum=0.9),
                                   named_parameters=[("frozen", frozen), ("free", free)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return frozen.grad, free.grad, opt.param_groups[0]["lr"], free.detach().clone()


def _embedding():
    torch.manual_seed(0)
    return torch.nn.Embedding(10, 3, sparse=True)


EMBED_INPUT = [torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.tensor([[1, 3, 4], [4, 7, 9]])]


def _sparse_adam(r):
    out = {}
    for sparse_as_dense in (False, True):
        emb = _embedding()
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        for _ in range(2):
            opt.zero_grad()
            emb(EMBED_INPUT[r]).sum().backward()
            opt.step()
        out[sparse_as_dense] = emb.weight.detach().clone()
    return out


def _int_average(r):
    return hvd.allreduce(torch.tensor([-1, 5]) if r == 0 else torch.tensor([-4, 2]), name="int.avg")


CHECKS = {"int_average": _int_average, "duplicate": _duplicate_at_submission, "any_order": _any_order, "one_rank_only": _one_rank_only,
          "join": _join, "outside_set": _outside_set, "without_names": _without_names,
          "state_before_grad": _state_before_any_gradient, "sparse_adam": _sparse_adam}


def _group():
    r, out = hvd.rank(), {}
    for key, fn in CHECKS.items():
        record(out, key, lambda fn=fn: fn(r))
    out["after"] = hvd.allreduce(_x(r), op=hvd.Sum, name="after")  # the ranks still agree
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_group, np=2, timeout=180)



def test_duplicate_name_raises_at_submission_and_async_never_blocks(results):
    for r, (raised, total) in enumerate(per_rank(results, "duplicate")):
        message, polled = raised
        assert "'dup'" in message and "already in flight" in message, (r, message)
        assert polled is False, (r, polled)  # submitted, not started: poll answers without waiting
        torch.testing.assert_close(total, _x(0) + _x(1))


def test_named_collectives_match_by_name_in_any_order(results):
    for got in per_rank(results, "any_order"):
        torch.testing.assert_close(got["a"], _x(0) + _x(1))
        torch.testing.assert_close(got["b"], torch.arange(4.0) * 3)


def test_a_name_submitted_on_one_rank_only_raises_on_every_rank(results):
    for r, o in enumerate(results):
        message = o["one_rank_only"]
        assert message.startswith("CollectiveMismatchError: phalanx: no rank can go on"), (r, message)
        assert "'only.rank0' by ranks [0]" in message and "'only.rank1' by ranks [1]" in message
        assert "\n" not in message
    for o in results:
        torch.testing.assert_close(o["after"], _x(0) + _x(1))


def test_join_answers_allreduce_with_zeros_and_refuses_allgather_and_broadcast(results):
    joined, training = per_rank(results, "join")
    torch.testing.assert_close(training["average"], _x(1) / 2)
    torch.testing.assert_close(training["async"], _x(1))
    for key in ("allgather", "broadcast"):
        assert training[key].startswith("HorovodInternalError: ") and "not supported with join" in training[key]
    assert joined["last"] == training["last"] == 1


def test_optimizer_outside_its_process_set_steps_alone(results):
    kinds = [kind for kind, _ in per_rank(results, "outside_set")]
    assert kinds == ["HorovodOptimizer", "OutsideSetOptimizer"]
    for r, (_, weight) in enumerate(per_rank(results, "outside_set")):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        ref = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 3) * (r + 1)).sum().backward()  # each rank alone: a set of one, and outside
        ref.step()
        torch.testing.assert_close(weight, model.weight.detach())


def test_optimizer_without_named_parameters_names_them_as_horovod(results):
    (names0, params0), (names1, params1) = per_rank(results, "without_names")
    assert names0 == names1 == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                "allreduce.noname.1.0", "allreduce.noname.1.1"]
    model = _two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the average of the two ranks' half-batch means is the full-batch mean
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(params0, ref)
    torch.testing.assert_close(params1, ref)


def test_broadcast_optimizer_state_before_any_gradient(results):
    for frozen_grad, free_grad, lr, free in per_rank(results, "state_before_grad"):
        assert frozen_grad is None  # requires_grad=False: left alone, as Horovod
        torch.testing.assert_close(free_grad, torch.zeros(4))
        assert lr == pytest.approx(0.1)  # rank 0's hyperparameters
        torch.testing.assert_close(free, torch.ones(4))  # no step was taken to build the state


def test_sparse_adam_over_sparse_and_densified_gradients(results):
    emb = _embedding()
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    for _ in range(2):
        grads = []
        for x in EMBED_INPUT:
            emb.zero_grad()
            emb(x).sum().backward()
            grads.append(emb.weight.grad)
        emb.weight.grad = ((grads[0] + grads[1]) / 2).coalesce()
        opt.step()
    for r, got in enumerate(per_rank(results, "sparse_adam")):
        for sparse_as_dense in (False, True):
            torch.testing.assert_close(got[sparse_as_dense], emb.weight.detach(),
                                       msg=lambda m, s=sparse_as_dense, r=r: f"rank {r} sparse_as_dense={s}: {m}")


def test_integer_average_truncates_toward_zero_as_horovods_suite(results):
    for got in per_rank(results, "int_average"):
        assert got.dtype == torch.int64 and got.tolist() == [-2, 3]  # (-5, 7) / 2; floor would give -3

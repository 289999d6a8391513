"""Process sets on 4 real ranks: every collective, the object collectives, the optimizer,
SyncBatchNorm, and sets added and removed at run time (Horovod 0.28's process-set API).

Ranks {0, 2} and {1, 3} run each op inside their own set at the same time; results must be
what the op gives over that set alone. ``root_rank`` is a global rank.
"""

import pytest
import torch
from rank_outcomes import per_rank, record

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

SETS = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}


def _x(r):
    return torch.tensor([1.0, 2.0]) * (r + 1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(r):
    g = torch.Generator().manual_seed(r)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)



def _process_sets():
    r = hvd.rank()
    evens, odds = hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])
    mine = evens if r % 2 == 0 else odds
    root = mine.ranks[1]
    out = {"ids": (evens.process_set_id, odds.process_set_id, mine.size(), mine.rank())}
    record(out, "allreduce", lambda: hvd.allreduce(_x(r), op=hvd.Sum, process_set=mine))
    record(out, "allreduce_async", lambda: hvd.synchronize(hvd.allreduce_async(_x(r), process_set=mine)))
    record(out, "grouped_allreduce", lambda: hvd.grouped_allreduce([_x(r), _x(r)[:1]], op=hvd.Sum,
                                                                  process_set=mine))
    record(out, "allgather", lambda: hvd.allgather(torch.full((r + 1,), float(r)), process_set=mine))
    record(out, "broadcast", lambda: hvd.broadcast(_x(r), root_rank=root, process_set=mine))
    record(out, "alltoall", lambda: hvd.alltoall(torch.tensor([10.0 * r, 10.0 * r + 1]), process_set=mine))
    record(out, "reducescatter", lambda: hvd.reducescatter(torch.ones(4) * (r + 1), op=hvd.Sum, process_set=mine))
    record(out, "objects", lambda: (hvd.broadcast_object(f"r{r}", root_rank=root, process_set=mine),
                                   hvd.allgather_object(r, process_set=mine)))
    record(out, "barrier", lambda: hvd.barrier(process_set=mine))

    def optimizer():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=mine)
        x, y = _batch(r)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    record(out, "optimizer", optimizer)

    def sync_batchnorm():
        bn = hvd.SyncBatchNorm(3, process_set=mine)
        x = _batch(r)[0].requires_grad_()
        y = bn(x)
        (y * torch.arange(3.0)).sum().backward()
        return y.detach(), x.grad
    record(out, "sync_batchnorm", sync_batchnorm)

    def dynamic():
        trio = hvd.add_process_set(hvd.ProcessSet([0, 1, 2]))
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=trio).item() if trio.included() else None
        removed = hvd.remove_process_set(trio)
        try:
            hvd.allreduce(torch.ones(1), process_set=trio)
            after = "no error"
        except ValueError as e:
            after = str(e)
        again = hvd.add_process_set([0, 3])
        got2 = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again).item() if again.included() else None
        return got, removed, after, got2, hvd.remove_process_set(hvd.global_process_set)
    record(out, "dynamic", dynamic)

    def overlapping():
        # rank 3 is not in the first set: with member-only group creation it named [0, 3]
        # differently from rank 0 and both hung in dist.new_group
        sets = [hvd.add_process_set(ranks) for ranks in ([0, 1, 2], [0, 3], [1, 2, 3])]
        got = [hvd.allreduce(torch.ones(1) * (r + 1), op=hvd.Sum, process_set=s).item() if s.included() else None
               for s in sets]
        for s in sets:
            hvd.remove_process_set(s)
        return got
    record(out, "overlapping", overlapping)
    hvd.barrier()  # rank 0 holds the store: it must not leave while others still build a group
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_process_sets, np=4, timeout=300)



def test_sets_have_ids_sizes_and_ranks(results):
    assert [o["ids"] for o in results] == [(1, 2, 2, 0), (1, 2, 2, 0), (1, 2, 2, 1), (1, 2, 2, 1)]


@pytest.mark.parametrize("key", ["allreduce", "allreduce_async", "grouped_allreduce", "allgather", "broadcast",
                                 "alltoall", "reducescatter"])
def test_collective_runs_inside_the_set(results, key):
    for r, got in enumerate(per_rank(results, key)):
        a, b = SETS[r]
        me = SETS[r].index(r)
        want = {
            "allreduce": _x(a) + _x(b),
            "allreduce_async": (_x(a) + _x(b)) / 2,
            "grouped_allreduce": [_x(a) + _x(b), (_x(a) + _x(b))[:1]],
            "allgather": torch.cat([torch.full((a + 1,), float(a)), torch.full((b + 1,), float(b))]),
            "broadcast": _x(b),
            "alltoall": torch.tensor([10.0 * a + me, 10.0 * b + me]),
            "reducescatter": torch.full((2,), float(a + b + 2)),
        }[key]
        for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
            torch.testing.assert_close(g, w, msg=lambda m, r=r: f"rank {r}: {m}")


def test_object_collectives_and_barrier_inside_the_set(results):
    for r, got in enumerate(per_rank(results, "objects")):
        a, b = SETS[r]
        assert got == (f"r{b}", [a, b])
    assert per_rank(results, "barrier") == [None] * 4


def test_optimizer_averages_inside_its_set(results):
    got = per_rank(results, "optimizer")
    for pair in ([0, 2], [1, 3]):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            sum(torch.nn.functional.mse_loss(model(_batch(r)[0]), _batch(r)[1]) for r in pair).div(2).backward()
            opt.step()
        want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        for r in pair:
            torch.testing.assert_close(got[r], want, atol=1e-6, rtol=1e-5)


def test_sync_batchnorm_normalises_over_its_set(results):
    got = per_rank(results, "sync_batchnorm")
    for pair in ([0, 2], [1, 3]):
        x = torch.cat([_batch(r)[0] for r in pair]).requires_grad_()
        y = torch.nn.functional.batch_norm(x, None, None, training=True)
        (y * torch.arange(3.0)).sum().backward()
        for i, r in enumerate(pair):
            torch.testing.assert_close(got[r][0], y.detach()[4 * i:4 * i + 4], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[r][1], x.grad[4 * i:4 * i + 4], atol=1e-5, rtol=1e-5)


def test_sets_are_added_and_removed_at_run_time(results):
    for r, (got, removed, after, got2, removed_global) in enumerate(per_rank(results, "dynamic")):
        assert got == (3.0 if r in (0, 1, 2) else None)
        assert removed is True and removed_global is False
        assert "not registered" in after
        assert got2 == (2.0 if r in (0, 3) else None)


def test_overlapping_sets_added_where_some_ranks_are_not_members(results):
    want = {0: [6.0, 5.0, None], 1: [6.0, None, 9.0], 2: [6.0, None, 9.0], 3: [None, 5.0, 9.0]}
    assert per_rank(results, "overlapping") == [want[r] for r in range(4)]

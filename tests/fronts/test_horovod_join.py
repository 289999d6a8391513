"""hvd.join(): a joined rank answers the allreduces the others still issue with zeros, and
join() returns the last rank to join (Horovod 0.28's semantics), on 3 real ranks.

Rank 2 joins first, then rank 1, then rank 0. While rank 2 is joined, ranks 0 and 1 run every
collective of the facade: allreduce (every op, grouped, async) must give what it gives when rank 2
contributes zeros (the op's identity for Min/Max); allgather, broadcast, reducescatter and
alltoall raise on the training ranks, as Horovod's controller does ("... is not supported with
Join at this time"); object collectives and barrier are answered. One spawned group runs every
check; each check is its own test.
"""

import pytest
import torch

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

N = 3


def _x(r):
    return torch.tensor([1.0, 2.0, 4.0]) * (r + 1)


REFUSED = {  # Horovod's controller: not supported while a rank has joined
    "allgather": lambda r: hvd.allgather(torch.full((r + 1, 2), float(r))),
    "broadcast": lambda r: hvd.broadcast(_x(r), root_rank=1),
    "reducescatter": lambda r: hvd.reducescatter(torch.ones(6, 2) * (r + 1), op=hvd.Sum),
    "alltoall": lambda r: hvd.alltoall(torch.arange(3.0) + 10 * r, splits=[1, 1, 1]),
}


def _joined_group():
    r = hvd.rank()
    out = {}
    if r == 2:
        out["last"] = hvd.join()
        return out
    out["sum"] = hvd.allreduce(_x(r), op=hvd.Sum)
    out["average"] = hvd.allreduce(_x(r))  # divides by all 3 ranks, as Horovod
    out["max"] = hvd.allreduce(-_x(r), op=hvd.Max)
    out["min"] = hvd.allreduce(_x(r), op=hvd.Min)
    out["int16"] = hvd.allreduce(torch.tensor([3, -4], dtype=torch.int16), op=hvd.Sum)
    out["grouped"] = hvd.grouped_allreduce([_x(r), torch.tensor([r + 1])], op=hvd.Sum)
    for key, refused in REFUSED.items():
        try:
            refused(r)
        except Exception as e:  # noqa: BLE001 - the check compares the class and message
            out[key] = (type(e).__name__, str(e))
    out["async"] = hvd.synchronize(hvd.allreduce_async(_x(r), op=hvd.Sum, name="a"))
    out["objects"] = (hvd.broadcast_object(f"from {r}", root_rank=0), hvd.allgather_object(r))
    hvd.barrier()
    try:
        hvd.broadcast_object(r, root_rank=2, name="root_joined")
    except Exception as e:  # noqa: BLE001 - the check compares the message
        out["root_joined_error"] = (type(e).__name__, str(e))
    if r == 1:
        out["last"] = hvd.join()
        return out
    out["alone"] = hvd.allreduce(_x(r), op=hvd.Sum)  # ranks 1 and 2 have joined: zeros from both
    out["last"] = hvd.join()
    return out


def _mismatch_inside_join():
    r = hvd.rank()
    try:
        if r == 2:
            hvd.join()
        else:
            hvd.allreduce(torch.ones(2 + r), name="uneven")
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.fixture(scope="module")
def joined():
    return distributed(_joined_group, np=N, timeout=120)


def _x_sum(ranks):
    return sum(_x(r) for r in ranks)


CASES = {
    "sum": lambda r: _x_sum([0, 1]),
    "average": lambda r: _x_sum([0, 1]) / 3,
    "max": lambda r: -_x(0),  # the joined rank counts as the op's identity (zeros would give 0 here)
    "min": lambda r: _x(0),
    "int16": lambda r: torch.tensor([6, -8], dtype=torch.int16),
    "async": lambda r: _x_sum([0, 1]),
}


@pytest.mark.parametrize("key", list(CASES))
def test_joined_rank_answers_with_zeros(joined, key):
    for r in (0, 1):
        got = joined[r][key]
        torch.testing.assert_close(got, CASES[key](r), msg=lambda m, k=key, r=r: f"{k} on rank {r}: {m}")


def test_grouped_allreduce_under_join(joined):
    for r in (0, 1):
        a, b = joined[r]["grouped"]
        torch.testing.assert_close(a, _x_sum([0, 1]))
        assert b.tolist() == [3]


@pytest.mark.parametrize("key", list(REFUSED))
def test_collectives_horovod_refuses_under_join_raise_on_the_training_ranks(joined, key):
    for r in (0, 1):
        name, message = joined[r][key]
        assert name == "HorovodInternalError", (r, name, message)
        assert f"{key} " in message and "not supported with join" in message and "[2]" in message


def test_object_collectives_and_barrier_under_join(joined):
    for r in (0, 1):
        assert joined[r]["objects"] == ("from 0", [0, 1, None])


def test_broadcast_object_from_a_joined_root_raises_on_the_training_ranks(joined):
    for r in (0, 1):
        name, message = joined[r]["root_joined_error"]
        assert name == "HorovodInternalError" and "root_rank 2" in message and "joined" in message


def test_rank_alone_after_two_joined(joined):
    torch.testing.assert_close(joined[0]["alone"], _x(0))


def test_join_returns_the_last_rank_to_join_on_every_rank(joined):
    assert [o["last"] for o in joined] == [0, 0, 0]


def test_mismatched_shapes_inside_join_raise_on_every_rank_including_the_joined_one():
    results = distributed(_mismatch_inside_join, np=N, timeout=60)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} did not raise"
        name, message = res
        assert name == "CollectiveMismatchError", (r, name, message)
        assert "rank 0" in message and "rank 1" in message and "shape" in message

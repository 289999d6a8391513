"""Misuse of the Horovod facade raises at once on every rank (2 real ranks), never hangs.

Each case runs on both ranks; the expected exception type and the words its message must
contain (the op, the tensor name, the ranks that disagree) are checked per rank. The group
runs with a 20 s collective timeout: a case that hung instead of raising would fail with
a timeout error, not the expected message. After every case the ranks must still agree
(a final allreduce). Errors inside ``join`` are in tests/fronts/test_horovod_join.py.
"""

import pytest
import torch

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks


def _duplicate_name():
    first = hvd.allreduce_async(torch.ones(4), name="dup")
    try:
        hvd.allreduce_async(torch.ones(4), name="dup")
    finally:
        hvd.synchronize(first)


def _duplicate_name_across_ops():
    first = hvd.allgather_async(torch.ones(4), name="shared")
    try:
        hvd.broadcast_async(torch.ones(4), root_rank=0, name="shared")
    finally:
        hvd.synchronize(first)


def _cases(r, other=None, removed=None):
    return {
        "duplicate_name": (_duplicate_name, ValueError, ["dup", "already in flight"]),
        "duplicate_name_across_ops": (_duplicate_name_across_ops, ValueError, ["shared", "already in flight"]),
        "shape": (lambda: hvd.allreduce(torch.ones(2 + r), name="grad.w"), "CollectiveMismatchError",
                  ["grad.w", "shape", "rank 0", "rank 1"]),
        "dtype": (lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64), name="d"),
                  "CollectiveMismatchError", ["dtype", "float64", "rank 1"]),
        "op": (lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max, name="ops"),
               "CollectiveMismatchError", ["op", "sum", "max"]),
        "root": (lambda: hvd.broadcast(torch.ones(2), root_rank=r, name="b"), "CollectiveMismatchError",
                 ["root", "rank 0", "rank 1"]),
        "different_collectives": (lambda: hvd.allreduce(torch.ones(2), name="x") if r else
                                  hvd.allgather(torch.ones(2), name="x"), "CollectiveMismatchError",
                                  ["allreduce", "allgather"]),
        "allgather_trailing_dims": (lambda: hvd.allgather(torch.ones(2, 2 + r), name="g"),
                                    "CollectiveMismatchError", ["shape", "g"]),
        "grouped_different_lengths": (lambda: hvd.grouped_allreduce([torch.ones(2)] * (1 + r), name="grp"),
                                      "CollectiveMismatchError", ["grp"]),
        "alltoall_splits": (lambda: hvd.alltoall(torch.ones(3), splits=[1, 1]), ValueError, ["splits", "3"]),
        "reducescatter_scalar": (lambda: hvd.reducescatter(torch.tensor(2.0)), hvd.HorovodInternalError,
                                 ["scalar"]),
        "reducescatter_min": (lambda: hvd.reducescatter(torch.ones(2), op=hvd.Min), hvd.HorovodInternalError,
                              ["Sum or Average"]),
        "adasum_integer": (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
                           hvd.HorovodInternalError, ["Adasum", "floating point"]),
        "not_a_member": (lambda: hvd.allreduce(torch.ones(1), process_set=other), ValueError,
                         [f"rank {r}", "not in ProcessSet"]),
        "removed_set": (lambda: hvd.allreduce(torch.ones(1), process_set=removed), ValueError,
                        ["not registered"]),
        "average_and_op": (lambda: hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum), ValueError,
                           ["average", "op"]),
        "process_set_differs": (lambda: hvd.add_process_set([r]), ValueError,
                                ["add_process_set", "different ranks", "rank 0: [0]", "rank 1: [1]"]),
    }


_cases.expected = _cases


def _every_error():
    r = hvd.rank()
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]  # every rank adds the same sets
    other = sets[1 - r]
    removed = hvd.add_process_set([0, 1])
    hvd.remove_process_set(removed)
    out = {}
    for key, (call, _, _) in _cases(r, other, removed).items():
        try:
            call()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - compared per case
            out[key] = (type(e).__name__, str(e))
    out["still_in_step"] = hvd.allreduce(torch.tensor([1.0 + r]), op=hvd.Sum).item()
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_every_error, np=2, timeout=240, env={"PHALANX_TIMEOUT": "20"})


@pytest.mark.parametrize("case", ["duplicate_name", "duplicate_name_across_ops", "shape", "dtype", "op", "root",
                                  "different_collectives", "allgather_trailing_dims", "grouped_different_lengths",
                                  "alltoall_splits", "reducescatter_scalar", "reducescatter_min", "adasum_integer",
                                  "not_a_member", "removed_set", "average_and_op",
                                  "process_set_differs"])
def test_error_raised_on_every_rank(results, case):
    for r, o in enumerate(results):
        assert o[case] is not None, f"rank {r} did not raise"
        name, message = o[case]
        _, expected, words = _cases.expected(r)[case]
        expected = expected if isinstance(expected, str) else expected.__name__
        assert name == expected, (r, name, message)
        for w in words:
            assert w in message, (r, w, message)


def test_ranks_still_agree_after_every_error(results):
    assert [o["still_in_step"] for o in results] == [3.0, 3.0]


MIXED = """
import torch
import phalanx.horovod.torch as hvd

hvd.init()
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
if hvd.rank() == 0:  # rank 0 steps once more while rank 1 makes a facade collective
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
else:
    hvd.allreduce(torch.ones(3), name="metric")
"""


def test_a_rank_stepping_while_another_calls_a_collective_is_named(tmp_path):
    """Not a mismatch the check can see (the optimizer's reductions run on their own group): the
    facade call waits out the collective timeout, then says which call it made and where the other
    rank is (its heartbeat under `phalanx run`), in one line. Horovod stalls here (its stall
    inspector warns after 60 s)."""
    import subprocess
    import sys

    (tmp_path / "mixed.py").write_text(MIXED)
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "--timeout", "10", sys.executable,
                           str(tmp_path / "mixed.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    line = next((ln for ln in out.splitlines() if "did not make that call" in ln), None)
    assert line is not None, out[-3000:]
    assert "rank 1 called allreduce 'metric'" in line and "rank 0 is waiting in allreduce" in line, line
    assert "'dp.bucket0'" in line and "optimizer.step()" in line and "--timeout" in line, line
    assert "phalanx: rank 1" in out and "failed first" in out, out[-3000:]

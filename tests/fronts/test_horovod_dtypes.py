"""Every Horovod dtype through every op, on 1, 2 and 4 real ranks (CPU, gloo).

Horovod takes uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64 and bool;
gloo lacks int16, which phalanx carries as int32 (phalanx.comm.horovod_ops.dtypes). Values are small
integers, exact in every dtype, so each result is compared exactly with a single-process
reference. One spawned group per world size runs every (op, dtype); each pair is its own test.
bool takes the ops whose meaning is defined for it (movement; Sum/Max as "any", Min as "all").
"""

import pytest
import torch

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
ARITHMETIC = ["sum", "average", "min", "max", "product", "grouped_sum", "inplace_noncontiguous",
              "reducescatter_sum", "reducescatter_average"]
MOVEMENT = ["allgather", "grouped_allgather", "broadcast", "broadcast_inplace_noncontiguous", "alltoall",
            "alltoall_splits"]
BOOL_OPS = {"sum", "min", "max", "grouped_sum", "inplace_noncontiguous", "reducescatter_sum", *MOVEMENT}


def value(r: int, dtype, rows: int = 3) -> torch.Tensor:
    """Rank r's tensor: small integers (1..3) in ``rows`` x 2, or 0/1 for bool."""
    v = (torch.arange(rows * 2).reshape(rows, 2) + r) % 3
    return (v % 2).bool() if dtype == torch.bool else (v + 1).to(dtype)


def _ops(r, n, dtype):
    """The facade call for each op on this rank."""
    x = value(r, dtype)
    return {
        "sum": lambda: hvd.allreduce(x, op=hvd.Sum),
        "average": lambda: hvd.allreduce(x, op=hvd.Average),
        "min": lambda: hvd.allreduce(x, op=hvd.Min),
        "max": lambda: hvd.allreduce(x, op=hvd.Max),
        "product": lambda: hvd.allreduce(x, op=hvd.Product),
        "grouped_sum": lambda: hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum),
        "inplace_noncontiguous": lambda: hvd.allreduce_(value(r, dtype, 2).t(), op=hvd.Sum),
        "reducescatter_sum": lambda: hvd.reducescatter(value(r, dtype, 2 * n), op=hvd.Sum),
        "reducescatter_average": lambda: hvd.reducescatter(value(r, dtype, 2 * n), op=hvd.Average),
        "allgather": lambda: hvd.allgather(value(r, dtype, r + 1)),
        "grouped_allgather": lambda: hvd.grouped_allgather([x, value(r, dtype, 1)]),
        "broadcast": lambda: hvd.broadcast(x, root_rank=n - 1),
        "broadcast_inplace_noncontiguous": lambda: hvd.broadcast_(value(r, dtype, 2).t(), root_rank=0),
        "alltoall": lambda: hvd.alltoall(value(r, dtype, n)),
        "alltoall_splits": lambda: hvd.alltoall(value(r, dtype, n * (n + 1) // 2),
                                                splits=[j + 1 for j in range(n)])[0],
    }


def _every_dtype():
    r, n = hvd.rank(), hvd.size()
    out = {}
    for dtype in DTYPES:
        for op, call in _ops(r, n, dtype).items():
            if dtype == torch.bool and op not in BOOL_OPS:
                continue
            try:
                out[op, str(dtype)] = call()
            except Exception as e:  # noqa: BLE001 - the test reports it for this (op, dtype) only
                out[op, str(dtype)] = f"{type(e).__name__}: {e}"
    return out


def _reduce(stack, how, dtype):
    if dtype == torch.bool:
        return {"sum": stack.any(0), "max": stack.any(0), "min": stack.all(0)}[how]
    wide = stack.to(torch.float64)
    result = {"sum": wide.sum(0), "min": wide.min(0).values, "max": wide.max(0).values,
              "product": wide.prod(0), "average": wide.sum(0) / len(stack)}[how]
    if how == "average" and not dtype.is_floating_point:
        result = wide.sum(0).div(len(stack), rounding_mode="trunc")  # as Horovod's suite
    return result.to(dtype)


def expected(op, dtype, r, n):
    ranks = range(n)
    if op in ("sum", "average", "min", "max", "product"):
        return _reduce(torch.stack([value(i, dtype) for i in ranks]), op, dtype)
    if op == "grouped_sum":
        s = _reduce(torch.stack([value(i, dtype) for i in ranks]), "sum", dtype)
        return [s, s[:1]]
    if op == "inplace_noncontiguous":
        return _reduce(torch.stack([value(i, dtype, 2).t() for i in ranks]), "sum", dtype)
    if op.startswith("reducescatter"):
        full = _reduce(torch.stack([value(i, dtype, 2 * n) for i in ranks]), op.split("_")[1], dtype)
        return full[2 * r:2 * r + 2]
    if op == "allgather":
        return torch.cat([value(i, dtype, i + 1) for i in ranks])
    if op == "grouped_allgather":
        return [torch.cat([value(i, dtype) for i in ranks]), torch.cat([value(i, dtype, 1) for i in ranks])]
    if op == "broadcast":
        return value(n - 1, dtype)
    if op == "broadcast_inplace_noncontiguous":
        return value(0, dtype, 2).t()
    if op == "alltoall":
        return torch.cat([value(i, dtype, n)[r:r + 1] for i in ranks])
    if op == "alltoall_splits":
        start = r * (r + 1) // 2
        return torch.cat([value(i, dtype, n * (n + 1) // 2)[start:start + r + 1] for i in ranks])
    raise KeyError(op)


_groups = {}


def _results(np):
    if np not in _groups:
        _groups[np] = distributed(_every_dtype, np=np, timeout=300)
    return _groups[np]


CASES = [(np, op, dtype) for np in (1, 2, 4) for dtype in DTYPES for op in ARITHMETIC + MOVEMENT
         if dtype != torch.bool or op in BOOL_OPS]


@pytest.mark.parametrize("np,op,dtype", CASES, ids=[f"{n}-{o}-{str(d)[6:]}" for n, o, d in CASES])
def test_dtype_through_op(np, op, dtype):
    results = _results(np)
    for r in range(np):
        got, want = results[r][op, str(dtype)], expected(op, dtype, r, np)
        assert not isinstance(got, str), f"rank {r}: {got}"
        for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
            assert g.dtype == dtype, f"rank {r}: came back as {g.dtype}"
            assert g.shape == w.shape and torch.equal(g, w), f"rank {r}: {g.tolist()} != {w.tolist()}"

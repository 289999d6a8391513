"""Every differentiable Horovod collective, checked on 2 and 4 real ranks against a numerical reference.

The reference runs in one process: the collective written as plain torch ops over every rank's
input, the objective ``sum_r (w_r * y_r).sum()`` (rank r weighs its output by its own w_r),
and torch.autograd for the true gradient. Horovod 0.28's backward rules are that gradient times
a fixed factor per collective (from Horovod's own tests, e.g. reducescatter of ones on 2 ranks
gives [2,2,2,2,2,2,2,2]):

    allreduce, grouped_allreduce, alltoall      1
    allgather, grouped_allgather, broadcast     1/n   (the gradient is averaged, not summed)
    reducescatter, grouped_reducescatter        n
"""

import pytest
import torch

import phalanx.horovod.torch as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

PRE, POST = 0.5, 3.0


def inputs(r, n, case):
    g = torch.Generator().manual_seed(100 * r + len(case))
    rows = {"allgather": r + 1, "grouped_allgather": r + 1, "alltoall": n * (n + 1) // 2,
            "reducescatter_sum": n + 1, "reducescatter_average": n + 1, "grouped_reducescatter": 2 * n,
            "reducescatter_scaled": 2 * n}.get(case, 2)
    return [torch.randn(rows, 3, generator=g, dtype=torch.float64) for _ in range(2)]


def forward(case, xs, n, r, hv):
    """The collective on rank r, either through the facade (hv=True, xs = this rank's inputs) or
    written densely over every rank's inputs (hv=False, xs = list per rank)."""
    def mine(k):
        return xs[k] if hv else [x[k] for x in xs]

    if case == "allreduce_sum":
        return [hvd.allreduce(mine(0), op=hvd.Sum) if hv else sum(mine(0))]
    if case == "allreduce_average_scaled":
        if hv:
            return [hvd.allreduce(mine(0), op=hvd.Average, prescale_factor=PRE, postscale_factor=POST)]
        return [POST * sum(PRE * x for x in mine(0)) / n]
    if case == "grouped_allreduce":
        return hvd.grouped_allreduce([mine(0), mine(1)], op=hvd.Sum) if hv else [sum(mine(0)), sum(mine(1))]
    if case == "allgather":
        return [hvd.allgather(mine(0)) if hv else torch.cat(mine(0))]
    if case == "grouped_allgather":
        return hvd.grouped_allgather([mine(0), mine(1)]) if hv else [torch.cat(mine(0)), torch.cat(mine(1))]
    if case == "broadcast":
        return [hvd.broadcast(mine(0), root_rank=1) if hv else mine(0)[1]]
    if case == "alltoall":
        splits = [j + 1 for j in range(n)]
        if hv:
            return [hvd.alltoall(mine(0), splits=splits)[0]]
        start = r * (r + 1) // 2
        return [torch.cat([x[start:start + r + 1] for x in mine(0)])]
    if case.startswith("reducescatter") or case == "grouped_reducescatter":
        op = hvd.Sum if case in ("reducescatter_sum", "grouped_reducescatter") else hvd.Average
        pre, post = (PRE, POST) if case == "reducescatter_scaled" else (1.0, 1.0)
        k = 2 if case == "grouped_reducescatter" else 1
        if hv:
            if k == 2:
                return hvd.grouped_reducescatter([mine(0), mine(1)], op=op)
            return [hvd.reducescatter(mine(0), op=op, prescale_factor=pre, postscale_factor=post)]
        outs = []
        for j in range(k):
            total = post * sum(pre * x for x in mine(j)) / (n if op == hvd.Average else 1)
            rows = total.shape[0]
            counts = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
            outs.append(total.split(counts)[r])
        return outs
    raise KeyError(case)


FACTOR = {"allgather": "1/n", "grouped_allgather": "1/n", "broadcast": "1/n", "reducescatter_sum": "n",
          "reducescatter_average": "n", "reducescatter_scaled": "n", "grouped_reducescatter": "n"}
CASES = ["allreduce_sum", "allreduce_average_scaled", "grouped_allreduce", "allgather", "grouped_allgather",
         "broadcast", "alltoall", "reducescatter_sum", "reducescatter_average", "reducescatter_scaled",
         "grouped_reducescatter"]


def weights(r, case, outs):
    g = torch.Generator().manual_seed(7 + r)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def _every_gradient():
    r, n = hvd.rank(), hvd.size()
    out = {}
    for case in CASES:
        try:
            xs = [x.requires_grad_() for x in inputs(r, n, case)]
            ys = forward(case, xs, n, r, hv=True)
            sum((w * y).sum() for w, y in zip(weights(r, case, ys), ys)).backward()
            out[case] = [x.grad for x in xs]
        except Exception as e:  # noqa: BLE001 - reported for this case only
            out[case] = f"{type(e).__name__}: {e}"
    return out


def reference(case, n):
    xs = [[x.requires_grad_() for x in inputs(r, n, case)] for r in range(n)]
    loss = 0
    for r in range(n):
        ys = forward(case, xs, n, r, hv=False)
        loss = loss + sum((w * y).sum() for w, y in zip(weights(r, case, ys), ys))
    flat = [x for per_rank in xs for x in per_rank]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    factor = {"1/n": 1 / n, "n": n}.get(FACTOR.get(case), 1)
    return [[None if g is None else g * factor for g in grads[2 * r:2 * r + 2]] for r in range(n)]


_groups = {}


@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_gradient_matches_reference(np, case):
    if np not in _groups:
        _groups[np] = distributed(_every_gradient, np=np, timeout=300)
    want = reference(case, np)
    for r in range(np):
        got = _groups[np][r][case]
        assert not isinstance(got, str), f"rank {r}: {got}"
        for g, w in zip(got, want[r]):
            if w is None:  # the input does not reach the output (e.g. a second, unused tensor)
                assert g is None or torch.count_nonzero(g) == 0
                continue
            torch.testing.assert_close(g, w, msg=lambda m, r=r: f"rank {r}: {m}")


def _horovod_reference_values():
    """The numbers from Horovod's own test_horovod_reducescatter_grad / _grad_average."""
    x = torch.ones(8, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    y = torch.ones(8, requires_grad=True)
    hvd.reducescatter(y, op=hvd.Average).sum().backward()
    return x.grad.tolist(), y.grad.tolist()


def test_reducescatter_gradient_is_horovods_on_two_ranks():
    for summed, averaged in distributed(_horovod_reference_values, np=2):
        assert summed == [2.0] * 8 and averaged == [1.0] * 8

"""The Horovod facade on real ranks: every collective form, handles, names, process sets, errors."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import phalanx as px
import phalanx.horovod as hvd
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks


def _facade_collectives(tmp):
    r, n = hvd.rank(), hvd.size()
    out = {"sizes": (hvd.size(), hvd.local_size(), hvd.cross_size(), hvd.local_rank(), hvd.cross_rank(),
                     hvd.is_homogeneous())}
    x = torch.tensor([1.0, 2.0]) * (r + 1)
    out["avg"] = hvd.allreduce(x)
    out["sum_deprecated"] = hvd.allreduce(x, average=False)
    out["fp16"] = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Max)
    out["inplace_max"] = y
    h = hvd.allreduce_async(torch.ones(1 << 16) * r, op=hvd.Sum, name="big")
    out["poll_type"] = isinstance(hvd.poll(h), bool)
    out["async"] = hvd.synchronize(h)[:3]
    out["grouped"] = hvd.grouped_allreduce([x, torch.tensor([r], dtype=torch.int64), x * 2], op=hvd.Sum)
    zs = [x.clone(), x.clone() * 3]
    hvd.grouped_allreduce_(zs, op=hvd.Sum)
    out["grouped_inplace"] = zs
    out["allgather"] = hvd.allgather(torch.full((r + 1,), float(r)))
    out["grouped_allgather"] = hvd.grouped_allgather([torch.tensor([r]), torch.tensor([10 * r])])
    b = torch.tensor([float(r)])
    hvd.broadcast_(b, root_rank=1)
    out["broadcast_inplace"] = b
    out["broadcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=0)
    out["alltoall"] = hvd.alltoall(torch.arange(float(n)) + 10 * r)
    out["alltoall_splits"] = hvd.alltoall(torch.arange(3.0) + r, splits=[1, 2])
    out["reducescatter"] = hvd.reducescatter(torch.ones(4, 2) * (r + 1), op=hvd.Sum, postscale_factor=2.0)
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([torch.ones(2), torch.ones(4)], op=hvd.Sum)
    out["objects"] = (hvd.broadcast_object({"from": r}, root_rank=1), hvd.allgather_object(r))
    # errors
    errors = []
    first = hvd.allreduce_async(torch.ones(2), name="dup")
    try:
        hvd.allreduce_async(torch.ones(2), name="dup")
    except ValueError as e:
        errors.append(str(e))
    hvd.synchronize(first)
    try:
        hvd.allreduce(torch.ones(2 + r), name="mismatch")
    except Exception as e:  # CollectiveMismatchError
        errors.append(str(e))
    try:
        hvd.broadcast(torch.ones(1), root_rank=r, name="roots")
    except Exception as e:
        errors.append(str(e))
    out["errors"] = errors
    # process sets: {0} and {1} each reduce alone; the global set still works afterwards
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    mine = sets[r]
    out["ps"] = (mine.included(), mine.size(), mine.rank(), hvd.allreduce(torch.tensor([5.0 + r]), op=hvd.Sum,
                                                                              process_set=mine).item())
    try:
        hvd.allreduce(torch.ones(1), process_set=sets[1 - r])
    except ValueError as e:
        out["ps_error"] = str(e)
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64), name="dtypes")
    except Exception as e:
        out["dtype_error"] = str(e)
    both = hvd.add_process_set(hvd.ProcessSet([1, 0]))
    out["ps_objects"] = (hvd.broadcast_object(f"r{r}", root_rank=1, process_set=both),
                         hvd.allgather_object(r, process_set=both), both.rank(), True)
    hvd.barrier(process_set=both)
    with torch.no_grad():
        lin = torch.nn.Linear(2, 2)
        lin.weight.fill_(r)
    hvd.broadcast_parameters(lin.state_dict(), root_rank=1, process_set=both)
    out["ps_params"] = lin.weight.detach().clone()
    out["removed"] = (hvd.remove_process_set(both), hvd.remove_process_set(both))
    try:
        hvd.allreduce(torch.ones(1), process_set=both)
    except ValueError as e:
        out["removed_error"] = str(e)
    out["bf16"] = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16)
    # differentiable allreduce / allgather / broadcast (Horovod's backward rules)
    w = torch.tensor([1.0, 3.0]) * (r + 1)
    xs = [torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(3)]
    (hvd.allreduce(xs[0], op=hvd.Sum) * w).sum().backward()
    (hvd.allreduce(xs[1]) * w).sum().backward()
    g = torch.full((r + 1,), 1.0, requires_grad=True)
    (hvd.allgather(g) * (torch.arange(3.0) + 1) * (r + 1)).sum().backward()
    b = torch.tensor([5.0], requires_grad=True)
    (hvd.broadcast(b, root_rank=0) * (r + 1)).sum().backward()
    ga, gb = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([ga, gb], op=hvd.Sum)
    ((ya * w).sum() + yb.sum() * (r + 1)).backward()
    out["grads"] = (xs[0].grad, xs[1].grad, g.grad, b.grad, ga.grad, gb.grad)
    out["min_product_none"] = (hvd.allreduce(x, op=hvd.Min), hvd.allreduce(x, op=hvd.Product),
                               hvd.allreduce(x, compression=hvd.Compression.none))
    # every async form: launch all, then synchronize in reverse order
    ins = torch.tensor([1.0, 2.0]) * (r + 1)
    pending = {
        "allreduce_async_": hvd.allreduce_async_(ins.clone(), op=hvd.Sum),
        "allgather_async": hvd.allgather_async(torch.tensor([r])),
        "broadcast_async": hvd.broadcast_async(torch.tensor([float(r)]), root_rank=1),
        "broadcast_async_": hvd.broadcast_async_(torch.tensor([float(r)]), root_rank=0),
        "alltoall_async": hvd.alltoall_async(torch.arange(float(n)) + 10 * r),
        "reducescatter_async": hvd.reducescatter_async(torch.ones(2) * (r + 1), op=hvd.Sum),
        "grouped_allreduce_async": hvd.grouped_allreduce_async([ins, ins * 10], op=hvd.Sum),
        "grouped_allreduce_async_": hvd.grouped_allreduce_async_([ins.clone(), ins * 10], op=hvd.Sum),
        "grouped_allgather_async": hvd.grouped_allgather_async([torch.tensor([r]), torch.tensor([r, r])]),
        "grouped_reducescatter_async": hvd.grouped_reducescatter_async([torch.ones(2), torch.ones(4)], op=hvd.Sum),
        "sparse_allreduce_async": hvd.sparse_allreduce_async(
            torch.sparse_coo_tensor([[r, 3]], torch.ones(2, 2) * (r + 1), (4, 2)), name="sp", op=hvd.Sum),
    }
    out["async_forms"] = {k: hvd.synchronize(h) for k, h in reversed(pending.items())}
    # a handle polled before it can complete: rank 1 contributes only after rank 0 has polled
    from phalanx.comm.mismatch import set_mismatch_check

    hvd.barrier()
    set_mismatch_check(False)  # the pre-send probe would make rank 0 wait for rank 1 inside the launch
    polled = os.path.join(tmp, "polled")
    if r == 0:
        late = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="late")
        out["poll_before"] = hvd.poll(late)
        open(polled, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(polled) and time.monotonic() < deadline:
            time.sleep(0.01)
        late = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="late")
        out["poll_before"] = False
    out["late"] = hvd.synchronize(late)
    out["poll_after"] = hvd.poll(late)
    set_mismatch_check(True)
    hvd.barrier()
    out["builds"] = (hvd.gloo_built(), hvd.mpi_built(), hvd.nccl_built() == torch.cuda.is_available())
    return out


def test_facade_collectives_on_two_ranks(tmp_path):
    results = distributed(_facade_collectives, np=2, args=(str(tmp_path),))
    for r, o in enumerate(results):
        assert o["sizes"] == (2, 2, 1, r, 0, True)
        torch.testing.assert_close(o["avg"], torch.tensor([1.5, 3.0]))
        torch.testing.assert_close(o["sum_deprecated"], torch.tensor([3.0, 6.0]))
        torch.testing.assert_close(o["fp16"], torch.tensor([3.0, 6.0]))
        torch.testing.assert_close(o["scaled"], torch.tensor([6.0, 12.0]))
        torch.testing.assert_close(o["inplace_max"], torch.tensor([2.0, 4.0]))
        assert o["poll_type"] and o["async"].tolist() == [1.0, 1.0, 1.0]
        g = o["grouped"]
        torch.testing.assert_close(g[0], torch.tensor([3.0, 6.0]))
        assert g[1].tolist() == [1] and g[1].dtype == torch.int64
        torch.testing.assert_close(g[2], torch.tensor([6.0, 12.0]))
        torch.testing.assert_close(o["grouped_inplace"][1], torch.tensor([9.0, 18.0]))
        assert o["allgather"].tolist() == [0.0, 1.0, 1.0]
        assert [t.tolist() for t in o["grouped_allgather"]] == [[0, 1], [0, 10]]
        assert o["broadcast_inplace"].tolist() == [1.0] and o["broadcast"].tolist() == [0.0]
        assert o["alltoall"].tolist() == [float(r), float(r + 10)]
        recv, splits = o["alltoall_splits"]
        assert splits.tolist() == ([1, 1] if r == 0 else [2, 2])
        torch.testing.assert_close(o["reducescatter"], torch.full((2, 2), 6.0))
        assert [t.tolist() for t in o["grouped_reducescatter"]] == [[2.0], [2.0, 2.0]]
        assert o["objects"] == ({"from": 1}, [0, 1])
        dup, mismatch, roots = o["errors"]
        assert "already in flight" in dup
        assert "mismatch" in mismatch and "rank 1" in mismatch and "root" in roots
        assert o["ps"] == (True, 1, 0, 5.0 + r)
        assert "not in ProcessSet" in o["ps_error"]
        assert o["builds"] == (True, False, True)
        assert "dtype" in o["dtype_error"] and "float64" in o["dtype_error"]  # raised on both ranks
        assert o["ps_objects"] == ("r1", [0, 1], r, True)
        assert o["ps_params"].eq(1.0).all()
        assert o["removed"] == (True, False) and "not registered" in o["removed_error"]
        torch.testing.assert_close(o["bf16"], torch.tensor([3.0, 6.0]))
        g_sum, g_avg, g_gather, g_bcast, g_ga, g_gb = o["grads"]
        assert g_ga.tolist() == [3.0, 9.0] and g_gb.tolist() == [3.0]
        assert g_sum.tolist() == [3.0, 9.0] and g_avg.tolist() == [1.5, 4.5]
        assert g_gather.tolist() == ([1.5] if r == 0 else [3.0, 4.5])
        assert g_bcast.tolist() == ([1.5] if r == 0 else [0.0])
        mn, prod, plain = o["min_product_none"]
        assert mn.tolist() == [1.0, 2.0] and prod.tolist() == [2.0, 8.0] and plain.tolist() == [1.5, 3.0]
        a = o["async_forms"]
        torch.testing.assert_close(a["allreduce_async_"], torch.tensor([3.0, 6.0]))
        assert a["allgather_async"].tolist() == [0, 1]
        assert a["broadcast_async"].tolist() == [1.0] and a["broadcast_async_"].tolist() == [0.0]
        assert a["alltoall_async"][0].tolist() == [float(r), float(r + 10)]
        assert a["reducescatter_async"].tolist() == [3.0]
        for k in ("grouped_allreduce_async", "grouped_allreduce_async_"):
            assert [t.tolist() for t in a[k]] == [[3.0, 6.0], [30.0, 60.0]], k
        assert [t.tolist() for t in a["grouped_allgather_async"]] == [[0, 1], [0, 0, 1, 1]]
        assert [t.tolist() for t in a["grouped_reducescatter_async"]] == [[2.0], [2.0, 2.0]]
        assert a["sparse_allreduce_async"].to_dense()[:, 0].tolist() == [1.0, 2.0, 0.0, 3.0]
        assert o["poll_before"] is False and o["poll_after"] is True
        assert o["late"].tolist() == [2.0, 2.0, 2.0]


def test_facade_runtime_in_a_world_of_one():
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size(), hvd.is_initialized()) == (0, 1, True)
        with pytest.raises(ValueError, match="MPI"):
            hvd.init(comm=object())
        assert not hvd.mpi_enabled() and not hvd.mpi_threads_supported()
        assert not hvd.ddl_built() and not hvd.ccl_built() and hvd.gloo_enabled()
        assert hvd.cuda_built() == torch.cuda.is_available() and hvd.rocm_built() == (torch.version.hip is not None)
        assert hvd.SyncBatchNorm is px.SyncBatchNorm  # tested against full-batch BN in test_sync_batchnorm.py
        assert hvd.allreduce(torch.tensor([2.0])).tolist() == [2.0]  # a world of one returns at once
    finally:
        hvd.shutdown()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _embedding_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=True), torch.nn.Linear(3, 1))


def _facade_optimizer(trace_path):
    torch.manual_seed(hvd.rank())  # different starts: broadcast_parameters must align them
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # still empty: must not hang or fail
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16, num_groups=2, gradient_predivide_factor=2.0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    r = hvd.rank()
    hvd.start_timeline(trace_path)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
        opt.step()
    hvd.stop_timeline()
    out = {"adam": _flat(model)}
    # non-empty optimizer state: rank 1's is spoiled, the broadcast restores rank 0's
    if r == 1:
        for st in opt.state.values():
            st["exp_avg"].add_(5.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["exp_avg"] = torch.cat([st["exp_avg"].reshape(-1) for st in opt.state.values()])
    # backward_passes_per_step=2 and op=Sum: two local passes accumulate, then one summed reduction
    torch.manual_seed(0)
    model2 = torch.nn.Linear(4, 1)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.05),
                                    named_parameters=model2.named_parameters(), backward_passes_per_step=2,
                                    op=hvd.Sum)
    for _ in range(3):
        opt2.zero_grad()
        for half in range(2):
            rows = slice(r * 4 + half * 2, r * 4 + half * 2 + 2)
            torch.nn.functional.mse_loss(model2(x[rows]), y[rows]).backward()
        opt2.step()
    out["sum_k2"] = _flat(model2)
    # sparse gradients reduced densely (sparse_as_dense), explicit groups
    emb_model = _embedding_model()
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(emb_model.parameters(), lr=0.5),
                                    named_parameters=emb_model.named_parameters(), sparse_as_dense=True,
                                    groups=[[emb_model[0].weight], [emb_model[1].weight, emb_model[1].bias]])
    tokens = torch.arange(8).reshape(4, 2) % 6
    for _ in range(2):
        opt3.zero_grad()
        emb_model(tokens[r * 2:(r + 1) * 2]).pow(2).mean().backward()
        opt3.step()
    out["sparse_as_dense"] = _flat(emb_model)
    # sparse gradients by default (sparse_as_dense=False): allgathered, as Horovod does; the first
    # step finds them sparse inside a bucket, the second runs with them outside the buckets
    emb_model = _embedding_model()
    opt4 = hvd.DistributedOptimizer(torch.optim.SGD(emb_model.parameters(), lr=0.5),
                                    named_parameters=emb_model.named_parameters())
    for _ in range(2):
        opt4.zero_grad()
        emb_model(tokens[r * 2:(r + 1) * 2]).pow(2).mean().backward()
        opt4.step()
        out.setdefault("sparse_grad_is_sparse", []).append(emb_model[0].weight.grad.is_sparse)
    out["sparse"] = _flat(emb_model)
    # broadcast_parameters also takes model.parameters() (a plain list), as Horovod's does
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(r)
    hvd.broadcast_parameters(model2.parameters(), root_rank=1)
    out["bcast_list"] = _flat(model2)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    except ValueError as e:
        out["predivide_error"] = str(e)
    return out


def test_distributed_optimizer_matches_full_batch_reference(tmp_path):
    import json

    trace_path = tmp_path / "timeline.json"
    results = distributed(_facade_optimizer, np=2, args=(str(trace_path),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ref = _flat(model)
    for out in results:  # fp16 on the wire: agree to fp16 precision
        torch.testing.assert_close(out["adam"], ref, atol=2e-3, rtol=2e-3)
        assert "op=hvd.Average" in out["predivide_error"]
    torch.testing.assert_close(results[0]["adam"], results[1]["adam"])
    torch.testing.assert_close(results[0]["exp_avg"], results[1]["exp_avg"], rtol=0, atol=0)
    # reference for backward_passes_per_step=2, op=Sum: the sum of the four pair-losses' gradients
    torch.manual_seed(0)
    model2 = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    for _ in range(3):
        opt2.zero_grad()
        sum(torch.nn.functional.mse_loss(model2(x[i:i + 2]), y[i:i + 2]) for i in range(0, 8, 2)).backward()
        opt2.step()
    for out in results:
        torch.testing.assert_close(out["sum_k2"], _flat(model2), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out["bcast_list"], results[1]["sum_k2"] + 1, atol=1e-6, rtol=0)
    emb_model = _embedding_model()
    opt3 = torch.optim.SGD(emb_model.parameters(), lr=0.5)
    tokens = torch.arange(8).reshape(4, 2) % 6
    for _ in range(2):
        opt3.zero_grad()
        (emb_model(tokens[:2]).pow(2).mean() + emb_model(tokens[2:]).pow(2).mean()).div(2).backward()
        opt3.step()
    for out in results:
        torch.testing.assert_close(out["sparse_as_dense"], _flat(emb_model), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out["sparse"], _flat(emb_model), atol=1e-6, rtol=1e-5)
        assert out["sparse_grad_is_sparse"] == [True, True]
    # the timeline: one Chrome-trace JSON file with the spans of both ranks
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"allreduce_launch", "allreduce_wait", "optimizer_step"} <= names, names


# seed 002's script under `phalanx run`: tests/fronts/test_horovod_example.py (one job with the other example)


# ---------------------------------------------------------------- join with uneven data

def _join_data(steps):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]


def _join_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _join_uneven():
    r = hvd.rank()
    out = {}
    # (steps of rank 0, steps of rank 1): rank 1 runs out first; rank 1 has no data at all; equal data
    # "mixed": a facade allreduce after every step, answered by rank 1 once it has joined too
    # "opt_join": the optimizer's own join() (it answers steps only, on the calling thread)
    for case, counts in {"uneven": (5, 3), "empty": (2, 0), "equal": (2, 2), "mixed": (3, 1),
                         "opt_join": (2, 4)}.items():
        model = _join_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        for x, y in _join_data(10)[r * 5:][: counts[r]]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if case == "mixed":
                out.setdefault("metrics", []).append(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
        last = opt.join() if case == "opt_join" else hvd.join()
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)  # the joined replica is stale
        out[case] = (last, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    plain = px.DistributedOptimizer(torch.optim.SGD(_join_model().parameters(), lr=0.1), join_ready=False)
    try:
        plain.join()
    except RuntimeError as e:
        out["not_ready"] = str(e)
    return out


def _join_reference(counts):
    """One process: a step averages over both ranks, a joined rank counting as a zero gradient."""
    model = _join_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _join_data(10)
    for i in range(max(counts)):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(data[r * 5 + i][0]), data[r * 5 + i][1])
                   for r in range(2) if i < counts[r]) / 2
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_join_with_uneven_data_answers_with_zeros_and_returns_the_last_rank():
    results = distributed(_join_uneven, np=2, timeout=120)
    for case, counts, last in (("uneven", (5, 3), 0), ("empty", (2, 0), 0), ("equal", (2, 2), 1),
                               ("mixed", (3, 1), 0), ("opt_join", (2, 4), 1)):
        ref = _join_reference(counts)
        for r in range(2):
            got_last, params = results[r][case]
            assert got_last == last, (case, r, got_last)
            torch.testing.assert_close(params, ref, atol=1e-6, rtol=1e-5)
    assert results[0]["metrics"] == [2.0, 1.0, 1.0] and results[1]["metrics"] == [2.0]
    assert all("join_ready=True" in results[r]["not_ready"] for r in range(2))


# ---------------------------------------------------------------- hvd.elastic: a restart and a reset

E_STEPS_PER_EPOCH, E_EPOCHS, E_COMMIT, E_B = 6, 2, 3, 4  # local batch E_B on 2 ranks: global 8
ELASTIC_WORKER = textwrap.dedent(f"""
    import os, signal, sys
    import torch
    import phalanx.horovod.torch as hvd

    STEPS, EPOCHS, COMMIT, B = {E_STEPS_PER_EPOCH}, {E_EPOCHS}, {E_COMMIT}, {E_B}

    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS * 2 * B, 5, generator=g, dtype=torch.float64)
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def main(out):
        hvd.init()
        model = make()
        if hvd.rank() == 1:  # a different start on purpose: sync() must give it rank 0's
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        dataset = data()
        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=B, sampler=sampler)
        state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0,
                                       commit_dir=os.path.join(out, "commits"))

        def log(text):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{{text}} restart={{hvd.elastic.restart_count()}} rank={{hvd.rank()}}\\n")

        def on_reset():
            for group in opt.param_groups:
                group["lr"] = 0.025 * hvd.size()  # Horovod's use: rescale to the new world size
            log(f"reset step={{state.step}}")

        state.register_reset_callbacks([on_reset])
        interrupted = []

        @hvd.elastic.run
        def train(state):
            log(f"start step={{state.step}}")
            for state.epoch in range(state.epoch, EPOCHS):
                for batch_idx, (x, y) in enumerate(loader):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    state.sampler.record_batch(batch_idx, B)
                    state.step += 1
                    if hvd.elastic.restart_count() == 0 and state.step == 5 and hvd.rank() == 1:
                        os.kill(os.getpid(), signal.SIGKILL)  # a worker is lost
                    if hvd.elastic.restart_count() == 1 and state.step == 8 and not interrupted:
                        interrupted.append(1)  # every rank, same step: roll back to step 6
                        raise hvd.elastic.HostsUpdatedInterrupt("hosts changed")
                    if state.step % COMMIT == 0:
                        state.commit()
                state.sampler.set_epoch(state.epoch + 1)

        train(state)
        if hvd.rank() == 0:
            torch.save([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))
        log(f"end step={{state.step}} lr={{opt.param_groups[0]['lr']}}")
        hvd.shutdown()

    if __name__ == "__main__":
        main(sys.argv[1])
""")


def test_elastic_run_restores_resets_and_resyncs_after_a_lost_worker(tmp_path):
    script = tmp_path / "elastic_worker.py"
    script.write_text(ELASTIC_WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--max-restarts", "1", "--timeout", "60",
           sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = sorted((tmp_path / "events.txt").read_text().splitlines())
    for r in (0, 1):
        mine = [e.rsplit(" rank=", 1)[0] for e in events if e.endswith(f"rank={r}")]
        # restart 0: rank 1 killed at step 5; restart 1 resumes from the commit at step 3, then the
        # interrupt at step 8 rolls back to the commit at step 6; on_reset ran after each restore
        assert sorted(mine) == sorted([
            "start step=0 restart=0", "reset step=3 restart=1", "start step=3 restart=1",
            "reset step=6 restart=1", "start step=6 restart=1",
            f"end step={E_STEPS_PER_EPOCH * E_EPOCHS} lr=0.05 restart=1"]), mine
    # reference: one process, rank 0's start, the same global batches, no interruption
    ns = {}
    exec(compile(ELASTIC_WORKER, "worker", "exec"), ns)
    model = ns["make"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = ns["data"]()
    for epoch in range(E_EPOCHS):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(1 + epoch))
        for k in range(E_STEPS_PER_EPOCH):
            x, y = dataset[order[k * 2 * E_B:(k + 1) * 2 * E_B]]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for got, want in zip(final, model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-9)

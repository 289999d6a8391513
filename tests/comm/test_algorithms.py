"""Ring and hierarchical allreduce on real ranks (4 ranks as 2 simulated hosts x 2), vs a reference sum.

Values are small integers so that every summation order is exact in every dtype,
which lets the check be exact equality, for odd sizes and uneven chunks.
"""

import pytest
import torch

import phalanx as px
from phalanx.comm.algorithms import ALGORITHMS, allreduce, choose_algorithm
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
SIZES = (1, 3, 7, 1001, 70001)  # odd; 1 and 3 are smaller than the world and the host
# (chunk_bytes, numel) for the pipelined hierarchical: one element per shard, chunks of
# 2 elements with empty shards at the end, an uneven last chunk, ~18 chunks of 1000 elements
PIPELINE_CASES = ((4, 1), (4, 7), (24, 1001), (4000, 70001))


def _value(numel, dtype, rank):
    return ((torch.arange(numel) * 7 + rank * 3) % 11).to(dtype)


def _every_algorithm():
    topo = px.topology()
    r = topo.rank
    out = {}
    # Every rank makes every group, in the same order. Rank 3 is not in [0, 1, 2], so under
    # use_local_synchronization (names from the ranks and this rank's group count) ranks 0 and 3
    # named [0, 3] differently and hung; the hierarchical levels below come after them too.
    g012, g03 = topo.group([0, 1, 2]), topo.group([0, 3])
    if r in (0, 1, 2):
        out["g012"] = px.allreduce(torch.ones(1), op=px.Sum, group=g012).item()
    if r in (0, 3):
        out["g03"] = px.allreduce(torch.full((1,), r + 1.0), op=px.Sum, group=g03).item()
    for algo in ALGORITHMS:
        for dtype in DTYPES:
            for numel in SIZES:
                t = _value(numel, dtype, r)
                back = allreduce(t, algo, topology=topo, op=px.Sum)
                assert back is t, "allreduce works in place and returns its tensor"
                out[(algo, str(dtype), numel)] = t
        out[(algo, "avg")] = allreduce(_value(1001, torch.float32, r), algo, topology=topo, op=px.Average)
        out[(algo, "max")] = allreduce(_value(1001, torch.float32, r), algo, topology=topo, op=px.Max)
        # a non-contiguous tensor (a transposed view) is reduced through a copy
        m = _value(35, torch.float32, r).view(5, 7).t()
        allreduce(m, algo, topology=topo, op=px.Sum)
        out[(algo, "strided")] = m.clone()
        # async: several in flight, then wait in order
        hs = [allreduce(_value(999 + i, torch.float32, r), algo, topology=topo, async_op=True) for i in range(3)]
        polled = all(isinstance(h.is_completed(), bool) for h in hs)
        out[(algo, "async")] = [h.wait() for h in hs] + [polled and all(h.is_completed() for h in hs)]
    # hierarchical pipelined over many chunks, some smaller than the host (empty shards)
    for chunk, numel in PIPELINE_CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = _value(numel, dtype, r)
            out[("pipe", chunk, str(dtype), numel)] = allreduce(t, "hierarchical", topology=topo, chunk_bytes=chunk)
    out["pipe_max"] = allreduce(_value(1001, torch.float32, r), "hierarchical", topology=topo, op=px.Max,
                                chunk_bytes=400)
    # a blocking call issued while an asynchronous one is in flight must not interleave with it
    h = allreduce(_value(70001, torch.float32, r), "hierarchical", topology=topo, async_op=True, chunk_bytes=4000)
    out["pipe_sync_behind"] = allreduce(_value(7001, torch.float32, r), "hierarchical", topology=topo,
                                        chunk_bytes=400)
    out["pipe_async"] = h.wait()
    try:
        allreduce(torch.ones(4), "hierarchical", topology=topo, chunk_bytes=0)
    except ValueError as e:
        out["bad_chunk"] = str(e)
    # the ring on a sub-group of 3 ranks (odd ring), and the errors
    g = topo.group([0, 1, 3])  # every rank makes it; its members use it
    if r in (0, 1, 3):
        out["ring_sub"] = allreduce(_value(1001, torch.float32, r), "ring", topology=topo, group=g)
        try:
            allreduce(torch.ones(4), "hierarchical", topology=topo, group=g)
        except ValueError as e:
            out["hier_sub_error"] = str(e)
    try:
        allreduce(torch.ones(4), "bogus", topology=topo)
    except ValueError as e:
        out["bad_name"] = str(e)
    out["auto_big"] = choose_algorithm(64 << 20, topo)
    out["auto_small"] = choose_algorithm(4096, topo)
    return out


def test_every_algorithm_exact_on_two_simulated_hosts():
    n = 4
    results = distributed(_every_algorithm, np=n, local_size=2)
    for algo in ALGORITHMS:
        for dtype in DTYPES:
            for numel in SIZES:
                want = sum(_value(numel, dtype, r).double() for r in range(n)).to(dtype)
                for r, out in enumerate(results):
                    got = out[(algo, str(dtype), numel)]
                    assert got.dtype == dtype
                    assert torch.equal(got, want), f"{algo} {dtype} numel={numel} rank {r}"
        ref = sum(_value(1001, torch.float32, r) for r in range(n))
        ref_max = torch.stack([_value(1001, torch.float32, r) for r in range(n)]).max(0).values
        ref_strided = sum(_value(35, torch.float32, r) for r in range(n)).view(5, 7).t()
        for out in results:
            torch.testing.assert_close(out[(algo, "avg")], ref / n)
            assert torch.equal(out[(algo, "max")], ref_max)
            assert torch.equal(out[(algo, "strided")], ref_strided)
            *tensors, done = out[(algo, "async")]
            assert done
            for i, t in enumerate(tensors):
                torch.testing.assert_close(t, sum(_value(999 + i, torch.float32, r) for r in range(n)))
    for chunk, numel in PIPELINE_CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            want = sum(_value(numel, dtype, r).double() for r in range(n)).to(dtype)
            for r, out in enumerate(results):
                assert torch.equal(out[("pipe", chunk, str(dtype), numel)], want), \
                    f"pipelined chunk_bytes={chunk} {dtype} numel={numel} rank {r}"
    ref_max_pipe = torch.stack([_value(1001, torch.float32, r) for r in range(n)]).max(0).values
    for out in results:
        assert torch.equal(out["pipe_max"], ref_max_pipe)
        assert torch.equal(out["pipe_async"], sum(_value(70001, torch.float32, r) for r in range(n)))
        assert torch.equal(out["pipe_sync_behind"], sum(_value(7001, torch.float32, r) for r in range(n)))
        assert "chunk_bytes" in out["bad_chunk"]
    ref_sub = sum(_value(1001, torch.float32, r) for r in (0, 1, 3))
    for r in (0, 1, 3):
        assert torch.equal(results[r]["ring_sub"], ref_sub)
        assert "group=None" in results[r]["hier_sub_error"]
    assert [results[r]["g012"] for r in (0, 1, 2)] == [3.0] * 3 and [results[r]["g03"] for r in (0, 3)] == [5.0] * 2
    assert "ring" in results[0]["bad_name"] and "bogus" in results[0]["bad_name"]
    assert results[0]["auto_big"] == "hierarchical" and results[0]["auto_small"] == "flat"


def _one_host_auto():
    topo = px.topology()
    t = _value(1 << 18, torch.float32, topo.rank)
    return choose_algorithm(1 << 30, topo), allreduce(t, "hierarchical", topology=topo)


def test_one_host_auto_is_flat_and_hierarchical_still_exact():
    results = distributed(_one_host_auto, np=2)
    want = _value(1 << 18, torch.float32, 0) + _value(1 << 18, torch.float32, 1)
    for choice, t in results:
        assert choice == "flat"
        assert torch.equal(t, want)



def test_world_of_one_returns_at_once():
    topo = px.init()
    try:
        t = torch.arange(5.0)
        assert allreduce(t, "ring", topology=topo) is t
        assert torch.equal(allreduce(t, "hierarchical", topology=topo, async_op=True).wait(), torch.arange(5.0))
    finally:
        px.shutdown()

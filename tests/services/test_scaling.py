"""Cluster-scale planning: hardware profiles, model sizes from the architecture, the published rows
(each recomputed and held to the error docs/scaling.md states), and ``phalanx plan --hardware``."""

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest

from phalanx.planner import collectives, cost, hardware, published, scaling, workloads

pytestmark = pytest.mark.unit


def test_profiles_load():
    names = hardware.names()
    for want in ("p100-roce25", "p100-eth50", "v100-dgx2h", "a100-hdr", "h100-ib400", "h100-eth25", "cpu2"):
        assert want in names
    for name in names:
        hw = hardware.get(name)
        assert hw.node.gpus >= 1 and hw.gpu.hbm_bytes > 0
        assert all(v > 0 for v in hw.gpu.peak.values()), name
        assert 0 < hw.gpu.mfu <= 1 and hw.gpu.mfu_source, name
        assert hw.network.bandwidth > 0 and hw.network.latency_s >= 0, name
    h100 = hardware.get("h100-ib400")
    assert h100.gpu.peak["bf16"] == pytest.approx(989.5e12) and h100.network.bandwidth == pytest.approx(400e9)
    assert hardware.get("h100-eth25").network.bandwidth == pytest.approx(25e9 / 8)
    # P100's achieved fraction comes from Horovod's ResNet-101 example and the architecture's FLOPs
    assert hardware.P100_MFU == pytest.approx(1656.82 / 16 * 46.808e9 / 9.3e12, rel=1e-3)
    sim = hardware.simulated(200e6, ranks_per_host=2)
    # the tc rate less the headers tbf counts: 1448 bytes of TCP payload per 1514-byte frame
    assert sim.network.bandwidth == pytest.approx(25e6 * 1448 / 1514) and sim.node.gpus == 2
    with pytest.raises(ValueError, match="unknown hardware 'h100'.*h100-ib400"):
        hardware.get("h100")


def test_model_sizes_come_from_the_architecture():
    # torchvision's counts (inception without its auxiliary head) and Narayanan et al. Eq. 2 / Table 1
    sizes = {"resnet50": 25_557_032, "resnet101": 44_549_160, "vgg16": 138_357_544, "inception3": 23_834_568}
    for name, params in sizes.items():
        assert workloads.get(name).params == params, name
    assert workloads.get("resnet50").fwd_flops_per_sample == pytest.approx(2 * 4.09e9, rel=0.01)
    one_t = workloads.get("gpt-1t")
    assert one_t.params / 1e9 == pytest.approx(1008.0, abs=0.1)
    s, n_layers, h, v = 2048, 128, 25600, 51200
    assert one_t.train_flops_per_sample == pytest.approx(96 * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h)))
    assert workloads.get("gpt-8.3b").params / 1e9 == pytest.approx(8.3, abs=0.05)
    # backward meets the last layer first; every gradient is ready by the end
    order = workloads.get("vgg16").backward_order()
    assert order[0][0] == 4097 * 1000 and order[-1][1] == pytest.approx(1.0)
    assert 0 < workloads.get("gpt-13b").powersgd_ratio() < 0.01
    with pytest.raises(ValueError, match="unknown model 'gpt-2'"):
        workloads.get("gpt-2")


def test_allreduce_shares_the_node_network_by_hand():
    link = lambda bw, lat: cost.Link.from_bandwidth(bw, lat)  # noqa: E731
    hw = hardware.Hardware("t", hardware.GPUS["h100-sxm5"], hardware.Node("n", 8, 100e9, 1e-6),
                           hardware.Network("net", 50e9, 1e-5))
    m = 1e9
    # one node: a ring on the GPU links
    assert scaling.allreduce_time(m, hw, 8) == pytest.approx(cost.ring_allreduce(m, 8, link(100e9, 1e-6)))
    # 4 nodes, tp = 1: NCCL's ring gets the whole node's NICs; only the 2(4-1) steps that leave a node pay
    # the network's latency, the other 2(32-1) - 6 NVLink's (NVIDIA/nccl src/graph/tuning.cc)
    ring = 56 * 1e-6 + 6 * 1e-5 + 2 * 31 / 32 * m / 50e9
    assert scaling.allreduce_time(m, hw, 32, algorithm="ring") == pytest.approx(ring)
    # the tree: a chain in the node and log2(4) hops across, both ways, at 0.92 of the ring's bandwidth
    tree = lambda s: 2 * (7 * 1e-6 + 2 * 1e-5) + 2 * s / (0.92 * 50e9)  # noqa: E731
    assert scaling.allreduce_time(m, hw, 32) == pytest.approx(min(ring, tree(m)))  # NCCL's choice: the ring
    small = 1e3
    assert scaling.allreduce_time(small, hw, 32) == pytest.approx(tree(small))  # latency-bound: the tree
    assert collectives.nccl_allreduce(small, collectives.place(hw, 32))[1] == "tree"
    assert scaling.allreduce_time(small, hw, 32, trees=False) > tree(small)  # NCCL before 2.4: rings only
    # tp = 8: 8 dp groups cross every node at once, each ring gets 1/8 of it
    assert scaling.allreduce_time(m, hw, 4, tp=8) == pytest.approx(cost.ring_allreduce(m, 4, link(50e9 / 8, 1e-5)))
    # hierarchical: 8 cross rings per node (one per local rank), pipelined over 2 MiB chunks
    want = cost.hierarchical_allreduce(m, 8, 4, link(100e9, 1e-6), link(50e9 / 8, 1e-5), 2 << 20)
    assert scaling.allreduce_time(m, hw, 32, algorithm="hierarchical") == pytest.approx(want)
    with pytest.raises(ValueError, match="algorithm"):
        scaling.allreduce_time(m, hw, 32, algorithm="tree")
    # the simulated cluster runs gloo, whose allreduce is a ring at any size: its prediction (docs/scaling.md,
    # benchmarks/scaling_cluster.py) is the plain ring on the tc-capped link, every step a host-to-host one
    sim = hardware.simulated(100e6)
    wire = link(sim.network.bandwidth, sim.network.latency_s)
    for nbytes in (8, 5e5, 4.2e6):
        assert scaling.allreduce_time(nbytes, sim, 8) == pytest.approx(cost.ring_allreduce(nbytes, 8, wire))


@pytest.mark.parametrize("row", published.ROWS + published.MEMORY, ids=[r.key for r in published.ROWS + published.MEMORY])
def test_published_row_is_reproduced_within_its_stated_bound(row):
    predicted = published.reproduce(row)
    error = abs(published.error(row, predicted))
    assert error <= row.bound, (f"{row.key} ({row.source}): predicted {predicted:.3f}, published {row.figure} "
                                f"(bound {row.bound})")
    # a row held to a looser bound than the goal is a documented miss: it must still miss
    goal = published.goal(row)
    assert (error <= goal) == (row.bound <= goal), f"{row.key}: update docs/scaling.md"


def test_scale_terms():
    w, hw = workloads.get("gpt-13b"), hardware.get("h100-ib400")
    one = scaling.predict(w, hw, scaling.Job(dp=1, global_batch=2))
    assert one.efficiency == 1.0 and one.parts["dp_s"] == 0
    # pipeline bubble (p-1)/m, with m micro-batches per replica
    p = scaling.predict(w, hw, scaling.Job(dp=2, global_batch=16, pp=4, micro_batch=1, overlap=False))
    assert p.parts["bubble_s"] == pytest.approx(p.parts["compute_s"] * 3 / 8)
    # ZeRO-3 moves 1.5x the bytes of plain data parallel and holds 1/dp of the weights
    z0 = scaling.predict(w, hw, scaling.Job(dp=64, global_batch=128, overlap=False))
    z3 = scaling.predict(w, hw, scaling.Job(dp=64, global_batch=128, zero=3, overlap=False))
    assert z3.parts["dp_s"] > 1.4 * z0.parts["dp_s"] and z3.memory_bytes < z0.memory_bytes / 8
    # int8 sends about a quarter of fp16's... of fp32's bytes: half of these fp16 gradients, plus its codec
    i8 = scaling.predict(w, hw, scaling.Job(dp=64, global_batch=128, compression="int8", overlap=False))
    assert i8.parts["dp_s"] < 0.6 * z0.parts["dp_s"] and i8.parts["codec_s"] > 0
    with pytest.raises(ValueError, match="compression 'zip'"):
        scaling.predict(w, hw, scaling.Job(dp=2, global_batch=4, compression="zip"))
    ranked = scaling.search(w, hardware.get("h100-ib400"), 8, 16)
    assert all(p.memory_bytes <= 80e9 for p in ranked)
    assert not any(p.job.tp == 1 and p.job.pp == 1 and p.job.zero == 0 for p in ranked)  # 13B x 16 B: no


def test_plan_command_with_hardware(capsys):
    from phalanx.cli import plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())

    def run(*argv):
        args = parser.parse_args(["plan", *argv])
        return args.func(args), capsys.readouterr()

    rc, out = run("--gpus", "16", "--hardware", "h100-eth25", "--model", "gpt-1.3b", "--top", "3")
    assert rc == 0, out.err
    lines = out.out.splitlines()
    assert "16 x H100" in lines[0] and "step ms" in lines[1] and lines[2].lstrip().startswith("1 ")
    assert any(line.startswith("why #1 wins") for line in lines)
    assert "vs plain data parallel" in out.out  # on 25 Gbit/s, plain DP loses: the output says by how much
    rc, out = run("--gpus", "64", "--hardware", "h100-nvl", "--model", "gpt-1.3b")
    assert rc == 2 and "unknown hardware 'h100-nvl'" in out.err and out.err.count("\n") == 1
    rc, out = run("--gpus", "64", "--hardware", "h100-ib400")
    assert rc == 2 and "together" in out.err
    rc, out = run("--gpus", "64", "--hardware", "h100-ib400", "--model", "gpt-2")
    assert rc == 2 and "unknown model" in out.err


def test_projection_is_monotone_in_the_network():
    w = workloads.get("resnet50")
    slow, fast = hardware.get("h100-eth25"), hardware.get("h100-ib400")
    for n in (16, 64, 128):
        job = scaling.Job(dp=n, global_batch=64 * n)
        assert scaling.predict(w, slow, job).efficiency <= scaling.predict(w, fast, job).efficiency
        assert math.isfinite(scaling.predict(w, slow, job).step_s)


def test_measure_cpu_without_a_process_group():
    got = hardware.measure_cpu(seconds=0.05, size=128)
    assert got["fp32_flops"] > 0 and got["mem_bandwidth"] > 0 and got["cores"] >= 1
    assert got["link_alpha_s"] is None  # the loopback link needs 2+ ranks (calibrate.measure_link)


def test_strategy_traffic_as_declared():
    """ZeRO's terms are its declared collectives (phalanx.parallel.composition), not an allreduce x 1.5."""
    w, hw = workloads.get("gpt-13b"), hardware.get("h100-ib400")
    job = scaling.Job(dp=64, global_batch=128, overlap=False)
    dp, z1, z3 = (scaling.predict(w, hw, dataclasses.replace(job, zero=z, algorithm="ring")) for z in (0, 1, 3))
    # ZeRO-1: reduce-scatter + all-gather of the same buckets = a ring allreduce, step for step; the gather
    # runs after the optimizer step, so even with overlap that half is all exposed
    assert z1.parts["dp_s"] == pytest.approx(dp.parts["dp_s"])
    z1o = scaling.predict(w, hw, dataclasses.replace(job, zero=1, overlap=True))
    assert z1o.parts["dp_exposed_s"] >= 0.49 * z1.parts["dp_s"]
    assert "after the step" in z1o.why
    # ZeRO-3: two all-gathers (forward, backward) and a reduce-scatter: 1.5 allreduces of bandwidth
    assert z3.parts["dp_s"] == pytest.approx(1.5 * dp.parts["dp_s"], rel=0.05)
    # fp16 compression of bf16 gradients changes nothing, and it is ZeRO's only other choice: the gathers of
    # parameters are never compressed; PowerSGD is refused by px.zero, so the planner never pairs them
    assert all(not (p.job.zero and p.job.compression in ("int8", "powersgd"))
               for p in scaling.search(w, hw, 64, 128))
    # ZeRO-3 under a pipeline gathers and reduce-scatters every micro-batch: 4 micro-batches, ~4x the traffic
    one = scaling.predict(w, hw, scaling.Job(dp=8, pp=2, global_batch=64, micro_batch=4, zero=3, overlap=False))
    four = scaling.predict(w, hw, scaling.Job(dp=8, pp=2, global_batch=64, micro_batch=1, zero=3, overlap=False))
    assert four.parts["dp_s"] == pytest.approx(4 * one.parts["dp_s"], rel=0.05)


def test_memory_counts_activations_and_the_measured_allocator_overhead():
    import json
    import pathlib

    from phalanx.planner import memory

    # the constant is the largest reserved / allocated ratio of phalanx's own strategies on the H100 run
    results = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/results/gpu-h100-run1.jsonl"
    runs = [json.loads(line) for line in results.read_text().splitlines() if '"zero_memory"' in line]
    ratios = [r["max_memory_reserved"] / r["max_memory_allocated"] for r in runs
              if r.get("config") in ("ddp", "zero1", "zero2", "zero3")]
    assert memory.FRAGMENTATION == pytest.approx(max(ratios), abs=0.005)
    w = workloads.get("gpt-13b")  # recomputed blocks: inputs kept, one block's full set, fp32 logits
    s, h, v = 2048, 5140, 51200
    want = 2 * (s * h * 2 * 40 + s * h * 34 + s * v * 4)
    assert memory.activations(w, 2) == pytest.approx(want)
    no_rc = dataclasses.replace(w, recompute=False)  # Korthikanti Eq. 2 without the score term
    assert memory.activations(no_rc, 2, tp=4) == pytest.approx(2 * (s * h * (10 + 24 / 4) * 40 + s * v * 4 / 4))
    job = scaling.Job(dp=8, global_batch=16, zero=3)
    states = w.params * 16 / 8
    gathered = 2 * max(layer.params for layer in w.layers) * 2
    assert memory.per_gpu(w, job) == pytest.approx((states + gathered + want) * memory.FRAGMENTATION)


def test_eight_bit_state_is_priced_as_adam8bit_stores_it():
    """state_bits=8: each 4-byte moment becomes 1 byte + a 4-byte absmax a block of 2048, plus one
    slice of fp32 scratch in the step; `phalanx plan --state-bits 8` without --hardware is one line."""
    from phalanx.optim.adam8bit import SLICE
    from phalanx.planner import memory

    w = workloads.get("gpt-13b")
    full, eight = scaling.Job(dp=8, global_batch=16, zero=3), scaling.Job(dp=8, global_batch=16, zero=3, state_bits=8)
    saved = w.params * (8 - 2 * (1 + 4 / 2048)) / 8
    extra = memory.STEP_SCRATCH_BYTES_PER_ELEMENT * SLICE
    assert memory.per_gpu(w, eight) == pytest.approx((memory.per_gpu(w, full) / memory.FRAGMENTATION - saved + extra)
                                                     * memory.FRAGMENTATION)
    lines = scaling.plan("gpt-13b", "h100-ib400", 8, state_bits=8, top=1)
    assert "layouts fit" in lines[0]
    with pytest.raises(ValueError, match="--state-bits must be 32 or 8"):
        scaling.plan("gpt-13b", "h100-ib400", 8, state_bits=4)
    p = subprocess.run([sys.executable, "-m", "phalanx", "plan", "--params", "1e9", "--state-bits", "8"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("phalanx plan: --state-bits is priced for --hardware"), p.stderr

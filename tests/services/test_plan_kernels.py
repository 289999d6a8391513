"""The planner's kernel-table compute term (planner.kernels): the table is the measured H100 run, each term is
what the table says at the rows' shapes, and the published rows use it with the configuration each ran."""

import dataclasses
import json
import pathlib

import pytest

from phalanx.planner import hardware, kernels, published, scaling, workloads

pytestmark = pytest.mark.unit
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_table_is_the_measured_run():
    raw = (ROOT / "benchmarks/results/gpu-h100-kernel-rates.jsonl").read_text()
    # the second run (--only mlperf): its kernels appended, its copy bandwidth not (the first run's is the table's)
    mlperf = [line for line in (ROOT / "benchmarks/results/gpu-h100-kernel-rates-mlperf.jsonl").read_text().splitlines()
              if json.loads(line)["step"] in ("linear", "fp8_gemm", "attention")]
    assert kernels.H100_TABLE.read_text() == raw + "".join(line + "\n" for line in mlperf)
    machine = json.loads(raw.splitlines()[0])
    assert machine["gpu"].startswith("NVIDIA H100")
    k = kernels.H100
    assert set(k.elementwise) == {False, True}  # the eager and the compiled Llama block both measured
    assert k.elementwise[True][1] < k.elementwise[False][1]  # compile fuses: less elementwise time
    assert 1e12 < k.copy_bw < 3.35e12 and 5e14 < k.best_rate < 9.895e14


def test_terms_at_the_rows_shapes():
    k = kernels.H100
    rec = next(json.loads(line) for line in kernels.H100_TABLE.read_text().splitlines()
               if '"llama8b-tp1-b2/w1"' in line and '"linear"' in line)
    fwd, both, casts = k.linear_time(16384, 4096, 14336)
    assert (fwd, both, casts) == (rec["fwd_s"], rec["fwd_bwd_s"], 0.0)
    f8 = k.linear_time(16384, 4096, 14336, float8=True)
    assert f8[1] < 0.75 * both and f8[2] == pytest.approx(6 * (16384 * 4096 + 16384 * 14336 + 4096 * 14336) / k.copy_bw)
    # an unmeasured shape: the roofline of the best measured rate and the copy bandwidth
    assert k.linear_time(1000, 1000, 1000)[0] == pytest.approx(max(2e9 / k.best_rate, 6e6 / k.copy_bw))
    # attention scales with batch x heads from the nearest measurement
    one = k.attention_time(64, 8192, 128)
    assert k.attention_time(128, 8192, 128)[1] == pytest.approx(15.05e-3, rel=0.01)  # the 70B run measured
    assert one[1] == pytest.approx(7.29e-3, rel=0.01)
    # recomputation: op (every second matmul) costs less than full, more than none
    w = workloads.get("llama3-8b")
    t = {ac: sum(k.block_time(w, 16384, ac=ac).values()) for ac in kernels.AC_MODES}
    assert t["none"] < t["op"] < t["full"]
    with pytest.raises(ValueError, match="activation checkpointing 'some' unknown; choose one of none, op, full"):
        k.block_time(w, 16384, ac="some")
    # sequence parallel: the elementwise work on the row-parallel outputs (h wide) runs on 1/tp of the tokens
    w70 = workloads.get("llama3-70b")
    plain, sp = (k.block_time(w70, 16 * 8192, 8, sequence_parallel=s) for s in (False, True))
    assert sp["gemm_s"] == plain["gemm_s"]
    h, kv, ffn = 8192, 1024, 28672
    assert sp["hbm_s"] / plain["hbm_s"] == pytest.approx((h / 8 + 2 * kv / 8 + 2 * ffn / 8 + 2 * h / 8)
                                                         / (h / 8 + 2 * kv / 8 + 2 * ffn / 8 + 2 * h))
    assert k.block_time(w, 16384, 1, sequence_parallel=True) == k.block_time(w, 16384, 1)
    # tensor parallel: the column-parallel shards of the 70B block are the measured shapes (no roofline)
    block = next(layer for layer in w70.layers if layer.block)
    for i, (out, inp) in enumerate(block.matrices):
        n, kk = (out, inp // 8) if i in block.row_parallel else (out // 8, inp)
        assert (16 * 8192, kk, n) in k.linear, (i, out, inp)


def test_kernel_table_gpus_and_the_others():
    w = workloads.get("llama3-8b")
    job = scaling.Job(dp=8, global_batch=16, zero=3, ac="op")
    gt, sxm = hardware.get("h100-gt"), hardware.get("h100-ib400")
    assert gt.gpu.kernels == sxm.gpu.kernels == "h100"
    # the Grand Teton part: tensor-core time / 0.922 (middle of NVL..SXM), memory-bound time x 3.35/2.4
    assert scaling.predict(w, gt, job).parts["compute_s"] > 1.1 * scaling.predict(w, sxm, job).parts["compute_s"]
    # compile and Float8 each shorten the step; the one-constant model (mfu=) ignores both
    base = scaling.predict(w, gt, job).step_s
    comp = scaling.predict(w, gt, dataclasses.replace(job, compiled=True)).step_s
    f8 = scaling.predict(w, gt, dataclasses.replace(job, compiled=True, float8=True)).step_s
    assert f8 < comp < base
    one = scaling.predict(w, gt, job, mfu=gt.gpu.mfu)
    f8_one = scaling.predict(w, gt, dataclasses.replace(job, float8=True), mfu=gt.gpu.mfu)
    assert one.parts["compute_s"] == f8_one.parts["compute_s"]
    # a GPU without a table keeps the one-constant model
    a100 = hardware.get("a100-hdr")
    g = workloads.get("gpt-1.7b")
    p = scaling.predict(g, a100, scaling.Job(dp=8, global_batch=16))
    assert p.parts["compute_s"] == pytest.approx(g.train_flops_per_sample * 2 / a100.gpu.rate(g.precision))


def test_published_speedups_of_compile_and_float8():
    """The ratios within torchtitan's Table 1 do not depend on the machine's clock: compile and Float8, each
    against the row before it, within 5% of the published ratios (1.157 and 1.280)."""
    rows = {r.key: r for r in published.ROWS}
    pred = {k: published.reproduce(rows[k]) for k in ("torchtitan-8b-8", "torchtitan-8b-8-compile",
                                                      "torchtitan-8b-8-float8")}
    for a, b in (("torchtitan-8b-8", "torchtitan-8b-8-compile"), ("torchtitan-8b-8-compile", "torchtitan-8b-8-float8")):
        want = rows[b].figure / rows[a].figure
        assert pred[b] / pred[a] == pytest.approx(want, rel=0.05), (a, b)


def test_grand_teton_against_h200_is_the_hardware():
    """torchtitan's 8B job (compile + Float8, local batch 2) ran on Grand Teton's 500 W HBM2e H100s (Table 1: 8 GPUs,
    8,532 tokens/s; Table 3: 128 GPUs, 8,380) and on standard H200s (benchmarks/llama3-8b_h200_202506_trainy-
    whitefiber.md: 32 GPUs 10,938, 64 GPUs 10,753). The ratio of the two machines, 0.780 / 0.779, is what the
    hardware profile must give: within the interval torchtitan states (NVL .. SXM peak) and within 5% at its middle.
    The model misses the absolute rate by the same amount on both machines, so that miss is not the hardware's."""
    rows = {r.key: r for r in published.ROWS}
    gt8, h32, h64 = rows["torchtitan-8b-8-float8"], rows["torchtitan-8b-h200-32"], rows["torchtitan-8b-h200-64"]
    gt128 = dataclasses.replace(gt8, figure=8380, job=dataclasses.replace(gt8.job, dp=128, global_batch=256))
    h200 = {n: published.reproduce(r) for n, r in ((32, h32), (64, h64))}
    lo, hi = published.GT_GEMM_SCALE_ENDS
    for gt, n in ((gt8, 32), (gt128, 64)):
        want = gt.figure / {32: h32, 64: h64}[n].figure
        ends = [published.reproduce(gt, gemm_scale=s) / h200[n] for s in (lo, hi)]
        assert ends[0] < want < ends[1], (gt.figure, n, ends, want)
        assert published.reproduce(gt) / h200[n] == pytest.approx(want, rel=0.05)
    # the same software term: the absolute miss on H200 within 6 points of the Grand Teton row's (at the middle)
    miss_h200, miss_gt = (published.reproduce(r) / r.figure - 1 for r in (h32, gt8))
    assert miss_h200 > 0.15 and abs(miss_h200 - miss_gt) < 0.06, (miss_h200, miss_gt)


def test_float8_gain_on_the_70b_job_is_short_of_the_published():
    """torchtitan's 70B job on 256 Grand Teton H100s in bf16 and with Float8 (asyncTP_llama3_h100_2025-06_torchtitan.md,
    vanilla TP: 597.3 and 809.8 tokens/s, 1.356x). The model's Float8 gain there is 1.14x: short by more than 10%,
    which is why the 70B / 405B Float8 rows land near while the bf16 70B row misses (docs/scaling.md). When the
    model's gain moves within 10%, this fails: update the docs."""
    bf16, f8 = published.by_key("torchtitan-70b-256-bf16-2025"), published.by_key("torchtitan-70b-256-float8-2025")
    want = f8.figure / bf16.figure
    got = published.reproduce(f8) / published.reproduce(bf16)
    assert 1.0 < got < 0.9 * want, (got, want)


def test_software_terms_of_the_rows():
    """What a row's software ran, priced the same way for every row: the attention kernel (the table's cuDNN, or
    PyTorch's flash backend, FlashAttention-2, at its published H100 rates), the optimizer's implementation, and
    FSDP2's fp32 reduce-scatter and its copies around the collectives."""
    k, w = kernels.H100, workloads.get("llama3-8b")
    fwd_flops = 4 * 64 * 8192**2 * 128 / 2  # batch x heads 64, causal
    fwd, both = k.attention_time(64, 8192, 128, "flash2")
    assert fwd == pytest.approx(fwd_flops / 333e12) and both == pytest.approx(fwd + 2.5 * fwd_flops / 318e12)
    assert both > 1.5 * k.attention_time(64, 8192, 128)[1]  # FlashAttention-2 is the slower kernel on an H100
    assert k.attention_time(64, 6000, 128, "flash2")[0] == pytest.approx(4 * 64 * 6000**2 * 128 / 2 / 319e12)  # 4k
    with pytest.raises(ValueError, match="attention backend 'fa9' unknown; choose one of cudnn, flash2"):
        k.attention_time(64, 8192, 128, "fa9")
    terms = k.block_terms(w, 16384, ac="op", attention="flash2")
    assert sum(k.block_time(w, 16384, ac="op", attention="flash2").values()) == pytest.approx(sum(terms.values()))
    assert terms["attention_s"] == pytest.approx(both) and terms["recompute_s"] > 0  # op: attention saved, not rerun
    assert k.optimizer_time(1e9, implementation="foreach") == pytest.approx(92 / 32 * k.optimizer_time(1e9))
    with pytest.raises(ValueError, match="optimizer 'sgd' unknown; choose one of fused, foreach"):
        k.optimizer_time(1e9, implementation="sgd")

    gt = hardware.get("h100-gt")
    plain = scaling.Job(dp=8, global_batch=16, zero=3, ac="op")
    fsdp2 = dataclasses.replace(plain, fsdp2=True)
    a, b = scaling.predict(w, gt, plain), scaling.predict(w, gt, fsdp2)
    assert a.parts["compute_terms"]["fsdp2_copies_s"] == 0
    # two gathers copied out (read + write 2 B) and one fp32 copy-in (read 2, write 4) over all 8B parameters
    copies = b.parts["compute_terms"]["fsdp2_copies_s"]
    assert copies == pytest.approx(w.params * (2 * 2 * 2 + 2 + 4) / gt.gpu.hbm_bandwidth)
    assert sum(b.parts["compute_terms"].values()) == pytest.approx(b.parts["compute_s"])
    # the reduce-scatter in fp32: 4 bytes a gradient on the wire; the two gathers (bf16) unchanged
    assert b.parts["dp_s"] == pytest.approx(4 / 3 * a.parts["dp_s"], rel=0.02)
    f8 = scaling.predict(w, gt, dataclasses.replace(fsdp2, float8=True, compiled=True))
    copies = f8.parts["compute_terms"]["fsdp2_copies_s"]
    assert copies == pytest.approx(w.params * (2 * 2 * 1 + 6) / gt.gpu.hbm_bandwidth)  # gathered in float8
    one = scaling.predict(w, gt, dataclasses.replace(fsdp2, dp=1, global_batch=2))
    assert one.parts["compute_terms"]["fsdp2_copies_s"] == 0  # a world of one gathers nothing
    for field, bad, want in (("attention", "fa9", "cudnn, flash2"), ("optimizer", "sgd", "fused, foreach")):
        with pytest.raises(ValueError, match=f"{field} '{bad}' unknown; choose one of {want}"):
            scaling.predict(w, gt, dataclasses.replace(plain, **{field: bad}))

    # the rows: torchtitan's code ran flash, FSDP2 and foreach AdamW; Transformer Engine (Megatron-LM, MLPerf) cuDNN
    for row in published.ROWS[7:]:
        titan = row.key.startswith("torchtitan")
        assert (row.job.attention, row.job.fsdp2, row.job.optimizer) == (
            ("flash2", True, "foreach") if titan else ("cudnn", False, "fused")), row.key


def test_megatron_data_parallel_as_megatron_core_runs_it():
    """planner.megatron: the Megatron-LM rows' dp axis as Megatron-Core f2e5db4 runs it (fp32 reduce-scatter of
    max(40M, 1M x dp)-element buckets behind the last micro-batch's backward, bf16 gathers behind the first forward,
    Adam on 1/dp), and what docs/scaling.md says it shows: no micro-batch the README leaves open brings 7.1B within
    15%, and at the rows' micro-batch of 1 the 32B row falls below -15% (why the rows keep the model's own terms)."""
    from phalanx.planner import collectives, megatron
    row = published.by_key("megatron-h100-7.1b")
    w, hw, job = workloads.get(row.model), hardware.get(row.hardware), row.job
    p = scaling.predict(w, hw, job)
    s = megatron.step(w, hw, job)
    local = w.params / job.tp
    assert megatron.bucket_elements(48) == 48e6 and megatron.bucket_elements(8) == 40e6
    n = s["buckets"]   # a bucket closes at 48M elements: every layer of 7.1B at TP 2 (>= 100M) closes its own
    assert n == 32   # embedding, 30 blocks, output layer; each bucket pays the ring's latencies
    latency = collectives.gather_time(0.0, hw, job.dp, job.tp)
    for name, nbytes in (("reduce_s", 4), ("gather_s", 2)):  # fp32 gradients, bf16 parameters
        wire = collectives.gather_time(nbytes * local, hw, job.dp, job.tp) - latency
        assert s[name] == pytest.approx(n * latency + wire), name
    assert s["optimizer_s"] == pytest.approx(p.parts["compute_terms"]["optimizer_s"] / 48)
    assert s["model_step_s"] == pytest.approx(p.step_s) and s["tp_s"] == pytest.approx(p.parts["tp_s"])
    assert s["step_s"] == pytest.approx(p.step_s - p.parts["dp_exposed_s"] - p.parts["compute_terms"]["optimizer_s"]
                                        + s["reduce_exposed_s"] + s["gather_exposed_s"] + s["optimizer_s"])
    want = p.step_s * published.reproduce(row) / row.figure   # the step the published MFU implies
    for mb in (1, 2, 4):
        t = megatron.step(w, hw, dataclasses.replace(job, micro_batch=mb, accumulate=mb < 4))
        assert want / t["step_s"] - 1 > published.RELATIVE_BOUND, mb
    big = published.by_key("megatron-h100-32b")
    w32, job32 = workloads.get(big.model), big.job
    one, four = (megatron.step(w32, hw, dataclasses.replace(job32, micro_batch=mb, accumulate=mb < 4)) for mb in (1, 4))
    assert one["reduce_exposed_s"] > 10 * four["reduce_exposed_s"]  # one micro-batch's backward hides a tenth
    want32 = one["model_step_s"] * published.reproduce(big) / big.figure
    assert want32 / one["step_s"] - 1 < -published.RELATIVE_BOUND
    assert abs(published.error(big, published.reproduce(big))) < published.RELATIVE_BOUND  # the row: the model's


def test_nccl_nvlink_bus_bandwidth_is_a_contrast():
    """NCCL's expected bus bandwidth on 8 H100s over NVLink (360 GB/s, nccl-tests#326) against the profiles' 450: the
    torchtitan 70B bf16 row's exposed TP traffic grows and the row moves toward the published (docs/scaling.md), but
    Megatron-LM's 70B row, whose TP traffic is priced fully exposed where Megatron overlaps it, leaves its bound;
    so the profiles keep 450. When that stops being so, this fails: update the docs."""
    bus = published.NCCL_H100_NVLINK_BUS
    bf16, meg70 = published.by_key("torchtitan-70b-256-bf16-2025"), published.by_key("megatron-h100-70b")
    before, after = published.reproduce(bf16), published.reproduce(bf16, nvlink=bus)
    assert published.error(bf16, after) < published.error(bf16, before) - 0.04
    assert published.error(bf16, after) > published.RELATIVE_BOUND   # still a miss
    assert -published.RELATIVE_BOUND < published.error(meg70, published.reproduce(meg70)) < -0.10
    assert published.error(meg70, published.reproduce(meg70, nvlink=bus)) < -meg70.bound


def test_a_real_8b_step_on_one_h100_is_priced_as_measured():
    """The compute term against a real step (benchmarks/gpu/titan_step.py, run 8 on one H100 SXM): Llama 3 8B as
    torchtitan runs it, truncated to 1 and 3 blocks. One block inside the step is priced within 2% (measured 65.8
    ms), the whole step within 12%: what the model leaves out at dp 1 is FSDP2's world-of-one copies and part of
    the fp32 loss (docs/scaling.md, "What is left, term by term")."""
    rows = [json.loads(line) for line in (ROOT / "benchmarks/results/gpu-h100-run8-titan-step.jsonl").open()]
    steps = {(r["layers"], r["compile"]): r for r in rows if r["step"] == "titan_step"}
    assert steps[(1, False)]["device"].startswith("NVIDIA H100")

    def model(layers, compiled=False):
        w = workloads.llama(layers, 4096, 32, 8, 14336, 128256, 8192, name=f"llama3-8b-{layers}")
        job = published.titan_2024(dp=1, global_batch=2, zero=3, ac="op", compiled=compiled)
        return scaling.predict(w, hardware.get("h100-ib400"), job).step_s

    per_block = (steps[(3, False)]["step_s"] - steps[(1, False)]["step_s"]) / 2
    assert (model(3) - model(1)) / 2 == pytest.approx(per_block, rel=0.02)
    for (layers, compiled), r in steps.items():
        assert model(layers, compiled) == pytest.approx(r["step_s"], rel=0.12), (layers, compiled)
        assert model(layers, compiled) < r["step_s"]  # nothing the model prices is more than the step took

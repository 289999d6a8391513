"""Published scaling results, each recomputed by the cost model from its architecture and hardware.

A :class:`Row` holds what the paper or README states (hardware, model, batch,
layout, figure) and the job the model runs; :func:`reproduce` predicts the figure.
Nothing is tuned per row: the model's parameters and FLOPs come from
:mod:`~phalanx.planner.workloads`, the machines from :mod:`~phalanx.planner.hardware`
(one achieved-FLOPs constant per GPU generation), and the terms from
:mod:`~phalanx.planner.scaling`. ``BOUND`` is the error the docs state and the tests
assert for each row (points of efficiency or of % of peak).

Example::

    from phalanx.planner import published
    for row in published.ROWS:
        pred = published.reproduce(row)
        print(row.key, row.figure, round(pred, 3))
"""

from __future__ import annotations

import dataclasses

from phalanx.planner import hardware, memory, scaling, workloads

__all__ = ["Row", "ROWS", "TORCHTITAN", "TORCHTITAN_H200", "MEGATRON", "MLPERF", "reproduce", "error", "goal", "BOUND",
           "RELATIVE_BOUND", "by_key", "GT_GEMM_SCALE_ENDS", "MEMORY", "NCCL_H100_NVLINK_BUS", "titan_2024"]

BOUND = 0.10
"""the goal for the efficiency and %-of-peak rows: within 10 points (docs/scaling.md lists each row's own bound)"""
RELATIVE_BOUND = 0.15
"""the goal for the throughput rows (tokens/s per GPU): within 15% of the published figure"""


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    source: str
    model: str
    hardware: str
    metric: str
    """"efficiency" (against the base job), "peak" (fraction of the GPUs' peak FLOP/s), "mfu" (model FLOPs, no
    recomputation, per GPU per second over the peak; its error is relative, as the issue's goal states it), or
    "tokens" (tokens/s per GPU; its error is relative), or "memory" (peak GiB per GPU, reserved; relative)"""
    figure: float
    job: scaling.Job
    base: scaling.Job | None = None
    """efficiency is relative to this job (None: to one GPU doing the same work, i.e. compute alone)"""
    bound: float = BOUND
    """the error this row is held to (tests assert it; docs/scaling.md says why where it is not 10 points)"""
    note: str = ""


def _dp(n: int, per_gpu: int, **kw) -> scaling.Job:
    return scaling.Job(dp=n, global_batch=n * per_gpu, **kw)


ROWS: tuple[Row, ...] = (
    Row("horovod-resnet101", "Horovod README / docs/benchmarks.rst", "resnet101", "p100-roce25", "efficiency", 0.90,
        _dp(512, 64, bucket_mb=64, trees=False), note="TF CNN benchmarks, batch 64/GPU, fp32, 64 MB tensor fusion, one NCCL ring"),
    Row("horovod-inception3", "Horovod README / docs/benchmarks.rst", "inception3", "p100-roce25", "efficiency", 0.90,
        _dp(512, 64, bucket_mb=64, trees=False)),
    Row("horovod-vgg16", "Horovod README / docs/benchmarks.rst", "vgg16", "p100-roce25", "efficiency", 0.68,
        _dp(512, 64, bucket_mb=64, trees=False), bound=0.30,
        note="compute term: nominal FLOPs; cuDNN runs VGG's 3x3 convolutions with fewer (Winograd/FFT)"),
    Row("goyal-resnet50", "Goyal et al. 2017, ImageNet in 1 hour", "resnet50", "p100-eth50", "efficiency", 0.90,
        _dp(256, 32, algorithm="hierarchical", bucket_mb=4, trees=False),
        base=_dp(8, 32, algorithm="hierarchical", bucket_mb=4, trees=False),
        note="8 -> 256 GPUs; reduce in the server, allreduce across servers, broadcast; per-layer-group buckets"),
    Row("megatron-8.3b", "Shoeybi et al. 2019, Megatron-LM", "gpt-8.3b", "v100-dgx2h", "efficiency", 0.76,
        scaling.Job(dp=64, global_batch=512, tp=8, overlap=False),
        note="8-way tensor x 64-way data, global batch 512, activation checkpointing, allreduce after backward"),
    Row("narayanan-1t", "Narayanan et al. 2021, Table 1", "gpt-1t", "a100-hdr", "peak", 0.52,
        scaling.Job(dp=6, global_batch=3072, tp=8, pp=64, micro_batch=1, overlap=False),
        note="8-way tensor, 64-way pipeline, 6-way data; micro-batch 1 and a plain 1F1B schedule assumed"),
    Row("li-ddp-resnet50", "Li et al. 2020 (PyTorch DDP, VLDB)", "resnet50", "v100-ib100", "efficiency", 0.90,
        _dp(256, 32, bucket_mb=25),
        note="'near-linear' at 256 GPUs: read as >= 90%; hardware as read (8 V100 NVLink/server, 100 Gbit/s)"),
)


# torchtitan (Liang et al. 2024, arXiv:2410.06511; the same runs in pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md): Grand Teton H100 96GB, 400 Gbit/s per GPU, Llama 3.1, sequence
# 8192, FSDP2 (= ZeRO-3). Hardware ``h100-gt``: 500 W, HBM2e, its peak "between SXM and NVL" (GT_GEMM_SCALE_ENDS).
# Each row runs its configuration (selective op / full AC, torch.compile, Float8) and its software (_titan:
# FlashAttention-2, FSDP2's fp32 reduce and copies, foreach AdamW); AsyncTP is not modelled. The 8B rows and the 2025
# bf16 70B row are documented misses, +17% to +23% (docs/scaling.md: the same ~15% of the step is unpriced on H200s
# and in Megatron-LM's 7.1B row).
def _titan(**kw) -> scaling.Job:
    """A torchtitan job, as its code at the benchmark's commit runs it: attention in PyTorch's flash backend
    (FlashAttention-2, not the cuDNN kernel the table measured: planner.kernels.ATTENTION_BACKENDS says why, for the Dec
    2024 and the June 2025 runs), FSDP2 with its fp32 reduce and its copies (``Job.fsdp2``), and torch's foreach AdamW
    after clip_grad_norm_ (``Job.optimizer``; optimizer.fused defaults to False), and its pipeline as
    torch.distributed.pipelining holds it (``Job.pipeline_buffers``: memory only)."""
    return scaling.Job(attention="flash2", fsdp2=True, optimizer="foreach", tensor_parallel="dtensor",
                       pipeline_buffers="torch", **kw)


def titan_2024(**kw) -> scaling.Job:
    """A torchtitan job at 9dec370 (Dec 2024), for memory too: the loss not compiled ("compiling loss function causes
    CUDA errors, turning off for now", train.py), so ``cross_entropy(pred.float())`` op by op (``loss="eager"``), and
    launched by run_llama_train.sh, which sets PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"."""
    return _titan(loss="eager", expandable_segments=True, **kw)


_TT = "torchtitan, arXiv:2410.06511 / benchmarks/llama3_h100_202412_torchtitan.md"
_TT_2025 = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, Llama 3.1 70B on 256 H100"
TORCHTITAN: tuple[Row, ...] = (
    Row("torchtitan-8b-8", _TT + " Table 1 (FSDP)", "llama3-8b", "h100-gt", "tokens", 5762,
        titan_2024(dp=8, global_batch=16, zero=3, ac="op"), bound=0.30,
        note="8 GPUs, local batch 2, selective (op) activation checkpointing, eager (llama3_8b.toml at 9dec370)"),
    Row("torchtitan-8b-8-compile", _TT + " Table 1 (FSDP + compile)", "llama3-8b", "h100-gt", "tokens", 6667,
        titan_2024(dp=8, global_batch=16, zero=3, ac="op", compiled=True), bound=0.30),
    Row("torchtitan-8b-8-float8", _TT + " Table 1 (FSDP + compile + Float8)", "llama3-8b", "h100-gt", "tokens",
        8532, titan_2024(dp=8, global_batch=16, zero=3, ac="op", compiled=True, float8=True), bound=0.30),
    Row("torchtitan-8b-128", _TT + " Table 3 (FSDP)", "llama3-8b", "h100-gt", "tokens", 5605,
        titan_2024(dp=128, global_batch=256, zero=3, ac="op"), bound=0.30,
        note="128 GPUs, local batch 2, selective (op) activation checkpointing, eager"),
    Row("torchtitan-70b-256", _TT + " Table 4 (2D)", "llama3-70b", "h100-gt", "tokens", 829,
        titan_2024(dp=32, tp=8, global_batch=512, zero=3, ac="full", compiled=True, float8=True,
                    sequence_parallel=True), bound=0.15,
        note="FSDP 32 x TP 8, local batch 16, full AC, Float8 + torch.compile (synchronous TP)"),
    Row("torchtitan-405b-512", _TT + " Table 5 (3D, 1F1B)", "llama3-405b", "h100-gt", "tokens", 100,
        titan_2024(dp=8, tp=8, pp=8, global_batch=256, micro_batch=4, zero=3, overlap=False, ac="full",
                    compiled=True, float8=True, regather=False, sequence_parallel=True), bound=0.15,
        note="FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32 in 8 micro-batches (torchtitan's default: as many as "
             "stages), full AC, Float8 + compile; AsyncTP not modelled"),
    # The same 70B job a half-year later on the same cluster (pytorch/torchtitan
    # benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "Vanilla TP" column: FSDP 32 x TP 8, local batch 16, full
    # AC, torch.compile; llama3_70b.toml at 820504e: mode = "full"), in bf16 and with Float8 tensorwise linears.
    Row("torchtitan-70b-256-bf16-2025", _TT_2025 + " (bf16, vanilla TP)", "llama3-70b", "h100-gt", "tokens", 597.3,
        _titan(dp=32, tp=8, global_batch=512, zero=3, ac="full", compiled=True, sequence_parallel=True,
               expandable_segments=True), bound=0.30,
        note="the Table 4 job without Float8: the model's compute term alone, at the 70B's measured shapes"),
    Row("torchtitan-70b-256-float8-2025", _TT_2025 + " (Float8 tensorwise, vanilla TP)", "llama3-70b", "h100-gt",
        "tokens", 809.8, _titan(dp=32, tp=8, global_batch=512, zero=3, ac="full", compiled=True, float8=True,
                                sequence_parallel=True, expandable_segments=True), bound=0.15),
)
ROWS = ROWS + TORCHTITAN

# The same 8B job (torchtitan's llama3_8b.toml: selective op AC; local batch 2, torch.compile, Float8 tensorwise with
# the Float8 all-gather) on standard 700 W H200s: pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md
# (Trainy on WhiteFiber, June 2025: 8 H200 per host on NVLink, 400 Gbit/s CX-7 RDMA per GPU; torchtitan e7c0cae,
# whose llama3_8b.toml has selective_ac_option = "op"). No power cap and no unknown peak: what these rows miss is the
# model's own, and the Grand Teton rows' miss against them is what the hardware explains (test_plan_kernels.py).
_TT_H200 = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
TORCHTITAN_H200: tuple[Row, ...] = tuple(
    Row(f"torchtitan-8b-h200-{n}", _TT_H200 + f" ({n // 8} nodes)", "llama3-8b", "h200-ib400", "tokens", figure,
        _titan(dp=n, global_batch=2 * n, zero=3, ac="op", compiled=True, float8=True), bound=0.30,
        note=f"{n} H200, FSDP {n}, local batch 2, compile + Float8 (Float8 all-gather), selective op AC")
    for n, figure in ((32, 10938), (64, 10753)))
ROWS = ROWS + TORCHTITAN_H200

GT_GEMM_SCALE_ENDS = (835.5 / 989.5, 1.0)
"""torchtitan's Grand Teton H100 (500 W, HBM2e): "the actual peak TFLOPs number is between SXM and NVL"
(benchmarks/llama3_h100_202412_torchtitan.md, footnote 2). The ends of that interval as ``GPU.gemm_scale``
against the SXM5 the kernel table was measured on: the H100 NVL datasheet's 1,671 TFLOP/s bf16 with sparsity =
835.5 dense over the SXM5's 989.5, and the SXM5 itself. The profile (hardware ``h100-gt``) takes the middle."""

NCCL_H100_NVLINK_BUS = 360e9
"""the all-gather / allreduce bus bandwidth NCCL is expected to reach on 8 H100s over NVLink: "360 GB/s is exactly what
we'd expect on H100" (NCCL's Sylvain Jeaugey, NVIDIA/nccl-tests#326, June 2025, on all_gather_perf / all_reduce_perf
at 128 MB-16 GB), against the 450 GB/s a direction of the datasheet's NVLink that the H100 / H200 node profiles use. A
contrast only (docs/scaling.md): applied, it moves Megatron-LM's 70B row out of its bound, because the Megatron rows
price their tensor-parallel traffic fully exposed where Megatron overlaps it (--tp-comm-overlap)"""

# Megatron-LM's H100 weak scaling (NVIDIA/Megatron-LM README.md, "Performance Benchmarking", images/model_table.png:
# Megatron-Core r0.8.0; vocabulary 131,072, sequence 4,096; DP overlap of the gradient reduce and the parameter
# gather, TP communication overlap). The table gives each run's TP, PP, DP (48), GPUs, global batch and MFU;
# not given, so assumed: micro-batch 1 (gradient accumulation at PP 1), plain 1F1B, no recomputation, bf16, fused (TE)
# elementwise kernels. Sequence parallel with TP: Megatron's --tp-comm-overlap requires it.
# The distributed optimizer's reduce-scatter + overlapped parameter gather moves an allreduce's bytes:
# priced as the overlapped allreduce; its memory as its README states it (6 + 12/dp bytes a parameter).
_MEG = "Megatron-LM README.md (model_table.png, Megatron-Core r0.8.0, H100)"
MEGATRON: tuple[Row, ...] = tuple(
    Row(f"megatron-h100-{size}", _MEG, f"megatron-{size}", "h100-ib400", "mfu", tflops * 1e12 / 989.5e12,
        scaling.Job(dp=48, tp=tp, pp=pp, global_batch=batch, micro_batch=1, compiled=True, accumulate=True,
                    sequence_parallel=tp > 1, distributed_optimizer=True), bound=bound)
    for size, tp, pp, batch, tflops, bound in (   # per-GPU teraFLOP/s as published (MFU = that / 989.5)
        ("1.7b", 1, 1, 192, 408.8, 0.15), ("7.1b", 2, 1, 192, 465.9, 0.20), ("16b", 4, 1, 192, 489.1, 0.15),
        ("32b", 8, 1, 192, 459.6, 0.15), ("70b", 8, 2, 384, 419.7, 0.15), ("119b", 8, 4, 768, 420.5, 0.15),
        ("177b", 8, 6, 1152, 432.8, 0.15), ("314b", 8, 8, 1536, 474.4, 0.15), ("462b", 8, 16, 3072, 459.9, 0.15)))
ROWS = ROWS + MEGATRON

# MLPerf Training v3.1, GPT-3 175B, NVIDIA on Eos: 1344 x DGX H100 = 10,752 H100s (mlcommons/training_results_v3.1,
# NVIDIA/results/eos-dfw_n1344_ngc23.09_nemo/gpt3/result_0.txt: time to train 3.92 min; global batch 2688 of 2048
# tokens, gradient accumulation 8; median train_step_timing 0.9296 s over its 220 steps, the same in result_1 and
# result_2). Configuration: NVIDIA/benchmarks/gpt3/implementations/pytorch/config_DGXH100_1344x8x8x4x8_mbs1.sh,
# config_common.sh, config_fp8.sh and conf/custom.yaml: TP 4, PP 8 with 12 virtual stages (interleaved 1F1B),
# micro-batch 1, no recomputation, FP8 (Transformer Engine, hybrid), distributed Adam, TP communication overlap.
_MLPERF = "MLPerf Training v3.1, NVIDIA Eos (mlcommons/training_results_v3.1)"
MLPERF: tuple[Row, ...] = (
    Row("mlperf-gpt3-175b-10752", _MLPERF + " GPT-3 175B, 1344 x DGX H100", "gpt3-175b", "h100-ib400", "tokens",
        2688 * 2048 / 0.9296 / 10752,
        scaling.Job(dp=336, tp=4, pp=8, global_batch=2688, micro_batch=1, interleave=12, float8=True, compiled=True,
                    sequence_parallel=True, distributed_optimizer=True),
        bound=0.15, note="tokens/s per GPU of the training steps (the run's median step); evaluation not modelled"),
)
ROWS = ROWS + MLPERF

# Peak memory per GPU as published (GiB: torch.cuda.memory_stats' reserved_bytes.all.peak, the largest over the
# ranks, torchtitan's metrics.py), against planner.memory for the same job. torchtitan's Tables 1 and 3 (8B, FSDP 8
# and 128), Table 4 (70B 2D) and Table 5 (405B 3D, 1F1B); Trainy's H200 runs. Not here: Table 2 and 6 (context
# parallel, not modelled), the interleaved 405B (its peak depends on the schedule's order), Megatron-LM and MLPerf
# (no memory published; test_plan_memory checks that each of their runs fits its GPU). Each throughput row's job is
# the same job; the Table 3 compile and Float8 runs have no throughput row and get their own.
_8B_128 = dict(dp=128, global_batch=256, zero=3, ac="op")


def _memory(key: str, source: str, figure: float, bound: float = RELATIVE_BOUND, job: scaling.Job | None = None,
            model: str = "llama3-8b", hardware_name: str = "h100-gt") -> Row:
    base = next(row for row in ROWS if row.key == key) if job is None else None
    return Row(key + "-memory", source, base.model if base else model, base.hardware if base else hardware_name,
               "memory", figure, job or base.job, bound=bound)


MEMORY: tuple[Row, ...] = (
    _memory("torchtitan-8b-8", _TT + " Table 1 (FSDP)", 82.4),
    _memory("torchtitan-8b-8-compile", _TT + " Table 1 (FSDP + compile)", 77.0),
    _memory("torchtitan-8b-8-float8", _TT + " Table 1 (FSDP + compile + Float8)", 76.8),
    _memory("torchtitan-8b-128", _TT + " Table 3 (FSDP)", 67.0),
    _memory("torchtitan-8b-128-compile", _TT + " Table 3 (FSDP + compile)", 62.0,
            job=titan_2024(compiled=True, **_8B_128)),
    _memory("torchtitan-8b-128-float8", _TT + " Table 3 (FSDP + compile + Float8)", 61.8,
            job=titan_2024(compiled=True, float8=True, **_8B_128)),
    _memory("torchtitan-70b-256", _TT + " Table 4 (2D)", 71.9),
    _memory("torchtitan-405b-512", _TT + " Table 5 (3D, 1F1B)", 82.5, bound=0.30),
    _memory("torchtitan-8b-h200-32", _TT_H200 + " (4 nodes)", 47.96, bound=0.25),
    _memory("torchtitan-8b-h200-64", _TT_H200 + " (8 nodes)", 46.97, bound=0.25),
)
"""the published memory rows; documented misses: the 405B 3-D job (under) and the H200 runs at the default
allocator's overhead (over), docs/scaling.md"""


def by_key(key: str) -> Row:
    for row in ROWS + MEMORY:
        if row.key == key:
            return row
    raise KeyError(f"no published row {key!r}; rows: {', '.join(r.key for r in ROWS)}")


def reproduce(row: Row, *, mfu: float | None = None, gemm_scale: float | None = None,
              nvlink: float | None = None) -> float:
    """The row's figure as the cost model predicts it; ``gemm_scale`` replaces the GPU's tensor-core rate against
    the kernel table's part (the Grand Teton rows at either end of :data:`GT_GEMM_SCALE_ENDS`), ``nvlink`` the node's
    bus bandwidth per GPU in bytes/s (:data:`NCCL_H100_NVLINK_BUS`)."""
    w, hw = workloads.get(row.model), hardware.get(row.hardware)
    if row.metric == "memory":
        return memory.per_gpu(w, row.job) / 2**30
    if gemm_scale is not None:
        hw = dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, gemm_scale=gemm_scale))
    if nvlink is not None:
        hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpu_bandwidth=nvlink))
    p = scaling.predict(w, hw, row.job, mfu=mfu)
    if row.metric == "tokens":
        return p.samples_per_s * w.seq / row.job.gpus
    if row.metric == "peak":
        return p.flops_per_gpu / hw.gpu.peak[w.precision]
    if row.metric == "mfu":
        model = w.model_flops_per_sample * row.job.global_batch / row.job.gpus
        return model / p.step_s / hw.gpu.peak[w.precision]
    eff = p.efficiency
    if row.base is not None:
        eff /= scaling.predict(w, hw, row.base, mfu=mfu).efficiency
    return eff


def error(row: Row, predicted: float) -> float:
    """The row's error: points for efficiency and % of peak, relative for throughput."""
    if row.metric in ("tokens", "mfu", "memory"):
        return predicted / row.figure - 1
    return predicted - row.figure


def goal(row: Row) -> float:
    """The error the project aims at for a row of this metric."""
    return RELATIVE_BOUND if row.metric in ("tokens", "mfu", "memory") else BOUND

"""Cluster-scale step model: a workload (planner.workloads) on hardware (planner.hardware).

One training step of a ``dp x tp x pp`` job, per GPU. Each strategy's traffic is what
it declares in :mod:`phalanx.parallel.composition`, priced by :mod:`~phalanx.planner.collectives`
the way NCCL runs it::

    compute   = FLOPs/sample x samples per replica / (tp pp x peak x mfu)
    pipeline  = compute x (1 + (pp-1) / (v m))          1F1B bubble, m micro-batches, v interleaved chunks
              + (m + pp - 1) x 2 p2p sends of b s h      (split over the tp GPUs: scatter/gather)
    tensor    = m x blocks/pp x (4, or 6 with recomputation) allreduces of b s h over tp (NVLink)
    data      DataParallel: the model's own gradient buckets (the engine's packing rule), each ready as
                backward reaches it (by FLOPs), each an allreduce over dp (NCCL ring or tree, or phalanx's
                hierarchical); compression shrinks them and adds its codec (int8: 4 passes over HBM;
                PowerSGD: its matmuls). ZeRO-1/2: the same buckets reduce-scattered (stage 2: after every
                micro-batch), then the parameters all-gathered after the step, on the critical path.
                ZeRO-3: the parameters all-gathered module by module in forward, prefetched one ahead (only
                what a module's compute does not cover is exposed), again in backward beside the
                reduce-scatters, every micro-batch. What is left after backward is exposed when buckets
                overlap (Horovod, DDP, Goyal), all of it when they do not (Megatron: after the flush).

``efficiency`` is the compute alone over the step: weak scaling against one GPU (or
one node) doing the same per-GPU work with no communication; % of peak is
``efficiency x mfu``. Memory is :func:`phalanx.planner.memory.per_gpu`.

Example::

    from phalanx.planner import hardware, scaling, workloads
    p = scaling.predict(workloads.get("resnet101"), hardware.get("p100-roce25"),
                        scaling.Job(dp=512, global_batch=512 * 64, bucket_mb=64, algorithm="ring"))
    p.efficiency, p.step_s, p.why
"""

from __future__ import annotations

import dataclasses
import itertools

from phalanx.comm.buckets import pack
from phalanx.parallel import composition
from phalanx.planner import collectives, cost, kernels, memory
from phalanx.planner.collectives import allreduce_time
from phalanx.planner.hardware import Hardware
from phalanx.planner.workloads import Workload

__all__ = ["Job", "ScalePrediction", "predict", "search", "explain", "allreduce_time", "COMPRESSIONS",
           "SUMMABLE"]

COMPRESSIONS = ("none", "fp16", "int8", "powersgd")
"""the compressors this model can price"""
SUMMABLE = {"none": True, "fp16": True, "int8": False, "powersgd": False}
"""whether each one's payloads add up on the wire (the codec's own ``summable``; a test checks they agree)"""
INT8_RATIO = (1 + 4 / 256) / 4
"""int8 codes + one fp32 scale per 256 values, against fp32 (phalanx.comm.compression.quantize)"""
INT8_CODEC_PASSES = 4
"""HBM passes over the fp32 gradient: compress, re-compress the summed chunk, two decodes"""
POWERSGD_RANK = 4
FSDP2_REDUCE_BYTES = memory.FSDP2_REDUCE_BYTES


@dataclasses.dataclass(frozen=True)
class Job:
    dp: int
    global_batch: float
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    interleave: int = 1
    zero: int = 0
    compression: str = "none"
    algorithm: str = "flat"
    """"flat" (the backend's allreduce: NCCL picks ring or tree), "ring" (a flat ring only: NCCL before 2.4)
    or "hierarchical" (phalanx's: reduce-scatter in the node, allreduce across, allgather in the node)"""
    bucket_mb: float = 25.0
    trees: bool = True
    """the backend has NCCL's tree allreduce (NCCL 2.4, 2019 on); False: rings only, as in 2017"""
    overlap: bool = True
    """data-parallel buckets launched during backward (False: after it, e.g. after a pipeline flush)"""
    float8: bool = False
    """Float8 linears (torchao's tensorwise recipe; with ZeRO-3, the parameters gathered in float8 too). Priced
    only on a GPU with a measured kernel table (planner.kernels)"""
    compiled: bool = False
    """torch.compile of each block (fused elementwise kernels; kernel-table GPUs only)"""
    ac: str = ""
    """activation checkpointing: "none", "op" (torchtitan's selective op policy) or "full"; "" for the
    workload's own (full if it recomputes)"""
    sequence_parallel: bool = False
    """tensor parallel with sequence parallelism (Korthikanti et al. 2022; Megatron-LM, torchtitan): the norms
    and residual adds run on 1/tp of the tokens. phalanx's tensor parallel has none. Kernel-table GPUs only"""
    accumulate: bool = False
    """pp = 1: the per-replica batch runs as micro-batches of ``micro_batch`` (gradient accumulation, as
    Megatron-LM does); False: as one pass. Priced on kernel-table GPUs (the GEMMs' shapes change)"""
    state_bits: int = 32
    """Adam's two moments (or SGD's momentum) in 32 bits, or block-wise 8-bit (``state_bits=8`` of px.zero
    and DistributedOptimizer: phalanx.optim.Adam8bit; memory only, the step time is not priced)"""
    attention: str = "cudnn"
    """the causal attention kernel (planner.kernels.ATTENTION_BACKENDS): "cudnn", the measured table's (torch 2.11,
    Transformer Engine on Hopper), or "flash2" (PyTorch's flash backend, which torchtitan's runs used). Kernel-table
    GPUs only"""
    optimizer: str = "fused"
    """the optimizer step's implementation (planner.kernels.OPTIMIZER_BYTES_PER_PARAM): "fused" Adam, or "foreach"
    (torch's AdamW(foreach=True) after clip_grad_norm_, torchtitan's). Kernel-table GPUs only"""
    fsdp2: bool = False
    """ZeRO-3 as FSDP2 (torch.distributed.fsdp.fully_shard) runs it under torchtitan: the gradients reduce-scattered in
    fp32 (MixedPrecisionPolicy(reduce_dtype=float32), torchtitan's mixed_precision_reduce default: 4 bytes a gradient on
    the wire), each all-gather's output copied into the parameters on the compute stream (split_with_sizes_copy: read +
    write the gathered bytes) and each reduce-scatter's input built by casting the gradients into an fp32 buffer
    (_chunk_cat: read 2, write 4 bytes a gradient), which the compute stream waits for before it frees the gradients.
    phalanx's ZeRO-3 views its flat buffer instead (no copy out). Kernel-table GPUs only for the copies"""
    regather: bool = True
    """ZeRO-3 under a pipeline gathers the parameters again for every micro-batch (phalanx's); False: once a
    step (FSDP2 with reshard_after_forward=False, as torchtitan runs it with pipeline parallel)"""
    loss: str = "fused"
    """the cross-entropy as memory sees it (planner.memory.LOSS_BYTES_PER_LOGIT): "fused" (fp32 probabilities, or a
    compiled loss) or "eager" (``cross_entropy(logits.float())`` op by op: torchtitan before it compiled its loss).
    Memory only"""
    distributed_optimizer: bool = False
    """Megatron-LM's distributed optimizer: fp32 gradients, the optimizer state sharded over dp (6 + 12/dp bytes a
    parameter). Memory only: its reduce-scatter + overlapped gather is priced as the overlapped allreduce"""
    tensor_parallel: str = "megatron"
    """how tp > 1 with sequence parallel keeps its inputs, for memory: "megatron" (the sequence-sharded inputs of the
    column-parallel linears gathered again in backward, Korthikanti et al. 2022) or "dtensor"
    (torch.distributed.tensor.parallel, torchtitan's: the all-gathered inputs saved). Memory only"""
    expandable_segments: bool = False
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launch scripts): memory counts no allocator
    overhead (planner.memory.EXPANDABLE) instead of planner.memory.FRAGMENTATION"""
    pipeline_buffers: str = "recycled"
    """what the pipeline's runtime holds beside the activations, for memory (planner.memory.PIPELINE_BUFFERS):
    "recycled" (nothing counted: phalanx's stage recycles its receive buffers, Megatron-LM frees each output once it is
    sent) or "torch" (torch.distributed.pipelining, torchtitan's: every micro-batch's receive buffers allocated up front,
    each stage output kept until its backward, the last stage's outputs until the step ends). Memory only"""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def strategy(self) -> str:
        """The data-parallel strategy's name in phalanx.parallel.composition."""
        return f"zero{self.zero}" if self.zero else "allreduce"

    def command(self) -> str:
        """The phalanx call that runs this layout."""
        if self.tp == 1 and self.pp == 1:
            if self.dp == 1:
                return "plain model (one GPU)"
            comp = f", compression={self.compression!r}" if self.compression != "none" else ""
            if self.zero:
                return f"px.zero(model, optimizer, stage={self.zero}{comp})"
            alg = f", algorithm={self.algorithm!r}" if self.algorithm != "flat" else ""
            return f"px.DataParallel(model{comp}{alg})"
        sched = "" if self.interleave == 1 else ", schedule='interleaved_1f1b'"
        return (f"px.parallelize(model, RankGrid(dp={self.dp}, pp={self.pp}, tp={self.tp}), data_parallel="
                f"{self.strategy!r}" + (f", num_microbatches={self.micro_batches}" if self.pp > 1 else "") + sched + ")")

    @property
    def micro_batches(self) -> int:
        return max(1, int(self.global_batch / self.dp / self.micro_batch)) if self.pp > 1 else 1

    def __str__(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        s += f" zero={self.zero}" if self.zero else ""
        s += f" {self.compression}" if self.compression != "none" else ""
        s += f" {self.algorithm}" if self.dp > 1 and not self.zero else ""
        s += f" micro={self.micro_batch}" + (f" v={self.interleave}" if self.interleave > 1 else "") if self.pp > 1 else ""
        return s


@dataclasses.dataclass(frozen=True)
class ScalePrediction:
    job: Job
    step_s: float
    samples_per_s: float
    efficiency: float
    """compute alone / step (weak scaling against one GPU doing the same work)"""
    flops_per_gpu: float
    """achieved hardware FLOP/s per GPU (recomputation included)"""
    memory_bytes: float
    parts: dict
    why: str

    def fits(self, hw: Hardware) -> bool:
        return self.memory_bytes <= hw.gpu.hbm_bytes


def _buckets(w: Workload, shard: float, bucket_bytes: float, bytes_per_param: float) -> tuple[list, list]:
    """The engine's buckets of this model's gradients (backward order) and when each is ready."""
    order = w.backward_order()
    sizes = [p * shard * bytes_per_param for p, _ in order]
    groups = pack(sizes, bucket_bytes)
    return [sum(sizes[k] for k in g) for g in groups], [order[g[-1]][1] for g in groups]


def _prefetched(gathers: list[float], computes: list[float]) -> float:
    """Exposed time of gathers prefetched one module ahead: module k+1's gather runs under module k's
    compute, so the first gather is exposed, and each later one by what module k's compute leaves."""
    if not gathers:
        return 0.0
    return gathers[0] + sum(max(0.0, g - c) for g, c in zip(gathers[1:], computes))


def _data_traffic(w: Workload, hw: Hardware, job: Job, compute: float, m: int) -> dict:
    """The dp axis's traffic as the strategy declares it (phalanx.parallel.composition), priced."""
    axis = composition.by_name(job.strategy)
    shard = 1.0 / (job.tp * job.pp)
    bpp = w.grad_bytes_per_param
    ratio = {"none": 1.0, "fp16": min(1.0, 2 / bpp), "int8": INT8_RATIO * 4 / bpp,
             "powersgd": w.powersgd_ratio(POWERSGD_RANK)}[job.compression]
    sizes, ready = _buckets(w, shard, job.bucket_mb * 2**20, bpp)
    per_mb_forward = compute / 3 / m
    last = [0.0] * len(sizes)    # under the last micro-batch's backward, once a step
    every = [0.0] * len(sizes)   # under every micro-batch's backward
    after_step = forward_exposed = forward_total = 0.0
    for t in axis.traffic:
        times = m if t.per == "micro_batch" and (job.regather or t.op != "all_gather") else 1
        scale = ratio if t.compressed else (0.5 if job.float8 and t.op == "all_gather" else 1.0)
        if job.fsdp2 and t.op == "reduce_scatter":
            scale *= FSDP2_REDUCE_BYTES / bpp
        if t.op == "allreduce":
            each = [allreduce_time(b * scale, hw, job.dp, job.tp, job.algorithm, job.trees) for b in sizes]
        else:  # reduce-scatter / all-gather of the buckets (ZeRO lays its shards out by bucket)
            each = [collectives.gather_time(b * scale, hw, job.dp, job.tp) for b in sizes]
        if t.hides_behind == "backward":
            target = every if times > 1 else last
            for k, c in enumerate(each):
                target[k] += c
        elif t.hides_behind == "forward":  # module by module, prefetched one ahead
            units = [layer for layer in w.layers if layer.params]
            fwd_c = [per_mb_forward * layer.fwd_flops / max(w.fwd_flops_per_sample, 1.0) for layer in units]
            gathers = [collectives.gather_time(layer.params * shard * bpp * scale, hw, job.dp, job.tp)
                       for layer in units]
            forward_exposed += times * _prefetched(gathers, fwd_c)
            forward_total += times * sum(gathers)
        else:
            after_step += times * sum(each)
    one = [a + b for a, b in zip(last, every)]
    window = compute * (2 / 3) / m
    tail = cost.overlapped_exposure(one, window, 1.0, ready) if job.overlap and sum(one) else sum(one)
    # the other micro-batches' reductions hide behind the compute that follows them, if it is long enough
    earlier = max(0.0, (m - 1) * (sum(every) - compute / m))
    return {"dp_s": sum(last) + m * sum(every) + after_step + forward_total,
            "dp_exposed_s": tail + earlier + after_step + forward_exposed,
            "buckets": len(sizes), "forward_gather_s": forward_exposed, "after_step_s": after_step}


def predict(w: Workload, hw: Hardware, job: Job, *, mfu: float | None = None) -> ScalePrediction:
    """Step time, throughput, efficiency and memory of ``job`` running ``w`` on ``hw``."""
    if job.compression not in COMPRESSIONS:
        raise ValueError(f"compression {job.compression!r} unknown; choose one of {', '.join(COMPRESSIONS)}")
    for field, choices in (("optimizer", kernels.OPTIMIZER_BYTES_PER_PARAM), ("attention", kernels.ATTENTION_BACKENDS),
                           ("loss", memory.LOSS_BYTES_PER_LOGIT), ("ac", ("",) + memory.AC_POLICIES),
                           ("tensor_parallel", ("megatron", "dtensor")),
                           ("pipeline_buffers", memory.PIPELINE_BUFFERS)):
        if getattr(job, field) not in choices:
            raise ValueError(f"{field} {getattr(job, field)!r} unknown; choose one of {', '.join(choices)}")
    if job.tp > 1 and w.kind != "transformer" or job.pp > max(1, w.blocks):
        raise ValueError(f"{w.name}: tensor/pipeline parallel need transformer blocks (tp={job.tp}, pp={job.pp})")
    gpu = hw.gpu
    rate = gpu.rate(w.precision) * ((mfu / gpu.mfu) if mfu is not None else 1.0)
    per_replica = job.global_batch / job.dp
    shard = 1.0 / (job.tp * job.pp)
    m = max(1, per_replica / job.micro_batch) if job.pp > 1 else 1
    terms: dict = {}
    if gpu.kernels and w.kind == "transformer" and mfu is None:
        compute, terms = _kernel_compute(w, hw, job, per_replica, m)
    else:
        compute = w.train_flops_per_sample * per_replica * shard / rate
    bubble = (job.pp - 1) / (job.interleave * m) if job.pp > 1 else 0.0
    act = (job.micro_batch if job.pp > 1 else per_replica) * w.seq * w.hidden * 2  # a micro-batch's b s h, fp16
    gpn = hw.node.gpus
    per_gpu_net = cost.Link.from_bandwidth(hw.network.bandwidth / gpn, hw.network.latency_s)
    nvlink = cost.Link.from_bandwidth(hw.node.gpu_bandwidth, hw.node.latency_s)
    sends = sum(t.count for t in composition.PIPELINE_TRAFFIC)
    p2p = (m + job.pp - 1) * sends * per_gpu_net.time(act / job.tp) if job.pp > 1 else 0.0
    tp_link = nvlink if job.tp <= gpn else per_gpu_net
    # Megatron's f and g per block; recomputation runs the forward's allreduces again
    per_block = sum(t.count for t in composition.TENSOR_TRAFFIC) + (2 if w.recompute else 0)
    tp_time = m * (w.blocks / job.pp) * per_block * cost.ring_allreduce(act, job.tp, tp_link) if job.tp > 1 else 0.0
    data = _data_traffic(w, hw, job, compute, int(m)) if job.dp > 1 else {
        "dp_s": 0.0, "dp_exposed_s": 0.0, "buckets": 0, "forward_gather_s": 0.0, "after_step_s": 0.0}
    codec = 0.0
    if job.dp > 1 and job.compression == "int8":
        codec = INT8_CODEC_PASSES * w.params * shard * 4 / gpu.hbm_bandwidth
    elif job.dp > 1 and job.compression == "powersgd":
        codec = w.powersgd_flops(POWERSGD_RANK) * shard / gpu.rate("fp32")
    exposed = data["dp_exposed_s"]
    step = compute * (1 + bubble) + p2p + tp_time + exposed + codec
    mem = memory.per_gpu(w, job)
    eff = compute / step
    parts = {"compute_s": compute, "bubble_s": compute * bubble, "p2p_s": p2p, "tp_s": tp_time,
             "dp_s": data["dp_s"], "dp_exposed_s": exposed, "codec_s": codec, "compute_terms": terms}
    why = (f"compute {compute * 1e3:.1f} ms" + (f", bubble {bubble:.0%}" if bubble else "")
           + (f", tp allreduces {tp_time * 1e3:.1f} ms" if tp_time else "")
           + (f", p2p {p2p * 1e3:.1f} ms" if p2p else "")
           + (f"; {job.strategy} traffic {data['dp_s'] * 1e3:.1f} ms in {data['buckets']} bucket(s), "
              f"{exposed * 1e3:.1f} ms exposed" if job.dp > 1 else "")
           + (f" ({data['forward_gather_s'] * 1e3:.1f} of forward gathers)" if data["forward_gather_s"] else "")
           + (f" ({data['after_step_s'] * 1e3:.1f} after the step)" if data["after_step_s"] else "")
           + (f", codec {codec * 1e3:.1f} ms" if codec else "")
           + f"; {mem / 2**30:.1f} GiB/GPU")
    flops = w.train_flops_per_sample * per_replica * shard
    return ScalePrediction(job, step, job.global_batch / step, eff, flops / step, mem, parts, why)


def _kernel_compute(w: Workload, hw: Hardware, job: Job, per_replica: float, m: float) -> tuple[float, dict]:
    """A transformer's compute per GPU from the GPU's measured kernel table (planner.kernels): the blocks of
    one pipeline stage and, on the last stage, the output layer and the loss, for every micro-batch, then
    the optimizer step over the local parameters. Returns the seconds and the same, term by term."""
    k = kernels.get(hw.gpu.kernels)
    ac = job.ac or ("full" if w.recompute else "none")
    if job.pp == 1 and job.accumulate:
        m = per_replica / job.micro_batch
    tokens = (job.micro_batch if job.pp > 1 or job.accumulate else per_replica) * w.seq
    scale = {"gemm_scale": hw.gpu.gemm_scale, "hbm_scale": hw.gpu.hbm_bandwidth / kernels.MEASURED_HBM_BANDWIDTH}
    block = k.block_terms(w, tokens, job.tp, float8=job.float8, compiled=job.compiled, ac=ac,
                          sequence_parallel=job.sequence_parallel, attention=job.attention, **scale)
    head = k.head_time(w, tokens, job.tp, **scale)
    terms = {f"blocks_{name}": m * w.blocks / job.pp * t for name, t in block.items()}
    terms["head_linear_s"], terms["head_loss_s"] = m * head["gemm_s"], m * head["hbm_s"]
    local = w.params / (job.tp * job.pp) / (job.dp if job.zero else 1)
    terms["optimizer_s"] = k.optimizer_time(local, scale["hbm_scale"], job.optimizer)
    terms["fsdp2_copies_s"] = _fsdp2_copies(w, hw, job, m)
    return sum(terms.values()), terms


def _fsdp2_copies(w: Workload, hw: Hardware, job: Job, m: float) -> float:
    """HBM time of FSDP2's copies around its collectives (``Job.fsdp2``), on the compute stream's critical path: every
    gather's output copied into the parameters (read + write, bf16 or float8), every reduce-scatter's input cast from
    the bf16 gradients into fp32 (read 2, write 4), over the stage's whole (unsharded) parameters."""
    if not (job.fsdp2 and job.zero == 3 and job.dp > 1):
        return 0.0
    params = w.params / (job.tp * job.pp)
    gathers = 2 * (m if job.regather else 1)      # forward and backward (composition's ZeRO-3 traffic)
    gathered = 1 if job.float8 else w.grad_bytes_per_param
    nbytes = params * (gathers * 2 * gathered + m * (w.grad_bytes_per_param + FSDP2_REDUCE_BYTES))
    return nbytes / hw.gpu.hbm_bandwidth


def search(w: Workload, hw: Hardware, gpus: int, global_batch: float, *,
           compressions=COMPRESSIONS, algorithms=collectives.ALGORITHMS, micro_batches=(1, 2, 4),
           bucket_mb: float = 25.0, state_bits: int = 32) -> list[ScalePrediction]:
    """Every dp x tp x pp layout of ``gpus`` that phalanx builds and that fits the GPU's memory, fastest first.

    The data-parallel choices (strategy, compressor, algorithm) are
    :func:`phalanx.parallel.composition.data_axis_options`: what the strategies accept, under
    ``parallelize`` too. ``algorithms`` limits the allreduce algorithms searched ("ring" is a flat
    ring only, which NCCL's "flat" never does worse than, so it is left out unless asked for).
    """
    out = []
    # a cast to fp16 of gradients already in 16 bits sends the same bytes: not a layout of its own
    priced = {c: SUMMABLE[c] for c in compressions if not (c == "fp16" and w.grad_bytes_per_param <= 2)}
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.node.gpus and gpus % t == 0] if w.kind == "transformer" else [1]
    pps = [p for p in range(1, max(1, w.blocks) + 1) if gpus % p == 0 and max(1, w.blocks) % p == 0]
    for tp, pp in itertools.product(tps, pps):
        if gpus % (tp * pp):
            continue
        dp = gpus // (tp * pp)
        if global_batch % dp:
            continue
        options = composition.data_axis_options(priced, model_parallel=tp > 1 or pp > 1) if dp > 1 else []
        choices = [(o.axis.zero, o.compression, o.algorithm) for o in options
                   if o.algorithm in algorithms or o.axis.zero] or [(0, "none", "flat")]
        for (zero, comp, alg), mb in itertools.product(dict.fromkeys(choices), micro_batches if pp > 1 else (1,)):
            if pp > 1 and (global_batch / dp) % mb:
                continue
            job = Job(dp, global_batch, tp, pp, mb, 1, zero, comp, alg, bucket_mb, overlap=pp == 1,
                      state_bits=state_bits)
            p = predict(w, hw, job)
            if p.fits(hw):
                out.append(p)
    if not out:
        raise ValueError(f"no layout of {w.name} on {gpus} x {hw.gpu.name} fits {hw.gpu.hbm_bytes / 2**30:.0f} GiB "
                         "per GPU; add GPUs or lower the batch")
    return sorted(out, key=lambda p: (round(p.step_s, 4), p.memory_bytes))  # within 0.1 ms: less memory first


def _biggest_gap(a: ScalePrediction, b: ScalePrediction) -> str:
    """The terms that make ``a`` faster than ``b``, largest first."""
    terms = {"compute_s": "compute", "bubble_s": "pipeline bubble", "p2p_s": "pipeline sends",
             "tp_s": "tensor-parallel allreduces", "dp_exposed_s": "exposed gradient sync", "codec_s": "codec"}
    gaps = sorted(((b.parts[k] - a.parts[k], name) for k, name in terms.items()), reverse=True)
    said = ", ".join(f"{name} {d * 1e3:.0f} ms less" for d, name in gaps[:2] if d > 0.5e-3)
    return said or (f"the same predicted time and {a.memory_bytes / 2**30:.1f} instead of "
                    f"{b.memory_bytes / 2**30:.1f} GiB/GPU")


def explain(ranked: list[ScalePrediction], top: int = 5) -> list[str]:
    """Lines for ``phalanx plan --hardware``: the ranked layouts, then why the first wins."""
    lines = [f"{'#':>2} {'step ms':>10} {'samples/s':>11} {'eff':>5} {'GiB/GPU':>8}  layout"]
    for i, p in enumerate(ranked[:top], start=1):
        lines.append(f"{i:>2} {p.step_s * 1e3:10.1f} {p.samples_per_s:11.1f} {p.efficiency:5.0%} "
                     f"{p.memory_bytes / 2**30:8.1f}  {p.job}")
        lines.append(f"      {p.why}")
    best = ranked[0]
    lines.append(f"why #1 wins: {best.why}")
    lines.append(f"  build it: {best.job.command()}")
    if len(ranked) > 1:
        second = ranked[1]
        lines.append(f"  vs #2 ({second.job}): {(second.step_s - best.step_s) * 1e3:.1f} ms slower; "
                     f"#1 has {_biggest_gap(best, second)}")
    plain = [p for p in ranked if p.job.tp == 1 and p.job.pp == 1 and p.job.zero == 0 and p.job.compression == "none"]
    if plain and plain[0] is not best:
        lines.append(f"  vs plain data parallel ({plain[0].job}): {plain[0].step_s / best.step_s:.2f}x slower; "
                     f"#1 has {_biggest_gap(best, plain[0])}")
    elif not plain:
        lines.append("  plain data parallel (no ZeRO, no compression) does not fit in the GPU's memory")
    exact = [p for p in ranked if p.job.compression == "none"]
    if best.job.compression != "none":
        lines.append(f"  {best.job.compression} is lossy (error feedback keeps it converging; check accuracy)"
                     + (f"; the best exact layout ({exact[0].job}) is {exact[0].step_s / best.step_s:.2f}x slower"
                        if exact else ""))
    return lines


DEFAULT_BATCH_PER_GPU = {"cnn": 64, "transformer": 2}
"""samples per GPU when no batch is given: 64 images (the CNN benchmarks), 2 sequences (a GPT)"""


def plan(model: str, hardware_name: str, gpus: int, *, batch_per_gpu: float | None = None,
         global_batch: float | None = None, top: int = 5, state_bits: int = 32) -> list[str]:
    """``phalanx plan --gpus N --hardware H --model M``: the ranked layouts and why the first wins."""
    from phalanx.planner import hardware, workloads

    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    w, hw = workloads.get(model), hardware.get(hardware_name)
    if hw.network.bandwidth <= 0 or hw.gpu.hbm_bandwidth <= 0:
        raise ValueError(f"--hardware {hardware_name} has no network figures for a GPU plan; choose a GPU profile")
    if global_batch is None:
        global_batch = gpus * (batch_per_gpu or DEFAULT_BATCH_PER_GPU[w.kind])
    if state_bits not in (32, 8):
        raise ValueError(f"--state-bits must be 32 or 8, got {state_bits}")
    ranked = search(w, hw, gpus, global_batch, state_bits=state_bits)
    head = (f"{w.name}: {w.params / 1e9:.2f}B params, {w.train_flops_per_sample / 1e9:.1f} GFLOP/sample; "
            f"{gpus} x {hw.gpu.name} ({hw.node.gpus}/node, {hw.network.name}), global batch {global_batch:g}; "
            f"{len(ranked)} layouts fit")
    return [head] + explain(ranked, top)

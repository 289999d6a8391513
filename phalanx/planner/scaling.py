"""Cluster-scale step model: a workload (planner.workloads) on hardware (planner.hardware).

One training step of a ``dp x tp x pp`` job, per GPU, built from the alpha-beta
terms of :mod:`phalanx.planner.cost`::

    compute   = FLOPs/sample x samples per replica / (tp pp x peak x mfu)
    pipeline  = compute x (1 + (pp-1) / (v m))          1F1B bubble, m micro-batches, v interleaved chunks
              + (m + pp - 1) x 2 p2p sends of b s h      (split over the tp GPUs: scatter/gather)
    tensor    = m x blocks/pp x (4, or 6 with recomputation) ring allreduces of b s h over tp (NVLink)
    data      = gradient buckets (the model's own, packed by the engine's rule) ready as backward reaches
                them (by FLOPs), each a ring or hierarchical allreduce over dp; only what is left after
                backward is exposed when buckets overlap (Horovod, DDP, Goyal), all of it when they do not
                (Megatron: after the pipeline flush). ZeRO-3: x1.5. Compression shrinks the bytes and
                adds its codec (int8: 4 passes over HBM; PowerSGD: its matmuls).

The network is shared: every GPU of a node runs its data-parallel allreduce at the
same time, so a flat ring gets ``node bandwidth / (dp groups per node)`` and each
cross-node ring of a hierarchical allreduce ``node bandwidth / (GPUs per node / tp)``.

``efficiency`` is the compute alone over the step: weak scaling against one GPU (or
one node) doing the same per-GPU work with no communication; % of peak is
``efficiency x mfu``.

Example::

    from phalanx.planner import hardware, scaling, workloads
    p = scaling.predict(workloads.get("resnet101"), hardware.get("p100-roce25"),
                        scaling.Job(dp=512, global_batch=512 * 64, bucket_mb=64))
    p.efficiency, p.step_s, p.why
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from phalanx.comm.buckets import pack
from phalanx.planner import cost
from phalanx.planner.hardware import Hardware
from phalanx.planner.workloads import Workload

__all__ = ["Job", "ScalePrediction", "predict", "search", "explain", "allreduce_time", "COMPRESSIONS"]

COMPRESSIONS = ("none", "fp16", "int8", "powersgd")
INT8_RATIO = (1 + 4 / 256) / 4
"""int8 codes + one fp32 scale per 256 values, against fp32 (phalanx.comm.compression.quantize)"""
INT8_CODEC_PASSES = 4
"""HBM passes over the fp32 gradient: compress, re-compress the summed chunk, two decodes"""
POWERSGD_RANK = 4


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
    algorithm: str = "ring"
    """"ring" (one flat ring over all dp ranks, over every NIC of the node) or "hierarchical"
    (reduce-scatter in the node, ring across nodes, allgather in the node)"""
    bucket_mb: float = 25.0
    overlap: bool = True
    """data-parallel buckets launched during backward (False: after it, e.g. after a pipeline flush)"""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        s += f" zero={self.zero}" if self.zero else ""
        s += f" {self.compression}" if self.compression != "none" else ""
        s += f" {self.algorithm}" if self.dp > 1 else ""
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


def _placement(hw: Hardware, dp: int, tp: int) -> tuple[int, int, int]:
    """(dp ranks per node, nodes a dp group spans, dp groups sharing a node's network)."""
    gpn = hw.node.gpus
    per_node = max(1, min(dp, gpn // tp)) if tp <= gpn else 1
    nodes = math.ceil(dp / per_node)
    return per_node, nodes, max(1, gpn // per_node)


def allreduce_time(nbytes: float, hw: Hardware, dp: int, tp: int = 1, algorithm: str = "ring") -> float:
    """One data-parallel allreduce of ``nbytes`` per GPU, with every GPU of the node doing the same."""
    if dp <= 1:
        return 0.0
    per_node, nodes, groups = _placement(hw, dp, tp)
    nvlink = cost.Link.from_bandwidth(hw.node.gpu_bandwidth, hw.node.latency_s)
    if nodes == 1:
        return cost.ring_allreduce(nbytes, dp, nvlink)
    net = hw.network
    if algorithm == "ring":
        link = cost.Link.from_bandwidth(net.bandwidth / groups, net.latency_s)
        return cost.ring_allreduce(nbytes, dp, link)
    if algorithm != "hierarchical":
        raise ValueError(f"algorithm must be 'ring' or 'hierarchical', got {algorithm!r}")
    cross = cost.Link.from_bandwidth(net.bandwidth / (groups * per_node), net.latency_s)
    return cost.hierarchical_allreduce(nbytes, per_node, nodes, nvlink, cross, cost.HIERARCHICAL_CHUNK_BYTES)


def _buckets(w: Workload, shard: float, bucket_bytes: float, bytes_per_param: float) -> tuple[list, list]:
    """The engine's buckets of this model's gradients (backward order) and when each is ready."""
    order = w.backward_order()
    sizes = [p * shard * bytes_per_param for p, _ in order]
    groups = pack(sizes, bucket_bytes)
    return [sum(sizes[k] for k in g) for g in groups], [order[g[-1]][1] for g in groups]


def predict(w: Workload, hw: Hardware, job: Job, *, mfu: float | None = None) -> ScalePrediction:
    """Step time, throughput, efficiency and memory of ``job`` running ``w`` on ``hw``."""
    if job.compression not in COMPRESSIONS:
        raise ValueError(f"compression {job.compression!r} unknown; choose one of {', '.join(COMPRESSIONS)}")
    if job.tp > 1 and w.kind != "transformer" or job.pp > max(1, w.blocks):
        raise ValueError(f"{w.name}: tensor/pipeline parallel need transformer blocks (tp={job.tp}, pp={job.pp})")
    gpu = hw.gpu
    rate = gpu.rate(w.precision) * ((mfu / gpu.mfu) if mfu is not None else 1.0)
    per_replica = job.global_batch / job.dp
    shard = 1.0 / (job.tp * job.pp)
    compute = w.train_flops_per_sample * per_replica * shard / rate
    m = max(1, per_replica / job.micro_batch) if job.pp > 1 else 1
    bubble = (job.pp - 1) / (job.interleave * m) if job.pp > 1 else 0.0
    act = (job.micro_batch if job.pp > 1 else per_replica) * w.seq * w.hidden * 2  # a micro-batch's b s h, fp16
    gpn = hw.node.gpus
    per_gpu_net = cost.Link.from_bandwidth(hw.network.bandwidth / gpn, hw.network.latency_s)
    nvlink = cost.Link.from_bandwidth(hw.node.gpu_bandwidth, hw.node.latency_s)
    p2p = (m + job.pp - 1) * 2 * per_gpu_net.time(act / job.tp) if job.pp > 1 else 0.0
    tp_link = nvlink if job.tp <= gpn else per_gpu_net
    per_block = 6 if w.recompute else 4
    tp_time = m * (w.blocks / job.pp) * per_block * cost.ring_allreduce(act, job.tp, tp_link) if job.tp > 1 else 0.0
    # data parallel: buckets of this GPU's gradient shard
    bpp = w.grad_bytes_per_param
    ratio = {"none": 1.0, "fp16": min(1.0, 2 / bpp), "int8": INT8_RATIO * 4 / bpp,
             "powersgd": w.powersgd_ratio(POWERSGD_RANK)}[job.compression]
    sizes, ready = _buckets(w, shard, job.bucket_mb * 2**20, bpp)
    scale = ratio * (1.5 if job.zero == 3 else 1.0)
    times = [allreduce_time(b * scale, hw, job.dp, job.tp, job.algorithm) for b in sizes]
    codec = 0.0
    if job.dp > 1 and job.compression == "int8":
        codec = INT8_CODEC_PASSES * w.params * shard * 4 / gpu.hbm_bandwidth
    elif job.dp > 1 and job.compression == "powersgd":
        codec = w.powersgd_flops(POWERSGD_RANK) * shard / gpu.rate("fp32")
    backward = compute * (2 / 3) / (m if job.pp > 1 else 1)  # pipelines: only the last micro-batch's backward
    exposed = cost.overlapped_exposure(times, backward, 1.0 if job.overlap else 0.0, ready) if times else 0.0
    step = compute * (1 + bubble) + p2p + tp_time + exposed + codec
    memory = _memory(w, job, per_replica, m)
    eff = compute / step
    parts = {"compute_s": compute, "bubble_s": compute * bubble, "p2p_s": p2p, "tp_s": tp_time,
             "dp_s": sum(times), "dp_exposed_s": exposed, "codec_s": codec}
    why = (f"compute {compute * 1e3:.1f} ms" + (f", bubble {bubble:.0%}" if bubble else "")
           + (f", tp allreduces {tp_time * 1e3:.1f} ms" if tp_time else "")
           + (f", p2p {p2p * 1e3:.1f} ms" if p2p else "")
           + (f"; grad sync {sum(times) * 1e3:.1f} ms in {len(times)} bucket(s), {exposed * 1e3:.1f} ms exposed"
              if job.dp > 1 else "")
           + (f", codec {codec * 1e3:.1f} ms" if codec else "")
           + f"; {memory / 2**30:.1f} GiB/GPU")
    return ScalePrediction(job, step, job.global_batch / step, eff, compute * rate / step, memory, parts, why)


def _memory(w: Workload, job: Job, per_replica: float, m: float) -> float:
    """Weights + gradients + optimizer (fp32 SGD-momentum 12 B/param; mixed-precision Adam 16 B/param,
    ZeRO sharding the optimizer (1), gradients (2), weights (3) over dp) + activations."""
    n = w.params / (job.tp * job.pp)
    if w.precision == "fp32":
        wb, gb, ob = 4.0, 4.0, 4.0
    else:
        wb, gb, ob = 2.0, 2.0, 12.0
    if job.zero >= 1:
        ob /= job.dp
    if job.zero >= 2:
        gb /= job.dp
    if job.zero >= 3:
        wb /= job.dp
    states = n * (wb + gb + ob)
    micro = job.micro_batch if job.pp > 1 else per_replica
    in_flight = min(job.pp, m) if job.pp > 1 else 1
    acts = w.act_bytes_per_sample(4 if w.precision == "fp32" else 2) * micro * in_flight / job.pp
    if not w.recompute:
        acts /= job.tp
    return states + acts


def search(w: Workload, hw: Hardware, gpus: int, global_batch: float, *, zero_stages=(0, 1, 3),
           compressions=("none", "int8", "powersgd"), algorithms=("ring", "hierarchical"),
           micro_batches=(1, 2, 4), bucket_mb: float = 25.0) -> list[ScalePrediction]:
    """Every dp x tp x pp layout of ``gpus`` that fits the GPU's memory, fastest first."""
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.node.gpus and gpus % t == 0] if w.kind == "transformer" else [1]
    pps = [p for p in range(1, max(1, w.blocks) + 1) if gpus % p == 0 and max(1, w.blocks) % p == 0]
    for tp, pp in itertools.product(tps, pps):
        if gpus % (tp * pp):
            continue
        dp = gpus // (tp * pp)
        if global_batch % dp:
            continue
        grid = itertools.product(zero_stages if dp > 1 else (0,), compressions if dp > 1 else ("none",),
                                 algorithms if dp > 1 else ("ring",), micro_batches if pp > 1 else (1,))
        for zero, comp, alg, mb in grid:
            if pp > 1 and (global_batch / dp) % mb:
                continue
            job = Job(dp, global_batch, tp, pp, mb, 1, zero, comp, alg, bucket_mb, overlap=pp == 1)
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
         global_batch: float | None = None, top: int = 5) -> list[str]:
    """``phalanx plan --gpus N --hardware H --model M``: the ranked layouts and why the first wins."""
    from phalanx.planner import hardware, workloads

    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    w, hw = workloads.get(model), hardware.get(hardware_name)
    if hw.network.bandwidth <= 0 or hw.gpu.hbm_bandwidth <= 0:
        raise ValueError(f"--hardware {hardware_name} has no network figures for a GPU plan; choose a GPU profile")
    if global_batch is None:
        global_batch = gpus * (batch_per_gpu or DEFAULT_BATCH_PER_GPU[w.kind])
    ranked = search(w, hw, gpus, global_batch)
    head = (f"{w.name}: {w.params / 1e9:.2f}B params, {w.train_flops_per_sample / 1e9:.1f} GFLOP/sample; "
            f"{gpus} x {hw.gpu.name} ({hw.node.gpus}/node, {hw.network.name}), global batch {global_batch:g}; "
            f"{len(ranked)} layouts fit")
    return [head] + explain(ranked, top)

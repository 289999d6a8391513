"""Plan search: enumerate layouts, keep those that fit in memory, rank by predicted step time.

A layout is ``dp x pp x tp x ep = world`` plus a ZeRO stage, a gradient compression
and a bucket size (``ep`` > 1 only for a mixture-of-experts model: ``ModelSpec.num_experts``),
among those phalanx builds (:mod:`phalanx.parallel.composition`: ZeRO takes only summable
compressors, ``parallelize`` none). For each, the cost model (:mod:`phalanx.planner.cost`) predicts::

    step = pipeline(compute / (dp ep tp), pp stages, m micro-batches)  # bubble (p-1)/(m+p-1)
         + tensor-parallel allreduces (4 per layer)                      # on the intra link if tp fits a host
         + expert-parallel all-to-alls (4 per MoE layer)                 # on the intra link if ep·tp fits a host
         + the dp strategy's traffic left exposed: buckets under backward   # DataParallel: allreduce;
           (allreduce, or ZeRO's reduce-scatter + ZeRO-3's backward gather), # only cluster.overlap of it
           ZeRO-3's forward gathers beyond forward's compute, ZeRO's        # can hide
           parameter gather after the step
         + codec time of the compression
         + waiting: what a collective right after compute costs beyond itself (measured)

and the memory per rank of parameters, gradients and Adam state (ZeRO shards
them over dp). Under expert parallel the ep ranks hold different tokens: the dense
weights sync over dp·ep ranks (ZeRO shards them there), the experts (cut ep ways)
over dp. Each prediction carries a one-line *why*.

Example::

    from phalanx.planner import cost, plan
    cluster = cost.Cluster(hosts=2, ranks_per_host=4, intra=cost.Link.from_bandwidth(10e9, 5e-6),
                           inter=cost.Link.from_bandwidth(125e6, 5e-5), memory_bytes=16e9)
    model = plan.ModelSpec(params=350e6, layers=24, compute_s=0.8, act_bytes_per_layer=8e6)
    for p in plan.search(model, cluster)[:3]:
        print(p.step_s, p.layout, p.why)
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from phalanx.parallel import composition
from phalanx.planner import cost

__all__ = ["ModelSpec", "Layout", "Prediction", "predict", "search", "COMPRESSIONS"]

SUMMABLE = {"none": True, "fp16": True, "bf16": True}
"""whether each compressor's payloads add up on the wire (ZeRO takes only those)"""

COMPRESSIONS: dict[str, tuple[float, float]] = {
    # name: (bytes ratio, codec seconds per input byte — a CPU figure; calibrate for yours)
    "none": (1.0, 0.0),
    "fp16": (0.5, 0.25e-9),
    "bf16": (0.5, 0.25e-9),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model and one step of it."""

    params: float
    """number of trainable parameters"""
    layers: int = 1
    """layers (blocks) to cut into pipeline stages / tensor-parallel shards"""
    compute_s: float = 0.0
    """forward + backward + optimizer time of one global batch on one rank (measure it)"""
    act_bytes_per_layer: float = 0.0
    """activation bytes per layer for the global batch (tensor- and pipeline-parallel traffic)"""
    bytes_per_param: int = 4
    optim_bytes_per_param: int = 8
    """Adam in fp32: two moments"""
    backward_fraction: float = 2 / 3
    """share of compute_s spent in backward, the window gradient sync can hide in"""
    wait_s: float = 0.0
    """per step, what a collective right after compute costs beyond its own time: waiting for
    the slowest rank, cold communication threads (measure: calibrate.measure_overlap's wait_s)"""
    tensor_bytes: tuple[float, ...] = ()
    """optional: each gradient's bytes in the order backward produces them (reversed
    ``model.parameters()`` for a sequential model); then the buckets are the engine's
    (``cost.bucket_sizes``), each ready when its bytes are done (``cost.ready_fractions``),
    instead of ``ceil(bytes / bucket)`` equal buckets ready at even steps of backward"""

    num_experts: int = 0
    """experts per MoE layer (0: a dense model; ep must divide it)"""
    expert_params: float = 0.0
    """how many of ``params`` sit in experts (cut over ep; the rest is dense)"""
    moe_layers: int = 0
    """MoE layers (each: 4 all-to-alls of its tokens per step under ep > 1)"""
    top_k: int = 2
    """experts per token"""
    capacity_factor: float = 1.0
    """rows an expert takes, as a multiple of an even share (an all-to-all carries up to that)"""

    def __post_init__(self) -> None:
        if any(b <= 0 for b in self.tensor_bytes):
            raise ValueError(f"ModelSpec.tensor_bytes must all be positive byte counts, got {self.tensor_bytes}")
        if not 0 <= self.expert_params <= self.params:
            raise ValueError(f"ModelSpec.expert_params={self.expert_params} must be between 0 and params={self.params}")
        if self.num_experts and not (self.moe_layers and self.expert_params):
            raise ValueError("ModelSpec: a model with num_experts > 0 needs moe_layers and expert_params")


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    pp: int = 1
    tp: int = 1
    zero: int = 0
    compression: str = "none"
    bucket_mb: float = 25.0
    micro_batches: int = 1
    ep: int = 1

    def __str__(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        s = f"dp={self.dp} pp={self.pp} tp={self.tp}{ep} zero={self.zero} compression={self.compression} bucket={self.bucket_mb:g}MB"
        return s + (f" micro={self.micro_batches}" if self.pp > 1 else "")


@dataclasses.dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_s: float
    memory_bytes: float
    parts: dict
    why: str


def _dp_cluster(cluster: cost.Cluster, dp: int, inner: int) -> cost.Cluster:
    """The cluster the dp group sees: ranks of one dp group on a host share it; the rest cross hosts."""
    per_host = max(1, min(dp, cluster.ranks_per_host // max(inner, 1)))
    return dataclasses.replace(cluster, hosts=max(1, math.ceil(dp / per_host)), ranks_per_host=per_host)


def _data_traffic(layout: Layout, sizes: list[float], dpc: cost.Cluster, ratio: float,
                  codec: float) -> tuple[list[float], list[float], float]:
    """The dp strategy's traffic as it declares it (phalanx.parallel.composition): per bucket the time
    under backward, the forward gathers (ZeRO-3), and what runs after the step (ZeRO's parameter gather)."""
    axis = composition.by_name(f"zero{layout.zero}" if layout.zero else "allreduce")
    link = dpc.inter if dpc.hosts > 1 else dpc.intra
    backward, forward, after = [0.0] * len(sizes), [], 0.0
    for t in axis.traffic:
        if t.op == "allreduce":
            each = [cost.compressed_allreduce(b, dpc, ratio if t.compressed else 1.0, codec) for b in sizes]
        else:  # ZeRO's reduce-scatter / all-gather: a flat ring on the slowest link
            each = [cost.reducescatter(b * (ratio if t.compressed else 1.0), dpc.size, link)
                    + (b * codec if t.compressed else 0.0) for b in sizes]
        if t.hides_behind == "backward":
            backward = [a + b for a, b in zip(backward, each)]
        elif t.hides_behind == "forward":
            forward = each[::-1]  # forward meets the buckets in the opposite order
        else:
            after += sum(each)
    return backward, forward, after


def predict(model: ModelSpec, cluster: cost.Cluster, layout: Layout,
            codecs: dict[str, tuple[float, float]] | None = None) -> Prediction:
    """Predicted step time, memory and the why for one layout (``codecs`` overrides COMPRESSIONS)."""
    codecs = {**COMPRESSIONS, **(codecs or {})}
    if layout.compression not in codecs:
        raise ValueError(f"compression {layout.compression!r} unknown; choose one of {sorted(codecs)}")
    ep = layout.ep
    if layout.dp * layout.pp * layout.tp * ep != cluster.size:
        raise ValueError(f"dp*pp*tp*ep = {layout.dp}*{layout.pp}*{layout.tp}*{ep} != world size {cluster.size}")
    if ep > 1 and (not model.num_experts or model.num_experts % ep):
        raise ValueError(f"ep={ep} needs a model whose num_experts ({model.num_experts}) it divides")
    if ep > 1 and layout.zero == 3:
        raise ValueError("zero=3 with ep > 1: phalanx's expert parallel shards the dense weights with ZeRO-1 or 2 only")
    batch = layout.dp * ep  # ranks with their own slice of the batch
    shard_compute = model.compute_s / (batch * layout.tp)
    compute = cost.pipeline_step(shard_compute, layout.pp, layout.micro_batches,
                                 model.act_bytes_per_layer / batch, cluster.inter if layout.pp > 1 else None)
    tp_link = cluster.intra if layout.tp <= cluster.ranks_per_host else cluster.inter
    tp_time = cost.tp_comm(model.act_bytes_per_layer / batch, math.ceil(model.layers / layout.pp),
                           layout.tp, tp_link)
    ep_link = cluster.intra if ep * layout.tp <= cluster.ranks_per_host else cluster.inter
    ep_time = cost.ep_comm(model.act_bytes_per_layer / batch, math.ceil(model.moe_layers / layout.pp), ep, ep_link,
                           model.top_k, model.capacity_factor) if ep > 1 else 0.0
    dense_params = model.params - (model.expert_params if ep > 1 else 0.0)
    grad_bytes = dense_params * model.bytes_per_param / (layout.pp * layout.tp)
    ratio, codec = codecs[layout.compression]
    dpc = _dp_cluster(cluster, batch, layout.pp * layout.tp)
    if model.tensor_bytes:
        shard = grad_bytes / sum(model.tensor_bytes)  # tensors split evenly over pp x tp (and dtype)
        sizes = cost.bucket_sizes([b * shard for b in model.tensor_bytes], layout.bucket_mb * 2**20)
        ready = cost.ready_fractions(sizes)
    else:
        n = max(1, math.ceil(grad_bytes / (layout.bucket_mb * 2**20)))
        sizes, ready = [grad_bytes / n] * n, None
    bucket_times, fwd_gathers, after_step = _data_traffic(layout, sizes, dpc, ratio, codec)
    memory = cost.zero_memory(dense_params / (layout.pp * layout.tp), layout.zero, batch,
                              model.bytes_per_param, model.optim_bytes_per_param)
    if ep > 1:  # the experts: cut ep ways, synced over dp; counted as one more bucket, ready last (conservative)
        experts = model.expert_params / (layout.pp * layout.tp * ep)
        expert_sync = cost.compressed_allreduce(experts * model.bytes_per_param,
                                                _dp_cluster(cluster, layout.dp, layout.pp * layout.tp * ep), ratio, codec)
        if layout.dp > 1:
            bucket_times, ready = bucket_times + [expert_sync], (list(ready) + [1.0]) if ready is not None else None
        memory += cost.zero_memory(experts, 0, layout.dp, model.bytes_per_param, model.optim_bytes_per_param)
    n_buckets = len(bucket_times)
    comm_total = sum(bucket_times) + sum(fwd_gathers) + after_step
    exposed = cost.overlapped_exposure(bucket_times, compute * model.backward_fraction, cluster.overlap, ready)
    if fwd_gathers:  # ZeRO-3's forward gathers, prefetched one ahead: what forward's compute does not cover
        forward, e = compute * (1 - model.backward_fraction), cluster.overlap
        exposed += (1 - e) * sum(fwd_gathers) + e * max(fwd_gathers[0], sum(fwd_gathers) - forward)
    exposed += after_step
    wait = model.wait_s if batch > 1 else 0.0
    step = compute + tp_time + ep_time + exposed + wait
    bubble = cost.pipeline_bubble(layout.pp, layout.micro_batches)
    why = (f"compute {compute * 1e3:.1f} ms" + (f" (bubble {bubble:.0%})" if layout.pp > 1 else "")
           + (f"; grad sync {comm_total * 1e3:.1f} ms in {n_buckets} bucket(s) over "
              f"{'inter' if dpc.hosts > 1 else 'intra'}-host links, {exposed * 1e3:.1f} ms exposed"
              + (f" (overlap {cluster.overlap:.2f})" if cluster.overlap < 1 else "")
              if batch > 1 else "; no gradient sync (dp = 1)")
           + (f"; waiting {wait * 1e3:.1f} ms" if wait else "")
           + (f"; tp allreduces {tp_time * 1e3:.1f} ms" if layout.tp > 1 else "")
           + (f"; ep all-to-alls {ep_time * 1e3:.1f} ms" if ep > 1 else "")
           + f"; {memory / 2**30:.2f} GiB/rank")
    parts = {"compute_s": compute, "tp_s": tp_time, "ep_s": ep_time, "grad_sync_s": comm_total, "exposed_s": exposed,
             "wait_s": wait, "bubble": bubble}
    return Prediction(layout, step, memory, parts, why)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelSpec, cluster: cost.Cluster, *, zero_stages=(0, 1, 2, 3),
           compressions=("none", "fp16"), bucket_mbs=(1, 4, 25, 100), micro_batches=(4, 8),
           max_pp: int | None = None, max_tp: int | None = None) -> list[Prediction]:
    """Every layout that fits ``cluster.memory_bytes``, fastest first (ties: less memory first)."""
    out: list[Prediction] = []
    world = cluster.size
    eps = [e for e in _divisors(world) if model.num_experts % e == 0] if model.num_experts else [1]
    for tp, pp, ep in itertools.product(_divisors(world), _divisors(world), eps):
        if world % (tp * pp * ep) or pp > model.layers or (max_pp and pp > max_pp) or (max_tp and tp > max_tp):
            continue
        if (tp > 1 or ep > 1) and not model.act_bytes_per_layer:
            continue  # tensor and expert parallel cost their activation traffic: unknown without act_bytes_per_layer
        dp = world // (tp * pp * ep)
        # what phalanx builds on the dp axis (phalanx.parallel.composition): under parallelize (tp or pp > 1)
        # gradients go uncompressed; with dp * ep = 1 there is no gradient sync, so ZeRO and buckets change nothing
        options = composition.data_axis_options({c: SUMMABLE.get(c, False) for c in compressions},
                                                model_parallel=tp > 1 or pp > 1)
        runnable = dict.fromkeys((o.axis.zero, o.compression) for o in options if o.axis.zero in zero_stages)
        grid = ([(z, c, b) for (z, c), b in itertools.product(runnable, bucket_mbs)] if dp * ep > 1
                else [(0, "none", bucket_mbs[-1])])
        for zero, comp, bucket in grid:
            if ep > 1 and zero == 3:
                continue
            for m in (micro_batches if pp > 1 else (1,)):
                p = predict(model, cluster, Layout(dp, pp, tp, zero, comp, bucket, m, ep))
                if p.memory_bytes <= cluster.memory_bytes:
                    out.append(p)
    if not out:
        raise ValueError(f"no layout fits {cluster.memory_bytes / 2**30:.1f} GiB per rank; "
                         "add ranks, allow ZeRO-3 or a larger memory budget (--memory-gb)")
    return sorted(out, key=lambda p: (round(p.step_s, 9), p.memory_bytes))

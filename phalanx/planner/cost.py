"""Alpha-beta cost model: what a step's communication costs before you buy the machines.

A message of ``n`` bytes over a link costs ``alpha + n * beta`` (Hockney's model;
alpha = latency in seconds, beta = seconds per byte = 1 / bandwidth). Formulas,
for ``N`` ranks and a gradient of ``M`` bytes:

    ring allreduce (Patarasuk & Yuan 2009)    2(N-1) alpha + 2(N-1)/N * M beta
        N-1 reduce-scatter steps then N-1 allgather steps, each moving M/N:
        r0 ─M/N→ r1 ─M/N→ r2 ─M/N→ r3 ─M/N→ r0   (x 2(N-1))
    reduce-scatter / allgather                (N-1) alpha + (N-1)/N * M beta
    hierarchical (local L ranks, H hosts)     reduce-scatter on the intra link,
        ring allreduce of M/L across hosts on the inter link, allgather intra;
        pipelined over chunks: first chunk's three steps + (K-1) x the slowest step
    compressed                                allreduce of M * ratio + codec time
    the seeds' rule of thumb                  M / bandwidth + latency * messages

Overlap. Buckets launched during backward hide behind it only if communication
can progress while compute runs. Where it needs the same CPU cores (gloo over
loopback, or more busy threads than cores), it cannot: a fraction ``1 - e`` of
it is serialised with compute. ``e`` (``Cluster.overlap``) is measured, not
assumed: time compute alone (C), the allreduces alone (A) and the allreduces
launched asynchronously under the same compute (T); then
``e = (C + A - T) / (A - tail)`` (``fit_overlap``; ``tail`` is what perfect overlap
leaves after compute, ``max(0, A - C)`` when all is launched up front; 1 = hidden
as far as it can be, 0 = they add up, below 0 = together they cost more than one
after the other: threads thrash on too few cores). The exposed communication is then::

    exposed = (1 - e) * sum(bucket times) + e * (the tail left after backward, buckets fully async)

Data parallel's buckets are not equal: ``bucket_sizes`` packs the gradients as the
engine does, and ``ready_fractions`` makes each ready when its share of the bytes is
done (``plan.ModelSpec.tensor_bytes``; ``calibrate.measure_buckets`` measures it all
on the job's own buckets).

ZeRO (Rajbhandari et al. 2020): stages 1 and 2 move what an allreduce moves
(reduce-scatter of gradients + allgather of parameters); stage 3 gathers the
parameters again for backward: 1.5x. Pipeline (GPipe, Huang et al. 2019): with
``p`` stages and ``m`` micro-batches the bubble is ``(p-1)/(m+p-1)`` of the step.
Megatron tensor parallel (Shoeybi et al. 2019): per transformer layer, two
allreduces of the activations forward and two backward. Amdahl: speedup
``1 / ((1-P) + P/N)``.

Example::

    from phalanx.planner import cost
    eth = cost.Link.from_bandwidth(1250e6, latency_s=1e-4)     # 10 Gbit/s, 0.1 ms
    cost.seed_estimate(100e6, eth, messages=6)                 # 0.0806 s (the seeds' example)
    cost.ring_allreduce(100e6, 4, eth)                         # 0.1206 s (the exact ring)
    cost.amdahl(0.6, 10)                                       # 2.17
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from phalanx.comm.buckets import pack

__all__ = [
    "Link", "Cluster", "seed_estimate", "ring_allreduce", "reducescatter", "allgather",
    "hierarchical_allreduce", "allreduce", "compressed_allreduce", "bucket_sizes", "ready_fractions", "overlapped_exposure",
    "zero_comm", "zero_memory", "pipeline_bubble", "pipeline_step", "tp_comm", "alltoall", "ep_comm",
    "amdahl", "fit_amdahl", "fit_link", "fit_overlap",
]


@dataclasses.dataclass(frozen=True)
class Link:
    """One link type: ``alpha_s`` latency per message, ``beta_s`` seconds per byte."""

    alpha_s: float
    beta_s: float

    @classmethod
    def from_bandwidth(cls, bytes_per_s: float, latency_s: float) -> Link:
        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive bytes/s, got {bytes_per_s}")
        return cls(alpha_s=latency_s, beta_s=1.0 / bytes_per_s)

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta_s == 0 else 1.0 / self.beta_s

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha_s + nbytes * self.beta_s


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Hosts x ranks per host, an intra-host and an inter-host link, memory per rank, and
    ``overlap``: the share of communication that can run concurrently with compute
    (1 = a network engine of its own; 0 = it competes with compute for the same cores;
    negative = the contention costs extra; measure it with ``phalanx.planner.calibrate.measure_overlap``)."""

    hosts: int
    ranks_per_host: int
    intra: Link
    inter: Link
    memory_bytes: float = math.inf
    overlap: float = 1.0

    def __post_init__(self) -> None:
        if not -1.0 <= self.overlap <= 1.0:
            raise ValueError(f"Cluster.overlap must be in [-1, 1] (see cost.fit_overlap), got {self.overlap}")

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host


def seed_estimate(nbytes: float, link: Link, messages: int) -> float:
    """The seeds' rule of thumb: ``bytes / bandwidth + latency * messages``."""
    return link.time(nbytes, messages)


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring allreduce of ``nbytes`` over ``n`` ranks: ``2(n-1) alpha + 2(n-1)/n nbytes beta``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes * link.beta_s


def reducescatter(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter (also allgather) of a ``nbytes`` buffer over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * link.beta_s


allgather = reducescatter


HIERARCHICAL_CHUNK_BYTES = 2 << 20
"""The pipeline chunk of phalanx's hierarchical allreduce (``comm.algorithms.PIPELINE_CHUNK_BYTES``)."""


def hierarchical_allreduce(nbytes: float, local: int, hosts: int, intra: Link, inter: Link,
                           chunk_bytes: float | None = None) -> float:
    """Reduce-scatter inside each host, ring allreduce of a shard across hosts, allgather inside.

    ``chunk_bytes=None``: the three steps one after the other. With ``chunk_bytes`` the
    steps are pipelined over ``K = ceil(nbytes / chunk_bytes)`` chunks, as
    phalanx.comm.algorithms runs them: the first chunk goes through all three steps,
    and each further chunk adds the slowest step::

        t = rs(c) + x(c) + ag(c) + (K-1) * max(rs(c), x(c), ag(c)),   c = nbytes / K
    """
    chunks = 1 if not chunk_bytes or nbytes <= 0 else max(1, math.ceil(nbytes / chunk_bytes))
    c = nbytes / chunks
    rs = ag = reducescatter(c, local, intra)
    cross = ring_allreduce(c / max(local, 1), hosts, inter)
    return rs + cross + ag + (chunks - 1) * max(rs, cross, ag)


def allreduce(nbytes: float, cluster: Cluster, hierarchical: bool = False) -> float:
    """Allreduce over the whole cluster: a flat ring runs at the slowest link's pace."""
    if cluster.hosts == 1:
        return ring_allreduce(nbytes, cluster.ranks_per_host, cluster.intra)
    if hierarchical:
        return hierarchical_allreduce(nbytes, cluster.ranks_per_host, cluster.hosts, cluster.intra, cluster.inter,
                                      HIERARCHICAL_CHUNK_BYTES)
    return ring_allreduce(nbytes, cluster.size, cluster.inter)


def compressed_allreduce(nbytes: float, cluster: Cluster, ratio: float, codec_s_per_byte: float = 0.0,
                         hierarchical: bool = False) -> float:
    """Allreduce of ``nbytes * ratio`` plus encode/decode time (``codec_s_per_byte`` of input)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio}")
    return allreduce(nbytes * ratio, cluster, hierarchical) + nbytes * codec_s_per_byte


def bucket_sizes(tensor_bytes: Sequence[float], bucket_bytes: float) -> list[float]:
    """The buckets data parallel sends, from the gradients' sizes in the order they arrive.

    The engine's rule (:func:`phalanx.comm.buckets.pack`, as ``BucketManager`` packs): fill a
    bucket in arrival order and start a new one when the next gradient would take it past
    ``bucket_bytes`` (a gradient larger than that gets a bucket of its own). With 4 MiB
    buckets, gradients of 40 KB, 4 MiB and 1 MB make three buckets, not ``ceil(total / 4 MiB) = 2``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return [float(sum(tensor_bytes[k] for k in group)) for group in pack(tensor_bytes, bucket_bytes)]


def _tail(bucket_comm_s: Sequence[float], backward_s: float, ready: Sequence[float] | None) -> float:
    n = len(bucket_comm_s)
    if not n:
        return 0.0
    if ready is None:
        ready = [k / n for k in range(1, n + 1)]
    elif len(ready) != n:
        raise ValueError(f"ready needs one fraction per bucket: {len(ready)} for {n} buckets")
    free = 0.0
    for r, c in zip(ready, bucket_comm_s):
        free = max(free, backward_s * r) + c
    return max(0.0, free - backward_s)


def overlapped_exposure(bucket_comm_s: Sequence[float], backward_s: float, overlap: float = 1.0,
                        ready: Sequence[float] | None = None) -> float:
    """Communication left after backward when bucket ``k`` is ready at ``backward * ready[k]``.

    ``ready`` defaults to ``k/B`` for bucket ``k`` of B (equal buckets, backward spread
    evenly); :func:`ready_fractions` gives it for unequal buckets. Buckets go one at a
    time, as one process group's collectives do::

        backward ▕███████████████████████▏
        buckets        ▕b0▏  ▕b1▏   ▕b2─────▏   <- exposed = end of last bucket - end of backward

    ``overlap`` (e, see :func:`fit_overlap`): only that share hides; the rest adds to the
    step, ``(1 - e) * sum(bucket_comm_s) + e * tail`` (e < 0: contention adds more).
    """
    if not -1.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [-1, 1], got {overlap}")
    tail = _tail(bucket_comm_s, backward_s, ready)
    return (1.0 - overlap) * float(sum(bucket_comm_s)) + overlap * tail


def ready_fractions(bucket_bytes: Sequence[float]) -> list[float]:
    """When each bucket is complete, as a fraction of backward: its share of the bytes so far
    (backward's work on a dense layer grows with its parameters)."""
    total = float(sum(bucket_bytes))
    if total <= 0:
        return [1.0] * len(bucket_bytes)
    done, out = 0.0, []
    for b in bucket_bytes:
        done += b
        out.append(done / total)
    return out


def fit_overlap(compute_s: float, comm_s: float, both_s: float, tail_s: float | None = None) -> float:
    """The share ``e`` of communication that hides behind compute, from three timings.

    ``compute_s`` alone, ``comm_s`` (the allreduces) alone, and ``both_s``: the allreduces
    launched asynchronously, the same compute, then the waits. The model says
    ``both = C + A - e * (A - tail)``, where ``tail`` is what would be left after compute
    with perfect overlap; so ``e = (C + A - T) / (A - tail)``, clipped to [-1, 1]
    (negative: running both at once cost more than one after the other).

    ``tail_s=None``: everything launched before compute starts, so ``tail = max(0, A - C)``
    and ``e = (C + A - T) / min(C, A)``. Buckets launched as backward makes them ready
    leave a longer tail: pass ``overlapped_exposure(buckets, C, 1.0, ready)`` (what
    :func:`phalanx.planner.plan.predict` will use), and the model reproduces ``T``.
    """
    if min(compute_s, comm_s) <= 0:
        raise ValueError(f"fit_overlap needs positive compute and communication times, got "
                         f"{compute_s} and {comm_s}")
    tail = max(0.0, comm_s - compute_s) if tail_s is None else tail_s
    hideable = comm_s - tail
    if hideable <= 0:
        return 1.0  # nothing could hide: any e predicts the same
    return min(1.0, max(-1.0, (compute_s + comm_s - both_s) / hideable))


def zero_comm(param_bytes: float, stage: int, cluster: Cluster) -> float:
    """Per-step communication of ZeRO ``stage`` (0 = plain data parallel) on ``cluster``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    base = allreduce(param_bytes, cluster)
    return base * (1.5 if stage == 3 else 1.0)


def zero_memory(params: float, stage: int, dp: int, bytes_per_param: int = 4, optim_bytes_per_param: int = 8) -> float:
    """Bytes per rank of parameters + gradients + optimizer state (Adam: 8 B/param in fp32)."""
    p, g, o = params * bytes_per_param, params * bytes_per_param, params * optim_bytes_per_param
    if stage >= 1:
        o /= dp
    if stage >= 2:
        g /= dp
    if stage >= 3:
        p /= dp
    return p + g + o


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe / 1F1B step: ``(p-1) / (m+p-1)``."""
    if stages < 1 or micro_batches < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_step(compute_s: float, stages: int, micro_batches: int, act_bytes: float = 0.0,
                  link: Link | None = None) -> float:
    """Step time of ``compute_s`` of work split over ``stages``: ``(m+p-1)`` slots of ``compute/(p m)``,
    plus one activation send forward and one gradient send back per slot between stages."""
    slot = compute_s / (stages * micro_batches)
    send = 2 * link.time(act_bytes / micro_batches) if (link and stages > 1) else 0.0
    return (micro_batches + stages - 1) * (slot + send)


def tp_comm(act_bytes_per_layer: float, layers: int, tp: int, link: Link) -> float:
    """Megatron: 2 allreduces of the activations per layer forward, 2 backward."""
    return 4 * layers * ring_allreduce(act_bytes_per_layer, tp, link)


def alltoall(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of a rank's ``nbytes`` buffer over ``n`` ranks, pairwise: ``(n-1) alpha + (n-1)/n nbytes beta``
    (it keeps 1/n of its rows and sends each other rank 1/n)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * link.beta_s


def ep_comm(token_bytes: float, moe_layers: int, ep: int, link: Link, top_k: int = 2,
            capacity_factor: float = 1.0) -> float:
    """Expert parallel (GShard, Switch): 4 all-to-alls per MoE layer — dispatch and combine, forward
    and backward — each of a rank's ``token_bytes`` of activations times the rows a token becomes
    (``top_k``, padded up to ``capacity_factor``; dropping keeps it at most that). Not overlapped:
    the experts wait for their rows and the next layer for the outputs."""
    rows = top_k * max(1.0, capacity_factor)
    return 4 * moe_layers * alltoall(token_bytes * rows, ep, link)


def amdahl(p: float, n: float) -> float:
    """Amdahl's speedup on ``n`` workers when a fraction ``p`` of the work parallelises."""
    if not 0 <= p <= 1:
        raise ValueError(f"parallel fraction p must be in [0, 1], got {p}")
    return 1.0 / ((1 - p) + p / n)


def fit_amdahl(workers: Sequence[float], speedups: Sequence[float]) -> float:
    """Least-squares P from measured speedups: ``1/S - 1 = P (1/N - 1)``, clipped to [0, 1]."""
    xs = [1 / n - 1 for n in workers]
    ys = [1 / s - 1 for s in speedups]
    den = sum(x * x for x in xs)
    if den == 0:
        raise ValueError("fit_amdahl needs at least one measurement with more than one worker")
    return min(1.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / den))


def fit_link(samples: Sequence[tuple[float, float]], n: int, relative: bool = True) -> Link:
    """Calibrate alpha and beta from measured ring allreduces ``[(nbytes, seconds), ...]`` on ``n`` ranks.

    Least squares on ``t = a * 2(n-1) + b * 2(n-1)/n * nbytes``. ``relative=True`` (for
    isolated messages of assorted sizes) in *relative* error, each row divided by its
    ``t``: a plain fit lets the largest message's noise set the intercept (alpha swung
    0.1-1.6 ms on loopback that way); relative weights let the small messages fix alpha
    and the large ones beta. ``relative=False`` (for one layout's buckets timed back to
    back): plain least squares, whose residuals sum to zero, so the fitted link gives
    the buckets' total time as measured. Both clipped at zero.
    """
    if n < 2 or len(samples) < 2:
        raise ValueError("fit_link needs n >= 2 ranks and at least two message sizes")
    if any(t <= 0 for _, t in samples):
        raise ValueError(f"fit_link needs positive times, got {[t for _, t in samples]}")
    w = [1.0 / t if relative else 1.0 for _, t in samples]
    rows = [(2 * (n - 1) * k, 2 * (n - 1) / n * m * k, t * k) for (m, t), k in zip(samples, w)]
    s11 = sum(a * a for a, _, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    y1 = sum(a * t for a, _, t in rows)
    y2 = sum(b * t for _, b, t in rows)
    det = s11 * s22 - s12 * s12
    if det <= 1e-12 * s11 * s22:
        raise ValueError("fit_link needs at least two different message sizes")
    alpha = (y1 * s22 - y2 * s12) / det
    beta = (s11 * y2 - s12 * y1) / det
    if alpha < 0:  # latency below noise: refit bandwidth alone
        alpha, beta = 0.0, y2 / s22
    elif beta < 0:  # larger messages no slower (noise): a latency per message alone
        alpha, beta = y1 / s11, 0.0
    return Link(alpha_s=alpha, beta_s=beta)

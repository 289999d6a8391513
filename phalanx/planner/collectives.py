"""Collectives at cluster scale, priced the way NCCL runs them.

NCCL (``src/graph/tuning.cc``, ``ncclTopoTuneModel``) predicts each algorithm's time
as ``latency + bytes / algorithm bandwidth`` and runs the fastest. With ``N`` ranks on
``n`` nodes (``L = N/n`` per node), ``B`` the bus bandwidth, ``a`` the per-step latency
inside a node and ``A`` across nodes::

    ring allreduce    (2(N-1) - 2(n-1)) a + 2(n-1) A       + 2(N-1)/N * S / B
                      (only the steps that leave a node pay the network's latency)
    tree allreduce    2 ((L-1) a + log2(n) A)               + 2 S / (0.92 B)
                      (a chain inside each node, NCCL's double binary tree across
                      nodes; the tree's bus bandwidth is the ring's x 0.92)
    reduce-scatter,   (N-1 - (n-1)) a + (n-1) A             + (N-1)/N * S / B
    all-gather        (ring: NCCL runs no tree for them)

``B`` is what a rank's share of the links carries: inside one node the GPU's NVLink
bandwidth; across nodes the node's NICs shared by the groups that cross it (NCCL
runs one ring per NIC, so a group that holds every GPU of a node gets all its NICs),
never more than NVLink. NCCL 2.4 (2019) added the trees; runs published before it
(Horovod 2017, Goyal et al. 2017) ran rings only (``algorithm="ring"``).

phalanx's own ``algorithm="hierarchical"`` (``phalanx.comm.algorithms``) is
reduce-scatter inside the node, the backend's allreduce of one shard across nodes
(one rank per node: ring or tree, whichever is faster), allgather inside, pipelined
over 2 MiB chunks.

Not modelled: NVLink SHARP (NVLS) and SHARP in the switches (in-network reduction),
the protocols (LL / LL128 / Simple) and channel counts behind ``B``, and the
achieved fraction of line rate.

Example::

    from phalanx.planner import collectives, hardware
    hw = hardware.get("h100-ib400")
    collectives.allreduce_time(50e6, hw, 1024)          # NCCL's choice: the tree at this size and scale
    collectives.allreduce_time(50e6, hw, 1024, algorithm="ring")
"""

from __future__ import annotations

import dataclasses
import math

from phalanx.planner import cost
from phalanx.planner.hardware import Hardware

__all__ = ["Placement", "place", "ring_allreduce", "tree_allreduce", "nccl_allreduce", "ring_gather",
           "allreduce_time", "gather_time", "ALGORITHMS", "TREE_BANDWIDTH", "GLOO_ONLY"]

TREE_BANDWIDTH = 0.92
"""NCCL's tree allreduce bus bandwidth against the ring's (tuning.cc: ``busBw * .92``)"""

ALGORITHMS = ("flat", "ring", "hierarchical")
"""``flat``: the backend's own allreduce (NCCL picks ring or tree by size); ``ring``: a flat ring only
(NCCL before 2.4, or NCCL_ALGO=Ring); ``hierarchical``: phalanx's (phalanx.comm.algorithms)"""


@dataclasses.dataclass(frozen=True)
class Placement:
    """A data-parallel group on the machine: its ranks, the nodes they span, and their links."""

    ranks: int
    nodes: int
    bus_bw: float
    """bytes/s per rank: NVLink inside one node, the shared NICs across nodes"""
    intra_s: float
    inter_s: float
    per_node: int
    node_bw: float
    """bytes/s of NVLink per GPU (hierarchical's in-node steps)"""
    cross_bw: float
    """bytes/s a cross-node ring of one rank per node gets (hierarchical's middle step)"""


def place(hw: Hardware, dp: int, tp: int = 1) -> Placement:
    """Where the ``dp`` ranks of one group sit when every GPU of a node runs the same collective:
    tp ranks share a node first, so ``gpus/tp`` dp ranks per node and ``tp`` groups per node."""
    gpn = hw.node.gpus
    per_node = max(1, min(dp, gpn // tp)) if tp <= gpn else 1
    nodes = math.ceil(dp / per_node)
    groups = max(1, gpn // per_node)  # dp groups sharing a node's NICs
    nvlink = hw.node.gpu_bandwidth
    if nodes == 1:
        return Placement(dp, 1, nvlink, hw.node.latency_s, hw.node.latency_s, per_node, nvlink, nvlink)
    net = hw.network.bandwidth / groups
    return Placement(dp, nodes, min(nvlink, net), hw.node.latency_s, hw.network.latency_s, per_node, nvlink,
                     net / per_node)


def ring_allreduce(nbytes: float, p: Placement) -> float:
    n = p.ranks
    if n <= 1:
        return 0.0
    inter = 2 * (p.nodes - 1)
    return (2 * (n - 1) - inter) * p.intra_s + inter * p.inter_s + 2 * (n - 1) / n * nbytes / p.bus_bw


def tree_allreduce(nbytes: float, p: Placement) -> float:
    """NCCL's tree (across nodes only; inside one node NCCL runs the ring)."""
    if p.ranks <= 1:
        return 0.0
    if p.nodes == 1:
        return math.inf
    latency = 2 * ((p.ranks // p.nodes - 1) * p.intra_s + math.log2(p.nodes) * p.inter_s)
    return latency + 2 * nbytes / (TREE_BANDWIDTH * p.bus_bw)


def nccl_allreduce(nbytes: float, p: Placement) -> tuple[float, str]:
    """NCCL's choice: the faster of ring and tree, and which one it is."""
    ring, tree = ring_allreduce(nbytes, p), tree_allreduce(nbytes, p)
    return (tree, "tree") if tree < ring else (ring, "ring")


def ring_gather(nbytes: float, p: Placement) -> float:
    """Reduce-scatter or all-gather of a ``nbytes`` buffer (each rank ends with / starts from 1/N)."""
    n = p.ranks
    if n <= 1:
        return 0.0
    inter = p.nodes - 1
    return (n - 1 - inter) * p.intra_s + inter * p.inter_s + (n - 1) / n * nbytes / p.bus_bw


def _hierarchical(nbytes: float, p: Placement, tree: bool = True) -> float:
    chunks = max(1, math.ceil(nbytes / cost.HIERARCHICAL_CHUNK_BYTES)) if nbytes > 0 else 1
    c = nbytes / chunks
    nvlink = cost.Link.from_bandwidth(p.node_bw, p.intra_s)
    rs = ag = cost.reducescatter(c, p.per_node, nvlink)
    cross_group = Placement(p.nodes, p.nodes, p.cross_bw, p.inter_s, p.inter_s, 1, p.cross_bw, p.cross_bw)
    cross = nccl_allreduce(c / p.per_node, cross_group)[0] if tree else ring_allreduce(c / p.per_node, cross_group)
    return rs + cross + ag + (chunks - 1) * max(rs, cross, ag)


GLOO_ONLY = ("loopback", "netns")
"""networks the simulated cluster runs gloo on: its allreduce is a ring (no tree)"""


def allreduce_time(nbytes: float, hw: Hardware, dp: int, tp: int = 1, algorithm: str = "flat",
                   trees: bool = True) -> float:
    """One data-parallel allreduce of ``nbytes`` per GPU, with every GPU of the node doing the same.
    ``trees=False``: a backend without NCCL's trees (NCCL before 2.4, gloo) runs rings only."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if dp <= 1:
        return 0.0
    p = place(hw, dp, tp)
    trees = trees and hw.network.kind not in GLOO_ONLY
    if p.nodes == 1 or algorithm == "ring":
        return ring_allreduce(nbytes, p)
    if algorithm == "hierarchical":
        return _hierarchical(nbytes, p, tree=trees)
    return nccl_allreduce(nbytes, p)[0] if trees else ring_allreduce(nbytes, p)


def gather_time(nbytes: float, hw: Hardware, dp: int, tp: int = 1) -> float:
    """One reduce-scatter (or all-gather) of a ``nbytes`` buffer over the dp group (ZeRO's)."""
    return ring_gather(nbytes, place(hw, dp, tp)) if dp > 1 else 0.0

"""Hardware profiles for the planner: GPUs, nodes, networks, and named clusters.

A :class:`Hardware` is what a cost prediction needs to know about a machine room::

    Hardware = GPU   (peak FLOP/s per precision, HBM bytes and bandwidth, achieved fraction "mfu")
             + Node  (GPUs per node, GPU-to-GPU bandwidth inside the node: NVLink / NVSwitch / PCIe)
             + Network (per-node injection bandwidth, per-message latency; Ethernet / RoCE / InfiniBand)

Every figure below carries its source in a comment: the vendor datasheet (or paper)
it comes from. Bandwidths are bytes per second *per direction*; a datasheet's
"bidirectional" figure is halved. Latencies are per message step of a collective
(wire + switch + the communication library's software step), the alpha of
:class:`phalanx.planner.cost.Link`; they are order-of-magnitude figures and the
predictions in docs/scaling.md are bandwidth-bound, so they move little with them.

``GPU.mfu`` is the one achieved-FLOPs fraction per GPU generation the cost model
uses: compute time = FLOPs / (peak of the precision x mfu). Each has its source
(a published end-to-end training throughput on one GPU or one node, no network).

The CPU of this machine is measured, not looked up: :func:`measure_cpu` times a
float32 matmul (peak), a copy (memory bandwidth) and, under ``phalanx run`` with
2+ ranks, the loopback allreduce (``calibrate.measure_link``). ``CPU2`` holds what
it measured on the project's CI machine (cpu2).

Example::

    from phalanx.planner import hardware
    hw = hardware.get("h100-ib400")        # DGX H100 nodes, 8 x 400 Gbit/s NDR InfiniBand each
    hw.gpu.peak["bf16"], hw.node.gpus, hw.network.bandwidth
    hardware.names()                       # every named profile
"""

from __future__ import annotations

import dataclasses
import time

__all__ = ["GPU", "Node", "Network", "Hardware", "GPUS", "NETWORKS", "HARDWARE", "CPU2", "get", "names",
           "measure_cpu", "simulated", "TCP_PAYLOAD_PER_TBF_BYTE"]

GB = 1e9
T = 1e12
GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator: peak dense FLOP/s per precision, memory, and the achieved fraction."""

    name: str
    peak: dict
    """precision ("fp32", "tf32", "fp16", "bf16") -> dense FLOP/s (no sparsity)"""
    hbm_bytes: float
    hbm_bandwidth: float
    """bytes/s"""
    mfu: float
    """achieved fraction of peak in end-to-end training (one constant per generation; see its source)"""
    mfu_source: str = ""
    kernels: str = ""
    """a measured kernel table (planner.kernels) that prices a transformer's compute kernel by kernel instead
    of ``mfu``; "" for none"""
    gemm_scale: float = 1.0
    """this part's tensor-core rate against the part the kernel table was measured on"""

    def rate(self, precision: str) -> float:
        """Achieved FLOP/s at ``precision``: peak x mfu."""
        if precision not in self.peak:
            raise ValueError(f"{self.name} has no {precision!r} peak; choose one of {sorted(self.peak)}")
        return self.peak[precision] * self.mfu


@dataclasses.dataclass(frozen=True)
class Node:
    """GPUs per node and the bandwidth between two GPUs of one node (per GPU, per direction)."""

    name: str
    gpus: int
    gpu_bandwidth: float
    """bytes/s a GPU can send to its peers inside the node (NVLink total / 2, or PCIe per direction)"""
    latency_s: float = 5e-6


@dataclasses.dataclass(frozen=True)
class Network:
    """The node-to-node network: injection bandwidth per node (all its NICs), latency per step."""

    name: str
    bandwidth: float
    """bytes/s per node per direction (sum over the node's NICs)"""
    latency_s: float
    kind: str = "ethernet"
    """ethernet (TCP), roce, infiniband, or loopback / netns for the simulated machines"""


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    gpu: GPU
    node: Node
    network: Network
    description: str = ""


# --- GPUs -----------------------------------------------------------------------------------------
# mfu sources:
#  P100: Horovod docs/benchmarks.rst, tf_cnn_benchmarks ResNet-101, batch 64/GPU, 16 Pascal GPUs:
#        "total images/sec: 1656.82" = 103.6 img/s/GPU x 46.8 GFLOP/img (3 x 2 x 7.80 GMAC, the
#        architecture's count in planner.workloads) = 4.85 TFLOP/s of the P100 PCIe's 9.3: 0.52 (P100_MFU).
#  V100: Shoeybi et al. 2019 (Megatron-LM): 1.2B GPT-2 on one V100 of a DGX-2H sustains 39 TFLOP/s,
#        "30% of the theoretical peak".
#  A100: MosaicML llm-foundry scripts/train/benchmarking/README.md, MPT-13B, seq 2048, 8 x A100-80GB,
#        bf16, no activation checkpointing: MFU 59.57% (one node: no network in it).
#  H100: same table, MPT-13B, seq 2048, 8 x H100-80GB, bf16, no activation checkpointing: MFU 39.79%.
HOROVOD_RESNET101_IMG_S = 1656.82 / 16
"""images/s per GPU in Horovod's docs/benchmarks.rst example (ResNet-101, batch 64, 16 Pascal GPUs)"""

GPUS: dict[str, GPU] = {
    # NVIDIA Tesla P100 PCIe datasheet: 9.3 TFLOP/s fp32, 18.7 fp16, 16 GB HBM2 at 732 GB/s
    "p100-pcie": GPU("P100-PCIe-16GB", {"fp32": 9.3 * T, "fp16": 18.7 * T}, 16 * GB, 732 * GB,
                     mfu=0.0, mfu_source="Horovod docs/benchmarks.rst ResNet-101 example (see P100_MFU)"),
    # NVIDIA Tesla P100 SXM2 (NVLink) datasheet: 10.6 TFLOP/s fp32, 21.2 fp16, 16 GB HBM2 at 732 GB/s
    "p100-sxm2": GPU("P100-SXM2-16GB", {"fp32": 10.6 * T, "fp16": 21.2 * T}, 16 * GB, 732 * GB,
                     mfu=0.0, mfu_source="as p100-pcie (one constant per generation)"),
    # NVIDIA Tesla V100 SXM2 datasheet: 15.7 TFLOP/s fp32, 125 tensor (fp16), 32 GB HBM2 at 900 GB/s
    "v100-sxm2": GPU("V100-SXM2-32GB", {"fp32": 15.7 * T, "fp16": 125 * T}, 32 * GB, 900 * GB,
                     mfu=0.30, mfu_source="Shoeybi et al. 2019: 39 TFLOP/s on one V100 = 30% of peak"),
    # NVIDIA DGX-2H datasheet: 2.1 PFLOPS tensor for 16 V100 SXM3 32 GB (450 W) = 131 TFLOP/s each;
    # Megatron-LM (2019) calls 39 TFLOP/s 30% of this GPU's peak (39 / 0.30 = 130); fp32: the SXM2's 15.7
    # scaled by 131/125 (no datasheet fp32 figure for the 450 W part; no row here uses it)
    "v100-sxm3h": GPU("V100-SXM3-32GB-H", {"fp32": 16.4 * T, "fp16": 131 * T}, 32 * GB, 900 * GB,
                      mfu=0.30, mfu_source="Shoeybi et al. 2019: 39 TFLOP/s on one V100 = 30% of peak"),
    # NVIDIA A100 datasheet (SXM4 80GB): 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 dense; HBM2e 2039 GB/s
    "a100-sxm4": GPU("A100-SXM4-80GB", {"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T},
                     80 * GB, 2039 * GB, mfu=0.5957,
                     mfu_source="llm-foundry benchmarking README: MPT-13B seq 2048 on 8 x A100-80GB, MFU 59.57%"),
    # NVIDIA H100 datasheet (SXM5 80GB): 67 TFLOP/s fp32, 494.5 tf32, 989.5 bf16/fp16 dense; HBM3 3.35 TB/s
    "h100-sxm5": GPU("H100-SXM5-80GB", {"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T},
                     80 * GB, 3350 * GB, mfu=0.3979,
                     mfu_source="llm-foundry benchmarking README: MPT-13B seq 2048 on 8 x H100-80GB, MFU 39.79%",
                     kernels="h100"),
    # Meta's Grand Teton H100 (torchtitan benchmarks/llama3_h100_202412_torchtitan.md): "96GB HBM2e with 2.4
    # TB/sec", 500 W; its peak "between SXM and NVL" and not known, so the SXM5 figures, as torchtitan's MFU uses.
    # gemm_scale: the middle of that interval against the SXM5's 989.5: NVIDIA H100 NVL datasheet, 1,671 TFLOP/s
    # bf16 with sparsity = 835.5 dense; (835.5 + 989.5) / 2 / 989.5 = 0.922 (the ends, 0.844 and 1, in docs/scaling.md)
    "h100-hbm2e": GPU("H100-96GB-HBM2e (Grand Teton)", {"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T,
                                                       "bf16": 989.5 * T}, 96 * GB, 2400 * GB, mfu=0.3979,
                      mfu_source="the H100 constant (llm-foundry MPT-13B, 8 x H100-80GB: 39.79%)",
                      kernels="h100", gemm_scale=(835.5 + 989.5) / 2 / 989.5),
    # NVIDIA H200 datasheet (SXM): the H100's tensor cores (989.5 TFLOP/s bf16 dense), 141 GB HBM3e at 4.8 TB/s
    "h200-sxm": GPU("H200-SXM-141GB", {"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T},
                    141 * GB, 4800 * GB, mfu=0.3979,
                    mfu_source="the H100 constant: same tensor cores (no H200 end-to-end figure found)",
                    kernels="h100"),
    # NVIDIA HGX B200 (1000 W), as tabulated at glennklockwood.com/garden/processors/B200: bf16 2250 TFLOP/s dense,
    # fp32 80; DGX B200 datasheet: 1,440 GB HBM3e for 8 GPUs (180 GB each), 64 TB/s (8 TB/s each)
    "b200": GPU("B200-180GB", {"fp32": 80 * T, "tf32": 1100 * T, "fp16": 2250 * T, "bf16": 2250 * T}, 180 * GB,
                8000 * GB, mfu=0.3979,
                mfu_source="no published Blackwell end-to-end MFU found: the H100 constant, unverified"),
}

# --- nodes ----------------------------------------------------------------------------------------
NODES: dict[str, Node] = {
    # 4 P100 PCIe behind PCIe Gen3 x16: 15.75 GB/s per direction (PCI-SIG Gen3 x16 raw), no NVLink
    "pcie3x4": Node("4 GPUs on PCIe Gen3", 4, 15.75 * GB, 10e-6),
    # Facebook Big Basin (Goyal et al. 2017: 8 P100 with NVLink): P100 SXM2 datasheet, 4 NVLink x 40 GB/s
    # bidirectional = 80 GB/s per direction per GPU (hybrid cube mesh: not all pairs direct; a ring uses 2 links)
    "bigbasin": Node("Big Basin, 8 x P100 NVLink", 8, 40 * GB, 5e-6),
    # NVIDIA DGX-2H: 16 V100 on NVSwitch, 300 GB/s bidirectional per GPU = 150 GB/s per direction
    "dgx2h": Node("DGX-2H, 16 x V100 NVSwitch", 16, 150 * GB, 5e-6),
    # NVIDIA DGX-1V: 8 V100 SXM2, NVLink 2.0 hybrid cube mesh, 300 GB/s bidirectional per GPU
    "dgx1v": Node("DGX-1V, 8 x V100 NVLink", 8, 150 * GB, 5e-6),
    # NVIDIA DGX A100 datasheet: 8 A100, NVSwitch, 600 GB/s bidirectional per GPU
    "dgxa100": Node("DGX A100, 8 x A100 NVSwitch", 8, 300 * GB, 5e-6),
    # NVIDIA DGX H100 datasheet: 8 H100, NVLink 4 / NVSwitch, 900 GB/s bidirectional per GPU
    "dgxh100": Node("DGX H100, 8 x H100 NVLink4", 8, 450 * GB, 5e-6),
    # NVIDIA H200 datasheet (HGX H200): NVLink 900 GB/s bidirectional per GPU, 8 per board
    "hgxh200": Node("HGX H200, 8 x H200 NVLink4", 8, 450 * GB, 5e-6),
    # NVIDIA DGX B200 datasheet: 8 B200, NVLink 5, 1.8 TB/s bidirectional per GPU (14.4 TB/s in all)
    "dgxb200": Node("DGX B200, 8 x B200 NVLink5", 8, 900 * GB, 5e-6),
}

# --- networks -------------------------------------------------------------------------------------
# latency: a collective step over IB with NCCL ~ a few us (IB switch + HCA sub-us per the Mellanox
# datasheets, the rest is software); RoCE somewhat more; TCP/IP Ethernet tens of us (kernel stack).
NETWORKS: dict[str, Network] = {
    "eth10": Network("10 Gbit/s Ethernet (TCP)", 10 * GBIT, 50e-6, "ethernet"),
    "eth25": Network("25 Gbit/s Ethernet (TCP)", 25 * GBIT, 50e-6, "ethernet"),
    "roce25": Network("25 Gbit/s RoCE", 25 * GBIT, 10e-6, "roce"),  # Horovod's 512-GPU benchmark
    "eth50": Network("50 Gbit/s Ethernet", 50 * GBIT, 20e-6, "ethernet"),  # Goyal et al. 2017 (ConnectX-4)
    "roce100": Network("100 Gbit/s RoCE", 100 * GBIT, 10e-6, "roce"),
    "ib-edr": Network("1 x 100 Gbit/s EDR InfiniBand", 100 * GBIT, 5e-6, "infiniband"),
    # Megatron-LM 2019: DGX-2H nodes with 8 InfiniBand adapters, "100 GB/s of interconnect bandwidth
    # between servers" (8 x 100 Gbit/s EDR, Mellanox ConnectX-5)
    "ib-edr8": Network("8 x 100 Gbit/s EDR InfiniBand", 8 * 100 * GBIT, 5e-6, "infiniband"),
    # DGX A100 datasheet: 8 x 200 Gbit/s HDR InfiniBand (ConnectX-6) for compute
    "ib-hdr8": Network("8 x 200 Gbit/s HDR InfiniBand", 8 * 200 * GBIT, 5e-6, "infiniband"),
    # DGX H100 datasheet: 8 x 400 Gbit/s NDR InfiniBand (ConnectX-7) for compute
    "ib-ndr8": Network("8 x 400 Gbit/s NDR InfiniBand", 8 * 400 * GBIT, 5e-6, "infiniband"),
    # NVIDIA ConnectX-8 SuperNIC: 800 Gbit/s XDR InfiniBand, one per GPU (GB300 / B300 systems)
    "ib-xdr8": Network("8 x 800 Gbit/s XDR InfiniBand", 8 * 800 * GBIT, 5e-6, "infiniband"),
    # 400 Gbit/s RoCE per GPU (ConnectX-7 on Ethernet, e.g. Spectrum-X); RoCE's latency as above
    "roce400x8": Network("8 x 400 Gbit/s RoCE", 8 * 400 * GBIT, 10e-6, "roce"),
}


def _with_mfu(gpu: GPU, mfu: float) -> GPU:
    return dataclasses.replace(gpu, mfu=mfu)


def _p100_mfu() -> float:
    """P100's achieved fraction, from Horovod's own ResNet-101 example on 16 Pascal GPUs (P100 PCIe,
    fp32): images/s per GPU x the architecture's training FLOPs per image / fp32 peak."""
    from phalanx.planner import workloads  # same layer; imported late (workloads builds the models)

    flops = workloads.get("resnet101").train_flops_per_sample
    return HOROVOD_RESNET101_IMG_S * flops / GPUS["p100-pcie"].peak["fp32"]


P100_MFU = None  # filled in by _finish() below (needs the ResNet-101 count)


# --- named clusters -------------------------------------------------------------------------------
def _hardware() -> dict[str, Hardware]:
    p100 = _with_mfu(GPUS["p100-pcie"], P100_MFU)
    p100n = _with_mfu(GPUS["p100-sxm2"], P100_MFU)
    return {
        "p100-roce25": Hardware("p100-roce25", p100, NODES["pcie3x4"], NETWORKS["roce25"],
                                "Horovod's benchmark: 4 Pascal (P100 PCIe) per server, 25 Gbit/s RoCE"),
        "p100-eth50": Hardware("p100-eth50", p100n, NODES["bigbasin"], NETWORKS["eth50"],
                               "Goyal et al. 2017: Big Basin, 8 P100 NVLink per server, 50 Gbit/s Ethernet"),
        "v100-dgx2h": Hardware("v100-dgx2h", GPUS["v100-sxm3h"], NODES["dgx2h"], NETWORKS["ib-edr8"],
                               "Megatron-LM 2019: DGX-2H, 16 V100 on NVSwitch, 8 x EDR InfiniBand"),
        "v100-ib100": Hardware("v100-ib100", GPUS["v100-sxm2"], NODES["dgx1v"], NETWORKS["ib-edr"],
                               "8 V100 NVLink per server, 100 Gbit/s InfiniBand (Li et al. 2020, as read)"),
        "a100-hdr": Hardware("a100-hdr", GPUS["a100-sxm4"], NODES["dgxa100"], NETWORKS["ib-hdr8"],
                             "Narayanan et al. 2021 (Selene): DGX A100, 8 x 200 Gbit/s HDR InfiniBand"),
        "h100-ib400": Hardware("h100-ib400", GPUS["h100-sxm5"], NODES["dgxh100"], NETWORKS["ib-ndr8"],
                               "DGX H100: 8 H100 on NVLink4, 8 x 400 Gbit/s NDR InfiniBand (one per GPU)"),
        "h100-eth25": Hardware("h100-eth25", GPUS["h100-sxm5"], NODES["dgxh100"], NETWORKS["eth25"],
                               "8 H100 on NVLink4 per node, one 25 Gbit/s Ethernet NIC per node"),
        "h100-gt": Hardware("h100-gt", GPUS["h100-hbm2e"], NODES["dgxh100"], NETWORKS["ib-ndr8"],
                            "torchtitan's benchmark machine (Grand Teton): 8 H100 96GB on NVLink, 400 Gbit/s RDMA "
                            "per GPU"),
        "h100-roce400": Hardware("h100-roce400", GPUS["h100-sxm5"], NODES["dgxh100"], NETWORKS["roce400x8"],
                                 "8 H100 on NVLink4 per node, 8 x 400 Gbit/s RoCE"),
        "h200-ib400": Hardware("h200-ib400", GPUS["h200-sxm"], NODES["hgxh200"], NETWORKS["ib-ndr8"],
                               "HGX H200: 8 H200 on NVLink4, 8 x 400 Gbit/s NDR InfiniBand"),
        "b200-ib400": Hardware("b200-ib400", GPUS["b200"], NODES["dgxb200"], NETWORKS["ib-ndr8"],
                               "DGX B200: 8 B200 on NVLink5, 8 x 400 Gbit/s (ConnectX-7)"),
        "b200-xdr": Hardware("b200-xdr", GPUS["b200"], NODES["dgxb200"], NETWORKS["ib-xdr8"],
                             "8 B200 on NVLink5, 8 x 800 Gbit/s XDR InfiniBand (ConnectX-8)"),
        "cpu2": CPU2,
    }


# this machine (cpu2: 2 cores, torch 2.13 CPU), measured by measure_cpu() on 2026-11-25 at load ~5:
# float32 matmul 1024^2 on 2 threads 18.7 GFLOP/s (7.4 per rank with 2 ranks of 1 thread), copy 3.3 GB/s
# (read + write), loopback gloo allreduce between 2 ranks (calibrate.measure_link): alpha 225 us, 0.90 GB/s
CPU2 = Hardware(
    "cpu2",
    GPU("cpu2 (2 cores, float32)", {"fp32": 18.7e9}, 24 * 2**30, 3.3 * GB, mfu=1.0,
        mfu_source="measured matmul rate is the achieved rate (mfu 1 by construction)"),
    Node("cpu2: 2 ranks over loopback (gloo)", 2, 0.90 * GB, 225e-6),
    Network("loopback (gloo TCP)", 0.90 * GB, 225e-6, "loopback"),
    "this machine, measured by hardware.measure_cpu()")


TCP_PAYLOAD_PER_TBF_BYTE = (1500 - 20 - 20 - 12) / (1500 + 14)
"""Payload a TCP stream moves per byte ``tc tbf`` counts on a simulated host's link: 0.956.

A 1500-byte MTU frame carries 1448 bytes of payload under IPv4 (20), TCP (20) and its
timestamps option (12; RFC 791, RFC 9293, RFC 7323; Linux sends timestamps by default), and
tbf counts the 14-byte Ethernet header too (the packet's length on the veth; a GSO packet
is counted as its segments): 95.6 Mbit/s of payload at 100 Mbit/s. The link fitted to
isolated 2-host allreduces at 100 Mbit/s (``benchmarks/scaling_cluster.py``) gave 94.3-96.2
Mbit/s in five runs on cpu2 (load 10-20)."""


def simulated(rate_bits: float, ranks_per_host: int = 1) -> Hardware:
    """The simulated cluster of ``phalanx cluster up`` on cpu2: each netns host's link capped by
    ``tc tbf`` at ``rate_bits`` bit/s per direction, of which TCP moves
    :data:`TCP_PAYLOAD_PER_TBF_BYTE`; ranks of one host talk over loopback."""
    return Hardware(f"cpu2-netns-{rate_bits / 1e6:g}mbit", CPU2.gpu,
                    dataclasses.replace(CPU2.node, gpus=ranks_per_host),
                    Network(f"netns bridge, tc tbf {rate_bits / 1e6:g} Mbit/s", rate_bits / 8 * TCP_PAYLOAD_PER_TBF_BYTE,
                            CPU2.network.latency_s, "netns"),
                    "simulated hosts on cpu2 (phalanx.testing.cluster)")


HARDWARE: dict[str, Hardware] = {}


def _finish() -> None:
    global P100_MFU
    P100_MFU = _p100_mfu()
    HARDWARE.update(_hardware())


def names() -> list[str]:
    """Every named hardware profile."""
    if not HARDWARE:
        _finish()
    return sorted(HARDWARE)


def get(name: str) -> Hardware:
    """A named profile (``phalanx plan --hardware NAME``); a clear error names the choices."""
    if not HARDWARE:
        _finish()
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]


def measure_cpu(seconds: float = 0.5, size: int = 1024, group=None) -> dict:
    """Measure this machine: float32 matmul FLOP/s (all threads), copy bandwidth, and when
    torch.distributed is up with 2+ ranks the loopback allreduce link (calibrate.measure_link).

    Returns ``{"fp32_flops", "mem_bandwidth", "cores", "link_alpha_s", "link_bandwidth"}``.
    """
    import os

    import torch
    import torch.distributed as dist

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    flops = n * 2 * size**3 / (time.perf_counter() - t0)
    x = torch.empty(2**24)
    y = torch.empty_like(x)
    y.copy_(x)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        y.copy_(x)
        n += 1
    bw = n * 2 * x.numel() * 4 / (time.perf_counter() - t0)  # read + write
    out = {"fp32_flops": flops, "mem_bandwidth": bw, "cores": os.cpu_count(), "link_alpha_s": None,
           "link_bandwidth": None}
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        from phalanx.planner import calibrate

        link, _ = calibrate.measure_link(group=group)
        out["link_alpha_s"], out["link_bandwidth"] = link.alpha_s, link.bandwidth
    return out

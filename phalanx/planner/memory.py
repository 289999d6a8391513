"""Memory per GPU of a layout: model states as the strategy shards them, activations from the
architecture, and the allocator's overhead, so that "fits" means it fits.

::

    states       params + grads + optimizer, each divided by dp where the data-parallel strategy
                 shards it (phalanx.parallel.composition: ZeRO-1 the optimizer, 2 + grads, 3 + params)
                 and by tp x pp; mixed precision with Adam: 2 + 2 + 12 bytes a parameter (fp32 master
                 and two moments), fp32 with momentum: 4 + 4 + 4; with 8-bit state (``state_bits=8``,
                 Dettmers et al. 2021, arXiv:2110.02861) each 4-byte moment is 1 byte + a 4-byte absmax
                 per block of 2048, and the step's fp32 scratch is one slice of 2^20 elements (~26 MiB)
    gathered     ZeRO-3: the module being run and the one prefetched, whole, in the compute dtype
    residuals    lossy compression (int8, PowerSGD): error feedback keeps one gradient-sized buffer
    activations  a transformer block keeps s b h (10 + 24/t) bytes in 16 bits (Korthikanti et al. 2022,
                 arXiv:2205.05198, Eq. 2, without the 5 a s / h of attention scores: flash attention
                 keeps none), 34 s b h without tensor parallel; with full recomputation only its input,
                 2 s b h, plus one block's full set while it is recomputed; fp32 logits s V 4 / t; a CNN
                 keeps each layer's output and its pre-activation (2 x output elements)
                 x micro-batch x micro-batches in flight (1F1B: up to pp on the first stage) / pp
    overhead     x FRAGMENTATION: what the CUDA caching allocator reserves over the peak it hands out

Example::

    from phalanx.planner import hardware, memory, scaling, workloads
    memory.per_gpu(workloads.get("gpt-13b"), scaling.Job(dp=8, global_batch=16, zero=3))
"""

from __future__ import annotations

from phalanx.optim.adam8bit import SLICE
from phalanx.optim.quantize import BLOCK
from phalanx.parallel import composition
from phalanx.planner.workloads import Workload

__all__ = ["FRAGMENTATION", "per_gpu", "activations", "LOSSY"]

FRAGMENTATION = 1.21
"""``max_memory_reserved / max_memory_allocated`` of a training step on an H100, the largest of phalanx's
DataParallel (1.03) and ZeRO-1/2/3 (1.20, 1.21, 1.20) in benchmarks/results/gpu-h100-run1.jsonl (the
``zero_memory`` step: 12 x Linear(4096, 4096), AdamW, bf16). The CUDA context and NCCL's buffers sit outside
the allocator and are not counted."""

STEP_SCRATCH_BYTES_PER_ELEMENT = 26
"""phalanx.optim.Adam8bit's step: fp32 moments, update and temporaries of one slice, ~26 bytes an element"""

LOSSY = ("int8", "powersgd")
"""compressors with error feedback: one residual the size of the gradient"""


def activations(w: Workload, micro: float, tp: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes one pass of ``micro`` samples keeps for backward on one GPU (all its blocks)."""
    if w.kind != "transformer":
        return 2 * sum(layer.act_elems for layer in w.layers) * dtype_bytes * micro
    sbh = w.seq * w.hidden * micro
    full_block = sbh * (10 + 24 / tp) * dtype_bytes / 2   # Korthikanti Eq. 2 (16-bit), no score term
    logits = w.seq * w.vocab * 4 * micro / tp
    if w.recompute:
        return sbh * dtype_bytes * w.blocks + full_block + logits
    return full_block * w.blocks + logits


def per_gpu(w: Workload, job) -> float:
    """Peak bytes per GPU of ``job`` (a scaling.Job) running ``w``, allocator overhead included."""
    axis = composition.by_name(job.strategy)
    n = w.params / (job.tp * job.pp)
    wb, gb, ob = (4.0, 4.0, 4.0) if w.precision == "fp32" else (2.0, 2.0, 12.0)
    scratch = 0.0
    if job.state_bits == 8:
        moments = 4.0 if w.precision == "fp32" else 8.0     # momentum, or Adam's two moments
        ob += moments / 4 * (1 + 4 / BLOCK) - moments
        scratch = STEP_SCRATCH_BYTES_PER_ELEMENT * SLICE
    states = n * (wb / (job.dp if "params" in axis.shards else 1)
                  + gb / (job.dp if "grads" in axis.shards else 1)
                  + ob / (job.dp if "optimizer" in axis.shards else 1))
    gathered = 0.0
    if "params" in axis.shards and job.dp > 1:
        biggest = max(layer.params for layer in w.layers) / job.tp
        gathered = 2 * biggest * wb
    residual = n * w.grad_bytes_per_param if job.compression in LOSSY and job.dp > 1 else 0.0
    per_replica = job.global_batch / job.dp
    micro = job.micro_batch if job.pp > 1 else per_replica
    m = max(1, per_replica / job.micro_batch) if job.pp > 1 else 1
    in_flight = min(job.pp, m) if job.pp > 1 else 1
    acts = activations(w, micro, job.tp, 4 if w.precision == "fp32" else 2) * in_flight / job.pp
    return (states + gathered + residual + acts + scratch) * FRAGMENTATION

"""Memory per GPU of a layout: model states as the strategy shards them, activations from the
architecture and the job's checkpointing policy, and the allocator's overhead, so that "fits" means it fits.

::

    states       params + grads + optimizer, each divided by dp where the data-parallel strategy
                 shards it (phalanx.parallel.composition: ZeRO-1 the optimizer, 2 + grads, 3 + params)
                 and by tp x pp; mixed precision with Adam: 2 + 2 + 12 bytes a parameter (fp32 master
                 and two moments), fp32 with momentum: 4 + 4 + 4; Megatron's distributed optimizer
                 (``Job.distributed_optimizer``): 6 + 12/dp (bf16 parameters, fp32 gradients, the fp32 state
                 sharded: Megatron-LM's README, "Distributed optimizer"); with 8-bit state (``state_bits=8``,
                 Dettmers et al. 2021, arXiv:2110.02861) each 4-byte moment is 1 byte + a 4-byte absmax
                 per block of 2048, and the step's fp32 scratch is one slice of 2^20 elements (~26 MiB)
    gathered     ZeRO-3: the module being run and the one prefetched, whole, in the compute dtype.
                 FSDP2 (``Job.fsdp2``): the root group (embedding, output layer, final norm) stays gathered from
                 the start of forward to the end of backward (fully_shard does not reshard the root after
                 forward), two blocks (the one running and the one prefetched; float8 with Float8 linears) and,
                 in backward, one block's unsharded gradients in bf16 beside their fp32 reduce-scatter input;
                 under a pipeline (``regather=False``) the stage's whole parameters stay gathered and its
                 gradients accumulate unsharded in fp32 (torch.distributed.pipelining turns the gradient sync off
                 for all micro-batches but the last; FSDP2 upcasts the accumulated gradient to reduce_dtype)
    residuals    lossy compression (int8, PowerSGD): error feedback keeps one gradient-sized buffer
    activations  what each block keeps between its forward and its backward, by checkpointing policy:
                 none   Korthikanti et al. 2022 (arXiv:2205.05198) Eq. 2, s b h (10 + 24/t) bytes in 16 bits, without
                        the 5 a s / h of attention scores (flash attention keeps none); Eq. 4 with sequence
                        parallel: 34 s b h / t; with ``Job.tensor_parallel="dtensor"`` (torchtitan) each
                        column-parallel linear saves its all-gathered input instead of gathering it again: 4 s b h
                        more (and the output layer its own, 2 s b h)
                 full   the block's input, 2 s b h (/ t with sequence parallel)
                 op     torchtitan's selective policy (its _save_list, parallelize_llama.py): the block's input, the
                        output of every other matmul (the 1st, 3rd, 5th, 7th: a Llama block's wq, wv, w1, w2),
                        attention's output and its fp32 logsumexp, and each reduce-scatter's output (sequence
                        parallel); everything else is recomputed
                 + with op or full, one block's whole set (Korthikanti's) while it is recomputed in backward
                 + the loss: its bytes a logit at their peak (``Job.loss``): "fused" 4 (fp32 probabilities:
                 Megatron's vocab-parallel cross-entropy, or a compiled one: bf16 logits + bf16 gradient), "eager" 12
                 (``cross_entropy(logits.float())`` op by op, at the top of backward: the saved fp32 log-softmax,
                 nll_loss's dense fp32 gradient and log_softmax's fp32 gradient), 14 with tp > 1 (loss parallel)
                 with pp > 1 the larger of the first stage (1F1B: up to pp micro-batches in flight) and the last
                 (one micro-batch and the loss); a CNN keeps each layer's output and its pre-activation
    pipeline     what torch.distributed.pipelining holds beside them (``Job.pipeline_buffers="torch"``, torchtitan's;
                 stage.py and schedules.py): a stage output is (b, s/t, h) in the compute dtype (sequence parallel) and
                 the next stage's input. The first stage keeps each in-flight micro-batch's output in fwd_cache until
                 its backward, and one gradient-receive buffer per micro-batch (_prepare_backward_infra allocates them
                 all up front and keeps them across steps). The last stage keeps every micro-batch's output (the
                 logits) in output_chunks until the step merges them, one receive buffer per micro-batch
                 (_prepare_forward_infra, up front; the running one is the first block's saved input), and the
                 gradient each receive buffer accumulates in .grad (cleared only at the next step). Added to each
                 stage's activations before the larger is taken; "recycled" counts none of it (phalanx's stage
                 recycles its receive buffers, Megatron-LM frees an output's storage once it is sent)
    overhead     x FRAGMENTATION, what the CUDA caching allocator reserves over the peak it hands out; x 1 with
                 ``Job.expandable_segments`` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)

Example::

    from phalanx.planner import hardware, memory, scaling, workloads
    memory.per_gpu(workloads.get("gpt-13b"), scaling.Job(dp=8, global_batch=16, zero=3))
"""

from __future__ import annotations

from phalanx.optim.adam8bit import SLICE
from phalanx.optim.quantize import BLOCK
from phalanx.parallel import composition
from phalanx.planner.workloads import Workload

__all__ = ["FRAGMENTATION", "per_gpu", "breakdown", "activations", "LOSSY", "LOSS_BYTES_PER_LOGIT", "FSDP2_REDUCE_BYTES",
           "AC_POLICIES", "PIPELINE_BUFFERS"]

FRAGMENTATION = 1.21
"""``max_memory_reserved / max_memory_allocated`` of a training step on an H100, the largest of phalanx's
DataParallel (1.03) and ZeRO-1/2/3 (1.20, 1.21, 1.20) in benchmarks/results/gpu-h100-run1.jsonl (the
``zero_memory`` step: 12 x Linear(4096, 4096), AdamW, bf16), with the allocator's default settings. The CUDA
context and NCCL's buffers sit outside the allocator and are not counted."""

EXPANDABLE = 1.0
"""the overhead with ``expandable_segments:True``: the allocator maps physical pages into one segment that grows
(PyTorch's CUDA semantics notes, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"), so a freed block is not
stranded at a size later requests cannot use. Counted as nothing, a lower bound (the last page of a segment and the
small-block pool are not counted); no H100 measurement of it is in benchmarks/results."""

STEP_SCRATCH_BYTES_PER_ELEMENT = 26
"""phalanx.optim.Adam8bit's step: fp32 moments, update and temporaries of one slice, ~26 bytes an element"""

LOSSY = ("int8", "powersgd")
"""compressors with error feedback: one residual the size of the gradient"""

LOSS_BYTES_PER_LOGIT = {"fused": 4.0, "eager": 12.0}
"""the cross-entropy's bytes a logit at its peak (module docstring)"""

LOSS_PARALLEL_EAGER_BYTES = 14.0
""""eager" with tp > 1: torch.distributed.tensor.parallel's loss_parallel (torchtitan with TP) runs log-softmax on the
vocabulary-sharded logits as x.float(), x - max, exp(x - max), (x - max) - log(sum): at its forward peak the bf16 logits,
their fp32 copy, the shifted copy and the exponentials (or the result) are alive together, 2 + 4 + 4 + 4 bytes"""

FSDP2_REDUCE_BYTES = 4
"""bytes a gradient is reduce-scattered in under ``Job.fsdp2`` (MixedPrecisionPolicy(reduce_dtype=float32))"""

AC_POLICIES = ("none", "op", "full")

PIPELINE_BUFFERS = ("recycled", "torch")
"""what a pipeline's runtime holds beside the activations (module docstring, ``Job.pipeline_buffers``)"""


def _block(w: Workload):
    return next(layer for layer in w.layers if layer.block)


def _block_saved(w: Workload, tokens: float, tp: int, sp: bool, ac: str, dtype_bytes: int,
                 tp_saves_gathered: bool = False) -> float:
    """Bytes one block keeps from its forward to its backward for ``tokens`` tokens (module docstring)."""
    seq_shard = tp if sp else 1
    if ac == "full":
        return tokens * w.hidden / seq_shard * dtype_bytes
    if ac == "op":
        block = _block(w)
        elems = w.hidden / seq_shard + w.hidden / tp          # the block's input; attention's output
        for i, (rows, _cols) in enumerate(block.matrices):
            row_parallel = i in block.row_parallel
            if i % 2 == 0:                                     # torchtitan saves all but every second mm
                elems += rows if row_parallel else rows / tp   # a row-parallel mm writes partial sums, whole
            if row_parallel and sp and tp > 1:
                elems += rows / tp                             # reduce_scatter_tensor is on the save list
        return tokens * (elems * dtype_bytes + 4 * w.heads / tp)
    if sp and tp > 1:
        # Korthikanti Eq. 4 (34 s b h / t) re-gathers the sequence-sharded inputs of the attention and MLP linears
        # in backward; a DTensor ColwiseParallel linear after SequenceParallel (torchtitan) saves its all-gathered
        # input instead: two s b h tensors more
        return tokens * w.hidden * (34 / tp + (4 if tp_saves_gathered else 0)) * dtype_bytes / 2
    return tokens * w.hidden * (10 + 24 / tp) * dtype_bytes / 2


def _torch_pipelining_held(w: Workload, tokens: float, tp: int, sp: bool, micro_batches: int, in_flight: int,
                           dtype_bytes: int) -> tuple[float, float]:
    """Bytes torch.distributed.pipelining holds beside the activations, (first stage, last stage), at each one's peak:
    the first stage's in the last warm-up forward, the last stage's in the last micro-batch's backward (module
    docstring)."""
    out = tokens * w.hidden / (tp if sp and tp > 1 else 1) * dtype_bytes     # one stage output = one receive buffer
    first = in_flight * out + micro_batches * out          # outputs in fwd_cache; the gradient-receive buffers
    earlier = micro_batches - 1
    logits = tokens * w.vocab / tp * dtype_bytes
    last = earlier * logits + earlier * out + earlier * out  # output_chunks; idle receive buffers; their .grad
    return first, last


def activations(w: Workload, micro: float, tp: int = 1, dtype_bytes: int = 2, *, ac: str | None = None,
                sequence_parallel: bool = False, loss: str = "fused", in_flight: int = 1, pp: int = 1,
                tp_saves_gathered: bool = False, micro_batches: int = 1, pipeline_buffers: str = "recycled") -> float:
    """Peak bytes one GPU keeps for backward: ``micro`` samples a pass, ``in_flight`` passes held by the first of
    ``pp`` stages (module docstring); ``ac`` defaults to the workload's own (full if it recomputes);
    ``tp_saves_gathered``: tensor parallel as torch.distributed.tensor.parallel runs it (``Job.tensor_parallel``);
    ``pipeline_buffers="torch"`` adds what torch.distributed.pipelining holds for ``micro_batches`` a step."""
    if pipeline_buffers not in PIPELINE_BUFFERS:
        raise ValueError(f"pipeline_buffers {pipeline_buffers!r} unknown; choose one of {', '.join(PIPELINE_BUFFERS)}")
    if w.kind != "transformer":
        return 2 * sum(layer.act_elems for layer in w.layers) * dtype_bytes * micro * in_flight / pp
    ac = ac or ("full" if w.recompute else "none")
    if ac not in AC_POLICIES:
        raise ValueError(f"ac {ac!r} unknown; choose one of {', '.join(AC_POLICIES)}")
    tokens = w.seq * micro
    args = (w, tokens, tp, sequence_parallel)
    saved = _block_saved(*args, ac, dtype_bytes, tp_saves_gathered) * w.blocks / pp
    recomputing = _block_saved(*args, "none", dtype_bytes, tp_saves_gathered) if ac != "none" else 0.0
    per_logit = LOSS_BYTES_PER_LOGIT[loss]
    if loss == "eager" and tp > 1:
        per_logit = LOSS_PARALLEL_EAGER_BYTES
    logits = tokens * w.vocab / tp * per_logit
    if sequence_parallel and tp > 1 and tp_saves_gathered:
        logits += tokens * w.hidden * dtype_bytes      # the output layer saves its all-gathered input
    first, last = saved * in_flight, saved + logits
    if pp > 1 and pipeline_buffers == "torch":
        held_first, held_last = _torch_pipelining_held(w, tokens, tp, sequence_parallel, micro_batches, in_flight,
                                                       dtype_bytes)
        first, last = first + held_first, last + held_last
    return max(first, last) + recomputing


def _gathered(w: Workload, job, wb: float) -> float:
    """What a ZeRO-3 / FSDP2 layout holds unsharded beside its shards (module docstring)."""
    if not job.fsdp2:
        return 2 * max(layer.params for layer in w.layers) / job.tp * wb
    block = _block(w).params / job.tp
    stage = w.params / (job.tp * job.pp)
    root = (w.params - w.blocks * _block(w).params) / (job.tp * job.pp)
    gathered = 1 if job.float8 else wb            # torchao's float8 all-gather; the output layer stays bf16
    if not job.regather:
        return root * wb + (stage - root) * gathered + stage * FSDP2_REDUCE_BYTES
    return root * wb + 2 * block * gathered + block * (w.grad_bytes_per_param + FSDP2_REDUCE_BYTES)


def per_gpu(w: Workload, job) -> float:
    """Peak bytes per GPU of ``job`` (a scaling.Job) running ``w``, allocator overhead included."""
    return sum(breakdown(w, job).values())


def breakdown(w: Workload, job) -> dict:
    """:func:`per_gpu` term by term (bytes): states, gathered, residual, activations, pipeline (what
    torch.distributed.pipelining adds to the larger stage's activations), scratch, overhead."""
    axis = composition.by_name(job.strategy)
    shards = set(axis.shards) | ({"optimizer"} if job.distributed_optimizer else set())
    n = w.params / (job.tp * job.pp)
    wb, gb, ob = (4.0, 4.0, 4.0) if w.precision == "fp32" else (2.0, 2.0, 12.0)
    if job.distributed_optimizer:
        gb = 4.0                                  # Megatron keeps bf16 models' gradients in fp32
    scratch = 0.0
    if job.state_bits == 8:
        moments = 4.0 if w.precision == "fp32" else 8.0     # momentum, or Adam's two moments
        ob += moments / 4 * (1 + 4 / BLOCK) - moments
        scratch = STEP_SCRATCH_BYTES_PER_ELEMENT * SLICE
    parts = {"states": n * (wb / (job.dp if "params" in shards else 1)
                            + gb / (job.dp if "grads" in shards else 1)
                            + ob / (job.dp if "optimizer" in shards else 1))}
    parts["gathered"] = _gathered(w, job, wb) if "params" in shards and job.dp > 1 else 0.0
    parts["residual"] = n * w.grad_bytes_per_param if job.compression in LOSSY and job.dp > 1 else 0.0
    per_replica = job.global_batch / job.dp
    micro = job.micro_batch if job.pp > 1 or job.accumulate else per_replica
    m = max(1, per_replica / job.micro_batch) if job.pp > 1 else 1
    in_flight = int(min(job.pp, m)) if job.pp > 1 else 1
    args = (w, micro, job.tp, 4 if w.precision == "fp32" else 2)
    kw = dict(ac=job.ac or None, sequence_parallel=job.sequence_parallel, loss=job.loss, in_flight=in_flight, pp=job.pp,
              tp_saves_gathered=job.tensor_parallel == "dtensor", micro_batches=int(m))
    parts["activations"] = activations(*args, **kw)
    parts["pipeline"] = activations(*args, **kw, pipeline_buffers=job.pipeline_buffers) - parts["activations"]
    parts["scratch"] = scratch
    overhead = EXPANDABLE if job.expandable_segments else FRAGMENTATION
    parts["overhead"] = sum(parts.values()) * (overhead - 1)
    return parts

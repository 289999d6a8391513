"""Megatron-Core's data-parallel step as its code runs it, priced: a contrast for the Megatron-LM rows.

The Megatron-LM rows of :mod:`~phalanx.planner.published` price the distributed optimizer's traffic as phalanx's
overlapped allreduce: bf16 gradients, hidden behind the whole backward of the replica's batch, and the Adam step over
every local parameter. Megatron-Core at the commit that published the README's H100 table (NVIDIA/Megatron-LM
f2e5db4, 2024-07-15, ``images/model_table.png``), run with ``--use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather`` as that README states, does it otherwise::

    gradients   fp32 on the wire: bf16 training sets accumulate_allreduce_grads_in_fp32 (megatron/training/arguments.py)
    buckets     max(40M, 1M x dp) elements each (megatron/core/distributed/distributed_data_parallel.py)
    reduce      each bucket reduce-scattered as backward fills it, in the last micro-batch only: the schedule runs the
                first m-1 micro-batches under no_sync (megatron/core/pipeline_parallel/schedules.py,
                forward_backward_no_pipelining); exposed: what outlasts that one micro-batch's backward
    gather      the bf16 parameters all-gathered bucket by bucket in the next step's first forward; each bucket's
                forward pre-hook waits on it and launches the next (megatron/core/optimizer/distrib_optimizer.py,
                _finish_param_sync_helper): prefetched one bucket ahead of one micro-batch's forward
    optimizer   Adam over 1/dp of the local parameters (the optimizer's shard)

    last micro-batch:   fwd ▕██▏ bwd ▕████▏
    reduce-scatters              ▕b0▏▕b1▏▕b2──▏   exposed = what ends after the backward
    next step:          fwd ▕██▏ ...
    all-gathers        ▕g0▏▕g1▏▕g2▏               g0 exposed, then what a bucket's forward does not cover

:func:`step` returns the model's step with these terms in place of its own, so ``benchmarks/scaling.py --budget``
can print both. The rows do not use it: at their assumed micro-batch of 1 it moves the 32B row out of its bound
(-28.4%) and 1.7B past the goal (+15.6%), and 7.1B further out (+21.9%) (docs/scaling.md, "Megatron-LM"). MLPerf's row
ran NeMo's distributed Adam, not this code.

Example::

    from phalanx.planner import hardware, megatron, published, workloads
    row = published.by_key("megatron-h100-7.1b")
    megatron.step(workloads.get(row.model), hardware.get(row.hardware), row.job)["step_s"]
"""

from __future__ import annotations

from phalanx.planner import collectives, cost, scaling

__all__ = ["GRAD_BYTES", "PARAM_BYTES", "bucket_elements", "data_parallel", "step"]

GRAD_BYTES = 4
"""bytes a gradient on the wire: fp32 (arguments.py forces accumulate_allreduce_grads_in_fp32 under --bf16)"""
PARAM_BYTES = 2
"""bytes a parameter the all-gather moves: bf16 (the distributed optimizer's param buffer)"""


def bucket_elements(dp: int) -> float:
    """Megatron-Core's default gradient bucket with --overlap-grad-reduce: max(40M, 1M x dp) elements."""
    return max(40e6, 1e6 * dp)


def data_parallel(w, hw, job: scaling.Job, compute_terms: dict) -> dict:
    """The dp axis of a Megatron-Core job (``job.dp`` > 1) as f2e5db4 runs it: its ``buckets``, seconds of the fp32
    reduce-scatters (``reduce_s``) and what outlasts the last micro-batch's backward (``reduce_exposed_s``), of the
    bf16 gathers (``gather_s``) and what the first micro-batch's forward does not cover (``gather_exposed_s``), and
    the sharded Adam step (``optimizer_s``). ``compute_terms``: :func:`scaling.predict`'s ``parts["compute_terms"]``."""
    shard = 1.0 / (job.tp * job.pp)
    micro_batches = max(1.0, job.global_batch / job.dp / job.micro_batch) if job.pp > 1 or job.accumulate else 1.0
    passes = sum(t for name, t in compute_terms.items() if name.startswith(("blocks_", "head_")))
    backward, forward = passes / micro_batches * 2 / 3, passes / micro_batches / 3
    # a bucket closes once it holds bucket_elements (param_and_grad_buffer.py, parameter by parameter in backward
    # order); here layer by layer, each with the fraction of backward done when its gradients are ready
    per, grads, ready, held = bucket_elements(job.dp), [], [], 0.0
    for params, done in w.backward_order():
        held += params * shard
        if held >= per:
            grads.append(held * GRAD_BYTES)
            ready.append(done)
            held = 0.0
    if held:
        grads.append(held * GRAD_BYTES)
        ready.append(1.0)
    reduce = [collectives.gather_time(b, hw, job.dp, job.tp) for b in grads]
    gather = [collectives.gather_time(b * PARAM_BYTES / GRAD_BYTES, hw, job.dp, job.tp) for b in reversed(grads)]
    covers = [forward * b / sum(grads) for b in reversed(grads)]
    gather_exposed = gather[0] + sum(max(0.0, g - c) for g, c in zip(gather[1:], covers)) if gather else 0.0
    optimizer = compute_terms.get("optimizer_s", 0.0) / job.dp
    return {"buckets": len(grads), "reduce_s": sum(reduce),
            "reduce_exposed_s": cost.overlapped_exposure(reduce, backward, 1.0, ready),
            "gather_s": sum(gather), "gather_exposed_s": gather_exposed, "optimizer_s": optimizer}


def step(w, hw, job: scaling.Job) -> dict:
    """The model's step of ``job`` with its data-parallel terms and optimizer step as Megatron-Core runs them
    (:func:`data_parallel`): ``step_s``, the model's own (``model_step_s``), the tensor-parallel term (``tp_s``,
    priced fully exposed by both), and :func:`data_parallel`'s terms."""
    p = scaling.predict(w, hw, job)
    terms = p.parts["compute_terms"]
    dp = data_parallel(w, hw, job, terms)
    own = p.parts["dp_exposed_s"] + terms.get("optimizer_s", 0.0)
    run = dp["reduce_exposed_s"] + dp["gather_exposed_s"] + dp["optimizer_s"]
    return {"step_s": p.step_s - own + run, "model_step_s": p.step_s, "tp_s": p.parts["tp_s"], **dp}

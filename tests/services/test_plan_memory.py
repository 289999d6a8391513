"""planner.memory against the software the published runs used: torchtitan's selective-op save list, its eager
loss, FSDP2's root group and its pipeline-parallel gradient accumulation, Megatron's distributed optimizer, and the
allocator setting; every published run fits its GPU in the model ("fits means fits")."""

import dataclasses

import pytest

from phalanx.planner import hardware, memory, published, scaling, workloads

pytestmark = pytest.mark.unit


def test_selective_op_policy_keeps_what_torchtitans_save_list_keeps():
    """Llama 3.1 8B, local batch 2 x 8192: a block keeps its input, the 1st/3rd/5th/7th matmul's output (wq 4096,
    wv 1024, w1 14336, w2 4096), attention's output (4096) and its fp32 logsumexp (32 heads); the eager loss peaks at
    12 B a logit; one block is recomputed at a time (Korthikanti's 34 s b h)."""
    w = workloads.get("llama3-8b")
    tokens = 2 * 8192
    block = tokens * ((4096 + 4096 + 1024 + 4096 + 14336 + 4096) * 2 + 4 * 32)
    want = 32 * block + tokens * 4096 * 34 + tokens * 128256 * 12
    assert memory.activations(w, 2, ac="op", loss="eager") == pytest.approx(want)
    # full checkpointing keeps the input alone; no checkpointing keeps Korthikanti's set in every block
    full = memory.activations(w, 2, ac="full")
    assert full == pytest.approx(32 * tokens * 4096 * 2 + tokens * 4096 * 34 + tokens * 128256 * 4)
    assert memory.activations(w, 2, ac="none") == pytest.approx(32 * tokens * 4096 * 34 + tokens * 128256 * 4)
    with pytest.raises(ValueError, match="ac 'some' unknown"):
        memory.activations(w, 2, ac="some")


def test_sequence_parallel_and_dtensor_inputs():
    """Megatron's sequence parallel keeps 34 s b h / t a block (Korthikanti Eq. 4); DTensor's keeps the two
    all-gathered linear inputs too (4 s b h), and the output layer's (2 s b h); full AC keeps the sharded input."""
    w = workloads.get("llama3-70b")
    tokens, h, t, v = 16 * 8192, 8192, 8, 128256
    meg = memory.activations(w, 16, t, ac="full", sequence_parallel=True)
    assert meg == pytest.approx(80 * tokens * h * 2 / t + tokens * h * 34 / t + tokens * v / t * 4)
    dt = memory.activations(w, 16, t, ac="full", sequence_parallel=True, tp_saves_gathered=True, loss="eager")
    assert dt == pytest.approx(80 * tokens * h * 2 / t + tokens * h * (34 / t + 4) + tokens * h * 2
                               + tokens * v / t * memory.LOSS_PARALLEL_EAGER_BYTES)


def test_fsdp2_holds_its_root_group_and_pipeline_gradients():
    """FSDP2 keeps the root group (embedding + output) gathered through forward and backward, two blocks and one
    block's bf16 + fp32 gradients; under a pipeline (regather=False) the whole stage gathered and its gradients
    accumulated in fp32. The allocator's overhead is 1 with expandable segments."""
    w = workloads.get("llama3-8b")
    blk = next(layer.params for layer in w.layers if layer.block)
    root = w.params - 32 * blk
    base = scaling.Job(dp=8, global_batch=16, zero=3, ac="op", expandable_segments=True)
    fsdp2 = dataclasses.replace(base, fsdp2=True)
    acts = memory.activations(w, 2, ac="op")
    states = w.params * 16 / 8
    biggest = max(layer.params for layer in w.layers)
    assert memory.per_gpu(w, base) == pytest.approx(states + 2 * biggest * 2 + acts)   # phalanx: 2 x the biggest
    assert memory.per_gpu(w, fsdp2) == pytest.approx(states + root * 2 + 2 * blk * 2 + blk * 6 + acts)
    assert memory.per_gpu(w, dataclasses.replace(fsdp2, float8=True)) == pytest.approx(
        states + root * 2 + 2 * blk * 1 + blk * 6 + acts)
    assert memory.per_gpu(w, dataclasses.replace(fsdp2, expandable_segments=False)) == pytest.approx(
        memory.per_gpu(w, fsdp2) * memory.FRAGMENTATION)
    staged = scaling.Job(dp=2, pp=4, global_batch=16, micro_batch=2, zero=3, fsdp2=True, regather=False,
                         ac="full", expandable_segments=True)
    stage = w.params / 4
    first = memory.activations(w, 2, ac="full", in_flight=4, pp=4)
    assert memory.per_gpu(w, staged) == pytest.approx(stage * 16 / 2 + root / 4 * 2 + (stage - root / 4) * 2
                                                      + stage * 4 + first)


def test_megatron_distributed_optimizer_and_every_published_run_fits():
    """Megatron's distributed optimizer: 6 + 12/d bytes a parameter (its README). Every published run ran, so the model
    must say it fits its GPU; before this change torchtitan's 8B was 112 GiB on a 96 GB GPU."""
    w = workloads.get("megatron-7.1b")
    job = scaling.Job(dp=48, tp=2, global_batch=192, accumulate=True, sequence_parallel=True)
    dist = dataclasses.replace(job, distributed_optimizer=True)
    saved = (memory.per_gpu(w, job) - memory.per_gpu(w, dist)) / memory.FRAGMENTATION
    assert saved == pytest.approx(w.params / 2 * (16 - (6 + 12 / 48)))
    for row in published.ROWS:
        if row.metric in ("tokens", "mfu"):
            wl, hw = workloads.get(row.model), hardware.get(row.hardware)
            assert memory.per_gpu(wl, row.job) <= hw.gpu.hbm_bytes, row.key


def test_torch_pipelining_holds_outputs_and_receive_buffers():
    """torch.distributed.pipelining (Job.pipeline_buffers="torch"): the first stage keeps its in-flight outputs and one
    gradient-receive buffer per micro-batch; the last keeps every earlier micro-batch's logits (output_chunks), its idle
    receive buffers and the gradients they accumulate. A stage output is (b, s/t, h) bf16 under sequence parallel."""
    w = workloads.get("llama3-8b")
    tokens, h, v, t = 8192, 4096, 128256, 2
    out, logits = tokens * h / t * 2, tokens * v / t * 2
    kw = dict(sequence_parallel=True, loss="eager", tp_saves_gathered=True)
    # full AC, 4 stages, 8 micro-batches of 1, 4 in flight on the first stage: the last stage's logits dominate
    recycled = memory.activations(w, 1, t, ac="full", in_flight=4, pp=4, micro_batches=8, **kw)
    held = memory.activations(w, 1, t, ac="full", in_flight=4, pp=4, micro_batches=8, pipeline_buffers="torch", **kw)
    saved = 8 * tokens * h / t * 2
    recompute = tokens * h * (34 / t + 4)
    last = saved + logits * 7 + tokens * h * 2 + 7 * logits + 14 * out     # loss parallel: 14 B a logit = 7 x bf16
    assert recycled == pytest.approx(max(4 * saved, saved + logits * 7 + tokens * h * 2) + recompute)
    assert held == pytest.approx(max(4 * saved + 12 * out, last) + recompute)
    # no checkpointing, 2 stages, 2 micro-batches: the first stage's in-flight set dominates, + 2 outputs + 2 buffers
    block = tokens * h * (34 / t + 4)
    assert memory.activations(w, 1, t, ac="none", in_flight=2, pp=2, micro_batches=2, pipeline_buffers="torch",
                              **kw) == pytest.approx(2 * 16 * block + 4 * out)
    # breakdown reports it as its own term, nothing without a pipeline or with "recycled"
    row = published.by_key("torchtitan-405b-512-memory")
    parts = memory.breakdown(workloads.get(row.model), row.job)
    plain = memory.breakdown(workloads.get(row.model), dataclasses.replace(row.job, pipeline_buffers="recycled"))
    assert parts["pipeline"] > 2 * 2**30 and plain["pipeline"] == 0
    assert sum(parts.values()) - parts["pipeline"] == pytest.approx(sum(plain.values()))
    with pytest.raises(ValueError, match="pipeline_buffers 'gpipe' unknown"):
        memory.activations(w, 1, pipeline_buffers="gpipe")

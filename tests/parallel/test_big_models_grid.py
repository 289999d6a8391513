"""Combinations on a 2 x 2 grid of real ranks, HF Llama, against one process: ZeRO-3 over the dp
pairs composed with Megatron tensor parallel over the tp pairs (tied embedding and head), with
per-block recomputation, in fp32 and 8-bit Adam state, and the run's checkpoint (gathered over both
axes) loaded at world size 1, tp 1, giving the same next-step loss; ZeRO-1, 2 and 3 over the dp pairs
composed with a pipeline cut by module path over the pp pairs, each stage recomputed.

One spawned group of 4 ranks runs every check (module fixture); each check is its own test below.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_models import batch, hf_model, lm_loss, logits, max_diff

import phalanx as px
from phalanx.parallel.grid import RankGrid
from phalanx.parallel.pipeline import PipelineStage, partition, split_by_path
from phalanx.parallel.plans import apply_tp_plan
from phalanx.parallel.tensor import gather_tp_state_dict, vocab_parallel_cross_entropy
from phalanx.parallel.zero import zero
from phalanx.testing import distributed

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

pytestmark = pytest.mark.ranks

STEPS = 3


def _groups():
    """Rank r = 2·d + t: tp pairs {0, 1}, {2, 3}; dp pairs {0, 2}, {1, 3} (every rank makes every group)."""
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    r = px.rank()
    return r // 2, dp[r % 2], tp[r // 2]


def _zero3_tp(state_bits: int):
    """ZeRO-3 (dp 2) x TP (tp 2) + recomputation: 3 steps of Adam on the dp half of the batch."""
    d, dp_group, tp_group = _groups()
    m = hf_model("llama")
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_losses = []
    for s in range(STEPS):
        x, y = batch(s)
        ref_opt.zero_grad()
        loss = lm_loss(ref, x, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_tp_plan(m, tp_group)
    model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=3, group=dp_group, state_bits=state_bits)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        x, y = x.chunk(2)[d], y.chunk(2)[d]
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(logits(model, x), y, tp_group)
        loss.backward()
        opt.step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t, group=dp_group)
        losses.append(t.item() / 2)
    full = gather_tp_state_dict(model, tp_group)
    # the checkpoint at another layout: world 1, tp 1, the plain model
    x, y = batch(STEPS)
    nxt = vocab_parallel_cross_entropy(logits(model, x), y, tp_group).item()
    plain = hf_model("llama")
    plain.load_state_dict(full, strict=False)
    tied = plain.lm_head.weight is plain.get_input_embeddings().weight
    rsd = {k: v for k, v in ref.state_dict().items() if k in full}  # the tied head is the embedding
    return {"losses": losses, "ref": ref_losses, "diff": max_diff(full, rsd),
            "next": nxt, "reloaded_world1": lm_loss(plain, x, y).item(), "tied": tied,
            "keys_missing": sorted(set(ref.state_dict()) - set(full) - {"lm_head.weight"})}


def _ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _zero_pp(stage: int):
    """ZeRO-``stage`` (dp 2) x a pipeline cut by module path (pp 2, 1F1B over 2 micro-batches, each
    stage recomputed in backward): 3 steps of Adam against one process, this stage's tensors."""
    mesh = RankGrid(dp=2, pp=2)
    d, s, _ = mesh.coord
    m = hf_model("llama", tie=False, layers=4)
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        ref_opt.zero_grad()
        lm_loss(ref, x, y).backward()
        ref_opt.step()
    piece = split_by_path(m, partition(m, 2, method="parameters").boundaries(m), s)
    pipe = PipelineStage(piece, s, 2, ranks=mesh.pp_ranks, group=mesh.pp_group, grad_group=mesh.pp_grad_group,
                         loss_fn=_ce, checkpoint=True)
    _, opt = zero(piece, torch.optim.Adam(piece.parameters(), lr=1e-2), stage=stage, group=mesh.dp_group,
                  backward_passes_per_step=2)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(2)[d], y.chunk(2)[d]
        opt.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, num_microbatches=2)
        opt.step()
    sd = {k.removeprefix("model."): v for k, v in piece.state_dict().items()}
    rsd = ref.state_dict()
    return {"diff": max_diff(sd, {k: rsd[k] for k in sd}), "keys": len(sd)}


def _all_checks():
    out = {"zero3 tp fp32": _zero3_tp(32), "zero3 tp 8bit": _zero3_tp(8)}
    for stage in (1, 2, 3):
        out[f"zero{stage} pp"] = _zero_pp(stage)
    return out


@pytest.fixture(scope="module")
def grid():
    """One spawned group of 4 ranks runs every check; each check below is its own test."""
    return distributed(_all_checks, np=4, timeout=400)


def test_zero3_with_tensor_parallel_on_2x2_matches_one_process(grid):
    for res in grid:
        r = res["zero3 tp fp32"]
        assert r["tied"] and not r["keys_missing"], r
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < 5e-5, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_pipeline_on_2x2_matches_one_process(stage, grid):
    for res in grid:
        r = res[f"zero{stage} pp"]
        assert r["keys"] > 0 and r["diff"] < 5e-5, r


def test_zero3_tp_checkpoint_loads_at_world_1_tp_1(grid):
    for res in grid:
        for key in ("zero3 tp fp32", "zero3 tp 8bit"):
            r = res[key]
            assert r["reloaded_world1"] == pytest.approx(r["next"], rel=1e-5), (key, r)


def test_eight_bit_state_under_zero3_and_tp_follows_fp32(grid):
    for res in grid:
        r, fp32 = res["zero3 tp 8bit"], res["zero3 tp fp32"]
        # 3 steps at lr 1e-2: 8-bit moments move the curve by well under 2 % (the paper: indistinguishable)
        for got, want in zip(r["losses"], fp32["losses"]):
            assert got == pytest.approx(want, rel=0.02), (r["losses"], fp32["losses"])
        # Adam moves an element by at most ~lr a step, the 8-bit step no further (its bound on m/sqrt(v)):
        # the two runs' parameters stay within 2 x STEPS x lr (a quantized second moment that
        # underflowed to 0 in a block of ZeRO's flat shard moved one element by 15 before that bound)
        assert r["diff"] <= 2 * STEPS * 1e-2 * 1.001, r["diff"]

"""Big-model strategies on Hugging Face and torchtitan transformers (tiny configs, random weights),
real gloo ranks against one process: ZeRO-3 with tied embeddings and activation checkpointing,
8-bit Adam state (under ZeRO and under DistributedOptimizer, its memory and its resharded
checkpoint), pipeline stages cut by module path (untied, and with the head tied to the embedding
across the stages), Megatron tensor-parallel plans.

One spawned group of 2 ranks runs every check (module fixture); each check is its own test below.
"""

import copy
import re

import big_model_cells as cells
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_models import (
    KEY_BIAS,
    PARAM_TOL,
    STEPS,
    batch,
    count_block_forwards,
    have,
    hf_model,
    lm_loss,
    logits,
    make,
    max_diff,
    recompute,
    train,
)
from hf_models import global_mean as _global

import phalanx as px
from phalanx.optim import Adam8bit
from phalanx.parallel.pipeline import PipelineStage, partition, split_by_path
from phalanx.parallel.plans import apply_tp_plan
from phalanx.parallel.tensor import gather_tp_state_dict, vocab_parallel_cross_entropy
from phalanx.parallel.zero import zero
from phalanx.profiler.memory import memory_report
from phalanx.testing import distributed

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

pytestmark = pytest.mark.ranks


def _zero3(kind, recompute):
    m = hf_model(kind)
    ref = copy.deepcopy(m)
    calls = count_block_forwards(m, kind)  # an inner module's calls: HF's own hooks on a block stay outside
    if recompute:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), range(STEPS), sharded=False)
    model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=3)
    train(model, opt, range(STEPS))
    sd, rsd = model.state_dict(), ref.state_dict()
    tied = m.lm_head.weight is m.get_input_embeddings().weight
    gathered_after = opt.engine.param_bytes() - sum(s.numel() * s.element_size() for s in opt.engine.masters)
    return {"diff": max_diff(sd, rsd, KEY_BIAS), "key_bias": max_diff(sd, rsd) if kind == "gpt2" else 0.0,
            "block_forwards": len(calls), "tied": tied, "gathered_after_step": gathered_after,
            "units": [type(mod).__name__ for mod, _ in opt.engine.module_units]}


def _eight_bit_zero():
    """Stage 3 + recomputation + 8-bit state against fp32 Adam in one process: the loss curve."""
    steps = [s % 2 for s in range(30)]  # two batches again and again: a curve that falls
    m = hf_model("llama")
    ref = copy.deepcopy(m)
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3), steps, sharded=False)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = zero(m, torch.optim.AdamW(m.parameters(), lr=3e-3), stage=3, state_bits=8)
    losses = _global(train(model, opt, steps))
    fp32 = hf_model("llama")
    _, fp32_opt = zero(fp32, torch.optim.AdamW(fp32.parameters(), lr=3e-3), stage=3)
    train(fp32, fp32_opt, range(1))
    return {"losses": losses, "ref": [float(v) for v in ref_losses],
            "bytes_8bit": memory_report(opt)["optimizer_state"],
            "bytes_fp32": memory_report(fp32_opt)["optimizer_state"],
            "inner": type(opt.inner).__name__, "state_dtype": str(opt.inner.state[opt.chunks[0][0]]["exp_avg_q"].dtype)}


def _eight_bit_plain():
    """DistributedOptimizer(state_bits=8) equals one process stepping Adam8bit on the full batch."""
    m = hf_model("llama")
    ref = copy.deepcopy(m)
    train(ref, Adam8bit.like(torch.optim.Adam(ref.parameters(), lr=1e-2)), range(STEPS), sharded=False)
    opt = px.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2), named_parameters=m.named_parameters(),
                                  state_bits=8)
    train(m, opt, range(STEPS))
    return {"diff": max_diff(m.state_dict(), ref.state_dict()), "inner": type(opt.optimizer).__name__}


def _eight_bit_reshard():
    """8-bit ZeRO-3 state saved at world 2 and loaded at world 1 continues the same run."""
    solo = [dist.new_group([r]) for r in range(px.size())]  # every rank makes every group, in order
    m = hf_model("llama")
    model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=3, state_bits=8)
    train(model, opt, range(3))
    full_model = model.state_dict()
    shards = [None] * px.size()
    dist.all_gather_object(shards, opt.sharded_state_dict())
    after = _global(train(model, opt, range(3, 6)))
    m1 = hf_model("llama")
    model1, opt1 = zero(m1, torch.optim.Adam(m1.parameters(), lr=1e-2), stage=3, state_bits=8,
                        group=solo[px.rank()])
    model1.load_state_dict(full_model)
    opt1.load_sharded_state_dict(shards)
    again = [float(v) for v in train(model1, opt1, range(3, 6), sharded=False)]
    refused = {}  # another model's shards: one line, not a silent misaligned load (a user try, s6-ux)
    wider = hf_model("llama")
    wider.model.norm = torch.nn.RMSNorm(48)  # same names, one shape changed
    for key, other in (("deeper", hf_model("llama", layers=3)), ("gpt2", hf_model("gpt2")), ("wider", wider)):
        _, opt_o = zero(other, torch.optim.Adam(other.parameters(), lr=1e-2), stage=3, group=solo[px.rank()])
        try:
            opt_o.load_sharded_state_dict(shards)
            refused[key] = None
        except ValueError as e:
            refused[key] = str(e)
    return {"world2": after, "world1": again, "refused": refused}


def _eight_bit_temporaries():
    """One Adam8bit step over an 8M-element parameter: the resident set's peak above its start
    (glibc's mmap threshold at 64 KiB, so large blocks are counted while live), and whether the
    step wrote the moments back into the same bytes."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    p = torch.nn.Parameter(torch.randn(1 << 23))
    p.grad = torch.randn_like(p)
    opt = Adam8bit([p], lr=1e-3)
    opt.step()
    where = opt.state[p]["exp_avg_q"].data_ptr()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    opt.step()
    return {"peak_extra": status("VmHWM") - before, "fp32_moments": 8 * p.numel(),
            "in_place": opt.state[p]["exp_avg_q"].data_ptr() == where}


def _ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _pipeline(kind, tie=False):
    """Two stages cut where the parameter-balanced partition says, 1F1B over 2 micro-batches;
    ``tie``: the head tied to the embedding, a copy on each stage, their gradients summed."""
    m = make(kind, tie=tie, layers=4)
    ref = copy.deepcopy(m)
    ref_losses = train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), range(3), sharded=False)
    plan = partition(m, 2, method="parameters")
    stage = split_by_path(m, plan.boundaries(m), px.rank())
    pipe = PipelineStage(stage, px.rank(), 2, loss_fn=_ce)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    losses = []
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, num_microbatches=2)
        opt.step()
        losses.append(float(pipe.share_loss(loss)))
    sd, rsd = stage.model.state_dict(), ref.state_dict()
    # the stages' state dicts, joined, are the whole model's (same names): reload it at pp = 1
    parts = [None] * px.size()
    dist.all_gather_object(parts, sd)
    whole = make(kind, tie=tie, layers=4)
    whole.load_state_dict({k: v for part in parts for k, v in part.items()})
    x, y = batch(3)
    nxt = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, num_microbatches=2)
    reloaded = lm_loss(whole, x, y).item()
    return {"losses": losses, "ref": [float(v) for v in ref_losses], "boundaries": plan.boundaries(ref),
            "next": float(pipe.share_loss(nxt)), "reloaded_pp1": reloaded,
            "stage_costs": plan.stage_costs, "keys": sorted(sd), "tied": [t.name for t in stage.tied_across_stages],
            "diff": max_diff({k: rsd[k] for k in sd}, sd, KEY_BIAS)}  # this stage's tensors only


def _tensor_parallel(kind, recomputed=False):
    """Megatron's plan from tp_plan (tied head where the model ties it), loss on vocabulary-cut logits;
    ``recomputed``: every block recomputed in backward (its two all-reduces run again there)."""
    m = make(kind)
    ref = copy.deepcopy(m)
    ref_losses = train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), range(3), sharded=False)
    group = dist.group.WORLD
    if recomputed:
        recompute(m, kind)
    model = apply_tp_plan(m, group)
    calls = count_block_forwards(model, kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(logits(model, x), y, group)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full, rsd = gather_tp_state_dict(model, group), ref.state_dict()
    # HF GPT-2's Conv1D stores [in, out]; its parallel form is a linear layer ([out, in])
    conv = {f"{n}.weight" for n, mod in ref.named_modules() if type(mod).__name__ == "Conv1D"}
    diff = max((full[k] - (rsd[k].t() if k in conv else rsd[k])).abs().max().item() for k in full if KEY_BIAS not in k)
    local_q = {"gpt2": "transformer.h.0.attn.c_attn", "llama": "model.layers.0.self_attn.q_proj",
               "titan": "layers.0.attention.qkv_linear.wq"}[kind]
    # reload at tp = 1: the gathered state dict (a Conv1D's weight transposed back) into the plain model
    plain = make(kind)
    plain.load_state_dict({k: (v.t() if k in conv else v) for k, v in full.items()}, strict=False)
    x, y = batch(3)
    nxt = vocab_parallel_cross_entropy(logits(model, x), y, group).item()
    reloaded = lm_loss(plain, x, y).item()
    tied = kind != "titan" and ref.get_submodule("lm_head").weight is ref.get_input_embeddings().weight
    tied = tied and model.get_submodule("lm_head").weight is model.get_input_embeddings().weight  # re-tied
    return {"losses": losses, "ref": [float(v) for v in ref_losses], "diff": diff, "tied": tied,
            "block_forwards": len(calls), "next": nxt, "reloaded_tp1": reloaded,
            "local_rows": model.get_submodule(local_q).weight.shape[0],
            "full_rows": ref.get_submodule(local_q).weight.shape[-1 if kind == "gpt2" else 0]}


def _bad_heads():
    """GQA with one key/value head cannot be cut in two: one line, before any weight moves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    try:
        apply_tp_plan(LlamaForCausalLM(cfg), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


def _data_parallel(kind):
    m = make(kind)
    ref = copy.deepcopy(m)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), range(3), sharded=False)
    model = px.DataParallel(m)
    train(model, torch.optim.Adam(model.parameters(), lr=1e-2), range(3))
    return max_diff(m.state_dict(), ref.state_dict(), KEY_BIAS)


def _all_checks():
    out = cells.checks(KINDS)
    for kind in KINDS:
        out[("dp", kind)] = _data_parallel(kind)
        out[("pp", kind)] = _pipeline(kind)
        if kind != "titan":  # torchtitan's Llama is never tied
            out[("pp tied", kind)] = _pipeline(kind, tie=True)
        out[("tp", kind)] = _tensor_parallel(kind)
        if kind != "llama":  # HF Llama's recomputed tp runs under ZeRO-3 in test_big_models_grid.py
            out[("tp recompute", kind)] = _tensor_parallel(kind, recomputed=True)
    out["tp bad heads"] = _bad_heads()
    for kind in ("gpt2", "llama"):
        for rc in (False, True):
            out[("zero3", kind, rc)] = _zero3(kind, rc)
    out["8bit zero"] = _eight_bit_zero()
    out["8bit plain"] = _eight_bit_plain()
    out["8bit reshard"] = _eight_bit_reshard()
    out["8bit temporaries"] = _eight_bit_temporaries()
    return out


KINDS = ["gpt2", "llama"] + (["titan"] if have("titan") else [])
CHECKS = ([("zero3", k, r) for k in ("gpt2", "llama") for r in (False, True)]
          + ["8bit zero", "8bit plain", "8bit reshard", "8bit temporaries", "tp bad heads"]
          + [(s, k) for s in ("dp", "pp", "tp") for k in KINDS]
          + [("tp recompute", k) for k in KINDS if k != "llama"] + [("pp tied", k) for k in ("gpt2", "llama")]
          + cells.names(KINDS))
TITAN = pytest.param("titan", marks=pytest.mark.skipif(not have("titan"), reason="torchtitan is not installed (pip install torchtitan)"))


@pytest.fixture(scope="module")
def family():
    """One spawned group of 2 ranks runs every check; each check below is its own test."""
    return distributed(_all_checks, np=2, timeout=300)


def test_every_check_the_body_runs_is_tested(family):
    assert sorted(map(str, family[0])) == sorted(map(str, CHECKS))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_zero3_tied_and_recomputed_matches_one_process(kind, recompute, family):
    for res in family:
        r = res[("zero3", kind, recompute)]
        assert r["tied"], "the model's head should be its embedding (the case under test)"
        assert r["diff"] < PARAM_TOL, r  # Adam at lr 1e-2: a 2e-5 drift is 0.2 % of one step
        assert r["key_bias"] < 1e-3, r
        # every block forward runs twice a step when recomputed (the forward, then inside backward)
        assert r["block_forwards"] == STEPS * (2 if recompute else 1), r
        assert r["gathered_after_step"] == 0, "a unit stayed gathered after the step"
        # the head is a unit that owns no shard (tied) and gathers the embedding's
        assert r["units"].count("Embedding") == (2 if kind == "gpt2" else 1) and "Linear" in r["units"], r["units"]


@pytest.mark.parametrize("kind", ["gpt2", "llama", TITAN])
def test_data_parallel_matches_one_process(kind, family):
    for res in family:
        assert res[("dp", kind)] < PARAM_TOL, res[("dp", kind)]  # as ZeRO's: GPT-2 drifts 2e-5 in another sum order


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama", TITAN])
def test_zero1_and_zero2_match_one_process(kind, stage, family):
    for res in family:
        r = res[("zero", kind, stage)]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < PARAM_TOL, r


@pytest.mark.skipif(not have("titan"), reason="torchtitan is not installed (pip install torchtitan)")
def test_zero3_on_torchtitan_plain_and_recomputed_matches_one_process(family):
    for res in family:
        for key, forwards in ((("zero", "titan", 3), 1), (("zero3 recompute", "titan"), 2)):
            r = res[key]
            assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), (key, r)
            assert r["diff"] < PARAM_TOL, (key, r)
            assert r["block_forwards"] == cells.STEPS * forwards, (key, r)  # recomputed: twice a step


@pytest.mark.skipif(not have("titan"), reason="torchtitan is not installed (pip install torchtitan)")
def test_eight_bit_zero3_recomputed_on_torchtitan_follows_fp32(family):
    for res in family:
        r = res[("zero3 recompute 8bit", "titan")]
        assert r["inner"] == "Adam8bit" and r["block_forwards"] == 2 * cells.STEPS, r
        for got, want in zip(r["losses"], r["ref"]):  # the paper: indistinguishable curves; here 2 % a step
            assert got == pytest.approx(want, rel=0.02), r
        assert r["diff"] <= 2 * cells.STEPS * cells.LR * 1.001, r  # Adam moves an element <= ~lr a step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eight_bit_state_under_zero_on_gpt2_follows_fp32(stage, family):
    """GPT-2 (tied) under ZeRO-1, 2 and 3 (3 recomputed) with 8-bit Adam state, against one process's
    fp32 Adam: the paper's claim (indistinguishable curves), here 2 % a step."""
    for res in family:
        r = res[("zero 8bit", "gpt2", stage)]
        assert r["inner"] == "Adam8bit" and r["block_forwards"] == cells.STEPS * (2 if stage == 3 else 1), r
        for got, want in zip(r["losses"], r["ref"]):
            assert got == pytest.approx(want, rel=0.02), r
        assert r["diff"] <= 2 * cells.STEPS * cells.LR * 1.001, r  # Adam moves an element <= ~lr a step


@pytest.mark.parametrize("kind", ["gpt2", TITAN])
def test_eight_bit_distributed_optimizer_on_gpt2_and_torchtitan_matches_one_process(kind, family):
    for res in family:
        r = res[("8bit plain", kind)]
        assert r["inner"] == "Adam8bit" and r["diff"] < 5e-4, r  # one code step: see the Llama case below


def test_eight_bit_state_under_zero3_follows_the_fp32_curve(family):
    for res in family:
        r = res["8bit zero"]
        assert r["inner"] == "Adam8bit" and r["state_dtype"] == "torch.uint8"
        # the paper: 8-bit Adam matches 32-bit Adam's curve; here within 2 % per step over 30 steps
        for got, want in zip(r["losses"], r["ref"]):
            assert abs(got - want) <= 0.02 * want, (r["losses"], r["ref"])
        assert r["losses"][-1] < 0.9 * r["losses"][0], "the run did not train"


def test_eight_bit_state_is_under_0_3x_the_fp32_bytes(family):
    for res in family:
        r = res["8bit zero"]
        assert r["bytes_8bit"] <= 0.3 * r["bytes_fp32"], r


def test_eight_bit_step_temporaries_are_one_slice_not_the_parameter(family):
    for res in family:
        r = res["8bit temporaries"]
        assert r["in_place"], "the step should write the moments back into the same bytes"
        # one 1M-element slice: fp32 m and v (8 MiB), 6 MiB of scratch, a few 4 MiB temporaries;
        # the whole parameter's fp32 moments alone would be 64 MiB
        assert r["peak_extra"] < 0.5 * r["fp32_moments"], r


def test_eight_bit_distributed_optimizer_matches_one_process(family):
    for res in family:
        r = res["8bit plain"]
        assert r["inner"] == "Adam8bit"
        # a moment within rounding of a code boundary may round the other way: one code step
        # (< 5 % of that moment) moves that element by under 5 % of lr (1e-2) in a step
        assert r["diff"] < 5e-4, r


def test_eight_bit_checkpoint_reshards_to_another_world_size(family):
    for res in family:
        r = res["8bit reshard"]
        assert r["world1"][0] == pytest.approx(r["world2"][0], rel=1e-5)  # same parameters
        for a, b in zip(r["world1"][1:], r["world2"][1:]):  # same moments, requantized in new blocks
            assert a == pytest.approx(b, rel=2e-3), r
        assert re.match(r"load_sharded_state_dict: parameter 'model.layers.2.self_attn.q_proj.weight' \(param "
                        r"group 0\) is not in the checkpoint, .*load the shards saved from this model",
                        r["refused"]["deeper"] or ""), r["refused"]
        assert re.match(r"load_sharded_state_dict: parameter 'transformer.wte.weight' .* is not in the checkpoint",
                        r["refused"]["gpt2"] or ""), r["refused"]
        assert (r["refused"]["wider"] or "").startswith(
            "load_sharded_state_dict: parameter 'model.norm.weight' was saved with shape [32] but is [48] here"), r


@pytest.mark.parametrize("kind", ["gpt2", "llama", TITAN])
def test_pipeline_by_module_path_matches_one_process(kind, family):
    for res in family:
        r = res[("pp", kind)]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < PARAM_TOL, r
        assert r["reloaded_pp1"] == pytest.approx(r["next"], rel=1e-5), r  # saved at pp = 2, loaded at 1
        # 4 blocks, embedding and head: the parameter-balanced cut is in the middle
        assert len(r["boundaries"]) == 1 and r["boundaries"][0].endswith(".2"), r["boundaries"]
    embeds = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight", "titan": "tok_embeddings.weight"}
    assert embeds[kind] in family[0][("pp", kind)]["keys"] and embeds[kind] not in family[1][("pp", kind)]["keys"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_with_the_head_tied_across_stages_matches_one_process(kind, family):
    """The head tied to the embedding, cut into two stages: a copy on each, their gradients summed
    after every step (Megatron's tied embedding); both copies follow the one-process model."""
    embeds = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
    for res in family:
        r = res[("pp tied", kind)]
        assert r["tied"] == [embeds[kind]], r
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < PARAM_TOL, r
        assert r["reloaded_pp1"] == pytest.approx(r["next"], rel=1e-5), r
    assert embeds[kind] in family[0][("pp tied", kind)]["keys"] and "lm_head.weight" in family[1][("pp tied", kind)]["keys"]


@pytest.mark.parametrize("kind", ["gpt2", "llama", TITAN])
def test_tensor_parallel_plan_matches_one_process(kind, family):
    for res in family:
        r = res[("tp", kind)]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < PARAM_TOL, r
        assert r["local_rows"] * 2 == r["full_rows"], r  # q cut by heads: half on each rank
        assert r["reloaded_tp1"] == pytest.approx(r["next"], rel=1e-5), r  # saved at tp = 2, loaded at 1
        assert r["tied"] == (kind != "titan")


@pytest.mark.parametrize("kind", ["gpt2", TITAN])
def test_tensor_parallel_recomputed_matches_one_process(kind, family):
    for res in family:
        r = res[("tp recompute", kind)]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["diff"] < PARAM_TOL, r
        assert r["block_forwards"] == 2 * 3 + 1, r  # twice in each of 3 steps; once in the next loss (no backward)
        assert r["reloaded_tp1"] == pytest.approx(r["next"], rel=1e-5), r


def test_tensor_parallel_refuses_heads_that_do_not_divide(family):
    for res in family:
        assert "4 attention heads and 1 key/value heads must both divide by it" in res["tp bad heads"]

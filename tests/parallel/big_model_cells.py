"""Cells of the big-model matrix (docs/hf_models.md) run inside test_big_models.py's group of 2 ranks:
ZeRO-1 and 2 on every family and ZeRO-3 on torchtitan's Llama (plain and recomputed), 8-bit Adam
state on GPT-2 (tied) and torchtitan (DistributedOptimizer against Adam8bit in one process; ZeRO-3 +
recomputation against fp32 Adam's curve; ZeRO-1, 2 and 3 with 8-bit state on GPT-2, tied, against the
same curve). Each returns what its test asserts; :func:`checks` runs them all.
"""

import copy

import torch
from hf_models import KEY_BIAS, count_block_forwards, global_mean, make, max_diff, recompute, train

import phalanx as px
from phalanx.optim import Adam8bit
from phalanx.parallel.zero import zero

STEPS = 3
LR = 1e-2


def _reference(kind):
    """One process, the full batch, fp32 Adam: losses and state dict after STEPS steps."""
    ref = make(kind)
    losses = train(ref, torch.optim.Adam(ref.parameters(), lr=LR), range(STEPS), sharded=False)
    return [float(v) for v in losses], ref.state_dict()


def zero_cell(kind, stage, ref, recomputed=False, state_bits=32):
    """ZeRO-``stage`` on the 2 ranks (each half the batch), optionally recomputed / 8-bit, against ``ref``."""
    m = make(kind)
    calls = count_block_forwards(m, kind)
    if recomputed:
        recompute(m, kind)
    model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=LR), stage=stage, state_bits=state_bits)
    losses = global_mean(train(model, opt, range(STEPS)))
    ref_losses, ref_sd = ref
    return {"losses": losses, "ref": ref_losses, "diff": max_diff(model.state_dict(), ref_sd, KEY_BIAS),
            "block_forwards": len(calls), "inner": type(opt.inner).__name__}


def eight_bit_plain(kind):
    """DistributedOptimizer(state_bits=8) against one process stepping Adam8bit on the full batch."""
    m = make(kind)
    ref = copy.deepcopy(m)
    train(ref, Adam8bit.like(torch.optim.Adam(ref.parameters(), lr=LR)), range(STEPS), sharded=False)
    opt = px.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=LR), named_parameters=m.named_parameters(),
                                  state_bits=8)
    train(m, opt, range(STEPS))
    return {"diff": max_diff(m.state_dict(), ref.state_dict(), KEY_BIAS), "inner": type(opt.optimizer).__name__}


def names(kinds):
    """The keys :func:`checks` returns."""
    out = [("zero", k, s) for k in kinds for s in ((1, 2, 3) if k == "titan" else (1, 2))]
    if "titan" in kinds:
        out += [("zero3 recompute", "titan"), ("zero3 recompute 8bit", "titan")]
    if "gpt2" in kinds:
        out += [("zero 8bit", "gpt2", s) for s in (1, 2, 3)]
    return out + [("8bit plain", k) for k in kinds if k != "llama"]  # Llama's: test_big_models.py


def checks(kinds):
    out = {}
    for kind in kinds:
        ref = _reference(kind)
        for stage in (1, 2, 3) if kind == "titan" else (1, 2):  # HF's stage 3: test_big_models.py
            out[("zero", kind, stage)] = zero_cell(kind, stage, ref)
        if kind == "titan":
            out[("zero3 recompute", kind)] = zero_cell(kind, 3, ref, recomputed=True)
            out[("zero3 recompute 8bit", kind)] = zero_cell(kind, 3, ref, recomputed=True, state_bits=8)
        if kind == "gpt2":  # tied; stage 3 recomputed
            for stage in (1, 2, 3):
                out[("zero 8bit", kind, stage)] = zero_cell(kind, stage, ref, recomputed=stage == 3, state_bits=8)
        if kind != "llama":
            out[("8bit plain", kind)] = eight_bit_plain(kind)
    return out

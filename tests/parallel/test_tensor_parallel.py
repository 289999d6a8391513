"""Tensor parallel on real ranks (tp = 2) against one process: the layers, the vocab-parallel loss,
and a GPT trained 10 steps with Megatron's plan (same loss per step, same parameters)."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import GPT, GPTConfig, gpt_tp_plan
from phalanx.parallel.tensor import (
    apply_tensor_parallel,
    gather_tp_state_dict,
    vocab_parallel_cross_entropy,
)
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
STEPS = 10


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch(step, rows=4):
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, CFG.vocab_size, (rows, CFG.block_size + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _tp_body():
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    # the loss alone: sharded logits, same value and gradient as the full cross-entropy
    torch.manual_seed(1)
    logits = torch.randn(6, 10)
    target = torch.randint(0, 10, (6,))
    shard = logits[:, dist.get_rank() * 5 : (dist.get_rank() + 1) * 5].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, group)
    loss.backward()
    out["ce"] = (loss.detach(), shard.grad)
    # a GPT trained with the Megatron plan
    model = apply_tensor_parallel(_gpt(), gpt_tp_plan(_gpt()), group)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = vocab_parallel_cross_entropy(model(x), y, group)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = gather_tp_state_dict(model, group)
    out["local_q"] = tuple(model.get_submodule("block0.attn.q").weight.shape)
    return out


def test_tp2_matches_one_process():
    results = distributed(_tp_body, np=2, timeout=120)
    # reference: the loss alone
    torch.manual_seed(1)
    logits = torch.randn(6, 10).requires_grad_(True)
    target = torch.randint(0, 10, (6,))
    ref = F.cross_entropy(logits, target)
    ref.backward()
    for r, out in enumerate(results):
        torch.testing.assert_close(out["ce"][0], ref.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(out["ce"][1], logits.grad[:, r * 5 : (r + 1) * 5], atol=1e-6, rtol=0)
        assert out["local_q"] == (CFG.n_embd // 2, CFG.n_embd)  # really cut in two
    # reference: the GPT in one process
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, CFG.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert ref_losses[-1] < ref_losses[0]
    for out in results:
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), atol=1e-5, rtol=0)
        ref_params = dict(model.named_parameters())
        assert out["params"].keys() == ref_params.keys()
        for k, v in ref_params.items():
            torch.testing.assert_close(out["params"][k], v.detach(), atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_plan_errors_name_the_problem():
    model = _gpt()
    with pytest.raises(ValueError, match="styles are"):
        apply_tensor_parallel(model, {"block0.mlp.fc": "diagonal"}, None)
    with pytest.raises(ValueError, match="not a sub-module"):
        apply_tensor_parallel(model, {"block9.mlp.fc": "colwise"}, None)
    with pytest.raises(TypeError, match="nn.Embedding"):
        apply_tensor_parallel(model, {"block0.mlp.fc": "vocab"}, None)


def test_group_of_one_is_the_plain_model():
    # without torch.distributed the parallel layers are the full layers
    model, ref = _gpt(), _gpt()
    apply_tensor_parallel(model, gpt_tp_plan(model), None)
    x, y = _batch(0)
    torch.testing.assert_close(vocab_parallel_cross_entropy(model(x), y),
                               F.cross_entropy(ref(x).reshape(-1, CFG.vocab_size), y.reshape(-1)))
    assert type(model.get_submodule("block0.mlp.fc")).__name__ == "ColumnParallelLinear"
